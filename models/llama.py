"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): one decoder with per-architecture switches."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..core.interfaces import AttentionBackend, AttentionMetadata, ModelSpec, QuantMethod
from ..core.model import Model
from .layers import TORCH_OPS, Linear, PointwiseOps, RMSNorm, RotaryEmbedding


@dataclass(frozen=True)
class ArchConfig:
    """The fields of an HF config.json that the Llama family needs."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ArchConfig:
        arch = (raw.get("architectures") or ["?"])[0]
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
            eos = raw.get("eos_token_id")
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                rope=rope,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                sliding_window=int(window) if window else None,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                quantization_config=raw.get("quantization_config"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json is missing or has a bad field for {arch}: {exc}") from exc


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, q_size, bias, f"{prefix}.q_proj", quant, dtype)
        self.k_proj = Linear(cfg.hidden_size, kv_size, bias, f"{prefix}.k_proj", quant, dtype)
        self.v_proj = Linear(cfg.hidden_size, kv_size, bias, f"{prefix}.v_proj", quant, dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, False, f"{prefix}.o_proj", quant, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = attn.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, f"{prefix}.gate_proj", quant, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, f"{prefix}.up_proj", quant, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, f"{prefix}.down_proj", quant, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", quant, dtype, ops)
        self.mlp = MLP(cfg, f"{prefix}.mlp", quant, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class LlamaFamilyModel(Model):
    """Parameter names follow the HF checkpoints exactly, so loading is a name lookup. ``ops`` are the elementwise
    ops (norms, rotary, SiLU-and-mul): the torch reference, or fused Triton kernels on a GPU."""

    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None, dtype: torch.dtype, max_positions: int,
                 ops: PointwiseOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.cfg = cfg
        self.spec = ModelSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, max_positions,
                              cfg.eos_token_ids)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.model.embed_tokens.weight.requires_grad_(False)
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, f"model.layers.{i}", quant, dtype, ops) for i in range(cfg.num_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, ops)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, False, "lm_head", quant, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            hidden = layer.self_attn(hidden, positions, self.rotary, kv_cache, attn, meta)
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return (hidden @ self.model.embed_tokens.weight.T).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        expected = set(self.state_dict())  # every tensor the checkpoint must provide (quant layouts included)
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue  # derived buffers; tied head reuses embed_tokens
            owner, _, attr = name.rpartition(".")
            module = modules.get(owner)
            if isinstance(module, Linear):
                module.load(attr, tensor)
            elif name in params:
                param = params[name]
                if param.shape != tensor.shape:
                    raise CheckpointError(
                        f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
            else:
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint for {self.cfg.architecture}")
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        for module in modules.values():
            if isinstance(module, Linear):
                module.method.process_after_loading(module)
