"""Small fused ops (RMSNorm + residual, Gemma's too, neox rotary, SiLU- and GELU(tanh)-and-mul) with the signatures
of their torch references, ``rms_norm``, ``gemma_rms_norm``, ``apply_rotary``, ``silu_and_mul`` and
``gelu_tanh_and_mul`` in models/layers.py (``triton_ops()`` there bundles these).

The kernels round intermediates to the activation dtype exactly where the references do, so half-precision results
match them to the last bit up to fp32 rounding order (and, for GELU, its algebraic form: g / (1 + e^-2y)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, cols] with a contiguous last dim (copying only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ---------------------------------------------------------------- RMSNorm (+ residual)
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ROUND_NORMED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_out_ptr.dtype.element_ty)  # torch adds in the activation dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    if ROUND_NORMED:  # Llama's norm rounds the normed value before the weight multiply; Gemma's multiplies in fp32
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Like models/layers.py ``rms_norm``: norm(x), or with ``residual`` (norm(x + residual), x + residual)."""
    return _rms_norm(x, weight, eps, residual, torch.promote_types(weight.dtype, x.dtype), round_normed=True)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Like models/layers.py ``gemma_rms_norm``: the normed value times ``weight`` (1 + w, float32) in float32,
    rounded once to x's dtype."""
    return _rms_norm(x, weight, eps, residual, x.dtype, round_normed=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, dtype: torch.dtype,
              round_normed: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape, n_cols = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n_cols, eps,
            HAS_RES=residual is not None, BLOCK=block, ROUND_NORMED=round_normed, num_warps=_warps(block))
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


# ---------------------------------------------------------------- rotary embedding (neox: rotate halves)
@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_h, stride_oh, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < HALF)
    x1 = tl.load(x_ptr + h * stride_h + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * stride_h + HALF + i, mask=mask, other=0.0).to(tl.float32)
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    tl.store(o_ptr + h * stride_oh + i, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + h * stride_oh + HALF + i, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_cos, stride_sin, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads, cos, sin,
                  HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, num_k_heads, cos, sin,
                  HALF, BLOCK_H, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], cos/sin [max_pos, R/2] -> (q, k) with the first R dimensions of each head
    rotated (R <= D: a partial rotation passes the rest); new tensors unless ``inplace``."""
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin, positions)):
        raise ValueError("rotary_embedding needs q, k, cos and sin with a contiguous last dimension, and contiguous "
                         "positions")
    half = cos.shape[-1]
    if not 0 < 2 * half <= q.shape[-1]:
        raise ValueError(f"rotary_embedding turns 2 x {half} dimensions (the cos table's width), more than the "
                         f"{q.shape[-1]} of a head")
    passed = 2 * half < q.shape[-1]  # the kernel writes the turned dimensions only
    q_out = q if inplace else q.clone() if passed else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else k.clone() if passed else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens = q.shape[0]
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
            q.shape[1], k.shape[1], HALF=half, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
            BLOCK_HALF=triton.next_power_of_2(half))
    return q_out, k_out


# ---------------------------------------------------------------- SiLU-and-mul, GELU(tanh)-and-mul
@triton.jit
def _act_and_mul_kernel(gate_ptr, up_ptr, o_ptr, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr,
                        GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3) is g / (1 + e^-2y): no cancellation
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(gate_ptr.dtype.element_ty).to(tl.float32)  # torch's activation rounds, then the mul
    tl.store(o_ptr + row * stride_o + cols, (act * up).to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] in one pass."""
    return _act_and_mul(gate, up, block, gelu_tanh=False)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate, up [..., I] -> gelu(gate, approximate="tanh") * up [..., I] in one pass (Gemma's MLP)."""
    return _act_and_mul(gate, up, block, gelu_tanh=True)


def _act_and_mul(gate: torch.Tensor, up: torch.Tensor, block: int, gelu_tanh: bool) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"act_and_mul needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    inter = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and inter:
        block = min(block, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(g2.shape[0], triton.cdiv(inter, block))](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), inter, BLOCK=block, GELU_TANH=gelu_tanh,
            num_warps=_warps(block))
    return out.view(gate.shape)
