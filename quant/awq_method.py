"""The ``awq`` QuantMethod: W4A16 linears in the AutoAWQ GEMM layout, loaded or quantized on load (RTN)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..core.errors import CheckpointError, ConfigError
from ..core.interfaces import QuantMethod
from . import awq
from .common import (WeightOnlyApply, check_tensor_shape, deferred_weight, is_lm_head, layer_name, loaded_float_weight,
                     mark_loaded, require_loaded)

PACKED = ("qweight", "qzeros", "scales")
SYMMETRIC_ZEROS = -0x77777778  # the int32 word 0x88888888: eight zero points of 8


class AwqLinearMethod(WeightOnlyApply, QuantMethod):
    """int4 weights with per-group fp16 scales and zero points; activations stay in the model dtype.

    ``quantize_on_load=False`` loads ``qweight``/``qzeros``/``scales`` from an AutoAWQ GEMM checkpoint.
    ``quantize_on_load=True`` quantizes a plain ``weight`` (RTN) into packed buffers as it loads, layer by layer
    (the float model is never held whole). ``quantize_lm_head`` quantizes the output head too (AutoAWQ keeps it in
    16 bits), always on load: from the checkpoint's ``lm_head.weight``, or from the embedding when the two are tied.
    On CUDA, batches of at most ``fused_max_rows`` rows run the fused Triton W4A16 GEMM; larger ones dequantize the
    weight for that call in one Triton kernel and use a dense matmul (every CPU call too, dequantizing in torch).
    The dequantized weight is never cached: that would undo the memory saving.
    """

    name = "awq"

    def __init__(self, group_size: int | None = 128, modules_to_not_convert: Sequence[str] = (),
                 quantize_on_load: bool = False, fused_max_rows: int = 64, quantize_lm_head: bool = False,
                 symmetric: bool = False) -> None:
        if group_size is None and not quantize_on_load:
            raise CheckpointError("an AWQ checkpoint must state its group_size")
        if group_size is not None and not awq.is_group_size(group_size):
            raise CheckpointError(f"AWQ group_size must be one of {', '.join(map(str, awq.GROUP_SIZES))}, "
                                  f"got {group_size!r}")
        self.group_size = group_size
        self.modules_to_not_convert = tuple(modules_to_not_convert)
        self.quantize_on_load = quantize_on_load
        self.fused_max_rows = fused_max_rows
        self.quantize_lm_head = quantize_lm_head
        self.quantizes_tied_head = quantize_lm_head
        self.symmetric = symmetric  # the checkpoint says zero_point false: its qzeros must all be 8

    @classmethod
    def from_config(cls, config: awq.AwqConfig, fused_max_rows: int = 64,
                    quantize_lm_head: bool = False) -> AwqLinearMethod:
        return cls(config.group_size, config.modules_to_not_convert, False, fused_max_rows, quantize_lm_head,
                   symmetric=not config.zero_point)

    def applies_to(self, prefix: str) -> bool:
        if is_lm_head(prefix):
            return self.quantize_lm_head
        # AutoAWQ's rule: a module is skipped when any listed name is a substring of its path
        return not any(m in prefix for m in self.modules_to_not_convert)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        size = self.group_size if self.group_size is not None else auto_group_size(in_features)
        layer.awq_on_load = self.quantize_on_load or is_lm_head(layer_name(layer))
        if is_lm_head(layer_name(layer)) and out_features % awq.PACK:
            raise ConfigError(f"awq.lm_head: AWQ packs {awq.PACK} output columns per int32, and this model's "
                              f"vocabulary of {out_features} is not a multiple of {awq.PACK}; drop "
                              "--plugin-option awq.lm_head=true")
        group = awq.check_shapes(in_features, out_features, size, layer_name(layer), not layer.awq_on_load)
        layer.awq_group_size = group
        if layer.awq_on_load:
            deferred_weight(layer, out_features, in_features, dtype)
        else:
            packed_out = out_features // awq.PACK
            layer.register_buffer("qweight", torch.empty(in_features, packed_out, dtype=torch.int32))
            layer.register_buffer("qzeros", torch.empty(in_features // group, packed_out, dtype=torch.int32))
            layer.register_buffer("scales", torch.empty(in_features // group, out_features, dtype=torch.float16))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        if layer.awq_on_load and name in PACKED and is_lm_head(layer_name(layer)) and not self.quantize_on_load:
            raise CheckpointError(f"the checkpoint's lm_head is AWQ-packed ({name}), which infer does not load "
                                  "(AutoAWQ, transformers and vLLM leave the head unpacked; awq.lm_head=true "
                                  "quantizes it on load from a float lm_head.weight): use a checkpoint whose head is "
                                  "not packed")
        if layer.awq_on_load and name in PACKED:
            raise CheckpointError(
                f"layer {layer_name(layer)!r} holds a packed AWQ tensor {name!r}, but the checkpoint declares no "
                "AWQ quantization_config; add it to config.json or load an unquantized checkpoint")
        if not layer.awq_on_load and name == "weight":
            raise CheckpointError(
                f"layer {layer_name(layer)!r} has an unquantized 'weight' in an AWQ checkpoint; list the module in "
                "quantization_config.modules_to_not_convert, or re-export the checkpoint")
        if layer.awq_on_load and name == "weight":
            self._quantize(layer, loaded_float_weight(layer, tensor))
        elif name in ("qweight", "qzeros"):
            if tensor.dtype != torch.int32:
                raise CheckpointError(f"AWQ {name} must be int32, got {tensor.dtype} for layer {layer_name(layer)!r}")
            if name == "qzeros":
                _check_group_rows(layer, name, tensor, self.group_size)
            check_tensor_shape(layer, name, tensor, tuple(getattr(layer, name).shape))
            getattr(layer, name).copy_(tensor)
        elif name == "scales":
            _check_group_rows(layer, name, tensor, self.group_size)
            if not tensor.is_floating_point():
                raise CheckpointError(f"AWQ scales must be floating point, got {tensor.dtype} "
                                      f"for layer {layer_name(layer)!r}")
            check_tensor_shape(layer, name, tensor, tuple(layer.scales.shape))
            # keep the checkpoint's float dtype (fp16 normally): converting would round the scales
            layer.scales = tensor.to(layer.scales.device, copy=True)
        else:
            super().load_weight(layer, name, tensor)
        mark_loaded(layer, name)

    @staticmethod
    def _quantize(layer: nn.Module, weight: torch.Tensor) -> None:
        """RTN-quantize a float weight [out, in] into the layer's packed buffers."""
        name = layer_name(layer)
        if not bool(torch.isfinite(weight).all()):  # the loader's finite check would see only the scales
            raise CheckpointError(f"{name!r} holds NaN or infinite values, which no AWQ scale can hold: a weight "
                                  "past 65504 overflows when cast to --dtype float16 (load it with --dtype "
                                  "bfloat16 or float32), or the checkpoint is corrupt")
        try:
            qweight, qzeros, scales = awq.quantize_rtn(weight, layer.awq_group_size)
        except CheckpointError as exc:
            raise CheckpointError(f"{name!r}: {exc}") from None
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("qzeros", qzeros)
        layer.register_buffer("scales", scales)

    def process_after_loading(self, layer: nn.Module) -> None:
        needed = ("weight",) if layer.awq_on_load else PACKED
        require_loaded(layer, needed + (("bias",) if layer.bias is not None else ()), self.name)
        if self.symmetric and not layer.awq_on_load and bool((layer.qzeros != SYMMETRIC_ZEROS).any()):
            raise CheckpointError(f"the AWQ config says zero_point false (symmetric), but layer {layer_name(layer)!r} "
                                  "stores zero points other than 8, which symmetric loaders ignore: the config does "
                                  "not describe the checkpoint; correct zero_point")

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        # packed columns hold 8 output columns each, so concatenating along the output dimension is exact
        groups = {p.awq_group_size for p in parts}
        if len(groups) > 1 or len({p.scales.dtype for p in parts}) > 1:
            return False
        merged.awq_group_size = groups.pop()
        for name in PACKED:
            merged.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dim=1))
        return True

    def fused_gemm(self, layer: nn.Module, x: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
        from ..kernels.awq_gemm import awq_gemm

        return awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, layer.awq_group_size, input_order=input_order)

    def dequantized(self, layer: nn.Module, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
        if cuda:  # one kernel that reads each packed weight once (then cuBLAS)
            from ..kernels.awq_gemm import awq_dequantize

            return awq_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.awq_group_size, dtype)
        return awq.dequantize(layer.qweight, layer.qzeros, layer.scales, layer.awq_group_size, dtype=dtype)


def _check_group_rows(layer: nn.Module, name: str, tensor: torch.Tensor, declared: int | None) -> None:
    """qzeros and scales hold one row per group: a row count that implies another group size than the config's
    says so (the usual cause of their shape mismatch)."""
    in_features, expected = layer.qweight.shape[0], getattr(layer, name).shape[0]
    rows = tensor.shape[0] if tensor.dim() == 2 else 0
    if rows and rows != expected and in_features % rows == 0:
        raise CheckpointError(
            f"layer {layer_name(layer)!r}: the checkpoint's {name} has {rows} group rows, i.e. group_size "
            f"{in_features // rows} over {in_features} inputs, but quantization_config.group_size is {declared}; "
            "correct group_size in config.json")


def auto_group_size(in_features: int) -> int:
    """On-load quantization without a set group size: the largest of 128, 64, 32 that divides the input size."""
    return next((g for g in (128, 64, 32) if in_features % g == 0), -1)
