"""The `fp8` quant method: compressed-tensors and block-wise FP8 checkpoints, or dynamic FP8 quantization on load."""
from __future__ import annotations

import logging
from typing import Any

from ..core.config import EngineConfig
from ..core.errors import CheckpointError, ConfigError
from ..core.hookspecs import QuantMethodFactory, hookimpl
from ..core.interfaces import QuantMethod
from ..core.plugin_options import PluginOption, read_plugin_options
from ..core.registry import Register
from ..quant import FP8_BACKENDS, FUSED_MAX_ROWS

log = logging.getLogger("infer")

FP8_OPTIONS = {
    "backend": PluginOption("auto", "the FP8 GEMM: scaled_mm (torch._scaled_mm, CUDA sm89+), triton (infer's "
                            "kernel, CUDA), emulate (dequantize and run the model dtype's GEMM); auto picks by device",
                            choices=FP8_BACKENDS),
    "lm_head": PluginOption(False, "also quantize the output head when quantizing on load (per-channel e4m3; from "
                                   "the embedding when tied): fewer bytes per decode step, a larger logits error"),
}


def build_fp8(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """FP8 for a compressed-tensors or block-wise (quant_method "fp8") checkpoint, or per-channel/per-token dynamic
    FP8 on load when there is none.

    ``config.plugin_options["fp8"]``: the options of :data:`FP8_OPTIONS`.
    """
    import torch

    from ..core.loader import resolve_device, triton_runs_on
    from ..quant.fp8 import parse_compressed_tensors
    from ..quant.fp8_method import Fp8LinearMethod

    options = read_plugin_options(config, "fp8", FP8_OPTIONS)
    backend = options["backend"]
    on_cuda = resolve_device(config.device).type == "cuda"
    if backend == "triton" and not triton_runs_on(resolve_device(config.device)):
        raise ConfigError("--plugin-option fp8.backend=triton runs Triton kernels, which need a CUDA device (this "
                          "model runs on the CPU); use fp8.backend=emulate or drop the option")
    if backend == "triton" and on_cuda and torch.cuda.get_device_capability(resolve_device(config.device)) < (8, 9):
        raise ConfigError("--plugin-option fp8.backend=triton runs FP8 Triton kernels, which need a GPU with FP8 "
                          "tensor cores (sm89+, e.g. L4, H100); drop the option (auto emulates FP8 on this GPU) or "
                          "use fp8.backend=emulate")
    if backend == "scaled_mm" and on_cuda and torch.cuda.get_device_capability(resolve_device(config.device)) < (8, 9):
        raise ConfigError("--plugin-option fp8.backend=scaled_mm needs a GPU with FP8 tensor cores (sm89+, e.g. L4, "
                          "H100); drop the option (auto emulates FP8 on this GPU) or use fp8.backend=emulate")
    if quantization_config is None:
        log.info("fp8: quantizing weights on load (e4m3, per-channel scales; activations per token, dynamic)")
        return Fp8LinearMethod(None, backend, quantize_lm_head=options["lm_head"])
    method = quantization_config.get("quant_method")
    if method not in ("compressed-tensors", "fp8"):
        given = f"--quant {config.quant} was given, but " if config.quant else ""
        raise (ConfigError if config.quant else CheckpointError)(  # --quant given: change the command
            f"{given}the checkpoint is quantized with quant_method {method!r}, which infer's fp8 method does not load "
            "(it loads compressed-tensors and block-wise FP8 checkpoints and quantizes unquantized ones on load); "
            "drop --quant to use the checkpoint's own method")
    if options["lm_head"]:
        raise ConfigError("--plugin-option fp8.lm_head=true quantizes the head when fp8 quantizes on load, but this "
                          "checkpoint is quantized already and its config says which layers are FP8; drop the option")
    if method == "fp8":  # transformers' FineGrainedFP8: DeepSeek-V3, the Qwen3 FP8 releases
        from ..quant.fp8_block import parse_block_fp8
        from ..quant.fp8_block_method import BlockFp8LinearMethod

        return BlockFp8LinearMethod(parse_block_fp8(quantization_config), backend, resolve_device(config.device))
    parsed = parse_compressed_tensors(quantization_config)
    warn_kv_cache_scheme(quantization_config)
    return Fp8LinearMethod(parsed, backend)


PACKED_OPTIONS = {
    "fused_max_rows": FUSED_MAX_ROWS,
}


def build_compressed_tensors(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """A compressed-tensors checkpoint's method: int4 or int8 weights for ``pack-quantized`` groups (W4A16 run by
    the AWQ kernels, W8A16 by the W8A16 ones;
    ``config.plugin_options["compressed-tensors"]``: :data:`PACKED_OPTIONS`), beside them a non-uniform checkpoint's
    float-quantized groups by fp8; else fp8 (:func:`build_fp8`, whose options apply; without a checkpoint config,
    FP8 quantization on load)."""
    from ..quant.fp8 import group_formats
    from ..quant.pack_quantized import FORMAT

    formats = group_formats(quantization_config) if quantization_config is not None else set()
    if FORMAT not in formats:
        return build_fp8(config, quantization_config)
    from ..quant.gptq_method import pack_quantized_method
    from ..quant.pack_quantized import parse_pack_quantized

    options = read_plugin_options(config, "compressed-tensors", PACKED_OPTIONS)
    parsed = parse_pack_quantized(quantization_config)
    others = {name: group for name, group in quantization_config["config_groups"].items()
              if (group.get("format") or quantization_config.get("format")) != FORMAT}
    # a non-uniform checkpoint's FP8 groups: run by the fp8 method of those groups (its options apply)
    fp8 = build_fp8(config, {**quantization_config, "config_groups": others, "kv_cache_scheme": None}) \
        if others else None
    method = pack_quantized_method(parsed, options["fused_max_rows"], fp8)
    warn_kv_cache_scheme(quantization_config)
    return method


def warn_kv_cache_scheme(quantization_config: dict[str, Any]) -> None:
    if quantization_config.get("kv_cache_scheme"):
        log.warning("the checkpoint's kv_cache_scheme and its k/v scales are ignored; use --kv-cache-dtype to "
                    "choose the KV format (fp8 calibrates its own scales at start)")


@hookimpl
def register_quant_methods(register: Register[QuantMethodFactory]) -> None:
    register("fp8", build_fp8, options=FP8_OPTIONS)
    # checkpoints name their method in quantization_config.quant_method: compressed-tensors ones resolve here
    register("compressed-tensors", build_compressed_tensors, options=PACKED_OPTIONS)
