"""A review of the embedding path against sentence-transformers' behaviour: a truncated text prompt keeps the special
tokens the tokenizer closes it with (Qwen3-Embedding's EOS, which its last pooling reads), as the tokenizer's own
truncation does; a checkpoint whose Normalize module runs before its Pooling, or whose Pooling module has no
config, is not embedded by a default request as something else."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError
from infer.core.pooling import PoolingParams

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
TEXT = "def main(argv):\n    return sorted(argv, key=len)[0] if argv else None"


def sentence_transformers_folder(source: Path, folder: Path, modules: list[dict[str, str]],
                                 pooling_mode: str | None = "pooling_mode_lasttoken",
                                 max_seq_length: int | None = None) -> Path:
    """A copy of ``source`` with sentence-transformers' files: ``modules``, the Pooling module's config (one mode
    on; None: no config.json) and sentence_bert_config.json."""
    shutil.copytree(source, folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    if pooling_mode is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                       pooling_mode: True}))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


def closing_eos(folder: Path) -> None:
    """Make ``folder``'s tokenizer append EOS to every encoding, as Qwen3-Embedding's does (the position its last
    pooling reads)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|eos|>")
    end = {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}, end],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}, end],
        "special_tokens": {"<|eos|>": {"id": "<|eos|>", "ids": [eos], "tokens": ["<|eos|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


def test_a_truncated_text_prompt_keeps_the_eos_its_tokenizer_closes_it_with(llama: Path, tmp_path: Path,
                                                                            hf_hidden_states) -> None:
    """sentence-transformers truncates with the tokenizer (truncation=True, max_length=max_seq_length), which cuts
    the text and then adds the special tokens: the EOS stays last, and last pooling reads it. Token ids are cut as
    they are (no tokenizer is involved)."""
    from transformers import AutoTokenizer

    folder = sentence_transformers_folder(llama, tmp_path / "st", [TRANSFORMER, POOLING], max_seq_length=8)
    closing_eos(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    whole = tokenizer(TEXT)["input_ids"]
    assert len(whole) > 8 and whole[-1] == tokenizer.eos_token_id
    cut = tokenizer(TEXT, truncation=True, max_length=8)["input_ids"]  # what sentence-transformers embeds
    assert len(cut) == 8 and cut[-1] == tokenizer.eos_token_id and cut[:7] == whole[:7]
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    out = engine.embed([TEXT], PoolingParams(truncate=True))[0]
    assert out.prompt_token_ids == cut
    assert out.embedding == pytest.approx(hf_hidden_states(llama, cut)[-1].tolist(), abs=1e-5)  # no Normalize module
    assert engine.check_request(TEXT, PoolingParams(truncate=True)) == cut
    ids = engine.embed([whole], PoolingParams(truncate=True))[0]
    assert ids.prompt_token_ids == whole[:8]
    assert engine.kv.stats().used_blocks == 0 and engine.embeddings.live == 0


def test_a_normalize_module_before_the_pooling_is_not_applied_after_it(llama: Path, tmp_path: Path,
                                                                       hf_hidden_states) -> None:
    """[Transformer, Normalize, Pooling(mean)]: sentence-transformers averages unit vectors (not a unit vector
    itself); infer pools then normalizes, so a request relying on the checkpoint's defaults is refused, naming the
    order, and an explicit pooling is the pooled final hidden states as documented."""
    folder = sentence_transformers_folder(llama, tmp_path / "st", [TRANSFORMER, NORMALIZE, POOLING],
                                          "pooling_mode_mean_tokens")
    prompt = [5, 9, 14, 7, 22, 30, 11, 12, 13, 40]
    states = hf_hidden_states(llama, prompt)
    sentence_transformers = torch.nn.functional.normalize(states, dim=1).mean(0)
    pooled_then_normalized = torch.nn.functional.normalize(states.mean(0), dim=0)
    assert not torch.allclose(sentence_transformers, pooled_then_normalized, atol=1e-3)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="Normalize before its Pooling.*pass pooling="):
        engine.embed([prompt])
    out = engine.embed([prompt], PoolingParams(pooling="mean"))[0]
    assert out.embedding == pytest.approx(pooled_then_normalized.tolist(), abs=1e-5)
    assert engine.embeddings.live == 0 and engine.kv.stats().used_blocks == 0


def test_a_pooling_module_without_its_config_is_not_embedded_as_last(llama: Path, tmp_path: Path,
                                                                     hf_hidden_states) -> None:
    """modules.json names a Pooling module whose config.json is missing (sentence-transformers cannot load it; a
    partial download): its mode is unknown, so a default request is refused naming the file, not pooled last."""
    folder = sentence_transformers_folder(llama, tmp_path / "st", [TRANSFORMER, POOLING], pooling_mode=None)
    prompt = [5, 9, 14, 7, 22, 30, 11]
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match=r"1_Pooling[/\\]config\.json.*missing.*pass pooling="):
        engine.embed([prompt])
    out = engine.embed([prompt], PoolingParams(pooling="last", normalize=False))[0]
    assert out.embedding == pytest.approx(hf_hidden_states(llama, prompt)[-1].tolist(), abs=1e-5)
