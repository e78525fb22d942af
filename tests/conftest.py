"""Shared fixtures: tiny checkpoints come from infer.testing (the pytest11 plugin); HF reference helpers here."""
from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from infer.core.interfaces import AttentionMetadata

try:  # transformers >= 5.25 imports the `kernels` package (its hub kernels); take it now, while nothing can shadow it:
    # once the first test runs, pytest puts a checkout whose folder name is no identifier on sys.path itself, and
    # there infer's own kernels/ folder would pass for it
    importlib.import_module("kernels")
except ImportError:
    pass


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
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    # (1 + w) norms around both sublayers, GELU, a scaled embedding; sliding layers (window 8) with their own rope
    "gemma3": ("gemma3", {"tie_word_embeddings": True, "num_layers": 4}),
    # Gemma 2: no q/k norm, one rope, every second layer sliding, attention scores and logits softcapped
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "num_layers": 4}),
}


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where a Triton kernel's test runs: the CPU under TRITON_INTERPRET=1 (the default run), and CUDA under -m gpu
    (a test that parametrizes ``device`` itself overrides this)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is present, so the Triton interpreter is off; run the Triton tests with -m gpu")
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def unfrozen_heap() -> Iterator[None]:
    """Engines built with freeze_gc (bench arms, `serve`) freeze the heap; the next test starts unfrozen, so that
    this process's garbage stays collectable."""
    yield
    gc.unfreeze()


@pytest.fixture
def mem_available() -> int:
    """Linux's MemAvailable in bytes, read here apart from the engine's own reading; skips where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pytest.skip("no MemAvailable in /proc/meminfo on this system")


@pytest.fixture(scope="session")
def checkpoint(tiny_model_factory: Callable[..., Path]) -> Callable[[str], Path]:
    def get(name: str) -> Path:
        arch, kwargs = CHECKPOINTS[name]
        return tiny_model_factory(arch, **kwargs)

    return get


# a ChatML-like template that refuses unknown roles, as real templates do
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``tiny_model`` whose tokenizer adds BOS to every encoding and whose config has CHAT_TEMPLATE: a
    chat renderer that tokenized with special tokens would put two BOS in front."""
    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    bos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|bos|>")
    start = {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [start, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [start, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [bos], "tokens": ["<|bos|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="session")
def thinking_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with <think> and </think> as tokens of their own (as Qwen3's and DeepSeek-R1's tokenizers
    have them), their embeddings added by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("thinking")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)  # the new rows are drawn at random
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


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


@pytest.fixture(scope="session")
def hf_hidden_states() -> Callable[[Path, list[int]], torch.Tensor]:
    """HF transformers' final hidden states of one prompt (``AutoModel``'s ``last_hidden_state``: the backbone's,
    after its last norm), float32 on CPU: the reference of embeddings. Each checkpoint loads once."""
    from transformers import AutoModel

    models: dict[Path, torch.nn.Module] = {}

    def run(path: Path, prompt: list[int]) -> torch.Tensor:
        if path not in models:
            models[path] = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            return models[path](torch.tensor([prompt])).last_hidden_state[0].float()

    return run


def tutorial_plugins(marker: str, name: str) -> Any:
    """A PluginManager with the shipped plugins and docs/writing-a-plugin.md's python example that holds
    ``marker``, executed as a plugin module registered as ``name``: the tutorial runs as written."""
    import re
    import types

    from infer.core.plugins import PluginManager

    text = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md").read_text()
    [code] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if marker in block]
    module = types.ModuleType(f"{name}_example")
    exec(compile(code, "writing-a-plugin.md", "exec"), module.__dict__)
    plugins = PluginManager.from_entry_points()
    plugins.register(module, name=name, source="tutorial")
    return plugins


def loaded_linear(method: Any, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                  prefix: str = "model.layers.0.mlp.up_proj") -> Any:
    """A Linear of quant ``method`` at ``prefix`` that loaded checkpoint ``tensors`` (by attribute name) and was
    processed after loading, as the model loader does it."""
    from infer.models.layers import Linear

    linear = Linear(in_features, out_features, False, prefix, method, torch.float32)
    for name, tensor in tensors.items():
        linear.load(name, tensor)
    method.process_after_loading(linear)
    return linear


def recomputed_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """A transformers model's greedy continuation of ``prompt``, the whole sequence run at every step, without a
    cache (for a model whose forward a test hooks, or whose inputs are a multimodal model's text)."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([out[-1:]])], dim=1)
    return out


@dataclass
class PagedBatch:
    """A mixed attention batch over a paged cache (see :func:`paged_batch`)."""

    q: torch.Tensor  # [T, Hkv * group, D], a strided view, as a fused qkv projection gives
    k: torch.Tensor  # [T, Hkv, D] this step's new keys (not yet in the cache)
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page, Hkv, D] holding every sequence's cached prefix
    v_cache: torch.Tensor
    meta: AttentionMetadata
    query_lens: list[int]
    full_k: list[torch.Tensor]  # per sequence, every key of its context [C, Hkv, D]: the dense reference's input
    full_v: list[torch.Tensor]


def paged_batch(seqs: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int, page: int, num_blocks: int,
                dtype: torch.dtype, device: torch.device) -> PagedBatch:
    """Sequences given as (cached tokens, new tokens), their blocks in random order across the pool."""
    context = [c + n for c, n in seqs]
    full_k = [torch.randn(c, kv_heads, head_dim, dtype=dtype, device=device) for c in context]
    full_v = [torch.randn(c, kv_heads, head_dim, dtype=dtype, device=device) for c in context]
    blocks = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seqs), max(-(-c // page) for c in context), dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots, new_k, new_v = [], [], []
    for i, ((cached, _), ctx) in enumerate(zip(seqs, context, strict=True)):
        need = -(-ctx // page)
        tables[i, :need] = torch.tensor(blocks[:need])
        blocks = blocks[need:]
        pos = torch.arange(ctx)
        seq_slots = (tables[i, pos // page] * page + pos % page).long().to(device)
        block, offset = seq_slots[:cached] // page, seq_slots[:cached] % page
        k_cache[block, offset], v_cache[block, offset] = full_k[i][:cached], full_v[i][:cached]  # the cached prefix
        slots.append(seq_slots[cached:])
        new_k.append(full_k[i][cached:])
        new_v.append(full_v[i][cached:])
    query_lens = [n for _, n in seqs]
    qkv = torch.randn(sum(query_lens), kv_heads * (group + 2), head_dim, dtype=dtype, device=device)
    q = qkv[:, : kv_heads * group]
    k, v = qkv[:, kv_heads * group : kv_heads * (group + 1)], qkv[:, kv_heads * (group + 1) :]
    k.copy_(torch.cat(new_k))
    v.copy_(torch.cat(new_v))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=tables.to(device),
        query_start=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device),
        context_lens=torch.tensor(context, dtype=torch.int32, device=device), query_lens_cpu=query_lens,
        context_lens_cpu=context, block_size=page, max_query_len=max(query_lens), max_context_len=max(context))
    return PagedBatch(q, k, v, k_cache, v_cache, meta, query_lens, full_k, full_v)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D] are the last L of the C positions of k/v [C, Hkv, D]; causal SDPA in fp32."""
    group, (length, context) = q.shape[1] // k.shape[1], (q.shape[0], k.shape[0])
    mask = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
    k, v = (t.float().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask.to(q.device), scale=scale)
    return out.transpose(0, 1)


@pytest.fixture(scope="session")
def serve_engine() -> Callable[..., None]:
    """``serve_engine(engine, test, **options)``: run ``await test(client, port)`` against an in-process `infer
    serve` of ``engine`` with those ServeOptions (an AsyncClient connected to it), then close the server."""
    import asyncio

    def run(engine: object, test: Callable[..., object], **options: object) -> None:
        pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking")
        from infer.server.app import InferenceServer, ServeOptions
        from infer.server.client import AsyncClient

        async def main() -> None:
            serve_options = ServeOptions(port=0, grace_period_s=0.0, **options)  # type: ignore[arg-type]
            server = InferenceServer(engine, serve_options)
            port = await server.start()
            try:
                async with AsyncClient(f"127.0.0.1:{port}") as client:
                    await test(client, port)  # type: ignore[misc]
            finally:
                await server.close(grace=0.0)

        asyncio.run(main())

    return run


class LoopThread:
    """An event loop on a thread of its own, for in-process servers that a test's blocking clients (the openai
    client, a CLI run, gRPC's sync client) call from the main thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 60) -> Any:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextmanager
def serving(engine: Any, loops: LoopThread, **options: Any) -> Iterator[Any]:
    """``engine`` behind an in-process `infer serve` (an InferenceServer on free ports, no grace period, ``options``
    over those ServeOptions) running on ``loops``; closed at the end."""
    from infer.server.app import InferenceServer, ServeOptions

    server = InferenceServer(engine, ServeOptions(**{"port": 0, "grace_period_s": 0.0, **options}))
    try:
        loops.call(server.start())
        yield server
    finally:
        loops.call(server.close(grace=0.0))


def random_adapter(model: Path, out: Path) -> Path:
    """A PEFT LoRA adapter of ``model`` (q and v projections) with random weights, its B matrices too, so that it
    changes the output; saved to ``out``."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    adapted.save_pretrained(str(out))
    return out
