"""The Llama family against HF transformers: greedy tokens identical, last-token logits within 1e-4 relative."""
from __future__ import annotations

import math
import random
import re
import types
from pathlib import Path

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import SamplingParams
from infer.plugins.continuous_scheduler import AdmissionReserve

from conftest import CHECKPOINTS

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("merge", [False, True], ids=["apart", "merged"])  # merged q/k/v, gate/up: the CUDA default
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_and_logits_match_transformers(name, merge, checkpoint, hf_greedy):
    from transformers import AutoModelForCausalLM

    path = checkpoint(name)
    engine = Engine(EngineConfig(model=str(path), device="cpu", fuse_projections=merge))
    fused = name == "phi3"  # the checkpoint's own: merged whatever fuse_projections says
    assert all((layer.self_attn.qkv_proj is not None) == (merge or fused) and
               (layer.mlp.gate_up_proj is not None) == (merge or fused) for layer in engine.loaded.model.model.layers)
    batch_prompts = prompts(engine.loaded.model.spec.vocab_size, [5, 33, 17])
    results = engine.generate(batch_prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, result in zip(batch_prompts, results):
        ours = result.outputs[0].token_ids
        if ours != (want := hf_greedy(path, prompt, 64)):  # a near tie may flip (2.9e-6 apart seen, gemma3)
            assert_greedy_up_to_near_ties(hf, prompt, ours, want)

    prompt = batch_prompts[1]
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    out = engine.scheduler.schedule()
    _, logits = engine.runner.execute(out, engine.kv)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    rel = (logits[0] - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative logits error {rel:.2e}"


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """infer's logits of the token after ``prompt``: one prefill step of the engine, run by hand."""
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    _, logits = engine.runner.execute(engine.scheduler.schedule(), engine.kv)
    return logits[0]


def hf_last_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """HF transformers' float32 logits of the token after ``prompt`` (the reference)."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(
            torch.tensor([prompt])).logits[0, -1]


def assert_greedy_up_to_near_ties(hf, prompt: list[int], ours: list[int], want: list[int], tol: float = 1e-4) -> None:
    """Each of ``ours`` is HF's greedy choice after the tokens before it, or within ``tol`` of HF's largest logit
    there (a near tie the two implementations' rounding may break either way), and one such tie happened."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:]
    chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
    gaps = logits.max(dim=1).values - chosen
    assert gaps.max() < tol, f"token {int(gaps.argmax())} is {float(gaps.max()):.2e} below HF's best"
    first = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
    assert ours[:first] == want[:first] and gaps[first] < tol  # where HF's own greedy run went the other way


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


def test_an_admission_reserve_avoids_preemption_and_keeps_outputs_exact(checkpoint, hf_greedy):
    """--kv-admission-reserve 1 admits a request only while the free blocks cover what every running sequence may
    still write (max_tokens), so the workload above runs with no preemption; sequences still run together."""
    path = checkpoint("llama")
    rng = random.Random(1)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(14)]
    preemptions: dict[float | str, int] = {}
    for reserve in (0.0, 1.0, "auto"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=48, enable_prefix_caching=False,
                                     kv_admission_reserve=reserve))
        batch_prompts = prompts(engine.loaded.model.spec.vocab_size, lengths, seed=2)
        ids = engine.add_requests(batch_prompts, GREEDY)
        results, most_running = {}, 0
        while engine.has_unfinished():
            before = engine.scheduler.num_preemptions
            for out in engine.step():
                results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            most_running = max(most_running, engine.scheduler.num_running())
            if reserve == "auto" and engine.scheduler.num_preemptions > before:
                assert engine.scheduler.reserve.value == AdmissionReserve.START
        preemptions[reserve] = engine.scheduler.num_preemptions
        assert most_running > 1
        for prompt, rid in zip(batch_prompts, ids):
            assert results[rid] == hf_greedy(path, prompt, 64)
        stats = engine.kv.stats()
        assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
    assert preemptions[0.0] > 0 and preemptions[1.0] == 0
    assert preemptions["auto"] < preemptions[0.0]


def test_the_auto_admission_reserve_falls_while_nothing_is_preempted_and_resets_at_a_preemption():
    """--kv-admission-reserve auto: 0.7, down by 0.6 / 600 a step to 0.1, back to 0.7 at a preemption; a number
    stays fixed."""
    reserve = AdmissionReserve("auto")
    for step in range(1, 701):
        reserve.after_step(preempted=False)
        assert reserve.value == pytest.approx(max(0.1, 0.7 - 0.001 * step))
    reserve.after_step(preempted=True)
    assert reserve.value == 0.7
    fixed = AdmissionReserve(0.5)
    for preempted in (False, True, False):
        fixed.after_step(preempted)
        assert fixed.value == 0.5


def test_an_admission_reserve_counts_the_forks_of_an_n_request(checkpoint):
    """An n = 4 parent admitted mid chunked prefill has not forked yet: the reserve counts its future blocks n
    times, so R = 1 still preempts nothing (it counted them once, and a later request took the children's room)."""
    path = checkpoint("llama")
    rng = random.Random(0)
    batch = [[rng.randrange(3, 1000) for _ in range(200)]] + [[rng.randrange(3, 1000) for _ in range(20)]
                                                            for _ in range(6)]
    params = [SamplingParams(max_tokens=64, n=4, temperature=0.8, seed=1, ignore_eos=True)] + [GREEDY] * 6
    preemptions = {}
    for reserve in (0.0, 1.0):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=40, enable_prefix_caching=False,
                                     scheduler="chunked-prefill", max_num_batched_tokens=32,
                                     kv_admission_reserve=reserve))
        results = engine.generate(batch, params)
        assert [len(r.outputs) for r in results] == [4] + [1] * 6
        preemptions[reserve] = engine.scheduler.num_preemptions
    assert preemptions[0.0] > 0 and preemptions[1.0] == 0


@pytest.mark.parametrize("max_tokens, reserve, n, length", [((49, 49), 1.0, 1, 16), ((49, 33), 0.5, 1, 16),
                                                            ((49, 49), 1.0, 2, 16), ((49, 49), 1.0, 3, 20)])
def test_the_admission_reserve_admits_exactly_at_its_formula(checkpoint, max_tokens, reserve, n, length):
    """Two prompts of ``length`` tokens arrive together; A is admitted (nothing runs), then B only if the free
    blocks less B's prompt cover ceil(R x the blocks both may still write), each up to prompt + max_tokens - 1
    tokens; B's n - 1 children share its prompt's full blocks and each writes its own copy of a partial last one
    (they were counted as the parent's future n times): admitted with that many blocks in the pool, not one fewer."""
    path, block = checkpoint("llama"), 16
    final = [length + tokens - 1 for tokens in max_tokens]
    parent = [math.ceil(f / block) - math.ceil(length / block) for f in final]  # beyond the prompt's blocks
    child = math.ceil(final[1] / block) - length // block  # beyond the prompt's full blocks
    future = parent[0] + parent[1] + (n - 1) * child
    smallest = 2 * math.ceil(length / block) + math.ceil(reserve * future)  # A's and B's prompts, and the reserve
    prompts = [list(range(10, 10 + length)), list(range(100, 100 + length))]
    for blocks in (smallest - 1, smallest):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=blocks, block_size=block,
                                     enable_prefix_caching=False, kv_admission_reserve=reserve))
        for prompt, tokens, copies in zip(prompts, max_tokens, (1, n)):
            engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, n=copies,
                                                      ignore_eos=True))
        engine.step()
        assert engine.scheduler.num_running() == (1 if blocks < smallest else 1 + n), blocks


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_a_prefix_hit_on_cached_blocks_counts_them_as_taken(checkpoint, kv_cache):
    """B's prompt hits two cached blocks that no sequence holds: admitting B takes them from the free blocks, which
    the reserve counted as B's for nothing (B was admitted beside A and a sequence was preempted later); blocks a
    running sequence holds take nothing."""
    runs = {}
    for warm in (False, True):
        engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", block_size=4, num_kv_blocks=6,
                                     kv_admission_reserve=1.0, kv_cache=kv_cache))
        shared = list(range(100, 108))
        if warm:
            engine.generate([shared + [300]], SamplingParams(max_tokens=1, temperature=0.0))
        engine.add_request([21, 22, 23], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
        engine.add_request(shared + [400], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.step()
        waiting = engine.scheduler.num_waiting()
        while engine.has_unfinished():
            engine.step()
        runs[warm] = (waiting, engine.scheduler.num_preemptions)
    assert runs == {False: (1, 0), True: (1, 0)}


def test_an_n_request_alone_runs_under_a_full_reserve(checkpoint):
    """Nothing running: the reserve does not hold back the first request, even one whose forks it cannot cover."""
    engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=20,
                                 enable_prefix_caching=False, kv_admission_reserve=1.0))
    out = engine.generate([list(range(10, 170))], SamplingParams(max_tokens=64, n=4, temperature=0.8, seed=1,
                                                                 ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [64] * 4


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


def edited_model(folder, arch: str, edit, **options):
    """A tiny model whose config.json is then edited as a hand-written or older export would be."""
    import json

    from infer.models.tiny import make_tiny_model

    path = make_tiny_model(folder, arch, **options)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}


@pytest.mark.parametrize(("arch", "edit", "options"), [
    # transformers 5 writes a default rope_parameters; a rope_scaling added by hand wins in HF
    ("llama", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0}), {}),
    # llama3 RoPE: a top-level original_max_position_embeddings wins over the rope dict's; absent, the context
    ("llama", lambda c: c.update(rope_parameters=LLAMA3_ROPE, original_max_position_embeddings=32), {}),
    ("llama", lambda c: c.update(rope_parameters={k: v for k, v in LLAMA3_ROPE.items()
                                                  if k != "original_max_position_embeddings"}), {}),
    ("qwen3", lambda c: c.pop("head_dim"), {"extra": {"head_dim": 128}}),  # Qwen3's default head_dim is 128
    # HF's Mistral has no biases whatever the flags say; its window applies whatever use_sliding_window says
    ("mistral", lambda c: c.update(attention_bias=True, mlp_bias=True, use_sliding_window=False), {}),
    # a config without num_key_value_heads takes HF's default of its class: Mistral 8, Qwen 32 (Llama: the heads)
    ("mistral", lambda c: c.pop("num_key_value_heads"), {"num_heads": 16, "num_kv_heads": 8, "hidden_size": 128}),
    ("qwen2", lambda c: c.pop("num_key_value_heads"), {"num_heads": 32, "num_kv_heads": 32, "hidden_size": 128}),
    ("llama", lambda c: c.pop("num_key_value_heads"), {"num_heads": 4, "num_kv_heads": 4}),
    # an explicit null is one KV head per attention head (HF's post-init), not the class's default
    ("qwen2", lambda c: c.update(num_key_value_heads=None), {"num_heads": 4, "num_kv_heads": 4}),
    ("llama", lambda c: c.update(hidden_act="swish"), {}),  # HF's ACT2FN: swish is SiLU
])
def test_config_variants_run_what_hf_runs(tmp_path, hf_greedy, arch, edit, options):
    path = edited_model(tmp_path / "m", arch, edit, max_position_embeddings=64, **options)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [40])[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, 12)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


@pytest.mark.parametrize(("arch", "rope", "top"), [
    ("qwen2", YARN, {}),  # Qwen2.5's long-context recipe, in the rope_scaling of old exports
    # a ramp over dimensions not cut to whole ones; a ramp cut at the last dimension (DeepSeek's attention factor)
    ("qwen3", {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False,
               "original_max_position_embeddings": 4096}, {}),
    ("llama", {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 2**20,
               "original_max_position_embeddings": 2**28}, {}),
    ("qwen2", {**YARN, "factor": 16.0, "original_max_position_embeddings": 4}, {}),  # a ramp of no width
    ("llama", {**YARN, "attention_factor": 1.5, "original_max_position_embeddings": 8},  # the top-level one wins
     {"original_max_position_embeddings": 16}),
    ("mistral", {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}, {}),  # the context's
    ("qwen2", {**YARN, "factor": None}, {}),  # DeepSeek-V3's: max_position_embeddings / original
    ("qwen3", {**YARN, "beta_fast": 0, "mscale": 0, "mscale_all_dim": 1.0, "truncate": None}, {}),  # HF: defaults
    # the default betas (32, 1) where they place the ramp: an original context long enough to start it past dim 0
    ("qwen2", {**YARN, "original_max_position_embeddings": 4096}, {}),
])
def test_yarn_rope_logits_and_tokens_are_hfs_past_the_original_context(tmp_path, hf_greedy, arch, rope, top):
    """YaRN frequencies and its cos/sin scale against HF's (60 positions, past most cases' original context): the
    last token's logits within 1e-4 relative (YaRN moves them by over 1e-2) and greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = edited_model(tmp_path / "m", arch, lambda c: c.update(rope_scaling=rope, **top), max_position_embeddings=64)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, max_model_len=64))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [60])[0]
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    _, logits = engine.runner.execute(engine.scheduler.schedule(), engine.kv)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
        unscaled = AutoModelForCausalLM.from_pretrained(str(edited_model(  # the same weights without YaRN
            tmp_path / "plain", arch, lambda c: None, max_position_embeddings=64)), dtype=torch.float32)
        assert (unscaled.eval()(torch.tensor([prompt])).logits[0, -1] - ref).norm() / ref.norm() > 1e-2
    assert (logits[0] - ref).norm() / ref.norm() < 1e-4
    short = prompts(engine.loaded.model.spec.vocab_size, [20], seed=3)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert engine.generate([short], params)[0].outputs[0].token_ids == hf_greedy(path, short, 30)


def test_dynamic_ntk_rope_runs_as_hf_within_max_position_embeddings_and_no_further(tmp_path, hf_greedy):
    """HF's dynamic NTK scaling keeps the default frequencies up to max_position_embeddings and rescales them per
    sequence length past it: infer serves it within, and refuses a longer context by name."""
    from infer.core.errors import ConfigError

    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    path = edited_model(tmp_path / "m", "llama", lambda c: c.update(rope_scaling=dynamic), max_position_embeddings=64)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [50])[0]
    logits, ref = last_logits(engine, prompt), hf_last_logits(path, prompt)
    assert (logits - ref).norm() / ref.norm() < 1e-4
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)  # to position 64, the last one
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, 14)
    with pytest.raises(ConfigError, match="exceeds the 64 positions the model supports .*rope dynamic; past it, "
                                          "HF's dynamic NTK scaling changes the RoPE frequencies"):
        Engine(EngineConfig(model=str(path), device="cpu", max_model_len=65, num_kv_blocks=32))


LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}


@pytest.mark.parametrize(("arch", "rope", "top"), [
    ("phi3", LONGROPE, {"original_max_position_embeddings": 16}),  # Phi-3.5-mini's shape: factor from the ratio
    # Phi-3's older names for it ("su": HF 5 loads it only with the original context in the rope dict too)
    ("phi3", {**LONGROPE, "type": "su", "factor": 2.0, "original_max_position_embeddings": 16},
     {"original_max_position_embeddings": 16}),
    ("phi3", {**LONGROPE, "type": "yarn"}, {"original_max_position_embeddings": 16}),
    ("llama", {**LONGROPE, "rope_type": "longrope", "attention_factor": 1.3, "original_max_position_embeddings": 16},
     {}),
])
def test_longrope_turns_by_long_factor_past_the_original_context_and_by_short_within_it(
        tmp_path, hf_greedy, arch, rope, top, caplog):
    """A context past the original (--max-model-len 64): every position turns by long_factor, as HF turns a prompt
    longer than the original (logits within 1e-4, greedy tokens); the default context, the original (vLLM's
    default): by short_factor, as HF turns sequences that fit there."""
    from transformers import AutoModelForCausalLM

    path = edited_model(tmp_path / "m", arch, lambda c: c.update(rope_scaling=rope, **top), max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    unscaled = AutoModelForCausalLM.from_pretrained(str(edited_model(  # the same weights without LongRoPE
        tmp_path / "plain", arch, lambda c: None, max_position_embeddings=64)), dtype=torch.float32).eval()
    for context, length, generated in ((64, 40, 20), (None, 8, 8)):
        with caplog.at_level("INFO", logger="infer"):
            caplog.clear()
            engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, max_model_len=context))
        assert engine.max_model_len == (context or 16)
        assert ("exceeds the original 16, so every position turns by long_factor" in caplog.text) == bool(context)
        prompt = prompts(engine.loaded.model.spec.vocab_size, [length])[0]
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        _, logits = engine.runner.execute(engine.scheduler.schedule(), engine.kv)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            assert (unscaled(torch.tensor([prompt])).logits[0, -1] - ref).norm() / ref.norm() > 1e-2
        assert (logits[0] - ref).norm() / ref.norm() < 1e-4
        params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
        assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, generated)


@pytest.mark.parametrize("fused_ops", [False, pytest.param(True, marks=pytest.mark.slow)])  # interpreted: 15 s
def test_phi4_minis_partial_rotation_runs_what_hf_runs(tmp_path, hf_greedy, fused_ops):
    """Phi-4-mini turns 3/4 of each head (partial_rotary_factor 0.75: here 12 of 16 dimensions, the rest pass) by
    LongRoPE tables of 6 factors, with tied embeddings: logits within 1e-4 of HF's and greedy tokens, with the torch
    ops and with the Triton kernels."""
    rope = {"type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}
    whole = {**rope, "short_factor": rope["short_factor"] + [1.6, 1.7], "long_factor": rope["long_factor"] + [20, 24]}
    path, turned = (edited_model(tmp_path / name, "phi3", lambda c: c.update(
        rope_scaling=table, partial_rotary_factor=partial, original_max_position_embeddings=16),
        max_position_embeddings=64, tie_word_embeddings=True) for name, table, partial in (
            ("m", rope, 0.75), ("whole", whole, 1.0)))
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, fused_ops=fused_ops,
                                 max_model_len=64))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [40])[0]
    logits, ref, whole_ref = last_logits(engine, prompt), hf_last_logits(path, prompt), hf_last_logits(turned, prompt)
    assert (whole_ref - ref).norm() / ref.norm() > 1e-2  # the same weights turning whole heads
    assert (logits - ref).norm() / ref.norm() < 1e-4
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, 20)


def test_phi3s_original_context_is_its_classs_4096_where_the_top_level_has_none(tmp_path, hf_greedy, caplog):
    """HF's Phi3Config has original_max_position_embeddings 4096, which wins over the rope dict's: a 64-position
    context is then within the original, turned by short_factor."""
    rope = {**LONGROPE, "original_max_position_embeddings": 16}
    path = edited_model(tmp_path / "m", "phi3", lambda c: (c.update(rope_scaling=rope),
                                                           c.pop("original_max_position_embeddings", None)),
                        max_position_embeddings=64)
    with caplog.at_level("INFO", logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32))
    assert "long_factor" not in caplog.text
    prompt = prompts(engine.loaded.model.spec.vocab_size, [40])[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, 20)


def test_yarn_extends_the_context_to_the_original_times_its_factor(tmp_path):
    """vLLM's rule: Qwen2.5's max_position_embeddings 32768 with YaRN factor 4 (original 32768) serves 131072, by
    default too; a product below max_position_embeddings is the context as well."""
    from infer.core.errors import CheckpointError, ConfigError

    yarn = {**YARN, "original_max_position_embeddings": 32}
    path = edited_model(tmp_path / "m", "qwen2", lambda c: c.update(rope_scaling=yarn), max_position_embeddings=32)
    assert Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16)).max_model_len == 128
    short = edited_model(tmp_path / "s", "qwen2", lambda c: c.update(rope_scaling={**yarn, "factor": 1.0}),
                         max_position_embeddings=40)
    assert Engine(EngineConfig(model=str(short), device="cpu", num_kv_blocks=16)).max_model_len == 32
    with pytest.raises(ConfigError, match=r"exceeds the 128 positions the model supports \(max_position_embeddings "
                                          r"32, rope yarn\)"):
        Engine(EngineConfig(model=str(path), device="cpu", max_model_len=129, num_kv_blocks=16))
    for bad, complaint in (({"beta_fast": "32"}, "needs beta_fast as a number >= 0, got '32'"),
                           ({"factor": 0}, "needs factor as a positive number, got 0"),
                           ({"attention_factor": 0}, "needs attention_factor as a positive number, got 0"),
                           ({"mscale": -1}, "needs mscale as a number >= 0, got -1"),
                           ({"truncate": "no"}, "needs truncate as true or false, got 'no'")):
        broken = edited_model(tmp_path / "bad", "qwen2", lambda c: c.update(rope_scaling={**YARN, **bad}))
        with pytest.raises(CheckpointError, match=re.escape(complaint)):
            Engine(EngineConfig(model=str(broken), device="cpu", num_kv_blocks=16))


def hf_window(path) -> int | None:
    """The window HF's model attends within, read off its behaviour: the config's sliding_window where the last
    token's logits past it change when that window is made too wide to matter, None where they do not."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    window = getattr(AutoConfig.from_pretrained(str(path)), "sliding_window", None)
    if window is None:
        return None
    config = json.loads((path / "config.json").read_text())
    prompt = torch.tensor(prompts(config["vocab_size"], [window + 8], seed=5))
    with torch.no_grad():
        windowed = AutoModelForCausalLM.from_pretrained(str(path)).eval()(prompt).logits[0, -1]
        (path / "config.json").write_text(json.dumps({**config, "sliding_window": 10**6}))
        wide = AutoModelForCausalLM.from_pretrained(str(path)).eval()(prompt).logits[0, -1]
    (path / "config.json").write_text(json.dumps(config))
    return window if not torch.allclose(windowed, wide, rtol=0, atol=1e-6) else None


@pytest.mark.parametrize(("arch", "edit", "options"), [
    ("mistral", lambda c: c.pop("sliding_window", None), {"max_position_embeddings": 8192}),  # HF's default 4096
    ("mistral", lambda c: c.update(sliding_window=48, use_sliding_window=False), {}),  # Mistral slides whatever
    ("llama", lambda c: c.update(sliding_window=48, use_sliding_window=True), {}),  # Llama never slides
    # Qwen slides from layer max_window_layers (default 28) on, with use_sliding_window; given layer types win
    ("qwen2", lambda c: c.update(sliding_window=48, use_sliding_window=True, max_window_layers=2, layer_types=None),
     {}),
    ("qwen2", lambda c: c.update(sliding_window=48, use_sliding_window=True, max_window_layers=1, layer_types=None),
     {}),
    ("qwen2", lambda c: c.update(sliding_window=48, use_sliding_window=True, max_window_layers=0, layer_types=None),
     {}),
    ("qwen2", lambda c: c.update(sliding_window=48, use_sliding_window=True, max_window_layers=0,
                                 layer_types=["full_attention"] * 2), {}),
    ("qwen2", lambda c: (c.update(sliding_window=48, use_sliding_window=True, layer_types=None),
                         c.pop("max_window_layers", None)), {}),  # 2 layers, all below the default 28
    ("qwen2", lambda c: c.update(sliding_window=48, use_sliding_window=False, max_window_layers=0, layer_types=None),
     {}),
    ("qwen3", lambda c: (c.update(use_sliding_window=True, max_window_layers=0, layer_types=None),  # HF's 4096
                         c.pop("sliding_window", None)), {"max_position_embeddings": 8192}),
    ("qwen2", lambda c: (c.update(use_sliding_window=True, max_window_layers=0, layer_types=None),  # HF's 4096
                         c.pop("sliding_window", None)), {"max_position_embeddings": 8192}),
    ("phi3", lambda c: c.update(sliding_window=48), {}),  # Phi-3 slides where config.json gives a window
    ("phi3", lambda c: c.pop("sliding_window", None), {}),  # and not by default
])
def test_a_model_slides_where_hf_slides(tmp_path, arch, edit, options):
    """Its layers attend within HF's window (whether and where HF slides is read off HF's logits), over the
    model's whole context."""
    path = edited_model(tmp_path / "m", arch, edit, **options)
    window = hf_window(path)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=4))
    assert {layer.self_attn.window for layer in engine.loaded.model.model.layers} - {None} == \
        ({window} if window else set())
    assert engine.max_model_len == options.get("max_position_embeddings", 1024)


SLIDING = {  # a window of 16 in every layer (Mistral, Phi-3), or in layers from max_window_layers on (Qwen)
    "mistral": lambda c: c.update(sliding_window=16),
    "qwen2": lambda c: c.update(sliding_window=16, use_sliding_window=True, max_window_layers=1, layer_types=None),
    "phi3": lambda c: c.update(sliding_window=16),
}


@pytest.mark.parametrize("attention", ["torch", "cpu", "triton", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_window_attention_generates_what_hf_generates(tmp_path, hf_greedy, arch, attention):
    """Prompts of 50 tokens (3 windows) whole and in chunks of 16, then 20 decodes past them, and a second prompt
    served partly from the prefix cache: HF's greedy tokens, on every shipped backend (triton: the interpreter;
    cuda: triton on the GPU, with its CUDA graphs, in float32)."""
    if attention == "cuda" and not torch.cuda.is_available():
        pytest.fail("pytest -m gpu needs a CUDA device")
    device = {"cuda": dict(device="cuda", dtype="float32", attention="triton")}.get(
        attention, dict(device="cpu", attention=attention))
    path = edited_model(tmp_path / "m", arch, SLIDING[arch])
    prompt, other = prompts(1024, [50, 50], seed=4)
    other = prompt[:40] + other[:10]  # 40 cached tokens, then its own
    for chunked in ({}, {"scheduler": "chunked-prefill", "max_num_batched_tokens": 16}):
        engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, **device, **chunked))
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(path, prompt, 20)
        assert engine.generate([other], params)[0].outputs[0].token_ids == hf_greedy(path, other, 20)


@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_the_calibration_forward_slides_as_hf(tmp_path, arch, infer_plugins):
    """quant/forward.py's dense forward (AWQ calibration, fp8 KV scales) over prompts 3 windows long: every
    position's logits are HF's (it refused such samples)."""
    from transformers import AutoModelForCausalLM

    from infer.core.loader import load_model
    from infer.quant.forward import dense_forward

    path = edited_model(tmp_path / "m", arch, SLIDING[arch])
    loaded = load_model(EngineConfig(model=str(path), device="cpu").validate(), infer_plugins.collect(), path)
    batch = prompts(1024, [50, 30], seed=6)
    with torch.no_grad():
        ours = loaded.model.compute_logits(dense_forward(loaded.model, batch, loaded.device))
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        ref = torch.cat([hf(torch.tensor([prompt])).logits[0] for prompt in batch])
    assert (ours - ref).norm() / ref.norm() < 1e-4


def sliding_model_on(backend: type, tmp_path, infer_plugins, caplog) -> tuple:
    """A Mistral with a 16-position window on the plugin backend ``backend`` (registered under its lowercase name),
    and the engine built on it with the default context."""
    from infer.core.hookspecs import hookimpl

    name = backend.__name__.lower()
    module = types.ModuleType(name)
    module.register_attention_backends = hookimpl(lambda register: register(name, lambda config: backend()))
    infer_plugins.register(module, name=name, source="tests")
    path = edited_model(tmp_path / "m", "mistral", SLIDING["mistral"])
    with caplog.at_level("WARNING", logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", attention=name, num_kv_blocks=16), infer_plugins)
    return path, engine


def test_a_backend_without_a_sliding_window_runs_the_model_within_its_window(tmp_path, infer_plugins, caplog):
    """A plugin's backend that lacks one: the context is cut to the window, with a warning (a longer
    --max-model-len is refused); asked to slide past it anyway, attend refuses by name."""
    from infer.core.errors import ConfigError, PluginError
    from infer.plugins.torch_attention import TorchAttention

    class Plain(TorchAttention):
        supports_sliding_window = False

    path, engine = sliding_model_on(Plain, tmp_path, infer_plugins, caplog)
    assert engine.max_model_len == 16 and "limiting the model's context to its sliding window (16)" in caplog.text
    with pytest.raises(ConfigError, match="max-model-len 64 exceeds the model's sliding window 16, and attention "
                                          "backend Plain has no sliding window"):
        Engine(EngineConfig(model=str(path), device="cpu", attention="plain", num_kv_blocks=16, max_model_len=64),
               infer_plugins)
    meta = types.SimpleNamespace(max_context_len=17)
    with pytest.raises(PluginError, match="attention backend Plain has no sliding window"):
        Plain().attend(torch.zeros(1, 4, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), None, meta, 1.0, window=16)


def test_a_plugin_backend_whose_forward_takes_no_window_runs_within_the_window(tmp_path, infer_plugins, caplog):
    """A TorchAttention subclass written before backends had windows overrides forward(q, k, v, kv_cache, meta,
    scale): it inherits supports_sliding_window but cannot take one, so the context is cut to the window (it
    generated until its first context past the window, then failed with a TypeError)."""
    from infer.plugins.torch_attention import TorchAttention

    class Old(TorchAttention):
        def forward(self, q, k, v, kv_cache, meta, scale):
            return super().forward(q, k, v, kv_cache, meta, scale)

    path, engine = sliding_model_on(Old, tmp_path, infer_plugins, caplog)
    assert engine.max_model_len == 16 and "attention backend Old has no sliding window" in caplog.text
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # to position 16: the window's last
    out = engine.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    shipped = Engine(EngineConfig(model=str(path), device="cpu", attention="torch", num_kv_blocks=16))
    assert len(out) == 12 and out == shipped.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids


def test_other_activations_are_refused(tmp_path):
    from infer.core.errors import CheckpointError

    gelu = edited_model(tmp_path / "c", "llama", lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(CheckpointError, match="has hidden_act 'gelu'; infer's MLP computes silu"):
        Engine(EngineConfig(model=str(gelu), device="cpu", num_kv_blocks=4))


def test_make_tiny_model_writes_seeded_random_norms_and_the_head_it_is_asked_for(tmp_path) -> None:
    """The tiny checkpoints every test runs on: weights fixed by ``seed`` alone (not by the caller's generator, which
    is left as it was), norm weights drawn from [0.5, 1.5] rather than HF's constant init, a tied head when asked
    for, and head sizes that rotary embeddings can rotate."""
    import json

    from safetensors.torch import load_file

    from infer.core.errors import ConfigError
    from infer.models.tiny import make_tiny_model, stdlib_corpus

    corpus = stdlib_corpus(max_files=5)
    made = {}
    for name, caller_seed, seed in (("a", 7, 0), ("b", 8, 0), ("c", 7, 1)):
        torch.manual_seed(caller_seed)
        state = torch.get_rng_state()
        path = make_tiny_model(tmp_path / name, "gemma2", tie_word_embeddings=True, seed=seed, tokenizer_files=corpus)
        assert torch.equal(torch.get_rng_state(), state)
        made[name] = load_file(str(path / "model.safetensors"))
    assert made["a"].keys() == made["b"].keys() == made["c"].keys()
    assert all(torch.equal(made["a"][key], made["b"][key]) for key in made["a"])
    assert not torch.equal(made["a"]["model.embed_tokens.weight"], made["c"]["model.embed_tokens.weight"])
    norms = [tensor for key, tensor in made["a"].items() if "norm" in key]
    assert len(norms) > 2 and all(0.5 <= float(t.min()) and float(t.max()) <= 1.5 and float(t.std()) > 0.1
                                  for t in norms)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in made["a"]
    with pytest.raises(ConfigError, match="hidden-size 36 must split into 4 heads of an even size"):
        make_tiny_model(tmp_path / "odd", "llama", hidden_size=36, num_heads=4, tokenizer_files=corpus)

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_tiny_checkpoints_tokenizer_fits_the_model(name, checkpoint):
    """transformers loads a qwen checkpoint's tokenizer as Qwen2Tokenizer, which adds <|endoftext|> when it is
    missing: the tiny qwen models had 1025 tokens for a 1024-token model (and a warning at every load)."""
    import json

    from transformers import AutoTokenizer

    path = checkpoint(name)
    assert len(AutoTokenizer.from_pretrained(str(path))) == json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize(("arch", "edit"), [
    ("llama", lambda c: c.update(rms_norm_eps=0.0)),  # 0 is a value, not "absent"
    ("llama", lambda c: c.pop("rms_norm_eps")),
    ("phi3", lambda c: c.pop("rms_norm_eps")),  # Phi-3's default is 1e-5
    ("qwen2", lambda c: c.update(num_key_value_heads=None)),
    ("qwen2", lambda c: c.update(dtype="float16", torch_dtype="bfloat16")),  # dtype wins, torch_dtype fills in
    ("qwen3", lambda c: (c.update(use_sliding_window=True, max_window_layers=0, layer_types=None),
                         c.pop("sliding_window", None))),
])
def test_config_fields_read_as_transformers_reads_them(tmp_path, arch, edit):
    from transformers import AutoConfig

    from infer.core.loader import checkpoint_dtype, read_config
    from infer.models.llama import ArchConfig

    path = edited_model(tmp_path / "m", arch, edit, max_position_embeddings=8192)
    hf = AutoConfig.from_pretrained(str(path))
    ours = ArchConfig.from_hf(read_config(path))
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.num_kv_heads == hf.num_key_value_heads
    kinds = getattr(hf, "layer_types", None) or ["full_attention"]  # HF's Llama has none: it never slides
    windows = {hf.sliding_window if kind == "sliding_attention" else None for kind in kinds}
    assert {ours.sliding_window} == windows
    assert str(hf.dtype).removeprefix("torch.") == checkpoint_dtype(read_config(path)) == ours.torch_dtype



def test_phi3_longrope_without_an_original_context_takes_the_class_default() -> None:
    """A Phi-3 config whose longrope and top level leave original_max_position_embeddings out: Phi3Config's 4096,
    and the factor HF's longrope derives from it (max_position_embeddings / original)."""
    import copy

    from transformers import Phi3Config

    from infer.models.llama import ArchConfig

    raw = {"architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
           "vocab_size": 100, "pad_token_id": 0, "num_attention_heads": 4, "max_position_embeddings": 16384,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    hf = Phi3Config.from_dict(copy.deepcopy(raw))
    ours = ArchConfig.from_hf(copy.deepcopy(raw))
    assert ours.rope["original_max_position_embeddings"] == hf.rope_parameters["original_max_position_embeddings"]
    assert ours.rope["factor"] == hf.max_position_embeddings / hf.original_max_position_embeddings

@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3"])
def test_a_large_rms_norm_eps_reaches_every_norm_as_in_hf(tiny_model_factory, arch):
    """The tiny checkpoints' eps (1e-6) is far below their activations' mean square, so a norm that dropped it or
    took a constant would pass the other tests: here eps is of their size (q/k norms, Gemma's (1 + w) norms
    included), and the last token's logits must still be HF's within 1e-4."""
    path = tiny_model_factory(arch, max_position_embeddings=64, extra={"rms_norm_eps": 0.05})
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [20], seed=7)[0]
    logits, ref = last_logits(engine, prompt), hf_last_logits(path, prompt)
    assert (logits - ref).norm() / ref.norm() < 1e-4


def test_a_checkpoints_rotary_inv_freq_buffers_are_skipped(checkpoint, tmp_path, hf_greedy):
    """Older exports saved each layer's rotary_emb.inv_freq (a buffer HF derives from the config): the model
    loads without them and generates the tokens HF generates on the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoint("llama")
    path = tmp_path / "m"
    shutil.copytree(source, path)
    tensors = load_file(str(path / "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [12], seed=3)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(source, prompt, 8)


def test_merged_projections_keep_their_parts_biases(checkpoint, tmp_path):
    """HF initialises biases to zero, so the tiny Qwen2's q/k/v biases would hide a merge that dropped them: with
    random biases, merged q/k/v (the CUDA default) give HF's last-token logits within 1e-4."""
    from transformers import AutoModelForCausalLM

    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint("qwen2"), path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
    model.save_pretrained(str(path))
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16, fuse_projections=True))
    assert engine.loaded.model.model.layers[0].self_attn.qkv_proj is not None
    prompt = prompts(engine.loaded.model.spec.vocab_size, [20], seed=9)[0]
    logits = last_logits(engine, prompt)
    with torch.no_grad():
        ref = model.eval()(torch.tensor([prompt])).logits[0, -1]
    assert (logits - ref).norm() / ref.norm() < 1e-4


def test_a_bad_rms_norm_eps_or_rope_theta_is_refused(tmp_path):
    from infer.core.errors import CheckpointError

    for name, arch, edit, message in (
            ("a", "llama", lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps = -1e-06"),
            ("b", "llama", lambda c: (c.pop("rope_parameters", None), c.update(rope_theta=0)),
             "needs rope_theta as a positive number, got 0"),
            # a partial rotation: HF's Phi3 only; one of an odd number of dimensions (16 x 0.1 -> 1)
            ("c", "llama", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75),
             "has partial_rotary_factor 0.75; transformers' LlamaForCausalLM turns whole heads"),
            ("k", "phi3", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.1),
             "has partial_rotary_factor 0.1; it must be in .0, 1. and turn an even number of the head's 16"),
            ("d", "phi3", lambda c: c.update(rope_scaling={"type": "su", "short_factor": [1.0] * 8,
                                                           "long_factor": [2.0] * 7}),
             "rope 'longrope' in config.json of this Phi3ForCausalLM .Phi-3 reads rope types 'su' and 'yarn' as "
             "'longrope', as HF does. needs long_factor as a list of 8 positive "
             "numbers .one per pair of the 16 dimensions that turn., got a list of 7;"),
            ("l", "phi3", lambda c: c.update(rope_scaling={"type": "yarn", "short_factor": [1.0] * 9,
                                                           "long_factor": [2.0] * 8}),
             "needs short_factor as a list of 8 positive numbers .*got a list of 9;"),
            ("i", "phi3", lambda c: c.update(rope_scaling={"type": "longrope", "short_factor": [1.0] * 7 + [0],
                                                           "long_factor": [2.0] * 8}),
             "needs short_factor as a list of 8 positive numbers .*got \\[1.0, "),
            ("j", "llama", lambda c: c.update(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                            "long_factor": [2.0] * 8, "attention_factor": -1}),
             "rope 'longrope' in config.json of this LlamaForCausalLM needs attention_factor as a positive number"),
            ("e", "llama", lambda c: c.update(rms_norm_eps=float("inf")), "rms_norm_eps = inf; it must be a finite"),
            ("f", "llama", lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps = nan; it must be a finite"),
            ("g", "llama", lambda c: c.update(hidden_act=""), "has hidden_act ''; infer's MLP computes silu"),
            ("h", "mistral", lambda c: c.update(sliding_window=-1), "has sliding_window = -1; a window is a positive")):
        path = edited_model(tmp_path / name, arch, edit)
        with pytest.raises(CheckpointError, match=message):
            Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=4))


def test_an_architecture_that_model_type_contradicts_is_named(tmp_path, caplog):
    """transformers' AutoModelForCausalLM builds model_type's class, infer (like vLLM) architectures': say so."""
    path = edited_model(tmp_path / "m", "mistral", lambda c: c.update(architectures=["LlamaForCausalLM"],
                                                                     sliding_window=48))
    with caplog.at_level("WARNING", logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=4))
    assert "names the architecture LlamaForCausalLM but model_type 'mistral'" in caplog.text
    cfg = engine.loaded.model.cfg  # the Llama it names is built: it never slides, where Mistral would
    assert cfg.architecture == "LlamaForCausalLM" and cfg.sliding_window is None
    assert "builds as MistralForCausalLM" in caplog.text
