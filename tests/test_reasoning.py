"""Reasoning parsers: a chat's reply split into its <think> block and its content. The references: the rules of
plugins/reasoning_parsers.py's docstring written out by hand, the "only the markers are dropped" property, and
hand-built token streams for the tool parsers' special tags."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from infer import ChatPrompt, FunctionChoice, SamplingParams, StructuredOutput
from infer.cli import main
from infer.core.admission import check_reasoning_end
from infer.core.errors import PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import ReasoningEnd, ReasoningParser
from infer.core.llm import LLM
from infer.core.plugins import PluginManager
from infer.plugins.reasoning_parsers import THINK_END, THINK_START, ThinkReasoningParser

TEMPLATE = ("{%- if tools %}<|system|>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}{% endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n")
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time."}}
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.mark.parametrize("text, qwen3, deepseek_r1", [
    ("<think>a\nb</think>\n\nAnswer", ("a\nb", "\n\nAnswer"), ("a\nb", "\n\nAnswer")),
    ("Answer only", (None, "Answer only"), ("Answer only", "")),
    ("<think>cut while thinking", ("cut while thinking", ""), ("cut while thinking", "")),
    ("plan</think>answer", ("plan", "answer"), ("plan", "answer")),
    ("\n<think>x</think>y", ("x", "y"), ("x", "y")),  # the space before a leading <think> goes with it
    ("a <think>b</think> c", ("a <think>b", " c"), ("a <think>b", " c")),  # only a leading <think> opens one
    ("<think></think>", ("", ""), ("", "")),
])
def test_the_shipped_parsers_follow_their_documented_rules(text: str, qwen3: Any, deepseek_r1: Any) -> None:
    assert ThinkReasoningParser(opened_in_prompt=False).split(text) == qwen3
    assert ThinkReasoningParser(opened_in_prompt=True).split(text) == deepseek_r1


def test_only_the_markers_are_dropped() -> None:
    """Whatever the reply: it is (leading space,) an optional <think>, the reasoning, an optional </think> and the
    content, in that order; the reasoning holds no </think> (the first one closes it)."""
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "a", " ", "\n", "<", "think", ">", "/"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        lead = text[: len(text) - len(text.lstrip())]
        for parser in (ThinkReasoningParser(False), ThinkReasoningParser(True)):
            reasoning, content = parser.split(text)
            assert THINK_END not in (reasoning or "")
            assert any(text == (lead + opened if opened else "") + (reasoning or "") + closed + content
                       for opened in ("", THINK_START) for closed in ("", THINK_END)), (text, reasoning, content)
            if reasoning is None:
                assert content == text


@pytest.fixture(scope="module")
def llm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    template = tmp_path_factory.mktemp("reasoning") / "chat.jinja"
    template.write_text(TEMPLATE)
    return LLM(model=str(tiny_model), device="cpu", num_kv_blocks=128, chat_template=str(template),
               reasoning_parser="deepseek-r1", tool_parser="hermes")


def test_a_chats_reply_is_split_and_the_split_travels_with_it(llm: LLM) -> None:
    """deepseek-r1: the template opened the block, so a reply that never closes it (a random model's) is all
    reasoning, content "" (the rules' table above); the whole text stays in ``text``, and a stream's last delta
    carries the same split (the earlier ones none)."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    [out] = llm.chat(ASK, params)[0].outputs
    assert THINK_END not in out.text and out.text
    assert (out.reasoning_content, out.content, out.tool_calls) == (out.text, "", None)
    deltas = list(llm.engine.stream(ChatPrompt.of(ASK), params))
    assert "".join(c.text for d in deltas for c in d.outputs) == out.text
    assert (deltas[-1].outputs[0].reasoning_content, deltas[-1].outputs[0].content) == (out.text, "")
    assert all(c.reasoning_content is None and c.content is None for d in deltas[:-1] for c in d.outputs)
    two = llm.chat(ASK, SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, stop=["e"]))[0].outputs
    assert all((c.reasoning_content, c.content) == (c.text, "") for c in two)


def test_structured_output_plain_prompts_and_forced_calls_are_not_split(llm: LLM) -> None:
    """A grammar holds from the first token (a forced tool_choice's too), so such a reply has no reasoning; a
    prompt that is not a chat is not read at all."""
    regex = SamplingParams(max_tokens=12, temperature=0.0, structured_output=StructuredOutput(regex="[a-z]{1,8}"))
    [structured] = llm.chat(ASK, regex)[0].outputs
    assert structured.text and (structured.reasoning_content, structured.content) == (None, None)
    [plain] = llm.generate([llm.engine.tokenize(ChatPrompt.of(ASK))], SamplingParams(max_tokens=4))[0].outputs
    assert (plain.content, plain.reasoning_content) == (None, None)
    [out] = llm.chat(ASK, SamplingParams(max_tokens=24, temperature=0.0), tools=[CLOCK],
                     tool_choice=FunctionChoice("clock"))[0].outputs
    assert out.reasoning_content is None and [c.name for c in out.tool_calls] == ["clock"]


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_tool_tags_that_are_special_tokens_leave_no_reasoning_in_the_content(parser: str) -> None:
    """The tool parser reads the reply with its tags written out where they stand (the engine's text lacks
    them), then the reasoning is split off what it left: the content holds neither the calls nor the reasoning."""
    from infer.core.outputs import reply_parts, tagged_text
    from infer.plugins.tool_parsers import HermesToolParser, MistralToolParser

    vocab = {1: "<think>", 2: "plan", 3: "</think>", 4: "\n", 5: '{"name": "clock", "arguments": {}}',
             6: '[{"name": "clock", "arguments": {}}]', 10: "<tool_call>", 11: "</tool_call>", 12: "[TOOL_CALLS]"}
    if parser == "hermes":
        tool_parser: Any = HermesToolParser({10: "<tool_call>", 11: "</tool_call>"})
        ids = [1, 2, 3, 4, 10, 5, 11]
    else:
        tool_parser = MistralToolParser({12: "[TOOL_CALLS]"})
        ids = [1, 2, 3, 12, 6]
    text, marks = "", []
    for token in ids:  # as the engine marks them
        if token in tool_parser.written_tags:
            marks.append((len(text), tool_parser.written_tags[token]))
        else:
            text += vocab[token]
    reasoning, content, calls = reply_parts(tagged_text(text, marks), ids, tool_parser, ThinkReasoningParser(False))
    assert (reasoning, content) == ("plan", "")
    assert [(c.name, dict(c.arguments)) for c in calls] == [("clock", {})]
    assert re.fullmatch(r"call_[0-9a-f]{24}" if parser == "hermes" else "[A-Za-z0-9]{9}", calls[0].id)  # Mistral's


def test_infer_chat_keeps_what_the_parsers_read_and_no_empty_reasoning() -> None:
    """The assistant message `infer chat` keeps: an empty reasoning is none (a message may not carry one, and
    every later turn would be refused); a reply not read (or stopped) is its text."""
    from infer.cli.chat import reply_message
    from infer.core.chat_tools import ToolCall
    from infer.core.request import CompletionOutput

    empty = CompletionOutput(0, [], "", content="Hi", reasoning_content="")
    assert reply_message("<think></think>Hi", empty) == {"role": "assistant", "content": "Hi"}
    thought = CompletionOutput(0, [], "", content="Hi", reasoning_content="plan")
    assert reply_message("<think>plan</think>Hi", thought) == {
        "role": "assistant", "content": "Hi", "reasoning_content": "plan"}
    call = ToolCall("clock", {}, "call_1")
    called = CompletionOutput(0, [], "", content="", tool_calls=[call], reasoning_content="plan")
    assert reply_message("x", called) == {"role": "assistant", "content": None, "tool_calls": [call],
                                          "reasoning_content": "plan"}
    assert reply_message("raw", CompletionOutput(0, [], "raw")) == {"role": "assistant", "content": "raw"}
    assert reply_message("", None) == {"role": "assistant", "content": ""}
    ChatPrompt.of([*ASK, reply_message("<think></think>Hi", empty), {"role": "user", "content": "And?"}])


def engine_with_parser(tiny_model: Path, tmp_path: Path, name: str, parser: ReasoningParser) -> Any:
    """An engine on the tiny model with TEMPLATE and ``parser``, registered by a plugin as reasoning parser
    ``name``."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    class Plugin:
        @hookimpl
        def register_reasoning_parsers(self, register: Any) -> None:
            register(name, lambda config, tokenizer: parser)

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name=f"{name}-reasoning")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    return Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32, chat_template=str(template),
                               reasoning_parser=name), plugins)


def test_a_misbehaving_parser_is_a_plugin_error_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    class Broken(ReasoningParser):
        def split(self, text: str) -> Any:
            return text  # not a pair

        def reasoning_end(self, prompt_token_ids: Any) -> Any:
            return (5, True)  # not a ReasoningEnd

    engine = engine_with_parser(tiny_model, tmp_path, "broken", Broken())
    with pytest.raises(PluginError, match=r"reasoning parser 'broken' from 'broken-reasoning' returned .*not "
                                          r"\(reasoning or None, content\)"):
        engine.generate([ChatPrompt.of(ASK)], SamplingParams(max_tokens=3))
    with pytest.raises(PluginError, match=r"reasoning parser 'broken': reasoning_end\(\) returned \(5, True\)"):
        engine.generate([ChatPrompt.of(ASK)], SamplingParams(max_tokens=3, structured_output=StructuredOutput(
            regex="[a-z]+")))
    assert not engine.has_unfinished()


VOCAB = 100  # check_reasoning_end's vocabulary size: token ids are valid in [0, VOCAB)


@pytest.mark.parametrize("end, valid", [
    (None, True),
    (ReasoningEnd(VOCAB - 1), True),  # the last id of the vocabulary
    (ReasoningEnd(VOCAB), False),  # one past it
    (ReasoningEnd(-1), False),
    (ReasoningEnd(7, True, VOCAB - 1), True),
    (ReasoningEnd(7, False, VOCAB), False),
    (ReasoningEnd(7, False, 8), True),
    (ReasoningEnd(7, False, 7), False),  # opening and closing on one token: no reply could open and close a block
])
def test_a_reasoning_end_is_checked_against_the_vocabulary_and_its_markers_must_differ(end: ReasoningEnd | None,
                                                                                        valid: bool) -> None:
    """check_reasoning_end passes None or a ReasoningEnd whose marker ids lie in [0, vocab_size) and differ, and
    refuses the rest naming the parser: a marker id equal to the vocabulary size is out of it."""
    if valid:
        assert check_reasoning_end(end, VOCAB, "think") is end
    else:
        with pytest.raises(PluginError, match=r"reasoning parser 'think': reasoning_end\(\) returned"):
            check_reasoning_end(end, VOCAB, "think")


def test_the_split_travels_over_grpc_and_generate_json(llm: LLM, tiny_model: Path, serve_engine: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.chat(ASK, params)[0].outputs[0]

    async def test(client: Any, port: int) -> None:
        done = await client.complete(ChatPrompt.of(ASK), params)
        completion = done.outputs[0]
        assert (completion.text, completion.reasoning_content, completion.content) == (want.text, want.text, "")
        messages = [m async for m in client.generate(ChatPrompt.of(ASK), params)]
        last = messages[-1].outputs[0]
        assert (last.reasoning_content, last.HasField("content")) == (want.text, True)
        assert not any(c.HasField("reasoning_content") or c.HasField("content")
                       for m in messages[:-1] for c in m.outputs)
        structured = await client.complete(ChatPrompt.of(ASK), SamplingParams(
            max_tokens=8, structured_output=StructuredOutput(regex="[a-z]{1,6}")))
        assert not structured.outputs[0].HasField("reasoning_content")
        cli = await asyncio.to_thread(CliRunner().invoke, main, [
            "client", ASK[0]["content"], "--target", f"127.0.0.1:{port}", "--chat", "--max-tokens", "8"])
        assert (cli.exit_code, cli.stdout, cli.stderr) == (0, "\n", want.text + "\n"), cli.output  # content, reasoning

    serve_engine(llm.engine, test)
    line = json.dumps({"messages": ASK})
    base = ["--model", str(tiny_model), "--num-kv-blocks", "64", "--chat-template",
            str(llm.engine.config.chat_template)]
    result = CliRunner().invoke(main, [*base, "--reasoning-parser", "deepseek-r1", "generate", "--chat", "--json",
                                       "--max-tokens", "8", "--temperature", "0", line])
    assert result.exit_code == 0, result.output
    [got] = [json.loads(row) for row in result.stdout.splitlines()]
    assert (got["reasoning_content"], got["content"]) == (want.text, "")
    chat = CliRunner().invoke(main, [*base, "--reasoning-parser", "deepseek-r1", "chat", "--max-tokens", "8",
                                     "--temperature", "0"], input=ASK[0]["content"] + "\n")
    assert (chat.exit_code, chat.stdout, chat.stderr) == (0, "\n", want.text + "\n"), chat.output
    result = CliRunner().invoke(main, [*base, "--reasoning-parser", "qwen", "generate", "--chat", line])
    assert result.exit_code == 2 and "deepseek-r1" in result.stderr and "qwen3" in result.stderr, result.output


# ---------------------------------------------------------------- structured output after the reasoning
PATTERN = "is [a-z]{2,5}"


@pytest.fixture(scope="module")
def thinking_hf(thinking_model: Path) -> tuple[Any, list[str]]:
    """The HF model, and each token's text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(thinking_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    return hf, [tokenizer.decode([t], skip_special_tokens=True) for t in range(hf.config.vocab_size)]


def reference_after_reasoning(hf: Any, texts: list[str], prompt: list[int], bias: dict[int, float],
                              opens: int | None, closes: int, closed_in_prompt: bool, eos: int, max_tokens: int
                              ) -> list[int]:
    """Greedy decoding over HF transformers with ``bias`` added to the logits: no mask while reasoning (from the
    first token, unless the prompt closed the block; with ``opens``, only when the first token is it, the first
    token otherwise masked as the grammar's), then each token's argmax among those whose text keeps the content
    a prefix of a PATTERN match (the regex module's partial matching over the decoded text), EOS once it is
    whole."""
    import regex
    import torch

    out: list[int] = []
    content = "" if closed_in_prompt or opens is not None else None  # None: reasoning
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        for token, value in bias.items():
            logits[token] += value
        if content is None:
            allowed = list(range(len(texts)))
        else:
            allowed = [t for t, text in enumerate(texts) if text and t not in (opens, closes)
                       and regex.fullmatch(PATTERN, content + text, partial=True)]
            allowed += [eos] if regex.fullmatch(PATTERN, content) else []
            allowed += [opens] if opens is not None and not out else []
        token = max(allowed, key=lambda t: logits[t].item())
        out.append(token)
        if token == eos:
            break
        if content is None:
            content = "" if token == closes else None
        elif token == opens and len(out) == 1:
            content = None
        else:
            content += texts[token]
    return out


@pytest.mark.parametrize("parser, generation, bias_open, closed_in_prompt", [
    ("deepseek-r1", "<think>\n", None, False),  # the template opens the block
    ("qwen3", "", 30.0, False),  # the reply opens it
    ("qwen3", "", -30.0, False),  # the reply does not: the grammar holds from its first token
    ("qwen3", "<think>\n\n</think>\n\n", None, True),  # thinking off: the template closed an empty block
    ("deepseek-r1", "<think>\n\n</think>\n\n", None, True),  # and so for a parser whose replies open in the prompt
])
def test_structured_output_follows_the_reasoning(thinking_model: Path, thinking_hf: tuple[Any, list[str]],
                                                 tmp_path: Path, parser: str, generation: str,
                                                 bias_open: float | None, closed_in_prompt: bool) -> None:
    """With a reasoning parser, a chat's structured output holds after the reply's reasoning: the greedy tokens
    equal a reference loop over HF transformers that masks only past the first </think> (or from the first token,
    where the prompt closed the block or the reply did not open one), and the reply is split there."""
    import re

    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    template = tmp_path / "chat.jinja"
    template.write_text("{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n"
                        + generation)
    engine = Engine(EngineConfig(model=str(thinking_model), device="cpu", num_kv_blocks=64,
                                 chat_template=str(template), reasoning_parser=parser))
    opens, closes = (engine.tokenizer.convert_tokens_to_ids(m) for m in (THINK_START, THINK_END))
    prompt = engine.tokenize(ChatPrompt.of(ASK))
    [eos] = engine.eos_token_ids
    reasons = bias_open != -30.0 and not closed_in_prompt
    # biases with which the reference reasons, then closes the block: after two free tokens where the template
    # opened it (with qwen3, the reply's first token opens it; then this model closes it at once or never)
    earliest = 2 if parser == "deepseek-r1" else 1
    opening = [bias_open] if bias_open is None or bias_open < 0 else [2.0 * i for i in range(1, 10)]
    candidates = [(o, 0.5 * c) for o in opening for c in range(40)] if reasons else [(bias_open, 0.0)]
    for open_bias, close_bias in candidates:
        bias = {closes: close_bias} | ({opens: open_bias} if open_bias is not None else {})
        want = reference_after_reasoning(*thinking_hf, prompt, bias, opens if parser == "qwen3" else None, closes,
                                         closed_in_prompt, eos, 16)
        if not reasons or closes in want[earliest:12] and closes not in want[:earliest] and (
                opens in want[:1]) == (parser == "qwen3"):
            break
    else:
        pytest.fail("no biases make the reference reason, then close the block")
    params = SamplingParams(max_tokens=16, temperature=0.0, logit_bias=list(bias.items()),
                            structured_output=StructuredOutput(regex=PATTERN))
    [out] = engine.generate([ChatPrompt.of(ASK)], params)[0].outputs
    assert out.token_ids == want
    ahead = Engine(EngineConfig(model=str(thinking_model), device="cpu", num_kv_blocks=64, async_scheduling=True,
                                chat_template=str(template), reasoning_parser=parser))
    pair = ahead.generate([ChatPrompt.of(ASK)], dataclasses.replace(params, n=2))[0].outputs
    assert [c.token_ids for c in pair] == [want, want]  # masks a step late (async scheduling), forked sequences
    assert (out.reasoning_content is not None) == reasons == (closes in want)
    if not reasons:  # the grammar held from the first token: all content, whatever the text holds
        assert out.content == out.text
    if out.finish_reason.value == "stop":
        assert re.fullmatch(PATTERN, out.content)


def test_where_the_prompt_leaves_the_reasoning(thinking_model: Path, tiny_model: Path) -> None:
    """The prompt's last marker decides: a block it opens is the reply's to close; one it closes, with nothing but
    space after it, is thinking off; an earlier turn's, with more text after it, is neither. A tokenizer without
    the markers as tokens of their own cannot say."""
    from infer.core.interfaces import ReasoningEnd
    from infer.core.loader import load_tokenizer

    tokenizer = load_tokenizer(thinking_model)
    opens, closes = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    qwen3, r1 = ThinkReasoningParser(False, tokenizer), ThinkReasoningParser(True, tokenizer)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert r1.reasoning_end(ids("<|assistant|>\n<think>\n")) == ReasoningEnd(closes, False, None)
    assert qwen3.reasoning_end(ids("<|assistant|>\n<think>\n")) == ReasoningEnd(closes, False, None)  # opened
    assert qwen3.reasoning_end(ids("<|assistant|>\n<think>\n\n</think>\n\n")) == ReasoningEnd(closes, True, opens)
    assert qwen3.reasoning_end(ids("<think>a</think>b\n<|user|>\nmore\n<|assistant|>\n")) == \
        ReasoningEnd(closes, False, opens)
    assert ThinkReasoningParser(False, load_tokenizer(tiny_model)).reasoning_end(ids("<think>\n")) is None
    typed = ids("<|user|>\nWhy ") + ids("<th") + ids("ink>") + ids("?\n<|assistant|>\n")  # text, not the token
    assert THINK_START in tokenizer.decode(typed) and opens not in typed
    assert qwen3.reasoning_end(typed) == ReasoningEnd(closes, False, opens)
    assert qwen3.stream(typed).feed("an answer", True) == ("", "an answer")  # not opened: content
    assert r1.stream(ids("<|assistant|>\n<think>\n\n</think>\n\n")).feed("an answer", True) == ("", "an answer")


def test_thinking_is_off_where_at_most_8_space_tokens_follow_the_prompts_closed_block(thinking_model: Path) -> None:
    """MAX_SPACE_TOKENS: a closing marker followed by up to 8 tokens of nothing but space (a template's "\n\n") is
    thinking off; by 9 it is an earlier turn's. A prompt of space alone, without a marker, closed no block."""
    from infer.core.loader import load_tokenizer
    from infer.plugins.reasoning_parsers import CLOSED, OPENED

    tokenizer = load_tokenizer(thinking_model)
    opens, closes = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    [space] = tokenizer.encode("\n", add_special_tokens=False)
    [word] = tokenizer.encode("a", add_special_tokens=False)
    qwen3 = ThinkReasoningParser(False, tokenizer)
    for after, state in ((0, CLOSED), (1, CLOSED), (8, CLOSED), (9, None), (12, None)):
        prompt = [word, opens, word, closes] + [space] * after
        assert qwen3.prompt_state(prompt) == state, after
        assert qwen3.reasoning_end(prompt) == ReasoningEnd(closes, state == CLOSED, opens), after
        assert qwen3.stream(prompt).feed("<think>x</think>y", True) == (
            ("", "<think>x</think>y") if state == CLOSED else ("x", "y")), after  # thinking off: all content
    for prompt in ([], [space], [space] * 3):
        assert qwen3.prompt_state(prompt) is None and qwen3.reasoning_end(prompt) == ReasoningEnd(closes, False, opens)
    assert qwen3.prompt_state([word, opens] + [space] * 9) == OPENED


def test_a_deepseek_r1_reply_needs_no_think_of_its_own_whatever_the_prompt_shows(thinking_model: Path) -> None:
    """deepseek-r1's template opens the block, so its reply reasons from its first token: its structured output
    waits for the reply's </think> with no open_token, where the prompt's end shows the <think> or not (a template
    that leaves it out, an earlier turn's block); qwen3's reply opens the block itself there."""
    from infer.core.loader import load_tokenizer

    tokenizer = load_tokenizer(thinking_model)
    opens, closes = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    for text in ("<|user|>\nHi\n<|assistant|>\n", "<think>a</think>b\n<|user|>\nmore\n<|assistant|>\n"):
        prompt = tokenizer.encode(text, add_special_tokens=False)
        assert ThinkReasoningParser(True, tokenizer).reasoning_end(prompt) == ReasoningEnd(closes, False, None)
        assert ThinkReasoningParser(False, tokenizer).reasoning_end(prompt) == ReasoningEnd(closes, False, opens)


def test_markers_the_tokenizer_marks_special_are_none_to_follow(tiny_model: Path) -> None:
    """A tokenizer whose <think> and </think> are special tokens leaves them out of the text, so the shipped
    parsers cannot follow them (docs/plugin-hooks.md: they answer where the markers stay in the text): no
    reasoning_end, and the prompt's markers say nothing."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizer.add_special_tokens({"additional_special_tokens": [THINK_START, THINK_END]})
    opens, closes = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    for opened_in_prompt in (False, True):
        parser = ThinkReasoningParser(opened_in_prompt, tokenizer)
        for prompt in ([5, opens], [5, opens, 6, closes]):
            assert parser.reasoning_end(prompt) is None and parser.prompt_state(prompt) is None, prompt


# ---------------------------------------------------------------- splitting as the reply streams
def reference_split(text: str, prompt: str | None, opened_in_prompt: bool) -> tuple[str | None, str]:
    """The stream's rules (plugins/reasoning_parsers.py's docstring) by way of the tested ``split``: after an
    opened block a reply reasons as DeepSeek-R1's does, after a closed one it is content; else as ``split``, but a
    qwen3 reply that does not open a block itself is content even where it closes one."""
    if prompt == "closed":
        return None, text
    if prompt == "opened" or opened_in_prompt:
        return ThinkReasoningParser(opened_in_prompt=True).split(text)
    return ThinkReasoningParser(False).split(text) if text.lstrip().startswith(THINK_START) else (None, text)


def test_a_stream_splits_by_the_rules_whatever_the_chunks() -> None:
    """Random replies cut into random chunks: joined, the stream's parts are the reference split; after each chunk
    it holds back no more than a marker's start (or space before a first <think>)."""
    from infer.plugins.reasoning_parsers import CLOSED, CONTENT, OPENED, START, ThinkStream

    rng = random.Random(1)
    pieces = ["<think>", "</think>", "<th", "ink>", "</", "a", " ", "\n", "<", "think", ">", "/", "é"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(14)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for opened_in_prompt in (False, True):
            for prompt in (None, OPENED, CLOSED):
                stream = ThinkStream(CONTENT) if prompt == CLOSED else \
                    ThinkStream(START, reasons_unopened=opened_in_prompt or prompt == OPENED)
                reasoning, content, fed = "", "", ""
                for index, chunk in enumerate(chunks):
                    final = index == len(chunks) - 1
                    r, c = stream.feed(chunk, final)
                    reasoning, content, fed = reasoning + r, content + c, fed + chunk
                    if not final:
                        whole_r, whole_c = reference_split(fed, prompt, opened_in_prompt)
                        held = len(whole_r or "") + len(whole_c) - len(reasoning) - len(content)
                        assert whole_c.startswith(content) and (whole_r or "").startswith(reasoning), (fed, chunks)
                        assert held < len(THINK_END) or THINK_START.startswith(fed.lstrip()), (fed, chunks)
                want = reference_split(text, prompt, opened_in_prompt)
                got = (reasoning if stream.reasoned else None, content)
                assert got == want, (text, chunks, prompt, opened_in_prompt)


@pytest.mark.parametrize("parser, generation", [
    ("deepseek-r1", "<think>\n"), ("qwen3", "<think>\n"),  # the template opened the block: the reply reasons
    ("qwen3", ""),  # it did not, and the reply does not open one: all content, the </think> it writes too
])
def test_outputs_are_split_as_they_stream(thinking_model: Path, tmp_path: Path, serve_engine: Any, parser: str,
                                          generation: str) -> None:
    """Each output of a chat's reply carries the reasoning and content of its text: joined, they are the reply's
    split (the reference: the stream's rules over the whole text), and the last output's reasoning_content and
    content; no more than a marker's start is held back at any output. So over gRPC, streamed and unary."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    template = tmp_path / "chat.jinja"
    template.write_text("{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n"
                        + generation)
    engine = Engine(EngineConfig(model=str(thinking_model), device="cpu", num_kv_blocks=64,
                                 chat_template=str(template), reasoning_parser=parser))
    closes = engine.tokenizer.convert_tokens_to_ids(THINK_END)
    for close_bias in (0.5 * c for c in range(60)):  # a reply that writes </think> between other tokens
        params = SamplingParams(max_tokens=16, temperature=0.0, logit_bias=[(closes, close_bias)])
        [out] = engine.generate([ChatPrompt.of(ASK)], params)[0].outputs
        if closes in out.token_ids[1:10] and out.token_ids.count(closes) < 4:
            break
    else:
        pytest.fail("no bias makes the reply write </think>")
    want = reference_split(out.text, "opened" if generation else None, parser == "deepseek-r1")
    assert (out.reasoning_content, out.content) == want and (want[0] is None) == (generation == "")
    chat = CliRunner().invoke(main, ["--model", str(thinking_model), "--num-kv-blocks", "64", "--chat-template",
                                     str(template), "--reasoning-parser", parser, "chat", "--max-tokens", "16",
                                     "--temperature", "0", "--logit-bias", f"{closes}={close_bias}"],
                              input=ASK[0]["content"] + "\n")  # infer chat: the content out, the reasoning apart
    assert (chat.exit_code, chat.stdout, chat.stderr) == (0, want[1] + "\n", want[0] + "\n" if want[0] else ""), \
        chat.output
    for n, stop in ((1, []), (2, ["never written"])):  # one sequence, and several with stop strings
        deltas = list(engine.stream(ChatPrompt.of(ASK), dataclasses.replace(params, n=n, stop=stop)))
        for index in range(n):
            parts = [c for d in deltas for c in d.outputs if c.index == index]
            assert ("".join(c.reasoning_text for c in parts), "".join(c.content_text for c in parts)) == \
                (want[0] or "", want[1])
            assert (parts[-1].reasoning_content, parts[-1].content) == want
            for k in range(1, len(parts)):
                text = "".join(c.text for c in parts[:k])
                dropped = len(THINK_START) * text.lstrip().startswith(THINK_START) + len(THINK_END) * (
                    want[0] is not None and THINK_END in text)
                split = sum(len(c.reasoning_text) + len(c.content_text) for c in parts[:k])
                assert len(text) - dropped - split < len(THINK_END), (k, text)

    for held in (" ", "<"):  # a reply cut while its start is held back (space, a <think>'s start): its last output
        [token] = engine.tokenizer.encode(held, add_special_tokens=False)
        one = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=[(token, 100.0)])
        parts = [c for d in engine.stream(ChatPrompt.of(ASK), one) for c in d.outputs]
        whole = reference_split(held, "opened" if generation else None, parser == "deepseek-r1")
        assert ("".join(c.text for c in parts), "".join(c.reasoning_text for c in parts),
                "".join(c.content_text for c in parts)) == (held, whole[0] or "", whole[1])

    # a stop string that ends the reply while its start is held back: the held text is the reply's last
    lt, xt = (engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<", "x"))
    for x_bias in (40 + 0.25 * k for k in range(80)):
        stopped = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=[(lt, 50.0), (xt, x_bias)])
        if engine.generate([ChatPrompt.of(ASK)], stopped)[0].outputs[0].token_ids[:2] == [lt, xt]:
            break
    else:
        pytest.fail("no bias makes the reply '<x'")
    whole = reference_split("<", "opened" if generation else None, parser == "deepseek-r1")
    for n in (1, 2):
        deltas = list(engine.stream(ChatPrompt.of(ASK), dataclasses.replace(stopped, n=n, stop=["x"])))
        for index in range(n):
            parts = [c for d in deltas for c in d.outputs if c.index == index]
            assert ("".join(c.reasoning_text for c in parts), "".join(c.content_text for c in parts)) == \
                (whole[0] or "", whole[1]) and (parts[-1].reasoning_content, parts[-1].content) == whole

    async def test(client: Any, port: int) -> None:
        messages = [m async for m in client.generate(ChatPrompt.of(ASK), params)]
        assert all(c.HasField("reasoning_text") and c.HasField("content_text") for m in messages for c in m.outputs)
        streamed = ("".join(c.reasoning_text for m in messages for c in m.outputs),
                    "".join(c.content_text for m in messages for c in m.outputs))
        done = (await client.complete(ChatPrompt.of(ASK), params)).outputs[0]
        assert streamed == (done.reasoning_text, done.content_text) == (want[0] or "", want[1])
        assert (done.reasoning_content if done.HasField("reasoning_content") else None, done.content) == want

    serve_engine(engine, test)


def test_a_misbehaving_stream_is_a_plugin_error_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    """stream() that returns no ReasoningStream fails the request at admission, leaving nothing queued; a stream
    whose feed() returns no pair, or raises, fails it while it runs."""
    from infer.core.interfaces import ReasoningStream

    class Stream(ReasoningStream):
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        @property
        def reasoned(self) -> bool:
            return False

        def feed(self, text: str, final: bool) -> Any:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    class Parser(ReasoningParser):
        def __init__(self, stream: Any) -> None:
            self.answer = stream

        def split(self, text: str) -> tuple[str | None, str]:
            return None, text

        def stream(self, prompt_token_ids: Any) -> Any:
            return self.answer

    for name, answer, error in (
            ("not-a-stream", "a string", r"stream\(\) of the reasoning parser 'not-a-stream' from "
                                         r"'not-a-stream-reasoning' returned 'a string', "
                            r"not None or a ReasoningStream"),
            ("not-a-pair", Stream(("only reasoning",)),
             r"reasoning stream of 'not-a-pair' from 'not-a-pair-reasoning' returned \('only reasoning',\), not "),
            ("raises", Stream(ValueError("bad state")),
             r"reasoning stream of 'raises' from 'raises-reasoning' raised ValueError: bad state")):
        engine = engine_with_parser(tiny_model, tmp_path, name, Parser(answer))
        with pytest.raises(PluginError, match=error):
            engine.generate([ChatPrompt.of(ASK)], SamplingParams(max_tokens=3))
        assert not engine.has_unfinished()
        [plain] = engine.generate(["not a chat"], SamplingParams(max_tokens=3))  # not split: the engine serves on
        assert plain.outputs[0].reasoning_text is None and len(plain.outputs[0].token_ids) == 3


def test_a_structured_reply_whose_grammar_held_from_its_first_token_streams_as_content(thinking_model: Path,
                                                                                       tmp_path: Path) -> None:
    """qwen3 on a prompt that leaves the block to the reply, whose first token is not <think>: the grammar holds
    from it, and the reply is all content, as it streams too, though its text begins with "<think>"."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    template = tmp_path / "chat.jinja"
    template.write_text("{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n")
    engine = Engine(EngineConfig(model=str(thinking_model), device="cpu", num_kv_blocks=64,
                                 chat_template=str(template), reasoning_parser="qwen3"))
    opens, closes = (engine.tokenizer.convert_tokens_to_ids(m) for m in (THINK_START, THINK_END))
    params = SamplingParams(max_tokens=24, temperature=0.0, logit_bias=[(opens, -100.0), (closes, -100.0)],
                            structured_output=StructuredOutput(regex=" <think>[a-z]{2,4}</think>[a-z]{2,4}"))
    parts = [c for d in engine.stream(ChatPrompt.of(ASK), params) for c in d.outputs]
    text = "".join(c.text for c in parts)
    assert text.startswith(" <think>") and opens not in parts[-1].token_ids
    assert (parts[-1].reasoning_content, parts[-1].content) == (None, text)
    assert ("".join(c.reasoning_text for c in parts), "".join(c.content_text for c in parts)) == ("", text)


def test_a_stream_failing_mid_reply_fails_the_step_and_the_other_requests_finish(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    """A feed() that raises in the middle of a reply: step() raises the PluginError; a request that finished in
    that step leaves the engine (its last output is lost with the step: no later step() hands it out), and one
    that a stream reads gets its outputs; aborting the failed request ends it."""
    from infer.core.interfaces import ReasoningStream

    class Flaky(ReasoningStream):
        feeds = 0

        @property
        def reasoned(self) -> bool:
            return False

        def feed(self, text: str, final: bool) -> tuple[str, str]:
            Flaky.feeds += 1
            if Flaky.feeds == 2:
                raise ValueError("bad state")
            return "", text

    class Parser(ReasoningParser):
        def split(self, text: str) -> tuple[str | None, str]:
            return None, text

        def stream(self, prompt_token_ids: Any) -> ReasoningStream:
            return Flaky()

    engine = engine_with_parser(tiny_model, tmp_path, "flaky", Parser())
    engine.add_request(ChatPrompt.of(ASK), SamplingParams(max_tokens=6, ignore_eos=True), "chat")
    engine.add_request("plain", SamplingParams(max_tokens=2, ignore_eos=True), "plain")
    streamed = engine.stream("read", SamplingParams(max_tokens=2, ignore_eos=True), "read")
    outputs = engine.step()  # the prompts, and a first token each
    with pytest.raises(PluginError, match="reasoning stream of 'flaky' from 'flaky-reasoning' raised ValueError: bad "
                                          "state"):
        engine.step()  # the second tokens: the plain and the streamed requests end
    assert [o.request_id for o in outputs] == ["chat", "plain"]
    assert {o.request_id for o in engine.step()} == {"chat"}  # it goes on, unsplit; nothing of the others comes late
    assert list(engine.requests) == ["chat"]
    read = list(streamed)
    assert read[-1].finished and sum(len(o.outputs[0].token_ids) for o in read) == 2
    assert engine.abort("chat").finished and not engine.has_unfinished()
