"""Group options: every engine option, parsed into an EngineConfig (also used by `infer bench --ab` arms)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from ..core.config import EngineConfig
from ..core.plugins import PluginManager

ENGINE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--model", "-m", default=None, help="Local HF model folder (default: the embedded demo model)."),
    click.option("--plugin", "plugins", multiple=True, metavar="NAME",
                 help="Select a registered component by name, whatever its kind (repeatable)."),
    click.option("--scheduler", default=None, help="Scheduler plugin name [default: continuous]."),
    click.option("--kv-cache", default=None, help="KV cache plugin name [default: paged]."),
    click.option("--attention", default=None, help="Attention backend [default: triton on CUDA, else torch]."),
    click.option("--quant", default=None, help="Quantization method (e.g. awq, fp8) [default: from the checkpoint]."),
    click.option("--eviction-policy", default=None, help="Eviction policy for cached KV blocks [default: lru]."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
                 help="Weight and activation dtype [default: auto: float32 on CPU, bf16/fp16 on GPU]."),
    click.option("--device", default=None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    click.option("--max-num-seqs", type=int, default=None, help="Most sequences in one step [default: 256]."),
    click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget of one step [default: 8192]."),
    click.option("--max-model-len", type=int, default=None, help="Context length [default: the model's]."),
    click.option("--block-size", type=int, default=None, help="Tokens per KV block [default: 16]."),
    click.option("--num-kv-blocks", type=int, default=None, help="Size of the KV pool in blocks."),
    click.option("--kv-cache-memory-gb", type=float, default=None,
                 help="KV pool as a memory budget [default: 90%% of free GPU memory, or up to 2 GiB on CPU]."),
    click.option("--no-prefix-caching", is_flag=True, default=False, help="Disable prefix caching."),
    click.option("--preemption", "preemption_mode", type=click.Choice(["recompute", "swap"]), default=None,
                 help="What a preempted sequence does with its KV [default: recompute]."),
    click.option("--swap-space-gb", type=float, default=None, help="Host memory for --preemption swap [default: 4]."),
    click.option("--seed", type=int, default=None, help="Seed of unseeded sampling [default: 0]."),
    click.option("--no-cuda-graphs", is_flag=True, default=False, help="Run decode steps eagerly on CUDA."),
]

FIELD_OF_OPTION = {
    "model": "model", "scheduler": "scheduler", "kv_cache": "kv_cache", "attention": "attention", "quant": "quant",
    "eviction_policy": "eviction_policy", "dtype": "dtype", "device": "device", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
    "block_size": "block_size", "num_kv_blocks": "num_kv_blocks", "kv_cache_memory_gb": "kv_cache_memory_gb",
    "seed": "seed", "preemption_mode": "preemption_mode", "swap_space_gb": "swap_space_gb",
}


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(ENGINE_OPTIONS):
        func = option(func)
    return func


@dataclass
class EngineArgs:
    """Parsed group options; ``build`` turns them into a validated EngineConfig against a plugin manager."""

    values: dict[str, Any] = field(default_factory=dict)
    plugin_names: list[str] = field(default_factory=list)
    no_prefix_caching: bool = False
    no_cuda_graphs: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        values = {FIELD_OF_OPTION[k]: v for k, v in kwargs.items() if k in FIELD_OF_OPTION and v is not None}
        return cls(values, list(kwargs.get("plugins") or ()), bool(kwargs.get("no_prefix_caching")),
                   bool(kwargs.get("no_cuda_graphs")))

    def build(self, plugins: PluginManager) -> EngineConfig:
        config = EngineConfig(**self.values)
        if self.no_prefix_caching:
            config.enable_prefix_caching = False
        if self.no_cuda_graphs:
            config.cuda_graphs = False
        explicit = {k: v for k, v in self.values.items() if k in ("scheduler", "kv_cache", "attention", "quant")}
        config = plugins.resolve_plugin_names(config, self.plugin_names)
        config = config.replace(**explicit)  # an explicit option wins over --plugin
        for kind, name in (("scheduler", config.scheduler), ("kv_cache", config.kv_cache),
                           ("eviction_policy", config.eviction_policy)):
            plugins.registry(kind).entry(name)  # unknown names fail here, listing the choices
        if config.attention:
            plugins.registry("attention_backend").entry(config.attention)
        if config.quant:
            plugins.registry("quant_method").entry(config.quant)
        return config.validate()
