"""``infer quantize --method awq`` on mixtures of experts (quant/calibrate_moe.py): the folding is exact (the router
included), the written checkpoint computes its own weights as HF does, and experts no token reached are named.

The reference reading of the written AutoAWQ GEMM tensors is this file's own (the format's definition: nibble ``i``
of packed column ``c`` holds output column ``8c + ORDER[i]``; the weight is ``(q - z) * s`` per group of inputs)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.core.config import EngineConfig
from infer.core.loader import load_model
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams
from infer.quant.calibrate import AwqCalibrationConfig, calibrate_awq
from infer.quant.forward import dense_forward

CALIB = AwqCalibrationConfig(group_size=32, num_samples=8, seq_len=64, grid=10)
EXPERTS = {"moe_intermediate_size": 64}
ARCHES = {"mixtral": EXPERTS, "qwen3moe": EXPERTS, "qwen2moe": {**EXPERTS, "shared_expert_intermediate_size": 64}}


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager.from_entry_points().collect()


def read_awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """An AutoAWQ GEMM layer's weight [out, in], float32, by the format's definition (tests/test_quant.py's loop
    over the nibbles)."""
    from test_quant import naive_unpack

    q, z = naive_unpack(qweight).numpy(), np.repeat(naive_unpack(qzeros).numpy(), group, axis=0)
    s = np.repeat(scales.float().numpy(), group, axis=0)
    return torch.from_numpy(np.ascontiguousarray(((q - z) * s).T, dtype=np.float32))


def dense_twin(quantized: Path, dense: Path) -> None:
    """The AWQ checkpoint ``quantized`` as a plain float32 one, by :func:`read_awq_weight`."""
    state = load_file(str(quantized / "model.safetensors"))
    group = json.loads((quantized / "config.json").read_text())["quantization_config"]["group_size"]
    plain = {name: t.float() for name, t in state.items() if name.rpartition(".")[2] not in
             ("qweight", "qzeros", "scales")}
    for owner in {name.rpartition(".")[0] for name in state if name.endswith(".qweight")}:
        plain[f"{owner}.weight"] = read_awq_weight(*(state[f"{owner}.{k}"] for k in ("qweight", "qzeros", "scales")),
                                                   group)
    shutil.copytree(quantized, dense)
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))


SAMPLES = [[5, 17, 300, 42, 7, 99, 12, 8] * 3, [900, 12, 8, 8, 41, 3] * 4]


def generates_like_hf(quantized: Path, dense: Path, hf_greedy: Callable[[Path, list[int], int], list[int]],
                      prompts: list[list[int]], tokens: int, **options: Any) -> None:
    """infer's greedy tokens on the checkpoint ``quantized`` equal HF's on ``dense``, its weights as plain floats."""
    from infer import LLM

    llm = LLM(model=str(quantized), device="cpu", num_kv_blocks=32, **options)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(dense, prompt, tokens)


def expert_stats(path: Path, plugins: PluginManager) -> tuple[Any, list[Any]]:
    """The model at ``path`` (float32, its checkpoint's own linears) and what the AWQ calibration forward records of
    :data:`SAMPLES` at each layer's experts (every row kept)."""
    from infer.quant.calibrate import _collect

    loaded = load_model(EngineConfig(model=str(path), device="cpu", fuse_projections=False).validate(), plugins, path)
    with torch.no_grad():
        _, experts = _collect(loaded.model, SAMPLES, loaded.device, AwqCalibrationConfig(max_rows=1000),
                              lambda *call: None)
    return loaded, experts


@pytest.mark.parametrize("arch", list(ARCHES))
def test_calibrated_experts_generate_like_hf_on_the_written_weights(
        arch: str, tmp_path: Path, tiny_model_factory: Callable[..., Path],
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Each expert's gate, up and down written as AutoAWQ names them, the routers float and listed in
    modules_to_not_convert by paths no other module contains; no search does worse than RTN on its rows."""
    model = tiny_model_factory(arch, extra=ARCHES[arch])
    reports = calibrate_awq(model, tmp_path / "awq", CALIB)
    assert {r.group for r in reports} >= {"qkv", "o", "experts.gate_up", "experts.down"}
    assert all(r.error <= r.rtn_error for r in reports)
    assert sum(r.group == "experts.down" for r in reports) == 2 * 4  # every expert reached, in both layers
    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    down = "w2" if arch == "mixtral" else "down_proj"
    assert state[f"model.layers.1.{block}.experts.3.{down}.qweight"].dtype == torch.int32
    assert state[f"model.layers.1.{block}.gate.weight"].dtype == torch.float16
    skipped = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"]
    assert set(skipped) == {f"model.layers.{i}.{block}.{gate}" for i in range(2) for gate in
                            (("gate", "shared_expert_gate") if arch == "qwen2moe" else ("gate",))}
    quantized = {name.rpartition(".")[0] for name in state if name.endswith(".qweight")}
    assert not any(entry in owner for entry in skipped for owner in quantized)
    dense_twin(tmp_path / "awq", tmp_path / "dense")
    generates_like_hf(tmp_path / "awq", tmp_path / "dense", hf_greedy, [[5, 17, 300, 42, 7, 99],
                                                                        [900, 12, 8, 8, 41, 3, 3]], 8)


def test_each_written_expert_projection_holds_its_own_weights(tmp_path: Path,
                                                             tiny_model_factory: Callable[..., Path]) -> None:
    """Each expert's gate_proj, up_proj and down_proj, read back by the AutoAWQ format's definition
    (:func:`read_awq_weight`), are the original checkpoint's tensors of that name up to the folded scales and
    rounding: far closer (cosine) to them than to the expert's other projections of that shape."""
    model = tiny_model_factory("qwen3moe", extra=ARCHES["qwen3moe"])
    calibrate_awq(model, tmp_path / "awq", CALIB)
    original = load_file(str(model / "model.safetensors"))
    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    group = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]["group_size"]

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0))

    for layer in range(2):
        for e in range(4):
            name = f"model.layers.{layer}.mlp.experts.{e}"
            written = {p: read_awq_weight(*(state[f"{name}.{p}.{k}"] for k in ("qweight", "qzeros", "scales")), group)
                       for p in ("gate_proj", "up_proj")}
            for mine, other in (("gate_proj", "up_proj"), ("up_proj", "gate_proj")):
                own, others = (cosine(written[mine], original[f"{name}.{p}.weight"]) for p in (mine, other))
                assert own > 0.8 and own > others + 0.5, (name, mine, own, others)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_folding_the_experts_scales_leaves_the_model_unchanged(arch: str, tiny_model_factory: Callable[..., Path],
                                                               plugins: PluginManager) -> None:
    """Random scales folded into every sparse layer (the norm, the router, every expert's gate/up and down, the
    shared expert and its gate) leave the logits as they were: the routing sees what it saw."""
    from infer.quant.calibrate_moe import fold_experts

    path = tiny_model_factory(arch, extra=ARCHES[arch])
    loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), plugins, path)
    model, g = loaded.model, torch.Generator().manual_seed(3)
    prompts = [[5, 17, 300, 42, 7, 99, 12, 8], [900, 12, 8, 8, 41, 3]]
    before = model.compute_logits(dense_forward(model, prompts, loaded.device))
    for layer in model.model.layers:
        moe = layer.ffn()
        hidden, size = moe.w13.shape[2], moe.moe.intermediate_size
        gate_up = torch.rand(hidden, generator=g) * 3 + 0.2
        downs = {e: torch.rand(size, generator=g) * 3 + 0.2 for e in range(moe.moe.num_experts)}
        fold_experts(layer, gate_up, downs)
    after = model.compute_logits(dense_forward(model, prompts, loaded.device))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_experts_no_calibration_token_reached_keep_plain_rounding(
        tmp_path: Path, tiny_model_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """Two calibration tokens routed to 1 expert of 8 reach at most 2 of a layer's experts: the others' downs are
    rounded to nearest unscaled, named in one warning, and the checkpoint still computes its own weights."""
    model = tiny_model_factory("qwen3moe", extra={**EXPERTS, "num_experts": 8, "num_experts_per_tok": 1})
    options = AwqCalibrationConfig(group_size=32, num_samples=1, seq_len=2, grid=10)
    with caplog.at_level("WARNING", logger="infer"):
        reports = calibrate_awq(model, tmp_path / "awq", options, texts=["def f(x): return x"])
    reached = sum(r.group == "experts.down" for r in reports)
    assert 1 <= reached <= 2 * 2
    warned = [r.message for r in caplog.records if "saw no calibration token" in r.message]
    assert len(warned) == 1 and warned[0].startswith(f"{2 * 8 - reached} experts saw no calibration token")
    dense_twin(tmp_path / "awq", tmp_path / "dense")
    generates_like_hf(tmp_path / "awq", tmp_path / "dense", hf_greedy, [[5, 17, 300, 42, 7, 99]], 6)


def test_the_routed_search_pools_each_experts_error_on_its_own_rows() -> None:
    """search_scale_parts' error: each part's squared output difference on its own rows, summed, per output (RTN's
    at alpha 0, where s is all ones, and the chosen scales')."""
    from infer.quant import awq
    from infer.quant.calibrate import search_scale_parts

    g = torch.Generator().manual_seed(5)
    stat = torch.rand(64, generator=g) * 4 + 0.1
    rows = [torch.randn(n, 64, generator=g) * stat for n in (40, 24)]
    weights = [torch.randn(32, 64, generator=g) for _ in rows]

    def pooled(s: torch.Tensor) -> float:
        total = sum(float((x @ (awq.fake_quantize_rtn(w * s, 32) / s).t() - x @ w.t()).pow(2).sum())
                    for x, w in zip(rows, weights))
        return total / sum(x.shape[0] * w.shape[0] for x, w in zip(rows, weights))

    found = search_scale_parts([(x, [w]) for x, w in zip(rows, weights)], stat, 32, grid=8)
    assert found.error == pytest.approx(pooled(found.scales), rel=1e-5)
    assert found.rtn_error == pytest.approx(pooled(torch.ones(64)), rel=1e-5)
    assert found.alpha > 0 and found.error < found.rtn_error


def test_each_expert_is_searched_on_the_tokens_routed_to_it(tiny_model_factory: Callable[..., Path],
                                                             plugins: PluginManager) -> None:
    """The calibration forward keeps each sparse layer's hidden rows beside the experts the router chose for them;
    the gate_up search measures each expert on those rows only, and each expert's down on its own activations."""
    from infer.quant.calibrate import search_scale, search_scale_parts
    from infer.quant.calibrate_moe import search_experts

    path = tiny_model_factory("qwen3moe", extra=EXPERTS)
    loaded, experts = expert_stats(path, plugins)
    layer, stats = loaded.model.model.layers[1], experts[1]
    moe = layer.ffn()
    x, routes = torch.cat(stats.hidden.rows), torch.cat(stats.routes)
    assert x.shape[0] == stats.hidden.count == 48 and torch.equal(routes, moe.route(x)[1])
    size = moe.moe.intermediate_size
    for e in range(moe.moe.num_experts):
        routed = x[(routes == e).any(dim=-1)]
        hidden = routed @ moe.w13[e].t()
        assert stats.down[e].count == routed.shape[0] > 0
        torch.testing.assert_close(torch.cat(stats.down[e].rows), torch.nn.functional.silu(hidden[:, :size])
                                   * hidden[:, size:])
    reports, _, downs = search_experts(layer, stats, 1, AwqCalibrationConfig(group_size=32, grid=10), loaded.device)
    expected = search_scale_parts([(x[(routes == e).any(dim=-1)], [moe.w13[e]]) for e in range(4)],
                                  stats.hidden.abs_sum / 48, 32, 10, duo=True)
    assert (reports[0].alpha, reports[0].error) == pytest.approx((expected.alpha, expected.error))
    down = search_scale(torch.cat(stats.down[2].rows), stats.down[2].abs_sum / stats.down[2].count, [moe.w2[2]], 32,
                        10, duo=True)
    torch.testing.assert_close(downs[2], down.scales)


def test_experts_are_clipped_on_their_rows_divided_by_the_folded_scales(tiny_model_factory: Callable[..., Path],
                                                                       plugins: PluginManager) -> None:
    """clip_experts clamps each folded expert's gate/up by the search on its routed rows divided by the gate_up
    scale, the shared expert's on every row so divided, and each expert's down on its activations divided by its
    down scale (the inputs the folded weights see)."""
    from infer.quant.awq_clip import clip_, search_clip
    from infer.quant.calibrate_moe import clip_experts, fold_experts, search_experts

    path = tiny_model_factory("qwen2moe", extra=ARCHES["qwen2moe"])
    loaded, experts = expert_stats(path, plugins)
    layer, stats = loaded.model.model.layers[1], experts[1]
    moe = layer.ffn()
    reports, gate_up, downs = search_experts(layer, stats, 1, AwqCalibrationConfig(group_size=32, grid=10),
                                             loaded.device)
    fold_experts(layer, gate_up, downs)
    x, routes = torch.cat(stats.hidden.rows) / gate_up, torch.cat(stats.routes)

    def expected(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        clipped = weight.clone()
        clip_(clipped, search_clip(rows, clipped, 32), 32)
        return clipped

    w13 = [expected(x[(routes == e).any(dim=-1)], moe.w13[e]) for e in range(moe.moe.num_experts)]
    w2 = {e: expected(torch.cat(stats.down[e].rows) / s, moe.w2[e]) for e, s in downs.items()}
    shared = [expected(x, moe.shared_expert.get_submodule(p).weight) for p in ("gate_proj", "up_proj")]
    folded = moe.w13.clone(), moe.w2.clone()
    clip_experts(layer, stats, reports, gate_up, downs, 32, loaded.device)
    assert not torch.equal(moe.w13, folded[0]) and not torch.equal(moe.w2, folded[1])  # some groups clamped
    for e, w in enumerate(w13):
        assert torch.equal(moe.w13[e], w), e
    for e, w in w2.items():
        assert torch.equal(moe.w2[e], w), e
    for p, w in zip(("gate_proj", "up_proj"), shared):
        assert torch.equal(moe.shared_expert.get_submodule(p).weight, w), p


@pytest.mark.gpu
@pytest.mark.parametrize("arch, method", [("qwen2moe", "awq"), ("qwen3moe", "gptq"), ("gemma3", "awq"),
                                          ("gemma2", "gptq")])
def test_calibration_on_cuda_writes_a_checkpoint_that_generates_like_hf(
        arch: str, method: str, tmp_path: Path, tiny_model_factory: Callable[..., Path],
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """`infer quantize --device cuda`: the model in its checkpoint's dtype on the GPU (the fused ops, bf16 for
    Gemma), the searches, folds, clipping and GPTQ there; the written checkpoint, read back on the CPU, generates
    as HF does on its weights."""
    from test_gptq_calibrate import dense_twin as gptq_twin

    from infer.quant.gptq_calibrate import GptqCalibrationConfig, calibrate_gptq

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_model_factory(arch, extra=ARCHES[arch]) if arch in ARCHES else tiny_model_factory(arch)
    options = {"group_size": 32, "num_samples": 8, "seq_len": 64, "device": "cuda"}
    if method == "awq":
        calibrate_awq(model, tmp_path / "q", AwqCalibrationConfig(**options, grid=10))
        dense_twin(tmp_path / "q", tmp_path / "dense")
    else:
        calibrate_gptq(model, tmp_path / "q", GptqCalibrationConfig(**options))
        gptq_twin(tmp_path / "q", tmp_path / "dense")
    generates_like_hf(tmp_path / "q", tmp_path / "dense", hf_greedy, [[5, 17, 300, 42, 7, 99]], 8, dtype="float32")


def test_the_shared_expert_joins_the_experts_gate_up_search(tiny_model_factory: Callable[..., Path],
                                                            plugins: PluginManager) -> None:
    """Qwen2-MoE's shared expert reads the same normed state as the routed experts, so its gate and up share their
    scale: the search measures them on every row beside each expert on its routed rows (the module docstring)."""
    from infer.quant.calibrate import search_scale_parts
    from infer.quant.calibrate_moe import search_experts

    path = tiny_model_factory("qwen2moe", extra=ARCHES["qwen2moe"])
    loaded, experts = expert_stats(path, plugins)
    layer, stats = loaded.model.model.layers[0], experts[0]
    moe = layer.ffn()
    x, routes = torch.cat(stats.hidden.rows), torch.cat(stats.routes)
    shared = [moe.shared_expert.get_submodule(p).weight for p in ("gate_proj", "up_proj")]
    parts = [(x[(routes == e).any(dim=-1)], [moe.w13[e]]) for e in range(4)]
    stat = stats.hidden.abs_sum / stats.hidden.count
    with_shared = search_scale_parts(parts + [(x, shared)], stat, 32, 10, duo=True)
    without = search_scale_parts(parts, stat, 32, 10, duo=True)
    reports, _, _ = search_experts(layer, stats, 0, AwqCalibrationConfig(group_size=32, grid=10), loaded.device)
    assert reports[0].rtn_error == pytest.approx(with_shared.rtn_error) != pytest.approx(without.rtn_error)
