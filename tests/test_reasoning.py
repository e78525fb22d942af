"""Reasoning parsers: a chat's reply split into its <think> block and its content. The references: the rules of
plugins/reasoning_parsers.py's docstring (vLLM's readings of Qwen3 and DeepSeek-R1) written out by hand, the
"only the markers are dropped" property, and replies forced by a regex (structured output) so that a tiny random
model writes a known shape."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from infer import ChatPrompt, FunctionChoice, SamplingParams, StructuredOutput
from infer.cli import main
from infer.core.errors import PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import ReasoningParser
from infer.core.llm import LLM
from infer.core.plugins import PluginManager
from infer.plugins.reasoning_parsers import ThinkReasoningParser

TEMPLATE = ("{%- if tools %}<|system|>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{% endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n")
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time."}}
ASK = [{"role": "user", "content": "What time is it?"}]
THINK_THEN_ANSWER = r"<think>[a-z]{1,8}</think>[a-z ]{1,8}"


@pytest.mark.parametrize("text, qwen3, deepseek_r1", [
    ("<think>a\nb</think>\n\nAnswer", ("a\nb", "\n\nAnswer"), ("a\nb", "\n\nAnswer")),
    ("Answer only", (None, "Answer only"), ("Answer only", "")),
    ("<think>cut while thinking", ("cut while thinking", ""), ("cut while thinking", "")),
    ("plan</think>answer", ("plan", "answer"), ("plan", "answer")),
    ("\n<think>x</think>y", ("\nx", "y"), ("\nx", "y")),
    ("a <think>b</think> c", ("a <think>b", " c"), ("a <think>b", " c")),  # only a leading <think> opens one
    ("<think></think>", ("", ""), ("", "")),
])
def test_the_shipped_parsers_follow_their_documented_rules(text: str, qwen3: Any, deepseek_r1: Any) -> None:
    assert ThinkReasoningParser(opened_in_prompt=False).split(text) == qwen3
    assert ThinkReasoningParser(opened_in_prompt=True).split(text) == deepseek_r1


def test_only_the_markers_are_dropped() -> None:
    """Whatever the reply, reasoning + content is the reply less a leading <think> and the first </think>."""
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "a", " ", "\n", "<", "think", ">", "/"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        stripped = text.lstrip()
        body = text[: len(text) - len(stripped)] + stripped.removeprefix("<think>")
        for parser in (ThinkReasoningParser(False), ThinkReasoningParser(True)):
            reasoning, content = parser.split(text)
            assert (reasoning or "") + content == body.replace("</think>", "", 1), text


@pytest.fixture(scope="module")
def llm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    template = tmp_path_factory.mktemp("reasoning") / "chat.jinja"
    template.write_text(TEMPLATE)
    return LLM(model=str(tiny_model), device="cpu", num_kv_blocks=128, chat_template=str(template),
               reasoning_parser="qwen3", tool_parser="hermes")


def forced(pattern: str, max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=StructuredOutput(regex=pattern))


def test_a_chats_reply_is_split_into_reasoning_and_content(llm: LLM) -> None:
    """The reply (forced to think, then answer) ends whole; its reasoning is the text between the tags and its
    content the text after, the whole text kept; a streamed reply's last delta carries the same split."""
    [out] = llm.chat(ASK, forced(THINK_THEN_ANSWER))[0].outputs
    assert out.finish_reason.value == "stop" and out.text.startswith("<think>"), out.text
    between, _, after = out.text.removeprefix("<think>").partition("</think>")
    assert (out.reasoning_content, out.content, out.tool_calls) == (between, after, None)
    deltas = list(llm.engine.stream(ChatPrompt.of(ASK), forced(THINK_THEN_ANSWER)))
    assert "".join(c.text for d in deltas for c in d.outputs) == out.text
    assert (deltas[-1].outputs[0].reasoning_content, deltas[-1].outputs[0].content) == (between, after)
    assert all(c.reasoning_content is None for d in deltas[:-1] for c in d.outputs)


def test_the_tool_parser_reads_the_content_after_the_reasoning(llm: LLM) -> None:
    call = r'<tool_call>\{"name": "clock", "arguments": \{\}\}</tool_call>'
    [out] = llm.chat(ASK, forced(rf"<think>[a-z]{{1,6}}</think>{call}", 64), tools=[CLOCK])[0].outputs
    assert out.finish_reason.value == "stop", out.text
    between = out.text.removeprefix("<think>").partition("</think>")[0]
    assert out.reasoning_content == between and out.content == ""
    assert [(c.name, dict(c.arguments)) for c in out.tool_calls] == [("clock", {})]


def test_prompts_that_are_not_chats_and_forced_calls_are_not_split(llm: LLM) -> None:
    [plain] = llm.generate([llm.engine.tokenize(ChatPrompt.of(ASK))], forced(THINK_THEN_ANSWER))[0].outputs
    assert plain.text.startswith("<think>") and (plain.content, plain.reasoning_content) == (None, None)
    [out] = llm.chat(ASK, SamplingParams(max_tokens=24, temperature=0.0), tools=[CLOCK],
                     tool_choice=FunctionChoice("clock"))[0].outputs
    assert out.reasoning_content is None and [c.name for c in out.tool_calls] == ["clock"]


def test_a_misbehaving_parser_is_a_plugin_error_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    class Broken(ReasoningParser):
        def split(self, text: str) -> Any:
            return text  # not a pair

    class Plugin:
        @hookimpl
        def register_reasoning_parsers(self, register: Any) -> None:
            register("broken", lambda config, tokenizer: Broken())

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="broken-reasoning")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32, chat_template=str(template),
                                 reasoning_parser="broken"), plugins)
    with pytest.raises(PluginError, match=r"reasoning parser Broken returned .*not \(reasoning or None, content\)"):
        engine.generate([ChatPrompt.of(ASK)], SamplingParams(max_tokens=3))


def test_the_split_travels_over_grpc_and_generate_json(llm: LLM, tiny_model: Path, serve_engine: Any) -> None:
    want = llm.chat(ASK, forced(THINK_THEN_ANSWER))[0].outputs[0]

    async def test(client: Any, port: int) -> None:
        done = await client.complete(ChatPrompt.of(ASK), forced(THINK_THEN_ANSWER))
        completion = done.outputs[0]
        assert (completion.text, completion.reasoning_content, completion.content) == (
            want.text, want.reasoning_content, want.content)
        plain = await client.complete(ChatPrompt.of(ASK), SamplingParams(max_tokens=4, temperature=0.0))
        assert not plain.outputs[0].HasField("reasoning_content")  # no <think>: qwen3 reads no reasoning
        assert plain.outputs[0].content == plain.outputs[0].text

    serve_engine(llm.engine, test)
    line = json.dumps({"messages": ASK})
    base = ["--model", str(tiny_model), "--num-kv-blocks", "64", "--chat-template",
            str(llm.engine.config.chat_template)]
    result = CliRunner().invoke(main, [*base, "--reasoning-parser", "qwen3", "generate", "--chat", "--json",
                                       "--max-tokens", "48", "--temperature", "0", "--regex", THINK_THEN_ANSWER, line])
    assert result.exit_code == 0, result.output
    [got] = [json.loads(row) for row in result.stdout.splitlines()]
    assert (got["reasoning_content"], got["content"]) == (want.reasoning_content, want.content)
    result = CliRunner().invoke(main, [*base, "--reasoning-parser", "qwen", "generate", "--chat", line])
    assert result.exit_code == 2 and "deepseek-r1" in result.stderr and "qwen3" in result.stderr, result.output
