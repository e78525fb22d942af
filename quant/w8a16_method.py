"""W8A16 linears (:mod:`.w8a16`): the runtime half of the 8-bit GPTQ and compressed-tensors methods."""
from __future__ import annotations

import torch
from torch import nn

from ..core.interfaces import QuantMethod
from . import w8a16
from .awq_method import PACKED  # the same three tensor names, in another layout
from .common import WeightOnlyApply, layer_name


class W8A16LinearMethod(WeightOnlyApply, QuantMethod):
    """uint8 weights with per-group zero points and scales; activations stay in the model dtype. The loading is
    a checkpoint format's (:mod:`.gptq_method`): it calls :meth:`_quantized_layer` from ``create_weights`` and
    :meth:`_convert` once the layer's tensors are in. On CUDA, batches of at most ``fused_max_rows`` rows run the
    fused Triton W8A16 GEMM; larger ones dequantize the weight for that call in one kernel and use a dense matmul
    (every CPU call too, dequantizing in torch). The dequantized weight is never cached."""

    def __init__(self, group_size: int, fused_max_rows: int = 64) -> None:
        self.group_size = group_size
        self.fused_max_rows = fused_max_rows

    def _quantized_layer(self, layer: nn.Module, in_features: int, out_features: int) -> int:
        """Check the layer fits the 8-bit packing; return its effective group size."""
        group = w8a16.check_shapes(in_features, out_features, self.group_size, layer_name(layer))
        layer.w8a16_group_size = group
        layer.register_buffer("input_order", None)
        return group

    def _convert(self, layer: nn.Module, qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                 zero_offset: int) -> None:
        """Give the layer its uint8 ``qweight``/``qzeros`` (and ``input_order``) from GPTQ-layout tensors."""
        layer.qweight, layer.qzeros, layer.input_order = w8a16.from_gptq(
            qweight, qzeros, g_idx, layer.w8a16_group_size, zero_offset, layer_name(layer))

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        # one column per output: concatenating along the output dimension is exact
        if len({p.w8a16_group_size for p in parts}) > 1 or len({p.scales.dtype for p in parts}) > 1:
            return False
        merged.w8a16_group_size = parts[0].w8a16_group_size
        for name in PACKED:
            merged.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dim=1))
        return True

    def fused_gemm(self, layer: nn.Module, x: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
        from ..kernels.w8a16_gemm import w8a16_gemm

        return w8a16_gemm(x, layer.qweight, layer.qzeros, layer.scales, layer.w8a16_group_size,
                          input_order=input_order)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
        tensors = (layer.qweight, layer.qzeros, layer.scales, layer.w8a16_group_size)
        if cuda:
            from ..kernels.w8a16_gemm import w8a16_dequantize

            return w8a16_dequantize(*tensors, dtype)
        return w8a16.dequantize(*tensors, dtype=dtype)
