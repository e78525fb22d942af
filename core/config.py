"""EngineConfig: every engine option, validated once with messages that say what to do."""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, ConfigError, InvalidRequestError

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
# a level per 31 years is no aging; past it, priority x interval leaves the floats' range for the largest priorities
MAX_PRIORITY_AGING_S = 1e9
DEFAULT_MIXED_GRAPH_TOKENS = 2048
MAX_LORA_ADAPTERS = 16
DEFAULT_MAX_LORA_RANK = 16
MAX_LORA_RANK = 512
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_CPU_THREADS = 1024  # torch segfaults on a matmul after set_num_threads(100000); 1024 runs
TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
}
TYPE_NAMES = {"int": "an integer", "float": "a finite number", "bool": "True or False", "str": "a string",
              "dict": "a dict"}
# component kind -> the EngineConfig field that selects it
COMPONENT_FIELDS = {
    "scheduler": "scheduler",
    "kv_cache": "kv_cache",
    "attention_backend": "attention",
    "quant_method": "quant",
    "eviction_policy": "eviction_policy",
    "proposer": "proposer",
    "tool_parser": "tool_parser",
    "reasoning_parser": "reasoning_parser",
    "structured_output_backend": "structured_output_backend",
}


@dataclass
class EngineConfig:
    """Options shared by the CLI group, ``LLM(...)`` and ``infer serve``. Components are plugin names."""

    model: str | None = None  # a local HF folder; None means the embedded default model
    scheduler: str = "continuous"
    kv_cache: str = "paged"
    attention: str | None = None  # None: "triton" with CUDA, else "cpu" ("torch" without a C compiler)
    quant: str | None = None
    eviction_policy: str = "lru"
    proposer: str | None = None  # speculative decoding off when None
    tool_parser: str | None = None  # None: a chat's reply stays text, tool calls included
    reasoning_parser: str | None = None  # None: a chat's reply stays text, its reasoning included
    structured_output_backend: str = "fsm"  # compiles SamplingParams.structured_output (built at the first use)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit size of the KV pool; else from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # else: 90% of free GPU memory less 1 GiB, or <= 2 GiB on CPU
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    # "fcfs": requests run in arrival order; "priority": by SamplingParams.priority (higher first, ties in arrival
    # order), preempting lower-priority sequences to admit a higher-priority request; "lpm": waiting requests with
    # the longest cached prefix first (SGLang's longest prefix match) (Scheduler.scheduling_policies)
    scheduling_policy: str = "fcfs"
    # with "priority": a request gains one priority level per this many seconds since it arrived, so that none waits
    # for ever behind more important ones (None: no aging; Scheduler.follows_priority_aging)
    priority_aging_s: float | None = None
    swap_space_gb: float = 4.0  # host memory for --preemption swap
    num_swap_blocks: int | None = None  # explicit host swap pool in blocks; else derived from swap_space_gb
    # admit a request only while the free KV blocks cover this share of every running sequence's remaining max_tokens;
    # "auto": a share that adapts to preemptions (plugins/continuous_scheduler.AdmissionReserve)
    kv_admission_reserve: float | str = 0.0
    num_speculative_tokens: int = 0
    draft_model: str | None = None
    # LoRA adapters served beside the model: a name (what SamplingParams.lora_adapter gives) -> the folder that PEFT's
    # save_pretrained wrote. A step whose tokens use several adapters runs every loaded adapter's low-rank product for
    # every token (masked to each token's own), so the cost grows with their number: at most MAX_LORA_ADAPTERS
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # adapter slots, for adapters loaded while the engine runs (Engine.load_lora_adapter) beside those of lora_adapters;
    # None: as many as lora_adapters. With more, every decoder linear gets room, for an adapter of rank up to
    # max_lora_rank (None: the largest of lora_adapters' ranks, and DEFAULT_MAX_LORA_RANK with spare slots)
    max_lora_adapters: int | None = None
    max_lora_rank: int | None = None
    chat_template: str | None = None  # a Jinja chat template file, in place of the model's own (core/chat.py)
    # template variables of every chat prompt, each one the template reads; a prompt's own chat_template_kwargs win
    default_chat_template_kwargs: dict[str, Any] | None = None
    # a control token's text in a chat message (a user's "<|im_end|>") is encoded as plain text, so that only the
    # template writes control tokens (HF's apply_chat_template(sanitize_control_tokens=True), which it runs)
    sanitize_chat_control_tokens: bool = False
    cuda_graphs: bool = True
    # Steps that decode graphs do not take (prefill chunks, prefills beside decodes) of up to this many tokens
    # replay CUDA graphs too (one per token count of a ladder; padded to the next), where the attention backend
    # supports it; 0: they run eagerly. None: 2048, or max_num_batched_tokens when smaller. Larger steps run eagerly
    # (their GEMMs outlast the host's kernel launches).
    cuda_graph_max_tokens: int | None = None
    fused_ops: bool | None = None  # Triton norms/rotary/SiLU-and-mul in the model; None: on when it runs on CUDA
    # Unquantized linears (and a tied lm_head) of steps with at most this many rows run kernels/skinny_gemm.py
    # instead of cuBLAS, on CUDA in fp16/bf16; 0: never, the default until a GPU run has timed it (at most 16)
    skinny_gemm_rows: int = 0
    # q/k/v and gate/up projections merged into one GEMM each after loading, where the quant method can merge them
    # (fewer, larger GEMMs: fewer kernels per step). None: on when the model runs on CUDA
    fuse_projections: bool | None = None
    # Outputs of step N are built (detokenized, stop strings) in step N + 1 while the device runs its forward pass;
    # None: on when the model runs on CUDA (on a CPU nothing runs meanwhile, so it would only delay outputs)
    async_output: bool | None = None
    # Schedule and launch step N + 1 before reading step N's sampled tokens back: the device runs step N + 1 while
    # the host reads step N's tokens, checks stops and builds outputs (so outputs come a step late: async output is
    # implied). A sequence that stopped on a token of step N has run step N + 1 for nothing. None: on when the model
    # runs on CUDA without a proposer and async output is not turned off (an H200, 2026-11-30: 1.39x output tok/s on
    # the anchor workload, 1.23x single stream; docs/PERF.md), off on a CPU.
    async_scheduling: bool | None = None
    # At the end of start-up, gc.collect() then gc.freeze(): the startup heap (modules, model, tokenizer, graphs)
    # leaves the collector's scans, so no full collection stalls a step (process-wide; vLLM and SGLang do the same).
    # Off by default: an engine frozen into the heap is never collected if it sits in a reference cycle, so a
    # process that builds and drops engines (benchmarks, tests) would keep their memory. `infer serve` turns it on.
    freeze_gc: bool = False
    seed: int = 0
    cpu_threads: int | None = None  # torch intra-op threads when running on the CPU; None leaves torch's default
    plugin_options: dict[str, Any] = field(default_factory=dict)  # free-form options for third-party plugins

    def validate(self) -> EngineConfig:
        """Check types, ranges and combinations; return self for chaining."""
        for name in ("model", "draft_model", "chat_template"):  # a pathlib.Path is as good as a string
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for f in dataclasses.fields(self):
            kinds = [kind.strip().split("[")[0] for kind in str(f.type).split("|")]
            value = getattr(self, f.name)
            if not (value is None and "None" in kinds) and not any(TYPE_CHECKS[kind](value) for kind in kinds
                                                                   if kind != "None"):
                raise ConfigError(f"{f.name.replace('_', '-')} ({f.name} in Python) must be "
                                  f"{' or '.join(TYPE_NAMES.get(kind, kind) for kind in kinds)}, got {value!r}")
        if not all(isinstance(key, str) and isinstance(options, dict) for key, options in self.plugin_options.items()):
            raise ConfigError(f"plugin-options maps a namespace to a dict of options, e.g. {{'awq': {{'group_size': "
                              f"64}}}}, got {self.plugin_options!r}")
        self._validate_lora_adapters()
        if self.default_chat_template_kwargs is not None:
            from .chat import checked_template_kwargs

            try:
                self.default_chat_template_kwargs = checked_template_kwargs(self.default_chat_template_kwargs)
            except InvalidRequestError as exc:
                raise ConfigError(f"default-chat-template-kwargs: {exc}") from None
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")

        def positive(name: str) -> None:
            value = getattr(self, name)  # an int: the type pass above checked it
            if value <= 0:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive(name)
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ConfigError(f"block-size must be a power of two <= 256, got {self.block_size}")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        if not 0 <= self.skinny_gemm_rows <= 16:
            raise ConfigError(f"skinny-gemm-rows must be in [0, 16] (the kernel takes up to 16 rows), got "
                              f"{self.skinny_gemm_rows}")
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 0:
            raise ConfigError(f"cuda-graph-max-tokens must be >= 0 (0: no graphs for prefill and mixed steps), got "
                              f"{self.cuda_graph_max_tokens}")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= MAX_CPU_THREADS:
            raise ConfigError(f"cpu-threads must be in [1, {MAX_CPU_THREADS}] (this host has {os.cpu_count()} "
                              f"CPUs), got {self.cpu_threads}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ConfigError(f"num-swap-blocks must be >= 0, got {self.num_swap_blocks}")
        if self.swap_space_gb < 0:
            raise ConfigError(f"swap-space-gb must be >= 0, got {self.swap_space_gb}")
        reserve = self.kv_admission_reserve
        if reserve != "auto" and (isinstance(reserve, (str, bool)) or not 0 <= reserve <= 1):
            raise ConfigError(f"kv-admission-reserve must be a number in [0, 1] (0: admit whenever the prompt fits; "
                              f"1: keep room for every running sequence's max_tokens) or auto, got {reserve!r}")
        if self.max_model_len is not None:
            positive("max_model_len")
            if self.max_model_len < 2:
                raise ConfigError(f"max-model-len must be >= 2 (a prompt token and a generated one), got "
                                  f"{self.max_model_len}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv-cache-memory-gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.scheduling_policy!r}")
        if self.priority_aging_s is not None:
            if not 0 < self.priority_aging_s <= MAX_PRIORITY_AGING_S:
                raise ConfigError(f"priority-aging-s must be a number of seconds in (0, {MAX_PRIORITY_AGING_S:g}], "
                                  f"got {self.priority_aging_s!r}")
            if self.scheduling_policy != "priority":
                raise ConfigError(f"--priority-aging-s ages request priorities, which only --scheduling-policy "
                                  f"priority reads (this engine's is {self.scheduling_policy}); add "
                                  "--scheduling-policy priority or drop --priority-aging-s")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_speculative_tokens < 0 or self.num_speculative_tokens > 16:
            raise ConfigError(f"num-speculative-tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if self.plugin_options.get("spec_decode") and self.proposer is None:
            flags = ", ".join(f"--spec-{name.replace('_', '-')}" if name in ("min_acceptance", "max_batch_size")
                              else f"--plugin-option spec_decode.{name}"
                              for name in sorted(self.plugin_options["spec_decode"]))
            raise ConfigError(f"{flags}: speculative-decoding options need a proposer: add --proposer draft-model, "
                              "ngram or jump-forward (in Python: proposer=...)")
        if self.async_scheduling and self.async_output is False:
            raise ConfigError("--async-scheduling reads each step's tokens back during the next step, so its outputs "
                              "come a step later: drop --no-async-output")
        if self.async_scheduling and self.proposer is not None:
            raise ConfigError("--async-scheduling does not combine with speculative decoding yet (a draft round reads "
                              "the verified tokens back every step); drop one of them")
        if self.proposer is not None and self.num_speculative_tokens == 0:
            raise ConfigError(f"proposer {self.proposer!r} needs --num-speculative-tokens K with K >= 1")
        return self

    def _validate_lora_adapters(self) -> None:
        adapters = self.lora_adapters
        if len(adapters) > MAX_LORA_ADAPTERS:
            raise ConfigError(f"at most {MAX_LORA_ADAPTERS} LoRA adapters can be served at once (each runs beside "
                              f"every adapted token), got {len(adapters)}")
        slots, rank = self.max_lora_adapters, self.max_lora_rank
        if slots is not None and not max(1, len(adapters)) <= slots <= MAX_LORA_ADAPTERS:
            raise ConfigError(f"max-lora-adapters must be in [{max(1, len(adapters))}, {MAX_LORA_ADAPTERS}] (at least "
                              f"the {len(adapters)} --lora adapters), got {slots}")
        if rank is not None and not 1 <= rank <= MAX_LORA_RANK:
            raise ConfigError(f"max-lora-rank must be in [1, {MAX_LORA_RANK}], got {rank}")
        if rank is not None and not (adapters or slots):
            raise ConfigError("max-lora-rank sizes LoRA adapter slots; give --lora NAME=DIR or --max-lora-adapters N")
        for name, folder in list(adapters.items()):
            if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
                raise ConfigError(f"LoRA adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit (--lora NAME=DIR)")
            if isinstance(folder, os.PathLike):
                adapters[name] = folder = os.fspath(folder)
            if not isinstance(folder, str):
                raise ConfigError(f"LoRA adapter {name!r}: {folder!r} is not a folder's path; give the folder that "
                                  "PEFT's save_pretrained wrote (--lora NAME=DIR)")
            if not os.path.isdir(folder):  # as a missing model folder, and load_lora_adapter's missing folder
                raise CheckpointError(f"LoRA adapter {name!r}: {folder!r} is not a folder; give the folder that "
                                      "PEFT's save_pretrained wrote (--lora NAME=DIR)")

    def mixed_graph_tokens(self) -> int:
        """The largest prefill or mixed step captured in a CUDA graph (0: none)."""
        limit = DEFAULT_MIXED_GRAPH_TOKENS if self.cuda_graph_max_tokens is None else self.cuda_graph_max_tokens
        return min(limit, self.max_num_batched_tokens) if self.cuda_graphs else 0

    def async_scheduling_on(self, device_type: str) -> bool:
        """Whether steps are scheduled ahead on a model placed on ``device_type`` ("cuda", "cpu")."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda" and self.proposer is None and self.async_output is not False

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

