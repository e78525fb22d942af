"""Gemma 3 and Gemma 2 beyond the shared checkpoint tests (tests/test_models.py runs the tiny ones against
transformers): the configs real checkpoints carry, refusals, softcapping on each backend, and the fused ops."""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import recomputed_greedy  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import CheckpointError, ConfigError  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ([5, 9, 100, 7, 300, 41, 8, 2, 11, 12, 13], [700, 3, 3, 90])


def edited(src: Path, dst: Path, edit: Callable[[dict[str, Any]], object]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def as_released(config: dict[str, Any]) -> None:
    """The config.json google's releases carry (gemma-3-4b's text part): rope_theta, rope_local_base_freq and a
    linear rope_scaling for the global layers, sliding_window_pattern instead of layer_types."""
    config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=500000.0, rope_local_base_freq=5000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                  sliding_window_pattern=3)


def test_a_config_as_the_releases_write_it_generates_what_transformers_does(
        tmp_path: Path, checkpoint: Callable[[str], Path],
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = edited(checkpoint("gemma3"), tmp_path / "m", as_released)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32))
    for prompt, result in zip(PROMPTS, engine.generate(list(PROMPTS), GREEDY)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize(("change", "message"), [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping = -1.0; it must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"layer_types": ["sliding_attention"]}, "it should list 'sliding_attention' or 'full_attention' for each"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar = 0.0; it must be a positive number"),
    ({"sliding_window": None}, "sliding_window = None; Gemma's sliding layers need a positive window"),
    ({"hidden_activation": "gelu_new"}, "hidden_activation 'gelu_new'"),
])
def test_what_it_cannot_serve_is_refused_by_name(change: dict[str, Any], message: str, tmp_path: Path,
                                                  checkpoint: Callable[[str], Path]) -> None:
    path = edited(checkpoint("gemma3"), tmp_path / "m", lambda c: c.update(change))
    with pytest.raises(CheckpointError, match=message):
        Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8))


def test_the_context_is_max_position_embeddings_even_with_linear_scaling(tmp_path: Path,
                                                                       checkpoint: Callable[[str], Path]) -> None:
    """Gemma 3's 131072 positions already count its factor-8 scaling (trained at 32k): not 8 x 131072."""
    path = edited(checkpoint("gemma3"), tmp_path / "m", as_released)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8))
    assert engine.max_model_len == json.loads((path / "config.json").read_text())["max_position_embeddings"]


@pytest.mark.parametrize("name", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])  # the same kernels
def test_fused_ops_generate_what_the_torch_ops_do(name: str, checkpoint: Callable[[str], Path],
                                                  hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """The Triton rotary, (1 + w) norms (q/k norms included) and GELU-and-mul, interpreted."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton ops run on the CPU under TRITON_INTERPRET=1 only")
    path = checkpoint(name)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, fused_ops=True))
    short = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)  # interpreted kernels are slow
    for prompt, result in zip(PROMPTS, engine.generate(list(PROMPTS), short)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, short.max_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_on_cuda_with_graphs_it_generates_what_transformers_does(
        name: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = checkpoint(name)
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=32))
    for prompt, result in zip(PROMPTS, engine.generate(list(PROMPTS), GREEDY)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory, checkpoint: Callable[[str], Path]) -> Path:
    """A tiny Gemma3ForConditionalGeneration checkpoint (gemma-3-4b's shape of config and tensors)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=1024, query_pre_attn_scalar=24,
                            sliding_window=8, sliding_window_pattern=2, max_position_embeddings=1024)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                         mm_tokens_per_image=4)).eval()
    path = tmp_path_factory.mktemp("gemma3") / "multimodal"
    hf.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint("gemma3") / name, path / name)
    return path


def test_a_multimodal_checkpoint_serves_its_text_model(multimodal: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Gemma3ForConditionalGeneration (gemma-3-4b and larger): text_config's model, the vision tower left out;
    its tokens equal transformers' on the whole multimodal model given text."""
    import logging

    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(str(multimodal)).eval()
    with caplog.at_level(logging.INFO, logger="infer"):
        engine = Engine(EngineConfig(model=str(multimodal), device="cpu", num_kv_blocks=32))
    assert "serving its text model" in caplog.text
    for prompt, result in zip(PROMPTS, engine.generate(list(PROMPTS), GREEDY)):
        assert result.outputs[0].token_ids == recomputed_greedy(hf, prompt, GREEDY.max_tokens)


def test_a_multimodal_checkpoint_in_the_releases_names_serves_its_text_model(multimodal: Path, tmp_path: Path) -> None:
    """The names transformers 4.5x wrote (and gemma-3's releases carry): language_model.model.*, vision_tower.*,
    multi_modal_projector.*, with the tied head saved as language_model.lm_head.weight: transformers' tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForConditionalGeneration

    released = tmp_path / "released"
    shutil.copytree(multimodal, released)
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."))
    tensors = {next((new + name[len(old):] for old, new in renames if name.startswith(old)), name): tensor
               for name, tensor in load_file(str(multimodal / "model.safetensors")).items()}
    assert not any(name.startswith("model.") for name in tensors)
    tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
    save_file(tensors, str(released / "model.safetensors"), metadata={"format": "pt"})
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(multimodal)).eval()
    engine = Engine(EngineConfig(model=str(released), device="cpu", num_kv_blocks=32))
    for prompt, result in zip(PROMPTS[:2], engine.generate(list(PROMPTS[:2]), GREEDY)):
        assert result.outputs[0].token_ids == recomputed_greedy(hf, prompt, GREEDY.max_tokens)


def test_a_layer_count_is_not_checked_against_weights_named_otherwise(multimodal: Path, tmp_path: Path) -> None:
    """The loader checks num_hidden_layers against model.layers.N tensors only: a multimodal checkpoint (its layers
    under model.language_model.layers.N) whose config also states the text model's count at the top level loads,
    and generates what the one without it does."""
    stated = tmp_path / "stated"
    shutil.copytree(multimodal, stated)
    raw = json.loads((stated / "config.json").read_text())
    assert "num_hidden_layers" not in raw
    layers = raw["text_config"]["num_hidden_layers"]
    (stated / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": layers}))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ours, reference = (Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16)).generate(
        [PROMPTS[1]], params)[0].outputs[0].token_ids for path in (stated, multimodal))
    assert ours == reference


def test_a_lora_adapter_on_a_multimodal_checkpoint_equals_peft(multimodal: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """PEFT names a multimodal checkpoint's modules model.language_model.layers...: they adapt the text model; the
    vision tower's ("all-linear" reaches it) are left out, which changes nothing for text."""
    import logging

    import peft
    from transformers import Gemma3ForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        hf = Gemma3ForConditionalGeneration.from_pretrained(str(multimodal), dtype=torch.float32)
        model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                                        init_lora_weights=False)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "adapter"))
    with caplog.at_level(logging.INFO, logger="infer"):
        engine = Engine(EngineConfig(model=str(multimodal), device="cpu", dtype="float32", num_kv_blocks=32,
                                     lora_adapters={"a": str(tmp_path / "adapter")}))
    assert "outside the served text model" in caplog.text
    adapted = engine.generate(list(PROMPTS), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                            lora_adapter="a"))
    base = engine.generate(list(PROMPTS), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, result, plain in zip(PROMPTS, adapted, base):
        assert result.outputs[0].token_ids == recomputed_greedy(model, prompt, 8)
        assert result.outputs[0].token_ids != plain.outputs[0].token_ids  # the adapter changes the tokens


def test_fields_a_real_config_leaves_out_or_doubles_read_as_transformers_reads_them() -> None:
    """A multimodal config keeps eos [1, 106] (<end_of_turn>) at its top level; a rope_scaling beside transformers
    5's per-layer-type rope_parameters scales the global layers; a config whose layers all attend fully has no
    window."""
    from transformers import Gemma3Config as HfGemma3Config
    from transformers import Gemma3TextConfig

    from infer.models.gemma import GemmaConfig, text_config

    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                  "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2}}
    hf = HfGemma3Config(**{k: v for k, v in multimodal.items() if k != "architectures"})
    assert GemmaConfig.from_hf(text_config(multimodal)).eos_token_ids == tuple(hf.eos_token_id)
    doubled = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "num_hidden_layers": 2}
    ours = GemmaConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], **doubled})
    reference = Gemma3TextConfig(**doubled).rope_parameters["full_attention"]
    assert (ours.rope["rope_type"], ours.rope["factor"]) == (reference["rope_type"], reference["factor"])
    full = GemmaConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
                                 "layer_types": ["full_attention"] * 2})
    assert full.sliding_window is None


def test_norm_weights_round_to_the_model_dtype_before_the_one_is_added(checkpoint: Callable[[str], Path]) -> None:
    """transformers holds a float32 checkpoint's norm weight w in the model dtype and adds 1 in float32."""
    from safetensors.torch import load_file

    path = checkpoint("gemma3")
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", num_kv_blocks=8))
    stored = load_file(str(path / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    loaded = engine.loaded.model.model.layers[0].input_layernorm.weight
    assert torch.equal(loaded, stored.to(torch.bfloat16).float() + 1.0)
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM overflows float16"):
        Engine(EngineConfig(model=str(path), device="cpu", dtype="float16", num_kv_blocks=8))


def test_the_final_cap_is_computed_in_the_model_dtype_as_transformers_does(checkpoint: Callable[[str], Path]) -> None:
    """Gemma 2's final_logit_softcapping: transformers divides, takes tanh and multiplies the bfloat16 head output in
    bfloat16; capping the float32 copy instead differs in most logits."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("gemma2")
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", num_kv_blocks=8))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    cap = hf.config.final_logit_softcapping
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(8, hf.config.hidden_size, generator=generator) * 4).to(torch.bfloat16)
    with torch.no_grad():
        reference = torch.tanh(hf.lm_head(hidden) / cap) * cap  # Gemma2ForCausalLM.forward's cap
        ours = engine.loaded.model.compute_logits(hidden)
    assert ours.dtype == torch.float32 and torch.equal(ours, reference.float())

def test_the_norms_round_once_in_bfloat16_as_transformers_does() -> None:
    """Gemma's (1 + w) norm multiplies in float32 and rounds to the model dtype once (transformers' Gemma3RMSNorm);
    rounding the normed value before the multiplication differs in about a third of bfloat16 outputs. With a
    residual, the sum is taken in the model dtype first. Bit for bit, the torch ops and the module alike."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from infer.models.gemma import GemmaRMSNorm
    from infer.models.layers import gemma_rms_norm

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=generator) * 3).to(torch.bfloat16)
    residual = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
    reference = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(64, generator=generator) - 0.5)
    reference = reference.to(torch.bfloat16)
    ours = GemmaRMSNorm(64, 1e-6, torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(reference.weight.float() + 1.0)  # what load_weights stores
    assert torch.equal(ours(x), reference(x))
    normed, summed = gemma_rms_norm(x, ours.weight, 1e-6, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, reference(x + residual))


def test_fields_a_config_leaves_out_take_the_transformers_class_defaults() -> None:
    """A minimal config.json of each Gemma class: every default infer fills in is the one transformers' config
    class has (the tiny checkpoints spell each of these fields out, so only this test reads the defaults)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from infer.models.gemma import GEMMA2, GEMMA3, GemmaConfig

    for arch, hf_class in ((GEMMA2, Gemma2Config), (GEMMA3, Gemma3TextConfig)):
        hf = hf_class(num_hidden_layers=2)
        ours = GemmaConfig.from_hf({"architectures": [arch], "num_hidden_layers": 2})
        assert (ours.hidden_size, ours.intermediate_size, ours.vocab_size) == \
            (hf.hidden_size, hf.intermediate_size, hf.vocab_size)
        assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == \
            (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
        assert (ours.query_pre_attn_scalar, ours.rms_norm_eps, ours.max_position_embeddings) == \
            (hf.query_pre_attn_scalar, hf.rms_norm_eps, hf.max_position_embeddings)
        assert ours.tie_word_embeddings == hf.tie_word_embeddings
        assert ours.eos_token_ids == (hf.eos_token_id,)
        assert (ours.attn_softcap, ours.final_softcap) == \
            (getattr(hf, "attn_logit_softcapping", None), hf.final_logit_softcapping)
        assert ours.sliding_window == hf.sliding_window
        assert list(ours.sliding_layers) == [kind == "sliding_attention" for kind in hf.layer_types]
        ropes = hf.rope_parameters
        full, local = (ropes["full_attention"], ropes["sliding_attention"]) if "full_attention" in ropes else \
            (ropes, ropes)
        assert ours.rope["rope_theta"] == full["rope_theta"] and ours.local_rope["rope_theta"] == local["rope_theta"]


@pytest.mark.parametrize(("arch", "fields"), [
    ("Gemma3ForCausalLM",
     {"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}}),
    ("Gemma3ForCausalLM", {"rope_theta": 500_000.0, "rope_local_base_freq": 20_000.0}),
    ("Gemma2ForCausalLM", {"rope_theta": 50_000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
def test_the_ropes_a_config_spells_or_leaves_out_are_transformers(arch: str, fields: dict[str, Any]) -> None:
    """Gemma 3's per-layer-type rope_parameters without their rope_theta (transformers fills 1e6 and 1e4), an older
    config's rope_theta beside rope_local_base_freq, Gemma 2's rope_scaling: each layer type's rope is the config
    class's."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from infer.models.gemma import GemmaConfig

    ours = GemmaConfig.from_hf({"architectures": [arch], "num_hidden_layers": 2, **copy.deepcopy(fields)})
    hf_class = Gemma2Config if arch == "Gemma2ForCausalLM" else Gemma3TextConfig
    ropes = hf_class.from_dict({"num_hidden_layers": 2, **copy.deepcopy(fields)}).rope_parameters  # it fills in
    full, local = (ropes["full_attention"], ropes["sliding_attention"]) if "full_attention" in ropes else (ropes, ropes)
    for mine, theirs in ((ours.rope, full), (ours.local_rope, local)):
        keys = ("rope_type", "rope_theta", "factor")
        assert {k: mine.get(k, "default" if k == "rope_type" else None) for k in keys} == \
            {k: theirs.get(k) for k in keys}


# ---------------------------------------------------------------- Gemma 2
def as_released_gemma2(config: dict[str, Any]) -> None:
    """The config.json of google's Gemma 2 releases: rope_theta, no layer_types (every second layer slides), the
    older sliding_window_size beside sliding_window, a hybrid cache_implementation."""
    config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=10000.0, sliding_window_size=config["sliding_window"], cache_implementation="hybrid")


def test_gemma3_with_caps_set_caps_as_transformers_does(tmp_path: Path, checkpoint: Callable[[str], Path],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Gemma 3's releases set no caps; transformers applies a final_logit_softcapping a config sets, and ignores an
    attn_logit_softcapping (its Gemma 3 attention never passes one on): infer computes the same model, and says so."""
    import logging

    from transformers import AutoModelForCausalLM

    caps = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}
    path = edited(checkpoint("gemma3"), tmp_path / "m", lambda c: c.update(caps))
    with caplog.at_level(logging.WARNING, logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32))
    assert "transformers' Gemma 3 does not apply" in caplog.text
    prompt = list(PROMPTS[0])
    result = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    for token, logprob in result.outputs[0].logprobs[0].items():
        assert logprob == pytest.approx(float(expected[token]), abs=1e-4)


# the interpreted Triton model is slow: the kernels' softcap tests run by default, and -m gpu runs Gemma 2 on the
# Triton backend natively (test_on_cuda_with_graphs_it_generates_what_transformers_does)
@pytest.mark.parametrize("attention", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_gemma2_as_released_generates_what_transformers_does(
        attention: str, tmp_path: Path, checkpoint: Callable[[str], Path],
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Both caps (the tiny model's scores and logits reach them) on the torch backend (the cpu one's C kernel runs in
    tests/test_models.py) and on the Triton kernels, interpreted; contexts pass the 8-position window."""
    if attention == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton backend runs on the CPU under TRITON_INTERPRET=1 only")
    path = edited(checkpoint("gemma2"), tmp_path / "m", as_released_gemma2)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, attention=attention))
    for prompt, result in zip(PROMPTS, engine.generate(list(PROMPTS), GREEDY)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("case", ["causal", "extend", "decodes"])
def test_the_torch_backends_softcapped_attention_is_transformers_eager_attention(case: str) -> None:
    """plugins/torch_attention.attention with a cap against transformers' Gemma 2 eager_attention_forward, with the
    query rows in slices of 3 (a budget of 3 rows' scores): a prompt, an extend over a cached prefix, and padded
    decodes (the shapes the backend passes)."""
    import types

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from infer.plugins.torch_attention import attention

    torch.manual_seed(3)
    batch, heads, kv_heads, n, length = {"causal": (1, 4, 2, 10, 10), "extend": (1, 4, 2, 7, 12),
                                         "decodes": (3, 4, 2, 1, 9)}[case]
    q, k, v = (torch.randn(batch, h, rows, 16) for h, rows in ((heads, n), (kv_heads, length), (kv_heads, length)))
    if case == "causal":
        mask = None
        visible = torch.ones(n, length, dtype=torch.bool).tril()
    elif case == "extend":
        mask = visible = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    else:  # per decode, its context's length: keys past it are padding
        mask = visible = (torch.arange(length)[None, :] < torch.tensor([9, 4, 1])[:, None])[:, None, None, :]
    ours = attention(q, k, v, mask, 0.4, 2.0, max_score_bytes=3 * 4 * batch * heads * length)
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).expand(batch, 1, n, length)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.4, softcap=2.0)
    torch.testing.assert_close(ours, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("caps", ["set", "absent", "null"])  # absent: transformers' defaults (50, 30); null: none
def test_gemma2s_config_reads_as_transformers_reads_it(caps: str, tmp_path: Path,
                                                       checkpoint: Callable[[str], Path]) -> None:
    from transformers import AutoConfig

    from infer.core.loader import read_config
    from infer.models.gemma import GemmaConfig

    def edit(config: dict[str, Any]) -> None:
        as_released_gemma2(config)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if caps == "absent":
                config.pop(key)
            elif caps == "null":
                config[key] = None

    path = edited(checkpoint("gemma2"), tmp_path / "m", edit)
    hf, ours = AutoConfig.from_pretrained(str(path)), GemmaConfig.from_hf(read_config(path))
    assert ours.sliding_layers == tuple(kind == "sliding_attention" for kind in hf.layer_types)
    assert (ours.sliding_window, ours.rope["rope_theta"]) == (hf.sliding_window, hf.rope_parameters["rope_theta"])
    assert (ours.attn_softcap, ours.final_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping)
    assert not ours.qk_norm and ours.query_pre_attn_scalar == hf.query_pre_attn_scalar


@pytest.mark.parametrize(("change", "message"), [
    ({"attn_logit_softcapping": 0}, "attn_logit_softcapping = 0; it must be a positive number"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
])
def test_what_gemma2_cannot_serve_is_refused_by_name(change: dict[str, Any], message: str, tmp_path: Path,
                                                      checkpoint: Callable[[str], Path]) -> None:
    path = edited(checkpoint("gemma2"), tmp_path / "m", lambda c: c.update(change))
    with pytest.raises(CheckpointError, match=message):
        Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8))
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM overflows float16"):
        Engine(EngineConfig(model=str(checkpoint("gemma2")), device="cpu", num_kv_blocks=8, dtype="float16"))


def test_a_backend_that_cannot_softcap_is_refused(checkpoint: Callable[[str], Path], infer_plugins: Any) -> None:
    """A plugin backend without softcapping, or one whose forward predates the softcap parameter, would compute
    another model: refused by name at start (and by attend, were it reached)."""
    import types

    from infer.core.errors import PluginError
    from infer.core.hookspecs import hookimpl
    from infer.plugins.torch_attention import TorchAttention

    class Uncapped(TorchAttention):
        supports_softcap = False

    class OldForward(TorchAttention):
        def forward(self, q, k, v, kv_cache, meta, scale, window=None):  # type: ignore[no-untyped-def, override]
            return super().forward(q, k, v, kv_cache, meta, scale, window)

    for backend in (Uncapped, OldForward):
        name = backend.__name__.lower()
        module = types.ModuleType(name)
        module.register_attention_backends = hookimpl(  # type: ignore[attr-defined]
            lambda register, name=name, backend=backend: register(name, lambda config: backend()))
        infer_plugins.register(module, name=name, source="tests")
    for backend in (Uncapped, OldForward):
        name = backend.__name__.lower()
        with pytest.raises(ConfigError, match=f"the model caps its attention scores .attn_logit_softcapping 1.,"
                                              f" which attention backend {backend.__name__} cannot do"):
            Engine(EngineConfig(model=str(checkpoint("gemma2")), device="cpu", attention=name, num_kv_blocks=8),
                   infer_plugins)
    meta = types.SimpleNamespace(max_context_len=4)
    with pytest.raises(PluginError, match="attention backend Uncapped cannot softcap attention scores"):
        Uncapped().attend(torch.zeros(1, 4, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), None, meta, 1.0,
                          softcap=50.0)
