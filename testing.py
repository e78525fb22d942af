"""pytest fixtures for infer and its plugin authors (loaded through the ``pytest11`` entry point).

- ``infer_plugins``: a fresh PluginManager loaded from the installed entry points.
- ``tiny_model_factory``: ``tiny_model_factory(arch="llama", **kwargs) -> Path``, cached per session.
- ``tiny_model``: a tiny random-weight Llama folder (float32, GQA, untied head).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def infer_plugins() -> Any:
    from infer.core.plugins import PluginManager

    return PluginManager.from_entry_points()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from infer.models.tiny import make_tiny_model, stdlib_corpus

    made: dict[str, Path] = {}
    corpus = stdlib_corpus(max_files=60)

    def factory(arch: str = "llama", **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(out, arch, tokenizer_files=corpus, **kwargs)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")
