"""Structured output in the engine: each request's spec compiled once at admission (and cached), each of its
sequences followed by a matcher, and the rows they sample masked to what the matcher allows.

The masks are computed after the tokens in flight are read back (the engine samples after its settle), so async
scheduling keeps running ahead. With speculative decoding and the plugin option ``spec_decode.structured`` (or a
proposer of forced text, ``jump-forward``, which drafts what :meth:`forced_text` says), a copy of the matcher walks
each sequence's drafts: those after the first one the grammar refuses are dropped before
verification, and every position the rest are verified at is masked as a plain step would mask it
(:meth:`walk_drafts`). A proposer that can (``Proposer.propose_guided``, the draft model's) drafts under a copy of
its own (:meth:`draft_guide`), so that its drafts are ones the grammar allows.

A chat's structured output may follow the reply's reasoning (:meth:`follow_reasoning`, by the reasoning parser's
``ReasoningEnd``): until the token that closes it, rows are not masked (a sequence does not speculate then), and
the matcher takes the tokens after it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import PluginError
from .interfaces import Grammar, GrammarMatcher, ReasoningEnd, StructuredOutputBackend
from .request import Sequence, StructuredOutput
from .sampling import to_device

CACHED_GRAMMARS = 64


@dataclass
class DraftWalk:
    """:meth:`StructuredOutputs.walk_drafts`'s answer."""

    verified: int  # leading drafts worth verifying
    states: list[GrammarMatcher]  # verified + 1 matchers, one per verified position
    refused: bool  # whether the last verified draft is one the grammar refuses (its rejection is sure)


@dataclass
class ReasoningGate:
    """Where a sequence's grammar starts, its reasoning first (see ``ReasoningEnd``)."""

    end: ReasoningEnd
    start: int | None = None  # the output index the grammar holds from; None while reasoning (or undecided)
    scanned: int = 0  # output tokens looked at for the closing token

    def content_start(self, seq: Sequence) -> int | None:
        if self.start is None:
            tokens, first = seq.token_ids, seq.num_prompt_tokens
            if self.scanned == 0 and seq.num_output_tokens and self.end.open_token is not None and \
                    tokens[first] != self.end.open_token:
                self.start = 0  # the first token did not open the block: the reply has no reasoning
            else:
                for index in range(first + self.scanned, len(tokens)):
                    if tokens[index] == self.end.close_token:
                        self.start = index - first + 1
                        break
                self.scanned = seq.num_output_tokens
        return self.start

    def may_open(self, seq: Sequence) -> bool:
        """Whether the next token may open the reasoning instead of starting the grammar's output."""
        return self.start is None and seq.num_output_tokens == 0 and self.end.open_token is not None


class StructuredOutputs:
    """The engine's structured-output state: compiled grammars (most recently used first) and one matcher per
    sequence, fed each sequence's output tokens as they come."""

    def __init__(self, build: Callable[[], StructuredOutputBackend], name: str, vocab_size: int) -> None:
        """``build()`` makes the backend, at the first structured request."""
        self.build, self.name, self.vocab_size = build, name, vocab_size
        self.backend: StructuredOutputBackend | None = None
        self.grammars: OrderedDict[StructuredOutput, Grammar] = OrderedDict()
        self.pinned: dict[StructuredOutput, tuple[Grammar, int]] = {}  # live requests' grammars, with their count
        self.matchers: dict[int, GrammarMatcher] = {}  # seq_id -> its matcher
        self.taken: dict[int, int] = {}  # seq_id -> how many of its output tokens its matcher has taken
        self.walkable: dict[int, bool] = {}  # seq_id -> whether its matcher copies (speculative decoding asks)
        self.gates: dict[int, ReasoningGate] = {}  # seq_id -> where its grammar starts (a chat that reasons first)

    def admit(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` (InvalidRequestError from the backend for one it cannot follow) and keep it while a
        request that gives it lives (:meth:`discharge` at its end). A grammar that is no longer reusable
        (Grammar.reusable) serves the requests that began with it, and a new compile the ones after."""
        grammar, count = self.pinned.get(spec) or (self.grammar(spec), 0)
        if count and not self._reusable(grammar):
            grammar = self._compile(spec)
        self.pinned[spec] = grammar, count + 1

    def discharge(self, spec: StructuredOutput) -> None:
        grammar, count = self.pinned[spec]
        if count > 1:
            self.pinned[spec] = grammar, count - 1
        else:
            del self.pinned[spec]
            if not self._reusable(grammar):
                self.grammars.pop(spec, None)

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """The compiled ``spec``, from the cache when it is there (InvalidRequestError from the backend for one it
        cannot follow)."""
        if (pinned := self.pinned.get(spec)) is not None:
            return pinned[0]
        grammar = self.grammars.get(spec)
        if grammar is None or not self._reusable(grammar):
            return self._compile(spec)
        self.grammars.move_to_end(spec)
        return grammar

    def _compile(self, spec: StructuredOutput) -> Grammar:
        """A new compile of ``spec``, cached (in place of an earlier one)."""
        if self.backend is None:
            self.backend = self.build()
        grammar = self.backend.compile(spec)
        if not isinstance(grammar, Grammar):
            raise PluginError(f"structured-output backend {self.name!r}: compile() returned "
                              f"{type(grammar).__name__}, not a Grammar; fix the plugin")
        self.grammars[spec] = grammar
        self.grammars.move_to_end(spec)
        if len(self.grammars) > CACHED_GRAMMARS:
            self.grammars.popitem(last=False)
        return grammar

    def _reusable(self, grammar: Grammar) -> bool:
        reusable = grammar.reusable()
        if type(reusable) is not bool:
            raise PluginError(f"structured-output backend {self.name!r}: a grammar's reusable() returned "
                              f"{reusable!r:.40}, not a bool; fix the plugin")
        return reusable

    def follow_reasoning(self, seqs: list[Sequence], end: ReasoningEnd) -> None:
        """The grammar of ``seqs`` (a request's) holds after their reasoning, which ``end`` delimits."""
        for seq in seqs:
            self.gates[seq.seq_id] = ReasoningGate(end, 0 if end.closed_in_prompt else None)

    def reasoned(self, seq: Sequence) -> bool:
        """Whether ``seq``'s reply reasoned first: its grammar held from past a closing token, or never."""
        gate = self.gates.get(seq.seq_id)
        return gate is None or gate.content_start(seq) != 0

    def in_content(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar holds now (past its reasoning, if it reasons first)."""
        gate = self.gates.get(seq.seq_id)
        return gate is None or gate.content_start(seq) is not None

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """``logits`` [len(seqs), V] with the rows of structured sequences masked (a new tensor: -inf where their
        matcher disallows), or None when no row is masked. Row i belongs to ``seqs[i]``, whose tokens so far are
        all known. A sequence still reasoning is not masked, but at its first token, which may open the
        reasoning."""
        if not self.pinned:  # no live request is structured: nothing to look at
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.params.structured_output is not None and (
            self.in_content(seq) or self.gates[seq.seq_id].may_open(seq))]
        if not rows:
            return None
        masks = torch.stack([self._allowed(seqs[i]) for i in rows])
        if len(rows) == len(seqs):
            return logits.masked_fill(~masks, float("-inf"))
        at = to_device(rows, logits.device)  # a list index would wait for the device
        out = logits.clone()
        out[at] = logits[at].masked_fill(~masks, float("-inf"))
        return out

    def can_walk_drafts(self, seq: Sequence) -> bool:
        """Whether the backend can copy ``seq``'s matcher (GrammarMatcher.copy), so that its drafts can be
        verified under the grammar (asked once per sequence)."""
        walkable = self.walkable.get(seq.seq_id)
        if walkable is None:
            walkable = self.walkable[seq.seq_id] = self._matcher(seq).copy() is not None
        return walkable

    def walk_drafts(self, seq: Sequence, drafts: list[int]) -> DraftWalk:
        """How many leading ``drafts`` are worth verifying, and that many + 1 matchers: the j-th in the state
        after j of them (the 0-th, after the sequence's last token), copies walked apart from its own. The
        first draft the grammar refuses is the last verified: its rejection must still be drawn, as its
        residual, not the plain distribution, is what keeps sampling exact; a stop token is the last too (the
        mask judges it). The matcher after either repeats the one before (nothing is verified there)."""
        guide = self.draft_guide(seq)
        states = [guide.matcher]
        for token in drafts:
            guide.matcher = guide.matcher.copy()  # each verified position keeps its own state
            guide.advance(token)
            if guide.stopped:
                return DraftWalk(len(states), states + states[-1:], guide.refused)
            states.append(guide.matcher)
        return DraftWalk(len(drafts), states, refused=False)

    def forced_text(self, seq: Sequence) -> str:
        """What ``seq``'s grammar forces next (``GrammarMatcher.forced_text``)."""
        return self._matcher(seq).forced_text()

    def draft_guide(self, seq: Sequence) -> DraftGuide:
        """A copy of ``seq``'s matcher for a proposer to draft under (``Proposer.propose_guided``)."""
        walker = self._matcher(seq).copy()
        assert walker is not None, "can_walk_drafts said it copies"
        return DraftGuide(walker, seq, self._checked)

    def masks(self, states: list[GrammarMatcher]) -> torch.Tensor:
        """bool [len(states), V]: what each matcher of :meth:`walk_drafts` allows."""
        return torch.stack([self._checked(state.allowed()) for state in states])

    def _matcher(self, seq: Sequence) -> GrammarMatcher:
        """``seq``'s matcher, fed its output tokens so far (those after its reasoning)."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            spec = seq.params.structured_output
            assert spec is not None
            matcher = self.matchers[seq.seq_id] = self.grammar(spec).matcher()
        taken = self.taken.get(seq.seq_id)
        if taken is None:
            gate = self.gates.get(seq.seq_id)
            taken = 0 if gate is None else gate.content_start(seq)
            assert taken is not None, "a sequence still reasoning has no matcher"
        for token in seq.token_ids[seq.num_prompt_tokens + taken:]:
            matcher.advance(token)
        self.taken[seq.seq_id] = seq.num_output_tokens
        return matcher

    def _allowed(self, seq: Sequence) -> torch.Tensor:
        gate = self.gates.get(seq.seq_id)
        if gate is not None and gate.may_open(seq):  # the grammar's first tokens, or the one opening the reasoning
            spec = seq.params.structured_output
            assert spec is not None
            mask = self._checked(self.grammar(spec).matcher().allowed()).clone()
            mask[gate.end.open_token] = True
            return mask
        return self._checked(self._matcher(seq).allowed())

    def _checked(self, mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype != torch.bool or mask.shape != (self.vocab_size,):
            raise PluginError(f"structured-output backend {self.name!r}: allowed() returned a {mask.dtype} tensor of "
                              f"shape {tuple(mask.shape)}, not bool [{self.vocab_size}]; fix the plugin")
        return mask

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.taken.pop(seq_id, None)
        self.walkable.pop(seq_id, None)
        self.gates.pop(seq_id, None)


class DraftGuide(GrammarMatcher):
    """A sequence's matcher copy, walked along its drafts as a proposer draws them. Past a stop token, or a draft
    the grammar refuses (a proposer that drew outside the mask), it stays put: ``walk_drafts`` cuts the drafts
    there, so any mask serves after it."""

    def __init__(self, matcher: GrammarMatcher, seq: Sequence, checked: Callable[[torch.Tensor], torch.Tensor]
                 ) -> None:
        self.matcher, self.seq, self.checked = matcher, seq, checked
        self.length = seq.num_tokens  # the sequence's length with the drafts taken so far
        self.stopped = False
        self.refused = False  # stopped at a draft the grammar refuses (not at a stop token)

    def allowed(self) -> torch.Tensor:
        return self.checked(self.matcher.allowed())

    def forced_text(self) -> str:
        return "" if self.stopped else self.matcher.forced_text()

    def advance(self, token_id: int) -> None:
        self.length += 1
        if self.stopped or self.seq.stop_reason(token_id, self.length) is not None:
            self.stopped = True
            return
        try:
            self.matcher.advance(token_id)
        except ValueError:  # refused: verified and rejected (walk_drafts counts it)
            self.stopped = self.refused = True
