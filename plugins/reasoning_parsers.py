"""The shipped reasoning parsers, for models that think in a ``<think>...</think>`` block before they answer.

``qwen3``: Qwen3 writes ``<think>`` itself, so a reply without one has no reasoning (its hybrid models' template
closes an empty block in the prompt when ``enable_thinking`` is false); a reply that only closes one
(``</think>``: templates that open the block in the prompt, as Qwen3's thinking-only models' do) reasons up to it.
``deepseek-r1``: DeepSeek-R1's template opens the block in the prompt, so a reply reasons from its start (past a
``<think>`` of its own) up to ``</think>``. Either way an unclosed block is all reasoning (the reply was cut while
thinking: content ""), and only the markers are dropped (with any space before a leading ``<think>``): the text
between and around them is kept as it is. Where vLLM differs: its content is None where this one's is "", it
opens a block at a ``<think>`` anywhere (dropping the text before it), and its current Qwen3 parser reads a reply
without markers as reasoning while thinking is on.

Structured output follows the reasoning where the tokenizer spells each marker as one token of its own (Qwen3's
and DeepSeek-R1's do): the grammar holds from the token after the reply's first ``</think>``, or from the first
token where the prompt ends in a closed block (``enable_thinking`` false); ``qwen3``'s reply may open the block
with its first token (unless the prompt opened it), else the grammar holds from there. A structured reply whose
grammar held from its first token is not split.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.config import EngineConfig
from ..core.hookspecs import hookimpl
from ..core.interfaces import ReasoningEnd, ReasoningParser
from ..core.registry import Register

THINK_START, THINK_END = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    """``opened_in_prompt``: whether the template opens the block, so that a reply without markers is reasoning
    (DeepSeek-R1) rather than content (Qwen3)."""

    def __init__(self, opened_in_prompt: bool, tokenizer: Any = None) -> None:
        self.opened_in_prompt, self.tokenizer = opened_in_prompt, tokenizer
        self.open_token, self.close_token = (marker_token(tokenizer, THINK_START), marker_token(tokenizer, THINK_END)) \
            if tokenizer is not None else (None, None)

    def reasoning_end(self, prompt_token_ids: Sequence[int]) -> ReasoningEnd | None:
        if self.close_token is None or self.open_token is None:
            return None
        closed, opened = False, self.opened_in_prompt
        for index in range(len(prompt_token_ids) - 1, -1, -1):  # the prompt's last marker
            if prompt_token_ids[index] in (self.open_token, self.close_token):
                closed = prompt_token_ids[index] == self.close_token and \
                    not self.tokenizer.decode(prompt_token_ids[index + 1:]).strip()  # a block of an earlier turn: no
                opened = opened or prompt_token_ids[index] == self.open_token  # a template that opens it
                break
        return ReasoningEnd(self.close_token, closed, None if opened else self.open_token)

    def split(self, text: str) -> tuple[str | None, str]:
        opened = text.lstrip().startswith(THINK_START)
        if opened:  # the space before the marker goes with it
            text = text.lstrip()[len(THINK_START):]
        reasoning, closed, content = text.partition(THINK_END)
        if closed:
            return reasoning, content
        if opened or self.opened_in_prompt:
            return text, ""
        return None, text


def marker_token(tokenizer: Any, marker: str) -> int | None:
    """The id of the one token that is ``marker`` and stays in the text (not a special token), if there is one."""
    token_id = tokenizer.get_vocab().get(marker)
    return token_id if token_id is not None and tokenizer.decode([token_id], skip_special_tokens=True) == marker \
        else None


@hookimpl
def register_reasoning_parsers(register: Register[Any]) -> None:
    def qwen3(config: EngineConfig, tokenizer: Any) -> ReasoningParser:
        return ThinkReasoningParser(opened_in_prompt=False, tokenizer=tokenizer)

    def deepseek_r1(config: EngineConfig, tokenizer: Any) -> ReasoningParser:
        return ThinkReasoningParser(opened_in_prompt=True, tokenizer=tokenizer)

    register("qwen3", qwen3)
    register("deepseek-r1", deepseek_r1)
