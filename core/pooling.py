"""Embeddings: a prompt's final hidden states (after the model's last norm) pooled into one vector.

An embedding request (``Engine.add_request(prompt, PoolingParams(...))``) is scheduled as a prompt and ends when
its prompt is computed: no token is sampled. ``last`` pools the last prompt position (a causal model's only
position that has seen the whole prompt: Qwen3-Embedding, e5-mistral, gte-Qwen2); ``mean`` averages every
position (so none may come from a prefix cache: such a request's prompt is computed whole, as for prompt logprobs).
``dimensions`` keeps the first N values before the normalization (Matryoshka embeddings), and ``normalize`` divides
by the L2 norm. A checkpoint written by sentence-transformers says its pooling (``1_Pooling/config.json``) and
whether it normalizes (a ``Normalize`` module in ``modules.json``); those are the defaults.
"""
from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointError, InvalidRequestError, PluginError
from .request import SamplingParams

if TYPE_CHECKING:
    import torch

    from .interfaces import SchedulerOutput
    from .request import Sequence

POOLING_METHODS = ("last", "mean")
COMPUTED_MODULES = (".Transformer", ".Pooling", ".Normalize")  # sentence-transformers modules infer computes
ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: how its prompt's hidden states become one vector."""

    pooling: str | None = None  # "last" or "mean"; None: the checkpoint's sentence-transformers pooling, else last
    normalize: bool | None = None  # L2-normalize; None: as the checkpoint's modules.json says, else True
    dimensions: int | None = None  # keep the first N values (Matryoshka), before normalizing; None: all
    priority: int = 0  # as SamplingParams.priority: the priority scheduling policy and eviction policy read it
    lora_adapter: str | None = None  # pool the adapter's hidden states (a name the engine serves)

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)} (or None for the "
                                      f"checkpoint's), got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true, false or None, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer (or None for all), got "
                                      f"{self.dimensions!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not -2**31 <= self.priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if self.lora_adapter is not None and (not isinstance(self.lora_adapter, str) or not self.lora_adapter):
            raise InvalidRequestError(f"lora_adapter must be a non-empty name or None, got {self.lora_adapter!r}")


def embedding_sampling_params(params: PoolingParams) -> SamplingParams:
    """What the scheduler and KV cache see of an embedding request: a prompt of one sequence, never drafted for.
    max_tokens 1 reserves the token it never samples (the prompt fits the context with one to spare)."""
    return SamplingParams(max_tokens=1, temperature=0.0, priority=params.priority, lora_adapter=params.lora_adapter,
                          speculative=False)


@dataclass(frozen=True)
class Pooling:
    """PoolingParams resolved against the model: what the engine computes for one request."""

    method: str
    normalize: bool
    dimensions: int | None


@dataclass(frozen=True)
class PoolingDefaults:
    """What a checkpoint's sentence-transformers files say (None: they say nothing)."""

    method: str | None = None
    normalize: bool | None = None
    unapplied: tuple[str, ...] = ()  # its modules that change the vector and infer does not run (Dense, say)

    def resolve(self, params: PoolingParams, hidden_size: int | None) -> Pooling:
        """The pooling ``params`` ask for on a model of ``hidden_size`` (None: unknown, not checked)."""
        if params.dimensions is not None and hidden_size is not None and params.dimensions > hidden_size:
            raise InvalidRequestError(f"dimensions {params.dimensions} exceeds the model's hidden size "
                                      f"{hidden_size}; ask for at most {hidden_size} (or None for all)")
        if params.pooling is None and self.unapplied:
            raise InvalidRequestError(f"the checkpoint's sentence-transformers modules include "
                                      f"{', '.join(self.unapplied)}, which infer does not run, so its embedding is "
                                      f"not what infer computes; pass pooling= one of {', '.join(POOLING_METHODS)} "
                                      "for the pooled final hidden states without them")
        method = params.pooling or self.method or "last"
        if method not in POOLING_METHODS:
            modes = method.split("+")  # several: sentence-transformers concatenates their vectors
            named = " and ".join(map(repr, modes)) + (" together (concatenated)" if len(modes) > 1 else "")
            raise InvalidRequestError(f"the checkpoint's sentence-transformers pooling is {named}, which infer "
                                      f"does not compute; pass pooling= one of {', '.join(POOLING_METHODS)}")
        normalize = params.normalize if params.normalize is not None else self.normalize is not False
        return Pooling(method, normalize, params.dimensions)


def read_pooling_defaults(folder: Path) -> PoolingDefaults:
    """The pooling and normalization that ``folder``'s sentence-transformers files (``modules.json``,
    ``1_Pooling/config.json``) declare; none for a folder without them. A pooling mode infer does not compute (or
    several, joined by "+": their vectors concatenated) is an error only when it is the one asked for
    (``PoolingParams.pooling`` left None), and so is a module that changes the vector after the pooling (only
    Transformer, Pooling and Normalize are what infer computes)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingDefaults()
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        types = [str(m.get("type", "")) for m in modules]
        pooling_dirs = [str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    except (ValueError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{modules_file} is not a sentence-transformers module list: {exc}; fix or remove "
                              "it") from exc
    normalize = any(t.endswith(".Normalize") for t in types)
    unapplied = tuple(t.rsplit(".", 1)[-1] or "an untyped module" for t in types if not t.endswith(COMPUTED_MODULES))
    method = None
    if pooling_dirs and (config_file := folder / pooling_dirs[0] / "config.json").is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            modes = [name for name, on in config.items() if name.startswith("pooling_mode_") and on is True]
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{config_file} is not a sentence-transformers pooling config: {exc}") from exc
        method = ST_POOLING_MODES.get(modes[0], modes[0]) if len(modes) == 1 else "+".join(modes) or None
    return PoolingDefaults(method, normalize, unapplied)


@dataclass
class PoolRows:
    """The batch rows whose hidden states embedding requests pool this step, and whose they are."""

    rows: list[int]  # indices into the batch's tokens
    owners: list[tuple[Sequence, int, bool]]  # (sequence, its number of rows, whether its prompt is done)


def pool_rows(out: SchedulerOutput, query_lens: Seq[int], kv_cache: str) -> PoolRows | None:
    """The rows of ``out``'s batch (items of ``query_lens`` tokens, in order) that embedding requests pool; None if
    there are none. ``last`` needs the prompt's last row; ``mean`` every row it has not summed yet (a recompute
    after preemption sums only what is new), so a prefix cache must not have served any (``kv_cache`` names it)."""
    rows: list[int] = []
    owners: list[tuple[Sequence, int, bool]] = []
    offset = 0
    for item, length in zip(out.scheduled, query_lens):
        seq = item.seq
        if seq.pooling is not None and seq.embedding is None:
            start, end, total = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens, \
                seq.num_prompt_tokens
            done = end >= total
            if seq.pooling.method == "last":
                picked = [offset + total - 1 - start] if done else []
            else:
                if start > seq.pooled_until:
                    raise PluginError(f"KV cache {kv_cache!r} served positions {seq.pooled_until}-{start - 1} of "
                                      f"sequence {seq.seq_id} from its prefix cache, but its embedding averages "
                                      "every position: match_prefix must match nothing for a sequence whose "
                                      "needs_prompt_logits is true; fix the plugin")
                first = max(start, seq.pooled_until)
                picked = list(range(offset + first - start, offset + min(end, total) - start))
            rows += picked
            owners.append((seq, len(picked), done))
        offset += length
    return PoolRows(rows, owners) if owners else None


def collect_pooled(found: PoolRows, hidden: torch.Tensor) -> None:
    """Sum each owner's rows of ``hidden`` (float32), and give each whose prompt is done its ``embedding``."""
    import torch

    picked = hidden[torch.tensor(found.rows, dtype=torch.long, device=hidden.device)].float() if found.rows else None
    at = 0
    for seq, count, done in found.owners:
        if count:
            part = picked[at : at + count].sum(0)  # type: ignore[index]
            seq.pool_sum = part if seq.pool_sum is None else seq.pool_sum + part
            seq.pooled_until += count
            at += count
        if done:
            seq.embedding = finish_embedding(seq.pool_sum, seq.pooled_until if seq.pooling.method == "mean" else 1,
                                             seq.pooling)  # type: ignore[union-attr,arg-type]
            seq.pool_sum = None


def finish_embedding(total: torch.Tensor, count: int, pooling: Pooling) -> list[float]:
    """The mean of ``count`` summed rows, cut to ``pooling.dimensions`` and L2-normalized if asked."""
    vector = total / count
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)  # as torch.nn.functional.normalize's eps
    return vector.tolist()
