"""The `gptq` quant method: GPTQ checkpoints (AutoGPTQ, GPTQModel): 4 bits run by the AWQ W4A16 kernels, 8 bits by
the W8A16 ones; and `auto-round`, AutoRound's checkpoints, which pack GPTQ's layout (or AWQ's)."""
from __future__ import annotations

from typing import Any

from ..core.config import EngineConfig
from ..core.errors import ConfigError
from ..core.hookspecs import QuantMethodFactory, hookimpl
from ..core.interfaces import QuantMethod
from ..core.plugin_options import read_plugin_options
from ..core.registry import Register
from ..quant import FUSED_MAX_ROWS

GPTQ_OPTIONS = {
    "fused_max_rows": FUSED_MAX_ROWS,
}


def build_gptq(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """A GPTQ method for the checkpoint's ``quantization_config``; a checkpoint without one is refused (GPTQ needs
    calibration: quantize on load with ``--quant awq``, or calibrated with ``infer quantize``).

    ``config.plugin_options["gptq"]``: the options of :data:`GPTQ_OPTIONS`.
    """
    from ..quant.gptq import parse_config
    from ..quant.gptq_method import gptq_method

    options = read_plugin_options(config, "gptq", GPTQ_OPTIONS)
    if quantization_config is None:
        raise ConfigError("--quant gptq loads GPTQ checkpoints, and this one is not quantized: GPTQ needs "
                          "calibration; quantize on load with --quant awq (round-to-nearest int4) or --quant fp8, "
                          "or run `infer quantize --method gptq MODEL OUT` once and load OUT")
    return gptq_method(parse_config(quantization_config), options["fused_max_rows"])


def build_auto_round(config: EngineConfig, quantization_config: dict[str, Any] | None) -> QuantMethod:
    """The method of an AutoRound checkpoint (:mod:`infer.quant.auto_round`): GPTQ's layers for its auto_gptq
    packing, one per scheme, AWQ's for its auto_awq packing.

    ``config.plugin_options["auto-round"]``: the options of :data:`GPTQ_OPTIONS`.
    """
    from ..quant.auto_round import AutoRoundAwqMethod, parse_auto_round
    from ..quant.gptq_method import gptq_method

    options = read_plugin_options(config, "auto-round", GPTQ_OPTIONS)
    if quantization_config is None:
        raise ConfigError("--quant auto-round loads AutoRound checkpoints, and this one is not quantized; quantize "
                          "on load with --quant awq or --quant fp8, or run `infer quantize MODEL OUT` once and load "
                          "OUT")
    parsed = parse_auto_round(quantization_config)
    if parsed.packing == "awq":
        return AutoRoundAwqMethod(parsed, options["fused_max_rows"])
    return gptq_method(parsed, options["fused_max_rows"], name="auto-round")


@hookimpl
def register_quant_methods(register: Register[QuantMethodFactory]) -> None:
    register("gptq", build_gptq, options=GPTQ_OPTIONS)
    # AutoRound (Intel's auto-round) packs GPTQ's or AWQ's layout
    register("auto-round", build_auto_round, options=GPTQ_OPTIONS)
