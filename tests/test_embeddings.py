"""Embedding requests (PoolingParams) against HF transformers' final hidden states: last and mean pooling, whole
prefills, chunked ones, async scheduling, CUDA graphs' paths (replayed eagerly on the CPU), a prefix cache (last
pooling is served from it, mean pooling is not), a recomputed prompt, beside generation requests, and the defaults
a sentence-transformers checkpoint declares."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the graph paths run the triton backend, interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import InvalidRequestError  # noqa: E402
from infer.core.pooling import PoolingParams  # noqa: E402
from infer.core.request import FinishReason, RequestOutput, SamplingParams  # noqa: E402

PROMPTS = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(4)]  # 9 to 18 tokens


@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hidden(path: Path, hf_hidden_states) -> Callable[[list[int]], torch.Tensor]:
    """The HF model's final hidden states (after its last norm) at every prompt position."""
    return lambda prompt: hf_hidden_states(path, prompt)


def expected(states: torch.Tensor, method: str, normalize: bool = True, dimensions: int | None = None) -> list[float]:
    vector = states[-1] if method == "last" else states.mean(0)
    vector = vector[:dimensions] if dimensions is not None else vector
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()


def check(out: RequestOutput, prompt: list[int], hidden: Callable[[list[int]], torch.Tensor],
          params: PoolingParams, tolerance: float = 1e-5) -> None:
    assert out.finished and out.embedding is not None
    assert [c.finish_reason for c in out.outputs] == [FinishReason.STOP] and out.outputs[0].token_ids == []
    want = expected(hidden(prompt), params.pooling or "last", params.normalize is not False, params.dimensions)
    assert out.embedding == pytest.approx(want, abs=tolerance)


@pytest.mark.parametrize("variant", ["whole", "chunked", "async-scheduling", "graphs", "radix-cache"])
def test_embeddings_equal_hf(path: Path, hidden, variant: str) -> None:
    options: dict = dict(model=str(path), device="cpu", num_kv_blocks=64)
    if variant == "chunked":  # 5-token chunks: a mean sums rows of several steps
        options.update(scheduler="chunked-prefill", max_num_batched_tokens=5)
    if variant == "graphs":  # 3-token chunks: steps that a 3-query-token decode graph would replay (logits only)
        options.update(scheduler="chunked-prefill", max_num_batched_tokens=3, attention="triton", dtype="float32")
    if variant == "async-scheduling":
        options.update(async_scheduling=True)
    if variant == "radix-cache":
        options.update(kv_cache="radix-cache")
    engine = Engine(EngineConfig(**options))
    if variant == "graphs":
        engine.runner.enable_cuda_graphs(4, {3: 4}, eager=True, mixed_tokens=24, mixed_rows=8)
    params = [PoolingParams(), PoolingParams(pooling="mean"), PoolingParams(pooling="last", normalize=False),
              PoolingParams(pooling="mean", dimensions=16)]
    outs = engine.embed(PROMPTS, params)
    for out, prompt, one in zip(outs, PROMPTS, params):
        check(out, prompt, hidden, one)
    assert engine.embeddings.live == 0 and engine.kv.stats().used_blocks == 0
    if variant == "graphs":
        assert engine.runner.mixed_graphs is not None and engine.runner.mixed_graphs.replays > 0


@pytest.mark.gpu
def test_embeddings_on_cuda_equal_hf(path: Path, hidden) -> None:
    """The CUDA defaults (triton attention, CUDA graphs, async scheduling), in float32, beside generation."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64))
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    params = [PoolingParams(), PoolingParams(pooling="mean"), sampling, PoolingParams(dimensions=8)]
    outs = engine.generate(PROMPTS, params)
    for i in (0, 1, 3):
        check(outs[i], PROMPTS[i], hidden, params[i], 1e-4)  # type: ignore[arg-type]
    assert len(outs[2].outputs[0].token_ids) == 4


def test_embeddings_beside_generation_leave_it_unchanged(path: Path, hidden) -> None:
    """Embedding and generation requests in the same steps: the generated tokens equal those of a run alone, and
    an embedding request samples nothing (its steps count no output token)."""
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64)).generate(PROMPTS, sampling)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    params = [sampling, PoolingParams(pooling="mean"), sampling, PoolingParams()]
    outs = engine.generate(PROMPTS, params)
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == alone[i].outputs[0].token_ids and outs[i].embedding is None
    for i in (1, 3):
        check(outs[i], PROMPTS[i], hidden, params[i])  # type: ignore[arg-type]
        assert outs[i].metrics["num_output_tokens"] == 0
    assert engine.stats.output_tokens == 12


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_last_pooling_is_served_from_the_prefix_cache_and_mean_pooling_is_not(path: Path, hidden,
                                                                               kv_cache: str) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, kv_cache=kv_cache))
    prompt = PROMPTS[3]
    first = engine.embed([prompt])[0]
    assert first.num_cached_tokens == 0
    again = engine.embed([prompt])[0]
    assert again.num_cached_tokens > 0
    check(again, prompt, hidden, PoolingParams())
    mean = engine.embed([prompt], PoolingParams(pooling="mean"))[0]
    assert mean.num_cached_tokens == 0
    check(mean, prompt, hidden, PoolingParams(pooling="mean"))
    assert engine.embed([prompt])[0].num_cached_tokens > 0  # and caching goes on


def test_a_preempted_embedding_sums_each_position_once(path: Path, hidden) -> None:
    """A pool too small for every sequence preempts some, by recompute: a mean computed again from position 0
    adds only the positions it had not summed."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=6, max_num_seqs=4,
                                 scheduler="chunked-prefill", max_num_batched_tokens=8))
    prompts = [list(range(10, 22)), list(range(50, 62)), list(range(100, 140))]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2 + [PoolingParams(pooling="mean")]
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    check(outs[2], prompts[2], hidden, PoolingParams(pooling="mean"))


def test_a_sentence_transformers_checkpoint_sets_the_defaults(path: Path, hidden, tmp_path: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_lasttoken": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    out = engine.embed([PROMPTS[0]])[0]  # mean, and not normalized: no Normalize module
    assert out.embedding == pytest.approx(expected(hidden(PROMPTS[0]), "mean", normalize=False), abs=1e-5)

    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_median_tokens=True)  # a mode no pooler computes
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(InvalidRequestError, match="'pooling_mode_median_tokens', which no registered pooler computes"):
        Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64)).embed([PROMPTS[0]])


def test_bad_embedding_requests_are_refused(path: Path) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=32))
    with pytest.raises(InvalidRequestError, match="pooling must be a pooler's name"):
        PoolingParams(pooling="")
    with pytest.raises(InvalidRequestError, match="unknown pooler 'maxx' \\(did you mean 'max'\\?\\); registered: "
                       "first, last, max, mean, mean-sqrt-len, weighted-mean"):
        engine.embed([PROMPTS[0]], PoolingParams(pooling="maxx"))
    with pytest.raises(InvalidRequestError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidRequestError, match="dimensions 65 exceeds the model's hidden size 64"):
        engine.embed([PROMPTS[0]], PoolingParams(dimensions=65))
    with pytest.raises(InvalidRequestError, match="embed takes PoolingParams, got SamplingParams"):
        engine.embed([PROMPTS[0]], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"prompt \(32 tokens\) is too long to embed: at most 31 tokens "
                       r"\(the model's context length less one.*or pass truncate=True \(--truncate\)"):
        engine.embed([list(range(3, 35))])
    assert engine.embed([list(range(3, 34))])[0].embedding is not None  # 31: the context less one
    with pytest.raises(InvalidRequestError, match="lora_adapter .nope. is not loaded"):
        engine.embed([PROMPTS[0]], PoolingParams(lora_adapter="nope"))
    assert engine.requests == {} and engine.embeddings.live == 0


def test_an_aborted_embedding_request_ends_without_one(path: Path) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=4))
    rid = engine.add_request(PROMPTS[3], PoolingParams(pooling="mean"))
    engine.step()  # 4 of its 18 prompt tokens
    final = engine.abort(rid)
    assert final.finished and final.embedding is None
    assert [c.finish_reason for c in final.outputs] == [FinishReason.ABORT]
    assert engine.embeddings.live == 0 and engine.kv.stats().used_blocks == 0


def test_a_stream_of_an_embedding_request_yields_it_once(path: Path, hidden) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=4))
    deltas = list(engine.stream(PROMPTS[2], PoolingParams()))
    assert len(deltas) == 1
    check(deltas[0], PROMPTS[2], hidden, PoolingParams())


def test_embeddings_with_a_speculative_engine(path: Path, hidden) -> None:
    """An ngram proposer drafts for the generation requests only; the embedding is the plain one."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, proposer="ngram",
                                 num_speculative_tokens=3))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS[:2], [sampling, PoolingParams(pooling="mean")])
    assert len(outs[0].outputs[0].token_ids) == 8
    check(outs[1], PROMPTS[1], hidden, PoolingParams(pooling="mean"))


def test_the_llm_api_and_the_cli_print_the_engines_embeddings(path: Path, hidden) -> None:
    from click.testing import CliRunner

    from infer import LLM
    from infer.cli.main import main

    texts = ["def add(a, b):", "import os"]
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64)
    offline = llm.embed(texts, PoolingParams(pooling="mean", dimensions=8))
    ids = [out.prompt_token_ids for out in offline]
    for out in offline:
        assert out.embedding == pytest.approx(expected(hidden(out.prompt_token_ids), "mean", dimensions=8), abs=1e-5)
    result = CliRunner().invoke(main, ["--model", str(path), "--device", "cpu", "--num-kv-blocks", "64", "embed",
                                       "--pooling", "mean", "--dimensions", "8", *texts])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == texts
    assert [line["prompt_tokens"] for line in lines] == [len(i) for i in ids]
    for line, out in zip(lines, offline):
        assert line["embedding"] == pytest.approx(out.embedding, abs=1e-6)
    refused = CliRunner().invoke(main, ["--model", str(path), "--device", "cpu", "embed", "--dimensions", "0", "x"])
    assert refused.exit_code != 0 and "dimensions (--dimensions) must be a positive integer" in refused.output


def test_an_embedding_that_can_never_fit_the_kv_pool_says_so_in_its_own_terms(path: Path) -> None:
    from infer.core.errors import CapacityError

    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=2))
    with pytest.raises(CapacityError, match=r"^a prompt of 40 tokens needs up to 3 KV blocks \(40 tokens\) but the "
                       "cache has only 2; shorten the prompt or give the KV cache more blocks"):
        engine.embed([list(range(3, 43))])


def test_truncate_embeds_a_too_long_prompts_first_tokens(path: Path, hidden, tmp_path: Path) -> None:
    """The context less one token, or a sentence-transformers checkpoint's max_seq_length, whichever is shorter: a
    longer prompt is refused, or with truncate embeds its first tokens (as sentence-transformers truncates); its
    do_lower_case lowercases text prompts."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=32))
    prompt = list(range(3, 43))  # 40 tokens
    out = engine.embed([prompt], PoolingParams(pooling="mean", truncate=True))[0]
    assert out.prompt_token_ids == prompt[:31]
    assert out.embedding == pytest.approx(expected(hidden(prompt[:31]), "mean"), abs=1e-5)
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8, "do_lower_case": False}))
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match=r"prompt \(12 tokens\) is too long to embed: at most 8 tokens "
                       r"\(the checkpoint's sentence-transformers max_seq_length\)"):
        engine.embed([prompt[:12]])
    out = engine.embed([prompt[:12]], PoolingParams(truncate=True))[0]
    assert out.embedding == pytest.approx(expected(hidden(prompt[:8]), "last", normalize=False), abs=1e-5)
    assert engine.embed([prompt[:8]])[0].embedding == pytest.approx(out.embedding, abs=1e-6)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    lowered = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    assert lowered.embed(["Def Main():"])[0].prompt_token_ids == lowered.tokenize("def main():") != \
        lowered.tokenize("Def Main():")  # text is lowercased first; token ids are taken as they are
    assert lowered.embed([prompt[:8]])[0].prompt_token_ids == prompt[:8]
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 0}))
    from infer.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="max_seq_length = 0; it should be a positive integer"):
        Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))


def test_a_step_holding_no_row_to_pool_asks_for_no_pooling() -> None:
    """pool_rows: a last-position pooler's chunk before the prompt's end pools nothing (None: the step may replay a
    decode graph, which computes logits only); its last chunk pools the last row; an every-position pooler's rows
    start where it has summed to."""
    from infer.core.interfaces import ScheduledSequence, SchedulerOutput
    from infer.core.pooling import Pooling, pool_rows
    from infer.core.request import Sequence
    from infer.plugins.poolers import LastPooler, SumPooler

    last = Sequence(0, "a", list(range(10, 20)), SamplingParams(max_tokens=1), 0.0)
    last.pooling = Pooling("last", LastPooler(), True, None)
    assert pool_rows(SchedulerOutput([ScheduledSequence(last, 4)]), [4], "paged") is None
    last.num_computed_tokens = 8
    found = pool_rows(SchedulerOutput([ScheduledSequence(last, 2)]), [2], "paged")
    assert found is not None and found.rows == [1] and [(count, done) for _, count, done in found.owners] == [(1, True)]
    mean = Sequence(1, "b", list(range(10, 20)), SamplingParams(max_tokens=1), 0.0)
    mean.pooling = Pooling("mean", SumPooler(), True, None)
    mean.pooled_until = 3  # a recompute after preemption: positions 0-2 were summed before
    found = pool_rows(SchedulerOutput([ScheduledSequence(last, 2), ScheduledSequence(mean, 5)]), [2, 5], "paged")
    assert found is not None and found.rows == [1, 2 + 3, 2 + 4]  # last's row 1, then mean's positions 3 and 4
