"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router sends each token to its top-k experts,
gated SiLU MLPs whose outputs it sums, weighted by the router's probabilities (plus Qwen2-MoE's shared expert)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CheckpointError, shape_mismatch
from ..core.interfaces import QuantMethod, check_float
from ..quant.awq_method import AwqLinearMethod
from ..quant.w8a16_method import W8A16LinearMethod
from ..quant.fp8 import FP8_DTYPE, quantize_per_channel_into
from ..quant.fp8_block import (Block, block_gemm_reference, dequantize_blocks, has_fp8_tensor_cores, k_tile,
                               quantize_per_token_group)
from .layers import Linear

if TYPE_CHECKING:
    from ..kernels.awq_moe import AwqExperts
    from ..kernels.w8a16_moe import W8A16Experts

STACKABLE = {AwqLinearMethod: "awq_group_size", W8A16LinearMethod: "w8a16_group_size"}  # method -> its group attr

log = logging.getLogger("infer")


@dataclass(frozen=True)
class MoeConfig:
    """The experts of one architecture's sparse layers, and the checkpoint's names for them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize: bool  # the top-k probabilities are scaled to sum to 1 (Mixtral always, Qwen3-MoE by norm_topk_prob)
    float_weights: bool  # the routing weights multiply in float32 (Mixtral), else in the model's dtype (Qwen3-MoE)
    block: str  # the layer's submodule: "block_sparse_moe" (Mixtral) or "mlp" (Qwen3-MoE)
    projections: tuple[str, str, str]  # an expert's gate, up and down: ("w1", "w3", "w2") or "{gate,up,down}_proj"
    sparse_layers: tuple[bool, ...]  # per layer: experts (else a dense MLP)
    shared_intermediate_size: int = 0  # Qwen2-MoE: a shared expert every token goes through (0: none)


@dataclass(frozen=True)
class ExpertsFp8:
    """How the experts are FP8: e4m3 codes with the scales of blocks ``block13`` of w13 and ``block2`` of w2 ((bn,
    bk); (1, K) is one scale per output channel), inputs quantized per token and group of bk. ``scale_name``: the
    checkpoint's name for a scale; ``on_load``: the checkpoint's experts are float, quantized as they load (kept
    float where the fused experts cannot run FP8)."""

    block13: Block
    block2: Block
    scale_name: str = "weight_scale_inv"
    on_load: bool = False


def experts_fp8(quant: object, prefix: str, moe: MoeConfig, hidden_size: int) -> ExpertsFp8 | None:
    """The FP8 format of the experts at ``prefix`` under ``quant``: a block-wise FP8 checkpoint's blocks, a
    compressed-tensors FP8_DYNAMIC checkpoint's channels, or per-channel quantization on load (``--quant fp8``); None
    for unquantized experts (the model plugin refuses other quant methods)."""
    from ..core.errors import ConfigError
    from ..quant import fp8
    from ..quant.fp8_block_method import BlockFp8LinearMethod
    from ..quant.fp8_method import Fp8LinearMethod

    per_channel = ((1, hidden_size), (1, moe.intermediate_size))
    if isinstance(quant, BlockFp8LinearMethod):
        if not quant.applies_to(prefix):
            return None
        if quant.config.block is None:
            raise ConfigError("this FP8 checkpoint has no weight_block_size (one scale per tensor), which infer's "
                              "FP8 experts do not load; it loads block-wise FP8 experts")
        return ExpertsFp8(quant.config.block, quant.config.block)
    if not isinstance(quant, Fp8LinearMethod):
        return None
    if quant.checkpoint is None:
        return ExpertsFp8(*per_channel, on_load=True)
    scheme = quant.checkpoint.scheme_for(f"{prefix}.0.{moe.projections[0]}")
    if scheme is None:
        return None
    if scheme != fp8.DYNAMIC:
        raise CheckpointError(f"the experts at {prefix} use the FP8 scheme {scheme}; infer's FP8 experts load "
                              "compressed-tensors FP8_DYNAMIC ones (per-channel weights, dynamic per-token "
                              "activations)")
    return ExpertsFp8(*per_channel, scale_name="weight_scale")


def experts_quant(quant: QuantMethod | None, prefix: str, moe: MoeConfig) -> QuantMethod | None:
    """The quant method whose experts at ``prefix`` load as per-expert Linears (:class:`SparseMoe`'s ``experts``):
    one whose checkpoint tensors are not the stacked experts' (AWQ), where it converts any of an expert's
    projections (an AutoAWQ Qwen2-MoE checkpoint leaves gate_proj float: modules_to_not_convert ["gate"]); None for
    unquantized experts (``--skinny-gemm-rows``' unquantized method too) and for FP8 ones, which load stacked."""
    from ..quant.fp8_block_method import BlockFp8LinearMethod
    from ..quant.fp8_method import Fp8LinearMethod
    from .layers import UnquantizedMethod

    if quant is None or isinstance(quant, BlockFp8LinearMethod | Fp8LinearMethod | UnquantizedMethod):
        return None
    return quant if any(quant.applies_to(f"{prefix}.{e}.{projection}") for e in range(moe.num_experts)
                        for projection in moe.projections) else None


def stacked_layout(linear: nn.Module) -> tuple[type | None, int]:
    """The stacked experts' method class of an expert's linear (None: none stacks it) and its group size."""
    kind = next((kind for kind in STACKABLE if isinstance(linear.method, kind)), None)
    return kind, getattr(linear, STACKABLE[kind]) if kind is not None else 0


def fused_fp8_runs(device: torch.device, fp8: ExpertsFp8) -> bool:
    """Whether the fused Triton experts run ``fp8``'s experts on ``device``: a GPU with FP8 tensor cores, or the
    interpreter (CPU tensors), and K-tiles its scale groups allow."""
    native = device.type == "cuda"
    if native and not has_fp8_tensor_cores(device):
        return False
    return all(k_tile(block[1], native) is not None for block in (fp8.block13, fp8.block2))


class Router(nn.Module):
    """The checkpoint's ``gate``: a bias-free linear from the hidden state to one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)


def expert_linears(moe: MoeConfig, hidden_size: int, prefix: str, quant: QuantMethod, dtype: torch.dtype
                   ) -> nn.Module:
    """One expert's gate, up and down Linears, named as the checkpoint names them (``w1``/``w3``/``w2`` or
    ``gate_proj``/``up_proj``/``down_proj``)."""
    expert, size = nn.Module(), moe.intermediate_size
    for projection, (inputs, outputs) in zip(moe.projections, ((hidden_size, size), (hidden_size, size),
                                                                (size, hidden_size))):
        expert.add_module(projection, Linear(inputs, outputs, False, f"{prefix}.{projection}", quant, dtype))
    return expert


class SparseMoe(nn.Module):
    """The experts' weights are stacked (``w13`` [E, 2I, H]: gate's rows then up's; ``w2`` [E, H, I]) as the Triton
    kernel and transformers 5 hold them; a checkpoint's per-expert tensors load into their slices
    (``load_expert``). With ``fp8`` (:class:`ExpertsFp8`) they are e4m3 after loading, with ``w13_scale``
    [E, 2I / bn, ceil(H / bk)] and ``w2_scale`` [E, ceil(H / bn), ceil(I / bk)] (:mod:`infer.quant.fp8_block`).
    With ``linear_quant`` (AWQ, GPTQ: :func:`experts_quant`) each expert's projections are Linears of that method
    instead, ``experts.{e}.{projection}`` as the checkpoint names them, which load as any Linear does. ``fused``
    experts whose every projection is int4 in the AWQ layout, or every one W8A16, are then stacked after loading,
    ``w13_qweight`` ([E, H, 2I / 8] packed, or [E, H, 2I] bytes) and its qzeros and scales (gate's output columns,
    then up's) and ``w2_*``, the Linears freed, and run by the grouped W4A16 GEMMs (:mod:`infer.kernels.awq_moe`)
    or W8A16 ones (:mod:`infer.kernels.w8a16_moe`); others run one expert at a time by the torch loop."""

    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype,
                 silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fused: bool,
                 shared_expert: nn.Module | None = None, fp8: ExpertsFp8 | None = None,
                 linear_quant: QuantMethod | None = None, prefix: str = "") -> None:
        super().__init__()
        self.moe, self.silu_and_mul, self.fused, self.fp8 = moe, silu_and_mul, fused, fp8
        size, count = moe.intermediate_size, moe.num_experts
        self.gate = Router(hidden_size, count, dtype)
        self.shared_expert = shared_expert  # Qwen2-MoE's, scaled by sigmoid(shared_expert_gate x)
        self.shared_expert_gate = Router(hidden_size, 1, dtype) if shared_expert is not None else None
        self.experts: nn.ModuleList | None = None
        # the stacked experts' runtime method (AwqLinearMethod or W8A16LinearMethod) and group sizes (w13's, w2's)
        self.stacked: tuple[type, int, int] | None = None
        self.loaded: set[tuple[int, str]] = set()  # (expert, projection or projection + "_scale") loaded
        # Linears the stacked kernels cannot run (not every projection of every expert int4 AWQ, or every one
        # W8A16, or the experts' gate/up, or downs, in groups of several sizes): the torch loop runs them, which
        # reads expert counts back to the host (ModelSpec.graph_blocker)
        self.unstackable = False
        if linear_quant is not None:
            self.experts = nn.ModuleList(expert_linears(moe, hidden_size, f"{prefix}.experts.{e}", linear_quant, dtype)
                                         for e in range(count))
            self.register_buffer("w13", None)
            self.register_buffer("w2", None)
            layouts = [{stacked_layout(expert.get_submodule(p)) for expert in self.experts for p in projections}
                       for projections in (moe.projections[:2], moe.projections[2:])]  # gate/up's and down's
            kinds = {kind for layout in layouts for kind, _ in layout}
            self.unstackable = len(kinds) != 1 or None in kinds or any(len(layout) > 1 for layout in layouts)
            # (expert, "projection.tensor") the checkpoint must fill, before loading changes the Linears' tensors
            self.expected = {(e, f"{projection}.{attr}") for e, expert in enumerate(self.experts)
                             for projection in moe.projections
                             for attr in expert.get_submodule(projection).state_dict()}
            self.fused = fused and not self.unstackable
            return
        # buffers, not parameters: the checkpoint names the experts' tensors its own way (see load_expert)
        # e4m3 codes: the checkpoint's, or (--quant fp8) quantized as they load, where the fused experts run FP8
        runs_fp8 = fp8 is not None and not (fused and not fused_fp8_runs(torch.get_default_device(), fp8))
        stored = FP8_DTYPE if fp8 is not None and (not fp8.on_load or runs_fp8) else dtype
        self.register_buffer("w13", torch.empty(count, 2 * size, hidden_size, dtype=stored), persistent=False)
        self.register_buffer("w2", torch.empty(count, hidden_size, size, dtype=stored), persistent=False)
        if fp8 is not None and self.scaled:
            if size % fp8.block13[0]:
                raise CheckpointError(f"the experts' intermediate size {size} is not a multiple of the FP8 block's "
                                      f"{fp8.block13[0]} rows, so gate's and up's block scales cannot stack; infer "
                                      "cannot load this FP8 MoE checkpoint")
            self._register_scales()

    @property
    def scaled(self) -> bool:
        """Whether the experts hold e4m3 codes (with w13_scale/w2_scale): loaded so, or quantized as they load."""
        return self.w13 is not None and self.w13.dtype == FP8_DTYPE

    def _register_scales(self) -> None:
        assert self.fp8 is not None
        for name, block in (("w13", self.fp8.block13), ("w2", self.fp8.block2)):
            count, rows, cols = getattr(self, name).shape
            self.register_buffer(f"{name}_scale", torch.empty(count, -(-rows // block[0]), -(-cols // block[1]),
                                                              dtype=torch.float32, device=self.w13.device),
                                 persistent=False)

    def process_after_loading(self) -> None:
        """Stack fused int experts (:meth:`stack_quantized`). Where the fused Triton experts cannot run FP8 (a GPU below
        sm89, a scale group whose K-tile is too small), FP8 experts stay (``--quant fp8``: never quantized) or
        become float in the model dtype (the checkpoint's dequantized weights, activations unquantized), said once
        in the log."""
        if self.experts is not None and self.fused:
            self.stack_quantized()
        if self.fp8 is None:
            return
        if self.fused and not fused_fp8_runs(self.w13.device, self.fp8):
            log.warning("fp8: the fused Triton experts cannot run FP8 here (they need FP8 tensor cores, sm89+, and "
                        "scale groups of a multiple of 32 inputs on a GPU), so the experts run in %s (the "
                        "checkpoint's weights, dequantized if stored in FP8): correct, twice the memory of FP8",
                        self.gate.weight.dtype)
            if self.scaled:
                for name, block in (("w13", self.fp8.block13), ("w2", self.fp8.block2)):
                    weight, scale = getattr(self, name), getattr(self, f"{name}_scale")
                    dense = torch.stack([dequantize_blocks(w, s, block).to(self.gate.weight.dtype)
                                         for w, s in zip(weight, scale)])
                    self.register_buffer(name, dense, persistent=False)
                    delattr(self, f"{name}_scale")
            self.fp8 = None
            return

    def stack_quantized(self) -> None:
        """Stack the experts' loaded AWQ (or W8A16) Linears into the grouped GEMMs' tensors
        (:meth:`stacked_experts`), freeing each expert's Linears once copied (the peak is one expert's more)."""
        from ..quant.awq_method import PACKED

        assert self.experts is not None
        gate, up, down = self.moe.projections
        parts = {"w13": (gate, up), "w2": (down,)}
        first = self.experts[0]
        method = next(kind for kind in STACKABLE if isinstance(first.get_submodule(gate).method, kind))
        groups = []
        for name, projections in parts.items():
            linears = [first.get_submodule(p) for p in projections]
            kinds = {(getattr(expert.get_submodule(p), STACKABLE[method]), expert.get_submodule(p).scales.dtype)
                     for expert in self.experts for p in projections}
            if len(kinds) > 1:
                raise CheckpointError(f"the quantized experts' {'/'.join(projections)} differ in group size or scale "
                                      f"dtype ({sorted(map(str, kinds))}), which the stacked expert kernels cannot "
                                      "run; add --no-fused-ops to run them one expert at a time")
            groups.append(kinds.pop()[0])
            orders = [[getattr(expert.get_submodule(p), "input_order", None) for p in projections]
                      for expert in self.experts]  # GPTQ in activation order: a permutation of each expert's input
            if any(o is not None for pair in orders for o in pair):
                weight = linears[0].qweight  # an expert whose groups happen to be in order has None: the identity
                orders = [[torch.arange(weight.shape[0], device=weight.device) if o is None else o for o in pair]
                          for pair in orders]
                if any(not all(torch.equal(o, pair[0]) for o in pair) for pair in orders):
                    raise CheckpointError(f"the GPTQ experts' {'/'.join(projections)} read their input in different "
                                          "activation orders, which the stacked expert kernels cannot run; add "
                                          "--no-fused-ops to run them one expert at a time")
                self.register_buffer(f"{name}_input_order", torch.stack([pair[0] for pair in orders]),
                                     persistent=False)
            for attr in PACKED:  # a column holds whole output columns (8 packed, or one): concatenating is exact
                like = getattr(linears[0], attr)
                columns = sum(getattr(linear, attr).shape[1] for linear in linears)
                self.register_buffer(f"{name}_{attr}", like.new_empty(len(self.experts), like.shape[0], columns),
                                     persistent=False)
        for e, expert in enumerate(self.experts):
            for name, projections in parts.items():
                for attr in PACKED:
                    torch.cat([getattr(expert.get_submodule(p), attr) for p in projections], dim=1,
                              out=getattr(self, f"{name}_{attr}")[e])
            self.experts[e] = nn.Module()  # this expert's Linears go
        self.stacked = (method, groups[0], groups[1])
        self.experts = None

    def stacked_experts(self) -> tuple[AwqExperts, AwqExperts] | tuple[W8A16Experts, W8A16Experts]:
        """The stacked experts' (w13, w2) (after :meth:`stack_quantized`): AWQ's or W8A16's."""
        from ..kernels.awq_moe import AwqExperts
        from ..kernels.w8a16_moe import W8A16Experts

        assert self.stacked is not None
        method, *groups = self.stacked
        kind = AwqExperts if method is AwqLinearMethod else W8A16Experts
        w13, w2 = (kind(getattr(self, f"{name}_qweight"), getattr(self, f"{name}_qzeros"),
                        getattr(self, f"{name}_scales"), group, getattr(self, f"{name}_input_order", None))
                   for name, group in zip(("w13", "w2"), groups))
        return w13, w2  # type: ignore[return-value]

    def load_expert(self, prefix: str, name: str, tensor: torch.Tensor) -> None:
        """Load ``{prefix}.experts.{name}``: one expert's ("3.w1.weight", FP8 "3.w1.weight_scale_inv"), or
        transformers 5's stacked layout ("gate_up_proj" [E, 2I, H], "down_proj" [E, H, I]: ``w13`` and ``w2`` as
        they are; FP8 "gate_up_proj_scale_inv", "down_proj_scale_inv")."""
        if self.experts is not None:
            return self._load_linear(prefix, name, tensor)
        gate, up, down = self.moe.projections
        full, count = f"{prefix}.experts.{name}", self.moe.num_experts
        stacked, is_scale = name.removesuffix("_scale_inv"), name.endswith("_scale_inv")
        if stacked in ("gate_up_proj", "down_proj"):
            base = "w13" if stacked == "gate_up_proj" else "w2"
            target = getattr(self, base + ("_scale" if is_scale else ""), None)
            scale_target = getattr(self, base + "_scale", None)
            projections = (gate, up) if stacked == "gate_up_proj" else (down,)
            parts = {(e, p) for e in range(count) for p in projections}
        else:
            index, projection, attr = name.split(".", 2) if name.count(".") == 2 else ("", "", "")
            scale_name = self.fp8.scale_name if self.fp8 is not None else "weight_scale_inv"
            is_scale = attr == scale_name
            if not index.isdigit() or int(index) >= count or projection not in (gate, up, down) or \
                    attr not in ("weight", scale_name):
                hint = f" (config.json says {count} experts: is that right?)" if index.isdigit() else ""
                raise CheckpointError(f"unexpected tensor {full!r}: experts hold {gate}, {up} and {down} weights, "
                                      f"one set per expert 0..{count - 1}, or the stacked gate_up_proj and down_proj "
                                      f"of transformers 5{hint}")
            e = int(index)
            target = self._expert_slice(e, projection, is_scale)
            scale_target = self._expert_slice(e, projection, True)
            parts = {(e, projection)}
        on_load = self.fp8 is not None and self.fp8.on_load and self.scaled  # quantized as it loads
        if is_scale:
            if target is None or not self.scaled or on_load:
                raise CheckpointError(f"unexpected tensor {full!r}: an FP8 scale, but this model's experts are not "
                                      "FP8 in the checkpoint (config.json's quantization_config, with its "
                                      "modules_to_not_convert or ignore list, leaves them unquantized)")
            parts = {(e, p + "_scale") for e, p in parts}
        if target.shape != tensor.shape:
            raise shape_mismatch(full, tuple(tensor.shape), tuple(target.shape))
        if parts & self.loaded:
            raise CheckpointError(f"{full} holds expert weights that another tensor of the checkpoint held too; "
                                  "keep one layout (per-expert tensors or the stacked ones)")
        if self.scaled and not is_scale and not on_load and tensor.dtype != FP8_DTYPE:
            raise CheckpointError(f"{full} is {tensor.dtype}, but the checkpoint's quantization_config makes the "
                                  "experts FP8: float8_e4m3fn weights with their scales")
        if not self.scaled or is_scale or on_load:
            check_float(full, tensor)
        with torch.no_grad():
            if on_load:  # --quant fp8: one scale (amax / 448) per row, an expert at a time (a stacked tensor's too)
                for codes, scales, part in zip(*((target, scale_target, tensor) if tensor.dim() == 3 else
                                                 ([target], [scale_target], [tensor]))):
                    quantize_per_channel_into(codes, scales.squeeze(-1), part.to(codes.device, self.gate.weight.dtype))
                parts |= {(e, p + "_scale") for e, p in parts}
            else:
                target.copy_(tensor)
        self.loaded |= parts

    def _load_linear(self, prefix: str, name: str, tensor: torch.Tensor) -> None:
        """Per-expert Linears: one expert's tensor ("3.gate_proj.qweight", or a float "3.w1.weight" to quantize on
        load) goes to its Linear; transformers 5's stacked float ones are split among the experts."""
        assert self.experts is not None
        gate, up, down = self.moe.projections
        full, count = f"{prefix}.experts.{name}", self.moe.num_experts
        if name in ("gate_up_proj", "down_proj"):
            size = self.moe.intermediate_size
            expected = (count, 2 * size) if name == "gate_up_proj" else (count, self.gate.weight.shape[1])
            if tuple(tensor.shape[:2]) != expected:
                raise CheckpointError(f"shape mismatch for {full}: checkpoint {tuple(tensor.shape)}, model "
                                      f"{expected} by the experts' inputs")
            parts = [(gate, slice(0, size)), (up, slice(size, None))] if name == "gate_up_proj" else \
                [(down, slice(None))]
            for e in range(count):
                for projection, rows in parts:
                    self._load_part(full, e, projection, "weight", tensor[e, rows])
            return
        index, projection, attr = name.split(".", 2) if name.count(".") == 2 else ("", "", "")
        if not index.isdigit() or int(index) >= count or projection not in (gate, up, down):
            hint = f" (config.json says {count} experts: is that right?)" if index.isdigit() else ""
            raise CheckpointError(f"unexpected tensor {full!r}: experts hold {gate}, {up} and {down} linears, one "
                                  f"set per expert 0..{count - 1}{hint}")
        self._load_part(full, int(index), projection, attr, tensor)

    def _load_part(self, full: str, e: int, projection: str, attr: str, tensor: torch.Tensor) -> None:
        if (e, f"{projection}.{attr}") in self.loaded:
            raise CheckpointError(f"{full} holds expert weights that another tensor of the checkpoint held too; "
                                  "keep one layout (per-expert tensors or the stacked ones)")
        assert self.experts is not None
        getattr(self.experts[e], projection).load(attr, tensor)
        self.loaded.add((e, f"{projection}.{attr}"))

    def _expert_slice(self, e: int, projection: str, scale: bool) -> torch.Tensor | None:
        """Expert ``e``'s part of w13/w2 (or of their scales) that ``projection`` fills."""
        gate, _, down = self.moe.projections
        stacked = getattr(self, ("w2" if projection == down else "w13") + ("_scale" if scale else ""), None)
        if stacked is None or projection == down:
            return None if stacked is None else stacked[e]
        half = stacked.shape[1] // 2
        return stacked[e, :half] if projection == gate else stacked[e, half:]

    def missing(self, prefix: str) -> list[str]:
        """The per-expert tensors not loaded (each expert's gate, up and down, under ``prefix``)."""
        if self.experts is not None:
            return [f"{prefix}.experts.{e}.{part}" for e, part in sorted(self.expected - self.loaded)]
        from_checkpoint = self.fp8 is not None and self.scaled and not self.fp8.on_load  # else no scale tensors
        kinds = (("", "weight"),) + ((("_scale", self.fp8.scale_name),) if from_checkpoint else ())
        return [f"{prefix}.experts.{e}.{name}.{attr}" for e in range(self.moe.num_experts)
                for name in self.moe.projections for kind, attr in kinds if (e, name + kind) not in self.loaded]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights, expert ids), as HF computes them: softmax in float32 over all experts."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.stacked is not None:
            from ..kernels.awq_moe import fused_awq_experts
            from ..kernels.w8a16_moe import fused_w8a16_experts

            run = fused_awq_experts if self.stacked[0] is AwqLinearMethod else fused_w8a16_experts
            out = run(x, *self.stacked_experts(), weights, experts)  # type: ignore[arg-type]
        elif self.fused:
            from ..kernels.fused_moe import Fp8ExpertScales, fused_experts

            scales = None if self.fp8 is None else \
                Fp8ExpertScales(self.w13_scale, self.w2_scale, self.fp8.block13, self.fp8.block2)
            out = fused_experts(x, self.w13, self.w2, weights, experts, scales)
        else:
            out = self.experts_loop(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out

    def experts_loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The reference: expert by expert, in HF's order (bit-equal to it in float32). Reads the expert counts
        back to the host, so it runs outside CUDA graphs only."""
        out = torch.zeros_like(x)
        size = self.moe.intermediate_size
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens, slots = pairs // self.moe.top_k, pairs % self.moe.top_k
            hidden = self._expert_linear(x[tokens], e, "w13")
            y = self._expert_linear(self.silu_and_mul(hidden[:, :size], hidden[:, size:]), e, "w2")
            out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
        return out

    def _expert_linear(self, x: torch.Tensor, e: int, name: str) -> torch.Tensor:
        """``x @ W.T`` for expert ``e``'s ``name`` (w13 or w2); FP8 as the block-wise linears emulate it."""
        if self.experts is not None:
            gate, up, down = (getattr(self.experts[e], p) for p in self.moe.projections)
            return torch.cat([gate(x), up(x)], dim=-1) if name == "w13" else down(x)
        weight = getattr(self, name)[e]
        if self.fp8 is None:
            return F.linear(x, weight)
        block = self.fp8.block13 if name == "w13" else self.fp8.block2
        xq, x_scale = quantize_per_token_group(x, block[1])
        return block_gemm_reference(xq, x_scale, weight, getattr(self, f"{name}_scale")[e], block, x.dtype)
