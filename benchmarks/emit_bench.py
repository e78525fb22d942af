"""Host time of building outputs (the engine's postprocess: detokenize, deltas) per output token.

128 requests of the anchor workload's shapes (host_overhead.py's minuscule model) are prefilled; then each
iteration appends one token to every sequence and builds every request's delta output, as a decode step's
postprocess does (no stop strings, one sequence per request: the common case). Prints the median per token.
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
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--source", type=Path, default=None, help="import infer from this checkout (an A/B)")
    args = parser.parse_args()
    if args.source is not None:
        import_checkout(args.source)
    from infer.core.outputs import build_output
    from infer.core.request import SamplingParams

    engine = minuscule_engine(async_output=False, num_kv_blocks=HOST.requests * 1024 // 16 + 1)
    for prompt, _ in workload_requests(HOST):
        engine.add_request(prompt, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    engine.step()  # every prompt computed, a first token each
    requests = list(engine.requests.values())
    token = engine.tokenizer.encode(" x")[-1]
    times = []
    for _ in range(args.iterations):
        for req in requests:
            req.seqs[0].token_ids.append(token)
        start = time.perf_counter()
        for req in requests:
            build_output(req, {req.seqs[0].seq_id}, engine.scheduler.finish)
        times.append((time.perf_counter() - start) / len(requests))
    print(f"build_output: {statistics.median(times) * 1e6:.2f} us per output token ({len(requests)} requests, "
          f"median of {args.iterations})")


if __name__ == "__main__":
    main()
