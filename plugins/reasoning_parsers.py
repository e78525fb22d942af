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

Replies are split as they stream (``stream``), and the stream reads the prompt, which ``split`` cannot: the
prompt's last marker decides where a reply starts. After a ``<think>`` (the template opened the block) the reply
reasons until it closes the block, with either parser; after a closed block (thinking off) it is all content; else
``deepseek-r1``'s reply reasons and ``qwen3``'s reasons only if it opens a block itself. So a ``qwen3`` reply
that only closes a block counts as reasoning where the prompt opened it, not where it did not, and one that the
prompt opened but that was cut while thinking is reasoning. Text that may begin a marker is held back until it
cannot (a ``<th`` at the start, a ``</thi`` while reasoning).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.config import EngineConfig
from ..core.hookspecs import hookimpl
from ..core.interfaces import ReasoningEnd, ReasoningParser, ReasoningStream
from ..core.registry import Register

THINK_START, THINK_END = "<think>", "</think>"
START, REASONING, CONTENT = "start", "reasoning", "content"  # where a ThinkStream is in its reply
OPENED, CLOSED = "opened", "closed"  # where a prompt leaves the reasoning (ThinkReasoningParser.prompt_state)
MAX_SPACE_TOKENS = 8  # the tokens after a closing marker read as "nothing but space" (a template's "\n\n"): no more


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
        state = self.prompt_state(prompt_token_ids)
        opened = self.opened_in_prompt or state == OPENED
        return ReasoningEnd(self.close_token, state == CLOSED, None if opened else self.open_token)

    def stream(self, prompt_token_ids: Sequence[int]) -> ReasoningStream:
        state = self.prompt_state(prompt_token_ids)
        if state == CLOSED:
            return ThinkStream(CONTENT)
        return ThinkStream(START, reasons_unopened=self.opened_in_prompt or state == OPENED)

    def prompt_state(self, prompt_token_ids: Sequence[int]) -> str | None:
        """By the prompt's last marker token: OPENED where it opens a block (the template's: the reply's to close),
        CLOSED where it closes one with nothing but space after it (thinking off), else None (none, an earlier
        turn's, or a tokenizer without the markers as tokens: a marker's text that a user typed and that was
        encoded as text, with --sanitize-chat-control-tokens, is not one)."""
        if self.open_token is None or self.close_token is None:
            return None
        ids = list(prompt_token_ids)
        ids.reverse()
        opened, closed = (_index_or(ids, token) for token in (self.open_token, self.close_token))
        if opened < closed:
            return OPENED
        after = ids[:closed]
        return CLOSED if closed < len(ids) and len(after) <= MAX_SPACE_TOKENS and \
            not self.tokenizer.decode(after[::-1]).strip() else None

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


class ThinkStream(ReasoningStream):
    """One reply's split as it streams: at its START (a leading ``<think>`` may open the block; else it reasons if
    ``reasons_unopened``), in its reasoning, or in its content (for good: later markers are content)."""

    def __init__(self, mode: str, reasons_unopened: bool = False) -> None:
        self.mode, self.reasons_unopened, self.held, self._reasoned = mode, reasons_unopened, "", False

    @property
    def reasoned(self) -> bool:
        return self._reasoned

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.mode == START:
            lead = text.lstrip()
            if not final and THINK_START.startswith(lead):  # only space so far, or the start of a <think>
                self.held = text
                return "", ""
            if lead.startswith(THINK_START):  # the space before the marker goes with it
                self.mode, text = REASONING, lead[len(THINK_START):]
            else:
                self.mode = REASONING if self.reasons_unopened else CONTENT
            self._reasoned = self.mode == REASONING
        if self.mode == CONTENT:
            return "", text
        reasoning, closed, content = text.partition(THINK_END)
        if closed:
            self.mode = CONTENT
            return reasoning, content
        cut = len(reasoning) - (0 if final else marker_start(reasoning, THINK_END))
        self.held = reasoning[cut:]
        return reasoning[:cut], ""


def _index_or(items: list[int], item: int) -> int:
    """The first index of ``item`` in ``items``, else their length."""
    try:
        return items.index(item)
    except ValueError:
        return len(items)


def marker_start(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (but is not all of it)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


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
