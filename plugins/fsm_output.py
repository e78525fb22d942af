"""The shipped structured-output backend, ``fsm``: each spec becomes a regular expression (a choice is an
alternation of literals; a JSON schema goes through plugins/json_schema_regex.py), compiled into a DFA over
characters (plugins/regex_fsm.py), built whole at admission within MAX_DFA_STATES. A token may come next when its
bytes keep the output a prefix of a match.

The allowed tokens of a state at a character boundary come from one pass over a matrix of the vocabulary's code
points, each column a gather through the DFA's table by the code points' classes; a token that ends inside a
UTF-8 character is allowed when some character with those first bytes can continue the match (the bytes of a
character prefix cover one interval of code points). From inside a character, the vocabulary is walked in byte
order: tokens that share a prefix share its steps, and a dead prefix skips every token that starts with it. Each
state's mask is computed once, at its first use, and kept on the device (MASK_CACHE_BYTES for all grammars).

A GBNF grammar becomes a pushdown automaton instead (plugins/grammar_pda.py), whose configurations are built as the
outputs reach them: its table grows a row per configuration that a mask's pass over the matrix meets (each the
configuration's step by every class), and masks are cached like the others.
"""
from __future__ import annotations

import bisect
import copy
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..core.config import EngineConfig
from ..core.detokenizer import byte_level_table, cleans_up_spaces
from ..core.errors import InvalidRequestError
from ..core.hookspecs import hookimpl
from ..core.interfaces import Grammar, GrammarMatcher, StructuredOutputBackend, Vocabulary
from ..core.registry import Register
from ..core.request import StructuredOutput
from .json_schema_regex import schema_to_rules
from .grammar_pda import PushdownAutomaton
from .regex_fsm import DEAD, CharAutomaton

if TYPE_CHECKING:
    import torch

log = logging.getLogger("infer")
MASK_CACHE_BYTES = 256 * 2**20  # all grammars' masks together; a mask is one byte per vocabulary entry
MAX_DFA_STATES = 20_000  # a grammar's automaton is built whole at admission, within these bounds
MAX_DFA_WORK = 4_000_000  # NFA states visited while building it (about 1.5 s of Python at most)
MAX_DFA_CELLS = 4_000_000  # its table's states x character classes (about 1.5 s and 200 MB of Python at most)
MAX_FORCED_CHARS = 64  # forced_text looks this far ahead (a proposer drafts at most 16 tokens a round)
MAX_TOKEN_CHARS = 16  # longer tokens are stepped one by one (few vocabularies have many)
# A grammar's pushdown automaton keeps every configuration its outputs reached, about 1 KiB each (JSON object mode
# over randomly nested values: 26.6 MiB for 25,090); past this many, later requests get a fresh compile
MAX_REUSED_CONFIGURATIONS = 20_000
State = tuple[int, bytes]  # (automaton state, the bytes of a character begun but not finished)
UTF8_LIMITS = {2: (0x80, 0x7FF), 3: (0x800, 0xFFFF), 4: (0x10000, 0x10FFFF)}  # code points of each length
SURROGATES = (0xD800, 0xDFFF)


def utf8_length(lead: int) -> int:
    """The byte length of the UTF-8 character that starts with byte ``lead`` (0: not a lead byte)."""
    return 1 if lead < 0x80 else 2 if 0xC2 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else \
        4 if 0xF0 <= lead < 0xF5 else 0


def code_points(prefix: bytes) -> tuple[int, int] | None:
    """The interval of code points whose UTF-8 encoding starts with ``prefix`` (a lead byte and continuation
    bytes), or None when none does."""
    size = utf8_length(prefix[0])
    if size < 2 or any(not 0x80 <= b < 0xC0 for b in prefix[1:]):
        return None
    value = prefix[0] & (0x7F >> size)
    for b in prefix[1:]:
        value = value << 6 | b & 0x3F
    free = 6 * (size - len(prefix))  # the bits the missing continuation bytes hold
    low, high = UTF8_LIMITS[size]
    lo, hi = max(value << free, low), min(value << free | ((1 << free) - 1), high)
    if SURROGATES[0] <= hi <= SURROGATES[1]:  # UTF-8 cannot hold surrogates: cut them off either end
        hi = SURROGATES[0] - 1
    if SURROGATES[0] <= lo <= SURROGATES[1]:
        lo = SURROGATES[1] + 1
    return (lo, hi) if lo <= hi else None


def step(automaton: CharAutomaton, state: State, byte: int) -> State | None:
    """The state after one more byte, or None when no match can follow."""
    char, pending = state
    if not pending and byte < 0x80:
        nxt = automaton.step(char, byte)
        return None if nxt == DEAD else (nxt, b"")
    data = pending + bytes((byte,))
    if len(data) > 4 or (span := code_points(data)) is None:
        return None
    if utf8_length(data[0]) == len(data):  # the character is whole: its interval is the one code point
        nxt = automaton.step(char, span[0])
        return None if nxt == DEAD else (nxt, b"")
    return (char, data) if automaton.can_step_within(char, *span) else None


def class_matrix(bounds: list[int], index: TokenIndex) -> torch.Tensor:
    """[rows, MAX_TOKEN_CHARS]: the automaton's character class of each code point of the vocabulary's matrix."""
    import torch

    kind = torch.int16 if len(bounds) < 2**15 else torch.int32
    return (torch.searchsorted(torch.tensor(bounds), index.codes, right=True) - 1).to(kind)


class FsmGrammar(Grammar):
    """A compiled spec: its automaton, built whole at compile time (bounded), with the vocabulary's characters in
    the automaton's classes; masks come from the backend's cache."""

    offset = 0  # a state's row in ``next`` is state + offset

    def __init__(self, automaton: CharAutomaton, backend: FsmBackend) -> None:
        import torch  # not at the top: loading plugins imports no torch

        self.automaton, self.backend, self.index = automaton, backend, backend.token_index()
        self.key = next(backend.serials)  # names this grammar's masks in the backend's cache
        bounds, table = automaton.determinize(MAX_DFA_STATES, MAX_DFA_WORK, MAX_DFA_CELLS)
        self.dead = len(table)  # DEAD as a row of its own, which every class leads back to
        self.next = torch.tensor([[self.dead if t == DEAD else t for t in row] for row in table] +
                                 [[self.dead] * len(bounds)], dtype=torch.int32)
        self.classes = class_matrix(bounds, self.index)
        self.tail_ok: dict[tuple[int, int], bool] = {}  # (state, tail interval) -> whether some character fits
        self.bounds = bounds
        self.forced: dict[int, str] = {}  # automaton state -> its forced_text

    def matcher(self) -> FsmMatcher:
        return FsmMatcher(self)

    def allowed_ids(self, state: State) -> list[int]:
        """The ids of the tokens whose bytes lead from ``state`` to a live one: vectorized over the vocabulary from
        a character boundary, walked token by token otherwise (only tokens that go on with continuation bytes)."""
        if state[1]:
            return self.walk(state)
        import torch

        index = self.index
        current = torch.full((len(index.rows),), state[0] + self.offset, dtype=torch.int32)
        for j in range(index.codes.shape[1]):
            active = index.lengths > j
            self._fill(current, active)
            moved = self.next[current.long(), self.classes[:, j].long()]
            current = torch.where(active, moved, current)
        alive = current != self.dead
        tailed = alive & (index.tails >= 0)
        if bool(tailed.any()):
            states, tails = (current[tailed] - self.offset).tolist(), index.tails[tailed].tolist()
            alive[tailed] = torch.tensor([self._tail_fits(st, tail) for st, tail in zip(states, tails)])
        allowed = index.rows[alive].tolist()
        automaton = self.automaton
        for token, chars, span in index.long_tokens:
            char = state[0]
            for code in chars:
                char = automaton.step(char, code)
            if char != DEAD and (span is None or automaton.can_step_within(char, *span)):
                allowed.append(token)
        return allowed

    def _fill(self, rows: torch.Tensor, active: torch.Tensor) -> None:
        """Makes sure ``next`` holds the ``active`` ones of ``rows`` (a DFA's are all built at compile time)."""

    def forced_text(self, state: int) -> str:
        """The characters every match continues with from ``state``: while it is not a whole match and one class
        of a single code point leads on (cached; at most MAX_FORCED_CHARS)."""
        text = self.forced.get(state)
        if text is None:
            chars, char, bounds = [], state, self.bounds
            while len(chars) < MAX_FORCED_CHARS and not self.automaton.accepting(char):
                live = [k for k, target in enumerate(self.next[char].tolist()) if target != self.dead]
                if len(live) != 1:
                    break
                k = live[0]
                if k + 1 == len(bounds) or bounds[k + 1] - bounds[k] != 1 or \
                        SURROGATES[0] <= bounds[k] <= SURROGATES[1]:
                    break
                chars.append(chr(bounds[k]))
                char = int(self.next[char, k])
            text = self.forced[state] = "".join(chars)
        return text

    def _tail_fits(self, state: int, tail: int) -> bool:
        fits = self.tail_ok.get((state, tail))
        if fits is None:
            fits = self.tail_ok[state, tail] = self.automaton.can_step_within(state, *self.index.intervals[tail])
        return fits

    def walk(self, start: State) -> list[int]:
        """The ids of the tokens whose bytes lead from ``start`` to a live state, by a walk of the vocabulary in
        byte order: tokens that share a prefix share its steps, and a dead prefix skips every token with it."""
        automaton, ordered, ids = self.automaton, self.index.ordered, self.index.ids
        allowed: list[int] = []
        states: list[State] = [start]  # states[d]: after the first d bytes of ``current``
        current = b""
        i = 0
        while i < len(ordered):
            data = ordered[i]
            depth = 0
            limit = min(len(states) - 1, len(data))
            while depth < limit and data[depth] == current[depth]:
                depth += 1
            del states[depth + 1:]
            current = data
            for d in range(depth, len(data)):
                nxt = step(automaton, states[d], data[d])
                if nxt is None:  # no token that starts with data[:d + 1] can follow: skip them all
                    i = bisect.bisect_left(ordered, _after(data[: d + 1]), i + 1)
                    break
                states.append(nxt)
            else:
                allowed.append(ids[i])
                i += 1
        return allowed


class PdaGrammar(FsmGrammar):
    """A compiled GBNF grammar: a pushdown automaton whose configurations are built as outputs reach them (they
    are unbounded), so its table grows as masks meet them: row 0 is DEAD's, configuration c's row is c + 1."""

    offset = 1
    max_reused_configurations = MAX_REUSED_CONFIGURATIONS

    def __init__(self, automaton: PushdownAutomaton, backend: FsmBackend) -> None:  # no super(): no table yet
        import torch

        self.automaton, self.backend, self.index = automaton, backend, backend.token_index()
        self.key = next(backend.serials)
        self.bounds = automaton.classes()
        self.classes = class_matrix(self.bounds, self.index)
        self.dead = 0
        self.next = torch.zeros((64, len(self.bounds)), dtype=torch.int32)  # rows not filled yet lead to DEAD
        self.filled = bytearray(64)  # per row: whether it holds its configuration's steps
        self.tail_ok: dict[tuple[int, int], bool] = {}
        self.forced: dict[int, str] = {}

    def _fill(self, rows: torch.Tensor, active: torch.Tensor) -> None:
        import torch

        missing = [row for row in torch.unique(rows[active]).tolist()  # configurations built elsewhere (a long
                   if row and (row >= len(self.filled) or not self.filled[row])]  # token's steps) are new here
        if not missing:
            return
        steps = [[self.automaton.step(row - 1, point) + 1 for point in self.bounds] for row in missing]
        if (needed := self.automaton.num_states() + 1) > len(self.filled):  # room for every configuration so far
            grown = torch.zeros((2 * needed, len(self.bounds)), dtype=torch.int32)
            grown[: len(self.next)] = self.next
            self.next, self.filled = grown, self.filled + bytearray(2 * needed - len(self.filled))
        self.next[torch.tensor(missing)] = torch.tensor(steps, dtype=torch.int32)
        for row in missing:
            self.filled[row] = 1

    def reusable(self) -> bool:
        return self.automaton.num_states() <= self.max_reused_configurations

    def forced_text(self, state: int) -> str:
        """The characters every match continues with from ``state`` (cached; at most MAX_FORCED_CHARS)."""
        text = self.forced.get(state)
        if text is None:
            chars, char, automaton = [], state, self.automaton
            while len(chars) < MAX_FORCED_CHARS and not automaton.accepting(char) and \
                    (point := automaton.only_char(char)) is not None:
                chars.append(chr(point))
                char = automaton.step(char, point)
            text = self.forced[state] = "".join(chars)
        return text


def _after(prefix: bytes) -> bytes:
    """A byte string greater than every string that starts with ``prefix`` and not greater than any other that
    sorts after them (for an all-0xFF prefix, merely greater: the walk then looks at a few tokens more)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)
    return stripped[:-1] + bytes((stripped[-1] + 1,))


def split_utf8(data: bytes) -> tuple[list[int], bytes] | None:
    """The code points of ``data``'s whole characters and the bytes of an unfinished last one, or None when
    ``data`` does not start at a character or is not UTF-8."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        tail = data[cut:]
        if tail and (code_points(tail) is None or len(tail) >= utf8_length(tail[0])):
            return None
        return [ord(c) for c in text], tail
    return None


class TokenIndex:
    """A vocabulary as the fsm backend reads it: every token's bytes (None for special tokens, which no structured
    output holds), the tokens in byte order (for walks from inside a character), and, for those that start at a
    character, their code points as a matrix (``codes`` [rows, MAX_TOKEN_CHARS], ``lengths``) with the interval of
    an unfinished last character (``tails``: an index into ``intervals``, -1 for none); tokens with more characters
    are in ``long_tokens``."""

    def __init__(self, table: list[bytes | None]) -> None:
        import torch

        self.table = table
        pairs = sorted((data, token) for token, data in enumerate(table) if data)
        self.ordered = [data for data, _ in pairs]
        self.ids = [token for _, token in pairs]
        rows: list[int] = []
        codes: list[list[int]] = []
        lengths: list[int] = []
        tails: list[int] = []
        self.intervals: list[tuple[int, int]] = []
        interval_ids: dict[tuple[int, int], int] = {}
        self.long_tokens: list[tuple[int, list[int], tuple[int, int] | None]] = []  # with an unfinished one's span
        for token, data in enumerate(table):
            split = split_utf8(data) if data else None
            if split is None:
                continue
            chars, tail = split
            span = code_points(tail) if tail else None
            if len(chars) > MAX_TOKEN_CHARS:
                self.long_tokens.append((token, chars, span))
                continue
            rows.append(token)
            codes.append(chars + [0] * (MAX_TOKEN_CHARS - len(chars)))
            lengths.append(len(chars))
            tails.append(-1 if span is None else interval_ids.setdefault(span, len(interval_ids)))
        self.intervals = sorted(interval_ids, key=interval_ids.__getitem__)
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.codes = torch.tensor(codes, dtype=torch.int64).reshape(len(rows), MAX_TOKEN_CHARS)
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        self.tails = torch.tensor(tails, dtype=torch.int64)

    @classmethod
    def of(cls, vocabulary: Vocabulary) -> TokenIndex:
        """The index of a byte-level BPE tokenizer's vocabulary (GPT-2, Llama 3, Qwen, ...); InvalidRequestError
        for another kind, whose tokens are not fixed byte strings."""
        if cleans_up_spaces(vocabulary.tokenizer):  # the flag, where transformers honours it (not for BPE in 5)
            raise InvalidRequestError("structured output (the fsm backend) cannot follow this tokenizer: its "
                                      "clean_up_tokenization_spaces is true, so its text drops the spaces before "
                                      "punctuation that the tokens hold, and an output's text could differ from what "
                                      "was matched; set \"clean_up_tokenization_spaces\": false in the model's "
                                      "tokenizer_config.json")
        table = byte_level_table(vocabulary.tokenizer)
        if table is None:
            raise InvalidRequestError("structured output (the fsm backend) needs a byte-level BPE tokenizer (GPT-2, "
                                      "Llama 3, Qwen and Mistral's Tekken have one), whose tokens are fixed byte "
                                      "strings; this model's tokenizer is of another kind")
        return cls([data or None for data in table[: vocabulary.size]])


class FsmMatcher(GrammarMatcher):
    def __init__(self, grammar: FsmGrammar) -> None:
        self.grammar = grammar
        self.state: State = (grammar.automaton.start, b"")
        self.ended = False

    def allowed(self) -> torch.Tensor:
        return self.grammar.backend.mask(self.grammar, self.state)

    def copy(self) -> FsmMatcher:
        return copy.copy(self)  # its state is an immutable tuple

    def forced_text(self) -> str:
        char, pending = self.state
        return "" if self.ended or pending else self.grammar.forced_text(char)

    def advance(self, token_id: int) -> None:
        grammar = self.grammar
        if token_id in grammar.backend.vocabulary.eos_token_ids and not self.ended and \
                grammar.automaton.accepting(self.state[0]) and not self.state[1]:
            self.ended = True
            return
        table = grammar.index.table
        data = table[token_id] if not self.ended and 0 <= token_id < len(table) else None
        state: State | None = self.state
        for byte in data or b"":
            if state is None:
                break
            state = step(grammar.automaton, state, byte)
        if not data or state is None:
            raise ValueError(f"token {token_id} cannot continue the structured output here (it was not allowed)")
        self.state = state


class FsmBackend(StructuredOutputBackend):
    """Compiles regex, choice and JSON-schema specs; the vocabulary is indexed at the first compile. The masks of
    every grammar share one cache, least recently used out past MASK_CACHE_BYTES."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self.index: TokenIndex | None = None
        self.serials = itertools.count()
        self.masks: OrderedDict[tuple[int, State], torch.Tensor] = OrderedDict()

    def token_index(self) -> TokenIndex:
        if self.index is None:
            self.index = TokenIndex.of(self.vocabulary)
        return self.index

    def compile(self, spec: StructuredOutput) -> FsmGrammar:
        if spec.grammar is not None:
            return PdaGrammar(PushdownAutomaton.compile(spec.grammar), self)
        if spec.choice is not None:
            pattern = "|".join(escape(choice) for choice in spec.choice)
        elif spec.json_schema is not None:
            rules = schema_to_rules(spec.json_schema)  # more than root: refs that recur, as rules of a grammar
            pattern = rules["root"]
        else:
            assert spec.regex is not None
            pattern = spec.regex
        recursive = spec.json_schema is not None and len(rules) > 1
        try:
            if recursive:
                return PdaGrammar(PushdownAutomaton.of_regex_rules(rules), self)
            return FsmGrammar(CharAutomaton.compile(pattern), self)
        except InvalidRequestError as exc:
            if spec.regex is not None:
                raise
            what = "the choices" if spec.choice is not None else "the JSON schema"
            reason = str(exc).removeprefix("invalid regex: ").removeprefix("invalid grammar: ")
            raise InvalidRequestError(f"{what} cannot be followed: as a {'grammar' if recursive else 'regex'}, "
                                      f"{reason} (lower maxLength, maxItems, numeric bounds or the number of choices)"
                                      ) from None

    def mask(self, grammar: FsmGrammar, state: State) -> torch.Tensor:
        """The bool mask [vocabulary.size] on the device of what may follow ``state`` of ``grammar``."""
        key = (grammar.key, state)
        mask = self.masks.get(key)
        if mask is not None:
            self.masks.move_to_end(key)
            return mask
        import torch

        vocabulary = self.vocabulary
        allowed = grammar.allowed_ids(state)
        if grammar.automaton.accepting(state[0]) and not state[1]:
            allowed += vocabulary.eos_token_ids
        if not allowed:  # the tokenizer cannot spell any character that continues the match
            log.warning("structured output: no token can continue the output (the tokenizer lacks the characters "
                        "the pattern needs next); allowing EOS, which ends it unfinished")
            allowed = list(vocabulary.eos_token_ids)
        mask = torch.zeros(vocabulary.size, dtype=torch.bool)
        mask[torch.tensor(allowed, dtype=torch.long)] = True
        if vocabulary.device.type == "cuda":  # an asynchronous copy: the device may still run the forward pass
            mask = mask.pin_memory().to(vocabulary.device, non_blocking=True)
        self.masks[key] = mask
        while len(self.masks) * vocabulary.size > MASK_CACHE_BYTES and len(self.masks) > 1:
            self.masks.popitem(last=False)
        return mask


def escape(text: str) -> str:
    """``text`` as a regex that matches exactly it: every character but letters, digits and spaces escaped."""
    return "".join(c if c.isalnum() or c == " " else f"\\U{ord(c):08x}" for c in text)


@hookimpl
def register_structured_output_backends(register: Register) -> None:
    def factory(config: EngineConfig, vocabulary: Vocabulary) -> FsmBackend:
        return FsmBackend(vocabulary)

    register("fsm", factory)
