"""Attention micro-benchmarks (CUDA, bf16): decode's K/V read bandwidth against a measured copy bandwidth, and the
prefill/extend kernel's TFLOP/s against torch's SDPA on the same fresh prefill.

Shapes are Llama-3.2-1B's attention (32 q heads, 8 kv heads, head_dim 64), block size 16, pages scattered at
random. Each timed decode call reads a different replica of the KV so that the 50 MB L2 cannot serve repeats, and
the calls are replayed from a CUDA graph so that the host's launch cost is not what gets timed. Prefill cases are
compute-bound (their K/V fits in L2). Run: ``python benchmarks/kernel_bench.py``; prints one JSON line per case.
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


PREFILL_CASES = ((1, 1100, 1100), (1, 100, 1100), (16, 512, 512))  # (sequences, query tokens, context) each


def prefill_case(batch: int, query_len: int, context: int, iters: int) -> dict[str, float | int | str]:
    """The ragged prefill kernel on ``batch`` sequences of ``query_len`` new tokens ending a ``context``-token
    context (extend when query_len < context); a fresh prefill is also timed with torch's causal SDPA."""
    import torch.nn.functional as F

    from infer.kernels.attention import prefill_attention

    blocks_per_seq = math.ceil(context / PAGE)
    k_cache = torch.randn(batch * blocks_per_seq, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch * query_len, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ms = graph_ms_per_call(lambda _: prefill_attention(q, k_cache, v_cache, tables, starts, lens, HEAD_DIM ** -0.5,
                                                       out=out), 16, iters)
    keys_attended = batch * sum(context - query_len + i + 1 for i in range(query_len))  # causal
    flop = 4 * Q_HEADS * HEAD_DIM * keys_attended  # q.k and p.v, 2 flop per multiply-add
    row: dict[str, float | int | str] = {"kernel": "prefill_attention", "dtype": "bfloat16", "batch": batch,
                                         "query_len": query_len, "context": context, "ms": round(ms, 4),
                                         "tflops": round(flop / ms / 1e9, 1)}
    if query_len == context:  # the peer: SDPA (flash) on contiguous [B, H, T, D] K/V, the same causal work
        qs = q.view(batch, query_len, Q_HEADS, HEAD_DIM).transpose(1, 2)
        ks = torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        vs = torch.randn_like(ks)
        sdpa_ms = graph_ms_per_call(lambda _: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                             enable_gqa=True), 16, iters)
        row.update(sdpa_ms=round(sdpa_ms, 4), sdpa_tflops=round(flop / sdpa_ms / 1e9, 1),
                   ratio_to_sdpa=round(sdpa_ms / ms, 3))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--iters", type=int, default=20, help="timed copies / graph replays")
    parser.add_argument("--splits", type=int, nargs="+", default=[0],
                        help="KV splits to time per case; 0: default_num_splits' choice (the engine's)")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill/extend cases")
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
    for batch, query_len, context in () if args.no_prefill else PREFILL_CASES:
        print(json.dumps(prefill_case(batch, query_len, context, args.iters)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
