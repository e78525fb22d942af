"""Forced tool calls: a chat's ``tool_choice`` "required" (one call or more of its tools) or a named function
(exactly one call of it), served as vLLM serves them: the reply is structured output under a JSON schema built from
the tools' parameters, so it is read as JSON whatever the model's own call format, and needs no --tool-parser.

The reply's shapes are vLLM's: a named function's reply is its arguments object; "required"'s is a JSON array of
``{"name": ..., "parameters": {...}}`` objects, one per call. "none": the reply is content, read by no parser;
"auto" (the default): the engine's --tool-parser, if any, reads it."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence as Seq
from typing import Any

from .chat import ChatPrompt, Prompt
from .chat_tools import FunctionChoice, ParsedReply, ToolCall, ToolChoice, checked_tool_choice
from .errors import InvalidRequestError
from .interfaces import ToolParser
from .request import SamplingParams, StructuredOutput

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: none
DEFINITIONS = ("$defs", "definitions")


def reply_reading(prompt: Prompt, params: SamplingParams, tool_parser: ToolParser | None
                  ) -> tuple[SamplingParams, ToolParser | None]:
    """The parameters a request runs with and what reads its replies' calls (None: nothing), by the prompt's
    tool_choice. A forced choice adds the structured output of :func:`reply_schema`; InvalidRequestError where
    the parameters cannot take it."""
    if not isinstance(prompt, ChatPrompt) or not prompt.tools:
        return params, None
    choice = checked_tool_choice(prompt.tool_choice, prompt.tools)  # a prompt built directly is unchecked
    if choice in ("auto", "none"):
        return params, tool_parser if choice == "auto" else None
    what = forced_what(choice)
    if params.structured_output is not None:
        raise InvalidRequestError(f"{what} makes the reply structured output of its own, so it cannot take the "
                                  "request's structured_output; drop one of them")
    forced = dataclasses.replace(params, structured_output=StructuredOutput(json_schema=reply_schema(
        prompt.tools, choice)))
    try:
        forced.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{what} makes the reply structured output: {exc}") from None
    return forced, ForcedToolCalls(choice)


def forces_calls(prompt: Prompt) -> bool:
    """Whether ``prompt``'s tool_choice forces its reply to be calls ("required" or a named function)."""
    return isinstance(prompt, ChatPrompt) and bool(prompt.tools) and prompt.tool_choice not in ("auto", "none")


def forced_what(choice: ToolChoice) -> str:
    return f"tool_choice {choice.name!r}" if isinstance(choice, FunctionChoice) else f"tool_choice {choice!r}"


@contextlib.contextmanager
def schema_errors(reader: ToolParser | None) -> Iterator[None]:
    """A forced reply's schema refused by the structured-output backend: the error says it is the tools'."""
    try:
        yield
    except InvalidRequestError as exc:
        if not isinstance(reader, ForcedToolCalls):
            raise
        where = "" if isinstance(reader.choice, FunctionChoice) else (
            " (under 'required', tool N's parameters are at /items/anyOf/N/properties/parameters)")
        raise InvalidRequestError(f"{forced_what(reader.choice)} forces the reply under the tools' parameter "
                                  f"schemas, which cannot be followed{where}: {exc}; change the tool's parameters, "
                                  "or set tool_choice 'auto'") from None


def reply_schema(tools: Seq[Mapping[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of a reply forced by ``choice`` ("required" or a FunctionChoice) among ``tools``;
    InvalidRequestError for a tool whose parameters are not an object schema (OpenAI's rule)."""
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") or NO_PARAMETERS for tool in tools}
    for name, schema in parameters.items():
        if schema.get("type", "object") != "object":
            raise InvalidRequestError(f"{forced_what(choice)} forces calls, and the parameters of tool {name!r} are "
                                      f"not an object schema (type {schema.get('type')!r}); give it "
                                      "{\"type\": \"object\", \"properties\": {...}}")
    if isinstance(choice, FunctionChoice):
        return parameters[choice.name]
    assert choice == "required", choice
    hoisted: dict[str, Any] = {}
    calls = []
    for index, (name, schema) in enumerate(parameters.items()):
        own = {key: value for key, value in schema.items() if key not in DEFINITIONS}
        for key in DEFINITIONS:  # one root for every tool: each tool's definitions under names of its own
            for defined, definition in (schema.get(key) or {}).items():
                hoisted[f"tool{index}.{key}.{defined}"] = _relinked(definition, index)
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": _relinked(own, index)},
                      "required": ["name", "parameters"]})
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": items, "minItems": 1, **({"$defs": hoisted} if hoisted else {})}


def _relinked(schema: Any, index: int) -> Any:
    """``schema`` with its local refs (``#/$defs/X``, ``#/definitions/X``) pointing to tool ``index``'s hoisted
    definitions."""
    if isinstance(schema, list):
        return [_relinked(item, index) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _relinked(value, index) for key, value in schema.items()}
    ref = schema.get("$ref")
    for key in DEFINITIONS:
        if isinstance(ref, str) and ref.startswith(f"#/{key}/"):
            out["$ref"] = f"#/$defs/tool{index}.{key}.{ref.removeprefix(f'#/{key}/')}"
    return out


@dataclasses.dataclass(frozen=True)
class ForcedToolCalls(ToolParser):
    """Reads a reply forced by ``choice`` into calls. A reply that is not whole JSON (cut by max_tokens or a stop
    string) is all content, as the ToolParser contract asks."""

    choice: ToolChoice

    def parse(self, text: str, token_ids: Seq[int]) -> ParsedReply:
        try:
            value = json.loads(text)
        except ValueError:
            return ParsedReply(text)
        if isinstance(self.choice, FunctionChoice):
            return ParsedReply("", (ToolCall(self.choice.name, value),)) if isinstance(value, dict) else \
                ParsedReply(text)
        if isinstance(value, list) and value and all(isinstance(call, dict) and isinstance(
                call.get("name"), str) and isinstance(call.get("parameters"), dict) for call in value):
            return ParsedReply("", tuple(ToolCall(call["name"], call["parameters"]) for call in value))
        return ParsedReply(text)
