"""Block-wise FP8 kernels: activation quantization per token and group, and the GEMM whose every K-block carries one
scale per row of the activations and one per output block of the weight (torch references in
:mod:`infer.quant.fp8_block`).

Under TRITON_INTERPRET=1 an fp32 -> fp8 cast inside a kernel rounds wrongly, so :func:`per_token_group_quant` can
write the scaled, clamped fp32 values instead (``out_dtype=torch.float32``) for a test to cast in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.errors import ConfigError
from ..quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from ..quant.fp8_block import has_fp8_tensor_cores, k_tile
from .fp8 import per_token_quant


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    amax = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)  # NaN in, NaN out, as torch
    scale = tl.div_rn(tl.maximum(amax, MIN_AMAX_C, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C)
    tl.store(scale_ptr + row * stride_sm + group, scale)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_C,
                   propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def per_token_group_quant(x: torch.Tensor, group: int, out_dtype: torch.dtype = FP8_DTYPE
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (values [M, K] in ``out_dtype``, fp32 scales [M, ceil(K / group)]); its torch reference is
    :func:`~infer.quant.fp8_block.quantize_per_token_group`. One group per row (per-channel experts, per-tensor
    weights) is the per-token kernel's job: it walks K in blocks instead of holding the whole row."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant expects [M, K], got {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    if groups == 1 and m:
        out, scale = per_token_quant(x, out_dtype)
        return out, scale.unsqueeze(1)
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _per_token_group_quant_kernel[(m, groups)](
            x, out, scale, k, x.stride(0), out.stride(0), scale.stride(0), GROUP=group,
            BLOCK=triton.next_power_of_2(group), FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX)
    return out, scale


@triton.jit
def _w8a8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row offsets may pass 2**31
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # so are offs_n * stride_bn at N x K >= 2**31
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP_K: a K-tile lies in one scale group
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None],  # [BLOCK_K, BLOCK_N] view of W^T
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        group_k = k0 // GROUP_K
        a_scale = tl.load(a_scale_ptr + offs_m * stride_asm + group_k, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_ptr + (offs_n // GROUP_N) * stride_bsn + group_k, mask=mask_n, other=0.0)
        if UPCAST:  # the interpreter: every e4m3 value is exact in fp32, so the products are too
            partial = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            partial = tl.dot(a, b)
        acc += partial * a_scale[:, None] * b_scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def checked_k_tile(group_k: int, device: torch.device) -> tuple[int, bool]:
    """(the K-tile for scale groups of ``group_k``, whether the dots are native fp8): ConfigError where the kernels
    cannot run (a GPU below sm89, a group whose power-of-two factor is under the minimum)."""
    native = device.type == "cuda"
    if native and not has_fp8_tensor_cores(device):
        raise ConfigError("the FP8 Triton kernels need a GPU with FP8 tensor cores (sm89+: L4, H100, ...); use "
                          "--plugin-option fp8.backend=emulate")
    tile = k_tile(group_k, native)
    if tile is None:
        raise ConfigError(f"the FP8 Triton GEMMs need each scale group's input side to be a multiple of "
                          f"{32 if native else 16}, got {group_k}; use --plugin-option fp8.backend=emulate")
    return tile, native


def w8a8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    block: tuple[int, int], out_dtype: torch.dtype, *, block_m: int | None = None,
                    block_n: int = 64) -> torch.Tensor:
    """``a`` fp8 [M, K] with scales [M, ceil(K / bk)] times ``b`` fp8 [N, K] with scales [ceil(N / bn),
    ceil(K / bk)], transposed: [M, N] in ``out_dtype``. Native fp8 dots on CUDA (sm89+); in the interpreter the
    operands are upcast to fp32 first."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    groups_k = triton.cdiv(k, bk)
    if b.shape[1] != k or tuple(a_scale.shape) != (m, groups_k) or \
            tuple(b_scale.shape) != (triton.cdiv(n, bn), groups_k):
        raise ValueError(f"w8a8_block_gemm: a {tuple(a.shape)} (scales {tuple(a_scale.shape)}), b {tuple(b.shape)} "
                         f"(scales {tuple(b_scale.shape)}) do not fit blocks of {bn}x{bk}")
    a, b = a.contiguous(), b.contiguous()
    a_scale, b_scale = a_scale.to(torch.float32).contiguous(), b_scale.to(torch.float32).contiguous()
    tile, native = checked_k_tile(bk, a.device)
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w8a8_block_gemm_kernel[grid](
            a, a_scale, b, b_scale, out, m, n, k, a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0),
            out.stride(0), GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tile,
            UPCAST=not native)
    return out
