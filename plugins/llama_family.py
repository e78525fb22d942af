"""Registers the Llama-family architectures (Llama, Mistral, Qwen2, Qwen3)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.hookspecs import ModelFactory, hookimpl
from ..core.interfaces import Model, QuantMethod
from ..core.registry import Register

log = logging.getLogger("infer")


def build_llama_family(hf_config: dict[str, Any], quant: QuantMethod | None, dtype: torch.dtype,
                       config: EngineConfig) -> Model:
    from ..core.errors import ConfigError
    from ..models.llama import ArchConfig, LlamaFamilyModel

    arch = ArchConfig.from_hf(hf_config)
    max_len = config.max_model_len or arch.max_position_embeddings
    if arch.sliding_window is not None and max_len > arch.sliding_window:
        if config.max_model_len is not None:
            raise ConfigError(
                f"max-model-len {max_len} exceeds the model's sliding window {arch.sliding_window}; infer does not "
                f"implement sliding-window attention yet, so use --max-model-len <= {arch.sliding_window}")
        log.warning("limiting max_model_len to the sliding window (%d): sliding-window attention is not implemented",
                    arch.sliding_window)
        max_len = arch.sliding_window
    return LlamaFamilyModel(arch, quant, dtype, max_positions=max_len)


@hookimpl
def register_models(register: Register[ModelFactory]) -> None:
    from ..models.llama import ARCHITECTURES

    for name in ARCHITECTURES:
        register(name, build_llama_family)
