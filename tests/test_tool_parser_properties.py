"""Properties of the shipped tool parsers over generated replies: calls written in a format come back equal,
with the text around them as the content; any other text comes back whole (a parser never loses text, never
raises); and chat input of any shape is refused with InvalidRequestError, nothing else."""
from __future__ import annotations

import json
import keyword
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer import ChatPrompt, InvalidRequestError, ToolCall
from infer.core.chat_tools import ParsedReply
from infer.plugins.tool_parsers import (ARGS, CLOSE, OPEN, PYTHON_START, PYTHON_TAG, TOOL_CALLS, HermesToolParser,
                                        Llama3JsonToolParser, MistralToolParser, PythonicToolParser)

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False,
                                                                              width=32) | st.text(max_size=12)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                             max_size=3), max_leaves=8)
CALLS = st.builds(ToolCall, NAMES, st.dictionaries(NAMES, VALUES, max_size=4))
IDENTIFIERS = NAMES.filter(lambda name: not keyword.iskeyword(name))  # `in(...)`, `f(if=1)` are not Python
PYTHON_CALLS = st.builds(ToolCall, IDENTIFIERS, st.dictionaries(IDENTIFIERS, VALUES, max_size=4))
PROSE = st.text(st.characters(blacklist_characters="<[{"), max_size=40)  # text that starts no call
PARSERS = (HermesToolParser(), HermesToolParser(opened_in_prompt=True), HermesToolParser(opened_in_prompt=False),
           Llama3JsonToolParser(), PythonicToolParser(), MistralToolParser())


def roundtrip(call: ToolCall) -> ToolCall:
    """The call as JSON carries it (a float as JSON writes and reads it)."""
    return ToolCall(call.name, json.loads(json.dumps(call.arguments)))


@settings(max_examples=150, deadline=None)
@given(st.lists(CALLS, min_size=1, max_size=3), PROSE, st.sampled_from(["", "\n", "\n\n"]))
def test_hermes_calls_come_back_with_the_text_before_them(calls: list[ToolCall], prose: str, gap: str) -> None:
    text = prose + gap + "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}"
                                   for c in calls)
    assert HermesToolParser().parse(text, []) == ParsedReply(prose.rstrip(), tuple(map(roundtrip, calls)))


@settings(max_examples=150, deadline=None)
@given(st.lists(CALLS, min_size=1, max_size=3), st.sampled_from(["; ", ";", "\n", " ; "]))
def test_llama3_json_calls_come_back(calls: list[ToolCall], separator: str) -> None:
    text = separator.join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)
    assert Llama3JsonToolParser().parse(text, []) == ParsedReply("", tuple(map(roundtrip, calls)))


@settings(max_examples=150, deadline=None)
@given(st.lists(PYTHON_CALLS, min_size=1, max_size=3))
def test_pythonic_calls_come_back(calls: list[ToolCall]) -> None:
    text = "[" + ", ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls) + "]"
    assert PythonicToolParser().parse(text, []) == ParsedReply("", tuple(calls))


@settings(max_examples=150, deadline=None)
@given(st.lists(CALLS, min_size=1, max_size=3), PROSE, st.booleans())
def test_mistral_calls_come_back_after_the_content(calls: list[ToolCall], prose: str, tagged: bool) -> None:
    if tagged:  # mistral-common's tokenizer v11 on
        text = prose + "".join(f"{TOOL_CALLS}{c.name}{ARGS}{json.dumps(c.arguments)}" for c in calls)
    else:
        text = prose + TOOL_CALLS + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
    read = MistralToolParser().parse(text, [])
    assert ParsedReply(read.content, tuple(replace(call, id=None) for call in read.tool_calls)) == \
        ParsedReply(prose.rstrip(), tuple(map(roundtrip, calls)))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | st.builds(lambda a, tag, b: a + tag + b, st.text(max_size=30),
                                        st.sampled_from([OPEN, TOOL_CALLS, ARGS]), st.text(max_size=30)))
def test_any_other_text_comes_back_whole(text: str) -> None:
    for parser in PARSERS:
        reply = parser.parse(text, [])
        assert isinstance(reply, ParsedReply)
        if not reply.tool_calls:
            assert reply.content == text
        else:  # a call read out of random text must stand in it: its name written there, its text taken out
            assert all(call.name in text for call in reply.tool_calls), (parser, text, reply)
            assert len(reply.content or "") < len(text), (parser, text, reply)


def written(calls: list[ToolCall], form: str) -> str:
    """``calls`` as a reply in one of the shipped formats."""
    if form == "hermes":
        return "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}" for c in calls)
    if form == "mistral":
        return TOOL_CALLS + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
    if form == "llama3-json":
        return PYTHON_TAG + "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)
    return "[" + ", ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls) + "]"


SPACE = st.sampled_from(["", " ", "\n", "\n\n "])
REPLIES = st.one_of(  # calls after text, text after calls, calls alone, a tag named while reasoning, any text
    st.builds(lambda a, gap, calls, form, b: a + gap + written(calls, form) + b, PROSE | SPACE, SPACE,
              st.lists(PYTHON_CALLS, min_size=1, max_size=2), st.sampled_from(["hermes", "mistral", "llama3-json",
                                                                                "pythonic"]), SPACE | PROSE),
    st.builds(lambda a, calls: f"<think>{a} {OPEN}</think>\n" + written(calls, "hermes"), PROSE,
              st.lists(CALLS, min_size=1, max_size=2)),
    st.text(max_size=60),
    st.builds(lambda a, tag, b: a + tag + b, st.text(max_size=20), st.sampled_from([OPEN, TOOL_CALLS, PYTHON_TAG,
                                                                                      "[", "{", " ["]),
              st.text(max_size=20)))


@settings(max_examples=400, deadline=None)
@given(REPLIES, st.lists(st.integers(0, 400), max_size=12))
def test_the_content_that_streams_begins_the_content_read_and_holds_back_no_more_than_calls(
        text: str, cuts: list[int]) -> None:
    """At any cut of a reply, the content that streams (``streamed_content``) grows, and is a start of the content
    that ``parse`` reads out of the whole reply; what it holds back is where a call may begin: a tag's start (with
    the space before it) or more after a tag (hermes, mistral), a reply whose start may still be a call
    (llama3-json, pythonic)."""
    for parser in PARSERS:
        content, sent = parser.parse(text, []).content, 0
        for cut in [*sorted({min(c, len(text)) for c in cuts}), len(text)]:
            reply = text[:cut]
            n = parser.streamed_content(reply, [])
            assert sent <= n <= cut and content.startswith(reply[:n]), (parser, text, cut, n)
            held, sent = reply[n:].lstrip(), n
            if isinstance(parser, (HermesToolParser, MistralToolParser)):
                marker = OPEN if isinstance(parser, HermesToolParser) else TOOL_CALLS
                assert held.startswith(marker) or marker.startswith(held), (parser, reply, n)
            else:
                start = reply.lstrip().removeprefix(PYTHON_TAG if isinstance(parser, Llama3JsonToolParser) else
                                                    PYTHON_START).lstrip()
                assert n == cut or not start or start[0] in "[{" or PYTHON_START.startswith(held) or \
                    PYTHON_TAG.startswith(held), (parser, reply, n)


def test_hermes_streams_past_a_tag_named_while_reasoning() -> None:
    """A reply that opens with <think> streams whole while it reasons: a tag named there is text (parse reads it
    so); a tag in a reply that did not open one holds the stream back until a </think> shows it was reasoning."""
    reply = ("<think>I must answer in a <tool_call> block. Oslo.</think>\n\nChecking the weather now.\n<tool_call>"
             '{"name": "now", "arguments": {}}</tool_call>')
    content = HermesToolParser().parse(reply, []).content
    assert content == reply[: reply.index("now.") + 4]
    cuts = [HermesToolParser().streamed_content(reply[:cut], []) for cut in range(len(reply) + 1)]
    # "<" and "<t" may begin "<tool_call>": held; from "<th" on, reasoning: all of it streams
    assert cuts[: reply.index("</think>") + 8] == [0, 0, 0, *range(3, reply.index("</think>") + 8)]
    assert max(cuts) == len(content)
    opened_by_the_prompt = reply.removeprefix("<think>")  # DeepSeek-R1's template opens the block in the prompt
    cuts = [HermesToolParser().streamed_content(opened_by_the_prompt[:cut], [])
            for cut in range(len(opened_by_the_prompt) + 1)]
    assert cuts[opened_by_the_prompt.index("</think>") + 7] == opened_by_the_prompt.index(" <tool_call>")  # held
    assert cuts[opened_by_the_prompt.index("</think>") + 8] == opened_by_the_prompt.index("</think>") + 8
    assert HermesToolParser().parse(opened_by_the_prompt, []) == ParsedReply(content.removeprefix("<think>"), (
        ToolCall("now", {}),))


JSONISH = st.recursive(SCALARS | st.binary(max_size=3), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8) | st.integers(0, 3), inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(JSONISH | st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])},
                                                optional={"content": JSONISH, "tool_calls": JSONISH,
                                                          "tool_call_id": JSONISH, "name": JSONISH}), max_size=3),
       JSONISH)
def test_chat_input_of_any_shape_is_taken_or_refused_with_invalid_request_error(messages: Any, tools: Any) -> None:
    try:
        prompt = ChatPrompt.of(messages, tools=tools)
    except InvalidRequestError:
        return
    assert prompt.checked() == prompt and isinstance(prompt.text_length(), int)


OPENED_REPLIES = st.builds(  # the prompt opened the reasoning: calls named in it, calls after it
    lambda a, named, gap, calls, b: a + written(named, "hermes") + b + "</think>" + gap + written(calls, "hermes"),
    PROSE, st.lists(CALLS, max_size=2), SPACE, st.lists(CALLS, min_size=1, max_size=2), PROSE)


@settings(max_examples=400, deadline=None)
@given(REPLIES | OPENED_REPLIES, st.lists(st.integers(0, 400), max_size=12), st.booleans())
def test_the_calls_that_stream_begin_the_calls_read(text: str, cuts: list[int], opened: bool) -> None:
    """At any cut of a reply, the calls hermes streams (``streamed_calls``) grow, and begin the calls that ``parse``
    reads out of the whole reply; once the reply is whole, every call whose closing tag came streams (the text
    after the last one is none of a call's)."""
    parser = HermesToolParser(opened_in_prompt=opened)
    calls, sent = parser.parse(text, []).tool_calls, 0
    ordered = [*sorted({min(c, len(text)) for c in cuts}), len(text)]
    for cut in ordered:
        reply = text[:cut]
        n = parser.streamed_calls(reply, [])
        assert sent <= n <= len(calls) and parser.parse(reply, []).tool_calls[:n] == calls[:n], (text, cut, n)
        sent = n
    if text.rstrip().endswith(CLOSE) and calls:
        assert sent == len(calls), (text, sent)
    for cut in [*ordered[::-1], *cuts]:  # in any order (the n replies of a request share their parser): as anew
        assert parser.streamed_calls(text[:cut], []) == HermesToolParser(opened_in_prompt=opened).streamed_calls(
            text[:cut], []), (text, cut)


def test_a_think_tag_inside_a_call_named_while_reasoning_never_streams_a_call() -> None:
    """The prompt opened the reasoning, and a call named in it has a </think> in a string: until that JSON is whole,
    the tag reads as the reasoning's end, yet at no cut does a call stream that the whole reply does not begin
    with."""
    text = ('Try <tool_call>{"name": "say", "arguments": {"a": "</think><tool_call>", "b": "x"}}</tool_call> then'
            '</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    parser = HermesToolParser(opened_in_prompt=True)
    assert parser.parse(text, []).tool_calls == (ToolCall("now", {}),)
    streamed = [parser.streamed_calls(text[:cut], []) for cut in range(len(text) + 1)]
    assert max(streamed[: text.index("then")]) == 0 and streamed[-1] == 1


TAGGED = st.builds(lambda a, calls, b, c: (a + "".join(f"{TOOL_CALLS}{call.name}{ARGS}{json.dumps(call.arguments)}"
                                                  for call in calls) + b + c, len(calls) - (not b and not c)),
                   PROSE, st.lists(CALLS, min_size=1, max_size=3),
                   st.sampled_from(["", f"{TOOL_CALLS}oops", f"{TOOL_CALLS}x{ARGS}["]),
                   st.sampled_from(["", f"{TOOL_CALLS}now{ARGS}{{}}"]))  # (reply, the calls that stream before it ends)


@settings(max_examples=300, deadline=None)
@given(REPLIES | TAGGED.map(lambda built: built[0]), st.lists(st.integers(0, 400), max_size=12))
def test_the_mistral_calls_that_stream_begin_the_calls_read(text: str, cuts: list[int]) -> None:
    """mistral's streamed calls, at any cut, grow and begin the calls of the whole reply (names and arguments: ids
    it makes up anew each time)."""
    parser = MistralToolParser()
    calls, sent = [(c.name, c.arguments) for c in parser.parse(text, []).tool_calls], 0
    for cut in [*sorted({min(c, len(text)) for c in cuts}), len(text)]:
        n = parser.streamed_calls(text[:cut], [])
        read = [(c.name, c.arguments) for c in parser.parse(text[:cut], []).tool_calls]
        assert sent <= n <= len(calls) and read[:n] == calls[:n], (text, cut, n)
        sent = n


@settings(max_examples=100, deadline=None)
@given(TAGGED)
def test_mistral_streams_each_tagged_call_once_the_next_tag_begins(built: tuple[str, int]) -> None:
    """Before the reply ends, every call a tag follows has streamed, up to a segment that is no call."""
    text, streams = built
    assert MistralToolParser().streamed_calls(text, []) == streams


def test_a_tag_inside_a_mistral_calls_string_never_streams_a_call() -> None:
    """A tag in a call's JSON string is text; until that JSON is whole, what follows the tag reads as a segment of
    its own (here a call, as mistral's need no quotes), yet no cut streams it."""
    text = f'{TOOL_CALLS}say{ARGS}{{"text": "{TOOL_CALLS}now{ARGS}{{}}{TOOL_CALLS}x"}}{TOOL_CALLS}now{ARGS}{{}}'
    parser = MistralToolParser()
    assert [(c.name, c.arguments) for c in parser.parse(text, []).tool_calls] == [
        ("say", {"text": f"{TOOL_CALLS}now{ARGS}{{}}{TOOL_CALLS}x"}), ("now", {})]
    streamed = [parser.streamed_calls(text[:cut], []) for cut in range(len(text) + 1)]
    assert max(streamed[: text.index('x"}') + 3]) == 0 and streamed[-1] == 1


EVERY_CUT = [  # replies read at every cut: tags that begin at a reply's start, a tag in a call's string, JSON whole
    # before text that makes it no call
    '<|python_tag|>{"name": "now", "parameters": {}}',
    ' <|python_start|>[now(), weather(city="Oslo")]<|python_end|>',
    'Hi.\n<tool_call>{"name": "say", "arguments": {"text": "wrap it in <tool_call>"}}</tool_call>\n<tool_call>'
    '{"name": "now", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "now", "arguments": {}} and then</tool_call> Done.',
    'plan</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    '[TOOL_CALLS]say[ARGS]{"text": "[TOOL_CALLS]"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{} [TOOL_CALLS]x',
    'Hi [TOOL_CALLS][{"name": "now", "arguments": {}}]',
]


@pytest.mark.parametrize("text", EVERY_CUT)
def test_every_cut_of_a_reply_streams_a_start_of_its_content_and_of_its_calls(text: str) -> None:
    """The contract of streamed_content and streamed_calls checked at every cut (not a random few): what streams
    grows, and begins the content and the calls (names and arguments) that parse reads out of the whole reply."""
    for parser in PARSERS:
        read = parser.parse(text, [])
        calls, sent, streamed = [(c.name, c.arguments) for c in read.tool_calls], 0, 0
        for cut in range(len(text) + 1):
            reply = text[:cut]
            n, count = parser.streamed_content(reply, []), parser.streamed_calls(reply, [])
            assert sent <= n <= cut and read.content.startswith(reply[:n]), (parser, reply, n)
            so_far = [(c.name, c.arguments) for c in parser.parse(reply, []).tool_calls]
            assert streamed <= count <= len(so_far) and so_far[:count] == calls[:count], (parser, reply, count)
            sent, streamed = n, count


@pytest.mark.parametrize("reasoning, opened", [("", False), ("plan</think>\n", True)])
def test_hermes_streams_each_call_once_closed_though_an_earlier_one_names_a_tag(reasoning: str, opened: bool
                                                                                ) -> None:
    """A call whose string names <tool_call>: at every cut, a parser new to the reply streams every call whose
    closing tag is out (the reference: where the two calls' closing tags end)."""
    text = (reasoning + 'Hi.\n<tool_call>{"name": "say", "arguments": {"text": "wrap it in <tool_call>"}}</tool_call>'
            '\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    ends = [text.index("}}</tool_call>") + 2 + len(CLOSE), len(text)]
    for cut in range(len(text) + 1):
        assert HermesToolParser(opened_in_prompt=opened).streamed_calls(text[:cut], []) == sum(
            cut >= end for end in ends), cut
