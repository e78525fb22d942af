"""The experts of a sparse MoE layer as two grouped GEMMs (the reference is models/moe.py ``experts_loop``).

Each (token, k) pair routed to expert e is a row of e's GEMM. The pairs are sorted by expert and each expert's run
padded to a multiple of BLOCK_M, so that a block of rows shares one expert's weights; all of it with device ops
whose shapes depend on the batch size only (no host sync: CUDA graphs capture it). Grid rows past the padded total
are idle.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fused_ops import silu_and_mul

BLOCK_M = 16


class Fp8ExpertScales(NamedTuple):
    """The scales of e4m3 experts: w13's [E, 2I / bn, ceil(H / bk)] over blocks ``block13`` (bn, bk), w2's over
    ``block2``; each GEMM's input is quantized per token and group of its block's bk."""

    w13: torch.Tensor
    w2: torch.Tensor
    block13: tuple[int, int]
    block2: tuple[int, int]


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, rows_ptr, block_expert_ptr, a_scale_ptr, b_scale_ptr,
                         num_rows, N, K, stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse,
                         stride_bsn, A_ROW_DIV: tl.constexpr, HAS_SCALE: tl.constexpr, ROUND_TO: tl.constexpr,
                         PRECISION: tl.constexpr, FP8_BLOCKS: tl.constexpr, UPCAST: tl.constexpr,
                         GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[row] = a[row // A_ROW_DIV] @ b[expert].T (x scale[row]) for the rows of this block, all of one expert;
    padding rows hold num_rows and write nothing. FP8_BLOCKS: a and b are e4m3 and each K-tile's product is
    scaled by a_scale[a row, k group] and b_scale[expert, n group, k group] (BLOCK_K divides GROUP_K)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < num_rows
        a_rows = rows // A_ROW_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                        other=0.0)
            b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] of b[expert].T
            if FP8_BLOCKS:
                if UPCAST:  # the interpreter: every e4m3 value is exact in fp32, so the products are too
                    partial = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    partial = tl.dot(a, b)
                a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // GROUP_K, mask=valid, other=0.0)
                b_scale = tl.load(b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn + k0 // GROUP_K,
                                  mask=mask_n, other=0.0)
                acc += partial * a_scale[:, None] * b_scale[None, :]
            else:
                acc += tl.dot(a, b, input_precision=PRECISION)
        _store_rows(acc, c_ptr, scale_ptr, rows, valid, offs_n, mask_n, stride_cm, HAS_SCALE, ROUND_TO)


@triton.jit
def _store_rows(acc, c_ptr, scale_ptr, rows, valid, offs_n, mask_n, stride_cm, HAS_SCALE: tl.constexpr,
                ROUND_TO: tl.constexpr):
    """Store a block's valid rows of c; HAS_SCALE: the expert's output first rounded to ROUND_TO (as torch's GEMM
    or the expert's Linear returns it), then times its row's routing weight."""
    if HAS_SCALE:
        acc = acc.to(ROUND_TO).to(tl.float32)
        acc *= tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert): the (token, k) pair indices grouped by expert, each group padded with the sentinel
    T x K to a multiple of ``block_m``; and each block's expert (-1: past the padded total)."""
    flat = experts.flatten()
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(
        0, flat, torch.ones_like(flat))  # bincount would read the largest id back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start, padded_start = torch.cumsum(counts, 0) - counts, padded_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    slot = padded_start[sorted_experts] + torch.arange(num_pairs, device=device) - start[sorted_experts]
    capacity = num_pairs + num_experts * (block_m - 1)  # the most any routing pads to
    capacity = (capacity + block_m - 1) // block_m * block_m
    rows = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device).index_copy_(0, slot, order)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_starts < padded_end[-1], block_expert, -1)
    return rows, block_expert


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, num_rows: int,
                 a_row_div: int, scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
    """[num_rows, N]: row r = a[r // a_row_div] @ b[e].T (x scale[r], after rounding the product to ``round_to``,
    default a's dtype, or c's when fp8), e the expert of r's block. ``fp8`` (a_scale [rows of a, K groups],
    b_scale [E, N groups, K groups], (bn, bk)): a and b are e4m3 with block scales."""
    n, k = b.shape[1], b.shape[2]
    c = torch.empty(num_rows, n, dtype=out_dtype or a.dtype, device=a.device)
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    a_scale, b_scale, (group_n, group_k) = fp8 if fp8 is not None else (c, c, (1, 1))
    native = False
    if fp8 is not None:
        from .fp8_block import checked_k_tile

        tile, native = checked_k_tile(group_k, a.device)
        block_k = min(64, tile)
    round_to = round_to or (c.dtype if fp8 is not None else a.dtype)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, scale if scale is not None else c, rows, block_expert, a_scale, b_scale, num_rows, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), a_scale.stride(0), b_scale.stride(0),
        b_scale.stride(1) if fp8 is not None else 0, A_ROW_DIV=a_row_div, HAS_SCALE=scale is not None,
        ROUND_TO=TL_DTYPES[round_to], PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8_BLOCKS=fp8 is not None, UPCAST=not native, GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor, fp8: Fp8ExpertScales | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate's rows, then up's), w2 [E, H, I], the router's top-k ``weights`` and
    ``experts`` [T, k] -> [T, H]: sum over k of weight x down(silu(gate(x)) * up(x)) of the token's k experts.
    ``fp8``: e4m3 experts, as :class:`~infer.models.moe.SparseMoe` emulates them."""
    if any(t.stride(-1) != 1 for t in (x, w13, w2)):
        raise ValueError("fused_experts needs x, w13 and w2 with a contiguous last dimension")
    tokens, top_k = experts.shape
    size = w2.shape[2]
    rows, block_expert = sort_by_expert(experts, w13.shape[0])
    a, scales_13, scales_2 = x, None, None
    if fp8 is not None:
        from .fp8_block import per_token_group_quant

        a, a_scale = per_token_group_quant(x, fp8.block13[1])
        scales_13 = (a_scale, fp8.w13, fp8.block13)
    hidden = grouped_gemm(a, w13, rows, block_expert, tokens * top_k, top_k, out_dtype=x.dtype, fp8=scales_13)
    act = silu_and_mul(hidden[:, :size], hidden[:, size:])
    if fp8 is not None:
        act, act_scale = per_token_group_quant(act, fp8.block2[1])
        scales_2 = (act_scale, fp8.w2, fp8.block2)
    flat_weights = weights.reshape(-1).contiguous()
    # each pair's weighted output rounded to x's dtype before the pairs add up, as HF's loop (and experts_loop)
    # rounds it before its index_add_, whatever the routing weights' dtype (Mixtral's are float32)
    y = grouped_gemm(act, w2, rows, block_expert, tokens * top_k, 1, flat_weights, x.dtype, fp8=scales_2,
                     round_to=x.dtype)
    return y.view(tokens, top_k, y.shape[1]).sum(dim=1)
