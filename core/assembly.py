"""Engine assembly: load the model, then build the components the config names through the plugin registries."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig
from .errors import ConfigError, PluginError
from .interfaces import (AttentionBackend, EvictionPolicy, KVCache, Proposer, ReasoningParser, Scheduler,
                         ToolParser)
from .loader import LoadedModel, LoadProgress, host_memory_available, load_model
from .model import check_capturable, check_softcap, fit_sliding_window
from .lora import start_lora_adapters
from .plugins import PluginManager
from .runner import Culprits, ModelRunner

log = logging.getLogger("infer")
VERIFY_GRAPH_MAX_BATCH = 32


@dataclass
class Components:
    """What an Engine runs on. ``config`` is resolved in place: the model path, attention backend and swap blocks."""

    loaded: LoadedModel
    attention: AttentionBackend
    kv_dtype: torch.dtype
    num_blocks: int
    kv: KVCache
    scheduler: Scheduler
    runner: ModelRunner
    proposer: Proposer | None
    eviction: EvictionPolicy
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None

    @property
    def bytes_per_block(self) -> int:
        return ModelRunner.bytes_per_block(self.loaded.model, self.runner.block_size, self.kv_dtype)

    def active(self, config: EngineConfig) -> dict[str, str]:
        """Each kind's selected plugin name ("none" for a kind left out), as metrics and ``infer bench`` show."""
        return {"scheduler": config.scheduler, "kv_cache": config.kv_cache, "attention": config.attention,
                "eviction_policy": config.eviction_policy, "quant": self.loaded.quant_name or "none",
                "proposer": config.proposer or "none", "tool_parser": config.tool_parser or "none",
                "reasoning_parser": config.reasoning_parser or "none"}

    def blamed(self, config: EngineConfig) -> dict[str, tuple[str | None, object]]:
        """Each kind's (plugin name, component), for :class:`~infer.core.plugins.Blame` to name a failing one."""
        return {"scheduler": (config.scheduler, self.scheduler), "kv_cache": (config.kv_cache, self.kv),
                "eviction_policy": (config.eviction_policy, self.eviction),
                "attention_backend": (config.attention, self.attention),
                "proposer": (config.proposer, self.proposer), "tool_parser": (config.tool_parser, self.tool_parser),
                "reasoning_parser": (config.reasoning_parser, self.reasoning_parser),
                "quant_method": (self.loaded.quant_name, self.loaded.quant),
                "model": (self.loaded.architecture, self.loaded.model)}

    def summary(self, config: EngineConfig, async_output: bool, async_scheduling: bool) -> str:
        """The engine-ready log line: the model, the KV pool, the plugins and the fast-path switches."""
        spec, graphs, mixed = self.loaded.model.spec, self.runner.graphs, self.runner.mixed_graphs
        plugins = ", ".join(f"{kind} {name}" for kind, name in self.active(config).items())
        plugins += f", scheduling policy {config.scheduling_policy}"
        return (f"{config.model} on {self.loaded.device} in {str(self.loaded.dtype).removeprefix('torch.')} "
                f"({spec.num_layers} layers, max_model_len {spec.max_model_len}); KV pool {self.num_blocks} blocks "
                f"of {config.block_size} tokens, {str(self.kv_dtype).removeprefix('torch.')}, "
                f"{self.num_blocks * self.bytes_per_block / 2**20:.0f} MiB; {plugins}; CUDA graphs "
                + ("off" if graphs is None else "on" if mixed is None else f"on (mixed steps up to {mixed.sizes[-1]} "
                   "tokens)") + f", async output {'on' if async_output else 'off'}, async scheduling "
                f"{'on' if async_scheduling else 'off'}")


def assemble(config: EngineConfig, plugins: PluginManager, load_progress: LoadProgress | None = None) -> Components:
    """Load ``config.model`` (the embedded default when None) and build every component, each factory checked;
    ``load_progress``: told the bytes of the weight files read (core/loader.py ``LoadProgress``)."""
    plugins.check_plugin_options(config, warn_unknown=False)  # lazily built components' too, before any load
    if config.model is None:
        from ..models.tiny import ensure_default_model

        config.model = str(ensure_default_model())
    loaded = load_model(config, plugins, Path(config.model), load_progress)
    if config.cpu_threads is not None and loaded.device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)  # process-wide: torch has one intra-op pool
    config.attention, attention = make_attention(config, plugins, loaded)  # resolved: a draft runs on it too
    fit_sliding_window(loaded.model, attention, config.max_model_len)
    check_softcap(loaded.model, attention)
    graphs = config.cuda_graphs and loaded.device.type == "cuda" and attention.supports_cuda_graphs
    if graphs:
        check_capturable(loaded.model)  # before the draft model and the KV pool are built
    kv_dtype, kv_scales = kv_cache_format(config, loaded)
    proposer = make_proposer(config, plugins, loaded)  # before the KV pool is sized: a draft model takes memory too
    lora = start_lora_adapters(config, loaded)  # likewise
    per_block = ModelRunner.bytes_per_block(loaded.model, config.block_size, kv_dtype)
    num_blocks = num_kv_blocks(config, loaded, per_block)
    if config.preemption_mode == "swap" and config.num_swap_blocks is None:
        config.num_swap_blocks = int(config.swap_space_gb * 2**30) // per_block
        if not config.num_swap_blocks:
            log.warning("--preemption swap: --swap-space-gb %g holds no KV block (one takes %d bytes), so preempted "
                        "sequences are recomputed; raise --swap-space-gb", config.swap_space_gb, per_block)
    check_kv_memory(config, loaded.device, num_blocks, per_block)
    eviction = plugins.build("eviction_policy", config.eviction_policy, EvictionPolicy, config)
    kv = plugins.build("kv_cache", config.kv_cache, KVCache, config, num_blocks, eviction)
    if (getattr(kv, "block_size", None), getattr(kv, "num_blocks", None)) != (config.block_size, num_blocks):
        raise PluginError(f"KV cache {config.kv_cache!r} has block_size {getattr(kv, 'block_size', None)} and "
                          f"num_blocks {getattr(kv, 'num_blocks', None)}, not the {config.block_size} and {num_blocks}"
                          " its factory was given; fix the plugin (the runner and schedulers read both attributes)")
    scheduler = plugins.build("scheduler", config.scheduler, Scheduler, config, kv)
    if config.scheduling_policy not in scheduler.scheduling_policies:
        raise ConfigError(f"the scheduler {config.scheduler!r} follows the scheduling policies "
                          f"{', '.join(scheduler.scheduling_policies)}, not {config.scheduling_policy!r}; choose one "
                          "of those (--scheduling-policy), or a scheduler that follows it (--scheduler continuous)")
    if config.priority_aging_s is not None and not scheduler.follows_priority_aging:
        raise ConfigError(f"the scheduler {config.scheduler!r} does not follow --priority-aging-s (it does not set "
                          "Scheduler.follows_priority_aging); drop the option or choose --scheduler continuous or "
                          "chunked-prefill")
    runner = ModelRunner(loaded.model, attention, num_blocks, config.block_size, loaded.dtype, loaded.device,
                         config.seed, config.num_swap_blocks if config.preemption_mode == "swap" else 0,
                         kv_dtype=kv_dtype, kv_scales=kv_scales, culprits=Culprits(
                             f"scheduler {plugins.named('scheduler', config.scheduler)}",
                             f"KV cache {plugins.named('kv_cache', config.kv_cache)}"))
    if lora is not None and not kv.isolates_namespaces:
        raise ConfigError(f"KV cache {config.kv_cache!r} does not declare isolates_namespaces, so its prefix reuse "
                          "could serve one LoRA adapter's KV to another's request; use --kv-cache paged or radix-cache "
                          "with --lora")
    runner.lora = lora  # before graphs are captured: they include the adapters
    if config.cuda_graphs and loaded.device.type == "cuda":
        if graphs:
            mixed = config.mixed_graph_tokens() if attention.supports_mixed_cuda_graphs else 0
            if config.cuda_graph_max_tokens and not mixed:
                log.warning("--cuda-graph-max-tokens is ignored: attention backend %r cannot capture mixed steps, "
                            "so they run eagerly", config.attention)
            runner.enable_cuda_graphs(min(config.max_num_seqs, 256), verify_graph_sizes(config),
                                      mixed_tokens=mixed, mixed_rows=config.max_num_seqs)
        else:
            log.info("CUDA graphs are off: attention backend %r does not support them", config.attention)
    tool_parser = None if config.tool_parser is None else \
        plugins.build("tool_parser", config.tool_parser, ToolParser, config, loaded.tokenizer)
    if tool_parser is not None:
        check_written_tags(config.tool_parser or "", tool_parser.written_tags, loaded.model.spec.vocab_size)
    reasoning_parser = None if config.reasoning_parser is None else \
        plugins.build("reasoning_parser", config.reasoning_parser, ReasoningParser, config, loaded.tokenizer)
    return Components(loaded, attention, kv_dtype, num_blocks, kv, scheduler, runner, proposer, eviction, tool_parser,
                      reasoning_parser)


def check_written_tags(name: str, tags: object, vocab_size: int) -> None:
    """A tool parser's written_tags: a mapping of token ids in the vocabulary to non-empty texts."""
    if not (isinstance(tags, Mapping) and all(type(t) is int and 0 <= t < vocab_size and isinstance(text, str)
                                              and text for t, text in tags.items())):
        raise PluginError(f"tool parser {name!r}: written_tags is {tags!r:.80}, not a mapping of token ids in the "
                          f"vocabulary (0 to {vocab_size - 1}) to the texts to write; fix the plugin")


def make_attention(config: EngineConfig, plugins: PluginManager, loaded: LoadedModel
                   ) -> tuple[str, AttentionBackend]:
    """The named backend; by default `triton` on CUDA, `cpu` on the CPU (it compiles a C kernel: without a working
    C compiler, `torch`, with a warning that says why)."""
    registry = plugins.registry("attention_backend")
    if config.attention:
        return config.attention, plugins.build("attention_backend", config.attention, AttentionBackend, config)
    if loaded.device.type == "cuda":
        if "triton" in registry:
            return "triton", plugins.build("attention_backend", "triton", AttentionBackend, config)
        log.warning("CUDA device but no 'triton' attention backend is registered; using 'torch'")
    elif "cpu" in registry:
        try:
            return "cpu", plugins.build("attention_backend", "cpu", AttentionBackend, config)
        except PluginError as exc:
            log.warning("attention backend 'cpu' is unavailable, using 'torch': %s", exc)
    return "torch", plugins.build("attention_backend", "torch", AttentionBackend, config)


def make_proposer(config: EngineConfig, plugins: PluginManager, loaded: LoadedModel) -> Proposer | None:
    if config.proposer is None:
        if config.draft_model is not None or config.num_speculative_tokens:
            raise ConfigError("--draft-model and --num-speculative-tokens need a proposer: add --proposer draft-model "
                              "or --proposer ngram or jump-forward (or --plugin NAME; in Python: proposer=...)")
        return None
    entry = plugins.registry("proposer").entry(config.proposer)
    if config.draft_model is not None and entry.name != "draft-model":
        raise ConfigError(f"--draft-model is read by the draft-model proposer only, not by {entry.name!r}; "
                          "use --proposer draft-model, or drop --draft-model")
    return plugins.build("proposer", entry.name, Proposer, config, loaded, plugins)


def kv_cache_format(config: EngineConfig, loaded: LoadedModel
                    ) -> tuple[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """The KV element dtype and, for ``--kv-cache-dtype fp8``, the per-layer scales (quant/kv_cache.py)."""
    if config.kv_cache_dtype != "fp8":
        return loaded.dtype, None
    from ..quant.kv_cache import CALIBRATION_TOKENS, FP8_KV_DTYPE, calibrate_kv_scales, calibration_ids

    ids = calibration_ids(loaded.tokenizer, min(CALIBRATION_TOKENS, loaded.model.spec.max_model_len))
    return FP8_KV_DTYPE, calibrate_kv_scales(loaded.model, ids, loaded.device)


def verify_graph_sizes(config: EngineConfig) -> dict[int, int]:
    """Speculative decoding: verification steps of K + 1 query tokens per sequence get graphs too, for batches up
    to VERIFY_GRAPH_MAX_BATCH (speculation pays at small batches; its policy may turn it off above)."""
    k = config.num_speculative_tokens
    if config.proposer is None or k < 1:
        return {}
    return {k + 1: min(config.max_num_seqs, VERIFY_GRAPH_MAX_BATCH)}


def check_kv_memory(config: EngineConfig, device: torch.device, num_blocks: int, per_block: int) -> None:
    """Refuse a KV pool or swap space larger than the memory that would hold it, before the caches' bookkeeping
    (a list entry per block) and the tensors are built: past the machine's memory they only thrash or get killed."""
    pool = num_blocks * per_block
    if device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory
        if pool > device_memory:
            raise ConfigError(f"the KV pool ({num_blocks} blocks, {pool / 2**30:.1f} GiB) exceeds the {device} "
                              f"memory ({device_memory / 2**30:.1f} GiB); lower --num-kv-blocks or "
                              "--kv-cache-memory-gb")
    swap = (config.num_swap_blocks or 0) * per_block if config.preemption_mode == "swap" else 0
    on_host = {"KV pool": pool if device.type == "cpu" else 0, "swap space": swap}
    available = host_memory_available()
    if available is not None and sum(on_host.values()) > available:
        blocks = {"KV pool": f"{num_blocks} blocks, ", "swap space": ""}
        parts = " and the ".join(f"{name} ({blocks[name]}{size / 2**30:.1f} GiB)" for name, size in on_host.items()
                                 if size)
        raise ConfigError(f"the {parts} exceed{'s' if ' and ' not in parts else ''} the memory this machine has "
                          f"available ({available / 2**30:.1f} GiB, with the model loaded); lower --num-kv-blocks "
                          "or --kv-cache-memory-gb (the pool), or --swap-space-gb (swap; num_swap_blocks= in Python)")


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, per_block: int) -> int:
    """``--num-kv-blocks``, else what the KV memory budget holds: ``--kv-cache-memory-gb``, 90% of free GPU memory
    less 1 GiB, or on the CPU enough for max_num_seqs full contexts (at most 2 GiB)."""
    if config.num_kv_blocks is not None:
        if config.kv_cache_memory_gb is not None:
            log.warning("--kv-cache-memory-gb %g is unused: --num-kv-blocks %d sizes the KV pool; give one of them",
                        config.kv_cache_memory_gb, config.num_kv_blocks)
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * 2**30)
    elif loaded.device.type == "cuda":
        torch.cuda.empty_cache()  # loading's freed temporaries (e.g. merged projections' parts) count as free
        free, _ = torch.cuda.mem_get_info(loaded.device)
        budget = int(free * 0.9) - 2**30  # leave room for activations and CUDA graphs
    else:
        needed = config.max_num_seqs * loaded.model.spec.max_model_len // config.block_size + 1
        budget = min(2 * 2**30, needed * per_block)
    blocks = budget // per_block
    if blocks < 1:
        raise ConfigError(f"the KV budget holds no block of {per_block} bytes; raise --kv-cache-memory-gb")
    return blocks
