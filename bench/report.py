"""Reports of an A/B run: the side-by-side rich table, the JSON file, and the PNG plots (matplotlib, Agg)."""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..cli.options import SAMPLING_DEFAULTS
from .arms import ArmSpec
from .stats import METRICS, Aggregate, Metric, RunResult, summarize
from .workloads import RequestSampling


@dataclass
class BenchResult:
    """Everything one ``infer bench`` invocation measured."""

    arms: list[ArmSpec]
    runs: dict[str, list[RunResult]]  # arm key -> runs in round order
    meta: dict[str, Any]
    arm_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # arm key -> config, warm-up counters, ...
    sampling: RequestSampling = field(default_factory=RequestSampling)

    def summary(self) -> dict[str, dict[str, Aggregate]]:
        return summarize({arm.key: self.runs[arm.key] for arm in self.arms}, self.output_comparable())

    def output_comparable(self) -> set[str]:
        """The arms whose outputs can be compared with the first arm's: all when greedy; when sampled, the engine
        arms that speculate as the first does (the same seeded streams, drawn the same way: rejection sampling
        draws differently from plain sampling) if requests are seeded, else none (HF arms and servers draw from
        their own streams)."""
        if self.sampling.greedy:
            return {arm.key for arm in self.arms}
        if self.sampling.seed is None or not self.arms or not self.arms[0].is_engine:
            return set()
        first = self.speculation(self.arms[0].key)
        return {arm.key for arm in self.arms if arm.is_engine and self.speculation(arm.key) == first}

    def speculation(self, key: str) -> tuple[Any, ...]:
        """How an engine arm speculates (its proposer, K, draft and policy options): what changes its draws."""
        config = self.arm_info.get(key, {}).get("config", {}).get("config", {})
        if not config.get("proposer"):
            return ()
        return (config["proposer"], config.get("num_speculative_tokens"), config.get("draft_model"),
                repr(config.get("plugin_options", {}).get("spec_decode")))


def _number(value: float, unit: str) -> str:
    if unit == "%":
        percent = 100 * value
        shown = f"{percent:.2f}%" if 0 < abs(percent) < 1 else f"{percent:.1f}%"
        # 99.96% rounds to "100.0%", which reads as every one (an output that differs, in "outputs = first arm")
        return f"{math.floor(percent * 100) / 100:.2f}%" if shown == "100.0%" and percent < 100 else shown
    if unit == "abs":
        return f"{value:.1e}"
    if unit == "count" and float(value).is_integer():
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def format_cell(metric: Metric, agg: Aggregate, first: bool, repeats: int) -> str:
    """``median [min-max] ×ratio``, the ratio starred when the rounds do not show a difference (its paired
    ratios' 95% interval holds 1); "n/a" when the arm does not measure the metric."""
    if agg.median is None:
        return "n/a"
    text = _number(agg.median, metric.unit)
    if repeats > 1 and agg.low is not None and agg.high is not None and agg.low != agg.high:
        text += f" [{_number(agg.low, metric.unit)}–{_number(agg.high, metric.unit)}]"
    if not first and metric.has_ratio:
        text += f" ×{agg.ratio:.2f}" if agg.ratio is not None else " ×—"
        if agg.within_noise:
            text += "*"
    return text


def build_table(result: BenchResult) -> Table:
    summary = result.summary()
    repeats = max((len(r) for r in result.runs.values()), default=0)
    workload = result.meta.get("workload", {}).get("name", "?")
    first = result.arms[0].key
    requests = {len(run.requests) for runs in result.runs.values() for run in runs}
    compared = len(result.arms) > 1  # one arm: no ratios, no comparison of outputs
    ratio = f"×: ratio to arm {first}'s median; " if compared else ""
    notes = [f"median \\[min–max] over rounds; {ratio}↑ higher is better, ↓ lower is better; n/a: the arm does not "
             "measure it",
             *(["*: within noise: the 95% interval of the paired per-round ratios (a t interval on their logs) holds "
                f"1 (where arm {first}'s value is 0: that of the paired differences holds 0). Each cell is tested on "
                "its own at 5%, so a table of many cells shows some differences by chance: trust the ones that repeat "
                "across runs"] if compared else []),
             f"{'/'.join(map(str, sorted(requests)))} requests per run (a p99 of fewer than 100 is nearly their "
             "maximum)"]
    if note := sampling_note(result):
        notes.append(note)
    if any(_long_prompt_came_late(run) for runs in result.runs.values() for run in runs):
        notes.append("[yellow]the long prompt arrived after every steady decode had finished, so it delayed none: "
                     "raise --output-len or lower --long-delay[/yellow]")
    planned = result.meta.get("round_orders") or []
    leads = [order[0] for order in planned[:repeats]]
    if compared and 0 < repeats < len(planned) and len({leads.count(arm.key) for arm in result.arms}) > 1:
        counts = ", ".join(f"{arm.key} {leads.count(arm.key)}" for arm in result.arms)  # stopped early, unevenly
        notes.append(f"[yellow]the run stopped after {repeats} of {len(planned)} rounds, so the arms did not run "
                     f"first equally often (rounds led: {counts})[/yellow]")
    if repeats < 3:
        notes.append(f"[yellow]{repeats} round(s): too few to tell a difference from noise; use --repeats 3 or "
                     "more[/yellow]")
    table = Table(title=f"infer bench: {workload} workload, {repeats} round(s), arms interleaved",
                  caption="\n".join(notes + [arm.label for arm in result.arms]), caption_justify="left")
    table.add_column("metric", no_wrap=True)
    for arm in result.arms:
        table.add_column(arm.key, justify="right", no_wrap=True)
    for metric in METRICS:
        if all(summary[arm.key][metric.key].median is None for arm in result.arms) or (
                metric.key in ("outputs_match", "embeddings_max_diff") and not compared):
            continue  # the workload does not have it (a long prompt, say), no arm measures it, or one arm runs
        title = f"{metric.title} ({metric.unit})" if metric.unit == "ms" else metric.title
        title += " ↑" if metric.higher_is_better else " ↓"
        cells = [format_cell(metric, summary[arm.key][metric.key], i == 0, repeats)
                 for i, arm in enumerate(result.arms)]
        table.add_row(title, *map(Text, cells))  # plain text: a "[low–high]" cell is not markup
    return table


def sampling_note(result: BenchResult) -> str | None:
    """How the requests sampled, and which outputs were compared; None for plain greedy requests."""
    sampling = result.sampling
    given = ", ".join(f"{name}={value:g}" if not isinstance(value, tuple) else
                      f"{name}={{{', '.join(f'{token}: {bias:g}' for token, bias in value)}}}"
                      for name, value in sampling.fields.items() if value != SAMPLING_DEFAULTS[name])
    if not given:
        return None
    if sampling.greedy:
        return f"requests: greedy, {given}"
    if sampling.seed is None:
        return f"requests sampled with {given} from each engine's random stream: outputs not compared " \
               "(--sampling-seed seeds them)"
    compared = result.output_comparable()
    apart = [("HF arms draw from their own stream", any(arm.is_hf for arm in result.arms)),
             ("openai arms draw from their server's", any(arm.is_openai for arm in result.arms)),
             ("arms whose speculation differs from the first arm's draw differently",
              any(arm.is_engine and arm.key not in compared for arm in result.arms))]
    reasons = "; ".join(reason for reason, holds in apart if holds)
    return f"requests sampled with {given}, seeded from --sampling-seed {sampling.seed}" + \
        (f" ({reasons}: outputs n/a)" if reasons else "")


def _long_prompt_came_late(run: RunResult) -> bool:
    """long-prompt-arrival: the long prompt arrived after the other requests had all finished."""
    if run.long_session is None:
        return False
    long = [r for r in run.requests if r.session == run.long_session]
    others = [r.finish_s for r in run.requests if r.session != run.long_session]
    return bool(long and others) and long[0].arrival_s >= max(others)


def render_table(result: BenchResult, console: Console) -> str:
    """Print the table and return it as plain text, never cut: as wide as its widest cells need."""
    table = build_table(result)
    width = Measurement.get(console, console.options.update_width(100_000), table).maximum
    Console(width=max(console.width, width), file=console.file).print(table)
    recorder = Console(record=True, width=width, file=io.StringIO())
    recorder.print(table)
    return recorder.export_text()


def to_json(result: BenchResult) -> dict[str, Any]:
    summary = result.summary()
    arms = []
    for arm in result.arms:
        arms.append({
            "key": arm.key, "text": arm.text, "label": arm.label, "kind": arm_kind(arm),
            **result.arm_info.get(arm.key, {}),
            "summary": {key: {"median": agg.median, "ratio": agg.ratio, "values": agg.values,
                              "paired_ratios": agg.paired_ratios, "ratio_ci95": agg.ci95,
                              "paired_differences": agg.paired_differences,
                              "within_noise": agg.within_noise}
                        for key, agg in summary[arm.key].items()},
            "runs": [run.to_json() for run in result.runs[arm.key]],
        })
    return {**result.meta, "metrics": [m.__dict__ for m in METRICS], "arms": arms}


def arm_kind(arm: ArmSpec) -> str:
    return "hf" if arm.is_hf else "openai" if arm.is_openai else "engine"


def write_json(result: BenchResult, path: Path) -> None:
    """Strict JSON: a non-finite number (the default --rate, inf) is written as a string, "inf" or "nan"."""
    path.write_text(json.dumps(_finite(to_json(result)), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_plots(result: BenchResult, out: Path) -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, ITL, end-to-end per arm, pooled over rounds, of generation requests; the latency
    of embedding requests) and throughput.png (of generation requests, else of embedding requests); a panel no
    request has samples for is left out."""
    from matplotlib.figure import Figure

    samples = {
        "TTFT": lambda r: [r.ttft_s] if r.ttft_s is not None else [],
        "TPOT": lambda r: [r.tpot_s] if r.tpot_s is not None else [],
        "ITL": lambda r: r.itl_s,
        "end-to-end": lambda r: [] if r.embed else [r.e2e_s],
        "embedding latency": lambda r: [r.e2e_s] if r.embed else [],
    }
    requests = [req for runs in result.runs.values() for run in runs for req in run.requests]
    samples = {name: pick for name, pick in samples.items() if any(pick(req) for req in requests)} or samples
    latency = Figure(figsize=(5.5 * min(len(samples), 3), 4 * math.ceil(len(samples) / 3)), layout="constrained")
    axes = latency.subplots(math.ceil(len(samples) / 3), min(len(samples), 3), squeeze=False)
    for ax in axes.flat[len(samples):]:
        ax.set_visible(False)
    for ax, (name, pick) in zip(axes.flat, samples.items()):
        for arm in result.arms:
            values = sorted(1000 * v for run in result.runs[arm.key] for req in run.requests for v in pick(req))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=arm.label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    latency.savefig(out / "latency_cdf.png", dpi=110)

    summary = result.summary()
    bars = Figure(figsize=(4 + 1.5 * len(result.arms), 4.5), layout="constrained")
    keys = [arm.key for arm in result.arms]
    rates = (("requests_per_s", "requests/s"), ("output_tokens_per_s", "output tokens/s"))
    if all(summary[k]["requests_per_s"].median is None for k in keys):  # embedding requests only
        rates = (("embeddings_per_s", "embeddings/s"), ("embed_prompt_tokens_per_s", "prompt tokens/s"))
    for ax, (metric, title) in zip(bars.subplots(1, 2), rates):
        aggs = [summary[k][metric] for k in keys]
        heights = [a.median or 0.0 for a in aggs]
        errors = [[(a.median or 0) - min(a.values, default=0) for a in aggs],
                  [max(a.values, default=0) - (a.median or 0) for a in aggs]]
        ax.bar(keys, heights, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(keys))])
        for i, agg in enumerate(aggs):
            if i and agg.ratio is not None:
                ax.annotate(f"×{agg.ratio:.2f}", (i, max(agg.values)), ha="center", va="bottom", fontsize="small",
                            xytext=(0, 3), textcoords="offset points")
        ax.set_title(f"{title} (median, min-max)")
        ax.margins(y=0.12)  # room for the ratio labels
    bars.legend([bar for bar in bars.axes[0].patches], [arm.label for arm in result.arms], loc="outside lower center",
                fontsize="small")
    bars.savefig(out / "throughput.png", dpi=110)
    return [out / "latency_cdf.png", out / "throughput.png"]
