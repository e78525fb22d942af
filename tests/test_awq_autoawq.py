"""A checkpoint written by the real AutoAWQ (the optional ``awq`` extra, 0.2.9) loads in infer with the same weights.

A tiny random Llama is quantized by AutoAWQ on CPU (GEMM, 4 bits, group 64) with token-id calibration data, then
infer's unpacking is compared with AutoAWQ's own ``dequantize_gemm`` bit for bit, and infer's linear method with
AutoAWQ's ``WQLinear_GEMM`` forward.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("awq", reason="AutoAWQ is not installed (pip install 'infer-engine[awq]')")

from safetensors.torch import load_file  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.kernels.awq_gemm import awq_gemm, awq_gemm_reference  # noqa: E402
from infer.models.layers import Linear  # noqa: E402
from infer.plugins.awq import build_awq  # noqa: E402
from infer.quant import awq  # noqa: E402

pytestmark = pytest.mark.autoawq

GROUP = 64


@pytest.fixture(scope="module")
def autoawq_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(folder of an AutoAWQ-quantized tiny Llama, {module path: AutoAWQ's WQLinear_GEMM module})."""
    from awq import AutoAWQForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path_factory.mktemp("llama")
    out = tmp_path_factory.mktemp("llama-awq")
    # AutoAWQ's clip search needs every out_features to be a multiple of 64 (k/v: 2 heads * 32)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(src)
    model = AutoAWQForCausalLM.from_pretrained(str(src))
    g = torch.Generator().manual_seed(0)
    # token ids, each sample no longer than max_calib_seq_len (longer ones are silently dropped)
    calib = [torch.randint(0, 256, (32,), generator=g).tolist() for _ in range(8)]
    model.quantize(None, quant_config={"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"},
                   calib_data=calib, max_calib_seq_len=32, max_calib_samples=8)
    model.save_quantized(str(out))
    modules = {name: m for name, m in model.model.named_modules() if type(m).__name__ == "WQLinear_GEMM"}
    return out, modules


def checkpoint_layers(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        owner, _, attr = name.rpartition(".")
        if attr in ("qweight", "qzeros", "scales"):
            layers.setdefault(owner, {})[attr] = tensor
    return layers


def test_config_parses(autoawq_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    folder, _ = autoawq_checkpoint
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert awq.parse_config(qc) == awq.AwqConfig(GROUP, ())


def test_unpacked_weights_equal_autoawq_dequantization(autoawq_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    from awq.utils.packing_utils import dequantize_gemm

    folder, _ = autoawq_checkpoint
    layers = checkpoint_layers(folder)
    assert len(layers) == 2 * 7
    for name, t in layers.items():
        theirs = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], 4, GROUP)
        ours = awq.dequantize(t["qweight"], t["qzeros"], t["scales"], GROUP)
        assert ours.dtype == theirs.dtype == torch.float16, name
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), name
        # and our packer writes AutoAWQ's bytes back
        assert torch.equal(awq.pack_int4(awq.unpack_int4(t["qweight"])), t["qweight"]), name
        assert torch.equal(awq.pack_int4(awq.unpack_int4(t["qzeros"])), t["qzeros"]), name


def test_linear_method_matches_wqlinear_gemm(autoawq_checkpoint: tuple[Path, dict[str, Any]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import awq.modules.linear.gemm as autoawq_gemm

    if not torch.cuda.is_available():  # its Triton path needs CUDA; take its torch path (dequantize_gemm + matmul)
        monkeypatch.setattr(autoawq_gemm, "TRITON_AVAILABLE", False)
    folder, modules = autoawq_checkpoint
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    method = build_awq(EngineConfig(), qc)
    layers = checkpoint_layers(folder)
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(1)).half()
    for name, tensors in layers.items():
        theirs = modules[name]
        linear = Linear(theirs.in_features, theirs.out_features, False, name, method, torch.float16)
        for attr, tensor in tensors.items():
            linear.load(attr, tensor)
        method.process_after_loading(linear)
        xi = x[..., : theirs.in_features]
        with torch.no_grad():
            assert torch.equal(linear(xi), theirs(xi)), name


def test_triton_kernel_on_autoawq_weights(autoawq_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    folder, _ = autoawq_checkpoint
    t = checkpoint_layers(folder)["model.layers.0.mlp.down_proj"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = {k: v.to(device) for k, v in t.items()}
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)).to(device, torch.float16)
    out = awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], GROUP, block_k=128)
    ref = awq_gemm_reference(x, t["qweight"], t["qzeros"], t["scales"], GROUP)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
