"""Structured output in the engine: each request's spec compiled once at admission (and cached), each of its
sequences followed by a matcher, and the rows they sample masked to what the matcher allows.

The masks are computed after the tokens in flight are read back (the engine samples after its settle), so async
scheduling keeps running ahead; such requests do not speculate.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .errors import PluginError
from .interfaces import Grammar, GrammarMatcher, StructuredOutputBackend
from .request import Sequence, StructuredOutput

CACHED_GRAMMARS = 64


class StructuredOutputs:
    """The engine's structured-output state: compiled grammars (most recently used first) and one matcher per
    sequence, fed each sequence's output tokens as they come."""

    def __init__(self, backend: StructuredOutputBackend, name: str, vocab_size: int) -> None:
        self.backend, self.name, self.vocab_size = backend, name, vocab_size
        self.grammars: OrderedDict[StructuredOutput, Grammar] = OrderedDict()
        self.matchers: dict[int, GrammarMatcher] = {}  # seq_id -> its matcher
        self.taken: dict[int, int] = {}  # seq_id -> how many of its output tokens its matcher has taken

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """The compiled ``spec`` (InvalidRequestError from the backend for one it cannot follow)."""
        grammar = self.grammars.get(spec)
        if grammar is None:
            grammar = self.backend.compile(spec)
            if not isinstance(grammar, Grammar):
                raise PluginError(f"structured-output backend {self.name!r}: compile() returned "
                                  f"{type(grammar).__name__}, not a Grammar; fix the plugin")
            self.grammars[spec] = grammar
            if len(self.grammars) > CACHED_GRAMMARS:
                self.grammars.popitem(last=False)
        else:
            self.grammars.move_to_end(spec)
        return grammar

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """``logits`` [len(seqs), V] with the rows of structured sequences masked (a new tensor: -inf where their
        matcher disallows), or None when no row is structured. Row i belongs to ``seqs[i]``, whose tokens so far
        are all known."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.structured_output is not None]
        if not rows:
            return None
        masks = torch.stack([self._allowed(seqs[i]) for i in rows])
        out = logits.clone()
        at = torch.tensor(rows, device=logits.device) if len(rows) < len(seqs) else None
        picked = out if at is None else out[at]
        picked = picked.masked_fill(~masks, float("-inf"))
        if at is None:
            return picked
        out[at] = picked
        return out

    def _allowed(self, seq: Sequence) -> torch.Tensor:
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            spec = seq.params.structured_output
            assert spec is not None
            matcher = self.matchers[seq.seq_id] = self.grammar(spec).matcher()
        taken = self.taken.get(seq.seq_id, 0)
        for token in seq.token_ids[seq.num_prompt_tokens + taken:]:
            matcher.advance(token)
        self.taken[seq.seq_id] = seq.num_output_tokens
        mask = matcher.allowed()
        if mask.dtype != torch.bool or mask.shape != (self.vocab_size,):
            raise PluginError(f"structured-output backend {self.name!r}: allowed() returned a {mask.dtype} tensor of "
                              f"shape {tuple(mask.shape)}, not bool [{self.vocab_size}]; fix the plugin")
        return mask

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.taken.pop(seq_id, None)
