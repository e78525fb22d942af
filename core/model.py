"""The model interface: a causal LM over a flat token batch (an ``nn.Module``, hence apart from the torch-free
interfaces in :mod:`infer.core.interfaces`, which re-exports it)."""
from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from .errors import ConfigError
from .interfaces import AttentionBackend, AttentionMetadata, ModelSpec

log = logging.getLogger("infer")

# why a model without an LM head (ModelSpec.has_lm_head false) refuses generation and logits
NO_LM_HEAD = ("this checkpoint has no LM head (an embedding model): send embedding requests (PoolingParams, "
              "`infer embed`)")


def no_lm_head(spec: ModelSpec) -> str:
    """Why a model without an LM head refuses generation: NO_LM_HEAD, or a sequence classifier's reason."""
    if spec.num_labels is None:
        return NO_LM_HEAD
    return (f"this checkpoint is a sequence classifier ({spec.num_labels} labels, no LM head): send embedding "
            "requests (PoolingParams, `infer embed`), whose embedding is the label logits")


class Model(torch.nn.Module, ABC):
    """A causal LM over a flat token batch. The attention layers call the backend given in ``forward``.

    Subclasses set ``self.spec`` in their constructor.
    """

    spec: ModelSpec

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden] (after the last norm)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32; a model without an LM head (``spec.has_lm_head``
        false) raises InvalidRequestError (no_lm_head)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF name, tensor) pairs; raise CheckpointError on unknown names or missing tensors."""

    def label_logits(self, pooled: torch.Tensor) -> torch.Tensor | None:
        """Optional: a sequence classifier's score head (``spec.num_labels`` set): pooled final hidden states [N,
        hidden] -> label logits [N, num_labels] in float32, which embedding requests return. The default: None, for
        a model without such a head."""
        return None

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors as its checkpoint names and stores them, what ``load_weights`` takes back (``infer
        quantize`` writes them beside the quantized linears). The default: the state dict, for a model that keeps
        its tensors as they load."""
        return self.state_dict()

    def module_name(self, checkpoint_name: str) -> str | None:
        """The name this model gives the checkpoint's module ``checkpoint_name`` (as PEFT adapters spell it: the HF
        name without ``base_model.model.``); None for a module of the checkpoint that the model does not serve (a
        multimodal checkpoint's vision tower). The default: the same name."""
        return checkpoint_name


def check_softcap(model: Model, attention: AttentionBackend, what: str = "the model") -> None:
    """ConfigError for a model whose attention scores are softcapped (Gemma 2) on a backend that cannot cap them:
    without the cap it would compute another model."""
    if model.spec.attn_softcap is not None and not attention.takes_softcap():
        raise ConfigError(f"{what} caps its attention scores (attn_logit_softcapping {model.spec.attn_softcap:g}), "
                          f"which attention backend {type(attention).__name__} cannot do; use a backend that can "
                          "(--attention torch, cpu or triton)")


def check_capturable(model: Model, what: str = "the model") -> None:
    """ConfigError for a model whose forward syncs with the host (``ModelSpec.graph_blocker``), called where CUDA
    graphs would capture it."""
    if model.spec.graph_blocker is not None:
        raise ConfigError(f"{what}: {model.spec.graph_blocker}, which CUDA graphs cannot capture; add --no-cuda-graphs")


def fit_sliding_window(model: Model, attention: AttentionBackend, max_model_len: int | None, what: str = "the model"
                       ) -> None:
    """A model whose layers slide runs on a backend without a sliding window with its context cut to the window
    (where no position can see past it): a ConfigError for an explicit ``max_model_len`` beyond it, else a warning."""
    spec = model.spec
    window = spec.sliding_window
    if window is None or attention.takes_window() or spec.max_model_len <= window:
        return
    backend = type(attention).__name__
    if max_model_len is not None:
        raise ConfigError(f"max-model-len {spec.max_model_len} exceeds {what}'s sliding window {window}, and attention "
                          f"backend {backend} has no sliding window; use --max-model-len <= {window}, or a backend "
                          "that has one (torch, cpu, triton)")
    log.warning("limiting %s's context to its sliding window (%d): attention backend %s has no sliding window",
                what, window, backend)
    model.spec = dataclasses.replace(spec, max_model_len=window)
