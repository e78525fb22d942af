"""Embedding requests where they meet the rest of the engine: swap preemption, LoRA adapters, other architectures,
a draft-model proposer, the priority and lpm policies, prefix hold-back, aborts, hand-driven steps, failing steps.
Each embedding is checked against HF transformers' final hidden states (after the last norm), pooled."""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError, PluginError
from infer.core.hookspecs import hookimpl
from infer.core.plugins import PluginManager
from infer.core.pooling import PoolingParams
from infer.core.request import FinishReason, RequestOutput, SamplingParams
from infer.models.tiny import PRETRAINED_DIR

States = Callable[[list[int]], torch.Tensor]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MODES = {"sync": {}, "async-output": {"async_output": True}, "async-scheduling": {"async_scheduling": True}}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def hf_states(model: torch.nn.Module) -> States:
    """``model``'s final hidden states (a causal LM's inner ``model``, after its last norm) at every position."""
    def states(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0].float()
    return states


def load_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def expected(states: torch.Tensor, pooling: str, normalize: bool = True, dimensions: int | None = None
             ) -> list[float]:
    vector = states[-1] if pooling == "last" else states.mean(0)
    vector = vector[:dimensions] if dimensions is not None else vector
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()


def check(out: RequestOutput, ids: list[int], states: States, params: PoolingParams, tolerance: float = 1e-5) -> None:
    assert out.finished and out.embedding is not None
    assert [c.finish_reason for c in out.outputs] == [FinishReason.STOP]
    want = expected(states(ids), params.pooling or "last", params.normalize is not False, params.dimensions)
    assert out.embedding == pytest.approx(want, abs=tolerance)


def drained(engine: Engine) -> bool:
    return engine.kv.stats().used_blocks == 0 and engine.embeddings.live == 0 and not engine.requests


def steps(engine: Engine, limit: int = 200) -> Iterator[list[RequestOutput]]:
    """``engine.step()``'s outputs until nothing is left; a request never finished fails (no endless loop)."""
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        yield engine.step()
    pytest.fail(f"requests still unfinished after {limit} steps: {list(engine.requests)}")


@pytest.fixture(scope="module")
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llama_states(llama: Path) -> States:
    return hf_states(load_hf(llama).model)


def test_a_swapped_out_mean_embedding_comes_back_with_its_sum(llama: Path, llama_states: States) -> None:
    """A KV pool too small for all: sequences are swapped out to host memory mid-prompt and back."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=6, max_num_seqs=4,
                                 scheduler="chunked-prefill", max_num_batched_tokens=8, preemption_mode="swap",
                                 num_swap_blocks=32))
    prompts = [prompt(12, 1), prompt(12, 2), prompt(40, 3), prompt(30, 4)]
    params: list = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2 + \
        [PoolingParams(pooling="mean"), PoolingParams(pooling="last")]
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_swapped_out > 0 and outs[2].metrics["num_preemptions"] > 0  # the mean, mid-prompt
    for i in (2, 3):
        check(outs[i], prompts[i], llama_states, params[i])
    assert drained(engine)


def test_an_adapters_embedding_equals_pefts_hidden_states(llama: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    model = peft.get_peft_model(load_hf(llama), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "a"))
    engine = Engine(EngineConfig(model=str(llama), device="cpu", dtype="float32", num_kv_blocks=64,
                                 lora_adapters={"a": str(tmp_path / "a")}, kv_cache="radix-cache"))
    prompts = [prompt(11, 5), prompt(7, 6), prompt(11, 5)]
    params = [PoolingParams(pooling="mean", lora_adapter="a"), PoolingParams(lora_adapter="a"), PoolingParams()]
    outs = engine.embed(prompts, params)
    adapted = hf_states(model.base_model.model.model)
    check(outs[0], prompts[0], adapted, params[0])
    check(outs[1], prompts[1], adapted, params[1])
    with model.disable_adapter():
        base = hf_states(model.base_model.model.model)
        check(outs[2], prompts[2], base, params[2])
        assert outs[0].embedding != pytest.approx(expected(base(prompts[0]), "mean"), abs=1e-3)
    again = engine.embed([prompts[1], prompts[1]], [PoolingParams(lora_adapter="a"), PoolingParams()])
    check(again[0], prompts[1], adapted, params[1])
    with model.disable_adapter():
        check(again[1], prompts[1], base, PoolingParams())
    assert drained(engine)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2", "qwen3moe", "phi3"])
def test_other_architectures_pool_hfs_last_hidden_state(checkpoint, tiny_model_factory, name: str) -> None:
    path = tiny_model_factory("qwen3moe") if name == "qwen3moe" else checkpoint(name)
    states = hf_states(load_hf(path).model)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                                 scheduler="chunked-prefill", max_num_batched_tokens=8))
    prompts = [prompt(13, 7), prompt(20, 8), prompt(1, 9)]
    params = [PoolingParams(), PoolingParams(pooling="mean"), PoolingParams(pooling="mean", normalize=False)]
    for out, ids, one in zip(engine.embed(prompts, params), prompts, params):
        check(out, ids, states, one, 1e-4)
    assert drained(engine)


def test_a_draft_model_proposer_drafts_beside_embeddings() -> None:
    target = PRETRAINED_DIR / "target"
    states = hf_states(load_hf(target).model)
    plain = Engine(EngineConfig(model=str(target), device="cpu", num_kv_blocks=128))
    engine = Engine(EngineConfig(model=str(target), device="cpu", num_kv_blocks=128, proposer="draft-model",
                                 num_speculative_tokens=3))
    prompts = [prompt(9, 10), prompt(14, 11), prompt(6, 12), prompt(17, 13)]
    params: list = [GREEDY, PoolingParams(pooling="mean"), GREEDY, PoolingParams()]
    outs = engine.generate(prompts, params)
    alone = plain.generate([prompts[0], prompts[2]], GREEDY)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [a.outputs[0].token_ids for a in alone]
    check(outs[1], prompts[1], states, params[1])
    check(outs[3], prompts[3], states, params[3])
    assert engine.stats.spec_proposed > 0 and drained(engine)
    assert engine.spec.proposer.kv.stats().used_blocks == 0 and not engine.spec.proposer.shadows


@pytest.mark.parametrize("policy", ["priority", "lpm"])
def test_embeddings_under_the_priority_and_lpm_policies(llama: Path, llama_states: States, policy: str) -> None:
    """A shared prefix, the radix cache, chunks, one seat fewer than requests: every embedding equals HF's."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=24, block_size=4, max_num_seqs=3,
                                 scheduler="chunked-prefill", max_num_batched_tokens=12, kv_cache="radix-cache",
                                 scheduling_policy=policy))
    shared = prompt(16, 14)
    prompts = [shared + prompt(3 + i, 15 + i) for i in range(5)] + [prompt(9, 20)]
    params: list = [PoolingParams(pooling="mean" if i % 2 else "last", priority=i % 3) for i in range(5)]
    params.append(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, priority=2))
    outs = engine.generate(prompts, params)
    for out, ids, one in zip(outs[:5], prompts, params):
        check(out, ids, llama_states, one)
    again = engine.embed(prompts[:2])
    for out, ids in zip(again, prompts):
        check(out, ids, llama_states, PoolingParams())
    assert again[0].num_cached_tokens > 0 and drained(engine)


@pytest.mark.parametrize("mode", ["sync", "async-scheduling"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_more_important_request_preempts_an_embedding_mid_prompt(llama: Path, llama_states: States, mode: str,
                                                                   pooling: str) -> None:
    """One seat: a priority-5 request preempts a priority-0 embedding after 3 of its 5 chunks (recompute, the radix
    cache beside); computed again, its mean adds only the positions it had not summed."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=1,
                                 scheduler="chunked-prefill", max_num_batched_tokens=8, kv_cache="radix-cache",
                                 scheduling_policy="priority", **MODES[mode]))
    ids, params = prompt(40, 43), PoolingParams(pooling=pooling)
    rid = engine.add_request(ids, params)
    finished: dict[str, RequestOutput] = {}
    for _ in range(3):
        assert engine.step() == []
    important = engine.add_request(prompt(6, 44), SamplingParams(max_tokens=3, temperature=0.0, priority=5))
    for outs in steps(engine):
        finished.update((out.request_id, out) for out in outs if out.finished)
    assert list(finished) == [important, rid] and finished[rid].metrics["num_preemptions"] == 1
    check(finished[rid], ids, llama_states, params)
    assert drained(engine)


def test_many_last_embeddings_that_share_a_prefix_wait_for_it(llama: Path, llama_states: States) -> None:
    """The radix cache and chunked prefill: requests held back for the prefix another computes still pool it."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64, block_size=4,
                                 scheduler="chunked-prefill", max_num_batched_tokens=16, kv_cache="radix-cache"))
    shared = prompt(24, 21)
    prompts = [shared + prompt(2 + i, 22 + i) for i in range(6)] + [shared]
    params = [PoolingParams(pooling="mean" if i == 3 else "last") for i in range(7)]
    outs = engine.embed(prompts, params)
    for out, ids, one in zip(outs, prompts, params):
        check(out, ids, llama_states, one)
    assert sum(out.num_cached_tokens > 0 for out in outs) >= 4 and drained(engine)


def test_an_embedding_aborted_mid_prompt_under_async_scheduling(llama: Path, llama_states: States) -> None:
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64, async_scheduling=True,
                                 scheduler="chunked-prefill", max_num_batched_tokens=4))
    other = engine.add_request(prompt(5, 30), GREEDY)
    rid = engine.add_request(prompt(18, 31), PoolingParams(pooling="mean"))
    tokens: list[int] = []
    for _ in range(2):
        for out in engine.step():
            assert out.request_id == other
            tokens += out.outputs[0].token_ids
    final = engine.abort(rid)
    assert final.finished and final.embedding is None
    assert [c.finish_reason for c in final.outputs] == [FinishReason.ABORT]
    later = engine.add_request(prompt(18, 31), PoolingParams(pooling="mean"))
    results: dict[str, RequestOutput] = {}
    for outs in steps(engine):
        for out in outs:
            assert out.request_id != rid
            if out.request_id == other:
                tokens += out.outputs[0].token_ids
            if out.finished:
                results[out.request_id] = out
    check(results[later], prompt(18, 31), llama_states, PoolingParams(pooling="mean"))
    assert len(tokens) == 12 and drained(engine)


@pytest.mark.parametrize("mode", list(MODES))
def test_hand_driven_steps_give_an_embedding_once_finished(llama: Path, llama_states: States, mode: str) -> None:
    """engine.step(): an embedding request's one output, finished; a one-token prompt; all dimensions of the
    hidden size; a mean not normalized."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=6, kv_cache="radix-cache", **MODES[mode]))
    requests = {"one": ([42], PoolingParams()), "one-mean": ([42], PoolingParams(pooling="mean")),
                "one-again": ([42], PoolingParams()),
                "all-dims": (prompt(9, 32), PoolingParams(dimensions=64)),
                "raw-mean": (prompt(14, 33), PoolingParams(pooling="mean", normalize=False)),
                "gen": (prompt(4, 34), GREEDY)}
    for rid, (ids, params) in requests.items():
        engine.add_request(ids, params, rid)
    seen: dict[str, list[RequestOutput]] = {}
    for outs in steps(engine):
        for out in outs:
            seen.setdefault(out.request_id, []).append(out)
    for rid, (ids, params) in requests.items():
        if isinstance(params, PoolingParams):
            assert len(seen[rid]) == 1, rid
            check(seen[rid][0], ids, llama_states, params)
    assert drained(engine)


class FailsAt:
    def __init__(self, at: int) -> None:
        self.steps, self.at = 0, at

    @hookimpl
    def on_step(self, stats) -> None:
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("transient")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("at", [1, 3, 5])
def test_a_failing_step_ends_an_embedding_request_without_a_leak(llama: Path, llama_states: States, mode: str,
                                                                 at: int) -> None:
    plugins, observer = PluginManager.from_entry_points(), FailsAt(at)
    plugins.register(observer, name="fails", source="acme")
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64, scheduler="chunked-prefill",
                                 max_num_batched_tokens=4, **MODES[mode]), plugins)
    ids = prompt(18, 35)
    stream = engine.stream(ids, PoolingParams(pooling="mean"))
    other = engine.add_request(prompt(5, 36), GREEDY)
    with pytest.raises(PluginError, match="the observer 'fails' from 'acme' raised RuntimeError"):
        for _ in stream:
            pass
    engine.abort(other)
    assert drained(engine)
    check(engine.embed([ids], PoolingParams(pooling="mean"))[0], ids, llama_states, PoolingParams(pooling="mean"))


def test_embed_reads_a_none_in_its_list_of_params_as_the_default_pooling(llama: Path, llama_states: States) -> None:
    """embed's list of params may hold None (its check lets it through): that prompt is embedded with the default
    PoolingParams, not generated from as a SamplingParams request."""
    engine = Engine(EngineConfig(model=str(llama), device="cpu", num_kv_blocks=64))
    prompts = [prompt(8, 40), prompt(5, 41)]
    outs = engine.embed(prompts, [None, PoolingParams(pooling="mean")])  # type: ignore[list-item]
    check(outs[0], prompts[0], llama_states, PoolingParams())
    check(outs[1], prompts[1], llama_states, PoolingParams(pooling="mean"))
    assert outs[0].outputs[0].token_ids == [] and drained(engine)


ST_CASES = {  # (Pooling modes on, a module after the Pooling, the refusal)
    "mean-and-max": (("mean_tokens", "max_tokens"), None,
                     "'pooling_mode_mean_tokens' and 'pooling_mode_max_tokens' together"),
    "dense": (("mean_tokens",), "Dense", "modules include Dense, which infer does not run"),
}


@pytest.mark.parametrize("case", list(ST_CASES))
def test_a_checkpoint_whose_embedding_infer_cannot_compute_is_not_embedded_by_another(
        llama: Path, llama_states: States, tmp_path: Path, case: str) -> None:
    """sentence-transformers concatenates every pooling mode its config turns on (mean and max: twice the hidden
    size), and a Dense module projects the pooled vector: infer computes neither, so the checkpoint's default is
    refused, not replaced by a plain last or mean; an explicit pooling still gets the pooled hidden states."""
    modes, extra, refusal = ST_CASES[case]
    folder = tmp_path / "st"
    shutil.copytree(llama, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if extra is not None:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": f"sentence_transformers.models.{extra}"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, **{f"pooling_mode_{mode}": mode in modes for mode in (
            "cls_token", "mean_tokens", "max_tokens", "lasttoken")}}))
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    ids = prompt(6, 42)
    with pytest.raises(InvalidRequestError, match=f"{refusal}.*pass pooling="):
        engine.embed([ids])
    mean = PoolingParams(pooling="mean", normalize=False)  # no Normalize module: not normalized by default
    check(engine.embed([ids], PoolingParams(pooling="mean"))[0], ids, llama_states, mean)
    assert drained(engine)
