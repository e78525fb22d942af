"""Shared fixtures: tiny checkpoints come from infer.testing (the pytest11 plugin); HF reference helpers here."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The tiny test models gain nothing from intra-op threads, and on a busy 2-core machine torch's OpenMP
    # barriers on the main thread cost up to 10x (measured: 6.3 s against 0.49 s for the same generate call).
    torch.set_num_threads(1)

# (arch, extra make_tiny_model kwargs): GQA everywhere, tied and untied heads, qkv bias (qwen2), q/k norm (qwen3)
CHECKPOINTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"extra": {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"num_heads": 8, "num_kv_heads": 2}),
}


@pytest.fixture(scope="session")
def checkpoint(tiny_model_factory: Callable[..., Path]) -> Callable[[str], Path]:
    def get(name: str) -> Path:
        arch, kwargs = CHECKPOINTS[name]
        return tiny_model_factory(arch, **kwargs)

    return get


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    """HF transformers' greedy continuation of one prompt (EOS ignored), float32 on CPU: the reference."""
    from transformers import AutoModelForCausalLM

    models: dict[Path, torch.nn.Module] = {}

    def run(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        # generate()'s own loop, without its logits processors (min_new_tokens would mask EOS and change argmax)
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        model, ids, cache, out = models[path], torch.tensor([prompt]), None, []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                step = model(ids, past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                ids = step.logits[:, -1].argmax(-1, keepdim=True)
                out.append(int(ids))
        return out

    return run
