"""``--kv-cache-dtype fp8``: e4m3 KV blocks with static per-(layer, KV head) scales.

Format: an element ``x`` of KV head ``h`` is stored as ``fp8(clamp(x / s[h], -448, 448))`` and read back as
``stored * s[h]``; K and V have their own scales. The scales are fixed once, when the engine starts: a prefill of a
fixed calibration text (:func:`calibration_ids`) measures ``amax[h] = max |x|`` of every layer's K (after RoPE)
and V, and ``s[h] = HEADROOM * amax[h] / 448``.

Why static and why the headroom: static scales keep the cache a plain tensor (no per-token scale memory, so the
block count exactly doubles against bf16) and need no host sync. e4m3 is floating point: the scale only places the
top of its range, and every value in [2^-6 s, 448 s] (14 binades) keeps the same 3-bit mantissa. A headroom of 2
spends one of those binades so that K/V up to twice the calibration amax are stored unclamped; only values below
amax / 7000, which weigh nothing in attention, lose precision.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.errors import PluginError
from ..core.model import Model
from .calib_data import default_texts, token_samples
from .forward import dense_forward
from .fp8 import FP8_DTYPE as FP8_KV_DTYPE
from .fp8 import FP8_MAX
HEADROOM = 2.0
CALIBRATION_TOKENS = 512
MIN_AMAX = 1e-6  # a head whose K/V are all zero still gets a positive scale

KVScales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_scale, v_scale), each fp32 [num_kv_heads]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., Hkv, D] -> fp8 ``clamp(x / scale[h])``, dividing in fp32 (``scale`` [Hkv])."""
    return (x.to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``x`` [..., Hkv, D] -> ``x * scale[h]`` in ``dtype``, through fp32 (a 4-bit significand times the
    scale's 24 bits can need 28: rounded to fp32 first, where a scale has more than 20 significant bits)."""
    return (x.to(torch.float32) * scale[:, None]).to(dtype)


def calibration_ids(tokenizer: Any, max_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The fixed calibration prefill: the first ``max_tokens`` tokens of the default calibration text."""
    return token_samples(tokenizer, default_texts(), 1, max(2, max_tokens))[0]


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales that store ``HEADROOM * amax`` as the largest e4m3 value."""
    return amax.to(torch.float32).clamp(min=MIN_AMAX) * HEADROOM / FP8_MAX


@torch.inference_mode()
def calibrate_kv_scales(model: Model, token_ids: list[int], device: torch.device) -> KVScales:
    """Per-layer (k_scale, v_scale) [num_kv_heads] from one cache-free prefill of ``token_ids``."""
    layers = model.spec.num_layers
    amax: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        amax[layer] = (k.abs().amax(dim=(0, 2)).float(), v.abs().amax(dim=(0, 2)).float())

    dense_forward(model, [token_ids], device, observe)
    if any(a is None for a in amax):
        raise PluginError(f"the model {type(model).__name__} called the KV observer for "
                          f"{sum(a is not None for a in amax)} of its {layers} attention layers during calibration; "
                          "fix the model plugin (each attention layer reports its K and V once per forward pass)")
    return [(scales_from_amax(k), scales_from_amax(v)) for k, v in amax]  # type: ignore[misc]
