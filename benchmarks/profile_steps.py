"""Where an engine step's time goes: torch.profiler over prefill, extend and decode steps of the anchor model.

The first GPU run explained its misses from step timings alone (docs/PERF.md); this names the kernels and the
host work. Each scenario runs three times: a warm-up (compiles, allocator, graphs), a timed run, a profiled run:
- prefill: one fresh prompt of --prefix-len + --question-len tokens (no cached prefix);
- extend: --question-len new tokens after a cached --prefix-len prefix (the shared-prefix benchmark's request);
- decode-B for each B in --decode-batches: --steps decode steps of B sequences (CUDA graphs on a GPU).

Per scenario: host ms per engine step (the wall time of ``Engine.step`` in an unprofiled run, with the engine's own
phase split), device ms per step (kernels' and copies' time in the profiled run), kernels and copies (memcpy,
memset) per step, the profiled run's host time and the part of it inside torch ops and driver calls (the rest is
Python), then the top kernels and copies by device time and the top host ops by self CPU time. Prefill and
extend steps replay the mixed-step CUDA graphs by default (``--engine-arg cuda_graph_max_tokens=0``: eagerly).
``--out`` keeps a Chrome trace per scenario (open it in Perfetto). On a CPU the device columns are empty and the
run only checks that the script works. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PRESETS, build_model  # noqa: E402

PHASES = ("schedule", "execute", "sample", "postprocess")


def scenario_requests(args: argparse.Namespace, rng: random.Random
                      ) -> dict[str, tuple[list[list[int]], int, int, int | None]]:
    """name -> (prompts, max_tokens, steps before the window, window length: None runs to the end)."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    scenarios = {"prefill": ([tokens(args.prefix_len + args.question_len)], 1, 0, None),
                 "extend": ([prefix + tokens(args.question_len)], 1, 0, None)}
    for batch in args.decode_batches:  # two steps of prefill first (async output returns tokens a step late)
        scenarios[f"decode-{batch}"] = ([tokens(32) for _ in range(batch)], args.steps + 8, 2, args.steps)
    return scenarios


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine: Any, prompts: list[list[int]], max_tokens: int, skip: int, window: int | None,
        prof: profile | None) -> tuple[list[float], dict[str, float], int]:
    """Add ``prompts`` and step; time (and profile) ``window`` calls of ``Engine.step`` after the first ``skip``;
    abort the rest. Returns the wall time of the window's calls, summed per forward pass (with async output the
    call that returns a one-token request's output runs none: its time counts for the forward pass before it), the
    engine's phase times per forward pass, and the prompt tokens that the finished requests found cached."""
    from infer.core.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in prompts}
    times: list[float] = []
    phases_before: dict[str, float] = {}
    step = cached = forwards_before = 0
    while ids and (window is None or len(times) < window):
        if step == skip:  # the window opens
            sync()
            phases_before, forwards_before = dict(engine.stats.phase_s), engine.stats.steps
            if prof is not None:
                prof.start()
        start = time.perf_counter()
        outputs = engine.step()
        if step >= skip:
            times.append(time.perf_counter() - start)
        finished = [o for o in outputs if o.finished]
        cached += sum(o.num_cached_tokens for o in finished)
        ids -= {o.request_id for o in finished}
        step += 1
    sync()
    if prof is not None:
        prof.stop()
    forwards = engine.stats.steps - forwards_before  # steps that ran a forward pass
    times = [sum(times) / max(1, forwards)] * forwards
    phases = {p: (engine.stats.phase_s.get(p, 0.0) - phases_before.get(p, 0.0)) / max(1, forwards) for p in PHASES}
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times, phases, cached


def summarize(name: str, times: list[float], phases: dict[str, float], cached: int, profiled_times: list[float],
              prof: profile, top: int) -> dict[str, Any]:
    """One scenario's row (host figures from the unprofiled run, device figures from the profiled one) and its top
    kernels and host ops, printed."""
    events = prof.key_averages()
    device_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in device_ops if not e.key.startswith(("Memcpy", "Memset"))]
    copies = [e for e in device_ops if e.key.startswith(("Memcpy", "Memset"))]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    steps, profiled_steps = max(1, len(times)), max(1, len(profiled_times))
    row = {"scenario": name, "steps": len(times), "cached_tokens": cached,
           "host_ms": round(1e3 * sum(times) / steps, 3),
           "host_ms_profiled": round(1e3 * sum(profiled_times) / profiled_steps, 3),
           # time inside torch ops and driver calls; the rest of a profiled step is Python
           "ops_ms_profiled": round(sum(e.self_cpu_time_total for e in host) / 1e3 / profiled_steps, 3),
           "device_ms": round(sum(e.self_device_time_total for e in device_ops) / 1e3 / profiled_steps, 3)
           if device_ops else None,
           "kernels_per_step": round(sum(e.count for e in kernels) / profiled_steps, 1) if device_ops else None,
           "copies_per_step": round(sum(e.count for e in copies) / profiled_steps, 1) if device_ops else None,
           **{f"{p}_ms": round(1e3 * s, 3) for p, s in phases.items()}}
    print(f"\n== {name}: {json.dumps(row)}")
    if device_ops:
        print("top kernels and copies by device time (us per step, calls per step):")
        for e in sorted(device_ops, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {e.self_device_time_total / profiled_steps:9.1f}  {e.count / profiled_steps:6.1f}  {e.key[:100]}")
    print("top host ops by self CPU time (us per step, calls per step):")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / profiled_steps:9.1f}  {e.count / profiled_steps:6.1f}  {e.key[:100]}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="anchor", help="model shape (throughput.py's)")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model folder (built there if missing)")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=100)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--steps", type=int, default=16, help="profiled Engine.step calls per decode scenario")
    parser.add_argument("--top", type=int, default=12, help="rows of each top list")
    parser.add_argument("--out", type=Path, default=None, help="folder for the Chrome traces (none if unset)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field, e.g. async_scheduling=false (repeatable)")
    args = parser.parse_args()
    if args.steps < 1 or min(args.decode_batches) < 1:
        parser.error("--steps and --decode-batches must be >= 1")
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.model_dir, preset.shape, preset.dtype if device == "cuda" else "float32", device)
    options: dict[str, Any] = {}
    for item in args.engine_arg:
        field, _, value = item.partition("=")
        options[field] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
        for number in (int, float):
            try:
                options[field] = number(value)
                break
            except ValueError:
                pass
    defaults = dict(max_num_seqs=max(args.decode_batches), kv_cache_memory_gb=8.0 if device == "cuda" else 0.5,
                    max_model_len=args.prefix_len + args.question_len + args.steps + 64)
    engine = Engine(EngineConfig(model=str(model), **{**defaults, **options}))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    timed: dict[str, tuple[list[float], dict[str, float], int]] = {}
    for round_ in ("warm-up", "timed", "profiled"):  # the profiler slows the host: host times come from "timed"
        rng = random.Random(f"profile:{round_}")  # fresh tokens each round: the prefill scenario finds no cache
        for name, (prompts, max_tokens, skip, window) in scenario_requests(args, rng).items():
            if name == "extend":  # the same prefix, another question: the prefix's blocks are cached
                run(engine, [prompts[0][: args.prefix_len] + [7] * args.question_len], 1, 0, None, None)
            if round_ != "profiled":
                timed[name] = run(engine, prompts, max_tokens, skip, window, None)
                continue
            prof = profile(activities=activities)
            profiled_times, _, _ = run(engine, prompts, max_tokens, skip, window, prof)
            rows.append(summarize(name, *timed[name], profiled_times, prof, args.top))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.out / f"{name}.trace.json"))
    print(f"\n{args.preset} model on {device}; ms per engine step (host: Engine.step wall time; device: kernel time)")
    print(f"| scenario | steps | host | device | kernels | copies | host, profiled | in ops | {' | '.join(PHASES)} |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES))
    for r in rows:
        cells = [r["scenario"], r["steps"], r["host_ms"], r["device_ms"], r["kernels_per_step"], r["copies_per_step"],
                 r["host_ms_profiled"], r["ops_ms_profiled"],
                 *(r[f"{p}_ms"] for p in PHASES)]
        print("| " + " | ".join("n/a" if c is None else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
