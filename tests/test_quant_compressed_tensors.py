"""A checkpoint compressed by the ``compressed-tensors`` library (FP8 and FP8_DYNAMIC presets, pack-quantized int4/8)
loads in infer with the same weights as the library's own decompression."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")

from safetensors.torch import load_file, save_file  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.models.layers import Linear, UnquantizedMethod  # noqa: E402
from infer.plugins.fp8 import build_fp8  # noqa: E402
from infer.quant import fp8  # noqa: E402
from infer.quant.fp8_method import Fp8LinearMethod  # noqa: E402
from infer.quant.w8a16_method import W8A16LinearMethod  # noqa: E402

pytestmark = pytest.mark.compressed_tensors


def compress_tiny_llama(folder: Path, preset: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantize a tiny random Llama with ``preset`` and save it compressed; return the library's decompressed
    weights by module path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(dtype)
    compress_and_save(model, folder, preset)
    return {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def compress_and_save(model: torch.nn.Module, folder: Path, preset: str) -> None:
    """Quantize an HF model with ``preset`` (lm_head ignored) and save it compressed to ``folder``. ``model`` is left
    decompressed, running the library's own fake-quantized forward (the emulation reference)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    qconfig = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                 ignore=["lm_head"], format="float-quantized")
    apply_quantization_config(model, qconfig)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.data  # min/max calibration, what the library's memoryless observer computes
        if scheme.weights.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, _ = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.03)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    compressor.decompress_model(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC"])
def test_compressed_tensors_checkpoint_loads_with_the_same_weights(tmp_path: Path, preset: str,
                                                                   dtype: torch.dtype) -> None:
    decompressed = compress_tiny_llama(tmp_path, preset, dtype)
    qc: dict[str, Any] = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    method = build_fp8(EngineConfig(), qc)
    assert isinstance(method, Fp8LinearMethod)
    expected_scheme = fp8.STATIC if preset == "FP8" else fp8.DYNAMIC
    tensors = load_file(str(tmp_path / "model.safetensors"))
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        if owner in decompressed:
            by_module.setdefault(owner, {})[attr] = tensor
    assert len(by_module) == 8  # q k v o gate up down, and lm_head
    for prefix, state in by_module.items():
        out_features, in_features = decompressed[prefix].shape
        layer = Linear(in_features, out_features, False, prefix, method, dtype)
        for attr, tensor in state.items():
            layer.load(attr, tensor)
        layer.method.process_after_loading(layer)
        if prefix == "lm_head":
            assert isinstance(layer.method, UnquantizedMethod)
            assert torch.equal(layer.weight, decompressed[prefix])
            continue
        assert layer.fp8_scheme == expected_scheme
        # one rounding of an exact fp32 product: equal to the library's product in the checkpoint dtype
        ours = fp8.dequantize(layer.weight, layer.weight_scale).to(dtype)
        assert torch.equal(ours, decompressed[prefix]), prefix
        if preset == "FP8":
            assert torch.equal(layer.input_scale, state["input_scale"].float().reshape(1))


WEIGHT_ONLY = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}


@pytest.mark.parametrize("groups", [
    [("FP8_DYNAMIC", ["Linear"]), ("FP8", ["re:.*down_proj$"])],  # a pattern beats the class name, in either order
    [("FP8", ["re:.*down_proj$"]), ("FP8_DYNAMIC", ["Linear"])],
    [("FP8", ["re:.*mlp.*"]), ("FP8_DYNAMIC", ["re:.*_proj$"]), (WEIGHT_ONLY, ["model.layers.0.mlp.up_proj"])],
    [("FP8", ["Linear", "re:.*q_proj$"]), ("FP8_DYNAMIC", ["re:.*q_proj$"])],  # a target in two groups
    [("FP8_DYNAMIC", ["Linear"]), ("FP8", [r"re:mlp\.down_proj$"])],  # re.match: a pattern matches from the start
])
def test_overlapping_groups_resolve_as_the_library_resolves_them(groups: list[tuple[Any, list[str]]]) -> None:
    """When several groups target one linear, the library ranks the matches (exact path, patterns, class name);
    the group order in config.json decides nothing. infer must pick the scheme the library applied."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from transformers import LlamaConfig, LlamaForCausalLM

    def scheme(spec: Any, targets: list[str]) -> QuantizationScheme:
        if isinstance(spec, str):
            return preset_name_to_scheme(spec, targets)
        return QuantizationScheme(targets=targets, weights=QuantizationArgs(**spec))

    qconfig = QuantizationConfig(config_groups={f"group_{i}": scheme(s, t) for i, (s, t) in enumerate(groups)},
                                 ignore=["lm_head"], format="float-quantized")
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    apply_quantization_config(model, qconfig)
    ours = fp8.parse_compressed_tensors({**qconfig.model_dump(mode="json"), "quant_method": "compressed-tensors",
                                       "quantization_status": "compressed"})
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        lib, mine = module.quantization_scheme, ours.scheme_for(name)
        acts = lib.input_activations
        expected = fp8.Fp8Scheme(lib.weights.strategy, None if acts is None else acts.strategy,
                                 True if acts is None else bool(acts.dynamic))
        assert mine == expected, name


# ---------------------------------------------------------------- pack-quantized int4 and int8 (W4A16, W8A16)
def int_weights(group_size: int | None, symmetric: bool, bits: int = 4) -> dict[str, Any]:
    """The library's int weight arguments (``group_size`` None: per channel)."""
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size else "channel",
            "group_size": group_size}


def compress_packed(model: torch.nn.Module, folder: Path, groups: list[tuple[Any, list[str]]]) -> None:
    """Quantize ``model``'s linears (lm_head ignored) with the library, each by the group of (:func:`int_weights`,
    or a whole QuantizationScheme such as an FP8 preset's, and targets) whose target the library picks for it
    (min/max calibration per group, what its memoryless observer computes), and save them compressed: int groups
    pack-quantized, others as the library infers (mixed-precision beside int ones). ``model`` is left decompressed,
    running the library's own fake-quantized forward: the reference."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    uniform = all(isinstance(spec, dict) for spec, _ in groups)
    qconfig = QuantizationConfig(config_groups={
        f"group_{i}": QuantizationScheme(targets=targets, weights=QuantizationArgs(**spec))
        if isinstance(spec, dict) else spec for i, (spec, targets) in enumerate(groups)},
        ignore=["lm_head"], **({"format": "pack-quantized"} if uniform else {}))
    apply_quantization_config(model, qconfig)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w, args = module.weight.data, module.quantization_scheme.weights
        grouped = w.reshape(w.shape[0], -1, args.group_size or w.shape[1])  # [out, groups, group]
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if not args.symmetric:
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized" if uniform else None)
    compressor.compress_model(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    compressor.decompress_model(model)


@pytest.mark.parametrize("group_size, symmetric, bits", [
    (32, True, 4), (32, False, 4), (None, True, 4), (64, False, 4), (32, True, 8), (None, True, 8), (64, False, 8),
], ids=["W4A16-g32", "W4A16_ASYM-g32", "W4A16-channel", "W4A16_ASYM-g64", "W8A16-g32", "W8A16-channel",
        "W8A16_ASYM-g64"])
def test_pack_quantized_checkpoint_greedy_equals_the_library_emulation(
        group_size: int | None, symmetric: bool, bits: int, tiny_model: Path, tmp_path: Path) -> None:
    """(The library no longer writes activation order "group", whose weight_g_idx tests/test_quant_gptq.py loads.)"""
    engine = greedy_equals_the_library_emulation(tiny_model, tmp_path, [(int_weights(group_size, symmetric, bits),
                                                                         ["Linear"])])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in tensors) is not symmetric
    assert isinstance(engine.loaded.quant, W8A16LinearMethod) is (bits == 8)


def test_a_checkpoint_mixing_int4_and_int8_groups_loads_each_linear_by_its_group(tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    """llm-compressor's mixed precision: down_proj at W8A16, layer 1's attention asymmetric int4 per channel (a
    target of two groups is the later one's), the rest W4A16 in groups of 32 (the class-name target, which the
    patterns outrank)."""
    groups = [(int_weights(32, True), ["Linear", r"re:.*layers\.1\.self_attn\..*"]),
              (int_weights(64, True, 8), ["re:.*down_proj$"]),
              (int_weights(None, False), [r"re:.*layers\.1\.self_attn\..*"])]
    engine = greedy_equals_the_library_emulation(tiny_model, tmp_path, groups)
    methods = {m.prefix.removeprefix("model.layers."): m.method for m in engine.loaded.model.modules()
               if isinstance(m, Linear)}
    assert isinstance(methods["0.mlp.down_proj"], W8A16LinearMethod) and methods["0.mlp.down_proj"].group_size == 64
    assert methods["1.mlp.down_proj"] is methods["0.mlp.down_proj"] is not methods["0.mlp.up_proj"]
    assert not isinstance(methods["1.self_attn.o_proj"], W8A16LinearMethod)
    assert methods["1.self_attn.o_proj"].group_size == -1 and methods["0.self_attn.o_proj"].group_size == 32


def greedy_equals_the_library_emulation(tiny_model: Path, folder: Path, groups: list[tuple[Any, list[str]]]) -> Any:
    """Compress ``tiny_model`` by ``groups`` (:func:`compress_packed`) into ``folder``; assert infer's greedy tokens
    equal those of the library's emulated forward on two prompts; return the engine."""
    import shutil

    from transformers import AutoModelForCausalLM

    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    compress_packed(hf, folder, groups)
    assert load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.down_proj.weight_packed"].dtype == \
        torch.int32
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, folder / name)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=32))
    assert engine.loaded.quant is not None and engine.loaded.quant.name == "compressed-tensors"
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    for prompt in (torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (12, 7)):
        ids, reference = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                reference.append(int(hf(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([reference[-1:]])], dim=1)
        assert engine.generate([prompt], params)[0].outputs[0].token_ids == reference
    return engine


def test_a_non_uniform_checkpoint_runs_its_fp8_groups_beside_its_int_ones(tiny_model: Path, tmp_path: Path) -> None:
    """llm-compressor's non-uniform quantization: attention at FP8_DYNAMIC (float-quantized), the MLP at W4A16
    (pack-quantized), down_proj at W8A16, saved as the library's mixed-precision format; each linear loads by its
    group's format and scheme, and greedy decoding follows the library's emulated forward."""
    from compressed_tensors.quantization import preset_name_to_scheme

    fp8_attention = preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*self_attn\..*"])
    groups = [(int_weights(32, True), [r"re:.*mlp\..*"]), (int_weights(64, True, 8), ["re:.*down_proj$"]),
              (fp8_attention, [r"re:.*self_attn\..*"])]
    engine = greedy_equals_the_library_emulation(tiny_model, tmp_path, groups)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    methods = {m.prefix.removeprefix("model.layers."): m.method for m in engine.loaded.model.modules()
               if isinstance(m, Linear)}
    assert isinstance(methods["0.self_attn.q_proj"], Fp8LinearMethod) and methods["0.self_attn.q_proj"] is \
        methods["1.self_attn.o_proj"]
    assert isinstance(methods["1.mlp.down_proj"], W8A16LinearMethod)
    assert methods["0.mlp.up_proj"].group_size == 32 and engine.loaded.quant is methods["0.mlp.up_proj"]


def test_weights_without_symmetric_take_the_librarys_default() -> None:
    """A group whose weights omit ``symmetric`` is read as compressed-tensors reads it (QuantizationArgs' default)."""
    from compressed_tensors.quantization import QuantizationArgs

    from infer.quant.pack_quantized import parse_pack_quantized

    weights = {key: value for key, value in int_weights(32, True).items() if key != "symmetric"}
    config = parse_pack_quantized({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                   "quantization_status": "compressed", "ignore": ["lm_head"],
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}})
    assert config.scheme_for("model.layers.0.mlp.up_proj").symmetric is QuantizationArgs(**weights).symmetric
