"""The shipped poolers of embedding requests (core/pooling.py), as sentence-transformers defines its pooling modes:
``last`` (lasttoken), ``mean`` (mean_tokens), ``first`` (cls_token, alias ``cls``), ``max`` (max_tokens),
``weighted-mean`` (weightedmean_tokens: position i weighs i + 1, SGPT's) and ``mean-sqrt-len`` (mean_sqrt_len_tokens:
the sum over the square root of the length)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..core.hookspecs import PoolerFactory, hookimpl
from ..core.interfaces import Pooler
from ..core.registry import Register

if TYPE_CHECKING:
    import torch


class LastPooler(Pooler):
    """The last prompt position's hidden state: a causal model's only position that has seen the whole prompt."""

    reads_every_position = False

    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        return rows[-1].clone()

    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        return state


class FirstPooler(Pooler):
    """The first position's (sentence-transformers' cls_token)."""

    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        return rows[0].clone() if state is None else state

    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        return state


class SumPooler(Pooler):
    """The sum of every position's hidden state, weighted by ``weight(position)``, over ``divisor(n)``."""

    def weights(self, first_position: int, count: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def divisor(self, num_positions: int) -> float:
        return float(num_positions)

    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        weights = self.weights(first_position, rows.shape[0], rows)
        total = rows.sum(0) if weights is None else (rows * weights[:, None]).sum(0)
        return total if state is None else state + total

    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        return state / self.divisor(num_positions)


class MeanSqrtLenPooler(SumPooler):
    def divisor(self, num_positions: int) -> float:
        return math.sqrt(num_positions)


class WeightedMeanPooler(SumPooler):
    """Position i (from 0) weighs i + 1, so later positions, which have seen more of the prompt, count more."""

    def weights(self, first_position: int, count: int, like: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.arange(first_position + 1, first_position + count + 1, dtype=like.dtype, device=like.device)

    def divisor(self, num_positions: int) -> float:
        return num_positions * (num_positions + 1) / 2


class MaxPooler(Pooler):
    """Each dimension's largest value over the positions."""

    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        top = rows.amax(0)
        return top if state is None else state.maximum(top)

    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        return state


@hookimpl
def register_poolers(register: Register[PoolerFactory]) -> None:
    register("last", lambda config: LastPooler())
    register("mean", lambda config: SumPooler())
    register("first", lambda config: FirstPooler(), aliases=("cls",))
    register("max", lambda config: MaxPooler())
    register("weighted-mean", lambda config: WeightedMeanPooler())
    register("mean-sqrt-len", lambda config: MeanSqrtLenPooler())
