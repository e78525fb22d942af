"""Beam search beside requests: what a beam search costs the requests it runs beside, and what sharing a tight KV
pool costs the searches (waits for blocks, restarts that redo work).

Arms, each in a fresh engine on the `cpu` preset's model (throughput.py), taking turns over the rounds:
- ``alone``: the requests only (greedy, EOS ignored, all submitted at once);
- ``beside``: the same requests, and beam searches started after ``--start-step`` steps;
- ``tight``: as ``beside`` on a KV pool of ``--tight-blocks`` blocks, so that beams and requests give way to each
  other (the requests' preemptions, the searches' waits and restarts).
Per arm: the requests' mean TPOT and wall time until they all finished, the searches' wall time, and the engine's
totals (preemptions, beam_search_waits, beam_search_restarts). Every arm's request tokens and beams are checked
against the ``alone`` arm and the searches run alone: beside or not, the outputs are the same. "requests s" is the
time until the last request finished; "searches s" until the last search did. Prints a table last.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PRESETS, build_model  # noqa: E402


def run_arm(model: Path, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    from infer.core.beam_search import BeamSearchParams
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    blocks = args.tight_blocks if arm == "tight" else None
    engine = Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=blocks, enable_prefix_caching=False,
                                 max_num_seqs=args.requests))
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.beam_tokens, ignore_eos=True)
    if arm == "search-alone":  # the reference beams
        return {"beams": [[b.token_ids for b in engine.beam_search([p[: args.prompt_len // 2]], beam)[0].beams]
                          for p in prompts[: args.searches]]}
    ids = engine.add_requests(prompts, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    searches, started, search_done, requests_done = [], time.perf_counter(), None, None
    steps, unfinished = 0, set(ids)
    while engine.has_unfinished():
        if arm != "alone" and steps == args.start_step:
            searches = [engine.start_beam_search([prompts[i][: args.prompt_len // 2]], beam)
                        for i in range(args.searches)]
        for out in engine.step():
            outputs[out.request_id] += [t for c in out.outputs for t in c.token_ids]
            if out.finished:
                unfinished.discard(out.request_id)
        steps += 1
        now = time.perf_counter()
        if searches and search_done is None and all(s.done for s in searches):
            search_done = now
        if not unfinished and requests_done is None:
            requests_done = now
    summary = engine.stats.summary()
    return {"arm": arm, "wall_s": requests_done - started, "tpot_ms": summary["mean_tpot_ms"],
            "outputs": [outputs[r] for r in ids],
            "beams": [[b.token_ids for b in s.result()[0].beams] for s in searches],
            "search_s": (search_done - started) if search_done else None, "preemptions": summary["preemptions"],
            "waits": summary["beam_search_waits"], "restarts": summary["beam_search_restarts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--searches", type=int, default=2)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-tokens", type=int, default=64)
    parser.add_argument("--start-step", type=int, default=8)
    parser.add_argument("--tight-blocks", type=int, default=96, help="the tight arm's KV pool, in 16-token blocks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    preset = PRESETS["cpu"]
    model = build_model(Path(tempfile.gettempdir()) / "infer-beam-beside", preset.shape, preset.dtype, "cpu")
    arms = ("alone", "beside", "tight")
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for round_index in range(args.rounds):
        for arm in arms[round_index % 3:] + arms[: round_index % 3]:  # each arm first in turn
            results[arm].append(run_arm(model, arm, args))
    reference = results["alone"][0]["outputs"]
    beams = run_arm(model, "search-alone", args)["beams"]
    for arm in arms:
        for run in results[arm]:
            assert run["outputs"] == reference, f"{arm}: the requests' tokens differ from their run alone"
            assert arm == "alone" or run["beams"] == beams, f"{arm}: the beams differ from the searches run alone"
    print(f"{args.requests} requests ({args.prompt_len} prompt, {args.output_len} output tokens), {args.searches} "
          f"beam searches (width {args.beam_width}, {args.beam_tokens} tokens) from step {args.start_step}; medians "
          f"of {args.rounds} rounds")
    print(f"{'arm':<8} {'requests s':>10} {'TPOT ms':>8} {'searches s':>10} {'preempt':>8} {'waits':>6} "
          f"{'restarts':>8}")
    for arm in arms:
        runs = results[arm]

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else float("nan")

        print(f"{arm:<8} {med('wall_s'):>10.2f} {med('tpot_ms'):>8.2f} {med('search_s'):>10.2f} "
              f"{med('preemptions'):>8.0f} {med('waits'):>6.0f} {med('restarts'):>8.0f}")
    print("outputs: every arm's request tokens equal the alone arm's, and its beams those of the searches run "
          "alone")


if __name__ == "__main__":
    main()
