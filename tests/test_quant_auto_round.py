"""AutoRound checkpoints (quant/auto_round.py), written here by the real ``auto-round`` package (the optional
``autoround`` extra; round-to-nearest, ``iters=0``, on a tiny Llama on the CPU, calibration text given as strings so
that nothing is fetched) and loaded by infer: its unpacked weights equal the library's own dequantization bit for
bit (its QuantLinear, loaded through transformers, in float32, applied to the identity), or AutoAWQ's
``dequantize_gemm`` (fp16) for the AWQ packing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("auto_round", reason="the autoround extra is not installed")

from safetensors.torch import load_file  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import CheckpointError  # noqa: E402
from infer.core.loader import load_model  # noqa: E402
from infer.core.plugins import PluginManager  # noqa: E402
from infer.models.layers import Linear, UnquantizedMethod  # noqa: E402
from infer.plugins.gptq import build_auto_round  # noqa: E402
from infer.quant.gptq import GptqScheme  # noqa: E402

pytestmark = pytest.mark.autoround
TEXTS = ["def parse(text):\n    return [int(part) for part in text.split(',')]\n" * 20,
         "class Stack:\n    def __init__(self):\n        self.items = []\n" * 20]


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager.from_entry_points().collect()


def auto_round(model: Path, out: Path, fmt: str, sym: bool = True, layer_config: dict[str, Any] | None = None
               ) -> Path:
    """``model`` quantized by auto-round (int4, groups of 32, RTN) and saved in ``fmt``; the checkpoint's folder."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    rounder = AutoRound(hf, AutoTokenizer.from_pretrained(str(model)), bits=4, group_size=32, sym=sym, iters=0,
                        nsamples=2, seqlen=32, dataset=TEXTS, layer_config=layer_config or {})
    rounder.quantize_and_save(str(out), format=fmt)
    return next(path.parent for path in out.rglob("config.json"))


def ours(folder: Path, plugins: PluginManager) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """infer's load of ``folder``: the model, its quantized linears' weights [out, in] (float32), every method."""
    loaded = load_model(EngineConfig(model=str(folder), device="cpu").validate(), plugins, folder)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    weights = {m.prefix: m.method.dequantized(m, torch.float32, False).t() for m in linears
               if not isinstance(m.method, UnquantizedMethod)}
    return loaded, weights, {m.prefix: m.method for m in linears}


def library_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights [out, in] of auto-round's own QuantLinear layers, as transformers loads them: in float32, applied
    to the identity."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, device_map="cpu")
    weights = {}
    for name, module in model.named_modules():
        if "QuantLinear" in type(module).__name__:
            module.float()
            with torch.no_grad():
                weights[name] = module(torch.eye(module.infeatures)).t()
    return weights


def test_the_default_format_unpacks_as_the_library_does(tiny_model: Path, tmp_path: Path,
                                                        plugins: PluginManager) -> None:
    """format='auto_round', symmetric: GPTQ's tensors with v1 zero points (packing auto_round:auto_gptq)."""
    folder = auto_round(tiny_model, tmp_path / "ar", "auto_round")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["packing_format"]) == ("auto-round", "auto_round:auto_gptq")
    loaded, weights, _ = ours(folder, plugins)
    assert loaded.quant.name == "auto-round"
    theirs = library_weights(folder)
    assert weights.keys() == theirs.keys() and len(weights) == 14
    for name, weight in weights.items():
        assert torch.equal(weight, theirs[name]), name


def test_per_layer_settings_load_each_linear_by_its_own(tiny_model: Path, tmp_path: Path,
                                                         plugins: PluginManager) -> None:
    """auto-round's layer_config, written as extra_config: an 8-bit down_proj in groups of 64, a 16-bit k_proj."""
    from infer.quant.w8a16_method import W8A16LinearMethod

    layer_config = {"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64},
                    "model.layers.1.self_attn.k_proj": {"bits": 16}}
    folder = auto_round(tiny_model, tmp_path / "ar", "auto_round", layer_config=layer_config)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["extra_config"] == layer_config
    _, weights, methods = ours(folder, plugins)
    assert isinstance(methods["model.layers.0.mlp.down_proj"], W8A16LinearMethod)
    assert methods["model.layers.0.mlp.down_proj"].group_size == 64
    assert type(methods["model.layers.1.self_attn.k_proj"]) is UnquantizedMethod
    theirs = library_weights(folder)
    assert weights.keys() == theirs.keys() and len(weights) == 13
    for name, weight in weights.items():
        assert torch.equal(weight, theirs[name]), name


@pytest.mark.autoawq
@pytest.mark.parametrize("sym", [False, True])
def test_the_awq_packings_unpack_as_autoawq_does(sym: bool, tiny_model: Path, tmp_path: Path,
                                                  plugins: PluginManager) -> None:
    """format='auto_awq': an AutoAWQ GEMM checkpoint (quant_method awq; symmetric ones say zero_point false and store
    the zero point 8). The same tensors under AutoRound's own config (packing auto_round:auto_awq, what
    format='auto_round' writes for asymmetric schemes: auto-round 0.16.1 writes them byte for byte alike, checked in
    a venv without autoawq, whose presence breaks that export) load the same."""
    from awq.utils.packing_utils import dequantize_gemm

    folder = auto_round(tiny_model, tmp_path / "awq", "auto_awq", sym=sym)
    config = json.loads((folder / "config.json").read_text())
    assert (config["quantization_config"]["quant_method"], config["quantization_config"]["zero_point"]) == \
        ("awq", not sym)
    state = load_file(str(folder / "model.safetensors"))
    _, weights, _ = ours(folder, plugins)
    assert len(weights) == 14
    for name, weight in weights.items():
        theirs = dequantize_gemm(*(state[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales")), 4, 32)
        assert torch.equal(weight.half(), theirs.t()), name  # its fp16 product, ours exact in fp32 then rounded
    if sym:
        assert bool((state["model.layers.0.mlp.down_proj.qzeros"] == -0x77777778).all())  # 0x88888888: all 8
    else:  # zero_point false over zero points of its own: the config misdescribes the tensors
        shutil.copytree(folder, tmp_path / "wrong")
        wrong = json.loads(json.dumps(config))
        wrong["quantization_config"]["zero_point"] = False
        (tmp_path / "wrong" / "config.json").write_text(json.dumps(wrong))
        with pytest.raises(CheckpointError, match="says zero_point false .symmetric., but layer .* stores zero points "
                                                  "other than 8"):
            ours(tmp_path / "wrong", plugins)
    shutil.copytree(folder, tmp_path / "ar")
    config["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": sym,
                                     "data_type": "int", "packing_format": "auto_round:auto_awq",
                                     "block_name_to_quantize": "model.layers"}
    (tmp_path / "ar" / "config.json").write_text(json.dumps(config))
    loaded, again, methods = ours(tmp_path / "ar", plugins)
    assert loaded.quant.name == "auto-round" and type(methods["lm_head"]) is UnquantizedMethod
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)


def method_for(**changes: Any) -> Any:
    return build_auto_round(EngineConfig(), {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True,
                                             "packing_format": "auto_round:auto_gptq", **changes})


def test_which_linears_are_quantized_how_follows_the_librarys_rules() -> None:
    """Exact extra_config names first; then the blocks; then extra_config patterns (re.search), whose bits apply
    off the blocks too; 16 bits: float."""
    method = method_for(block_name_to_quantize="model.layers.0,model.layers.1", extra_config={
        "model.layers.1.mlp.down_proj": {"bits": 8}, r".*\.k_proj": {"bits": 16}, r"mlp\.up": {"group_size": 64},
        r"model\.layers\.2\..*gate": {"bits": 8}, "model.layers.9.mlp.up_proj": {"bits": 4}})
    expected = {"model.layers.1.mlp.down_proj": GptqScheme(8, 32), "model.layers.0.self_attn.k_proj": None,
                "model.layers.0.mlp.up_proj": GptqScheme(4, 64), "model.layers.0.mlp.down_proj": GptqScheme(4, 32),
                "model.layers.2.mlp.down_proj": None, "model.layers.2.mlp.up_proj": None,  # off the blocks
                "model.layers.2.mlp.gate_proj": GptqScheme(8, -1), "model.layers.9.mlp.up_proj": GptqScheme(4, 32),
                "lm_head": None}
    for prefix, scheme in expected.items():
        chosen = method.method_for(prefix)
        assert (chosen is None if scheme is None else chosen.scheme == scheme), prefix


@pytest.mark.parametrize("changes, message", [
    ({"packing_format": "auto_round:gptq"}, "packing_format 'auto_round:gptq' is not one infer loads"),
    ({"data_type": "nv_fp"}, "data_type 'nv_fp' in the AutoRound config is not int"),
    ({"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8, "data_type": "fp"}}},
     "data_type 'fp' in extra_config 'model.layers.0.mlp.down_proj' is not int"),  # a mixed checkpoint's FP8 layer
    ({"extra_config": {r".*down_proj": {"data_type": "mx_fp", "bits": 4}}}, "data_type 'mx_fp' in extra_config"),
    ({"act_bits": 8}, "act_bits 8 in the AutoRound config"),
    ({"bits": 16, "data_type": "float"}, "bits are 16, which leave every layer in 16 bits"),  # was an assert
    ({"bits": 2}, "bits must be 4 or 8 .or 16: unquantized., got 2 in the AutoRound config"),
    ({"extra_config": {"model.layers.0.mlp.up_proj": {"bits": 3}}}, "got 3 in extra_config"),
    ({"extra_config": {"lm_head": {"bits": 4}}}, "quantizes lm_head"),
    ({"extra_config": {"[bad": {"bits": 8}}}, "not a valid regular expression"),
    ({"group_size": 48}, "group_size must be one of"),
    ({"packing_format": "auto_round:auto_awq", "extra_config": {"model.layers.0.mlp.up_proj": {"bits": 8}}},
     "packs its layers as AWQ with settings of their own"),
])
def test_unsupported_configs_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        method_for(**changes)


def test_an_unquantized_checkpoint_is_refused_with_the_way_out(tiny_model: Path) -> None:
    from infer.core.engine import Engine
    from infer.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--quant auto-round loads AutoRound checkpoints"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", quant="auto-round", num_kv_blocks=16))


def test_older_block_names_and_act_bits_follow_the_library() -> None:
    """auto-round's own loader (``get_layer_config``) reads ``to_quant_block_names`` when a config has no
    ``block_name_to_quantize`` (older files), and quantizes activations only when ``act_bits`` is 8 or less:
    infer quantizes the same linears, and refuses a config exactly when the library would quantize activations."""
    from types import SimpleNamespace

    from auto_round.inference.convert_model import get_layer_config
    from auto_round.schemes import QuantizationScheme
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    settings = {"bits": 4, "group_size": 32, "sym": True, "data_type": "int", "extra_config": {}}
    library = get_layer_config(model, SimpleNamespace(to_quant_block_names="model.layers.0", **settings))
    method = method_for(to_quant_block_names="model.layers.0")
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert {name for name in linears if method.applies_to(name)} == {n for n, s in library.items() if s.bits < 16}
    for act_bits in (4, 8, 16):
        if QuantizationScheme.from_dict({**settings, "act_bits": act_bits}).is_act_quantize():
            with pytest.raises(CheckpointError, match=f"act_bits {act_bits}"):
                method_for(act_bits=act_bits)
        else:
            assert method_for(act_bits=act_bits).applies_to("model.layers.0.mlp.up_proj")
