"""Tiny checkpoints with a locally trained byte-level BPE tokenizer (test fixtures, make-tiny-model), and the
embedded default model."""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": None},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "use_sliding_window": False,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
    # every second layer slides, within 8 positions; the softmax scale is not head_dim's
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "query_pre_attn_scalar": 24,
               "sliding_window": 8, "sliding_window_pattern": 2},
    # Gemma 2: every second layer slides, within 8 positions; caps far below the releases' (50, 30), so that the
    # tiny model's scores and logits reach them
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "query_pre_attn_scalar": 24,
               "sliding_window": 8, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
    "qwen2moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "use_sliding_window": False,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                 "shared_expert_intermediate_size": 80},
}
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"  # the shipped pair: target/ and draft/


def stdlib_corpus(max_files: int = 400) -> list[Path]:
    """A local corpus every machine has: the Python standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py"))[:max_files]


def train_tokenizer(out_dir: Path, vocab_size: int = 1024, files: list[Path] | None = None,
                    extra_special_tokens: tuple[str, ...] = ()) -> Any:
    """Train a byte-level BPE on local text and save it as an HF fast tokenizer in ``out_dir``; its vocabulary,
    special tokens included, has ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in (files or stdlib_corpus()))
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_model(out_dir: str | Path, arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 1024, tie_word_embeddings: bool = False, seed: int = 0,
                    init_std: float = 0.1, vocab_size: int = 1024, tokenizer_files: list[Path] | None = None,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random-weight model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..core.errors import ConfigError

    if arch not in ARCH_CONFIGS:
        raise ConfigError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCH_CONFIGS)}")
    sizes = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 intermediate_size=intermediate_size)
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {value}")
    if hidden_size % (2 * num_heads) or num_heads % num_kv_heads:
        raise ConfigError(f"hidden-size {hidden_size} must split into {num_heads} heads of an even size (rotary "
                          f"embeddings rotate pairs), and the {num_heads} heads into {num_kv_heads} KV heads: use a "
                          f"multiple of {2 * num_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # transformers loads a qwen checkpoint's tokenizer as Qwen2Tokenizer, which adds <|endoftext|> (its unk token)
    # when the vocabulary lacks it: one token past the model's vocabulary
    extra_special = ("<|endoftext|>",) if arch.startswith("qwen") else ()
    tokenizer = train_tokenizer(out, vocab_size, tokenizer_files, extra_special)
    raw = dict(ARCH_CONFIGS[arch])
    raw.update(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
        head_dim=hidden_size // num_heads,
    )
    raw.update(extra or {})  # may replace any of the above (head_dim included)
    model_type = raw.pop("model_type")
    raw.pop("architectures")
    config = AutoConfig.for_model(model_type, **raw)
    with torch.random.fork_rng(devices=[]):  # seeded weights, and the caller's generator left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF initialises norms to 1; random norms exercise the weight loading better
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(str(out))
    return out


def parameter_count(hidden_size: int, num_layers: int, intermediate_size: int, tie_word_embeddings: bool = False,
                    num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 1024, experts: int = 0) -> int:
    """The parameters of make_tiny_model's llama of this shape (its defaults alike), counted before it is built:
    q/o and k/v projections, the gated MLP (or ``experts`` of them and their router: Mixtral's), two norms a layer,
    the final norm, the embedding and the head."""
    kv_width = hidden_size // num_heads * num_kv_heads
    mlp = 3 * hidden_size * intermediate_size * max(experts, 1) + experts * hidden_size
    per_layer = 2 * hidden_size**2 + 2 * hidden_size * kv_width + mlp + 2 * hidden_size
    return num_layers * per_layer + hidden_size + (1 if tie_word_embeddings else 2) * vocab_size * hidden_size


def ensure_default_model() -> Path:
    """The embedded default: the shipped target trained on the standard library (spec_decode/train_pair.py)."""
    import logging

    from ..core.errors import CheckpointError

    shipped = PRETRAINED_DIR / "target"
    if not (shipped / "config.json").exists():
        raise CheckpointError(f"the embedded default model is missing from this installation ({shipped}); "
                              "reinstall infer-engine, or pass --model DIR")
    logging.getLogger("infer").warning("using the embedded demo model, a tiny Llama trained on the Python standard "
                                       "library (%s); pass --model DIR for a real model", shipped)
    return shipped
