"""The `awq` quant method: AutoAWQ GEMM checkpoints, or round-to-nearest int4 quantization on load."""
from __future__ import annotations

import logging
from typing import Any

from ..core.config import EngineConfig
from ..core.hookspecs import QuantMethodFactory, hookimpl
from ..core.interfaces import QuantMethod
from ..core.plugin_options import PluginOption, read_plugin_options
from ..core.registry import Register
from ..quant import AWQ_GROUP_SIZES, FUSED_MAX_ROWS

log = logging.getLogger("infer")

AWQ_OPTIONS = {
    "group_size": PluginOption(None, "the group of on-load quantization (-1: one group over each layer's whole "
                               "input); default per layer: the largest of 128, 64, 32 that divides its input, else "
                               "-1; ignored on an AWQ checkpoint", kind=int, choices=AWQ_GROUP_SIZES),
    "fused_max_rows": FUSED_MAX_ROWS,
    "lm_head": PluginOption(False, "also quantize the output head on load (RTN int4; from the embedding when "
                                   "tied): fewer bytes per decode step, a larger logits error; AutoAWQ keeps the "
                                   "head in 16 bits"),
}


def build_awq(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """An AWQ method for the checkpoint's ``quantization_config``, or RTN on load when there is none.

    ``config.plugin_options["awq"]``: the options of :data:`AWQ_OPTIONS`.
    """
    from ..quant.awq import parse_config
    from ..quant.awq_method import AwqLinearMethod

    options = read_plugin_options(config, "awq", AWQ_OPTIONS)
    fused_max_rows, group_size, lm_head = options["fused_max_rows"], options["group_size"], options["lm_head"]
    if group_size is not None and quantization_config is not None:
        log.warning("awq: the checkpoint is AWQ-quantized already, so awq.group_size=%r is ignored (it sets the "
                    "group of on-load quantization)", group_size)
    if quantization_config is None:
        log.warning("awq: quantizing on load with round-to-nearest (int4, group %s); calibrated AWQ is more "
                    "accurate: run `infer quantize --method awq MODEL OUT` once and load OUT",
                    group_size or "128, or 64/32 where 128 does not divide a layer's input, else -1 (one group "
                    "over the whole input)")
        return AwqLinearMethod(group_size, quantize_on_load=True, fused_max_rows=fused_max_rows,
                               quantize_lm_head=lm_head)
    return AwqLinearMethod.from_config(parse_config(quantization_config), fused_max_rows=fused_max_rows,
                                       quantize_lm_head=lm_head)


@hookimpl
def register_quant_methods(register: Register[QuantMethodFactory]) -> None:
    register("awq", build_awq, options=AWQ_OPTIONS)
