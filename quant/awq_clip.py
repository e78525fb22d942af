"""AWQ's weight clipping (Lin et al., 2023; AutoAWQ's ``auto_clip``), after the scales are folded.

Each linear's weights are clamped per (output row, group of inputs) to ``±m``, where ``m`` minimises that group's share
of the output error on the calibration rows (their inputs divided by the folded scales):

    err(m) = mean over rows x of ( x_g . (RTN(clamp(w_g, -m, m)) - w_g) )^2

over ``m = max|w_g| * (1 - i / 20)`` for ``i = 0 .. 9`` (AutoAWQ's grid: down to half the range; ``i = 0`` is no
clipping, so no group's error grows). Rows are subsampled to at most 512, as AutoAWQ does. q_proj and k_proj (and
Phi-3's fused qkv_proj, which holds them) are not clipped: their outputs meet in the attention scores, which a
per-linear error does not see (AutoAWQ skips q_proj and k_proj for that reason; its name test misses Phi-3's
qkv_proj, which it clips whole).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import awq

GRID, STEPS, MAX_TOKENS = 20, 10, 512
UNCLIPPED = ("q_proj", "k_proj", "qkv_proj")


def clips(path: str) -> bool:
    """Whether the linear at ``path`` (inside a decoder layer) is clipped."""
    return path.rsplit(".", 1)[-1] not in UNCLIPPED


def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int, max_elements: int = 1 << 24
                ) -> torch.Tensor:
    """The clamp ``m`` [out, groups] of ``weight`` [out, in] for inputs ``x`` [n, in] (the module docstring); some
    output rows at a time (a multiple of 8, as RTN needs), so that the [rows, n, groups] partial outputs and the rows'
    weights stay near ``max_elements`` each."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    x = x[:: max(1, x.shape[0] // MAX_TOKENS)].to(torch.float32)
    xg = x.reshape(x.shape[0], in_features // group, group)
    best = torch.empty(out_features, in_features // group, dtype=torch.float32, device=weight.device)
    # the [rows, n, groups] partial outputs, and the few float32 copies of the rows' weights, near max_elements
    chunk = min(max_elements // max(1, x.shape[0] * (in_features // group)), max_elements // in_features)
    step = max(1, chunk // awq.PACK) * awq.PACK  # a multiple of 8, as RTN needs
    for first in range(0, out_features, step):
        w = weight[first: first + step].to(torch.float32)
        rows = w.shape[0]
        wg = w.reshape(rows, -1, group)
        ref = torch.einsum("ngk,cgk->cng", xg, wg)
        full = wg.abs().amax(dim=-1)  # [rows, groups]
        chosen, least = full.clone(), torch.full_like(full, float("inf"))
        for i in range(STEPS):
            m = full * (1 - i / GRID)
            clamped = torch.maximum(torch.minimum(wg, m[..., None]), -m[..., None]).reshape(rows, in_features)
            quantized = awq.fake_quantize_rtn(clamped, group_size).reshape(rows, -1, group)
            error = (torch.einsum("ngk,cgk->cng", xg, quantized) - ref).pow(2).mean(dim=1)
            better = error < least
            least = torch.where(better, error, least)
            chosen = torch.where(better, m, chosen)
        best[first: first + rows] = chosen
    return best


def clip_(weight: torch.Tensor, m: torch.Tensor, group_size: int) -> None:
    """Clamp ``weight`` [out, in] in place to ``±m`` [out, groups] per (row, group)."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    view = weight.view(out_features, in_features // group, group)
    bound = m.to(weight.dtype)[..., None]
    torch.maximum(torch.minimum(view, bound), -bound, out=view)


def quantized_error(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group_size: int,
                    head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """The output error of quantizing as written: over ``parts`` of (rows x [n, in], the folded weight before
    clipping [out, in], the weight to quantize [out, in]), the squared difference of ``x @ RTN(w).T`` and
    ``x @ reference.T`` summed, divided by the number of outputs. With ``head`` (parts of one ``x``), of
    ``head`` of the parts' outputs side by side instead (the MLP's output: :func:`.calibrate.mlp_head`)."""
    if head is not None:
        x = parts[0][0].to(torch.float32)
        ours = torch.cat([x @ awq.fake_quantize_rtn(weight, group_size).t() for _, _, weight in parts], dim=-1)
        theirs = torch.cat([x @ reference.to(torch.float32).t() for _, reference, _ in parts], dim=-1)
        difference = head(ours) - head(theirs)
        return float(difference.pow(2).sum()) / max(difference.numel(), 1)
    total, outputs = 0.0, 0
    for x, reference, weight in parts:
        x = x.to(torch.float32)
        quantized = awq.fake_quantize_rtn(weight, group_size)
        total += float((x @ (quantized - reference.to(torch.float32)).t()).pow(2).sum())
        outputs += x.shape[0] * weight.shape[0]
    return total / max(outputs, 1)
