"""Logits processors (``register_logits_processors``, ``SamplingParams.logits_processors``): the shipped
``no-repeat-ngram`` against HF transformers' NoRepeatNGramLogitsProcessor, beside unprocessed requests, under async
scheduling and speculative decoding; and the contract the engine holds a third party's processor to."""
from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import ConfigError, InvalidRequestError, PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import LogitsProcessor, ProcessorRow
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams

PROMPTS = [[5, 17, 300, 42, 7, 99, 512, 3], [900, 12, 8, 8, 41], [3, 3, 3]]


def hf_processed_greedy(path: Path, prompt: list[int], processor: Any, max_new_tokens: int) -> list[int]:
    """Greedy decoding with a transformers logits processor on each step's scores (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            scores = processor(ids, model(ids).logits[:, -1].float())
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def hf_no_repeat_greedy(path: Path, prompt: list[int], size: int, max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' own NoRepeatNGramLogitsProcessor."""
    from transformers import NoRepeatNGramLogitsProcessor

    return hf_processed_greedy(path, prompt, NoRepeatNGramLogitsProcessor(size), max_new_tokens)


def no_repeat(size: int, **params: Any) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                          logits_processors={"no-repeat-ngram": {"size": size}}, **params)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_repeat_ngram_generates_what_transformers_does(size: int, tiny_model: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    outputs = engine.generate(PROMPTS, no_repeat(size))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_no_repeat_greedy(tiny_model, prompt, size, 24)


def test_bad_words_generates_what_transformers_does(tiny_model: Path, hf_greedy: Any) -> None:
    """Words of one, two and three tokens taken from the plain greedy output (so that they would occur), against
    transformers' NoBadWordsLogitsProcessor (HF's bad_words_ids)."""
    from transformers import NoBadWordsLogitsProcessor

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    for prompt in PROMPTS:
        plain = hf_greedy(tiny_model, prompt, 16)
        words = [plain[3:4], plain[6:8], [prompt[-1], *plain[:2]]]
        [output] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                            logits_processors={"bad-words": {"token_ids": words}}))
        expected = hf_processed_greedy(tiny_model, prompt, NoBadWordsLogitsProcessor(words), 16)
        assert output.outputs[0].token_ids == expected != plain


def test_bad_words_given_as_text_ban_both_spellings(tiny_model: Path, hf_greedy: Any) -> None:
    """Text words, as vLLM's bad_words: each tokenized as written and after a space, both banned (transformers'
    NoBadWordsLogitsProcessor given those token sequences is the reference)."""
    from transformers import AutoTokenizer, NoBadWordsLogitsProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    plain = hf_greedy(tiny_model, PROMPTS[0], 16)
    words = [tokenizer.decode(plain[:1]).strip(), tokenizer.decode(plain[2:4]).strip()]  # as the output spells them
    sequences = [ids for word in words for form in (word, " " + word)
                 if (ids := tokenizer.encode(form, add_special_tokens=False))]
    [output] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                            logits_processors={"bad-words": {"words": words}}))
    expected = hf_processed_greedy(tiny_model, PROMPTS[0], NoBadWordsLogitsProcessor(sequences), 16)
    assert output.outputs[0].token_ids == expected != plain


def test_allowed_tokens_samples_only_those(tiny_model: Path) -> None:
    """Greedy: the model's argmax over the allowed tokens alone (transformers' logits, the others set to -inf);
    sampled at temperature 1: no other token ever."""
    allowed = [7, 100, 250, 311, 512]

    class OnlyThese:
        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            keep = torch.full_like(scores, float("-inf"))
            keep[:, allowed] = 0.0
            return scores + keep

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    calls = {"allowed-tokens": {"token_ids": allowed}}
    [greedy] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                            logits_processors=calls))
    assert greedy.outputs[0].token_ids == hf_processed_greedy(tiny_model, PROMPTS[0], OnlyThese(), 12)
    [sampled] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                                                             logits_processors=calls))
    assert set(sampled.outputs[0].token_ids) <= set(allowed) and len(set(sampled.outputs[0].token_ids)) > 1


@pytest.mark.parametrize(("name", "args", "message"), [
    ("bad-words", {"token_ids": [5]}, "each a list of 1 to 64 token ids"),
    ("bad-words", {"token_ids": [[]]}, "each a list of 1 to 64 token ids"),
    ("bad-words", {"token_ids": [[1, -2]]}, "integers >= 0"),
    ("bad-words", {"words": [[1]]}, 'takes "token_ids": 1 to 1024 words'),
    ("bad-words", {"words": [""]}, "non-empty strings"),
    ("bad-words", {}, 'takes "token_ids"'),
    ("bad-words", {"token_ids": [[1]], "text": "x"}, 'takes "token_ids"'),
    ("allowed-tokens", {"token_ids": []}, "1 to 131072 token ids"),
    ("allowed-tokens", {"token_ids": [1.5]}, "integers >= 0"),
])
def test_the_token_list_processors_refuse_bad_arguments(name: str, args: dict[str, Any], message: str,
                                                        tiny_model: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    with pytest.raises(InvalidRequestError, match=f"logits processor '{name}': .*{message}"):
        engine.check_request("x", SamplingParams(logits_processors={name: args}))


@pytest.mark.parametrize("options", [{"async_scheduling": True}, {"proposer": "ngram", "num_speculative_tokens": 3}],
                         ids=["async-scheduling", "speculative"])
def test_processed_and_plain_requests_share_batches(options: dict[str, Any], tiny_model: Path,
                                                    hf_greedy: Any) -> None:
    """A processed request beside plain ones in every step: each gets its own reference (HF with the processor,
    HF without), under async scheduling (the processor sees the token read back in the step before) and beside
    speculating sequences (a processed one does not speculate: drafts would skip its processor)."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options))
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, [no_repeat(2), plain, no_repeat(3)])
    assert outputs[0].outputs[0].token_ids == hf_no_repeat_greedy(tiny_model, PROMPTS[0], 2, 24)
    assert outputs[1].outputs[0].token_ids == hf_greedy(tiny_model, PROMPTS[1], 24)
    assert outputs[2].outputs[0].token_ids == hf_no_repeat_greedy(tiny_model, PROMPTS[2], 3, 24)


def test_sampled_forks_never_repeat_a_token_and_the_state_goes_with_them(tiny_model: Path) -> None:
    """n = 4 seeded samples at temperature 0.7 (where the tiny model repeats itself) under size 1: no token twice in
    any of them, nor one of the prompt's; each finished sequence's state is released."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    [output] = engine.generate([PROMPTS[1]], SamplingParams(
        max_tokens=40, temperature=0.7, seed=5, n=4, ignore_eos=True,
        logits_processors={"no-repeat-ngram": {"size": 1}}))
    for completion in output.outputs:
        assert len(set(completion.token_ids)) == 40 and not set(completion.token_ids) & set(PROMPTS[1])
    assert engine.processors.built["no-repeat-ngram"].seen == {}


@pytest.mark.parametrize(("given", "kept"), [
    ("no-repeat-ngram", (("no-repeat-ngram", "{}"),)),
    (["a", ("b", {"size": 2, "x": [1, None]})], (("a", "{}"), ("b", '{"size":2,"x":[1,null]}'))),
    ({"b": {"y": 1, "x": 2}, "a": None}, (("b", '{"x":2,"y":1}'), ("a", "{}"))),
    ([("a", '{"size": 2, "b": [1]}')], (("a", '{"b":[1],"size":2}'),)),  # JSON text (gRPC's) kept as a dict's
    (None, ()),
])
def test_the_forms_a_request_names_processors_in(given: Any, kept: tuple[tuple[str, str], ...]) -> None:
    params = SamplingParams(logits_processors=given)
    params.validate()
    assert params.logits_processors == kept and hash(params) == hash(SamplingParams(logits_processors=kept))


@pytest.mark.parametrize(("given", "message"), [
    ([("a", {"x": float("nan")})], "must be names, \\(name, args\\) pairs"),
    ([("a", '[1, 2]')], "the arguments of logits processor 'a' must be a JSON object"),
    ([("a", "{")], "the arguments of logits processor 'a' must be a JSON object"),
    (["a", "a"], "names a processor twice"),
    ([f"p{i}" for i in range(9)], "at most 8 processors"),
    ([("", {})], "must be names"),
    (42, "must be names"),
])
def test_malformed_processor_lists_are_refused(given: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(logits_processors=given).validate()


class Recording(LogitsProcessor):
    """Bans token 0 (+ ``args["also"]``), and keeps what it was handed."""

    def __init__(self, result: str = "ok") -> None:
        self.result, self.rows, self.released = result, [], []

    def check(self, args: Mapping[str, Any]) -> None:
        if "bad" in args:
            raise InvalidRequestError("no bad arguments")

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        self.rows.append([(row.seq_id, list(row.token_ids), row.num_prompt_tokens, dict(row.args)) for row in rows])
        if self.result == "raise":
            raise RuntimeError("processor failed")
        if self.result == "shape":
            return logits[:, :-1]
        if self.result == "ban all":
            return logits.fill_(float("-inf"))
        logits[:, 0] = float("-inf")
        for i, row in enumerate(rows):
            logits[i, row.args.get("also", 0)] = float("-inf")
        return logits

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def engine_with(processor: LogitsProcessor, tiny_model: Path, **options: Any) -> Engine:
    import types

    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("acme_processors")
    module.register_logits_processors = hookimpl(
        lambda register: register("recording", lambda config, tokenizer: processor))
    plugins.register(module, name="acme", source="infer-plugin-acme")
    return Engine(EngineConfig(model=str(tiny_model), device="cpu", **options), plugins)


def test_a_processor_gets_each_rows_tokens_and_arguments_and_its_bans_hold(tiny_model: Path) -> None:
    """Rows come in batch order with the sequence's tokens so far and its request's arguments; processors chain in
    each request's order (the shipped one, then this one); the tokens they ban never come out."""
    processor = Recording()
    engine = engine_with(processor, tiny_model)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.generate([PROMPTS[0]], plain)[0].outputs[0].token_ids
    calls = {"no-repeat-ngram": {"size": 1}, "recording": {"also": first[0]}}
    outputs = engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                           logits_processors=calls), plain])
    got = outputs[0].outputs[0].token_ids
    assert first[0] not in got and 0 not in got and len(set(got)) == 4 and not set(got) & set(PROMPTS[0])
    assert outputs[1].outputs[0].token_ids == engine.generate([PROMPTS[1]], plain)[0].outputs[0].token_ids
    assert len(processor.rows) == 4 and all(len(step) == 1 for step in processor.rows)
    for step, [(seq_id, tokens, prompt_len, args)] in enumerate(processor.rows):
        assert tokens == PROMPTS[0] + got[:step] and prompt_len == len(PROMPTS[0]) and args == {"also": first[0]}
    assert processor.released == [processor.rows[0][0][0]]


def test_a_processors_errors_name_it(tiny_model: Path) -> None:
    with pytest.raises(InvalidRequestError, match="logits processor 'recording': no bad arguments"):
        engine_with(Recording(), tiny_model).generate(["x"],
                                                      SamplingParams(logits_processors={"recording": {"bad": 1}}))
    with pytest.raises(PluginError, match="the logits processor 'recording' from 'infer-plugin-acme' raised "
                                          "RuntimeError: processor failed"):
        engine_with(Recording("raise"), tiny_model).generate(["x"], SamplingParams(logits_processors=["recording"]))
    with pytest.raises(PluginError, match=r"logits processor 'recording': apply\(\) returned torch.float32 \(1, \d+\) "
                                          r"on cpu, not the torch.float32 \(1, \d+\) on cpu it was given"):
        engine_with(Recording("shape"), tiny_model).generate(["x"], SamplingParams(logits_processors=["recording"]))



def test_a_processor_that_bans_every_token_yields_with_a_warning(tiny_model: Path, caplog: Any) -> None:
    """A processor that leaves a row no token (a soft preference against a hard constraint, or a bug) yields: the
    row is sampled as without it, a warning names it once, and the other requests go on."""
    import logging

    engine = engine_with(Recording("ban all"), tiny_model)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [output.outputs[0].token_ids for output in engine.generate(["x", "y"], plain)]
    with caplog.at_level(logging.WARNING, logger="infer"):
        outputs = engine.generate(["x", "y"], [dataclasses.replace(plain, logits_processors=["recording"]), plain])
    assert [output.outputs[0].token_ids for output in outputs] == expected
    warned = [r.getMessage() for r in caplog.records]
    assert sum("its logits processors (recording) banned every token" in m for m in warned) == 1
    assert not any("hold NaN" in m for m in warned)


def test_unknown_processors_are_refused_with_the_choices(tiny_model: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    with pytest.raises(InvalidRequestError, match="unknown logits processor 'no-repeat-ngrams' \\(did you mean "
                                                  "'no-repeat-ngram'\\?\\); registered: allowed-tokens, bad-words, "
                                                  "no-repeat-ngram"):
        engine.add_request("x", SamplingParams(logits_processors=["no-repeat-ngrams"]))
    with pytest.raises(InvalidRequestError, match='no-repeat-ngram\': takes {"size": n}'):
        engine.check_request("x", SamplingParams(logits_processors={"no-repeat-ngram": {"size": 65}}))
    assert not engine.has_unfinished()


def test_plugin_refuses_a_processor_name() -> None:
    plugins = PluginManager.from_entry_points()
    with pytest.raises(ConfigError, match="'no-repeat-ngram' is a logits processor, which each request chooses"):
        plugins.resolve_plugin_names(EngineConfig(), ["no-repeat-ngram"])


def test_the_arguments_reach_processors_as_json_values() -> None:
    params = SamplingParams(logits_processors={"a": {"n": 1, "list": [1.5, "x"], "flag": True}})
    assert json.loads(params.logits_processors[0][1]) == {"n": 1, "list": [1.5, "x"], "flag": True}


def test_the_tutorials_logits_processor_runs_as_written(tiny_model: Path, hf_greedy: Any) -> None:
    """docs/writing-a-plugin.md's ban-token example, executed as a plugin module: the banned token never comes out,
    and its greedy output is transformers' with that token's logit at -inf."""
    from conftest import tutorial_plugins

    plugins = tutorial_plugins("class BanToken", "ban-token")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), plugins)
    banned = hf_greedy(tiny_model, PROMPTS[0], 1)[0]

    class Ban:
        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores.index_fill(1, torch.tensor([banned]), float("-inf"))

    [output] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                            logits_processors={"ban-token": {"token_id": banned}}))
    assert output.outputs[0].token_ids == hf_processed_greedy(tiny_model, PROMPTS[0], Ban(), 8)
    assert banned not in output.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="logits processor 'ban-token': takes"):
        engine.check_request("x", SamplingParams(logits_processors={"ban-token": {"token_id": -1}}))



class Scaled(LogitsProcessor):
    """Multiplies the logits by the engine-wide ``factor`` its factory read from ``plugin_options``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        return logits * self.factor


def test_a_processor_declares_engine_wide_options_as_any_component_does(tiny_model: Path) -> None:
    """register(..., options=...) serves logits processors too: `--plugin-option scaled.factor=V` reaches the
    factory (read_plugin_options), a bad value or key is a ConfigError when the engine is built, before any
    request, and the option's value acts on the requests that name the processor (a negative factor turns greedy
    decoding into picking the least likely token)."""
    from infer.core.plugin_options import PluginOption, read_plugin_options

    declared = {"factor": PluginOption(1.0, "what the logits are multiplied by", kind=float)}
    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("acme_scaled")
    module.register_logits_processors = hookimpl(lambda register: register(
        "scaled", lambda config, tokenizer: Scaled(read_plugin_options(config, "scaled", declared)["factor"]),
        options=declared))
    plugins.register(module, name="acme", source="infer-plugin-acme")
    for bad, message in (({"factor": "x"}, "scaled.factor"), ({"factr": 2.0}, "did you mean scaled.factor")):
        with pytest.raises(ConfigError, match=message):
            Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32,
                                plugin_options={"scaled": bad}), plugins)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32,
                                 plugin_options={"scaled": {"factor": -1.0}}), plugins)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logits_processors=["scaled"])
    assert engine.generate([PROMPTS[0]], params)[0].outputs[0].token_ids == \
        hf_processed_greedy(tiny_model, PROMPTS[0], lambda ids, scores: scores * -1.0, 3)
