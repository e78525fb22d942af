"""What one run records, the metrics derived from it, and their aggregation over repeats.

Times are seconds from the start of the run. A metric that does not apply to an arm (the HF baseline has no
prefix cache; an engine without a proposer has no acceptance rate) is None, shown as "n/a". Generation and
embedding requests each have their own rows, over their own requests: TTFT, TPOT and ITL are generation's, and an
embedding request's latency is its arrival to its embedding.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the client saw it: arrival, the time of every output token, and the finish."""

    session: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    token_times_s: list[float]
    finish_s: float
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache (None: unknown)
    output_ids: list[int] = field(default_factory=list)  # compared across arms: faster must not mean different
    priority: int = 0  # SamplingParams.priority (the file workload's lines may give it)
    embed: bool = False  # an embedding request: no output token, its ``embedding`` instead
    embedding: list[float] | None = None  # compared across arms (not written to the JSON)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between deliveries: tokens that arrive together (accepted drafts of one speculative step share
        a timestamp) make one delivery, not gaps of 0."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:]) if b > a]

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass
class EngineCounters:
    """Engine-side metrics of one run, read from the engine's own stats (differences over the run)."""

    kv_total_blocks: int
    kv_peak_used_blocks: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    evictions: int  # cached blocks the KV cache dropped to make room (prefix-cache pressure)
    spec_proposed: int
    spec_accepted: int
    speculative: bool  # a proposer is configured, so the acceptance rate applies


@dataclass
class RunResult:
    arm: str  # the arm key: A, B, ...
    round: int
    duration_s: float
    requests: list[RequestRecord]
    engine: EngineCounters | None = None  # None for the HF baseline
    notes: dict[str, Any] = field(default_factory=dict)
    long_session: int | None = None  # long-prompt-arrival: the session of the long prompt (its TTFT is a metric)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for request in data["requests"]:
            del request["embedding"]  # a vector per request would swamp the file: the summary compares them
        data["metrics"] = run_metrics(self)  # outputs_match compares arms: only the summary holds it
        return data


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    unit: str  # "" (a rate), "ms", "%" (a fraction, shown in percent), "count" or "abs" (a small difference)
    higher_is_better: bool
    has_ratio: bool = True  # False: a comparison with the first arm already, not divided by its value


METRICS: tuple[Metric, ...] = (
    Metric("requests_per_s", "requests/s", "", True),
    Metric("output_tokens_per_s", "output tok/s", "", True),
    Metric("embeddings_per_s", "embeddings/s", "", True),
    Metric("embed_prompt_tokens_per_s", "embedding prompt tok/s", "", True),
    Metric("ttft_p50_ms", "TTFT p50", "ms", False),
    Metric("ttft_p99_ms", "TTFT p99", "ms", False),
    Metric("long_ttft_ms", "long prompt TTFT", "ms", False),
    Metric("top_priority_ttft_p50_ms", "TTFT p50, top priority", "ms", False),
    Metric("top_priority_ttft_p99_ms", "TTFT p99, top priority", "ms", False),
    Metric("bottom_priority_ttft_max_ms", "TTFT max, lowest priority", "ms", False),
    Metric("tpot_p50_ms", "TPOT p50", "ms", False),
    Metric("tpot_p99_ms", "TPOT p99", "ms", False),
    Metric("itl_p50_ms", "ITL p50", "ms", False),
    Metric("itl_p99_ms", "ITL p99", "ms", False),
    Metric("e2e_p50_ms", "end-to-end p50", "ms", False),
    Metric("e2e_p99_ms", "end-to-end p99", "ms", False),
    Metric("embed_latency_p50_ms", "embedding latency p50", "ms", False),
    Metric("embed_latency_p99_ms", "embedding latency p99", "ms", False),
    Metric("kv_peak_blocks", "peak KV blocks", "count", False),
    Metric("kv_peak_usage", "peak KV usage", "%", False),
    Metric("prefix_hit_rate", "prefix hit rate", "%", True),
    Metric("acceptance_rate", "acceptance rate", "%", True),
    Metric("preemptions", "preemptions", "count", False),
    Metric("evictions", "KV evictions", "count", False),
    Metric("engine_steps", "engine steps", "count", False),
    Metric("outputs_match", "outputs = first arm", "%", True),
    Metric("embeddings_max_diff", "embedding max |diff| from first arm", "abs", False, has_ratio=False),
)

# Student's t: the two-sided 95% critical value for 1..30 degrees of freedom (any statistics table); beyond 30,
# 1.96 + 2.5/df is within 0.002 of the exact value.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else 1.96 + 2.5 / df


def ratio_ci95(ratios: list[float]) -> tuple[float, float] | None:
    """The 95% confidence interval of the geometric mean of paired ratios (a paired t interval on their logs);
    None with fewer than two ratios or a ratio that is not positive and finite."""
    if len(ratios) < 2 or not all(0 < r < math.inf for r in ratios):
        return None
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def difference_ci95(differences: list[float]) -> tuple[float, float] | None:
    """The 95% confidence interval of the mean of paired differences (a paired t interval); None with fewer than
    two differences."""
    if len(differences) < 2:
        return None
    mean = statistics.fmean(differences)
    half = t95(len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean - half, mean + half


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else 1000 * value


def run_metrics(run: RunResult) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` for one run, but those that compare arms (:func:`summarize`): the rates over
    the run's wall time, generation's over its generation requests and embedding's over its embedding requests (a
    kind the run has none of is None)."""
    reqs = [r for r in run.requests if not r.embed]
    embeds = [r for r in run.requests if r.embed]
    ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
    tpot = [r.tpot_s for r in reqs if r.tpot_s is not None]
    itl = [gap for r in reqs for gap in r.itl_s]
    e2e = [r.e2e_s for r in reqs]
    timed = run.duration_s > 0
    generates = timed and (bool(reqs) or not embeds)  # a run of no request at all still shows 0 requests/s
    out: dict[str, float | None] = {
        "requests_per_s": len(reqs) / run.duration_s if generates else None,
        "output_tokens_per_s": sum(r.output_tokens for r in reqs) / run.duration_s if generates else None,
        "embeddings_per_s": len(embeds) / run.duration_s if timed and embeds else None,
        "embed_prompt_tokens_per_s": sum(r.prompt_tokens for r in embeds) / run.duration_s if timed and embeds
        else None,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e),
                         ("embed_latency", [r.e2e_s for r in embeds])):
        out[f"{name}_p50_ms"] = _ms(percentile(values, 50))
        out[f"{name}_p99_ms"] = _ms(percentile(values, 99))
    long = [r.ttft_s for r in reqs if r.session == run.long_session and r.ttft_s is not None]
    out["long_ttft_ms"] = _ms(long[0]) if long else None
    top = max((r.priority for r in reqs), default=0)  # n/a unless the requests' priorities differ
    first = [r.ttft_s for r in reqs if r.priority == top and r.ttft_s is not None] \
        if any(r.priority != top for r in reqs) else []
    out["top_priority_ttft_p50_ms"] = _ms(percentile(first, 50))
    out["top_priority_ttft_p99_ms"] = _ms(percentile(first, 99))
    bottom = min((r.priority for r in reqs), default=0)  # the longest wait of the least important: starvation
    last = [r.ttft_s for r in reqs if r.priority == bottom and r.ttft_s is not None] if bottom != top else []
    out["bottom_priority_ttft_max_ms"] = _ms(max(last)) if last else None
    eng = run.engine
    if eng is None:
        out.update(dict.fromkeys(("kv_peak_blocks", "kv_peak_usage", "prefix_hit_rate", "acceptance_rate",
                                  "preemptions", "evictions", "engine_steps")))
    else:
        out["kv_peak_blocks"] = float(eng.kv_peak_used_blocks)
        out["kv_peak_usage"] = eng.kv_peak_used_blocks / eng.kv_total_blocks if eng.kv_total_blocks else None
        out["prefix_hit_rate"] = eng.prefix_hits / eng.prefix_queries if eng.prefix_queries else 0.0
        out["acceptance_rate"] = eng.spec_accepted / eng.spec_proposed if eng.speculative and eng.spec_proposed \
            else None  # no drafts: n/a, not "every draft rejected"
        out["preemptions"] = float(eng.preemptions)
        out["evictions"] = float(eng.evictions)
        steps = run.notes.get("steps")  # what a step's fixed cost multiplies: fewer with speculation
        out["engine_steps"] = float(steps) if steps is not None else None
    return out


def outputs_match(run: RunResult, reference: RunResult) -> float | None:
    """The fraction of ``run``'s generation requests whose output tokens equal the reference run's for the same
    turn."""
    expected = {(r.session, r.turn): r.output_ids for r in reference.requests}
    generated = [r for r in run.requests if not r.embed]
    if not generated:
        return None
    return sum(expected.get((r.session, r.turn)) == r.output_ids for r in generated) / len(generated)


def embeddings_max_diff(run: RunResult, reference: RunResult) -> float | None:
    """The largest absolute difference between a value of one of ``run``'s embeddings and the same value of the
    reference run's embedding of the same request (inf where their lengths differ); None without any pair."""
    expected = {(r.session, r.turn): r.embedding for r in reference.requests if r.embedding is not None}
    pairs = [(r.embedding, expected[(r.session, r.turn)]) for r in run.requests
             if r.embedding is not None and (r.session, r.turn) in expected]
    if not pairs:
        return None
    return max(max((abs(a - b) for a, b in zip(mine, theirs)), default=0.0) if len(mine) == len(theirs) else math.inf
               for mine, theirs in pairs)


@dataclass
class Aggregate:
    """One metric of one arm over its repeats: the values, their median, the ratio of that median to the first
    arm's, and the paired ratios (each round's value over the first arm's in the same round: rounds interleave
    the arms, so a pair shares the machine's state) with their 95% confidence interval."""

    values: list[float]
    median: float | None
    ratio: float | None = None
    paired_ratios: list[float] = field(default_factory=list)
    paired_differences: list[float] = field(default_factory=list)  # each round's value minus the first arm's

    @property
    def ci95(self) -> tuple[float, float] | None:
        return ratio_ci95(self.paired_ratios)

    @property
    def within_noise(self) -> bool:
        """The rounds do not show a difference from the first arm: the 95% interval of the paired ratios holds 1;
        where some round has no ratio (the first arm's value is 0, as a baseline's prefix hit rate or preemptions
        are) or one is 0, the 95% interval of the paired differences holds 0. One round shows nothing."""
        pairs = max(len(self.paired_ratios), len(self.paired_differences))
        if pairs < 2:
            return True
        ci = self.ci95 if len(self.paired_ratios) == pairs else None
        if ci is not None:
            return ci[0] <= 1 <= ci[1]
        diff = difference_ci95(self.paired_differences)  # summarize pairs every round: never None here
        return diff is None or diff[0] <= 0 <= diff[1]

    @property
    def low(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def high(self) -> float | None:
        return max(self.values) if self.values else None


def aggregate(values: list[float | None]) -> Aggregate:
    present = [v for v in values if v is not None]
    if not present:
        return Aggregate([], None)
    return Aggregate(present, statistics.median(present))


def summarize(runs_by_arm: dict[str, list[RunResult]], output_comparable: set[str] | None = None
              ) -> dict[str, dict[str, Aggregate]]:
    """arm -> metric -> Aggregate, with ratios against the first arm (in the given order). Outputs are compared
    with the first arm's for the arms in ``output_comparable`` (default: every arm); embeddings, which sample
    nothing, for every arm."""
    per_run = {arm: [run_metrics(r) for r in runs] for arm, runs in runs_by_arm.items()}
    first_runs = next(iter(runs_by_arm.values()), [])
    for arm, runs in runs_by_arm.items():
        for metrics, run, reference in zip(per_run[arm], runs, first_runs):
            metrics["embeddings_max_diff"] = embeddings_max_diff(run, reference)
            if output_comparable is None or arm in output_comparable:
                metrics["outputs_match"] = outputs_match(run, reference)
    table = {arm: {m.key: aggregate([values.get(m.key) for values in runs]) for m in METRICS}
             for arm, runs in per_run.items()}
    first_key = next(iter(table), None)
    for arm, metrics in table.items():
        for key, agg in metrics.items():
            base = table[first_key][key].median if first_key is not None else None
            if agg.median is not None and base:
                agg.ratio = agg.median / base
            pairs = zip(per_run[arm], per_run[first_key]) if first_key is not None else ()
            both = [(own[key], ref[key]) for own, ref in pairs if own.get(key) is not None and ref.get(key) is not None]
            agg.paired_ratios = [a / b for a, b in both if b]
            agg.paired_differences = [a - b for a, b in both]
    return table
