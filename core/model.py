"""The model interface: a causal LM over a flat token batch (an ``nn.Module``, hence apart from the torch-free
interfaces in :mod:`infer.core.interfaces`, which re-exports it)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from .interfaces import AttentionBackend, AttentionMetadata, ModelSpec


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
        """hidden [N, hidden] -> logits [N, vocab] in float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF name, tensor) pairs; raise CheckpointError on unknown names or missing tensors."""
