"""The ``cpu`` attention backend: its C kernel against dense SDPA, the engine against HF, and its build errors."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import PluginError
from infer.core.request import SamplingParams
from infer.plugins import cpu_attention

from conftest import dense_attention, paged_batch

SCALE = 0.13


@pytest.fixture(scope="module")
def backend() -> cpu_attention.CpuAttention:
    return cpu_attention.create_backend(EngineConfig(device="cpu"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group,head_dim,page", [(1, 32, 16), (2, 64, 16), (4, 80, 8)])
def test_forward_matches_dense_attention(backend, threads: int, group: int, head_dim: int, page: int) -> None:
    torch.manual_seed(group)
    rng = random.Random(head_dim)
    # decodes of many lengths (a partial last block, exactly one block, a single token) mixed with prefills and
    # short queries over a cached context (a verification, a draft round's first step), which run as decodes
    seqs = [(rng.randrange(0, 90), 1) for _ in range(9)] + [(page - 1, 1), (0, 1), (0, 12), (2 * page, 5)]
    seqs += [(rng.randrange(1, 90), n) for n in (2, 3, 8)] + [(0, 3), (page - 2, 2), (3, 9)]
    rng.shuffle(seqs)
    batch = paged_batch(seqs, 2, group, head_dim, page, 160, torch.float32, torch.device("cpu"))
    batch.meta.backend_data = backend.prepare(batch.meta)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(batch.q, batch.k, batch.v, (batch.k_cache, batch.v_cache), batch.meta, SCALE)
    finally:
        torch.set_num_threads(before)
    start = 0
    for i, n in enumerate(batch.query_lens):
        ref = dense_attention(batch.q[start : start + n], batch.full_k[i], batch.full_v[i], SCALE)
        torch.testing.assert_close(out[start : start + n], ref, atol=2e-5, rtol=2e-5)
        start += n


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_engine_equals_hf_with_either_cpu_backend(attention: str, checkpoint, hf_greedy) -> None:
    path = checkpoint("qwen3")  # GQA 4:1 and q/k norms
    engine = Engine(EngineConfig(model=str(path), device="cpu", attention=attention, num_kv_blocks=64))
    assert engine.active["attention"] == attention
    prompts = [[5, 9, 11, 40, 2, 7, 300, 12] * 3, [17, 18], list(range(50, 90))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, 40)


def test_default_on_the_cpu_is_the_kernel_and_fp8_kv_takes_the_torch_path(checkpoint) -> None:
    engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=32))
    assert engine.active["attention"] == "cpu" and engine.attention.use_kernel
    fp8 = cpu_attention.create_backend(EngineConfig(device="cpu", kv_cache_dtype="fp8"))
    assert not fp8.use_kernel


def test_no_compiler_is_a_clear_error_and_the_default_falls_back_loudly(monkeypatch, checkpoint, caplog) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: None)
    with pytest.raises(PluginError, match="needs a C compiler.*--attention torch"):
        cpu_attention.create_backend(EngineConfig(device="cpu"))
    with caplog.at_level(logging.WARNING, logger="infer"):
        engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=32))
    assert engine.active["attention"] == "torch"
    assert "attention backend 'cpu' is unavailable, using 'torch'" in caplog.text
    with pytest.raises(PluginError, match="needs a C compiler"):
        Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", attention="cpu", num_kv_blocks=32))


def test_a_failed_compile_shows_the_compiler_output(monkeypatch, tmp_path: Path) -> None:
    broken = tmp_path / "cpu_attention.c"
    broken.write_text("int paged_decode_attention_f32( { this is not C }\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", broken)
    with pytest.raises(PluginError, match="(?s)failed.*--attention torch.*error"):
        cpu_attention.build_kernel(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is left to be loaded later


def test_the_library_is_built_once_and_reused(tmp_path: Path) -> None:
    cpu_attention.build_kernel(tmp_path)
    (library,) = tmp_path.glob("cpu_attention-*.so")
    stamp = library.stat().st_mtime_ns
    cpu_attention.build_kernel(tmp_path)
    assert list(tmp_path.glob("cpu_attention-*.so")) == [library] and library.stat().st_mtime_ns == stamp


def test_refused_on_cuda() -> None:
    with pytest.raises(PluginError, match="runs on the CPU"):
        cpu_attention.create_backend(EngineConfig(device="cuda"))


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path: Path) -> None:
    """Linked with -ffast-math, the library's constructor would turn on flush-to-zero for the whole process."""
    cpu_attention.build_kernel(tmp_path)  # a fresh cache: compiled and loaded now
    assert torch.tensor([1e-38]).div(100).item() == pytest.approx(1e-40, rel=1e-3, abs=0)  # not flushed to 0


def test_an_unwritable_cache_is_a_plugin_error_and_the_default_falls_back(monkeypatch, tmp_path: Path, checkpoint,
                                                                          caplog) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    with pytest.raises(PluginError, match="could not be built or loaded.*XDG_CACHE_HOME"):
        cpu_attention.create_backend(EngineConfig(device="cpu"))
    with caplog.at_level(logging.WARNING, logger="infer"):
        engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=32))
    assert engine.active["attention"] == "torch" and "XDG_CACHE_HOME" in caplog.text


def test_a_block_table_too_short_for_its_context_is_refused(backend) -> None:
    batch = paged_batch([(40, 1), (3, 1)], 2, 2, 32, 16, 16, torch.float32, torch.device("cpu"))
    batch.meta.block_tables = batch.meta.block_tables[:, :2]  # 41 tokens need 3 blocks of 16
    with pytest.raises(PluginError, match="cannot hold contexts of 41 tokens"):
        backend.prepare(batch.meta)
