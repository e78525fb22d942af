"""W4A16 GEMM for AutoAWQ GEMM-layout weights, dequantization fused: ``x [M, K] @ dequant(W) [K, N] -> [M, N]``.

Meant for small M (decode), where the GEMM is bound by reading the K * N / 2 bytes of int4 weights once. Each
program owns a BLOCK_M x BLOCK_N output tile and walks K (or one of SPLIT_K slices of it, summed with atomics into an
fp32 buffer). What keeps the work beside the weight stream small:

- Per-group path (``group % BLOCK_K == 0``, or one group over K): a K block lies in one group, so it loads one scale
  row [BLOCK_N] and one packed zero row [BLOCK_N / 8], and scales the [BLOCK_M, BLOCK_N] partial product, not the
  [BLOCK_K, BLOCK_N] weight tile. Other group sizes (e.g. 32 with BLOCK_K 64) gather per K row, as a fallback.
- Each thread unpacks whole int32 words with shifts and ``tl.join`` straight into output-column order, so on the
  per-group path the dequantized tile goes to shared memory (on its way to the MMA) in 16-byte stores (in the PTX
  Triton 3.9 emits for sm_90). A nibble becomes a float by OR-ing it into the mantissa of b = 1024 (fp16), 128
  (bf16) or 2**23 (fp32); b cancels in the exact ``q - z``, and no int-to-float conversion (a fraction of the FMA
  rate) runs per weight.
- Decode tiles are 128 x 128 (8 KB of int4 per iteration). Split-K aims at four programs per SM, about one resident
  wave, so that every SM streams weights; it is capped by the K blocks and by keeping the fp32 partial sums
  (M * N * 4 bytes per split) under a quarter of the weight bytes. ``benchmarks/quant_bench.py --awq-sweep`` times
  the alternatives.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant.awq import dequantize


@triton.jit
def _nibbles(q, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr):
    """Packed int32 q [ROWS, COLS / 8] -> [ROWS, COLS] in DTYPE, in output-column order: each nibble + b, exactly."""
    # column 8c + 4w + 2v + u is picked by the inner (w), middle (v) and outer (u) join; output column j of a word
    # sits in nibble (j >> 1) + 4 * (j & 1), so the inner joins pair nibbles 2 apart, the middle 1, the outer 4
    a = tl.join(tl.join(q & 0xF, (q >> 8) & 0xF), tl.join((q >> 4) & 0xF, (q >> 12) & 0xF))
    b = tl.join(tl.join((q >> 16) & 0xF, (q >> 24) & 0xF), tl.join((q >> 20) & 0xF, (q >> 28) & 0xF))
    nib = tl.reshape(tl.join(a, b), (ROWS, COLS))
    if DTYPE == tl.float16:
        return (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    elif DTYPE == tl.bfloat16:
        return (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (nib | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_dot(x, qw, qz_ptr, s_ptr, k0, offs_k, mask_k, offs_p, mask_p, offs_n, mask_n, group_size, stride_zg,
                 stride_sg, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PER_GROUP: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ the dequantized K block of packed qw [BLOCK_K, BLOCK_N / 8] (rows offs_k, packed
    columns offs_p; zeros and scales at qz_ptr and s_ptr, row stride per group) -> [BLOCK_M, BLOCK_N] in fp32."""
    DTYPE: tl.constexpr = x.dtype
    if PER_GROUP:  # one scale and zero row for the block, applied to the partial product
        group = k0 // group_size
        qz = tl.load(qz_ptr + group * stride_zg + offs_p, mask=mask_p, other=0)
        s = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = _nibbles(qw, BLOCK_K, BLOCK_N, DTYPE) - _nibbles(qz[None, :], 1, BLOCK_N, DTYPE)  # q - z, exact
        if DTYPE == tl.float32:
            partial = tl.dot(x, w, input_precision="ieee") * s[None, :]
        else:
            partial = tl.dot(x, w) * s[None, :]
    else:
        group = offs_k // group_size
        qz = tl.load(qz_ptr + group[:, None] * stride_zg + offs_p[None, :],
                     mask=mask_k[:, None] & mask_p[None, :], other=0)
        s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        w = (_nibbles(qw, BLOCK_K, BLOCK_N, tl.float32) - _nibbles(qz, BLOCK_K, BLOCK_N, tl.float32)) * s
        if DTYPE == tl.float32:
            partial = tl.dot(x, w, input_precision="ieee")
        else:
            partial = tl.dot(x, w.to(DTYPE))
    return partial


@triton.jit
def _load_columns(ptr, rows, row_stride, col_stride, offs_k, mask_rows, mask_k, order_ptr, HAS_ORDER: tl.constexpr):
    """ptr[rows, cols] for the K block ``offs_k``: cols = order[offs_k] (GPTQ's activation order: weight row k
    multiplies input column order[k]), or offs_k itself; masked lanes read 0."""
    if HAS_ORDER:
        cols = tl.load(order_ptr + offs_k, mask=mask_k, other=0)
    else:
        cols = offs_k
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride,
                   mask=mask_rows[:, None] & mask_k[None, :], other=0.0)


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, order_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_zg, stride_sg, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_GROUP: tl.constexpr, ATOMIC: tl.constexpr, HAS_ORDER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACKED_N: tl.constexpr = BLOCK_N // 8

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_n * PACKED_N + tl.arange(0, PACKED_N)  # packed columns
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_p = offs_p < N // 8
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = _load_columns(x_ptr, offs_m, stride_xm, stride_xk, offs_k, mask_m, mask_k, order_ptr, HAS_ORDER)
        qw = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_p[None, :], mask=mask_k[:, None] & mask_p[None, :],
                     other=0)
        acc += _dequant_dot(x, qw, qz_ptr, s_ptr, k0, offs_k, mask_k, offs_p, mask_p, offs_n, mask_n, group_size,
                            stride_zg, stride_sg, BLOCK_K, BLOCK_N, PER_GROUP)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:  # one of several K slices: sum into the fp32 buffer
        tl.atomic_add(out_ptrs, acc, mask=mask_out)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def auto_split_k(m: int, tiles: int, k: int, block_k: int, sms: int) -> int:
    """K slices for ``tiles`` output tiles on ``sms`` SMs: about four programs per SM, at most one slice per K block
    and 32 in all, and fp32 partial sums (M * N * 4 bytes per slice) under a quarter of the weights' K * N / 2."""
    return max(1, min(triton.cdiv(4 * sms, tiles), triton.cdiv(k, block_k), k // (32 * m), 32))


def group_k_block(group: int, k: int, largest: int) -> int:
    """The largest K block (a power of two, 16 to ``largest``) that a group holds whole, so that the per-group path
    runs (group 32 or 64 checkpoints too)."""
    return next(b for b in (128, 64, 32, 16) if b <= largest and (group % b == 0 or group >= k))


@dataclass(frozen=True)
class GemmPlan:
    """The tiles and K slices of one weight-only GEMM launch (awq_gemm's, w8a16_gemm's)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int  # whole K blocks, so that a block lies in one group

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n), self.split_k

    def output(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Where the kernel writes: x's dtype, or with K slices an fp32 buffer they sum into atomically."""
        if self.split_k > 1:
            return torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)
        return torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)


def plan_gemm(x: torch.Tensor, n: int, group: int, block_m: int | None, block_n: int | None, block_k: int | None,
              split_k: int | None) -> GemmPlan:
    """The given blocks and split, the rest by default: 16 x 128 x 128 for M <= 16, else up to 64 x 64 x 64,
    block_k lowered to a smaller group size; split_k from :func:`auto_split_k` on CUDA, else 1."""
    m, k = x.shape
    block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    block_n = block_n or (128 if m <= 16 else 64)
    block_k = block_k or group_k_block(group, k, 128 if m <= 16 else 64)
    if split_k is None:  # on CUDA from the SM count, elsewhere 1
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split_k = auto_split_k(m, tiles, k, block_k, _sm_count(x.device.index or 0)) if x.is_cuda else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return GemmPlan(block_m, block_n, block_k, triton.cdiv(k, k_per_split), k_per_split)


def check_order(input_order: torch.Tensor | None, k: int, x: torch.Tensor) -> torch.Tensor:
    """The ``input_order`` a GEMM kernel gathers x's columns by (None: x itself, a pointer the kernel never reads)."""
    if input_order is None:
        return x
    if input_order.shape != (k,) or input_order.dtype not in (torch.int32, torch.int64) or \
            input_order.device != x.device:
        raise ValueError(f"input_order must be an int32/int64 [{k}] tensor on {x.device}, got {input_order.dtype} "
                         f"{tuple(input_order.shape)} on {input_order.device}")
    return input_order.contiguous()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count  # asked once, not per layer call


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             *, input_order: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
             block_k: int | None = None, split_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight, qzeros, scales) -> [M, N]`` in x's dtype (fp32, fp16 or bf16); with
    ``input_order`` [K] (GPTQ's activation order), ``x[:, input_order] @ dequant(...)``, gathered as x loads.

    ``group_size`` -1 means one group over all of K. Blocks are powers of two, ``block_n`` and ``block_k`` >= 16
    (None: 128 x 128 for M <= 16, else 64 x 64, block_k lowered to a smaller group size); ``split_k > 1`` splits
    K across programs and sums into an fp32 buffer (None: :func:`auto_split_k` on CUDA, else 1).
    """
    if x.dim() != 2:
        raise ValueError(f"awq_gemm expects x of shape [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[1] * 8
    if qweight.shape[0] != k:
        raise ValueError(f"x has K={k} but qweight has {qweight.shape[0]} input rows")
    if m == 0:
        return x.new_empty((0, n))
    group = k if group_size == -1 else group_size
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    plan = plan_gemm(x, n, group, block_m, block_n, block_k, split_k)
    out = plan.output(x, n)
    _awq_gemm_kernel[plan.grid(m, n)](
        x, qweight, qzeros, scales, out, check_order(input_order, k, x),
        m, n, k, group, plan.k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        PER_GROUP=group % plan.block_k == 0 or group >= k, ATOMIC=plan.split_k > 1,
        HAS_ORDER=input_order is not None, num_warps=num_warps,
    )
    return out.to(x.dtype)


@triton.jit
def _dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, K, N, group_size, stride_qk, stride_zg, stride_sg, stride_ok,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[k, n] = (q - z) * s for one [BLOCK_K, BLOCK_N] tile: exact in fp32 (a nibble difference times an fp16
    scale), rounded once to out's dtype."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_p = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k, mask_p, mask_n = offs_k < K, offs_p < N // 8, offs_n < N
    group = offs_k // group_size
    packed = mask_k[:, None] & mask_p[None, :]
    qw = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_p[None, :], mask=packed, other=0)
    qz = tl.load(qz_ptr + group[:, None] * stride_zg + offs_p[None, :], mask=packed, other=0)
    s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :],
                other=0.0).to(tl.float32)
    w = (_nibbles(qw, BLOCK_K, BLOCK_N, tl.float32) - _nibbles(qz, BLOCK_K, BLOCK_N, tl.float32)) * s
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_k[:, None] & mask_n[None, :])


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """:func:`~infer.quant.awq.dequantize` as one Triton kernel (the same values, bit for bit): the large-batch
    path of a W4A16 linear on CUDA, which reads each packed weight once instead of running a chain of elementwise
    ops over int32 and float32 copies of the whole weight."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if group_size == -1 else group_size
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_kernel[grid](qweight, qzeros, scales, out, k, n, group, qweight.stride(0), qzeros.stride(0),
                          scales.stride(0), out.stride(0), BLOCK_K=block_k, BLOCK_N=block_n)
    return out


def awq_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, input_order: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: gather x's columns (``input_order``), dequantize to x's dtype, then matmul (accumulating
    in fp32)."""
    x = x if input_order is None else x[:, input_order]
    w = dequantize(qweight, qzeros, scales, group_size, dtype=x.dtype).to(torch.float32)
    return (x.to(torch.float32) @ w).to(x.dtype)
