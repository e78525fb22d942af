"""W8A16 GEMM, dequantization fused: ``x [M, K] @ dequant(W) [K, N] -> [M, N]`` for :mod:`infer.quant.w8a16`
weights (uint8 codes [K, N], uint8 zero points and float scales per group of K rows).

Meant for small M (decode), where the GEMM is bound by reading the K * N bytes of codes once. Each program owns a
BLOCK_M x BLOCK_N output tile and walks K (or one of SPLIT_K slices of it, summed with atomics into an fp32 buffer),
as :mod:`.awq_gemm` does. A K block lies in one group (BLOCK_K divides the group size, or one group spans K), so
it loads one zero and one scale row and scales the [BLOCK_M, BLOCK_N] partial product, not the weight tile;
``q - z`` (-255..255) is exact in fp16, bf16 and fp32, so the MMA runs on exact integers in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.w8a16 import dequantize
from .awq_gemm import _load_columns, check_order, plan_gemm


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, order_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_zg, stride_sg, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = _load_columns(x_ptr, offs_m, stride_xm, stride_xk, offs_k, mask_m, mask_k, order_ptr, HAS_ORDER)
        q = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :],
                    other=0)
        group = k0 // group_size
        z = tl.load(qz_ptr + group * stride_zg + offs_n, mask=mask_n, other=0)
        s = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = q.to(x.dtype) - z.to(x.dtype)[None, :]  # exact: integers within 255 of 0
        if x.dtype == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee") * s[None, :]
        else:
            acc += tl.dot(x, w) * s[None, :]

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:  # one of several K slices: sum into the fp32 buffer
        tl.atomic_add(out_ptrs, acc, mask=mask_out)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, *, input_order: torch.Tensor | None = None, block_m: int | None = None,
               block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int = 4) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight, qzeros, scales) -> [M, N]`` in x's dtype (fp32, fp16 or bf16); with
    ``input_order`` [K] (GPTQ's activation order), ``x[:, input_order] @ dequant(...)``, gathered as x loads.

    ``group_size`` -1 means one group over all of K. Blocks are powers of two >= 16 (None: 16 x 128 x 128 for
    M <= 16, else up to 64 x 64 x 64, block_k lowered to a smaller group size; a given block_k must divide the group
    size); ``split_k > 1`` splits K across programs (None: :func:`~.awq_gemm.auto_split_k` on CUDA, else 1).
    """
    if x.dim() != 2:
        raise ValueError(f"w8a16_gemm expects x of shape [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] != k or qweight.dtype != torch.uint8:
        raise ValueError(f"x has K={k}; qweight must be uint8 [K, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if m == 0:
        return x.new_empty((0, n))
    group = k if group_size == -1 else group_size
    plan = plan_gemm(x, n, group, block_m, block_n, block_k, split_k)
    if group % plan.block_k and group < k:
        raise ValueError(f"block_k {plan.block_k} must divide the group size {group}")
    out = plan.output(x, n)
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    _w8a16_gemm_kernel[plan.grid(m, n)](
        x, qweight, qzeros, scales, out, check_order(input_order, k, x), m, n, k, group, plan.k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, ATOMIC=plan.split_k > 1,
        HAS_ORDER=input_order is not None, num_warps=num_warps,
    )
    return out.to(x.dtype)


@triton.jit
def _w8a16_dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, K, N, group_size, stride_qk, stride_zg, stride_sg,
                          stride_ok, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[k, n] = (q - z) * s for one [BLOCK_K, BLOCK_N] tile in fp32 (exact for fp16/bf16 scales), then out's
    dtype."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    group = offs_k // group_size
    q = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    z = tl.load(qz_ptr + group[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], ((q - z) * s).to(out_ptr.dtype.element_ty),
             mask=mask)


def w8a16_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """:func:`~infer.quant.w8a16.dequantize` as one Triton kernel (the same values, bit for bit): the large-batch
    path of a W8A16 linear on CUDA, with no fp32 copy of the whole weight on the way."""
    if qweight.dtype != torch.uint8 or qzeros.dtype != torch.uint8:
        raise ValueError(f"w8a16_dequantize needs uint8 codes and zero points, got {qweight.dtype}, {qzeros.dtype}")
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    k, n = qweight.shape
    group = k if group_size == -1 else group_size
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _w8a16_dequant_kernel[grid](qweight, qzeros, scales, out, k, n, group, qweight.stride(0), qzeros.stride(0),
                                scales.stride(0), out.stride(0), BLOCK_K=block_k, BLOCK_N=block_n)
    return out


def w8a16_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int, input_order: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: gather x's columns (``input_order``), dequantize to x's dtype, then matmul (accumulating
    in fp32)."""
    x = x if input_order is None else x[:, input_order]
    w = dequantize(qweight, qzeros, scales, group_size, dtype=x.dtype).to(torch.float32)
    return (x.to(torch.float32) @ w).to(x.dtype)
