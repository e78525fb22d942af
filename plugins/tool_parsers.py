"""The shipped tool parsers: ``hermes`` (Hermes 2 Pro's format, which Qwen 2.5 and Qwen 3 use: each call a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, after the reply's text),
``llama3-json`` (Llama 3.1 and 3.2's JSON tool calling: the reply is the call, ``{"name": ...,
"parameters": {...}}``, several separated by ``;``), ``pythonic`` (Llama 3.2's and Llama 4's: the reply is a
Python list of calls with keyword arguments, ``[get_weather(city="Oslo"), now()]``) and ``mistral`` (Mistral's
``[TOOL_CALLS]``, in both of mistral-common's encodings: a JSON list of calls, and since tokenizer v11 one
``[TOOL_CALLS]name[ARGS]{...}`` per call).

Where the tokenizer marks hermes's or mistral's tags special (Mistral's does), the parser asks the engine to write
them out in the text it reads (``written_tags``). Each says how much of a reply streams as content before the
reply has ended (``streamed_content``): hermes and mistral the text before their first tag (hermes's after the
reasoning's end: a tag named while reasoning does not stop the stream); llama3-json and pythonic, whose replies
are all calls or all content, the whole text once its first characters are no call's, else nothing until the reply
is read. hermes streams each call once its closing tag is out (``streamed_calls``), mistral each of its tagged
calls once the next begins; the others' calls come with the reply's last output (a later call that does not parse
would make their whole reply text)."""
from __future__ import annotations

import ast
import itertools
import json
import re
import secrets
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core.chat_tools import ParsedReply, ToolCall, json_like
from ..core.config import EngineConfig
from ..core.errors import InvalidRequestError
from ..core.hookspecs import hookimpl
from ..core.interfaces import ToolParser
from ..core.registry import Register
from .reasoning_parsers import marker_start

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"  # Qwen3 reasons first: a tag mentioned there is not a call
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker of a call; a special token, so usually not in the text
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, likewise
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's control tokens
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")


class PythonicToolParser(ToolParser):
    """A reply that is a Python list of calls, ``[name(key=literal, ...), ...]``: every call, and no content. It is
    read as a syntax tree, never run: each argument must be a literal that JSON can hold (strings, numbers, True,
    False, None, lists and dicts of them); anything else (positional arguments, expressions, sets) leaves the
    reply as text."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        source = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        if not (source.startswith("[") and source.endswith("]")):
            return ParsedReply(text)
        try:
            tree = ast.parse(source, mode="eval").body
            calls = tuple(_python_call(node) for node in tree.elts) if isinstance(tree, ast.List) else ()
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return ParsedReply(text)
        return ParsedReply("", calls) if calls else ParsedReply(text)

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        return _all_unless_led_by(text, PYTHON_START, "[")


def _python_call(node: ast.expr) -> ToolCall:
    """One ``name(key=literal, ...)``; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or any(
            keyword.arg is None for keyword in node.keywords):
        raise ValueError("not a call of a name with keyword arguments")
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    if (call := _json_call(node.func.id, arguments)) is None:
        raise ValueError("arguments JSON cannot hold")
    return call


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_refuse)  # stateless; NaN and Infinity, which json.loads takes, are refused


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after the reasoning (a ``<think>``
    block); the text outside them is the content (usually what comes before the first). A block that is no call
    (its JSON does not parse, or is not a call's) is text of the content; a last block cut off by max_tokens (no
    closing tag) is read too, if its JSON is whole. The text between calls is kept as written, but a stretch of
    only whitespace is dropped (the newlines a template writes between calls); so is space after the content, and
    before it where no text comes before the first call. The content streams up to the first tag (and the space before it), and
    the calls each once closed, where the reply's reasoning is known (``for_prompt``). ``written_tags``: the
    tags' token ids, for a tokenizer that marks them special; ``prompt_tail``: the text of a prompt's last
    tokens, where ``for_prompt`` looks for a reasoning block the prompt opened (None: not known, so a
    ``</think>`` after calls ends a reasoning the prompt may have opened, and calls stream with the last output);
    ``opened_in_prompt``: whether the prompt of the replies read opened one (None: not known)."""

    def __init__(self, written_tags: Mapping[int, str] | None = None,
                 prompt_tail: Callable[[Sequence[int]], str] | None = None,
                 opened_in_prompt: bool | None = None) -> None:
        self.written_tags = dict(written_tags or {})
        self.prompt_tail, self.opened_in_prompt = prompt_tail, opened_in_prompt
        self.counted = ("", 0, 0)  # streamed_calls' last reply through its closed calls, their count, their start

    def for_prompt(self, prompt_token_ids: Sequence[int]) -> ToolParser:
        if self.prompt_tail is None:
            return self
        tail = self.prompt_tail(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        return HermesToolParser(self.written_tags, opened_in_prompt=tail.rfind(THINK_START) > tail.rfind(THINK_END))

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        if (first := _after_reasoning(text, self.opened_in_prompt)) is None:  # cut while reasoning: all text
            return ParsedReply(text)
        reply, calls, outside, position = text[first:], [], [], 0
        for start, call, end, _ in _blocks(reply):
            if call is not None:
                outside.append(reply[position:start])
                calls.append(call)
                position = end
        if not calls:
            return ParsedReply(text)
        outside[0] = text[:first] + outside[0]
        content = "".join(part.strip() and part for part in [*outside, reply[position:]]).rstrip()
        return ParsedReply(content if outside[0].strip() else content.lstrip(), tuple(calls))

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        if (first := _after_reasoning(text, self.opened_in_prompt)) is None:  # reasoning so far, unless "<t"
            return 0 if OPEN.startswith(text.lstrip()) else len(text)  # begins a call's tag
        return _content_before(text, OPEN, first)

    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        if self.opened_in_prompt is None:  # a </think> to come may make the calls so far reasoning
            return 0
        if (first := _after_reasoning(text, self.opened_in_prompt)) is None:
            return 0
        known, count, start = self.counted  # a reply's closed calls stay as they are: read on after them
        if start != first or not text.startswith(known):
            known, count = text[:first], 0
        for _, call, end, closed in _blocks(text[first:], len(known) - first):
            if call is None or not closed:
                break
            count, known = count + 1, text[: first + end]
        self.counted = known, count, first
        return count


PROMPT_TAIL_TOKENS = 32  # a template that opens the reasoning does so at the prompt's end


def _blocks(reply: str, position: int = 0) -> Iterator[tuple[int, ToolCall | None, int, bool]]:
    """Each ``<tool_call>`` block of ``reply`` from ``position``, in order: where its tag starts, its call (None:
    the block is text), where it ends, and whether it is closed (its closing tag came). The JSON is read whole, so a
    tag inside one of its strings is text; the next block is looked for after a call, or after the tag of a block
    that is none."""
    start = reply.find(OPEN, position)
    while start >= 0:
        call, end, closed = None, start + len(OPEN), False
        try:
            value, after = DECODER.raw_decode(reply, _skip_space(reply, end))
        except (ValueError, RecursionError):
            value, after = None, end
        after = _skip_space(reply, after)
        if (read := _call(value, needs_arguments=False)) is not None and (
                after == len(reply) or reply.startswith(CLOSE, after)):
            closed = after < len(reply)
            call, end = read, after + len(CLOSE) * closed
        yield start, call, end, closed
        start = reply.find(OPEN, end)


def _after_reasoning(text: str, opened_in_prompt: bool | None = None) -> int | None:
    """Where hermes looks for calls: after the first ``</think>`` outside a call's JSON where the reply reasons (the
    prompt or the reply opened a ``<think>`` block; it ends there, as vLLM's reasoning parsers end it), else from
    the start; None while the reply reasons still. Where the prompt's part is not known (``opened_in_prompt``
    None), a ``</think>`` after calls in a reply that did not open a block ends one too. More text never moves a
    ``</think>`` found under calls that stream: only a call's JSON that does not parse yet may come to hold it (in
    a string), and no whole call can stand within such JSON (its quotes would end the string)."""
    lead = text.lstrip()
    if not opened_in_prompt and THINK_START.startswith(lead) and lead:  # "<t...": a call's tag or reasoning
        return None
    reasons = opened_in_prompt or lead.startswith(THINK_START)
    if opened_in_prompt is False and not reasons:
        return 0
    position = 0
    while (close := text.find(THINK_END, position)) >= 0:
        call = text.find(OPEN, position, close)
        if call < 0:
            return close + len(THINK_END)
        try:  # a </think> inside the JSON of a call is text
            _, position = DECODER.raw_decode(text, _skip_space(text, call + len(OPEN)))
        except (ValueError, RecursionError):
            position = call + len(OPEN)
    return None if reasons else 0


class MistralToolParser(ToolParser):
    """The content, then ``[TOOL_CALLS]`` and the calls: a JSON list of ``{"name": ..., "arguments": {...}}``
    (mistral-common's tokenizers up to v7), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 on; a
    ``[CALL_ID]id`` may come before ``[ARGS]``). In the list, anything after the calls, or a call that does not
    parse, leaves the whole reply as text; of the segments, one that is no call is text of the content (after the
    text before the calls), the others calls. Each call's id is the model's own where it wrote one of 9 letters
    and digits, else a new one of that form: Mistral's templates refuse any other in the next turn (as vLLM does,
    its issue 9019). The content streams up to the first tag; the segments' calls each once the next
    ``[TOOL_CALLS]`` begins, up to the first segment that is no call yet. ``written_tags`` as for hermes:
    Mistral's tokenizers mark the three tags special."""

    def __init__(self, written_tags: Mapping[int, str] | None = None) -> None:
        self.written_tags = dict(written_tags or {})

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        content, tag, rest = text.partition(TOOL_CALLS)
        if not tag:
            return ParsedReply(text)
        if rest.lstrip().startswith("["):
            calls, unread = _mistral_list(rest), ""
        else:
            segments = list(_mistral_segments(rest))
            calls = tuple(call for _, call, _ in segments if call is not None)
            unread = "".join(TOOL_CALLS + segment for segment, call, _ in segments if call is None)
        return ParsedReply(content.rstrip() + unread, calls) if calls else ParsedReply(text)

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        return _content_before(text, TOOL_CALLS)

    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        _, tag, rest = text.partition(TOOL_CALLS)
        if not tag or rest.lstrip().startswith("["):  # the list is read whole
            return 0
        closed = itertools.takewhile(lambda segment: segment[1] is not None and segment[2], _mistral_segments(rest))
        return sum(1 for _ in closed)  # not past a segment that is no call yet: its JSON may come to hold the next


def _mistral_list(rest: str) -> tuple[ToolCall, ...]:
    """The calls of ``[{...}, ...]`` followed by nothing but space; () for anything else."""
    try:
        value, end = DECODER.raw_decode(rest, _skip_space(rest, 0))
    except (ValueError, RecursionError):
        return ()
    if not isinstance(value, list) or not value or rest[end:].strip():
        return ()
    calls = [_call(item, needs_arguments=False) for item in value]
    if any(call is None for call in calls):
        return ()
    return tuple(replace(call, id=_mistral_id(item.get("id"))) for call, item in zip(calls, value))  # type: ignore


def _mistral_segments(rest: str) -> Iterator[tuple[str, ToolCall | None, bool]]:
    """The segments of ``rest`` (what follows a reply's first ``[TOOL_CALLS]``), each the text up to the next tag:
    its text, its call (None: text), and whether a tag follows it. A call's JSON is read whole, so a tag in one of
    its strings is text; a segment that is no call ends at the next tag."""
    position = 0
    while True:
        call, end = _mistral_call(rest, position)
        if call is None:
            end = rest.find(TOOL_CALLS, position)
            end = len(rest) if end < 0 else end
        yield rest[position:end], call, end < len(rest)
        if end == len(rest):
            return
        position = end + len(TOOL_CALLS)


def _mistral_call(rest: str, start: int) -> tuple[ToolCall | None, int]:
    """The call ``name[CALL_ID]id[ARGS]{...}`` at ``start``, followed by space and then the next ``[TOOL_CALLS]``
    or the end, and where it ends; (None, start) for anything else."""
    args, tag = rest.find(ARGS, start), rest.find(TOOL_CALLS, start)
    if args < 0 or 0 <= tag < args:
        return None, start
    name, _, own_id = (part.strip() for part in rest[start:args].partition(CALL_ID))
    if not FUNCTION_NAME.fullmatch(name):
        return None, start
    try:
        value, end = DECODER.raw_decode(rest, _skip_space(rest, args + len(ARGS)))
    except (ValueError, RecursionError):
        return None, start
    end = _skip_space(rest, end)
    if not isinstance(value, Mapping) or not (end == len(rest) or rest.startswith(TOOL_CALLS, end)) or (
            call := _json_call(name, value)) is None:
        return None, start
    return replace(call, id=_mistral_id(own_id)), end


def _mistral_id(own: object) -> str:
    """The model's call id where it is 9 letters and digits (what Mistral's templates and mistral-common accept),
    else a new one."""
    if isinstance(own, str) and MISTRAL_CALL_ID.fullmatch(own):
        return own
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class Llama3JsonToolParser(ToolParser):
    """A reply that is one or more ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is read too),
    separated by ``;`` and optionally led by ``<|python_tag|>``: every call, and no content. An object without
    parameters or arguments is a JSON answer, not a call."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not rest.startswith("{"):
            return ParsedReply(text)
        calls = []
        while rest:
            try:
                value, end = DECODER.raw_decode(rest)
            except (ValueError, RecursionError):
                return ParsedReply(text)
            if (call := _call(value, needs_arguments=True)) is None:
                return ParsedReply(text)
            calls.append(call)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        return ParsedReply("", tuple(calls))

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        return _all_unless_led_by(text, PYTHON_TAG, "{")


def _content_before(text: str, marker: str, start: int = 0) -> int:
    """The end of a reply's content that streams where ``marker`` begins its calls: before the first marker from
    ``start``, or a start of one at the end of ``text``, and before the space in front of it (dropped where calls
    follow)."""
    end = text.find(marker, start)
    end = len(text) - marker_start(text, marker) if end < 0 else end
    while end and text[end - 1].isspace():
        end -= 1
    return end


def _all_unless_led_by(text: str, tag: str, opening: str) -> int:
    """For a reply that is all calls or all content, the calls led by ``opening`` (after space, and an optional
    ``tag``): all of ``text`` once its start shows it cannot be calls, else none of it."""
    lead = text.lstrip()
    if tag.startswith(lead):  # nothing but space yet, or a start of the tag
        return 0
    after = lead.removeprefix(tag).lstrip()
    return 0 if not after or after.startswith(opening) else len(text)


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index].isspace():
        index += 1
    return index


def _call(value: Any, needs_arguments: bool) -> ToolCall | None:
    """A call from ``{"name": str, "arguments" or "parameters": mapping, its JSON text, or null}``; None for
    anything else."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if needs_arguments and "arguments" not in value and "parameters" not in value:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = DECODER.decode(arguments)
        except (ValueError, RecursionError):
            return None
    arguments = {} if arguments is None else arguments
    return _json_call(value["name"], arguments) if isinstance(arguments, Mapping) else None


def _json_call(name: str, arguments: Mapping[str, Any]) -> ToolCall | None:
    """The call if its arguments are what the engine accepts of a parser (JSON-like: string keys, no NaN, UTF-8,
    nesting within MAX_JSON_DEPTH), as a JSON copy (tuples become lists); None otherwise."""
    try:
        return ToolCall(name, json_like(dict(arguments), "arguments"))
    except InvalidRequestError:
        return None


def special_tags(tokenizer: Any, tags: Sequence[str]) -> dict[int, str]:
    """The ids of those of ``tags`` that ``tokenizer`` marks special (its decode leaves them out of the text)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    return {tokenizer.convert_tokens_to_ids(tag): tag for tag in tags if tag in special}


def hermes_parser(config: EngineConfig, tokenizer: Any) -> ToolParser:
    """The hermes parser for ``tokenizer``: the engine writes out the tags it marks special, and it reads whether
    a prompt opened a reasoning block out of the prompt's decoded end, decoded as the reply's text is (special
    tokens left out: where the tokenizer marks <think> special, no reply's text shows its </think> either)."""
    def prompt_tail(token_ids: Sequence[int]) -> str:
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)

    return HermesToolParser(special_tags(tokenizer, (OPEN, CLOSE)), prompt_tail)


def mistral_parser(config: EngineConfig, tokenizer: Any) -> ToolParser:
    return MistralToolParser(special_tags(tokenizer, (TOOL_CALLS, ARGS, CALL_ID)))


@hookimpl
def register_tool_parsers(register: Register[Any]) -> None:
    def llama3_json(config: EngineConfig, tokenizer: Any) -> ToolParser:
        return Llama3JsonToolParser()

    def pythonic(config: EngineConfig, tokenizer: Any) -> ToolParser:
        return PythonicToolParser()

    register("hermes", hermes_parser, aliases=("qwen",))
    register("llama3-json", llama3_json)
    register("pythonic", pythonic)
    register("mistral", mistral_parser)
