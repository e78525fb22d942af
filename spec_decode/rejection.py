"""Vectorized verification of draft tokens: exact rejection sampling and its greedy special case.

Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192),
Algorithm 1. Row ``b`` verifies ``num_drafts[b] <= K`` draft tokens ``x_1..x_k`` with the target's distributions
``p_0..p_k`` (``p_j`` is the target's next-token distribution after ``x_j``; ``p_0`` after the last real token)
and the draft's ``q_0..q_{k-1}`` from which the drafts were sampled. The emitted tokens are distributed exactly as
``k + 1`` (at most) successive samples from the target.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUM_TOLERANCE = 1e-2  # a draft distribution's sum may be off 1 by this much (low-precision softmax), no more


@dataclass
class Verified:
    num_accepted: torch.Tensor  # [B] int64: leading drafts accepted
    next_token: torch.Tensor  # [B] int64: the recovered token at the first rejection, or the bonus token


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor,
                     uniform: torch.Tensor, noise: torch.Tensor) -> Verified:
    """p [B, K+1, V] and q [B, K, V] probabilities, draft [B, K] (padding ignored), num_drafts [B],
    uniform [B, K] ~ U(0, 1), noise [B, V] ~ Exp(1), all independent of the drafts' own sampling."""
    batch, k = draft.shape
    valid = torch.arange(k, device=draft.device)[None, :] < num_drafts[:, None]
    p_x = p[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_x = q.gather(2, draft[..., None]).squeeze(2)
    # accept x_j when u_j < p(x_j) / q(x_j), i.e. with probability min(1, p/q)  (Algorithm 1)
    accepted = (uniform * q_x < p_x) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=draft.device)
    p_r = p[rows, num_accepted]
    # at the first rejection sample from norm(max(0, p - q)) (sec. 2.3); after the last draft (all
    # accepted) q is taken as 0, which makes this the bonus sample from p
    rejected = num_accepted < num_drafts
    q_r = q[rows, num_accepted.clamp(max=k - 1)] * rejected[:, None] if k else torch.zeros_like(p_r)
    residual = (p_r - q_r).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_r)  # p == q up to rounding
    return Verified(num_accepted, (residual / noise).argmax(dim=-1))  # exponential race: draws from residual


def improper_drafts(q: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows whose q_j (j < num_drafts) is no distribution draft x_j can have been drawn from: a
    value negative or not finite, a sum off 1 by more than SUM_TOLERANCE, or q_j(x_j) = 0. Algorithm 1 is exact
    only for the q the drafts came from; another (logits, an unnormalized mask) biases the output silently."""
    k = draft.shape[1]
    valid = torch.arange(k, device=draft.device)[None, :] < num_drafts[:, None]
    q_x = q.gather(2, draft[..., None]).squeeze(2)
    proper = torch.isfinite(q).all(-1) & (q >= 0).all(-1) & ((q.sum(-1) - 1).abs() <= SUM_TOLERANCE) & (q_x > 0)
    return (valid & ~proper).any(dim=1)


def describe_improper(q: torch.Tensor, draft: list[int]) -> str:
    """What is wrong with the first improper row of ``q`` [n, V] (as ``improper_drafts`` judges) for ``draft``."""
    q = q.detach().float().cpu()
    for j, token in enumerate(draft):
        row = q[j]
        if not torch.isfinite(row).all():
            return f"draft {j}'s probabilities hold {int((~torch.isfinite(row)).sum())} non-finite value(s)"
        if (row < 0).any():
            return f"draft {j}'s probabilities hold negative values (down to {row.min().item():.4g})"
        if abs(row.sum().item() - 1) > SUM_TOLERANCE:
            return f"draft {j}'s probabilities sum to {row.sum().item():.4g}, not 1"
        if row[token] <= 0:
            return f"draft {j} is token {token}, to which its probabilities give 0"
    return "no row is improper"


def greedy_accept(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """The temperature-0 limit: accept drafts while each equals the target's argmax before it, then emit the argmax
    at the first mismatch (or the bonus token after the last draft). ``target_argmax`` has ``len(draft) + 1``
    entries; returns (drafts accepted, next token)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, target_argmax[accepted]


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """E[tokens emitted per verification] = (1 - a^(k+1)) / (1 - a) for i.i.d. acceptance a (sec. 3.1, eq. 1)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)
