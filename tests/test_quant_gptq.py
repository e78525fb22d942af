"""GPTQ checkpoints (``quant_method: "gptq"``, 4 and 8 bits) load as what they hold.

The checkpoints are written here from a tiny float model: each linear's weight is quantized per group (RTN), in
activation order or not, and packed by this file's own bit loops as the format stores it (quant/gptq.py's docstring;
AutoGPTQ's ``QuantLinear.pack``: ``qweight`` packed along the input, ``qzeros`` along the output, ``z - 1`` stored in
the v1 ``gptq`` format). The reference is the same model with the dequantized weights ``(q - z[g_idx]) * s[g_idx]``
as plain float tensors. The v1 offset and the packing directions are also checked against a third party's writer:
AutoAWQ's ``unpack_reorder_pack`` (its AWQ-to-GPTQ conversion for the exllama kernels).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import loaded_linear  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import CheckpointError, ConfigError  # noqa: E402
from infer.core.loader import load_model  # noqa: E402
from infer.core.plugins import PluginManager  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from infer.models.layers import Linear  # noqa: E402
from infer.plugins.gptq import build_gptq  # noqa: E402
from infer.quant import awq, gptq  # noqa: E402
from infer.quant.awq_method import AwqLinearMethod  # noqa: E402
from infer.quant.forward import dense_forward  # noqa: E402
from infer.quant.w8a16_method import W8A16LinearMethod  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 7, 99, 512, 3], [900, 12, 8, 8, 41]]
GROUP = 32


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager.from_entry_points().collect()


def pack_words(values: np.ndarray, bits: int = 4) -> np.ndarray:
    """[..., 32 / bits] values 0..2**bits - 1 -> [...] int32 words, value ``i`` in bits ``bits * i`` and up."""
    words = np.zeros(values.shape[:-1], dtype=np.uint64)
    for i in range(32 // bits):
        words |= (values[..., i].astype(np.uint64) & (2**bits - 1)) << np.uint64(bits * i)
    return words.astype(np.uint32).view(np.int32)


def gptq_layer(weight: torch.Tensor, group: int, order: torch.Tensor | None, sym: bool, v1: bool, bits: int = 4
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of ``weight`` [out, in] (RTN per group to ``bits``; ``order``: the activation order, a
    permutation of the inputs whose i-th member joins group ``i // group``) and the float weight [out, in] they stand
    for."""
    max_q, pack = 2**bits - 1, 32 // bits
    out_features, in_features = weight.shape
    perm = torch.arange(in_features) if order is None else order
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_features) // group).to(torch.int32)
    w = weight.t().double()  # [in, out]
    groups = in_features // group
    scales, zeros = torch.empty(groups, out_features), torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        scale = ((hi - lo) / max_q) if not sym else (torch.maximum(-lo, hi) / (max_q / 2))
        scales[g] = scale.clamp(min=1e-4).half().float()
        zeros[g] = torch.full_like(zeros[g], 2**(bits - 1)) if sym else (-lo / scales[g]).round().clamp(0, max_q).long()
    s, z = scales[g_idx.long()].double(), zeros[g_idx.long()]
    q = ((w / s).round() + z).clamp(0, max_q).long()
    zero_words = pack_words(zeros.numpy().reshape(groups, -1, pack), bits)
    if v1:  # GPTQModel's v2 -> v1: 1 off each field of each whole word (a zero point of 0 borrows from the next)
        one_each = sum(1 << (bits * i) for i in range(pack))
        zero_words = (zero_words.view(np.uint32) - np.uint32(one_each)).view(np.int32)
    packed = pack_words(q.numpy().reshape(in_features // pack, pack, -1).transpose(0, 2, 1), bits)
    tensors = {"qweight": torch.from_numpy(packed), "qzeros": torch.from_numpy(zero_words), "scales": scales.half(),
               "g_idx": g_idx}
    return tensors, ((q - z).double() * s).t().float()


def write_gptq(src: Path, dst: Path, dense: Path, act_order: str = "none", sym: bool = True, v1: bool = True,
               group: int = GROUP, g_idx: bool = True, extra: dict[str, Any] | None = None,
               in_order: str = "", bits: int = 4, dynamic: dict[str, dict[str, Any]] | None = None) -> None:
    """``src``'s model as a GPTQ checkpoint in ``dst`` and its dequantized float twin in ``dense``. ``act_order``:
    "none"; "shared" (one random order per layer input, as GPTQ gives linears that read the same input);
    "each" (one per linear); linears whose path holds ``in_order`` (if given) keep the input order all the same.
    ``dynamic``: GPTQModel's per-module overrides (``+:`` patterns with bits and group_size; ``-:`` patterns, mapped
    to None, leave their modules float), applied as GPTQModel applies them (the first matching pattern) and written
    to the config."""
    state = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    plain = dict(state)
    gen = torch.Generator().manual_seed(0)
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for name, tensor in state.items():
        owner = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and tensor.dim() == 2):
            quantized[name] = tensor
            continue
        rule = next((rule for pattern, rule in (dynamic or {}).items() if re.match(pattern[2:], owner)), {})
        if rule is None:  # a -: pattern
            quantized[name] = tensor
            continue
        own_group, own_bits = rule.get("group_size", group), rule.get("bits", bits)
        key = (owner.rsplit(".", 1)[0] if act_order == "shared" else owner, tensor.shape[1])
        order = None if act_order == "none" or (in_order and in_order in owner) else \
            orders.setdefault(key, torch.randperm(tensor.shape[1], generator=gen))
        tensors, dequantized = gptq_layer(tensor, own_group if own_group > 0 else tensor.shape[1], order, sym, v1,
                                          own_bits)
        quantized.update({f"{owner}.{attr}": t for attr, t in tensors.items() if g_idx or attr != "g_idx"})
        plain[name] = dequantized
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                     "desc_act": act_order != "none", "checkpoint_format": "gptq" if v1 else "gptq_v2",
                                     **({"dynamic": {k: v or {} for k, v in dynamic.items()}} if dynamic else {}),
                                     **(extra or {})}
    for folder, tensors in ((dst, quantized), (dense, plain)):
        shutil.copytree(src, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))


def load(path: Path, plugins: PluginManager, **options: Any) -> Any:
    return load_model(EngineConfig(model=str(path), device="cpu", **options).validate(), plugins, path)


def logits(path: Path, plugins: PluginManager, **options: Any) -> torch.Tensor:
    loaded = load(path, plugins, **options)
    with torch.no_grad():
        return loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS, loaded.device))


@pytest.mark.parametrize("act_order, sym, v1, bits", [
    ("none", True, True, 4), ("none", False, False, 4), ("each", True, True, 4), ("shared", False, True, 4),
    ("shared", True, False, 4), ("none", False, True, 8), ("each", True, True, 8), ("shared", False, False, 8),
])
def test_gptq_checkpoint_computes_its_dequantized_weights(act_order: str, sym: bool, v1: bool, bits: int,
                                                          tiny_model: Path, tmp_path: Path,
                                                          plugins: PluginManager) -> None:
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", act_order, sym, v1, bits=bits)
    loaded = load(tmp_path / "gptq", plugins)
    assert isinstance(loaded.quant, W8A16LinearMethod) is (bits == 8)
    ours, reference = logits(tmp_path / "gptq", plugins), logits(tmp_path / "dense", plugins)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reference, logits(tiny_model, plugins), atol=1e-4)  # the rounding is in both


@pytest.mark.parametrize("act_order, merged, bits", [("none", True, 4), ("shared", True, 4), ("each", False, 4),
                                                     ("shared", True, 8), ("each", False, 8)])
def test_projections_merge_only_when_their_input_orders_agree(act_order: str, merged: bool, bits: int,
                                                              tiny_model: Path, tmp_path: Path,
                                                              plugins: PluginManager) -> None:
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", act_order, bits=bits)
    loaded = load(tmp_path / "gptq", plugins, fuse_projections=True)
    names = {m.prefix.rsplit(".", 1)[-1] for m in loaded.model.modules() if isinstance(m, Linear)}
    assert ({"qkv_proj", "gate_up_proj"} <= names) is merged
    assert ("q_proj" in names) is not merged
    with torch.no_grad():
        ours = loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS, loaded.device))
    torch.testing.assert_close(ours, logits(tmp_path / "dense", plugins), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["quantize_config.json", "config.json"])
def test_autogptq_settings_beside_config_json_are_read(name: str, tiny_model: Path, tmp_path: Path,
                                                       plugins: PluginManager) -> None:
    """AutoGPTQ's save_quantized kept the settings in quantize_config.json, older ones without quant_method; one in
    config.json wins over it."""
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", "each")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    settings = config.pop("quantization_config")
    del settings["quant_method"]
    (tmp_path / "gptq" / "quantize_config.json").write_text(json.dumps(settings))
    if name == "config.json":  # the beside file would say v2, off by one: config.json's is the one read
        beside = {**settings, "checkpoint_format": "gptq_v2"}
        (tmp_path / "gptq" / "quantize_config.json").write_text(json.dumps(beside))
        config["quantization_config"] = {**settings, "quant_method": "gptq"}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins), logits(tmp_path / "dense", plugins),
                               rtol=1e-5, atol=1e-5)


def test_an_upper_case_quant_method_is_the_registered_method(tiny_model: Path, tmp_path: Path,
                                                             plugins: PluginManager) -> None:
    """Some hub configs spell the method in capitals ("GPTQ", "AWQ"): it names the registered lower-case method, and
    the checkpoint loads as that one does."""
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", "each")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "GPTQ"
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins), logits(tmp_path / "dense", plugins),
                               rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_g_idx_has_consecutive_groups(tiny_model: Path, tmp_path: Path,
                                                           plugins: PluginManager) -> None:
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", g_idx=False)
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins), logits(tmp_path / "dense", plugins),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gptq_checkpoint_generates_like_hf_on_its_dequantized_weights(
        device: str, bits: int, tiny_model: Path, tmp_path: Path,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """On a GPU also: projections merged (one input order per layer input), the fused W4A16 (W8A16) kernel up to 64
    rows on each layer's permuted input, the dequantizing kernel for the prompts above, CUDA graphs."""
    from infer import LLM

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", "shared", sym=True, v1=True, bits=bits)
    llm = LLM(model=str(tmp_path / "gptq"), device=device, num_kv_blocks=32)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(tmp_path / "dense", prompt, 10)


@pytest.mark.parametrize("act_order, fused_ops, bits", [("none", True, 4), ("each", False, 4), ("shared", True, 4),
                                                        ("shared", True, 8), ("each", False, 8), ("none", True, 8)])
def test_gptq_experts_compute_their_dequantized_weights(act_order: str, fused_ops: bool, bits: int, tmp_path: Path,
                                                        tiny_model_factory: Callable[..., Path],
                                                        plugins: PluginManager) -> None:
    """Stacked (fused ops), experts in activation order gather their inputs in their own order, an expert whose
    groups happen to be in input order (here expert 1's) the identity; 8-bit experts stack as W8A16 ones."""
    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    from infer.models.moe import SparseMoe

    write_gptq(moe, tmp_path / "gptq", tmp_path / "dense", act_order, in_order=".experts.1.", bits=bits)
    blocks = [m for m in load(tmp_path / "gptq", plugins, fused_ops=fused_ops).model.modules()
              if isinstance(m, SparseMoe)]
    runtime = W8A16LinearMethod if bits == 8 else AwqLinearMethod
    assert blocks and all((b.stacked[0] is runtime) if fused_ops else b.stacked is None for b in blocks)
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins, fused_ops=fused_ops),
                               logits(tmp_path / "dense", plugins), rtol=1e-4, atol=1e-4)


def test_experts_whose_gate_and_up_orders_differ_are_refused_by_the_stacked_kernels(
        tmp_path: Path, plugins: PluginManager, tiny_model_factory: Callable[..., Path]) -> None:
    """GPTQ gives an expert's gate and up one order (they read the same input); the grouped GEMM computes them
    together, so a checkpoint where they differ runs one expert at a time only."""
    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    write_gptq(moe, tmp_path / "gptq", tmp_path / "dense", "each")
    with pytest.raises(CheckpointError, match="gate_proj/up_proj read their input in different activation orders"):
        logits(tmp_path / "gptq", plugins, fused_ops=True)


def test_a_checkpoint_of_several_schemes_computes_its_dequantized_weights(tiny_model: Path, tmp_path: Path,
                                                                           plugins: PluginManager) -> None:
    """GPTQModel's dynamic overrides: each linear loads by its own scheme (layer 1 at 8 bits in groups of 64, layer
    0's k_proj one group, its down_proj float); projections of one scheme still merge, others stay apart."""
    from infer.models.layers import UnquantizedMethod

    dynamic = {r"-:.*layers\.0\.mlp\.down_proj": None, r"+:.*layers\.1\.": {"bits": 8, "group_size": 64},
               r"+:.*layers\.0\.self_attn\.k_proj": {"group_size": -1}}
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", "shared", sym=False, dynamic=dynamic)
    loaded = load(tmp_path / "gptq", plugins, fuse_projections=True)
    methods = {m.prefix.removeprefix("model.layers."): m.method for m in loaded.model.modules()
               if isinstance(m, Linear)}
    assert isinstance(methods["1.self_attn.qkv_proj"], W8A16LinearMethod) and methods["1.mlp.down_proj"].group_size \
        == 64 and methods["1.mlp.gate_up_proj"] is methods["1.self_attn.o_proj"]
    assert {"0.self_attn.q_proj", "0.self_attn.k_proj", "0.self_attn.v_proj"} <= methods.keys()  # k's scheme differs
    assert methods["0.self_attn.k_proj"] is not methods["0.self_attn.q_proj"] is methods["0.mlp.gate_up_proj"]
    assert type(methods["0.self_attn.q_proj"]) is not W8A16LinearMethod
    assert type(methods["0.mlp.down_proj"]) is UnquantizedMethod
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins, fuse_projections=True),
                               logits(tmp_path / "dense", plugins), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(tmp_path / "dense", plugins), logits(tiny_model, plugins), atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_checkpoint_of_several_schemes_generates_like_hf_on_its_dequantized_weights(
        device: str, tiny_model: Path, tmp_path: Path,
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    """On a GPU also: the fused W4A16 and W8A16 kernels side by side in one model, merged where schemes agree."""
    from infer import LLM

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dynamic = {r"+:.*layers\.1\.mlp\.": {"bits": 8, "group_size": 64}, r"+:.*\.k_proj": {"group_size": -1}}
    write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "dense", "shared", dynamic=dynamic)
    llm = LLM(model=str(tmp_path / "gptq"), device=device, num_kv_blocks=32)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(tmp_path / "dense", prompt, 10)


def test_experts_of_several_schemes_stack_per_layer_where_they_agree(
        tmp_path: Path, plugins: PluginManager, tiny_model_factory: Callable[..., Path]) -> None:
    """Layer 0's experts at 8 bits stack as W8A16 experts, layer 1's as int4 but for one expert's down_proj in
    groups of 64, which its stacked GEMM cannot share: that layer runs one expert at a time."""
    from infer.models.moe import SparseMoe

    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    dynamic = {r"+:.*layers\.0\.mlp\.experts": {"bits": 8}, r"+:.*layers\.1\.mlp\.experts\.2\.down": {"group_size": 64}}
    write_gptq(moe, tmp_path / "gptq", tmp_path / "dense", "none", dynamic=dynamic)
    blocks = [m for m in load(tmp_path / "gptq", plugins, fused_ops=True).model.modules() if isinstance(m, SparseMoe)]
    assert [b.stacked and b.stacked[0] for b in blocks] == [W8A16LinearMethod, None]
    assert [b.unstackable for b in blocks] == [False, True]
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins, fused_ops=True),
                               logits(tmp_path / "dense", plugins), rtol=1e-4, atol=1e-4)


def test_experts_load_quantized_when_expert_0_is_left_float(tmp_path: Path, plugins: PluginManager,
                                                            tiny_model_factory: Callable[..., Path]) -> None:
    """A dynamic exclusion of expert 0 alone: the others are still quantized Linears (run one expert at a time),
    not the float stacked experts that expert 0's float weights alone would suggest."""
    from infer.models.layers import UnquantizedMethod
    from infer.models.moe import SparseMoe

    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    write_gptq(moe, tmp_path / "gptq", tmp_path / "dense", "none", dynamic={r"-:.*\.experts\.0\.": None})
    blocks = [m for m in load(tmp_path / "gptq", plugins).model.modules() if isinstance(m, SparseMoe)]
    assert all(b.experts is not None and b.unstackable for b in blocks)
    assert type(blocks[0].experts[0].up_proj.method) is UnquantizedMethod
    assert isinstance(blocks[0].experts[1].up_proj.method, AwqLinearMethod)
    torch.testing.assert_close(logits(tmp_path / "gptq", plugins), logits(tmp_path / "dense", plugins),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.autoawq
def test_v1_layout_matches_autoawq_conversion_of_an_awq_layer() -> None:
    pytest.importorskip("awq", reason="AutoAWQ is not installed (pip install 'infer-engine[awq]')")
    from awq.utils.packing_utils import unpack_reorder_pack

    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(3))
    qweight, qzeros, scales = awq.quantize_rtn(weight, GROUP)
    gptq_qweight, gptq_qzeros = unpack_reorder_pack(qweight, qzeros, 4)  # GPTQ v1 (exllama's: zeros - 1)
    assert (gptq_qweight.shape, gptq_qzeros.shape) == ((128 // 8, 96), (128 // GROUP, 96 // 8))
    ours = gptq.to_awq(gptq_qweight.to(torch.int32), gptq_qzeros.to(torch.int32), None, GROUP, 1, "layer")
    assert torch.equal(ours[0], qweight) and torch.equal(ours[1], qzeros) and ours[2] is None


@pytest.mark.parametrize("chunk_elements", [256 * 8, 1 << 22])  # 8 output columns at a time, or all at once
def test_repacking_keeps_the_weights_whatever_the_chunk(chunk_elements: int) -> None:
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    order = torch.randperm(256, generator=torch.Generator().manual_seed(5))
    tensors, dequantized = gptq_layer(weight, GROUP, order, sym=False, v1=False)
    qweight, qzeros, found = gptq.to_awq(tensors["qweight"], tensors["qzeros"], tensors["g_idx"], GROUP, 0, "layer",
                                         chunk_elements)
    assert found is not None
    # the AWQ layer computes x[:, order] @ W[order]: its weight, rows put back, is the GPTQ layer's
    restored = torch.empty(256, 64)
    restored[found] = awq.dequantize(qweight, qzeros, tensors["scales"], GROUP, torch.float32)
    assert torch.equal(restored, dequantized.t())


def method_for(**changes: Any) -> Any:
    return build_gptq(EngineConfig(), {"quant_method": "gptq", "bits": 4, "group_size": GROUP, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"bits": 3}, "bits must be 4 or 8"),
    ({"bits": 8.0}, "bits must be 4 or 8"),
    ({"group_size": 100}, "group_size must be one of"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"format": "bitblas"}, "checkpoint_format 'bitblas'"),
    ({"is_marlin_format": True}, "checkpoint_format 'marlin'"),
    ({"lm_head": True}, "quantizes lm_head"),
    ({"dynamic": {"+:.*down_proj": {"bits": 3}}}, "bits must be 4 or 8, got 3 in dynamic '\\+:.\\*down_proj'"),
    ({"dynamic": {".*down_proj": {"group_size": 48}}}, "group_size must be one of .* got 48 in dynamic"),
    ({"dynamic": {".*down_proj": {"format": "gptq_v2"}}}, "dynamic '.\\*down_proj' changes format"),
    ({"checkpoint_format": "gptq_v2", "dynamic": {".*up": {"format": "gptq"}}}, "dynamic '.\\*up' changes format"),
    ({"dynamic": {".*down_proj": {"sym": "yes"}}}, "gives sym 'yes', not true or false"),
    ({"dynamic": {".*down_proj": 8}}, "must map to an object of overrides"),
    ({"dynamic": {".*down_proj": {"lm_head": True}}}, "dynamic '.\\*down_proj' changes lm_head"),  # a quantized head
    ({"dynamic": {"-:.*down_proj[": {}}}, "not a valid regular expression"),
    ({"format": "gptq_v2", "checkpoint_format": "gptq"}, "checkpoint_format and format disagree"),
    ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({"modules_in_block_to_quantize": ["self_attn.q_proj"]}, "list of lists"),
])
def test_unsupported_configs_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        method_for(**changes)


def test_another_methods_checkpoint_under_quant_gptq_is_the_commands_mistake() -> None:
    with pytest.raises(ConfigError, match="--quant gptq was given, but the checkpoint is quantized with 'awq'; drop"):
        method_for(quant_method="awq")


def test_the_format_field_gptqmodel_writes_is_read_too() -> None:
    assert method_for(format="gptq_v2").config.zero_offset == 0
    assert method_for(checkpoint_format="GPTQ").config.zero_offset == 1


def test_an_unquantized_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match="--quant awq"):
        build_gptq(EngineConfig(), None)


def test_dynamic_overrides_give_each_module_the_first_matching_patterns_scheme() -> None:
    """GPTQModel (and vLLM) take the first pattern that re.match-es the module path: ``-:`` leaves it float, others
    override the config's bits, group_size and desc_act. Linears of one scheme share one method (so they merge)."""
    from infer.quant.gptq import GptqScheme
    from infer.quant.gptq_method import GptqInt8LinearMethod, GptqLinearMethod

    method = method_for(desc_act=True, dynamic={
        "-:.*mlp\\.down_proj$": {}, r"+:.*layers\.1\..*": {"bits": 8, "group_size": 64, "damp_percent": 0.1},
        r".*layers\.[12]\.self_attn": {"bits": 4, "group_size": -1}, "+:.*q_proj": {"bits": 4, "desc_act": True}})
    expected = {"model.layers.3.mlp.down_proj": None, "model.layers.1.mlp.down_proj": None,
                "model.layers.1.mlp.up_proj": GptqScheme(8, 64, True), "model.layers.1.self_attn.k_proj":
                GptqScheme(8, 64, True), "model.layers.2.self_attn.k_proj": GptqScheme(4, -1, False),
                "model.layers.3.self_attn.q_proj": GptqScheme(4, GROUP, True),
                "model.layers.3.mlp.up_proj": GptqScheme(4, GROUP, True), "lm_head": None}
    for prefix, scheme in expected.items():
        chosen = method.method_for(prefix)
        assert (chosen is None if scheme is None else chosen.scheme == scheme), prefix
        assert method.applies_to(prefix) is (scheme is not None)
        if scheme is not None:
            assert type(chosen) is (GptqInt8LinearMethod if scheme.bits == 8 else GptqLinearMethod)
            assert chosen.group_size == scheme.group_size
    assert method.method_for("model.layers.0.mlp.up_proj") is method  # the config's own scheme
    assert method.method_for("model.layers.3.self_attn.q_proj") is method  # an override that changes nothing
    assert method.method_for("model.layers.1.mlp.gate_proj") is method.method_for("model.layers.1.self_attn.o_proj")
    assert method_for().method_for("model.layers.0.mlp.up_proj") is not None


def test_a_dynamic_override_may_restate_the_format_under_either_key() -> None:
    """GPTQModel writes format, transformers checkpoint_format: an override naming the config's format by the other
    key changes nothing."""
    method = method_for(checkpoint_format="gptq_v2", dynamic={r".*up_proj": {"format": "GPTQ_V2", "bits": 8}})
    assert method.config.zero_offset == 0 and method.method_for("model.layers.0.mlp.up_proj").scheme.bits == 8
    assert method_for(dynamic={r".*up_proj": {"checkpoint_format": "gptq"}}).config.zero_offset == 1


def test_a_dynamic_override_turns_activation_order_on_or_off() -> None:
    """An override's desc_act replaces the config's, both ways (a layer in activation order must bring g_idx)."""
    on = method_for(desc_act=False, dynamic={r".*q_proj": {"desc_act": True}})
    assert on.method_for("model.layers.0.self_attn.q_proj").scheme.act_order is True
    assert on.method_for("model.layers.0.self_attn.k_proj").scheme.act_order is False
    off = method_for(desc_act=True, dynamic={r".*q_proj": {"desc_act": False}})
    assert off.method_for("model.layers.0.self_attn.q_proj").scheme.act_order is False
    assert off.method_for("model.layers.0.self_attn.k_proj").scheme.act_order is True


def test_modules_in_block_to_quantize_picks_the_quantized_linears() -> None:
    method = method_for(modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]])
    assert method.applies_to("model.layers.3.self_attn.k_proj")
    assert method.applies_to("model.layers.0.mlp.down_proj")
    assert not method.applies_to("model.layers.0.self_attn.o_proj")
    assert not method.applies_to("lm_head") and not method_for().applies_to("lm_head")
    assert method_for().applies_to("model.layers.0.self_attn.o_proj")


def gptq_linear(tensors: dict[str, torch.Tensor], **changes: Any) -> Linear:
    """A 64 -> 32 GPTQ linear (config ``changes``) that loaded ``tensors``."""
    return loaded_linear(method_for(**changes), tensors, 64, 32)


def test_layer_errors_name_the_layer_and_the_fix() -> None:
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    tensors, _ = gptq_layer(weight, GROUP, None, sym=False, v1=True)
    with pytest.raises(CheckpointError, match="unquantized 'weight' in a GPTQ checkpoint"):
        gptq_linear({"weight": weight})
    with pytest.raises(CheckpointError, match="qweight must be int32"):
        gptq_linear({"qweight": tensors["qweight"].to(torch.int64)})
    with pytest.raises(CheckpointError, match="missing qzeros"):
        gptq_linear({"qweight": tensors["qweight"], "scales": tensors["scales"]})
    with pytest.raises(CheckpointError, match="g_idx names groups outside 0..1"):
        gptq_linear({**tensors, "g_idx": torch.full((64,), 2, dtype=torch.int32)})
    uneven = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)
    with pytest.raises(CheckpointError, match="other sizes than group_size 32"):
        gptq_linear({**tensors, "g_idx": uneven})
    with pytest.raises(CheckpointError, match="desc_act .* has no g_idx"):
        gptq_linear({k: t for k, t in tensors.items() if k != "g_idx"}, desc_act=True)


@pytest.mark.parametrize("bits, rows", [(4, 3), (8, 3), (8, 70)])
def test_the_fused_kernels_gather_an_act_order_layers_input(bits: int, rows: int) -> None:
    """The fused W4A16/W8A16 GEMM (forced here: on a GPU, batches up to fused_max_rows run it) reads an act-order
    layer's input in the layer's input order as it loads it; the other paths permute first (70 rows: past
    fused_max_rows, dequantize and matmul)."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(15))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(16))
    tensors, dequantized = gptq_layer(weight, GROUP, order, sym=False, v1=True, bits=bits)
    method = method_for(bits=bits, desc_act=True)
    forced = type("FusedWhereAllowed", (type(method),),
                  {"runs_fused": lambda self, x: x.shape[0] <= self.fused_max_rows})(method.config)
    linear = loaded_linear(forced, tensors, 64, 32)
    assert linear.input_order is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(17))
    torch.testing.assert_close(linear(x), x @ dequantized.t(), rtol=1e-4, atol=1e-4)


def test_v1_zero_points_of_0_read_back_as_transformers_reads_them() -> None:
    """GPTQModel writes v1 by subtracting 0x11111111 from each qzeros word: a zero point of 0 borrows from the next
    nibble (its nibble reads 15, the next one less 1). Adding it back to the whole word, as transformers does,
    restores both."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(12))
    weight[:16, :32] = weight[:16, :32].abs()  # all positive: a zero point of 0 in group 0 of those rows
    tensors, dequantized = gptq_layer(weight, GROUP, None, sym=False, v1=True)
    nibbles = gptq.unpack_columns(tensors["qzeros"])
    assert nibbles[0, :16].tolist() == ([15] + [14] * 7) * 2  # as stored: -1, and the borrows from the next ones
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(gptq_linear(dict(tensors))(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)
    int64_g_idx = {**tensors, "g_idx": tensors["g_idx"].to(torch.int64)}  # some writers' dtype: group numbers
    torch.testing.assert_close(gptq_linear(int64_g_idx)(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)


def test_a_zero_bias_for_a_layer_without_one_is_skipped_and_another_refused() -> None:
    """AutoGPTQ's older packers saved a bias buffer (zeros) for every layer, which vLLM skips too."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    tensors, dequantized = gptq_layer(weight, GROUP, None, sym=True, v1=True)
    linear = gptq_linear({**tensors, "bias": torch.zeros(32, dtype=torch.float16)})
    assert linear.bias is None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(linear(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="nonzero bias"):
        gptq_linear({**tensors, "bias": torch.full((32,), 0.5, dtype=torch.float16)})


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_quantized_layers_load_gptq_tensors_transposed_with_their_g_idx(bits: int) -> None:
    """compressed-tensors' int4 and int8 tensors are GPTQ v2's transposed (quant/pack_quantized.py), ``weight_g_idx``
    its g_idx (llm-compressor's former activation order "group"); a symmetric scheme stores no zero point (0: 8, or
    128 at 8 bits)."""
    from infer.plugins.fp8 import build_compressed_tensors

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(10))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    for symmetric in (False, True):
        tensors, dequantized = gptq_layer(weight, GROUP, order, sym=symmetric, v1=False, bits=bits)
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
                  "group_size": GROUP}}}}
        method = build_compressed_tensors(EngineConfig(), qc)
        linear = Linear(64, 32, False, "model.layers.0.mlp.down_proj", method, torch.float32)
        checkpoint = {"weight_packed": tensors["qweight"].t(), "weight_scale": tensors["scales"].t().float(),
                      "weight_g_idx": tensors["g_idx"], "weight_shape": torch.tensor([32, 64])}
        if not symmetric:
            checkpoint["weight_zero_point"] = tensors["qzeros"].t()
        for name, tensor in checkpoint.items():
            linear.load(name, tensor.contiguous())
        method.process_after_loading(linear)
        torch.testing.assert_close(linear(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="weight_shape is \\[64, 32\\]"):
        linear = Linear(64, 32, False, "model.layers.0.mlp.down_proj", method, torch.float32)
        linear.load("weight_shape", torch.tensor([64, 32]))
    asymmetric = Linear(64, 32, False, "model.layers.0.mlp.down_proj",
                        build_compressed_tensors(EngineConfig(), pack_quantized_config(symmetric=False)), torch.float32)
    with pytest.raises(CheckpointError, match="unpacked int8, as older compressed-tensors releases wrote it"):
        asymmetric.load("weight_zero_point", torch.zeros(32, 2, dtype=torch.int8))
    with pytest.raises(CheckpointError, match="weight_zero_point, but the config's scheme is symmetric"):
        linear.load("weight_zero_point", tensors["qzeros"].t().contiguous())
    with pytest.raises(CheckpointError, match="missing weight_packed"):
        method.process_after_loading(Linear(64, 32, False, "model.layers.0.mlp.down_proj", method, torch.float32))


def pack_quantized_config(**weights: Any) -> dict[str, Any]:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}


@pytest.mark.parametrize("change, message", [
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=3), "not static 4- or 8-bit int"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy 'tensor'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=16), "group_size 16"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "activations too"),
    (lambda qc: qc["config_groups"].update(group_1={"targets": ["re:.*down_proj$"], "format": "float-quantized"}),
     "group 'group_1' weights must be an object, got None; infer loads the FP8"),
    (lambda qc: qc["config_groups"].update(group_1={"targets": ["re:.*down_proj$"], "format": "nvfp4-pack-quantized"}),
     "group 'group_1' is 'nvfp4-pack-quantized', neither pack-quantized nor float-quantized"),
    (lambda qc: qc.update(quantization_status="frozen"), "quantization_status is 'frozen'"),
])
def test_unsupported_pack_quantized_configs_are_refused_by_name(change: Callable[[dict[str, Any]], None],
                                                                message: str) -> None:
    from infer.plugins.fp8 import build_compressed_tensors

    qc = pack_quantized_config()
    change(qc)
    with pytest.raises(CheckpointError, match=message):
        build_compressed_tensors(EngineConfig(), qc)


def test_pack_quantized_targets_and_ignore_pick_the_int4_linears() -> None:
    from infer.plugins.fp8 import build_compressed_tensors

    qc = pack_quantized_config()
    qc["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    qc["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    method = build_compressed_tensors(EngineConfig(), qc)
    assert method.applies_to("model.layers.0.mlp.down_proj") and method.applies_to("model.layers.1.mlp.up_proj")
    assert not method.applies_to("model.layers.1.mlp.down_proj")
    assert not method.applies_to("model.layers.0.self_attn.q_proj") and not method.applies_to("lm_head")


def test_pack_quantized_act_order_needs_g_idx_and_fused_rows_is_an_option() -> None:
    from infer.plugins.fp8 import build_compressed_tensors

    options = EngineConfig(plugin_options={"compressed-tensors": {"fused_max_rows": 8}})
    method = build_compressed_tensors(options, pack_quantized_config(actorder="group"))
    assert method.fused_max_rows == 8 and build_compressed_tensors(EngineConfig(), pack_quantized_config()) \
        .fused_max_rows == 64
    tensors, _ = gptq_layer(torch.randn(32, 64, generator=torch.Generator().manual_seed(14)), GROUP, None, True, False)
    linear = Linear(64, 32, False, "model.layers.0.mlp.down_proj", method, torch.float32)
    for name, tensor in (("weight_packed", tensors["qweight"].t()), ("weight_scale", tensors["scales"].t()),
                         ("weight_shape", torch.tensor([32, 64]))):
        linear.load(name, tensor.contiguous())
    with pytest.raises(CheckpointError, match="actorder 'group', but layer .* has no weight_g_idx"):
        method.process_after_loading(linear)


def test_pack_quantized_checkpoints_say_their_kv_cache_scheme_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    from infer.plugins.fp8 import build_compressed_tensors

    with caplog.at_level(logging.WARNING, logger="infer"):
        build_compressed_tensors(EngineConfig(), {**pack_quantized_config(), "kv_cache_scheme": {"num_bits": 8}})
    assert any("kv_cache_scheme and its k/v scales are ignored" in r.message for r in caplog.records)


def as_pack_quantized(gptq_dir: Path, symmetric: bool, bits: int = 4) -> None:
    """Rewrite a gptq_v2 checkpoint written by :func:`write_gptq` in compressed-tensors' pack-quantized names
    (quant/pack_quantized.py: GPTQ's tensors transposed, g_idx as weight_g_idx, the symmetric zero point unstored)."""
    state = load_file(str(gptq_dir / "model.safetensors"))
    names = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point",
             "g_idx": "weight_g_idx"}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        owner, _, attr = name.rpartition(".")
        if attr not in names:
            out[name] = tensor
        elif not (attr == "qzeros" and symmetric):
            out[f"{owner}.{names[attr]}"] = tensor if attr == "g_idx" else tensor.t().contiguous()
        if attr == "qweight":
            out[f"{owner}.weight_shape"] = torch.tensor([tensor.shape[1], tensor.shape[0] * (32 // bits)])
    save_file(out, str(gptq_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"] = {**pack_quantized_config(symmetric=symmetric, num_bits=bits),
                                     "ignore": ["lm_head"]}
    (gptq_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("symmetric, fused_ops, bits", [(True, True, 4), (False, False, 4), (False, True, 8)])
def test_pack_quantized_experts_in_activation_order_compute_their_weights(
        symmetric: bool, fused_ops: bool, bits: int, tmp_path: Path, tiny_model_factory: Callable[..., Path],
        plugins: PluginManager) -> None:
    """llm-compressor's W4A16 and W8A16 mixtures of experts: per-expert pack-quantized linears, stacked with the
    fused ops."""
    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    write_gptq(moe, tmp_path / "ct", tmp_path / "dense", "shared", sym=symmetric, v1=False, bits=bits)
    as_pack_quantized(tmp_path / "ct", symmetric, bits)
    loaded = load(tmp_path / "ct", plugins, fused_ops=fused_ops)
    assert loaded.quant.name == "compressed-tensors"
    torch.testing.assert_close(logits(tmp_path / "ct", plugins, fused_ops=fused_ops),
                               logits(tmp_path / "dense", plugins), rtol=1e-4, atol=1e-4)


def test_dynamic_patterns_are_matched_from_the_start_of_the_path() -> None:
    """GPTQModel (and vLLM) apply a dynamic pattern when ``re.match`` finds it at the start of the module path, so a
    pattern that names only the path's end (no leading ``.*``) overrides nothing."""
    import re

    method = method_for(dynamic={r"+:mlp\.down_proj": {"bits": 8}, r"-:self_attn\.o_proj": {},
                                 r"model\.layers\.1\.mlp\.up_proj": {"bits": 8}})
    for prefix in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        assert re.match(r"mlp\.down_proj|self_attn\.o_proj", prefix) is None  # the rule's reference
        assert method.method_for(prefix).scheme.bits == 4, prefix
    assert method.method_for("model.layers.1.mlp.up_proj").scheme.bits == 8


@pytest.mark.parametrize("activations", [None, "token"], ids=["fp8-weights", "fp8-dynamic"])
def test_a_non_uniform_checkpoint_runs_fp8_experts_beside_int4_attention(
        activations: str | None, tmp_path: Path, tiny_model_factory: Callable[..., Path], plugins: PluginManager,
        caplog: pytest.LogCaptureFixture) -> None:
    """llm-compressor's mixed-precision format on a mixture of experts: attention W4A16 (pack-quantized), the
    experts FP8 per output channel (float-quantized), weight-only or with the input rounded to e4m3 per token
    (FP8_DYNAMIC). The reference: the float model on the int4 attention's dequantized weights and the experts'
    weights rounded as stored, each expert's input rounded per token as FP8_DYNAMIC does (a pre-hook on each expert
    projection of infer's float model, which runs the experts one by one)."""
    from infer.quant.fp8 import FP8_DTYPE

    moe = tiny_model_factory("qwen3moe", extra={"moe_intermediate_size": 64})
    write_gptq(moe, tmp_path / "ct", tmp_path / "dense", v1=False, dynamic={"-:.*experts.*": None})
    as_pack_quantized(tmp_path / "ct", symmetric=True)
    packed, dense = load_file(str(tmp_path / "ct" / "model.safetensors")), \
        load_file(str(tmp_path / "dense" / "model.safetensors"))
    for name in [name for name in packed if ".experts." in name]:
        scale = packed[name].abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        packed[name] = (packed[name] / scale).clamp(-448, 448).to(FP8_DTYPE)
        packed[name.removesuffix("weight") + "weight_scale"] = scale
        dense[name] = packed[name].float() * scale
    save_file(packed, str(tmp_path / "ct" / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(tmp_path / "dense" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["config_groups"]["group_0"].update(targets=[r"re:.*self_attn\..*"], format="pack-quantized")
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    qc["config_groups"]["group_1"] = {
        "targets": [r"re:.*experts\..*"], "format": "float-quantized", "weights": fp8,
        "input_activations": activations and {"num_bits": 8, "type": "float", "symmetric": True,
                                              "strategy": activations, "dynamic": True}}
    qc.update(format="mixed-precision", kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))

    with caplog.at_level(logging.WARNING, logger="infer"):
        loaded = load(tmp_path / "ct", plugins)
    assert sum("kv_cache_scheme and its k/v scales are ignored" in r.message for r in caplog.records) == 1
    experts = [m for m in loaded.model.modules() if isinstance(m, Linear) and ".experts." in m.prefix]
    assert experts and {m.method.name for m in experts} == {"fp8"} and all(m.weight.dtype == FP8_DTYPE
                                                                          for m in experts)
    assert loaded.quant.name == "compressed-tensors" and loaded.quant.applies_to("model.layers.0.self_attn.q_proj")
    with torch.no_grad():
        got = loaded.model.compute_logits(dense_forward(loaded.model, PROMPTS, loaded.device))
    torch.testing.assert_close(got, hf_moe_logits(tmp_path / "dense", activations is not None), rtol=1e-4, atol=1e-4)


def hf_moe_logits(path: Path, round_inputs: bool) -> torch.Tensor:
    """transformers' logits for :data:`PROMPTS` (concatenated) on the float checkpoint at ``path``; with
    ``round_inputs``, its experts module computed by the definition with each expert projection's input rounded to
    e4m3 per token (:func:`per_token_e4m3`), on transformers' own routing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if round_inputs and name.endswith("mlp.experts"):
            module.register_forward_hook(lambda m, args, out: fp8_dynamic_experts(args[0], m, args[1], args[2]))
    with torch.no_grad():
        return torch.cat([model(torch.tensor([prompt])).logits[0] for prompt in PROMPTS])


def fp8_dynamic_experts(x: torch.Tensor, experts: torch.nn.Module, chosen: torch.Tensor, weights: torch.Tensor
                        ) -> torch.Tensor:
    """The experts on transformers' stacked weights (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), expert by
    expert over its tokens, each projection's input rounded per token."""
    out, size = torch.zeros_like(x), experts.down_proj.shape[2]
    for e in range(experts.gate_up_proj.shape[0]):
        tokens, slots = torch.where(chosen == e)
        h = per_token_e4m3(x[tokens]) @ experts.gate_up_proj[e].t()
        y = per_token_e4m3(torch.nn.functional.silu(h[:, :size]) * h[:, size:]) @ experts.down_proj[e].t()
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def per_token_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 on one scale per token (row), amax / 448: FP8_DYNAMIC's input quantization."""
    from infer.quant.fp8 import FP8_DTYPE

    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x / scale).clamp(-448, 448).to(FP8_DTYPE).to(x.dtype) * scale
