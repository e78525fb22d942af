"""GPTQ calibration (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") written as a GPTQ checkpoint (:mod:`.gptq`: v1 format, int4 or int8, symmetric or not, fp16 group
scales).

For a linear with weight ``W`` [out, in] and calibration inputs ``X`` [n, in], ``H = 2 X^T X / n``, damped by
``damp`` times the mean of its diagonal. The columns are quantized one at a time, in order (with ``act_order``, by
decreasing ``diag(H)``); with ``U`` the upper Cholesky factor of ``H^-1``, quantizing column ``j`` to ``q_j`` moves
every later column ``k`` by ``-(w_j - q_j) / U[j, j] * U[j, k]``, the update that minimises ``||(W - Q) X^T||^2``
given the columns quantized so far (the paper's equations 2 and 3 in their Cholesky form, section 3 step 3), applied
to the later columns a block of ``block_size`` at a time (step 2: lazy batch updates). A group's scale is chosen
when its first column is reached, from its columns as they are then (:func:`group_params`): ``2 max|w| / (2^b - 1)``
per output row for ``b`` bits, rounded up to fp16, zero point ``2^(b - 1)``; asymmetric, the row's range widened to
hold 0, over ``2^b - 1``, and its own zero point.

Layers are quantized in order, each on the inputs that the already-quantized layers before it produce (the forward
pass run up to that layer: L (L + 1) / 2 layer passes in all); within a layer every linear sees the unquantized
layer's activations (AutoGPTQ's ``true_sequential=False``). A mixture of experts' experts are quantized one by one,
each on the tokens the router sends it (its gate and up on their hidden states, its down on its own activations);
an expert no calibration token reached is rounded to nearest (its Hessian taken as the identity), said in the log.
The router stays in 16 bits, as GPTQModel keeps it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from torch import nn

from ..core.errors import ConfigError
from . import awq, w8a16
from .calib_job import (CalibrationOptions, ProgressFn, check_at_least_one, check_request, linear_groups,
                        load_for_calibration, write_quantized)
from .forward import dense_forward

log = logging.getLogger("infer")



@dataclass(frozen=True)
class GptqCalibrationConfig(CalibrationOptions):
    """Options of ``infer quantize --method gptq``."""

    act_order: bool = False  # quantize the columns by decreasing Hessian diagonal (desc_act), not in input order
    damp: float = 0.01  # of the mean Hessian diagonal, added to it
    block_size: int = 128  # columns per lazy batch update (rounded up to a multiple of the group size)
    sym: bool = True  # symmetric: zero point 2^(bits - 1); else each group's own (its range widened to hold 0)
    supported_bits: ClassVar[tuple[int, ...]] = (awq.BITS, w8a16.BITS)
    bits_refusal: ClassVar[str] = "infer quantizes GPTQ to 4- or 8-bit weights (its W4A16 and W8A16 kernels)"

    def validate(self) -> Self:
        super().validate()
        if not (math.isfinite(self.damp) and 0 < self.damp <= 1):
            raise ConfigError(f"--damp must be in (0, 1], a fraction of the mean Hessian diagonal, got {self.damp}")
        check_at_least_one(self, ("block_size",))
        return self


@dataclass(frozen=True)
class GptqLayerReport:
    layer: int
    linear: str
    error: float  # tr((W - Q) H (W - Q)^T) / tr(W H W^T): the relative output error on the calibration inputs
    rtn_error: float  # the same for round-to-nearest with the same group size (its own scales)


@dataclass(frozen=True)
class GptqResult:
    """One linear quantized: codes 0..2^bits - 1 [out, in], fp16 scales and zero points [in / g, out], g_idx [in]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] the codes stand for, in float32."""
        g = self.g_idx.long()
        return (self.codes - self.zeros[g].t()).to(torch.float32) * self.scales.to(torch.float32)[g].t()


def group_params(columns: torch.Tensor, bits: int = awq.BITS, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row of ``columns`` [out, g]: the scale, rounded up to fp16, and the zero point. Symmetric:
    ``2 max|w| / (2^bits - 1)`` and ``2^(bits - 1)``; else ``(max - min) / (2^bits - 1)`` over the range widened to
    hold 0, and ``round(-min / scale)``. An all-zero row gets the scale of a range of 1 (2 when symmetric)."""
    max_q = 2**bits - 1
    if sym:
        extent = columns.abs().amax(dim=1)
        extent = 2 * torch.where(extent > 0, extent, torch.ones_like(extent))
        lo = None
    else:
        lo, hi = columns.amin(dim=1).clamp(max=0), columns.amax(dim=1).clamp(min=0)
        extent = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    scale = awq.round_up_to_fp16(extent / max_q).to(torch.float32)
    zero = torch.full_like(scale, 1 << (bits - 1)) if lo is None else torch.round(-lo / scale).clamp(0, max_q)
    return scale, zero


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = awq.BITS) -> torch.Tensor:
    """Codes 0..2^bits - 1 of ``w`` [out] under ``scale`` and ``zero`` [out]."""
    return (torch.round(w / scale) + zero).clamp(0, 2**bits - 1)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, act_order: bool = False,
                  damp: float = 0.01, block_size: int = 128, bits: int = awq.BITS, sym: bool = True) -> GptqResult:
    """GPTQ of ``weight`` [out, in] to ``bits`` (symmetric or not) under the input Hessian ``hessian`` [in, in]
    (``2 X^T X / n``); group_size -1: one group over the whole input. Inputs no calibration token used (a zero
    diagonal) get zero weights."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(torch.float32).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if order is not None:
        w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(in_features, device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty_like(w)
    scales = torch.empty(in_features // group, out_features, device=w.device)
    zeros = torch.empty_like(scales)
    block = -(-max(block_size, 1) // group) * group if group < in_features else max(block_size, 1)
    if group == in_features:  # one group: its scales come from the weight as it is, before any update
        scales[0], zeros[0] = group_params(w, bits, sym)
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        part, errors = w[:, start:end].clone(), torch.empty(out_features, end - start, device=w.device)
        for i in range(end - start):
            j = start + i
            if j % group == 0 and group < in_features:  # the group lies in this block (a multiple of the group)
                # its columns, updated so far
                scales[j // group], zeros[j // group] = group_params(part[:, i: i + group], bits, sym)
            scale, zero = scales[j // group], zeros[j // group]
            codes[:, j] = quantize_column(part[:, i], scale, zero, bits)
            errors[:, i] = (part[:, i] - (codes[:, j] - zero) * scale) / u[j, j]
            part[:, i:] -= errors[:, i: i + 1] * u[j, j:end].unsqueeze(0)
        w[:, end:] -= errors @ u[start:end, end:]
    g_idx = torch.arange(in_features, device=w.device) // group
    if order is not None:  # back to input order: input order[j] was quantized j-th, in group j // group
        codes, g_idx = codes[:, torch.argsort(order)], g_idx[torch.argsort(order)]
    return GptqResult(codes.to(torch.int32), scales.to(torch.float16), zeros.to(torch.int32), g_idx.to(torch.int32))


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(D H D^T) / tr(W H W^T)`` with ``D = W - approx``: the output error relative to the output on the
    calibration inputs whose Hessian is ``hessian``."""
    delta = weight.to(torch.float32) - approx
    w = weight.to(torch.float32)
    return float(((delta @ hessian) * delta).sum() / ((w @ hessian) * w).sum().clamp(min=1e-30))


def rtn_dequantized(weight: torch.Tensor, group_size: int, bits: int = awq.BITS, sym: bool = True) -> torch.Tensor:
    """Round-to-nearest with this format's scales and zero points: the baseline of the report."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group, group)
    params = [group_params(w[:, g], bits, sym) for g in range(w.shape[1])]
    scales, zeros = (torch.stack([p[i] for p in params], dim=1).unsqueeze(-1) for i in range(2))
    codes = (torch.round(w / scales) + zeros).clamp(0, 2**bits - 1)
    return ((codes - zeros) * scales).reshape(out_features, in_features)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack ``32 / bits`` consecutive values along ``dim`` (0 or 1) of a 2-D integer tensor into each int32, the
    first in the lowest bits (GPTQ's qweight along the input, its qzeros along the output)."""
    pack = 32 // bits
    v = values.to(torch.int64)
    v = v.reshape(-1, pack, v.shape[1]) if dim == 0 else v.reshape(v.shape[0], -1, pack).transpose(1, 2)
    shifts = (bits * torch.arange(pack, device=values.device, dtype=torch.int64)).view(1, -1, 1)
    packed = (v << shifts).sum(dim=1)  # [rows / pack, cols] or [rows, cols / pack]
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def v1_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points [groups, out] -> GPTQ v1 ``qzeros`` [groups, out / (32 / bits)]: packed, then 1 taken off each
    field on the whole word, as GPTQModel writes v1 (a zero point of 0 borrows from the next field)."""
    words = pack_words(zeros, bits, dim=1).to(torch.int64) - sum(1 << shift for shift in range(0, 32, bits))
    return torch.where(words < -2**31, words + 2**32, words).to(torch.int32)


class _Reached(Exception):
    """Raised by the hook at the end of the layer being calibrated: the rest of the forward pass is not needed."""


def expert_weights(moe: Any, expert: int) -> list[tuple[str, str, torch.Tensor]]:
    """One expert's (projection name, Hessian key, weight view [out, in]) of a float SparseMoe: its gate and up
    (which read the hidden state) and its down (which reads the expert's activations)."""
    gate, up, down = moe.moe.projections
    size = moe.moe.intermediate_size
    return [(gate, f"experts.{expert}.w13", moe.w13[expert, :size]),
            (up, f"experts.{expert}.w13", moe.w13[expert, size:]),
            (down, f"experts.{expert}.w2", moe.w2[expert])]


def layer_hessians(model: Any, index: int, samples: list[list[int]], device: torch.device, batch: int
                   ) -> dict[str, torch.Tensor]:
    """``2 X^T X / n`` at the input of each linear group of decoder layer ``index``, over every sample (the forward
    pass stops after that layer); for a sparse layer's experts, over the tokens routed to each (keys
    ``experts.{e}.w13`` and ``experts.{e}.w2``; none for an expert no token reached)."""
    from ..models.moe import SparseMoe

    layer = model.model.layers[index]
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        sums[name] = sums[name] + x.t() @ x if name in sums else x.t() @ x
        counts[name] = counts.get(name, 0) + x.shape[0]

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            add(name, args[0].reshape(-1, args[0].shape[-1]).to(torch.float32))
        return hook

    def record_experts(moe: SparseMoe, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        _, chosen = moe.route(x)
        size = moe.moe.intermediate_size
        for e in range(moe.moe.num_experts):
            routed = x[(chosen == e).any(dim=-1)]
            if routed.shape[0]:
                hidden = routed @ moe.w13[e].t()
                add(f"experts.{e}.w13", routed.to(torch.float32))
                add(f"experts.{e}.w2", moe.silu_and_mul(hidden[:, :size], hidden[:, size:]).to(torch.float32))

    def stop(module: nn.Module, args: Any, output: Any) -> None:
        raise _Reached

    handles = [layer.get_submodule(g.linears[0]).register_forward_pre_hook(record(g.name))
               for g in linear_groups(layer)]
    if isinstance(layer.ffn(), SparseMoe):
        handles.append(layer.ffn().register_forward_pre_hook(record_experts))
    handles.append(layer.register_forward_hook(stop))
    try:
        for first in range(0, len(samples), batch):
            try:
                dense_forward(model, samples[first: first + batch], device)
            except _Reached:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2 * total / counts[name] for name, total in sums.items()}


def calibrate_gptq(model_dir: Path, out_dir: Path, config: GptqCalibrationConfig = GptqCalibrationConfig(),
                   texts: Iterable[str] | None = None, progress: ProgressFn | None = None,
                   plugins: Any = None) -> list[GptqLayerReport]:
    """Calibrate, quantize and write ``out_dir`` (a GPTQ checkpoint of ``config.bits``); return each linear's error
    report."""
    from ..models.moe import SparseMoe

    raw, config = check_request(model_dir, out_dir, config)
    report_progress: ProgressFn = progress or (lambda phase, done, total: None)
    loaded, samples, seq_len = load_for_calibration(model_dir, config, texts, plugins)
    model, group_size = loaded.model, config.group_size
    assert group_size is not None  # check_request chose it
    for i, layer in enumerate(model.model.layers):
        for g in linear_groups(layer):
            for path in g.linears:
                check_gptq_format(layer.get_submodule(path).in_features, f"model.layers.{i}.{path}", config.bits)
    tensors: dict[str, torch.Tensor] = {}
    reports: list[GptqLayerReport] = []
    unreached: list[str] = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        report_progress("GPTQ, layer by layer", i, len(layers))
        hessians = layer_hessians(model, i, samples, loaded.device, config.batch_samples)

        def quantize(path: str, weight: torch.Tensor, hessian: torch.Tensor, bias: torch.Tensor | None) -> None:
            """GPTQ of one linear at ``path`` in layer i: its tensors to write, its report; the layer's own weight
            becomes the quantized one (the next layers see this layer quantized)."""
            result = gptq_quantize(weight, hessian, group_size, config.act_order, config.damp, config.block_size,
                                   config.bits, config.sym)
            quantized, name = result.dequantized(), f"model.layers.{i}.{path}"
            rtn = rtn_dequantized(weight, group_size, config.bits, config.sym)
            reports.append(GptqLayerReport(i, path, relative_error(weight, quantized, hessian),
                                           relative_error(weight, rtn, hessian)))
            tensors.update({f"{name}.qweight": pack_words(result.codes.t(), config.bits, dim=0).cpu(),
                            f"{name}.qzeros": v1_zeros(result.zeros, config.bits).cpu(),
                            f"{name}.scales": result.scales.cpu(), f"{name}.g_idx": result.g_idx.cpu()})
            if bias is not None:
                tensors[f"{name}.bias"] = bias
            weight.copy_(quantized.to(weight.dtype))

        for g in linear_groups(layer):
            for path in g.linears:
                linear = layer.get_submodule(path)
                quantize(path, linear.weight.data, hessians[g.name],
                         linear.bias.data if linear.bias is not None else None)
        moe = layer.ffn()
        if isinstance(moe, SparseMoe):
            for e in range(moe.moe.num_experts):
                for projection, key, weight in expert_weights(moe, e):
                    if key not in hessians:  # no token reached it: round to nearest
                        unreached.append(f"model.layers.{i}.{layer.feed_forward}.experts.{e}")
                        hessians[key] = torch.eye(weight.shape[1], device=weight.device)
                    quantize(f"{layer.feed_forward}.experts.{e}.{projection}", weight, hessians[key], None)
    report_progress("GPTQ, layer by layer", len(layers), len(layers))
    if unreached := sorted(set(unreached)):
        log.warning("%d experts saw no calibration token and were rounded to nearest (%s%s); give more or more "
                    "varied text with --calib, or more --num-samples", len(unreached), ", ".join(unreached[:4]),
                    ", ..." if len(unreached) > 4 else "")
    qc = {"quant_method": "gptq", "bits": config.bits, "group_size": group_size, "sym": config.sym,
          "desc_act": config.act_order, "static_groups": False, "true_sequential": False,
          "damp_percent": config.damp, "checkpoint_format": "gptq", "lm_head": False}
    record = {"method": "infer quantize --method gptq", "options": asdict(config),
              "calibration_data": {"samples": len(samples), "tokens": sum(map(len, samples)), "seq_len": seq_len},
              "linears": [asdict(r) for r in reports]}
    write_quantized(model, tensors, model_dir, out_dir, raw, qc, ("gptq_calibration.json", record))
    return reports


def check_gptq_format(in_features: int, prefix: str, bits: int = awq.BITS) -> None:
    """GPTQ packs 32 / bits inputs per int32 (AWQ's check covers the outputs and the group)."""
    if in_features % (32 // bits):
        raise ConfigError(f"GPTQ packs {32 // bits} inputs per int32 at {bits} bits, and {prefix} has {in_features}: "
                          "this model cannot be stored as GPTQ; use --method awq (4 bits, packed along the outputs)")

