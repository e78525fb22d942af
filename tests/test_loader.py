"""Imperfect HF folders: each loads as transformers reads it, or fails with a CheckpointError that names the file,
tensor or field and says what to do. Never a traceback, never a silently different model."""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.cli import main
from infer.core.errors import CheckpointError, ConfigError, InvalidRequestError
from infer.core.loader import check_finite

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 300, 42]


def copy_of(src: Path, dst: Path, config: dict[str, Any] | None = None,
            tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    """``src`` copied to ``dst``, with config.json fields replaced (None deletes) and the tensors rewritten."""
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        for key, value in config.items():
            if value is None:
                raw.pop(key, None)
            else:
                raw[key] = value
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        save_file(tensors(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def greedy(path: Path, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY) -> list[int]:
    return LLM(model=str(path), device="cpu").generate([prompt], params)[0].outputs[0].token_ids


def load_error(path: Path, **options: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        LLM(model=str(path), device="cpu", **options)
    return str(info.value)


@pytest.fixture(scope="module")
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


def test_a_stray_safetensors_file_is_not_part_of_the_checkpoint(llama, tmp_path, hf_greedy, caplog):
    path = copy_of(llama, tmp_path / "m")
    save_file({"model.norm.weight": torch.zeros(64)}, str(path / "zz-extra.safetensors"))
    with caplog.at_level(logging.WARNING, logger="infer"):
        assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)
    assert "zz-extra.safetensors" in caplog.text


def test_a_tensor_in_two_files_is_an_error(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "a.safetensors"))
    save_file({"model.norm.weight": torch.zeros(64)}, str(path / "b.safetensors"))
    assert "'model.norm.weight' appears twice" in (message := load_error(path))
    assert "(in b.safetensors; without model.safetensors.index.json infer reads every *.safetensors file" in message


def test_a_tensor_the_model_refuses_names_its_file_among_several(llama, tmp_path):
    """An adapter's file left beside unindexed shards: the error named the tensor, not the file to move out."""
    path = copy_of(llama, tmp_path / "m")
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}, str(path / "adapter.safetensors"))
    message = load_error(path)
    assert "unexpected tensor 'base_model.model.lm_head.lora_A.weight'" in message
    assert "(in adapter.safetensors; without model.safetensors.index.json" in message
    (path / "adapter.safetensors").unlink()
    single = copy_of(llama, tmp_path / "single", tensors=lambda t: {**t, "stray.weight": torch.zeros(2)})
    assert "unexpected tensor 'stray.weight'" in (message := load_error(single)) and "(in " not in message


@pytest.mark.parametrize("index, expected", [("{not json", "is not a valid safetensors index"),
                                             ('{"metadata": {}}', "is not a valid safetensors index")])
def test_a_broken_shard_index_names_the_file(llama, tmp_path, index, expected):
    path = copy_of(llama, tmp_path / "m")
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(index)
    message = load_error(path)
    assert expected in message and "model.safetensors.index.json" in message


def test_weight_files_that_are_no_files_are_named(llama, tmp_path):
    """A copied HF cache snapshot's dangling link failed with a raw FileNotFoundError after the model was built; a
    folder where a weight file should be, or an index naming a file by a number, with an OSError or a TypeError."""
    path = copy_of(llama, tmp_path / "link")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("../blobs/gone")
    assert "model.safetensors is a link to '../blobs/gone', which does not exist" in load_error(path)
    assert "cp -rL" in load_error(path)
    folder = copy_of(llama, tmp_path / "folder")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors").mkdir()
    assert "model.safetensors is not a file" in load_error(folder)
    shard = copy_of(llama, tmp_path / "shard")
    names = list(load_file(str(shard / "model.safetensors")))
    (shard / "model.safetensors").rename(shard / "model-00001-of-00001.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: 1 for n in names}}))
    assert "is not a valid safetensors index" in (message := load_error(shard)) and "a file name is 1" in message
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    assert greedy(shard) == greedy(llama)  # the same folder, indexed right, loads


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_config_file_that_is_a_folder_is_a_checkpoint_error(llama, tmp_path, name):
    path = copy_of(llama, tmp_path / "m")
    (path / name).unlink(missing_ok=True)
    (path / name).mkdir()
    assert f"cannot read {path / name} (" in (message := load_error(path)) and "it should be a file" in message


def test_model_safetensors_wins_over_a_shard_index_as_in_hf(llama, tmp_path, hf_greedy, caplog):
    """A folder holding both (a leftover of a re-export): transformers loads model.safetensors, and so must infer,
    or the two run different weights."""
    path = copy_of(llama, tmp_path / "m")
    other = {name: t * 0.5 if t.dim() == 2 else t for name, t in load_file(str(path / "model.safetensors")).items()}
    save_file(other, str(path / "model-00001-of-00001.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00001-of-00001.safetensors" for name in other}}))
    with caplog.at_level(logging.WARNING, logger="infer"):
        assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens) == greedy(llama)
    assert any("loading model.safetensors only, as transformers does" in r.message for r in caplog.records)


def test_generation_config_eos_ids_stop_generation_as_in_hf(llama, tmp_path, hf_greedy):
    reference = hf_greedy(llama, PROMPT, 8)
    stop_at = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 1)  # a first occurrence
    path = copy_of(llama, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, reference[stop_at]]}))
    out = LLM(model=str(path), device="cpu").generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].outputs[0].token_ids == reference[: stop_at + 1]
    assert out[0].outputs[0].finish_reason.value == "stop"


def test_generation_config_eos_ids_replace_config_json_eos_as_in_hf(llama, tmp_path):
    """HF's generate stops only at generation_config.json's eos ids when it names some; config.json's (and the
    tokenizer's) do not stop it. They used to be merged, which stopped earlier than HF."""
    from transformers import AutoModelForCausalLM

    reference = LLM(model=str(llama), device="cpu").generate([PROMPT], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    firsts = [i for i, t in enumerate(reference) if t not in reference[:i]]
    early, late = firsts[1], firsts[-1]
    path = copy_of(llama, tmp_path / "m", {"eos_token_id": reference[early]})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [reference[late]]}))
    out = LLM(model=str(path), device="cpu").generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf_out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert out[0].outputs[0].token_ids == hf_out == reference[: late + 1]


def test_a_tokenizer_larger_than_the_vocabulary_refuses_the_prompt_not_the_step(llama, tmp_path):
    def shrink(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v[:512].contiguous() if k in ("model.embed_tokens.weight", "lm_head.weight") else v
                for k, v in t.items()}

    path = copy_of(llama, tmp_path / "m", {"vocab_size": 512}, shrink)
    llm = LLM(model=str(path), device="cpu")
    text = "".join(llm.tokenizer.convert_ids_to_tokens([900, 901])).replace("\u0120", " ")
    with pytest.raises(InvalidRequestError, match=r"tokenizer has more tokens than the model"):
        llm.generate([text], GREEDY)
    assert len(llm.generate(["a"], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens  # still serves


def test_tied_embeddings_with_a_different_head_are_refused(llama, tmp_path):
    message = load_error(copy_of(llama, tmp_path / "m", {"tie_word_embeddings": True}))
    assert "lm_head.weight differs from model.embed_tokens.weight" in message
    assert "tie_word_embeddings false" in message


def test_tied_embeddings_with_the_same_head_load(llama, tmp_path, hf_greedy):
    def tie(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return t | {"lm_head.weight": t["model.embed_tokens.weight"].clone()}

    path = copy_of(llama, tmp_path / "m", {"tie_word_embeddings": True}, tie)
    assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_tied_tensor_saved_under_the_heads_name_alone_loads_as_in_hf(arch, checkpoint, tmp_path, hf_greedy):
    """safetensors' save_model keeps one name of tensors that share memory, the first in order: lm_head.weight.
    transformers loads such a checkpoint; infer refused it for a missing model.embed_tokens.weight."""
    def head_only(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        embedding = t.pop("model.embed_tokens.weight")
        return {**{k: v for k, v in t.items() if k != "lm_head.weight"}, "lm_head.weight": embedding}

    path = copy_of(checkpoint(arch), tmp_path / "m", {"tie_word_embeddings": True}, head_only)
    assert "model.embed_tokens.weight" not in load_file(str(path / "model.safetensors"))
    assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)


def test_non_finite_weights_are_refused_by_name(llama, tmp_path):
    def poison(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        up, norm = t["model.layers.0.mlp.up_proj.weight"].clone(), t["model.norm.weight"].clone()
        up[3, 1], norm[0] = float("nan"), float("inf")
        return t | {"model.layers.0.mlp.up_proj.weight": up, "model.norm.weight": norm}

    message = load_error(copy_of(llama, tmp_path / "m", tensors=poison))
    assert message.startswith("2 weight tensor(s) hold NaN or infinite values")
    assert "layers.0.mlp.up_proj.weight" in message and "norm.weight" in message


def test_weight_matrices_of_zeros_are_warned_of(llama, tmp_path, caplog):
    """A download cut short in a preallocated file leaves zeros: the model loaded silently and generated token 0
    forever. A trained model has no all-zero weight matrix (vectors are not checked: zero biases are common)."""
    def zero_tail(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = sorted(t)
        return {k: torch.zeros_like(v) if i >= len(names) // 2 else v for i, (k, v) in
                enumerate((k, t[k]) for k in names)}

    with caplog.at_level(logging.WARNING, logger="infer"):
        LLM(model=str(llama), device="cpu")
    assert "hold only zeros" not in caplog.text
    path = copy_of(llama, tmp_path / "m", tensors=zero_tail)
    zeroed = sorted(k for k, v in load_file(str(path / "model.safetensors")).items() if v.dim() >= 2 and not v.any())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer"):
        LLM(model=str(path), device="cpu")
    [message] = [r.getMessage() for r in caplog.records if "hold only zeros" in r.getMessage()]
    named = message.partition(" (")[2].partition(", ...)")[0].split(", ")
    assert message.startswith(f"{len(zeroed)} weight matrices hold only zeros (") and len(named) == 5
    assert set(named) <= set(zeroed)
    assert "compare the files' checksums" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2fnuz])
def test_fp8_weights_are_checked_for_every_bit_pattern(dtype):
    """8-bit floats have no aminmax, so their bits are read: each of the 256 patterns is refused exactly when torch
    itself upcasts it to NaN or an infinity (a compressed-tensors FP8 checkpoint's weights are stored so)."""
    for pattern in range(256):
        module = torch.nn.Module()
        module.register_buffer("weight", torch.tensor([0, 1, pattern], dtype=torch.uint8).view(dtype))
        finite = bool(torch.isfinite(module.weight.float()).all())
        if finite:
            check_finite(module)
        else:
            with pytest.raises(CheckpointError, match="1 weight tensor"):
                check_finite(module)


def test_a_weight_past_float16_range_names_the_cast_not_the_checkpoint(llama, tmp_path):
    """A float32 checkpoint with a weight of 1e5 loads in float32; cast to float16 (largest 65504) it overflows,
    which is the cast's doing: the error said the checkpoint was corrupt."""
    def big(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        up = t["model.layers.0.mlp.up_proj.weight"].clone()
        up[0, 0] = 1e5
        return t | {"model.layers.0.mlp.up_proj.weight": up}

    path = copy_of(llama, tmp_path / "m", {"torch_dtype": "float32", "dtype": None}, big)
    assert LLM(model=str(path), device="cpu", num_kv_blocks=4)
    assert "cast to --dtype float16, whose largest value is 65504, its weights overflow" in load_error(
        path, dtype="float16")
    message = load_error(path, dtype="float16", quant="awq")  # it said the checkpoint cannot be AWQ: use fp8
    assert "'model.layers.0.mlp.up_proj' holds NaN or infinite values" in message and "--dtype bfloat16" in message
    assert LLM(model=str(path), device="cpu", num_kv_blocks=4, dtype="bfloat16", quant="awq")


@pytest.mark.parametrize(("text", "complaint"), [
    ("[1, 2]", "holds [1, 2], not a JSON object of config fields"), ("null", "holds null, not a JSON object"),
    (b"\xff\xfe{}", "is not valid JSON in UTF-8")])
def test_a_config_json_that_is_no_object_is_a_checkpoint_error(llama, tmp_path, text, complaint):
    path = copy_of(llama, tmp_path / "m")
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    assert complaint in load_error(path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_truncated_tokenizer_file_is_named(llama, tmp_path, name):
    path = copy_of(llama, tmp_path / "m")
    text = (path / name).read_text()
    (path / name).write_text(text[: len(text) // 2])
    assert f"{name} is not valid JSON (" in load_error(path)


def test_a_tokenizer_config_without_a_vocabulary_file_says_so(llama, tmp_path):
    """transformers' own message told the user to install sentencepiece or tiktoken."""
    path = copy_of(llama, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    message = load_error(path)
    assert "it has no vocabulary file (none of tokenizer.json, tokenizer.model, vocab.json" in message
    assert "copy the tokenizer files of the model it came from" in message and "sentencepiece" not in message


def test_a_tokenizer_file_that_is_a_folder_is_a_checkpoint_error(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").mkdir()
    assert "could not load the tokenizer from" in load_error(path)


def test_config_sizes_past_the_hosts_memory_are_a_capacity_error(llama, tmp_path):
    """torch's CPU allocator raises a RuntimeError, which was reported as a bug in infer."""
    from infer.core.errors import CapacityError

    with pytest.raises(CapacityError) as info:
        LLM(model=str(copy_of(llama, tmp_path / "m", {"vocab_size": 10**12})), device="cpu")
    assert "the model factory 'LlamaForCausalLM' from 'infer-engine' ran out of host memory (" in str(info.value)
    assert "GiB at once): the sizes it was given (for a model, config.json's vocab_size" in str(info.value)


def test_weights_past_the_hosts_available_memory_are_refused_before_loading(llama, tmp_path, mem_available):
    """Each MLP matrix fits (torch.empty only reserves its pages), but together they pass Linux's MemAvailable
    (read independently, conftest): loading would have been killed part-way. Refused before any weight is read."""
    from infer.core.errors import CapacityError

    raw = json.loads((llama / "config.json").read_text())
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    intermediate = int(1.5 * mem_available / (3 * layers * hidden * 4))  # gate, up, down of every layer, float32
    path = copy_of(llama, tmp_path / "m", {"intermediate_size": intermediate})
    with pytest.raises(CapacityError) as info:
        LLM(model=str(path), device="cpu", dtype="float32")
    message = str(info.value)
    needed = float(message.partition("the model's weights need ")[2].partition(" GiB")[0])
    assert needed == pytest.approx(3 * layers * hidden * intermediate * 4 / 2**30, rel=0.01)
    assert f"num_hidden_layers {layers}, hidden_size {hidden}" in message and "GiB of memory this machine" in message


@pytest.mark.parametrize("stated", [3, 2_000_000])
def test_num_hidden_layers_past_the_checkpoints_layers_is_refused_before_the_model_is_built(llama, tmp_path, stated):
    """The 2-layer checkpoint with a config.json that says more: refused from the weight files' names, before
    building the layers (two million of them would take hours) or loading any weight, as HF's load would be told
    by its missing tensors (it random-initializes them with a warning)."""
    from safetensors import safe_open

    with safe_open(str(llama / "model.safetensors"), "pt") as f:
        last = max(int(name.split(".")[2]) for name in f.keys() if name.startswith("model.layers."))
    path = copy_of(llama, tmp_path / "m", {"num_hidden_layers": stated})
    assert load_error(path) == (f"config.json has num_hidden_layers {stated}, but the weights hold decoder layers "
                                f"0 to {last} only (model.layers.N.*); correct num_hidden_layers, or fetch the "
                                "checkpoint again if some of its files are missing")


def test_num_hidden_layers_below_the_checkpoints_layers_names_the_field(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m", {"num_hidden_layers": 1})
    assert load_error(path).startswith("config.json has num_hidden_layers 1, but the weights hold decoder layer 1 "
                                       "too (model.layers.1.")


@pytest.mark.parametrize("field, value", [("vocab_size", 2048), ("num_attention_heads", 8)])
def test_a_size_in_config_json_that_the_weights_contradict_names_the_fields_to_correct(llama, tmp_path, field, value):
    path = copy_of(llama, tmp_path / "m", {field: value})
    message = load_error(path)
    assert message.startswith("shape mismatch for ") and "the sizes in config.json (" in message
    assert field in message and message.endswith("correct config.json, or fetch the checkpoint again")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_a_gemma_norm_that_is_not_float_is_refused(checkpoint, tmp_path, dtype):
    """Gemma's norms load as 1 + w, computed in float: an integer or fp8 norm went through as a float one."""
    def cast_norm(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return t | {"model.norm.weight": t["model.norm.weight"].to(dtype)}

    path = copy_of(checkpoint("gemma2"), tmp_path / "m", tensors=cast_norm)
    assert f"tensor 'model.norm.weight' is {str(dtype).removeprefix('torch.')}, where infer expects float" in \
        load_error(path)


def test_a_missing_head_loads_an_embedding_model_and_suggests_tied_embeddings(llama, tmp_path, caplog):
    """An untied checkpoint without lm_head.weight is an embedding model (Qwen3-Embedding-8B ships so): it loads,
    refuses generation, and the warning says how to fix a generation model that lost its head."""
    path = copy_of(llama, tmp_path / "m", tensors=lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with caplog.at_level(logging.WARNING, logger="infer"):
        llm = LLM(model=str(path), device="cpu")
    assert "set tie_word_embeddings true if the head is the embedding" in caplog.text
    with pytest.raises(InvalidRequestError, match="this checkpoint has no LM head"):
        llm.generate([PROMPT], GREEDY)


@pytest.mark.parametrize("fields, expected", [
    ({"hidden_size": "64"}, "hidden_size = '64', which should be a JSON int"),
    ({"num_hidden_layers": True}, "num_hidden_layers = True, which should be a JSON int"),
    ({"intermediate_size": None}, "lacks the field 'intermediate_size'"),
    ({"intermediate_size": 0}, "intermediate_size = 0, which must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false', which should be a JSON bool"),
    ({"num_hidden_layers": None}, "lacks the field 'num_hidden_layers'"),
    ({"max_position_embeddings": 0}, "max_position_embeddings = 0, which must be a positive integer"),
    ({"max_position_embeddings": -5}, "max_position_embeddings = -5, which must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0, which must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0, which must be a positive integer"),
    ({"num_key_value_heads": 3}, "4 attention heads and 3 key/value heads"),
    ({"head_dim": 0}, "head_dim = 0, which must be a positive integer"),
    ({"head_dim": None, "hidden_size": 2}, "leaves head_dim to its default, 0, which must be a positive integer"),
    ({"vocab_size": -1}, "vocab_size = -1, which must be a positive integer"),
    ({"architectures": "LlamaForCausalLM"}, "it should be a list of class names"),
    ({"architectures": ["LlamaForCausalLM", 1]}, "it should be a list of class names"),
    ({"quantization_config": "awq"}, "quantization_config = 'awq'; it should be an object"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config has quant_method 'bitsandbytes', which no installed plugin loads"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "needs factor as a positive number"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0}},
     "needs factor as a positive number"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}, "needs low_freq_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
     "rope 'longrope' in config.json of this LlamaForCausalLM needs short_factor as a list of 8 positive numbers"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},  # "su" is Phi-3's name for it only
     "unsupported rope_type 'su' in config.json of this LlamaForCausalLM; supported: default, linear, llama3"),
])
def test_bad_config_fields_are_named(llama, tmp_path, fields, expected):
    assert expected in load_error(copy_of(llama, tmp_path / "m", fields))


def test_absent_optional_fields_take_transformers_defaults(tiny_model_factory, tmp_path, hf_greedy):
    """LlamaConfig's defaults: num_key_value_heads = num_attention_heads, max_position_embeddings 2048."""
    source = tiny_model_factory("llama", num_kv_heads=4)  # 4 heads, 4 KV heads: the default when the field is absent
    path = copy_of(source, tmp_path / "m", {"num_key_value_heads": None, "max_position_embeddings": None})
    assert LLM(model=str(path), device="cpu").engine.max_model_len == 2048
    assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_config_without_architectures_loads_by_model_type_as_in_hf(arch, tiny_model_factory, tmp_path, hf_greedy):
    """AutoModelForCausalLM picks the class from model_type when config.json has no `architectures`."""
    path = copy_of(tiny_model_factory(arch), tmp_path / "m", {"architectures": None})
    assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)
    copy_of(path, tmp_path / "neither", {"model_type": None})
    assert "unsupported architecture '(none in config.json)'" in load_error(tmp_path / "neither")


@pytest.mark.parametrize("arch, extra", [("llama", {"attention_bias": True, "mlp_bias": True}),
                                         ("qwen3", {"attention_bias": True})])
def test_projection_biases_load_as_transformers_runs_them(arch, extra, tiny_model_factory, tmp_path, hf_greedy):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m"
    shutil.copytree(tiny_model_factory(arch, extra=extra), path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    biases = [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert any("o_proj" in name for name in biases) and (arch != "llama" or any("mlp" in name for name in biases))
    with torch.no_grad():  # HF initialises biases to zero, which would hide a bias never loaded
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(str(path))
    assert greedy(path) == hf_greedy(path, PROMPT, GREEDY.max_tokens)


def test_quantized_tensors_without_a_quantization_config_name_the_layer(llama, tmp_path):
    def add(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return t | {"model.layers.0.mlp.up_proj.qweight": torch.zeros(64, 16, dtype=torch.int32)}

    message = load_error(copy_of(llama, tmp_path / "m", tensors=add))
    assert "'model.layers.0.mlp.up_proj.qweight'" in message and "quantization_config" in message


@pytest.mark.parametrize("quant", [None, "fp8", "awq"])  # on-load quantization would re-quantize the raw codes
@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_integer_or_fp8_weights_without_a_quantization_config_are_refused(llama, tmp_path, dtype, quant):
    def cast(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return t | {"model.layers.1.self_attn.k_proj.weight": t["model.layers.1.self_attn.k_proj.weight"].to(dtype)}

    message = load_error(copy_of(llama, tmp_path / "m", tensors=cast), quant=quant)
    assert "'model.layers.1.self_attn.k_proj.weight'" in message and "quantization_config" in message


def test_quantization_settings_infer_cannot_read_are_named(llama, tmp_path):
    """AutoAWQ's own spelling without quant_method in config.json: the error says what to add (it blamed
    modules_to_not_convert once the packed tensors met unquantized layers). Settings kept beside config.json are
    read (the writer's method unless they name one: tests/test_quant_gptq.py loads such checkpoints), but not two
    such files, nor one that is no JSON object."""
    qc = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
    message = load_error(copy_of(llama, tmp_path / "m", {"quantization_config": qc}))
    assert "has no quant_method" in message and '"quant_method": "awq"' in message and "--quant" in message
    path = copy_of(llama, tmp_path / "both")
    for name in ("quant_config.json", "quantize_config.json"):
        (path / name).write_text(json.dumps(qc))
    assert "holds both quant_config.json and quantize_config.json" in load_error(path)
    (path / "quant_config.json").unlink()
    (path / "quantize_config.json").write_text("[4]")
    assert "not a JSON object of quantization settings" in load_error(path)


def test_auto_dtype_is_float32_on_the_cpu_and_follows_a_float16_checkpoint_on_a_gpu() -> None:
    """docs/cli.md's --dtype auto: float32 on CPU; on GPU float16 for a float16 checkpoint, else bfloat16. An
    explicit --dtype wins everywhere (no GPU needed: only the device's type is read)."""
    from infer.core.loader import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [resolve_dtype("auto", stated, cuda) for stated in ("float16", "bfloat16", "float32", None)] == [
        torch.float16, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert {resolve_dtype("auto", stated, cpu) for stated in ("float16", "bfloat16", None)} == {torch.float32}
    assert resolve_dtype("float16", "bfloat16", cpu) is torch.float16
    assert resolve_dtype("bfloat16", "float16", cuda) is torch.bfloat16


def test_the_checkpoint_dtype_that_auto_follows_is_the_one_transformers_reads(llama, tmp_path, monkeypatch):
    """config.json's dtype before torch_dtype (AutoConfig's reading) is what --dtype auto is resolved from."""
    from transformers import AutoConfig

    import infer.core.loader as loader

    path = copy_of(llama, tmp_path / "m", {"dtype": "float16", "torch_dtype": "bfloat16"})
    stated: list[str | None] = []
    resolve = loader.resolve_dtype

    def spy(name: str, given: str | None, device: torch.device) -> torch.dtype:
        stated.append(given)
        return resolve(name, given, device)

    monkeypatch.setattr(loader, "resolve_dtype", spy)
    LLM(model=str(path), device="cpu", num_kv_blocks=4)
    assert stated == [str(AutoConfig.from_pretrained(str(path)).dtype).removeprefix("torch.")] == ["float16"]


def test_a_shard_index_naming_a_missing_file_names_it(llama, tmp_path):
    """A sharded download with a shard left out: the index's missing file is named, before the model is built."""
    path = copy_of(llama, tmp_path / "m")
    names = sorted(load_file(str(path / "model.safetensors")))
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}}))
    assert "model.safetensors.index.json names files that are missing: model-00002-of-00002.safetensors" in \
        load_error(path)


def test_a_quant_method_named_in_a_separate_settings_file_is_its_own(llama, tmp_path):
    """quantize_config.json is AutoGPTQ's file, but a quant_method it names is the one read (the writer's only fills
    in a missing one)."""
    path = copy_of(llama, tmp_path / "m")
    (path / "quantize_config.json").write_text(json.dumps({"quant_method": "bitsandbytes", "load_in_4bit": True}))
    assert "quant_method 'bitsandbytes', which no installed plugin loads" in load_error(path)


@pytest.mark.parametrize("listed", [False, True])
def test_a_single_generation_config_eos_id_stops_as_a_list_of_one_does(llama, tmp_path, hf_greedy, listed):
    """generation_config.json's eos_token_id is an id or a list of ids (GenerationConfig takes both)."""
    reference = hf_greedy(llama, PROMPT, 8)
    stop_at = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 1)
    path = copy_of(llama, tmp_path / "m")
    stop = reference[stop_at]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop] if listed else stop}))
    out = LLM(model=str(path), device="cpu").generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].outputs[0].token_ids == reference[: stop_at + 1]


@pytest.mark.parametrize("eos", [True, -1, [2, -1], [False], "2", [2.0]])
def test_generation_config_eos_ids_that_are_no_token_ids_are_refused(llama, tmp_path, eos):
    path = copy_of(llama, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert f"has eos_token_id = {eos!r}; it should be a token id or a list of them" in load_error(path)


def test_an_empty_quantization_config_is_no_quantization(llama, tmp_path):
    """``"quantization_config": {}`` (an export that cleared it) describes no quantization: the weights load as
    the unquantized model's."""
    assert greedy(copy_of(llama, tmp_path / "m", {"quantization_config": {}})) == greedy(llama)


def test_a_shard_the_index_names_that_is_a_broken_link_is_named_as_one(llama, tmp_path):
    """A copied HF cache snapshot, sharded: the index's shard is a link to a blob left behind, which the error
    names as such (with the fix), not as a missing file."""
    path = copy_of(llama, tmp_path / "m")
    names = sorted(load_file(str(path / "model.safetensors")))
    (path / "model.safetensors").unlink()
    (path / "model-00001-of-00001.safetensors").symlink_to("../blobs/gone")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: "model-00001-of-00001.safetensors" for name in names}}))
    message = load_error(path)
    assert "model-00001-of-00001.safetensors is a link to '../blobs/gone', which does not exist" in message
    assert "cp -rL" in message and "missing" not in message


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2fnuz])
def test_fp8_matrices_of_zeros_are_told_by_their_values_not_their_bits(dtype, caplog):
    """A matrix of negative zeros (bit pattern 0x80 where that is -0.0) holds only zeros, as torch upcasts it; every
    other finite pattern is a value."""
    for pattern in range(256):
        weight = torch.tensor([[pattern, pattern]], dtype=torch.uint8).view(dtype)
        if not torch.isfinite(weight.float()).all():
            continue
        module = torch.nn.Module()
        module.register_buffer("weight", weight)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infer"):
            check_finite(module)
        assert ("hold only zeros" in caplog.text) is (not weight.float().any()), pattern


def test_num_hidden_layers_is_checked_against_the_layers_of_every_shard(llama, tmp_path):
    """The decoder layers in an earlier shard than the last count: a sharded checkpoint whose last shard holds the
    head alone is refused for a num_hidden_layers past its layers, as the single-file one is."""
    path = copy_of(llama, tmp_path / "m", {"num_hidden_layers": 3})
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    layers = {name for name in tensors if name.startswith("model.layers.")}
    last = max(int(name.split(".")[2]) for name in layers)
    shards = {"model-00001-of-00002.safetensors": sorted(layers),
              "model-00002-of-00002.safetensors": sorted(set(tensors) - layers)}
    for file, names in shards.items():
        save_file({name: tensors[name] for name in names}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: file for file, names in shards.items() for name in names}}))
    assert last == 1 and f"num_hidden_layers 3, but the weights hold decoder layers 0 to {last} only" in \
        load_error(path)


def test_a_tokenizer_the_size_of_the_vocabulary_is_not_warned_of(llama, caplog):
    """The warning is for a tokenizer with more tokens than the model's vocabulary, not as many."""
    from transformers import AutoTokenizer

    size = json.loads((llama / "config.json").read_text())["vocab_size"]
    assert len(AutoTokenizer.from_pretrained(str(llama))) == size
    with caplog.at_level(logging.WARNING, logger="infer"):
        LLM(model=str(llama), device="cpu", num_kv_blocks=4)
    assert "tokens but the model's vocabulary" not in caplog.text


@pytest.mark.parametrize(("quant", "own"), [("fp8", "awq"), ("awq", "gptq"), ("gptq", "awq")])
def test_quant_names_the_method_over_the_checkpoints_own(llama, tmp_path, quant, own):
    """--quant is the method used (docs/cli.md: the checkpoint's quant_method is only its default): fp8 given for an
    AWQ checkpoint is fp8's to refuse, by name, not AWQ loading as if --quant were not there. The command is what
    to change (drop --quant): a ConfigError, exit status 2, as for --quant gptq on a float checkpoint."""
    qc = {"quant_method": own, "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm", "sym": True}
    path = copy_of(llama, tmp_path / "m", {"quantization_config": qc})
    with pytest.raises(ConfigError, match=f"--quant {quant} was given, but the checkpoint is quantized with "
                                          f"(quant_method )?'{own}'"):
        LLM(model=str(path), device="cpu", quant=quant)
    result = CliRunner().invoke(main, ["--model", str(path), "--quant", quant, "generate", "hi"])
    assert result.exit_code == 2 and "drop --quant" in result.output, result.output


def test_a_matrix_with_a_zero_among_other_values_is_not_warned_of(caplog):
    """Only a matrix of nothing but zeros is the mark of a cut download: one whose smallest or largest value is 0
    (a non-negative or a non-positive matrix) holds values."""
    for values, zeros in (([[0.0, 1.0]], False), ([[-2.0, 0.0]], False), ([[0.0, -0.0]], True)):
        module = torch.nn.Linear(2, 1, bias=False)
        module.weight.data = torch.tensor(values)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infer"):
            check_finite(module)
        assert ("hold only zeros" in caplog.text) is zeros, values


def test_a_missing_tensor_among_several_files_blames_no_file(llama, tmp_path):
    """A tensor no file holds is reported once all are read: naming the last file read would send the user to
    the wrong one."""
    path = copy_of(llama, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(name for name in tensors if name != "model.norm.weight")
    save_file({name: tensors[name] for name in names[: len(names) // 2]}, str(path / "a.safetensors"))
    save_file({name: tensors[name] for name in names[len(names) // 2:]}, str(path / "b.safetensors"))
    message = load_error(path)
    assert "model.norm.weight" in message and "(in " not in message
