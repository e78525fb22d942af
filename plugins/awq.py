"""The `awq` quant method: AutoAWQ GEMM checkpoints, or round-to-nearest int4 quantization on load."""
from __future__ import annotations

import logging
from typing import Any

from ..core.config import EngineConfig
from ..core.errors import ConfigError
from ..core.hookspecs import QuantMethodFactory, hookimpl
from ..core.interfaces import QuantMethod
from ..core.registry import Register

log = logging.getLogger("infer")


def build_awq(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """An AWQ method for the checkpoint's ``quantization_config``, or RTN on load when there is none.

    ``config.plugin_options["awq"]`` may set ``group_size`` (on-load quantization only; default: per layer, the
    largest of 128, 64, 32 that divides its input size, else -1) and
    ``fused_max_rows`` (the largest batch that runs the fused Triton kernel on CUDA; default 64).
    """
    from ..quant.awq import parse_config
    from ..quant.awq_method import AwqLinearMethod

    options = config.plugin_options.get("awq", {}) if isinstance(config.plugin_options, dict) else {}
    fused_max_rows = options.get("fused_max_rows", 64)
    if not isinstance(fused_max_rows, int) or isinstance(fused_max_rows, bool) or fused_max_rows < 0:
        raise ConfigError(f"awq.fused_max_rows must be an integer >= 0 (0 never runs the fused kernel), got "
                          f"{fused_max_rows!r}; e.g. --plugin-option awq.fused_max_rows=64")
    group_size = options.get("group_size")
    if group_size is not None and quantization_config is not None:
        log.warning("awq: the checkpoint is AWQ-quantized already, so awq.group_size=%r is ignored (it sets the "
                    "group of on-load quantization)", group_size)
    if quantization_config is None:
        from ..quant.awq import GROUP_SIZES, is_group_size

        if group_size is not None and not is_group_size(group_size):
            raise ConfigError(f"awq.group_size must be one of {', '.join(map(str, GROUP_SIZES))} (-1: one group over "
                              f"each layer's whole input), got {group_size!r}; e.g. --plugin-option awq.group_size=64")
        log.warning("awq: quantizing on load with round-to-nearest (int4, group %s); calibrated AWQ is more "
                    "accurate: run `infer quantize --method awq MODEL OUT` once and load OUT",
                    group_size or "128, or 64/32 where 128 does not divide a layer's input, else -1 (one group "
                    "over the whole input)")
        return AwqLinearMethod(group_size, quantize_on_load=True, fused_max_rows=fused_max_rows)
    return AwqLinearMethod.from_config(parse_config(quantization_config), fused_max_rows=fused_max_rows)


@hookimpl
def register_quant_methods(register: Register[QuantMethodFactory]) -> None:
    register("awq", build_awq)
