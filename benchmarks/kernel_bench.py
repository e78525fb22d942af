"""Decode-attention micro-benchmark: achieved K/V read bandwidth against a measured copy bandwidth (CUDA, bf16).

Shapes are Llama-3.2-1B's attention (32 q heads, 8 kv heads, head_dim 64), block size 16, pages scattered at
random. Each timed call reads a different replica of the KV so that the 50 MB L2 cannot serve repeats, and the
calls are replayed from a CUDA graph so that the host's launch cost is not what gets timed.
Run: ``python benchmarks/kernel_bench.py``; prints one JSON line per case.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 64, 16
MIN_BYTES_PER_ROUND = 1 << 30  # replicas of the KV per round: at least 1 GiB, far above L2


def time_ms(fn: Callable[[int], object], iters: int) -> float:
    """Mean milliseconds per call of ``fn(i)``, measured with CUDA events after a warm-up round."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_ms_per_call(fn: Callable[[int], object], calls: int, replays: int) -> float:
    """Capture ``fn(0) .. fn(calls - 1)`` in one CUDA graph, so host launch cost is not what gets timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return time_ms(lambda _: graph.replay(), replays) / calls


def copy_gbps(nbytes: int, iters: int) -> float:
    """Device copy bandwidth, counting read plus write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda _: dst.copy_(src), iters) / 1e6


def decode_case(batch: int, context: int, iters: int, num_sms: int, splits: int | None = None
                ) -> dict[str, float | int | str]:
    from infer.kernels.attention import decode_attention, default_num_splits

    blocks_per_seq = math.ceil(context / PAGE)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    replicas = max(1, math.ceil(MIN_BYTES_PER_ROUND / kv_bytes))
    num_blocks = replicas * batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(replicas, batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    splits = splits or default_num_splits(batch, KV_HEADS, context, num_sms)
    ms = graph_ms_per_call(lambda i: decode_attention(q, k_cache, v_cache, tables[i % replicas], lens,
                                                      HEAD_DIM ** -0.5, splits), max(replicas, 16), iters)
    del k_cache, v_cache
    return {"kernel": "decode_attention", "dtype": "bfloat16", "batch": batch, "context": context,
            "num_splits": splits, "ms": round(ms, 4), "kv_bytes": kv_bytes, "gbps": round(kv_bytes / ms / 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--iters", type=int, default=20, help="timed copies / graph replays")
    parser.add_argument("--splits", type=int, nargs="+", default=[0],
                        help="KV splits to time per case; 0: default_num_splits' choice (the engine's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU (Triton kernels run natively there); none is visible", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy = copy_gbps(2 << 30, args.iters)
    print(json.dumps({"kernel": "copy", "device": props.name, "gbps": round(copy, 1)}))
    for context in args.context:
        for batch in args.batch:
            for splits in args.splits:
                row = decode_case(batch, context, args.iters, props.multi_processor_count, splits or None)
                row["fraction_of_copy"] = round(float(row["gbps"]) / copy, 3)
                row["splits_chosen_by"] = "engine" if not splits else "--splits"
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
