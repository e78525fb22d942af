"""Speculative-decoding proposers: `draft-model` (a small checkpoint with its own paged KV), `ngram` (prompt
lookup) and `jump-forward` (the text a structured output's grammar forces next). Selected by ``--plugin NAME`` or
``--proposer NAME``, with ``--num-speculative-tokens K``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.config import EngineConfig
from ..core.hookspecs import ProposerFactory, hookimpl
from ..core.interfaces import Proposer
from ..core.registry import Register
from ..spec_decode.ngram import NGRAM_OPTIONS

if TYPE_CHECKING:
    from ..core.loader import LoadedModel
    from ..core.plugins import PluginManager


def build_draft_model(config: EngineConfig, target: LoadedModel, plugins: PluginManager) -> Proposer:
    from ..spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer.load(config, target, plugins)


def build_ngram(config: EngineConfig, target: LoadedModel, plugins: PluginManager) -> Proposer:
    from ..spec_decode.ngram import NgramProposer

    return NgramProposer.from_config(config)


def build_jump_forward(config: EngineConfig, target: LoadedModel, plugins: PluginManager) -> Proposer:
    from ..spec_decode.jump_forward import JumpForwardProposer

    return JumpForwardProposer(target.tokenizer, target.model.spec.vocab_size)


@hookimpl
def register_proposers(register: Register[ProposerFactory]) -> None:
    register("draft-model", build_draft_model, aliases=("draft",))
    register("ngram", build_ngram, aliases=("prompt-lookup",), options=NGRAM_OPTIONS)
    register("jump-forward", build_jump_forward)
