"""The `ngram` proposer: prompt lookup decoding, with no model at all.

The drafts continue the most recent earlier occurrence of the sequence's last ``n`` tokens (longest ``n`` first),
in the prompt or in what was generated so far. Repetitive text (code, extraction, edits) accepts many of them.
The proposal is deterministic, so its draft distribution is a point mass (``Proposal.probs`` is empty).
"""
from __future__ import annotations

from typing import Any

from ..core.errors import ConfigError
from ..core.interfaces import Proposal, Proposer
from ..core.request import Sequence


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_options(cls, plugin_options: dict[str, Any]) -> NgramProposer:
        """``min_n`` / ``max_n`` from ``EngineConfig.plugin_options["ngram"]`` (defaults 2 and 4)."""
        options = plugin_options.get("ngram", {}) if isinstance(plugin_options, dict) else {}
        values = {key: options.get(key, default) for key, default in (("min_n", 2), ("max_n", 4))}
        bad = {k: v for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad or values["min_n"] > values["max_n"]:
            raise ConfigError(f"ngram options min_n and max_n must be integers with 1 <= min_n <= max_n; got "
                              f"{values} (set them with --plugin-option ngram.min_n=2 --plugin-option ngram.max_n=4)")
        return cls(values["min_n"], values["max_n"])

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        drafts = {seq.seq_id: tokens for seq in seqs if (tokens := self.lookup(seq.token_ids, k))}
        return Proposal(drafts)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix of ``min_n..max_n``
        tokens (the latest match whose continuation has all ``k`` tokens, else the longest continuation)."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix, best = tokens[length - n :], []
            for start in range(length - n - 1, -1, -1):  # latest first; a match ends before the suffix does
                if tokens[start] == suffix[0] and tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if len(follow) == k:
                        return follow
                    best = follow if len(follow) > len(best) else best
            if best:
                return best
        return []
