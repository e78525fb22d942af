"""A GEMM for few rows (decode batches of up to 16): ``x [M, K] @ w[N, K].T``, bandwidth-bound on the weight.

The first GPU run (2026-11-30, docs/PERF.md) timed cuBLAS bf16 at M = 1 on the 1B's MLP shapes at 2.6-2.8 TB/s, about
two thirds of the card's copy bandwidth, and faster at M = 2 than at M = 1. Each program here streams ``BLOCK_N``
weight rows over the whole of K in ``BLOCK_K`` tiles and multiplies them with every row of x at once (rows padded
to 16 for ``tl.dot``; the padding costs no weight bytes). Not used by the engine yet: ``benchmarks/quant_bench.py``
times it against cuBLAS first (``skinny_gemm`` columns, and a tile sweep with ``--awq-sweep``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_mask[:, None] & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_mask[:, None] & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def default_block_n(n: int, num_sms: int) -> int:
    """The widest of 64, 32, 16 weight rows per program that still gives every SM a program or more."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) >= num_sms), 16)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, *, block_n: int | None = None, block_k: int = 256,
                num_sms: int = 132, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` for M <= 16, in x's dtype (fp32 accumulation)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_gemm takes x [M <= {MAX_ROWS}, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_gemm needs x and weight contiguous along K")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = block_n or default_block_n(n, num_sms)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out
