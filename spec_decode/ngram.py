"""The `ngram` proposer: prompt lookup decoding, with no model at all.

The drafts continue the most recent earlier occurrence of the sequence's last ``n`` tokens (longest ``n`` first),
in the prompt or in what was generated so far. Repetitive text (code, extraction, edits) accepts many of them.
The proposal is deterministic, so its draft distribution is a point mass (``Proposal.probs`` is empty).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.errors import ConfigError
from ..core.interfaces import Proposal, Proposer
from ..core.plugin_options import PluginOption, read_plugin_options
from ..core.request import Sequence

if TYPE_CHECKING:
    from ..core.config import EngineConfig

NGRAM_OPTIONS = {
    "min_n": PluginOption(2, "the shortest suffix of the sequence that is looked up", minimum=1),
    "max_n": PluginOption(4, "the longest suffix of the sequence that is looked up (tried first)", minimum=1),
}


@dataclass
class _NgramIndex:
    """Where each ``min_n``-gram of a sequence starts (ascending), kept up to date as tokens are appended: a lookup
    reads the places where the last ``min_n`` tokens occurred instead of scanning the whole context (O(k) for
    typical text, O(context) per lookup before). Memory: a list slot per position, plus a key per distinct
    ``min_n``-gram."""

    indexed: int = 0  # the min_n-grams ending at or before this position are in ``starts``
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, _NgramIndex] = {}  # by seq_id

    @classmethod
    def from_config(cls, config: EngineConfig) -> NgramProposer:
        """``min_n`` / ``max_n`` from ``config.plugin_options["ngram"]`` (see :data:`NGRAM_OPTIONS`)."""
        options = read_plugin_options(config, "ngram", NGRAM_OPTIONS)
        if options["min_n"] > options["max_n"]:
            raise ConfigError(f"--plugin-option ngram.min_n must be at most ngram.max_n, got min_n {options['min_n']} "
                              f"and max_n {options['max_n']}")
        return cls(options["min_n"], options["max_n"])

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        drafts = {seq.seq_id: tokens for seq in seqs if (tokens := self.lookup(seq.token_ids, k, seq.seq_id))}
        return Proposal(drafts)

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)

    def lookup(self, tokens: list[int], k: int, key: int | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix of ``min_n..max_n``
        tokens (the latest match whose continuation has all ``k`` tokens, else the longest continuation). ``key``
        keeps the index of ``tokens`` for the next call (a sequence's id; tokens are only ever appended)."""
        index = self._index(tokens, key)
        length, m = len(tokens), self.min_n
        candidates = index.starts.get(tuple(tokens[length - m :]), ()) if length > m else ()
        for n in range(min(self.max_n, length - 1), m - 1, -1):
            head, best = tokens[length - n : length - m], []  # the n-suffix is head + the last m tokens
            for p in reversed(candidates):  # latest first; p = where the match's last m tokens start
                start = p - (n - m)
                if start < 0 or tokens[start:p] != head:  # (the suffix itself matches: its continuation is empty)
                    continue
                follow = tokens[start + n : start + n + k]
                if len(follow) == k:
                    return follow
                best = follow if len(follow) > len(best) else best
            if best:
                return best
        return []

    def _index(self, tokens: list[int], key: int | None) -> _NgramIndex:
        index = self.indexes.get(key) if key is not None else None
        if index is None or index.indexed > len(tokens):  # new, or the tokens were cut: build afresh
            index = _NgramIndex()
            if key is not None:
                self.indexes[key] = index
        m = self.min_n
        for end in range(max(index.indexed, m - 1) + 1, len(tokens) + 1):
            index.starts.setdefault(tuple(tokens[end - m : end]), []).append(end - m)
        index.indexed = len(tokens)
        return index
