"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text models (``Gemma3ForCausalLM``: gemma-3-1b, and the text stacks of
the larger ones): the Llama layout with Gemma's differences, as transformers computes them:

- norms scale by (1 + weight), in float32 before rounding to the model dtype, and wrap both sublayers:
  ``h + post_norm(attention(input_norm(h)))``, then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``; in Gemma 3, q and k
  are normed too;
- the embedding is multiplied by sqrt(hidden_size) (rounded to the model dtype);
- the MLP's gate goes through tanh-approximated GELU;
- the softmax scale is query_pre_attn_scalar ** -0.5;
- Gemma 2 caps the attention scores and the final logits: x -> cap * tanh(x / cap) (attn_logit_softcapping 50,
  final_logit_softcapping 30 in the releases; Gemma 3's are null, and transformers applies a final cap a config
  sets, never an attention one);
- sliding layers attend within ``sliding_window``: every second one in Gemma 2 (one rope for all layers); five in
  six by default in Gemma 3, turned by their own rope (theta 10,000), the full-attention layers by the global one
  (theta 1,000,000, linear scaling by 8 in the 4B and larger).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..core.interfaces import AttentionBackend, AttentionMetadata, QuantMethod
from ..core.loader import checkpoint_dtype
from .layers import TORCH_OPS, PointwiseOps, RotaryEmbedding
from .llama import MLP, ArchConfig, Attention, LlamaFamilyModel, _Fields, check_rope, rms_norm_eps

log = logging.getLogger("infer")
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
ARCHITECTURES = (GEMMA2, GEMMA3)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) x (1 + w), in float32, rounded to x's dtype. ``weight`` holds 1 + w (float32), added on load."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: PointwiseOps = TORCH_OPS) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), the sum in x's dtype."""
        return self.ops.gemma_rms_norm(x, self.weight, self.eps, residual)


@dataclass(frozen=True)
class GemmaConfig(ArchConfig):
    """ArchConfig (whose ``rope`` is the full-attention layers') plus Gemma's own fields."""

    local_rope: dict[str, Any] | None = None  # the sliding layers' rope (Gemma 3)
    query_pre_attn_scalar: float = 256.0
    local_rope_layers: tuple[bool, ...] = ()  # per layer: a sliding one, whose rope is local_rope
    attn_softcap: float | None = None  # Gemma 2's caps: scores and logits x -> cap * tanh(x / cap)
    final_softcap: float | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> GemmaConfig:
        arch = GEMMA2 if raw.get("architectures", [None])[0] == GEMMA2 else GEMMA3
        gemma2 = arch == GEMMA2
        field = _Fields(raw, arch)
        caps = {key: softcap(field, key, gemma2) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        if not gemma2 and caps["attn_logit_softcapping"] is not None:
            log.warning("config.json of this %s sets attn_logit_softcapping, which transformers' Gemma 3 does not "
                        "apply (it caps the final logits only): infer does as transformers does", arch)
            caps["attn_logit_softcapping"] = None
        if raw.get("use_bidirectional_attention"):
            raise CheckpointError(f"config.json of this {arch} sets use_bidirectional_attention (an "
                                  "embedding model's); infer generates with causal attention only")
        act = field.get("hidden_activation", str) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"config.json of this {arch} has hidden_activation {act!r}; infer's Gemma MLP "
                                  "computes gelu_pytorch_tanh")
        heads, hidden = field.positive("num_attention_heads", 8), field.positive("hidden_size", 2304)
        kv_heads = field.positive("num_key_value_heads", 4)
        if heads % kv_heads:
            raise CheckpointError(f"config.json of this {arch} has {heads} attention heads and {kv_heads} "
                                  "key/value heads; the first must be a multiple of the second")
        head_dim, layers = field.positive("head_dim", 256), field.positive("num_hidden_layers", 26)
        full, local = gemma2_rope(raw) if gemma2 else rope_tables(raw)
        for rope in (full, local):
            check_rope(rope, arch, head_dim)
        types = raw.get("layer_types")
        if types is None:  # transformers' rule: every second layer is global in Gemma 2, every sixth in Gemma 3
            pattern = 2 if gemma2 else field.positive("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or \
                not set(types) <= {"sliding_attention", "full_attention"}:
            raise CheckpointError(f"config.json of this {arch} has layer_types = {types!r}; it should list "
                                  f"'sliding_attention' or 'full_attention' for each of the {layers} layers")
        window = field.get("sliding_window", int) if "sliding_window" in raw else 4096
        if not window or window < 0:
            raise CheckpointError(f"config.json of this {arch} has sliding_window = {window!r}; Gemma's sliding "
                                  "layers need a positive window (transformers cannot run one without)")
        scalar = field.get("query_pre_attn_scalar", (int, float))
        scalar = 256.0 if scalar is None else float(scalar)
        if not 0 < scalar < math.inf:
            raise CheckpointError(f"config.json of this {arch} has query_pre_attn_scalar = {scalar}; it must be a "
                                  "positive number")
        eos = field.get("eos_token_id", (int, list))
        eos = 1 if "eos_token_id" not in raw else eos
        bias = bool(field.get("attention_bias", bool))
        tied = field.get("tie_word_embeddings", bool)
        sliding = tuple(t == "sliding_attention" for t in types)
        return cls(
            architecture=arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, rotary_dim=head_dim, intermediate_size=field.positive("intermediate_size", 9216),
            vocab_size=field.positive("vocab_size", 256000 if gemma2 else 262208),
            rms_norm_eps=rms_norm_eps(field, 1e-6),
            max_position_embeddings=field.positive("max_position_embeddings", 8192 if gemma2 else 131072),
            tie_word_embeddings=tied is not False, attention_bias=bias, o_proj_bias=bias, mlp_bias=False,
            qk_norm=not gemma2, rope=full,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=window if any(sliding) else None, sliding_layers=sliding,
            torch_dtype=checkpoint_dtype(raw), quantization_config=raw.get("quantization_config"),
            local_rope=local, query_pre_attn_scalar=scalar, local_rope_layers=(False,) * layers if gemma2 else sliding,
            attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"])


GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # transformers' defaults


def softcap(field: _Fields, key: str, gemma2: bool) -> float | None:
    """``key``'s cap: a positive number or null (no cap); where absent, transformers' default (Gemma 2's
    GEMMA2_CAPS; Gemma 3 has none)."""
    if key not in field.raw:
        return GEMMA2_CAPS[key] if gemma2 else None
    value = field.get(key, (int, float))
    if value is not None and not 0 < value < math.inf:
        raise CheckpointError(f"config.json of this {field.arch} has {key} = {value!r}; it must be a positive number "
                              "(or null: no cap)")
    return None if value is None else float(value)


def gemma2_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 2's one rope (transformers 5's rope_parameters, or rope_theta and rope_scaling), for both layer types."""
    params = raw.get("rope_parameters")
    rope = dict(params) if isinstance(params, dict) else {}
    rope.update(raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    return rope, rope


def rope_tables(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention rope, sliding rope): transformers 5's ``rope_parameters`` per layer type, or the older
    rope_theta, rope_scaling (the global layers') and rope_local_base_freq."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        full.update(raw.get("rope_scaling") or {})  # transformers applies a rope_scaling to the global layers
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return full, local


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps, window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", quant, dtype, ops, window,
                                   scale=cfg.query_pre_attn_scalar**-0.5, norm=GemmaRMSNorm, softcap=cfg.attn_softcap)
        self.mlp = MLP(cfg, f"{prefix}.mlp", quant, dtype, ops, act_and_mul=ops.gelu_tanh_and_mul)
        self.feed_forward = "mlp"
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            self.add_module(name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops))

    def ffn(self) -> MLP:
        return self.mlp


class GemmaModel(LlamaFamilyModel):
    """The Llama family's loading, merging and heads with Gemma's layers, norms, embedding scale, ropes and caps."""

    cfg: GemmaConfig
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: GemmaConfig, quant: QuantMethod | None, dtype: torch.dtype, max_positions: int,
                 ops: PointwiseOps = TORCH_OPS, merge_projections: bool = False, multimodal: bool = False,
                 backbone: bool = False) -> None:
        super().__init__(cfg, quant, dtype, max_positions, ops, merge_projections, backbone)
        self.multimodal = multimodal  # a Gemma3ForConditionalGeneration checkpoint: its text model's tensors
        self.spec = replace(self.spec, attn_softcap=cfg.attn_softcap)
        local = replace(cfg, rope=cfg.local_rope or {})
        self.local_rotary = RotaryEmbedding(local.rotary_dim, max_positions, local.rope, ops) \
            if any(cfg.local_rope_layers) else self.rotary
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype).item()  # HF rounds it to the model dtype

    def make_layer(self, index: int, quant: QuantMethod | None, dtype: torch.dtype, window: int | None
                   ) -> nn.Module:
        return GemmaDecoderLayer(self.cfg, f"model.layers.{index}", quant, dtype, self.ops, window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        for layer, local, kv_cache in zip(self.model.layers, self.cfg.local_rope_layers, kv_caches):
            rotary = self.local_rotary if local else self.rotary
            out = layer.self_attn(layer.input_layernorm(hidden), positions, rotary, kv_cache, attn, meta)
            normed, hidden = layer.pre_feedforward_layernorm(layer.post_attention_layernorm(out), hidden)
            hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(normed))
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits, capped in the model dtype as transformers caps them (in bfloat16 the cap ties top
        logits, and greedy picks the first of a tie)."""
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_softcap
        if cap is None:
            return logits
        in_dtype = logits.to(self.model.embed_tokens.weight.dtype)  # exact: the head computed them in it
        return (torch.tanh(in_dtype / cap) * cap).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's norm weights w load as 1 + w (in float32, as transformers computes it); a multimodal
        checkpoint's text tensors load under the text model's names, its vision tower's are left out."""
        if self.multimodal:
            weights = text_weights(weights)
        dtype = self.model.embed_tokens.weight.dtype  # transformers holds w in the model dtype, then adds 1 in fp32
        super().load_weights((name, tensor.to(dtype).float() + 1.0 if name.endswith("norm.weight") and
                              tensor.is_floating_point() and tensor.element_size() > 1 else tensor)
                             for name, tensor in weights)  # an integer or fp8 norm is refused as it is

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The norms' w back from the 1 + w they hold (a text-only model's names)."""
        if self.multimodal:
            raise NotImplementedError("the text model of a multimodal Gemma 3 does not write its checkpoint")
        return {name: t - 1.0 if name.endswith("norm.weight") else t for name, t in self.state_dict().items()}

    def module_name(self, checkpoint_name: str) -> str | None:
        return text_name(checkpoint_name) if self.multimodal else checkpoint_name


# a Gemma3ForConditionalGeneration checkpoint's text tensors (the releases' names, then transformers 5's), and the
# tensors of its vision tower and projector
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_name(name: str) -> str | None:
    """A multimodal checkpoint's name for a text tensor or module under the text model's; None for the vision
    tower's and the projector's."""
    if name.startswith(VISION_PREFIXES):
        return None
    return next((new + name[len(old):] for old, new in TEXT_PREFIXES if name.startswith(old)), name)


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    return ((text, tensor) for name, tensor in weights if (text := text_name(name)) is not None)


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json's text model as a Gemma3ForCausalLM config (its dtype,
    quantization, head tying and special tokens from the top level where text_config leaves them out)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json of this Gemma3ForConditionalGeneration has text_config = {text!r}; it "
                              "should be an object with the text model's fields")
    text = dict(text)
    for key in ("dtype", "torch_dtype", "quantization_config", "tie_word_embeddings", "eos_token_id", "bos_token_id",
                "pad_token_id"):  # the releases keep eos [1, 106] (<end_of_turn> too) at the top level
        if key in raw and key not in text:
            text[key] = raw[key]
    return {**text, "architectures": [GEMMA3]}
