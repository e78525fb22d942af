"""The engine's LoRA adapters: the ``--lora`` ones, loaded at start, and those loaded into free slots and unloaded
while it runs (``--max-lora-adapters``). The weights live in models/lora.py's LoraStack; this module checks what the
engine knows: names, the requests that use an adapter, the prefix cache that holds its KV."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .config import DEFAULT_MAX_LORA_RANK, LORA_NAME, EngineConfig
from .errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from ..models.lora import LoraAdapter, LoraStack
    from .engine import Engine
    from .loader import LoadedModel

log = logging.getLogger(__name__)


def start_lora_adapters(config: EngineConfig, loaded: LoadedModel) -> LoraStack | None:
    """The ``--lora`` adapters in a stack of ``--max-lora-adapters`` slots, attached to the model's linears; None
    when the engine serves no adapters. Spare slots give every decoder linear room; without, only the modules some
    adapter adapts get it."""
    if not config.lora_adapters and not config.max_lora_adapters:
        return None
    from ..models.lora import LoraStack, for_model, read_adapter

    adapters = [for_model(read_adapter(name, Path(folder)), loaded.model)
                for name, folder in config.lora_adapters.items()]
    slots = config.max_lora_adapters or len(adapters)
    spare = slots > len(adapters)  # room for adapters loaded later: any rank up to the default, on every linear
    rank = config.max_lora_rank or max([a.rank for a in adapters] + [DEFAULT_MAX_LORA_RANK] * spare)
    if above := [a for a in adapters if a.rank > rank]:  # the options conflict: a usage error, not the folder's
        raise ConfigError(f"LoRA adapter {above[0].name!r} has rank {above[0].rank}, above --max-lora-rank {rank}; "
                          f"raise --max-lora-rank to {max(a.rank for a in above)} or leave it unset")
    targets = None if spare else {module for a in adapters for module in a.weights}
    stack = LoraStack(loaded.model, slots, rank, targets, loaded.dtype, loaded.device)
    for adapter in adapters:
        stack.add(adapter)
    log.info("LoRA adapters: %s; %d slot(s) of rank %d", ", ".join(
        f"{a.name} (rank {a.rank}, {len(a.weights)} modules)" for a in adapters) or "none yet", slots, rank)
    return stack


def load_lora_adapter(engine: Engine, name: str, folder: str | os.PathLike[str] | LoraAdapter) -> None:
    """See :meth:`Engine.load_lora_adapter`."""
    stack = engine.runner.lora
    if stack is None:
        raise InvalidRequestError("this engine serves no LoRA adapters; start it with --max-lora-adapters N (or "
                                  "--lora NAME=DIR) to load some while it runs")
    check_lora_name(name)
    if name in stack.tokens.slot_of:
        raise InvalidRequestError(f"LoRA adapter {name!r} is loaded already; unload it first to replace it")
    from ..models.lora import LoraAdapter, for_model, read_adapter

    if isinstance(folder, LoraAdapter):
        adapter, folder = folder, "memory"
        if adapter.name != name:
            raise InvalidRequestError(f"the adapter read as {adapter.name!r} cannot be loaded as {name!r}")
    else:
        adapter = read_adapter(name, Path(folder))  # CheckpointError: what is wrong with the folder
    adapter = for_model(adapter, engine.runner.model)
    slot = stack.add(adapter)
    engine.intake.checker = dataclasses.replace(engine.checker, lora_adapters=frozenset(stack.tokens.slot_of))
    log.info("loaded LoRA adapter %s (rank %d, %d modules) from %s into slot %d", name, adapter.rank,
             len(adapter.weights), folder, slot)


def check_lora_name(name: object) -> None:
    """InvalidRequestError unless ``name`` can name an adapter."""
    if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
        raise InvalidRequestError(f"LoRA adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit")


def lora_users(engine: Engine) -> dict[str, list[str]]:
    """The live users of each adapter in use: its requests' ids, and "a beam search" per search."""
    users: dict[str, list[str]] = {}
    for request_id, request in engine.requests.items():
        if request.params.lora_adapter is not None:
            users.setdefault(request.params.lora_adapter, []).append(request_id)
    for search in engine.searches.active:
        if search.params.lora_adapter is not None:
            users.setdefault(search.params.lora_adapter, []).append("a beam search")
    return users


def unload_lora_adapter(engine: Engine, name: str) -> None:
    """See :meth:`Engine.unload_lora_adapter`."""
    stack = engine.runner.lora
    loaded = sorted(stack.tokens.slot_of) if stack is not None else []
    if stack is None or name not in stack.tokens.slot_of:
        raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded; the loaded adapters: "
                                  f"{', '.join(loaded) or 'none'}")
    users = lora_users(engine).get(name, [])
    if users:
        raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} request(s) "
                                  f"({', '.join(users[:3])}{', ...' if len(users) > 3 else ''}); unload it once they "
                                  "finish, or abort them first")
    # KV computed under this adapter must never serve a later adapter of the same name
    dropped = engine.kv.drop_namespace(name)
    if not dropped and not engine.kv.reset_prefix_cache():
        raise InvalidRequestError(f"KV cache {engine.config.kv_cache!r} can drop neither the adapter's cached "
                                  "blocks (KVCache.drop_namespace) nor its whole prefix cache (reset_prefix_cache), so "
                                  f"KV computed under {name!r} could serve a later adapter of that name; unloading "
                                  "needs a KV cache that can (paged, radix-cache)")
    stack.remove(name)
    engine.intake.checker = dataclasses.replace(engine.checker, lora_adapters=frozenset(stack.tokens.slot_of))
    log.info("unloaded LoRA adapter %s (%s)", name, "its cached prefixes dropped" if dropped else
             "the prefix cache emptied: the KV cache cannot drop one adapter's")
