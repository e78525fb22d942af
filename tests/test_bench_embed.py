"""`infer bench --task embed`: embedding requests in every arm (Engine.embed's vectors), the HF baseline's padded
AutoModel batches against them, the embedding metrics by their formulas, a mixed file workload, and the refusals."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy
import pytest
from click.testing import CliRunner, Result

from infer.bench.stats import RequestRecord, RunResult, embeddings_max_diff, run_metrics
from infer.bench.workloads import WorkloadSpec, parse_workload_file
from infer.cli import main
from infer.core.pooling import PoolingParams

ONE_ROUND = ("--repeats", "1", "--warmup-rounds", "0")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def engine_arm(model: Path, task: str = "embed"):
    from infer.bench.arms import parse_arms
    from infer.bench.runner import EngineArm
    from infer.cli.options import EngineArgs
    from infer.core.plugins import PluginManager

    [spec] = parse_arms([], EngineArgs.from_kwargs({"model": str(model), "device": "cpu", "num_kv_blocks": 64}))
    return EngineArm(spec, PluginManager.from_entry_points(), task)


# ---------------------------------------------------------------- the workload's requests (no model)
def test_file_lines_embed_as_their_embed_field_says_over_the_tasks_parameters(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a", "embed": true}\n'
                    '{"prompt": [5], "max_tokens": 3, "embed": {"pooling": "mean", "dimensions": 8}}\n'
                    '{"prompt": "b", "max_tokens": 2}\n'
                    '{"prompt": "c", "embed": "yes"}\n'
                    '{"prompt": "c", "embed": {"dimensions": 0}}\n'
                    '{"prompt": "c", "embed": true, "structured_output": {"regex": "a"}}\n'
                    '{"prompt": "c", "embed": false}\n'
                    '{"prompt": "c", "embed": {"pooling": "mean", "size": 3}}\n')
    entries, errors = parse_workload_file(path)
    assert [(e.line, e.pooling, e.max_tokens) for e in entries] == [
        (1, PoolingParams(), 0), (2, PoolingParams("mean", None, 8), 0), (3, None, 2)]
    assert [e.split(":")[0] for e in errors] == ["line 4", "line 5", "line 6", "line 7", "line 8"]
    assert "'embed' must be true, false or an object of pooling, dimensions, normalize" in errors[0]
    assert "dimensions must be a positive integer" in errors[1]
    assert "takes no structured output" in errors[2] and "'max_tokens' is missing" in errors[3]
    # --task embed: every line embeds with the task's parameters, which a line's object overrides field by field
    task = PoolingParams("last", False, 4)
    entries, errors = parse_workload_file(path, task)
    assert [(e.line, e.pooling) for e in entries] == [(1, task), (2, PoolingParams("mean", False, 8)), (3, task)]
    assert "--task embed makes every line an embedding request" in errors[3]


def test_embed_task_prompts_are_the_generate_tasks_and_reserve_one_token() -> None:
    from infer.bench.workloads import Vocab, build_workload

    vocab = Vocab(500, frozenset({0}))
    pooling = PoolingParams("mean")
    for name in ("random", "shared-prefix"):
        spec = WorkloadSpec(name, num_requests=4, input_len=9, prefix_len=12, question_len=5)
        generate = build_workload(spec, 0, vocab)
        embed = build_workload(WorkloadSpec(name, num_requests=4, input_len=9, prefix_len=12, question_len=5,
                                            task="embed", pooling=pooling), 0, vocab)
        turns = [s.turns[0] for s in embed.sessions]
        assert [t.tokens for t in turns] == [s.turns[0].tokens for s in generate.sessions]
        assert {(t.pooling, t.max_tokens) for t in turns} == {(pooling, 0)}
        assert embed.longest_request() == max(len(t.tokens) for t in turns) + 1  # the token it never samples


# ---------------------------------------------------------------- metrics (their formulas)
def test_embedding_metrics_are_their_formulas_each_over_its_own_requests() -> None:
    embeds = [RequestRecord(0, 0, 0.0, 10, 0, [], 0.5, embed=True, embedding=[1.0, 0.0]),
              RequestRecord(1, 0, 0.1, 30, 0, [], 0.3, embed=True, embedding=[0.0, 1.0]),
              RequestRecord(2, 0, 0.2, 20, 0, [], 1.2, embed=True, embedding=[0.6, 0.8])]
    generated = [RequestRecord(3, 0, 0.0, 7, 3, [0.4, 0.6, 0.9], 0.9), RequestRecord(4, 0, 0.5, 5, 2, [0.7, 1.5], 1.5)]
    only = run_metrics(RunResult("A", 0, 2.0, embeds))
    assert only["embeddings_per_s"] == 3 / 2.0 and only["embed_prompt_tokens_per_s"] == 60 / 2.0
    latencies = [0.5, 0.2, 1.0]
    assert only["embed_latency_p50_ms"] == pytest.approx(1000 * statistics.median(latencies))
    assert only["embed_latency_p99_ms"] == pytest.approx(1000 * numpy.percentile(latencies, 99))
    assert all(only[key] is None for key in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms",
                                             "itl_p50_ms", "e2e_p50_ms"))
    mixed = run_metrics(RunResult("A", 0, 4.0, embeds + generated))
    assert mixed["requests_per_s"] == 2 / 4.0 and mixed["output_tokens_per_s"] == 5 / 4.0
    assert mixed["embeddings_per_s"] == 3 / 4.0 and mixed["embed_prompt_tokens_per_s"] == 60 / 4.0
    assert mixed["e2e_p50_ms"] == pytest.approx(1000 * statistics.median([0.9, 1.0]))  # generation's own
    assert mixed["ttft_p50_ms"] == pytest.approx(1000 * statistics.median([0.4, 0.2]))
    assert mixed["embed_latency_p50_ms"] == only["embed_latency_p50_ms"]
    # the largest difference of any value of any request, matched by its turn
    other = [RequestRecord(r.session, 0, 0.0, 1, 0, [], 1.0, embed=True, embedding=[a + d for a in r.embedding])
             for r, d in zip(embeds, (1e-6, -3e-5, 2e-6))]
    assert embeddings_max_diff(RunResult("B", 0, 1.0, other), RunResult("A", 0, 1.0, embeds)) == pytest.approx(3e-5)
    assert embeddings_max_diff(RunResult("B", 0, 1.0, generated), RunResult("A", 0, 1.0, embeds)) is None


def test_one_arms_table_shows_the_embedding_rows_but_no_comparison() -> None:
    import io

    from rich.console import Console

    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, render_table

    records = [RequestRecord(i, 0, 0.0, 8, 0, [], 0.1 * (i + 1), embed=True, embedding=[1.0]) for i in range(3)]
    runs = {"A": [RunResult("A", 0, 1.0, records)]}
    text = render_table(BenchResult([ArmSpec("A", "")], runs, {}), Console(file=io.StringIO()))
    assert "embeddings/s" in text and "embedding latency p99" in text
    assert "embedding max" not in text and "requests/s" not in text.replace("embeddings/s", "")
    two = {"A": runs["A"], "B": [RunResult("B", 0, 1.0, records)]}
    text = render_table(BenchResult([ArmSpec("A", ""), ArmSpec("B", "x")], two, {}), Console(file=io.StringIO()))
    assert "embedding max |diff| from first arm" in text and "0.0e+00 ×" not in text  # no ratio to a difference


def test_hf_embedding_batches_are_the_longest_waiting_requests_at_most_the_batch_size() -> None:
    from types import SimpleNamespace

    from infer.bench.arms import ArmSpec
    from infer.bench.hf import HFArm
    from infer.bench.workloads import Session, Turn, Workload

    batches: list[list[int]] = []

    def embed_batch(workload: Workload, batch: list[tuple]) -> list[list[float]]:
        batches.append([len(prompt) for _, _, _, prompt, _ in batch])
        return [[float(len(prompt))] for _, _, _, prompt, _ in batch]

    stub = SimpleNamespace(batch_size=2, spec=ArmSpec("B", "hf", hf_mode="static"), _embed_batch=embed_batch)
    lengths = (3, 7, 2, 5, 4)
    sessions = tuple(Session(0.0, (Turn(tuple(range(n)), 0, pooling=PoolingParams()),)) for n in lengths)
    result = HFArm._run_static(stub, Workload("random", 0, sessions), lambda: None)  # type: ignore[arg-type]
    assert batches == [[7, 5], [4, 3], [2]]
    assert [(r.session, r.prompt_tokens, r.embedding, r.embed) for r in result.requests] == [
        (i, n, [float(n)], True) for i, n in enumerate(lengths)]


# ---------------------------------------------------------------- real runs on the tiny model
@pytest.mark.parametrize(("workload", "params"), [("random", PoolingParams("mean", False, 16)),
                                                  ("shared-prefix", PoolingParams())])
def test_an_embed_runs_embeddings_are_engine_embeds(tiny_model: Path, workload: str, params: PoolingParams) -> None:
    from infer.bench.session import make_workloads
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    spec = WorkloadSpec(workload, num_requests=5, input_len=12, prefix_len=24, question_len=6, task="embed",
                        pooling=params)
    arm = engine_arm(tiny_model)
    [round_] = make_workloads(spec, range(1), [arm], None)
    result = arm.run(round_, lambda: None)
    prompts = [list(session.turns[0].tokens) for session in round_.sessions]
    expected = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64)).embed(prompts, params)
    assert [(r.embed, r.output_tokens, r.prompt_tokens) for r in result.requests] == [
        (True, 0, len(p)) for p in prompts]
    for record, out in zip(result.requests, expected):
        assert len(record.embedding) == len(out.embedding) and record.embedding == pytest.approx(out.embedding,
                                                                                                 abs=1e-6)


@pytest.mark.parametrize("params", [PoolingParams(), PoolingParams("mean", False, 24)])
def test_the_hf_arms_embeddings_equal_infers(tiny_model: Path, params: PoolingParams) -> None:
    """Padded batches of 2 (the lengths differ: right padding and the mask matter), float32 on CPU."""
    from infer.bench.arms import ArmSpec
    from infer.bench.hf import HFArm
    from infer.bench.session import make_workloads

    spec = WorkloadSpec("random", num_requests=5, input_len=14, len_sigma=0.6, task="embed", pooling=params)
    infer_arm = engine_arm(tiny_model)
    hf_arm = HFArm(ArmSpec("B", "hf", hf_mode="static"), tiny_model, 2, "cpu", "float32", task="embed")
    [round_] = make_workloads(spec, range(1), [infer_arm, hf_arm], None)
    assert len({len(s.turns[0].tokens) for s in round_.sessions}) > 2
    mine, theirs = infer_arm.run(round_, lambda: None), hf_arm.run(round_, lambda: None)
    assert [(r.session, r.prompt_tokens, r.embed) for r in theirs.requests] == [
        (r.session, r.prompt_tokens, r.embed) for r in mine.requests]
    for a, b in zip(mine.requests, theirs.requests):
        assert len(a.embedding) == len(b.embedding) == (params.dimensions or 64)
        assert b.embedding == pytest.approx(a.embedding, abs=1e-4)
    assert theirs.notes == {"batch_size": 2}


def test_an_embed_bench_reports_rates_latency_and_the_hf_arms_difference(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--task", "embed", "--workload",
                 "shared-prefix", "--prefix-len", "30", "--question-len", "8", "--num-requests", "6", "--ab",
                 "--kv-cache paged", "--kv-cache radix-cache", "hf", "--repeats", "2", "--warmup-rounds", "0",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    table = (out / "table.txt").read_text()
    for row in ("embeddings/s", "embedding prompt tok/s", "embedding latency p50", "embedding max |diff|"):
        assert row in table
    assert "TTFT" not in table and "output tok/s" not in table and "outputs = first arm" not in table
    data = json.loads((out / "results.json").read_text())
    assert data["workload"]["task"] == "embed"
    for arm in data["arms"]:
        for run_ in arm["runs"]:
            reqs, duration, metrics = run_["requests"], run_["duration_s"], run_["metrics"]
            assert len(reqs) == 6 and all(r["embed"] and "embedding" not in r for r in reqs)
            assert metrics["embeddings_per_s"] == pytest.approx(len(reqs) / duration)
            assert metrics["embed_prompt_tokens_per_s"] == pytest.approx(sum(r["prompt_tokens"] for r in reqs)
                                                                         / duration)
            latencies = [r["finish_s"] - r["arrival_s"] for r in reqs]
            assert metrics["embed_latency_p50_ms"] == pytest.approx(1000 * statistics.median(latencies))
            assert metrics["requests_per_s"] is None and metrics["ttft_p50_ms"] is None
    diffs = {arm["key"]: arm["summary"]["embeddings_max_diff"]["values"] for arm in data["arms"]}
    assert diffs["A"] == [0.0, 0.0] and len(diffs["C"]) == 2 and max(diffs["B"] + diffs["C"]) < 1e-4


def test_a_mixed_file_workload_reports_both_kinds_each_over_its_own(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "def add(a, b):", "max_tokens": 4}\n'
                    '{"prompt": "import os", "embed": true}\n'
                    '{"prompt": "x = 1", "embed": {"pooling": "mean", "bogus": 1}}\n'
                    '{"prompt": [5, 6, 7, 8, 9], "max_tokens": 3}\n'
                    '{"prompt": [7, 8, 9, 10], "embed": {"pooling": "mean", "dimensions": 8, "normalize": false}}\n'
                    '{"prompt": "y", "embed": {"pooling": "max"}}\n')  # the hf arm pools last or mean only
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "file", "--file", str(path),
            "--ab", "", "hf", *ONE_ROUND]
    refused = run(*args)
    assert refused.exit_code == 2 and "line 3: 'embed' must be true, false or an object" in refused.output
    result = run(*args, "--skip-bad-lines", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "line 6: arm B ('hf') refuses its embedding request: the HF baseline pools last or mean only" in \
        result.output
    table = (out / "table.txt").read_text()
    assert "TTFT p50" in table and "embedding latency p50" in table and "outputs = first arm" in table
    data = json.loads((out / "results.json").read_text())
    for arm in data["arms"]:
        [run_] = arm["runs"]
        reqs, metrics, duration = run_["requests"], run_["metrics"], run_["duration_s"]
        assert [(r["embed"], r["output_tokens"]) for r in reqs] == [(False, 4), (True, 0), (False, 3), (True, 0)]
        generated, embedded = [r for r in reqs if not r["embed"]], [r for r in reqs if r["embed"]]
        assert metrics["requests_per_s"] == pytest.approx(2 / duration)
        assert metrics["output_tokens_per_s"] == pytest.approx(7 / duration)
        assert metrics["embeddings_per_s"] == pytest.approx(2 / duration)
        assert metrics["ttft_p50_ms"] == pytest.approx(1000 * statistics.median(
            r["token_times_s"][0] - r["arrival_s"] for r in generated))
        assert metrics["e2e_p50_ms"] == pytest.approx(1000 * statistics.median(
            r["finish_s"] - r["arrival_s"] for r in generated))
        assert metrics["embed_latency_p50_ms"] == pytest.approx(1000 * statistics.median(
            r["finish_s"] - r["arrival_s"] for r in embedded))
    hf = data["arms"][1]["summary"]
    assert hf["outputs_match"]["values"] == [1.0] and hf["embeddings_max_diff"]["values"][0] < 1e-4


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(("args", "message"), [
    (["--pooling", "mean"], "--pooling shape embedding requests: add --task embed"),
    (["--dimensions", "8", "--no-normalize"], "--dimensions, --normalize/--no-normalize shape embedding requests"),
    (["--task", "embed", "--output-len", "8"], "--task embed: --output-len apply to generated tokens"),
    (["--task", "embed", "--temperature", "0.7", "--sampling-seed", "3"],
     "--task embed: --temperature, --sampling-seed apply to generated tokens"),
    (["--task", "embed", "--workload", "multi-turn"], "--task embed does not run the multi-turn workload: its next "
     "turn's prompt holds the previous turn's output"),
    (["--task", "embed", "--workload", "long-prompt-arrival"], "--task embed does not run the long-prompt-arrival"),
    (["--task", "embed", "--ab", "", "hf:cb"], "transformers' continuous batching (hf:cb) generates and does not"),
    (["--task", "embed", "--pooling", "max", "--ab", "", "hf"], "the HF baseline pools last or mean only, not 'max'"),
    (["--task", "embed", "--dimensions", "0"], "dimensions (--dimensions) must be a positive integer"),
])
def test_options_of_the_other_task_are_refused_before_any_model_loads(args: list[str], message: str) -> None:
    result = run("bench", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "building arm" not in result.output and "Traceback" not in result.output


def test_a_file_line_that_embeds_refuses_hf_continuous_batching(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 2}\n{"prompt": "b", "embed": true}\n')
    result = run("bench", "--workload", "file", "--file", str(path), "--ab", "", "hf:cb")
    assert result.exit_code == 2 and "line 2 of the file is an embedding request: transformers' continuous" in \
        result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--pooling", "nope"], "refuses the random workload's embedding requests (the longest: "),
    (["--pooling", "nope"], "unknown pooler 'nope'"),
    (["--dimensions", "100000"], "dimensions 100000 exceeds the model's hidden size 64"),
])
def test_a_pooling_the_model_cannot_compute_is_refused_before_any_run(tiny_model: Path, args: list[str],
                                                                       message: str) -> None:
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--task", "embed", "--num-requests", "2",
                 "--input-len", "8", *ONE_ROUND, *args)
    assert result.exit_code == 2 and message in result.output and "round 1/1" not in result.output


def test_an_embedding_workload_longer_than_the_context_names_no_output_length(tiny_model: Path) -> None:
    result = run("--model", str(tiny_model), "bench", "--task", "embed", "--workload", "shared-prefix", *ONE_ROUND)
    assert result.exit_code == 2 and "context length is 1024; lower --prefix-len/--question-len or use" in \
        result.output
