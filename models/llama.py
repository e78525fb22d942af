"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3): one decoder with per-architecture switches."""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointError, InvalidRequestError, shape_mismatch
from ..core.loader import checkpoint_dtype
from ..core.interfaces import AttentionBackend, AttentionMetadata, ModelSpec, QuantMethod, check_float
from ..core.model import Model, no_lm_head
from .layers import TORCH_OPS, Linear, PointwiseOps, RMSNorm, RotaryEmbedding, UnquantizedMethod, merge_linears
from .moe import MoeConfig, Router, SparseMoe, experts_fp8, experts_quant


EMBEDDING = "model.embed_tokens.weight"


def load_parameter(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy a float checkpoint tensor into a parameter of the same shape."""
    if param.shape != tensor.shape:
        raise shape_mismatch(name, tuple(tensor.shape), tuple(param.shape))
    check_float(name, tensor)
    with torch.no_grad():
        param.copy_(tensor)


# compressed-tensors' kv_cache_scheme tensors (and the older per-projection form)
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.k_zero_point", "self_attn.v_zero_point",
                  "k_proj.output_scale", "v_proj.output_scale")


@dataclass(frozen=True)
class ArchConfig:
    """The fields of an HF config.json that the Llama family needs."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first rotary_dim dimensions of each head turn (head_dim but for a partial rotation)
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any] = field(default_factory=dict)
    fused_projections: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3), not their parts
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it attends within sliding_window (else all keys)
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None
    moe: MoeConfig | None = None  # the sparse experts of Mixtral and Qwen3-MoE

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ArchConfig:
        arch = raw["architectures"][0]  # the loader checked it
        field = _Fields(raw, arch)
        defaults = ARCH_DEFAULTS.get(arch, {})
        heads, hidden = field.positive("num_attention_heads"), field.positive("hidden_size")
        max_positions = field.positive("max_position_embeddings", defaults.get("max_position_embeddings", 2048))
        # HF: an explicit null means one KV head per attention head; an absent key, the class's default
        kv_default = heads if "num_key_value_heads" in raw else defaults.get("num_key_value_heads") or heads
        kv_heads = field.positive("num_key_value_heads", kv_default)
        if heads % kv_heads:
            raise CheckpointError(f"config.json of this {arch} has {heads} attention heads and {kv_heads} key/value "
                                  "heads; grouped-query attention needs the first a multiple of the second; fix "
                                  "num_attention_heads or num_key_value_heads")
        act = field.get("hidden_act", str)
        act = "silu" if act is None else act
        if act not in ("silu", "swish"):
            raise CheckpointError(f"config.json of this {arch} has hidden_act {act!r}; infer's MLP computes silu "
                                  "(swish) only")
        # HF: a rope_scaling dict wins over rope_parameters (transformers 5 writes a default rope_parameters)
        rope = dict(field.get("rope_scaling", dict) or field.get("rope_parameters", dict) or {})
        theta = field.get("rope_theta", (int, float))
        rope.setdefault("rope_theta", defaults.get("rope_theta", 10000.0) if theta is None else theta)
        if arch == "Phi3ForCausalLM" and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            rope["rope_type"] = "longrope"  # HF's Phi3Config reads both so
        kind = rope.get("rope_type", rope.get("type"))
        if kind in ("llama3", "yarn", "longrope"):  # HF: a top-level one wins (Phi-3's class has 4096), else the
            top = field.get("original_max_position_embeddings", int) or defaults.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = top or rope.get("original_max_position_embeddings") \
                or max_positions
            # HF: YaRN's explicit null factor (DeepSeek-V3's), LongRoPE's absent one is this ratio
            if kind == "yarn" and "factor" in rope and rope["factor"] is None or kind == "longrope" and \
                    rope.get("factor") is None:
                old = rope["original_max_position_embeddings"]
                rope["factor"] = max_positions / old if isinstance(old, (int, float)) and old > 0 else None
        head_dim = field.positive("head_dim", defaults.get("head_dim") or hidden // heads)
        rotary_dim = rotary_dimensions(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)),
                                       head_dim, arch)
        check_rope(rope, arch, rotary_dim)
        eos = field.get("eos_token_id", (int, list))
        # HF's default window (4096) applies where the key is absent; null means none
        window = field.get("sliding_window", int) if "sliding_window" in raw else defaults.get("sliding_window")
        if window is not None and window < 0:
            raise CheckpointError(f"config.json of this {arch} has sliding_window = {window}; a window is a positive "
                                  "number of positions (null, or 0, for none); fix config.json")
        num_layers = field.positive("num_hidden_layers")
        sliding = (True,) * num_layers  # Mistral and Phi-3 slide in every layer where there is a window
        if "max_window_layers" in defaults:  # Qwen2/3: layer i slides with use_sliding_window, i >= that
            types = raw.get("layer_types")
            first = field.get("max_window_layers", int)  # 0: every layer slides
            first = defaults["max_window_layers"] if first is None else first
            sliding = tuple(kind == "sliding_attention" for kind in types) if isinstance(types, list) and \
                len(types) == num_layers else tuple(i >= first for i in range(num_layers))
            window = window if field.get("use_sliding_window", bool) and any(sliding) else None
        elif arch == "Qwen3MoeForCausalLM":  # every layer slides with use_sliding_window
            window = window if field.get("use_sliding_window", bool) else None
        elif arch == "Qwen2MoeForCausalLM":  # with use_sliding_window: layer_types, else HF's rule (even i < 28)
            types, first = raw.get("layer_types"), field.get("max_window_layers", int)
            first = 28 if first is None else first
            sliding = tuple(kind == "sliding_attention" for kind in types) if isinstance(types, list) and \
                len(types) == num_layers else tuple(i % 2 == 0 and i < first for i in range(num_layers))
            window = window if field.get("use_sliding_window", bool) and any(sliding) else None
        elif arch not in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):  # Llama never slides
            window = None
        biases = BIASES.get(arch, BIASES["LlamaForCausalLM"])
        qkv = biases["qkv"]
        attention_bias = qkv is True or (qkv == "flag" and bool(field.get("attention_bias", bool))) or (
            qkv == "qkv_bias" and field.get("qkv_bias", bool) is not False)  # Qwen2-MoE's flag, true by default
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            intermediate_size=field.positive("intermediate_size"),
            vocab_size=field.positive("vocab_size"),
            rms_norm_eps=rms_norm_eps(field, defaults.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(field.get("tie_word_embeddings", bool)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and biases["o"],
            mlp_bias=biases["mlp"] and bool(field.get("mlp_bias", bool)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=rope,
            fused_projections=arch == "Phi3ForCausalLM",
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=window or None,
            sliding_layers=sliding if window else (),
            torch_dtype=checkpoint_dtype(raw),
            quantization_config=raw.get("quantization_config"),
            moe=moe_config(field, num_layers),
        )


# HF's defaults for fields a config.json may leave out, where they differ from Llama's
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096, "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "max_window_layers": 28,
                         "sliding_window": 4096},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32,
                         "max_window_layers": 28, "sliding_window": 4096},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "original_max_position_embeddings": 4096},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                           "rope_theta": 1e6},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "sliding_window": 4096},
}
# which biases each HF architecture has: qkv True always, "flag" as attention_bias says, False never; o_proj with
# the q/k/v bias when "o"; the MLP's as mlp_bias says when "mlp"
BIASES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv": "flag", "o": True, "mlp": True},
    "MistralForCausalLM": {"qkv": False, "o": False, "mlp": False},
    "Qwen2ForCausalLM": {"qkv": True, "o": False, "mlp": False},
    "Qwen3ForCausalLM": {"qkv": "flag", "o": True, "mlp": False},
    "Phi3ForCausalLM": {"qkv": False, "o": False, "mlp": False},
    "MixtralForCausalLM": {"qkv": False, "o": False, "mlp": False},
    "Qwen3MoeForCausalLM": {"qkv": "flag", "o": True, "mlp": False},
    "Qwen2MoeForCausalLM": {"qkv": "qkv_bias", "o": False, "mlp": False},
}


def moe_config(field: _Fields, num_layers: int) -> MoeConfig | None:
    """The experts as HF's class reads them: Mixtral's num_local_experts (8) of intermediate_size in every layer;
    Qwen3-MoE's num_experts (128) of moe_intermediate_size (768) in layer i unless i is in mlp_only_layers or
    (i + 1) is no multiple of decoder_sparse_step."""
    if field.arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return None
    # transformers 5 writes num_local_experts (both classes read num_experts as its alias); older exports the other
    experts = field.get("num_local_experts", int)
    experts = field.get("num_experts", int) if experts is None else experts
    if field.arch == "MixtralForCausalLM":
        experts = 8 if experts is None else experts
        if experts < 1:
            raise CheckpointError(f"config.json of this {field.arch} has num_local_experts = {experts}, which must be "
                                  "a positive integer; fix config.json")
        moe = MoeConfig(experts, field.positive("num_experts_per_tok", 2), field.positive("intermediate_size"), True,
                        True, "block_sparse_moe", ("w1", "w3", "w2"), (True,) * num_layers)
    else:  # Qwen3-MoE, Qwen2-MoE (whose layers add a shared expert, gated by a sigmoid)
        qwen2 = field.arch == "Qwen2MoeForCausalLM"
        experts = (60 if qwen2 else 128) if experts is None else experts
        step = field.positive("decoder_sparse_step", 1)
        dense = field.get("mlp_only_layers", list) or []
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        moe = MoeConfig(experts, field.positive("num_experts_per_tok", 4 if qwen2 else 8),
                        field.positive("moe_intermediate_size", 1408 if qwen2 else 768),
                        bool(field.get("norm_topk_prob", bool)), False, "mlp", ("gate_proj", "up_proj", "down_proj"),
                        sparse, field.positive("shared_expert_intermediate_size", 5632) if qwen2 else 0)
    if any(moe.sparse_layers) and moe.top_k > moe.num_experts:
        raise CheckpointError(f"config.json of this {field.arch} routes each token to {moe.top_k} experts "
                              f"(num_experts_per_tok) of {moe.num_experts}; fix config.json")
    return moe


@dataclass
class _Fields:
    """Typed reads of config.json: a wrong type is an error naming the field (int("64") or bool("false") would
    quietly accept what the checkpoint's author did not mean)."""

    raw: dict[str, Any]
    arch: str

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        value = self.raw.get(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            names = " or ".join(k.__name__ for k in kinds)
            raise CheckpointError(f"config.json of this {self.arch} has {key} = {value!r}, which should be a JSON "
                                  f"{names}; fix config.json")
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        """A positive integer field: required when ``default`` is None, else ``default`` when absent (or null)."""
        value = self.get(key, int)
        if value is None:
            if default is None:
                raise CheckpointError(f"config.json of this {self.arch} lacks the field {key!r}; is it a complete "
                                      "HF config?")
            if default < 1:  # derived, e.g. head_dim = hidden_size // num_attention_heads
                raise CheckpointError(f"config.json of this {self.arch} leaves {key} to its default, {default}, "
                                      "which must be a positive integer; fix config.json")
            return default
        if value < 1:
            raise CheckpointError(f"config.json of this {self.arch} has {key} = {value}, which must be a positive "
                                  "integer; fix config.json")
        return value


def rms_norm_eps(field: _Fields, default: float) -> float:
    """config.json's rms_norm_eps (HF's ``default`` when absent); 0 is taken as written, as HF does."""
    eps = field.get("rms_norm_eps", (int, float))
    if eps is not None and (eps < 0 or not math.isfinite(eps)):
        raise CheckpointError(f"config.json of this {field.arch} has rms_norm_eps = {eps}; it must be a finite "
                              "number >= 0; fix config.json")
    return default if eps is None else float(eps)


ROPE_FIELDS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",),
               "longrope": ("factor", "original_max_position_embeddings")}
OPTIONAL_ROPE_FIELDS = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
                        "longrope": ("attention_factor",)}
ZERO_IS_DEFAULT = frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim"})  # HF reads `value or default`


def rotary_dimensions(partial: object, head_dim: int, arch: str) -> int:
    """How many dimensions of each head turn: all, or (Phi-3's partial_rotary_factor, HF's int(head_dim x it)) the
    first ones; HF's other classes turn whole heads."""
    if partial == 1:
        return head_dim
    if arch != "Phi3ForCausalLM":
        raise CheckpointError(f"config.json of this {arch} has partial_rotary_factor {partial!r}; transformers' "
                              f"{arch} turns whole heads (1.0); only Phi3ForCausalLM turns part of them")
    turned = int(head_dim * partial) if isinstance(partial, (int, float)) and not isinstance(partial, bool) and \
        0 < partial < 1 else 0
    if turned < 2 or turned % 2:
        raise CheckpointError(f"config.json of this {arch} has partial_rotary_factor {partial!r}; it must be in "
                              f"(0, 1] and turn an even number of the head's {head_dim} dimensions (rotary "
                              "embeddings turn pairs); fix config.json")
    return turned


def check_rope(rope: dict[str, Any], arch: str, rotary_dim: int) -> None:
    """The rope fields this rope type reads are present and positive numbers (its optional ones, where set), and
    LongRoPE's short_factor and long_factor lists of rotary_dim / 2 of them."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_FIELDS:
        raise CheckpointError(f"unsupported rope_type {kind!r} in config.json of this {arch}; supported: "
                              f"{', '.join(ROPE_FIELDS)}")
    optional = [key for key in OPTIONAL_ROPE_FIELDS.get(kind, ()) if rope.get(key) is not None]
    for key in ("rope_theta", *ROPE_FIELDS[kind], *optional):
        value, zero = rope.get(key), key in ZERO_IS_DEFAULT
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value < math.inf or zero and value == 0):
            raise CheckpointError(f"rope {kind!r} in config.json of this {arch} needs {key} as "
                                  f"{'a number >= 0' if zero else 'a positive number'}, got {value!r}; fix "
                                  "rope_parameters (or rope_scaling) in config.json")
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        factors = rope.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in factors):
            shown = f"a list of {len(factors)}" if isinstance(factors, list) and len(factors) != rotary_dim // 2 \
                else repr(factors)
            alias = " (Phi-3 reads rope types 'su' and 'yarn' as 'longrope', as HF does)" \
                if arch == "Phi3ForCausalLM" else ""
            raise CheckpointError(f"rope 'longrope' in config.json of this {arch}{alias} needs {key} as a list of "
                                  f"{rotary_dim // 2} positive numbers (one per pair of the {rotary_dim} "
                                  f"dimensions that turn), got {shown}; fix rope_parameters (or rope_scaling) in "
                                  "config.json")
    if kind == "yarn" and not isinstance(rope.get("truncate", True), (bool, type(None))):
        raise CheckpointError(f"rope 'yarn' in config.json of this {arch} needs truncate as true or false, got "
                              f"{rope['truncate']!r}; fix rope_parameters (or rope_scaling) in config.json")


class Attention(nn.Module):
    """``scale``: the softmax scale (default head_dim ** -0.5); ``norm``: the q/k norms' class (with qk_norm);
    ``softcap``: the scores' cap (Gemma 2's attn_logit_softcapping)."""

    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps, window: int | None = None, scale: float | None = None,
                 norm: Callable[..., nn.Module] = RMSNorm, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window  # attend to the last `window` positions only (HF's sliding window), None: all
        self.softcap = softcap
        self.prefix = prefix
        self.scale = cfg.head_dim**-0.5 if scale is None else scale
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.qkv_proj: Linear | None = None  # set by merge_projections, which then drops q/k/v_proj
        if cfg.fused_projections:
            self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias, f"{prefix}.qkv_proj", quant, dtype)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_size, bias, f"{prefix}.q_proj", quant, dtype)
            self.k_proj = Linear(cfg.hidden_size, kv_size, bias, f"{prefix}.k_proj", quant, dtype)
            self.v_proj = Linear(cfg.hidden_size, kv_size, bias, f"{prefix}.v_proj", quant, dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_proj_bias, f"{prefix}.o_proj", quant, dtype)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.sizes = [q_size, kv_size, kv_size]

    def merge_projections(self) -> bool:
        return self.qkv_proj is None and merge_linears(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:  # views into one [t, q + 2 kv] output: kernels take row strides
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = attn.attend(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); ``act_and_mul`` (default the ops' silu_and_mul) computes act(gate) * up."""

    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps, inner: int | None = None,
                 act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.act_and_mul = act_and_mul or ops.silu_and_mul
        inner, bias = inner or cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj: Linear | None = None  # set by merge_projections, which then drops gate/up_proj
        if cfg.fused_projections:  # gate's outputs, then up's
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * inner, bias, f"{prefix}.gate_up_proj", quant, dtype)
        else:
            self.gate_proj = Linear(cfg.hidden_size, inner, bias, f"{prefix}.gate_proj", quant, dtype)
            self.up_proj = Linear(cfg.hidden_size, inner, bias, f"{prefix}.up_proj", quant, dtype)
        self.down_proj = Linear(inner, cfg.hidden_size, bias, f"{prefix}.down_proj", quant, dtype)

    def merge_projections(self) -> bool:
        return self.gate_up_proj is None and merge_linears(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act_and_mul(gate, up))
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, prefix: str, quant: QuantMethod | None, dtype: torch.dtype,
                 ops: PointwiseOps, window: int | None = None, sparse: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", quant, dtype, ops, window)
        self.feed_forward = "mlp"  # the submodule's name, as the checkpoint has it
        if sparse and cfg.moe is not None:
            self.feed_forward = block = cfg.moe.block
            shared = MLP(cfg, f"{prefix}.{block}.shared_expert", quant, dtype, ops, cfg.moe.shared_intermediate_size) \
                if cfg.moe.shared_intermediate_size else None
            experts = f"{prefix}.{block}.experts"
            self.add_module(block, SparseMoe(cfg.moe, cfg.hidden_size, dtype, ops.silu_and_mul,
                                             fused=ops.name == "triton", shared_expert=shared,
                                             fp8=experts_fp8(quant, experts, cfg.moe, cfg.hidden_size),
                                             linear_quant=experts_quant(quant, experts, cfg.moe),
                                             prefix=f"{prefix}.{block}"))
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", quant, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def ffn(self) -> MLP | SparseMoe:
        return getattr(self, self.feed_forward)


class LlamaFamilyModel(Model):
    """Parameter names follow the HF checkpoints exactly, so loading is a name lookup. ``ops`` are the elementwise
    ops (norms, rotary, SiLU-and-mul): the torch reference, or fused Triton kernels on a GPU. ``backbone``: the
    checkpoint names a bare backbone (Qwen3Model, MistralModel), which has an LM head only if it ships
    ``lm_head.*``; any checkpoint without those and with untied embeddings loads without a head too
    (``spec.has_lm_head`` false: an embedding model)."""

    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None, dtype: torch.dtype, max_positions: int,
                 ops: PointwiseOps = TORCH_OPS, merge_projections: bool = False, backbone: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.backbone = backbone
        self.merge_after_loading = merge_projections
        self.cfg = cfg
        self.spec = ModelSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, max_positions,
                              cfg.eos_token_ids, cfg.sliding_window)
        self.model = nn.Module()
        # an empty weight: loading fills it (a random init would draw from torch's global generator for nothing)
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                               _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.model.embed_tokens.weight.requires_grad_(False)
        windows = [cfg.sliding_window if slides else None for slides in cfg.sliding_layers] or [None] * cfg.num_layers
        self.model.layers = nn.ModuleList(self.make_layer(i, quant, dtype, windows[i]) for i in range(cfg.num_layers))
        self.model.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope, ops)
        # a quant method that takes the head gets its own copy of a tied one (quantized from the embedding on load)
        own_head = quant is not None and quant.quantizes_tied_head and quant.applies_to("lm_head")
        self.lm_head = None if cfg.tie_word_embeddings and not own_head else Linear(
            cfg.hidden_size, cfg.vocab_size, False, "lm_head", quant, dtype)
        # a tied head multiplies by the embedding: as an unquantized linear (the skinny kernel when enabled)
        self.tied_head = quant if isinstance(quant, UnquantizedMethod) else UnquantizedMethod()
        self.score: nn.Module | None = None  # a sequence classifier's head (add_score_head)

    def add_score_head(self, num_labels: int) -> None:
        """Make this a sequence classifier (HF's *ForSequenceClassification): ``score.weight`` [num_labels, hidden]
        loads from the checkpoint, kept in float32 (vLLM's choice: HF computes it in the model dtype), and the model
        serves no LM head (one the checkpoint ships is ignored, as transformers ignores it)."""
        self.score = nn.Module()
        self.score.weight = nn.Parameter(torch.empty(num_labels, self.cfg.hidden_size, dtype=torch.float32),
                                         requires_grad=False)
        self.lm_head = None
        self.spec = replace(self.spec, has_lm_head=False, num_labels=num_labels)

    def label_logits(self, pooled: torch.Tensor) -> torch.Tensor | None:
        if self.score is None:
            return None
        return pooled.float() @ self.score.weight.t()

    norm_class: Callable[..., nn.Module] = RMSNorm  # the final norm's (a subclass's layers choose their own)

    def make_layer(self, index: int, quant: QuantMethod | None, dtype: torch.dtype, window: int | None
                   ) -> nn.Module:
        """Decoder layer ``index`` (attending within ``window`` positions, None: all)."""
        sparse = self.cfg.moe is not None and self.cfg.moe.sparse_layers[index]
        return DecoderLayer(self.cfg, f"model.layers.{index}", quant, dtype, self.ops, window, sparse)

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
            hidden = layer.ffn()(hidden)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.spec.has_lm_head:
            raise InvalidRequestError(no_lm_head(self.spec))
        if self.lm_head is None:
            return self.tied_head.matmul(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.score is not None:  # a classifier: no LM head to load
            weights = ((name, tensor) for name, tensor in weights if not name.startswith("lm_head."))
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        expected = set(self.state_dict())  # every tensor the checkpoint must provide (quant layouts included)
        experts = {name: module for name, module in modules.items() if isinstance(module, SparseMoe)}
        # the experts report their own missing tensors (a stacked checkpoint tensor fills many per-expert Linears)
        expected = {key for key in expected if not any(key.startswith(f"{block}.experts.") for block in experts)}
        # Mixtral's experts sit under block_sparse_moe, where transformers 5's own layout puts them under mlp
        renamed = self.cfg.moe.block if self.cfg.moe is not None and self.cfg.moe.block != "mlp" else None
        tied = self.cfg.tie_word_embeddings
        if tied:
            expected -= {"lm_head.weight"}  # a quantized copy of a tied head is loaded from the embedding below
        seen: set[str] = set()
        tied_head: torch.Tensor | None = None
        ships_head = False  # any lm_head.* tensor (a quantized head has several)
        qc = self.cfg.quantization_config
        kv_scales = KV_SCALE_NAMES if isinstance(qc, dict) and qc.get("kv_cache_scheme") else ()
        for name, tensor in weights:
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears twice among the checkpoint's safetensors files; "
                                      "remove the stray copy (or list the right files in model.safetensors.index.json)")
            if renamed is not None and ".mlp." in name:
                name = name.replace(".mlp.", f".{renamed}.", 1)
            if name.endswith("rotary_emb.inv_freq") or name.endswith(kv_scales):
                continue  # a derived buffer; the KV scales of a kv_cache_scheme, which --kv-cache-dtype replaces
            ships_head = ships_head or name.startswith("lm_head.")
            if name == "lm_head.weight" and tied:
                tied_head = tensor  # must be the embedding: checked below
                continue
            owner, _, attr = name.rpartition(".")
            module = modules.get(owner)
            block, is_expert, expert_name = name.partition(".experts.")
            if is_expert and block in experts:
                experts[block].load_expert(block, expert_name, tensor)
            elif isinstance(module, Router) and (attr != "weight" or not tensor.is_floating_point()
                                                 or tensor.element_size() == 1):
                raise CheckpointError(f"{name} ({str(tensor.dtype).removeprefix('torch.')}): this checkpoint "
                                      f"quantized the router {owner}, which infer loads in float only, as "
                                      "transformers does; quantize it again with the routers (mlp.gate, "
                                      "shared_expert_gate) left out (llm-compressor's ignore list, "
                                      "modules_to_not_convert)")
            elif isinstance(module, Linear):
                module.load(attr, tensor)
            elif name in params:
                load_parameter(name, params[name], tensor)
            else:
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer is not None and int(layer[1]) >= self.cfg.num_layers:
                    raise CheckpointError(f"config.json has num_hidden_layers {self.cfg.num_layers}, but the weights "
                                          f"hold decoder layer {layer[1]} too ({name}); correct num_hidden_layers")
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint for {self.cfg.architecture}")
            seen.add(name)
        if tied_head is not None and EMBEDDING not in seen and EMBEDDING in params:
            # the tied tensor saved under the head's name alone (safetensors' save_model keeps the first name)
            load_parameter(EMBEDDING, params[EMBEDDING], tied_head)
            seen.add(EMBEDDING)
            tied_head = None
        if not ships_head and (self.backbone or not tied):  # an embedding model: no head to load or compute
            self.lm_head = None
            self.spec = replace(self.spec, has_lm_head=False)
            expected = {key for key in expected if not key.startswith("lm_head.")}
        missing = sorted(expected - seen) + [name for prefix, module in experts.items()
                                             for name in module.missing(prefix)]
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        embedding = self.model.embed_tokens.weight
        if tied_head is not None and not torch.equal(tied_head.to(embedding.device, embedding.dtype), embedding):
            raise CheckpointError("config.json says tie_word_embeddings true, but the checkpoint's lm_head.weight "
                                  "differs from model.embed_tokens.weight; set tie_word_embeddings false in "
                                  "config.json to use the separate head")
        if tied and self.lm_head is not None:
            self.lm_head.load("weight", embedding)
        linears = [module for module in self.modules() if isinstance(module, Linear)]  # a dropped head's gone
        del modules, params, tied_head, embedding  # no reference may outlive what the loops below replace
        for module in linears:  # on-load quantization frees each float weight as it goes
            module.method.process_after_loading(module)
        module = linears = None  # no reference may keep Linears that stacking AWQ experts frees as it goes
        for moe in experts.values():
            moe.process_after_loading()
        del experts
        if self.merge_after_loading:  # each layer's parts are freed as it merges: peak memory is one layer's more
            self.merge_projections()

    def merge_projections(self) -> int:
        """Merge each layer's q/k/v and gate/up linears into one each, where their quant method can (after loading:
        the checkpoint's names are the unmerged ones; Phi-3's come merged). Returns how many merges were made."""
        return sum(part.merge_projections() for layer in self.model.layers for part in (layer.self_attn, layer.ffn())
                   if not isinstance(part, SparseMoe))
