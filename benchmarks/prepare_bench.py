"""Host time of ModelRunner.prepare for one decode step of 128 running sequences, the batch-building part of a step.

The engine runs the anchor workload's requests (128 at once) on the minuscule model of host_overhead.py until every
sequence decodes and has about ``--context`` tokens; then the next step's schedule is prepared ``--iterations``
times. The attention backend's own planning (``AttentionBackend.prepare``, device-specific: the CPU backend's
differs from Triton's) is timed apart and subtracted, leaving what every backend pays. Prints the median.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import HOST, import_checkout, minuscule_engine  # noqa: E402
from throughput import workload_requests  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1000, help="tokens per sequence when timed (prompt + output)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--source", type=Path, default=None, help="import infer from this checkout (an A/B)")
    args = parser.parse_args()
    if args.source is not None:
        import_checkout(args.source)
    from infer.core.request import SamplingParams

    engine = minuscule_engine(attention="torch", num_kv_blocks=HOST.requests * 2048 // 16 + 1, max_model_len=2048)
    for prompt, _ in workload_requests(HOST):
        engine.add_request(prompt, SamplingParams(max_tokens=2048 - len(prompt), temperature=0.0, ignore_eos=True))
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    while min(s.num_tokens for s in seqs) < args.context:
        engine.step()
    out = engine.scheduler.schedule()
    runner, kv = engine.runner, engine.kv
    total, planning = [], []
    for _ in range(args.iterations):
        start = time.perf_counter()
        batch = runner.prepare(out, kv)
        total.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.attention.prepare(batch.meta)
        planning.append(time.perf_counter() - start)
    us = (statistics.median(total) - statistics.median(planning)) * 1e6
    tables = sum(len(kv.block_table(item.seq)) for item in out.scheduled) / len(out.scheduled)
    print(f"prepare, {len(out.scheduled)} decodes, {tables:.1f} blocks per table: {us:.0f} us per step, "
          f"{us / len(out.scheduled):.2f} us per sequence (backend planning excluded)")


if __name__ == "__main__":
    main()
