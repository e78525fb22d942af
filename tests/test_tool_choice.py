"""OpenAI's tool_choice: "required" and a named function force the reply to be calls (JSON under the tools' parameter
schemas, as vLLM serves them), read into tool_calls without a tool parser; "none" leaves the reply unread; "auto"
keeps the engine's parser. The references: a JSON Schema validator (test_json_schema_regex's), the masked greedy
loop over HF transformers (test_structured_output's), and the parser's own reading for "auto"."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import regex
from click.testing import CliRunner
from test_json_schema_regex import valid
from test_structured_output import reference_greedy, token_table

from infer import BeamSearchParams, ChatPrompt, FunctionChoice, InvalidRequestError, SamplingParams, StructuredOutput
from infer.cli import main
from infer.core.chat_tools import ToolCall
from infer.core.llm import LLM
from infer.core.request import FinishReason
from infer.core.tool_choice import ForcedToolCalls, forces_calls, reply_schema
from infer.plugins.json_schema_regex import schema_to_regex

TEMPLATE = ("{%- if tools %}<|system|>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{% endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
            "{%- for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{%- endfor %}"
            "\n{%- endfor %}<|assistant|>\n")
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The forecast.", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "hourly": {"type": "boolean"},
                                     "day": {"$ref": "#/$defs/day"}},
    "required": ["unit", "hourly"], "$defs": {"day": {"enum": ["today", "tomorrow"]}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time; no parameters."}}
TOOLS = [FORECAST, CLOCK]
ASK = [{"role": "user", "content": "Weather in Oslo tomorrow?"}]


@pytest.fixture(scope="module")
def llm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    template = tmp_path_factory.mktemp("tool-choice") / "tools.jinja"
    template.write_text(TEMPLATE)
    return LLM(model=str(tiny_model), device="cpu", num_kv_blocks=128, chat_template=str(template),
               tool_parser="hermes")


def schema_of(name: str) -> dict[str, Any]:
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    return tool["function"].get("parameters") or {"type": "object", "additionalProperties": False}


def test_a_named_function_makes_the_reply_its_arguments(llm: LLM, tiny_model: Path) -> None:
    """Greedy: the tokens the HF model picks under the schema's mask; sampled: every whole reply is arguments valid
    under the function's schema, read into one call with an id, and content ""."""
    choice = {"type": "function", "function": {"name": "forecast"}}
    params = SamplingParams(max_tokens=40, temperature=0.0)
    out = llm.chat(ASK, params, tools=TOOLS, tool_choice=choice)[0].outputs[0]
    pattern = schema_to_regex(reply_schema(TOOLS, FunctionChoice("forecast")))
    prompt = llm.engine.tokenize(ChatPrompt.of(ASK, tools=TOOLS))
    assert out.token_ids == reference_greedy(tiny_model, pattern, token_table(llm.engine), llm.engine.eos_token_ids,
                                             40, prompt)
    sampled = llm.chat(ASK, SamplingParams(max_tokens=40, temperature=1.0, n=6, seed=1), tools=TOOLS,
                       tool_choice=choice)[0].outputs
    whole = [c for c in (out, *sampled) if c.finish_reason is FinishReason.STOP]
    assert len(whole) >= 4, [c.text for c in sampled]
    for completion in whole:
        arguments = json.loads(completion.text)
        assert valid(arguments, schema_of("forecast"), schema_of("forecast")), completion.text
        [call] = completion.tool_calls
        assert (call.name, call.arguments, completion.content) == ("forecast", arguments, "")
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    clock = llm.chat(ASK, params, tools=TOOLS, tool_choice=FunctionChoice("clock"))[0].outputs[0]
    assert (clock.text, clock.tool_calls[0].name, clock.tool_calls[0].arguments) == ("{}", "clock", {})


def test_required_makes_the_reply_a_list_of_calls(llm: LLM) -> None:
    """Every whole reply is a non-empty JSON array of {"name", "parameters"} objects, each naming a tool and valid
    under its schema ($refs included); the calls read out are exactly those."""
    params = SamplingParams(max_tokens=160, temperature=1.0, n=8, seed=2)
    replies = llm.chat(ASK, params, tools=TOOLS, tool_choice="required")[0].outputs
    whole = [c for c in replies if c.finish_reason is FinishReason.STOP]
    assert len(whole) >= 3, [c.text for c in replies]
    pattern = regex.compile(schema_to_regex(reply_schema(TOOLS, "required")))
    for completion in replies:  # a reply cut by max_tokens: a prefix of one, unread
        if completion not in whole:
            assert pattern.fullmatch(completion.text, partial=True) and completion.tool_calls == [], completion.text
    for completion in whole:
        calls = json.loads(completion.text)
        assert isinstance(calls, list) and calls, completion.text
        for call in calls:
            assert set(call) == {"name", "parameters"}, completion.text
            assert valid(call["parameters"], schema_of(call["name"]), schema_of(call["name"])), completion.text
        assert [(c.name, c.arguments) for c in completion.tool_calls] == [(c["name"], c["parameters"]) for c in calls]
        assert completion.content == ""
    assert {c.tool_calls[0].name for c in whole} <= {"forecast", "clock"}


def test_a_reply_cut_short_is_all_content_and_none_and_auto_differ(llm: LLM) -> None:
    """Cut by max_tokens, a forced reply is a prefix of a valid one, kept whole as content without calls. "none":
    the reply is not read (no content, no calls); "auto": the engine's hermes parser reads it."""
    cut = llm.chat(ASK, SamplingParams(max_tokens=3, temperature=0.0), tools=TOOLS, tool_choice="required")[0]
    completion = cut.outputs[0]
    assert completion.finish_reason is FinishReason.LENGTH and completion.text.startswith("[")
    assert (completion.content, completion.tool_calls) == (completion.text, [])
    params = SamplingParams(max_tokens=6, temperature=0.0)
    auto, none = (llm.chat(ASK, params, tools=TOOLS, tool_choice=choice)[0].outputs[0] for choice in ("auto", "none"))
    assert auto.text == none.text  # the same prompt, unconstrained
    assert (auto.content, auto.tool_calls) == (auto.text, []) and (none.content, none.tool_calls) == (None, None)


@pytest.mark.parametrize(("tools", "choice", "complaint"), [
    (TOOLS, "any", "tool_choice must be 'auto', 'none', 'required' or"),
    (TOOLS, {"type": "function", "name": "clock"}, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "radar"}}, "names the function 'radar', which is not among"),
    (None, "required", "tool_choice 'required' needs tools"),
    (None, FunctionChoice("clock"), "which is not among the chat's tools (none)"),
])
def test_a_bad_tool_choice_is_refused_by_name(llm: LLM, tools: Any, choice: Any, complaint: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
        llm.chat(ASK, SamplingParams(max_tokens=2), tools=tools, tool_choice=choice)


def test_what_a_forced_reply_cannot_take_is_refused(llm: LLM) -> None:
    """Forced calls are structured output: not beside another one, nor with ignore_eos, nor in beam search."""
    regex = StructuredOutput(regex="[a-z]+")
    for params, complaint in ((SamplingParams(structured_output=regex), "cannot take the request's structured_output"),
                              (SamplingParams(ignore_eos=True), "makes the reply structured output: invalid sampling "
                                                                "parameters: ignore_eos cannot")):
        with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
            llm.chat(ASK, params, tools=TOOLS, tool_choice="required")
        with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
            llm.engine.check_request(ChatPrompt.of(ASK, tools=TOOLS, tool_choice="required"), params)
    prompt = ChatPrompt.of(ASK, tools=TOOLS, tool_choice=FunctionChoice("clock"))
    with pytest.raises(InvalidRequestError, match="beam search cannot force tool calls"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4))
    assert llm.engine.requests == {}


def test_required_hoists_each_tools_definitions_under_names_of_its_own() -> None:
    """Two tools that both define "#/$defs/day" keep their own: a reply valid for each is matched, a swapped one
    is not."""
    other = {"type": "function", "function": {"name": "tide", "parameters": {
        "type": "object", "properties": {"day": {"$ref": "#/definitions/day"}}, "required": ["day"],
        "definitions": {"day": {"enum": ["mon", "tue"]}}}}}
    schema = reply_schema([FORECAST, other], "required")
    pattern = schema_to_regex(schema)
    good = [{"name": "forecast", "parameters": {"unit": "C", "hourly": False, "day": "today"}},
            {"name": "tide", "parameters": {"day": "mon"}}]
    assert re.fullmatch(pattern, json.dumps(good)) and valid(good, schema, schema)
    swapped = [{"name": "tide", "parameters": {"day": "today"}}]
    assert not re.fullmatch(pattern, json.dumps(swapped)) and not valid(swapped, schema, schema)
    assert FORECAST["function"]["parameters"]["properties"]["day"] == {"$ref": "#/$defs/day"}  # the tool unchanged


OUTLINE = {"type": "function", "function": {"name": "outline", "description": "A nested outline.", "parameters": {
    "$ref": "#/$defs/section", "$defs": {"section": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 4},
        "parts": {"type": "array", "items": {"$ref": "#/$defs/section"}, "maxItems": 2}}, "required": ["title"]}}}}}


def test_a_tool_whose_parameters_recur_is_forced_at_any_depth(llm: LLM) -> None:
    """A recursive parameter schema (an outline of sections) is followed, not refused: its hoisted definition
    becomes a grammar rule, so "required" accepts a reply nested deeper than a regex could hold and refuses a bad
    one, as the validator does; sampled replies validate and are read into their calls."""
    from infer.plugins.grammar_pda import PushdownAutomaton
    from infer.plugins.json_schema_regex import schema_to_rules

    schema = reply_schema([OUTLINE], "required")
    automaton = PushdownAutomaton.of_regex_rules(schema_to_rules(schema))
    deep: dict[str, Any] = {"title": "a"}
    for _ in range(8):
        deep = {"title": "b", "parts": [deep]}
    for reply in ([{"name": "outline", "parameters": deep}],
                  [{"name": "outline", "parameters": {"title": "a", "parts": [{"title": "toolong"}]}}],
                  [{"name": "outline", "parameters": {"parts": []}}]):
        assert automaton.fullmatch(json.dumps(reply)) == valid(reply, schema, schema), reply
    params = SamplingParams(max_tokens=120, temperature=1.0, n=6, seed=4)
    replies = llm.chat(ASK, params, tools=[OUTLINE], tool_choice="required")[0].outputs
    whole = [c for c in replies if c.finish_reason is FinishReason.STOP]
    assert whole, [c.text for c in replies]
    for completion in whole:
        assert valid(json.loads(completion.text), schema, schema), completion.text
        assert [c.arguments for c in completion.tool_calls] == [c["parameters"] for c in json.loads(completion.text)]


def test_same_names_under_defs_and_definitions_stay_apart() -> None:
    """A tool may define "x" under both $defs and definitions: "required" keeps both, as a named choice does."""
    tool = {"type": "function", "function": {"name": "pair", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/definitions/x"}},
        "required": ["a", "b"], "$defs": {"x": {"const": "x"}}, "definitions": {"x": {"const": "y"}}}}}
    for choice, reply in ((FunctionChoice("pair"), {"a": "x", "b": "y"}),
                          ("required", [{"name": "pair", "parameters": {"a": "x", "b": "y"}}])):
        pattern = schema_to_regex(reply_schema([tool], choice))
        assert re.fullmatch(pattern, json.dumps(reply)), choice
        assert not re.fullmatch(pattern, json.dumps(reply).replace('"y"', '"x"')), choice


def test_a_prompt_built_directly_and_refused_tools_name_what_to_change(llm: LLM) -> None:
    """A ChatPrompt built without ChatPrompt.of may carry OpenAI's mapping; duplicate names, parameters that are
    not an object schema and schemas the backend cannot follow are refused naming the tool choice."""
    built = ChatPrompt(tuple(ChatPrompt.of(ASK).messages), tools=tuple(TOOLS),
                       tool_choice={"type": "function", "function": {"name": "clock"}})  # type: ignore[arg-type]
    reply = llm.generate([built], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert (reply.text, reply.tool_calls[0].name) == ("{}", "clock")
    text = {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}
    bounded = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 9}}}}}
    for tools, choice, complaint in (
            ([CLOCK, CLOCK], "required", "tools must have distinct names"),
            ([text], "required", "the parameters of tool 'say' may be a value other than an object (type 'string')"),
            ([CLOCK, bounded], "required", "tool_choice 'required' forces the reply under the tools' parameter "
                                           "schemas, which cannot be followed (under 'required', tool N's"),
            ([bounded], FunctionChoice("count"), "tool_choice 'count' forces the reply under the tools' parameter")):
        with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
            llm.chat(ASK, SamplingParams(max_tokens=2), tools=tools, tool_choice=choice)
        if "distinct" not in complaint:
            with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
                llm.engine.check_request(ChatPrompt.of(ASK, tools=tools, tool_choice=choice))


def test_a_forced_reply_is_an_object_whatever_the_parameters_leave_open(llm: LLM) -> None:
    """Parameters without a "type" (a description alone) get "type": "object": a reply such as "" or 1 would be no
    call. Parameters whose values may be other than objects are refused, as are definitions that are no mapping;
    unions and refs of objects only are served."""
    def tool(parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    pattern = schema_to_regex(reply_schema([tool({"description": "anything"})], FunctionChoice("f")))
    assert re.fullmatch(pattern, '{"a":1}') and not any(re.fullmatch(pattern, v) for v in ('""', "1", "[]", "null"))
    replies = llm.chat(ASK, SamplingParams(max_tokens=60, temperature=1.0, n=16, seed=3),
                       tools=[tool({"description": "anything"})], tool_choice=FunctionChoice("f"))[0].outputs
    whole = [reply for reply in replies if reply.finish_reason is FinishReason.STOP]
    past_float_range = [reply for reply in whole if "inf" in repr(json.loads(reply.text))]  # 1e999: no call holds it
    assert len(whole) > len(past_float_range) and all(
        (reply.content, reply.tool_calls) == (reply.text, []) if reply in past_float_range else
        len(reply.tool_calls) == 1 and reply.tool_calls[0].arguments == json.loads(reply.text) for reply in whole)
    objects = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"$ref": "#/$defs/b"}], "$defs": {"b": {"type": ["object"], "properties": {}}}}
    for choice in (FunctionChoice("f"), "required"):
        assert schema_to_regex(reply_schema([tool(objects)], choice))
        for parameters, complaint in (
                ({"anyOf": [{"type": "object"}, {"type": "string"}]}, "may be a value other than an object"),
                ({"$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}}, "may be a value other than an object"),
                ({"$ref": "#/$defs/s", "$defs": {"s": {"$ref": "#/$defs/s"}}}, "may be a value other than an object"),
                ({"enum": [{"a": 1}, 2]}, "may be a value other than an object"),
                ({"type": "object", "$defs": [{"type": "integer"}]},
                 "have '$defs' [{\"type\": \"integer\"}], not an object of named schemas"),
                ({"type": "object", "definitions": "x"}, "have 'definitions' \"x\", not an object of named schemas")):
            with pytest.raises(InvalidRequestError, match=re.escape(complaint)):
                reply_schema([tool(parameters)], choice)
    with pytest.raises(InvalidRequestError, match="not an object of named schemas"):
        llm.chat(ASK, SamplingParams(max_tokens=2), tools=[tool({"type": "object", "$defs": []})],
                 tool_choice="required")


def test_a_prompt_built_with_no_tool_choice_is_auto(llm: LLM) -> None:
    """tool_choice None (a ChatPrompt built directly) reads as "auto" everywhere: beam search serves it."""
    prompt = ChatPrompt(tuple(ChatPrompt.of(ASK).messages), tools=tuple(TOOLS), tool_choice=None)
    assert not forces_calls(prompt)
    assert llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3))[0].beams


def test_the_forced_reader_keeps_anything_but_whole_calls_as_content() -> None:
    named, required = ForcedToolCalls(FunctionChoice("clock")), ForcedToolCalls("required")
    assert named.parse('{"a": 1}', []).tool_calls == (ToolCall("clock", {"a": 1}),)
    for parser, text in ((named, '{"a": '), (named, "[1]"), (required, "[]"), (required, '[{"name": "x"}]'),
                         (required, "{}"), (named, '{"a": 1e999}'), (required, '[{"name": "x", "parameters": '
                                                                           '{"a": [-1E+400]}}]')):
        reply = parser.parse(text, [])
        assert (reply.content, reply.tool_calls) == (text, ()), text


def test_tool_choice_travels_over_grpc_infer_client_and_generate_chat(llm: LLM, tiny_model: Path,
                                                                      serve_engine: Any, tmp_path: Path) -> None:
    """The Python client sends a ChatPrompt's tool_choice (a word, or OpenAI's named object as JSON), the server
    answers with the call LLM.chat reads; `infer client --chat --tools F --tool-choice NAME` prints it; a
    `generate --chat` line takes "tool_choice"; a bad one is INVALID_ARGUMENT."""
    import asyncio

    import grpc

    from infer.server import infer_pb2 as pb
    from infer.server.client import build_request
    from infer.server.convert import prompt_of

    prompt = ChatPrompt.of(ASK, tools=TOOLS, tool_choice=FunctionChoice("forecast"))
    assert prompt_of(build_request(prompt)) == prompt and prompt.tool_choice == FunctionChoice("forecast")
    assert prompt_of(build_request(ChatPrompt.of(ASK, tools=TOOLS, tool_choice="none"))).tool_choice == "none"
    named = {"type": "function", "function": {"name": "forecast"}}
    want = llm.chat(ASK, SamplingParams(max_tokens=40, temperature=0.0), tools=TOOLS, tool_choice=named)[0]
    want_calls = [(c.name, c.arguments) for c in want.outputs[0].tool_calls]
    assert want_calls
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))

    async def test(client: Any, port: int) -> None:
        done = await client.complete(prompt, max_tokens=40, temperature=0.0)
        completion = done.outputs[0]
        assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == want_calls
        assert completion.HasField("content") and completion.content == ""
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], tools=json.dumps(TOOLS),
                       tool_choice='{"type": "function", "function": {"name": "radar"}}')
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.stub.Complete(pb.GenerateRequest(chat=chat))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "'radar'" in info.value.details()
        cli = await asyncio.to_thread(CliRunner().invoke, main, [
            "client", ASK[0]["content"], "--target", f"127.0.0.1:{port}", "--chat", "--tools", str(tools),
            "--tool-choice", "forecast", "--max-tokens", "40", "--temperature", "0"])
        assert (cli.exit_code, cli.stdout) == (0, "\n"), cli.output  # the reply's content: none, all calls
        assert all(f"{name}({json.dumps(arguments)})" in cli.stderr for name, arguments in want_calls), cli.stderr

    serve_engine(llm.engine, test)
    for args, code, complaint in ((["--tool-choice", "required"], 2, "--tool-choice is for a conversation; add --chat"),
                                  (["--chat", "--tool-choice", "required"], 2,
                                   "tool_choice (--tool-choice) 'required' needs tools"),
                                  (["--chat", "--tools", str(tools), "--tool-choice",
                                    '{"type": "function", "function": {"name": "none"}}'], 2,
                                   "names the function 'none', which is not among")):
        result = CliRunner().invoke(main, ["client", "x", "--target", "127.0.0.1:1", *args])
        assert result.exit_code == code and complaint in result.stderr, result.output
    line = json.dumps({"messages": ASK, "tools": TOOLS, "tool_choice": named})
    result = CliRunner().invoke(main, ["--model", str(tiny_model), "--num-kv-blocks", "64", "--chat-template",
                                       str(llm.engine.config.chat_template), "generate", "--chat", "--json",
                                       "--max-tokens", "40", "--temperature", "0", line])
    assert result.exit_code == 0, result.output
    [got] = [json.loads(row) for row in result.stdout.splitlines()]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == want_calls


def test_infer_chat_forces_the_replies_to_your_turns_only(llm: LLM, tiny_model: Path, tmp_path: Path) -> None:
    """`infer chat --tool-choice NAME`: the reply to a turn is the call LLM.chat forces; the reply to the `/tool`
    answer is the one LLM.chat gives under "auto" to the same conversation, and the next turn's reply is forced
    again; a choice that cannot apply is exit 2 before the first turn."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    forced = llm.chat(ASK, params, tools=TOOLS, tool_choice=FunctionChoice("forecast"))[0].outputs[0]
    assert forced.tool_calls
    answered = [*ASK, {"role": "assistant", "content": None, "tool_calls": forced.tool_calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    after = llm.chat(answered, params, tools=TOOLS)[0].outputs[0].text
    assert after != llm.chat(answered, params, tools=TOOLS, tool_choice=FunctionChoice("forecast"))[0].outputs[0].text
    again = [*answered, {"role": "assistant", "content": after}, {"role": "user", "content": "And in Bergen?"}]
    next_call = llm.chat(again, params, tools=TOOLS, tool_choice=FunctionChoice("forecast"))[0].outputs[0]
    assert next_call.tool_calls and next_call.text != llm.chat(again, params, tools=TOOLS)[0].outputs[0].text
    base = ["--model", str(tiny_model), "--num-kv-blocks", "128", "--chat-template",
            str(llm.engine.config.chat_template), "chat", "--max-tokens", "40", "--temperature", "0"]
    result = CliRunner().invoke(main, [*base, "--tools", str(tools), "--tool-choice", "forecast"],
                                input=f"{ASK[0]['content']}\n/tool call_1 21C\nAnd in Bergen?\n")
    assert (forced.content, next_call.content) == ("", "")  # all calls: the content printed is blank
    assert result.exit_code == 0 and result.stdout == f"\n{after}\n\n", result.output
    [call] = forced.tool_calls
    assert "tool call call_" in result.stderr and f"{call.name}({json.dumps(call.arguments)})" in result.stderr
    assert "warning: no tool call call_1 in this conversation (the calls made: call_" in result.stderr
    bare = CliRunner().invoke(main, [*base, "--tools", str(tools)], input="/tool\n")
    assert bare.exit_code == 0 and "/tool ID RESULT answers a tool call by its id" in bare.stderr and not bare.stdout
    for args, complaint in ((["--tool-choice", "required"], "tool_choice (--tool-choice) 'required' needs tools"),
                            (["--tools", str(tools), "--tool-choice", "radar"], "'radar'"),
                            (["--tools", str(tools), "--tool-choice", "forecast", "--min-tokens", "2"], "min_tokens")):
        result = CliRunner().invoke(main, [*base, *args], input="hi\n")
        assert result.exit_code == 2 and complaint in result.stderr and not result.stdout, result.output
