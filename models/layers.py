"""Building blocks shared by the Llama family: quantizable Linear, RMSNorm, rotary embedding, SiLU-and-mul."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CheckpointError
from ..core.interfaces import QuantMethod


class UnquantizedMethod(QuantMethod):
    """Plain ``weight`` [out, in] (and ``bias``); the default for every linear layer. With ``skinny_max_rows``,
    fp16/bf16 inputs of at most that many rows (<= 16) run kernels/skinny_gemm.py instead of torch's matmul
    (``--skinny-gemm-rows``; on CUDA, or CPU tensors under TRITON_INTERPRET=1)."""

    name = "none"

    def __init__(self, skinny_max_rows: int = 0) -> None:
        self.skinny_max_rows = skinny_max_rows

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.bias)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``: the skinny kernel for few fp16/bf16 rows when enabled, else F.linear."""
        if self.skinny_max_rows and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1 and \
                weight.stride(-1) == 1 and x.numel() <= self.skinny_max_rows * x.shape[-1]:
            from ..kernels.skinny_gemm import skinny_gemm

            out = skinny_gemm(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        merged.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        return True


class Linear(nn.Module):
    """A linear layer whose storage and matmul belong to a QuantMethod.

    ``bias`` is stored in the activation dtype by every method (checkpoint name ``bias``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, prefix: str,
                 quant: QuantMethod | None, dtype: torch.dtype, create: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.prefix = in_features, out_features, prefix
        self.parts = [(prefix, out_features)]  # (HF module name, output size) of what it computes, side by side
        self.lora: nn.Module | None = None  # models/lora.py's LoraDelta, with --lora adapters that target it
        method = quant.method_for(prefix) if quant is not None else None
        self.method: QuantMethod = method if method is not None else UnquantizedMethod()
        if create:
            self.method.create_weights(self, in_features, out_features, bias, dtype)

    @classmethod
    def merged(cls, parts: list[Linear], prefix: str) -> Linear | None:
        """One linear computing ``parts``' outputs side by side (loaded and processed parts over the same input),
        or None when their quant methods differ or cannot merge them."""
        method, biases = parts[0].method, [p.bias for p in parts]
        if any(type(p.method) is not type(method) or p.in_features != parts[0].in_features for p in parts) or \
                len({b is None for b in biases}) > 1:
            return None
        merged = cls(parts[0].in_features, sum(p.out_features for p in parts), False, prefix, None,
                     torch.get_default_dtype(), create=False)
        merged.method = method
        merged.parts = [part for p in parts for part in p.parts]
        if not method.merge(list(parts), merged):
            return None
        merged.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        return merged

    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.method.load_weight(self, name, tensor)

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        # a weight still on the meta device (quantized as it loads: quant/common.py deferred_weight) has no data to
        # move or cast; its load_anchor buffer moves instead
        weight = self._parameters.get("weight")
        if weight is None or weight.device.type != "meta":
            return super()._apply(fn, recurse)
        del self._parameters["weight"]
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.lora is None else self.lora(x, out)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, quant={self.method.name}"


def merge_linears(owner: nn.Module, names: tuple[str, ...], merged_name: str) -> bool:
    """Replace ``owner``'s linears ``names`` by one linear ``merged_name`` computing their outputs side by side,
    where their quant method can (see :meth:`Linear.merged`); the parts are dropped. Whether it merged."""
    merged = Linear.merged([getattr(owner, name) for name in names], f"{owner.prefix}.{merged_name}")
    if merged is None:
        return False
    setattr(owner, merged_name, merged)
    for name in names:
        delattr(owner, name)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), as HF computes it."""
    if residual is not None:
        x = x + residual
        residual = x
    h = F.rms_norm(x.float(), x.shape[-1:], eps=eps)  # HF: x * rsqrt(mean(x^2) + eps) in float32
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's: the normed value times ``weight`` (which holds 1 + w, float32) in float32, rounded once to x's dtype;
    with ``residual``, (norm(x + residual), x + residual), the sum in x's dtype."""
    if residual is not None:
        x = x + residual
        residual = x
    out = (F.rms_norm(x.float(), x.shape[-1:], eps=eps) * weight).to(x.dtype)
    return out if residual is None else (out, residual)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary: q [T, Hq, D], k [T, Hk, D], cos/sin tables [max_pos, R/2] -> rotated copies, computed in float32
    (HF rotates in the model's dtype: the same in float32; in bf16/fp16 this rounds once, HF at every product). The
    first R dimensions of each head turn (R = D but for a partial rotation, Phi-4-mini's), the rest pass as they are."""
    c, s = cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    turned = 2 * cos.shape[-1]
    x1, x2 = x[..., :turned].float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return out if turned == x.shape[-1] else torch.cat((out, x[..., turned:]), dim=-1)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class PointwiseOps:
    """The elementwise ops of a decoder layer, with the signatures of the torch functions above (the reference).

    ``TORCH_OPS`` runs anywhere; :func:`triton_ops` gives the fused Triton kernels of kernels/fused_ops.py.
    """

    name: str
    rms_norm: Callable[..., Any]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gemma_rms_norm: Callable[..., Any] = gemma_rms_norm
    gelu_tanh_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gelu_tanh_and_mul


TORCH_OPS = PointwiseOps("torch", rms_norm, apply_rotary, silu_and_mul)


def triton_ops() -> PointwiseOps:
    """The fused Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1). q/k are rotated in place: the
    model's projections made them and nothing else reads them."""
    from ..kernels import fused_ops

    return PointwiseOps("triton", fused_ops.rms_norm, partial(fused_ops.rotary_embedding, inplace=True),
                        fused_ops.silu_and_mul, fused_ops.gemma_rms_norm, fused_ops.gelu_tanh_and_mul)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: PointwiseOps = TORCH_OPS) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), as HF computes it."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, rope: dict[str, Any], context: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the HF rope types 'default', 'linear', 'llama3', 'yarn', 'dynamic' and 'longrope'
    (computed in float32) for a model served ``context`` positions, and the factor cos and sin are multiplied by (1
    but for YaRN and LongRoPE)."""
    theta = float(rope.get("rope_theta", 10000.0))
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", "dynamic"):  # HF's dynamic NTK rescales the base only past max_position_embeddings,
        return inv_freq, 1.0  # which the engine refuses for it
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        return yarn_inv_freq(pos_freqs, head_dim, rope)
    if kind == "longrope":
        return longrope_inv_freq(pos_freqs, rope, context)
    raise CheckpointError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3, yarn, dynamic, "
                          "longrope")


def longrope_inv_freq(pos_freqs: torch.Tensor, rope: dict[str, Any], context: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024, arXiv 2402.13753; Phi-3's 128k models): each frequency is divided by its own
    factor, from long_factor for a context past original_max_position_embeddings and short_factor within it; cos
    and sin are scaled by ``attention_factor``, by default sqrt(1 + ln(factor) / ln(original)).

    The table is chosen once, by the served context (vLLM's rule): HF picks it per forward pass by the sequence's
    length, and re-prefills a Phi-3 sequence that grows past the original context. The two agree on every sequence
    when the context is within the original, and otherwise on prompts longer than the original."""
    old_len, factor = float(rope["original_max_position_embeddings"]), float(rope["factor"])
    ext = torch.tensor(rope["long_factor"] if context > old_len else rope["short_factor"], dtype=torch.float32)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return 1.0 / (ext * pos_freqs), float(attention)


def yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv 2309.00071, as HF computes it): a dimension that turns more than beta_fast
    times over the original context keeps its frequency, one that turns fewer than beta_slow times is divided by
    ``factor``, and a linear ramp over the dimensions between mixes the two; cos and sin are scaled by
    ``attention_factor``, by default 0.1 ln(factor) + 1 (or DeepSeek's ratio of two such terms, mscale over
    mscale_all_dim)."""
    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    old_len = float(rope["original_max_position_embeddings"])

    def dimension_turning(rotations: float) -> float:  # the dimension pair that turns `rotations` times in old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)
    low, high = dimension_turning(fast), dimension_turning(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the weight of the unscaled frequency
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        weight, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, weight) / mscale(factor, all_dims) if weight and all_dims else mscale(factor)
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) of the first ``rotary_dim`` dimensions of each head, with a
    precomputed cos/sin table up to ``max_positions``."""

    def __init__(self, rotary_dim: int, max_positions: int, rope: dict[str, Any], ops: PointwiseOps = TORCH_OPS
                 ) -> None:
        super().__init__()
        self.ops = ops
        inv_freq, scale = rope_inv_freq(rotary_dim, rope, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [max_positions, rotary_dim / 2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated (q, k), computed in float32 (see apply_rotary)."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
