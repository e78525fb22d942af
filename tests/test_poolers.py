"""Poolers as plugins (register_poolers): the shipped ones against sentence-transformers' formulas over HF
transformers' final hidden states, fed a chunk at a time; a plugin's pooler, held to its contract."""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import ConfigError, InvalidRequestError, PluginError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import Pooler
from infer.core.plugins import PluginManager
from infer.core.pooling import PoolingParams

PROMPTS = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(4)]  # 9 to 18 tokens


@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hidden(path: Path, hf_hidden_states) -> Callable[[list[int]], torch.Tensor]:
    return lambda prompt: hf_hidden_states(path, prompt)


def formula(states: torch.Tensor, name: str) -> torch.Tensor:
    """sentence-transformers' Pooling modes, for one unpadded sequence."""
    n = states.shape[0]
    weights = torch.arange(1, n + 1, dtype=states.dtype)
    return {"last": states[-1], "first": states[0], "cls": states[0], "mean": states.mean(0),
            "max": states.amax(0), "weighted-mean": (states * weights[:, None]).sum(0) / weights.sum(),
            "mean-sqrt-len": states.sum(0) / math.sqrt(n)}[name]


@pytest.mark.parametrize("name", ["last", "mean", "first", "cls", "max", "weighted-mean", "mean-sqrt-len"])
def test_each_shipped_pooler_equals_sentence_transformers(path: Path, hidden, name: str) -> None:
    """5-token chunks: each prompt's rows reach the pooler over several steps."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=5))
    outs = engine.embed(PROMPTS, PoolingParams(pooling=name, normalize=False))
    for out, prompt in zip(outs, PROMPTS):
        assert out.embedding == pytest.approx(formula(hidden(prompt), name).tolist(), abs=1e-5)


class Recording(Pooler):
    """Sums the rows and records what it was handed: (first_position, number of rows) per add."""

    def __init__(self, every: bool) -> None:
        self.reads_every_position = every  # type: ignore[misc]
        self.calls: list[tuple[int, int]] = []

    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        self.calls.append((first_position, rows.shape[0]))
        return rows.sum(0) if state is None else state + rows.sum(0)

    def finish(self, state: torch.Tensor, num_positions: int) -> torch.Tensor:
        return torch.cat([state, torch.tensor([float(num_positions)], device=state.device)])


class Broken(Pooler):
    def add(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor:
        return rows.sum(0)

    def finish(self, state: torch.Tensor, num_positions: int) -> Any:
        return state[None]  # [1, H]: not a vector


def engine_with(path: Path, poolers: dict[str, Pooler], **options: Any) -> Engine:
    class Plugin:
        @hookimpl
        def register_poolers(self, register: Any) -> None:
            for name, pooler in poolers.items():
                register(name, lambda config, pooler=pooler: pooler)

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="test-poolers", source="tests")
    return Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                               max_num_batched_tokens=5, **options), plugins)


def test_a_plugin_pooler_gets_every_position_once_in_order(path: Path, hidden) -> None:
    every, last = Recording(every=True), Recording(every=False)
    engine = engine_with(path, {"sum-all": every, "sum-last": last})
    prompt = PROMPTS[3]  # 18 tokens: chunks of 5, 5, 5, 3
    out = engine.embed([prompt], PoolingParams(pooling="sum-all", normalize=False))[0]
    assert every.calls == [(0, 5), (5, 5), (10, 5), (15, 3)]
    want = hidden(prompt).sum(0).tolist() + [18.0]
    assert out.embedding == pytest.approx(want, abs=1e-4)
    out = engine.embed([prompt], PoolingParams(pooling="sum-last", normalize=False))[0]
    assert last.calls == [(17, 1)]
    assert out.embedding == pytest.approx(hidden(prompt)[-1].tolist() + [1.0], abs=1e-5)
    assert engine.embed([prompt], PoolingParams(pooling="sum-last", normalize=False))[0].num_cached_tokens > 0
    assert engine.embed([prompt], PoolingParams(pooling="sum-all", normalize=False))[0].num_cached_tokens == 0


def test_a_plugin_pooler_that_breaks_its_contract_is_named(path: Path) -> None:
    engine = engine_with(path, {"broken": Broken()})
    with pytest.raises(PluginError, match="pooler 'broken'"):
        engine.embed([PROMPTS[0]], PoolingParams(pooling="broken"))
    assert engine.kv.stats().used_blocks == 0 and not engine.requests  # embed aborted it, freeing its blocks


def test_unknown_poolers_and_pooler_plugins_are_refused(path: Path) -> None:
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="unknown pooler 'median'.*first, last, max, mean"):
        engine.embed([PROMPTS[0]], PoolingParams(pooling="median"))
    plugins = PluginManager.from_entry_points()
    with pytest.raises(ConfigError, match="'max' is a pooler, which each embedding request chooses"):
        plugins.resolve_plugin_names(EngineConfig(model=str(path)), ["max"])


def test_a_sentence_transformers_max_pooling_checkpoint_pools_by_max(path: Path, hidden, tmp_path: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    out = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64)).embed([PROMPTS[1]])[0]
    want = torch.nn.functional.normalize(formula(hidden(PROMPTS[1]), "max"), dim=0)
    assert out.embedding == pytest.approx(want.tolist(), abs=1e-5)


def test_the_tutorials_pooler_runs_as_written(path: Path, hidden) -> None:
    """docs/writing-a-plugin.md's last4 example, executed as a plugin module, in 5-token chunks: the mean of each
    prompt's last four hidden states, as transformers computes them."""
    from conftest import tutorial_plugins

    plugins = tutorial_plugins("class LastFourMean", "last4")
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=5), plugins)
    outs = engine.embed(PROMPTS + [[7, 8, 9]], PoolingParams(pooling="last4", normalize=False))
    for out, prompt in zip(outs, PROMPTS + [[7, 8, 9]]):
        assert out.embedding == pytest.approx(hidden(prompt)[-4:].mean(0).tolist(), abs=1e-5)
