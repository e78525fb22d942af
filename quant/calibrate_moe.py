"""AWQ calibration of a sparse layer's experts (Mixtral, Qwen2-MoE, Qwen3-MoE), beside :mod:`.calibrate`'s groups.

A sparse layer's attention (qkv, o) and its shared expert's down (Qwen2-MoE) are :mod:`.calibrate`'s groups. Its
experts get two kinds of scale:

==============  ======================================  ===========================================================
scale           input                                   folding (exact: the unquantized model is unchanged)
==============  ======================================  ===========================================================
experts gate_up post_attention_layernorm output [H]     ``1 / s`` into the norm weight; ``s`` into the columns of
                                                        every expert's gate and up, the shared expert's, and the
                                                        router's and shared expert gate's, which stay float
experts down    one expert's silu(gate) * up [I]        ``1 / s`` into that expert's up rows; one ``s`` per expert
==============  ======================================  ===========================================================

The router reads the same normed hidden state, so its columns take ``s`` too and the routing is unchanged (AutoAWQ's
Mixtral and Qwen3-MoE quantizers leave the router out of the folding, so theirs routes ``x / s``).

The gate_up search (:func:`.calibrate.search_scale_parts`) measures each expert's output error on the calibration
rows routed to it, and the shared expert's on every row; ``stat`` is the mean |x| over every token, as for a dense
MLP. An expert's down is searched on its own activations. An expert no calibration token reached keeps ``s = 1``
for its down (plain round to nearest) and is named in a warning.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from . import awq
from .awq_clip import clip_, quantized_error, search_clip
from .calibrate import AwqCalibrationConfig, GroupReport, GroupStats, ScaleSearch, search_scale, search_scale_parts

GATE_UP, DOWN = "experts.gate_up", "experts.down"  # the groups' names in reports


@dataclass
class ExpertStats:
    """What the calibration forward saw at one sparse layer: its hidden states (every token), the experts each kept
    row was routed to, and each expert's activations on the tokens routed to it."""

    hidden: GroupStats = field(default_factory=GroupStats)
    routes: list[torch.Tensor] = field(default_factory=list)  # [kept rows, top_k] expert ids, beside hidden.rows
    down: dict[int, GroupStats] = field(default_factory=dict)

    def add(self, moe: Any, x: torch.Tensor, stride: int) -> None:
        """Record the input ``x`` of SparseMoe ``moe`` (a forward pre-hook), keeping every ``stride``-th row."""
        x = x.reshape(-1, x.shape[-1])
        _, chosen = moe.route(x)
        self.hidden.add(x, stride)
        self.routes.append(chosen[::stride].clone())
        size = moe.moe.intermediate_size
        for e in range(moe.moe.num_experts):
            routed = x[(chosen == e).any(dim=-1)]
            if routed.shape[0]:
                hidden = routed @ moe.w13[e].t()
                self.down.setdefault(e, GroupStats()).add(moe.silu_and_mul(hidden[:, :size], hidden[:, size:]),
                                                         stride)


def search_experts(layer: nn.Module, stats: ExpertStats, index: int, config: AwqCalibrationConfig,
                   device: torch.device) -> tuple[list[GroupReport], torch.Tensor, dict[int, torch.Tensor]]:
    """The scale searches of sparse layer ``layer`` (number ``index``) on the original weights: the reports, the
    gate_up scales [H] and each reached expert's down scales [I]."""
    moe = layer.ffn()
    x, routes = torch.cat(stats.hidden.rows).to(device), torch.cat(stats.routes).to(device)
    parts = [(x[(routes == e).any(dim=-1)], [moe.w13[e].float()]) for e in range(moe.moe.num_experts)]
    if moe.shared_expert is not None:
        parts.append((x, [moe.shared_expert.get_submodule(p).weight.float() for p in ("gate_proj", "up_proj")]))
    assert stats.hidden.abs_sum is not None
    group_size, grid, duo = config.group_size, config.grid, config.duo_scaling
    assert group_size is not None  # check_request chose it
    found = search_scale_parts(parts, stats.hidden.abs_sum / stats.hidden.count, group_size, grid, duo=duo)
    reports = [GroupReport(index, GATE_UP, found.alpha, found.error, found.rtn_error)]
    downs: dict[int, torch.Tensor] = {}
    for e, record in sorted(stats.down.items()):
        assert record.abs_sum is not None
        down: ScaleSearch = search_scale(torch.cat(record.rows).to(device), record.abs_sum / record.count,
                                         [moe.w2[e].float()], group_size, grid, duo=duo)
        downs[e] = down.scales
        reports.append(GroupReport(index, DOWN, down.alpha, down.error, down.rtn_error))
    return reports, found.scales, downs


def fold_experts(layer: nn.Module, gate_up: torch.Tensor, downs: dict[int, torch.Tensor]) -> None:
    """Fold the scales of :func:`search_experts` into sparse layer ``layer`` (exact: see the module docstring)."""
    moe = layer.ffn()
    size = moe.moe.intermediate_size
    with torch.no_grad():
        layer.post_attention_layernorm.weight.div_(gate_up.to(layer.post_attention_layernorm.weight.dtype))
        columns = [moe.gate.weight, moe.w13]
        if moe.shared_expert is not None:
            columns += [moe.shared_expert_gate.weight] + [moe.shared_expert.get_submodule(p).weight
                                                          for p in ("gate_proj", "up_proj")]
        for weight in columns:
            weight.mul_(gate_up.to(weight.dtype))
        for e, s in downs.items():
            moe.w13[e, size:].div_(s.to(moe.w13.dtype)[:, None])
            moe.w2[e].mul_(s.to(moe.w2.dtype)[None, :])


def clip_experts(layer: nn.Module, stats: ExpertStats, reports: list[GroupReport], gate_up: torch.Tensor,
                 downs: dict[int, torch.Tensor], group_size: int, device: torch.device) -> list[GroupReport]:
    """Clip sparse layer ``layer``'s folded experts (:mod:`.awq_clip`): each expert's gate and up on its routed rows,
    the shared expert's on every row, each reached expert's down on its activations, all divided by their scales;
    return :func:`search_experts`' ``reports`` with the errors as written."""
    moe = layer.ffn()
    x, routes = torch.cat(stats.hidden.rows).to(device) / gate_up, torch.cat(stats.routes).to(device)

    def clipped(rows: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reference = weight.clone()
        if rows.shape[0]:
            clip_(weight, search_clip(rows, weight, group_size), group_size)
        return rows, reference, weight

    parts = [clipped(x[(routes == e).any(dim=-1)], moe.w13[e]) for e in range(moe.moe.num_experts)]
    if moe.shared_expert is not None:
        parts += [clipped(x, moe.shared_expert.get_submodule(p).weight.data) for p in ("gate_proj", "up_proj")]
    errors = [quantized_error(parts, group_size)]
    for e, s in sorted(downs.items()):
        errors.append(quantized_error([clipped(torch.cat(stats.down[e].rows).to(device) / s, moe.w2[e])],
                                      group_size))
    return [replace(report, clipped_error=error) for report, error in zip(reports, errors, strict=True)]


def expert_tensors(layer: nn.Module, prefix: str, group_size: int) -> dict[str, torch.Tensor]:
    """Each expert's gate, up and down of sparse layer ``layer``, RTN-quantized to the AutoAWQ GEMM layout and named
    as the checkpoint names them (``{prefix}.{block}.experts.{e}.{projection}.qweight`` ...)."""
    moe = layer.ffn()
    size, (gate, up, down) = moe.moe.intermediate_size, moe.moe.projections
    tensors: dict[str, torch.Tensor] = {}
    for e in range(moe.moe.num_experts):
        for projection, weight in ((gate, moe.w13[e, :size]), (up, moe.w13[e, size:]), (down, moe.w2[e])):
            qweight, qzeros, scales = awq.quantize_rtn(weight, group_size)
            name = f"{prefix}.{layer.feed_forward}.experts.{e}.{projection}"
            tensors.update({f"{name}.qweight": qweight.cpu(), f"{name}.qzeros": qzeros.cpu(),
                            f"{name}.scales": scales.cpu()})
    return tensors


def routers(model: Any) -> list[str]:
    """The module paths of the routers (and shared expert gates) of ``model``'s sparse layers: float linears that a
    loader matching ``modules_to_not_convert`` as substrings (AutoAWQ, transformers, vLLM) leaves alone, each path
    matching no other module."""
    from ..models.moe import SparseMoe

    names = []
    for i, layer in enumerate(model.model.layers):
        moe = layer.ffn()
        if isinstance(moe, SparseMoe):
            names.append(f"model.layers.{i}.{layer.feed_forward}.gate")
            if moe.shared_expert_gate is not None:
                names.append(f"model.layers.{i}.{layer.feed_forward}.shared_expert_gate")
    return names
