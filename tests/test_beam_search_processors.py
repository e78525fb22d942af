"""Logits processors in beam search (``BeamSearchParams.logits_processors``): the beams equal HF transformers' beam
search with the equivalent processor (``no_repeat_ngram_size``, ``bad_words_ids``, a LogitsProcessor of its own),
each beam its own row; the processors' state goes with the beams, whatever ends them; bad calls are refused at the
start; the CLI and gRPC take them."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from test_beam_search import TEXTS, hf_beam_search, with_eos

from infer.core.beam_search import BeamSearchOutput, BeamSearchParams
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError, PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import LogitsProcessor, ProcessorRow
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams

NO_REPEAT = "no-repeat-ngram"


@pytest.fixture(scope="module")
def eos_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_eos(tiny_model, tmp_path_factory.mktemp("eos-model"), 1)


def assert_equals_hf(result: BeamSearchOutput, path: Path, params: BeamSearchParams, **hf_options: Any) -> None:
    """The beams' tokens and scores are those of HF's beam search given ``hf_options`` (its processors)."""
    beams, scores = hf_beam_search(path, result.prompt_token_ids, params.beam_width, params.max_tokens,
                                   params.length_penalty, params.ignore_eos, **hf_options)
    assert [b.token_ids for b in result.beams] == beams
    assert [b.score for b in result.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)


def repeated_ngrams(ids: list[int], size: int) -> int:
    grams = [tuple(ids[i : i + size]) for i in range(len(ids) - size + 1)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize(("size", "width", "ignore_eos"), [(2, 4, True), (2, 3, False), (3, 4, False), (3, 3, True)])
def test_no_repeat_ngram_beams_equal_hf(eos_model: Path, size: int, width: int, ignore_eos: bool) -> None:
    """HF's generate(num_beams=W, no_repeat_ngram_size=N): the same beams and scores (forked beams keep their
    parent's n-grams, dead ones take theirs away), no n-gram twice in prompt + beam, where the plain search repeats
    some."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    params = BeamSearchParams(beam_width=width, max_tokens=20, ignore_eos=ignore_eos,
                              logits_processors={NO_REPEAT: {"size": size}})
    results = engine.beam_search(TEXTS, params)
    for result in results:
        assert_equals_hf(result, eos_model, params, no_repeat_ngram_size=size)
        assert not any(repeated_ngrams(result.prompt_token_ids + b.token_ids, size) for b in result.beams)
    plain = engine.beam_search(TEXTS, dataclasses.replace(params, logits_processors=()))
    assert any(repeated_ngrams(r.prompt_token_ids + b.token_ids, size) for r in plain for b in r.beams)
    if not ignore_eos:
        assert any(b.finish_reason.value == "stop" for r in results for b in r.beams)  # the stop path ran too


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_bad_words_beams_equal_hf(eos_model: Path, ignore_eos: bool) -> None:
    """HF's generate(num_beams=3, bad_words_ids=...), alone and chained with no_repeat_ngram_size: words of one and
    two tokens from the plain beams, and one that begins in the prompt, never come out."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    plain = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=ignore_eos)
    eos = set(engine.eos_token_ids)
    for found in engine.beam_search(TEXTS, plain):
        prompt, best, second = found.prompt_token_ids, found.beams[0].token_ids, found.beams[1].token_ids
        words = [w for w in (best[2:3], second[3:5], [prompt[-1], best[0]]) if len(w) > 1 or w[0] not in eos]
        for calls, hf in (({"bad-words": {"token_ids": words}}, {}),
                          ({"bad-words": {"token_ids": words}, NO_REPEAT: {"size": 3}}, {"no_repeat_ngram_size": 3})):
            params = dataclasses.replace(plain, logits_processors=calls)
            [result] = engine.beam_search([prompt], params)
            assert_equals_hf(result, eos_model, params, bad_words_ids=words, **hf)
            assert [b.token_ids for b in result.beams] != [b.token_ids for b in found.beams]
            for beam in result.beams:  # no word ends in the output
                ids = prompt + beam.token_ids
                assert not any(ids[i : i + len(w)] == w for w in words
                               for i in range(len(prompt) - len(w) + 1, len(ids) - len(w) + 1))


class CutBeams(LogitsProcessor):
    """Bans every token in the rows whose last token is ``after``: such a beam has no continuation."""

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.token_ids[-1] == row.args["after"]:
                logits[i] = float("-inf")
        return logits


class HFCutBeams:
    """CutBeams as a transformers logits processor."""

    def __init__(self, after: int) -> None:
        self.after = after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[input_ids[:, -1] == self.after] = float("-inf")
        return scores


class Holding(LogitsProcessor):
    """Keeps state for every row it sees until released; records the most it held for beams no longer in a step
    (released late), and can raise at its ``fail_at``-th call."""

    def __init__(self, fail_at: int = 0, ban_all: bool = False) -> None:
        self.held: set[int] = set()
        self.stale, self.calls, self.fail_at, self.ban_all = 0, 0, fail_at, ban_all

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("processor failed")
        ids = {row.seq_id for row in rows}
        self.stale = max(self.stale, len(self.held - ids))
        self.held |= ids
        return logits.fill_(float("-inf")) if self.ban_all else logits

    def release(self, seq_id: int) -> None:
        self.held.discard(seq_id)


def engine_with(model: Path, **processors: LogitsProcessor) -> Engine:
    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("acme_beam_processors")

    def register_logits_processors(register: Any) -> None:
        for name, processor in processors.items():
            register(name.replace("_", "-"), lambda config, tokenizer, built=processor: built)

    module.register_logits_processors = hookimpl(register_logits_processors)
    plugins.register(module, name="acme", source="infer-plugin-acme")
    return Engine(EngineConfig(model=str(model), device="cpu", block_size=4), plugins)


def test_a_beam_its_processors_leave_no_token_ends_as_in_hf(eos_model: Path) -> None:
    """A row banned whole drops that beam's continuations and the others go on, as HF's -inf scores do (no yield:
    other beams have tokens)."""
    from transformers import LogitsProcessorList

    engine = engine_with(eos_model, cut_beams=CutBeams())
    plain = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    for found in engine.beam_search(TEXTS, plain):
        after = found.beams[0].token_ids[0]
        if after == found.prompt_token_ids[-1]:
            continue
        params = dataclasses.replace(plain, logits_processors={"cut-beams": {"after": after}})
        [result] = engine.beam_search([found.prompt_token_ids], params)
        assert_equals_hf(result, eos_model, params, logits_processor=LogitsProcessorList([HFCutBeams(after)]))
        assert all(after not in b.token_ids[:-1] for b in result.beams)
        assert result.beams[0].token_ids != found.beams[0].token_ids


def test_banned_continuations_never_fill_the_beams(eos_model: Path) -> None:
    """With two allowed tokens and four beams, every allowed sequence of 3 fits the beams, so the beams are the
    best 4 of the 8 by the model's log-probability (HF's forward pass); after one token only 2 beams exist: a
    banned continuation never fills a beam, even when too few are allowed."""
    from transformers import AutoModelForCausalLM

    allowed = [7, 300]
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    model = AutoModelForCausalLM.from_pretrained(str(eos_model), dtype=torch.float32).eval()
    prompt = engine.tokenize(TEXTS[0])
    params = BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True,
                              logits_processors={"allowed-tokens": {"token_ids": allowed}})
    [result] = engine.beam_search([prompt], params)
    totals = {}
    for tokens in ([a, b, c] for a in allowed for b in allowed for c in allowed):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], dim=-1)
        totals[tuple(tokens)] = sum(logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))
    best = sorted(totals, key=totals.__getitem__, reverse=True)[:4]
    assert [tuple(b.token_ids) for b in result.beams] == best
    assert [b.cumulative_logprob for b in result.beams] == pytest.approx([totals[t] for t in best], abs=1e-4)
    [short] = engine.beam_search([prompt], dataclasses.replace(params, max_tokens=1))
    assert sorted(b.token_ids for b in short.beams) == [[7], [300]]


class Poison(LogitsProcessor):
    """Sets token ``token`` of every row to ``value``: NaN (a bug) or -inf (a ban)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        logits[:, rows[0].args["token"]] = self.value
        return logits


def test_a_nan_log_probability_is_never_chosen_as_a_banned_one_is_not(eos_model: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A processor (or a model) that leaves NaN at a token: a NaN total would rank first in topk; it is read as
    -inf instead, so the beams equal those of a processor that bans the token, and a warning says so, once."""
    engine = engine_with(eos_model, poison=Poison(float("nan")), ban=Poison(float("-inf")))
    plain = engine.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    token = plain[0].beams[0].token_ids[0]  # the best beam's first token: a NaN there matters
    banned = engine.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True,
                                                              logits_processors={"ban": {"token": token}}))
    with caplog.at_level(logging.WARNING, logger="infer.core.beam_search"):
        search = engine.start_beam_search([[5, 6, 7]], BeamSearchParams(
            beam_width=3, max_tokens=8, ignore_eos=True, logits_processors={"poison": {"token": token}}))
        while not search.done:
            engine.step()
    poisoned = search.result()
    assert [(b.token_ids, b.cumulative_logprob) for b in poisoned[0].beams] == \
        [(b.token_ids, b.cumulative_logprob) for b in banned[0].beams]
    assert all(token not in b.token_ids and math.isfinite(b.score) for b in poisoned[0].beams)
    assert search.unscorable_steps == 8
    assert [r.message.count("log-probabilities are NaN") for r in caplog.records] == [1]


def test_processors_that_leave_a_prompt_no_continuation_yield_with_a_warning(
        eos_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As a sampled row's: where every beam of a prompt is banned whole, the step ranks them as without the
    processors (the plain beams come out), and one warning names them."""
    engine = engine_with(eos_model, ban_all=Holding(ban_all=True))
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, logits_processors=["ban-all"])
    with caplog.at_level(logging.WARNING, logger="infer"):
        search = engine.start_beam_search(TEXTS[:2], params)
        while not search.done:
            engine.step()
    plain = engine.beam_search(TEXTS[:2], dataclasses.replace(params, logits_processors=()))
    assert [[b.token_ids for b in r.beams] for r in search.result()] == [[b.token_ids for b in r.beams] for r in plain]
    assert search.processors_yielded_steps == 2 * 8  # every step of both prompts
    warned = [r.getMessage() for r in caplog.records if "banned every continuation" in r.getMessage()]
    assert len(warned) == 1 and "its logits processors (ban-all)" in warned[0]


def test_processor_state_goes_with_each_beam_and_with_the_search(eos_model: Path) -> None:
    """A beam that dies (not chosen, or its prompt done) is released before the next step; at the end, after an
    abort and after an error, no beam's state is left; the shipped no-repeat-ngram holds none either."""
    holding = Holding()
    engine = engine_with(eos_model, holding=holding)
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True,
                              logits_processors={"holding": {}, NO_REPEAT: {"size": 2}})
    engine.beam_search(TEXTS, params)
    no_repeat = engine.processors.built[NO_REPEAT]
    assert holding.calls == 16 and holding.stale == 0 and not holding.held and not no_repeat.seen
    search = engine.start_beam_search(TEXTS, params)
    for _ in range(3):
        engine.step()
    live = {beam.seq_id for state in search.states for beam, _ in state.live}
    assert set(no_repeat.seen) == holding.held and len(live) == 4 * len(TEXTS)  # mid-search: live beams' only,
    assert len(holding.held) > len(TEXTS) and holding.held <= live  # those that ran in the last step
    engine.abort_beam_search(search)
    assert not holding.held and not no_repeat.seen and search.result()
    failing = Holding(fail_at=3)
    engine = engine_with(eos_model, failing=failing)
    with pytest.raises(PluginError, match="'failing' from 'infer-plugin-acme' raised RuntimeError: processor failed"):
        engine.beam_search(TEXTS, dataclasses.replace(params, logits_processors={"failing": {}, NO_REPEAT: {"size": 2}
                                                                                  }))
    assert failing.calls == 3 and not failing.held and not engine.processors.built[NO_REPEAT].seen
    stats = engine.kv.stats()
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


class CountingReleases(LogitsProcessor):
    """Records the ids of the rows it sees and every ``release`` call."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.released: list[int] = []

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        self.seen |= {row.seq_id for row in rows}
        return logits

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


@pytest.mark.parametrize("abort_after", [None, 3])
def test_each_beam_is_released_once(eos_model: Path, abort_after: int | None) -> None:
    """As a request's sequence is: a beam dropped mid-search is not released a second time when the search ends
    (a processor that deletes its state at release would raise and fail the search), whether it runs to its end or
    is aborted; every beam that ran is released."""
    counting = CountingReleases()
    engine = engine_with(eos_model, counting=counting)
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=False, logits_processors=["counting"])
    search = engine.start_beam_search(TEXTS, params)
    steps = 0
    while not search.done:
        engine.step()
        steps += 1
        if steps == abort_after:
            engine.abort_beam_search(search)
    assert search.result()
    assert len(counting.seen) > 4 * len(TEXTS)  # beams were dropped and forked
    assert sorted(counting.released) == sorted(set(counting.released)) and counting.seen <= set(counting.released)


@pytest.mark.parametrize("given", [
    "no-repeat-ngram", ["bad-words", NO_REPEAT], [(NO_REPEAT, {"size": 3})], {NO_REPEAT: {"size": 3}, "x": None},
    [(NO_REPEAT, '{"size": 3}')]])
def test_beam_search_takes_the_forms_sampling_params_take(given: Any) -> None:
    assert BeamSearchParams(logits_processors=given).logits_processors == \
        SamplingParams(logits_processors=given).logits_processors


@pytest.mark.parametrize(("given", "message"), [
    ([(NO_REPEAT, "[3]")], "the arguments of logits processor 'no-repeat-ngram' must be a JSON object"),
    ([NO_REPEAT, NO_REPEAT], "logits_processors names a processor twice"),
    ([f"p{i}" for i in range(9)], "logits_processors may name at most 8 processors, got 9"),
    (5, "logits_processors must be names, \\(name, args\\) pairs or a {name: args} dict")])
def test_malformed_processor_lists_are_refused_as_in_sampling_params(given: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        BeamSearchParams(logits_processors=given).validate()
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(logits_processors=given).validate()


@pytest.mark.parametrize(("calls", "message"), [
    (["no-repeat-ngrams"], "unknown logits processor 'no-repeat-ngrams' \\(did you mean 'no-repeat-ngram'\\?\\); "
                           "registered: allowed-tokens, bad-words, no-repeat-ngram"),
    ({NO_REPEAT: {"size": 0}}, "logits processor 'no-repeat-ngram': takes {\"size\": n}"),
    ({"bad-words": {"token_ids": [5]}}, "logits processor 'bad-words': .*each a list of 1 to 64 token ids")])
def test_unknown_processors_and_bad_arguments_are_refused_at_the_start(tiny_model: Path, calls: Any,
                                                                       message: str) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.start_beam_search(TEXTS, BeamSearchParams(logits_processors=calls))
    assert info.value.prompt_index is None  # the parameters, not a prompt
    assert not engine.has_unfinished() and engine.kv.stats().used_blocks == 0


def test_generate_beam_width_takes_logits_processors(eos_model: Path) -> None:
    """`infer generate --beam-width 3 --logits-processor no-repeat-ngram='{"size": 2}'` prints the beams
    Engine.beam_search gives; an unknown processor is refused before any prompt runs; other sampling options still
    are."""
    from click.testing import CliRunner

    from infer.cli import main

    params = BeamSearchParams(beam_width=3, max_tokens=12, logits_processors={NO_REPEAT: {"size": 2}})
    expected = Engine(EngineConfig(model=str(eos_model), device="cpu")).beam_search(TEXTS[:2], params)
    base = ["--model", str(eos_model), "--device", "cpu", "generate", *TEXTS[:2], "--beam-width", "3",
            "--max-tokens", "12"]
    result = CliRunner().invoke(main, [*base, "--logits-processor", 'no-repeat-ngram={"size": 2}', "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["prompt_index"], d["index"], d["token_ids"]) for d in lines] == [
        (p, rank, b.token_ids) for p, out in enumerate(expected) for rank, b in enumerate(out.beams)]
    plain = CliRunner().invoke(main, [*base, "--json"])
    assert [json.loads(line)["token_ids"] for line in plain.stdout.splitlines()] != [d["token_ids"] for d in lines]
    unknown = CliRunner().invoke(main, [*base, "--logits-processor", "nope"])
    assert unknown.exit_code == 1 and "unknown logits processor 'nope'" in unknown.output and not unknown.stdout
    refused = CliRunner().invoke(main, [*base, "--logits-processor", NO_REPEAT, "--temperature", "0.5"])
    assert refused.exit_code == 2 and "drop --temperature" in refused.output and "--logits-processor" not in \
        refused.output


def test_the_beam_search_request_carries_processors_both_ways() -> None:
    """The client's request holds what BeamSearchParams keeps, in any form; the server reads it back."""
    from infer.server.client import build_beam_request
    from infer.server.convert import beam_params_of
    from infer.server import infer_pb2 as pb

    calls: Mapping[str, Any] = {NO_REPEAT: {"size": 3}, "bad-words": {"token_ids": [[5, 6]]}}
    request = build_beam_request("x", beam_width=2, logits_processors=calls)
    assert [(c.name, json.loads(c.args_json)) for c in request.logits_processors] == list(calls.items())
    assert beam_params_of(pb.BeamSearchRequest.FromString(request.SerializeToString())) == \
        BeamSearchParams(beam_width=2, logits_processors=calls)
    assert beam_params_of(pb.BeamSearchRequest(logits_processors=[pb.LogitsProcessorCall(name="x")])) \
        .logits_processors == (("x", "{}"),)
    with pytest.raises(InvalidRequestError, match="invalid beam search parameters: logits_processors must be"):
        build_beam_request("x", logits_processors=5)
