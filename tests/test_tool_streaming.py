"""Tool calls left out of the content as a reply streams: each output's content_text is its text up to where the
tool parser says a call may begin (``streamed_content``), the rest comes with the last output once ``parse`` has
read the reply, and joined they are the last output's content. The reference: a test parser whose "call" is the
first "e" of the reply, so every reply of the tiny model holds one at a place the test knows."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from infer import (ChatPrompt, FunctionChoice, PluginError, SamplingParams, StructuredOutput, ToolCall,
                   hookimpl)
from infer.cli import main
from infer.core.chat_tools import ParsedReply
from infer.core.interfaces import ReasoningParser, ToolParser
from infer.core.llm import LLM
from infer.core.plugins import PluginManager

TEMPLATE = ("{% if tools %}<|system|>\n{{ tools | tojson }}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
            "{{ m.content }}\n{% endfor %}<|assistant|>\n")
NOTE = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 6}}, "required": ["note"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "rest", "parameters": NOTE}}]
CHAT = [{"role": "user", "content": "def add(a, b):"}]


def from_e(text: str, marker: str = "e") -> ParsedReply:
    """The reply's first ``marker`` is a call of ``rest``, which gets the text from there; the content is the rest."""
    cut = text.find(marker)
    return ParsedReply(text) if cut < 0 else ParsedReply(text[:cut] + text[cut + 1:],
                                                         (ToolCall("rest", {"text": text[cut:]}),))


class FromE(ToolParser):
    """from_e, streaming the text before the marker."""

    marker = "e"

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        return from_e(text, self.marker)

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        cut = text.find(self.marker)
        return len(text) if cut < 0 else cut


class Whole(FromE):
    """As FromE, with the default streamed_content: the content comes whole with the last output."""

    streamed_content = ToolParser.streamed_content


class Raises(FromE):
    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        raise KeyError("no state")


class Overshoots(FromE):
    def streamed_content(self, text: str, token_ids: Sequence[int]) -> Any:
        return len(text) + 1


class Disagrees(FromE):
    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        return len(text)  # all of it, though parse cuts a call out of it


class SplitsWhole(ReasoningParser):
    """A reasoning parser without a stream: the text up to the first "a" is the reasoning."""

    def split(self, text: str) -> tuple[str | None, str]:
        reasoning, a, content = text.partition("a")
        return (reasoning, content) if a else (None, text)


class Shrinks(ToolParser):
    """All content; streamed_content a few characters while the reply is short, then none: an answer below an
    earlier one streams nothing more, and nothing streamed is taken back or sent twice."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        return ParsedReply(text)

    def streamed_content(self, text: str, token_ids: Sequence[int]) -> int:
        return min(len(text), 3) if len(text) < 12 else 0


class BadTags(FromE):
    written_tags = {"<call>": 7}  # backwards: text to id


class EachE(ToolParser):
    """Every "e" of the reply is a call of ``rest`` at its place, and streams once written; the content is the text
    without them, whole with the last output."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        return ParsedReply(text.replace("e", ""), tuple(ToolCall("rest", {"at": at}) for at in e_places(text)))

    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        return text.count("e")


def e_places(text: str) -> list[int]:
    return [at for at, char in enumerate(text) if char == "e"]


class AllButLast(EachE):
    """As EachE, but the last "e" of the reply so far streams only once another follows it (or with the last
    output): fewer calls stream than the reply so far's parse reads."""

    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        return max(text.count("e") - 1, 0)


class RaisesOnCalls(EachE):
    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        raise KeyError("no calls")


class Overcounts(EachE):
    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> int:
        return text.count("e") + 1


class NotACount(EachE):
    def streamed_calls(self, text: str, token_ids: Sequence[int]) -> Any:
        return str(text.count("e"))


class Moves(EachE):
    """Its calls name the length of the text they were read from: a call streamed is not the whole reply's."""

    def parse(self, text: str, token_ids: Sequence[int]) -> ParsedReply:
        read = super().parse(text, token_ids)
        return ParsedReply(read.content, tuple(ToolCall("rest", {**c.arguments, "of": len(text)}) for c in
                                               read.tool_calls))


class NoPromptParser(EachE):
    def for_prompt(self, prompt_token_ids: Sequence[int]) -> Any:
        return None


PARSERS = {"from-e": FromE, "whole": Whole, "shrinks": Shrinks, "raises": Raises, "overshoots": Overshoots,
           "disagrees": Disagrees, "bad-tags": BadTags, "each-e": EachE, "all-but-last": AllButLast,
           "raises-on-calls": RaisesOnCalls, "overcounts": Overcounts,
           "not-a-count": NotACount, "moves": Moves, "no-prompt-parser": NoPromptParser}


class Plugin:
    @hookimpl
    def register_tool_parsers(self, register: Any) -> None:
        for name, parser in PARSERS.items():
            register(name, lambda config, tokenizer, parser=parser: parser())

    @hookimpl
    def register_reasoning_parsers(self, register: Any) -> None:
        register("splits-whole", lambda config, tokenizer: SplitsWhole())


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tool-streaming") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def llm_with(model: Path, template: Path, parser: str, **options: Any) -> LLM:
    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="tool-streaming", source="tests")
    return LLM(model=str(model), plugins=plugins, device="cpu", num_kv_blocks=64, chat_template=str(template),
               tool_parser=parser, **options)


def parts_of(deltas: list[Any], index: int = 0) -> list[Any]:
    return [c for d in deltas for c in d.outputs if c.index == index]


def test_content_streams_up_to_the_call_and_joins_into_the_content(tiny_model: Path, template: Path,
                                                                  serve_engine: Any) -> None:
    llm = llm_with(tiny_model, template, "from-e")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = ChatPrompt.of(CHAT, tools=TOOLS)
    [out] = llm.engine.generate([prompt], params)[0].outputs
    cut = out.text.find("e")
    assert 0 < cut < len(out.text) - 4, out.text  # the test's premise: a call mid-reply, content after it
    assert (out.content, out.tool_calls[0].arguments) == (from_e(out.text).content, {"text": out.text[cut:]})
    sampled = dataclasses.replace(params, temperature=1.0, seed=3)  # sequences that differ
    for n, more in ((1, params), (2, dataclasses.replace(sampled, stop=["never written"])), (3, sampled)):
        deltas = list(llm.engine.stream(prompt, dataclasses.replace(more, n=n)))
        texts = ["".join(c.text for c in parts_of(deltas, index)) for index in range(n)]
        assert len(set(texts)) == n
        for index, whole in enumerate(texts):  # each sequence's own reply
            parts = parts_of(deltas, index)
            cut = len(whole) if "e" not in whole else whole.index("e")
            assert len(parts) > 3 and all(c.reasoning_text == "" for c in parts)
            for k in range(1, len(parts)):  # before the last output: the text so far, up to the call
                text = "".join(c.text for c in parts[:k])
                assert "".join(c.content_text for c in parts[:k]) == text[:cut], (k, text)
            assert "".join(c.content_text for c in parts) == parts[-1].content == from_e(whole).content
            assert parts[-1].content_text == whole[cut + 1:]  # the content after the call comes last
    rid = llm.engine.add_request(prompt, dataclasses.replace(params, ignore_eos=True))
    taken: list[Any] = []
    while sum(len(c.text) for c in taken) <= cut + 2:
        taken += [c for d in llm.engine.step() for c in d.outputs]
    taken += llm.engine.abort(rid).outputs  # not read: what was held back is content
    assert "".join(c.content_text for c in taken) == "".join(c.text for c in taken) and taken[-1].content is None

    async def test(client: Any, port: int) -> None:
        messages = [m async for m in client.generate(prompt, max_tokens=24, temperature=0.0)]
        assert all(c.HasField("content_text") for m in messages for c in m.outputs)
        streamed = "".join(c.content_text for m in messages for c in m.outputs)
        done = (await client.complete(prompt, max_tokens=24, temperature=0.0)).outputs[0]
        assert streamed == done.content_text == done.content == out.content and done.reasoning_text == ""

    serve_engine(llm.engine, test)


def test_without_streamed_content_the_content_comes_with_the_last_output(tiny_model: Path, template: Path) -> None:
    """The default streamed_content, and a forced tool_choice (its reply is JSON: all calls, or all content if
    cut): content_text is empty until the last output, which carries the whole content."""
    llm = llm_with(tiny_model, template, "whole")
    for prompt, params in ((ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=12, temperature=0.0)),
                           (ChatPrompt.of(CHAT, tools=TOOLS, tool_choice=FunctionChoice("rest")),
                            SamplingParams(max_tokens=40, temperature=0.0))):
        parts = parts_of(list(llm.engine.stream(prompt, params)))
        assert len(parts) > 3 and all(c.content_text == "" for c in parts[:-1])
        assert parts[-1].content_text == parts[-1].content and parts[-1].tool_calls
    plain = parts_of(list(llm.engine.stream(ChatPrompt.of(CHAT), SamplingParams(max_tokens=4))))  # no tools
    assert all(c.content_text is None and c.reasoning_text is None for c in plain)


def test_content_streamed_is_never_taken_back_by_a_smaller_answer(tiny_model: Path, template: Path) -> None:
    """streamed_content answers less than before once the reply is 12 characters long: each output's content_text
    joined so far is the text up to the largest answer yet (the reference: the contract, over the text so far),
    and with the last output's they are the whole reply, each character once."""
    llm = llm_with(tiny_model, template, "shrinks")
    parts = parts_of(list(llm.engine.stream(ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=24,
                                                                                             temperature=0.0))))
    text, most = "", 0
    for k, part in enumerate(parts[:-1], 1):
        text += part.text
        most = max(most, Shrinks().streamed_content(text, []))
        assert "".join(c.content_text for c in parts[:k]) == text[:most], text
    whole = text + parts[-1].text
    assert len(text) >= 12 and most > 0, whole  # the premise: an answer, then a smaller one
    assert "".join(c.content_text for c in parts) == parts[-1].content == whole


def test_calls_are_cut_out_before_the_reasoning_is_split(thinking_model: Path, tmp_path: Path) -> None:
    """A tool parser and a reasoning parser: the tool parser's content is what the reasoning stream splits, so
    joined the outputs' parts are the last output's reasoning_content and content."""
    from infer.plugins.reasoning_parsers import ThinkReasoningParser

    template = tmp_path / "thinking.jinja"
    template.write_text(TEMPLATE + "<think>\n")
    llm = llm_with(thinking_model, template, "from-e", reasoning_parser="deepseek-r1")
    closes = llm.engine.tokenizer.convert_tokens_to_ids("</think>")
    prompt = ChatPrompt.of(CHAT, tools=TOOLS)
    for bias in (0.5 * k for k in range(60)):  # a reply that closes its reasoning early, and says more after
        params = SamplingParams(max_tokens=24, temperature=0.0, logit_bias=[(closes, bias)])
        [out] = llm.engine.generate([prompt], params)[0].outputs
        reasoning, _, after = out.text.partition("</think>")
        head = len(reasoning) + len("</think>") + 2  # the call's marker: a character first written after this
        if 0 < len(reasoning) < len(after) - 4 and (marker := next((c for c in out.text[head:]
                                                                    if c not in out.text[:head]), None)):
            break
    else:
        pytest.fail("no bias closes the reasoning early")
    llm.engine.intake.tool_parser.marker = marker  # the call begins in the content, its text held back
    want = ThinkReasoningParser(opened_in_prompt=True).split(from_e(out.text, marker).content)
    assert want[0] and want[1] and out.text.find(marker) < len(out.text) - 1
    [out] = llm.engine.generate([prompt], params)[0].outputs
    assert (out.reasoning_content, out.content) == want and out.tool_calls
    parts = parts_of(list(llm.engine.stream(prompt, params)))
    assert ("".join(c.reasoning_text for c in parts), "".join(c.content_text for c in parts)) == want
    assert any(c.reasoning_text for c in parts[:-1]) and any(c.content_text for c in parts[:-1])  # as they came


def test_outputs_are_not_split_beside_a_reasoning_parser_that_splits_whole_replies_only(
        tiny_model: Path, template: Path) -> None:
    llm = llm_with(tiny_model, template, "from-e", reasoning_parser="splits-whole")
    parts = parts_of(list(llm.engine.stream(ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=24,
                                                                                             temperature=0.0))))
    text = "".join(c.text for c in parts)
    assert all(c.content_text is None and c.reasoning_text is None for c in parts)
    assert (parts[-1].reasoning_content, parts[-1].content) == SplitsWhole().split(from_e(text).content)


def test_speculative_outputs_stream_the_same_content(tiny_model: Path, template: Path) -> None:
    """Several tokens per step (the ngram proposer): the outputs' content joins into the same content as without."""
    prompt, params = ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=48, temperature=0.0)
    plain = llm_with(tiny_model, template, "from-e").engine.generate([prompt], params)[0].outputs[0]
    llm = llm_with(tiny_model, template, "from-e", proposer="ngram", num_speculative_tokens=3)
    parts = parts_of(list(llm.engine.stream(prompt, params)))
    assert "".join(c.text for c in parts) == plain.text and llm.engine.stats.spec_accepted > 0
    assert "".join(c.content_text for c in parts) == parts[-1].content == plain.content


@pytest.mark.parametrize("parser, complaint", [
    ("raises", r"the tool parser 'raises' from 'tests' raised KeyError in streamed_content\(\): 'no state'"),
    ("overshoots", r"streamed_content\(\) of the tool parser 'overshoots' from 'tests' returned \d+ for a reply of \d+ "
                   r"characters"),
    ("disagrees", r"the tool parser 'disagrees' from 'tests' streamed .* as the start of the reply's content, but "
                  r"its parse\(\) "
                  r"gave the content .*; fix its streamed_content\(\)"),
    ("raises-on-calls", r"the tool parser 'raises-on-calls' from 'tests' raised KeyError in streamed_calls\(\): "
                        r"'no calls'"),
    ("overcounts", r"streamed_calls\(\) of the tool parser 'overcounts' from 'tests' returned 1 for a reply so far "
                   r"whose parse\(\) reads 0 calls"),
    ("not-a-count", r"streamed_calls\(\) of the tool parser 'not-a-count' from 'tests' returned '\d+', not a count of "
                    r"calls"),
    ("moves", r"the tool parser 'moves' from 'tests' streamed the calls \[ToolCall\(name='rest', arguments="
              r"\{'at': \d+, 'of': \d+\}.* as the reply's first, but its parse\(\) read the calls .*; fix its "
              r"streamed_calls\(\)"),
    ("no-prompt-parser", r"for_prompt\(\) of the tool parser 'no-prompt-parser' from 'tests' returned None, not a "
                         r"ToolParser with the same written_tags"),
])
def test_a_stream_method_that_breaks_its_contract_fails_the_request_naming_it(
        tiny_model: Path, template: Path, parser: str, complaint: str) -> None:
    llm = llm_with(tiny_model, template, parser)
    with pytest.raises(PluginError, match=complaint):
        llm.chat(CHAT, SamplingParams(max_tokens=24, temperature=0.0), tools=TOOLS)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    with pytest.raises(PluginError, match=r"tool parser 'bad-tags': written_tags is \{'<call>': 7\}, not a mapping "
                                          r"of token ids in the vocabulary \(0 to \d+\) to the texts to write"):
        llm_with(tiny_model, template, "bad-tags")


@pytest.fixture(scope="module")
def tagged_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with <tool_call> and </tool_call> as special tokens (so decode, and the engine's text, leave
    them out), their embeddings added by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tagged")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def test_tags_the_tokenizer_marks_special_are_written_out_where_they_stand(tagged_model: Path, template: Path
                                                                         ) -> None:
    """hermes on a tokenizer that marks its tags special: the engine's text lacks them, the parser reads the text
    with them written out where their tokens stand (the reference: HF's decode of the runs between them), and the
    content streams up to the first one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tagged_model)
    opens = tokenizer.convert_tokens_to_ids("<tool_call>")
    llm = LLM(model=str(tagged_model), device="cpu", num_kv_blocks=64, chat_template=str(template),
              tool_parser="hermes")
    assert llm.engine.intake.tool_parser.written_tags[opens] == "<tool_call>"
    prompt = ChatPrompt.of(CHAT, tools=TOOLS)
    for bias in (0.05 * k for k in range(120)):  # a reply that writes the tag between other tokens
        params = SamplingParams(max_tokens=16, temperature=0.0, logit_bias=[(opens, bias)])
        [out] = llm.engine.generate([prompt], params)[0].outputs
        if opens in out.token_ids[1:10] and out.token_ids[0] != opens and out.token_ids.count(opens) < 4:
            break
    else:
        pytest.fail("no bias makes the reply write the tag")
    runs, run = [], []
    for token in out.token_ids:
        if token == opens:
            runs += [tokenizer.decode(run, skip_special_tokens=True), "<tool_call>"]
            run = []
        else:
            run.append(token)
    tagged = "".join(runs) + tokenizer.decode(run, skip_special_tokens=True)
    assert "<tool_call>" not in out.text and out.text == tagged.replace("<tool_call>", "")
    assert (out.content, out.tool_calls) == (tagged, [])  # no JSON after the tag: all content, the tag written out
    parts = parts_of(list(llm.engine.stream(prompt, params)))
    before = tagged[: tagged.index("<tool_call>")].rstrip()
    assert "".join(c.content_text for c in parts[:-1]) == before and before
    assert "".join(c.content_text for c in parts) == tagged


def called(calls: Sequence[ToolCall] | None) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, call.arguments) for call in calls or ()]


def test_calls_stream_once_read_and_join_into_the_last_outputs_calls(tiny_model: Path, template: Path,
                                                                    serve_engine: Any) -> None:
    """Each output carries the calls the parser read since the last one (``streamed_calls``): the reference is the
    text output so far, every "e" of which is a call. Joined they are the last output's calls, ids and all."""
    llm = llm_with(tiny_model, template, "each-e")
    prompt, params = ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=24, temperature=0.0)
    sampled = dataclasses.replace(params, temperature=1.0, seed=3, n=2)
    held = dataclasses.replace(sampled, stop=["e never written"])  # an "e" that ends the text so far is held back
    spec = llm_with(tiny_model, template, "each-e", proposer="ngram", num_speculative_tokens=3)
    for engine, more in ((llm.engine, params), (llm.engine, sampled), (llm.engine, held),
                         (spec.engine, dataclasses.replace(params, max_tokens=48))):
        deltas = list(engine.stream(prompt, more))
        for index in range(more.n):
            parts, text, streamed = parts_of(deltas, index), "", []
            for c in parts[:-1]:
                text += c.text
                streamed += c.new_tool_calls
                assert called(streamed) == [("rest", {"at": at}) for at in e_places(text)], text
            whole = text + parts[-1].text
            assert len(e_places(text)) > 1 and len(e_places(whole)) > len(e_places(text[: len(text) // 2])), whole
            assert streamed + parts[-1].new_tool_calls == parts[-1].tool_calls  # ids too
            assert called(parts[-1].tool_calls) == [("rest", {"at": at}) for at in e_places(whole)]
            assert len({call.id for call in parts[-1].tool_calls}) == len(parts[-1].tool_calls)
    assert spec.engine.stats.spec_accepted > 0
    rid = llm.engine.add_request(prompt, dataclasses.replace(params, ignore_eos=True))
    taken: list[Any] = []
    while not any(c.new_tool_calls for c in taken):
        taken += [c for d in llm.engine.step() for c in d.outputs]
    taken += llm.engine.abort(rid).outputs  # not read: the calls streamed stand, the text is content
    text = "".join(c.text for c in taken)
    assert called([call for c in taken for call in c.new_tool_calls]) == [("rest", {"at": at})
                                                                          for at in e_places(text[: -len(
                                                                              taken[-1].text) or None])]
    assert taken[-1].new_tool_calls == [] and taken[-1].tool_calls is None

    async def test(client: Any, port: int) -> None:
        messages = [m async for m in client.generate(prompt, max_tokens=24, temperature=0.0)]
        streamed = [call for m in messages for c in m.outputs for call in c.new_tool_calls]
        assert any(c.new_tool_calls for m in messages[:-1] for c in m.outputs)
        done = (await client.complete(prompt, max_tokens=24, temperature=0.0)).outputs[0]
        assert [(c.id, c.name, c.arguments) for c in done.new_tool_calls] == \
            [(c.id, c.name, c.arguments) for c in done.tool_calls]
        assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(c.name, json.loads(c.arguments))
                                                                         for c in done.tool_calls]
        assert [json.loads(c.arguments) for c in done.tool_calls] == [{"at": at} for at in e_places(done.text)]
        tools = template.parent / "streamed-tools.json"
        tools.write_text(json.dumps(TOOLS))
        result = await asyncio.to_thread(CliRunner().invoke, main, [
            "client", CHAT[0]["content"], "--target", f"127.0.0.1:{port}", "--chat", "--tools", str(tools),
            "--max-tokens", "24", "--temperature", "0"])
        assert result.exit_code == 0, result.output  # each call listed once, as it streams or with the last
        listed = re.findall(r"infer: tool call (\S+): rest\((.*)\)\n", result.stderr)
        assert [json.loads(arguments) for _, arguments in listed] == [{"at": at} for at in e_places(done.text)]
        assert len({id_ for id_, _ in listed}) == len(listed)

    serve_engine(llm.engine, test)


def test_no_more_calls_stream_than_streamed_calls_says(tiny_model: Path, template: Path) -> None:
    """Where parse reads more calls out of the reply so far than streamed_calls counts, only those counted stream
    (the reference: every "e" of the text so far but its last); the last output carries the rest, ids kept."""
    llm = llm_with(tiny_model, template, "all-but-last")
    parts = parts_of(list(llm.engine.stream(ChatPrompt.of(CHAT, tools=TOOLS), SamplingParams(max_tokens=24,
                                                                                             temperature=0.0))))
    text, streamed = "", []
    for c in parts[:-1]:
        text += c.text
        streamed += c.new_tool_calls
        assert called(streamed) == [("rest", {"at": at}) for at in e_places(text)[:-1]], text
    assert len(e_places(text)) > 2 and streamed  # the premise: calls streamed, one held back
    assert streamed + parts[-1].new_tool_calls == parts[-1].tool_calls
    assert called(parts[-1].tool_calls) == [("rest", {"at": at}) for at in e_places(text + parts[-1].text)]


FORMATS = {  # a reply of the calls in a shipped parser's format, and how many of them a text so far has finished
    "hermes": (lambda calls: "Hi.\n" + "".join(f'<tool_call>{json.dumps({"name": c.name, "arguments": c.arguments})}'
                                              "</tool_call>" for c in calls), lambda text: text.count("</tool_call>")),
    "mistral": (lambda calls: "Hi." + "".join(f"[TOOL_CALLS]{c.name}[ARGS]{json.dumps(c.arguments)}" for c in calls),
                lambda text: max(text.count("[TOOL_CALLS]") - 1, 0)),  # one finishes where the next begins
}


@pytest.mark.parametrize("parser", FORMATS)
def test_the_shipped_parsers_stream_each_call_once_it_is_finished(tiny_model: Path, template: Path, parser: str
                                                                  ) -> None:
    """hermes and mistral end to end on a reply a regex forces into their format: each call comes in the first
    output whose text finishes it (the reference: the text so far), before the reply ends."""
    calls = [ToolCall("rest", {"note": "a"}), ToolCall("rest", {"note": "b c"}), ToolCall("rest", {"note": "d"})]
    written, finished = FORMATS[parser]
    reply = written(calls)
    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=64, chat_template=str(template),
              tool_parser=parser)
    params = SamplingParams(max_tokens=len(reply) + 8, temperature=0.0, structured_output=StructuredOutput(
        regex=re.escape(reply)))
    parts = parts_of(list(llm.engine.stream(ChatPrompt.of(CHAT, tools=TOOLS), params)))
    text, streamed = "", []
    for c in parts:
        text += c.text
        streamed += c.new_tool_calls
        assert called(streamed) == called(calls[: finished(text) if c is not parts[-1] else 3]), text
    assert text == reply and parts[-1].content == "Hi." and streamed == parts[-1].tool_calls
    assert any(c.new_tool_calls for c in parts[:-1])  # the first call before the last output


def test_infer_chat_lists_each_call_once_as_it_streams(tiny_model: Path, template: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`infer chat --tools` lists every call of the reply once, in order (those that streamed are not listed again
    with the last output), and prints the content."""
    import sys

    llm = llm_with(tiny_model, template, "each-e")
    monkeypatch.setattr(sys.modules["infer.cli.main"], "build_engine", lambda ctx: llm.engine)
    tools = template.parent / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    [out] = llm.chat(CHAT, SamplingParams(max_tokens=24, temperature=0.0), tools=TOOLS)[0].outputs
    result = CliRunner().invoke(main, ["chat", "--tools", str(tools), "--max-tokens", "24", "--temperature", "0"],
                                input=f"{CHAT[0]['content']}\n")
    assert result.exit_code == 0, result.output
    listed = re.findall(r"infer: tool call (\S+): rest\(\{\"at\": (\d+)\}\)", result.stderr)
    assert [int(at) for _, at in listed] == e_places(out.text) and len({id_ for id_, _ in listed}) == len(listed) > 1
    assert result.stdout == out.content + "\n"  # one line: a call listed after it does not add another
