"""W8A16: 8-bit integer weights with per-group scales and zero points; activations stay 16-bit (or 32-bit).

The layout infer runs 8-bit GPTQ and compressed-tensors ``pack-quantized`` int8 checkpoints in (both store four
8-bit codes per int32; they are unpacked on load, one byte per weight either way once loaded; a layer's unpacking
holds a few temporary copies of its codes):

- ``qweight`` uint8 [in, out]: the codes, input-major like AWQ's (one byte each, so the kernel reads them as is).
- ``qzeros``  uint8 [in / g, out]: the zero points.
- ``scales``  [in / g, out], the checkpoint's float dtype.

The weight of input row ``k``, output column ``n`` is ``(q[k, n] - z[k // g, n]) * s[k // g, n]``; ``q - z`` lies
in -255..255, so in fp32 the product is exact for fp16 or bf16 scales (one rounding, to the activations' dtype).
"""
from __future__ import annotations

import sys

import torch

from ..core.errors import CheckpointError

BITS = 8
PACK = 32 // BITS  # 8-bit values per int32
V1_WORD_OFFSET = 0x01010101  # GPTQ v1 stores z - 1 in each byte, taken off (and put back) on the whole word


def check_shapes(in_features: int, out_features: int, group_size: int, prefix: str) -> int:
    """Check a checkpoint layer fits the 8-bit packing; return the effective group size (``in_features`` for -1)."""
    group = in_features if group_size == -1 else group_size
    if group <= 0 or in_features % group:
        raise CheckpointError(f"8-bit group_size {group_size} does not divide in_features {in_features} for layer "
                              f"{prefix!r}: the checkpoint does not fit its own config.json (a wrong "
                              "quantization_config.group_size, or the config.json of another model)")
    for size, what in ((in_features, "in_features"), (out_features, "out_features")):
        if size % PACK:
            raise CheckpointError(f"8-bit checkpoints pack {PACK} values per int32, so they need {what} divisible by "
                                  f"{PACK}, got {size} for layer {prefix!r}; list the module among the config's "
                                  "unquantized ones if the checkpoint keeps it in 16 bits")
    return group


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols] -> uint8 [rows, cols, 4]: byte ``i`` is bits 8i..8i+7 (little-endian words)."""
    if sys.byteorder != "little" and words.device.type == "cpu":  # GPUs are little-endian
        raise CheckpointError("infer unpacks 8-bit weights as little-endian bytes, and this CPU is big-endian")
    return words.contiguous().view(torch.uint8).view(*words.shape, PACK)


def unpack_rows(qweight: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ ``qweight`` int32 [in / 4, out] (byte ``i`` of row ``r``: input row ``4r + i``) -> uint8 [in, out], its
    input rows taken in ``order`` (None: as they are)."""
    words, cols = qweight.shape
    codes = _bytes(qweight).permute(0, 2, 1).reshape(words * PACK, cols)
    return (codes if order is None else codes[order]).contiguous()


def unpack_columns(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qzeros`` int32 [rows, out / 4] (byte ``i`` of column ``c``: output column ``4c + i``) -> uint8
    [rows, out]."""
    return _bytes(qzeros).reshape(qzeros.shape[0], -1).clone()


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
              zero_offset: int, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An 8-bit GPTQ layer's packed tensors (``zero_offset`` 1: the v1 format) -> this layout's ``(qweight,
    qzeros)`` and the input order (None: none; see :func:`~.gptq.input_order`). ``g_idx`` None: ``k // group``."""
    from .gptq import input_order

    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    group = check_shapes(in_features, out_features, group_size, prefix)
    order = input_order(g_idx, group, prefix) if g_idx is not None else None
    words = qzeros.to(torch.int64) + zero_offset * V1_WORD_OFFSET  # v1 -> v2, wrapping as 32-bit words do
    zeros = unpack_columns(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    return unpack_rows(qweight, order), zeros, order


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The layer's weight [in, out] (``nn.Linear``'s transposed): ``(q - z) * s`` in fp32, then ``dtype``
    (default: the scales')."""
    in_features, out_features = qweight.shape
    group = in_features if group_size == -1 else group_size
    q = qweight.view(in_features // group, group, out_features).to(torch.float32)
    w = (q - qzeros.unsqueeze(1).to(torch.float32)) * scales.unsqueeze(1).to(torch.float32)
    return w.reshape(in_features, out_features).to(dtype or scales.dtype)

