"""Tool use in chat prompts, as OpenAI's chat API and HF's chat templates have it: the tools the model may call
(function definitions with JSON-schema parameters, given to the template as ``tools``), an assistant turn's calls
(``tool_calls``) and a tool's answer (a "tool" message citing the ``tool_call_id`` it answers). The engine renders
them into the prompt; reading the calls out of the model's reply is a tool parser's work (``--tool-parser``,
core/interfaces.py's ToolParser), as the format is the model's own (Qwen's ``<tool_call>`` JSON, Llama 3.1's bare
JSON object, ...)."""
from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError

MAX_JSON_DEPTH = 64  # nesting of lists and mappings; HF's template sandbox copies values recursively
TOOL_SHAPE = "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}}"
CALL_SHAPE = "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': {...} or a JSON object string}}"
TOOL_CHOICES = ("auto", "none", "required")
NAMED_CHOICE_SHAPE = "{'type': 'function', 'function': {'name': ...}}"
CHOICE_SHAPE = f"'auto', 'none', 'required' or {NAMED_CHOICE_SHAPE}"


def brief(value: object) -> str:
    """``value`` shown in an error, bounded (3 levels, 6 items, 80 characters a part): str() of a value nested deeper
    than the recursion limit raised RecursionError, and of a huge one built all of it."""
    shown = reprlib.Repr()  # its keyword arguments are Python 3.12's
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlist, shown.maxdict = 3, 80, 80, 6, 6
    return shown.repr(value)


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant turn: the function's ``name``, its ``arguments`` (a JSON object) and the ``id``
    that the tool's answer cites (optional)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """OpenAI's shape and key order, ``type`` "function" included, the arguments as a mapping: what tool-use
        templates read (vLLM parses OpenAI's JSON string the same way, and HF's documentation asks for a
        mapping)."""
        call = {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}
        return call if self.id is None else {"id": self.id, **call}


@dataclass(frozen=True)
class ParsedReply:
    """A reply read by a tool parser: its ``content`` (the text outside the calls; the whole text when it holds
    none, or a call that does not parse) and its ``tool_calls``."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class FunctionChoice:
    """A ``tool_choice`` that names the one function the reply calls (OpenAI's ``{"type": "function", "function":
    {"name": ...}}``)."""

    name: str


ToolChoice = str | FunctionChoice  # one of TOOL_CHOICES, or a FunctionChoice


def json_like(value: Any, what: str) -> Any:
    """A deep copy of ``value`` (so the caller's later edits change nothing); InvalidRequestError unless it is
    JSON-like (strings, numbers, bools, None, lists and string-keyed mappings, at most MAX_JSON_DEPTH deep) and its
    text is UTF-8."""
    _check_shape(value, what)
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError: a lone surrogate
        raise InvalidRequestError(f"{what} must be JSON-like (strings, numbers, bools, None, lists and mappings of "
                                  f"UTF-8 text), got {brief(value)} ({exc})") from None
    return json.loads(text)


def load_json(text: str, what: str, expected: str) -> Any:
    """``text`` parsed; InvalidRequestError naming ``what`` and the ``expected`` value for text that is not JSON
    or nests deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{what} is not JSON ({exc}); send {expected}") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels; send {expected}") from None
    _check_shape(value, what)
    return value


def _check_shape(value: Any, what: str) -> None:
    """Mapping keys are strings (JSON would turn 1 and "1" into one key) and nesting stays within MAX_JSON_DEPTH
    (a deeper value would exhaust the recursion of the copies below); walked without recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, Mapping):
            if bad := [key for key in item if not isinstance(key, str)]:
                raise InvalidRequestError(f"{what} must be JSON-like: mapping keys are strings, got {bad[0]!r}")
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequestError(f"{what} nests lists and mappings deeper than {MAX_JSON_DEPTH} levels")
        pending.extend((child, depth + 1) for child in children)


def checked_tools(tools: Sequence[Mapping[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    """The tool definitions, copied; InvalidRequestError for anything but a list of OpenAI function tools."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of {TOOL_SHAPE} entries, got {type(tools).__name__}")
    copied = json_like(list(tools), "tools")
    for index, tool in enumerate(copied):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):  # as in messages, a None is an absent key (pydantic's model_dump writes them)
            tool["function"] = function = {key: value for key, value in function.items() if value is not None}
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tool {index} must be {TOOL_SHAPE}, got {brief(tool)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tool {index}: function.name must be a non-empty string")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequestError(f"tool {index}: function.parameters must be a JSON schema object")
    names = [tool["function"]["name"] for tool in copied]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise InvalidRequestError(f"tools must have distinct names (a call names its function), and "
                                  f"{', '.join(map(repr, repeated))} is given more than once; rename or drop one")
    return tuple(copied)


def checked_tool_choice(choice: object, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """``choice`` as a ToolChoice ("auto" for None); InvalidRequestError for anything but CHOICE_SHAPE, for
    "required" without tools, and for a function that is not among ``tools``."""
    if choice is None:
        return "auto"
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(function, Mapping) \
                or set(function) != {"name"} or not isinstance(function["name"], str):
            raise InvalidRequestError(f"tool_choice must be {CHOICE_SHAPE}, got {brief(choice)}")
        choice = FunctionChoice(function["name"])
    if isinstance(choice, FunctionChoice):
        names = [tool["function"]["name"] for tool in tools]
        if choice.name not in names:
            raise InvalidRequestError(f"tool_choice names the function {choice.name!r}, which is not among the chat's "
                                      f"tools ({', '.join(map(repr, names)) or 'none'}); name one of them")
        return choice
    if choice not in TOOL_CHOICES:
        raise InvalidRequestError(f"tool_choice must be {CHOICE_SHAPE}, got {brief(choice)}")
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs tools to call; give the chat tools, or set tool_choice "
                                  "'auto'")
    return choice  # type: ignore[return-value]


def parse_tool_choice(text: str | None, what: str, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """A ToolChoice from text (a CLI option or a gRPC field, named ``what``): "" is "auto", a word is itself, and
    text that starts with ``{`` is OpenAI's JSON object of a named function."""
    if text and text.lstrip().startswith("{"):
        return checked_tool_choice(load_json(text, what, f"a JSON object {NAMED_CHOICE_SHAPE}"), tools)
    return checked_tool_choice(text or None, tools)


def parse_tools(text: str | None, what: str) -> tuple[dict[str, Any], ...]:
    """Tool definitions from a JSON array (a CLI file or a gRPC field, named ``what``); none for None or ""."""
    if not text:
        return ()
    value = load_json(text, what, f"a JSON array of {TOOL_SHAPE} entries")
    if not isinstance(value, list):
        raise InvalidRequestError(f"{what} must be a JSON array of tool definitions, got {text[:80]}")
    return checked_tools(value)


def tool_calls_of(index: int, calls: object) -> tuple[ToolCall, ...]:
    """Chat message ``index``'s ``tool_calls``: ToolCalls, or OpenAI's mappings (keys whose value is None
    dropped, ``arguments`` a mapping or OpenAI's JSON object string)."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise InvalidRequestError(f"chat message {index}: tool_calls must be a list of {CALL_SHAPE} entries")
    return tuple(_call(f"chat message {index}: tool call {number}", call) for number, call in enumerate(calls))


def _call(what: str, call: object) -> ToolCall:
    if isinstance(call, ToolCall):
        call = {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{what} must be {CALL_SHAPE}, got {brief(call)}")
    call = {key: value for key, value in call.items() if value is not None}
    function = call.get("function")
    if set(call) - {"id", "type", "function"} or call.get("type", "function") != "function" or \
            not isinstance(function, Mapping) or set(function) - {"name", "arguments"}:
        raise InvalidRequestError(f"{what} must be {CALL_SHAPE}, got {brief(call)}")
    name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{what}: function.name must be a non-empty string")
    if call_id is not None and (not isinstance(call_id, str) or not call_id):
        raise InvalidRequestError(f"{what}: id must be a non-empty string")
    if isinstance(arguments, str):
        arguments = load_json(arguments, f"{what}: arguments", "a JSON object")
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{what}: arguments must be a JSON object (a mapping, or its JSON text), got "
                                  f"{brief(arguments)}")
    json_like([name, call_id], what)
    return ToolCall(name, json_like(dict(arguments), f"{what}: arguments"), call_id)
