"""The HF baseline's embeddings: ``AutoModel`` on right-padded batches with an attention mask, sorted by length
(sentence-transformers' order: the least padding), each row pooled as its request asks (``last`` or ``mean``: the
poolers the baseline computes), cut to its ``dimensions`` and L2-normalized if asked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import InvalidRequestError
from ..core.pooling import PoolingDefaults, PoolingParams

if TYPE_CHECKING:
    import torch

HF_POOLERS = ("last", "mean")


@dataclass(frozen=True)
class HFPooling:
    """PoolingParams resolved for the baseline, as the engine resolves them against the checkpoint."""

    method: str
    normalize: bool
    dimensions: int | None


def resolve_hf_pooling(params: PoolingParams, defaults: PoolingDefaults, hidden_size: int) -> HFPooling:
    """What the baseline computes for ``params``, chosen as the engine chooses (core/pooling.py: the checkpoint's
    sentence-transformers pooling and normalization where the request leaves them None, else last, normalized).
    InvalidRequestError for what the engine refuses, and for a pooler other than last and mean."""
    method, normalize = defaults.choose(params, hidden_size, lambda: list(HF_POOLERS))
    if method not in HF_POOLERS:
        whose = "" if params.pooling else " (the checkpoint's sentence-transformers pooling)"
        raise InvalidRequestError(f"the HF baseline pools {' or '.join(HF_POOLERS)} only, not {method!r}{whose}; "
                                  "drop the hf arms or pass --pooling last or mean")
    return HFPooling(method, normalize, params.dimensions)


def classifier_pooling(params: PoolingParams) -> HFPooling:
    """A sequence classifier's pooling, as the engine's: last by default, never normalized or cut (InvalidRequestError
    for normalize or dimensions, and for a pooler the baseline lacks)."""
    if params.normalize or params.dimensions is not None:
        raise InvalidRequestError("this model is a sequence classifier: its embedding is the label logits, which are "
                                  "neither normalized nor cut; leave normalize and dimensions unset")
    method = params.pooling or "last"
    if method not in HF_POOLERS:
        raise InvalidRequestError(f"the HF baseline pools {' or '.join(HF_POOLERS)} only, not {method!r}; drop the "
                                  "hf arms or pass --pooling last or mean")
    return HFPooling(method, False, None)


def longest_first(prompts: list[list[int]]) -> list[int]:
    """The order in which the baseline batches ``prompts``: by length, longest first (stable)."""
    return sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))


def embed_padded(backbone: Any, prompts: list[list[int]], poolings: list[HFPooling], pad_id: int,
                 device: torch.device, label_head: Any = None) -> list[list[float]]:
    """One forward of ``backbone`` (an ``AutoModel``) over ``prompts`` right-padded to the longest, with an attention
    mask; each row's final hidden states over its own positions, pooled by its ``poolings`` (then, for a sequence
    classifier, its score head ``label_head`` in float32: the label logits)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in prompts], device=device)
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=device)
    with torch.no_grad():
        states = backbone(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    vectors = []
    for row, (prompt, pooling) in enumerate(zip(prompts, poolings)):
        real = states[row, : len(prompt)]
        vector = real[-1] if pooling.method == "last" else real.mean(0)
        if label_head is not None:
            vector = vector @ label_head.weight.float().T
        if pooling.dimensions is not None:
            vector = vector[: pooling.dimensions]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        vectors.append(vector.cpu().tolist())
    return vectors
