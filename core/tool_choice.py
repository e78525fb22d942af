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
from .chat_tools import FunctionChoice, ParsedReply, ToolCall, ToolChoice, checked_tool_choice, json_like
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
    return isinstance(prompt, ChatPrompt) and bool(prompt.tools) and prompt.tool_choice not in (None, "auto", "none")


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
    parameters = {tool["function"]["name"]: _object_schema(tool["function"].get("parameters") or NO_PARAMETERS,
                                                           tool["function"]["name"], choice) for tool in tools}
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


def _object_schema(schema: Mapping[str, Any], name: str, choice: ToolChoice) -> Mapping[str, Any]:
    """A tool's parameters as a forced reply takes them: a schema of objects only, else InvalidRequestError (a
    reply that is another JSON value would be no call). Without a ``type`` and an applicator, it gets
    ``"type": "object"``: keywords such as ``properties`` or ``description`` alone do not rule out other values."""
    for key in DEFINITIONS:
        if key in schema and not isinstance(schema[key], Mapping):
            raise InvalidRequestError(f"{forced_what(choice)}: the parameters of tool {name!r} have {key!r} "
                                      f"{json.dumps(schema[key])[:60]}, not an object of named schemas; fix the "
                                      "tool's parameters")
    if "type" not in schema and not any(key in schema for key in APPLICATORS):
        return {"type": "object", **schema}
    if not _objects_only(schema, schema, set()):
        raise InvalidRequestError(f"{forced_what(choice)} forces calls, and the parameters of tool {name!r} may be "
                                  f"a value other than an object (type {schema.get('type')!r}); give them "
                                  "{\"type\": \"object\", \"properties\": {...}} (each branch of an 'anyOf' "
                                  "or 'oneOf' too)")
    return schema


APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")


def _objects_only(schema: Any, root: Mapping[str, Any], seen: set[str]) -> bool:
    """Whether every value ``schema`` allows is a JSON object (its local refs looked up in ``root``)."""
    if not isinstance(schema, Mapping):
        return False
    if schema.get("type") in ("object", ["object"]):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str):
        key, _, defined = ref.removeprefix("#/").partition("/")
        target = root.get(key, {}).get(defined) if key in DEFINITIONS and isinstance(root.get(key), Mapping) else None
        return ref not in seen and _objects_only(target, root, seen | {ref})
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            branches = [_objects_only(branch, root, seen) for branch in schema[key]]
            return any(branches) if key == "allOf" else all(branches)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    return values is not None and all(isinstance(value, dict) for value in values)


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
    string), or holds a number past float range, is all content, as the ToolParser contract asks."""

    choice: ToolChoice

    def parse(self, text: str, token_ids: Seq[int]) -> ParsedReply:
        try:  # JSON-like: the grammar allows numbers past float range (1e999), which no call's arguments hold
            value = json_like(json.loads(text), "a forced reply")
        except (ValueError, RecursionError, InvalidRequestError):
            return ParsedReply(text)
        if isinstance(self.choice, FunctionChoice):
            return ParsedReply("", (ToolCall(self.choice.name, value),)) if isinstance(value, dict) else \
                ParsedReply(text)
        if isinstance(value, list) and value and all(isinstance(call, dict) and isinstance(
                call.get("name"), str) and isinstance(call.get("parameters"), dict) for call in value):
            return ParsedReply("", tuple(ToolCall(call["name"], call["parameters"]) for call in value))
        return ParsedReply(text)
