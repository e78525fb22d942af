"""Logits processors, second look: what the first tests left unpinned. References are transformers' own processors
and model (bias, then NoRepeatNGramLogitsProcessor, greedy), the documented contracts (a processor is built once,
a processor's bans hold under a structured output, a row with a NaN logit has no token, logprobs stay the model's),
and the argument rules of SamplingParams, no-repeat-ngram, the gRPC proto and the CLI."""
from __future__ import annotations

import json
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError, PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import LogitsProcessor, ProcessorRow
from infer.core.plugins import PluginManager
from infer.core.request import MAX_LOGITS_PROCESSORS, MAX_PROCESSOR_ARGS_CHARS, SamplingParams, StructuredOutput
from infer.plugins.logits_processors import MAX_NGRAM, NoRepeatNgram

PROMPT = [5, 17, 300, 42, 7, 99, 512, 3]


class Banning(LogitsProcessor):
    """Bans the tokens ``args["ban"]``; ``mode`` breaks the contract in one way."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            logits[i, list(row.args.get("ban", []))] = float("-inf")
        if self.mode == "one nan":
            logits[:, 7] = float("nan")
        elif self.mode == "float64":
            return logits.double()
        elif self.mode == "extra row":
            return torch.cat([logits, logits[:1]])
        return logits


def engine_with(factory: Callable[[Any, Any], LogitsProcessor], tiny_model: Path, **options: Any) -> Engine:
    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("acme_audit_processors")
    module.register_logits_processors = hookimpl(lambda register: register("banning", factory))
    plugins.register(module, name="acme", source="infer-plugin-acme")
    return Engine(EngineConfig(model=str(tiny_model), device="cpu", **options), plugins)


def hf_greedy_with(path: Path, prompt: list[int], steps: int, bias: dict[int, float] | None = None,
                   ngram: int | None = None) -> tuple[list[int], list[float]]:
    """transformers' model, each step's scores + ``bias`` then NoRepeatNGramLogitsProcessor(``ngram``), argmax;
    with the raw model's log-softmax of each chosen token."""
    from transformers import AutoModelForCausalLM, NoRepeatNGramLogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids, raw_logprobs = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            raw = model(ids).logits[:, -1].float()
            scores = raw.clone()
            for token, value in (bias or {}).items():
                scores[:, token] += value
            if ngram is not None:
                scores = NoRepeatNGramLogitsProcessor(ngram)(ids, scores)
            token = scores.argmax(-1, keepdim=True)
            raw_logprobs.append(float(raw.log_softmax(-1)[0, token]))
            ids = torch.cat([ids, token], dim=1)
    return ids[0, len(prompt):].tolist(), raw_logprobs


def test_a_processor_is_built_once_and_keeps_its_state_across_requests(tiny_model: Path) -> None:
    """The factory runs at the first request that names the processor, not at every admission: a processor's
    per-sequence state must survive other requests arriving (a rebuild would drop what it kept for the running
    ones, and release() would reach the new instance)."""
    built: list[Banning] = []

    def factory(config: Any, tokenizer: Any) -> Banning:
        assert tokenizer.decode([5]) is not None  # the engine's tokenizer
        built.append(Banning())
        return built[-1]

    engine = engine_with(factory, tiny_model)
    params = SamplingParams(max_tokens=3, logits_processors=["banning"])
    engine.add_request(PROMPT, params)
    engine.step()
    engine.add_request(PROMPT[:4], params)
    while engine.has_unfinished():
        engine.step()
    engine.generate([PROMPT], params)
    assert len(built) == 1 and engine.processors.built["banning"] is built[0]


def test_processors_see_the_biased_logits_as_transformers_chains_them(tiny_model: Path) -> None:
    """A processor runs on the logits after the logit bias (and penalties), as transformers applies its processors
    in turn: bias then no-repeat-ngram, greedy, against transformers' own."""
    bias = {token: 4.0 for token in PROMPT[:4]}
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    [output] = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                        logit_bias=bias, logits_processors={"no-repeat-ngram":
                                                                                            {"size": 2}}))
    expected, _ = hf_greedy_with(tiny_model, PROMPT, 16, bias=bias, ngram=2)
    assert output.outputs[0].token_ids == expected


def test_logprobs_stay_the_models_own_under_a_processor(tiny_model: Path) -> None:
    """The documented contract: the logprobs a request returns are the raw model's, not the processed logits'."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    [output] = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0,
                                                        logits_processors={"no-repeat-ngram": {"size": 1}}))
    tokens, raw = hf_greedy_with(tiny_model, PROMPT, 10, ngram=1)
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    got = [entry[token] for entry, token in zip(completion.logprobs, tokens)]
    assert got == pytest.approx(raw, abs=1e-4)


def test_a_structured_output_masks_the_processed_logits(tiny_model: Path) -> None:
    """A processor's bans hold under a structured output (the mask is applied to the processed row, not the raw
    one): six digits under no-repeat-ngram size 1 repeat no token, and still match the pattern."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    structure = StructuredOutput(regex="[0-9]{6}")
    [plain] = engine.generate(["x = "], SamplingParams(max_tokens=12, temperature=0.0, structured_output=structure))
    assert len(set(plain.outputs[0].token_ids[:-1])) < len(plain.outputs[0].token_ids[:-1])  # it repeats one
    [output] = engine.generate(["x = "], SamplingParams(max_tokens=12, temperature=0.0, structured_output=structure,
                                                        logits_processors={"no-repeat-ngram": {"size": 1}}))
    ids = output.outputs[0].token_ids
    assert re.fullmatch("[0-9]{6}", output.outputs[0].text) and len(set(ids)) == len(ids)


def test_a_row_with_one_nan_logit_has_no_token(tiny_model: Path) -> None:
    """A NaN anywhere in a row (not only a row all NaN) makes softmax and argmax meaningless: counted, and warned
    of (tests/test_plugins.py), at every step it happens."""
    engine = engine_with(lambda config, tokenizer: Banning("one nan"), tiny_model)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True, logits_processors=["banning"]))
    seq = engine.requests[rid].seqs[0]
    while engine.has_unfinished():
        engine.step()
    assert seq.unsampleable_steps == 2


def test_token_zero_is_a_token_not_a_missing_one(tiny_model: Path) -> None:
    """Token id 0 is sampled like any other (only a row without a token is an error): a bias of 100 on it makes it
    transformers' argmax too."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    [output] = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                        logit_bias={0: 100.0}))
    expected, _ = hf_greedy_with(tiny_model, PROMPT, 3, bias={0: 100.0})
    assert expected == [0, 0, 0] and output.outputs[0].token_ids == expected


@pytest.mark.parametrize(("mode", "got"), [("float64", r"torch.float64 \(1, \d+\)"),
                                           ("extra row", r"torch.float32 \(2, \d+\)")])
def test_a_processor_returning_another_dtype_or_row_count_is_refused(tiny_model: Path, mode: str, got: str) -> None:
    engine = engine_with(lambda config, tokenizer: Banning(mode), tiny_model)
    with pytest.raises(PluginError, match=rf"logits processor 'banning': apply\(\) returned {got} on cpu, not the "
                                          r"torch.float32 \(1, \d+\) on cpu it was given"):
        engine.generate([PROMPT], SamplingParams(max_tokens=2, logits_processors=["banning"]))


def test_the_limits_on_processor_lists_are_inclusive() -> None:
    SamplingParams(logits_processors=[f"p{i}" for i in range(MAX_LOGITS_PROCESSORS)]).validate()
    padding = MAX_PROCESSOR_ARGS_CHARS - len('{"x":""}')
    SamplingParams(logits_processors={"a": {"x": "y" * padding}}).validate()
    with pytest.raises(InvalidRequestError, match=f"take {MAX_PROCESSOR_ARGS_CHARS + 1} characters as JSON, over "
                                                  f"{MAX_PROCESSOR_ARGS_CHARS}"):
        SamplingParams(logits_processors={"a": {"x": "y" * (padding + 1)}}).validate()


@pytest.mark.parametrize("args", [{"size": 0}, {"size": -1}, {"size": MAX_NGRAM + 1}, {"size": True},
                                  {"size": 2.0}, {"size": 2, "n": 3}, {}])
def test_no_repeat_ngram_refuses_what_is_not_one_positive_integer_size(args: Mapping[str, Any]) -> None:
    """transformers' NoRepeatNGramLogitsProcessor takes a positive integer; a bool, a float or another key is no
    size (``{"size": true}`` would have banned every repeated token)."""
    with pytest.raises(InvalidRequestError, match=r'takes \{"size": n\}'):
        NoRepeatNgram().check(args)


@pytest.mark.parametrize("size", [1, MAX_NGRAM])
def test_no_repeat_ngram_takes_the_ends_of_its_range(size: int) -> None:
    NoRepeatNgram().check({"size": size})


def test_a_grpc_call_without_arguments_is_an_empty_object() -> None:
    """proto3 leaves an unset args_json "" (what a client in another language sends for no arguments): {}."""
    from infer.server import infer_pb2 as pb
    from infer.server.convert import sampling_params_of

    request = pb.GenerateRequest(params=pb.SamplingParams(logits_processors=[pb.LogitsProcessorCall(
        name="no-repeat-ngram")]))
    assert sampling_params_of(request).logits_processors == (("no-repeat-ngram", "{}"),)


def test_the_cli_keeps_arguments_in_the_form_the_python_api_does() -> None:
    """--logits-processor NAME=JSON gives the SamplingParams that the same arguments as a dict give (keys sorted,
    no spaces), whatever the order they were typed in."""
    import click
    from click.testing import CliRunner

    from infer.cli.options import sampling_options

    received: list[dict[str, Any]] = []

    @click.command()
    @sampling_options
    def command(sampling: dict[str, Any]) -> None:
        received.append(sampling)

    result = CliRunner().invoke(command, ["--logits-processor", 'mine={"b": 1, "a": [2, {"d": 3, "c": 4}]}'])
    assert result.exit_code == 0, result.output
    calls = received[0]["logits_processors"]
    assert SamplingParams(logits_processors=calls) == \
        SamplingParams(logits_processors={"mine": {"a": [2, {"c": 4, "d": 3}], "b": 1}})
    assert json.loads(calls[0][1]) == {"a": [2, {"c": 4, "d": 3}], "b": 1}


def test_a_processor_that_a_grammar_contradicts_yields_to_it_and_the_batch_goes_on(tiny_model: Path, hf_greedy: Any,
                                                                                   caplog: Any) -> None:
    """no-repeat-ngram (size 3) under a pattern that repeats text: the grammar soon allows only tokens the
    processor bans. That is the request's own contradiction (admitted as valid), not a broken component: there the
    processor yields (a warning says so, once), the output still matches the pattern, and the plain request beside
    it still gets transformers' greedy tokens."""
    import logging

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    contradicted = SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(regex="(ab){20}"),
                                  logits_processors={"no-repeat-ngram": {"size": 3}})
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="infer"):
        outputs = engine.generate([PROMPT, PROMPT], [contradicted, plain])
    assert outputs[1].outputs[0].token_ids == hf_greedy(tiny_model, PROMPT, 30)
    assert re.fullmatch("(ab){20}", outputs[0].outputs[0].text)
    warned = [r.getMessage() for r in caplog.records if "banned every token its other constraints" in r.getMessage()]
    assert len(warned) == 1 and "(no-repeat-ngram)" in warned[0]
