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
"""
from __future__ import annotations

from typing import Any

from ..core.config import EngineConfig
from ..core.hookspecs import hookimpl
from ..core.interfaces import ReasoningParser
from ..core.registry import Register

THINK_START, THINK_END = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    """``opened_in_prompt``: whether the template opens the block, so that a reply without markers is reasoning
    (DeepSeek-R1) rather than content (Qwen3)."""

    def __init__(self, opened_in_prompt: bool) -> None:
        self.opened_in_prompt = opened_in_prompt

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


@hookimpl
def register_reasoning_parsers(register: Register[Any]) -> None:
    def qwen3(config: EngineConfig, tokenizer: Any) -> ReasoningParser:
        return ThinkReasoningParser(opened_in_prompt=False)

    def deepseek_r1(config: EngineConfig, tokenizer: Any) -> ReasoningParser:
        return ThinkReasoningParser(opened_in_prompt=True)

    register("qwen3", qwen3)
    register("deepseek-r1", deepseek_r1)
