"""FP8 kernels: dynamic per-token activation quantization, and a W8A8 GEMM with per-row/per-column scales.

Under TRITON_INTERPRET=1 an fp32 -> fp8 cast inside a kernel rounds wrongly, so :func:`per_token_quant` can write
the scaled, clamped fp32 values instead (``out_dtype=torch.float32``) for a test to cast in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX


@triton.jit
def _per_token_quant_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at 65k tokens of 32k features
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    # NaN in, NaN out, as in torch: max.f32 (and tl.max's reduction) returns the operand that is not NaN, which
    # would hide a NaN activation behind finite fp8 values
    row_max = tl.max(amax, axis=0)
    row_max = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), row_max)
    # s = max(amax, MIN_AMAX) / 448, and x / s, both correctly rounded, as torch divides on the CPU (on CUDA torch
    # multiplies by the rounded reciprocal of a Python-float divisor, which can differ in the last bit)
    scale = tl.div_rn(tl.maximum(row_max, MIN_AMAX_C, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=offs < K)


def per_token_quant(x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE, block_k: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (values [M, K] in ``out_dtype``, fp32 scales [M]); its torch reference is
    :func:`~infer.quant.fp8.quantize_per_token`."""
    if x.dim() != 2:
        raise ValueError(f"per_token_quant expects [M, K], got {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    block_k = block_k or min(triton.next_power_of_2(k), 4096)
    _per_token_quant_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0),
                                  FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK_K=block_k)
    return out, scale


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row offsets may pass 2**31
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None],  # [BLOCK_K, BLOCK_N] view of W^T
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # every e4m3 value is exact in fp32, so the products are too
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc * a_scale[:, None] * b_scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def w8a8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, *, block_m: int | None = None, block_n: int = 64, block_k: int = 64
              ) -> torch.Tensor:
    """``(a [M, K] @ b [N, K].T) * a_scale[:, None] * b_scale[None, :]`` with fp8 ``a``/``b`` and fp32 scales.

    ``a_scale`` is [M] or [1] and ``b_scale`` [N] or [1]. Native fp8 dots on sm89+; elsewhere (and in the
    interpreter) the operands are upcast to fp32 first.
    """
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"w8a8_gemm: a is [{m}, {k}] but b is {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    a_scale = a_scale.to(torch.float32).reshape(-1).expand(m).contiguous()
    b_scale = b_scale.to(torch.float32).reshape(-1).expand(n).contiguous()
    native = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 9)
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_gemm_kernel[grid](a, a_scale, b, b_scale, out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=not native)
    return out


def w8a8_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The torch reference of :func:`w8a8_gemm`: exact fp8 products, fp32 accumulation, then the scales."""
    acc = a.to(torch.float32) @ b.to(torch.float32).t()
    return (acc * a_scale.to(torch.float32).reshape(-1, 1) * b_scale.to(torch.float32).reshape(1, -1)).to(out_dtype)
