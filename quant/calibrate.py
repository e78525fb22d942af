"""Built-in AWQ calibration: activation-aware per-input-channel scales, then an AutoAWQ GEMM checkpoint.

For every decoder layer, each group of linears that shares an input gets one scale vector ``s`` [in]:

=========  ==============================  =================================================================
group      input                           where ``1 / s`` is folded (exact, so the unquantized model is unchanged)
=========  ==============================  =================================================================
qkv        input_layernorm output          input_layernorm.weight
gate_up    post_attention_layernorm output post_attention_layernorm.weight
o          attention output                v_proj's output rows (and bias); with GQA ``s`` is shared by the
                                           q heads of one KV head, since each v channel feeds all of them
down       silu(gate) * up                 up_proj's output rows
=========  ==============================  =================================================================

Phi-3's checkpoints hold q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``: its groups are those linears
whole, and ``1 / s`` of o and down goes into their last rows, v's and up's alone (exact under GQA too, where
AutoAWQ's Phi-3 quantizer divides as many rows as o has inputs: k's and part of q's as well).

A sparse layer (Mixtral, Qwen2-MoE, Qwen3-MoE) has qkv, o and its shared expert's down here; its experts' gate/up
and down scales, and the router's share in them, are :mod:`.calibrate_moe`'s.

The search: ``stat`` is the mean |x| per input channel over all calibration tokens; for alpha on the grid
0, 1/grid, ..., 1, ``s = stat^alpha`` (with ``duo_scaling``, the default as in AutoAWQ and llm-compressor,
``stat^alpha / (w^(1 - alpha) + 1e-4)``, ``w`` the group's :func:`weight_stat`) normalised by
``sqrt(max(s) * min(s))``, and the error is the mean squared difference between ``x @ W.T`` and
``x @ (RTN(W * s) / s).T`` on a subset of the calibration activations (for gate_up, of the MLP outputs those give,
``down(act(gate) * up)`` with down unquantized, as AutoAWQ measures the MLP block: :func:`mlp_head`). Plain RTN
(``s = 1``) is measured too and kept when no alpha beats it, so the chosen scales never do worse than RTN on that
subset. Every group is searched on the original weights and activations (as AutoAWQ does), then the scales are
folded and the layer is RTN-quantized (int4, the layout of :mod:`.awq`), its weights clipped first where that
lowers the error (:mod:`.awq_clip`; ``clip``). Scales are never stored explicitly: every group above has a previous
op to fold into.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from torch import nn

from . import awq
from .awq_clip import clip_, clips, quantized_error, search_clip
from .calib_job import (CalibrationOptions, LinearGroup, ProgressFn, check_at_least_one, check_request,
                        linear_groups, load_for_calibration, write_quantized)
from .forward import dense_forward

if TYPE_CHECKING:
    from .calibrate_moe import ExpertStats

log = logging.getLogger("infer")
Head = Callable[[torch.Tensor], torch.Tensor]  # a group's linear outputs [n, sum of out] -> what its error measures


@dataclass(frozen=True)
class AwqCalibrationConfig(CalibrationOptions):
    """Options of ``infer quantize --method awq``."""

    grid: int = 20  # alpha in {0, 1/grid, ..., 1}
    max_rows: int = 1024  # calibration rows kept per linear group for the error measurement
    clip: bool = True  # clamp each group of weights where that lowers its output error (quant/awq_clip.py)
    duo_scaling: bool = True  # scales from the activations and the weights (search_scale), else the activations
    bits_refusal: ClassVar[str] = "AWQ supports 4-bit weights only (the AutoAWQ GEMM format)"

    def validate(self) -> Self:
        super().validate()
        check_at_least_one(self, ("grid", "max_rows"))
        return self


def awq_groups(layer: nn.Module) -> tuple[LinearGroup, ...]:
    """The scale groups of a decoder layer's Linears: :func:`linear_groups`, but in a sparse layer the shared
    expert's gate and up share the experts' gate_up scale (:mod:`.calibrate_moe`), not a group of their own."""
    from ..models.moe import SparseMoe

    groups = linear_groups(layer)
    return tuple(g for g in groups if g.name != "gate_up") if isinstance(layer.ffn(), SparseMoe) else groups


@dataclass
class GroupStats:
    """What the calibration forward saw at one group's input."""

    abs_sum: torch.Tensor | None = None  # [in] fp32: sum of |x| over all tokens
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # fp32 subsets of x, for the error measurement

    def add(self, x: torch.Tensor, stride: int) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        total = x.abs().sum(dim=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += x.shape[0]
        self.rows.append(x[::stride].clone())


@dataclass(frozen=True)
class GroupReport:
    layer: int
    group: str
    alpha: float | None  # None: plain RTN kept (no scaling)
    error: float  # output MSE with the chosen scales
    rtn_error: float  # output MSE of plain RTN (alpha 0)
    clipped_error: float | None = None  # output MSE as written: the chosen scales, then clipping (None: no clipping)


@dataclass(frozen=True)
class ScaleSearch:
    scales: torch.Tensor  # [in] fp32
    alpha: float | None  # None: no alpha beat plain RTN (duo scaling), so s = 1
    error: float
    rtn_error: float


# ---------------------------------------------------------------- the scale search
def search_scale(x: torch.Tensor, stat: torch.Tensor, weights: list[torch.Tensor], group_size: int, grid: int,
                 share: tuple[int, int, int] | None = None, duo: bool = False, head: Head | None = None
                 ) -> ScaleSearch:
    """Best ``s = stat^alpha`` (normalised) for linears ``weights`` ([out_j, in], fp32) sharing input ``x`` [n, in];
    with ``duo``, ``s = stat^alpha / (w^(1 - alpha) + 1e-4)``, ``w`` the weights' :func:`weight_stat` (AutoAWQ's
    and llm-compressor's default "duo scaling"). Plain RTN (``s = 1``) is measured too and kept when no alpha beats
    it: then the search's alpha is 0 without ``duo`` (``stat^0``), None with it.

    ``share = (kv_heads, group, head_dim)``: the input is [kv_heads * group * head_dim] (o_proj under GQA) and one
    scale per (kv head, channel) is shared by the group's q heads, so that it folds into v_proj's output rows.
    """
    return search_scale_parts([(x, weights)], stat, group_size, grid, share, duo, head)


def mlp_head(layer: nn.Module) -> Head:
    """A dense layer's MLP output from its gate and up outputs side by side, ``down(act(gate) * up)`` with the
    down projection unquantized (biases added): what the gate_up group's error is measured on, as AutoAWQ measures
    the MLP block's output. It reads the layer's weights when called (folded ones, after folding)."""
    mlp = layer.ffn()
    linears = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]

    def head(y: torch.Tensor) -> torch.Tensor:
        if linears[0].bias is not None:
            y = y + torch.cat([linear.bias for linear in linears]).to(torch.float32)
        gate, up = y.chunk(2, dim=-1)
        return mlp.act_and_mul(gate, up) @ mlp.down_proj.weight.to(torch.float32).t()
    return head


def weight_stat(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Duo scaling's weight statistic [in]: per input channel, the mean over every output row of ``|w|`` relative to
    the largest ``|w|`` of its group of inputs in that row (AutoAWQ's ``w_mean``)."""
    w = torch.cat(weights).to(torch.float32).abs()
    rows, inputs = w.shape
    group = inputs if group_size == -1 else group_size
    grouped = w.view(rows, inputs // group, group)
    return (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).view(rows, inputs).mean(dim=0)


def search_scale_parts(parts: list[tuple[torch.Tensor, list[torch.Tensor]]], stat: torch.Tensor, group_size: int,
                       grid: int, share: tuple[int, int, int] | None = None, duo: bool = False,
                       head: Head | None = None) -> ScaleSearch:
    """:func:`search_scale` for linears that read one input space but not the same rows: ``parts`` pairs rows
    [n_p, in] with the weights that see them (a mixture's experts, each on the tokens routed to it); the error is
    the squared output difference summed over every part, divided by the number of outputs. ``head`` maps the
    linears' outputs, side by side, to what the error is measured on (an MLP's output: :func:`mlp_head`)."""
    def out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t() if head is None else head(x @ w.t())

    refs = [(x, w, out(x, w)) for x, weights in parts for w in [torch.cat(weights).to(torch.float32)]]
    outputs = sum(ref.numel() for _, _, ref in refs)

    def error(s: torch.Tensor) -> float:
        return sum(float((out(x, awq.fake_quantize_rtn(w * s, group_size) / s) - ref).pow(2).sum())
                   for x, w, ref in refs) / max(outputs, 1)

    def per_head(v: torch.Tensor) -> torch.Tensor:  # under GQA, one value per (KV head, channel)
        return v if share is None else v.view(*share).mean(dim=1)

    base = per_head(stat.to(torch.float32))
    w_base = per_head(weight_stat([w for _, w, _ in refs], group_size)) if duo else None
    ones = torch.ones_like(stat, dtype=torch.float32)
    rtn_error = error(ones)
    best = ScaleSearch(ones, None, rtn_error, rtn_error)
    for i in range(grid + 1):
        alpha = i / grid
        s = base.pow(alpha) if w_base is None else base.pow(alpha) / (w_base.pow(1 - alpha) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if share is not None:
            kv_heads, group, head_dim = share
            s = s.unsqueeze(1).expand(kv_heads, group, head_dim).reshape(-1)
        found = error(s)
        if found < best.error or (best.alpha is None and found <= best.error):  # a tie: the alpha, not RTN
            best = ScaleSearch(s, alpha, found, rtn_error)
    return best


def _fold(layer: nn.Module, group: LinearGroup, s: torch.Tensor) -> None:
    """Multiply the group's weight columns by ``s`` and divide the previous op's output by ``s`` (exact): a
    linear's last rows, all of v_proj's or up_proj's, v's of qkv_proj or up's of gate_up_proj."""
    prev = layer.get_submodule(group.prev)
    with torch.no_grad():
        for path in group.linears:
            linear = layer.get_submodule(path)
            linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
        if prev.weight.dim() == 1:  # RMSNorm
            prev.weight.div_(s.to(prev.weight.dtype))
            return
        rows = s
        if group.name == "o":  # under GQA, s repeats per q head; v has one row per KV head
            attn = layer.self_attn
            rows = s.view(attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim)[:, 0].reshape(-1)
        n = rows.numel()
        prev.weight[-n:].div_(rows.to(prev.weight.dtype)[:, None])
        if getattr(prev, "bias", None) is not None:
            prev.bias[-n:].div_(rows.to(prev.bias.dtype))


# ---------------------------------------------------------------- the whole run
def _collect(model: Any, samples: list[list[int]], device: torch.device, config: AwqCalibrationConfig,
             progress: ProgressFn) -> tuple[list[dict[str, GroupStats]], list[ExpertStats | None]]:
    """Run the calibration samples through the model, recording each group's input statistics and row subset, and
    each sparse layer's experts' (:class:`.calibrate_moe.ExpertStats`; None for a dense layer)."""
    from ..models.moe import SparseMoe
    from .calibrate_moe import ExpertStats

    layers = model.model.layers
    stats: list[dict[str, GroupStats]] = [{g.name: GroupStats() for g in awq_groups(layer)} for layer in layers]
    experts = [ExpertStats() if isinstance(layer.ffn(), SparseMoe) else None for layer in layers]
    total_tokens = sum(len(s) for s in samples)
    stride = max(1, -(-total_tokens // config.max_rows))
    handles = []
    for i, layer in enumerate(layers):
        for g in awq_groups(layer):
            def hook(module: nn.Module, args: tuple[torch.Tensor, ...], record: GroupStats = stats[i][g.name]) -> None:
                record.add(args[0], stride)

            handles.append(layer.get_submodule(g.linears[0]).register_forward_pre_hook(hook))
        if (record := experts[i]) is not None:
            handles.append(layer.ffn().register_forward_pre_hook(
                lambda moe, args, record=record: record.add(moe, args[0], stride)))
    try:
        batches = [samples[i: i + config.batch_samples] for i in range(0, len(samples), config.batch_samples)]
        for done, batch in enumerate(batches):
            progress("calibration forward", done, len(batches))
            dense_forward(model, batch, device)
        progress("calibration forward", len(batches), len(batches))
    finally:
        for handle in handles:
            handle.remove()
    return stats, experts


def _clip_groups(layer: nn.Module, stats: dict[str, GroupStats], searches: dict[str, ScaleSearch], group_size: int,
                 device: torch.device) -> dict[str, float]:
    """Clip the folded linears of each group (:mod:`.awq_clip`) on its calibration rows divided by its scales; return
    each group's output error as it will be written."""
    errors = {}
    for g in awq_groups(layer):
        x = torch.cat(stats[g.name].rows).to(device) / searches[g.name].scales
        parts = []
        for path in g.linears:
            weight = layer.get_submodule(path).weight.data
            reference = weight.clone()
            if clips(path):
                clip_(weight, search_clip(x, weight, group_size), group_size)
            parts.append((x, reference, weight))
        errors[g.name] = quantized_error(parts, group_size, mlp_head(layer) if g.name == "gate_up" else None)
    return errors


def _quantized_layer_tensors(layer: nn.Module, prefix: str, group_size: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for g in linear_groups(layer):
        for path in g.linears:
            linear = layer.get_submodule(path)
            qweight, qzeros, scales = awq.quantize_rtn(linear.weight.data, group_size)
            name = f"{prefix}.{path}"
            tensors.update({f"{name}.qweight": qweight.cpu(), f"{name}.qzeros": qzeros.cpu(),
                            f"{name}.scales": scales.cpu()})
            if linear.bias is not None:
                tensors[f"{name}.bias"] = linear.bias.data
    return tensors


def calibrate_awq(model_dir: Path, out_dir: Path, config: AwqCalibrationConfig = AwqCalibrationConfig(),
                  texts: Iterable[str] | None = None, progress: ProgressFn | None = None,
                  plugins: Any = None) -> list[GroupReport]:
    """Calibrate, quantize and write ``out_dir`` (an AutoAWQ GEMM checkpoint infer loads); return the search report.

    ``texts`` default to the standard library's sources (:func:`.calib_data.default_texts`).
    """
    from .calibrate_moe import clip_experts, expert_tensors, fold_experts, routers, search_experts

    raw, config = check_request(model_dir, out_dir, config)
    report_progress: ProgressFn = progress or (lambda phase, done, total: None)
    loaded, samples, seq_len = load_for_calibration(model_dir, config, texts, plugins)
    model, used = loaded.model, sum(map(len, samples))
    assert config.group_size is not None  # check_request chose it
    stats, experts = _collect(model, samples, loaded.device, config, report_progress)

    tensors: dict[str, torch.Tensor] = {}
    reports: list[GroupReport] = []
    unreached: list[str] = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        report_progress("scale search", i, len(layers))
        attn = layer.self_attn
        searches = {}
        for g in awq_groups(layer):
            record = stats[i][g.name]
            x = torch.cat(record.rows).to(loaded.device)
            stat = record.abs_sum / record.count
            weights = [layer.get_submodule(p).weight.data.to(torch.float32) for p in g.linears]
            share = (attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim) if g.name == "o" else None
            searches[g.name] = search_scale(x, stat, weights, config.group_size, config.grid, share,
                                            config.duo_scaling, mlp_head(layer) if g.name == "gate_up" else None)
        layer_reports = [GroupReport(i, name, found.alpha, found.error, found.rtn_error)
                         for name, found in searches.items()]
        if (routed := experts[i]) is not None:  # searched on the original weights too, before any folding
            found, gate_up, downs = search_experts(layer, routed, i, config, loaded.device)
            unreached += [f"model.layers.{i}.{layer.feed_forward}.experts.{e}"
                          for e in range(layer.ffn().moe.num_experts) if e not in downs]
            fold_experts(layer, gate_up, downs)
        for g in awq_groups(layer):
            _fold(layer, g, searches[g.name].scales)
        if config.clip:
            clipped = _clip_groups(layer, stats[i], searches, config.group_size, loaded.device)
            layer_reports = [replace(r, clipped_error=clipped[r.group]) for r in layer_reports]
        if routed is not None:
            if config.clip:
                found = clip_experts(layer, routed, found, gate_up, downs, config.group_size, loaded.device)
            layer_reports += found
            tensors.update(expert_tensors(layer, f"model.layers.{i}", config.group_size))
        reports += layer_reports
        tensors.update(_quantized_layer_tensors(layer, f"model.layers.{i}", config.group_size))
        stats[i], experts[i] = {}, None  # free the rows
    report_progress("scale search", len(layers), len(layers))
    if unreached:
        log.warning("%d experts saw no calibration token: their down projections are rounded to nearest, unscaled "
                    "(%s%s); give more or more varied text with --calib, or more --num-samples", len(unreached),
                    ", ".join(unreached[:4]), ", ..." if len(unreached) > 4 else "")

    qc = {"quant_method": "awq", "bits": config.bits, "group_size": config.group_size, "zero_point": True,
          "version": awq.SUPPORTED_VERSION, "modules_to_not_convert": routers(model) or None}
    record = {"method": "infer quantize --method awq", "options": asdict(config),
              "calibration_data": {"samples": len(samples), "tokens": used, "seq_len": seq_len},
              "groups": [asdict(r) for r in reports]}
    write_quantized(model, tensors, model_dir, out_dir, raw, qc, ("awq_calibration.json", record))
    return reports

