"""AWQ (W4A16) experts of a sparse MoE layer as two grouped GEMMs, dequantization fused: the int4 counterpart of
kernels/fused_moe.py (same routing by :func:`~infer.kernels.fused_moe.sort_by_expert`, same rounding points), each
K block dequantized as kernels/awq_gemm.py does it. Device ops only, so CUDA graphs capture it; the reference is
models/moe.py ``experts_loop`` over each expert's AWQ Linears.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from .awq_gemm import _dequant_dot, _load_columns, group_k_block
from .fused_moe import BLOCK_M, TL_DTYPES, _store_rows, sort_by_expert
from .fused_ops import silu_and_mul


class AwqExperts(NamedTuple):
    """One GEMM's weights for every expert, in the AutoAWQ GEMM layout stacked over experts: qweight
    [E, K, N / 8] and qzeros [E, K / group, N / 8] (int32), scales [E, K / group, N]; ``group_size`` -1 is one group
    over K. ``input_order`` [E, K] (int64), for GPTQ experts in activation order: expert e's weight row k multiplies
    input column ``input_order[e, k]``."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    input_order: torch.Tensor | None = None


@triton.jit
def _grouped_awq_kernel(a_ptr, qw_ptr, qz_ptr, s_ptr, c_ptr, scale_ptr, rows_ptr, block_expert_ptr, order_ptr,
                        num_rows, N, K, group_size, stride_am, stride_qe, stride_qk, stride_ze, stride_zg, stride_se,
                        stride_sg, stride_cm, A_ROW_DIV: tl.constexpr, HAS_SCALE: tl.constexpr,
                        ROUND_TO: tl.constexpr, PER_GROUP: tl.constexpr, HAS_ORDER: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[row] = a[row // A_ROW_DIV] @ dequant(expert's weights) (x scale[row]) for the rows of this block, all of
    one expert; padding rows hold num_rows and write nothing. HAS_ORDER: weight row k meets a's column
    order[expert, k]."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        PACKED_N: tl.constexpr = BLOCK_N // 8
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < num_rows
        a_rows = rows // A_ROW_DIV
        offs_p = tl.program_id(1) * PACKED_N + tl.arange(0, PACKED_N)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_p = offs_p < N // 8
        mask_n = offs_n < N
        qw_base = qw_ptr + expert * stride_qe
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = _load_columns(a_ptr, a_rows, stride_am, 1, offs_k, valid, mask_k, order_ptr + expert * K, HAS_ORDER)
            qw = tl.load(qw_base + offs_k[:, None] * stride_qk + offs_p[None, :],
                         mask=mask_k[:, None] & mask_p[None, :], other=0)
            acc += _dequant_dot(a, qw, qz_ptr + expert * stride_ze, s_ptr + expert * stride_se, k0, offs_k, mask_k,
                                offs_p, mask_p, offs_n, mask_n, group_size, stride_zg, stride_sg, BLOCK_K, BLOCK_N,
                                PER_GROUP)
        _store_rows(acc, c_ptr, scale_ptr, rows, valid, offs_n, mask_n, stride_cm, HAS_SCALE, ROUND_TO)


def grouped_awq_gemm(a: torch.Tensor, w: AwqExperts, rows: torch.Tensor, block_expert: torch.Tensor, num_rows: int,
                     a_row_div: int, scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     block_n: int = 64) -> torch.Tensor:
    """[num_rows, N]: row r = a[r // a_row_div] @ dequant(w[e]) (x scale[r], after rounding the product to a's
    dtype), e the expert of r's block (:func:`~infer.kernels.fused_moe.sort_by_expert`)."""
    k, n = w.qweight.shape[1], w.qweight.shape[2] * 8
    c = torch.empty(num_rows, n, dtype=out_dtype or a.dtype, device=a.device)
    group = k if w.group_size == -1 else w.group_size
    block_k = group_k_block(group, k, 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    order = w.input_order
    _grouped_awq_kernel[grid](
        a, w.qweight, w.qzeros, w.scales, c, scale if scale is not None else c, rows, block_expert,
        order if order is not None else rows, num_rows, n, k, group, a.stride(0), w.qweight.stride(0),
        w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1), w.scales.stride(0), w.scales.stride(1),
        c.stride(0), A_ROW_DIV=a_row_div, HAS_SCALE=scale is not None, ROUND_TO=TL_DTYPES[a.dtype],
        PER_GROUP=group % block_k == 0 or group >= k, HAS_ORDER=order is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_awq_experts(x: torch.Tensor, w13: AwqExperts, w2: AwqExperts, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 (gate's output columns, then up's: [E, H, 2I / 8] packed), w2 ([E, I, H / 8]), the router's
    top-k ``weights`` and ``experts`` [T, k] -> [T, H]: sum over k of weight x down(silu(gate(x)) * up(x))."""
    return fused_weight_only_experts(x, w13, w2, weights, experts, grouped_awq_gemm)


class GroupedGemm(Protocol):
    def __call__(self, a: torch.Tensor, w: Any, rows: torch.Tensor, block_expert: torch.Tensor, num_rows: int,
                 a_row_div: int, scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor: ...


def fused_weight_only_experts(x: torch.Tensor, w13: Any, w2: Any, weights: torch.Tensor, experts: torch.Tensor,
                              grouped_gemm: GroupedGemm) -> torch.Tensor:
    """The two grouped GEMMs of weight-only quantized experts (AWQ's, or kernels/w8a16_moe.py's), w13 and w2 the
    ``grouped_gemm``'s weights: sum over k of weight x down(silu(gate(x)) * up(x))."""
    if x.stride(-1) != 1 or any(t is not None and not t.is_contiguous() for w in (w13, w2) for t in w[:3] + w[4:]):
        raise ValueError("the fused experts need x with a contiguous last dimension and contiguous expert tensors")
    tokens, top_k = experts.shape
    size = w2.qweight.shape[1]
    rows, block_expert = sort_by_expert(experts, w13.qweight.shape[0])
    hidden = grouped_gemm(x, w13, rows, block_expert, tokens * top_k, top_k)
    act = silu_and_mul(hidden[:, :size], hidden[:, size:])
    flat_weights = weights.reshape(-1).contiguous()
    # each pair's weighted output rounded to x's dtype before the pairs add up, as HF's loop (and experts_loop)
    # rounds it before its index_add_, whatever the routing weights' dtype (Mixtral's are float32)
    y = grouped_gemm(act, w2, rows, block_expert, tokens * top_k, 1, flat_weights, x.dtype)
    return y.view(tokens, top_k, y.shape[1]).sum(dim=1)
