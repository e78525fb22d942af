"""Prompt logprobs against HF transformers' full-prompt forward pass: whole prefills, chunked ones, async scheduling,
CUDA graphs' outputs (replayed eagerly on the CPU), a recomputed prompt, beside prefix caching (a prompt that asks
for them is computed in full, and caching still serves the others), n > 1, streams and the CLI (gRPC: test_server)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the graph paths run the triton backend, interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import InvalidRequestError  # noqa: E402
from infer.core.request import RequestOutput, SamplingParams  # noqa: E402

PROMPTS = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(4)]  # 9 to 18 tokens


@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(path: Path) -> Callable[[list[int]], torch.Tensor]:
    """The HF model's log-softmax at every prompt position: row j is the distribution of token j + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs


def check(out: RequestOutput, prompt: list[int], width: int, reference: Callable[[list[int]], torch.Tensor]) -> None:
    """Entry 0 is None; entry i holds prompt token i's logprob and the top ``width`` of position i - 1, as HF."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    logp = reference(prompt)
    for i, entry in enumerate(entries[1:], 1):
        assert entry is not None
        assert entry[prompt[i]] == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-4)
        top = logp[i - 1].topk(width)
        assert set(entry) == set(top.indices.tolist()) | {prompt[i]}
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("variant", ["whole", "chunked", "async-scheduling", "graphs", "radix-cache"])
def test_prompt_logprobs_equal_hf(path: Path, reference, variant: str) -> None:
    options: dict = dict(model=str(path), device="cpu", num_kv_blocks=64)
    if variant == "chunked":  # 5-token chunks: each prompt's rows come from several steps
        options.update(scheduler="chunked-prefill", max_num_batched_tokens=5)
    if variant == "graphs":  # 3-token chunks of one sequence: steps that a 3-query-token graph replays
        options.update(scheduler="chunked-prefill", max_num_batched_tokens=3, attention="triton", dtype="float32")
    if variant == "async-scheduling":
        options.update(async_scheduling=True)
    if variant == "radix-cache":
        options.update(kv_cache="radix-cache")
    engine = Engine(EngineConfig(**options))
    if variant == "graphs":  # logits from a decode graph's output buffer, or hidden states from a mixed-step graph
        engine.runner.enable_cuda_graphs(4, {3: 4}, eager=True, mixed_tokens=24, mixed_rows=8)
    widths = [0, 1, 3, 5]
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=w) for w in widths])
    for out, prompt, width in zip(outs, PROMPTS, widths):
        check(out, prompt, width, reference)
    plain = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert engine.prompt_logprob_requests == 0
    if variant == "graphs":
        assert engine.runner.graphs is not None and engine.runner.graphs.replays[3] > 0
        assert engine.runner.mixed_graphs is not None and engine.runner.mixed_graphs.replays > 0


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_equal_hf(path: Path, reference) -> None:
    """The CUDA defaults (triton attention, CUDA graphs, async scheduling), in float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
    for out, prompt in zip(outs, PROMPTS):
        check(out, prompt, 2, reference)


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_a_prompt_asking_for_logprobs_is_not_served_from_the_prefix_cache(path: Path, reference,
                                                                          kv_cache: str) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, kv_cache=kv_cache))
    prompt = PROMPTS[3]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert engine.generate([prompt], params)[0].num_cached_tokens == 0
    assert engine.generate([prompt], params)[0].num_cached_tokens > 0  # cached now
    asked = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert asked.num_cached_tokens == 0
    check(asked, prompt, 2, reference)
    assert engine.generate([prompt], params)[0].num_cached_tokens > 0  # and caching goes on


def test_a_preempted_prompt_keeps_what_it_collected(path: Path, reference) -> None:
    """A pool too small for every sequence preempts some, by recompute: a prompt computed again adds no entry
    twice, and those that came from its first computation stay right."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=6, max_num_seqs=4,
                                 scheduler="chunked-prefill", max_num_batched_tokens=8))
    prompts = [list(range(10, 22)), list(range(50, 62))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                   prompt_logprobs=1))
    assert engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        check(out, prompt, 1, reference)


def test_a_recomputed_prompt_reads_only_the_positions_it_has_not_collected() -> None:
    """After a preemption mid-prompt a sequence computes its prompt again from position 0 (no prefix hit); rows go
    to it only from the first position whose entry it lacks, and each row predicts the next prompt token."""
    from infer.core.interfaces import ScheduledSequence, SchedulerOutput
    from infer.core.prompt_logprobs import prompt_rows
    from infer.core.request import Sequence

    prompt = list(range(100, 110))
    other = Sequence(1, "b", [7, 8, 9], SamplingParams(prompt_logprobs=2), 0.0)
    seq = Sequence(0, "a", prompt, SamplingParams(prompt_logprobs=1), 0.0)
    seq.prompt_logprobs += [{101: -1.0}, {102: -1.0}, {103: -1.0}]  # tokens 1-3 collected before the preemption
    out = SchedulerOutput([ScheduledSequence(other, 3), ScheduledSequence(seq, 8)])
    found = prompt_rows(out, [3, 8], "paged")
    assert found is not None
    # other: positions 0-1 predict tokens 1-2 (position 2 predicts its first output); seq: positions 3-7, at 3 + j
    assert found.rows == [0, 1, 3 + 3, 3 + 4, 3 + 5, 3 + 6, 3 + 7]
    assert found.targets == [8, 9, *prompt[4:9]] and found.widths == [2, 2, 1, 1, 1, 1, 1]
    assert [(s.seq_id, count) for s, count in found.owners] == [(1, 2), (0, 5)]


def test_a_cache_hit_of_one_position_is_caught_too() -> None:
    from infer.core.errors import PluginError
    from infer.core.interfaces import ScheduledSequence, SchedulerOutput
    from infer.core.prompt_logprobs import prompt_rows
    from infer.core.request import Sequence

    seq = Sequence(0, "a", list(range(100, 110)), SamplingParams(prompt_logprobs=1), 0.0)
    seq.prompt_logprobs.append({101: -1.0})  # position 0 read; position 1 is next
    seq.num_computed_tokens = 2  # but the cache served it
    with pytest.raises(PluginError, match="served positions 1-1 of sequence 0"):
        prompt_rows(SchedulerOutput([ScheduledSequence(seq, 4)]), [4], "paged")


def test_prompt_logprobs_in_slices_of_a_few_rows(path: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits are read ROWS_PER_SLICE prompt rows at a time: slices of 4 rows, each owner's top-n kept."""
    from infer.core import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 4)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    widths = [0, 1, 3, 5]
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=w) for w in widths])
    for out, prompt, width in zip(outs, PROMPTS, widths):
        check(out, prompt, width, reference)


def test_prompt_logprobs_beside_a_sequence_verifying_drafts() -> None:
    """A step that verifies a speculating sequence's drafts and computes a prompt: the prompt's rows sit after the
    drafts in the batch."""
    from transformers import AutoModelForCausalLM

    from infer.models.tiny import PRETRAINED_DIR

    target = PRETRAINED_DIR / "target"
    engine = Engine(EngineConfig(model=str(target), device="cpu", num_kv_blocks=128, proposer="draft-model",
                                 num_speculative_tokens=3))
    first = engine.add_request("def fibonacci(n):\n", SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(3):
        engine.step()
    prompt = engine.tokenize("import os\nimport sys\n")
    second = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                finished[out.request_id] = out
            if out.finished:
                finished.setdefault(out.request_id, out)
    assert finished[first].metrics["spec_proposed"] > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    entries = finished[second].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:], 1):
        assert entry is not None and entry[prompt[i]] == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-4)


def test_an_aborted_prompt_returns_no_partial_logprobs(path: Path) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=4))
    rid = engine.add_request(list(range(20, 40)), SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))
    engine.step()
    engine.step()  # 8 of 20 prompt positions computed
    final = engine.abort(rid)
    assert final.finished and final.prompt_logprobs is None and engine.prompt_logprob_requests == 0


def test_n_sequences_share_one_prompt_logprobs_and_a_stream_carries_it_once(path: Path, reference) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3,
                                                       prompt_logprobs=1))[0]
    assert len(out.outputs) == 3
    check(out, PROMPTS[1], 1, reference)
    deltas = list(engine.stream(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)))
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].outputs and carrying[0].outputs[0].token_ids  # with the first token
    check(carrying[0], PROMPTS[2], 2, reference)


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_prompt_logprobs_out_of_range_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value).validate()  # type: ignore[arg-type]


def test_a_kv_cache_that_serves_such_a_prompt_from_its_cache_is_named(path: Path, infer_plugins) -> None:
    import dataclasses
    import types

    from infer.core.errors import PluginError
    from infer.core.hookspecs import hookimpl
    from infer.plugins.paged_cache import PagedKVCache

    class Careless(PagedKVCache):
        """Matches cached prefixes whatever the sequence asks for."""

        def match_prefix(self, seq):  # type: ignore[no-untyped-def]
            asked, seq.params = seq.params, dataclasses.replace(seq.params, prompt_logprobs=None)
            try:
                return super().match_prefix(seq)
            finally:
                seq.params = asked

    module = types.ModuleType("careless")
    module.register_kv_caches = hookimpl(lambda register: register(
        "careless", lambda config, n, eviction: Careless(n, config.block_size, eviction, True)))
    infer_plugins.register(module, name="careless", source="tests")
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, kv_cache="careless"), infer_plugins)
    prompt = PROMPTS[3]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(PluginError, match=r"KV cache 'careless' served positions 0-15 of sequence .* match_prefix "
                                          r"must match nothing for a sequence whose needs_prompt_logits is true"):
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))


def test_generate_json_prints_both_kinds_of_logprobs(path: Path, reference) -> None:
    from click.testing import CliRunner

    from infer.cli import main

    prompt = PROMPTS[0]
    args = ["--model", str(path), "--device", "cpu", "generate", json.dumps(prompt), "--max-tokens", "2"]
    refused = CliRunner().invoke(main, [*args, "--prompt-logprobs", "1"])
    assert refused.exit_code == 2 and "--logprobs and --prompt-logprobs print with --json" in refused.output
    done = CliRunner().invoke(main, [*args, "--json", "--logprobs", "0", "--prompt-logprobs", "2"])
    assert done.exit_code == 0, done.output
    line = json.loads(done.stdout.splitlines()[-1])
    assert len(line["logprobs"]) == 2 and [e["token_id"] for e in line["logprobs"][0]] == line["token_ids"][:1]
    entries, prompt_ids = line["prompt_logprobs"], line["prompt_token_ids"]
    want = Engine(EngineConfig(model=str(path), device="cpu")).generate(
        [json.dumps(prompt)], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert prompt_ids == want.prompt_token_ids and entries[0] is None and want.prompt_logprobs is not None
    assert len(entries) == len(want.prompt_logprobs)
    for got, expected in zip(entries[1:], want.prompt_logprobs[1:]):
        assert expected is not None and {x["token_id"]: pytest.approx(x["logprob"], abs=1e-5) for x in got} == expected
    beam = CliRunner().invoke(main, [*args, "--json", "--beam-width", "2", "--prompt-logprobs", "1"])
    assert beam.exit_code == 2 and "drop --prompt-logprobs" in beam.output
