"""Quantization at model level on the tiny checkpoints: logits error bounds of `--quant awq` (RTN and calibrated) and
`--quant fp8`, `infer quantize`, real AutoAWQ and compressed-tensors checkpoints through the Engine, and
`--kv-cache-dtype fp8` (logits bound, greedy output, block count, concurrency).

Error bounds. ``rel`` is the relative Frobenius error of the logits of 4 seeded prompts (all positions) against the
unquantized model. A quantizer's rounding adds to every linear's weights noise of relative RMS ``eps``, uncorrelated
with the signal (weights and activations alike: a linear's output error is relative ``eps`` either way). The
reference is that noise model propagated by the model itself: the unquantized model with independent Gaussian noise
of relative RMS ``eps`` on every quantized weight (:func:`noisy_logits`), which the quantizer's ``rel`` should
match; each bound is 1.2x it, and 0.8x is the floor (measured on three model seeds: RTN 1.00-1.01x, FP8 0.93-0.98x).

- int4 RTN, group 64, Gaussian weights: the step is E[range of 64 normals] / 15 = 4.69 sigma / 15, the rounding
  noise is step / sqrt(12), so eps = 0.090.
- FP8 W8A8 (e4m3, 3 mantissa bits): each operand rounds with relative RMS 2^-3 / sqrt(12) * E[1 / mantissa]
  = 0.026; weight and activation together eps = 0.037.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import random
import re
import shutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from infer.cli.main import main  # noqa: E402
from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import CheckpointError, ConfigError  # noqa: E402
from infer.core.hookspecs import hookimpl  # noqa: E402
from infer.core.interfaces import AttentionMetadata, LayerKVCache  # noqa: E402
from infer.core.loader import load_model  # noqa: E402
from infer.core.plugins import PluginManager  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from infer.models.layers import Linear  # noqa: E402
from infer.plugins.torch_attention import TorchAttention  # noqa: E402
from infer.quant.calib_data import default_texts  # noqa: E402
from infer.quant.calib_job import groups_of  # noqa: E402
from infer.quant.calibrate import AwqCalibrationConfig, _fold, calibrate_awq  # noqa: E402
from infer.quant.forward import dense_forward  # noqa: E402
from infer.quant.kv_cache import FP8_KV_DTYPE, calibrate_kv_scales, calibration_ids  # noqa: E402

INT4_G64_EPS = 4.69 / 15 / math.sqrt(12)  # 0.090
FP8_EPS = math.sqrt(2) * 2.0**-3 / math.sqrt(12) * 0.72  # 0.037
CALIB = AwqCalibrationConfig(group_size=64, num_samples=8, seq_len=64, grid=10)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def seeded_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


PROMPTS = seeded_prompts(4, 32)


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager.from_entry_points().collect()


@pytest.fixture(scope="module")
def model128(tiny_model_factory: Callable[..., Path]) -> Path:
    # AutoAWQ needs every out_features to be a multiple of 64: k/v are 2 heads x 32 at hidden size 128
    return tiny_model_factory("llama", hidden_size=128, intermediate_size=256)


def prompt_logits(path: Path, plugins: PluginManager, prompts: list[list[int]] = PROMPTS, **options: Any
                  ) -> torch.Tensor:
    """Logits [all prompt tokens, vocab] of the model at ``path`` loaded with ``options`` (fp32 on CPU)."""
    loaded = load_model(EngineConfig(model=str(path), device="cpu", **options).validate(), plugins, path)
    with torch.no_grad():
        return loaded.model.compute_logits(dense_forward(loaded.model, prompts, loaded.device))


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def noisy_logits(path: Path, plugins: PluginManager, eps: float, head: bool = False) -> torch.Tensor:
    """:func:`prompt_logits` of the unquantized model with seeded Gaussian noise of relative RMS ``eps`` added to the
    weight of every linear a quant method converts (all but lm_head, unless ``head``)."""
    loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)
    g = torch.Generator().manual_seed(0)
    for module in loaded.model.modules():
        if isinstance(module, Linear) and (head or "lm_head" not in module.prefix):
            w = module.weight
            w += eps * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g)
    with torch.no_grad():
        return loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS, loaded.device))


def with_outlier_channels(src: Path, dst: Path, channels: list[int], factor: float) -> Path:
    """A copy of ``src`` whose norm weights are ``factor`` times larger on ``channels``: every linear that reads a
    norm's output sees activation outliers there, the case AWQ's scales are for."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for name, tensor in state.items():
        if name.endswith("layernorm.weight"):
            tensor[channels] *= factor
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- logits bounds of the quant methods
@pytest.fixture(scope="module")
def calibrated128(model128: Path, plugins: PluginManager, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("awq") / "calibrated"
    calibrate_awq(model128, out, CALIB, plugins=plugins)
    return out


def test_awq_rtn_and_calibrated_logits_within_bound(model128: Path, calibrated128: Path,
                                                    plugins: PluginManager) -> None:
    ref = prompt_logits(model128, plugins)
    predicted = rel(noisy_logits(model128, plugins, INT4_G64_EPS), ref)
    rtn = prompt_logits(model128, plugins, quant="awq", plugin_options={"awq": {"group_size": 64}})
    calibrated = prompt_logits(calibrated128, plugins)
    assert 0.8 * predicted < rel(rtn, ref) < 1.2 * predicted, (rel(rtn, ref), predicted)
    assert 0 < rel(calibrated, ref) < 1.2 * predicted, (rel(calibrated, ref), predicted)


@pytest.mark.parametrize("method,options,eps", [("awq", {"group_size": 64}, INT4_G64_EPS), ("fp8", {}, FP8_EPS)])
def test_on_load_quantization_of_fused_projections_is_within_the_bound(
        method: str, options: dict[str, Any], eps: float, tiny_model_factory: Callable[..., Path],
        plugins: PluginManager) -> None:
    """Phi-3's qkv_proj and gate_up_proj are quantized whole (one linear each), within the noise model's bound."""
    phi3 = tiny_model_factory("phi3", hidden_size=128, intermediate_size=256)
    ref = prompt_logits(phi3, plugins)
    predicted = rel(noisy_logits(phi3, plugins, eps), ref)
    error = rel(prompt_logits(phi3, plugins, quant=method, plugin_options={method: options}), ref)
    assert 0.8 * predicted < error < 1.2 * predicted, (error, predicted)


@pytest.mark.parametrize("method,options,eps", [("awq", {"group_size": 64}, INT4_G64_EPS), ("fp8", {}, FP8_EPS)])
def test_lm_head_option_quantizes_the_head_within_its_bound(method: str, options: dict[str, Any], eps: float,
                                                            model128: Path, plugins: PluginManager) -> None:
    """awq.lm_head / fp8.lm_head = true: the head's rounding noise joins the layers' in the same noise model, and
    the error grows."""
    ref = prompt_logits(model128, plugins)
    predicted = rel(noisy_logits(model128, plugins, eps, head=True), ref)
    layers_only = rel(prompt_logits(model128, plugins, quant=method, plugin_options={method: options}), ref)
    with_head = rel(prompt_logits(model128, plugins, quant=method,
                                  plugin_options={method: {**options, "lm_head": True}}), ref)
    assert 0.8 * predicted < with_head < 1.2 * predicted, (with_head, predicted)
    assert with_head > layers_only


@pytest.mark.parametrize("tied", [True, False])
def test_fp8_lm_head_option_quantizes_the_head_of_the_right_weight(tied: bool, tiny_model_factory: Callable[..., Path],
                                                                   plugins: PluginManager) -> None:
    from infer.quant import fp8

    path = tiny_model_factory("llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=tied)
    state = load_file(str(path / "model.safetensors"))
    head = state["model.embed_tokens.weight" if tied else "lm_head.weight"].float()
    model = load_model(EngineConfig(model=str(path), device="cpu", quant="fp8",
                                    plugin_options={"fp8": {"lm_head": True}}).validate(), plugins, path).model
    weight, scale = fp8.quantize_weight_per_channel(head)
    assert model.lm_head.method.name == "fp8"
    assert torch.equal(model.lm_head.weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(model.lm_head.weight_scale, scale)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())


def test_fp8_lm_head_option_is_refused_on_a_quantized_checkpoint() -> None:
    from infer.plugins.fp8 import build_fp8

    config = EngineConfig(plugin_options={"fp8": {"lm_head": True}})
    with pytest.raises(ConfigError, match="checkpoint is quantized already and its config says which layers are "
                                          "FP8; drop the option"):
        build_fp8(config, {"quant_method": "compressed-tensors"})
    with pytest.raises(CheckpointError, match="quantized with quant_method 'awq', which infer's fp8 method does not "
                                              "load"):  # another method's checkpoint: that is what to say first
        build_fp8(config, {"quant_method": "awq"})


@pytest.mark.parametrize("source", ["tied", "untied", "awq-checkpoint"])
def test_awq_lm_head_option_packs_the_rtn_head_of_the_right_weight(source: str, model128: Path, calibrated128: Path,
                                                                   tiny_model_factory: Callable[..., Path],
                                                                   plugins: PluginManager) -> None:
    """The quantized head holds quantize_rtn of the checkpoint's head (of the embedding when tied, which keeps its
    float weight for the lookup), on load for a plain checkpoint and for an AWQ one alike."""
    from infer.quant import awq

    path = {"tied": lambda: tiny_model_factory("llama", hidden_size=128, intermediate_size=256,
                                               tie_word_embeddings=True),
            "untied": lambda: model128, "awq-checkpoint": lambda: calibrated128}[source]()
    state = load_file(str(path / "model.safetensors"))
    head = state["model.embed_tokens.weight" if source == "tied" else "lm_head.weight"].float()
    options: dict[str, Any] = {"plugin_options": {"awq": {"lm_head": True}}}
    if source != "awq-checkpoint":
        options = {"quant": "awq", "plugin_options": {"awq": {"lm_head": True, "group_size": 64}}}
    model = load_model(EngineConfig(model=str(path), device="cpu", **options).validate(), plugins, path).model
    assert model.lm_head.method.name == "awq"
    expected = awq.quantize_rtn(head, 64)
    for name, tensor in zip(("qweight", "qzeros", "scales"), expected):
        assert torch.equal(getattr(model.lm_head, name), tensor), name
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    reference = hidden @ awq.dequantize(*expected, 64, dtype=torch.float32)
    torch.testing.assert_close(model.compute_logits(hidden), reference)


def test_awq_lm_head_option_refuses_a_checkpoint_whose_head_is_packed(calibrated128: Path, tmp_path: Path,
                                                                      plugins: PluginManager) -> None:
    from infer.quant import awq

    path = tmp_path / "packed-head"
    shutil.copytree(calibrated128, path)
    state = load_file(str(path / "model.safetensors"))
    packed = awq.quantize_rtn(state.pop("lm_head.weight").float(), 64)
    state.update(zip(("lm_head.qweight", "lm_head.qzeros", "lm_head.scales"), packed))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the checkpoint's lm_head is AWQ-packed \(qweight\), which infer does "
                                              "not load .*: use a checkpoint whose head is not packed"):
        load_model(EngineConfig(model=str(path), device="cpu", plugin_options={"awq": {"lm_head": True}}).validate(),
                   plugins, path)
    with pytest.raises(CheckpointError, match="the checkpoint's lm_head is quantized, which infer does not load: use "
                                              "one whose head is not"):  # without the option, the same answer
        load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)


def test_a_tied_head_stays_the_embedding_unless_the_method_takes_it(tiny_model_factory: Callable[..., Path],
                                                                     plugins: PluginManager) -> None:
    """Only a method with quantizes_tied_head gets a head of its own: an unquantized method with the skinny GEMM,
    or a third-party method whose applies_to keeps the default (every linear), keep the tied head the embedding."""
    from infer.models.layers import UnquantizedMethod

    class EveryLinear(UnquantizedMethod):  # applies_to: the default, True for 'lm_head'
        name = "every-linear"

    path = tiny_model_factory("llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    for method in (UnquantizedMethod(skinny_max_rows=4), EveryLinear()):
        loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)
        model = type(loaded.model)(loaded.model.cfg, method, torch.float32, loaded.model.spec.max_model_len)
        assert model.lm_head is None, type(method).__name__


def test_awq_lm_head_option_refuses_a_vocabulary_it_cannot_pack(tiny_model_factory: Callable[..., Path],
                                                                plugins: PluginManager) -> None:
    path = tiny_model_factory("llama", vocab_size=1001)
    with pytest.raises(ConfigError, match="vocabulary of 1001 is not a multiple of 8; drop --plugin-option "
                                          "awq.lm_head=true"):
        load_model(EngineConfig(model=str(path), device="cpu", quant="awq",
                                plugin_options={"awq": {"lm_head": True}}).validate(), plugins, path)


@pytest.mark.parametrize("method", ["awq", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_on_load_quantization_never_holds_the_float_model(arch: str, method: str, model128: Path,
                                                          tiny_model_factory: Callable[..., Path],
                                                          plugins: PluginManager, monkeypatch) -> None:
    """--quant awq / fp8 on a float checkpoint quantizes each linear, and each expert, as its weight arrives: the
    model's allocated bytes, read before each checkpoint tensor is taken and at the end, never pass the quantized
    model's (a linear's float weight is a meta placeholder until then), far below the float model's."""
    import itertools

    path = model128 if arch == "llama" else tiny_model_factory(arch, hidden_size=128)

    from infer.models.llama import LlamaFamilyModel

    def allocated(model: torch.nn.Module) -> int:
        tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")

    seen: list[int] = []
    load = LlamaFamilyModel.load_weights

    def measured(model: LlamaFamilyModel, weights: Any) -> None:
        def stream() -> Any:
            for item in weights:
                seen.append(allocated(model))
                yield item
            seen.append(allocated(model))
        load(model, stream())

    monkeypatch.setattr(LlamaFamilyModel, "load_weights", measured)
    quantized = allocated(load_model(EngineConfig(model=str(path), device="cpu", quant=method).validate(), plugins,
                                     path).model)
    assert len(seen) > 10 and max(seen) <= quantized
    seen.clear()
    dense = allocated(load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path).model)
    assert max(seen) == dense > 1.5 * quantized  # the float model is allocated whole before loading


def test_fp8_logits_within_bound(model128: Path, plugins: PluginManager) -> None:
    ref = prompt_logits(model128, plugins)
    predicted = rel(noisy_logits(model128, plugins, FP8_EPS), ref)
    assert 0.8 * predicted < rel(prompt_logits(model128, plugins, quant="fp8"), ref) < 1.2 * predicted


def merged_and_apart(path: Path, plugins: PluginManager, **options: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The model loaded with merged projections, and its logits and the unmerged model's on PROMPTS."""
    merged = load_model(EngineConfig(model=str(path), device="cpu", fuse_projections=True, **options).validate(),
                        plugins, path)
    with torch.no_grad():
        logits = merged.model.compute_logits(dense_forward(merged.model, PROMPTS, merged.device))
    return merged.model, logits, prompt_logits(path, plugins, fuse_projections=False, **options)


@pytest.mark.parametrize("model, options", [
    ("model128", {}), ("model128", {"quant": "awq", "plugin_options": {"awq": {"group_size": 64}}}),
    ("calibrated128", {}), ("model128", {"quant": "fp8"})], ids=["bf16-path", "awq-rtn", "awq-checkpoint", "fp8"])
def test_merged_projections_compute_what_the_separate_ones_do(model: str, options: dict[str, Any],
                                                              plugins: PluginManager,
                                                              request: pytest.FixtureRequest) -> None:
    """q/k/v and gate/up merged into one linear each (the CUDA default): same logits as the separate linears, up
    to the float32 rounding of differently shaped matmuls, with each quant method's tensors concatenated."""
    model_obj, logits, apart = merged_and_apart(request.getfixturevalue(model), plugins, **options)
    for layer in model_obj.model.layers:
        assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")  # freed
    assert rel(logits, apart) < 1e-5


def test_fp8_merges_per_tensor_scales_only_when_they_are_equal(plugins: PluginManager) -> None:
    from infer.quant import fp8
    from infer.quant.fp8_method import Fp8LinearMethod

    method = Fp8LinearMethod(fp8.Fp8CheckpointConfig(((("Linear",), fp8.STATIC),)))
    parts = []
    for i, scale in enumerate((0.5, 0.5, 0.25)):
        part = Linear(16, 8, False, f"model.layers.0.self_attn.{'qkv'[i]}_proj", method, torch.float32)
        part.weight.copy_(torch.randn(8, 16).to(fp8.FP8_DTYPE))
        part.weight_scale.fill_(scale)
        part.input_scale.fill_(0.1)
        parts.append(part)
    assert Linear.merged(parts[:2], "qk") is not None
    assert Linear.merged(parts, "qkv") is None  # a third scale would need requantizing: kept apart
    x = torch.randn(3, 16)
    merged = Linear.merged(parts[:2], "qk")
    assert torch.equal(merged(x), torch.cat([parts[0](x), parts[1](x)], dim=-1))
    parts[1].input_scale.fill_(0.2)  # equal weight scales, but static input scales that differ: kept apart
    assert Linear.merged(parts[:2], "qk") is None


def test_fp8_parts_of_different_schemes_stay_apart() -> None:
    """A merged linear runs one scheme: a part whose activations stay unquantized (weight-only) never merges
    with one that rounds them to fp8 per token, although both hold per-channel weight scales."""
    from infer.quant import fp8
    from infer.quant.fp8_method import Fp8LinearMethod

    weight_only = fp8.Fp8Scheme("channel", None)
    method = Fp8LinearMethod(fp8.Fp8CheckpointConfig(((("re:.*q_proj$",), fp8.DYNAMIC), (("Linear",), weight_only))))
    parts = []
    for name in ("q_proj", "k_proj"):
        part = Linear(16, 8, False, f"model.layers.0.self_attn.{name}", method, torch.float32)
        part.load("weight", torch.randn(8, 16).to(fp8.FP8_DTYPE))
        part.load("weight_scale", torch.rand(8) + 0.1)
        method.process_after_loading(part)
        parts.append(part)
    assert [p.fp8_scheme for p in parts] == [fp8.DYNAMIC, weight_only]
    assert Linear.merged(parts, "qk") is None


def test_a_quant_method_without_merge_keeps_the_projections_apart(tiny_model: Path, infer_plugins: Any) -> None:
    """A third-party QuantMethod written before ``merge`` existed: the default merges nothing, and the model runs
    its projections apart, with merging on."""
    from infer.core.interfaces import QuantMethod
    from infer.models.layers import UnquantizedMethod

    class PlainMethod(QuantMethod):  # plain weights; merge is QuantMethod's default
        name = "plain"
        create_weights = UnquantizedMethod.create_weights

        def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, layer.weight, layer.bias)

    def register_quant_methods(register: Any) -> None:
        register("plain", lambda config, quantization_config: PlainMethod())

    module = types.ModuleType("plain_quant")
    module.register_quant_methods = hookimpl(register_quant_methods)  # type: ignore[attr-defined]
    infer_plugins.register(module, source="acme")
    plugins = infer_plugins.collect()
    loaded = load_model(EngineConfig(model=str(tiny_model), device="cpu", quant="plain", fuse_projections=True)
                        .validate(), plugins, tiny_model)
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj is None and isinstance(layer.self_attn.q_proj.method, PlainMethod)
    with torch.no_grad():
        logits = loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS, loaded.device))
    assert rel(logits, prompt_logits(tiny_model, plugins)) < 1e-6


def test_calibrated_awq_beats_rtn_with_activation_outliers(model128: Path, plugins: PluginManager,
                                                           tmp_path: Path) -> None:
    model = with_outlier_channels(model128, tmp_path / "outliers", [3, 50, 77, 100], 16.0)
    calib = tmp_path / "calib.jsonl"  # the same stdlib text as the default, given as a JSONL --calib file
    texts = [text for _, text in zip(range(3), default_texts())]
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "awq"
    result = CliRunner().invoke(main, ["quantize", "--method", "awq", str(model), str(out), "--calib", str(calib),
                                       "--group-size", "64", "--num-samples", "8", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "mean alpha" in result.output and f"wrote the AWQ checkpoint {out}" in result.output
    ref = prompt_logits(model, plugins)
    rtn = rel(prompt_logits(model, plugins, quant="awq", plugin_options={"awq": {"group_size": 64}}), ref)
    calibrated = rel(prompt_logits(out, plugins), ref)
    # measured: RTN 0.60, calibrated 0.42 (x16 on 4 of 128 channels)
    assert calibrated < 0.85 * rtn, (calibrated, rtn)
    report = json.loads((out / "awq_calibration.json").read_text())
    # alpha 0 is plain RTN, so a chosen alpha > 0 means the search measured a strictly lower error there
    assert any(g["alpha"] > 0 and g["error"] < g["rtn_error"] for g in report["groups"]
               if g["group"] in ("qkv", "gate_up"))


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_calibrated_gemma_generates_like_hf_on_its_written_weights(
        name: str, checkpoint: Callable[[str], Path], tmp_path: Path, plugins: PluginManager,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Gemma's MLP scale folds into its pre-feedforward norm, 1 / s into the (1 + w) it computes with; the norms are
    written back as w, the floats in bfloat16 (Gemma overflows float16), config.json saying so."""
    from test_awq_calibrate_moe import dense_twin

    from infer import LLM

    calibrate_awq(checkpoint(name), tmp_path / "awq", CALIB, plugins=plugins)
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    assert state["model.layers.0.pre_feedforward_layernorm.weight"].dtype == torch.bfloat16
    assert state["model.layers.0.mlp.up_proj.scales"].dtype == torch.float16
    original = load_file(str(checkpoint(name) / "model.safetensors"))
    for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):  # output norms: no scale folds there
        key = f"model.layers.1.{norm}.weight"
        assert torch.equal(state[key], original[key].bfloat16()), key
    dense_twin(tmp_path / "awq", tmp_path / "dense")
    llm = LLM(model=str(tmp_path / "awq"), device="cpu", num_kv_blocks=32)
    for prompt in PROMPTS[:2]:
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == \
            hf_greedy(tmp_path / "dense", prompt, GREEDY.max_tokens)


def test_calibrated_checkpoint_is_in_the_autoawq_gemm_format(calibrated128: Path, model128: Path) -> None:
    config = json.loads((calibrated128 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": None}
    assert config["torch_dtype"] == "float16"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (calibrated128 / name).read_bytes() == (model128 / name).read_bytes()
    state = load_file(str(calibrated128 / "model.safetensors"))
    q_proj = "model.layers.1.self_attn.q_proj"
    assert state[f"{q_proj}.qweight"].shape == (128, 16) and state[f"{q_proj}.qweight"].dtype == torch.int32
    assert state[f"{q_proj}.qzeros"].shape == (2, 16) and state[f"{q_proj}.scales"].shape == (2, 128)
    assert state[f"{q_proj}.scales"].dtype == torch.float16 and f"{q_proj}.weight" not in state
    assert state["lm_head.weight"].dtype == torch.float16  # never quantized
    engine = Engine(EngineConfig(model=str(calibrated128), device="cpu", num_kv_blocks=16))
    assert engine.active["quant"] == "awq"  # the checkpoint's own method (GetModelInfo said "none" without --quant)


@pytest.mark.autoawq
def test_calibrated_checkpoint_generates_like_hf_on_its_dequantized_weights(
        calibrated128: Path, model128: Path, tmp_path: Path,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """What ``infer quantize`` wrote, dequantized by AutoAWQ's own code, is the model HF runs; infer's greedy tokens
    on the packed checkpoint are HF's on that model."""
    dense = dequantized_copy(calibrated128, model128, tmp_path / "dequantized", group=64)
    engine = Engine(EngineConfig(model=str(calibrated128), device="cpu", num_kv_blocks=32))
    for prompt in seeded_prompts(2, 10, seed=6):
        assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(dense, prompt, GREEDY.max_tokens)


@pytest.mark.autoawq
def test_phi3_calibrates_its_fused_projections_whole(tiny_model_factory: Callable[..., Path], tmp_path: Path,
                                                     plugins: PluginManager,
                                                     hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Phi-3's qkv_proj and gate_up_proj are written whole (AutoAWQ's names); AutoAWQ's dequantization of them is the
    model HF runs, infer's greedy tokens are HF's there, and the logits keep within the int4 noise model's bound."""
    phi3 = tiny_model_factory("phi3", hidden_size=128, intermediate_size=256)
    calibrate_awq(phi3, tmp_path / "awq", CALIB, plugins=plugins)
    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    assert state["model.layers.0.self_attn.qkv_proj.qweight"].shape == (128, 256 // 8)
    assert state["model.layers.0.mlp.gate_up_proj.qweight"].shape == (128, 512 // 8)
    dense = dequantized_copy(tmp_path / "awq", phi3, tmp_path / "dequantized", group=64)
    engine = Engine(EngineConfig(model=str(tmp_path / "awq"), device="cpu", num_kv_blocks=32))
    for prompt in seeded_prompts(2, 10, seed=6):
        assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(dense, prompt, GREEDY.max_tokens)
    ref = prompt_logits(phi3, plugins)
    predicted = rel(noisy_logits(phi3, plugins, INT4_G64_EPS), ref)
    assert 0 < rel(prompt_logits(tmp_path / "awq", plugins), ref) < 1.2 * predicted


# GQA (o_proj scales shared per KV head); v_proj bias; fused projections; Gemma's (1 + w) norms, its MLP reading the
# pre-feedforward norm
@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3", "gemma3", "gemma2"])
def test_scale_folding_leaves_the_model_unchanged(name: str, checkpoint: Callable[[str], Path],
                                                  plugins: PluginManager) -> None:
    path = checkpoint(name)
    loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)
    model, g = loaded.model, torch.Generator().manual_seed(3)
    for module in model.modules():  # the tiny checkpoints' biases are zero, which any folding leaves alone
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            module.bias.data.copy_(torch.randn(module.bias.shape, generator=g))
    before = model.compute_logits(dense_forward(model, PROMPTS[:2], loaded.device))
    for layer in model.model.layers:
        attn = layer.self_attn
        for group in groups_of(layer):
            width = layer.get_submodule(group.linears[0]).in_features
            s = torch.rand(width, generator=g) * 3 + 0.2
            if group.name == "o":  # one scale per (KV head, channel), repeated over the q heads it serves
                heads = attn.num_heads // attn.num_kv_heads
                s = s.view(attn.num_kv_heads, heads, attn.head_dim)[:, :1].expand(-1, heads, -1).reshape(-1)
            _fold(layer, group, s)
    after = model.compute_logits(dense_forward(model, PROMPTS[:2], loaded.device))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_calibration_forward_sees_every_token_and_keeps_at_most_max_rows(tiny_model: Path,
                                                                          plugins: PluginManager) -> None:
    """Whatever the batching, each group's statistics cover every token: the sum of |x| and the count of the inputs
    its linears see in one forward pass of all the samples; at most ``max_rows`` of those inputs are kept, unchanged.
    Progress runs from (0, batches) to (batches, batches), and no hook is left on the model."""
    from infer.quant.calibrate import _collect

    loaded = load_model(EngineConfig(model=str(tiny_model), device="cpu").validate(), plugins, tiny_model)
    model, samples = loaded.model, seeded_prompts(5, 16, seed=2)
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def observe(key: tuple[int, str]) -> Callable[..., None]:
        return lambda module, args: seen.__setitem__(key, args[0].reshape(-1, args[0].shape[-1]).float().clone())

    handles = [layer.get_submodule(g.linears[0]).register_forward_pre_hook(observe((i, g.name)))
               for i, layer in enumerate(model.model.layers) for g in groups_of(layer)]
    with torch.no_grad():
        dense_forward(model, samples, loaded.device)
    for handle in handles:
        handle.remove()
    calls: list[tuple[str, int, int]] = []
    with torch.no_grad():
        stats, experts = _collect(model, samples, loaded.device, AwqCalibrationConfig(max_rows=30, batch_samples=2),
                                  lambda *call: calls.append(call))
        dense_forward(model, samples, loaded.device)  # recorded nowhere
    assert calls[0] == ("calibration forward", 0, 3) and calls[-1] == ("calibration forward", 3, 3)
    assert len(seen) == 4 * len(stats) and experts == [None] * len(stats)
    for (i, name), x in seen.items():
        record = stats[i][name]
        assert record.count == x.shape[0] == 5 * 16
        torch.testing.assert_close(record.abs_sum, x.abs().sum(dim=0), rtol=1e-5, atol=1e-5)
        rows = torch.cat(record.rows)
        assert 0 < rows.shape[0] <= 30
        assert all(float((x - row).abs().amax(dim=1).min()) < 1e-4 for row in rows)  # inputs, as they were


@pytest.mark.parametrize("arch, changes, group", [
    ("llama", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 24}, 32),  # o_proj's input, 4 x 24 = 96
    ("llama", {"hidden_size": 128, "intermediate_size": 160}, 32),  # down_proj's input
    ("phi3", {"intermediate_size": 160}, 32),  # down_proj's input, beside the fused gate_up_proj
    ("phi3", {"num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 4}, 64),  # qkv_proj: 64 + 2 x 4 outputs
])
def test_quantize_request_checks_every_linear_before_the_model_loads(arch: str, changes: dict[str, int], group: int,
                                                                     checkpoint: Callable[[str], Path],
                                                                     tmp_path: Path) -> None:
    """From config.json alone: the default group size is the largest of 128, 64, 32 that divides every checkpoint
    linear's input size (docs/cli.md); a group size that does not divide one is refused."""
    from infer.quant.calib_job import check_request

    model = tmp_path / "model"
    shutil.copytree(checkpoint(arch), model)
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), **changes}))
    assert check_request(model, tmp_path / "out", AwqCalibrationConfig())[1].group_size == group
    with pytest.raises(CheckpointError, match="group_size 128 does not divide in_features"):
        check_request(model, tmp_path / "out", AwqCalibrationConfig(group_size=128))


def test_calibration_keeps_every_linears_bias(checkpoint: Callable[[str], Path], plugins: PluginManager,
                                              tmp_path: Path) -> None:
    """Qwen2's q/k/v biases are written beside their packed weights: q's and k's as they were (s scales their
    inputs, not their outputs), v's divided by o's scales as its weight rows are."""
    path = tmp_path / "qwen2"
    shutil.copytree(checkpoint("qwen2"), path)
    original = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    for name, tensor in original.items():
        if name.endswith(".bias"):  # the tiny checkpoint's are zero
            tensor.copy_(torch.randn(tensor.shape, generator=g))
    save_file(original, str(path / "model.safetensors"), metadata={"format": "pt"})
    calibrate_awq(path, tmp_path / "awq", CALIB, plugins=plugins)
    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        for name in ("q_proj", "k_proj"):
            assert torch.equal(state[f"{prefix}.{name}.bias"], original[f"{prefix}.{name}.bias"].half())
        v_bias = original[f"{prefix}.v_proj.bias"].half()
        assert state[f"{prefix}.v_proj.bias"].shape == v_bias.shape and not torch.equal(state[f"{prefix}.v_proj.bias"],
                                                                                        v_bias)
        assert f"{prefix}.o_proj.bias" not in state


def test_the_scales_calibration_folds_leave_the_unquantized_model_unchanged(
        checkpoint: Callable[[str], Path], plugins: PluginManager, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer, as calibrate_awq folded it just before quantizing, computes what the original did (docs: the
    folding is exact), GQA's o_proj included, where a scale must be one per (KV head, channel) to fold into v.
    (Without clipping, which changes weights on purpose.)"""
    from infer.quant import calibrate

    path = checkpoint("llama")  # 4 q heads on 2 KV heads
    folded: dict[str, torch.Tensor] = {}
    quantize = calibrate._quantized_layer_tensors

    def record(layer: torch.nn.Module, prefix: str, group_size: int) -> dict[str, torch.Tensor]:
        folded.update({f"{prefix}.{name}": t.clone() for name, t in layer.state_dict().items()})
        return quantize(layer, prefix, group_size)

    monkeypatch.setattr(calibrate, "_quantized_layer_tensors", record)
    calibrate_awq(path, tmp_path / "awq", dataclasses.replace(CALIB, clip=False), plugins=plugins)
    loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)
    before = loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS[:2], loaded.device))
    loaded.model.load_state_dict({**loaded.model.state_dict(), **folded})
    after = loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS[:2], loaded.device))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args, message, status", [
    (["--group-size", "48"], "--group-size must be one of -1, 32, 64, 128, got 48", 2),
    (["--bits", "8"], "supports 4-bit weights only", 2),
    (["--group-size", "128"], "group_size 128 does not divide in_features 64", 1),  # the model's shape, found on load
    (["--num-samples", "0"], "num-samples must be >= 1", 2),
    (["--seq-len", "1"], "--seq-len must be >= 2", 2),
    (["--seq-len", "0"], "--seq-len must be >= 2", 2),
    (["--device", "bogus"], "--device must be auto, cpu, cuda or cuda:N, got 'bogus'", 2),
])
def test_quantize_command_rejects_bad_options(args: list[str], message: str, status: int, tiny_model: Path,
                                              tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["quantize", str(tiny_model), str(tmp_path / "out"), *args])
    assert result.exit_code == status and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_quantize_command_rejects_bad_paths(tiny_model: Path, calibrated128: Path, tmp_path: Path) -> None:
    from infer.quant.calib_job import check_request

    def fails(args: list[str], message: str) -> None:
        result = CliRunner().invoke(main, ["quantize", *args, "--group-size", "32"])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, result.output

    fails([str(calibrated128), str(tmp_path / "a")], "is already quantized (awq)")
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()),
                                                   "architectures": ["GPT2LMHeadModel"]}))
    fails([str(other), str(tmp_path / "p")], "infer quantize supports LlamaForCausalLM, MistralForCausalLM, "
          "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
          "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM; ")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": "LlamaForCausalLM"}))
    fails([str(odd), str(tmp_path / "a")], "architectures = 'LlamaForCausalLM'; it should be a list")
    (odd / "config.json").write_text(json.dumps({**config, "quantization_config": "awq"}))
    fails([str(odd), str(tmp_path / "a")], "quantization_config = 'awq'; it should be an object")
    group = CliRunner().invoke(main, ["--device", "cpu", "--quant", "fp8", "quantize", str(tiny_model),
                                      str(tmp_path / "a")])
    assert group.exit_code == 2 and "the options before `quantize` (--device, --quant)" in group.output
    assert "takes its own --device" in group.output
    fails([str(tiny_model), str(tmp_path / "missing" / "out")], "does not exist; create it first")
    (tmp_path / "plain").write_text("a file")
    fails([str(tiny_model), str(tmp_path / "plain" / "out")], "is a file, not a folder")
    fails([str(tiny_model), str(tmp_path / "plain")], "already exists and is not an empty folder")
    fails([str(tmp_path / "plain"), str(tmp_path / "e")], "does not exist or is not a folder")
    fails([str(tiny_model / ".." / tiny_model.name), str(tiny_model)], "OUT must differ from MODEL")  # spelt apart
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_model, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors weight files"):  # before the model loads
        check_request(weightless, tmp_path / "w", AwqCalibrationConfig())
    if Path("/proc").is_dir():  # a folder nobody can make folders in, even root (whom os.access lets through)
        fails([str(tiny_model), "/proc/out"], "cannot write into '/proc', the parent folder of OUT")
    fails([str(tiny_model), str(tiny_model)], "OUT must differ from MODEL")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    fails([str(tiny_model), str(tmp_path / "full")], "already exists and is not an empty folder")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    fails([str(tiny_model), str(tmp_path / "link")], "is a symbolic link")
    fails([str(tmp_path / "nothing"), str(tmp_path / "b")], "does not exist")
    (tmp_path / "calib.jsonl").write_text('{"text": "a"}\n{"other": 1}\n')
    fails([str(tiny_model), str(tmp_path / "c"), "--calib", str(tmp_path / "calib.jsonl")], "line 2 must be")
    fails([str(tiny_model), str(tmp_path / "d"), "--calib", str(tmp_path / "none.txt")], "does not exist")


# ---------------------------------------------------------------- real producers through the Engine
def dequantized_copy(quantized: Path, original: Path, dense: Path, group: int) -> Path:
    """An AutoAWQ GEMM checkpoint dequantized by AutoAWQ's own code (fp32 scales: exact), saved as a plain fp32
    checkpoint beside ``original``'s config and tokenizer: the reference model for HF."""
    from awq.utils.packing_utils import dequantize_gemm

    state = load_file(str(next(quantized.glob("*.safetensors"))))
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        owner, _, attr = name.rpartition(".")
        if attr == "qweight":
            w = dequantize_gemm(tensor, state[f"{owner}.qzeros"], state[f"{owner}.scales"].float(), 4, group)
            plain[f"{owner}.weight"] = w.t().contiguous()
        elif attr not in ("qzeros", "scales"):
            plain[name] = tensor.float()
    shutil.copytree(original, dense)
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    return dense


@pytest.mark.autoawq
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # Phi-3's qkv_proj and gate_up_proj are quantized fused
def test_autoawq_checkpoint_generates_like_hf_on_its_dequantized_weights(
        arch: str, model128: Path, tmp_path: Path, hf_greedy: Callable[[Path, list[int], int], list[int]],
        tiny_model_factory: Callable[..., Path]) -> None:
    pytest.importorskip("awq", reason="AutoAWQ is not installed (pip install 'infer-engine[awq]')")
    from awq import AutoAWQForCausalLM

    from infer import LLM

    if arch != "llama":
        model128 = tiny_model_factory(arch, hidden_size=128, intermediate_size=256)
    quantized, dense = tmp_path / "autoawq", tmp_path / "dequantized"
    model = AutoAWQForCausalLM.from_pretrained(str(model128))
    calib = seeded_prompts(8, 32, seed=1)  # token ids, none longer than max_calib_seq_len
    model.quantize(None, quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"},
                   calib_data=calib, max_calib_seq_len=32, max_calib_samples=8)
    model.save_quantized(str(quantized))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model128 / name, quantized / name)
    dequantized_copy(quantized, model128, dense, group=64)
    llm = LLM(model=str(quantized), device="cpu", num_kv_blocks=32)
    for prompt in seeded_prompts(2, 10, seed=2):
        ours = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert ours == hf_greedy(dense, prompt, GREEDY.max_tokens)


@pytest.mark.compressed_tensors
@pytest.mark.parametrize(("preset", "kv_cache_scheme", "arch"), [
    ("FP8", False, "llama"), ("FP8_DYNAMIC", False, "llama"), ("FP8", True, "llama"),
    ("FP8", False, "phi3"), ("FP8_DYNAMIC", False, "phi3"),  # Phi-3's fused projections, one scale (or row) each
])
def test_compressed_tensors_checkpoint_greedy_equals_the_library_emulation(
        preset: str, kv_cache_scheme: bool, arch: str, tiny_model: Path, tmp_path: Path,
        tiny_model_factory: Callable[..., Path]) -> None:
    """With ``kv_cache_scheme`` the checkpoint also holds the per-layer ``self_attn.k_scale``/``v_scale`` that
    compressed-tensors writes for an fp8 KV cache; infer ignores them (it says so) and loads the rest."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from test_quant_compressed_tensors import compress_and_save
    from transformers import AutoModelForCausalLM

    if arch != "llama":
        tiny_model = tiny_model_factory(arch)

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    compress_and_save(hf, tmp_path, preset)  # hf now runs the library's fake-quantized (emulated) forward
    if kv_cache_scheme:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                            "dynamic": False, "symmetric": True}
        (tmp_path / "config.json").write_text(json.dumps(config))
        tensors = load_file(str(tmp_path / "model.safetensors"))
        for i in range(config["num_hidden_layers"]):
            tensors |= {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.05]) for kv in "kv"}
        save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, tmp_path / name)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=32))
    assert engine.loaded.quant is not None and engine.loaded.quant.name == "fp8"
    for prompt in seeded_prompts(2, 12, seed=3):
        ids, reference = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                token = int(hf(ids).logits[0, -1].argmax())
                reference.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == reference


# ---------------------------------------------------------------- --kv-cache-dtype fp8
def paged_prefill_logits(model: Any, prompt: list[int], caches: list[LayerKVCache]) -> torch.Tensor:
    """Logits of one prefill through the torch backend: every position's attention reads K/V back from ``caches``."""
    n, size = len(prompt), 16
    blocks = -(-n // size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
        query_lens_cpu=[n], context_lens_cpu=[n], block_size=size, max_query_len=n, max_context_len=n)
    attention = TorchAttention()
    meta.backend_data = attention.prepare(meta)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, attention, meta))


def test_fp8_kv_logits_bound(tiny_model: Path, plugins: PluginManager) -> None:
    """e4m3 keeps 4 significant bits to bf16's 8, so its KV rounding error is about 2^4 times bf16's; the bound allows
    2x that (measured: about 17x, relative logits error 0.035 against fp32 KV; bf16 KV: 0.002)."""
    loaded = load_model(EngineConfig(model=str(tiny_model), device="cpu").validate(), plugins, tiny_model)
    model, spec = loaded.model, loaded.model.spec
    scales = calibrate_kv_scales(model, calibration_ids(loaded.tokenizer), loaded.device)
    shape = (8, 16, spec.num_kv_heads, spec.head_dim)

    def caches(dtype: torch.dtype, scaled: bool) -> list[LayerKVCache]:
        return [LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                             *((k, v) if scaled else (None, None))) for k, v in scales]

    prompt = seeded_prompts(1, 100, seed=4)[0]
    ref = paged_prefill_logits(model, prompt, caches(torch.float32, False))
    bf16 = rel(paged_prefill_logits(model, prompt, caches(torch.bfloat16, False)), ref)
    fp8 = rel(paged_prefill_logits(model, prompt, caches(FP8_KV_DTYPE, True)), ref)
    assert 0 < bf16 and fp8 < min(2**5 * bf16, 0.1), (fp8, bf16)


def hf_fp8_kv_greedy(path: Path, scales: list[tuple[torch.Tensor, torch.Tensor]], prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuations (fp32) with every K/V it caches rounded as the fp8 KV format stores
    them: ``e4m3(clamp(x / s[h], -448, 448)) * s[h]``, with ``scales`` [(k_scale, v_scale) per layer] per KV head."""
    from transformers import AutoModelForCausalLM, DynamicCache

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [batch, kv heads, tokens, head dim]
        s = scale[:, None, None]
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s

    class Fp8RoundedCache(DynamicCache):
        def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            k_scale, v_scale = scales[layer_idx]
            return super().update(rounded(k, k_scale), rounded(v, v_scale), layer_idx, *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids, cache, tokens = torch.tensor([prompt]), Fp8RoundedCache(), []
        with torch.no_grad():
            for _ in range(max_tokens):
                step = model(ids, past_key_values=cache, use_cache=True)
                ids = step.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(ids))
        outputs.append(tokens)
    return outputs


def test_fp8_kv_greedy_equals_hf_with_fp8_rounded_kv(tiny_model: Path, plugins: PluginManager) -> None:
    """Greedy with ``--kv-cache-dtype fp8`` is HF's greedy with K/V rounded to e4m3 at the engine's per-head scales,
    token for token. (Against full-precision KV no exact rule holds: fp8 KV moves the tiny model's flat logits by up
    to 0.24, enough to flip near-ties; test_fp8_kv_logits_bound bounds that error.)"""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8"), plugins)
    cache = engine.runner.kv_caches[0]
    assert cache[0].dtype == FP8_KV_DTYPE and cache.k_scale.shape == (engine.loaded.model.spec.num_kv_heads,)
    prompts = [engine.tokenize(p) for p in (seeded_prompts(1, 40, seed=5)[0], [17, 18], "def add(a, b):\n    return")]
    outputs = [r.outputs[0].token_ids for r in engine.generate(prompts, GREEDY)]
    scales = [(c.k_scale, c.v_scale) for c in engine.runner.kv_caches]
    assert outputs == hf_fp8_kv_greedy(tiny_model, scales, prompts, GREEDY.max_tokens)


def test_fp8_kv_on_a_softcapping_model_equals_hf_with_fp8_rounded_kv(checkpoint, plugins: PluginManager) -> None:
    """Gemma 2: the scales' calibration pass caps the attention scores too (it refused the model before)."""
    path = checkpoint("gemma2")
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8"), plugins)
    prompts = seeded_prompts(2, 20, seed=6)
    outputs = [r.outputs[0].token_ids for r in engine.generate(prompts, GREEDY)]
    scales = [(c.k_scale, c.v_scale) for c in engine.runner.kv_caches]
    assert outputs == hf_fp8_kv_greedy(path, scales, prompts, GREEDY.max_tokens)


def test_fp8_kv_scales_are_twice_hf_kv_amax_over_448(tiny_model: Path, plugins: PluginManager) -> None:
    """The format's static scales, from HF's own K (after RoPE) and V on the calibration prefill: per layer and KV
    head, s = 2 * max|x| / 448 (headroom 2, e4m3's largest value 448). K and V each get their own."""
    from transformers import AutoModelForCausalLM, DynamicCache

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8"), plugins)
    amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    class Observed(DynamicCache):
        def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [batch, kv heads, tokens, head dim]
            amax[layer_idx] = (k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3)))
            return super().update(k, v, layer_idx, *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([calibration_ids(engine.tokenizer)]), past_key_values=Observed(), use_cache=True)
    assert sorted(amax) == list(range(len(engine.runner.kv_caches)))
    for layer, cache in enumerate(engine.runner.kv_caches):
        k_amax, v_amax = amax[layer]
        assert not torch.allclose(k_amax, v_amax, rtol=0.05)  # else a K/V swap would pass
        torch.testing.assert_close(cache.k_scale, 2 * k_amax / 448, rtol=1e-4, atol=0)
        torch.testing.assert_close(cache.v_scale, 2 * v_amax / 448, rtol=1e-4, atol=0)


def test_fp8_kv_doubles_the_blocks_and_the_concurrent_sequences(tiny_model: Path, plugins: PluginManager) -> None:
    # one bf16 block of the tiny model: 2 (K, V) x 2 layers x 16 slots x 2 heads x 16 dims x 2 bytes = 4 KiB
    budget_gb = 64 * 4096 / 2**30
    peaks, blocks = {}, {}
    for kv_dtype in ("auto", "fp8"):
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", dtype="bfloat16", kv_cache_dtype=kv_dtype,
                                     kv_cache_memory_gb=budget_gb, enable_prefix_caching=False), plugins)
        blocks[kv_dtype] = engine.num_blocks
        for prompt in seeded_prompts(24, 40, seed=6):  # 40 + 8 tokens: 3 blocks per sequence
            engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.scheduler.num_running())
        peaks[kv_dtype] = peak
    assert blocks == {"auto": 64, "fp8": 128}
    assert peaks["auto"] <= 64 // 3 < peaks["fp8"], peaks


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def test_fp8_kv_triton_backend_equals_torch_backend(device: str, tiny_model: Path, plugins: PluginManager) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is present, so the Triton interpreter is off; run with -m gpu")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [seeded_prompts(1, 20, seed=7)[0], [17, 18, 19]]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(tiny_model), device=device, dtype="float32", attention=backend,
                                     num_kv_blocks=16, kv_cache_dtype="fp8"), plugins)
        outputs[backend] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]


def test_quantize_default_group_size_divides_every_layer(tiny_model: Path, tmp_path: Path) -> None:
    """Without --group-size the largest of 128, 64, 32 that divides every input size is used (64 for hidden 64):
    the defaults work on small models such as the shipped one (hidden 192)."""
    out = tmp_path / "awq"
    result = CliRunner().invoke(main, ["quantize", str(tiny_model), str(out), "--num-samples", "2", "--seq-len", "32"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert "(int4, group 64)" in result.output
    record = json.loads((out / "awq_calibration.json").read_text())
    assert record["calibration_data"] == {"samples": 2, "tokens": 64, "seq_len": 32}  # what was used, not asked
    assert {k: record["options"][k] for k in ("group_size", "bits", "num_samples", "seq_len", "device")} == {
        "group_size": 64, "bits": 4, "num_samples": 2, "seq_len": 32, "device": "auto"}  # the group size chosen
    assert [(g["layer"], g["group"]) for g in record["groups"]] == [
        (layer, group) for layer in range(2) for group in ("qkv", "o", "gate_up", "down")]
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # readable as the umask allows


def test_quantize_warns_when_the_calibration_text_is_tiny(tiny_model: Path, tmp_path: Path, caplog) -> None:
    """Each shortfall is said, and awq_calibration.json records the samples, tokens and sample length used."""
    from transformers import AutoTokenizer

    def used(out: str) -> dict[str, int]:
        return json.loads((tmp_path / out / "awq_calibration.json").read_text())["calibration_data"]

    tokens = AutoTokenizer.from_pretrained(str(tiny_model)).encode
    (tmp_path / "one.txt").write_text("x")
    with caplog.at_level(logging.WARNING, logger="infer"):
        result = CliRunner().invoke(main, ["quantize", str(tiny_model), str(tmp_path / "q"), "--calib",
                                           str(tmp_path / "one.txt"), "--seq-len", "32"])
    assert result.exit_code == 0, result.output
    assert "the calibration text holds only" in caplog.text and "under one sample of 32" in caplog.text
    caplog.clear()
    (tmp_path / "short.txt").write_text("def f(x):\n    return x + 1\n" * 12)
    with caplog.at_level(logging.WARNING, logger="infer"):
        result = CliRunner().invoke(main, ["quantize", str(tiny_model), str(tmp_path / "q1"), "--calib",
                                           str(tmp_path / "short.txt"), "--seq-len", "32", "--num-samples", "64"])
    assert result.exit_code == 0, result.output
    assert re.search(r"holds \d samples of 32 tokens, not the 64 asked for \(--num-samples\)", caplog.text)
    count = sum(len(tokens(line + "\n\n", add_special_tokens=False)) for line in ["def f(x):", "    return x + 1"] * 12)
    assert used("q1") == {"samples": count // 32, "tokens": count // 32 * 32, "seq_len": 32}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer"):
        result = CliRunner().invoke(main, ["quantize", str(tiny_model), str(tmp_path / "q2"), "--calib",
                                           str(tmp_path / "one.txt"), "--seq-len", "5000", "--num-samples", "1"])
    assert result.exit_code == 0, result.output
    assert "--seq-len 5000 is longer than the model's context (1024 tokens): the samples use 1024" in caplog.text
    assert used("q2") == {"samples": 1, "tokens": len(tokens("x\n\n", add_special_tokens=False)), "seq_len": 1024}


def test_calibration_text_of_exactly_the_samples_asked_for_warns_nothing(tiny_model: Path, plugins: PluginManager,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoTokenizer

    from infer.quant.calib_job import load_for_calibration

    text = "def add(a, b):\n    return a + b"
    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(text + "\n\n", add_special_tokens=False)
    with caplog.at_level(logging.WARNING, logger="infer"):
        _, samples, seq_len = load_for_calibration(
            tiny_model, AwqCalibrationConfig(num_samples=1, seq_len=len(ids), device="cpu"), [text], plugins)
    assert samples == [ids] and seq_len == len(ids)
    assert [r.message for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("code, message, full", [(errno.ENOSPC, "No space left on device", True),
                                                 (errno.EDQUOT, "Disk quota exceeded", True),
                                                 (errno.EACCES, "Permission denied", False),
                                                 (None, "Error while serializing", False)])  # a SafetensorError
def test_a_failed_checkpoint_write_is_a_checkpoint_error_and_leaves_nothing(code: int | None, message: str,
                                                                            full: bool, tiny_model: Path,
                                                                            tmp_path: Path) -> None:
    """A failed write is a CheckpointError that leaves no folder behind; a full disk or quota says to free space."""
    from safetensors import SafetensorError

    from infer.quant.calib_job import _write_checkpoint

    def failing(*args: object, **kwargs: object) -> None:
        raise SafetensorError(message) if code is None else OSError(code, message)

    with pytest.raises(CheckpointError, match=f"{message}.*OUT was not created") as info:
        _write_checkpoint(tiny_model, tmp_path / "out", {}, {}, failing, {"quant_method": "awq"}, ("r.json", {}))
    assert ("OUT was not created: free disk space or choose another path" in str(info.value)) == full
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_or_failed_move_leaves_out_as_it_was(tiny_model: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while writing leaves nothing and goes on; a move that fails into an existing empty OUT leaves it
    there, empty."""
    from infer.quant import calib_job

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calib_job._write_checkpoint(tiny_model, tmp_path / "out", {}, {}, interrupted, {}, ("r.json", {}))
    assert list(tmp_path.iterdir()) == []

    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    (tmp_path / "out").mkdir()
    monkeypatch.setattr(calib_job.os, "replace", cross_device)
    with pytest.raises(CheckpointError, match="Invalid cross-device link.*OUT was not created"):
        calib_job._write_checkpoint(tiny_model, tmp_path / "out", {}, {"w": torch.ones(2)}, save_file, {},
                                    ("r.json", {}))
    assert list(tmp_path.iterdir()) == [tmp_path / "out"] and list((tmp_path / "out").iterdir()) == []


def test_the_checkpoint_copies_model_files_but_no_weights_or_quantization_configs(tmp_path: Path) -> None:
    """OUT: the new weights, config.json with the quantization_config and float16 under both dtype keys, the record,
    and MODEL's other files as they are; not MODEL's weights in any format, their index, older quantization configs
    or folders. OUT has the mode of a plain mkdir, and no temporary folder is left beside it."""
    from infer.quant.calib_job import _write_checkpoint

    model = tmp_path / "model"
    (model / "extra").mkdir(parents=True)
    kept = {"tokenizer.json": "{}", "generation_config.json": '{"do_sample": false}', "chat_template.jinja": "{{ x }}",
            "README.md": "# model"}
    for name in ("config.json", "model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                 "model.safetensors.index.json", "training_args.pt", "quant_config.json", "quantize_config.json"):
        (model / name).write_text("old")
    for name, text in kept.items():
        (model / name).write_text(text)
    raw = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    qc, out = {"quant_method": "awq", "bits": 4}, tmp_path / "out"
    _write_checkpoint(model, out, raw, {"w": torch.ones(2)}, save_file, qc, ("record.json", {"groups": [1]}))
    assert sorted(p.name for p in out.iterdir()) == sorted([*kept, "config.json", "model.safetensors", "record.json"])
    assert all((out / name).read_text() == text for name, text in kept.items())
    assert json.loads((out / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"],
                                                             "torch_dtype": "float16", "dtype": "float16",
                                                             "quantization_config": qc}
    assert json.loads((out / "record.json").read_text()) == {"groups": [1]}
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.ones(2))
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_fp8_triton_backend_on_the_cpu_and_a_one_position_context_are_config_errors(tiny_model: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="fp8.backend=triton runs Triton kernels, which need a CUDA device"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", quant="fp8",
                            plugin_options={"fp8": {"backend": "triton"}}))
    with pytest.raises(ConfigError, match="max-model-len must be >= 2"):  # fp8 KV calibration would overrun it
        Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache_dtype="fp8", max_model_len=1))


@pytest.mark.parametrize("options, message", [({"skinny_gemm_rows": 8}, "--skinny-gemm-rows runs a Triton kernel"),
                                              ({"fused_ops": True}, "--fused-ops runs Triton kernels")])
def test_triton_only_options_on_the_cpu_are_config_errors(tiny_model: Path, monkeypatch, options, message) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=message):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", **options))


def test_the_gate_up_search_measures_the_mlps_output(tiny_model: Path, plugins: PluginManager) -> None:
    """As AutoAWQ measures the MLP block: the gate_up group's error is that of down(silu(gate) * up), gate and up
    quantized with the candidate scales, down in float, here computed from the definition."""
    from infer.quant import awq
    from infer.quant.calibrate import mlp_head, search_scale

    loaded = load_model(EngineConfig(model=str(tiny_model), device="cpu", fuse_projections=False).validate(),
                        plugins, tiny_model)
    mlp = loaded.model.model.layers[1].mlp
    g = torch.Generator().manual_seed(13)
    x = torch.randn(96, mlp.gate_proj.in_features, generator=g)
    x[:, [3, 17]] *= 12
    gate, up, down = (m.weight.detach().float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    found = search_scale(x, x.abs().mean(dim=0), [gate, up], 32, 10, duo=True,
                         head=mlp_head(loaded.model.model.layers[1]))

    def mlp_error(s: torch.Tensor) -> float:
        q = [awq.fake_quantize_rtn(w * s, 32) / s for w in (gate, up)]
        ours = (torch.nn.functional.silu(x @ q[0].t()) * (x @ q[1].t())) @ down.t()
        theirs = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
        return float((ours - theirs).pow(2).mean())

    assert found.rtn_error == pytest.approx(mlp_error(torch.ones(x.shape[1])), rel=1e-4)
    assert found.error == pytest.approx(mlp_error(found.scales), rel=1e-4) and found.error <= found.rtn_error


@pytest.mark.parametrize("fuse", [False, True])
def test_the_mlp_head_is_the_mlp_of_a_model_with_biases(tiny_model: Path, tmp_path: Path, plugins: PluginManager,
                                                        fuse: bool) -> None:
    """mlp_head maps the gate and up outputs (no bias, side by side) to HF LlamaMLP's output (mlp_bias true) less
    the down projection's bias, which cancels in every error the search takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.quant.calibrate import mlp_head

    torch.manual_seed(14)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, mlp_bias=True,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    mlp = hf.model.layers[0].mlp
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(linear.bias, std=0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, tmp_path / name)
    loaded = load_model(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                                     fuse_projections=fuse).validate(), plugins, tmp_path)
    x = torch.randn(24, 64)
    y = torch.cat([x @ mlp.gate_proj.weight.t(), x @ mlp.up_proj.weight.t()], dim=-1)
    with torch.no_grad():
        expected = mlp(x) - mlp.down_proj.bias
    assert torch.allclose(mlp_head(loaded.model.model.layers[0])(y), expected, atol=1e-4, rtol=1e-4)


def test_calibration_searches_gate_up_on_the_mlps_output(tiny_model: Path, tmp_path: Path, plugins: PluginManager,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate_awq hands the gate_up search a head that turns gate and up outputs into the MLP's output, down(silu(
    gate) * up) with the checkpoint's own down weight (computed here from its tensors), and no head to the others."""
    from infer.quant import calibrate

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    seen: list[tuple[int, torch.Tensor | None]] = []  # per search: its linears, its head's output on x's outputs
    search = calibrate.search_scale

    def spy(rows: torch.Tensor, stat: torch.Tensor, weights: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        head = args[4] if len(args) > 4 else kwargs.get("head")
        seen.append((len(weights), None if head is None else head(x @ torch.cat(weights).float().t()).clone()))
        return search(rows, stat, weights, *args, **kwargs)

    monkeypatch.setattr(calibrate, "search_scale", spy)
    calibrate_awq(tiny_model, tmp_path / "awq", CALIB, plugins=plugins)
    assert [n for n, out in seen if out is not None] == [2, 2]  # the gate_up group of each layer
    original = load_file(str(tiny_model / "model.safetensors"))
    for layer, out in enumerate(out for _, out in seen if out is not None):
        gate, up, down = (original[f"model.layers.{layer}.mlp.{p}_proj.weight"].float() for p in ("gate", "up", "down"))
        expected = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
