"""LoRA adapters (models/lora.py): PEFT's own adapters, saved by PEFT, served beside the base model; the reference
is PEFT's model on HF transformers (unmerged, its own forward pass)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import types
from collections.abc import Callable
from pathlib import Path

import peft  # the reference (in the dev extra): PEFT's own model on HF transformers
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from infer import LLM, SamplingParams
from infer.cli import main
from infer.core.beam_search import BeamSearchParams
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CapacityError, CheckpointError, ConfigError, InvalidRequestError
from infer.models.layers import Linear

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 12, 40, 7, 3], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [700, 33]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def peft_greedy(model: peft.PeftModel, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """PEFT's greedy continuation, and the log-softmax at the first generated position."""
    ids, out, first = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids).logits[0, -1].float()
            first = torch.log_softmax(logits, -1) if first is None else first
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    assert first is not None
    return out, first


class Adapter:
    """A PEFT adapter with random A and B (large enough to change the greedy tokens), saved to ``folder``."""

    def __init__(self, base: Path, folder: Path, targets: tuple[str, ...] = ALL_TARGETS, rank: int = 4,
                 alpha: float = 16, seed: int = 0, rslora: bool = False) -> None:
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                                 use_rslora=rslora)
        self.model = peft.get_peft_model(hf, config).eval()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.2)
        self.model.save_pretrained(str(folder))
        self.folder = folder

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        return peft_greedy(self.model, prompt, steps)

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """PEFT's logprob of each prompt token after the first, given those before it."""
        with torch.no_grad():
            logprobs = torch.log_softmax(self.model(torch.tensor([prompt])).logits[0].float(), -1)
        return [float(logprobs[i - 1, token]) for i, token in enumerate(prompt) if i]


def tokens(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def adapters(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    """On the llama checkpoint: "all" (every projection, rank 4), "qv" (q and v only, rank 8, rsLoRA)."""
    base, root = checkpoint("llama"), tmp_path_factory.mktemp("lora")
    return {"all": Adapter(base, root / "all"), "qv": Adapter(base, root / "qv", ("q_proj", "v_proj"), rank=8,
                                                                 alpha=4, seed=1, rslora=True)}


def engine_for(base: Path, adapters: dict[str, Adapter], **options) -> Engine:
    return Engine(EngineConfig(**{"model": str(base), "device": "cpu", "dtype": "float32", "num_kv_blocks": 128,
                                  "lora_adapters": {name: str(a.folder) for name, a in adapters.items()}, **options}))


@pytest.mark.parametrize("name", ["llama-tied", "qwen2", "qwen3", "mistral", "phi3"])
def test_an_adapter_on_each_architecture_equals_peft(checkpoint, tmp_path, name: str) -> None:
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if name == "phi3" else ALL_TARGETS  # its modules
    adapter = Adapter(checkpoint(name), tmp_path / "adapter", targets, seed=3)
    engine = engine_for(checkpoint(name), {"a": adapter})
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3,
                                                  prompt_logprobs=0, lora_adapter="a"))
    for prompt, result in zip(PROMPTS, out):
        expected, first = adapter.greedy(prompt, 10)
        assert result.outputs[0].token_ids == expected
        for token, logprob in result.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(float(first[token]), abs=1e-4)
        got = [entry[token] for entry, token in zip(result.prompt_logprobs[1:], prompt[1:])]
        assert got == pytest.approx(adapter.prompt_logprobs(prompt), abs=1e-4)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
def test_a_batch_mixing_adapters_and_the_base_model_equals_each_alone(checkpoint, adapters, hf_greedy, fuse) -> None:
    """Each token gets its own request's adapter (or none) in one batch; q/k/v and gate/up merged or not. Then each
    adapter alone beside the base model (the steps that run one adapter's slot only)."""
    base = checkpoint("llama")
    engine = engine_for(base, adapters, fuse_projections=fuse)
    for names in ([None, "all", "qv", "all", None, "qv"], [None, "qv"], ["all", None]):
        prompts = [PROMPTS[i % 3] for i in range(len(names))]
        params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lora_adapter=n) for n in names]
        for prompt, name, got in zip(prompts, names, tokens(engine.generate(prompts, params))):
            assert got == (hf_greedy(base, prompt, 10) if name is None else adapters[name].greedy(prompt, 10)[0])


def test_requests_without_an_adapter_are_unchanged_bit_for_bit(checkpoint, adapters) -> None:
    """A base-model token adds an exact zero delta: its logprobs equal those of an engine without adapters that runs
    batches of the same shapes."""
    base = checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    plain = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_kv_blocks=128)).generate(
        PROMPTS * 2, params)
    mixed = engine_for(base, adapters).generate(
        PROMPTS * 2, [params] * 3 + [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    lora_adapter="all")] * 3)
    for want, got in zip(plain, mixed[:3]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


@pytest.mark.parametrize("variant", ["chunked-prefill", "graphs", "async-scheduling", "fork", "ngram", "draft-model",
                                     "recompute", "swap", "beam-search"])
def test_adapters_through_the_engine_paths(checkpoint, adapters, hf_greedy, variant: str) -> None:
    """Chunked prefills beside decodes; padded CUDA-graph steps (eager, triton backend under the interpreter);
    steps scheduled before the previous step's tokens are read back; n > 1 forks; speculative verification (the
    proposers know nothing of adapters: the target verifies with them, the draft model runs without); preemption by
    recompute and by swap; beam search of width 1 (greedy). A base-model request runs beside the adapter's."""
    base, adapter = checkpoint("llama"), adapters["all"]
    options: dict = {}
    if variant == "chunked-prefill":
        options = dict(scheduler="chunked-prefill", max_num_batched_tokens=5)
    if variant == "graphs":
        options = dict(attention="triton", scheduler="chunked-prefill", max_num_batched_tokens=3)
    if variant == "ngram":
        options = dict(proposer="ngram", num_speculative_tokens=3, plugin_options={"ngram": {"min_n": 1}})
    if variant == "async-scheduling":
        options = dict(async_scheduling=True)
    if variant == "draft-model":
        options = dict(proposer="draft-model", draft_model=str(base), num_speculative_tokens=3)
    if variant in ("recompute", "swap"):
        options = dict(preemption_mode=variant, num_swap_blocks=64, num_kv_blocks=9, block_size=4)
    engine = engine_for(base, adapters, **options)
    if variant == "graphs":
        engine.runner.enable_cuda_graphs(4, {3: 4}, eager=True, mixed_tokens=24, mixed_rows=8)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], PROMPTS[1], PROMPTS[1]]  # the first repeats: the n-gram proposer drafts
    names = ["all", "all", None]
    expected = [adapter.greedy(p, 10)[0] if n else hf_greedy(base, p, 10) for p, n in zip(prompts, names)]
    if variant == "beam-search":
        for prompt, name, want in zip(prompts, names, expected):
            out = engine.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True,
                                                                lora_adapter=name))
            assert out[0].beams[0].token_ids == want
        return
    n = 3 if variant == "fork" else 1
    out = engine.generate(prompts, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=n,
                                                   lora_adapter=name) for name in names])
    assert [[c.token_ids for c in result.outputs] for result in out] == [[want] * n for want in expected]
    if variant == "graphs":
        assert engine.runner.graphs is not None and sum(engine.runner.graphs.replays.values()) > 0
        assert engine.runner.mixed_graphs is not None and engine.runner.mixed_graphs.replays > 0
    if variant in ("ngram", "draft-model"):
        assert engine.stats.spec_proposed > 0
    if variant in ("recompute", "swap"):
        assert engine.stats.preemptions > 0


class FrozenBranchGraph:
    """What CUDA-graph capture does to Python control flow, on the CPU: the adapters' branches taken at capture
    (``LoraTokens.active`` and ``only``) are kept; a replay reruns the captured function on the same buffers."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor, lora) -> None:
        self.run, self.out, self.lora, self.branch = run, out, lora, (lora.active, lora.only)

    def replay(self) -> None:
        live, (self.lora.active, self.lora.only) = (self.lora.active, self.lora.only), self.branch
        try:
            self.out.copy_(self.run())
        finally:
            self.lora.active, self.lora.only = live


@pytest.mark.parametrize("qv_loaded", ["at-start", "after-capture"])
def test_captured_graphs_hold_the_adapters_delta(checkpoint, adapters, hf_greedy, monkeypatch, qv_loaded) -> None:
    """The adapters' kernels, for every adapter, must be in the graphs whatever the step before capture ran (a
    capture that skipped them replayed the base model for every adapted decode); an adapter loaded into a free slot
    after capture is in them too (its weights are written into the buffers the graphs read)."""
    from infer.core import cuda_graphs

    base = checkpoint("llama")
    if qv_loaded == "at-start":
        engine = engine_for(base, adapters, attention="triton")
    else:
        engine = engine_for(base, {"all": adapters["all"]}, attention="triton", max_lora_adapters=2)

    def capture(run, pool):  # the loop variables the closure reads are frozen at capture, as a graph's are
        run = types.FunctionType(run.__code__, run.__globals__, None, None,
                                 tuple(types.CellType(c.cell_contents) for c in run.__closure__ or ()))
        out = run()
        return FrozenBranchGraph(run, out, engine.runner.lora.tokens), out, pool

    monkeypatch.setattr(cuda_graphs, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2, lora_adapter="all"))  # an eager step's state first
    engine.runner.enable_cuda_graphs(4)
    if qv_loaded == "after-capture":
        engine.load_lora_adapter("qv", adapters["qv"].folder)
    names = [None, "all", "qv"]
    out = engine.generate(PROMPTS, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_adapter=n)
                                    for n in names])
    assert sum(engine.runner.graphs.replays.values()) > 0
    for prompt, name, got in zip(PROMPTS, names, tokens(out)):
        assert got == (hf_greedy(base, prompt, 6) if name is None else adapters[name].greedy(prompt, 6)[0])


@pytest.mark.gpu
def test_adapters_on_cuda_with_graphs_equal_peft(checkpoint, adapters, hf_greedy) -> None:
    """The CUDA defaults (triton attention, CUDA graphs captured with the adapters' delta), in float32; one adapter
    loaded after the capture."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    base = checkpoint("llama")
    engine = Engine(EngineConfig(model=str(base), device="cuda", dtype="float32", num_kv_blocks=128,
                                 lora_adapters={"all": str(adapters["all"].folder)}, max_lora_adapters=2))
    assert engine.runner.graphs is not None
    engine.load_lora_adapter("qv", adapters["qv"].folder)  # after capture: written into the buffers graphs read
    names = [None, "all", "qv", "all"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    out = engine.generate(prompts, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lora_adapter=n)
                                    for n in names])
    for prompt, name, got in zip(prompts, names, tokens(out)):
        assert got == (hf_greedy(base, prompt, 10) if name is None else adapters[name].greedy(prompt, 10)[0])
    assert sum(engine.runner.graphs.replays.values()) > 0


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(checkpoint, adapters, hf_greedy, kv_cache) -> None:
    base = checkpoint("llama")
    engine = engine_for(base, adapters, kv_cache=kv_cache)
    prompt = list(range(200, 240))  # two full blocks of 16, then 8 tokens
    runs = []
    for name in ["all", None, "all", "qv", None]:
        out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                       lora_adapter=name))[0]
        runs.append((out.num_cached_tokens, out.outputs[0].token_ids))
        want = hf_greedy(base, prompt, 6) if name is None else adapters[name].greedy(prompt, 6)[0]
        assert out.outputs[0].token_ids == want, name
    assert [cached for cached, _ in runs] == [0, 0, 32, 0, 32]


def test_a_request_for_an_adapter_that_is_not_loaded_is_refused(checkpoint, adapters) -> None:
    engine = engine_for(checkpoint("llama"), {"all": adapters["all"]})
    with pytest.raises(InvalidRequestError, match="lora_adapter 'sql' is not loaded; the loaded adapters: all"):
        engine.add_request("x", SamplingParams(lora_adapter="sql"))
    plain = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match="start the engine with --lora NAME=DIR"):
        plain.add_request("x", SamplingParams(lora_adapter="all"))
    with pytest.raises(InvalidRequestError, match="lora_adapter must be the name"):
        engine.add_request("x", SamplingParams(lora_adapter=""))


def test_bad_adapter_options_are_config_errors(checkpoint, tmp_path) -> None:
    """A malformed option is the command's mistake (exit status 2); a folder that is not there, as a missing model
    folder, is the checkpoint's (exit status 1)."""
    base = str(checkpoint("llama"))
    with pytest.raises(CheckpointError, match="is not a folder"):
        EngineConfig(model=base, lora_adapters={"a": str(tmp_path / "missing")}).validate()
    result = CliRunner().invoke(main, ["--model", base, "--lora", f"a={tmp_path / 'missing'}", "generate", "hi"])
    assert result.exit_code == 1 and "is not a folder" in result.output
    with pytest.raises(ConfigError, match="is not a folder's path"):
        EngineConfig(model=base, lora_adapters={"a": 5}).validate()
    with pytest.raises(ConfigError, match="must be 1-64 letters"):
        EngineConfig(model=base, lora_adapters={"a b": str(tmp_path)}).validate()
    with pytest.raises(ConfigError, match="at most 16 LoRA adapters"):
        EngineConfig(model=base, lora_adapters={f"a{i}": str(tmp_path) for i in range(17)}).validate()


def rewrite(adapter: Adapter, folder: Path, config: dict | None = None,
            tensors: Callable[[dict], dict] | None = None) -> Path:
    """A copy of ``adapter``'s files with config keys replaced and tensors transformed."""
    folder.mkdir()
    raw = json.loads((adapter.folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    weights = load_file(adapter.folder / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, folder / "adapter_model.safetensors")
    return folder


def renamed(old: str, new: str) -> Callable[[dict], dict]:
    return lambda weights: {name.replace(old, new): t for name, t in weights.items()}


BAD_ADAPTERS = {
    "dora": ({"use_dora": True}, None, "does not serve DoRA"),
    "bias": ({"bias": "all"}, None, "without biases"),
    "rank": ({"r": 5}, None, "with r = 5 they must be"),
    "rank-zero": ({"r": 0}, None, r"r = 0; it must be an integer in \[1, "),
    "rank-above-the-largest": ({"r": 513}, None, r"r = 513; it must be an integer in \[1, 512\]"),
    "rank-of-one-half": ({}, lambda w: {n: t[:-1].contiguous() if "layers.0.self_attn.q_proj.lora_A" in n else t
                                        for n, t in w.items()}, r"q_proj has lora_A \(3, .* with r = 4 they must be"),
    "rank-pattern": ({"rank_pattern": {"q_proj": 2}}, None, "per-module ranks"),
    "not-lora": ({"peft_type": "IA3"}, None, "LORA adapters only"),
    "pissa": ({"init_lora_weights": "pissa_niter_4"}, None, "path_initial_model_for_weight_conversion"),
    "lm-head": ({}, renamed("model.layers.0.self_attn.q_proj", "lm_head"), "does not serve LoRA on the LM head"),
    "no-such-layer": ({}, renamed("layers.0.", "layers.9."), "'model.layers.9.mlp.down_proj', which is not"),
    "embedding": ({}, renamed("lora_A.weight", "lora_embedding_A"), "unexpected tensor"),
    "half": ({}, lambda w: {n: t for n, t in w.items() if "layers.0.self_attn.q_proj.lora_B" not in n},
             "q_proj has lora_A but not its other half"),
    "shape": ({}, lambda w: {n: t[:, :-1].contiguous() if "q_proj.lora_A" in n else t for n, t in w.items()},
              "was the adapter trained on this base model"),
    "shape-of-b": ({}, lambda w: {n: t[:-1].contiguous() if "q_proj.lora_B" in n else t for n, t in w.items()},
                   r"q_proj has lora_A .* and lora_B \(63, 4\), but the layer maps"),
    "bdlora": ({"use_bdlora": {"target_modules_bd_a": ["o_proj"], "nblocks": 2}}, None, "block-diagonal LoRA"),
    "kasa": ({"kasa_config": {"rank": 4}}, None, r"KaSA adapters \(kasa_config\), which also change the base"),
    "monteclora": ({"monteclora_config": {"n_experts": 2}}, None, r"MonteCLoRA adapters \(monteclora_config\)"),
    "arrow": ({"arrow_config": {"top_k": 2}}, None, r"Arrow-routed adapters \(arrow_config\)"),
    "velora": ({"velora_config": {"rank": 4}}, None, r"VeLoRA adapters \(velora_config\)"),
    "nan-alpha": ({"lora_alpha": float("nan")}, None, "lora_alpha = nan; it must be a finite number"),  # json: NaN
    "negative-alpha": ({"lora_alpha": -1e42}, None, r"holds values up to .*e\+\d+ \(lora_B scaled by -.*\), beyond"),
    "nan": ({}, lambda w: {n: t.index_fill(0, torch.tensor([0]), float("nan")) if "v_proj.lora_B" in n else t
                           for n, t in w.items()}, "v_proj.lora_B.weight holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_adapters_infer_cannot_serve_are_refused_with_the_reason(checkpoint, adapters, tmp_path, case: str) -> None:
    config, tensors, message = BAD_ADAPTERS[case]
    folder = rewrite(adapters["all"], tmp_path / case, config, tensors)
    with pytest.raises(CheckpointError, match=message):
        Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=16,
                            lora_adapters={"bad": str(folder)}))


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_a_peft_adapter_on_the_head_or_the_embeddings_is_refused_with_the_reason(checkpoint, tmp_path, module) -> None:
    """PEFT saves the head's or the embedding's base weight beside its LoRA factors: that tensor was refused as
    one of an unreadable file, not for the reason."""
    adapter = Adapter(checkpoint("llama"), tmp_path / module, ("q_proj", module))
    with pytest.raises(CheckpointError, match=f"does not serve LoRA on the LM head or the input embeddings .*"
                                              f"without {module} in target_modules"):
        engine_for(checkpoint("llama"), {"bad": adapter})


def test_an_adapter_beyond_the_dtypes_range_is_refused(checkpoint, adapters, tmp_path) -> None:
    folder = rewrite(adapters["all"], tmp_path / "huge", None,
                     lambda w: {n: t * 1e5 if "o_proj.lora_B" in n else t for n, t in w.items()})
    with pytest.raises(CheckpointError, match="o_proj holds values up to .* beyond torch.float16's range"):
        Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", dtype="float16", num_kv_blocks=16,
                            lora_adapters={"huge": str(folder)}))
    engine_for(checkpoint("llama"), {"huge": types.SimpleNamespace(folder=folder)})  # float32 holds it


def test_an_adapter_that_overflows_leaves_the_other_tokens_alone(checkpoint, adapters, tmp_path) -> None:
    """float16, an adapter whose weights fit the dtype but whose x @ A overflows: the tokens of other requests in
    its batch, and every token once CUDA graphs run every loaded adapter, keep their outputs (a mask multiplied
    inf by 0 into NaN there)."""
    folder = rewrite(adapters["all"], tmp_path / "loud", None,
                     lambda w: {n: t * 2e4 / t.abs().max() if "layers.0.self_attn.q_proj.lora_A" in n else t
                                for n, t in w.items()})
    base = checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = engine_for(base, {"loud": types.SimpleNamespace(folder=folder), "all": adapters["all"]},
                        dtype="float16", enable_prefix_caching=False)
    alone = engine.generate([PROMPTS[0], PROMPTS[1]], [params, dataclasses.replace(params, lora_adapter="all")])
    beside = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [
        params, dataclasses.replace(params, lora_adapter="all"), dataclasses.replace(params, lora_adapter="loud")])
    engine.runner.lora.tokens.prepare_capture(16)  # as before a capture: every loaded adapter runs in every step
    graphed = engine.generate([PROMPTS[0], PROMPTS[1]], [params, dataclasses.replace(params, lora_adapter="all")])
    for result in (beside[:2], graphed):
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in result] == \
            [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone]


def test_a_pickled_adapter_is_refused_with_the_fix(checkpoint, adapters, tmp_path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapters["all"].folder / "adapter_config.json").read_text())
    (folder / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=16,
                            lora_adapters={"old": str(folder)}))


def register_paged_variant(plugins, name: str, cls: type) -> None:
    """Register ``cls`` (a PagedKVCache subclass, prefix caching on) as the third-party KV cache ``name``."""
    from infer import hookimpl

    @hookimpl
    def register_kv_caches(register):
        register(name, lambda config, n, eviction: cls(n, config.block_size, eviction, True))

    module = types.ModuleType(f"{name}_kv")
    module.register_kv_caches = register_kv_caches  # type: ignore[attr-defined]
    plugins.register(module, source="acme")


def test_a_kv_cache_that_does_not_isolate_adapters_is_refused(checkpoint, adapters, infer_plugins) -> None:
    from infer.plugins.paged_cache import PagedKVCache

    class SharesAcrossAdapters(PagedKVCache):
        isolates_namespaces = False

    register_paged_variant(infer_plugins, "shared", SharesAcrossAdapters)
    with pytest.raises(ConfigError, match="'shared' does not declare isolates_namespaces"):
        Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", num_kv_blocks=16, kv_cache="shared",
                            lora_adapters={"all": str(adapters["all"].folder)}), infer_plugins)


@pytest.mark.parametrize("can", ["reset", "neither"])
def test_unloading_with_a_kv_cache_that_cannot_drop_one_namespace(checkpoint, adapters, infer_plugins, can) -> None:
    """A third-party cache without drop_namespace: the engine empties its whole prefix cache instead, or, if it
    cannot do that either, refuses to unload."""
    from infer.plugins.paged_cache import PagedKVCache

    class Coarse(PagedKVCache):
        def drop_namespace(self, namespace: str) -> bool:
            return False

        def reset_prefix_cache(self) -> bool:
            return can == "reset" and super().reset_prefix_cache()

    register_paged_variant(infer_plugins, "coarse", Coarse)
    engine = Engine(EngineConfig(model=str(checkpoint("llama")), device="cpu", dtype="float32", num_kv_blocks=64,
                                 kv_cache="coarse", lora_adapters={"all": str(adapters["all"].folder)}), infer_plugins)
    prompt, greedy = list(range(200, 240)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], dataclasses.replace(greedy, lora_adapter="all"))
    engine.generate([prompt], greedy)
    if can == "neither":
        with pytest.raises(InvalidRequestError, match="can drop neither the adapter's cached blocks"):
            engine.unload_lora_adapter("all")
        assert engine.lora_adapters == ["all"]
        return
    engine.unload_lora_adapter("all")
    assert engine.lora_adapters == [] and engine.kv.stats().cached_blocks == 0
    assert engine.generate([prompt], greedy)[0].num_cached_tokens == 0


def test_the_cli_serves_adapters_by_name(checkpoint, adapters) -> None:
    base, adapter = checkpoint("llama"), adapters["qv"]
    runner = CliRunner()
    result = runner.invoke(main, ["--model", str(base), "--device", "cpu", "--dtype", "float32", "--lora",
                                  f"qv={adapter.folder}", "generate", "--lora-adapter", "qv", "--max-tokens", "10",
                                  "--temperature", "0", "--ignore-eos", "--json", "x"])
    assert result.exit_code == 0, result.output
    prompt = json.loads(result.output)
    ids = Engine(EngineConfig(model=str(base), device="cpu", num_kv_blocks=16)).tokenize("x")
    assert prompt["token_ids"] == adapter.greedy(ids, 10)[0]
    for args, message in ((["--lora", "qv"], "is not NAME=DIR"),
                          (["--lora", f"a={adapter.folder}", "--lora", f"a={adapter.folder}"], "given twice")):
        result = runner.invoke(main, ["--model", str(base), *args, "generate", "x"])
        assert result.exit_code == 2 and message in result.output
    result = runner.invoke(main, ["--model", str(base), "--device", "cpu", "generate", "--lora-adapter", "qv", "x"])
    assert result.exit_code != 0 and "lora_adapter 'qv' is not loaded" in result.output


def test_the_cli_runs_beam_search_on_the_adapter(checkpoint, adapters) -> None:
    """--lora-adapter reaches beam search too: the beams are the engine's beam search with that adapter."""
    base, adapter = checkpoint("llama"), adapters["qv"]
    result = CliRunner().invoke(main, ["--model", str(base), "--device", "cpu", "--dtype", "float32", "--lora",
                                       f"qv={adapter.folder}", "generate", "--lora-adapter", "qv", "--beam-width",
                                       "2", "--max-tokens", "6", "--ignore-eos", "--json", "x"])
    assert result.exit_code == 0, result.output
    engine = engine_for(base, {"qv": adapter})
    beams = {name: [b.token_ids for b in engine.beam_search(["x"], BeamSearchParams(2, 6, 1.0, True, name))[0].beams]
             for name in ("qv", None)}
    assert beams["qv"] != beams[None]  # the adapter changes the beams, so the test sees whether it was applied
    assert [json.loads(line)["token_ids"] for line in result.stdout.splitlines()] == beams["qv"]


def test_infer_chat_replies_with_the_adapter(chat_model, tmp_path) -> None:
    """The chat command's --lora-adapter reaches every turn: its replies are LLM.chat's with that adapter (whose
    outputs the tests above hold to PEFT's), not the base model's."""
    adapter = Adapter(chat_model, tmp_path / "a", seed=4)
    llm = LLM(model=str(chat_model), device="cpu", dtype="float32", num_kv_blocks=64,
              lora_adapters={"a": adapter.folder})
    turn = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    adapted = llm.chat(turn, dataclasses.replace(params, lora_adapter="a"))[0].outputs[0].text
    assert adapted != llm.chat(turn, params)[0].outputs[0].text
    result = CliRunner().invoke(main, ["--model", str(chat_model), "--dtype", "float32", "--lora",
                                       f"a={adapter.folder}", "chat", "--lora-adapter", "a", "--max-tokens", "6",
                                       "--temperature", "0"], input="hi\n")
    assert result.exit_code == 0 and result.stdout == f"{adapted}\n", result.output
    result = CliRunner().invoke(main, ["--model", str(chat_model), "chat", "--lora-adapter", "a"], input="hi\n")
    assert result.exit_code == 2 and "lora_adapter 'a' is not loaded" in result.output


def test_grpc_requests_pick_adapters_and_model_info_lists_them(checkpoint, adapters, serve_engine) -> None:
    import grpc

    engine = engine_for(checkpoint("llama"), adapters)
    expected = adapters["all"].greedy(PROMPTS[0], 10)[0]

    async def check(client, port) -> None:
        info = await client.model_info()
        assert list(info.lora_adapters) == ["all", "qv"]
        out = await client.complete(PROMPTS[0], max_tokens=10, temperature=0.0, ignore_eos=True, lora_adapter="all")
        assert list(out.outputs[0].token_ids) == expected
        beams = await client.beam_search(PROMPTS[0], beam_width=1, max_tokens=10, ignore_eos=True,
                                         lora_adapter="all")
        assert list(beams.beams[0].token_ids) == expected
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(PROMPTS[0], max_tokens=2, lora_adapter="sql")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora_adapter 'sql' is not loaded" in refused.value.details()

    serve_engine(engine, check)


def test_grpc_loads_and_unloads_adapters_only_where_the_server_allows_it(checkpoint, adapters, serve_engine,
                                                                        monkeypatch) -> None:
    """Also: GetStats, /metrics and `client --stats` count the requests under way per adapter."""
    import grpc

    from infer.plugins.server_commands import stats_dict
    from infer.server.metrics import StatsCollector

    engine = engine_for(checkpoint("llama"), {"all": adapters["all"]}, max_lora_adapters=2, max_lora_rank=8)
    expected = adapters["qv"].greedy(PROMPTS[1], 6)[0]

    async def refused(call, code, message) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == code and message in error.value.details(), error.value.details()

    async def allowed(client, port) -> None:
        assert await client.load_lora_adapter("qv", adapters["qv"].folder) == ["all", "qv"]
        assert list((await client.model_info()).lora_adapters) == ["all", "qv"]
        out = await client.complete(PROMPTS[1], max_tokens=6, temperature=0.0, ignore_eos=True, lora_adapter="qv")
        assert list(out.outputs[0].token_ids) == expected
        stream = client.generate(PROMPTS[1], max_tokens=500, ignore_eos=True, lora_adapter="qv")
        await stream.read()  # under way
        stats = await client.stats()
        assert dict(stats.lora_requests) == {"all": 0, "qv": 1}
        assert json.loads(json.dumps(stats_dict(stats)))["lora_requests"] == {"all": 0, "qv": 1}  # client --stats
        [family] = [f for f in StatsCollector(lambda: stats, lambda: 0).collect() if f.name == "infer_lora_requests"]
        assert [(sample.labels["adapter"], sample.value) for sample in family.samples] == [("all", 0), ("qv", 1)]
        stream.cancel()
        await refused(client.load_lora_adapter("x", adapters["qv"].folder), grpc.StatusCode.FAILED_PRECONDITION,
                      "all 2 adapter slots are taken")
        await refused(client.load_lora_adapter("bad name", adapters["qv"].folder), grpc.StatusCode.INVALID_ARGUMENT,
                      "must be 1-64 letters")
        await refused(client.load_lora_adapter("y", ""), grpc.StatusCode.INVALID_ARGUMENT, "path is required")
        await refused(client.load_lora_adapter("y", adapters["qv"].folder.name), grpc.StatusCode.INVALID_ARGUMENT,
                      "is relative; give the adapter folder's absolute path")
        assert await client.unload_lora_adapter("all") == ["qv"]
        await refused(client.load_lora_adapter("y", adapters["qv"].folder.parent),
                      grpc.StatusCode.FAILED_PRECONDITION, "no adapter_config.json")
        await refused(client.unload_lora_adapter("all"), grpc.StatusCode.INVALID_ARGUMENT, "'all' is not loaded")
        assert list((await client.model_info()).lora_adapters) == ["qv"]
        target = ["--target", f"127.0.0.1:{port}"]
        monkeypatch.chdir(adapters["all"].folder.parent)  # a relative PATH is the command's, sent absolute
        result = await asyncio.to_thread(invoke, "lora", "load", "all", adapters["all"].folder.name, *target)
        assert result.exit_code == 0 and result.output == "loaded all; serving: all, qv\n", result.output
        result = await asyncio.to_thread(invoke, "lora", "unload", "qv", *target)
        assert result.exit_code == 0 and result.output == "unloaded qv; serving: all\n", result.output
        result = await asyncio.to_thread(invoke, "lora", "unload", "qv", *target)
        assert result.exit_code == 1 and "INVALID_ARGUMENT: LoRA adapter 'qv' is not loaded" in result.output
        result = await asyncio.to_thread(invoke, "lora", "load", "qv", *target)
        assert result.exit_code == 2 and "load takes NAME and PATH" in result.output

    serve_engine(engine, allowed, allow_lora_loading=True)

    async def denied(client, port) -> None:
        for call in (client.load_lora_adapter("all", adapters["all"].folder), client.unload_lora_adapter("qv")):
            await refused(call, grpc.StatusCode.PERMISSION_DENIED, "serve --allow-lora-loading")
        assert list((await client.model_info()).lora_adapters) == ["all"]
        result = await asyncio.to_thread(invoke, "lora", "unload", "all", "--target", f"127.0.0.1:{port}")
        assert result.exit_code == 1 and "PERMISSION_DENIED: this server loads no LoRA adapters" in result.output

    serve_engine(engine, denied)


def test_model_info_lists_an_adapter_whose_load_outlived_its_caller(checkpoint, adapters, serve_engine,
                                                                     monkeypatch) -> None:
    """A load runs to its end on the engine thread even when its caller cancels (or its deadline passes) mid-way:
    GetModelInfo went on listing the adapters from before it (the cancelled handler never updated its list)."""
    import grpc

    engine = engine_for(checkpoint("llama"), {"all": adapters["all"]}, max_lora_adapters=2, max_lora_rank=8)
    started, release = threading.Event(), threading.Event()
    load = engine.load_lora_adapter

    def slow_load(name, adapter) -> None:  # a large adapter on a busy machine: the window made wide
        started.set()
        release.wait(10)
        load(name, adapter)

    monkeypatch.setattr(engine, "load_lora_adapter", slow_load)

    async def cancelled(client, port) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.load_lora_adapter("qv", adapters["qv"].folder, timeout=0.5)
        assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and started.is_set()
        await asyncio.sleep(0.2)  # the server's handler is cancelled too
        release.set()
        for _ in range(200):
            if "qv" in (await client.stats()).lora_requests:  # the engine serves it
                break
            await asyncio.sleep(0.05)
        assert list((await client.model_info()).lora_adapters) == ["all", "qv"]

    serve_engine(engine, cancelled, allow_lora_loading=True)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def dequantized_checkpoint(engine: Engine, base: Path, folder: Path) -> Path:
    """``base`` with every linear's weight replaced by what the engine's quantized linear computes (its method
    applied to the identity: exact for weight-only methods), the dense model PEFT is the reference on."""
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    dense = dict(hf.named_modules())
    for module in engine.runner.model.modules():
        if isinstance(module, Linear) and module.prefix != "lm_head":
            with torch.no_grad():
                weight = module.method.apply(module, torch.eye(module.in_features)).t()
            for part, size in module.parts:
                dense[part].weight.data.copy_(weight[:size])
                weight = weight[size:]
    hf.save_pretrained(str(folder))
    return folder


def test_an_adapter_on_an_awq_quantized_base_equals_peft_on_its_dequantized_weights(checkpoint, adapters,
                                                                                    tmp_path) -> None:
    """The QLoRA-style use: an adapter trained on the dense model served over the int4 base. The adapter's delta
    adds to the quantized linears' output as it does to the dense ones' in PEFT."""
    base = checkpoint("llama")
    engine = engine_for(base, adapters, quant="awq", plugin_options={"awq": {"group_size": 32}})
    assert any(isinstance(m, Linear) and m.method.name == "awq" for m in engine.runner.model.modules())
    dense = dequantized_checkpoint(engine, base, tmp_path / "dequantized")
    for name, adapter in adapters.items():
        reference = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32), str(adapter.folder)).eval()
        out = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3,
                                                      lora_adapter=name))
        for prompt, result in zip(PROMPTS, out):
            expected, first = peft_greedy(reference, prompt, 10)
            assert result.outputs[0].token_ids == expected, name
            for token, logprob in result.outputs[0].logprobs[0].items():
                assert logprob == pytest.approx(float(first[token]), abs=1e-4)


def test_adapters_load_and_unload_while_the_engine_runs(checkpoint, adapters, hf_greedy, tmp_path) -> None:
    """Into free slots, between steps, beside running requests; an adapter in use stays; unloading drops its cached
    prefixes, so an adapter loaded later under the same name never gets the old one's KV (the base model's stay)."""
    base = checkpoint("llama")
    engine = engine_for(base, {"all": adapters["all"]}, max_lora_adapters=2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    running = engine.add_request(PROMPTS[0], dataclasses.replace(greedy, lora_adapter="all"))
    first = engine.step()
    engine.load_lora_adapter("qv", adapters["qv"].folder)  # mid-request
    assert engine.lora_adapters == ["all", "qv"]
    names = ["qv", None]
    ids = [engine.add_request(PROMPTS[i + 1], dataclasses.replace(greedy, lora_adapter=n)) for i, n in enumerate(names)]
    with pytest.raises(InvalidRequestError, match=r"'qv' is in use by 1 request\(s\) \(" + ids[0]):
        engine.unload_lora_adapter("qv")
    with pytest.raises(CapacityError, match="all 2 adapter slots are taken; unload one"):
        engine.load_lora_adapter("third", adapters["qv"].folder)
    with pytest.raises(InvalidRequestError, match="'all' is loaded already; unload it first"):
        engine.load_lora_adapter("all", adapters["qv"].folder)
    done: dict[str, list[int]] = {}
    for out in first + drain(engine):  # step() gives each request's new tokens
        done.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert done[running] == adapters["all"].greedy(PROMPTS[0], 8)[0]
    assert done[ids[0]] == adapters["qv"].greedy(PROMPTS[1], 8)[0]
    assert done[ids[1]] == hf_greedy(base, PROMPTS[2], 8)

    prompt = list(range(200, 240))  # two full blocks of 16 get cached
    once = [engine.generate([prompt], dataclasses.replace(greedy, lora_adapter="all"))[0] for _ in range(2)]
    assert once[1].num_cached_tokens == 32
    engine.generate([prompt], greedy)  # the base model's blocks of the same prompt
    engine.unload_lora_adapter("all")
    assert engine.generate([prompt], greedy)[0].num_cached_tokens == 32
    with pytest.raises(InvalidRequestError, match="lora_adapter 'all' is not loaded; the loaded adapters: qv"):
        engine.add_request(prompt, dataclasses.replace(greedy, lora_adapter="all"))
    other = Adapter(base, tmp_path / "other", seed=7)
    engine.load_lora_adapter("all", other.folder)
    again = engine.generate([prompt], dataclasses.replace(greedy, lora_adapter="all"))[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == other.greedy(prompt, 8)[0]
    assert again.outputs[0].token_ids != once[0].outputs[0].token_ids


def drain(engine: Engine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_runtime_loads_that_cannot_be_served_are_refused(checkpoint, adapters) -> None:
    base = checkpoint("llama")
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters; start it with --max-lora-adapters N"):
        Engine(EngineConfig(model=str(base), device="cpu", num_kv_blocks=16)).load_lora_adapter(
            "qv", adapters["qv"].folder)
    llm = LLM(model=str(base), device="cpu", dtype="float32", num_kv_blocks=64, max_lora_adapters=2, max_lora_rank=4)
    engine = llm.engine
    assert engine.lora_adapters == []
    with pytest.raises(CheckpointError, match="has rank 8, above the 4 this engine reserved"):
        engine.load_lora_adapter("qv", adapters["qv"].folder)
    with pytest.raises(InvalidRequestError, match="must be 1-64 letters"):
        engine.load_lora_adapter("../x", adapters["all"].folder)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        engine.load_lora_adapter("x", base)
    with pytest.raises(CheckpointError, match=r"'.*missing' does not exist; give the folder"):
        engine.load_lora_adapter("x", base.parent / "missing")
    with pytest.raises(CheckpointError, match=r"'.*config.json' is not a folder; give the folder"):
        engine.load_lora_adapter("x", base / "config.json")
    with pytest.raises(CheckpointError, match=r"'missing' does not exist \(a relative path, read from /"):
        engine.load_lora_adapter("x", Path("missing"))
    with pytest.raises(CheckpointError, match="cannot read '/aaaa.*': File name too long"):  # was INTERNAL over gRPC
        engine.load_lora_adapter("x", Path("/" + "a" * 5000))
    deep = base.parent / "deep-config"
    deep.mkdir(exist_ok=True)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="adapter_config.json is not readable JSON: maximum recursion depth"):
        engine.load_lora_adapter("x", deep)
    with pytest.raises(InvalidRequestError, match="'x' is not loaded; the loaded adapters: none"):
        engine.unload_lora_adapter("x")
    assert engine.lora_adapters == []  # a refused load takes no slot
    llm.load_lora_adapter("all", adapters["all"].folder)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_adapter="all"))
    assert out[0].outputs[0].token_ids == adapters["all"].greedy(PROMPTS[0], 6)[0]
    llm.unload_lora_adapter("all")
    assert engine.lora_adapters == []
    exact = engine_for(base, {"qv": adapters["qv"]})  # no spare slot: room on q_proj and v_proj only
    exact.unload_lora_adapter("qv")
    with pytest.raises(CheckpointError, match="no adapter loaded at start adapts, so the engine reserved no room"):
        exact.load_lora_adapter("all", adapters["all"].folder)
    with pytest.raises(ConfigError, match=r"max-lora-adapters must be in \[2, 16\]"):
        EngineConfig(model=str(base), lora_adapters={n: str(a.folder) for n, a in adapters.items()},
                     max_lora_adapters=1).validate()
    with pytest.raises(ConfigError, match="max-lora-rank sizes LoRA adapter slots"):
        EngineConfig(model=str(base), max_lora_rank=8).validate()
    small = CliRunner().invoke(main, ["--model", str(base), "--device", "cpu", "--num-kv-blocks", "16",
                                      "--max-lora-rank", "4", "--lora", f"qv={adapters['qv'].folder}", "generate", "x"])
    assert small.exit_code == 2 and "LoRA adapter 'qv' has rank 8, above --max-lora-rank 4; raise --max-lora-rank " \
        "to 8" in small.output, small.output


def test_an_adapter_config_without_lora_alpha_scales_as_peft_reads_it(checkpoint, adapters, tmp_path) -> None:
    """A config without lora_alpha (hand-written, or an older PEFT's): PEFT reads it with LoraConfig's default."""
    base, folder = checkpoint("llama"), rewrite(adapters["all"], tmp_path / "no-alpha")
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    reference = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(folder)).eval()
    engine = engine_for(base, {"no-alpha": types.SimpleNamespace(folder=folder)})
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                                                  lora_adapter="no-alpha"))
    for prompt, result in zip(PROMPTS, out):
        expected, first = peft_greedy(reference, prompt, 6)
        assert result.outputs[0].token_ids == expected
        for token, logprob in result.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(float(first[token]), abs=1e-4)


def test_an_adapter_loaded_into_a_freed_slot_keeps_nothing_of_the_one_before(checkpoint, adapters) -> None:
    """qv (q and v only, rank 8) into the slot all (every projection, rank 4) left, then all into qv's: neither
    gets the other's modules or rank rows."""
    engine = engine_for(checkpoint("llama"), {"all": adapters["all"]}, max_lora_adapters=2)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for old, new in [("all", "qv"), ("qv", "all")]:
        engine.unload_lora_adapter(old)
        engine.load_lora_adapter(new, adapters[new].folder)
        out = engine.generate(PROMPTS, dataclasses.replace(greedy, lora_adapter=new))
        assert tokens(out) == [adapters[new].greedy(prompt, 6)[0] for prompt in PROMPTS], new


def test_an_adapter_read_under_one_name_is_not_loaded_under_another(checkpoint, adapters) -> None:
    from infer.models.lora import read_adapter

    engine = engine_for(checkpoint("llama"), {}, max_lora_adapters=2)
    with pytest.raises(InvalidRequestError, match="the adapter read as 'qv' cannot be loaded as 'other'"):
        engine.load_lora_adapter("other", read_adapter("qv", adapters["qv"].folder))
    assert engine.lora_adapters == []


def test_an_adapter_on_some_parts_of_a_fused_projection_equals_peft(checkpoint, adapters) -> None:
    """No spare slot, so only the adapted modules get room: qv adapts q and v of the merged q/k/v projection."""
    engine = engine_for(checkpoint("llama"), {"qv": adapters["qv"]}, fuse_projections=True)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_adapter="qv"))
    assert tokens(out) == [adapters["qv"].greedy(prompt, 6)[0] for prompt in PROMPTS]


def test_an_adapter_loaded_where_one_overflowed_leaves_no_trace_of_it(checkpoint, adapters, tmp_path) -> None:
    """float16: an adapter loaded into the slot of one whose x @ A overflows, on modules the new one does not adapt,
    equals it loaded into a fresh engine (stale A rows times the new zero B would be inf * 0, NaN)."""
    loud = rewrite(adapters["all"], tmp_path / "loud", None,
                   lambda w: {n: t * 2e4 / t.abs().max() if "layers.0.self_attn.q_proj.lora_A" in n else t
                              for n, t in w.items()})
    v_only = rewrite(adapters["qv"], tmp_path / "v-only", None, lambda w: {n: t for n, t in w.items() if "v_proj" in n})
    base, options = checkpoint("llama"), dict(dtype="float16", enable_prefix_caching=False, max_lora_adapters=2)
    fresh = engine_for(base, {"v": types.SimpleNamespace(folder=v_only)}, **options)
    reused = engine_for(base, {"loud": types.SimpleNamespace(folder=loud)}, **options)
    reused.unload_lora_adapter("loud")
    reused.load_lora_adapter("v", v_only)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, lora_adapter="v")
    want, got = fresh.generate(PROMPTS, params), reused.generate(PROMPTS, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in want]


def test_an_adapter_a_beam_search_uses_is_not_unloaded_until_it_ends(checkpoint, adapters) -> None:
    """A beam search on an adapter is one of its users: unloading it mid-search is refused (its beams' next steps
    would run without it), and allowed once the search is done; the search's one beam is the adapter's greedy."""
    engine = engine_for(checkpoint("llama"), {"all": adapters["all"]})
    search = engine.start_beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True,
                                                                     lora_adapter="all"))
    engine.step()
    with pytest.raises(InvalidRequestError, match=r"'all' is in use by 1 request\(s\) \(a beam search\)"):
        engine.unload_lora_adapter("all")
    while engine.has_unfinished():
        engine.step()
    assert search.result()[0].beams[0].token_ids == adapters["all"].greedy(PROMPTS[0], 6)[0]
    engine.unload_lora_adapter("all")
    assert engine.lora_adapters == []


def test_a_request_waits_only_for_a_prefix_computed_under_its_own_adapter(checkpoint, adapters) -> None:
    """Three requests of one prompt arrive together: the base model's and the adapter's run at once (neither can
    reuse the other's KV); the second under the adapter waits a step for the first's blocks."""
    engine = engine_for(checkpoint("llama"), adapters)
    prompt = list(range(300, 340))
    first_step = []
    schedule = engine.scheduler.schedule

    def observed():  # the scheduler's schedule wrapped for the test's observation only
        out = schedule()
        first_step.append([item.seq.request_id for item in out.scheduled])
        return out

    engine.scheduler.schedule = observed
    for rid, name in (("base", None), ("all", "all"), ("all-again", "all")):
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, lora_adapter=name), request_id=rid)
    engine.step()
    assert first_step == [["base", "all"]]
