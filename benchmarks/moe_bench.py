"""MoE experts micro-benchmark: infer's Triton grouped GEMMs (kernels/fused_moe.py), its torch loop (models/moe.py)
and HF transformers' experts module (the peer on the device image: no vLLM there) on one layer's shapes.

Shapes: Qwen3-30B-A3B (128 experts of 768, 8 per token, hidden 2048) and Mixtral-8x7B (8 of 14336, 2 per token,
hidden 4096), random bf16 weights and routing. Each case checks the three outputs agree, then times each with CUDA
events (the Triton path also replayed from a CUDA graph: the engine's decode steps run so; on CUDA also with the
weights in block-wise FP8, 128 x 128, as Qwen3-30B-A3B-FP8 holds them, with its error against HF's bf16 output,
about 0.04 from e4m3 rounding of weights and activations), and with the weights in AWQ int4 (round-to-nearest,
group 128; 32 on the CPU smoke shape) as infer runs AWQ experts: stacked for the grouped W4A16 GEMMs
(kernels/awq_moe.py, graphed on CUDA), and each expert's Linears one expert at a time, the loop infer keeps for
experts not all int4 (their error against HF's float output is int4's through three projections: 0.15 on the CPU
smoke shape). Prints one
JSON line per case and a table. ``--device cpu`` runs a small shape on the Triton interpreter (a smoke test, not a
figure).
Run: ``python benchmarks/moe_bench.py [--tokens 1 16 128 1024]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable

import torch

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "cpu-smoke": (8, 2, 64, 96)}


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean milliseconds per call after a warm-up (CUDA events on a GPU, the wall clock elsewhere)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] -> e4m3 codes and a scale per 128 x 128 block (amax / 448), as block-wise FP8 checkpoints hold."""
    e, r, c = w.shape
    blocks = w.float().reshape(e, r // 128, 128, c // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    return (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, r, c), scale


def awq_experts(moe: object, hidden: int, w13: torch.Tensor, w2: torch.Tensor, group: int) -> torch.nn.Module:
    """A SparseMoe whose experts are AWQ Linears (int4, RTN at ``group``) quantized from w13/w2 on load."""
    from infer.models.moe import SparseMoe
    from infer.quant.awq_method import AwqLinearMethod

    with torch.device(w13.device):
        block = SparseMoe(moe, hidden, w13.dtype, lambda g, u: torch.nn.functional.silu(g) * u, fused=False,
                          linear_quant=AwqLinearMethod(group, quantize_on_load=True), prefix="mlp")
    size = w2.shape[2]
    for e, expert in enumerate(block.experts):
        for name, weight in (("gate_proj", w13[e, :size]), ("up_proj", w13[e, size:]), ("down_proj", w2[e])):
            linear = expert.get_submodule(name)
            linear.load("weight", weight)
            linear.method.process_after_loading(linear)
    return block


def w8a16_stack(w: torch.Tensor, group: int) -> object:
    """[E, N, K] float -> W8A16Experts ([E, K, N] codes): symmetric RTN per group of ``group`` inputs, scale
    max|w| / 127.5 in fp16, zero point 128 (what an 8-bit GPTQ checkpoint without calibration holds)."""
    from infer.kernels.w8a16_moe import W8A16Experts

    t = w.transpose(1, 2).float()  # [E, K, N]
    e, k, n = t.shape
    grouped = t.reshape(e, k // group, group, n)
    scale = (grouped.abs().amax(dim=2) / 127.5).clamp_min(1e-8).half()  # [E, K / group, N]
    codes = (grouped / scale.float().unsqueeze(2)).round().add(128).clamp(0, 255).to(torch.uint8).reshape(e, k, n)
    zeros = torch.full_like(scale, 128, dtype=torch.uint8)
    return W8A16Experts(codes.contiguous(), zeros, scale, group)


def case(shape: str, tokens: int, device: torch.device, dtype: torch.dtype, iters: int) -> dict[str, object]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from infer.kernels.awq_moe import fused_awq_experts
    from infer.kernels.fused_moe import Fp8ExpertScales, fused_experts
    from infer.models.moe import MoeConfig, SparseMoe

    experts, top_k, hidden, size = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    w13 = torch.randn(experts, 2 * size, hidden, device=device, dtype=dtype, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, size, device=device, dtype=dtype, generator=gen) * size**-0.5
    probs = torch.softmax(torch.randn(tokens, experts, device=device, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    moe = MoeConfig(experts, top_k, size, True, False, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    loop = SparseMoe(moe, hidden, dtype, lambda g, u: torch.nn.functional.silu(g) * u, fused=False).to(device)
    loop.w13.copy_(w13)
    loop.w2.copy_(w2)
    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=size, num_experts=experts,
                                        num_experts_per_tok=top_k)).to(device, dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
    awq = awq_experts(moe, hidden, w13, w2, 128 if hidden % 128 == 0 and size % 128 == 0 else 32)
    stacked = copy.deepcopy(awq)
    stacked.stack_quantized()
    awq_stacked = stacked.stacked_experts()
    runs = {"triton": lambda: fused_experts(x, w13, w2, weights, ids), "torch_loop": lambda: loop.experts_loop(
        x, weights, ids), "awq_loop": lambda: awq.experts_loop(x, weights, ids),
        "awq_triton": lambda: fused_awq_experts(x, *awq_stacked, weights, ids), "hf": lambda: hf(x, ids, weights)}
    with torch.no_grad():
        outs = {name: fn().float() for name, fn in runs.items()}
        scale = outs["hf"].norm().clamp_min(1e-6)
        errors = {name: float((out - outs["hf"]).norm() / scale) for name, out in outs.items() if name != "hf"}
        row: dict[str, object] = {"shape": shape, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                                  "device": device.type, "rel_err_vs_hf": errors}
        for name, fn in runs.items():
            row[f"{name}_ms"] = round(time_ms(fn, iters, device), 4)
        if device.type == "cuda":
            row["triton_graph_ms"] = round(time_ms(graphed(runs["triton"]), iters, device), 4)
            row["awq_triton_graph_ms"] = round(time_ms(graphed(runs["awq_triton"]), iters, device), 4)
            # 8-bit experts (GPTQ Int8, compressed-tensors W8A16): the grouped W8A16 GEMMs
            from infer.kernels.w8a16_moe import fused_w8a16_experts

            group = 128 if hidden % 128 == 0 and size % 128 == 0 else 32
            int8 = (w8a16_stack(w13, group), w8a16_stack(w2, group))

            def run_w8a16() -> torch.Tensor:
                return fused_w8a16_experts(x, *int8, weights, ids)
            row["w8a16_rel_err_vs_hf"] = float((run_w8a16().float() - outs["hf"]).norm() / scale)
            row["w8a16_triton_graph_ms"] = round(time_ms(graphed(run_w8a16), iters, device), 4)
            # block-wise FP8 experts (Qwen3-30B-A3B-FP8's format): the same weights in 128 x 128 e4m3 blocks
            (w13_fp8, w13_scale), (w2_fp8, w2_scale) = block_fp8(w13), block_fp8(w2)

            def run_fp8() -> torch.Tensor:
                return fused_experts(x, w13_fp8, w2_fp8, weights, ids,
                                     Fp8ExpertScales(w13_scale, w2_scale, (128, 128), (128, 128)))
            row["fp8_rel_err_vs_hf"] = float((run_fp8().float() - outs["hf"]).norm() / scale)
            row["triton_fp8_graph_ms"] = round(time_ms(graphed(run_fp8), iters, device), 4)
    row["hf_over_triton"] = round(float(row["hf_ms"]) / float(row.get("triton_graph_ms", row["triton_ms"])), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    shapes = args.shapes or (["cpu-smoke"] if cpu else ["qwen3-30b-a3b", "mixtral-8x7b"])
    dtype = torch.float32 if cpu else torch.bfloat16
    rows = [case(shape, tokens, device, dtype, args.iters) for shape in shapes for tokens in args.tokens]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"{'shape':<15}{'tokens':>7}{'triton ms':>11}{'graphed':>9}{'fp8 graphed':>12}{'loop ms':>9}"
          f"{'awq loop':>9}{'awq graphed':>12}{'w8a16 graphed':>14}{'HF ms':>9}{'HF/triton':>10}")
    for r in rows:
        print(f"{r['shape']:<15}{r['tokens']:>7}{r['triton_ms']:>11}{r.get('triton_graph_ms', '-'):>9}"
              f"{r.get('triton_fp8_graph_ms', '-'):>12}{r['torch_loop_ms']:>9}{r['awq_loop_ms']:>9}"
              f"{r.get('awq_triton_graph_ms', r['awq_triton_ms']):>12}{r.get('w8a16_triton_graph_ms', '-'):>14}"
              f"{r['hf_ms']:>9}{r['hf_over_triton']:>10}")


if __name__ == "__main__":
    main()
