"""Every Triton kernel compiles for sm_90 (H100/H200) at the anchor model's shapes, on a machine without a GPU.

The launchers run under the interpreter on small inputs with the anchor's head and block shapes, in bf16 and fp16;
a pre-run hook (the interpreter's own ``add_pre_run_hook``) records each launch's argument types and constexprs.
A subprocess without the interpreter then compiles every recorded launch with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``: Triton's front end, its GPU passes and the ptxas that ships in the triton wheel, which
catches what the interpreter forgives (types, layouts, unsupported ops, shared memory). The interpreter hides
``num_warps`` from hooks, so each launch compiles with the launcher's rule for it, restated in WARPS below.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, `pytest -m gpu` compiles them natively")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from infer.kernels import (attention, awq_gemm, awq_moe, fp8, fp8_block, fused_moe, fused_ops,  # noqa: E402
                           skinny_gemm, w8a16_gemm, w8a16_moe)

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}
HEADS, KV_HEADS, HEAD_DIM, PAGE, HIDDEN, INTER = 32, 8, 64, 16, 2048, 8192  # Llama-3.2-1B, block size 16
WARPS = {"_rms_norm_kernel": 8, "_decode_split_kernel": 4, "_prefill_kernel": 4}  # the launchers' choice here

COMPILE = r"""
import importlib, json, multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(rec):
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    constexprs = {k: triton.language.dtype(v["dtype"]) if isinstance(v, dict) else v
                  for k, v in rec["constexprs"].items()}
    try:
        done = triton.compile(ASTSource(fn, rec["signature"], constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": rec["num_warps"]})
        if done.metadata.shared > 227 * 1024:  # the H100/H200 limit per block
            return f"{rec['name']}: {done.metadata.shared} bytes of shared memory"
    except Exception as exc:
        return f"{rec['name']} {rec['constexprs']}: {exc!r}"[:2000]

with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("fork")) as pool:
    failures = [f for f in pool.map(build, json.load(sys.stdin)) if f is not None]
print(json.dumps(failures))
"""


def kernels() -> dict[str, object]:
    found = {}
    for module in (attention, awq_gemm, awq_moe, fp8, fp8_block, fused_moe, fused_ops, skinny_gemm, w8a16_gemm,
                   w8a16_moe):
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "add_pre_run_hook"):
                found[name] = value
    return found


def record(kernel: object, launches: list[dict]) -> None:
    import inspect

    params = list(inspect.signature(kernel.fn).parameters.values())

    def hook(*args: object, **kwargs: object) -> None:
        bound = dict(zip((p.name for p in params), args)) | kwargs
        signature, constexprs = {}, {}
        for p in params:
            value = bound[p.name]
            if "constexpr" in str(p.annotation) or value is None or (type(value) is int and value == 1):
                signature[p.name], constexprs[p.name] = "constexpr", value  # Triton specializes an int 1 so
                if hasattr(value, "primitive_bitwidth"):  # a triton dtype (ROUND_TO): by name through JSON
                    constexprs[p.name] = {"dtype": str(value)}
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + TYPES[value.dtype]
            elif isinstance(value, float):
                signature[p.name] = "fp32"
            else:
                signature[p.name] = "i32" if abs(int(value)) < 2**31 else "i64"
        launches.append({"module": kernel.fn.__module__, "name": kernel.fn.__name__, "signature": signature,
                         "constexprs": constexprs, "num_warps": WARPS.get(kernel.fn.__name__, 4)})

    kernel.add_pre_run_hook(hook)


def anchor_launches(dtype: torch.dtype) -> None:
    """One call of every launcher with the anchor's shapes and few tokens."""
    kc = torch.zeros(4, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype)
    k8 = kc.to(torch.float8_e4m3fn)
    scale = torch.ones(KV_HEADS)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, HEADS, HEAD_DIM, dtype=dtype)
    for cache, scales in ((kc, {}), (k8, {"k_scale": scale, "v_scale": scale})):
        attention.decode_attention(q, cache, cache, tables, lens, 0.125, 2, **scales)
        attention.prefill_attention(torch.randn(6, HEADS, HEAD_DIM, dtype=dtype), cache, cache, tables,
                                    torch.tensor([0, 3, 6], dtype=torch.int32), lens, 0.125, **scales)
        attention.prefill_attention(torch.randn(6, HEADS, HEAD_DIM, dtype=dtype), cache, cache, tables[:1],
                                    torch.tensor([0, 6], dtype=torch.int32), lens[:1], 0.125, **scales)  # B = 1
    # Gemma 2: softcapped scores (SOFTCAP), on a sliding window
    attention.decode_attention(q, kc, kc, tables, lens, 0.125, 2, window=8, softcap=50.0)
    attention.prefill_attention(torch.randn(6, HEADS, HEAD_DIM, dtype=dtype), kc, kc, tables,
                                torch.tensor([0, 3, 6], dtype=torch.int32), lens, 0.125, window=8, softcap=50.0)
    kv = torch.randn(3, KV_HEADS, HEAD_DIM, dtype=dtype)
    attention.store_kv(kv, kv, kc, kc.clone(), torch.arange(3))
    x = torch.randn(2, HIDDEN, dtype=dtype)
    fused_ops.rms_norm(x, torch.ones(HIDDEN, dtype=dtype), 1e-5, residual=x.clone())
    fused_ops.silu_and_mul(torch.randn(2, INTER, dtype=dtype), torch.randn(2, INTER, dtype=dtype))
    fused_ops.gemma_rms_norm(x, torch.ones(HIDDEN, dtype=dtype), 1e-6, residual=x.clone())
    fused_ops.gelu_tanh_and_mul(torch.randn(2, INTER, dtype=dtype), torch.randn(2, INTER, dtype=dtype))
    cos = torch.randn(32, HEAD_DIM // 2)
    fused_ops.rotary_embedding(torch.arange(2), q.clone(), torch.randn(2, KV_HEADS, HEAD_DIM, dtype=dtype), cos, cos)
    fp8.per_token_quant(x)
    for rows in (1, 64):  # fp8 GEMM blocks by row count; the native fp8 dot (UPCAST=False) is the GPU's path
        a, b = torch.zeros(rows, 256, dtype=torch.float8_e4m3fn), torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
        fp8.w8a8_gemm(a, torch.ones(rows), b, torch.ones(128), dtype)
    qweight, qzeros = torch.zeros(256, 16, dtype=torch.int32), torch.zeros(2, 16, dtype=torch.int32)
    for rows, split in ((1, 4), (32, 1)):  # decode splits K across programs (atomics); larger batches do not
        awq_gemm.awq_gemm(torch.randn(rows, 256, dtype=dtype), qweight, qzeros, torch.ones(2, 128, dtype=dtype), 128,
                          split_k=split)
    awq_gemm.awq_gemm(torch.randn(1, 256, dtype=dtype), qweight, torch.zeros(8, 16, dtype=torch.int32),
                      torch.ones(8, 128, dtype=dtype), 32)  # group 32 < BLOCK_K: the per-row scales and zeros
    awq_gemm.awq_dequantize(qweight, qzeros, torch.ones(2, 128, dtype=torch.float16), 128, dtype)  # prefill
    order = torch.randperm(256)  # GPTQ's activation order, gathered as x loads
    awq_gemm.awq_gemm(torch.randn(1, 256, dtype=dtype), qweight, qzeros, torch.ones(2, 128, dtype=dtype), 128,
                      input_order=order, split_k=4)
    codes, zeros = torch.zeros(256, 128, dtype=torch.uint8), torch.zeros(2, 128, dtype=torch.uint8)
    for rows, split in ((1, 4), (32, 1), (64, 1)):  # 8-bit GPTQ / compressed-tensors W8A16: each tile size
        w8a16_gemm.w8a16_gemm(torch.randn(rows, 256, dtype=dtype), codes, zeros, torch.ones(2, 128, dtype=dtype),
                              128, split_k=split)
    w8a16_gemm.w8a16_dequantize(codes, zeros, torch.ones(2, 128, dtype=torch.float16), 128, dtype)
    w8a16_gemm.w8a16_gemm(torch.randn(1, 256, dtype=dtype), codes, zeros, torch.ones(2, 128, dtype=dtype), 128,
                          input_order=order, split_k=4)
    w8a16_gemm.w8a16_gemm(torch.randn(1, 256, dtype=dtype), codes, zeros, torch.ones(2, 128, dtype=dtype), 128,
                          input_order=order.to(torch.int32))
    moe_launches(dtype)
    for rows, block_n in ((1, 64), (16, 16)):
        skinny_gemm.skinny_gemm(torch.randn(rows, 512, dtype=dtype), torch.randn(128, 512, dtype=dtype),
                                block_n=block_n)


def moe_launches(dtype: torch.dtype) -> None:
    """The experts' grouped GEMMs (float, block-wise FP8, AWQ, W8A16) and the FP8 block GEMM, on a small layer: 4
    experts, 2 per token, hidden 256, each expert's intermediate 128 (the block shapes of larger ones)."""
    from infer.quant import awq

    experts, hidden, inter = 4, 256, 128
    x = torch.randn(3, hidden, dtype=dtype)
    weights, chosen = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 0], [3, 1]])
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.1, torch.randn(experts, hidden, inter) * 0.1
    fused_moe.fused_experts(x, w13.to(dtype), w2.to(dtype), weights, chosen)
    codes13, codes2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    scales = fused_moe.Fp8ExpertScales(torch.ones(experts, 2, 2), torch.ones(experts, 2, 1), (128, 128), (128, 128))
    fused_moe.fused_experts(x, codes13, codes2, weights, chosen, scales)
    fp8_block.w8a8_block_gemm(codes13[0], torch.ones(256, 2), codes13[1], torch.ones(2, 2), (128, 128), dtype)
    packed = [[awq.quantize_rtn(w, 128) for w in stack] for stack in (w13, w2)]
    stacked = [awq_moe.AwqExperts(*(torch.stack([p[i] for p in stack]) for i in range(3)), 128) for stack in packed]
    awq_moe.fused_awq_experts(x, *stacked, weights.to(dtype), chosen)
    ordered = [w._replace(input_order=torch.stack([torch.randperm(w.qweight.shape[1]) for _ in range(experts)]))
               for w in stacked]  # GPTQ experts in activation order
    awq_moe.fused_awq_experts(x, *ordered, weights.to(dtype), chosen)
    int8 = [w8a16_moe.W8A16Experts(torch.randint(0, 256, w.shape, dtype=torch.uint8).transpose(1, 2).contiguous(),
                                   torch.full((experts, w.shape[2] // 128, w.shape[1]), 128, dtype=torch.uint8),
                                   torch.ones(experts, w.shape[2] // 128, w.shape[1], dtype=torch.float16), 128)
            for w in (w13, w2)]  # [E, K, N] codes: the transposes of w13's and w2's shapes
    w8a16_moe.fused_w8a16_experts(x, *int8, weights.to(dtype), chosen)
    ordered8 = [w._replace(input_order=o.input_order) for w, o in zip(int8, ordered)]
    w8a16_moe.fused_w8a16_experts(x, *ordered8, weights.to(dtype), chosen)


def test_every_kernel_compiles_for_sm90_at_the_anchor_shapes() -> None:
    launches: list[dict] = []
    found = kernels()
    for kernel in found.values():
        record(kernel, launches)
    try:
        for dtype in (torch.bfloat16, torch.float16):
            anchor_launches(dtype)
    finally:
        for kernel in found.values():
            kernel.pre_run_hooks.clear()
    for launch in launches:
        if launch["name"] in ("_w8a8_gemm_kernel", "_w8a8_block_gemm_kernel", "_grouped_gemm_kernel"):
            launch["constexprs"]["UPCAST"] = False  # what sm89+ runs (the interpreter takes the upcast path)
    assert {launch["name"] for launch in launches} == set(found), "a kernel has no anchor launch here"
    unique = list({json.dumps(launch, sort_keys=True): launch for launch in launches}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-P", "-c", COMPILE], input=json.dumps(unique), capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
