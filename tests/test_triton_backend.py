"""The ``triton`` attention backend: registration, the factory's refusal, and forward against dense SDPA."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pluggy  # noqa: E402
import pytest  # noqa: E402

from infer.core import hookspecs  # noqa: E402
from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import ConfigError  # noqa: E402
from infer.plugins import attention_backends, triton_attention  # noqa: E402

from conftest import dense_attention, paged_batch  # noqa: E402

PAGE, NUM_BLOCKS, HEAD_DIM, SCALE = 16, 32, 32, 0.17


def test_registers_through_pluggy() -> None:
    pm = pluggy.PluginManager("infer")
    pm.add_hookspecs(hookspecs)
    pm.register(attention_backends)
    seen: dict[str, object] = {}
    pm.hook.register_attention_backends(register=lambda name, factory, aliases=(): seen.setdefault(name, factory))
    assert set(seen) == {"torch", "cpu", "triton"}
    # the factory imports the backend's module only when called (CUDA here, or the interpreter on the CPU)
    assert isinstance(seen["triton"](EngineConfig()), triton_attention.TritonAttentionBackend)


def test_factory_refuses_without_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"drop --attention for the device's default \(cpu on a CPU\), or use "
                                          "--attention cpu or torch"):
        triton_attention.create_backend(EngineConfig())


CASES = {
    "decode": [(0, 1), (8, 1), (15, 1), (40, 1)],  # (cached tokens, new tokens)
    "mixed": [(0, 12), (20, 1), (16, 5), (3, 1), (17, 17)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_dense_attention(device: torch.device, dtype: torch.dtype, group: int, case: str) -> None:
    torch.manual_seed(group)
    batch = paged_batch(CASES[case], 2, group, HEAD_DIM, PAGE, NUM_BLOCKS, dtype, device)
    q, k, v, meta, query_lens, kv_heads = batch.q, batch.k, batch.v, batch.meta, batch.query_lens, 2
    k_cache, v_cache, full_k, full_v = batch.k_cache, batch.v_cache, batch.full_k, batch.full_v
    backend = triton_attention.create_backend(EngineConfig(device=device.type))
    meta.backend_data = backend.prepare(meta)
    assert meta.backend_data.all_decode == (case == "decode")
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, SCALE)

    assert out.shape == q.shape and out.dtype == dtype
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    start = 0
    for i, n in enumerate(query_lens):
        ref = dense_attention(q[start:start + n], full_k[i], full_v[i], SCALE)
        torch.testing.assert_close(out[start:start + n].float(), ref, **tol)
        start += n
    flat = meta.slot_mapping
    assert torch.equal(k_cache.view(-1, kv_heads, HEAD_DIM)[flat], k)
    assert torch.equal(v_cache.view(-1, kv_heads, HEAD_DIM)[flat], v)


@pytest.mark.parametrize("fused", [False, True], ids=["torch-ops", "fused-ops-merged-projections"])
@pytest.mark.parametrize("name", ["qwen3"])
def test_engine_greedy_with_triton_equals_torch_backend(name: str, fused: bool, checkpoint,
                                                        device: torch.device) -> None:
    """The triton arm with the fused Triton ops over merged q/k/v and gate/up outputs (strided views; the CUDA
    defaults) or with the torch ops over separate projections."""
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    path = str(checkpoint(name))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 40, 2, 7, 300, 12] * 3, [17, 18], list(range(50, 90))]
    outputs = {}
    for backend in ("torch", "triton"):
        fusion = dict(fused_ops=fused, fuse_projections=fused) if backend == "triton" else {}
        engine = Engine(EngineConfig(model=path, device=device.type, dtype="float32", attention=backend,
                                     num_kv_blocks=64, **fusion))  # float32: bf16 (the CUDA default) can flip near ties
        outputs[backend] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize(("speculative", "async_scheduling"), [(False, False), (True, False), (False, True)],
                         ids=["decode", "verify", "decode-async-scheduling"])
def test_padded_graph_batches_give_the_plain_tokens(checkpoint, device: torch.device, speculative: bool,
                                                    async_scheduling: bool) -> None:
    """Decode graphs (q = 1) and verification graphs (q = K + 1) over padded static inputs: 3 sequences run in
    graphs of 4. On the CPU the padded forward runs uncaptured (``eager``), which checks the padding itself. With
    async scheduling, the graphs' input ids come from the previous step's tokens on the device."""
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams
    from infer.models.tiny import PRETRAINED_DIR

    options = dict(model=str(checkpoint("llama")), device=device.type, dtype="float32", attention="triton",
                   max_num_seqs=8, num_kv_blocks=96, cuda_graphs=False)
    if speculative:  # the shipped pair: the draft proposes all K tokens, so every sequence verifies K + 1
        options.update(model=str(PRETRAINED_DIR / "target"), proposer="draft-model", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(3)]
    plain = Engine(EngineConfig(**options))
    graphed = Engine(EngineConfig(**options, async_scheduling=async_scheduling))
    graphed.runner.enable_cuda_graphs(4, {4: 4} if speculative else None, eager=device.type == "cpu")
    draft_fits: list[bool] = []
    if speculative:  # the draft's one-token steps and its two-token first step of each later round
        draft_runner = graphed.spec.proposer.runner
        draft_runner.enable_cuda_graphs(4, {2: 4}, eager=device.type == "cpu")
        fits = draft_runner.graphs.fits
        draft_runner.graphs.fits = lambda meta, n: draft_fits.append(fits(meta, n)) or draft_fits[-1]
    expected = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    assert [r.outputs[0].token_ids for r in graphed.generate(prompts, params)] == expected
    replays = graphed.runner.graphs.replays
    assert replays[4] > 0 if speculative else replays[1] > 0 and set(replays) == {1}
    if speculative:  # only the first round (whole prompts) runs uncaptured
        assert draft_fits.count(False) == 1 and draft_runner.graphs.replays[2] > 0


@pytest.mark.parametrize("variant", ["sync", "async-scheduling", pytest.param("fp8-kv", marks=pytest.mark.slow),
                                     pytest.param("speculative", marks=pytest.mark.slow)])
def test_mixed_step_graphs_give_the_plain_tokens(checkpoint, device: torch.device, variant: str) -> None:
    """Prefill chunks beside decodes (chunked prefill, a 24-token budget) replay the mixed graphs of 16 and 24
    tokens (8 rows), padded; the tokens equal the plain engine's, whose steps all run eagerly. Also with an fp8 KV
    cache, and with speculative decoding (verification beside prefill chunks: query lengths K + 1 and others)."""
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams
    from infer.models.tiny import PRETRAINED_DIR

    options = dict(model=str(checkpoint("llama")), device=device.type, dtype="float32", attention="triton",
                   max_num_seqs=8, num_kv_blocks=96, cuda_graphs=False, scheduler="chunked-prefill",
                   max_num_batched_tokens=24)
    if variant == "fp8-kv":
        options.update(kv_cache_dtype="fp8")
    if variant == "speculative":  # the shipped pair, so that the draft proposes and the target verifies
        options.update(model=str(PRETRAINED_DIR / "target"), proposer="draft-model", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 11 * i % 900 + 3] * (2 * i + 3) for i in range(5)]  # 9 to 33 tokens
    expected = [r.outputs[0].token_ids for r in Engine(EngineConfig(**options)).generate(prompts, params)]
    graphed = Engine(EngineConfig(**options, async_scheduling=variant == "async-scheduling"))
    graphed.runner.enable_cuda_graphs(4, eager=device.type == "cpu", mixed_tokens=24, mixed_rows=8)
    assert graphed.runner.mixed_graphs is not None and graphed.runner.mixed_graphs.sizes == [16, 24]
    assert [r.outputs[0].token_ids for r in graphed.generate(prompts, params)] == expected
    assert graphed.runner.mixed_graphs.replays >= 5


def test_running_out_of_memory_while_capturing_names_the_options(checkpoint, device: torch.device,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.core.cuda_graphs import MixedGraphs
    from infer.core.engine import Engine
    from infer.core.errors import ConfigError

    engine = Engine(EngineConfig(model=str(checkpoint("llama")), device=device.type, dtype="float32",
                                 attention="triton", num_kv_blocks=32, cuda_graphs=False))

    def out_of_memory(self: MixedGraphs, pool: object = None) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(MixedGraphs, "capture", out_of_memory)
    with pytest.raises(ConfigError, match="mixed steps of up to 64 tokens.*--cuda-graph-max-tokens"):
        engine.runner.enable_cuda_graphs(4, eager=device.type == "cpu", mixed_tokens=64, mixed_rows=8)
    assert engine.runner.graphs is None and engine.runner.mixed_graphs is None


def test_mixed_token_ladder() -> None:
    from infer.core.cuda_graphs import mixed_token_sizes

    assert mixed_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_token_sizes(100) == [16, 32, 64, 100] and mixed_token_sizes(600) == [16, 32, 64, 128, 256, 512, 600]
    assert mixed_token_sizes(8) == [8]


@pytest.mark.parametrize("k", [1, 3])
def test_draft_round_graphs_draft_what_the_step_by_step_rounds_draft(device: torch.device, k: int) -> None:
    """Whole greedy draft rounds replayed from static buffers (uncaptured on the CPU, CUDA graphs on a GPU): the same
    drafts as the step-by-step path, hence the same acceptance counts (greedy outputs alone would not show a bad
    draft), while rounds that cannot replay (new shadows' prefills, a sampled request) go step by step."""
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams
    from infer.models.tiny import PRETRAINED_DIR

    options = dict(model=str(PRETRAINED_DIR / "target"), device=device.type, dtype="float32", attention="triton",
                   max_num_seqs=8, num_kv_blocks=96, cuda_graphs=False, proposer="draft-model",
                   num_speculative_tokens=k)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(max_tokens=4, temperature=0.8, seed=3)]
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "    for i in range("]
    stepwise, replayed = Engine(EngineConfig(**options)), Engine(EngineConfig(**options))
    replayed.spec.proposer.enable_round_graphs(4, k, eager=device.type == "cpu")
    tokens = [[r.outputs[0].token_ids for r in e.generate(prompts, params)] for e in (stepwise, replayed)]
    assert tokens[0][:2] == tokens[1][:2]
    assert stepwise.spec.proposer.round_graphs is None and replayed.spec.proposer.round_graphs.replays >= 3
    counts = [(e.stats.spec_proposed, e.stats.spec_accepted, e.stats.spec_rounds) for e in (stepwise, replayed)]
    assert counts[0] == counts[1], counts


def test_a_round_with_a_guided_sequence_is_not_replayed(device: torch.device) -> None:
    """Round graphs know nothing of grammars: a round holding a structured sequence goes step by step, so its
    drafts are drawn under the grammar (none refused) and its greedy output is the plain engine's."""
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams, StructuredOutput
    from infer.models.tiny import PRETRAINED_DIR

    options = dict(model=str(PRETRAINED_DIR / "target"), device=device.type, dtype="float32", attention="triton",
                   max_num_seqs=8, num_kv_blocks=96, cuda_graphs=False)
    structured = SamplingParams(max_tokens=10, temperature=0.0, structured_output=StructuredOutput(regex=r"[A-Z]{9}"))
    engine = Engine(EngineConfig(**options, proposer="draft-model", num_speculative_tokens=3,
                                 plugin_options={"spec_decode": {"structured": True}}))
    engine.spec.proposer.enable_round_graphs(4, 3, eager=device.type == "cpu")
    [out] = engine.generate(["x = "], structured)
    assert engine.stats.spec_rounds > 0 and engine.stats.spec_grammar_refused == 0
    assert engine.spec.proposer.round_graphs.replays == 0
    plain = Engine(EngineConfig(**options)).generate(["x = "], structured)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
