"""The `jump-forward` proposer: a structured-output sequence's drafts are the tokens of the text its grammar forces
next (a JSON schema's keys and punctuation, the rest of an enum value once its first letters chose it, a regex's
literals), with no model at all.

SGLang's jump-forward decoding appends such text without running the model on it, retokenized, which changes the
output's distribution (the model may well have spelled the text with other tokens). Here the text's tokens are
drafts instead: the target verifies them in the step that samples the first of them, at positions masked by the
grammar, so the output stays exact (a point-mass draft x is accepted with probability p(x) under the mask, and a
rejection is resampled from the rest), and a forced stretch of n tokens costs one forward pass instead of n.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

from ..core.interfaces import GrammarMatcher, Proposal, Proposer
from ..core.request import Sequence

CACHED_TEXTS = 4096  # forced texts whose tokens are kept (one per grammar state that forces any)


class JumpForwardProposer(Proposer):
    drafts_forced_text = True

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.spelled: OrderedDict[str, list[int]] = OrderedDict()  # forced text -> its tokens, least recent first

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        return Proposal({})  # a sequence without a grammar has no text forced on it

    def propose_guided(self, seqs: list[Sequence], k: int, guides: dict[int, GrammarMatcher]) -> Proposal:
        drafts = {}
        for seq_id, guide in guides.items():
            if (text := guide.forced_text()) and (tokens := self.spell(text)[:k]):
                drafts[seq_id] = tokens
        return Proposal(drafts)

    def spell(self, text: str) -> list[int]:
        """The tokenizer's tokens of ``text``: none added, a special token's text spelled as text (a pattern's
        ``<|eos|>`` is not EOS), cut before any id past the model's vocabulary (a tokenizer may hold more)."""
        tokens = self.spelled.get(text)
        if tokens is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            tokens = self.spelled[text] = list(itertools.takewhile(lambda token: token < self.vocab_size, ids))
            if len(self.spelled) > CACHED_TEXTS:
                self.spelled.popitem(last=False)
        else:
            self.spelled.move_to_end(text)
        return tokens
