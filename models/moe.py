"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router sends each token to its top-k experts,
gated SiLU MLPs whose outputs it sums, weighted by the router's probabilities (plus Qwen2-MoE's shared expert)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CheckpointError
from ..core.interfaces import check_float


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


class Router(nn.Module):
    """The checkpoint's ``gate``: a bias-free linear from the hidden state to one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)


class SparseMoe(nn.Module):
    """The experts' weights are stacked (``w13`` [E, 2I, H]: gate's rows then up's; ``w2`` [E, H, I]) as the Triton
    kernel and transformers 5 hold them; a checkpoint's per-expert tensors load into their slices
    (``load_expert``)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype,
                 silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fused: bool,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.moe, self.silu_and_mul, self.fused = moe, silu_and_mul, fused
        size = moe.intermediate_size
        self.gate = Router(hidden_size, moe.num_experts, dtype)
        self.shared_expert = shared_expert  # Qwen2-MoE's, scaled by sigmoid(shared_expert_gate x)
        self.shared_expert_gate = Router(hidden_size, 1, dtype) if shared_expert is not None else None
        # buffers, not parameters: the checkpoint names the experts' tensors its own way (see load_expert)
        self.register_buffer("w13", torch.empty(moe.num_experts, 2 * size, hidden_size, dtype=dtype), persistent=False)
        self.register_buffer("w2", torch.empty(moe.num_experts, hidden_size, size, dtype=dtype), persistent=False)
        self.loaded: set[tuple[int, str]] = set()  # (expert, projection) loaded from the checkpoint

    def load_expert(self, prefix: str, name: str, tensor: torch.Tensor) -> None:
        """Load ``{prefix}.experts.{name}``: one expert's ("3.w1.weight"), or transformers 5's stacked layout
        ("gate_up_proj" [E, 2I, H], "down_proj" [E, H, I]: ``w13`` and ``w2`` as they are)."""
        gate, up, down = self.moe.projections
        full, size, count = f"{prefix}.experts.{name}", self.moe.intermediate_size, self.moe.num_experts
        if name in ("gate_up_proj", "down_proj"):
            target = self.w13 if name == "gate_up_proj" else self.w2
            parts = {(e, p) for e in range(count) for p in ((gate, up) if name == "gate_up_proj" else (down,))}
        else:
            index, projection, attr = name.split(".", 2) if name.count(".") == 2 else ("", "", "")
            if not index.isdigit() or int(index) >= count or projection not in (gate, up, down) or attr != "weight":
                hint = f" (config.json says {count} experts: is that right?)" if index.isdigit() else ""
                raise CheckpointError(f"unexpected tensor {full!r}: experts hold {gate}, {up} and {down} weights, "
                                      f"one set per expert 0..{count - 1}, or the stacked gate_up_proj and down_proj "
                                      f"of transformers 5{hint}")
            e = int(index)
            target = self.w2[e] if projection == down else self.w13[e, :size] if projection == gate \
                else self.w13[e, size:]
            parts = {(e, projection)}
        if target.shape != tensor.shape:
            raise CheckpointError(f"shape mismatch for {full}: checkpoint {tuple(tensor.shape)}, model "
                                  f"{tuple(target.shape)}")
        if parts & self.loaded:
            raise CheckpointError(f"{full} holds expert weights that another tensor of the checkpoint held too; "
                                  "keep one layout (per-expert tensors or the stacked ones)")
        check_float(full, tensor)
        with torch.no_grad():
            target.copy_(tensor)
        self.loaded |= parts

    def missing(self, prefix: str) -> list[str]:
        """The per-expert tensors not loaded (each expert's gate, up and down, under ``prefix``)."""
        return [f"{prefix}.experts.{e}.{name}.weight" for e in range(self.moe.num_experts)
                for name in self.moe.projections if (e, name) not in self.loaded]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights, expert ids), as HF computes them: softmax in float32 over all experts."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.fused:
            from ..kernels.fused_moe import fused_experts

            out = fused_experts(x, self.w13, self.w2, weights, experts)
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
            hidden = F.linear(x[tokens], self.w13[e])
            y = F.linear(self.silu_and_mul(hidden[:, :size], hidden[:, size:]), self.w2[e])
            out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
        return out
