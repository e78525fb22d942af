"""Embedding checkpoints as the hub ships them: tensors named as the bare backbone names them (``embed_tokens``,
``layers.N``, ``norm``, no ``model.``; Qwen3-Embedding, e5-mistral), an architecture naming the backbone
(``Qwen3Model``), and no LM head (Qwen3-Embedding-8B: ``tie_word_embeddings`` false, no ``lm_head.weight``). Such a
model's embeddings equal transformers' ``AutoModel`` ``last_hidden_state``; it refuses generation; a bare-keyed
checkpoint that has a head generates as the prefixed one; a checkpoint mixing both layouts is refused."""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the graph test runs the triton backend, interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from infer import LLM  # noqa: E402
from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import CheckpointError, InvalidRequestError  # noqa: E402
from infer.core.beam_search import BeamSearchParams  # noqa: E402
from infer.core.pooling import PoolingParams  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402

PROMPTS = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(3)]  # 9 to 15 tokens
NO_HEAD = "this checkpoint has no LM head (an embedding model): send embedding requests (PoolingParams, `infer embed`)"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def rewrite(src: Path, dst: Path, bare: bool = True, head: bool = True, **config: object) -> Path:
    """A copy of checkpoint ``src``: its tensors without ``model.`` (``bare``), without ``lm_head.weight`` (not
    ``head``), and config.json's fields replaced by ``config``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {name.removeprefix("model.") if bare else name: t for name, t in tensors.items()
               if head or name != "lm_head.weight"}
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **config}))
    return dst


def pooled(states: torch.Tensor, method: str, normalize: bool) -> list[float]:
    vector = states[-1] if method == "last" else states.mean(0)
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()


HEADLESS = {  # name: (fixture checkpoint, config.json changes): no lm_head.weight in each
    "Qwen3Model": ("qwen3", {"architectures": ["Qwen3Model"], "tie_word_embeddings": False}),
    "Qwen3ForCausalLM-untied": ("qwen3", {"tie_word_embeddings": False}),  # Qwen3-Embedding-8B
    "MistralModel": ("mistral", {"architectures": ["MistralModel"]}),  # e5-mistral
    "LlamaModel-tied": ("llama-tied", {"architectures": ["LlamaModel"]}),  # a backbone: no head, even tied
}


@pytest.mark.parametrize("case", HEADLESS)
def test_a_headless_bare_checkpoint_embeds_as_transformers_backbone(checkpoint: Callable[[str], Path],
                                                                    tmp_path: Path, case: str, caplog,
                                                                    hf_hidden_states) -> None:
    source, config = HEADLESS[case]
    original = checkpoint(source)
    assert json.loads((original / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")
    path = rewrite(original, tmp_path / "m", head=False, **config)
    with caplog.at_level(logging.INFO, logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert "names its tensors as a bare backbone does" in caplog.text
    assert "no LM head: this engine serves embeddings only" in caplog.text
    assert "generation requests and beam searches will be refused" in caplog.text
    assert "AutoModelForCausalLM builds" not in caplog.text  # a backbone is no other architecture of its type
    assert engine.loaded.model.spec.has_lm_head is False and engine.loaded.model.lm_head is None
    params = [PoolingParams(pooling="last"), PoolingParams(pooling="mean"), PoolingParams(pooling="mean",
                                                                                          normalize=False)]
    for out, prompt, one in zip(engine.embed(PROMPTS, params), PROMPTS, params):
        want = pooled(hf_hidden_states(original, prompt), one.pooling, one.normalize is not False)
        assert out.embedding == pytest.approx(want, abs=1e-5)
    assert engine.embeddings.live == 0 and engine.kv.stats().used_blocks == 0


def test_a_headless_model_refuses_generation_and_beam_search(checkpoint: Callable[[str], Path],
                                                             tmp_path: Path) -> None:
    path = rewrite(checkpoint("qwen3"), tmp_path / "m", head=False, tie_word_embeddings=False)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    refusals: list[Callable[[], object]] = [
        lambda: engine.add_request(PROMPTS[0]), lambda: engine.add_request(PROMPTS[0], GREEDY),
        lambda: engine.check_request(PROMPTS[0], GREEDY), lambda: engine.generate(PROMPTS, GREEDY),
        lambda: engine.stream(PROMPTS[0], GREEDY),
        lambda: engine.generate(PROMPTS[:2], [PoolingParams(), GREEDY]),  # all or none: the embedding goes too
        lambda: engine.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4)),
        lambda: engine.start_beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4)),
        lambda: engine.loaded.model.compute_logits(torch.zeros(1, engine.loaded.arch.hidden_size)),
    ]
    for refused in refusals:
        with pytest.raises(InvalidRequestError) as info:
            refused()
        assert str(info.value).endswith(NO_HEAD)  # generate's names the prompt first
    assert engine.requests == {} and not engine.searches and engine.kv.stats().used_blocks == 0
    assert engine.embed(PROMPTS[:1])[0].embedding is not None  # embeddings still served
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate([PROMPTS[0]], GREEDY)


def test_a_causal_lm_that_lost_its_head_says_so(checkpoint: Callable[[str], Path], tmp_path: Path, caplog) -> None:
    """A generation model whose lm_head.weight is missing loads (as an embedding model), with a warning that says
    generation is refused and how to fix it."""
    path = rewrite(checkpoint("llama"), tmp_path / "m", bare=False, head=False)
    with caplog.at_level(logging.WARNING, logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert "LlamaForCausalLM with tie_word_embeddings false, but the checkpoint holds no lm_head.weight, so " \
        "generation requests and beam searches will be refused" in caplog.text
    assert "set tie_word_embeddings true if the head is the embedding" in caplog.text
    with pytest.raises(InvalidRequestError, match="no LM head"):
        engine.generate(PROMPTS[:1], GREEDY)


@pytest.mark.parametrize("source, config", [("llama", {}), ("qwen3", {}), ("qwen2", {}),  # qwen2: tied
                                            ("mistral", {"architectures": ["MistralModel"]})])
def test_a_bare_checkpoint_with_a_head_generates_as_the_prefixed_one(checkpoint: Callable[[str], Path],
                                                                     tmp_path: Path, hf_greedy, source: str,
                                                                     config: dict) -> None:
    """A backbone that ships lm_head.weight keeps it (the mistral case, named MistralModel)."""
    original = checkpoint(source)
    path = rewrite(original, tmp_path / "m", **config)
    prompt = PROMPTS[1]
    want = hf_greedy(original, prompt, GREEDY.max_tokens)
    prefixed = Engine(EngineConfig(model=str(original), device="cpu", num_kv_blocks=64)).generate([prompt], GREEDY)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert engine.loaded.model.spec.has_lm_head
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == \
        prefixed[0].outputs[0].token_ids == want


def test_a_checkpoint_mixing_both_layouts_is_refused(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    path = rewrite(checkpoint("llama"), tmp_path / "m", bare=False)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mixes two layouts of the backbone's tensor names: \d+ under "
                                              r"'model.' \(e.g. 'model\..*'\) and 1 without it \(e.g. 'norm.weight'"):
        LLM(model=str(path), device="cpu")


def test_a_bare_checkpoint_with_too_few_layers_is_refused_before_building(checkpoint: Callable[[str], Path],
                                                                          tmp_path: Path) -> None:
    """The decoder-layer count check reads bare names as the model names them."""
    path = rewrite(checkpoint("llama"), tmp_path / "m", num_hidden_layers=40)
    with pytest.raises(CheckpointError, match="num_hidden_layers 40, but the weights hold decoder layers 0 to 1"):
        LLM(model=str(path), device="cpu")


def test_a_headless_model_captures_no_decode_graphs(checkpoint: Callable[[str], Path], tmp_path: Path,
                                                    hf_hidden_states) -> None:
    """Decode graphs compute logits: none for a headless model; mixed-step graphs (hidden states) replay, and the
    embeddings still equal transformers'. Replayed eagerly on the CPU."""
    original = checkpoint("qwen3")
    path = rewrite(original, tmp_path / "m", head=False, architectures=["Qwen3Model"])
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=3, attention="triton", dtype="float32"))
    engine.runner.enable_cuda_graphs(4, {3: 4}, eager=True, mixed_tokens=24, mixed_rows=8)
    assert engine.runner.graphs is None and engine.runner.mixed_graphs is not None
    params = PoolingParams(pooling="mean")
    out = engine.embed(PROMPTS[:2], params)
    for one, prompt in zip(out, PROMPTS):
        assert one.embedding == pytest.approx(pooled(hf_hidden_states(original, prompt), "mean", True), abs=1e-5)
    assert engine.runner.mixed_graphs.replays > 0


def test_every_backbone_is_registered_as_transformers_names_it() -> None:
    """Each Llama-family *ForCausalLM's twin is the AutoModel class of its model_type, built by the same model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from infer.core.plugins import PluginManager
    from infer.plugins.llama_family import ARCHITECTURES, BACKBONES

    causal_types = {arch: model_type for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    want = {MODEL_MAPPING_NAMES[causal_types[arch]]: arch for arch in ARCHITECTURES}
    assert BACKBONES == want
    models = PluginManager.from_entry_points().collect().registry("model")
    assert {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"} <= set(models.names())
    assert set(want) <= set(models.names())


def test_the_bare_layout_maps_only_for_a_model_that_names_its_backbone_under_model() -> None:
    """A multimodal checkpoint's names are no bare backbone's; a plugin model that names its tensors bare itself
    takes the checkpoint's names as they are."""
    from torch import nn

    from infer.core.loader import KeyLayout, key_layout

    multimodal = ["language_model.model.layers.0.mlp.up_proj.weight", "language_model.model.norm.weight",
                  "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "multi_modal_projector.weight"]
    assert key_layout(multimodal) == KeyLayout()
    layout = key_layout(["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "norm.weight", "lm_head.weight"])
    assert [layout.model_name(n) for n in ("layers.0.mlp.up_proj.weight", "lm_head.weight")] == \
        ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    own = nn.Module()
    own.layers = nn.ModuleList([nn.Linear(2, 2)])
    assert layout.for_model(own) == KeyLayout()
    llama_like = nn.Module()
    llama_like.model = own
    assert layout.for_model(llama_like) == layout and layout.bare
