"""The ``fp8`` QuantMethod: e4m3 weights with fp32 scales, activations quantized to fp8 per token or per tensor."""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from ..core.errors import CheckpointError, ConfigError
from ..core.interfaces import QuantMethod
from . import FP8_BACKENDS, fp8
from .common import (check_tensor_shape, deferred_weight, is_lm_head, layer_name, loaded_float_weight, mark_loaded,
                     require_loaded)

log = logging.getLogger("infer")

BACKENDS = FP8_BACKENDS
IGNORED_ZERO_POINTS = ("weight_zero_point", "input_zero_point")  # symmetric: always zero when present


class Fp8LinearMethod(QuantMethod):
    """W8A8 FP8 linears.

    ``checkpoint=None`` quantizes a plain ``weight`` as it loads (per-channel weight scales, dynamic per-token
    activation scales; ``lm_head`` stays unquantized unless ``quantize_lm_head``). With a
    :class:`~infer.quant.fp8.Fp8CheckpointConfig` it loads compressed-tensors ``weight`` (float8_e4m3fn),
    ``weight_scale`` and, for static activations, ``input_scale``.

    Once loaded a layer holds ``weight`` fp8 [out, in], ``weight_scale`` fp32 [out] or [1]
    and, when static, ``input_scale`` fp32 [1]. ``backend``: ``scaled_mm`` (``torch._scaled_mm``, CUDA sm89+),
    ``triton`` (the W8A8 Triton GEMM), ``emulate`` (quantize activations to fp8 and back, dequantize the weight,
    matmul in fp32: correct anywhere, saves weight memory, not faster), or ``auto``: ``scaled_mm`` where it can
    run, else ``emulate``, announced once in the log.
    """

    name = "fp8"

    def __init__(self, checkpoint: fp8.Fp8CheckpointConfig | None = None, backend: str = "auto",
                 quantize_lm_head: bool = False) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"fp8 backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.checkpoint = checkpoint
        self.backend = backend
        self.quantize_lm_head = quantize_lm_head
        self.quantizes_tied_head = quantize_lm_head
        self._announced: set[str] = set()

    def _scheme(self, prefix: str) -> fp8.Fp8Scheme | None:
        if self.checkpoint is None:
            return None if is_lm_head(prefix) and not self.quantize_lm_head else fp8.DYNAMIC
        return self.checkpoint.scheme_for(prefix)

    def applies_to(self, prefix: str) -> bool:
        return self._scheme(prefix) is not None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        scheme = self._scheme(getattr(layer, "prefix", "")) or fp8.DYNAMIC
        layer.fp8_scheme = scheme
        if self.checkpoint is None:  # quantized as it loads
            deferred_weight(layer, out_features, in_features, dtype)
        else:
            layer.register_buffer("weight", torch.empty(out_features, in_features, dtype=fp8.FP8_DTYPE))
            scale_shape = (out_features,) if scheme.weight_strategy == "channel" else (1,)
            layer.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32))
            if scheme.static_input:
                layer.register_buffer("input_scale", torch.empty(1, dtype=torch.float32))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def _required(self, layer: nn.Module) -> tuple[str, ...]:
        names = ("weight",) if self.checkpoint is None else ("weight", "weight_scale")
        if self.checkpoint is not None and layer.fp8_scheme.static_input:
            names += ("input_scale",)
        return names + (("bias",) if layer.bias is not None else ())

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        where = f"layer {layer_name(layer)!r}"
        if self.checkpoint is None or name == "bias":
            if name not in ("weight", "bias"):
                raise CheckpointError(f"{where} holds {name!r}, a quantized checkpoint's tensor, but config.json "
                                      "declares no quantization_config (so --quant fp8 quantizes on load and expects "
                                      "unquantized weights); restore the quantization_config, or load an unquantized "
                                      "checkpoint")
            if name == "weight":
                weight, scale = fp8.quantize_weight_per_channel(loaded_float_weight(layer, tensor))
                layer.register_buffer("weight", weight)
                layer.register_buffer("weight_scale", scale)
            else:
                super().load_weight(layer, name, tensor)
        elif name == "weight":
            if tensor.dtype != fp8.FP8_DTYPE:
                raise CheckpointError(
                    f"{where}: expected a float8_e4m3fn weight, got {tensor.dtype}; the checkpoint must be saved "
                    "compressed (quantization_status 'compressed', format 'float-quantized')")
            check_tensor_shape(layer, name, tensor, tuple(layer.weight.shape))
            layer.weight.copy_(tensor)
        elif name in ("weight_scale", "input_scale") and hasattr(layer, name):
            target: torch.Tensor = getattr(layer, name)
            if not tensor.is_floating_point() or tensor.numel() != target.numel():
                raise CheckpointError(
                    f"{where}: {name} has shape {tuple(tensor.shape)} ({tensor.dtype}) but the "
                    f"{layer.fp8_scheme.weight_strategy if name == 'weight_scale' else 'static tensor'} scheme "
                    f"needs {target.numel()} float value(s)")
            target.copy_(tensor.reshape(target.shape))  # [out, 1] and [] checkpoint shapes both flatten
        elif name in IGNORED_ZERO_POINTS:
            if bool(torch.any(tensor.to(torch.float32) != 0)):
                raise CheckpointError(f"{where}: {name} is not zero; asymmetric FP8 is not supported")
            return
        else:
            raise CheckpointError(f"unexpected tensor {name!r} for {where} with FP8 scheme {layer.fp8_scheme}")
        mark_loaded(layer, name)

    def process_after_loading(self, layer: nn.Module) -> None:
        require_loaded(layer, self._required(layer), self.name)

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        """Per-channel weight scales concatenate; per-tensor ones (and static input scales) merge only when equal."""
        scheme = parts[0].fp8_scheme
        if any(p.fp8_scheme != scheme for p in parts):
            return False
        for name in ("weight_scale", "input_scale") if scheme.weight_strategy != "channel" else ("input_scale",):
            if hasattr(parts[0], name) and not all(torch.equal(getattr(p, name), getattr(parts[0], name))
                                                   for p in parts):
                return False
        merged.fp8_scheme = scheme
        merged.register_buffer("weight", torch.cat([p.weight for p in parts]))
        merged.register_buffer("weight_scale", torch.cat([p.weight_scale for p in parts])
                               if scheme.weight_strategy == "channel" else parts[0].weight_scale.clone())
        if hasattr(parts[0], "input_scale"):
            merged.register_buffer("input_scale", parts[0].input_scale.clone())
        return True

    # ------------------------------------------------------------------ apply
    def _announce(self, backend: str, reason: str) -> None:
        if backend not in self._announced:
            self._announced.add(backend)
            log.warning("fp8: %s; using the %s path", reason, backend)

    def _pick_backend(self, x: torch.Tensor, n: int, k: int) -> str:
        if self.backend == "scaled_mm" and x.is_cuda and (n % 16 or k % 16):
            raise ConfigError(f"fp8.backend=scaled_mm needs layer shapes that are multiples of 16 on CUDA "
                              f"(torch._scaled_mm), got a [{n}, {k}] layer; drop the option (auto emulates such "
                              "layers)")
        if self.backend != "auto":
            return self.backend
        if not x.is_cuda:
            self._announce("emulate", "no CUDA device, so FP8 matmuls are emulated (activations rounded to fp8 "
                           "per token, weights dequantized, fp32 matmul): correct, saves weight memory, not faster")
            return "emulate"
        if _capability(x.device.index or 0) < (8, 9) or not hasattr(torch, "_scaled_mm"):
            self._announce("emulate", "this GPU has no FP8 tensor cores (needs sm89+, e.g. L4/H100), so FP8 "
                           "matmuls are emulated by dequantizing: correct and memory-saving but slower than bf16")
            return "emulate"
        if n % 16 or k % 16:
            self._announce("emulate", f"a layer of shape [{n}, {k}] is not a multiple of 16 for torch._scaled_mm")
            return "emulate"
        return "scaled_mm"

    def _quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scheme: fp8.Fp8Scheme = layer.fp8_scheme
        if scheme.static_input:
            return fp8.to_fp8(x, layer.input_scale), layer.input_scale
        if scheme.act_strategy == "tensor":  # dynamic per-tensor
            scale = fp8.scale_from_amax(x.abs().amax()).reshape(1)
            return fp8.to_fp8(x, scale), scale
        if x.is_cuda:
            from ..kernels.fp8 import per_token_quant

            return per_token_quant(x)
        return fp8.quantize_per_token(x)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        n, k = layer.weight.shape
        scheme: fp8.Fp8Scheme = layer.fp8_scheme
        if scheme.act_strategy is None:  # weight-only FP8
            out = x2 @ fp8.dequantize(layer.weight, layer.weight_scale).to(x2.dtype).t()
        else:
            backend = self._pick_backend(x2, n, k)
            xq, x_scale = self._quantize_input(layer, x2)
            if backend == "scaled_mm":
                out = scaled_mm(xq, x_scale, layer.weight, layer.weight_scale, x2.dtype)
            elif backend == "triton":
                from ..kernels.fp8 import w8a8_gemm

                out = w8a8_gemm(xq, x_scale, layer.weight, layer.weight_scale, x2.dtype)
            else:
                x_dq = fp8.dequantize(xq, x_scale)
                out = (x_dq @ fp8.dequantize(layer.weight, layer.weight_scale).t()).to(x2.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], n)


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with per-tensor scales, or row-wise ones ([M, 1] x [1, N], bf16 output) otherwise."""
    m, n = xq.shape[0], weight.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()),
                                out_dtype=out_dtype)
    scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)  # asked once, not on every layer call
