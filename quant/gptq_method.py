"""The ``gptq`` QuantMethods, and compressed-tensors' int4/int8 ones that load the same way: 4-bit layers are
repacked on load into the AWQ layout and run as AWQ layers; 8-bit ones run as W8A16 layers (:mod:`.w8a16`)."""
from __future__ import annotations

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..core.interfaces import QuantMethod
from . import awq, gptq, w8a16
from .awq_method import PACKED, AwqLinearMethod
from .common import (SchemeVariants, check_tensor_shape, layer_name, mark_loaded, require_loaded, was_loaded,
                     with_variants)
from .fp8 import Fp8Scheme
from .pack_quantized import PackQuantizedConfig, PackQuantizedScheme
from .w8a16_method import W8A16LinearMethod


class GptqTensors(SchemeVariants):
    """The loading GPTQ checkpoints share, whatever their layers run as (a mixin before the runtime method:
    :class:`~.awq_method.AwqLinearMethod` for 4 bits, :class:`~.w8a16_method.W8A16LinearMethod` for 8). One method
    serves the linears of one :class:`~.gptq.GptqScheme`; a checkpoint of several (GPTQModel's ``dynamic``
    overrides) has one per scheme (:func:`gptq_method`), each linear given its own by ``method_for``. A layer
    loads GPTQ's ``qweight``/``qzeros``/``scales``/``g_idx`` and, once all are in, holds what the runtime method's
    layers hold, plus ``input_order``: None, or for a checkpoint quantized in activation order the permutation
    applied to the layer's input first. ``g_idx`` may be absent (older checkpoints): the groups are then
    consecutive. The output head is never quantized. The runtime method provides ``_quantized_layer`` (checks the
    layer, sets its group size and returns it), ``_convert`` (GPTQ-layout tensors -> its own) and ``apply_ordered`` (its
    ``apply`` with an input order)."""

    name = "gptq"
    config: gptq.GptqConfig
    scheme: gptq.GptqScheme  # of the linears this method serves
    pack: int  # values per int32

    def scheme_for(self, prefix: str) -> gptq.GptqScheme | None:
        return self.config.scheme_for(prefix)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        group = self._quantized_layer(layer, in_features, out_features)
        layer.register_buffer("qweight", torch.empty(in_features // self.pack, out_features, dtype=torch.int32))
        layer.register_buffer("qzeros", torch.empty(in_features // group, out_features // self.pack,
                                                    dtype=torch.int32))
        layer.register_buffer("scales", torch.empty(in_features // group, out_features, dtype=torch.float16))
        layer.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32), persistent=False)  # optional
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            raise CheckpointError(f"layer {layer_name(layer)!r} has an unquantized 'weight' in a GPTQ checkpoint; "
                                  "list the quantized modules in quantization_config.modules_in_block_to_quantize, "
                                  "or re-export the checkpoint")
        if name in ("qweight", "qzeros", "g_idx"):
            self._copy_codes(layer, name, tensor)
        elif name == "scales":
            self._take_scales(layer, name, tensor)
        elif name == "bias" and layer.bias is None:  # AutoGPTQ's older packers saved a bias for every layer
            if bool(tensor.any()):
                raise CheckpointError(f"the GPTQ checkpoint gives layer {layer_name(layer)!r} a nonzero bias, which "
                                      "this architecture's layer does not have: the checkpoint is of another model")
            return  # all zeros: nothing to add
        else:
            QuantMethod.load_weight(self, layer, name, tensor)  # type: ignore[arg-type]
        mark_loaded(layer, name)

    def _copy_codes(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        if name.endswith("g_idx") and tensor.dtype == torch.int64:  # group numbers, not packed words: any int fits
            tensor = tensor.clamp(-1, 2**31 - 1).to(torch.int32)  # out of range stays out of range (input_order)
        if tensor.dtype != torch.int32:
            raise CheckpointError(f"{self.name} {name} must be int32, got {tensor.dtype} for layer "
                                  f"{layer_name(layer)!r}")
        check_tensor_shape(layer, name, tensor, tuple(getattr(layer, name).shape))
        getattr(layer, name).copy_(tensor)

    def _take_scales(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_floating_point() or tensor.element_size() == 1:
            raise CheckpointError(f"{self.name} {name} must be float16 or wider, got {tensor.dtype} for layer "
                                  f"{layer_name(layer)!r}")
        check_tensor_shape(layer, name, tensor, tuple(getattr(layer, name).shape))
        setattr(layer, name, tensor.to(getattr(layer, name).device, copy=True))  # the checkpoint's dtype: exact

    def process_after_loading(self, layer: nn.Module) -> None:
        require_loaded(layer, PACKED + (("bias",) if layer.bias is not None else ()), self.name)
        g_idx = layer.g_idx if was_loaded(layer, "g_idx") else None
        if g_idx is None and self.scheme.act_order:
            raise CheckpointError(f"the GPTQ config says desc_act (activation order), but layer {layer_name(layer)!r} "
                                  "has no g_idx, without which its groups are unknown: the checkpoint is incomplete")
        self._convert(layer, layer.qweight, layer.qzeros, g_idx, self.config.zero_offset)
        del layer.g_idx

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        orders = [p.input_order for p in parts]
        if any((o is None) != (orders[0] is None) or (o is not None and not torch.equal(o, orders[0]))
               for o in orders):
            return False  # each part permutes its input its own way
        if not super().merge(parts, merged):  # type: ignore[misc]
            return False
        merged.register_buffer("input_order", orders[0])
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.apply_ordered(layer, x, layer.input_order)  # type: ignore[attr-defined]


class GptqLinearMethod(GptqTensors, AwqLinearMethod):
    """4-bit GPTQ layers, repacked on load into the AWQ layout (:func:`.gptq.to_awq`) and run by its kernels,
    merges and stacked experts."""

    pack = awq.PACK

    def __init__(self, config: gptq.GptqConfig, fused_max_rows: int = 64, scheme: gptq.GptqScheme | None = None
                 ) -> None:
        self.config, self.scheme = config, scheme or config.scheme
        AwqLinearMethod.__init__(self, self.scheme.group_size, fused_max_rows=fused_max_rows)
        self.variants = {self.scheme: self}

    def _quantized_layer(self, layer: nn.Module, in_features: int, out_features: int) -> int:
        """Check the layer's shape fits the packing; set what every int4 layer has; return its group size."""
        group = awq.check_shapes(in_features, out_features, self.group_size, layer_name(layer), checkpoint=True)
        if in_features % awq.PACK:
            raise CheckpointError(f"{self.name} packs {awq.PACK} inputs per int32, so it needs in_features "
                                  f"divisible by {awq.PACK}, got {in_features} for layer {layer_name(layer)!r}")
        layer.awq_group_size, layer.awq_on_load = group, False
        layer.register_buffer("input_order", None)
        return group

    def _convert(self, layer: nn.Module, qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                 zero_offset: int) -> None:
        layer.qweight, layer.qzeros, layer.input_order = gptq.to_awq(
            qweight, qzeros, g_idx, layer.awq_group_size, zero_offset, layer_name(layer))


class GptqInt8LinearMethod(GptqTensors, W8A16LinearMethod):
    """8-bit GPTQ layers, unpacked on load into :mod:`.w8a16`'s layout and run by the W8A16 kernels, merges and
    stacked experts."""

    pack = w8a16.PACK

    def __init__(self, config: gptq.GptqConfig, fused_max_rows: int = 64, scheme: gptq.GptqScheme | None = None
                 ) -> None:
        self.config, self.scheme = config, scheme or config.scheme
        W8A16LinearMethod.__init__(self, self.scheme.group_size, fused_max_rows)
        self.variants = {self.scheme: self}


class PackQuantizedTensors(GptqTensors):
    """The loading of compressed-tensors ``pack-quantized`` layers (:mod:`.pack_quantized`), a mixin before the
    runtime method as :class:`GptqTensors` is: they load the checkpoint's ``weight_packed``, ``weight_scale``,
    ``weight_zero_point`` (asymmetric schemes), ``weight_g_idx`` (optional) and ``weight_shape`` (checked), then
    convert as GPTQ layers do, from the transposed tensors (``gptq_v2``; a symmetric scheme's zero point is half
    the codes' range). The output head is quantized only where the config targets it. One method serves the linears
    of one :class:`~.pack_quantized.PackQuantizedScheme` (:func:`pack_quantized_method`)."""

    name = "compressed-tensors"
    checkpoint: PackQuantizedConfig
    symmetric: bool

    def scheme_for(self, prefix: str) -> PackQuantizedScheme | Fp8Scheme | None:  # type: ignore[override]
        return self.checkpoint.scheme_for(prefix)

    def _set_scheme(self, config: PackQuantizedConfig, scheme: PackQuantizedScheme) -> None:
        self.checkpoint, self.symmetric, self.variants = config, scheme.symmetric, {scheme: self}

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        group = self._quantized_layer(layer, in_features, out_features)
        layer.register_buffer("weight_packed", torch.empty(out_features, in_features // self.pack,
                                                           dtype=torch.int32))
        layer.register_buffer("weight_scale", torch.empty(out_features, in_features // group, dtype=dtype))
        if not self.symmetric:
            layer.register_buffer("weight_zero_point", torch.empty(out_features // self.pack, in_features // group,
                                                                   dtype=torch.int32))
        layer.register_buffer("weight_g_idx", torch.empty(in_features, dtype=torch.int32), persistent=False)
        layer.register_buffer("weight_shape", torch.tensor([out_features, in_features]))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        if name == "weight_zero_point" and tensor.dtype == torch.int8 and hasattr(layer, name):
            raise CheckpointError(f"{layer_name(layer)}.weight_zero_point is unpacked int8, as older "
                                  "compressed-tensors releases wrote it; infer loads packed int32 zero points: "
                                  "re-save the checkpoint with a current compressed-tensors")
        if name in ("weight_packed", "weight_zero_point", "weight_g_idx") and hasattr(layer, name):
            self._copy_codes(layer, name, tensor)
        elif name == "weight_scale":
            self._take_scales(layer, name, tensor)
        elif name == "weight_shape":
            if tensor.dim() != 1 or tensor.is_floating_point() or not torch.equal(tensor.cpu(), layer.weight_shape):
                raise CheckpointError(f"{layer_name(layer)}.weight_shape is {tensor.tolist()}, but the layer is "
                                      f"{layer.weight_shape.tolist()} (out, in): the checkpoint is of another model")
        elif name == "weight_zero_point":
            raise CheckpointError(f"{layer_name(layer)} has a weight_zero_point, but the config's scheme is "
                                  "symmetric: config.json does not describe this checkpoint")
        else:
            QuantMethod.load_weight(self, layer, name, tensor)  # type: ignore[arg-type]
        mark_loaded(layer, name)

    def process_after_loading(self, layer: nn.Module) -> None:
        zero_point = () if self.symmetric else ("weight_zero_point",)
        require_loaded(layer, ("weight_packed", "weight_scale", "weight_shape") + zero_point
                       + (("bias",) if layer.bias is not None else ()), self.name)
        groups, out_features = layer.weight_scale.shape[1], layer.weight_packed.shape[0]
        qzeros = layer.weight_zero_point.t() if zero_point else torch.full(
            (groups, out_features // self.pack), symmetric_zeros(32 // self.pack), dtype=torch.int32,
            device=layer.weight_packed.device)
        g_idx = layer.weight_g_idx if was_loaded(layer, "weight_g_idx") else None
        if g_idx is None and self.scheme.act_order:
            raise CheckpointError(f"the compressed-tensors config says actorder 'group', but layer "
                                  f"{layer_name(layer)!r} has no weight_g_idx: the checkpoint is incomplete")
        self._convert(layer, layer.weight_packed.t(), qzeros, g_idx, 0)
        layer.scales = layer.weight_scale.t().contiguous()
        for name in ("weight_packed", "weight_scale", "weight_g_idx", "weight_shape") + zero_point:
            delattr(layer, name)


class PackQuantizedLinearMethod(PackQuantizedTensors, GptqLinearMethod):
    """compressed-tensors int4 layers, run as AWQ layers."""

    def __init__(self, config: PackQuantizedConfig, fused_max_rows: int = 64,
                 scheme: PackQuantizedScheme | None = None) -> None:
        scheme = scheme or config.schemes[0]
        GptqLinearMethod.__init__(self, gptq_config(scheme), fused_max_rows)
        self._set_scheme(config, scheme)


class PackQuantizedInt8LinearMethod(PackQuantizedTensors, GptqInt8LinearMethod):
    """compressed-tensors int8 weight-only layers (llm-compressor's W8A16), run as W8A16 layers."""

    def __init__(self, config: PackQuantizedConfig, fused_max_rows: int = 64,
                 scheme: PackQuantizedScheme | None = None) -> None:
        scheme = scheme or config.schemes[0]
        GptqInt8LinearMethod.__init__(self, gptq_config(scheme), fused_max_rows)
        self._set_scheme(config, scheme)


def gptq_config(scheme: PackQuantizedScheme) -> gptq.GptqConfig:
    """The GPTQ config a pack-quantized scheme's linears load by: gptq_v2 zero points (stored or implied)."""
    return gptq.GptqConfig(gptq.GptqScheme(scheme.bits, scheme.group_size, scheme.act_order), zero_offset=0)


def gptq_method(config: gptq.GptqConfig, fused_max_rows: int = 64, name: str = "gptq") -> QuantMethod:
    """The method of a GPTQ checkpoint: its own scheme's (4 bits: :class:`GptqLinearMethod`, 8:
    :class:`GptqInt8LinearMethod`), holding one per ``dynamic`` override's scheme besides; ``name`` in load errors
    (the registered method's: AutoRound's checkpoints load through these too)."""
    def build(scheme: gptq.GptqScheme) -> QuantMethod:
        method = (GptqLinearMethod if scheme.bits == 4 else GptqInt8LinearMethod)(config, fused_max_rows, scheme)
        method.name = name
        return method
    return with_variants(build, config.schemes)


def pack_quantized_method(config: PackQuantizedConfig, fused_max_rows: int = 64, fp8: QuantMethod | None = None
                          ) -> QuantMethod:
    """The method of a pack-quantized checkpoint: its first int group's scheme's, holding one for each other scheme
    of its groups (4 bits: :class:`PackQuantizedLinearMethod`, 8: :class:`PackQuantizedInt8LinearMethod`; a
    non-uniform checkpoint's FP8 groups: ``fp8``, the method of those groups)."""
    def build(scheme: PackQuantizedScheme | Fp8Scheme) -> QuantMethod:
        if isinstance(scheme, Fp8Scheme):
            assert fp8 is not None, "a config with FP8 groups needs their method"
            return fp8
        kind = PackQuantizedLinearMethod if scheme.bits == 4 else PackQuantizedInt8LinearMethod
        return kind(config, fused_max_rows, scheme)
    return with_variants(build, config.schemes)


def symmetric_zeros(bits: int) -> int:
    """The int32 word of packed zero points a symmetric scheme implies: each code's midpoint (8 for 4 bits, 128
    for 8), the signed zero point 0 offset as compressed-tensors offsets codes."""
    word = sum((1 << (bits - 1)) << shift for shift in range(0, 32, bits))
    return word - 2**32 if word >= 2**31 else word
