"""W8A16 experts of a sparse MoE layer (8-bit GPTQ and compressed-tensors checkpoints) as two grouped GEMMs,
dequantization fused: kernels/awq_moe.py's routing and rounding with kernels/w8a16_gemm.py's weights (uint8 codes,
one zero point and scale row per group and K block). Device ops only, so CUDA graphs capture it; the reference is
models/moe.py ``experts_loop`` over each expert's W8A16 Linears.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .awq_gemm import _load_columns, group_k_block
from .awq_moe import fused_weight_only_experts
from .fused_moe import BLOCK_M, TL_DTYPES, _store_rows


class W8A16Experts(NamedTuple):
    """One GEMM's weights for every expert, :mod:`infer.quant.w8a16`'s layout stacked over experts: qweight
    [E, K, N] and qzeros [E, K / group, N] (uint8), scales [E, K / group, N]; ``group_size`` -1 is one group over
    K. ``input_order`` [E, K] (int64), for GPTQ experts in activation order: expert e's weight row k multiplies input
    column ``input_order[e, k]``."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    input_order: torch.Tensor | None = None


@triton.jit
def _grouped_w8a16_kernel(a_ptr, qw_ptr, qz_ptr, s_ptr, c_ptr, scale_ptr, rows_ptr, block_expert_ptr, order_ptr,
                          num_rows, N, K, group_size, stride_am, stride_qe, stride_qk, stride_ze, stride_zg,
                          stride_se, stride_sg, stride_cm, A_ROW_DIV: tl.constexpr, HAS_SCALE: tl.constexpr,
                          ROUND_TO: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[row] = a[row // A_ROW_DIV] @ dequant(expert's weights) (x scale[row]) for the rows of this block, all of
    one expert; padding rows hold num_rows and write nothing. A K block lies in one group. HAS_ORDER: weight row k
    meets a's column order[expert, k]."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < num_rows
        a_rows = rows // A_ROW_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        qw_base = qw_ptr + expert * stride_qe
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = _load_columns(a_ptr, a_rows, stride_am, 1, offs_k, valid, mask_k, order_ptr + expert * K, HAS_ORDER)
            q = tl.load(qw_base + offs_k[:, None] * stride_qk + offs_n[None, :],
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
            group = k0 // group_size
            z = tl.load(qz_ptr + expert * stride_ze + group * stride_zg + offs_n, mask=mask_n, other=0)
            s = tl.load(s_ptr + expert * stride_se + group * stride_sg + offs_n, mask=mask_n, other=0.0)
            w = q.to(a.dtype) - z.to(a.dtype)[None, :]  # exact: integers within 255 of 0
            if a.dtype == tl.float32:
                acc += tl.dot(a, w, input_precision="ieee") * s.to(tl.float32)[None, :]
            else:
                acc += tl.dot(a, w) * s.to(tl.float32)[None, :]
        _store_rows(acc, c_ptr, scale_ptr, rows, valid, offs_n, mask_n, stride_cm, HAS_SCALE, ROUND_TO)


def grouped_w8a16_gemm(a: torch.Tensor, w: W8A16Experts, rows: torch.Tensor, block_expert: torch.Tensor,
                       num_rows: int, a_row_div: int, scale: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, block_n: int = 64) -> torch.Tensor:
    """[num_rows, N]: row r = a[r // a_row_div] @ dequant(w[e]) (x scale[r], after rounding the product to a's
    dtype), e the expert of r's block (:func:`~infer.kernels.fused_moe.sort_by_expert`)."""
    k, n = w.qweight.shape[1], w.qweight.shape[2]
    c = torch.empty(num_rows, n, dtype=out_dtype or a.dtype, device=a.device)
    group = k if w.group_size == -1 else w.group_size
    block_k = group_k_block(group, k, 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    order = w.input_order
    _grouped_w8a16_kernel[grid](
        a, w.qweight, w.qzeros, w.scales, c, scale if scale is not None else c, rows, block_expert,
        order if order is not None else rows, num_rows, n, k, group, a.stride(0), w.qweight.stride(0),
        w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1), w.scales.stride(0), w.scales.stride(1),
        c.stride(0), A_ROW_DIV=a_row_div, HAS_SCALE=scale is not None, ROUND_TO=TL_DTYPES[a.dtype],
        HAS_ORDER=order is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_w8a16_experts(x: torch.Tensor, w13: W8A16Experts, w2: W8A16Experts, weights: torch.Tensor,
                        experts: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 (gate's output columns, then up's: [E, H, 2I]), w2 ([E, I, H]), the router's top-k ``weights``
    and ``experts`` [T, k] -> [T, H]: sum over k of weight x down(silu(gate(x)) * up(x))."""
    return fused_weight_only_experts(x, w13, w2, weights, experts, grouped_w8a16_gemm)
