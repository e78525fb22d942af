"""`infer bench`: seeded workloads, arm parsing, the interleaved A/B run and its reports, and clear errors."""
from __future__ import annotations

import io
import json
import math
import re
import statistics
import subprocess
import sys
from collections.abc import Callable

import numpy
import pytest
from click.testing import CliRunner, Result

from infer.bench.command import expand_ab
from infer.bench.runner import Replay
from infer.bench.stats import EngineCounters, RequestRecord, RunResult, percentile, run_metrics
from infer.bench.workloads import Vocab, WorkloadError, WorkloadSpec, build_workload, parse_workload_file, validate_spec
from infer.cli import main
from infer.core.request import SamplingParams

VOCAB = Vocab(1000, frozenset({0, 1, 2}))


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- workloads (no model)
@pytest.mark.parametrize("name", ["random", "shared-prefix", "multi-turn", "long-prompt-arrival"])
def test_rounds_share_lengths_and_arrivals_but_not_tokens(name):
    spec = WorkloadSpec(name, num_requests=6, input_len=20, output_len=5, prefix_len=40, question_len=10, turns=3,
                        long_len=50, rate=10.0)
    first, again, second = (build_workload(spec, r, VOCAB) for r in (0, 0, 1))
    assert first == again  # every arm of a round replays exactly these requests
    shape = [(s.arrival_s, [(len(t.tokens), t.max_tokens) for t in s.turns]) for s in first.sessions]
    assert shape == [(s.arrival_s, [(len(t.tokens), t.max_tokens) for t in s.turns]) for s in second.sessions]
    assert [s.turns for s in first.sessions] != [s.turns for s in second.sessions]
    tokens = {tok for s in first.sessions for t in s.turns for tok in t.tokens}
    assert tokens <= set(VOCAB.allowed)  # no special token in random prompts


def test_shapes_of_each_workload():
    spec = WorkloadSpec("shared-prefix", num_requests=5, prefix_len=40, question_len=10, output_len=4)
    prompts = [s.turns[0].tokens for s in build_workload(spec, 0, VOCAB).sessions]
    assert len({p[:40] for p in prompts}) == 1 and all(len(p) > 40 for p in prompts)

    multi = build_workload(WorkloadSpec("multi-turn", num_requests=3, turns=4, input_len=8, output_len=2), 0, VOCAB)
    assert multi.num_requests == 12 and all(len(s.turns) == 4 for s in multi.sessions)

    spec = WorkloadSpec("long-prompt-arrival", num_requests=4, input_len=8, long_len=300, long_delay_s=0.5)
    sessions = build_workload(spec, 0, VOCAB).sessions
    assert [s.arrival_s for s in sessions] == [0, 0, 0, 0, 0.5] and len(sessions[-1].turns[0].tokens) == 300

    lengths = [len(s.turns[0].tokens) for s in build_workload(
        WorkloadSpec("random", num_requests=400, input_len=100, len_sigma=0.5), 0, VOCAB).sessions]
    assert 85 < sum(lengths) / len(lengths) < 115 and max(lengths) > 200  # lognormal: the mean, and a long tail


def test_poisson_arrivals_at_the_given_rate():
    sessions = build_workload(WorkloadSpec("random", num_requests=400, input_len=4, rate=20.0), 0, VOCAB).sessions
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    assert 15 < len(arrivals) / arrivals[-1] < 25
    assert all(s.arrival_s == 0 for s in build_workload(WorkloadSpec(num_requests=5), 0, VOCAB).sessions)


@pytest.mark.parametrize("name", ["random", "multi-turn", "long-prompt-arrival"])
def test_lora_adapters_spread_over_sessions_in_turn(name):
    spec = WorkloadSpec(name, num_requests=5, input_len=4, output_len=2, turns=2, long_len=8,
                        lora_adapters=("a", "a", "b"))
    sessions = build_workload(spec, 0, VOCAB).sessions
    assert [s.lora_adapter for s in sessions] == ["a", "a", "b", "a", "a", "b"][:len(sessions)]
    plain = build_workload(WorkloadSpec(name, num_requests=5, input_len=4, output_len=2, turns=2, long_len=8), 0,
                           VOCAB).sessions
    assert [s.turns for s in sessions] == [s.turns for s in plain] and {s.lora_adapter for s in plain} == {None}


def test_a_turn_prompt_is_the_history_then_the_new_user_turn():
    workload = build_workload(WorkloadSpec("multi-turn", num_requests=2, turns=3, input_len=4, output_len=2), 0,
                              VOCAB)
    replay = Replay(workload)
    first = replay.pop_due(0.0)
    assert [(s, t) for _, s, t, _, _ in first] == [(0, 0), (1, 0)]
    assert replay.pop_due(10.0) == []  # a later turn waits for the previous one
    _, s, t, prompt, _ = first[0]
    replay.finished(s, t, prompt, [7, 8], now=1.5)
    [(arrival, s2, t2, prompt2, _)] = replay.pop_due(2.0)
    assert (arrival, s2, t2) == (1.5, 0, 1)
    assert prompt2 == prompt + [7, 8] + list(workload.sessions[0].turns[1].tokens)


def test_workload_file_names_every_bad_line_and_keeps_the_good_ones(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 4}\n'
                    'not json\n'
                    '\n'
                    '{"prompt": [5, 6, 7], "max_tokens": 2, "id": "kept: other fields are ignored"}\n'
                    '{"prompt": "", "max_tokens": 3}\n'
                    '{"prompt": "x"}\n'
                    '{"prompt": [1, -2], "max_tokens": 1}\n'
                    '[1, 2]\n'
                    '{"prompt": "y", "max_tokens": 0}\n'
                    '{"prompt": [8], "max_tokens": 1, "lora_adapter": "sql"}\n'
                    '{"prompt": [8], "max_tokens": 1, "lora_adapter": ""}\n')
    entries, errors = parse_workload_file(path)
    assert [(e.line, e.prompt, e.max_tokens, e.lora_adapter) for e in entries] == [
        (1, "hello", 4, None), (4, (5, 6, 7), 2, None), (10, (8,), 1, "sql")]
    assert [e.split(":")[0] for e in errors] == ["line 2", "line 5", "line 6", "line 7", "line 8", "line 9",
                                                 "line 11"]
    assert "'lora_adapter' must be the name of a LoRA adapter" in errors[-1]
    with pytest.raises(WorkloadError, match=r"7 bad line\(s\) of 10(.|\n)*line 2: not valid JSON(.|\n)*line 9"):
        validate_spec(WorkloadSpec("file", file=path))
    assert len(validate_spec(WorkloadSpec("file", file=path, skip_bad_lines=True)) or []) == 3
    with pytest.raises(WorkloadError, match="a --workload file names each line's own"):
        validate_spec(WorkloadSpec("file", file=path, lora_adapters=("sql",)))
    workload = build_workload(WorkloadSpec("file"), 0, VOCAB, tokenize=lambda text: [ord(c) for c in text],
                              entries=entries)
    assert [(s.turns[0].tokens, s.turns[0].max_tokens, s.lora_adapter) for s in workload.sessions] == [
        (tuple(map(ord, "hello")), 4, None), ((5, 6, 7), 2, None), ((8,), 1, "sql")]


def test_workload_file_token_ids_lengths_and_priorities_are_read_as_documented(tmp_path):
    """Token id 0 is an id ("non-negative"); an empty list, a boolean id or max_tokens are not numbers of tokens; a
    line without "priority" has priority 0; a file that is not UTF-8 is a WorkloadError, not a crash."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [0], "max_tokens": 1}\n{"prompt": [true], "max_tokens": 1}\n'
                    '{"prompt": [], "max_tokens": 1}\n{"prompt": [3], "max_tokens": true}\n'
                    '{"prompt": "x", "max_tokens": 2, "priority": 3}\n')
    entries, errors = parse_workload_file(path)
    assert [(e.line, e.prompt, e.max_tokens, e.priority) for e in entries] == [(1, (0,), 1, 0), (5, "x", 2, 3)]
    assert [e.split(":")[0] for e in errors] == ["line 2", "line 3", "line 4"]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\u00e9", "max_tokens": 1}\n'.encode("latin-1"))
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        parse_workload_file(latin)


def test_lognormal_lengths_keep_their_mean_and_are_never_zero():
    """--input-len is the mean of the lognormal prompt lengths, whatever --len-sigma; no request has 0 tokens
    (a mean output of 1 at sigma 1 draws below 0.5 for about 42% of requests); --len-sigma 0 and --long-delay 0
    are valid (fixed lengths, a long prompt at the start)."""
    sessions = build_workload(WorkloadSpec(num_requests=4000, input_len=100, output_len=1, len_sigma=1.0), 0,
                              VOCAB).sessions
    assert 0.93 < statistics.fmean(len(s.turns[0].tokens) for s in sessions) / 100 < 1.07
    assert min(s.turns[0].max_tokens for s in sessions) == 1
    assert validate_spec(WorkloadSpec(len_sigma=0.0)) is None
    assert validate_spec(WorkloadSpec("long-prompt-arrival", long_delay_s=0.0)) is None


def test_longest_request_counts_history_and_outputs_and_random_tokens_skip_special_ones():
    from infer.bench.workloads import Session, Turn, Workload

    chat = Session(0.0, (Turn((1, 2, 3), 2), Turn((4, 5, 6, 7), 5)))  # turn 2 holds 3 + 2 + 4 + 5 = 14 tokens
    single = Session(0.0, (Turn(tuple(range(10)), 1),))  # 11 tokens
    assert Workload("multi-turn", 0, (single, chat)).longest_request() == 14
    assert Vocab(6, frozenset({0, 5})).allowed == (1, 2, 3, 4)
    with pytest.raises(ValueError, match="no non-special token"):
        Vocab(2, frozenset({0, 1}))


def test_a_requests_parameters_carry_its_adapter_structure_priority_and_own_seed():
    """Exactly max_tokens, EOS ignored, unless the request is structured (it ends at EOS once whole); each turn of
    a conversation samples from its own seed."""
    from infer.bench.workloads import RequestSampling
    from infer.core.request import StructuredOutput

    sampling = RequestSampling({"temperature": 1.0}, seed=9)
    regex = StructuredOutput(regex="[ab]+")
    structured = sampling.params(6, 0, 1, 2, "sql", regex, 3)
    assert (structured.max_tokens, structured.ignore_eos, structured.lora_adapter, structured.priority) == (
        6, False, "sql", 3)
    assert structured.structured_output == regex and sampling.params(6, 0, 1, 2).ignore_eos
    assert len({sampling.params(6, 0, 1, turn).seed for turn in range(3)}) == 3


def test_ab_takes_every_argument_up_to_the_next_option():
    names = {"--ab", "--repeats", "--out", "--workload"}
    assert expand_ab(["--workload", "x", "--ab", "--kv-cache paged", "", "hf", "--repeats", "2"], names) == [
        "--workload", "x", "--ab", "--kv-cache paged", "--ab", "", "--ab", "hf", "--repeats", "2"]
    assert expand_ab(["--ab", "a", "--ab", "b", "--out=d"], names) == ["--ab", "a", "--ab", "b", "--out=d"]


def test_an_arms_component_replaces_the_groups_of_that_kind(infer_plugins):
    """Group `--kv-cache radix-cache` or `--plugin radix-cache`; an arm's `--plugin paged` or `--kv-cache paged`
    runs paged, whichever way either side chose (the arm's label must be what runs)."""
    from infer.bench.arms import parse_arms
    from infer.cli.options import EngineArgs
    from infer.core.config import COMPONENT_FIELDS

    def kind_of(name: str) -> str | None:
        return next((f for k, f in COMPONENT_FIELDS.items() if name in infer_plugins.registry(k)), None)

    unknown_kinds = parse_arms(["--plugin lru"], EngineArgs.from_kwargs({"plugins": ["radix-cache"]}))[0]
    assert unknown_kinds.args.plugin_names == ["radix-cache", "lru"]  # without kind_of, names are only added
    for group in ({"kv_cache": "radix-cache"}, {"plugins": ["radix-cache", "lfu"]}):
        base = EngineArgs.from_kwargs(group)
        for arm in ("--plugin paged", "--kv-cache paged"):
            [a, b] = parse_arms(["", arm], base, kind_of)
            assert a.args.build(infer_plugins).kv_cache == "radix-cache"
            built = b.args.build(infer_plugins)
            assert built.kv_cache == "paged"
            assert built.eviction_policy == ("lfu" if "plugins" in group else "lru")  # other kinds stay


def test_arm_keys_hf_modes_and_the_group_options_every_arm_keeps():
    """Arms are keyed A..Z, AA, AB, ...; "hf" is the static baseline; an arm's value replaces the group's, and a
    group --no-prefix-caching holds for every arm (docs/cli.md); no --ab: one arm of the group options."""
    from infer.bench.arms import parse_arms
    from infer.cli.options import EngineArgs

    base = EngineArgs.from_kwargs({"max_num_seqs": 8, "no_prefix_caching": True})
    assert [arm.key for arm in parse_arms([""] * 28, base)][24:] == ["Y", "Z", "AA", "AB"]
    [alone] = parse_arms([], base)
    assert alone.args == base and alone.label == "A: (group options)"
    plain, own, hf, static, cb = parse_arms(["", "--max-num-seqs 4", "hf", "hf:static", " hf:cb "], base)
    assert (plain.args.values["max_num_seqs"], own.args.values["max_num_seqs"]) == (8, 4)
    assert plain.args.no_prefix_caching and own.args.no_prefix_caching
    assert [arm.hf_mode for arm in (hf, static, cb)] == ["static", "static", "cb"]


def test_the_lowest_prioritys_longest_ttft_stands_without_any_top_priority_token():
    """The lowest priority's longest TTFT is the longest of its requests' TTFTs (token time less arrival) also where
    no request of the top priority produced a token; with a single priority it is n/a."""
    reqs = [RequestRecord(0, 0, 0.0, 10, 0, [], 0.9, priority=2),  # ended without a token (its TTFT is n/a)
            RequestRecord(1, 0, 0.1, 10, 1, [0.6], 0.6, priority=0),
            RequestRecord(2, 0, 0.2, 10, 1, [0.4], 0.4, priority=0)]
    metrics = run_metrics(RunResult("A", 0, 1.0, reqs))
    assert math.isclose(metrics["bottom_priority_ttft_max_ms"], 1000 * max(0.6 - 0.1, 0.4 - 0.2))
    assert metrics["top_priority_ttft_p50_ms"] is None
    assert run_metrics(RunResult("A", 0, 1.0, reqs[1:]))["bottom_priority_ttft_max_ms"] is None


def test_metrics_of_one_run():
    reqs = [RequestRecord(0, 0, 0.0, 10, 3, [0.1, 0.2, 0.4], 0.4, 5),
            RequestRecord(1, 0, 0.1, 10, 1, [0.3], 0.3, 0)]
    metrics = run_metrics(RunResult("A", 0, 0.5, reqs))
    assert metrics["requests_per_s"] == 4 and metrics["output_tokens_per_s"] == 8
    assert math.isclose(metrics["ttft_p50_ms"], 150) and math.isclose(metrics["tpot_p50_ms"], 150)
    assert math.isclose(metrics["itl_p50_ms"], 150) and math.isclose(metrics["e2e_p99_ms"], 398)
    assert metrics["prefix_hit_rate"] is None and metrics["preemptions"] is None  # no engine counters: n/a
    assert metrics["engine_steps"] is None
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    values = [0.5, 9.0, 1.0, 4.0, 2.5, 7.0, 3.0]  # numpy's default (linear) method, which docs/cli.md names
    assert [percentile(values, q) for q in (0, 50, 90, 99, 100)] == pytest.approx(
        [float(numpy.percentile(values, q)) for q in (0, 50, 90, 99, 100)], abs=1e-12)
    rates = [run_metrics(RunResult("A", 0, 0.5, reqs, engine=EngineCounters(10, 1, 0, 0, 0, 0, proposed, accepted,
                                                                            speculative)))["acceptance_rate"]
             for proposed, accepted, speculative in ((8, 6, True), (0, 0, True), (0, 0, False))]
    assert rates == [0.75, None, None]  # no drafts proposed: n/a, not "every draft rejected"


def test_ratios_pair_the_rounds_and_star_a_ratio_within_noise():
    from infer.bench.report import format_cell
    from infer.bench.stats import METRICS, summarize

    def runs(arm: str, durations: list[float]) -> list[RunResult]:  # one request of 10 tokens per run
        return [RunResult(arm, i, d, [RequestRecord(0, 0, 0.0, 5, 10, [0.01 * t for t in range(10)], d)])
                for i, d in enumerate(durations)]

    summary = summarize({"A": runs("A", [1.0, 2.0, 4.0]), "B": runs("B", [0.5, 2.5, 2.0]),
                         "C": runs("C", [0.5, 1.0, 2.0])})
    tok_s = next(m for m in METRICS if m.key == "output_tokens_per_s")
    b, c = summary["B"]["output_tokens_per_s"], summary["C"]["output_tokens_per_s"]
    assert b.values == [20, 4, 5] and b.median == 5 and b.ratio == 5 / 5  # A's values: 10, 5, 2.5
    assert b.paired_ratios == [2, 0.8, 2] and b.within_noise  # the rounds disagree
    assert c.paired_ratios == [2, 2, 2] and not c.within_noise and c.ci95 == pytest.approx((2, 2))
    assert format_cell(tok_s, b, False, 3) == "5.00 [4.00–20.0] ×1.00*"
    assert format_cell(tok_s, c, False, 3) == "10.0 [5.00–20.0] ×2.00"
    assert format_cell(tok_s, summary["A"]["output_tokens_per_s"], True, 3) == "5.00 [2.50–10.0]"


def test_a_first_arm_of_zero_is_compared_by_paired_differences():
    """A baseline's prefix hit rate (or preemptions) is 0 in every round, so no ratio exists: a consistent
    difference is still a difference, and an inconsistent one is within noise."""
    from infer.bench.stats import summarize

    def runs(arm: str, hits: list[int]) -> list[RunResult]:
        counters = [EngineCounters(10, 1, 100, h, 0, 0, 0, 0, False) for h in hits]
        return [RunResult(arm, i, 1.0, [RequestRecord(0, 0, 0.0, 5, 2, [0.1, 0.2], 0.2)], c)
                for i, c in enumerate(counters)]

    summary = summarize({"A": runs("A", [0, 0, 0]), "B": runs("B", [66, 66, 66]), "C": runs("C", [0, 66, 0])})
    b, c = summary["B"]["prefix_hit_rate"], summary["C"]["prefix_hit_rate"]
    assert b.paired_ratios == [] and b.paired_differences == pytest.approx([0.66] * 3) and not b.within_noise
    assert c.paired_differences == pytest.approx([0, 0.66, 0]) and c.within_noise  # a 4.3 t-interval holds 0
    assert summary["B"]["preemptions"].paired_differences == [0, 0, 0] and summary["B"]["preemptions"].within_noise


def test_itl_counts_gaps_between_deliveries():
    """Tokens delivered together (a speculative step's accepted drafts) share a timestamp: one delivery."""
    record = RequestRecord(0, 0, 0.0, 5, 5, [0.1, 0.2, 0.2, 0.2, 0.5], 0.5)
    assert record.itl_s == pytest.approx([0.1, 0.3]) and record.tpot_s == pytest.approx(0.1)


def test_the_table_never_cuts_a_cell():
    """Four arms of five-digit throughput: every cell, ratio and star included, is in the recorded table."""
    import io

    from rich.console import Console

    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, format_cell, render_table
    from infer.bench.stats import METRICS

    arms = [ArmSpec(key, text) for key, text in zip("ABCD", ["", "--kv-cache radix-cache", "--no-prefix-caching",
                                                              "--scheduler chunked-prefill"])]
    runs = {arm.key: [RunResult(arm.key, i, d, [RequestRecord(0, 0, 0.0, 5, 15238, [0.01, 0.02], d)])
                      for i, d in enumerate([1.0 + 0.1 * j, 0.9, 1.13 - 0.05 * j])] for j, arm in enumerate(arms)}
    result = BenchResult(arms, runs, {"workload": {"name": "random"}})
    text = render_table(result, Console(file=io.StringIO(), width=80))
    summary = result.summary()
    tok_s = next(m for m in METRICS if m.key == "output_tokens_per_s")
    for i, arm in enumerate(arms):
        assert format_cell(tok_s, summary[arm.key]["output_tokens_per_s"], i == 0, 3) in text
    assert "…" not in text


def test_repeats_default_to_a_multiple_of_the_arms():
    import io

    from rich.console import Console

    from infer.bench.command import balanced_repeats

    err = Console(file=io.StringIO())
    assert [balanced_repeats(None, arms, err) for arms in (1, 2, 3, 4, 5)] == [3, 4, 3, 4, 5]
    assert balanced_repeats(6, 2, err) == 6 and err.file.getvalue() == ""
    assert balanced_repeats(3, 2, err) == 3 and "arm A runs first in 2 of 3 rounds" in err.file.getvalue()


def test_t_critical_values_give_95_percent_coverage():
    """Each T95 value against Student's t density integrated numerically (Simpson): P(|T| <= t) = 0.95."""
    from infer.bench.stats import t95

    def coverage(t: float, df: int, n: int = 20000) -> float:
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        density = [c * (1 + (i * t / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        simpson = density[0] + density[-1] + sum((4 if i % 2 else 2) * density[i] for i in range(1, n))
        return 2 * simpson * (t / n) / 3

    for df in (1, 2, 3, 5, 10, 29, 30, 31, 60, 200):
        assert coverage(t95(df), df) == pytest.approx(0.95, abs=5e-4), df


def test_identical_arms_are_called_different_one_time_in_twenty():
    """Paired ratios of two identical noisy arms: the star (within noise) is missing in about 5% of comparisons at
    any number of rounds; a consistent 10% difference is found in 3 rounds."""
    import random

    from infer.bench.stats import Aggregate

    rng = random.Random(0)
    for rounds in (2, 3, 5):
        trials = 4000
        called = sum(not Aggregate([], None, paired_ratios=[rng.lognormvariate(0, 0.2) for _ in range(rounds)])
                     .within_noise for _ in range(trials))
        assert 0.035 < called / trials < 0.065, rounds
    assert not Aggregate([], None, paired_ratios=[1.1 * rng.lognormvariate(0, 0.02) for _ in range(3)]).within_noise
    assert Aggregate([], None, paired_ratios=[1.3]).within_noise  # one round shows no difference


def test_outputs_match_compares_each_turn_with_the_first_arms():
    from infer.bench.stats import outputs_match, summarize

    def run_(arm: str, outputs: list[list[int]]) -> RunResult:
        return RunResult(arm, 0, 1.0, [RequestRecord(i, 0, 0.0, 3, len(o), [0.1] * len(o), 0.1, output_ids=o)
                                       for i, o in enumerate(outputs)])

    a, b = run_("A", [[1, 2], [3, 4], [5, 6], [7, 8]]), run_("B", [[1, 2], [3, 9], [5, 6], [7, 8]])
    assert outputs_match(b, a) == 0.75 and outputs_match(a, a) == 1.0
    summary = summarize({"A": [a], "B": [b]})
    assert summary["B"]["outputs_match"].median == 0.75 and summary["A"]["outputs_match"].median == 1.0


def test_t95_is_the_published_table_up_to_30_degrees_of_freedom():
    """Student's t, two-sided 95%, as any statistics table prints it (the approximation starts after 30)."""
    from infer.bench.stats import t95

    assert [t95(df) for df in (1, 2, 3, 10, 29, 30)] == [12.706, 4.303, 3.182, 2.228, 2.045, 2.042]


def test_paired_intervals_are_t_intervals_and_need_finite_positive_ratios():
    from infer.bench.stats import difference_ci95, ratio_ci95

    differences = [1.0, 3.0]  # mean 2, sample standard deviation sqrt(2), 1 degree of freedom: t = 12.706
    half = 12.706 * statistics.stdev(differences) / math.sqrt(2)
    assert difference_ci95(differences) == pytest.approx((2 - half, 2 + half))
    assert difference_ci95([5.0]) is None
    logs = [math.log(2.0), math.log(8.0)]
    half = 12.706 * statistics.stdev(logs) / math.sqrt(2)
    assert ratio_ci95([2.0, 8.0]) == pytest.approx((4 * math.exp(-half), 4 * math.exp(half)))
    for ratios in ([2.0, math.inf], [2.0, 0.0], [2.0, -1.0], [2.0, math.nan], [2.0]):
        assert ratio_ci95(ratios) is None, ratios


def test_the_long_prompts_ttft_is_its_own_sessions():
    requests = [RequestRecord(0, 0, 0.0, 10, 2, [0.1, 0.2], 0.2), RequestRecord(1, 0, 0.5, 500, 2, [1.25, 1.3], 1.3),
                RequestRecord(2, 0, 0.6, 10, 2, [0.7, 0.8], 0.8)]
    assert run_metrics(RunResult("A", 0, 1.5, requests, long_session=1))["long_ttft_ms"] == pytest.approx(750)
    assert run_metrics(RunResult("A", 0, 1.5, requests))["long_ttft_ms"] is None


def test_engine_metrics_that_do_not_apply_are_none_and_a_cache_never_asked_hit_nothing():
    requests = [RequestRecord(0, 0, 0.0, 10, 2, [0.1, 0.2], 0.2)]
    counters = EngineCounters(kv_total_blocks=0, kv_peak_used_blocks=0, prefix_queries=0, prefix_hits=0,
                              preemptions=2, evictions=3, spec_proposed=0, spec_accepted=0, speculative=False)
    metrics = run_metrics(RunResult("A", 0, 1.0, requests, engine=counters, notes={"steps": 7}))
    assert metrics["kv_peak_usage"] is None and metrics["acceptance_rate"] is None
    assert metrics["prefix_hit_rate"] == 0.0  # (--no-prefix-caching) a 0 that the paired differences compare
    assert (metrics["preemptions"], metrics["evictions"], metrics["engine_steps"]) == (2.0, 3.0, 7.0)
    counters = EngineCounters(kv_total_blocks=40, kv_peak_used_blocks=10, prefix_queries=200, prefix_hits=50,
                              preemptions=0, evictions=0, spec_proposed=8, spec_accepted=2, speculative=True)
    metrics = run_metrics(RunResult("A", 0, 1.0, requests, engine=counters))
    assert (metrics["kv_peak_usage"], metrics["prefix_hit_rate"], metrics["acceptance_rate"]) == (0.25, 0.25, 0.25)
    assert metrics["kv_peak_blocks"] == 10.0 and metrics["engine_steps"] is None


def test_outputs_match_is_the_share_of_the_runs_own_requests():
    from infer.bench.stats import outputs_match

    def run_(outputs: list[list[int]]) -> RunResult:
        return RunResult("A", 0, 1.0, [RequestRecord(i, 0, 0.0, 3, len(o), [0.1] * len(o), 0.1, output_ids=o)
                                       for i, o in enumerate(outputs)])

    reference = run_([[1], [2], [3], [4]])
    assert outputs_match(run_([[1], [2]]), reference) == 1.0  # the reference ran more: a stopped run, say
    assert outputs_match(run_([[1], [9], [3]]), reference) == pytest.approx(2 / 3)
    assert outputs_match(run_([]), reference) is None  # no requests: no share


def test_ratios_of_exactly_one_and_of_zero_are_kept_and_judged_as_documented():
    """Identical rounds give an interval of exactly (1, 1), which holds 1; a round whose value is 0 gives a ratio of
    0, kept, and the paired differences judge the arm; so they do where the first arm's value is 0 in a round."""
    from infer.bench.stats import Aggregate, summarize

    assert Aggregate([], None, paired_ratios=[1.0, 1.0, 1.0], paired_differences=[0.0, 0.0, 0.0]).within_noise

    def runs(arm: str, hits: list[int]) -> list[RunResult]:
        return [RunResult(arm, i, 1.0, [RequestRecord(0, 0, 0.0, 5, 2, [0.1, 0.2], 0.2)],
                          EngineCounters(10, 1, 100, h, 0, 0, 0, 0, False)) for i, h in enumerate(hits)]

    summary = summarize({"A": runs("A", [10, 20, 40]), "B": runs("B", [0, 40, 80])})
    b = summary["B"]["prefix_hit_rate"]
    assert b.paired_ratios == pytest.approx([0.0, 2.0, 2.0])
    assert b.paired_differences == pytest.approx([-0.1, 0.2, 0.4])
    differences = [0.05, 0.01, 0.01]  # a first arm of 0 in round 0: its two ratios agree, its differences do not
    half = 4.303 * statistics.stdev(differences) / math.sqrt(3)
    assert statistics.fmean(differences) - half < 0  # the t interval of the differences holds 0
    assert Aggregate([], None, paired_ratios=[2.0, 2.0], paired_differences=differences).within_noise


def test_rounds_rotate_the_arm_order_and_apply_each_arms_process_settings():
    """Round i runs the arms rotated by i; each run sees its own arm's thread count and frozen heap, whichever arm
    was built last."""
    import gc

    import torch
    from rich.console import Console

    from infer.bench.arms import ArmSpec
    from infer.bench.session import ProcessSettings, run_rounds

    seen: list[tuple[str, int, bool]] = []

    class FakeArm:
        def __init__(self, key: str, cpu_threads: int | None, freeze_gc: bool) -> None:
            self.spec, self.cpu_threads, self.freeze_gc = ArmSpec(key, key, None), cpu_threads, freeze_gc

        def run(self, workload, on_request_done):
            seen.append((self.spec.key, torch.get_num_threads(), gc.get_freeze_count() > 0))
            return RunResult(self.spec.key, workload.round, 1.0, [])

    default = torch.get_num_threads()
    torch.set_num_threads(default + 1)  # a process default other than arm B's 1 (this suite runs torch on 1 thread)
    settings = ProcessSettings()
    torch.set_num_threads(1)  # as an arm with --cpu-threads 1 leaves it when it is built last
    workloads = [build_workload(WorkloadSpec(num_requests=1), r, VOCAB, None, None) for r in range(3)]
    try:
        run_rounds([FakeArm("A", None, True), FakeArm("B", 1, False), FakeArm("C", None, False)], workloads,
                   settings, Console(quiet=True))
    finally:
        gc.unfreeze()
        torch.set_num_threads(default)
    assert [key for key, _, _ in seen] == list("ABC" "BCA" "CAB")
    assert {(key, threads, frozen) for key, threads, frozen in seen} == {
        ("A", default + 1, True), ("B", 1, False), ("C", default + 1, False)}


class _FakeArm:
    """What the workload checks read of an arm: vocabulary, context, KV pool, tokenizer, what it refuses."""

    def __init__(self, key: str, vocab: Vocab = VOCAB, max_model_len: int = 1024,
                 kv_capacity_tokens: int | None = None,
                 tokenize: Callable[[str], list[int]] = lambda text: [ord(c) for c in text],
                 reasons: bool = False) -> None:
        from infer.bench.arms import ArmSpec

        self.spec = ArmSpec(key, f"--fake {key}", None)
        self.vocab, self.max_model_len, self.kv_capacity_tokens = vocab, max_model_len, kv_capacity_tokens
        self.tokenize, self.reasons = tokenize, reasons
        self.checked: list[tuple[int, int]] = []
        self.kept: list[object] = []

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        self.checked.append((len(prompt), max_tokens))

    def reasons_before_grammar(self, chat: object) -> bool:
        return self.reasons

    def keep_structured(self, params: SamplingParams) -> None:
        self.kept.append(params.structured_output)


def test_every_rounds_workload_fits_every_arm_and_the_first_arm_tokenizes():
    """Tokens every arm's vocabulary has (no arm's special ones); a request of exactly the smallest context or KV
    pool fits, one token more is refused naming the limit; the longest prompt goes to each arm's own check; text is
    tokenized by the first arm."""
    from infer.bench.session import make_workloads
    from infer.bench.workloads import FileEntry

    spec = WorkloadSpec(num_requests=20, input_len=10, output_len=5, len_sigma=0)  # every request: 15 tokens
    large = _FakeArm("A", Vocab(1000, frozenset({0, 2})), max_model_len=4096)
    small = _FakeArm("B", Vocab(40, frozenset({1})), max_model_len=15, kv_capacity_tokens=15)
    [workload] = make_workloads(spec, range(1), [large, small], None)
    tokens = {t for session in workload.sessions for t in session.turns[0].tokens}
    assert max(tokens) < 40 and not tokens & {0, 1, 2}
    for limits, message in (({"max_model_len": 14}, "context length is 14"),
                            ({"kv_capacity_tokens": 14}, r"arm B \('--fake B'\) has KV blocks for 14 tokens")):
        with pytest.raises(WorkloadError, match=message):
            make_workloads(spec, range(1), [large, _FakeArm("B", **limits)], None)
    entries = [FileEntry("ab", 4, line=1), FileEntry(tuple(range(3, 11)), 2, line=2)]
    other = _FakeArm("B", tokenize=lambda text: [5] * len(text))
    [workload] = make_workloads(WorkloadSpec("file"), range(1), [large, other], entries)
    assert workload.sessions[0].turns[0].tokens == (97, 98) and other.checked == [(8, 2)]


def test_file_lines_are_checked_against_the_vocabulary_context_kv_pool_and_structure(tmp_path):
    from infer.bench.session import keep_fitting_lines, keep_structured_lines
    from infer.bench.workloads import FileEntry, check_vocabulary

    spec = WorkloadSpec("file", skip_bad_lines=True)
    entries = [FileEntry((5, 9), 1, line=1), FileEntry((10,), 1, line=2), FileEntry("text", 1, line=3)]
    good, errors = check_vocabulary(spec, entries, 10)
    assert [e.line for e in good] == [1, 3] and [e.split(":")[0] for e in errors] == ["line 2"]
    with pytest.raises(WorkloadError, match="has no good line"):  # --skip-bad-lines with every line bad: no run
        check_vocabulary(spec, entries[1:2], 10)
    # context: the smallest (10); a text prompt counts the first arm's tokens (6, where arm B's makes 1)
    arms = [_FakeArm("A", max_model_len=10), _FakeArm("B", max_model_len=12, tokenize=lambda text: [7])]
    good, errors = keep_fitting_lines(spec, arms, [FileEntry("abcdef", 4, line=1), FileEntry((1,) * 7, 4, line=2)])
    assert [(e.line, e.prompt) for e in good] == [(1, (97, 98, 99, 100, 101, 102))]
    assert errors == ["line 2: a request of 11 tokens (prompt and max_tokens), over the context length of 10"]
    good, errors = keep_fitting_lines(spec, [_FakeArm("A", kv_capacity_tokens=8)],
                                      [FileEntry((1,) * 5, 3, line=1), FileEntry((1,) * 5, 4, line=2)])
    assert [e.line for e in good] == [1] and errors[0].startswith("line 2: a request of 9 tokens")
    # forced tool calls never reason first, so an arm's reasoning parser refuses none; a line without a structured
    # output is not compiled
    tool = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
    lines = [{"messages": [{"role": "user", "content": "x"}], "tools": [tool], "max_tokens": 9,
              "tool_choice": {"type": "function", "function": {"name": "run"}}},
             {"prompt": "plain", "max_tokens": 2},
             {"prompt": "x = ", "max_tokens": 4, "structured_output": {"regex": "a+"}}]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    reasoning = _FakeArm("A", reasons=True)
    good, errors = keep_structured_lines(spec, [reasoning], parse_workload_file(path)[0])
    assert [e.line for e in good] == [1, 2, 3] and errors == []
    assert len(reasoning.kept) == 2 and None not in reasoning.kept


def test_engine_arms_without_a_kv_size_share_the_free_gpu_memory_equally(monkeypatch):
    """On CUDA, each engine arm that sets no KV size gets an equal share of the free memory, every resident arm (HF
    ones too) counted so that all fit; an arm with --num-kv-blocks, a CPU arm and a lone arm are left alone."""
    import torch

    from infer.bench.arms import ArmSpec
    from infer.bench.session import share_gpu_memory
    from infer.cli.options import EngineArgs

    free = 12 * 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 2 * free))

    def arm(key: str, **values: object) -> ArmSpec:
        return ArmSpec(key, "", EngineArgs(dict(values)))

    specs = [arm("A"), arm("B"), arm("C", num_kv_blocks=64), arm("D", device="cpu")]
    share_gpu_memory(specs, hf_arms=2)
    a, b = (spec.args.values["kv_cache_memory_gb"] for spec in specs[:2])
    assert a == b and 6 * a * 2**30 <= free  # four engine arms and two HF arms resident at once
    assert all("kv_cache_memory_gb" not in spec.args.values for spec in specs[2:])
    alone = [arm("A")]
    share_gpu_memory(alone, hf_arms=0)
    assert "kv_cache_memory_gb" not in alone[0].args.values


def test_the_hf_baseline_runs_the_group_model_or_else_the_first_engine_arms():
    from pathlib import Path
    from types import SimpleNamespace

    from infer.bench.runner import EngineArm
    from infer.bench.session import hf_model_path
    from infer.cli.options import EngineArgs

    def engine_arm(model: str) -> EngineArm:
        arm = object.__new__(EngineArm)
        arm.engine = SimpleNamespace(config=SimpleNamespace(model=model))
        return arm

    built = {"A": engine_arm("/models/first"), "B": engine_arm("/models/second")}
    assert hf_model_path(EngineArgs({"model": "/models/group"}), built) == Path("/models/group")
    assert hf_model_path(EngineArgs(), built) == Path("/models/first")


def test_a_long_prompt_that_delayed_nothing_is_flagged():
    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, build_table

    def run_with_long_arrival(arrival: float) -> RunResult:
        steady = RequestRecord(0, 0, 0.0, 10, 3, [0.1, 0.2, 0.3], 0.3)
        long = RequestRecord(1, 0, arrival, 500, 3, [arrival + 0.5, arrival + 0.6, arrival + 0.7], arrival + 0.7)
        return RunResult("A", 0, 1.0, [steady, long], long_session=1)

    for arrival, flagged in ((0.25, False), (0.35, True)):
        result = BenchResult([ArmSpec("A", "")], {"A": [run_with_long_arrival(arrival)]}, {"workload": {}})
        assert ("the long prompt arrived after every steady decode had finished" in str(build_table(result).caption)) \
            is flagged



def test_one_arm_s_table_has_no_ratios_or_comparison_of_outputs():
    """With nothing to compare, the ratio notes and the "outputs = first arm" row (always 100%) were noise."""
    from rich.console import Console

    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, build_table

    run_ = RunResult("A", 0, 1.0, [RequestRecord(0, 0, 0.0, 10, 3, [0.1, 0.2, 0.3], 0.3)])
    for arms, compared in ((["A"], False), (["A", "B"], True)):
        result = BenchResult([ArmSpec(key, "") for key in arms], {key: [run_] for key in arms}, {"workload": {}})
        console = Console(record=True, width=300, file=io.StringIO())
        console.print(build_table(result))
        text = console.export_text()
        assert ("ratio to arm A" in text) is compared and ("within noise" in text) is compared
        assert ("outputs = first arm" in text) is compared
        assert "output tok/s" in text or "tok/s" in text


def test_sampled_outputs_are_compared_only_between_engine_arms_that_speculate_alike():
    """Seeded sampling: the engine arms whose proposer and K equal the first arm's are compared, never an HF arm,
    and nothing when an HF arm is first; the note lists only the options that differ from greedy's defaults."""
    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, sampling_note
    from infer.bench.workloads import RequestSampling
    from infer.cli.options import SAMPLING_DEFAULTS

    def speculating(proposer: str | None = None, k: int | None = None) -> dict[str, object]:
        return {"config": {"config": {"proposer": proposer, "num_speculative_tokens": k}}}

    seeded = RequestSampling({**SAMPLING_DEFAULTS, "temperature": 1.0}, seed=5)
    arms = [ArmSpec(key, key) for key in "ABCD"] + [ArmSpec("E", "hf", hf_mode="static")]
    info = {"A": speculating("ngram", 2), "B": speculating("ngram", 2), "C": speculating("ngram", 3),
            "D": speculating()}
    result = BenchResult(arms, {}, {}, info, seeded)
    assert result.output_comparable() == {"A", "B"}
    note = sampling_note(result) or ""
    assert note.startswith("requests sampled with temperature=1, seeded from --sampling-seed 5 (")
    assert "HF arms draw from their own stream" in note and note.endswith(": outputs n/a)")
    assert BenchResult([arms[4], arms[3]], {}, {}, info, seeded).output_comparable() == set()
    assert BenchResult([arms[3], arms[4]], {}, {}, info, seeded).output_comparable() == {"D"}  # no proposer, as HF
    greedy = BenchResult(arms, {}, {}, info, RequestSampling({**SAMPLING_DEFAULTS, "repetition_penalty": 1.3}))
    assert greedy.output_comparable() == set("ABCDE")
    assert sampling_note(greedy) == "requests: greedy, repetition_penalty=1.3"


def test_table_rows_name_their_unit_and_direction_and_an_arm_that_does_not_measure_shows_n_a():
    from rich.console import Console

    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, build_table

    record = RequestRecord(0, 0, 0.0, 10, 3, [0.1, 0.2, 0.3], 0.3)
    counters = EngineCounters(10, 4, 100, 50, 0, 0, 0, 0, False)

    def table_of(rounds: int) -> str:
        runs = {"A": [RunResult("A", r, 1.0, [record], counters) for r in range(rounds)],
                "B": [RunResult("B", r, 1.0, [record]) for r in range(rounds)]}
        result = BenchResult([ArmSpec("A", ""), ArmSpec("B", "hf", hf_mode="static")], runs, {"workload": {}})
        console = Console(record=True, width=300, file=io.StringIO())
        console.print(build_table(result))
        return console.export_text()

    rows = {line.split("│")[1].strip(): line for line in table_of(3).splitlines() if line.count("│") >= 3}
    assert {"requests/s ↑", "TTFT p50 (ms) ↓", "peak KV blocks ↓", "prefix hit rate ↑"} <= set(rows)
    assert "50.0%" in rows["prefix hit rate ↑"] and "n/a" in rows["prefix hit rate ↑"]
    assert "too few to tell a difference" not in table_of(3) and "2 round(s): too few" in table_of(2)


def test_results_json_keeps_the_paired_statistics_and_writes_non_finite_numbers_as_strings(tmp_path):
    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, to_json, write_json

    def runs(arm: str, durations: list[float]) -> list[RunResult]:  # one request per run: requests/s = 1 / d
        return [RunResult(arm, i, d, [RequestRecord(0, 0, 0.0, 5, 2, [0.1, 0.2], 0.2)]) for i, d in
                enumerate(durations)]

    result = BenchResult([ArmSpec("A", ""), ArmSpec("B", "")], {"A": runs("A", [1.0, 2.0, 4.0]),
                                                                 "B": runs("B", [0.5, 1.0, 2.0])},
                         {"workload": {"rate": math.inf, "sigma": math.nan, "pair": (1.0, -math.inf)}})
    b = to_json(result)["arms"][1]["summary"]["requests_per_s"]
    assert b["paired_ratios"] == [2.0, 2.0, 2.0] and b["ratio_ci95"] == pytest.approx((2.0, 2.0))
    assert b["paired_differences"] == pytest.approx([1.0, 0.5, 0.25])  # B's 2, 1, 0.5 less A's 1, 0.5, 0.25
    write_json(result, tmp_path / "results.json")
    text = (tmp_path / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text  # strict JSON has neither
    assert json.loads(text)["workload"] == {"rate": "inf", "sigma": "nan", "pair": [1.0, "-inf"]}


def test_step_recorder_keeps_the_peak_since_its_reset():
    from types import SimpleNamespace

    from infer.bench.runner import StepRecorder

    recorder = StepRecorder()
    for peak in (3, 8, 5):
        recorder.on_step(SimpleNamespace(peak_used_blocks=peak))  # type: ignore[arg-type]
    assert (recorder.peak_used_blocks, recorder.steps) == (8, 3)
    recorder.reset()
    recorder.on_step(SimpleNamespace(peak_used_blocks=2))  # type: ignore[arg-type]
    assert (recorder.peak_used_blocks, recorder.steps) == (2, 1)


class _FakeEngine:
    """What EngineArm.run reads of an engine: each step gives every live request two tokens (as a speculative step
    delivers them), and each step adds 1 preemption, 2 evictions, 4 drafts proposed and 3 accepted to cumulative
    counters that an earlier run left non-zero."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(enable_prefix_caching=True, proposer=None, kv_cache="paged")
        self.kv = SimpleNamespace(reset_prefix_cache=lambda: True, stats=lambda: SimpleNamespace(
            total_blocks=64, prefix_queries=10, prefix_hits=5, evictions=self.evictions))
        self.scheduler = SimpleNamespace(num_preemptions=7)
        self.stats = SimpleNamespace(spec_proposed=40, spec_accepted=30)
        self.evictions, self.steps = 12, 0
        self.live: dict[str, list] = {}
        self.params: dict[str, SamplingParams] = {}

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> str:
        self.live[request_id] = [len(prompt), params.max_tokens, 0]
        self.params[request_id] = params
        return request_id

    def step(self) -> list:
        from types import SimpleNamespace

        self.steps += 1
        self.scheduler.num_preemptions += 1
        self.evictions += 2
        self.stats.spec_proposed += 4
        self.stats.spec_accepted += 3
        outputs = []
        for rid, item in list(self.live.items()):
            prompt_len, max_tokens, done = item
            count = min(2, max_tokens - done)
            item[2] += count
            outputs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[prompt_len] * count)],
                                           finished=item[2] == max_tokens, num_cached_tokens=1))
            if item[2] == max_tokens:
                del self.live[rid]
        return outputs


def test_a_run_records_every_token_its_history_and_the_engines_counters_over_the_run():
    from infer.bench.arms import ArmSpec
    from infer.bench.runner import EngineArm, StepRecorder
    from infer.bench.workloads import Session, Turn, Workload

    engine = _FakeEngine()
    arm = object.__new__(EngineArm)  # the arm around the fake engine, as __init__ sets it up around a real one
    arm.spec, arm.engine, arm.recorder, arm.warned_warm = ArmSpec("A", ""), engine, StepRecorder(), False
    chat = Session(0.0, (Turn((1, 2, 3), 3), Turn((4,), 4), Turn((5, 6), 1)), lora_adapter="sql")
    result = arm.run(Workload("multi-turn", 0, (chat, Session(0.0, (Turn((7,), 2),)))), lambda: None)
    # a turn's prompt is the history (earlier prompts and outputs) and its own tokens; every token has a time
    assert [(r.session, r.turn, r.prompt_tokens, r.output_tokens, len(r.token_times_s)) for r in result.requests] == [
        (0, 0, 3, 3, 3), (0, 1, 3 + 3 + 1, 4, 4), (0, 2, 7 + 4 + 2, 1, 1), (1, 0, 1, 2, 2)]
    first = result.requests[0].token_times_s
    assert first[0] == first[1] < first[2]  # two tokens of one step arrive together
    assert [engine.params[rid].lora_adapter for rid in sorted(engine.params)] == ["sql", "sql", "sql", None]
    counters, n = result.engine, engine.steps
    assert (counters.preemptions, counters.evictions, counters.spec_proposed, counters.spec_accepted) == (
        n, 2 * n, 4 * n, 3 * n)
    assert not counters.speculative  # no proposer: no acceptance rate


def test_an_engine_arm_leaves_its_tokenizers_special_tokens_out_of_random_prompts(tiny_model):
    from transformers import AutoTokenizer

    from infer.bench.arms import parse_arms
    from infer.bench.runner import EngineArm
    from infer.cli.options import EngineArgs
    from infer.core.plugins import PluginManager

    [spec] = parse_arms([], EngineArgs.from_kwargs({"model": str(tiny_model), "device": "cpu", "num_kv_blocks": 8}))
    arm = EngineArm(spec, PluginManager.from_entry_points())
    special = set(AutoTokenizer.from_pretrained(str(tiny_model)).all_special_ids)
    assert special and arm.vocab.special == special and not special & set(arm.vocab.allowed)
    assert arm.kv_capacity_tokens == 8 * arm.engine.config.block_size


def test_hf_static_batches_every_request_and_cuts_each_to_its_own_length():
    """Requests beyond --hf-batch-size wait for the next batch; a batch generates its longest output, each request
    keeps its own max_tokens of it (tokens and times), and each sampled batch is seeded."""
    import time
    from types import SimpleNamespace

    from infer.bench.arms import ArmSpec
    from infer.bench.hf import HFArm, _StepTimes
    from infer.bench.workloads import RequestSampling, Session, Turn, Workload

    calls: list[tuple[int, int, int | None]] = []

    def generate(prompts: list[list[int]], max_new_tokens: int, sampling: RequestSampling, seed: int | None
                 ) -> tuple[list[float], list[list[int]]]:
        calls.append((len(prompts), max_new_tokens, seed))
        now = time.perf_counter()
        return [now + 0.01 * i for i in range(max_new_tokens)], [[len(p)] * max_new_tokens for p in prompts]

    stub = SimpleNamespace(batch_size=2, spec=ArmSpec("A", "hf", hf_mode="static"), _generate_batch=generate)
    sessions = tuple(Session(0.0, (Turn(tuple(range(n)), m),)) for n, m in ((3, 2), (4, 5), (5, 1)))
    sampling = RequestSampling({"temperature": 1.0}, seed=7)
    result = HFArm._run_static(stub, Workload("random", 0, sessions, sampling=sampling), lambda: None)  # type: ignore
    assert [(r.prompt_tokens, r.output_tokens, len(r.token_times_s), r.output_ids) for r in result.requests] == [
        (3, 2, 2, [3, 3]), (4, 5, 5, [4] * 5), (5, 1, 1, [5])]
    assert [(size, tokens) for size, tokens, _ in calls] == [(2, 5), (1, 1)]
    assert None not in {seed for _, _, seed in calls} and calls[0][2] != calls[1][2]
    streamer = _StepTimes()
    for value in ("prompt", "token 1", "token 2"):  # generate's first put is the prompt
        streamer.put(value)
    assert len(streamer.times) == 2


def test_hf_continuous_batching_records_times_from_the_runs_start_and_each_turns_history():
    import time
    from types import SimpleNamespace

    from infer.bench.arms import ArmSpec
    from infer.bench.hf import HFArm
    from infer.bench.workloads import Session, Turn, Workload

    class Manager:
        """transformers' manager as _drive_cb reads it: a request is done when added, its timestamps perf_counter's."""

        def __init__(self) -> None:
            self.done: list[SimpleNamespace] = []

        def add_request(self, prompt: list[int], request_id: str, max_new_tokens: int, **_: object) -> None:
            now = time.perf_counter()
            self.done.append(SimpleNamespace(request_id=request_id, error=None, timestamps=[now] * max_new_tokens,
                                             lifespan=(now, now), generated_tokens=[len(prompt)] * max_new_tokens))

        def get_result(self, timeout: float) -> SimpleNamespace | None:
            return self.done.pop(0) if self.done else None

    workload = Workload("multi-turn", 0, (Session(0.0, (Turn((1, 2), 3), Turn((3,), 2))),))
    stub = SimpleNamespace(spec=ArmSpec("A", "hf:cb", hf_mode="cb"))
    result = HFArm._drive_cb(stub, Manager(), workload, lambda: None)  # type: ignore[arg-type]
    assert [(r.prompt_tokens, r.output_tokens, r.output_ids) for r in result.requests] == [
        (2, 3, [2, 2, 2]), (2 + 3 + 1, 2, [6, 6])]
    assert all(0 <= t <= r.finish_s <= result.duration_s for r in result.requests for t in r.token_times_s)


# ---------------------------------------------------------------- bad input through the CLI
@pytest.mark.parametrize(("args", "message"), [
    (["--repeats", "0"], "Invalid value for '--repeats': 0 is not in the range x>=1"),
    (["--workload", "chat"], "Invalid value for '--workload': 'chat' is not one of 'random'"),
    (["--ab", "--kv-cache paged", "--kv-cach paged"], "arm B ('--kv-cach paged'): No such option '--kv-cach'"),
    (["--ab", "--max-num-seqs many"], "arm A ('--max-num-seqs many'): Invalid value for '--max-num-seqs'"),
    (["--ab", "--kv-cache", "paged"], "arm A ('--kv-cache'): Option '--kv-cache' requires an argument"),
    (["--ab", "--plugin 'unbalanced"], "arm A (\"--plugin 'unbalanced\"): cannot split the options"),
    (["--ab", "hf:turbo"], "the HF baseline is written 'hf', 'hf:static' or 'hf:cb'"),
    (["--workload", "file"], "--workload file needs --file PATH"),
    (["--file", __file__], "--file is read by --workload file only; this run's workload is 'random'"),
    (["--num-requests", "0"], "--num-requests must be a positive integer"),
    (["--len-sigma", "nan"], "--len-sigma and --long-delay must be finite and >= 0"),
    (["--workload", "long-prompt-arrival", "--long-delay", "inf"], "--len-sigma and --long-delay must be finite"),
    (["--workload", "long-prompt-arrival", "--rate", "5"], "--rate does not apply to long-prompt-arrival"),
    (["--ab", "--repeats", "1"], "--ab needs at least one arm after it"),
    (["--out", __file__ + "/sub"], "Invalid value for '--out': cannot create or write the output folder"),
    (["--out", "/proc"], "Invalid value for '--out': cannot create or write the output folder"),  # exists, not writable
    (["--temperature", "-1"], "temperature (--temperature) must be a number >= 0"),
    (["--sampling-seed", "-1"], "Invalid value for '--sampling-seed'"),
    (["--ab", "", "hf:cb", "--repetition-penalty", "1.2"], "transformers' continuous batching drops "
     "--repetition-penalty"),
    (["--ab", "", "hf", "--presence-penalty", "0.5"], "HF transformers has no --presence-penalty: drop it or the hf"),
    (["--ab", "", "hf", "--logits-processor", "no-repeat-ngram"], "HF transformers has no --logits-processor: drop"),
    # static HF batches apply a repetition penalty (only hf:cb drops it): the bench goes on to the next check
    (["--ab", "", "hf", "--repetition-penalty", "1.2", "--num-requests", "0"], "--num-requests must be a positive"),
    (["--workload", "multi-turn", "--turns", "0"], "--turns must be a positive integer, got 0"),
    (["--rate", "0"], "--rate must be > 0 requests/s"),
    (["--workload", "long-prompt-arrival", "--long-delay", "-1"], "--len-sigma and --long-delay must be finite and"),
    (["--lora-adapter", "sql"], "arm A: (group options) cannot serve LoRA adapter(s) sql"),
    (["--lora-adapter", "sql", "--ab", "hf"], "the HF baseline (hf) serves no LoRA adapters"),
])
def test_bad_input_is_a_clear_error(args, message):
    result = run("bench", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)  # a usage error, no crash


def test_a_workload_longer_than_the_context_names_its_own_length_options(tiny_model):
    result = run("--model", str(tiny_model), "bench", "--workload", "shared-prefix", "--repeats", "1")
    assert result.exit_code == 2 and "context length is 1024; lower --prefix-len/--question-len/--output-len or" \
        in result.output


def test_a_workload_larger_than_an_arms_kv_pool_names_the_arm_before_running(tiny_model):
    result = run("--model", str(tiny_model), "bench", "--num-requests", "4", "--ab", "", "--num-kv-blocks 6")
    assert result.exit_code == 2 and "arm B ('--num-kv-blocks 6') has KV blocks for 96 tokens" in result.output
    assert "give that arm more KV memory" in result.output and "warming up" not in result.output


def test_an_arm_failing_mid_run_names_itself_and_keeps_the_completed_rounds():
    from infer.bench.arms import ArmSpec
    from infer.bench.session import ProcessSettings, RunError, run_rounds as run_arms
    from infer.core.errors import CapacityError

    class FakeArm:
        cpu_threads, freeze_gc = None, False

        def __init__(self, key: str, fail_in_round: int | None, error: BaseException | None = None) -> None:
            self.spec, self.fail_in_round = ArmSpec(key, f"--fake {key}", None), fail_in_round
            self.error = error or CapacityError("no room")

        def run(self, workload, on_request_done):
            if workload.round == self.fail_in_round:
                raise self.error
            return RunResult(self.spec.key, workload.round, 1.0, [])

    workloads = [build_workload(WorkloadSpec(num_requests=1), r, VOCAB, None, None) for r in range(3)]
    from rich.console import Console

    def run_rounds(arms, workloads, err):
        return run_arms(arms, workloads, ProcessSettings(), err)

    with pytest.raises(RunError, match=r"arm B \('--fake B'\) failed in round 2 of 3: no room") as caught:
        run_rounds([FakeArm("A", None), FakeArm("B", 1)], workloads, Console(quiet=True))
    assert {key: [r.round for r in runs] for key, runs in caught.value.runs.items()} == {"A": [0], "B": [0]}
    # not only infer's own errors: a CUDA out-of-memory error or Ctrl-C keeps the completed rounds too
    oom = FakeArm("B", 2, RuntimeError("CUDA out of memory"))
    with pytest.raises(RunError, match="failed in round 3 of 3: RuntimeError: CUDA out of memory") as caught:
        run_rounds([FakeArm("A", None), oom], workloads, Console(quiet=True))
    assert [len(runs) for runs in caught.value.runs.values()] == [2, 2] and not caught.value.interrupted
    with pytest.raises(RunError, match=r"^interrupted in round 2 of 3 \(arm A, '--fake A'\)$") as caught:
        run_rounds([FakeArm("A", 1, KeyboardInterrupt()), FakeArm("B", None)], workloads, Console(quiet=True))
    assert caught.value.interrupted and [len(runs) for runs in caught.value.runs.values()] == [1, 1]


def test_an_arm_whose_options_the_engine_refuses_is_a_command_line_error(tiny_model, tmp_path):
    """Status 2, as `generate` exits for the same options; a missing model is status 1 in both."""
    result = run("--model", str(tiny_model), "bench", "--num-requests", "2", "--repeats", "1", "--warmup-rounds", "0",
                 "--ab", "", "--kv-admission-reserve 2")
    assert result.exit_code == 2 and "arm B ('--kv-admission-reserve 2'): kv-admission-reserve must be" in \
        result.output
    result = run("--model", str(tiny_model), "bench", "--num-requests", "2", "--repeats", "1", "--warmup-rounds", "0",
                 "--ab", "", f"--model {tmp_path / 'missing'}")
    assert result.exit_code == 1 and "does not exist" in result.output


def test_an_arm_failing_at_run_time_is_named_and_fails_the_command(tiny_model, tmp_path):
    # the first turns fit arm B's step budget (checked before any run); the second, with the history, does not
    result = run("--model", str(tiny_model), "bench", "--workload", "multi-turn", "--turns", "2", "--num-requests",
                 "2", "--input-len", "40", "--output-len", "8", "--len-sigma", "0", "--repeats", "1",
                 "--warmup-rounds", "0", "--ab", "", "--max-num-batched-tokens 64", "--out", str(tmp_path))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "arm B ('--max-num-batched-tokens 64') failed in round 1 of 1: prompt of 88 tokens" in result.output
    data = json.loads((tmp_path / "results.json").read_text())  # no round to tabulate, but the failure is on record
    assert data["failure"].startswith("arm B") and [len(arm["runs"]) for arm in data["arms"]] == [0, 0]
    assert data["rounds_completed"] == 0 and data["repeats"] == 1
    assert not (tmp_path / "table.txt").exists()


def test_an_unknown_component_in_an_arm_names_the_arm(tiny_model):
    result = run("--model", str(tiny_model), "bench", "--ab", "--kv-cache paged", "--kv-cache nope")
    assert result.exit_code == 2 and "building arm" not in result.output  # refused before any engine is built
    assert "arm B ('--kv-cache nope'): unknown kv cache 'nope'; registered kv caches: paged" in result.output
    assert "before `bench`" not in result.output  # the arm's own option is wrong, not the group's


def test_an_arm_refused_for_the_group_options_says_they_apply(tiny_model):
    result = run("--model", str(tiny_model), "--async-scheduling", "bench", "--ab",
                 "--proposer ngram --num-speculative-tokens 2")
    assert result.exit_code == 2 and "--async-scheduling does not combine" in result.output
    assert "the options before `bench` apply to every arm" in result.output


def test_a_bad_workload_file_lists_its_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 2}\n{"prompt": 3, "max_tokens": 2}\n{oops\n')
    result = run("bench", "--workload", "file", "--file", str(path))
    assert result.exit_code == 2
    assert "line 2: 'prompt' must be a string or a list of token ids" in result.output
    assert "line 3: not valid JSON" in result.output and "--skip-bad-lines" in result.output


# ---------------------------------------------------------------- real runs on the tiny model
def test_multi_turn_ab_with_the_hf_baseline(tiny_model, tmp_path):
    """The issue's acceptance run, plus the hf arm: table, JSON and plots; hit rates are the engines' own."""
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "multi-turn",
                 "--num-requests", "3", "--turns", "3", "--input-len", "20", "--output-len", "6",
                 "--ab", "--kv-cache paged", "--kv-cache radix-cache", "hf", "--repeats", "2", "--warmup-rounds", "0",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"results.json", "table.txt", "latency_cdf.png", "throughput.png"}
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in ("latency_cdf.png", "throughput.png"))

    table = (out / "table.txt").read_text()
    assert "prefix hit rate" in table and "C: hf" in table and "×" in table
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads((out / "results.json").read_text(), parse_constant=refuse)  # strict JSON
    assert data["workload"]["rate"] == "inf"  # the default --rate
    assert data["order"] == ["A", "B", "C"] and data["repeats"] == 2 and data["rounds_completed"] == 2
    assert data["round_orders"] == [["A", "B", "C"], ["B", "C", "A"]]
    arms = {arm["key"]: arm for arm in data["arms"]}
    assert [len(arm["runs"]) for arm in arms.values()] == [2, 2, 2]
    assert all(len(run["requests"]) == 9 for arm in arms.values() for run in arm["runs"])

    for key in ("A", "B"):
        arm = arms[key]
        runs = arm["runs"]
        for run_ in runs:
            engine, metrics = run_["engine"], run_["metrics"]
            assert engine["prefix_queries"] > 0 and engine["preemptions"] == 0
            assert metrics["prefix_hit_rate"] == engine["prefix_hits"] / engine["prefix_queries"] > 0
            # the same rate from another path: what each RequestOutput reported as served from the cache
            reqs = run_["requests"]
            assert metrics["prefix_hit_rate"] == pytest.approx(
                sum(r["cached_tokens"] for r in reqs) / sum(r["prompt_tokens"] for r in reqs))
        totals, warmup = arm["engine_totals"], arm["warmup"]
        for counter in ("prefix_queries", "prefix_hits"):  # the runs and the warm-up add up to the engine's totals
            assert warmup[counter] + sum(r["engine"][counter] for r in runs) == totals[counter]
        assert totals["summary"]["prefix_hit_rate"] == round(totals["prefix_hits"] / totals["prefix_queries"], 4)
        assert arm["summary"]["prefix_hit_rate"]["median"] > 0

    assert arms["B"]["summary"]["outputs_match"]["values"] == [1.0, 1.0]  # the radix cache changes no token
    assert "outputs = first arm" in table
    hf = arms["C"]
    assert hf["kind"] == "hf" and hf["summary"]["requests_per_s"]["ratio"] > 0
    assert hf["summary"]["outputs_match"]["values"] == [1.0, 1.0]  # HF static generate: infer's greedy tokens
    assert hf["summary"]["prefix_hit_rate"]["median"] is None and all(r["engine"] is None for r in hf["runs"])
    assert arms["B"]["summary"]["output_tokens_per_s"]["ratio"] == pytest.approx(
        arms["B"]["summary"]["output_tokens_per_s"]["median"] / arms["A"]["summary"]["output_tokens_per_s"]["median"])


def test_file_workload_with_skipped_lines_against_hf_continuous_batching(tiny_model, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "def add(a, b):", "max_tokens": 4}\n'
                    '{"prompt": [5, 6, 7, 8, 9], "max_tokens": 3}\n'
                    '{"prompt": "broken", "max_tokens": -1}\n'
                    '{"prompt": "import os", "max_tokens": 5}\n'
                    '{"prompt": [5, 99999], "max_tokens": 2}\n'  # outside the vocabulary: found after loading
                    '{"prompt": "x = 1", "max_tokens": 100000}\n')  # over the context: it stopped the bench
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "file", "--file", str(path),
            "--ab", "", "hf:cb", "--repeats", "1", "--warmup-rounds", "0"]
    refused = run(*args)
    assert refused.exit_code == 2 and "line 3" in refused.output  # the syntax check, before any model loads
    path.write_text(path.read_text().replace('{"prompt": "broken", "max_tokens": -1}\n', ""))
    refused = run(*args)
    assert refused.exit_code == 2 and "line 4: token ids [99999] are outside the vocabulary" in refused.output
    # every check that needs the models lists its bad lines in one refusal (the long line came only after a fix)
    assert "has 2 bad line(s) found once the models loaded" in refused.output and "(3 line(s) left)" in refused.output
    assert "line 5: a request of 100003 tokens" in refused.output
    path.write_text('{"prompt": "broken", "max_tokens": -1}\n' + path.read_text())
    result = run(*args, "--skip-bad-lines", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "skipped" in result.output and "line 1" in result.output and "line 5: token ids [99999]" in result.output
    assert "line 6: a request of 100003 tokens (prompt and max_tokens), over the context length of" in result.output
    data = json.loads((out / "results.json").read_text())
    for arm in data["arms"]:
        [run_] = arm["runs"]
        assert sorted(r["output_tokens"] for r in run_["requests"]) == [3, 4, 5]
    assert data["arms"][1]["config"]["mode"] == "cb"
    assert data["arms"][1]["summary"]["ttft_p50_ms"]["median"] > 0
    assert data["arms"][1]["summary"]["outputs_match"]["values"] == [1.0]  # HF CB: infer's greedy tokens


def test_file_workload_chats_render_with_the_first_arms_template(tiny_model, tmp_path):
    """A line may be a chat ({"messages": [...], "tools": [...]}): the first arm's engine renders it with its chat
    template (here --chat-template), every arm runs those ids; a bad chat is a bad line, and a model without a
    template stops the bench."""
    from infer import LLM, ChatPrompt

    template = tmp_path / "chat.jinja"
    template.write_text("{% if tools %}<|system|>{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                        "<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}<|assistant|>\n")
    chats = [{"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 3},
             {"messages": [{"role": "system", "content": "Code."}, {"role": "user", "content": "import os"}],
              "tools": [{"type": "function", "function": {"name": "run"}}], "max_tokens": 2}]
    path = tmp_path / "w.jsonl"
    bad = ['{"messages": [], "max_tokens": 2}', '{"prompt": "x", "messages": [], "max_tokens": 2}',
           '{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}, "max_tokens": 2}']
    path.write_text("".join(json.dumps(c) + "\n" for c in chats) + "\n".join(bad) + "\n")
    entries, errors = parse_workload_file(path)
    assert [e.prompt for e in entries] == [ChatPrompt.of(c["messages"], tools=c.get("tools")) for c in chats]
    assert errors == ["line 3: a chat prompt needs at least one message",
                      "line 4: give 'prompt' or 'messages' (a chat), not both",
                      "line 5: tools must be a list of {'type': 'function', 'function': {'name': ..., 'description': "
                      "..., 'parameters': {...}}} entries, got dict"]
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--device", "cpu", "--chat-template", str(template), "bench", "--workload",
            "file", "--file", str(path), "--skip-bad-lines", "--ab", "", "hf:cb", "--repeats", "1",
            "--warmup-rounds", "0", "--out", str(out)]
    result = run(*args)
    assert result.exit_code == 0, result.output
    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=16, chat_template=str(template))
    want = sorted(len(llm.engine.tokenize(entry.prompt)) for entry in entries)
    data = json.loads((out / "results.json").read_text())
    for arm in data["arms"]:
        assert sorted(r["prompt_tokens"] for r in arm["runs"][0]["requests"]) == want
    assert data["arms"][1]["summary"]["outputs_match"]["values"] == [1.0]  # HF ran the same ids
    args.remove("--chat-template")
    args.remove(str(template))
    refused = run(*args[:-2])
    assert refused.exit_code == 2 and "line 1: this model's tokenizer has no chat template" in refused.output


def test_a_structured_chat_line_an_arm_would_reason_before_is_a_bad_line(thinking_model, tmp_path):
    """Served, a chat's structured output holds after the reasoning when the engine's reasoning parser says where
    it ends; the bench sends chats as token ids, where it would hold from the first token: an arm with such a parser
    makes the line a bad line, naming the arm, instead of measuring something serving never runs."""
    template = tmp_path / "opened.jinja"
    template.write_text("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>\n<think>")
    ask = {"messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 8}
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({**ask, "structured_output": {"regex": "is [a-z]{2,5}"}}) + "\n" + json.dumps(ask)
                    + "\n")
    common = ["--model", str(thinking_model), "--device", "cpu", "--chat-template", str(template), "bench",
              "--workload", "file", "--file", str(path), "--repeats", "1", "--warmup-rounds", "0"]
    result = run(*common, "--ab", "", "--reasoning-parser deepseek-r1", "--out", str(tmp_path / "a"))
    assert result.exit_code == 2, result.output
    assert "line 1: arm B ('--reasoning-parser deepseek-r1') has a reasoning parser that lets this chat's reply " \
           "reason before its structured output" in " ".join(result.output.split())
    result = run(*common, "--ab", "", "--reasoning-parser deepseek-r1", "--skip-bad-lines", "--out",
                 str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert [len(a["runs"][0]["requests"]) for a in json.loads((tmp_path / "b" / "results.json").read_text())[
        "arms"]] == [1, 1]
    result = run(*common, "--ab", "", "--no-prefix-caching", "--out", str(tmp_path / "c"))  # no parser: served alike
    assert result.exit_code == 0, result.output


def _bench_outputs(tiny_model, tmp_path, name: str, *args: str) -> dict[str, list[list[int]]]:
    """arm key -> each request's output ids, in (session, turn) order, of a one-round bench with ``args``."""
    out = tmp_path / name
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--num-requests", "3", "--input-len", "8",
                 "--output-len", "8", "--len-sigma", "0", "--repeats", "1", "--warmup-rounds", "0", "--out", str(out),
                 *args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    outputs = {arm["key"]: [r["output_ids"] for r in arm["runs"][0]["requests"]] for arm in data["arms"]}
    return outputs | {"table": " ".join((out / "table.txt").read_text().split()),
                      "summary": {arm["key"]: arm["summary"] for arm in data["arms"]}}


def test_sampling_options_reach_every_arms_sampler(tiny_model, tmp_path):
    """Top-1 sampling is greedy, in the engine and in HF; a higher temperature samples other tokens, the same
    ones from the same --sampling-seed in every engine arm and every run, and none are compared unseeded."""
    greedy = _bench_outputs(tiny_model, tmp_path, "greedy", "--ab", "", "hf")
    assert greedy["A"] == greedy["B"]
    top1 = _bench_outputs(tiny_model, tmp_path, "top1", "--temperature", "1.0", "--top-k", "1",
                          "--sampling-seed", "5", "--ab", "", "hf")
    assert top1["A"] == top1["B"] == greedy["A"]
    assert "requests sampled with temperature=1, top_k=1, seeded from --sampling-seed 5" in top1["table"]

    hot = ["--temperature", "2.0", "--sampling-seed", "5", "--ab", "", "--no-prefix-caching", "hf"]
    first, again = (_bench_outputs(tiny_model, tmp_path, name, *hot) for name in ("hot1", "hot2"))
    assert first["A"] != greedy["A"] and first["C"] != greedy["A"]  # sampled, in both samplers
    assert first["A"] == first["B"] == again["A"] == again["B"]  # seeded per request: arms and runs agree
    assert first["C"] == again["C"]  # the HF arm's batches are seeded too
    assert first["summary"]["B"]["outputs_match"]["values"] == [1.0]
    assert first["summary"]["C"]["outputs_match"]["median"] is None  # HF samples from its own stream
    assert "seeded from --sampling-seed 5 (HF arms draw from their own stream: outputs n/a)" in first["table"]

    unseeded = _bench_outputs(tiny_model, tmp_path, "unseeded", "--temperature", "2.0",
                              "--ab", "", "--no-prefix-caching")
    assert unseeded["summary"]["B"]["outputs_match"]["median"] is None
    assert "outputs = first arm" not in unseeded["table"] and "outputs not compared" in unseeded["table"]
    hf_first = _bench_outputs(tiny_model, tmp_path, "hf-first", "--temperature", "2.0", "--sampling-seed", "5",
                              "--ab", "hf", "")
    assert hf_first["summary"]["B"]["outputs_match"]["median"] is None  # not compared with HF's own stream
    # rejection sampling draws otherwise than plain sampling: only arms that speculate alike are compared
    ngram = "--proposer ngram --num-speculative-tokens 2"
    spec = _bench_outputs(tiny_model, tmp_path, "spec", "--temperature", "2.0", "--sampling-seed", "5",
                          "--ab", ngram, "", f"{ngram} --no-prefix-caching", ngram.replace("2", "3"))
    assert spec["summary"]["B"]["outputs_match"]["median"] is None
    assert spec["summary"]["D"]["outputs_match"]["median"] is None  # another K draws otherwise too
    assert spec["summary"]["C"]["outputs_match"]["values"] == [1.0] and spec["A"] == spec["C"]
    assert "arms whose speculation differs from the first arm's draw differently: outputs n/a" in spec["table"]


def test_an_eos_argmax_stops_no_arm_and_every_arm_generates_it(tiny_model, tmp_path):
    """Every arm generates exactly its tokens, EOS among them where it comes: with EOS made the argmax (a bias),
    the engine and both HF baselines output EOS throughout (the static HF arm masked EOS, and diverged there)."""
    import json as json_module

    eos = json_module.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    outputs = _bench_outputs(tiny_model, tmp_path, "eos", "--logit-bias", f"{eos}=100", "--ab", "", "hf", "hf:cb")
    assert outputs["A"] == outputs["B"] == outputs["C"] == [[eos] * 8] * 3


def test_logit_controls_reach_both_samplers(tiny_model, tmp_path):
    """Greedy with a logit bias and a repetition penalty: the engine and HF generate the same changed tokens; an
    engine-only bench takes the penalties HF lacks."""
    plain = _bench_outputs(tiny_model, tmp_path, "plain", "--ab", "")
    controlled = _bench_outputs(tiny_model, tmp_path, "controlled", "--logit-bias", "300=2.5",
                                "--repetition-penalty", "1.3", "--ab", "", "hf")
    assert controlled["A"] == controlled["B"] != plain["A"]
    assert "requests: greedy, repetition_penalty=1.3, logit_bias={300: 2.5}" in controlled["table"]
    _bench_outputs(tiny_model, tmp_path, "presence", "--presence-penalty", "0.5", "--frequency-penalty", "0.5")


def test_hf_generation_config_carries_every_sampling_option():
    from types import SimpleNamespace

    from infer.bench.hf import HFArm
    from infer.bench.workloads import RequestSampling

    stub = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=2), pad_id=0, vocab=SimpleNamespace(size=1024))
    fields = dict(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.2, logit_bias=((7, -3.0),))
    for cb in (False, True):
        config = HFArm._generation_config(stub, 8, cb, RequestSampling(fields))  # type: ignore[arg-type]
        assert (config.do_sample, config.temperature, config.top_p, config.top_k, config.min_p) == (
            True, 0.7, 0.9, 0, 0.05)
        assert config.repetition_penalty == 1.2 and config.sequence_bias == {(7,): -3.0}
        # an eos id no token has (EOS generated as any token, stopping nothing), and EOS never masked
        assert config.max_new_tokens == 8 and config.eos_token_id == (-1 if cb else 1024)
        assert not config.min_new_tokens


def test_request_seeds_differ_per_round_session_and_turn():
    from infer.bench.workloads import RequestSampling

    sampling = RequestSampling({"temperature": 1.0}, seed=123456)
    seeds = [sampling.request_seed(r, s, t) for r in range(-2, 3) for s in range(20) for t in range(4)]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**63 for seed in seeds)
    assert RequestSampling({"temperature": 1.0}).request_seed(0, 0, 0) is None


def test_min_tokens_holds_each_request_to_its_own_length_and_a_bias_to_the_vocabulary(tiny_model, tmp_path):
    """--min-tokens above some requests' lengths holds EOS back to their end; out-of-vocabulary --logit-bias ids
    are a command-line error once the models are loaded."""
    from infer.bench.workloads import RequestSampling

    assert RequestSampling({"min_tokens": 6}).params(4, 0, 0, 0).min_tokens == 4
    outputs = _bench_outputs(tiny_model, tmp_path, "min", "--min-tokens", "6", "--len-sigma", "0.5")
    assert all(len(ids) > 0 for ids in outputs["A"])
    refused = run("--model", str(tiny_model), "--device", "cpu", "bench", "--num-requests", "2", "--repeats", "1",
                  "--warmup-rounds", "0", "--logit-bias", "1024=1")  # the first id past the vocabulary's last, 1023
    assert refused.exit_code == 2 and "--logit-bias names token ids [1024] outside the vocabulary of 1024" \
        in refused.output


def test_a_logit_bias_must_fit_the_smallest_vocabulary_of_the_arms(tiny_model, tiny_model_factory):
    """Arms may run models of different vocabularies: a --logit-bias id is checked against the smallest one."""
    small = tiny_model_factory("llama", vocab_size=512)
    refused = run("--model", str(tiny_model), "--device", "cpu", "bench", "--num-requests", "2", "--repeats", "1",
                  "--warmup-rounds", "0", "--logit-bias", "600=1", "--ab", "", f"--model {small}")
    assert refused.exit_code == 2 and "--logit-bias names token ids [600] outside the vocabulary of 512" \
        in refused.output


def test_an_hf_only_bench_exits_without_leak_reports(tiny_model):
    """The HF arm runs with the heap frozen; unfrozen at exit, no extension module reports its objects as leaked
    (nanobind printed about 30 lines)."""
    done = subprocess.run([sys.executable, "-P", "-m", "infer.cli", "--device", "cpu", "--model", str(tiny_model),
                           "bench", "--ab", "hf", "--num-requests", "2", "--repeats", "1", "--warmup-rounds", "0",
                           "--input-len", "8", "--output-len", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leak" not in done.stderr.lower(), done.stderr[-2000:]


def test_the_hf_arm_draws_no_loading_bar_where_stderr_is_no_terminal(tiny_model):
    """CliRunner's stderr is no terminal: from_pretrained's "Loading weights" tqdm bar stays off, and transformers'
    process-wide switch is back on after the command."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # else transformers would draw no bar anyway
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--ab", "hf", "--num-requests", "2",
                 "--repeats", "1", "--warmup-rounds", "0", "--input-len", "8", "--output-len", "4")
    assert result.exit_code == 0, result.output
    assert "building arm A: hf (HF transformers) ..." in result.stderr  # the arm loaded its model in this command
    assert "Loading weights" not in result.stderr and not re.search(r"\d+/\d+ \[\d\d:\d\d", result.stderr), \
        result.stderr
    assert hf_logging.is_progress_bar_enabled()


def test_every_run_starts_with_a_cold_prefix_cache(tiny_model, tmp_path):
    """The file workload repeats its prompts in every round (warm-up included): no run may hit an earlier one's."""
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"prompt": list(range(100 * i + 10, 100 * i + 50)), "max_tokens": 2}) + "\n"
                            for i in range(3)))
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "file", "--file", str(path),
                 "--ab", "", "--kv-cache radix-cache", "--repeats", "2", "--warmup-rounds", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    for arm in json.loads((out / "results.json").read_text())["arms"]:
        assert arm["warmup"]["prefix_hits"] == 0
        for run_ in arm["runs"]:
            assert run_["engine"]["prefix_queries"] == 120 and run_["engine"]["prefix_hits"] == 0
            assert run_["notes"]["cold_prefix_cache"] is True


def test_the_peak_kv_blocks_count_requests_that_finish_in_the_step(tiny_model, tmp_path):
    """4 requests of 16 prompt and 2 output tokens in blocks of 16: each holds a second block (token 17's KV) in
    the step that ends it, so the peak is 8 blocks, not the 4 left after the first step."""
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "--block-size", "16", "bench", "--num-requests", "4",
                 "--input-len", "16", "--output-len", "2", "--len-sigma", "0", "--repeats", "1",
                 "--warmup-rounds", "0", "--out", str(out))
    assert result.exit_code == 0, result.output
    [arm] = json.loads((out / "results.json").read_text())["arms"]
    assert arm["runs"][0]["metrics"]["kv_peak_blocks"] == 4 * -(-(16 + 2 - 1) // 16) == 8


def test_evictions_and_the_long_prompts_ttft_are_reported(tiny_model, tmp_path):
    """A pool too small for the run's prompts evicts cached blocks; long-prompt-arrival times its long prompt."""
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "long-prompt-arrival",
                 "--num-requests", "6", "--input-len", "40", "--output-len", "4", "--len-sigma", "0", "--long-len",
                 "120", "--long-delay", "0", "--ab", "--num-kv-blocks 10", "--repeats", "1", "--warmup-rounds", "0",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "KV evictions" in result.output and "long prompt TTFT" in result.output
    again = run("--model", str(tiny_model), "bench", "--num-requests", "1", "--out", str(out))
    assert again.exit_code == 2 and "holds an earlier run's results.json, table.txt" in again.output  # not lost
    [arm] = json.loads((out / "results.json").read_text())["arms"]
    [run_] = arm["runs"]
    assert run_["metrics"]["evictions"] == run_["engine"]["evictions"] > 0
    long_request = next(r for r in run_["requests"] if r["prompt_tokens"] == 120)
    ttft_ms = 1000 * (long_request["token_times_s"][0] - long_request["arrival_s"])
    assert run_["metrics"]["long_ttft_ms"] == pytest.approx(ttft_ms)


def test_the_literal_acceptance_command(tiny_model, tmp_path):
    """The issue's command with the default workload sizes (32 conversations of 4 turns). (Its run time on CPU is a
    performance figure: measured by hand, never asserted in a test.)"""
    result = run("--model", str(tiny_model), "bench", "--workload", "multi-turn", "--ab", "--kv-cache paged",
                 "--kv-cache radix-cache", "--repeats", "2", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(run_["metrics"]["prefix_hit_rate"] > 0 for arm in data["arms"] for run_ in arm["runs"])


# ---------------------------------------------------------------- the benchmark scripts gpu_check.sh runs
def bench_script(*args: str, timeout: float = 240) -> str:
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / args[0]
    done = subprocess.run([sys.executable, str(script), *args[1:]], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_throughput_script_reports_infer_before_and_without_hf(tmp_path):
    """The smoke preset end to end without HF: the table and the summary file hold infer's figures."""
    out = bench_script("throughput.py", "--preset", "smoke", "--hf=", "--out", str(tmp_path / "out"),
                       "--model-dir", str(tmp_path / "model"), "--extra-arm=--async-scheduling")
    summary = json.loads((tmp_path / "out" / "anchor_summary.json").read_text())
    requests = [json.loads(line) for line in (tmp_path / "out" / "anchor.jsonl").read_text().splitlines()]
    prompt_tokens, output_tokens = sum(len(r["prompt"]) for r in requests), sum(r["max_tokens"] for r in requests)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (prompt_tokens, output_tokens)  # the file it ran
    assert summary["anchor_infer_tps"] > 0 and summary["single_infer_tps"] > 0
    assert list(summary["extra_arms_tps"]) == ["--async-scheduling"]
    table = out[out.rindex(f"smoke: {prompt_tokens} prompt / {output_tokens} output tokens"):].splitlines()
    assert [line.split("  ")[0] for line in table[2:]] == [
        "infer", "infer --async-scheduling", "infer single stream", "infer single stream --async-scheduling"]
    assert list(summary["single_extra_arms_tps"]) == ["--async-scheduling"]
    assert not (tmp_path / "model.partial").exists() and list((tmp_path / "model").glob("*.safetensors"))


@pytest.mark.slow  # about 50 s on CI's 2 cores: four smoke runs of the anchor script
def test_throughput_script_adds_hf_baselines_to_an_earlier_runs_infer_figures(tmp_path):
    """gpu_check.sh's stages: infer and HF continuous batching first; later, with --reuse-infer, HF static and HF
    single stream beside the same infer figures, each HF arm in its own process."""
    args = ["--preset", "smoke", "--out", str(tmp_path / "out"), "--model-dir", str(tmp_path / "model")]
    bench_script("throughput.py", *args, "--hf", "cb")
    first = json.loads((tmp_path / "out" / "anchor_summary.json").read_text())
    assert first["anchor_infer_tps"] > 0 and first["anchor_hf_cb_tps"] > 0 and "anchor_hf_static_tps" not in first
    out = bench_script("throughput.py", *args, "--reuse-infer", "--hf", "static,single")
    summary = json.loads((tmp_path / "out" / "anchor_summary.json").read_text())
    assert {k: summary[k] for k in first} == first  # infer's figures were not measured again
    assert all(summary[key] > 0 for key in ("anchor_hf_static_tps", "single_hf_tps"))
    table = out[out.rindex("smoke: "):].splitlines()
    assert [line.split("  ")[0] for line in table[2:]] == [
        "infer", "HF generate static, batch 32", "HF continuous batching", "infer single stream", "HF single stream"]


def test_prepare_bench_script_runs():
    out = bench_script("prepare_bench.py", "--context", "40", "--iterations", "3")
    assert "prepare, 128 decodes," in out and "us per sequence (backend planning excluded)" in out


def test_emit_bench_script_runs():
    assert "us per output token (128 requests" in bench_script("emit_bench.py", "--iterations", "3")


def test_spec_bench_script_runs_and_keeps_the_tokens():
    out = bench_script("spec_bench.py", "--ks", "2", "--repeats", "1", "--max-tokens", "12")
    rows = [line for line in out.splitlines() if line.startswith("| draft-model K=2")]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].strip(" |").split("|")]
    assert cells[9] == "true"  # the speculative arm's tokens equal the peer's
    record = json.loads(out.strip().splitlines()[-1])
    alpha, c = record["arms"][1]["alpha"], record["c"]
    assert 0 < c < 1 and cells[3] == f"{(1 - alpha**3) / (1 - alpha) / (2 * c + 1):.2f}x"  # Leviathan's eq. 2


def test_lora_bench_script_measures_every_arm():
    out = bench_script("lora_bench.py", "--adapters", "2", "--rank", "2", "--requests", "2", "--prompt-len", "8",
                       "--max-tokens", "3", "--rounds", "1")
    arms = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert arms[1:] == ["base", "loaded, unused", "1 adapter", "2 loaded, 1 in use", "2 adapters",
                        "1 of 2 slots, loaded at run time", "HF generate, base", "HF generate, PEFT adapter"]


def test_profile_steps_script_profiles_each_scenario(tmp_path):
    """gpu_check.sh's profile stage on the CPU: the extend scenario's prompt finds its prefix cached and the fresh
    prefill's does not; each decode window is --steps steps long; a Chrome trace per scenario."""
    out = bench_script("profile_steps.py", "--preset", "smoke", "--model-dir", str(tmp_path / "model"),
                       "--decode-batches", "1", "4", "--steps", "3", "--prefix-len", "48", "--question-len", "16",
                       "--out", str(tmp_path / "traces"))
    rows = {json.loads(line.split(": ", 1)[1])["scenario"]: json.loads(line.split(": ", 1)[1])
            for line in out.splitlines() if line.startswith("== ")}
    assert list(rows) == ["prefill", "extend", "decode-1", "decode-4"]
    assert (rows["prefill"]["cached_tokens"], rows["extend"]["cached_tokens"]) == (0, 48)  # 3 full blocks of 16
    assert rows["decode-1"]["steps"] == rows["decode-4"]["steps"] == 3
    assert all(row["host_ms"] > 0 and row["device_ms"] is None for row in rows.values())  # no CUDA here
    table = out[out.rindex("| scenario |"):].splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == list(rows)
    for name in rows:
        assert json.loads((tmp_path / "traces" / f"{name}.trace.json").read_text())["traceEvents"]


def test_beam_beside_script_finds_the_same_outputs_in_every_arm():
    """benchmarks/beam_beside.py at a small size: its own checks (requests' tokens as alone, beams as a search run
    alone) pass in every arm, and the tight pool makes the searches wait for blocks."""
    out = bench_script("beam_beside.py", "--requests", "3", "--output-len", "12", "--prompt-len", "16",
                       "--beam-tokens", "6", "--tight-blocks", "10", "--start-step", "2", "--rounds", "1")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-4:-1]}
    assert list(rows) == ["alone", "beside", "tight"] and int(rows["tight"][5]) > 0  # waits
    assert out.splitlines()[-1].startswith("outputs: every arm's request tokens equal the alone arm's")


def test_requests_run_on_the_lora_adapters_their_lines_name(tiny_model, tmp_path, hf_greedy):
    """A file line's ``lora_adapter`` reaches the engine: that request's tokens are PEFT's greedy ones on the
    adapter, the others' the base model's, in every arm and round; an arm that lacks the adapter, an HF arm, and
    --lora-adapter beside a file are refused before any model loads."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "sql"))

    def peft_greedy(prompt: list[int], steps: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(steps):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        return ids[0, len(prompt):].tolist()

    lines = [([5, 6, 7, 8, 9], "sql"), ([40, 41, 42], None), ([40, 41, 42], "sql")]
    expected = [peft_greedy(p, 6) if name else hf_greedy(tiny_model, p, 6) for p, name in lines]
    assert expected[1] != expected[2]  # the adapter changes the tokens
    path, out = tmp_path / "w.jsonl", tmp_path / "out"
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6, **({"lora_adapter": name} if name else {})})
                            + "\n" for p, name in lines))
    group = ["--model", str(tiny_model), "--device", "cpu"]
    bench = ["bench", "--workload", "file", "--file", str(path), "--repeats", "2", "--warmup-rounds", "0"]
    result = run(*group, "--lora", f"sql={tmp_path / 'sql'}", *bench, "--ab", "", "--no-prefix-caching",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    for arm in json.loads((out / "results.json").read_text())["arms"]:
        for run_ in arm["runs"]:
            assert [r["output_ids"] for r in sorted(run_["requests"], key=lambda r: r["session"])] == expected

    refused = run(*group, *bench)
    assert refused.exit_code == 2 and "arm A: (group options) cannot serve LoRA adapter(s) sql" in refused.output
    assert "it loads none" in refused.output and "building arm" not in refused.output
    refused = run(*group, "--lora", f"sql={tmp_path / 'sql'}", *bench, "--ab", "", "hf")
    assert refused.exit_code == 2 and "the HF baseline (hf) serves no LoRA adapters" in refused.output
    refused = run(*group, "--lora", f"sql={tmp_path / 'sql'}", *bench, "--lora-adapter", "sql")
    assert refused.exit_code == 2 and "a --workload file names each line's own" in refused.output


def test_structured_lines_end_whole_and_compare_backends_and_proposers(tiny_model, tmp_path):
    """A file line's structured_output, or its chat's forced tool_choice, makes its output a whole match that ends
    at EOS (the reference: the decoded text against Python's re, the choices, the schema), while plain lines still
    run to max_tokens; an arm drafting the grammar's forced text (jump-forward) is exact, so its outputs match the
    first arm's, and it drafted. Refused: the HF baseline, --min-tokens, a structured_output that is not one of its
    fields (a bad line, before any model loads), and a spec an arm cannot follow (a bad line naming the arm)."""
    import re

    from infer import LLM

    template = tmp_path / "chat.jinja"
    template.write_text("{% if tools %}<|system|>{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                        "<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}<|assistant|>\n")
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    tool = {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["on", "off"]}}, "required": ["x"]}}}
    lines = [{"prompt": "def f(x):", "max_tokens": 5},
             {"prompt": "data = ", "max_tokens": 40, "structured_output": {"json_schema": schema}},
             {"prompt": "x = ", "max_tokens": 40, "structured_output": {"regex": "[a-c]{3}"}},
             {"prompt": "ok = ", "max_tokens": 40, "structured_output": {"choice": ["yes", "no"]}},
             {"messages": [{"role": "user", "content": "Switch it"}], "tools": [tool], "max_tokens": 40,
              "tool_choice": {"type": "function", "function": {"name": "run"}}, "structured_output": None}]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    base = ["--model", str(tiny_model), "--device", "cpu", "--num-kv-blocks", "64", "--chat-template", str(template),
            "bench", "--workload", "file", "--file", str(path), "--repeats", "1", "--warmup-rounds", "0"]
    result = run(*base, "--ab", "", "--proposer jump-forward --num-speculative-tokens 4", "--out", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    tokenizer = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=8).engine.tokenizer
    for arm in data["arms"]:
        requests = sorted(arm["runs"][0]["requests"], key=lambda r: r["session"])
        plain, json_reply, regex_reply, choice_reply, call = (
            tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in requests)
        assert len(requests[0]["output_ids"]) == 5
        assert re.fullmatch(r'\{"a": ?[0-9]\}', json_reply) and 0 <= json.loads(json_reply)["a"] <= 9
        assert re.fullmatch("[a-c]{3}", regex_reply) and choice_reply in ("yes", "no")
        assert json.loads(call) in ({"x": "on"}, {"x": "off"})
        assert all(r["output_ids"][-1] in tokenizer.all_special_ids for r in requests[1:])  # ended at EOS
    assert data["arms"][1]["summary"]["outputs_match"]["values"] == [1.0]
    assert data["arms"][1]["runs"][0]["engine"]["spec_proposed"] > 0
    steps = [arm["runs"][0]["metrics"]["engine_steps"] for arm in data["arms"]]
    assert steps == [arm["runs"][0]["notes"]["steps"] for arm in data["arms"]] and steps[1] < steps[0]
    assert "engine steps" in result.output

    hf = run(*base, "--ab", "", "hf")
    assert hf.exit_code == 2 and "HF transformers (hf) has no structured output" in hf.output, hf.output
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({**lines[4], "structured_output": {"regex": "a"}}) + "\n")
    assert parse_workload_file(both)[1] == ["line 1: tool_choice 'run' makes the reply structured output of its own, "
                                            "so it cannot take the request's structured_output; drop one of them"]
    floor = run(*base, "--min-tokens", "2", "--ab", "")
    assert floor.exit_code == 2 and "line 2:" in floor.output and "min_tokens" in floor.output, floor.output
    path.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "n = ", "max_tokens": 8, "structured_output": {"json_schema": {"type": "integer", "multipleOf": 2}}},
        {"prompt": "m", "max_tokens": 8, "structured_output": {"ebnf": "x"}},
        {"prompt": "k = ", "max_tokens": 8, "structured_output": {"regex": "[0-9]+"}})) + "\n")
    bad = run(*base, "--ab", "")
    assert bad.exit_code == 2 and "line 2: 'structured_output' must be an object of one of regex, choice, " \
        "json_schema, grammar" in bad.output, bad.output
    skipped = run(*base, "--skip-bad-lines", "--ab", "")
    assert skipped.exit_code == 0, skipped.output
    assert "skipped" in skipped.output and "line 1: arm A ('') cannot follow its structured output" in \
        skipped.output and "multipleOf" in skipped.output, skipped.output


def test_a_share_below_one_never_shows_as_a_hundred_percent() -> None:
    """"outputs = first arm" of 1999 of 2000 requests rounded to "100.0%" (unstarred: a difference nobody saw)."""
    from infer.bench.report import _number

    assert _number(1999 / 2000, "%") == "99.95%" and _number(0.99999, "%") == "99.99%"
    assert _number(1.0, "%") == "100.0%" and _number(0.5, "%") == "50.0%" and _number(0.004, "%") == "0.40%"


def test_a_prompt_over_an_arms_step_budget_is_refused_before_any_run(tiny_model):
    """It failed the arm while warming up (exit 1), after the other arms had loaded and warmed up."""
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "long-prompt-arrival",
                 "--long-len", "200", "--num-requests", "2", "--output-len", "2", "--repeats", "1",
                 "--ab", "", "--max-num-batched-tokens 64")
    assert result.exit_code == 2, result.output
    assert "longest prompt (200 tokens) does not fit arm B ('--max-num-batched-tokens 64')" in result.output
    assert "exceeds max-num-batched-tokens 64" in result.output and "warming up" not in result.output


def test_a_run_stopped_early_says_its_rounds_did_not_rotate_evenly():
    """3 of 4 rounds kept (a failure, Ctrl-C): arm A led two of them, which the table did not say."""
    from infer.bench.arms import ArmSpec
    from infer.bench.report import BenchResult, build_table

    record = RequestRecord(0, 0, 0.0, 10, 3, [0.1, 0.2, 0.3], 0.3)
    runs = {key: [RunResult(key, r, 1.0, [record]) for r in range(3)] for key in "AB"}
    orders = [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    stopped = BenchResult([ArmSpec("A", ""), ArmSpec("B", "")], runs, {"workload": {}, "round_orders": orders})
    assert "stopped after 3 of 4 rounds, so the arms did not run first equally often (rounds led: A 2, B 1)" in \
        str(build_table(stopped).caption)
    whole = BenchResult([ArmSpec("A", ""), ArmSpec("B", "")], runs, {"workload": {}, "round_orders": orders[:3]})
    assert "stopped after" not in str(build_table(whole).caption)
    even = {key: results[:2] for key, results in runs.items()}  # 2 of 4 kept: each arm led one, as rotation wants
    stopped_evenly = BenchResult([ArmSpec("A", ""), ArmSpec("B", "")], even, {"workload": {}, "round_orders": orders})
    assert "did not run first equally often" not in str(build_table(stopped_evenly).caption)


def test_moe_bench_agrees_with_hfs_experts_before_timing():
    """benchmarks/moe_bench.py on the CPU (the Triton interpreter): the Triton experts and the torch loop give HF's
    experts module's output (float32) on the case it times, and the AWQ ones int4's error, both alike."""
    rows = [json.loads(line) for line in bench_script("moe_bench.py", "--device", "cpu", "--tokens", "3", "--iters",
                                                      "1").splitlines() if line.startswith("{")]
    assert [(r["shape"], r["tokens"]) for r in rows] == [("cpu-smoke", 3)]
    assert rows[0]["rel_err_vs_hf"]["triton"] < 1e-5 and rows[0]["rel_err_vs_hf"]["torch_loop"] < 1e-6
    # int4's error (RTN at group 32: ~9% a weight, three projections deep), not a broken layer's (~1)
    assert 1e-3 < rows[0]["rel_err_vs_hf"]["awq_loop"] < 0.3
    assert abs(rows[0]["rel_err_vs_hf"]["awq_triton"] - rows[0]["rel_err_vs_hf"]["awq_loop"]) < 1e-5


def test_workload_lines_give_priorities_and_the_top_prioritys_ttft_is_reported(tiny_model, tmp_path):
    """One seat: under --scheduling-policy priority the priority-2 lines run first, so they finish before every
    other line (fcfs: in file order); the top-priority TTFT rows are those requests' TTFT percentiles, and the
    lowest priority's longest TTFT is reported."""
    path = tmp_path / "w.jsonl"
    priorities = [0, 0, 2, 1, 2, 0]
    path.write_text("".join(json.dumps({"prompt": [10 + i, 11, 12], "max_tokens": 3, "priority": p}) + "\n"
                            for i, p in enumerate(priorities)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [5], "max_tokens": 1, "priority": 1.5}\n{"prompt": [5], "max_tokens": 1, '
                   '"priority": true}\n{"prompt": [5], "max_tokens": 1, "priority": 2147483648}\n'
                   '{"prompt": [5], "max_tokens": 1, "priority": -7}\n')
    entries, errors = parse_workload_file(bad)
    assert [e.priority for e in entries] == [-7] and len(errors) == 3
    assert all(e.split(": ", 1)[1].startswith("priority must be an integer in (-2**31, 2**31)") for e in errors)
    out = tmp_path / "out"
    result = run("--model", str(tiny_model), "--device", "cpu", "--max-num-seqs", "1", "bench", "--workload",
                 "file", "--file", str(path), "--ab", "--scheduling-policy fcfs", "--scheduling-policy priority",
                 "--repeats", "1", "--warmup-rounds", "0", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "TTFT p50, top priority" in result.output and "TTFT p99, top priority" in result.output
    assert "TTFT max, lowest priority" in result.output
    fcfs, by_priority = (arm["runs"][0] for arm in json.loads((out / "results.json").read_text())["arms"])
    for run_ in (fcfs, by_priority):
        assert [r["priority"] for r in run_["requests"]] == priorities
        top = [r["token_times_s"][0] - r["arrival_s"] for r in run_["requests"] if r["priority"] == 2]
        assert run_["metrics"]["top_priority_ttft_p50_ms"] == pytest.approx(1000 * statistics.median(top))
        assert run_["metrics"]["top_priority_ttft_p99_ms"] == pytest.approx(
            1000 * statistics.quantiles(top, n=100, method="inclusive")[98])
        bottom = [r["token_times_s"][0] - r["arrival_s"] for r in run_["requests"] if r["priority"] == 0]
        assert run_["metrics"]["bottom_priority_ttft_max_ms"] == pytest.approx(1000 * max(bottom))
    finish_order = [r["priority"] for r in sorted(by_priority["requests"], key=lambda r: r["finish_s"])]
    assert finish_order == [2, 2, 1, 0, 0, 0]
    assert [r["session"] for r in sorted(fcfs["requests"], key=lambda r: r["finish_s"])] == list(range(6))


def test_policy_workload_script_writes_a_seeded_file_the_bench_reads(tmp_path):
    first, again, grouped = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "g.jsonl"
    out = bench_script("policy_workload.py", str(first), "--num-requests", "400", "--top-share", "0.25")
    bench_script("policy_workload.py", str(again), "--num-requests", "400", "--top-share", "0.25")
    entries, errors = parse_workload_file(first)
    top = sum(e.priority for e in entries)
    assert not errors and len(entries) == 400 and {e.priority for e in entries} == {0, 1}
    assert f"400 requests, {top} of priority 1" in out and 70 <= top <= 130  # binomial(400, 0.25): mean 100, sd 8.7
    assert first.read_text() == again.read_text()
    assert statistics.mean(len(e.prompt) for e in entries) == pytest.approx(64, rel=0.1)
    assert all(3 <= t < 259 for e in entries for t in e.prompt)
    bench_script("policy_workload.py", str(grouped), "--num-requests", "40", "--prefix-groups", "3",
                 "--prefix-len", "20")
    prompts = [e.prompt for e in parse_workload_file(grouped)[0]]
    assert len({p[:20] for p in prompts}) == 3 and all(len(p) > 20 for p in prompts)
