"""The shipped structured-output backend, ``fsm``: each spec becomes a regular expression (a choice is an
alternation of literals; a JSON schema goes through plugins/json_schema_regex.py), compiled into a lazily built DFA
over characters (plugins/regex_fsm.py). A token may come next when its bytes keep the output a prefix of a match.

The allowed tokens of a state are found by walking the vocabulary in byte order: tokens that share a prefix share
its automaton steps, and a dead prefix skips every token that starts with it. A token may end inside a UTF-8
character when some character with those first bytes can continue the match (the bytes of a character prefix
cover one interval of code points). Each state's mask is computed once, at its first use, and kept on the device.
"""
from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..core.config import EngineConfig
from ..core.detokenizer import byte_level_table
from ..core.errors import InvalidRequestError
from ..core.hookspecs import hookimpl
from ..core.interfaces import Grammar, GrammarMatcher, StructuredOutputBackend, Vocabulary
from ..core.registry import Register
from ..core.request import StructuredOutput
from .json_schema_regex import schema_to_regex
from .regex_fsm import DEAD, CharAutomaton

if TYPE_CHECKING:
    import torch

log = logging.getLogger("infer")
CACHED_MASKS = 1024  # per grammar; a mask is one byte per vocabulary entry
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


class FsmGrammar(Grammar):
    """A compiled spec: its automaton, the vocabulary in byte order and the masks of the states met so far."""

    def __init__(self, automaton: CharAutomaton, vocabulary: Vocabulary, index: TokenIndex) -> None:
        self.automaton, self.vocabulary, self.index = automaton, vocabulary, index
        self.masks: OrderedDict[State, torch.Tensor] = OrderedDict()

    def matcher(self) -> FsmMatcher:
        return FsmMatcher(self)

    def mask(self, state: State) -> torch.Tensor:
        mask = self.masks.get(state)
        if mask is None:
            import torch  # not at the top: loading plugins imports no torch

            allowed = self.allowed_ids(state)
            if self.automaton.accepting(state[0]) and not state[1]:
                allowed += self.vocabulary.eos_token_ids
            if not allowed:  # the tokenizer cannot spell any character that continues the match
                log.warning("structured output: no token can continue the output (the tokenizer lacks the "
                            "characters the pattern needs next); allowing EOS, which ends it unfinished")
                allowed = list(self.vocabulary.eos_token_ids)
            mask = torch.zeros(self.vocabulary.size, dtype=torch.bool)
            mask[torch.tensor(sorted(allowed), dtype=torch.long)] = True
            mask = self.masks[state] = mask.to(self.vocabulary.device)
            if len(self.masks) > CACHED_MASKS:
                self.masks.popitem(last=False)
        else:
            self.masks.move_to_end(state)
        return mask

    def allowed_ids(self, start: State) -> list[int]:
        """The ids of the tokens whose bytes lead from ``start`` to a live state."""
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


class TokenIndex:
    """Every token's bytes (None for special tokens, which no structured output holds), and the tokens in byte
    order."""

    def __init__(self, table: list[bytes | None]) -> None:
        self.table = table
        pairs = sorted((data, token) for token, data in enumerate(table) if data)
        self.ordered = [data for data, _ in pairs]
        self.ids = [token for _, token in pairs]

    @classmethod
    def of(cls, vocabulary: Vocabulary) -> TokenIndex:
        """The index of a byte-level BPE tokenizer's vocabulary (GPT-2, Llama 3, Qwen, ...); InvalidRequestError
        for another kind, whose tokens are not fixed byte strings."""
        table = byte_level_table(vocabulary.tokenizer)
        if table is None:
            raise InvalidRequestError("structured output (the fsm backend) needs a byte-level BPE tokenizer (GPT-2, "
                                      "Llama 3, Qwen and Mistral's Tekken have one), whose tokens are fixed byte "
                                      "strings; this model's tokenizer is of another kind")
        return cls([data or None for data in table[: vocabulary.size]])


def _after(prefix: bytes) -> bytes:
    """The least byte string greater than every string that starts with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)
    return stripped[:-1] + bytes((stripped[-1] + 1,))


class FsmMatcher(GrammarMatcher):
    def __init__(self, grammar: FsmGrammar) -> None:
        self.grammar = grammar
        self.state: State = (grammar.automaton.start, b"")
        self.ended = False

    def allowed(self) -> torch.Tensor:
        return self.grammar.mask(self.state)

    def advance(self, token_id: int) -> None:
        grammar = self.grammar
        if token_id in grammar.vocabulary.eos_token_ids and not self.ended and \
                grammar.automaton.accepting(self.state[0]) and not self.state[1]:
            self.ended = True
            return
        data = grammar.index.table[token_id] if not self.ended and 0 <= token_id < len(grammar.index.table) else None
        state: State | None = self.state
        for byte in data or b"":
            if state is None:
                break
            state = step(grammar.automaton, state, byte)
        if not data or state is None:
            raise ValueError(f"token {token_id} cannot continue the structured output here (it was not allowed)")
        self.state = state


class FsmBackend(StructuredOutputBackend):
    """Compiles regex, choice and JSON-schema specs; the vocabulary is indexed at the first compile."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self.index: TokenIndex | None = None

    def compile(self, spec: StructuredOutput) -> FsmGrammar:
        if spec.choice is not None:
            pattern = "|".join(escape(choice) for choice in spec.choice)
        elif spec.json_schema is not None:
            pattern = schema_to_regex(spec.json_schema)
        else:
            assert spec.regex is not None
            pattern = spec.regex
        automaton = CharAutomaton.compile(pattern)
        if self.index is None:
            self.index = TokenIndex.of(self.vocabulary)
        return FsmGrammar(automaton, self.vocabulary, self.index)


def escape(text: str) -> str:
    """``text`` as a regex that matches exactly it: every character but letters, digits and spaces escaped."""
    return "".join(c if c.isalnum() or c == " " else f"\\U{ord(c):08x}" for c in text)


@hookimpl
def register_structured_output_backends(register: Register) -> None:
    def factory(config: EngineConfig, vocabulary: Vocabulary) -> FsmBackend:
        return FsmBackend(vocabulary)

    register("fsm", factory)
