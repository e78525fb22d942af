"""The Llama family against HF transformers: greedy tokens identical, last-token logits within 1e-4 relative."""
from __future__ import annotations

import random

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import SamplingParams

from conftest import CHECKPOINTS

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_and_logits_match_transformers(name, checkpoint, hf_greedy):
    from transformers import AutoModelForCausalLM

    path = checkpoint(name)
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    batch_prompts = prompts(engine.loaded.model.spec.vocab_size, [5, 33, 17])
    results = engine.generate(batch_prompts, GREEDY)
    for prompt, result in zip(batch_prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, 64)

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = batch_prompts[1]
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    out = engine.scheduler.schedule()
    _, logits = engine.runner.execute(out, engine.kv)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    rel = (logits[0] - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative logits error {rel:.2e}"


def test_preemption_under_a_small_cache_keeps_outputs_exact(checkpoint, hf_greedy):
    path = checkpoint("llama")
    rng = random.Random(1)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(14)]
    # the longest request needs 23 blocks of 16; 48 blocks force preemption when 16 run together
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=48, enable_prefix_caching=False))
    batch_prompts = prompts(engine.loaded.model.spec.vocab_size, lengths, seed=2)
    results = engine.generate(batch_prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(batch_prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, 64)
    stats = engine.kv.stats()
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


def test_preemption_by_swap_keeps_outputs_exact(checkpoint, hf_greedy):
    path = checkpoint("llama")
    rng = random.Random(3)
    lengths = [rng.randint(20, 200) for _ in range(10)]
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=40, preemption_mode="swap",
                                 num_swap_blocks=200))
    batch_prompts = prompts(engine.loaded.model.spec.vocab_size, lengths, seed=4)
    results = engine.generate(batch_prompts, GREEDY)
    assert engine.scheduler.num_swapped_out > 0
    for prompt, result in zip(batch_prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, 64)
    stats = engine.kv.stats()
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
    assert not engine.scheduler.swap.held


def test_linear_rope_scaling_extends_the_context_limit(tmp_path, hf_greedy):
    """A 64-position model with linear RoPE scaling x4 runs at 256 positions, and no further; past position 64 its
    greedy tokens are HF's."""
    from infer.core.errors import ConfigError
    from infer.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", max_position_embeddings=64,
                             extra={"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})
    engine = Engine(EngineConfig(model=str(folder), device="cpu", max_model_len=256, num_kv_blocks=32))
    assert engine.max_model_len == 256
    prompt = prompts(engine.loaded.model.spec.vocab_size, [150])[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(folder, prompt, 16)
    with pytest.raises(ConfigError, match="exceeds the 256 positions the model supports"):
        Engine(EngineConfig(model=str(folder), device="cpu", max_model_len=257, num_kv_blocks=32))
