"""Tool parsers: the shipped formats read calls out of replies as the models write them (the formats as their
chat templates ask for them), a reply they cannot read stays whole, and the engine gives every reply of a chat that
offered tools to the parser, into the last output of each sequence, over gRPC and the CLI too."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from infer import ChatPrompt, PluginError, SamplingParams, ToolCall, hookimpl
from infer.core.errors import UnknownComponentError
from infer.cli import main
from infer.core.chat_tools import ParsedReply
from infer.core.interfaces import ToolParser
from infer.core.llm import LLM
from infer.plugins.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser

WEATHER = ToolCall("weather", {"city": "Oslo", "days": [1, 2]})
NOW = ToolCall("now", {})


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Sunny.", "Sunny.", ()),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>', "", (WEATHER,)),
    ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Let me look.", (WEATHER, NOW)),
    ('<think>Oslo.</think>\n\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>', "<think>Oslo.</think>",
     (NOW,)),  # Qwen3 thinks first; arguments as OpenAI's JSON text
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nAnything else?', "Anything else?", (NOW,)),
    ('<tool_call>\n{"name": "now", "arguments": {}}', "", (NOW,)),  # cut by max_tokens after whole JSON
    ('<tool_call>\n{"name": "now", "argum', '<tool_call>\n{"name": "now", "argum', ()),  # cut inside it
    # a block that is no call is text of the content, the calls around it calls (streamed calls stand)
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
     '<tool_call>{oops}</tool_call>', (NOW,)),
    ('A.<tool_call>{"name": 7}</tool_call> B.\n<tool_call>{"name": "now"}</tool_call>',
     'A.<tool_call>{"name": 7}</tool_call> B.', (NOW,)),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', ()),
    # an empty name is none: a call needs one (the engine refuses a parser's call without it)
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '<tool_call>{"name": "", "arguments": {}}</tool_call>',
     ()),
    ('<tool_call>{"name": "now", "arguments": [1]}</tool_call>', '<tool_call>{"name": "now", "arguments": [1]}'
     '</tool_call>', ()),
    ('<tool_call>{"name": "say", "arguments": {"text": "wrap it in <tool_call> and </tool_call>"}}</tool_call>', "",
     (ToolCall("say", {"text": "wrap it in <tool_call> and </tool_call>"}),)),  # tags inside a JSON string
    ("<think>I will emit a <tool_call> now.</think>\n\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n"
     "</tool_call>", "<think>I will emit a <tool_call> now.</think>", (NOW,)),  # a tag named while reasoning
    # the reasoning ends at its first </think> outside a call's JSON, as vLLM's reasoning parsers end it: one in an
    # argument or after the calls dropped every call (the last </think> was taken for the reasoning's end)
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "say", "arguments": {"text": '
     '"<p></think></p>"}}</tool_call>', "", (NOW, ToolCall("say", {"text": "<p></think></p>"}))),
    ('<think>Hm.</think><tool_call>{"name": "say", "arguments": {"text": "</think>"}}</tool_call>', "<think>Hm.</think>",
     (ToolCall("say", {"text": "</think>"}),)),
    # cut while reasoning: a call named there is not one (it was taken out of the reasoning as a call)
    ('<think>I could call <tool_call>{"name": "now", "arguments": {}}</tool_call> but', '<think>I could call '
     '<tool_call>{"name": "now", "arguments": {}}</tool_call> but', ()),
    # the prompt opened the reasoning (DeepSeek-R1): a call named before its </think> is not one
    ('I could call <tool_call>{"name": "say", "arguments": {}}</tool_call>.</think>\n<tool_call>{"name": "now", '
     '"arguments": {}}</tool_call>', 'I could call <tool_call>{"name": "say", "arguments": {}}</tool_call>.</think>',
     (NOW,)),
    ('<tool_call>{"name": "now", "arguments": null}</tool_call>', "", (NOW,)),
    ('<tool_call>{"name": "now"}</tool_call>', "", (NOW,)),
    # the text between calls is kept as written, but a stretch of only whitespace is dropped (a template's newlines)
    ('Hi.<tool_call>{"name": "now"}</tool_call>\n<tool_call>{"name": "now"}</tool_call> Bye.', "Hi. Bye.",
     (NOW, NOW)),
    ('Hi.<tool_call>{"name": "now"}</tool_call> and <tool_call>{"name": "now"}</tool_call>\n', "Hi. and",
     (NOW, NOW)),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', '<tool_call>{"name": "f", "arguments": '
     '{"x": NaN}}</tool_call>', ()),  # not JSON, though json.loads takes it
    ('<tool_call>{"name": "now", "arguments": {}} trailing</tool_call>', '<tool_call>{"name": "now", "arguments": '
     '{}} trailing</tool_call>', ()),
    (f'<tool_call>{{"name": "f", "arguments": {{"x": {"[" * 70}{"]" * 70}}}}}</tool_call>',
     f'<tool_call>{{"name": "f", "arguments": {{"x": {"[" * 70}{"]" * 70}}}}}</tool_call>', ()),  # too deep
])
def test_hermes_reads_qwen_and_hermes_replies(text: str, content: str, calls: tuple[ToolCall, ...]) -> None:
    assert HermesToolParser().parse(text, []) == ParsedReply(content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "weather", "parameters": {"city": "Oslo", "days": [1, 2]}}', "", (WEATHER,)),
    ('<|python_tag|>{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}; {"name": "now", '
     '"parameters": {}}', "", (WEATHER, NOW)),
    (' {"name": "now", "parameters": {"note": "a; b"}} ', "", (ToolCall("now", {"note": "a; b"}),)),
    ("It is sunny in Oslo.", "It is sunny in Oslo.", ()),
    ('{"name": "now", "parameters": {}} and more', '{"name": "now", "parameters": {}} and more', ()),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', ()),
    ('{"name": "now", "parameters": {', '{"name": "now", "parameters": {', ()),
    ('{"name": "Bob", "age": 42}', '{"name": "Bob", "age": 42}', ()),  # a JSON answer, not a call
    ('{"name": "now", "parameters": null}', "", (NOW,)),
    ('{"name": "", "parameters": {}}', '{"name": "", "parameters": {}}', ()),  # no name: no call
])
def test_llama3_json_reads_llama_replies(text: str, content: str, calls: tuple[ToolCall, ...]) -> None:
    assert Llama3JsonToolParser().parse(text, []) == ParsedReply(content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("[get_user_info(user_id=7890, special='black')]", "", (ToolCall("get_user_info", {"user_id": 7890,
                                                                                       "special": "black"}),)),
    ('[weather(city="Oslo", days=[1, 2]), now()]', "", (WEATHER, NOW)),
    ("<|python_start|>[now()]<|python_end|>", "", (NOW,)),  # Llama 4's markers, when the text keeps them
    ('[f(a={"b": None, "c": (1, 2)}, d=True)]', "", (ToolCall("f", {"a": {"b": None, "c": [1, 2]}, "d": True}),)),
    ("[citation needed]", "[citation needed]", ()),
    ("The answer is [now()]", "The answer is [now()]", ()),
    ("[1, 2]", "[1, 2]", ()),
    ("[f(1)]", "[f(1)]", ()),  # positional: no parameter name
    ("[f(x={1, 2})]", "[f(x={1, 2})]", ()),  # a set: not JSON
    ("[f(x=1e999)]", "[f(x=1e999)]", ()),  # infinity: not JSON
    ("[f(x={1: 'a', '1': 'b'})]", "[f(x={1: 'a', '1': 'b'})]", ()),  # JSON keys are strings: these would merge
    ("[f(x='\\udcff')]", "[f(x='\\udcff')]", ()),  # a lone surrogate: not UTF-8
    ("[f(x=g())]", "[f(x=g())]", ()),  # an expression: never run
    ("[f(**k)]", "[f(**k)]", ()),
    ("[a.b(x=1)]", "[a.b(x=1)]", ()),
    ("[]", "[]", ()),
    # a comment is text of the reply: it stays, and the reply is no list of calls alone (a parser never drops text)
    ("[now()]  # done", "[now()]  # done", ()),
    ("# plan\n[now()]", "# plan\n[now()]", ()),
])
def test_pythonic_reads_llama_3_2_and_4_replies_without_running_them(text: str, content: str,
                                                                     calls: tuple[ToolCall, ...]) -> None:
    assert PythonicToolParser().parse(text, []) == ParsedReply(content, calls)


# the replies as mistral-common encodes an assistant message's calls: a JSON list after [TOOL_CALLS] (its tokenizers
# v3 and v7; v7 and later put the content first), one [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} per call (v11),
# [TOOL_CALLS]name[ARGS]{...} (v13)
@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}]', "", (WEATHER,)),
    ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}, "id": "a1b2c3d4e"}, '
     '{"name": "now", "arguments": {}, "id": "f5g6h7i8j"}]', "", (WEATHER, NOW)),
    ('Let me check.[TOOL_CALLS][{"name": "now", "arguments": {}}]', "Let me check.", (NOW,)),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo", "days": [1, 2]}[TOOL_CALLS]now[ARGS]{}', "", (WEATHER, NOW)),
    ('Checking.[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo", "days": [1, 2]}', "Checking.",
     (WEATHER,)),
    ("It is sunny.", "It is sunny.", ()),
    ('[TOOL_CALLS]now[ARGS]{"a": 1} and more', '[TOOL_CALLS]now[ARGS]{"a": 1} and more', ()),
    # a segment that is no call is text of the content, the calls around it calls (streamed calls stand)
    ('[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]oops[TOOL_CALLS]weather[ARGS]{"city": "Oslo", "days": [1, 2]}',
     "[TOOL_CALLS]oops", (NOW, WEATHER)),
    ('Hi. [TOOL_CALLS]now[ARGS]{"a": 1} x[TOOL_CALLS]now[ARGS]{}', 'Hi.[TOOL_CALLS]now[ARGS]{"a": 1} x', (NOW,)),
    ('[TOOL_CALLS]now[ARGS]{"a": ', '[TOOL_CALLS]now[ARGS]{"a": ', ()),  # cut by max_tokens
    ('[TOOL_CALLS]now{"a": 1}', '[TOOL_CALLS]now{"a": 1}', ()),  # no [ARGS]
    ('[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]get weather[ARGS]{}', ()),  # not a function name
    ('[TOOL_CALLS]now[ARGS][1]', '[TOOL_CALLS]now[ARGS][1]', ()),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}] done', '[TOOL_CALLS][{"name": "now", "arguments": {}}] done', ()),
    ('[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', ()),
    ('[TOOL_CALLS][{"name": "", "arguments": {}}]', '[TOOL_CALLS][{"name": "", "arguments": {}}]', ()),
    ('[TOOL_CALLS][]', "[TOOL_CALLS][]", ()),
    ('[TOOL_CALLS][{"name": "now", "arguments": "{}"}]', "", (NOW,)),  # arguments as their JSON text
    # space after a segment's JSON, before the next tag or the end: the call's still (the model's "\n" at the end)
    ('[TOOL_CALLS]now[ARGS]{} \n', "", (NOW,)),
    ('[TOOL_CALLS]now[ARGS]{}\n[TOOL_CALLS]weather[ARGS]{"city": "Oslo", "days": [1, 2]}', "", (NOW, WEATHER)),
])
def test_mistral_reads_both_of_mistral_commons_encodings(text: str, content: str, calls: tuple[ToolCall, ...]
                                                         ) -> None:
    reply = MistralToolParser().parse(text, [])
    assert ParsedReply(reply.content, tuple(replace(call, id=None) for call in reply.tool_calls)) == \
        ParsedReply(content, calls)
    # ids of 9 letters and digits, the model's own where it wrote one: Mistral's templates refuse any other
    assert all(re.fullmatch("[A-Za-z0-9]{9}", call.id or "") for call in reply.tool_calls)
    own = re.findall(r'"id": "(\w+)"|\[CALL_ID\](\w+)', text)
    assert [a or b for a, b in own] == [call.id for call in reply.tool_calls][: len(own)]


@pytest.mark.parametrize("own", ["a1b2c3d4e5", "abc_12345", "\u03b1\u03b2\u03b3\u03b4\u03b5\u03b6\u03b7\u03b8\u03b9"])
def test_a_mistral_call_id_of_another_shape_is_replaced(own: str) -> None:
    """Ten characters, an underscore, non-ASCII letters: not Mistral's 9 ASCII letters and digits, so the call gets a
    new id (its template would refuse the model's own); an id with space around it is the model's own."""
    parser = MistralToolParser()
    for text in (f"[TOOL_CALLS]f[CALL_ID]{own}[ARGS]{{}}",
                 f'[TOOL_CALLS][{{"name": "f", "arguments": {{}}, "id": "{own}"}}]'):
        ids = [call.id for call in parser.parse(text, []).tool_calls]
        assert len(ids) == 1 and ids[0] != own and re.fullmatch("[A-Za-z0-9]{9}", ids[0], re.ASCII), (text, ids)
    assert parser.parse("[TOOL_CALLS]f[CALL_ID] a1b2c3d4e [ARGS]{}", []).tool_calls[0].id == "a1b2c3d4e"


def test_a_mistral_segment_ends_at_the_next_tag_though_no_args_came() -> None:
    """A segment is the text up to the next [TOOL_CALLS]: one whose [CALL_ID] runs into that tag before an [ARGS]
    is no call (text of the content), and the [ARGS] after the tag are the next segment's, whose call has no id of
    the model's (the one before the tag was another segment's)."""
    text = '[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[TOOL_CALLS]weather[ARGS]{"city": "Oslo", "days": [1, 2]}'
    parser = MistralToolParser()
    reply = parser.parse(text, [])
    assert (reply.content, [replace(call, id=None) for call in reply.tool_calls]) == (
        "[TOOL_CALLS]now[CALL_ID]a1b2c3d4e", [WEATHER])
    assert reply.tool_calls[0].id != "a1b2c3d4e"
    # nothing streams past a segment that is no call, the first here, even once a tag follows the call after it
    assert [parser.streamed_calls(text + more, []) for more in ("", "[TOOL_CALLS]")] == [0, 0]


def test_mistral_call_ids_fit_the_next_turn_of_mistrals_template(tmp_path: Path) -> None:
    """infer's own ids (call_ and 24 hex digits) made Mistral v0.3's template refuse the tool loop's next turn
    ("Tool call IDs should be alphanumeric strings with length 9!"): the ids a reply gets must render."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse(message: str) -> None:
        raise ValueError(message)

    template = ImmutableSandboxedEnvironment().from_string(  # the check of Mistral 7B v0.3's template
        "{%- for message in messages %}{%- for call in message.tool_calls or [] %}"
        "{%- if not call.id is defined or call.id|length != 9 %}"
        "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
        "{{- call.id }}{%- endfor %}{%- endfor %}")
    reply = MistralToolParser().parse('[TOOL_CALLS][{"name": "now", "arguments": {}}]', [])
    rendered = template.render(messages=[{"role": "assistant", "tool_calls": [c.template_dict()
                                                                             for c in reply.tool_calls]}],
                               raise_exception=refuse)
    assert rendered == reply.tool_calls[0].id


def test_mistral_reads_the_tags_from_the_tokens_where_the_tokenizer_marks_them_special(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from infer.core.config import EngineConfig
    from infer.plugins.tool_parsers import mistral_parser

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]})
    parser = mistral_parser(EngineConfig(), tokenizer)  # the engine writes the tags out in the text it reads
    assert parser.written_tags == {tokenizer.convert_tokens_to_ids(tag): tag for tag in ("[TOOL_CALLS]", "[ARGS]",
                                                                                         "[CALL_ID]")}
    assert mistral_parser(EngineConfig(), AutoTokenizer.from_pretrained(str(tiny_model))).written_tags == {}
    reply = 'Checking.[TOOL_CALLS]weather[ARGS]{"city": "Oslo", "days": [1, 2]}[TOOL_CALLS]now[ARGS]{}'
    read = parser.parse(reply, [])
    assert (read.content, [replace(call, id=None) for call in read.tool_calls]) == ("Checking.", [WEATHER, NOW])


class EchoParser(ToolParser):
    """Every reply is one call of "echo" holding the reply's text and tokens: a result the tests can predict."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        return ParsedReply(f"said {len(text)}", (ToolCall("echo", {"text": text, "tokens": list(token_ids)}),))


class NamedCallParser(ToolParser):
    """One call of "lookup" with an id of its own: the id a /tool answer cites."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        return ParsedReply("", (ToolCall("lookup", {"chars": len(text)}, "c1"),))


class BrokenParser(ToolParser):
    def parse(self, text: str, token_ids: Sequence[int]) -> Any:
        return text  # not a ParsedReply


class RaisingParser(ToolParser):
    def parse(self, text: str, token_ids: Sequence[int]) -> Any:
        raise ValueError("no JSON here")


class OpaqueParser(ToolParser):
    def parse(self, text: str, token_ids: Sequence[int]) -> Any:
        return ParsedReply("", (ToolCall("f", {"when": object()}),))  # arguments no client can read


class ParserPlugin:
    @hookimpl
    def register_tool_parsers(self, register: Any) -> None:
        register("echo", lambda config, tokenizer: EchoParser())
        register("broken", lambda config, tokenizer: BrokenParser())
        register("named", lambda config, tokenizer: NamedCallParser())
        register("opaque", lambda config, tokenizer: OpaqueParser())
        register("raising", lambda config, tokenizer: RaisingParser())


TEMPLATE = ("{% if tools %}<|system|>\n{{ tools | tojson }}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
            "{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.id }} {{ c.function.name }}</call>{% endfor %}"
            "{{ m.tool_call_id or '' }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parsers") / "tools.jinja"
    path.write_text(TEMPLATE)
    return path


def echo_llm(tiny_model: Path, template: Path, parser: str = "echo") -> LLM:
    from infer.core.plugins import PluginManager

    plugins = PluginManager.from_entry_points()
    plugins.register(ParserPlugin(), name="parsers", source="tests")
    return LLM(model=str(tiny_model), plugins=plugins, device="cpu", num_kv_blocks=64, chat_template=str(template),
               tool_parser=parser)


def expected(out: Any) -> list[ToolCall]:
    """EchoParser's call for ``out``, with the id the engine gave it (random, checked for its shape)."""
    [call] = out.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    return [ToolCall("echo", {"text": out.text, "tokens": out.token_ids}, call.id)]


def test_hermes_reads_tags_that_the_tokenizer_marks_special(tiny_model: Path) -> None:
    """A checkpoint whose tokenizer marks <tool_call> special: the engine's text lacks the tags, so the parser that
    hermes builds for it asks the engine to write them out (tests/test_tool_streaming.py runs that)."""
    from transformers import AutoTokenizer

    from infer.core.config import EngineConfig
    from infer.plugins.tool_parsers import hermes_parser

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    reply = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}</tool_call>'
    assert "<tool_call>" not in tokenizer.decode(tokenizer.encode(reply), skip_special_tokens=True)  # the trap
    parser = hermes_parser(EngineConfig(), tokenizer)
    assert parser.written_tags == {tokenizer.convert_tokens_to_ids(tag): tag for tag in ("<tool_call>", "</tool_call>")}
    assert parser.parse(reply, []) == ParsedReply("Checking.", (WEATHER,))
    assert hermes_parser(EngineConfig(), AutoTokenizer.from_pretrained(str(tiny_model))).written_tags == {}


SAY = ToolCall("say", {})
MENTIONED = ('I could call <tool_call>{"name": "say", "arguments": {}}</tool_call>.</think>\n<tool_call>'
             '{"name": "now", "arguments": {}}</tool_call>')


@pytest.mark.parametrize(("opened", "text", "content", "calls"), [
    (True, MENTIONED, MENTIONED[: MENTIONED.index("\n")], (NOW,)),  # a call named while reasoning is not one
    (False, MENTIONED, "I could call .</think>", (SAY, NOW)),  # no reasoning: the </think> is text
    (None, MENTIONED, MENTIONED[: MENTIONED.index("\n")], (NOW,)),  # not known: a </think> after calls ends one
    (True, '<tool_call>{"name": "now", "arguments": {}}</tool_call>', '<tool_call>{"name": "now", "arguments": {}}'
           '</tool_call>', ()),  # cut while reasoning
    (False, '<think>Hm.</think><tool_call>{"name": "now"}</tool_call>', "<think>Hm.</think>", (NOW,)),  # the reply's
    (False, '<tool_call>{"name": "now"}</tool_call> Done.</think>', "Done.</think>", (NOW,)),
])
def test_hermes_reads_the_reasoning_a_prompt_opened(opened: bool | None, text: str, content: str,
                                                    calls: tuple[ToolCall, ...]) -> None:
    assert HermesToolParser(opened_in_prompt=opened).parse(text, []) == ParsedReply(content, calls)


def test_hermes_sees_whether_a_prompt_opened_a_reasoning_block(thinking_model: Path, tiny_model: Path) -> None:
    """for_prompt reads the prompt's decoded end: a template that opens the block (Qwen3's thinking models,
    DeepSeek-R1's) leaves a <think> there, one that turns thinking off closes it, and a prompt without one
    opened none; only with that known do calls stream (the reference: the replies' parse)."""
    from transformers import AutoTokenizer

    from infer.core.config import EngineConfig
    from infer.plugins.tool_parsers import hermes_parser

    for model in (thinking_model, tiny_model):
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        parser = hermes_parser(EngineConfig(), tokenizer)
        assert parser.streamed_calls(MENTIONED, []) == 0  # not known until a prompt is given
        for prompt, opened in (("Hi<|assistant|>\n<think>\n", True), ("Hi<|assistant|>\n<think>\n\n</think>\n\n",
                                                                         False),
                               ("Hi<|assistant|>\n", False), ("<think>a</think> Hi " * 9 + "<think>", True)):
            reader = parser.for_prompt(tokenizer.encode(prompt))
            assert isinstance(reader, HermesToolParser) and reader.opened_in_prompt is opened, (model, prompt)
            assert reader.parse(MENTIONED, []).tool_calls == ((NOW,) if opened else (SAY, NOW))
            assert reader.streamed_calls(MENTIONED, []) == (1 if opened else 2)
            assert reader.streamed_calls(MENTIONED[:-1], []) == (0 if opened else 1)  # the last block not closed


def test_hermes_reads_the_last_32_tokens_of_a_prompt_for_an_opened_block(thinking_model: Path) -> None:
    """for_prompt reads the prompt's last 32 tokens (docs/plugin-hooks.md): a <think> that is the 32nd token from
    the end opened the reply's reasoning; one a token further back is outside what it reads (an earlier turn's)."""
    from transformers import AutoTokenizer

    from infer.core.config import EngineConfig
    from infer.plugins.tool_parsers import hermes_parser

    tokenizer = AutoTokenizer.from_pretrained(str(thinking_model))
    parser = hermes_parser(EngineConfig(), tokenizer)
    opens = tokenizer.convert_tokens_to_ids("<think>")
    [a] = tokenizer.encode("a", add_special_tokens=False)
    for after, opened in ((0, True), (30, True), (31, True), (32, False), (40, False)):  # tokens after the <think>
        reader = parser.for_prompt([a] * 3 + [opens] + [a] * after)
        assert isinstance(reader, HermesToolParser) and reader.opened_in_prompt is opened, after
        assert reader.parse(MENTIONED, []).tool_calls == ((NOW,) if opened else (SAY, NOW)), after


def test_hermes_reads_a_prompt_as_the_reply_is_read_where_the_think_tags_are_special(tiny_model: Path) -> None:
    """A tokenizer that marks <think> and </think> special: the engine's text of a reply leaves its </think> out,
    so the prompt's <think> must not count either, else every call of the reply would read as reasoning."""
    from transformers import AutoTokenizer

    from infer.core.config import EngineConfig
    from infer.plugins.tool_parsers import hermes_parser

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    reader = hermes_parser(EngineConfig(), tokenizer).for_prompt(tokenizer.encode("<|user|>\nTime?\n<think>\n"))
    reply = tokenizer.encode('plan</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    text = tokenizer.decode(reply, skip_special_tokens=True)  # what the engine gives the parser
    assert "</think>" not in text and isinstance(reader, HermesToolParser) and reader.opened_in_prompt is False
    assert reader.parse(text, reply) == ParsedReply("plan", (NOW,)) and reader.streamed_calls(text, reply) == 1


def test_the_engine_gives_each_whole_reply_of_a_chat_with_tools_to_the_parser(tiny_model: Path, template: Path
                                                                              ) -> None:
    llm = echo_llm(tiny_model, template)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    done = llm.chat(CHAT, params, tools=TOOLS)[0]
    out = done.outputs[0]
    assert out.tool_calls == expected(out) and out.content == f"said {len(out.text)}"
    plain = llm.chat(CHAT, params)[0].outputs[0]  # no tools offered: no parsing
    assert (plain.tool_calls, plain.content) == (None, None)
    assert (llm.generate(["def add(a, b):"], params)[0].outputs[0].tool_calls) is None
    deltas = list(llm.engine.stream(ChatPrompt.of(CHAT, tools=TOOLS), params))
    assert all(d.outputs[0].tool_calls is None for d in deltas[:-1]) and len(deltas) > 1
    text = "".join(d.outputs[0].text for d in deltas)
    assert deltas[-1].outputs[0].tool_calls[0].arguments["text"] == text == out.text  # the whole reply, once
    stopped = llm.chat(CHAT, SamplingParams(max_tokens=6, temperature=0.0, stop=[out.text[2:4]]), tools=TOOLS)[0]
    assert stopped.outputs[0].tool_calls[0].arguments["text"] == stopped.outputs[0].text == out.text[:2]
    several = llm.chat(CHAT, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7), tools=TOOLS)[0]
    for completion in several.outputs:  # each sequence's own reply
        assert completion.tool_calls == expected(completion)
    assert len({c.tool_calls[0].id for c in several.outputs}) == 3
    rid = llm.engine.add_request(ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    aborted = llm.engine.abort(rid).outputs[0]  # not a whole reply: not read
    assert aborted.finish_reason.value == "abort" and aborted.tool_calls is None and not llm.engine.has_unfinished()


def test_a_parser_that_breaks_its_contract_is_named(tiny_model: Path, template: Path) -> None:
    llm = echo_llm(tiny_model, template, "broken")
    with pytest.raises(PluginError, match="the tool parser 'broken' from 'tests' returned str, not a ParsedReply"):
        llm.chat(CHAT, SamplingParams(max_tokens=2), tools=TOOLS)
    llm = echo_llm(tiny_model, template, "raising")
    with pytest.raises(PluginError, match="the tool parser 'raising' from 'tests' raised ValueError: no JSON here"):
        llm.chat(CHAT, SamplingParams(max_tokens=2), tools=TOOLS)
    assert not llm.engine.has_unfinished()
    llm = echo_llm(tiny_model, template, "opaque")
    with pytest.raises(PluginError, match="the tool parser 'opaque' from 'tests' returned a malformed call .* "
                                          "JSON-like"):
        llm.chat(CHAT, SamplingParams(max_tokens=2), tools=TOOLS)
    with pytest.raises(UnknownComponentError, match="unknown tool parser 'nope'; registered tool parsers: hermes, "
                                                    "llama3-json, mistral, pythonic"):
        LLM(model=str(tiny_model), device="cpu", num_kv_blocks=16, tool_parser="nope")


def test_qwen_is_another_name_of_the_hermes_parser() -> None:
    """docs/plugin-hooks.md: `hermes` (alias `qwen`: Qwen 2.5/3 and Hermes): --tool-parser qwen selects it."""
    from infer.core.plugins import PluginManager
    from infer.plugins.tool_parsers import hermes_parser

    tool_parsers = PluginManager.from_entry_points().registry("tool_parser")
    assert "qwen" in tool_parsers and tool_parsers.entry("qwen").name == "hermes"
    assert tool_parsers.get("qwen") is tool_parsers.get("hermes") is hermes_parser


def test_parsed_calls_travel_over_grpc(tiny_model: Path, template: Path, serve_engine: Any) -> None:
    import asyncio

    llm = echo_llm(tiny_model, template)
    want = llm.chat(CHAT, SamplingParams(max_tokens=6, temperature=0.0), tools=TOOLS)[0].outputs[0]
    tools = template.parent / "grpc-tools.json"
    tools.write_text(json.dumps(TOOLS))

    async def test(client: Any, port: int) -> None:
        prompt = ChatPrompt.of(CHAT, tools=TOOLS)
        done = await client.complete(prompt, request_id="r1", max_tokens=6, temperature=0.0)
        streamed = [r async for r in client.generate(prompt, request_id="r2", max_tokens=6, temperature=0.0)]
        plain = await client.complete(ChatPrompt.of(CHAT), max_tokens=6, temperature=0.0)
        cli = [await asyncio.to_thread(CliRunner().invoke, main, [
            "client", CHAT[0]["content"], "--target", f"127.0.0.1:{port}", "--chat", "--tools", str(tools),
            "--max-tokens", "6", "--temperature", "0", *more]) for more in ([], ["--n", "2"])]
        for completion in (done.outputs[0], streamed[-1].outputs[0]):
            assert completion.HasField("content") and completion.content == want.content
            [call] = completion.tool_calls
            assert (call.name, json.loads(call.arguments)) == ("echo", want.tool_calls[0].arguments)
            assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert not any(r.outputs and r.outputs[0].tool_calls for r in streamed[:-1])
        assert not plain.outputs[0].HasField("content") and not plain.outputs[0].tool_calls
        for result, count in zip(cli, (1, 2)):  # `infer client --chat --tools`: the content, the calls on stderr
            assert result.exit_code == 0 and result.stdout == (want.content + "\n") * count, result.output
            listed = re.findall(r"infer: tool call (call_[0-9a-f]{24}): echo\((.*)\)\n", result.stderr)
            assert [json.loads(arguments) for _, arguments in listed] == [want.tool_calls[0].arguments] * count

    serve_engine(llm.engine, test)


def test_generate_chat_json_shows_what_the_parser_read(tiny_model: Path, template: Path) -> None:
    """The shipped hermes parser on a real reply (the tiny model writes no call: all content), through
    `infer --tool-parser hermes generate --chat --json`; a chat without tools is not parsed."""
    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=32, chat_template=str(template),
              tool_parser="hermes")
    reply = llm.chat(CHAT, SamplingParams(max_tokens=5, temperature=0.0), tools=TOOLS)[0].outputs[0]
    assert (reply.content, reply.tool_calls) == (reply.text, [])
    lines = [json.dumps({"messages": CHAT, "tools": TOOLS}), json.dumps(CHAT)]
    result = CliRunner().invoke(main, ["--model", str(tiny_model), "--num-kv-blocks", "32", "--chat-template",
                                       str(template), "--tool-parser", "hermes", "generate", "--chat", "--json",
                                       "--max-tokens", "5", "--temperature", "0"], input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    parsed, unparsed = (json.loads(line) for line in result.stdout.splitlines())
    assert (parsed["content"], parsed["tool_calls"]) == (reply.text, []) and parsed["text"] == reply.text
    assert "tool_calls" not in unparsed and "content" not in unparsed


def test_infer_chat_keeps_parsed_calls_and_answers_one_with_slash_tool(tiny_model: Path, template: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With --tool-parser, `infer chat --tools` lists the calls a reply makes, keeps them in the conversation as
    calls, and `/tool ID RESULT` sends the tool's answer: the model's next reply is LLM.chat's to that history."""
    llm = echo_llm(tiny_model, template, "named")
    import sys

    monkeypatch.setattr(sys.modules["infer.cli.main"], "build_engine", lambda ctx: llm.engine)
    tools = template.parent / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.chat(CHAT, params, tools=TOOLS)[0].outputs[0]
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": first.tool_calls},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    second = llm.chat(history, params, tools=TOOLS)[0].outputs[0]
    result = CliRunner().invoke(main, ["chat", "--tools", str(tools), "--max-tokens", "4", "--temperature", "0"],
                                input=f"{CHAT[0]['content']}\n/tool c1 42\n/tool\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{first.content}\n{second.content}\n" == "\n\n"  # the replies' content: all calls
    assert f'infer: tool call c1: lookup({{"chars": {len(first.text)}}}) (answer with /tool c1 RESULT)' in result.stderr
    assert "/tool ID RESULT answers a tool call by its id" in result.stderr
