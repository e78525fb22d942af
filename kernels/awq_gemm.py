"""W4A16 GEMM for AutoAWQ GEMM-layout weights, dequantization fused: ``x [M, K] @ dequant(W) [K, N] -> [M, N]``.

Meant for small M (decode). Each program owns a BLOCK_M x BLOCK_N output tile and walks K (optionally one of
SPLIT_K slices of it, reduced with atomics into an fp32 buffer). The packed qweight tile [BLOCK_K, BLOCK_N / 8] is
unpacked by shifts into [BLOCK_K, BLOCK_N] columns in *nibble order*: tile column ``c * 8 + i`` is output column
``c * 8 + AWQ_ORDER[i]``. Zeros unpack the same way; scales are loaded, and the output stored, at the permuted
column indices, so the kernel never reorders nibbles.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant.awq import dequantize


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_zg, stride_sg, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACKED_N: tl.constexpr = BLOCK_N // 8

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_n * PACKED_N + tl.arange(0, PACKED_N)  # packed columns
    nibble = tl.arange(0, 8)
    shifts = nibble * 4
    # nibble i of a packed column holds output column 8c + order[i], order = [0, 2, 4, 6, 1, 3, 5, 7]
    order = (nibble % 4) * 2 + nibble // 4
    offs_n = tl.reshape(offs_p[:, None] * 8 + order[None, :], (BLOCK_N,))  # output column of each tile column
    mask_m = offs_m < M
    mask_p = offs_p < N // 8
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_p[None, :]
        qw = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_p[None, :], mask=mask_w, other=0)
        group = offs_k // group_size
        qz = tl.load(qz_ptr + group[:, None] * stride_zg + offs_p[None, :], mask=mask_w, other=0)
        s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        q = tl.reshape((qw[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        z = tl.reshape((qz[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        w = (q - z).to(tl.float32) * s
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:  # one of several K slices: sum into the fp32 buffer
        tl.atomic_add(out_ptrs, acc, mask=mask_out)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def _auto_split_k(x: torch.Tensor, tiles: int, k: int, block_k: int) -> int:
    """On CUDA, split K until there are about two programs per SM (decode has few output tiles); else 1."""
    if not x.is_cuda:
        return 1
    return max(1, min(triton.cdiv(2 * _sm_count(x.device.index or 0), tiles), k // (4 * block_k), 16))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count  # asked once, not per layer call


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             *, block_m: int | None = None, block_n: int = 64, block_k: int = 64, split_k: int | None = None
             ) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight, qzeros, scales) -> [M, N]`` in x's dtype (fp32, fp16 or bf16).

    ``group_size`` -1 means one group over all of K. ``block_n`` must be a multiple of 8 and at least 16;
    ``split_k > 1`` splits K across programs and sums into an fp32 buffer (None: chosen from the SM count).
    """
    if x.dim() != 2:
        raise ValueError(f"awq_gemm expects x of shape [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[1] * 8
    if qweight.shape[0] != k:
        raise ValueError(f"x has K={k} but qweight has {qweight.shape[0]} input rows")
    group = k if group_size == -1 else group_size
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if split_k is None:
        split_k = _auto_split_k(x, triton.cdiv(m, block_m) * triton.cdiv(n, block_n), k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out,
        m, n, k, group, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=split_k > 1, DOT_FP32=x.dtype == torch.float32,
    )
    return out.to(x.dtype) if split_k > 1 else out


def awq_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """The torch reference: dequantize to x's dtype, then matmul (accumulating in fp32)."""
    w = dequantize(qweight, qzeros, scales, group_size, dtype=x.dtype).to(torch.float32)
    return (x.to(torch.float32) @ w).to(x.dtype)
