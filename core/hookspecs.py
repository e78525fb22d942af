"""Every hook of infer. Registration hooks receive a ``register(name, factory, aliases=(), options=None)`` callback.

Factories are called lazily, after the config is validated, and should import heavy modules inside.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click
    import torch

    from .config import EngineConfig
    from .interfaces import (AttentionBackend, EvictionPolicy, KVCache, LogitsProcessor, Model, Pooler, Proposer,
                             QuantMethod, ReasoningParser, Scheduler, StructuredOutputBackend, ToolParser, Vocabulary)
    from .loader import LoadedModel
    from .plugins import PluginManager
    from .metrics import StepStats
    from .registry import Register
    from .request import RequestOutput

hookspec = pluggy.HookspecMarker("infer")
hookimpl = pluggy.HookimplMarker("infer")

SchedulerFactory = Callable[["EngineConfig", "KVCache"], "Scheduler"]
KVCacheFactory = Callable[["EngineConfig", int, "EvictionPolicy"], "KVCache"]
EvictionPolicyFactory = Callable[["EngineConfig"], "EvictionPolicy"]
AttentionBackendFactory = Callable[["EngineConfig"], "AttentionBackend"]
QuantMethodFactory = Callable[["EngineConfig", "dict[str, Any] | None"], "QuantMethod"]
ProposerFactory = Callable[["EngineConfig", "LoadedModel", "PluginManager"], "Proposer"]
ModelFactory = Callable[["dict[str, Any]", "QuantMethod | None", "torch.dtype", "EngineConfig"], "Model"]
ToolParserFactory = Callable[["EngineConfig", Any], "ToolParser"]
ReasoningParserFactory = Callable[["EngineConfig", Any], "ReasoningParser"]
StructuredOutputBackendFactory = Callable[["EngineConfig", "Vocabulary"], "StructuredOutputBackend"]
LogitsProcessorFactory = Callable[["EngineConfig", Any], "LogitsProcessor"]
PoolerFactory = Callable[["EngineConfig"], "Pooler"]
CommandFactory = Callable[[], "click.Command"]


def hookspec_namespace() -> dict[str, Any]:
    """The names that the hookspecs' annotations and the factory types use, imported now: this module imports them
    for type checkers only, so that loading the plugins (``infer --help``) does not load torch. Tooling that
    resolves the annotations passes it: ``typing.get_type_hints(hookspecs.register_models,
    localns=hookspec_namespace())``; a factory type's forward references resolve with it too."""
    from importlib import import_module

    from . import config, interfaces, loader, metrics, plugins, registry, request

    abcs = ("AttentionBackend", "EvictionPolicy", "KVCache", "LogitsProcessor", "Model", "Pooler", "Proposer",
            "QuantMethod", "ReasoningParser", "Scheduler", "StructuredOutputBackend", "ToolParser", "Vocabulary")
    return {"click": import_module("click"), "torch": import_module("torch"), "EngineConfig": config.EngineConfig,
            "LoadedModel": loader.LoadedModel, "PluginManager": plugins.PluginManager, "StepStats": metrics.StepStats,
            "Register": registry.Register, "RequestOutput": request.RequestOutput,
            **{name: getattr(interfaces, name) for name in abcs}}


@hookspec
def register_schedulers(register: Register[SchedulerFactory]) -> None:
    """Register scheduling policies.

    Call ``register(name, factory, aliases=(), options=None)`` once per scheduler. ``factory(config, kv_cache)``
    returns a :class:`~infer.core.interfaces.Scheduler` that allocates from ``kv_cache``. Selected by ``--scheduler
    NAME``.
    """


@hookspec
def register_kv_caches(register: Register[KVCacheFactory]) -> None:
    """Register KV block managers.

    ``factory(config, num_blocks, eviction_policy)`` returns a :class:`~infer.core.interfaces.KVCache` over
    ``num_blocks`` blocks of ``config.block_size`` tokens, evicting cached blocks through ``eviction_policy``.
    Selected by ``--kv-cache NAME``.
    """


@hookspec
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    """Register eviction policies for cached KV blocks.

    ``factory(config)`` returns a fresh :class:`~infer.core.interfaces.EvictionPolicy`; each cache gets its own.
    Selected by ``--eviction-policy NAME``.
    """


@hookspec
def register_attention_backends(register: Register[AttentionBackendFactory]) -> None:
    """Register attention implementations.

    ``factory(config)`` returns an :class:`~infer.core.interfaces.AttentionBackend`. It must raise PluginError
    when the device or dtype is unsupported. Selected by ``--attention NAME``.
    """


@hookspec
def register_quant_methods(register: Register[QuantMethodFactory]) -> None:
    """Register weight quantization methods.

    ``factory(config, quantization_config)`` returns a :class:`~infer.core.interfaces.QuantMethod`;
    ``quantization_config`` is the checkpoint's ``quantization_config`` dict, or None for an unquantized
    checkpoint (quantize on load, or raise CheckpointError). Selected by ``--quant NAME``, or by the checkpoint's
    ``quant_method``.
    """


@hookspec
def register_proposers(register: Register[ProposerFactory]) -> None:
    """Register speculative-decoding proposers.

    ``factory(config, target, plugins)`` returns a :class:`~infer.core.interfaces.Proposer`; ``target`` is the
    target's :class:`~infer.core.loader.LoadedModel` (``model``, whose ``spec`` has ``vocab_size``; ``tokenizer``,
    ``device``, ``dtype``, ``path``), and ``plugins`` the engine's PluginManager, whose registries build other
    components (a draft model's architecture, attention backend, KV cache) as the engine would. Selected by
    ``--proposer NAME``.
    """


@hookspec
def register_tool_parsers(register: Register[ToolParserFactory]) -> None:
    """Register readers of the tool calls in models' replies.

    ``factory(config, tokenizer)`` returns a :class:`~infer.core.interfaces.ToolParser` for replies of the model
    whose tokenizer is given (a parser of a format marked by special tokens decodes ``token_ids`` with it). The
    engine asks ``for_prompt`` once per request for the parser of its replies, gives ``parse`` the reply of every
    chat that offered tools once the reply is finished, and, as the reply streams, asks ``streamed_content`` and
    ``streamed_calls`` how much content and how many calls it may hand out already (docs/plugin-hooks.md has the
    contracts). Selected by ``--tool-parser NAME``.
    """


@hookspec
def register_reasoning_parsers(register: Register[ReasoningParserFactory]) -> None:
    """Register splitters of reasoning models' replies into reasoning and content.

    ``factory(config, tokenizer)`` returns a :class:`~infer.core.interfaces.ReasoningParser` for replies of the
    model whose tokenizer is given. The engine gives ``split`` the reply of every chat but a beam search's and a
    structured one whose grammar holds from the first token (a forced ``tool_choice``'s, or where ``reasoning_end``
    says None), once the reply is finished and a tool parser, if any, has read its calls out; ``reasoning_end`` lets
    a structured reply's grammar start after the reasoning, and ``stream`` splits a reply as it streams
    (docs/plugin-hooks.md has the contracts). Selected by ``--reasoning-parser NAME``.
    """


@hookspec
def register_structured_output_backends(register: Register[StructuredOutputBackendFactory]) -> None:
    """Register compilers of structured outputs (regex, choice, JSON schema, GBNF grammar) into token masks.

    ``factory(config, vocabulary)`` returns a :class:`~infer.core.interfaces.StructuredOutputBackend` for the
    model whose :class:`~infer.core.interfaces.Vocabulary` is given. The engine compiles each request's
    ``SamplingParams.structured_output`` at admission and masks each of its sampled rows with its matcher's
    ``allowed()``. Selected by ``--structured-output-backend NAME``.
    """


@hookspec
def register_logits_processors(register: Register[LogitsProcessorFactory]) -> None:
    """Register logits processors, which requests choose by name.

    ``factory(config, tokenizer)`` returns a :class:`~infer.core.interfaces.LogitsProcessor` for the model whose
    tokenizer is given (a processor that reads text tokenizes it with it), built once per engine when a request
    first names it. A request names processors with their arguments in
    ``SamplingParams.logits_processors``; the engine checks the arguments at admission (``check``) and hands the
    processor the logits rows of those requests' sequences before each sample (``apply``). Not selected by
    ``--plugin``: each request picks its own (``infer generate --logits-processor NAME``).
    """


@hookspec
def register_poolers(register: Register[PoolerFactory]) -> None:
    """Register poolers, which embedding requests choose by name (``PoolingParams.pooling``; core/pooling.py).

    ``factory(config)`` returns a :class:`~infer.core.interfaces.Pooler`, built once per engine when a request
    first names it. The engine hands it the final hidden states of each embedding request's prompt positions as the
    prompt is computed, a chunk at a time (``add``), then asks for the vector (``finish``), which it cuts to the
    request's ``dimensions`` and normalizes. Not selected by ``--plugin``: each request picks its own
    (``infer embed --pooling NAME``). A sentence-transformers checkpoint's pooling mode names the default: see
    core/pooling.py for the names it maps to.
    """


@hookspec
def register_models(register: Register[ModelFactory]) -> None:
    """Register model architectures by their HF ``architectures`` name (e.g. ``LlamaForCausalLM``).

    ``factory(hf_config, quant_method, dtype, config)`` returns an uninitialised :class:`~infer.core.interfaces.Model`
    with parameters in ``dtype``, created under a ``torch.device`` context; weights arrive through
    ``Model.load_weights``. ``hf_config`` is the parsed config.json; raise CheckpointError for unsupported fields.
    """


@hookspec
def register_commands(register: Register[CommandFactory]) -> None:
    """Register CLI subcommands: ``factory()`` returns a ``click.Command`` added to the ``infer`` group."""


@hookspec
def on_request_finished(output: RequestOutput) -> None:
    """Observe a finished (or aborted) request's final output. Must not change results."""


@hookspec
def on_step(stats: StepStats) -> None:
    """Observe the statistics of one engine step. Must not change results."""
