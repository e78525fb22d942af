"""`infer quantize --method gptq` (quant/gptq_calibrate.py): the algorithm against the paper's unblocked form, its
error against round-to-nearest, and the checkpoint it writes read back by this file's own GPTQ reader."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from infer.cli.main import main  # noqa: E402
from infer.core.errors import ConfigError  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from infer.quant.gptq_calibrate import (GptqCalibrationConfig, calibrate_gptq, gptq_quantize,  # noqa: E402
                                        relative_error, rtn_dequantized)

CALIB = GptqCalibrationConfig(group_size=32, num_samples=8, seq_len=64, device="cpu")


def correlated_inputs(n: int, features: int, seed: int) -> torch.Tensor:
    """Inputs with unequal, correlated channels (as activations are): where GPTQ has something to exploit."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) * torch.logspace(0, -1.5, features).unsqueeze(0)
    return torch.randn(n, features, generator=g) @ mix


def round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16).to(torch.float64)
    return torch.where(h < x, torch.nextafter(x.to(torch.float16), torch.tensor(np.inf, dtype=torch.float16))
                       .to(torch.float64), h)


def unblocked_reference(weight: torch.Tensor, hessian: torch.Tensor, group: int, act_order: bool,
                        damp: float, bits: int = 4, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's column-by-column form in float64 (its equation 3, with ``H^-1`` updated by Gaussian elimination
    instead of a Cholesky factor): codes and dequantized weight, in input order. Symmetric: the scale
    ``2 max|w| / (2^bits - 1)``, the zero point ``2^(bits - 1)``; asymmetric (AutoGPTQ's quantizer): the range
    [min(w, 0), max(w, 0)] over ``2^bits - 1``, the zero point ``round(-min / scale)``."""
    max_q = 2**bits - 1
    w, h = weight.double().clone(), hessian.double().clone()
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(w.shape[1])
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    codes, deq = torch.empty_like(w), torch.empty_like(w)
    for j in range(w.shape[1]):
        if j % group == 0 and sym:
            extent = w[:, j: j + group].abs().amax(dim=1)
            scale = round_up_fp16(2 * torch.where(extent > 0, extent, torch.ones_like(extent)) / max_q)
            zero = torch.full_like(scale, 2 ** (bits - 1))
        elif j % group == 0:
            lo, hi = w[:, j: j + group].amin(dim=1).clamp(max=0), w[:, j: j + group].amax(dim=1).clamp(min=0)
            scale = round_up_fp16(torch.where(hi > lo, hi - lo, torch.ones_like(hi)) / max_q)
            zero = torch.round(-lo / scale).clamp(0, max_q)
        codes[:, j] = (torch.round(w[:, j] / scale) + zero).clamp(0, max_q)
        deq[:, j] = (codes[:, j] - zero) * scale
        err = (w[:, j] - deq[:, j]) / hinv[j, j]
        w[:, j:] -= err.unsqueeze(1) * hinv[j, j:].unsqueeze(0)
        hinv -= torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    back = torch.argsort(order)
    return codes[:, back], deq[:, back].float()


@pytest.mark.parametrize("act_order", [False, True])
# the block rounds up to a multiple of the group
@pytest.mark.parametrize("group, block, bits, sym", [(32, 128, 4, True), (64, 32, 4, True), (-1, 48, 4, True),
                                                     (32, 64, 8, True), (32, 64, 4, False), (-1, 48, 8, False)])
def test_blocked_cholesky_gptq_equals_the_papers_unblocked_form(act_order: bool, group: int, block: int,
                                                                bits: int, sym: bool) -> None:
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    x = correlated_inputs(512, 128, seed=1)
    hessian = 2 * x.t() @ x / x.shape[0]
    ours = gptq_quantize(weight, hessian, group, act_order, damp=0.01, block_size=block, bits=bits, sym=sym)
    codes, deq = unblocked_reference(weight, hessian, 128 if group == -1 else group, act_order, 0.01, bits, sym)
    assert (ours.codes == codes.int()).float().mean() > 0.99  # float32 against float64: a rare tie may round apart
    assert relative_error(weight, ours.dequantized(), hessian) == pytest.approx(
        relative_error(weight, deq, hessian), rel=0.03)
    groups = 1 if group == -1 else 128 // group
    assert torch.equal(torch.bincount(ours.g_idx.long(), minlength=groups), torch.full((groups,), 128 // groups))
    in_input_order = torch.equal(ours.g_idx.long(), torch.arange(128) // (128 // groups))
    assert in_input_order == (not act_order or group == -1)  # one group holds every input in any order


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_the_calibration_inputs(act_order: bool) -> None:
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    x = correlated_inputs(1024, 256, seed=3)
    hessian = 2 * x.t() @ x / x.shape[0]
    gptq, rtn = gptq_quantize(weight, hessian, 64, act_order).dequantized(), rtn_dequantized(weight, 64)

    def output_error(approx: torch.Tensor) -> float:  # on the inputs themselves, not through the Hessian
        return float(((x @ (weight - approx).t()).norm() / (x @ weight.t()).norm()) ** 2)

    assert output_error(gptq) < 0.8 * output_error(rtn)
    for approx in (gptq, rtn):  # the report's formula: the same ratio
        assert relative_error(weight, approx, hessian) == pytest.approx(output_error(approx), rel=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_v1_zero_points_are_written_as_gptqmodel_writes_them(bits: int) -> None:
    """Each field less 1 on the whole word: a zero point of 0 borrows from the next field, and this file's reader
    (the whole word plus 1 in every field) gets every zero point back, 0 and the largest included."""
    from infer.quant.gptq_calibrate import v1_zeros

    top = 2**bits - 1
    zeros = torch.tensor([[0, top, 3, 0, 1, 0, top, 7], [5, 0, 0, 0, top, top, 0, 2]], dtype=torch.int32)
    words = v1_zeros(zeros, bits)
    assert words.shape == (2, 8 // (32 // bits)) and words.dtype == torch.int32
    ones = np.uint32(sum(1 << (bits * i) for i in range(32 // bits)))
    back = words.numpy().view(np.uint32) + ones
    fields = np.stack([(back >> np.uint32(bits * i)) & np.uint32(top) for i in range(32 // bits)], axis=2)
    assert fields.reshape(2, 8).tolist() == zeros.tolist()


def test_an_input_no_token_uses_gets_zero_weights() -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    x = correlated_inputs(256, 64, seed=5)
    x[:, 7] = 0
    result = gptq_quantize(weight, 2 * x.t() @ x / 256, 32)
    assert torch.equal(result.dequantized()[:, 7], torch.zeros(16))


def read_gptq_weight(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """This file's own reading of a GPTQ v1 layer (symmetric or not): ``(q - z) * s`` per input's group, ``32 / bits``
    fields per int32 word, the first in the lowest bits; v1's z is the qzeros word plus 1 in every field, added to
    the whole word (GPTQModel's rule: a stored -1 borrowed from the next field)."""
    pack, mask = 32 // bits, np.uint32(2**bits - 1)
    words = tensors["qweight"].numpy().view(np.uint32)  # [in / pack, out]
    q = np.stack([(words >> np.uint32(bits * i)) & mask for i in range(pack)], axis=1).reshape(-1, words.shape[1])
    one_each = sum(1 << (bits * i) for i in range(pack))
    zwords = tensors["qzeros"].numpy().view(np.uint32) + np.uint32(one_each)  # wraps as a 32-bit word
    z = np.stack([(zwords >> np.uint32(bits * i)) & mask for i in range(pack)], axis=2).reshape(zwords.shape[0], -1)
    z = z.astype(np.int64)
    g = tensors["g_idx"].numpy().astype(np.int64)
    s = tensors["scales"].float().numpy()
    return torch.from_numpy(np.ascontiguousarray(((q.astype(np.float64) - z[g]) * s[g]).T, dtype=np.float32))


def dense_twin(quantized: Path, dense: Path) -> None:
    """The GPTQ checkpoint ``quantized`` as a plain float32 one, by :func:`read_gptq_weight`."""
    state = load_file(str(quantized / "model.safetensors"))
    bits = json.loads((quantized / "config.json").read_text())["quantization_config"]["bits"]
    plain = {name: t.float() for name, t in state.items() if name.rpartition(".")[2] not in
             ("qweight", "qzeros", "scales", "g_idx")}
    for owner in {name.rpartition(".")[0] for name in state if name.endswith(".qweight")}:
        plain[f"{owner}.weight"] = read_gptq_weight({k: state[f"{owner}.{k}"] for k in
                                                     ("qweight", "qzeros", "scales", "g_idx")}, bits)
    shutil.copytree(quantized, dense)
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))


EXPERTS = {"moe_intermediate_size": 64}  # a multiple of the group size, as real models' are


@pytest.mark.parametrize("arch, act_order, bits, extra, sym", [
    ("llama", False, 4, None, True), ("llama", True, 4, None, True), ("phi3", True, 4, None, True),
    ("qwen2", False, 4, None, True), ("llama", True, 8, None, True), ("qwen3moe", True, 4, EXPERTS, True),
    ("mixtral", False, 8, None, True), ("qwen2moe", False, 4, {**EXPERTS, "shared_expert_intermediate_size": 64}, True),
    ("llama", True, 4, None, False), ("qwen3moe", False, 8, EXPERTS, False), ("gemma3", True, 4, None, True),
    ("gemma2", False, 8, None, False)])
def test_the_written_checkpoint_generates_like_hf_on_its_weights(
        arch: str, act_order: bool, bits: int, extra: dict[str, int] | None, sym: bool, tmp_path: Path,
        tiny_model_factory: Callable[..., Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Mixtures of experts too: each expert quantized on the tokens routed to it, written as per-expert linears;
    Gemma's norms written back as the w of its (1 + w), the floats in bfloat16 (it overflows float16)."""
    from infer import LLM

    model = tiny_model_factory(arch, extra=extra) if extra else tiny_model_factory(arch)
    options = {**CALIB.__dict__, "act_order": act_order, "bits": bits, "sym": sym}
    reports = calibrate_gptq(model, tmp_path / "gptq", GptqCalibrationConfig(**options))
    assert all(r.error < r.rtn_error for r in reports)  # on the calibration inputs
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) \
        == ("gptq", bits, 32, sym, act_order, "gptq")
    assert json.loads((tmp_path / "gptq" / "gptq_calibration.json").read_text())["calibration_data"]["samples"] == 8
    written = json.loads((tmp_path / "gptq" / "config.json").read_text())["torch_dtype"]
    assert written == ("bfloat16" if arch.startswith("gemma") else "float16")
    dense_twin(tmp_path / "gptq", tmp_path / "dense")
    llm = LLM(model=str(tmp_path / "gptq"), device="cpu", num_kv_blocks=32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt in ([5, 17, 300, 42, 7, 99], [900, 12, 8, 8, 41, 3, 3]):
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(tmp_path / "dense", prompt, 8)


def test_experts_no_calibration_token_reached_are_rounded_to_nearest(
        tmp_path: Path, tiny_model_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Two calibration tokens routed to 1 expert of 8 each reach at most 2 of a layer's experts: the others have no
    Hessian, are rounded to nearest (their reported error is RTN's) and named in a warning."""
    from infer import LLM

    model = tiny_model_factory("qwen3moe", extra={**EXPERTS, "num_experts": 8, "num_experts_per_tok": 1})
    options = GptqCalibrationConfig(**{**CALIB.__dict__, "num_samples": 1, "seq_len": 2})
    with caplog.at_level("WARNING", logger="infer"):
        reports = calibrate_gptq(model, tmp_path / "gptq", options, texts=["def f(x): return x"])
    experts = [r for r in reports if ".experts." in r.linear]
    assert len(experts) == 2 * 8 * 3
    rounded = [r for r in experts if r.error == pytest.approx(r.rtn_error, rel=1e-6)]
    assert len(rounded) >= 2 * 6 * 3
    warned = [r.message for r in caplog.records if "saw no calibration token" in r.message]
    assert len(warned) == 1 and warned[0].startswith(f"{len(rounded) // 3} experts saw no calibration token")
    dense_twin(tmp_path / "gptq", tmp_path / "dense")
    llm = LLM(model=str(tmp_path / "gptq"), device="cpu", num_kv_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 300, 42, 7, 99]
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(tmp_path / "dense", prompt, 6)


def test_quantize_command_writes_gptq_and_refuses_gptq_options_elsewhere(tiny_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    common = ["--num-samples", "4", "--seq-len", "32", "--device", "cpu"]
    result = runner.invoke(main, ["quantize", str(tiny_model), str(tmp_path / "a"), "--method", "awq",
                                  "--act-order", *common])
    assert result.exit_code == 2 and "--act-order applies to --method gptq only" in result.output
    result = runner.invoke(main, ["quantize", str(tiny_model), str(tmp_path / "a"), "--asym", *common])
    assert result.exit_code == 2 and "--sym/--asym applies to --method gptq only" in result.output
    result = runner.invoke(main, ["quantize", str(tiny_model), str(tmp_path / "b"), "--method", "gptq",
                                  "--damp", "0", *common])
    assert result.exit_code != 0 and "--damp must be in (0, 1]" in result.output
    result = runner.invoke(main, ["quantize", str(tiny_model), str(tmp_path / "c"), "--method", "gptq",
                                  "--act-order", "--asym", "--group-size", "32", "--bits", "8", *common])
    assert result.exit_code == 0, result.output
    assert "wrote the GPTQ checkpoint" in result.output and "(int8, group 32)" in result.output
    assert "GPTQ / RTN" in result.output
    written = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert written["desc_act"] is True and written["sym"] is False and written["bits"] == 8


def test_the_summary_pools_a_mixtures_experts_by_projection() -> None:
    from infer.plugins.quant_commands import gptq_summary
    from infer.quant.gptq_calibrate import GptqLayerReport

    reports = [GptqLayerReport(0, "self_attn.q_proj", 0.1, 0.2), GptqLayerReport(1, "self_attn.q_proj", 0.3, 0.4),
               GptqLayerReport(0, "mlp.experts.0.w1", 1.0, 2.0), GptqLayerReport(0, "mlp.experts.11.w1", 3.0, 4.0),
               GptqLayerReport(1, "mlp.experts.3.w2", 5.0, 6.0)]
    assert gptq_summary(reports) == [("self_attn.q_proj", pytest.approx(0.2), pytest.approx(0.3)),
                                     ("mlp.experts.*.w1", 2.0, 3.0), ("mlp.experts.*.w2", 5.0, 6.0)]


def test_bad_gptq_options_are_config_errors() -> None:
    for options, message in (({"damp": float("nan")}, "--damp"), ({"block_size": 0}, "--block-size"),
                             ({"bits": 3}, "4- or 8-bit weights"), ({"group_size": 48}, "--group-size")):
        with pytest.raises(ConfigError, match=message):
            GptqCalibrationConfig(**options).validate()


def test_each_layer_is_quantized_on_the_inputs_of_the_quantized_layers_before_it(tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    """Layer 1's codes are GPTQ's under the Hessian of its inputs in the float model with layer 0's weights
    quantized (read back from the checkpoint), not in the float model itself."""
    from infer.core.config import EngineConfig
    from infer.core.loader import load_model
    from infer.core.plugins import PluginManager
    from infer.quant.calib_data import default_texts, token_samples
    from infer.quant.gptq_calibrate import layer_hessians

    calibrate_gptq(tiny_model, tmp_path / "gptq", CALIB)
    plugins = PluginManager.from_entry_points().collect()
    state = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    read = {owner: read_gptq_weight({k: state[f"{owner}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}, 4)
            for owner in {name.rpartition(".")[0] for name in state if name.endswith(".qweight")}}
    floats = load_file(str(tiny_model / "model.safetensors"))
    shutil.copytree(tiny_model, tmp_path / "layer0")
    save_file({**floats, **{f"{owner}.weight": w for owner, w in read.items() if ".layers.0." in owner}},
              str(tmp_path / "layer0" / "model.safetensors"))
    written, original = read["model.layers.1.mlp.up_proj"], floats["model.layers.1.mlp.up_proj.weight"]
    agreement = {}
    for name, path in (("quantized", tmp_path / "layer0"), ("float", tiny_model)):
        loaded = load_model(EngineConfig(model=str(path), device="cpu", fuse_projections=False).validate(), plugins,
                            path)
        samples = token_samples(loaded.tokenizer, default_texts(), CALIB.num_samples, CALIB.seq_len)
        hessian = layer_hessians(loaded.model, 1, samples, loaded.device, CALIB.batch_samples)["gate_up"]
        agreement[name] = float((gptq_quantize(original, hessian, 32).dequantized() == written).float().mean())
    assert agreement["quantized"] > 0.999 and agreement["float"] < agreement["quantized"]
