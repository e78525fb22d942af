"""The ``triton`` attention backend: registration, the factory's refusal, and forward against dense SDPA."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pluggy  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from infer.core import hookspecs  # noqa: E402
from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import PluginError  # noqa: E402
from infer.core.interfaces import AttentionMetadata  # noqa: E402
from infer.plugins import triton_attention  # noqa: E402

PAGE, NUM_BLOCKS, HEAD_DIM, SCALE = 16, 32, 32, 0.17


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is present, so the Triton interpreter is off; run the backend with -m gpu")
    return torch.device(request.param)


def test_registers_through_pluggy() -> None:
    pm = pluggy.PluginManager("infer")
    pm.add_hookspecs(hookspecs)
    pm.register(triton_attention)
    seen: dict[str, object] = {}
    pm.hook.register_attention_backends(register=lambda name, factory, aliases=(): seen.setdefault(name, factory))
    assert seen == {"triton": triton_attention.create_backend}


def test_factory_refuses_without_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PluginError, match="--attention torch"):
        triton_attention.create_backend(EngineConfig())


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D] are the last L of the C positions of k/v [C, Hkv, D]; causal SDPA in fp32."""
    group, (length, context) = q.shape[1] // k.shape[1], (q.shape[0], k.shape[0])
    mask = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
    k, v = (t.float().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask.to(q.device), scale=scale)
    return out.transpose(0, 1)


CASES = {
    "decode": [(0, 1), (8, 1), (15, 1), (40, 1)],  # (cached tokens, new tokens)
    "mixed": [(0, 12), (20, 1), (16, 5), (3, 1), (17, 17)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_dense_attention(device: torch.device, dtype: torch.dtype, group: int, case: str) -> None:
    torch.manual_seed(group)
    seqs, kv_heads = CASES[case], 2
    context = [c + n for c, n in seqs]
    full_k = [torch.randn(c, kv_heads, HEAD_DIM, dtype=dtype, device=device) for c in context]
    full_v = [torch.randn(c, kv_heads, HEAD_DIM, dtype=dtype, device=device) for c in context]
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    tables = torch.zeros(len(seqs), max(-(-c // PAGE) for c in context), dtype=torch.int32)
    k_cache = torch.zeros(NUM_BLOCKS, PAGE, kv_heads, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots, new_k, new_v = [], [], []
    for i, ((cached, new), ctx) in enumerate(zip(seqs, context, strict=True)):
        need = -(-ctx // PAGE)
        tables[i, :need] = torch.tensor(blocks[:need])
        blocks = blocks[need:]
        pos = torch.arange(ctx)
        seq_slots = (tables[i, pos // PAGE] * PAGE + pos % PAGE).long().to(device)
        page, off = seq_slots[:cached] // PAGE, seq_slots[:cached] % PAGE
        k_cache[page, off], v_cache[page, off] = full_k[i][:cached], full_v[i][:cached]  # the cached prefix
        slots.append(seq_slots[cached:])
        new_k.append(full_k[i][cached:])
        new_v.append(full_v[i][cached:])
    query_lens = [n for _, n in seqs]
    qkv = torch.randn(sum(query_lens), kv_heads * (group + 2), HEAD_DIM, dtype=dtype, device=device)
    q = qkv[:, : kv_heads * group]
    k, v = qkv[:, kv_heads * group: kv_heads * (group + 1)], qkv[:, kv_heads * (group + 1):]
    k.copy_(torch.cat(new_k))
    v.copy_(torch.cat(new_v))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=tables.to(device),
        query_start=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device),
        context_lens=torch.tensor(context, dtype=torch.int32, device=device), query_lens_cpu=query_lens,
        context_lens_cpu=context, block_size=PAGE, max_query_len=max(query_lens), max_context_len=max(context))
    backend = triton_attention.create_backend(EngineConfig(device=device.type))
    meta.backend_data = backend.prepare(meta)
    assert meta.backend_data.all_decode == (case == "decode")
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, SCALE)

    assert out.shape == q.shape and out.dtype == dtype
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    start = 0
    for i, n in enumerate(query_lens):
        ref = dense_reference(q[start:start + n], full_k[i], full_v[i], SCALE)
        torch.testing.assert_close(out[start:start + n].float(), ref, **tol)
        start += n
    flat = meta.slot_mapping
    assert torch.equal(k_cache.view(-1, kv_heads, HEAD_DIM)[flat], k)
    assert torch.equal(v_cache.view(-1, kv_heads, HEAD_DIM)[flat], v)


@pytest.mark.parametrize("name", ["qwen3"])
def test_engine_greedy_with_triton_equals_torch_backend(name: str, checkpoint, device: torch.device) -> None:
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    path = str(checkpoint(name))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 40, 2, 7, 300, 12] * 3, [17, 18], list(range(50, 90))]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=path, device=device.type, attention=backend, num_kv_blocks=64))
        outputs[backend] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
