"""Engine behaviour against references: HF greedy, torch sampling semantics, and KV bookkeeping."""
from __future__ import annotations

import gc
import logging
import math
import random
import threading
import time
from typing import Any

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CapacityError, InvalidRequestError
from infer.core.hookspecs import hookimpl
from infer.core.metrics import StepStats
from infer.core.plugins import PluginManager
from infer.core.request import FinishReason, SamplingParams, Sequence
from infer.plugins.continuous_scheduler import ContinuousScheduler
from infer.plugins.eviction import LRUPolicy
from infer.plugins.paged_cache import PagedKVCache

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=256))


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def drained(engine: Engine) -> bool:
    s = engine.kv.stats()
    return s.used_blocks == 0 and s.free_blocks + s.cached_blocks == s.total_blocks


def test_fork_n_greedy_equals_hf_and_shares_prompt_blocks(tiny_model, hf_greedy):
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=256))
    prompt = rand_prompt(200, 1)  # 12.5 blocks: the last block is partial and gets copied on first write
    ref = hf_greedy(tiny_model, prompt, 24)
    peaks = {}
    for n in (1, 4):
        engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=n),
                           request_id=f"n{n}")
        peak, outputs = 0, {}
        while engine.has_unfinished():
            for delta in engine.step():
                for c in delta.outputs:
                    outputs.setdefault(c.index, []).extend(c.token_ids)
            peak = max(peak, engine.kv.stats().used_blocks)
        peaks[n] = peak
        assert [outputs[i] for i in range(n)] == [ref] * n
    assert peaks[4] < 1.5 * peaks[1], peaks
    assert drained(engine)


def test_chunked_prefill_equals_unchunked(tiny_model, hf_greedy):
    prompts = [rand_prompt(n, n) for n in (150, 7, 90, 260)]
    chunked = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="chunked-prefill",
                                  max_num_batched_tokens=64, num_kv_blocks=256))
    results = chunked.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 24)
    assert drained(chunked)


def test_prefix_cache_hits_and_keeps_outputs(tiny_model, hf_greedy):
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=256))
    system = rand_prompt(64, 3)
    prompts = [system + rand_prompt(10, 10 + i) for i in range(3)]
    engine.generate(prompts[:1], GREEDY)
    results = engine.generate(prompts[1:], GREEDY)
    assert engine.stats.prefix_hit_rate > 0.5
    assert all(r.num_cached_tokens == 64 for r in results)
    for prompt, result in zip(prompts[1:], results):
        assert result.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 24)


def test_an_n_request_reports_the_prompt_tokens_its_prefix_hit_saved(tiny_model):
    """num_cached_tokens is the request's prompt tokens read from the prefix cache (64: the cached system prompt),
    whatever n: its forked sequences, which compute no prompt of their own, do not lower it."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=256))
    system = rand_prompt(64, 3)
    engine.generate([system + rand_prompt(10, 10)], SamplingParams(max_tokens=2, temperature=0.0))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=n) for n in (1, 3)]
    one, three = engine.generate([system + rand_prompt(10, 11), system + rand_prompt(10, 12)], params)
    assert len(three.outputs) == 3 and one.num_cached_tokens == three.num_cached_tokens == 64


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    alone = engine.generate([rand_prompt(20, 5)], params)[0].outputs[0].token_ids
    crowd = engine.generate([rand_prompt(30, 6), rand_prompt(20, 5), rand_prompt(9, 7)],
                            [SamplingParams(max_tokens=12, temperature=1.0), params, params])
    assert crowd[1].outputs[0].token_ids == alone
    assert crowd[2].outputs[0].token_ids != alone  # a different prompt with the same seed diverges
    assert not engine.runner.sampler.seeded  # each finished sequence's generator was released


def test_sampling_filters_follow_their_definitions():
    from infer.core.sampling import Sampler

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampler.filtered_probs(logits, [SamplingParams(top_p=0.7)])
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = Sampler.filtered_probs(logits, [SamplingParams(top_k=3)])
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    probs = Sampler.filtered_probs(logits, [SamplingParams(min_p=0.5)])  # keep p >= 0.25
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = Sampler.filtered_probs(logits, [SamplingParams(temperature=0.5)])
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))
    shuffled = logits[:, [2, 0, 3, 1]]
    for tiny in (1e-30, 1e-300):  # the smallest set reaching top_p is the top token, also once float32 rounds to 0
        probs = Sampler.filtered_probs(shuffled, [SamplingParams(top_p=tiny)])
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # a row without top_p keeps its whole distribution beside one with it: its float32 cumsum reaches 1.0 before its
    # last tokens (31 of these 32,000), which a threshold of 1.0 would drop, varying a seeded request
    # with its batch
    flat = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 2.0
    alone = Sampler.filtered_probs(flat, [SamplingParams(), SamplingParams()])
    beside = Sampler.filtered_probs(flat, [SamplingParams(), SamplingParams(top_p=0.9)])
    assert torch.equal(alone[0], beside[0]) and bool((alone[0] > 0).all())


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's distribution after HF transformers' warpers, in generate's order: temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    warpers += [MinPLogitsWarper(params.min_p)] if params.min_p else []
    scores = logits[None].clone()
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(dim=-1)[0]


def test_each_rows_filters_equal_hf_warpers_whatever_the_other_rows_ask() -> None:
    """One batch of rows with different filters (and rows with none): each row's distribution is HF's for its own
    parameters, temperature first; a filter of one row touches no other."""
    from infer.core.sampling import Sampler

    rows = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=0.5, top_k=5),
            SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=0.4, min_p=0.3),
            SamplingParams(temperature=1.7), SamplingParams(top_k=20, top_p=0.9, min_p=0.05)]
    logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(0)) * 2.0
    probs = Sampler.filtered_probs(logits, rows)
    for row, params in enumerate(rows):
        expected = hf_warped(logits[row], params)
        assert torch.equal(probs[row] > 0, expected > 0), params
        assert torch.allclose(probs[row], expected, atol=1e-6), params


def test_min_p_keeps_a_token_at_exactly_min_p_times_the_top_probability() -> None:
    """HF's MinPLogitsWarper (and vLLM) drop only the tokens below min_p * the top probability."""
    from infer.core.sampling import Sampler

    logits = torch.tensor([[0.0, -math.log(2), -math.log(2), -3.0]])  # float32 softmax: p[1] == p[2] == p[0] / 2
    probs = Sampler.filtered_probs(logits, [SamplingParams(min_p=0.5)])
    assert torch.equal(probs[0] > 0, hf_warped(logits[0], SamplingParams(min_p=0.5)) > 0)
    assert probs[0].tolist()[3] == 0.0 and probs[0, 1] == probs[0, 2] > 0


def test_sampled_frequencies_match_the_distribution():
    from infer.core.sampling import Sampler

    sampler = Sampler(torch.device("cpu"), seed=0)
    target = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(target).expand(20000, 4).contiguous()
    tokens = sampler(logits, [SamplingParams(temperature=1.0)] * 20000, [None] * 20000).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 20000
    assert torch.allclose(freq, target, atol=0.015)


def test_logprobs_equal_log_softmax_of_hf_logits(engine, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(12, 8)
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = ref.topk(3)
    entry = out.logprobs[0]
    assert set(entry) == set(top.indices.tolist())  # greedy token is the top-1
    for token, value in zip(top.indices.tolist(), top.values.tolist()):
        assert entry[token] == pytest.approx(value, abs=1e-4)


def test_each_row_of_a_batch_gets_the_number_of_logprobs_it_asked_for() -> None:
    """Rows asking for 4, none, 0, 1 and 2 logprobs in one batch: each entry holds the row's own top-n of the raw
    log-softmax and its sampled token, whatever the other rows ask."""
    from infer.core.sampling import Sampler

    widths = [4, None, 0, 1, 2]
    params = [SamplingParams(temperature=2.0 if row % 2 else 0.0, logprobs=width) for row, width in enumerate(widths)]
    logits = torch.randn(len(widths), 40, generator=torch.Generator().manual_seed(3)) * 2.0
    out = Sampler(torch.device("cpu"), seed=0)(logits, params, [None] * len(widths))
    logp = logits.log_softmax(dim=-1)
    for row, (width, token, entry) in enumerate(zip(widths, out.token_ids, out.logprobs)):
        if width is None:
            assert entry is None
            continue
        assert entry is not None and set(entry) == {token, *logp[row].topk(width).indices.tolist()}, row
        for candidate, value in entry.items():
            assert value == pytest.approx(logp[row, candidate].item(), abs=1e-5)


def test_sampled_logprobs_are_the_raw_distributions_at_every_position(engine, tiny_model):
    """At temperature 0.7 with top_k 5, each position's entry holds the sampled token and the top 3 of HF's
    log-softmax of the unscaled logits given the tokens so far: temperature and top-k shape the sampling, not the
    logprobs (README: "top-n of the raw model distribution")."""
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(12, 21)
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=4, logprobs=3, ignore_eos=True)
    out = engine.generate([prompt], params)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[position].topk(3).indices.tolist()
        assert set(entry) == {token, *top}
        for candidate, value in entry.items():
            assert value == pytest.approx(ref[position, candidate].item(), abs=1e-4)
    assert any(token != ref[i].argmax() for i, token in enumerate(out.token_ids))  # it sampled, not greedy


def test_stream_deltas_concatenate_to_the_final_text(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "def add(a, b):"
    full = engine.generate([prompt], params)[0].outputs[0]
    deltas = list(engine.stream(prompt, params))
    assert "".join(c.text for d in deltas for c in d.outputs) == full.text
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == full.token_ids
    assert deltas[-1].finished and full.text == engine.tokenizer.decode(full.token_ids)


def test_stop_strings_and_stop_tokens(engine):
    prompt = rand_prompt(10, 9)
    free = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop_token = free.token_ids[5]
    first = free.token_ids.index(stop_token)
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    # the stop token's text is left out (token_ids keep it), on every output path: one sequence, n > 1, stop
    # strings beside it, a stream
    shown = engine.tokenizer.decode(free.token_ids[:first])
    assert engine.tokenizer.decode([stop_token]).strip() and out.text == shown
    for extra in ({"n": 2}, {"stop": ["never appears"]}):
        both = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=[stop_token], **extra))[0].outputs
        assert [c.text for c in both] == [shown] * len(both)
    streamed = engine.stream(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_token]))
    assert "".join(c.text for d in streamed for c in d.outputs) == shown
    kept = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_token], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == engine.tokenizer.decode(free.token_ids[: first + 1])  # vLLM's option
    stop_text = free.text[6:9]
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                   stop=[stop_text]))[0].outputs[0]
    assert out.text == free.text[: free.text.index(stop_text)] and out.finish_reason is FinishReason.STOP
    streamed = engine.stream(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop_text]))
    assert "".join(c.text for d in streamed for c in d.outputs) == out.text  # nothing streamed is taken back
    kept = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop_text],
                          include_stop_str_in_output=True)
    streamed = engine.stream(prompt, kept)
    assert "".join(c.text for d in streamed for c in d.outputs) == free.text[: free.text.index(stop_text) + 3]


def test_abort_frees_blocks_and_other_requests_continue(engine):
    a = engine.add_request(rand_prompt(40, 11), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request(rand_prompt(40, 12), GREEDY)
    engine.step()
    final = engine.abort(a)
    assert final.finished and final.outputs[0].finish_reason is FinishReason.ABORT
    while engine.has_unfinished():
        engine.step()
    assert b not in engine.requests and drained(engine)


def test_kv_waste_stays_below_one_block_per_sequence(engine):
    lengths = (3, 17, 40, 64, 100)
    prompts = [rand_prompt(n, 20 + n) for n in lengths]
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine.step()  # every prompt computed, nothing decoded yet: each holds ceil(n / size) blocks for n tokens
    size = engine.kv.block_size
    assert engine.stats.kv_waste_slots == sum(-(-n // size) * size - n for n in lengths)
    for rid in ids:
        engine.abort(rid)
    engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert 0 < engine.stats.kv_max_waste_per_seq < engine.kv.block_size


def test_review_regressions(engine, tiny_model):
    """A tiny temperature is greedy; an abandoned stream frees its request; n > 1 respects max-num-seqs."""
    from infer.core.sampling import Sampler

    prompt = rand_prompt(12, 31)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tiny = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    probs = Sampler.filtered_probs(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), [SamplingParams(top_p=0.5)])
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0]]))  # the smallest set reaching top_p

    stream = engine.stream(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.requests and drained(engine)

    narrow = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_num_seqs=4, num_kv_blocks=128))
    for i in range(2):
        narrow.add_request(rand_prompt(20, 40 + i), SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=i))
    peak = 0
    while narrow.has_unfinished():
        narrow.step()
        peak = max(peak, narrow.scheduler.num_running())
    assert peak <= 4


def test_generate_as_completed_yields_in_finishing_order_and_frees_the_rest(engine):
    long, short = SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)
    completed = engine.generate_as_completed(["a long one", "a short one", "long again"], [long, short, long])
    first_index, first = next(completed)
    assert first_index == 1 and first.finished and len(first.outputs[0].token_ids) == 3
    completed.close()  # the caller stops reading: the other two are aborted, their KV freed
    assert not engine.has_unfinished() and drained(engine)
    in_order = engine.generate(["a long one", "a short one"], [long, short])
    assert [len(r.outputs[0].token_ids) for r in in_order] == [12, 3]


def test_prompts_and_a_list_of_params_of_another_length_are_refused(engine):
    """One SamplingParams per prompt: a list of another length is refused, not cut to the shorter (which ran
    prompts without their params, or dropped prompts)."""
    from infer.core.errors import InvalidRequestError

    for prompts, params in (([[5, 6], [7, 8]], [SamplingParams(max_tokens=1)]),
                            ([[5, 6]], [SamplingParams(max_tokens=1)] * 2)):
        with pytest.raises(InvalidRequestError, match=f"got {len(prompts)} prompts but {len(params)} SamplingParams"):
            engine.generate(prompts, params)
    assert not engine.has_unfinished()


def test_a_bad_prompt_among_many_is_named_and_nothing_runs(engine):
    from infer.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt 2 of 3: .*context length"):
        engine.generate(["fine", "x " * 5000, "fine too"], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished() and drained(engine)


def test_the_engine_logs_what_it_built(tiny_model, caplog):
    """`infer -v`: one line says which components run, the KV pool and the dtypes."""
    import logging

    with caplog.at_level(logging.INFO, logger="infer"):
        built = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, kv_cache="radix-cache",
                                    scheduling_policy="lpm"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    assert "KV pool 64 blocks of 16 tokens" in line and "kv_cache radix-cache" in line and "on cpu" in line
    assert "scheduling policy lpm" in line
    spec = built.loaded.model.spec  # K and V, every layer, 16 slots per block, float32
    assert f"{64 * 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4 / 2**20:.0f} MiB" in line


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_every_reader_gets_every_delta_of_its_own_requests(engine):
    """A generate inside another's loop, two streams read in turn, a request added by hand while a generate runs:
    each reader gets all of its requests' tokens (a step made by one reader dropped the others' deltas, or raised),
    the same tokens as each request run alone."""
    lengths = {"one": 2, "two": 9, "inner": 4, "bg": 3}
    alone = {p: engine.generate([p], greedy(n))[0].outputs[0].token_ids for p, n in lengths.items()}
    got = {}
    for i, out in engine.generate_as_completed(["one", "two"], [greedy(2), greedy(9)]):
        got[("one", "two")[i]] = out.outputs[0].token_ids
        if i == 0:  # "two" runs on inside the nested call
            got["inner"] = engine.generate(["inner"], greedy(4))[0].outputs[0].token_ids
    assert got == {p: alone[p] for p in ("one", "two", "inner")}

    streams = {p: engine.stream(p, greedy(lengths[p])) for p in ("one", "two")}
    streamed = {p: [] for p in streams}
    finished = {p: False for p in streams}
    while not all(finished.values()):
        for p, it in streams.items():  # one delta of each in turn
            if not finished[p]:
                delta = next(it)
                streamed[p] += delta.outputs[0].token_ids
                finished[p] = delta.finished
    assert streamed == {p: alone[p] for p in streams}

    rid = engine.add_request("bg", greedy(3))
    engine.step()
    assert engine.generate(["inner"], greedy(4))[0].outputs[0].token_ids == alone["inner"]  # "bg" ends meanwhile
    late = [out for out in engine.step() if out.request_id == rid]  # what generate's steps made of it
    assert [t for out in late for t in out.outputs[0].token_ids] == alone["bg"][1:] and late[-1].finished
    assert not engine.has_unfinished() and drained(engine)


def test_an_abort_ends_the_generate_call_that_reads_the_request(engine):
    """generate_as_completed stepped an empty engine forever when another caller aborted one of its requests."""
    calls = engine.generate_as_completed(["a", "b"], [greedy(1), greedy(50)])
    first = next(calls)
    [other] = engine.requests
    aborted = engine.abort(other)
    index, final = next(calls)
    assert (first[0], index) == (0, 1) and final.finished and aborted.finished
    assert final.outputs[0].finish_reason is FinishReason.ABORT
    assert not engine.has_unfinished() and drained(engine)


def test_an_outputs_prompt_is_the_callers_to_change(engine):
    """Extending prompt_token_ids of a delta ("the context so far") changed the sequence's own prompt."""
    tokens = []
    for delta in engine.stream("def f(x):", greedy(8)):
        delta.prompt_token_ids.extend(delta.outputs[0].token_ids)
        tokens += delta.outputs[0].token_ids
    assert tokens == engine.generate(["def f(x):"], greedy(8))[0].outputs[0].token_ids


@pytest.mark.parametrize("request_id", ["", 0, 5, {}, ["x"]])
def test_a_request_id_must_be_a_non_empty_string(engine, request_id):
    from infer.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="request_id must be a non-empty string"):
        engine.add_request("hi", greedy(1), request_id)
    if not isinstance(request_id, str):
        with pytest.raises(InvalidRequestError, match="request_id must be a string"):
            engine.abort(request_id)
    assert engine.check_request("hi")  # params default as add_request's do


def test_freeze_gc_moves_the_startup_heap_out_of_the_collector(tiny_model):
    import gc
    import subprocess
    import sys

    gc.unfreeze()
    try:
        Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16))
        assert gc.get_freeze_count() == 0  # off by default: tests and benchmarks build and drop engines
        Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16, freeze_gc=True))
        assert gc.get_freeze_count() > 10_000  # the modules, the model and the engine
    finally:
        gc.unfreeze()
    # the heap is unfrozen at exit: triton's nanobind extension, frozen with it, reports no leaked objects
    code = ("import triton, triton.language; from infer.core.config import EngineConfig; "
            "from infer.core.engine import Engine; "
            f"Engine(EngineConfig(model={str(tiny_model)!r}, device='cpu', num_kv_blocks=16, freeze_gc=True))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_load_progress_counts_the_weight_files_bytes(tiny_model, tmp_path):
    """Engine(load_progress=...) (the CLI's bar on a terminal) is told the bytes read after each tensor, across the
    files of a sharded checkpoint: never backwards, each file whole at its end, the files' total last."""
    import shutil

    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    sizes = []
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        path = sharded / f"model-0000{shard + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(path), metadata={"format": "pt"})
        sizes.append(path.stat().st_size)
    calls: list[tuple[int, int]] = []
    Engine(EngineConfig(model=str(sharded), device="cpu", num_kv_blocks=16), load_progress=lambda *c: calls.append(c))
    total = sum(sizes)
    assert len(calls) >= len(names) and {t for _, t in calls} == {total}
    reads = [read for read, _ in calls]
    assert reads == sorted(reads) and reads[-1] == total and sizes[0] in reads


def test_serve_freezes_the_heap_by_default_and_the_option_wins(tiny_model):
    import gc

    from infer.cli.main import build_engine, main as cli
    from infer.cli.options import EngineArgs

    for options, default, expected in (([], True, True), (["--no-freeze-gc"], True, False), ([], False, False)):
        ctx = cli.make_context("infer", ["--model", str(tiny_model), "--device", "cpu", "--num-kv-blocks", "16",
                                         *options, "plugins"])
        ctx.obj = EngineArgs.from_kwargs(ctx.params)  # what the group's callback does
        try:
            engine = build_engine(ctx, freeze_gc=default)  # `serve` passes True
        finally:
            gc.unfreeze()
        assert engine.config.freeze_gc is expected


class StepBudget:
    def __init__(self) -> None:
        self.tokens: list[int] = []  # per step: tokens scheduled
        self.seqs: list[int] = []

        self.split: list[tuple[int, int]] = []  # per step: (prefill tokens, decode tokens)
        self.peaks: list[int] = []  # per step: KV blocks in use as its forward pass ran

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        self.peaks.append(stats.peak_used_blocks)
        self.tokens.append(stats.num_prefill_tokens + stats.num_decode_tokens)
        self.seqs.append(stats.num_seqs)
        self.split.append((stats.num_prefill_tokens, stats.num_decode_tokens))


def observed_engine(path, **options) -> tuple[Engine, StepBudget]:
    log, plugins = StepBudget(), PluginManager.from_entry_points()
    plugins.register(log, name="step-budget")
    return Engine(EngineConfig(model=str(path), device="cpu", **options), plugins), log


def test_a_one_token_prefill_is_not_counted_as_a_decode(tiny_model):
    """A prefix hit that leaves one prompt token to compute schedules a one-token item: still a prefill."""
    e, log = observed_engine(tiny_model, block_size=4, num_kv_blocks=32)
    prompt, params = list(range(10, 19)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    e.generate([prompt], params)
    log.split.clear()
    assert e.generate([prompt], params)[0].num_cached_tokens == 8
    assert log.split == [(1, 0), (0, 1), (0, 1)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_kv_peak_counts_the_blocks_of_requests_that_finish_in_a_step(tiny_model, async_scheduling):
    """4 requests of 16 prompt tokens and 2 output tokens, blocks of 16: the second step writes token 17's KV, a
    second block each, and ends them. The peak is the blocks that held (read at the step's end, after the finished
    requests freed theirs, it was the first step's 4)."""
    e, log = observed_engine(tiny_model, block_size=16, num_kv_blocks=32, async_scheduling=async_scheduling)
    e.generate([rand_prompt(16, seed) for seed in range(4)], SamplingParams(max_tokens=2, temperature=0.0,
                                                                          ignore_eos=True))
    assert max(log.peaks) == e.stats.kv_peak_used_blocks == 4 * -(-(16 + 2 - 1) // 16) == 8
    assert e.stats.summary()["kv_peak_used_blocks"] == 8 and drained(e)


def scheduled_log(e: Engine) -> list[list[tuple[int, int, int]]]:
    """Per step: (seq_id, uncomputed tokens before the step, tokens scheduled) of every running sequence; the
    scheduler's schedule() wrapped for the test's observation only."""
    log: list[list[tuple[int, int, int]]] = []
    schedule = e.scheduler.schedule

    def observed():
        running = {s.seq_id: s.num_tokens - s.num_computed_tokens for s in e.scheduler.running}
        out = schedule()
        given = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
        log.append([(sid, left, given.get(sid, 0)) for sid, left in running.items()])
        return out

    e.scheduler.schedule = observed
    return log


def test_forked_decodes_go_before_prefill_chunks_and_none_starves(tiny_model, hf_greedy):
    """A fork's children joined the running list behind a prefill admitted with their parent's last chunk, and
    behind every older sequence when the budget held fewer tokens than running decodes: they waited steps."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="chunked-prefill", block_size=4,
                            num_kv_blocks=64, max_num_batched_tokens=16))
    log = scheduled_log(e)
    forked, long = list(range(10, 20)), list(range(100, 140))
    e.add_request(forked, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3))
    e.add_request(long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    for step in log:
        if any(left > 1 and given for _, left, given in step):  # a prefill chunk ran: every decode ran too
            assert all(given for _, left, given in step if left == 1), step
    tight = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="chunked-prefill", block_size=4,
                                num_kv_blocks=64, max_num_batched_tokens=4, max_num_seqs=8))
    log = scheduled_log(tight)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = tight.generate([[11], [12], [13], [14]], [params] * 3 + [SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, n=3)])
    assert all(given for step in log for _, left, given in step if left == 1)  # no running decode ever waits
    assert [c.token_ids for c in outs[3].outputs] == [hf_greedy(tiny_model, [14], 12)] * 3


def test_a_swapped_in_chunked_prefill_keeps_the_step_budget(tiny_model, hf_greedy):
    """A prompt swapped out halfway through its prefill comes back in chunks, not all at once."""
    e, log = observed_engine(tiny_model, scheduler="chunked-prefill", preemption_mode="swap", num_swap_blocks=64,
                             num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    e.add_request(list(range(10, 26)), params, "A")
    for _ in range(24):
        e.step()
    long = list(range(100, 240))
    e.add_request(long, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), "B")
    outputs = {}
    while e.has_unfinished():
        for out in e.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
    assert e.scheduler.num_swapped_out >= 1 and max(log.tokens) <= 16
    assert outputs["B"] == hf_greedy(tiny_model, long, 10)


def test_a_swapped_in_request_of_n_sequences_takes_n_seats(tiny_model):
    e, log = observed_engine(tiny_model, scheduler="chunked-prefill", preemption_mode="swap", num_swap_blocks=64,
                             num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=3)
    rng = random.Random(10)
    requests = [([rng.randrange(3, 500) for _ in range(rng.randint(4, 70))],
                 SamplingParams(max_tokens=rng.randint(2, 30), temperature=0.0, ignore_eos=True,
                                n=rng.choice((1, 2, 2)))) for _ in range(12)]
    finished = 0
    while requests or e.has_unfinished():
        if requests and rng.random() < 0.5:
            e.add_request(*requests.pop(0))
        if e.has_unfinished():
            finished += sum(out.finished for out in e.step())
    assert finished == 12 and e.scheduler.num_swapped_out > 0 and max(log.seqs) <= 3


def test_admission_counts_the_positions_that_get_kv(tiny_model, hf_greedy):
    """The last sampled token is never fed back: 16 prompt tokens + 17 new ones need 32 positions, two blocks."""
    prompt = list(range(10, 26))
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=2))
    out = e.generate([prompt], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 17)
    with pytest.raises(CapacityError, match="needs up to 3 KV blocks .*; lower max_tokens"):
        e.add_request(prompt, SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True))
    with pytest.raises(CapacityError, match="needs up to 3 KV blocks .*; shorten the prompt or give"):
        e.check_request(list(range(10, 43)), SamplingParams(max_tokens=1))  # the prompt alone needs 3 blocks
    assert not e.has_unfinished()  # check_request queues nothing


def test_request_metrics_count_requests_and_prompt_hits_only(tiny_model):
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.9, seed=1, n=4, ignore_eos=True))[0]
    assert (e.stats.requests_finished, len(e.stats.ttft_s), len(e.stats.tpot_s)) == (1, 1, 4)
    assert out.metrics["num_output_tokens"] == sum(len(c.token_ids) for c in out.outputs) == 20
    # two prompts sharing nothing, in a pool that preempts one: its recompute finds its own blocks, not a prompt hit
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=6, max_num_seqs=4))
    started = time.perf_counter()
    outs = e.generate([list(range(10, 14)), list(range(50, 54))],
                      SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - started
    assert e.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0] and e.stats.prefix_hit_rate == 0.0
    # each request's own timings: its first token before its end, 59 gaps between its 60 tokens, within the wall
    assert sum(o.metrics["num_preemptions"] for o in outs) == e.scheduler.num_preemptions
    for o in outs:
        m = o.metrics
        assert 0 < m["ttft_s"] < m["e2e_s"] <= wall and 0 < m["tpot_s"] * 59 <= m["e2e_s"] - m["ttft_s"] + 1e-9


def test_a_requests_arrival_time_is_when_it_came_in_and_never_after_now(tiny_model):
    """A server that queued a request passes when it came in: the request's TTFT and end-to-end time count from
    there (0.5 s before it was added here), and a time after now, or no time at all, is refused by name."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for bad in (time.perf_counter() + 60, float("nan"), True, "now"):
        with pytest.raises(InvalidRequestError, match="arrival_time must be a time.perf_counter.. value not after now"):
            e.add_request([5, 6, 7], params, arrival_time=bad)
    assert not e.has_unfinished()
    added = time.perf_counter()
    rid = e.add_request([5, 6, 7], params, arrival_time=added - 0.5)
    late = e.add_request([5, 6, 7], params)
    outs = {}
    while e.has_unfinished():
        outs.update((o.request_id, o) for o in e.step() if o.finished)
    wall = time.perf_counter() - added
    assert 0.5 < outs[rid].metrics["ttft_s"] < outs[rid].metrics["e2e_s"] <= wall + 0.5
    assert 0 < outs[late].metrics["ttft_s"] < outs[late].metrics["e2e_s"] <= wall
    assert outs[rid].outputs[0].token_ids == outs[late].outputs[0].token_ids


# ---------------------------------------------------------------- the Python API refuses bad input by name
@pytest.mark.parametrize(("call", "message"), [
    (lambda e: e.generate(None), "prompts must be a list of prompts (strings, token-id lists or ChatPrompts), got "
                                 "NoneType"),
    (lambda e: e.generate(b"hello"), "prompts must be a list of prompts (strings, token-id lists or ChatPrompts), "
                                     "got bytes"),
    (lambda e: e.generate(["a", 5]), "prompt 2 of 2: a prompt is a string, a list of token ids or a ChatPrompt, "
                                     "got int"),
    (lambda e: e.generate([b"hi"]), "got bytes (decode the bytes to text first)"),
    (lambda e: e.generate(["hi"], {"max_tokens": 3}), "sampling parameters must be an infer.SamplingParams, got dict"),
    (lambda e: e.generate(["a\udcff"]), "the prompt is not valid UTF-8 text"),
    (lambda e: e.generate(["hi"], SamplingParams(priority="high")), "priority must be an integer"),
    (lambda e: e.generate(["hi"], SamplingParams(stop=[""])), "stop must be a non-empty string or a list of them"),
    (lambda e: e.generate(["hi"], SamplingParams(stop=["ok", "\udcff"])), "stop string 2 is not valid UTF-8 text"),
    (lambda e: e.generate(["hi"], SamplingParams(stop_token_ids=5)), "stop_token_ids must be a list of non-negative"),
    (lambda e: e.generate(["hi"], SamplingParams(max_tokens=True)), "max_tokens must be a positive integer, got True"),
    (lambda e: e.generate(["hi"], SamplingParams(seed=2**63)), "seed must be an integer in [0, 2**63), got 922337"),
    (lambda e: e.generate(["hi"], SamplingParams(seed=-1)), "seed must be an integer in [0, 2**63), got -1"),
    (lambda e: e.generate(["hi"], SamplingParams(repetition_penalty=0.0)), "repetition_penalty must be a number in "
     "(0, 1000]"),
    (lambda e: e.generate(["hi"], SamplingParams(frequency_penalty=2.5)), "frequency_penalty must be a number in "
     "[-2, 2]"),
    (lambda e: e.generate(["hi"], SamplingParams(presence_penalty=float("nan"))), "presence_penalty must be a number"),
    (lambda e: e.generate(["hi"], SamplingParams(max_tokens=4, min_tokens=5)), "min_tokens must be an integer in "
     "[0, max_tokens=4], got 5"),
    (lambda e: e.generate(["hi"], SamplingParams(repetition_penalty=float("nan"))), "repetition_penalty must be a "
     "number in (0, 1000]"),
    (lambda e: e.generate(["hi"], SamplingParams(repetition_penalty=1001.0)), "repetition_penalty must be a number "
     "in (0, 1000]"),
    (lambda e: e.generate(["hi"], SamplingParams(frequency_penalty=-2.5)), "frequency_penalty must be a number in "
     "[-2, 2]"),
    (lambda e: e.generate(["hi"], SamplingParams(min_tokens=-1)), "min_tokens must be an integer in [0, "),
    (lambda e: e.generate(["hi"], SamplingParams(min_tokens=2.5)), "min_tokens must be an integer in [0, "),
    (lambda e: e.generate(["hi"], SamplingParams(logit_bias={5: 101.0})), "logit_bias values must be numbers in "
     "[-100, 100], got 101.0 for token 5"),
    (lambda e: e.generate(["hi"], SamplingParams(logit_bias={i: 1.0 for i in range(1025)})), "logit_bias may hold "
     "at most 1024 token ids, got 1025"),
    (lambda e: e.generate(["hi"], SamplingParams(stop_token_ids=[5] * 1025)), "stop_token_ids may hold at most 1024 "
     "token ids, got 1025"),  # min_tokens bans each on every step: 400k of them held every request's steps
    (lambda e: e.generate(["hi"], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[
        t for t in range(e.checker.vocab_size) if t not in e.eos_token_ids])), "min_tokens bans EOS and the "
     "stop_token_ids until that many tokens are out, and together they are the whole vocabulary"),  # sampled token 0
    (lambda e: e.generate(["hi"], SamplingParams(logit_bias={"5": 1.0})), "logit_bias keys must be token ids "
     "(integers >= 0), got '5'"),
    (lambda e: e.generate(["hi"], SamplingParams(logit_bias={10**6: 1.0})), "logit_bias's token ids must be below "
     "the model's vocabulary size"),
])
def test_bad_python_api_input_is_an_invalid_request_naming_it(engine, call, message):
    from infer.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        call(engine)
    assert message in str(info.value)
    assert not engine.has_unfinished()  # nothing half-submitted


def test_ctrl_c_after_the_scheduler_finished_requests_leaves_no_request_behind(tiny_model, monkeypatch):
    """A Ctrl-C between the scheduler's finish (in update) and the output left the requests registered for good:
    has_unfinished() stayed True, step() returned [] forever, and their last delta never came."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [e.add_request(p, sampling) for p in ([5, 6, 7], [8, 9, 10, 11])]
    update, interrupted = e.scheduler.update, []

    def update_then_ctrl_c(out, sampled, now):
        update(out, sampled, now)
        if not interrupted and all(item.seq.is_finished for item in out.scheduled):
            interrupted.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(e.scheduler, "update", update_then_ctrl_c)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = set()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            for out in e.step():
                tokens[out.request_id] += out.outputs[0].token_ids
    for _ in range(3):
        for out in e.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            finished |= {out.request_id} if out.finished else set()
    assert interrupted and not e.has_unfinished() and not e.requests and finished == set(ids)
    reference = e.generate([[5, 6, 7], [8, 9, 10, 11]], sampling)
    assert [tokens[rid] for rid in ids] == [r.outputs[0].token_ids for r in reference]
    assert e.kv.stats().used_blocks == 0


def test_ctrl_c_while_a_finished_sequence_frees_its_blocks_leaves_the_engine_going(tiny_model, monkeypatch):
    """The scheduler took the sequence out of its queue, the free was interrupted, and the sequence was left
    neither queued nor finished: every later step failed, blaming the scheduler, and its request never ended."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, block_size=4))
    insert, interrupted = e.kv.eviction.insert, []

    def insert_with_ctrl_c(*args, **kwargs):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return insert(*args, **kwargs)

    monkeypatch.setattr(e.kv.eviction, "insert", insert_with_ctrl_c)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rid = e.add_request(list(range(5, 17)), sampling)  # three full blocks: cached as they are freed
    with pytest.raises(KeyboardInterrupt):
        while e.has_unfinished():
            e.step()
    outputs = [out for _ in range(3) for out in e.step()]
    assert interrupted and not e.has_unfinished() and [o.request_id for o in outputs if o.finished] == [rid]
    assert e.generate([[5, 6, 7]], sampling)[0].outputs[0].token_ids == \
        Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64)).generate(
            [[5, 6, 7]], sampling)[0].outputs[0].token_ids


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
@pytest.mark.parametrize("where", ["free", "fork", "allocate"])
def test_a_real_ctrl_c_inside_the_kv_bookkeeping_lands_after_the_step(tiny_model, monkeypatch, kv_cache, where):
    """SIGINT raised KeyboardInterrupt wherever Python was: halfway through freeing a finished sequence's blocks
    (they leaked, and the cache counted blocks it could not free), through a fork (n > 1: the child was lost and
    every later step failed) or through a prefix hit's allocation (its matched blocks leaked). Now it is held until
    the step is done."""
    import signal

    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, block_size=4, kv_cache=kv_cache))
    target = {"free": e.kv.eviction, "fork": e.kv, "allocate": e.kv}[where]
    method = {"free": "insert", "fork": "fork", "allocate": "allocate"}[where]
    original, signalled = getattr(target, method), []

    def signalling(*args, **kwargs):
        if not signalled and (where != "allocate" or e.kv.stats().cached_blocks):  # a prefix hit's allocation
            signalled.append(True)
            signal.raise_signal(signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, method, signalling)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2 if where == "fork" else 1)
    prompt = list(range(5, 17))  # three full blocks: cached as they are freed
    ids = [e.add_request(prompt, sampling)]
    tokens: dict[str, list[list[int]]] = {}

    def collect(deltas: list) -> None:
        for out in deltas:
            for o in out.outputs:
                tokens.setdefault(out.request_id, [[], []])[o.index] += o.token_ids

    with pytest.raises(KeyboardInterrupt):
        while e.has_unfinished():
            collect(e.step())
            if where == "allocate" and len(ids) == 1 and not e.has_unfinished():
                ids.append(e.add_request(prompt + [3], sampling))
    while e.has_unfinished():
        collect(e.step())
    stats = e.kv.stats()
    assert signalled and stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks
    fresh = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    prompts = [prompt, prompt + [3]][: len(ids)]
    expected = [[o.token_ids for o in r.outputs] for r in fresh.generate(prompts, sampling)]
    assert [tokens[rid][: sampling.n] for rid in ids] == expected


def test_ctrl_c_late_in_a_step_drops_no_delta_of_another_stream(tiny_model):
    """A Ctrl-C in an on_step observer, while the caller read stream A, came after B's delta of that step was
    built: it was dropped, and B's text silently lacked a token."""

    class CtrlCOnce:
        steps = 0

        @hookimpl
        def on_step(self, stats):
            CtrlCOnce.steps += 1
            if CtrlCOnce.steps == 3:
                raise KeyboardInterrupt

    plugins = PluginManager.from_entry_points()
    plugins.register(CtrlCOnce(), name="ctrl-c-once", source="test")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a, b = e.stream([5, 6, 7], sampling), e.stream([8, 9, 10], sampling)
    with pytest.raises(KeyboardInterrupt):
        for _ in a:
            pass
    got = [t for out in b for t in out.outputs[0].token_ids]
    assert got == e.generate([[8, 9, 10]], sampling)[0].outputs[0].token_ids
    assert not e.has_unfinished() and e.kv.stats().used_blocks == 0


def test_a_second_thread_is_refused_while_one_steps(tiny_model, monkeypatch):
    """Not thread-safe, as documented: two threads' generate calls returned wrong tokens without an error."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    inside, release, results = threading.Event(), threading.Event(), []
    execute = e.runner.execute

    def blocking_execute(*args, **kwargs):
        inside.set()
        release.wait(10)
        return execute(*args, **kwargs)

    from infer.core.beam_search import BeamSearchParams

    search = e.start_beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=20))
    monkeypatch.setattr(e.runner, "execute", blocking_execute)
    worker = threading.Thread(target=lambda: results.append(e.generate([[5, 6, 7]], sampling)))
    worker.start()
    assert inside.wait(10)
    for call in (lambda: e.add_request([5, 6], sampling), e.step, lambda: e.abort("x"),
                 lambda: e.generate([[5, 6]], sampling), lambda: e.abort_beam_search(search),
                 lambda: e.start_beam_search([[7, 8]]), lambda: e.beam_search([[7, 8]])):  # these two left searches
        with pytest.raises(RuntimeError, match="this Engine is in use by another thread, and it is not thread-safe"):
            call()
    release.set()
    worker.join(10)
    e.abort_beam_search(search)  # from this thread once the other is out
    assert results[0][0].outputs[0].token_ids == e.generate([[5, 6, 7]], sampling)[0].outputs[0].token_ids
    assert not e.requests and not e.has_unfinished() and e.kv.stats().used_blocks == 0


def test_a_stream_collected_inside_a_step_is_aborted_after_it(tiny_model, monkeypatch):
    """A started stream caught in a reference cycle, collected by the garbage collector in the middle of a step,
    aborted its request right there (the step then failed, blaming a plugin); now at the next step's start."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kept = e.add_request([8, 9, 10], sampling)
    stream = e.stream([5, 6, 7], sampling, request_id="cycled")
    next(stream)
    cycle: list = [stream]
    cycle.append(cycle)
    del stream, cycle
    execute, collected = e.runner.execute, []

    def collect_then_execute(*args, **kwargs):
        if not collected:  # scheduled, not yet run: an abort here took the blocks the batch was built for
            collected.append(gc.collect())
        return execute(*args, **kwargs)

    monkeypatch.setattr(e.runner, "execute", collect_then_execute)
    tokens: list[int] = []
    while e.has_unfinished():
        tokens += [t for out in e.step() if out.request_id == kept for t in out.outputs[0].token_ids]
    assert collected and "cycled" not in e.requests and not e.readers.owned
    assert tokens == e.generate([[8, 9, 10]], sampling)[0].outputs[0].token_ids
    assert e.kv.stats().used_blocks == 0


def test_a_stream_read_to_its_finished_delta_leaves_the_id_to_a_new_request(engine):
    """A caller's `if out.finished: break` left the finished stream owning the id: a later request of that id had
    its deltas swallowed, and closing the old iterator then aborted it."""
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = engine.stream([5, 6, 7], sampling, request_id="job-1")
    for out in first:
        if out.finished:
            break
    engine.add_request([5, 6, 7], sampling, request_id="job-1")
    deltas = engine.step()
    first.close()
    assert engine.has_unfinished() and "job-1" in engine.requests  # not aborted by the old reader
    while engine.has_unfinished():
        deltas += engine.step()
    want = engine.generate([[5, 6, 7]], sampling)[0].outputs[0].token_ids
    assert [t for d in deltas if d.request_id == "job-1" for t in d.outputs[0].token_ids] == want
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason is not FinishReason.ABORT


def test_none_for_the_stop_lists_means_none(engine):
    """OpenAI's null: None for stop or stop_token_ids is no stop (it was refused as not a string or a list)."""
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.generate(["hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, stop=None))[0] \
        .outputs[0].token_ids == engine.generate(["hi"], params)[0].outputs[0].token_ids


@pytest.mark.parametrize(("options", "message"), [
    ({"blocksize": 16}, "LLM() got unknown option(s) blocksize (did you mean 'block_size'?)"),
    ({"device": 5}, "device (device in Python) must be a string, got 5"),
    ({"device": "cuda:5"}, "device 'cuda:5' was requested but"),  # no CUDA, or fewer than 6 devices
    ({"num_speculative_tokens": "4"}, "num-speculative-tokens (num_speculative_tokens in Python) must be an integer, "
                                      "got '4'"),
    ({"swap_space_gb": None}, "swap-space-gb (swap_space_gb in Python) must be a finite number, got None"),
    ({"plugin_options": {"awq": 3}}, "plugin-options maps a namespace to a dict of options"),
    ({"seed": -1}, "seed must be in [0, 2**63), got -1"),
    ({"cuda_graph_max_tokens": -1}, "cuda-graph-max-tokens must be >= 0 (0: no graphs for prefill and mixed steps)"),
    ({"skinny_gemm_rows": 17}, "skinny-gemm-rows must be in [0, 16] (the kernel takes up to 16 rows), got 17"),
    ({"cpu_threads": 100_000}, "cpu-threads must be in [1, 1024]"),  # torch segfaults there; nothing must start
    ({"cpu_threads": 0}, "cpu-threads must be in [1, 1024]"),
    ({"kv_admission_reserve": 1.5}, "kv-admission-reserve must be a number in [0, 1]"),
    ({"kv_admission_reserve": "adaptive"}, "or auto, got 'adaptive'"),
    ({"kv_admission_reserve": True}, "must be a finite number or a string, got True"),
])
def test_bad_llm_options_are_config_errors_naming_them(tiny_model, options, message):
    from infer import LLM
    from infer.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        LLM(model=str(tiny_model), device="cpu", **options) if "device" not in options else \
            LLM(model=str(tiny_model), **options)
    assert message in str(info.value)


def test_num_kv_blocks_wins_over_a_memory_budget_with_a_warning(tiny_model, caplog):
    from infer import LLM

    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=40, kv_cache_memory_gb=0.5)
    assert llm.engine.kv.num_blocks == 40
    assert "--kv-cache-memory-gb 0.5 is unused: --num-kv-blocks 40 sizes the KV pool" in caplog.text


def test_a_pathlib_model_folder_is_accepted(tiny_model):
    from pathlib import Path

    from infer import LLM

    assert LLM(model=Path(tiny_model), device="cpu").generate(["hi"], SamplingParams(max_tokens=2))[0].finished


def test_a_top_k_beyond_the_vocabulary_filters_nothing(engine):
    def sample(top_k: int) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=1.0, top_k=top_k, seed=7)
        return engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids

    assert sample(10**20) == sample(0)


def test_a_kv_pool_beyond_the_available_host_memory_is_refused_before_allocation(mem_available: int) -> None:
    """A CPU pool that fits the machine's physical memory but not what is free would be zero-filled into the
    OOM killer; it is refused up front. The bound is Linux's MemAvailable, read independently (conftest)."""
    from infer.core.assembly import check_kv_memory
    from infer.core.errors import ConfigError

    per_block = 2**20
    config = EngineConfig(model="unused", device="cpu")
    fits = mem_available // 2 // per_block
    check_kv_memory(config, torch.device("cpu"), fits, per_block)
    with pytest.raises(ConfigError, match=r"the KV pool \(\d+ blocks, .* GiB\) exceeds the memory this machine has "
                                          r"available \(.* GiB, with the model loaded\); lower --num-kv-blocks"):
        check_kv_memory(config, torch.device("cpu"), mem_available // per_block + 64, per_block)
    config.preemption_mode, config.num_swap_blocks = "swap", fits
    with pytest.raises(ConfigError, match=r"the KV pool \(\d+ blocks, .* GiB\) and the swap space \(.* GiB\) exceed "
                                          "the memory"):
        check_kv_memory(config, torch.device("cpu"), fits + 64, per_block)


def test_a_text_too_long_for_any_tokenization_is_refused_without_tokenizing(engine):
    """The bound: every token spells at most ``longest`` characters (its vocabulary string's length), so the most
    compact text, the longest token repeated, needs at least ``max_prompt_chars / 4`` characters to fill the
    context; anything past ``max_prompt_chars`` is refused before the tokenizer sees it."""
    from infer.core.admission import RequestChecker
    from infer.core.errors import InvalidRequestError

    checker = engine.checker
    vocab = engine.tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = engine.tokenizer.decode([vocab[longest]]) * engine.max_model_len
    assert len(text) <= checker.max_prompt_chars // 4 and len(engine.tokenizer.encode(text)) >= engine.max_model_len

    class Untouchable:  # a tokenizer that must not be called
        def get_vocab(self) -> dict[str, int]:
            return vocab

        def encode(self, text: str) -> list[int]:
            raise AssertionError("tokenized a prompt that cannot fit")

    bounded = RequestChecker.for_model(Untouchable(), checker.vocab_size, checker.max_model_len)
    assert bounded.max_prompt_chars == checker.max_prompt_chars
    with pytest.raises(InvalidRequestError, match=f"the prompt has {checker.max_prompt_chars + 1} characters, more "
                                                  "than the model's context of"):
        bounded.tokenize("x" * (checker.max_prompt_chars + 1))


def test_each_request_limit_admits_its_bound_and_refuses_one_past_it():
    """The checker's limits, each at its edge: token ids in [0, vocab), prompt + max_tokens up to the context,
    at most max_prompt_chars characters, stop ids below the vocabulary, min_tokens' ban (EOS unless ignore_eos)
    short of the whole vocabulary, and only loaded LoRA adapters."""
    from infer.core.admission import RequestChecker
    from infer.core.errors import InvalidRequestError

    class CharTokenizer:  # one token per character
        def encode(self, text: str) -> list[int]:
            return [ord(c) % 10 for c in text]

    vocab, context, eos = 10, 8, 9
    checker = RequestChecker(CharTokenizer(), vocab, context, max_prompt_chars=5, lora_adapters=frozenset({"a"}),
                             eos_token_ids=frozenset({eos}))
    assert checker.check([0, vocab - 1], SamplingParams(max_tokens=context - 2)) == [0, vocab - 1]
    with pytest.raises(InvalidRequestError, match="exceeds the model's context length"):
        checker.check([0, vocab - 1], SamplingParams(max_tokens=context - 1))
    for bad in ([vocab], [-1], [True]):
        with pytest.raises(InvalidRequestError, match=r"prompt token ids must be integers in \[0, 10\)"):
            checker.tokenize(bad)
    assert len(checker.tokenize("x" * 5)) == 5
    with pytest.raises(InvalidRequestError, match="the prompt has 6 characters"):
        checker.tokenize("x" * 6)
    checker.check_params(SamplingParams(stop_token_ids=[vocab - 1]))
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be below the model's vocabulary size 10"):
        checker.check_params(SamplingParams(stop_token_ids=[vocab]))
    others = [t for t in range(vocab) if t != eos]  # with EOS: the whole vocabulary
    checker.check_params(SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=others, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="min_tokens bans EOS and the stop_token_ids"):
        checker.check_params(SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=others))
    checker.check_params(SamplingParams(lora_adapter="a"))
    with pytest.raises(InvalidRequestError, match="lora_adapter 'b' is not loaded; the loaded adapters: a"):
        checker.check_params(SamplingParams(lora_adapter="b"))


def test_swap_that_cannot_hold_a_sequence_is_warned_about_and_recomputes(tiny_model, hf_greedy, caplog):
    """A swap space of no block, and a full one, fall back to recompute: correct tokens, and said once each."""
    with caplog.at_level(logging.WARNING, logger="infer"):
        none = Engine(EngineConfig(model=str(tiny_model), device="cpu", preemption_mode="swap", swap_space_gb=1e-9))
    assert "--swap-space-gb 1e-09 holds no KV block" in caplog.text and not none.runner.host_caches
    caplog.clear()
    prompts = [list(range(10 + 40 * i, 30 + 40 * i)) for i in range(4)]
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", preemption_mode="swap", num_swap_blocks=2,
                            block_size=4, num_kv_blocks=16))
    with caplog.at_level(logging.WARNING, logger="infer"):
        outs = e.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert e.scheduler.num_preemptions > e.scheduler.num_swapped_out  # some preemptions found the swap full
    assert caplog.text.count("the swap space is full") == 1
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_model, p, 24) for p in prompts]


def test_sampling_numbers_are_python_numbers_and_bools_are_none(engine):
    """True passed as temperature 1 and top_p 1; numpy float32 got "must be in (0, 1]"; a temperature past float32
    made every logit 0 and turned top-k off; [True, 5] passed as token ids."""
    import numpy as np

    from infer import InvalidRequestError

    for field, value, message in (("temperature", True, "temperature must be a number >= 0"),
                                  ("top_p", True, "top_p must be a number in"), ("min_p", False, "min_p must be a"),
                                  ("top_p", np.float32(0.5), "top_p must be a Python int or float, got"),
                                  ("max_tokens", np.int64(4), "max_tokens must be a Python int or float, got"),
                                  ("temperature", 1e39, r"temperature must be at most 1e\+06")):
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("hi", SamplingParams(**{field: value}))
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
        engine.add_request([True, 5], greedy(1))
    assert engine.generate(["hi"], SamplingParams(top_p=np.float64(0.5), max_tokens=1))  # a float subclass: fine


def test_building_an_engine_leaves_torch_global_generator_alone(tiny_model):
    """The embedding's random init drew from torch's global generator (then loading overwrote it)."""
    from infer import LLM, ConfigError

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16))
    assert torch.equal(torch.rand(3), expected)
    for bad in (None, [5]):
        with pytest.raises(ConfigError, match="plugin must be a component name or a list of them"):
            LLM(str(tiny_model), plugin=bad)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(engine):
    """The text was cut at the stop string but the finish reason said length (a stop token there says stop)."""
    for prompt in ("def f(x):", "import os\n", "class A:", "x = [", "return", "while True:"):
        tokens = engine.generate([prompt], greedy(6))[0].outputs[0].token_ids
        full = engine.tokenizer.decode(tokens)
        last = engine.tokenizer.decode(tokens[-1:]).strip()
        if last and full.find(last) == len(full.rstrip()) - len(last):  # the last token's text, found only there
            break
    else:
        pytest.fail("no prompt whose last token's text is new to its output")
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[last]))
    completion = out[0].outputs[0]
    assert completion.token_ids == tokens and completion.finish_reason is FinishReason.STOP
    assert completion.text == full[: full.find(last)]


def test_an_abort_does_not_finish_a_completion_twice(engine):
    """n = 3: a completion that stopped early was reported finished again by the abort."""
    seeded = dict(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, n=3)
    free = engine.generate(["hello"], SamplingParams(**seeded))[0].outputs  # each completion draws from its seed
    stop = next(t for t in free[2].token_ids[1:3] if t not in free[0].token_ids + free[1].token_ids
                and t not in free[2].token_ids[:1])
    rid = engine.add_request("hello", SamplingParams(**seeded, stop_token_ids=[stop]))
    deltas = []
    for _ in range(5):
        deltas += engine.step()
    deltas.append(engine.abort(rid))
    finishes = [(c.index, c.finish_reason) for d in deltas for c in d.outputs if c.finish_reason is not None]
    assert sorted(finishes) == [(0, FinishReason.ABORT), (1, FinishReason.ABORT), (2, FinishReason.STOP)]
    assert drained(engine)


def test_a_stream_closed_before_its_first_delta_aborts_its_request(engine):
    stream = engine.stream("hi", greedy(20))
    stream.close()
    assert not engine.has_unfinished() and not engine.readers.owned and not engine.readers.waiting and drained(engine)
    with engine.stream("hi", greedy(20)) as deltas:
        next(deltas)
    assert not engine.has_unfinished() and not engine.readers.owned and drained(engine)


def test_a_batch_reader_closed_before_its_first_result_aborts_its_requests(engine):
    calls = engine.generate_as_completed(["a", "b"], greedy(20))
    calls.close()
    assert not engine.has_unfinished() and not engine.readers.owned and drained(engine)


def test_a_reader_dropped_unread_has_its_requests_aborted_at_the_next_step(engine):
    """Dropped before its first next (an error between the call and the loop), a reader ran no clean-up: its request
    decoded to max_tokens for nobody, and its id stayed owned, so step() never saw a later request of that id."""
    import gc

    stream = engine.stream("hi", greedy(200), request_id="r1")
    batch = engine.generate_as_completed(["a", "b"], greedy(200))
    del stream, batch
    gc.collect()
    engine.step()  # aborts them first
    assert not engine.has_unfinished() and not engine.readers.owned and drained(engine)
    engine.add_request("hi", greedy(3), request_id="r1")
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 3 and deltas[-1].finished
    started = engine.stream("hi", greedy(50), request_id="r2")
    next(started)
    del started  # started: its own clean-up aborts it at once
    gc.collect()
    assert not engine.has_unfinished() and not engine.readers.abandoned
    again = list(engine.stream("hi", greedy(3), request_id="r2"))  # the id reused at once: the old reader leaves it
    assert sum(len(d.outputs[0].token_ids) for d in again) == 3 and again[-1].outputs[0].finish_reason.value == "length"


def test_the_summary_after_an_abort_shows_the_pool_as_it_is(engine):
    """The summary's KV figures were the last step's: after an abort they still counted the aborted request's
    blocks as used while its finished count had moved on."""
    rid = engine.add_request("hello there", greedy(50))
    engine.step()
    engine.step()
    engine.abort(rid)
    summary, kv = engine.stats.summary(), engine.kv.stats()
    assert (summary["kv_blocks_used"], summary["kv_blocks_free"], summary["kv_blocks_cached"]) == \
        (kv.used_blocks, kv.free_blocks, kv.cached_blocks) and kv.used_blocks == 0


def test_a_failed_step_still_delivers_the_other_readers_outputs(tiny_model):
    """An observer fails one step: the reader whose next() ran it gets the error; another stream still gets every
    token, and a batch reader whose request finished in that step its result (it stepped an idle engine forever)."""
    class FailsOnce:
        def __init__(self, at: int) -> None:
            self.steps, self.at = 0, at

        @hookimpl
        def on_step(self, stats):
            self.steps += 1
            if self.steps == self.at:
                raise RuntimeError("transient")

    from infer.core.errors import PluginError

    for at in (3, 4):  # 4: B (4 tokens) finishes in the failing step
        plugins, observer = PluginManager.from_entry_points(), FailsOnce(-1)
        plugins.register(observer, name="fails-once", source="acme")
        e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
        want = e.generate([rand_prompt(14, 8)], greedy(12))[0].outputs[0].token_ids
        observer.steps, observer.at = 0, at
        a, b = e.stream(rand_prompt(12, 7), greedy(10)), e.stream(rand_prompt(14, 8), greedy(12))
        with pytest.raises(PluginError, match="the observer 'fails-once' from 'acme' raised RuntimeError"):
            for _ in a:
                pass
        assert [t for out in b for t in out.outputs[0].token_ids] == want
        observer.steps = 0
        batch = e.generate_as_completed([rand_prompt(14, 8)], greedy(4))
        with pytest.raises(PluginError):
            for _ in e.stream(rand_prompt(12, 7), greedy(10)):
                pass
        [(index, result)] = list(batch)
        assert index == 0 and result.outputs[0].token_ids == want[:4] and drained(e)


def test_append_output_copies_new_and_out_of_order_completions_in():
    """The in-place fast path serves one delta over completions 0..n-1 only; anything else is merged by index."""
    from infer.core.outputs import append_output
    from infer.core.request import CompletionOutput, RequestOutput

    def texts(out):
        return [(c.index, c.token_ids, c.text) for c in out.outputs]

    late = append_output(RequestOutput("r", [1], [CompletionOutput(1, [5], "b")], False),
                         RequestOutput("r", [1], [CompletionOutput(0, [4], "a", FinishReason.STOP)], True))
    assert texts(late) == [(0, [4], "a"), (1, [5], "b")] and late.finished
    grown = append_output(RequestOutput("r", [1], [CompletionOutput(0, [4], "a")], False),
                          RequestOutput("r", [1], [CompletionOutput(1, [6], "c")], False))
    assert texts(grown) == [(0, [4], "a"), (1, [6], "c")]
    full = RequestOutput("r", [1], [CompletionOutput(0, [4], "a"), CompletionOutput(1, [6], "c")], False)
    same = full.outputs
    assert texts(append_output(full, RequestOutput("r", [1], [CompletionOutput(1, [7], "d")], False))) == [
        (0, [4], "a"), (1, [6, 7], "cd")] and full.outputs is same  # in place


def test_only_a_stop_token_that_ended_the_sequence_is_silent():
    from infer.core.request import SequenceStatus

    def ended(tokens, reason):
        seq = Sequence(0, "r", [1, 2], SamplingParams(stop_token_ids=(9,)), 0.0, eos_token_ids=frozenset({3}))
        seq.token_ids += tokens
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return seq.ends_on_stop_token()

    assert ended([5, 3], FinishReason.STOP) and ended([5, 9], FinishReason.STOP)
    assert not ended([5, 6], FinishReason.STOP)  # a stop string ended it: its last token's text stays
    assert not ended([5, 3], FinishReason.LENGTH) and not ended([5, 3], FinishReason.ABORT)
    assert not ended([], FinishReason.STOP)  # the prompt's last token is no output


def test_of_two_stop_strings_found_together_the_earlier_then_the_longer_ends_the_text():
    from types import SimpleNamespace

    from infer.core.outputs import RequestState, _first_stop

    req = RequestState("r", [1], SamplingParams(stop=("ie", "i", "s")), 0.0, [], [], [0], [0])
    assert _first_stop(req, 0, SimpleNamespace(text="calies")) == (3, 5)  # "ie" and "i" at 3, before "s" at 5
    assert _first_stop(req, 0, SimpleNamespace(text="cal")) is None


# ---------------------------------------------------------------- readers, outputs and forks (a mutation audit)
class FailsOnFirstFinish:
    """on_request_finished raises once: the step that ends a request fails, its final delta lost with it."""
    failed = False

    @hookimpl
    def on_request_finished(self, output):
        if not self.failed:
            self.failed = True
            raise RuntimeError("transient")


@pytest.mark.parametrize("reader", ["generate_as_completed", "stream"])
def test_a_reader_whose_request_ended_in_another_callers_failed_step_ends_too(tiny_model, reader, monkeypatch):
    """Its last delta lost in a failed step another reader ran, a reader still ends with what came before."""
    from infer.core.errors import PluginError

    plugins = PluginManager.from_entry_points()
    plugins.register(FailsOnFirstFinish(), name="fails-on-finish", source="acme")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    prompt = rand_prompt(14, 8)
    victim = getattr(e, reader)([prompt] if reader == "generate_as_completed" else prompt, greedy(4))
    with pytest.raises(PluginError, match="fails-on-finish"):
        for _ in e.stream(rand_prompt(12, 7), greedy(10)):  # its 4th step ends the victim, and fails
            pass
    assert not e.requests
    advance, calls = e._advance, []  # it looped over an idle engine forever: fail instead of hanging
    monkeypatch.setattr(e, "_advance", lambda: (calls.append(1), len(calls) <= 40 or pytest.fail(
        "stepped an idle engine"), advance()))
    if reader == "generate_as_completed":
        [(index, result)] = list(victim)
        tokens = result.outputs[0].token_ids
    else:
        tokens = [t for out in victim for t in out.outputs[0].token_ids]
    want = e.generate([prompt], greedy(4))[0].outputs[0].token_ids
    assert 0 < len(tokens) < 4 and tokens == want[: len(tokens)]
    assert not e.readers.owned and not e.readers.waiting and e.kv.stats().used_blocks == 0


def test_a_stream_ends_at_its_finished_delta_even_when_its_id_is_taken_at_once(engine):
    """The loop's next() after the finished delta ends the stream without stepping the id's new request."""
    got = []
    for out in engine.stream([5, 6, 7], greedy(3), request_id="job-2"):
        got += out.outputs[0].token_ids
        if out.finished:
            engine.add_request([5, 6, 7], greedy(30), request_id="job-2")
    assert engine.requests["job-2"].seqs[0].num_output_tokens == 0
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    want = engine.generate([[5, 6, 7]], greedy(30))[0].outputs[0].token_ids
    assert got == want[:3] and [t for d in deltas for t in d.outputs[0].token_ids] == want


def test_a_batch_request_that_ends_inside_a_nested_call_keeps_its_last_deltas(engine):
    """"two" ends inside the nested call (its delta of the step that ends "one" read first): returned whole."""
    lengths = {"one": 2, "two": 4, "inner": 8}
    alone = {p: engine.generate([p], greedy(n))[0].outputs[0].token_ids for p, n in lengths.items()}
    got = {}
    for i, out in engine.generate_as_completed(["two", "one"], [greedy(4), greedy(2)]):
        got[("two", "one")[i]] = (out.outputs[0].token_ids, out.finished, out.outputs[0].finish_reason)
        if i == 1:  # "two" ends inside this call
            got["inner"] = (engine.generate(["inner"], greedy(8))[0].outputs[0].token_ids, True, FinishReason.LENGTH)
    assert got == {p: (alone[p], True, FinishReason.LENGTH) for p in lengths}
    assert not engine.has_unfinished() and not engine.readers.owned and not engine.readers.waiting


def test_a_batch_reader_collected_inside_a_step_has_its_requests_aborted_after_it(tiny_model, monkeypatch):
    """As a stream's: GC'd inside a step, its unfinished request is aborted at the next step's start."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    kept = e.add_request([8, 9, 10], greedy(8))
    batch = e.generate_as_completed([[5, 6, 7], [5, 6]], [greedy(1), greedy(30)])
    assert next(batch)[0] == 0
    cycle: list = [batch]
    cycle.append(cycle)
    del batch, cycle
    execute, collected = e.runner.execute, []

    def collect_then_execute(*args, **kwargs):
        if not collected:
            collected.append(gc.collect())
        return execute(*args, **kwargs)

    monkeypatch.setattr(e.runner, "execute", collect_then_execute)
    seen, steps = set(), 0
    while e.has_unfinished():
        seen |= {out.request_id for out in e.step()}
        steps += 1
    assert collected and seen == {kept} and not e.readers.owned and steps <= 8 and drained(e)


@pytest.mark.parametrize("extra", [{}, {"stop": ["never appears"]}])
def test_the_stop_token_that_ends_an_output_keeps_its_logprobs(engine, tiny_model, extra):
    """Its text is left out, but it is an output token: one logprobs entry per token, HF's log-softmax."""
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(10, 9)
    free = engine.generate([prompt], greedy(8))[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, stop_token_ids=[free[3]],
                            **extra)
    out = engine.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and len(out.logprobs) == len(out.token_ids)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    for position, entry in enumerate(out.logprobs):
        assert set(entry) == set(ref[position].topk(2).indices.tolist())  # greedy: the token is the top-1
        for candidate, value in entry.items():
            assert value == pytest.approx(ref[position, candidate].item(), abs=1e-4)


def test_a_forked_child_whose_first_token_is_a_stop_token_stops_there(engine):
    """Greedy n = 2: both sequences sample the same first token; as a stop token it ends the child too."""
    prompt = rand_prompt(10, 9)
    first = engine.generate([prompt], greedy(4))[0].outputs[0].token_ids[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2, stop_token_ids=[first])
    out = engine.generate([prompt], params)[0]
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([first], FinishReason.STOP)] * 2
    assert not engine.has_unfinished() and drained(engine)


def test_an_n_request_aborted_before_its_fork_leaves_nothing_to_a_later_request_of_its_id(engine):
    """The unforked children of an aborted n = 3 request are not forked into a later request of the same id."""
    prompt = rand_prompt(10, 9)
    engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=3), request_id="x")
    assert engine.abort("x").finished
    engine.add_request(prompt, greedy(4), request_id="x")
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
        assert engine.scheduler.num_running() <= 1
    want = engine.generate([prompt], greedy(4))[0].outputs[0].token_ids
    assert [(c.index, t) for d in deltas for c in d.outputs for t in c.token_ids] == [(0, t) for t in want]
    assert drained(engine)


def test_forked_children_start_from_the_parents_computed_prompt(tiny_model, hf_greedy):
    """n = 3: the prompt is computed once; then one decode token per sequence a step; each is HF's greedy run."""
    class Steps:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        @hookimpl
        def on_step(self, stats):
            self.seen.append((stats.num_prefill_tokens, stats.num_decode_tokens))

    plugins, steps = PluginManager.from_entry_points(), Steps()
    plugins.register(steps, name="steps", source="test")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    prompt = rand_prompt(20, 3)
    out = e.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny_model, prompt, 4)] * 3
    assert steps.seen == [(20, 0)] + [(0, 3)] * 3


def bare_scheduler(num_blocks: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                   block_size: int = 4, **options: Any) -> ContinuousScheduler:
    """The continuous scheduler over a paged cache without prefix caching, driven without a model; ``options``:
    more EngineConfig fields."""
    config = EngineConfig(block_size=block_size, enable_prefix_caching=False, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, **options)
    return ContinuousScheduler(config, PagedKVCache(num_blocks, block_size, LRUPolicy(), False))


def three_decoding(scheduler: ContinuousScheduler) -> tuple[Sequence, Sequence, Sequence]:
    """A and B (one block each, full) and C (10 tokens: 3 blocks, the last part-full) prefilled in one step, each
    given its first token: in a pool of 5 blocks none is free, and A and B each need a new block to decode."""
    a, b, c = (Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=4), 0.0)
               for i, prompt in enumerate([[1] * 4, [2] * 4, [3] * 10]))
    for seq in (a, b, c):
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [item.seq for item in first.scheduled] == [a, b, c] and scheduler.kv.num_free_blocks() == 0
    scheduler.update(first, {seq.seq_id: [7] for seq in (a, b, c)}, 0.0)
    return a, b, c


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(3, 8192), (8, 3)])
def test_n_up_to_the_running_seats_is_accepted_and_one_more_refused(max_num_seqs: int,
                                                                   max_num_batched_tokens: int) -> None:
    """n sequences run at once: n equal to the seats (the smaller of max_num_seqs and max_num_batched_tokens) is
    accepted, n one over is refused."""
    scheduler = bare_scheduler(64, max_num_seqs, max_num_batched_tokens)
    seats = min(max_num_seqs, max_num_batched_tokens)
    for n, accepted in ((seats, True), (seats + 1, False)):
        seq = Sequence(n, "r", [1, 2], SamplingParams(max_tokens=2, n=n), 0.0)
        if accepted:
            scheduler.check(seq)
        else:
            with pytest.raises(CapacityError, match=f"n={n} asks for {n} sequences"):
                scheduler.check(seq)


def test_a_prompt_of_exactly_the_token_budget_is_accepted_unchunked() -> None:
    scheduler = bare_scheduler(64, max_num_batched_tokens=8)
    scheduler.check(Sequence(0, "r", list(range(8)), SamplingParams(max_tokens=1), 0.0))
    with pytest.raises(CapacityError, match="prompt of 9 tokens exceeds max-num-batched-tokens 8"):
        scheduler.check(Sequence(1, "r", list(range(9)), SamplingParams(max_tokens=1), 0.0))


def test_a_preemption_takes_the_youngest_running_sequence_and_requeues_it_first() -> None:
    """A and B decode into a new block each, C (admitted last, mid-block) needs none; the pool has no free block.
    A's allocation preempts the youngest, C (not B, older), whose blocks let A and B run and leave one free; C goes
    back to the front of the queue, before D, which arrived later."""
    scheduler = bare_scheduler(5, max_num_seqs=8)
    a, b, c = three_decoding(scheduler)
    d = Sequence(3, "r3", [4], SamplingParams(max_tokens=1), 0.0)
    scheduler.add(d)
    second = scheduler.schedule()
    assert second.preempted == [c]
    assert [item.seq for item in second.scheduled] == [a, b]
    assert list(scheduler.waiting) == [c, d] and scheduler.kv.num_free_blocks() == 1


def test_a_recompute_longer_than_the_token_budget_runs_alone() -> None:
    """A is preempted with more tokens (prompt and outputs) than a step's budget: once nothing else runs, its
    recompute is scheduled alone, over budget, rather than waiting forever."""
    scheduler = bare_scheduler(3, max_num_seqs=8, max_num_batched_tokens=8)
    b = Sequence(0, "r0", [2], SamplingParams(max_tokens=4), 0.0)
    a = Sequence(1, "r1", [1] * 7, SamplingParams(max_tokens=4), 0.0)
    scheduler.add(b)
    scheduler.add(a)
    recomputes: list[tuple[int, int]] = []  # (tokens scheduled, tokens of A) in A's steps after its preemption
    for _ in range(10):
        out = scheduler.schedule()
        recomputes += [(item.num_new_tokens, a.num_tokens) for item in out.scheduled
                       if item.seq is a and a.num_preemptions]
        scheduler.update(out, {item.seq.seq_id: [7] for item in out.scheduled
                               if item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens}, 0.0)
        if not scheduler.has_unfinished():
            break
    assert a.num_preemptions == 1 and b.finish_reason is not None and a.finish_reason is not None
    scheduled, tokens = recomputes[0]
    assert scheduled == tokens > scheduler.token_budget  # every token of A at once


def test_a_victim_that_exactly_fills_the_swap_space_is_swapped_and_an_abort_while_swapped_frees_it() -> None:
    """The swap space holds exactly the victim's computed blocks: it is swapped out, not recomputed. Aborted while
    it waits swapped out, its host blocks return to the swap space (a step later, as every released host block)."""
    swap_blocks = 3
    scheduler = bare_scheduler(5, max_num_seqs=8, preemption_mode="swap", num_swap_blocks=swap_blocks)
    a, b, c = three_decoding(scheduler)
    second = scheduler.schedule()
    assert second.preempted == [c]
    victim_blocks = -(-len(c.prompt_token_ids) // 4)  # its prompt, computed in the first step
    assert victim_blocks == swap_blocks and len(second.block_ops.swap_out) == victim_blocks
    scheduler.finish(c, FinishReason.ABORT)
    scheduler.update(second, {seq.seq_id: [7] for seq in (a, b)}, 0.0)
    scheduler.schedule()
    assert scheduler.swap is not None and sorted(scheduler.swap.free) == list(range(swap_blocks))


def test_a_requeued_parent_that_has_forked_takes_one_seat() -> None:
    """An n=2 parent preempted after its first token (its child forked then and runs on) takes one seat when it is
    admitted again, not n: beside its running child it fits in max_num_seqs=2."""
    scheduler = bare_scheduler(16, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, n=2)
    child = Sequence(1, "r0", [1] * 4, params, 0.0, index=1, token_ids=[1] * 4 + [8])
    parent = Sequence(0, "r0", [1] * 4, params, 0.0, token_ids=[1] * 4 + [7], num_preemptions=1)
    scheduler.add(child)
    assert [item.seq for item in scheduler.schedule().scheduled] == [child]
    scheduler.add(parent)
    assert [item.seq for item in scheduler.schedule().scheduled] == [child, parent]


# ---------------------------------------------------------------- engine bookkeeping (a second mutation audit)
def test_a_request_id_in_use_is_refused_and_its_request_runs_on(engine):
    """A second add_request of a live id is an InvalidRequestError; the first request keeps its id and tokens."""
    from infer.core.errors import InvalidRequestError

    engine.add_request([5, 6, 7], greedy(4), request_id="taken")
    with pytest.raises(InvalidRequestError, match="request id 'taken' is already in use"):
        engine.add_request([8, 9, 10], greedy(9), request_id="taken")
    assert engine.scheduler.num_waiting() + engine.scheduler.num_running() == 1  # nothing of the second queued
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [t for d in deltas for t in d.outputs[0].token_ids] == \
        engine.generate([[5, 6, 7]], greedy(4))[0].outputs[0].token_ids
    assert [d.finished for d in deltas].count(True) == 1 and drained(engine)


def test_the_summary_counts_every_prompt_and_output_token(tiny_model):
    """summary()'s prompt_tokens and output_tokens: the prompts' lengths and every completion's tokens (n = 2
    counts both), one request run alone, then three together."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.9, seed=1, n=2, ignore_eos=True))
    assert (e.stats.summary()["prompt_tokens"], e.stats.summary()["output_tokens"]) == (4, 6)
    e.generate([[5] * 10, [6] * 3, [7]], [greedy(2), greedy(5), greedy(1)])
    assert (e.stats.summary()["prompt_tokens"], e.stats.summary()["output_tokens"]) == (4 + 14, 6 + 8)


def test_closing_a_batch_reader_after_two_of_its_requests_ended_together_aborts_the_third(engine):
    """Two requests end in one step, the caller takes the first result and closes the reader: the other finished
    one is not aborted (it no longer exists: aborting it raised NotFoundError out of close()), the third is."""
    calls = engine.generate_as_completed([[5, 6, 7], [8, 9, 10], [11, 12]], [greedy(2), greedy(2), greedy(40)])
    index, first = next(calls)
    assert index == 0 and first.finished
    calls.close()
    assert not engine.has_unfinished() and not engine.readers.owned and drained(engine)


def test_an_abort_that_fails_as_a_stream_is_closed_raises_from_close(tiny_model):
    """Closing a stream aborts its request; an observer's error in that abort is news (no error came before), so
    close() raises it, naming the plugin, and the request is gone."""
    from infer.core.errors import PluginError

    plugins = PluginManager.from_entry_points()
    plugins.register(FailsOnFirstFinish(), name="fails-on-finish", source="acme")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    stream = e.stream([5, 6, 7], greedy(30))
    next(stream)
    with pytest.raises(PluginError, match="fails-on-finish"):
        stream.close()
    assert not e.requests and e.kv.stats().used_blocks == 0


def test_after_a_ctrl_c_a_completion_that_stopped_before_it_is_not_finished_again(tiny_model):
    """A Ctrl-C (in an on_step observer) while an n = 3 request runs, one of its completions stopped steps before:
    the next step re-emits only requests whose every sequence finished, so each completion finishes once, and the
    request's tokens are those of an uninterrupted run."""
    class CtrlCAt:
        steps, at = 0, -1

        @hookimpl
        def on_step(self, stats):
            self.steps += 1
            if self.steps == self.at:
                raise KeyboardInterrupt

    plugins, observer = PluginManager.from_entry_points(), CtrlCAt()
    plugins.register(observer, name="ctrl-c-at", source="test")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    seeded = dict(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, n=3)
    free = e.generate(["hello"], SamplingParams(**seeded))[0].outputs
    stop = next(t for t in free[2].token_ids[1:3] if t not in free[0].token_ids + free[1].token_ids
                and t not in free[2].token_ids[:1])
    want = e.generate(["hello"], SamplingParams(**seeded, stop_token_ids=[stop]))[0].outputs
    assert want[2].finish_reason is FinishReason.STOP and len(want[2].token_ids) <= 3
    observer.steps, observer.at = 0, 6  # completion 2 stopped by step 4
    driver = e.stream([5, 6, 7], greedy(30))
    watched = e.stream("hello", SamplingParams(**seeded, stop_token_ids=[stop]))
    with pytest.raises(KeyboardInterrupt):
        for _ in driver:
            pass
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes = []
    for out in watched:
        for c in out.outputs:
            tokens[c.index] += c.token_ids
            finishes += [(c.index, c.finish_reason)] if c.finish_reason is not None else []
    assert sorted(finishes) == [(0, FinishReason.LENGTH), (1, FinishReason.LENGTH), (2, FinishReason.STOP)]
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in want]
    assert not e.has_unfinished() and e.kv.stats().used_blocks == 0


def test_copies_a_scheduler_leaves_in_the_kv_cache_run_before_the_step(tiny_model, hf_greedy):
    """KVCache.take_block_ops: "the engine takes what is left after each Scheduler.schedule". A scheduler that
    never takes the copy-on-write copies itself still gets them run: n = 3 forks share a part-full prompt block,
    each child's first write copies it, and every completion is HF's greedy one."""
    from infer.core.interfaces import BlockOps

    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    schedule, take, inside, left = e.scheduler.schedule, e.kv.take_block_ops, [], []

    def schedule_without_taking():
        inside.append(True)
        try:
            return schedule()
        finally:
            inside.pop()

    def take_outside_schedule() -> BlockOps:
        if inside:
            return BlockOps()
        ops = take()
        left.append(len(ops.copies))
        return ops

    e.scheduler.schedule, e.kv.take_block_ops = schedule_without_taking, take_outside_schedule
    prompt = rand_prompt(20, 4)  # a part-full second block, shared by the forks
    out = e.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny_model, prompt, 6)] * 3
    assert sum(left) >= 2  # the copies came to the engine
    assert drained(e)


def test_a_scheduler_whose_finish_leaves_the_sequence_running_is_named(tiny_model):
    """The engine ends a request by its sequences' status: a finish() that does not set it would leave the request
    for ever, so the abort fails naming the scheduler and what its finish() must do."""
    from infer.core.errors import PluginError

    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64))
    rid = e.add_request([5, 6, 7], greedy(10))
    e.step()
    e.scheduler.finish = lambda seq, reason: None
    with pytest.raises(PluginError, match=r"scheduler 'continuous': finish\(\) left sequence \d+ RUNNING; it must "
                                          "set seq.status = SequenceStatus.FINISHED"):
        e.abort(rid)


def test_an_error_held_for_a_step_that_then_fails_is_not_raised_by_the_next_step(tiny_model):
    """An observer's error at a request's end is held until the step's end; a Ctrl-C later in that step raises
    instead. The held error goes with that step: the next steps run clean, and the other request's tokens are whole."""
    class FinishThenCtrlC:
        failed = interrupted = False

        @hookimpl
        def on_request_finished(self, output):
            if not self.failed:
                self.failed = True
                raise RuntimeError("transient")

        @hookimpl
        def on_step(self, stats):
            if self.failed and not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt

    plugins, observer = PluginManager.from_entry_points(), FinishThenCtrlC()
    plugins.register(observer, name="finish-then-ctrl-c", source="test")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    short, long = e.stream([5, 6, 7], greedy(2)), e.stream([8, 9, 10], greedy(8))
    with pytest.raises(KeyboardInterrupt):
        for _ in short:
            pass
    assert observer.failed and observer.interrupted
    tokens = [t for out in long for t in out.outputs[0].token_ids]  # steps on: no error left over
    assert tokens == e.generate([[8, 9, 10]], greedy(8))[0].outputs[0].token_ids
    assert not e.has_unfinished() and e.kv.stats().used_blocks == 0


def test_of_two_requests_failing_at_their_end_in_one_step_the_first_ones_error_is_raised(tiny_model):
    """Both requests end in one step and an observer fails on each: both are finished and gone, and the step
    raises the first failure (the first request's), as it does for any error held until a step's end."""
    from infer.core.errors import PluginError

    class FailsOnEveryFinish:
        @hookimpl
        def on_request_finished(self, output):
            raise RuntimeError(f"cannot record {output.request_id}")

    plugins = PluginManager.from_entry_points()
    plugins.register(FailsOnEveryFinish(), name="fails-on-every-finish", source="acme")
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    e.add_request([5, 6, 7], greedy(2), request_id="first")
    e.add_request([8, 9, 10], greedy(2), request_id="second")
    e.step()
    with pytest.raises(PluginError) as info:
        e.step()
    assert "cannot record first" in str(info.value.__cause__) and not e.requests
    assert e.kv.stats().used_blocks == 0


def test_one_token_prefill_chunks_beside_decodes_equal_hf(tiny_model, hf_greedy):
    """A budget of 4 tokens with three sequences decoding leaves one token a step to a long prompt: each of its
    one-token chunks but the last is a prefill (no sample), and every output is HF's greedy one."""
    e, log = observed_engine(tiny_model, scheduler="chunked-prefill", max_num_batched_tokens=4, max_num_seqs=4,
                             num_kv_blocks=64, block_size=4)
    prompts, lengths = [[11], [12], [13], rand_prompt(9, 60)], [12, 12, 12, 3]
    outs = e.generate(prompts, [greedy(n) for n in lengths])
    assert sum(split == (1, 3) for split in log.split) >= 4  # one prompt token beside three decodes, steps on end
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_model, p, n) for p, n in zip(prompts, lengths)]
    assert drained(e)


def test_a_kv_memory_budget_holds_the_blocks_its_bytes_fit(tiny_model):
    """--kv-cache-memory-gb: a block holds K and V of every layer for block_size tokens (float32 on the CPU), so the
    pool is the budget over that, rounded down."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache_memory_gb=0.01, block_size=16))
    spec = e.loaded.model.spec
    per_block = 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4
    assert e.kv.num_blocks == int(0.01 * 2**30) // per_block > 1
