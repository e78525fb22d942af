"""Block-wise FP8 checkpoints (quant_method "fp8": DeepSeek-V3, the Qwen3 FP8 releases). transformers is the
producer (its FineGrainedFP8 quantizer writes the checkpoints) and the reference: its dequantization gives the
weights, and its model on those weights, with each linear's input rounded to fp8 per token and group as the
format's dynamic activations are (written here from the format, :func:`fake_quantized_input`), gives the tokens."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import loaded_linear, recomputed_greedy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from infer import LLM  # noqa: E402
from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import CheckpointError, ConfigError  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from infer.kernels import fp8_block as fp8_block_kernels  # noqa: E402
from infer.kernels.fp8_block import per_token_group_quant, w8a8_block_gemm  # noqa: E402
from infer.models.layers import Linear  # noqa: E402
from infer.plugins.fp8 import build_fp8  # noqa: E402
from infer.quant.fp8 import FP8_DTYPE  # noqa: E402
from infer.quant.fp8_block import (BlockFp8Config, block_gemm_reference, dequantize_blocks, k_tile,  # noqa: E402
                                   parse_block_fp8, quantize_per_token_group)
from infer.quant.fp8_block_method import BlockFp8LinearMethod  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK = (16, 32)  # the tiny models' sizes are multiples of it; real checkpoints use [128, 128]


def hf_block_quantize(src: Path, dst: Path, block: tuple[int, int] | None, skip: list[str] | None = None,
                      scale_dtype: torch.dtype = torch.float32) -> Path:
    """``src`` quantized by transformers' FineGrainedFP8 quantizer (every projection but lm_head and ``skip``),
    with transformers' own quantization_config; scales stored in ``scale_dtype`` (Qwen3's releases use bf16)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.utils.quantization_config import FineGrainedFP8Config

    qconfig = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=skip)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(qconfig))
    shutil.copytree(src, dst)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight") and should_convert_module(module, (skip or []) + ["lm_head"]):
            state |= {k: v.to(scale_dtype) if k.endswith("_scale_inv") else v
                      for k, v in quantize.convert({name: tensor}).items()}
        else:
            state[name] = tensor
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = json.loads(qconfig.to_json_string(use_diff=False))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def fake_quantized_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...], group: int | None
                         ) -> tuple[torch.Tensor, ...]:
    """A forward pre-hook: the input rounded to e4m3 per token and per ``group`` features (None: the whole token;
    scale amax / 448)."""
    x = args[0]
    shape, k = x.shape, x.shape[-1]
    group = group or k
    padded = torch.nn.functional.pad(x.reshape(-1, k).float(), (0, -k % group)).unflatten(-1, (-1, group))
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    rounded = (padded / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale
    return (rounded.flatten(-2)[:, :k].reshape(shape).to(x.dtype),)


def hf_reference_greedy(path: Path, prompt: list[int], group: int) -> list[int]:
    """transformers' model on the checkpoint at ``path`` (dequantized on load on a CPU), each FP8 linear's input
    fake-quantized: greedy tokens (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    fp8_layers = {n.removesuffix(".weight") for n, t in load_file(str(path / "model.safetensors")).items()
                  if t.dtype == FP8_DTYPE}
    for name, module in model.named_modules():
        if name in fp8_layers:
            module.register_forward_pre_hook(lambda m, a: fake_quantized_input(m, a, group))
    return recomputed_greedy(model, prompt, GREEDY.max_tokens)


# ---------------------------------------------------------------- the format
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_transformers_dequantization(tiny_model: Path, tmp_path: Path,
                                                   scale_dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    path = hf_block_quantize(tiny_model, tmp_path / "fp8", BLOCK, scale_dtype=scale_dtype)
    hf = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).named_modules())
    method = build_fp8(EngineConfig(), json.loads((path / "config.json").read_text())["quantization_config"])
    assert isinstance(method, BlockFp8LinearMethod)
    tensors = load_file(str(path / "model.safetensors"))
    checked = 0
    for name, tensor in tensors.items():
        if not name.endswith("weight_scale_inv"):
            continue
        prefix = name.removesuffix(".weight_scale_inv")
        weight = tensors[f"{prefix}.weight"]
        layer = Linear(weight.shape[1], weight.shape[0], False, prefix, method, torch.float32)
        layer.load("weight", weight)
        layer.load("weight_scale_inv", tensor)
        method.process_after_loading(layer)
        assert layer.fp8_block == BLOCK
        assert torch.equal(dequantize_blocks(layer.weight, layer.weight_scale_inv, BLOCK), hf[prefix].weight), prefix
        checked += 1
    assert checked == 2 * 7  # q k v o gate up down in each of 2 layers


def test_partial_edge_blocks_dequantize_as_transformers_does() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = (torch.randn(40, 72) * 50).to(FP8_DTYPE)
    scale = torch.rand(3, 3) + 0.01  # ceil(40 / 16) x ceil(72 / 32): the last row and column blocks are partial
    expected = _dequantize_fp8_weight(weight, scale, list(BLOCK), torch.float32)
    assert torch.equal(dequantize_blocks(weight, scale, BLOCK), expected)


def test_per_token_group_quantization_rounds_each_group_on_its_own_scale() -> None:
    x = torch.randn(5, 72) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(32)[:72]
    xq, scale = quantize_per_token_group(x, 32)
    assert scale.shape == (5, 3)
    expected = fake_quantized_input(torch.nn.Identity(), (x,), 32)[0]
    assert torch.equal(xq.float() * scale.repeat_interleave(32, 1)[:, :72], expected)


@pytest.mark.parametrize(("change", "message"), [
    ({"activation_scheme": "static"}, "activation_scheme is 'static'"),
    ({"fmt": "e5m2"}, "fmt is 'e5m2'"),
    ({"scale_fmt": "ue8m0"}, "ue8m0"),
    ({"expert_dtype": "fp4"}, "FP4 experts"),
    ({"modules_to_convert": ["model.embed_tokens"]}, "embeddings"),
    ({"weight_block_size": [128]}, "two positive integers"),
    ({"weight_block_size": [0, 128]}, "two positive integers"),
    ({"weight_block_size": [True, 128]}, "two positive integers"),  # a JSON true is no size
    ({"modules_to_not_convert": "lm_head"}, "a list of module names"),
    ({"modules_to_not_convert": 5}, "a list of module names, got 5"),  # was a TypeError, "a bug in infer"
    ({"modules_to_not_convert": ["lm_head", "("]}, "entry '\\(' is not a valid regular expression"),
])
def test_configs_it_cannot_run_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]} | change
    with pytest.raises(CheckpointError, match=message):
        parse_block_fp8(qc)


@pytest.mark.parametrize("skip", [None, ["lm_head"], ["down_proj"], ["model.layers.1"], ["model.layers.1.mlp.gate"],
                                  [r"model\.layers\.\d+\.self_attn\.(k|v)_proj"]])
def test_modules_to_not_convert_match_as_transformers_matches_them(skip: list[str] | None) -> None:
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = parse_block_fp8({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": skip})
    for name in ("lm_head", "model.layers.1.self_attn.k_proj", "model.layers.11.self_attn.k_proj",
                 "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.up_proj"):
        # transformers leaves lm_head out by default, when the config lists nothing
        assert config.applies_to(name) == should_convert_module(name, skip if skip is not None else ["lm_head"]), name


def test_config_defaults_are_transformers_defaults() -> None:
    """No weight_block_size: transformers' 128 x 128 (an explicit null: one scale per tensor); the activation
    scheme in any case; MiniMax's and AutoFP8's ``ignored_layers`` when modules_to_not_convert is null."""
    from transformers.utils.quantization_config import FineGrainedFP8Config

    for qc in ({"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": None},
               {"quant_method": "fp8", "activation_scheme": "Dynamic", "modules_to_not_convert": None,
                "ignored_layers": ["model.layers.0.mlp"]}):
        hf = FineGrainedFP8Config.from_dict(dict(qc))
        ours = parse_block_fp8(qc)
        assert ours.block == (None if hf.weight_block_size is None else tuple(hf.weight_block_size))
        assert ours.modules_to_not_convert == (None if hf.modules_to_not_convert is None
                                               else tuple(hf.modules_to_not_convert))


def test_the_plugin_refuses_options_a_block_checkpoint_cannot_take() -> None:
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="torch._scaled_mm's block scaling is not wired"):
        build_fp8(EngineConfig(plugin_options={"fp8": {"backend": "scaled_mm"}}), qc)
    with pytest.raises(ConfigError, match="checkpoint is quantized already"):
        build_fp8(EngineConfig(plugin_options={"fp8": {"lm_head": True}}), qc)


# ---------------------------------------------------------------- loading errors and merges
def loaded_layer(method: BlockFp8LinearMethod, tensors: dict[str, torch.Tensor], out: int = 48, inp: int = 64
                 ) -> Linear:
    return loaded_linear(method, tensors, inp, out)


def test_a_layer_missing_its_scales_or_with_wrong_ones_is_named() -> None:
    method = BlockFp8LinearMethod(BlockFp8Config(BLOCK))
    weight = torch.randn(48, 64).to(FP8_DTYPE)
    with pytest.raises(CheckpointError, match="missing weight_scale_inv for layer 'model.layers.0.mlp.up_proj'"):
        loaded_layer(method, {"weight": weight})
    with pytest.raises(CheckpointError, match=r"blocks of 16x32 over a \[48, 64\] weight need \[3, 2\] floats"):
        loaded_layer(method, {"weight": weight, "weight_scale_inv": torch.ones(2, 2)})
    # as many values as the grid, in another shape (made with other blocks, or transposed): it scaled wrong weights
    with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape \(2, 3\).*need \[3, 2\] floats"):
        loaded_layer(method, {"weight": weight, "weight_scale_inv": torch.ones(2, 3)})
    for one in (torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([[0.5]])):  # one scale per tensor, as stored
        whole = loaded_layer(BlockFp8LinearMethod(BlockFp8Config(None)), {"weight": weight, "weight_scale_inv": one})
        assert whole.weight_scale_inv.shape == (1, 1) and whole.weight_scale_inv.item() == 0.5
    with pytest.raises(CheckpointError, match="has a float weight but also weight_scale_inv"):
        loaded_layer(method, {"weight": torch.randn(48, 64), "weight_scale_inv": torch.ones(3, 2)})
    with pytest.raises(CheckpointError, match="weight is torch.int8"):
        loaded_layer(method, {"weight": torch.zeros(48, 64, dtype=torch.int8)})
    for one_row in (weight[:1], torch.randn(1, 64)):  # fp8 or float: never broadcast over the layer's rows
        with pytest.raises(CheckpointError, match=r"shape mismatch for model.layers.0.mlp.up_proj.weight: "
                                                  r"checkpoint \(1, 64\), model \(48, 64\)"):
            loaded_layer(method, {"weight": one_row, "weight_scale_inv": torch.ones(3, 2)})


@pytest.mark.parametrize(("sizes", "merges"), [((32, 16, 16), True), ((24, 24), False),
                                                ((32, 20), True)])  # the last part may end in a partial block
def test_parts_merge_only_along_whole_row_blocks(sizes: tuple[int, ...], merges: bool) -> None:
    method = BlockFp8LinearMethod(BlockFp8Config(BLOCK), backend="emulate")
    parts = [loaded_layer(method, {"weight": (torch.randn(n, 64) * 100).to(FP8_DTYPE),
                                   "weight_scale_inv": torch.rand(-(-n // 16), 2) + 0.01}, out=n) for n in sizes]
    merged = Linear.merged(parts, "model.layers.0.mlp.merged")
    assert (merged is not None) == merges
    if merged is not None:
        x = torch.randn(3, 64)
        assert torch.equal(merged(x), torch.cat([p(x) for p in parts], dim=1))


def test_each_layer_gets_a_gemm_that_can_run_it() -> None:
    """auto emulates on the CPU; an explicit triton is checked per layer at load: the Triton GEMM's K-tile must
    divide the scale group (16 at least in the interpreter, 32 on a GPU)."""
    auto = BlockFp8LinearMethod(BlockFp8Config((16, 32)))
    assert loaded_layer(auto, {"weight": torch.randn(48, 64).to(FP8_DTYPE), "weight_scale_inv": torch.ones(3, 2)}
                        ).fp8_backend == "emulate"
    triton = BlockFp8LinearMethod(BlockFp8Config((16, 8)), backend="triton")
    with pytest.raises(ConfigError, match="cannot run layer 'model.layers.0.mlp.up_proj': its weight scales group 8 "
                                          "inputs, and the Triton GEMM needs a multiple of 16"):
        Linear(64, 48, False, "model.layers.0.mlp.up_proj", triton, torch.float32)
    at_minimum = BlockFp8LinearMethod(BlockFp8Config((16, 16)), backend="triton")  # 16: the interpreter's minimum
    assert Linear(64, 48, False, "model.layers.0.mlp.up_proj", at_minimum, torch.float32).fp8_backend == "triton"


def test_k_tile_is_the_largest_power_of_two_up_to_128_dividing_the_group() -> None:
    for group in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384):
        largest = max(t for t in (1, 2, 4, 8, 16, 32, 64, 128) if group % t == 0)
        assert k_tile(group, native=True) == (largest if largest >= 32 else None), group
        assert k_tile(group, native=False) == (largest if largest >= 16 else None), group


def test_an_explicit_emulate_backend_is_kept_where_triton_could_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8.backend=emulate is obeyed on a GPU with FP8 tensor cores too, where auto picks the Triton GEMM."""
    from infer.quant import fp8_block_method

    monkeypatch.setattr(fp8_block_method, "has_fp8_tensor_cores", lambda device: True)
    for backend, expected in (("emulate", "emulate"), ("auto", "triton")):
        method = BlockFp8LinearMethod(BlockFp8Config((16, 32)), backend, torch.device("cuda"))
        assert Linear(64, 48, False, "model.layers.0.mlp.up_proj", method, torch.float32).fp8_backend == expected


# ---------------------------------------------------------------- the Triton kernels
@pytest.mark.parametrize("group", [32, 96])  # 96: one group per row, which the per-token kernel quantizes
def test_per_token_group_quant_kernel_matches_the_reference(device: torch.device, group: int) -> None:
    x = torch.randn(6, 72, device=device) * torch.tensor([1.0, 300.0, 1e-3], device=device).repeat_interleave(32)[:72]
    x[2, 40:64] = 0.0  # an all-zero group still gets a positive scale
    x[4] = 0.0
    expected, expected_scale = quantize_per_token_group(x.cpu(), group)
    # the interpreter's fp32 -> fp8 cast rounds wrongly: the kernel writes the scaled fp32 values, torch casts them
    out_dtype = torch.float32 if device.type == "cpu" else FP8_DTYPE
    values, scale = per_token_group_quant(x, group, out_dtype)
    assert torch.equal(scale.cpu(), expected_scale)
    assert torch.equal(values.cpu().to(FP8_DTYPE).view(torch.uint8), expected.view(torch.uint8))


def test_per_token_group_quant_kernel_with_groups_that_are_not_powers_of_two(device: torch.device) -> None:
    """Groups of 48 (a block of 64 lanes each): a group's scale and values come from its own 48 columns, not from
    the first 16 of the next group."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 144, generator=g) * torch.tensor([1.0, 50.0, 0.01]).repeat_interleave(48)
    expected, expected_scale = quantize_per_token_group(x, 48)
    out_dtype = torch.float32 if device.type == "cpu" else FP8_DTYPE
    values, scale = per_token_group_quant(x.to(device), 48, out_dtype)
    assert scale.shape == (4, 3) and torch.equal(scale.cpu(), expected_scale)
    assert torch.equal(values.cpu().to(FP8_DTYPE).view(torch.uint8), expected.view(torch.uint8))


def test_per_token_group_quant_kernel_keeps_nan_and_inf_groups_as_torch_does(device: torch.device) -> None:
    """NaN in, NaN out, per group: tl.max returns the operand that is not NaN, which would give a NaN group a finite
    scale and finite fp8 values; an inf group's scale is inf; a finite group beside them is untouched."""
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0, 1.0, float("inf"), -1.0, 0.5, 5.0, -5.0, 2.5, 1.0]])
    expected, expected_scale = quantize_per_token_group(x, 4)
    out_dtype = torch.float32 if device.type == "cpu" else FP8_DTYPE
    values, scale = per_token_group_quant(x.to(device), 4, out_dtype)
    torch.testing.assert_close(scale.cpu(), expected_scale, equal_nan=True, rtol=0, atol=0)
    assert scale[0, 0].isnan() and scale[0, 1].isinf() and scale[0, 2].isfinite()
    torch.testing.assert_close(values.cpu().to(FP8_DTYPE).float(), expected.float(), equal_nan=True, rtol=0, atol=0)


def test_block_gemm_refuses_scales_that_do_not_fit_its_blocks(device: torch.device) -> None:
    """Scales of another block shape would be read out of bounds, or with the wrong group for most tiles."""
    a = torch.zeros(3, 64, device=device).to(FP8_DTYPE)
    b = torch.zeros(40, 64, device=device).to(FP8_DTYPE)
    a_scale, b_scale = torch.ones(3, 2, device=device), torch.ones(3, 2, device=device)  # blocks of (16, 32)
    w8a8_block_gemm(a, a_scale, b, b_scale, (16, 32), torch.float32)
    for bad_a, bad_b in ((a_scale[:, :1], b_scale), (a_scale, b_scale[:2]), (a_scale, b_scale[:, :1])):
        with pytest.raises(ValueError, match="do not fit blocks"):
            w8a8_block_gemm(a, bad_a, b, bad_b, (16, 32), torch.float32)


@pytest.mark.parametrize(("m", "n", "k", "block"), [(1, 48, 64, (16, 32)), (5, 40, 72, (16, 32)),
                                                    (33, 96, 128, (32, 64)), (3, 20, 96, (20, 96))])
def test_block_gemm_kernel_matches_the_reference(device: torch.device, m: int, n: int, k: int,
                                                 block: tuple[int, int]) -> None:
    """Partial edge blocks on both sides; a block wider than the K-tile ((32, 64): two tiles share a scale); a
    per-tensor-like block (20, 96) whose sides are not powers of two."""
    g = torch.Generator().manual_seed(m)
    xq, x_scale = quantize_per_token_group(torch.randn(m, k, generator=g), block[1])
    weight = (torch.randn(n, k, generator=g) * 100).to(FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.01
    expected = block_gemm_reference(xq, x_scale, weight, scale, block, torch.float32)
    out = w8a8_block_gemm(xq.to(device), x_scale.to(device), weight.to(device), scale.to(device), block,
                          torch.float32)
    # fp32 sums in another order: each differs by at most k roundings of the sum of the terms' magnitudes
    magnitudes = block_gemm_reference(xq.abs(), x_scale, weight.abs(), scale, block, torch.float32)
    assert bool(((out.cpu() - expected).abs() <= k * 2.0**-24 * magnitudes).all())


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize(("arch", "skip", "scale_dtype"), [
    ("llama", None, torch.float32),
    ("llama", ["down_proj", "model.layers.1.self_attn"], torch.bfloat16),
    ("qwen2", None, torch.bfloat16),  # q/k/v biases beside fp8 weights
])
def test_engine_greedy_equals_transformers_on_the_same_fp8_arithmetic(
        arch: str, skip: list[str] | None, scale_dtype: torch.dtype, tmp_path: Path,
        checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture) -> None:
    path = hf_block_quantize(checkpoint(arch), tmp_path / "fp8", BLOCK, skip, scale_dtype)
    with caplog.at_level(logging.WARNING, logger="infer"):
        llm = LLM(model=str(path), device="cpu", num_kv_blocks=32)
    assert llm.engine.loaded.quant is not None and isinstance(llm.engine.loaded.quant, BlockFp8LinearMethod)
    for prompt in ([5, 9, 100, 7, 300, 41, 8, 2], [700, 3, 3, 90]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_reference_greedy(path, prompt, BLOCK[1])
    assert "block-wise FP8 matmuls are emulated" in caplog.text


def test_float_weights_under_an_fp8_config_load_unquantized_as_transformers_loads_them(
        tiny_model: Path, tmp_path: Path, hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """A layer the config quantizes whose checkpoint weight is a float tensor (here every one) runs unquantized."""
    path = tmp_path / "declared"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=32)
    prompt = [5, 9, 100, 7]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(tiny_model, prompt, GREEDY.max_tokens)


@pytest.mark.gpu
def test_the_triton_path_on_cuda_generates_what_transformers_does(tiny_model: Path, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = hf_block_quantize(tiny_model, tmp_path / "fp8", BLOCK)
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_kv_blocks=32)
    for prompt in ([5, 9, 100, 7, 300, 41, 8, 2], [700, 3, 3, 90]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_reference_greedy(path, prompt, BLOCK[1])


# ---------------------------------------------------------------- block-wise FP8 experts
def fp8_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                          experts: torch.Tensor, group13: int | None, group2: int | None) -> torch.Tensor:
    """The definition on dequantized float weights, expert by expert over its tokens (in token order, as
    transformers' experts loop runs), each expert's input fake-quantized per token and group (of ``group13``
    features for gate/up, ``group2`` for down)."""
    size, out = w2.shape[2], torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tokens, slots = torch.where(experts == e)
        if not len(tokens):
            continue
        h = fake_quantized_input(torch.nn.Identity(), (x[tokens],), group13)[0] @ w13[e].t()
        act = torch.nn.functional.silu(h[:, :size]) * h[:, size:]
        y = fake_quantized_input(torch.nn.Identity(), (act,), group2)[0] @ w2[e].t()
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def random_fp8_weights(num_experts: int, rows: int, cols: int, block: tuple[int, int], gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 [E, rows, cols] with random block scales, and its dequantized float copy."""
    weight = (torch.randn(num_experts, rows, cols, generator=gen) * 100).to(FP8_DTYPE)
    scale = torch.rand(num_experts, -(-rows // block[0]), -(-cols // block[1]), generator=gen) * 2e-3 + 1e-4
    return weight, scale, torch.stack([dequantize_blocks(w, s, block) for w, s in zip(weight, scale)])


@pytest.mark.parametrize("blocks", [((16, 64), (16, 64)), ((1, 64), (1, 96))], ids=["blocks", "channels"])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 8, 2), (5, 4, 3), (37, 8, 2), (0, 4, 2)])
def test_fp8_experts_equal_the_definition(device: torch.device, tokens: int, num_experts: int, top_k: int,
                                          blocks: tuple[tuple[int, int], tuple[int, int]]) -> None:
    """The torch loop (the CPU path) and the Triton grouped GEMMs against the definition, with block scales (a
    partial K-group in the down projection, I = 96) and with per-channel ones (compressed-tensors, --quant fp8).
    The interpreter's fp8 cast rounds wrongly (see kernels/fp8_block.py), so on the CPU the fused path runs with
    torch's quantization in its place; on CUDA as it is."""
    from infer.kernels.fused_moe import Fp8ExpertScales, fused_experts, grouped_gemm, sort_by_expert
    from infer.models.moe import ExpertsFp8, MoeConfig, SparseMoe

    gen = torch.Generator().manual_seed(tokens)
    (hidden, size), (block13, block2) = (64, 96), blocks
    w13, s13, w13_float = random_fp8_weights(num_experts, 2 * size, hidden, block13, gen)
    w2, s2, w2_float = random_fp8_weights(num_experts, hidden, size, block2, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, experts = torch.topk(torch.softmax(torch.randn(tokens, num_experts, generator=gen), -1), top_k, dim=-1)
    ref = fp8_experts_reference(x, w13_float, w2_float, weights, experts, block13[1], block2[1])
    moe = MoeConfig(num_experts, top_k, size, False, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    layer = SparseMoe(moe, hidden, torch.float32, lambda g, u: torch.nn.functional.silu(g) * u, fused=False,
                      fp8=ExpertsFp8(block13, block2))
    for name, tensor in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
        getattr(layer, name).copy_(tensor)
    loop = layer.experts_loop(x, weights, experts)
    torch.testing.assert_close(loop, ref, atol=1e-4, rtol=1e-4)
    on = {"device": device}
    if device.type == "cuda":
        got = fused_experts(x.to(**on), w13.to(**on), w2.to(**on), weights.to(**on), experts.to(**on),
                            Fp8ExpertScales(s13.to(**on), s2.to(**on), block13, block2)).cpu()
    else:  # the interpreter's fp8 cast rounds wrongly: the same path with torch's quantization
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fp8_block_kernels, "per_token_group_quant",
                          lambda t, group: quantize_per_token_group(t, group))
            got = fused_experts(x, w13, w2, weights, experts, Fp8ExpertScales(s13, s2, block13, block2))
    # other fp32 sums round the down projection's input to fp8 otherwise now and then: a bound, not equality
    assert float((got - loop).norm()) <= 1e-2 * float(loop.norm()) + 1e-6
    if device.type == "cuda":
        return
    # each grouped GEMM on its own, given the same quantized operands, is exact up to fp32 sums
    rows, block_expert = sort_by_expert(experts, num_experts)
    xq, x_scale = quantize_per_token_group(x, block13[1])
    hidden_out = grouped_gemm(xq, w13, rows, block_expert, tokens * top_k, top_k, out_dtype=torch.float32,
                              fp8=(x_scale, s13, block13))
    act = torch.nn.functional.silu(hidden_out[:, :size]) * hidden_out[:, size:]
    aq, a_scale = quantize_per_token_group(act, block2[1])
    y = grouped_gemm(aq, w2, rows, block_expert, tokens * top_k, 1, weights.reshape(-1).contiguous(), torch.float32,
                     fp8=(a_scale, s2, block2), round_to=torch.float32)
    for pair, e in enumerate(experts.flatten().tolist()):  # row r is pair r: token r // top_k, its expert e
        token, row = [pair // top_k], [pair]
        expected = block_gemm_reference(xq[token], x_scale[token], w13[e], s13[e], block13, torch.float32)
        torch.testing.assert_close(hidden_out[row], expected, atol=1e-4, rtol=1e-4)
        expected = block_gemm_reference(aq[row], a_scale[row], w2[e], s2[e], block2, torch.float32)
        torch.testing.assert_close(y[row], expected * weights.flatten()[pair], atol=1e-4, rtol=1e-4)


def channel_rounded(weight: torch.Tensor) -> torch.Tensor:
    """Each row (the last dimension) rounded to e4m3 on its own scale, amax / 448: per-channel FP8."""
    scale = weight.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (weight / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale


def hf_moe_reference_greedy(path: Path, prompt: list[int], group: int | None, round_per_channel: bool = False
                            ) -> list[int]:
    """:func:`hf_reference_greedy` for a MoE model: its experts module's output replaced (a forward hook) by
    :func:`fp8_experts_reference` on transformers' own routing and dequantized expert weights. Every projection is
    FP8 (the router stays float); ``round_per_channel``: a float checkpoint, whose projections' and experts' weights
    are first rounded per channel, as ``--quant fp8`` quantizes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if round_per_channel:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                    param.copy_(channel_rounded(param))
    for name, module in model.named_modules():
        if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, a: fake_quantized_input(m, a, group))
        if name.endswith("mlp.experts"):
            module.register_forward_hook(lambda m, a, out: fp8_experts_reference(
                a[0], m.gate_up_proj, m.down_proj, a[2], a[1], group, group))
    return recomputed_greedy(model, prompt, GREEDY.max_tokens)


def stacked_experts(src: Path, dst: Path, num_layers: int, num_experts: int) -> Path:
    """``src``'s per-expert FP8 tensors in transformers 5's stacked layout (gate_up_proj, down_proj and their
    _scale_inv), as transformers' quantizer writes a model that holds its experts stacked."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for layer in range(num_layers):
        base = f"model.layers.{layer}.mlp.experts"
        for suffix, out in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
            def take(name: str, e: int) -> torch.Tensor:
                return tensors.pop(f"{base}.{e}.{name}.{suffix}")
            tensors[f"{base}.gate_up_proj{out}"] = torch.stack(
                [torch.cat([take("gate_proj", e), take("up_proj", e)]) for e in range(num_experts)])
            tensors[f"{base}.down_proj{out}"] = torch.stack([take("down_proj", e) for e in range(num_experts)])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_a_qwen3_moe_fp8_checkpoint_generates_what_transformers_does(tiny_model_factory: Callable[..., Path],
                                                                     tmp_path: Path, layout: str) -> None:
    """Qwen3-30B-A3B-FP8's layout: per-expert e4m3 weights and scales, the router left in float; and transformers
    5's stacked one."""
    path = hf_block_quantize(tiny_model_factory("qwen3moe"), tmp_path / "fp8", (16, 16))
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    served = path if layout == "per-expert" else stacked_experts(path, tmp_path / "stacked", 2, 4)
    llm = LLM(model=str(served), device="cpu", num_kv_blocks=32)
    for prompt in ([5, 9, 100, 7, 300, 41, 8, 2], [700, 3, 3, 90]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_moe_reference_greedy(path, prompt, 16)


def test_fp8_experts_missing_or_unexpected_scales_are_named(tiny_model_factory: Callable[..., Path],
                                                            tmp_path: Path) -> None:
    path = hf_block_quantize(tiny_model_factory("qwen3moe"), tmp_path / "fp8", (16, 16))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors, e\.g\. \['model\.layers\.1\.mlp\.experts\.2\."
                                              r"up_proj\.weight_scale_inv'\]"):
        LLM(model=str(path), device="cpu", num_kv_blocks=32)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["experts"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="experts.0.down_proj.weight' is float8_e4m3fn, where infer expects "
                                              "float weights"):
        LLM(model=str(path), device="cpu", num_kv_blocks=32)
    save_file({k: v.float() if ".experts." in k else v for k, v in tensors.items()}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="an FP8 scale, but this model's experts are not FP8 in the checkpoint"):
        LLM(model=str(path), device="cpu", num_kv_blocks=32)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": None}  # one scale per tensor
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no weight_block_size .one scale per tensor., which infer's FP8 experts"):
        LLM(model=str(path), device="cpu", num_kv_blocks=32)


@pytest.mark.gpu
def test_fp8_experts_on_cuda_with_graphs_generate_what_transformers_does(tiny_model_factory: Callable[..., Path],
                                                                         tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})  # K-tiles of 32: native fp8 dots
    path = hf_block_quantize(model, tmp_path / "fp8", (16, 32))
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_kv_blocks=32)
    for prompt in ([5, 9, 100, 7, 300, 41, 8, 2], [700, 3, 3, 90]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_moe_reference_greedy(path, prompt, 32)


def compressed_tensors_moe(src: Path, dst: Path) -> Path:
    """``src`` (a float MoE checkpoint with per-expert tensors) as llm-compressor's FP8_DYNAMIC preset writes it:
    every projection's weight in e4m3 with one ``weight_scale`` per output channel [N, 1]; the routers and lm_head
    ignored. The config is the compressed-tensors library's own."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    shutil.copytree(src, dst)
    state = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if name.endswith("_proj.weight") or ".experts." in name:
            scale = tensor.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
            state[name] = (tensor / scale).clamp(-448, 448).to(FP8_DTYPE)
            state[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            state[name] = tensor
    save_file(state, str(dst / "model.safetensors"))
    qconfig = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                                 ignore=["lm_head", r"re:.*\.gate$"], format="float-quantized",
                                 quantization_status="compressed")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {**qconfig.model_dump(mode="json"), "quant_method": "compressed-tensors"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("arch", "source"), [("qwen3moe", "--quant fp8"), ("mixtral", "--quant fp8"),
                                              ("qwen3moe", "--quant fp8 stacked"), ("qwen3moe", "compressed-tensors")])
def test_per_channel_fp8_experts_generate_what_transformers_does(arch: str, source: str, tmp_path: Path,
                                                                 tiny_model_factory: Callable[..., Path]) -> None:
    """``--quant fp8`` on a float MoE checkpoint quantizes its experts per channel as they load (as it does the
    projections), per expert or as transformers 5 stacks them; a compressed-tensors FP8_DYNAMIC checkpoint holds the
    same codes and scales."""
    float_path = tiny_model_factory(arch)
    if source == "--quant fp8 stacked":
        from transformers import AutoModelForCausalLM

        stacked = tmp_path / "stacked"
        AutoModelForCausalLM.from_pretrained(str(float_path), dtype=torch.float32).save_pretrained(
            str(stacked), save_original_format=False)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(float_path / name, stacked / name)
        llm = LLM(model=str(stacked), device="cpu", num_kv_blocks=32, quant="fp8")
    elif source == "--quant fp8":
        llm = LLM(model=str(float_path), device="cpu", num_kv_blocks=32, quant="fp8")
    else:
        llm = LLM(model=str(compressed_tensors_moe(float_path, tmp_path / "ct")), device="cpu", num_kv_blocks=32)
    assert all(moe.fp8 is not None and moe.w13.dtype == FP8_DTYPE for moe in llm.engine.loaded.model.modules()
               if type(moe).__name__ == "SparseMoe")
    for prompt in ([5, 9, 100, 7, 300, 41, 8, 2], [700, 3, 3, 90]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == \
            hf_moe_reference_greedy(float_path, prompt, None, round_per_channel=True)


def test_a_missing_expert_weight_under_quant_fp8_is_named_alone(tmp_path: Path,
                                                                tiny_model_factory: Callable[..., Path]) -> None:
    """--quant fp8 quantizes the experts as they load, scales included: a float checkpoint missing one expert's
    weight is told that one, not scale tensors it never holds."""
    path = tmp_path / "m"
    shutil.copytree(tiny_model_factory("qwen3moe"), path)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    state = load_file(str(path / "model.safetensors"))
    del state[name]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"missing 1 tensors, e\.g\. \['{re.escape(name)}'\]"):
        LLM(model=str(path), device="cpu", num_kv_blocks=32, quant="fp8")


def test_fp8_experts_the_fused_kernels_cannot_run_are_dequantized(caplog: pytest.LogCaptureFixture) -> None:
    """Scale groups of 8 inputs: no K-tile the Triton experts take (as on a GPU below sm89, where Triton has no
    e4m3), so the experts become float on load, the checkpoint's dequantized weights, and say so."""
    from infer.models.moe import ExpertsFp8, MoeConfig, SparseMoe

    gen = torch.Generator().manual_seed(0)
    block = (16, 8)
    w13, s13, w13_float = random_fp8_weights(4, 96, 64, block, gen)
    w2, s2, w2_float = random_fp8_weights(4, 64, 48, block, gen)
    moe = MoeConfig(4, 2, 48, False, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    layer = SparseMoe(moe, 64, torch.float32, lambda g, u: torch.nn.functional.silu(g) * u, fused=True,
                      fp8=ExpertsFp8(block, block))
    for name, tensor in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
        getattr(layer, name).copy_(tensor)
    with caplog.at_level(logging.WARNING, logger="infer"):
        layer.process_after_loading()
    assert "the fused Triton experts cannot run FP8 here" in caplog.text
    assert layer.fp8 is None and not hasattr(layer, "w13_scale")
    assert torch.equal(layer.w13, w13_float) and torch.equal(layer.w2, w2_float)
    # --quant fp8 there: the float experts load as they are, never rounded to e4m3
    layer = SparseMoe(moe, 64, torch.float32, lambda g, u: torch.nn.functional.silu(g) * u, fused=True,
                      fp8=ExpertsFp8(block, block, on_load=True))
    layer.load_expert("mlp", "gate_up_proj", w13_float)
    layer.load_expert("mlp", "down_proj", w2_float)
    layer.process_after_loading()
    assert layer.fp8 is None and torch.equal(layer.w13, w13_float) and torch.equal(layer.w2, w2_float)
