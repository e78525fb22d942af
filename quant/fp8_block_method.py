"""The QuantMethod of block-wise FP8 checkpoints (:mod:`.fp8_block`): e4m3 weights with per-block scales, activations
quantized per token and group at run time."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..core.errors import CheckpointError, ConfigError
from ..core.interfaces import QuantMethod, check_float
from .common import check_tensor_shape, layer_name, mark_loaded, require_loaded
from .fp8 import FP8_DTYPE
from .fp8_block import BlockFp8Config, block_gemm_reference, has_fp8_tensor_cores, k_tile, quantize_per_token_group

log = logging.getLogger("infer")

BACKENDS = ("auto", "triton", "emulate")


class BlockFp8LinearMethod(QuantMethod):
    """W8A8 linears with block scales.

    A quantized layer holds ``weight`` fp8 [out, in], ``weight_scale_inv`` fp32 [ceil(out / bn), ceil(in / bk)],
    ``fp8_block`` (bn, bk) and ``fp8_backend``. As in transformers, a layer the config quantizes but whose
    checkpoint ``weight`` is a float tensor (a head or a router left in bf16) stays unquantized: ``fp8_block``
    None, ``weight`` in the model dtype. ``backend``: ``triton`` (per-token-group quantization and the
    block-scaled GEMM: a GPU with FP8 tensor cores, or the interpreter), ``emulate`` (quantize activations to fp8
    and back, dequantize the weight, fp32 matmul: correct anywhere, saves weight memory, not faster), or ``auto``:
    ``triton`` where it runs on ``device`` (sm89+, and a K-tile of at least 32 for the layer's bk), else
    ``emulate``, announced once in the log.
    """

    name = "fp8"

    def __init__(self, config: BlockFp8Config, backend: str = "auto", device: torch.device | None = None) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"block-wise FP8 checkpoints run with fp8.backend {', '.join(BACKENDS)}, not "
                              f"{backend!r} (torch._scaled_mm's block scaling is not wired); drop the option")
        self.config = config
        self.backend = backend
        self.device = device or torch.device("cpu")
        self._announced: set[str] = set()

    def _layer_backend(self, prefix: str, group_k: int) -> str:
        """The GEMM of a layer whose scale groups span ``group_k`` inputs."""
        native = self.device.type == "cuda"
        tile = k_tile(group_k, native)
        if self.backend == "triton":
            if tile is None:
                raise ConfigError(f"fp8.backend=triton cannot run layer {prefix!r}: its weight scales group "
                                  f"{group_k} inputs, and the Triton GEMM needs a multiple of {32 if native else 16};"
                                  " drop the option (auto emulates such layers)")
            return "triton"
        if self.backend == "emulate":
            return "emulate"
        if not native:
            self._announce("no CUDA device, so block-wise FP8 matmuls are emulated (activations rounded to fp8 per "
                           "token and group, weights dequantized, fp32 matmul): correct, saves weight memory, not "
                           "faster")
        elif not has_fp8_tensor_cores(self.device):
            self._announce("this GPU has no FP8 tensor cores (sm89+: L4, H100, ...), so block-wise FP8 matmuls are "
                           "emulated by dequantizing: correct and memory-saving, but slower than bf16")
        elif tile is None:
            self._announce(f"layers whose weight scales group {group_k} inputs (not a multiple of 32) cannot run "
                           "the Triton FP8 GEMM, so they are emulated")
        else:
            return "triton"
        return "emulate"

    def _announce(self, reason: str) -> None:
        if reason not in self._announced:
            self._announced.add(reason)
            log.warning("fp8: %s", reason)

    def applies_to(self, prefix: str) -> bool:
        return self.config.applies_to(prefix)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        layer.fp8_block = self.config.block_for(out_features, in_features)
        layer.fp8_backend = self._layer_backend(getattr(layer, "prefix", ""), layer.fp8_block[1])
        layer.model_dtype = dtype
        # weight_scale_inv is registered when the checkpoint provides it: a float weight needs none
        layer.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        where = f"layer {layer_name(layer)!r}"
        if name == "bias":
            super().load_weight(layer, name, tensor)
        elif name == "weight":
            check_tensor_shape(layer, name, tensor, tuple(layer.weight.shape))
            if tensor.dtype != FP8_DTYPE:
                if tensor.element_size() == 1:
                    raise CheckpointError(f"{where}: weight is {tensor.dtype}; block-wise FP8 checkpoints hold "
                                          "float8_e4m3fn weights (or float ones for layers left unquantized)")
                check_float(f"{layer_name(layer)}.weight", tensor)
                layer.fp8_block = None
                layer.register_buffer("weight", tensor.to(layer.weight.device, layer.model_dtype, copy=True))
            else:
                layer.weight.copy_(tensor)
        elif name == "weight_scale_inv":
            bn, bk = self.config.block_for(*layer.weight.shape)
            n, k = layer.weight.shape
            shape = (-(-n // bn), -(-k // bk))
            # exact: a transposed grid, or one of other blocks with as many values, would scale the wrong weights
            fits = tuple(tensor.shape) == shape or shape == (1, 1) and tensor.numel() == 1  # one per tensor: [] too
            if not tensor.is_floating_point() or not fits:
                raise CheckpointError(f"{where}: weight_scale_inv has shape {tuple(tensor.shape)} ({tensor.dtype}) "
                                      f"but blocks of {bn}x{bk} over a [{n}, {k}] weight need {list(shape)} floats; "
                                      "check weight_block_size in config.json")
            scale = tensor.to(layer.weight.device, torch.float32, copy=True).reshape(shape)
            layer.register_buffer("weight_scale_inv", scale)
        else:
            raise CheckpointError(f"unexpected tensor {name!r} for {where} of a block-wise FP8 checkpoint")
        mark_loaded(layer, name)

    def process_after_loading(self, layer: nn.Module) -> None:
        require_loaded(layer, ("weight",) + (("bias",) if layer.bias is not None else ()), "block-wise FP8")
        if layer.fp8_block is None:
            if hasattr(layer, "weight_scale_inv"):
                raise CheckpointError(f"layer {layer_name(layer)!r} has a float weight but also weight_scale_inv; "
                                      "a block-wise FP8 checkpoint stores the weight of a scaled layer as fp8")
        else:
            require_loaded(layer, ("weight_scale_inv",), "block-wise FP8")

    def merge(self, parts: list[nn.Module], merged: nn.Module) -> bool:
        """Quantized parts concatenate when each but the last fills whole row blocks; float ones always do."""
        block = parts[0].fp8_block
        if any(p.fp8_block != block for p in parts) or \
                block is not None and any(p.weight.shape[0] % block[0] for p in parts[:-1]):
            return False
        merged.model_dtype, merged.fp8_block, merged.fp8_backend = parts[0].model_dtype, block, parts[0].fp8_backend
        merged.register_buffer("weight", torch.cat([p.weight for p in parts]))
        if block is not None:
            merged.register_buffer("weight_scale_inv", torch.cat([p.weight_scale_inv for p in parts]))
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        block = layer.fp8_block
        if block is None:
            out = x2 @ layer.weight.t()
        elif layer.fp8_backend == "triton":
            from ..kernels.fp8_block import per_token_group_quant, w8a8_block_gemm

            xq, x_scale = per_token_group_quant(x2, block[1])
            out = w8a8_block_gemm(xq, x_scale, layer.weight, layer.weight_scale_inv, block, x2.dtype)
        else:
            xq, x_scale = quantize_per_token_group(x2, block[1])
            out = block_gemm_reference(xq, x_scale, layer.weight, layer.weight_scale_inv, block, x2.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.weight.shape[0])
