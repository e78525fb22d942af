"""The shipped tool parsers: ``hermes`` (Hermes 2 Pro's format, which Qwen 2.5 and Qwen 3 use: each call a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, after the reply's text)
and ``llama3-json`` (Llama 3.1 and 3.2's JSON tool calling: the reply is the call, ``{"name": ...,
"parameters": {...}}``, several separated by ``;``)."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.chat_tools import ParsedReply, ToolCall
from ..core.config import EngineConfig
from ..core.hookspecs import hookimpl
from ..core.interfaces import ToolParser
from ..core.registry import Register

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker of a call; a special token, so usually not in the text


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text outside them is the content
    (usually what comes before the first). A last block cut off by max_tokens (no closing tag) is read too, if its
    JSON is whole."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        first, *blocks = text.split(OPEN)
        if not blocks:
            return ParsedReply(text)
        calls, outside = [], [first]
        for block in blocks:
            body, _, rest = block.partition(CLOSE)
            if (call := _call(_loads(body))) is None:
                return ParsedReply(text)  # a call that does not parse: the reply stays text, whole
            calls.append(call)
            outside.append(rest)
        return ParsedReply("".join(part.strip() and part for part in outside).strip(), tuple(calls))


class Llama3JsonToolParser(ToolParser):
    """A reply that is one or more ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is read too),
    separated by ``;`` and optionally led by ``<|python_tag|>``: every call, and no content."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not rest.startswith("{"):
            return ParsedReply(text)
        decoder, calls = json.JSONDecoder(), []
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):
                return ParsedReply(text)
            if (call := _call(value)) is None:
                return ParsedReply(text)
            calls.append(call)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        return ParsedReply("", tuple(calls))


def _loads(body: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _call(value: Any) -> ToolCall | None:
    """A call from ``{"name": str, "arguments" or "parameters": mapping or its JSON text}``; None for anything
    else."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    return ToolCall(value["name"], dict(arguments)) if isinstance(arguments, Mapping) else None


@hookimpl
def register_tool_parsers(register: Register[Any]) -> None:
    def hermes(config: EngineConfig, tokenizer: Any) -> ToolParser:
        return HermesToolParser()

    def llama3_json(config: EngineConfig, tokenizer: Any) -> ToolParser:
        return Llama3JsonToolParser()

    register("hermes", hermes, aliases=("qwen",))
    register("llama3-json", llama3_json)
