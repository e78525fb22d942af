"""Sparse MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers, and the Triton experts against the torch
loop."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CheckpointError, ConfigError
from infer.core.request import SamplingParams
from infer.models.moe import MoeConfig, SparseMoe
from infer.models.tiny import make_tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def moe_model(folder, arch: str, num_layers: int = 2, extra: dict | None = None, **edits):
    """A tiny MoE checkpoint HF built with ``extra`` in its config, whose config.json then says ``edits``."""
    path = make_tiny_model(folder, arch, num_layers=num_layers, max_position_embeddings=128, extra=extra)
    if edits:
        config = json.loads((path / "config.json").read_text())
        config.update(edits)
        (path / "config.json").write_text(json.dumps(config))
    return path


def edit_tensors(path, edit) -> None:
    """Rewrite ``path``'s model.safetensors after ``edit`` (a function of the name -> tensor dict) changed it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# a dense first layer (mlp_only_layers) and experts every second layer; top-k probabilities left unscaled
MIXED = {"mlp_only_layers": [0], "decoder_sparse_step": 2, "norm_topk_prob": False}
SLOW = pytest.mark.slow  # the interpreted Triton experts take about 25 s a model: one runs by default


@pytest.mark.parametrize(("arch", "edits", "fused"), [
    pytest.param("mixtral", {}, False, id="mixtral-torch"), pytest.param("mixtral", {}, True, id="mixtral-triton"),
    pytest.param("qwen3moe", {}, False, id="qwen3moe-torch"),
    pytest.param("qwen3moe", {}, True, id="qwen3moe-triton", marks=SLOW),
    pytest.param("qwen3moe", MIXED, False, id="mixed-torch"),
    pytest.param("qwen3moe", MIXED, True, id="mixed-triton", marks=SLOW),
    # Qwen2-MoE: a shared expert beside the routed ones, gated by a sigmoid; q/k/v biases as qkv_bias says
    pytest.param("qwen2moe", {}, False, id="qwen2moe-torch"),
    pytest.param("qwen2moe", {**MIXED, "qkv_bias": False}, True, id="qwen2moe-mixed-triton", marks=SLOW),
    pytest.param("qwen2moe", {**MIXED, "qkv_bias": False}, False, id="qwen2moe-mixed-torch"),
])
def test_moe_models_generate_what_hf_generates(tmp_path, hf_greedy, arch, edits, fused):
    """A batch of prompts (prefills and decodes routed together): greedy tokens equal HF's, last-token logits
    within 1e-4; the torch experts loop and the Triton grouped GEMMs (interpreted on the CPU)."""
    from transformers import AutoModelForCausalLM

    if fused and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton experts run on the CPU under TRITON_INTERPRET=1 only")
    path = moe_model(tmp_path / "m", arch, num_layers=3 if edits else 2, extra=edits)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, fused_ops=fused))
    layers = engine.loaded.model.model.layers
    sparse = [isinstance(layer.ffn(), SparseMoe) for layer in layers]
    assert sparse == ([False, True, False] if edits else [True, True])
    # the loop syncs with the host: on CUDA the engine refuses graphs for it by name (ModelSpec.graph_blocker)
    assert (engine.loaded.model.spec.graph_blocker is None) == fused
    batch = prompts(engine.loaded.model.spec.vocab_size, [7, 40, 19])
    for prompt, result in zip(batch, engine.generate(batch, GREEDY)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)
    engine.add_request(batch[1], SamplingParams(max_tokens=1, temperature=0.0))
    _, logits = engine.runner.execute(engine.scheduler.schedule(), engine.kv)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(
            torch.tensor([batch[1]])).logits[0, -1]
    assert (logits[0] - ref).norm() / ref.norm() < 1e-4


def test_qwen2_moes_sliding_layers_are_hfs(tmp_path, hf_greedy):
    """With use_sliding_window and no layer_types, HF's Qwen2-MoE slides in the even layers below
    max_window_layers (Qwen2's rule is the layers from it on)."""
    path = moe_model(tmp_path / "m", "qwen2moe", num_layers=3, extra={
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert [layer.self_attn.window for layer in engine.loaded.model.model.layers] == [8, None, None]
    prompt = prompts(engine.loaded.model.spec.vocab_size, [30], seed=5)[0]
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("use", [False, True])
def test_qwen3_moe_slides_only_with_use_sliding_window(tmp_path, hf_greedy, use: bool) -> None:
    """HF's Qwen3MoeConfig drops sliding_window unless use_sliding_window is set; with it every layer slides."""
    path = moe_model(tmp_path / "m", "qwen3moe", use_sliding_window=use, sliding_window=8)  # as config.json says
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(path)).sliding_window == (8 if use else None)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert [layer.self_attn.window for layer in engine.loaded.model.model.layers] == [8 if use else None] * 2
    prompt = prompts(engine.loaded.model.spec.vocab_size, [30], seed=5)[0]
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_the_routing_weights_multiply_in_the_dtype_transformers_uses(arch):
    """In bfloat16 Mixtral's block multiplies the experts' outputs by float32 routing weights, Qwen3-MoE's by weights
    rounded to bfloat16 first (the two differ in the last bit of many outputs): the torch experts loop equals
    transformers' sparse block bit for bit, its config read by ArchConfig."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from infer.models.layers import silu_and_mul
    from infer.models.llama import ArchConfig

    sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
             "num_experts_per_tok": 2}
    if arch == "mixtral":
        hf_config = MixtralConfig(**sizes, intermediate_size=48, num_local_experts=4)
        block_class, architecture = MixtralSparseMoeBlock, "MixtralForCausalLM"
    else:
        hf_config = Qwen3MoeConfig(**sizes, moe_intermediate_size=48, num_experts=4, norm_topk_prob=True)
        block_class, architecture = Qwen3MoeSparseMoeBlock, "Qwen3MoeForCausalLM"
    moe = ArchConfig.from_hf({**hf_config.to_dict(), "architectures": [architecture]}).moe
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf = block_class(hf_config).eval()
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        hf = hf.to(torch.bfloat16)
    block = SparseMoe(moe, 32, torch.bfloat16, silu_and_mul, fused=False)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
    block.load_expert("mlp", "gate_up_proj", hf.experts.gate_up_proj.detach())
    block.load_expert("mlp", "down_proj", hf.experts.down_proj.detach())
    x = torch.randn(1, 24, 32, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(block(x[0]), hf(x)[0])


def reference_experts(x, w13, w2, weights, experts):
    """Token by token, straight from the definition: sum over k of w x down(silu(gate x) * up x)."""
    size = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), experts[t]):
            h = w13[e].double() @ x[t].double()
            out[t] += w * (w2[e].double() @ (torch.nn.functional.silu(h[:size]) * h[size:]))
    return out


# bf16 on CUDA only (-m gpu): the Triton interpreter's tl.dot multiplies bf16's raw bits (triton-lang/triton#11584)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 8, 2), (5, 4, 3), (37, 8, 2), (20, 3, 1), (0, 4, 2)])
def test_triton_experts_equal_the_definition(device, dtype, tokens, num_experts, top_k):
    """Padding rows, experts no token chose, blocks of several tokens, k up to 3, no token at all: the grouped GEMMs
    against a float64 reference (fp16: within its rounding), and the torch loop too (float32)."""
    from infer.kernels.fused_moe import fused_experts, sort_by_expert

    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter has no bf16 dot (triton-lang/triton#11584): bf16 runs on CUDA only")
    gen = torch.Generator().manual_seed(tokens)
    hidden, size = 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * size, hidden, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden, size, generator=gen) * 0.2
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    x, w13, w2 = (t.to(dtype) for t in (x, w13, w2))
    ref = reference_experts(x, w13, w2, weights, experts)
    got = fused_experts(x.to(device), w13.to(device), w2.to(device), weights.to(device, dtype), experts.to(device))
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol, rtol=tol)
    if dtype != torch.float32:
        return
    moe = MoeConfig(num_experts, top_k, size, False, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    block = SparseMoe(moe, hidden, torch.float32, lambda g, u: torch.nn.functional.silu(g) * u, fused=False)
    block.w13.copy_(w13)
    block.w2.copy_(w2)
    torch.testing.assert_close(block.experts_loop(x, weights, experts).double(), ref, atol=1e-5, rtol=1e-5)
    rows, block_expert = sort_by_expert(experts.to(device), num_experts, block_m=4)
    rows, block_expert = rows.cpu(), block_expert.cpu()
    flat = experts.flatten()
    real = rows[rows < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))  # every pair once
    for b, e in enumerate(block_expert.tolist()):  # a block's pairs are all its expert's
        chunk = rows[4 * b:4 * b + 4]
        chunk = chunk[chunk < tokens * top_k]
        assert (e == -1) == (len(chunk) == 0) and all(flat[chunk] == e)


def awq_stack(weights: torch.Tensor, group: int):
    """[E, out, in] float -> the experts' AwqExperts (RTN at ``group``) and their dequantized weights [E, out, in]."""
    from infer.kernels.awq_moe import AwqExperts
    from infer.quant import awq

    packed = [awq.quantize_rtn(w, group) for w in weights]
    stacked = AwqExperts(*(torch.stack([p[i] for p in packed]) for i in range(3)), group)
    dense = torch.stack([awq.dequantize(*p, group, dtype=torch.float32).t() for p in packed])
    return stacked, dense


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "group", "hidden", "size"), [
    (1, 8, 2, 32, 64, 64), (20, 3, 1, 64, 64, 64), (0, 4, 2, 32, 64, 64),
    (9, 5, 3, 128, 256, 128),  # most checkpoints' group: two K blocks of 64 per group
    (37, 4, 3, -1, 72, 40)])  # one group over K; K and N not multiples of the blocks
def test_triton_awq_experts_equal_the_definition(device, dtype, tokens, num_experts, top_k, group, hidden, size):
    """The int4 grouped GEMMs against the float64 definition on the dequantized weights and, in float32, against
    the torch loop over each expert's AWQ Linears."""
    from infer.kernels.awq_moe import AwqExperts, fused_awq_experts
    from infer.quant.awq_method import AwqLinearMethod

    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter has no bf16 dot (triton-lang/triton#11584): bf16 runs on CUDA only")
    gen = torch.Generator().manual_seed(tokens + group)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate, up, down = (awq_stack(torch.randn(num_experts, *shape, generator=gen) * 0.2, group)
                      for shape in ((size, hidden), (size, hidden), (hidden, size)))
    # gate's packed output columns, then up's: the stacking SparseMoe does after loading
    w13 = AwqExperts(*(torch.cat([g, u], dim=2) for g, u in zip(gate[0][:3], up[0][:3])), group)
    dense13, (w2, dense2) = torch.cat([gate[1], up[1]], dim=1), down
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    ref = reference_experts(x, dense13.to(dtype), dense2.to(dtype), weights, experts)
    on = [AwqExperts(*(t.to(device) for t in w[:3]), w.group_size) for w in (w13, w2)]
    got = fused_awq_experts(x.to(device), *on, weights.to(device, dtype), experts.to(device))
    # float32: sums of up to 256 + 128 products in another order than the reference's, each off by up to about
    # (their count) x 2^-24 of the magnitudes summed (1.6e-5 seen on one CPU with a bound of 1e-5)
    tol = {torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert got.dtype == dtype  # within the dtype's rounding of the intermediate activations, at their scale
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol * max([1.0, *ref.abs().flatten().tolist()]), rtol=tol)
    if dtype != torch.float32:
        return
    moe = MoeConfig(num_experts, top_k, size, False, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    block = SparseMoe(moe, hidden, torch.float32, lambda g, u: torch.nn.functional.silu(g) * u, fused=False,
                      linear_quant=AwqLinearMethod(group), prefix="mlp")
    for e, expert in enumerate(block.experts):
        for name, (packed, _) in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
            for attr, tensor in zip(("qweight", "qzeros", "scales"), packed):
                expert.get_submodule(name).load(attr, tensor[e])
    torch.testing.assert_close(got.cpu(), block.experts_loop(x, weights, experts), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("tokens", "group"), [(7, 32), (33, 128)])
def test_triton_awq_experts_gather_each_experts_input_order(device, dtype, tokens, group):
    """GPTQ experts in activation order: expert e's weight row k multiplies input column order[e, k] (w13's of the
    hidden state, w2's of the activations), against the float64 definition with each row put back in its place."""
    from infer.kernels.awq_moe import AwqExperts, fused_awq_experts

    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter has no bf16 dot (triton-lang/triton#11584): bf16 runs on CUDA only")
    num_experts, top_k, hidden, size = 4, 2, 256, 128
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate, up, down = (awq_stack(torch.randn(num_experts, *shape, generator=gen) * 0.2, group)
                      for shape in ((size, hidden), (size, hidden), (hidden, size)))
    order13, order2 = (torch.stack([torch.randperm(n, generator=gen) for _ in range(num_experts)])
                       for n in (hidden, size))

    def placed(dense: torch.Tensor, order: torch.Tensor) -> torch.Tensor:  # row k of expert e at input order[e, k]
        out = torch.empty_like(dense)
        for e in range(dense.shape[0]):
            out[e][:, order[e]] = dense[e]
        return out

    w13 = AwqExperts(*(torch.cat([g, u], dim=2) for g, u in zip(gate[0][:3], up[0][:3])), group, order13)
    w2 = AwqExperts(*down[0][:3], group, order2)
    dense13, dense2 = placed(torch.cat([gate[1], up[1]], dim=1), order13), placed(down[1], order2)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    ref = reference_experts(x, dense13.to(dtype), dense2.to(dtype), weights, experts)
    on = [AwqExperts(*(t.to(device) for t in w[:3]), w.group_size, w.input_order.to(device)) for w in (w13, w2)]
    got = fused_awq_experts(x.to(device), *on, weights.to(device, dtype), experts.to(device))
    tol = {torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol * max([1.0, *ref.abs().flatten().tolist()]), rtol=tol)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("tokens", "group", "ordered"), [(7, 32, False), (33, 128, True), (0, 64, False),
                                                          (12, -1, True)])
def test_triton_w8a16_experts_equal_the_definition(device, dtype, tokens, group, ordered):
    """8-bit experts (GPTQ, compressed-tensors W8A16): uint8 codes over the whole range, zero points and fp16 scales
    per group, in activation order or not, against the float64 definition on the dequantized weights
    ``(q - z) * s``, each expert's row k placed at its input column order[e, k]."""
    from infer.kernels.w8a16_moe import W8A16Experts, fused_w8a16_experts

    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter has no bf16 dot (triton-lang/triton#11584): bf16 runs on CUDA only")
    num_experts, top_k, hidden, size = 4, 2, 256, 128
    gen = torch.Generator().manual_seed(tokens + group)

    def experts_of(k: int, n: int, order: torch.Tensor | None) -> tuple[W8A16Experts, torch.Tensor]:
        """[E, K, N] codes (expert e's row k meets input order[e, k]) and the weight [E, N, K] they stand for."""
        g = k if group == -1 else group
        q = torch.randint(0, 256, (num_experts, k, n), generator=gen, dtype=torch.uint8)
        z = torch.randint(96, 160, (num_experts, k // g, n), generator=gen, dtype=torch.uint8)
        s = (torch.rand(num_experts, k // g, n, generator=gen) * 2e-3 + 1e-4).half()
        dense = (q.double() - z.double().repeat_interleave(g, dim=1)) * s.double().repeat_interleave(g, dim=1)
        placed = torch.empty_like(dense)
        for e in range(num_experts):
            placed[e][order[e] if ordered else slice(None)] = dense[e]
        return W8A16Experts(q, z, s, group, order), placed.transpose(1, 2)

    def orders(k: int) -> torch.Tensor | None:
        return torch.stack([torch.randperm(k, generator=gen) for _ in range(num_experts)]) if ordered else None

    order13 = orders(hidden)  # gate and up read the same input: one order per expert, as GPTQ gives them
    (gate, dense_gate), (up, dense_up) = experts_of(hidden, size, order13), experts_of(hidden, size, order13)
    w2, dense2 = experts_of(size, hidden, orders(size))
    w13 = W8A16Experts(torch.cat([gate.qweight, up.qweight], dim=2), torch.cat([gate.qzeros, up.qzeros], dim=2),
                       torch.cat([gate.scales, up.scales], dim=2), group, gate.input_order)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    ref = reference_experts(x, torch.cat([dense_gate, dense_up], dim=1).to(dtype), dense2.to(dtype), weights, experts)
    on = [W8A16Experts(*(t.to(device) for t in w[:3]), w.group_size,
                       w.input_order.to(device) if w.input_order is not None else None) for w in (w13, w2)]
    got = fused_w8a16_experts(x.to(device), *on, weights.to(device, dtype), experts.to(device))
    tol = {torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol * max([1.0, *ref.abs().flatten().tolist()]), rtol=tol)


def test_float32_routing_weights_round_each_pair_before_the_sum_as_hf_does(device):
    """Mixtral's routing weights are float32: HF (and experts_loop) round each pair's weighted output to the model
    dtype before adding it up (index_add_), so the fused experts do too; summing the pairs in float32 and rounding
    once agreed with the loop on about 2 in 3 fp16 values."""
    from infer.kernels.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(3)
    tokens, num_experts, top_k, hidden, size = 40, 4, 2, 32, 24
    x = torch.randn(tokens, hidden, generator=gen).half()
    w13 = (torch.randn(num_experts, 2 * size, hidden, generator=gen) * 0.2).half()
    w2 = (torch.randn(num_experts, hidden, size, generator=gen) * 0.2).half()
    weights, experts = torch.topk(torch.softmax(torch.randn(tokens, num_experts, generator=gen), -1), top_k, dim=-1)
    moe = MoeConfig(num_experts, top_k, size, False, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))
    block = SparseMoe(moe, hidden, torch.float16, lambda g, u: torch.nn.functional.silu(g) * u, fused=False)
    block.w13.copy_(w13)
    block.w2.copy_(w2)
    loop = block.experts_loop(x, weights, experts)
    got = fused_experts(x.to(device), w13.to(device), w2.to(device), weights.to(device), experts.to(device)).cpu()
    assert got.dtype == torch.float16 and (got == loop).float().mean() > 0.99


@pytest.mark.parametrize("kind", ["float", "awq"])
def test_grouped_gemms_round_each_experts_output_before_its_routing_weight(device, kind):
    """fp16: each pair's expert output is rounded to fp16 (as the expert's Linear returns it) and only then multiplied
    by the pair's routing weight, as the torch loop does: equal but for fp32 summation order (rounding once instead,
    after the weight, matches about 72%)."""
    from infer.kernels.awq_moe import grouped_awq_gemm
    from infer.kernels.fused_moe import grouped_gemm, sort_by_expert

    gen = torch.Generator().manual_seed(21)
    tokens, num_experts, top_k, k, n = 12, 4, 2, 64, 64
    pairs = tokens * top_k
    a = torch.randn(pairs, k, generator=gen).half()  # a_row_div 1: one row of a per (token, k) pair
    experts = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    scale = torch.rand(pairs, generator=gen).half()
    rows, block_expert = sort_by_expert(experts.to(device), num_experts)
    on = {"device": device}
    if kind == "float":
        w = (torch.randn(num_experts, n, k, generator=gen) * 0.2).half()
        dense = w.float()
        got = grouped_gemm(a.to(**on), w.to(**on), rows, block_expert, pairs, 1, scale.to(**on))
    else:
        from infer.kernels.awq_moe import AwqExperts

        stacked, dense = awq_stack(torch.randn(num_experts, n, k, generator=gen) * 0.2, 32)
        w = AwqExperts(*(t.to(**on) for t in stacked[:3]), 32)
        got = grouped_awq_gemm(a.to(**on), w, rows, block_expert, pairs, 1, scale.to(**on))
    expert_out = torch.stack([a[r].float() @ dense[e].t() for r, e in enumerate(experts.flatten().tolist())])
    want = (expert_out.half().float() * scale.float()[:, None]).half()
    assert got.dtype == torch.float16
    assert (got.cpu() == want).float().mean() > 0.97


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_checkpoints_as_transformers_5_writes_them_load(tmp_path, hf_greedy, arch):
    """transformers 5's own layout (save_original_format=False: stacked experts.gate_up_proj and down_proj, Mixtral's
    under mlp), num_experts for num_local_experts, and HF's class default rope_theta (Mixtral's 1e6): HF's tokens."""
    import shutil

    from transformers import AutoModelForCausalLM

    path = moe_model(tmp_path / "m", arch)
    stacked = tmp_path / "stacked"
    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).save_pretrained(
        str(stacked), save_original_format=False)
    for file in path.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            shutil.copy(file, stacked / file.name)
    from safetensors import safe_open

    with safe_open(str(stacked / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    config = json.loads((stacked / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    config.pop("rope_theta", None)
    config.get("rope_parameters", {}).pop("rope_theta", None)
    (stacked / "config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model=str(stacked), device="cpu", num_kv_blocks=64))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [30], seed=4)[0]
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(stacked, prompt, GREEDY.max_tokens)


def test_moe_refusals_name_the_cause(tmp_path):
    bad = moe_model(tmp_path / "k", "mixtral", num_experts_per_tok=5)
    with pytest.raises(CheckpointError, match="routes each token to 5 experts .num_experts_per_tok. of 4"):
        Engine(EngineConfig(model=str(bad), device="cpu", num_kv_blocks=16))
    short = moe_model(tmp_path / "s", "qwen3moe")
    edit_tensors(short, lambda tensors: tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"checkpoint is missing 1 tensors, e\.g\. "
                                              r"\['model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'\]"):
        Engine(EngineConfig(model=str(short), device="cpu", num_kv_blocks=16))
    fewer = moe_model(tmp_path / "e", "mixtral", num_local_experts=3)  # the checkpoint holds 4
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.block_sparse_moe\.experts\.3\."
                                              r"w1\.weight': experts hold w1, w3 and w2 weights, one set per expert "
                                              r"0\.\.2, .*\(config\.json says 3 experts: is that right\?\)"):
        Engine(EngineConfig(model=str(fewer), device="cpu", num_kv_blocks=16))
    gated = moe_model(tmp_path / "g", "qwen2moe", num_layers=1)  # a router quantized by tooling that ignored it
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    edit_tensors(gated, lambda tensors: tensors.update({name: tensors[name].to(torch.float8_e4m3fn),
                                                        name + "_scale": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"shared_expert_gate\.weight (\(float8_e4m3fn\)|_scale).*quantized "
                                              r"the router model\.layers\.0\.mlp\.shared_expert_gate, which infer "
                                              "loads in float only"):
        Engine(EngineConfig(model=str(gated), device="cpu", num_kv_blocks=16))



def test_a_checkpoint_holding_an_expert_in_both_layouts_is_refused(tmp_path) -> None:
    """Per-expert tensors beside transformers 5's stacked down_proj of the same experts: whichever comes second
    would overwrite the first, so the checkpoint is refused (HF's loader takes one layout or the other)."""
    path = moe_model(tmp_path / "m", "qwen3moe")

    def add_stacked(tensors: dict[str, torch.Tensor]) -> None:
        prefix = "model.layers.0.mlp.experts."
        count = len({name for name in tensors if name.startswith(prefix) and name.endswith(".down_proj.weight")})
        tensors[prefix + "down_proj"] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(count)])

    edit_tensors(path, add_stacked)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.(\d+\.)?down_proj(\.weight)? holds "
                                              "expert weights that another tensor of the checkpoint held too"):
        Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16))

# ---------------------------------------------------------------- AWQ experts (each expert's Linears)
AWQ_MOE = {"mixtral": {}, "qwen2moe": {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}}


def awq_linear_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The tensors --quant awq converts: every linear's weight (experts', shared expert's, attention's), not the
    routers (mlp.gate, shared_expert_gate), the norms, the embedding or the head."""
    return [name for name, t in tensors.items() if t.dim() == 2 and name.endswith("proj.weight")
            or ".experts." in name]


def rtn_copies(src, folder, group: int = 64, not_convert: list[str] | None = None):
    """(an AutoAWQ GEMM checkpoint of ``src``: each converted weight packed by round-to-nearest at ``group``, but
    those of modules with a ``not_convert`` name in theirs (AutoAWQ's rule), and the float checkpoint of its
    dequantized weights: the model both compute)."""
    from safetensors.torch import load_file, save_file

    from infer.quant import awq

    packed, dense = folder / "packed", folder / "dense"
    for copy in (packed, dense):
        shutil.copytree(src, copy)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in awq_linear_weights(tensors):
        if any(skip in name.removesuffix(".weight") for skip in not_convert or ()):
            continue
        owner = name.removesuffix(".weight")
        qweight, qzeros, scales = awq.quantize_rtn(tensors[name], group)
        del quantized[name]
        quantized.update({f"{owner}.qweight": qweight, f"{owner}.qzeros": qzeros, f"{owner}.scales": scales})
        dequantized[name] = awq.dequantize(qweight, qzeros, scales, group, dtype=torch.float32).t().contiguous()
    save_file(quantized, str(packed / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dense / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": not_convert}
    (packed / "config.json").write_text(json.dumps(config))
    return packed, dense


@pytest.mark.parametrize("arch", list(AWQ_MOE))
def test_awq_experts_generate_what_hf_generates_on_their_dequantized_weights(tmp_path, hf_greedy, arch):
    """An AWQ MoE checkpoint as AutoAWQ writes one (experts, shared expert and attention packed, but modules named
    like "gate": Qwen2-MoE's gate_proj stays float) and --quant awq on the float one (per expert, and as
    transformers 5 stacks the experts): each is HF's model on its dequantized weights, token for token; the experts
    stay packed (int4) in memory, and spare LoRA slots (every other linear takes adapters) leave them alone."""
    from transformers import AutoModelForCausalLM

    path = moe_model(tmp_path / "m", arch, extra=AWQ_MOE[arch])
    packed, dense_packed = rtn_copies(path, tmp_path / "autoawq", not_convert=["gate"])
    _, dense = rtn_copies(path, tmp_path / "rtn")
    stacked = tmp_path / "stacked"
    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).save_pretrained(
        str(stacked), save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, stacked / name)
    on_load = {"quant": "awq", "plugin_options": {"awq": {"group_size": 64}}}
    batch = prompts(1024, [5, 19], seed=3)
    for model, options, reference in ((packed, {"max_lora_adapters": 1}, dense_packed), (path, on_load, dense),
                                      (stacked, on_load, dense)):
        engine = Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=32, **options))
        block = engine.loaded.model.model.layers[0].ffn()
        # the torch loop: AutoAWQ's Qwen2-MoE for its float gate_proj, the others for the fused ops off (the CPU)
        why = "projections are all int4 (AWQ, GPTQ) or all 8-bit" if model == packed and arch == "qwen2moe" else \
            "without the fused Triton ops (the CUDA default) runs its experts by the torch loop"
        assert why in str(engine.loaded.model.spec.graph_blocker)
        assert block.w13 is None and block.experts[1].get_submodule(block.moe.projections[2]).qweight.dtype == \
            torch.int32
        for prompt, result in zip(batch, engine.generate(batch, GREEDY)):
            assert result.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)
        if "max_lora_adapters" in options:  # a batch with an adapter's request runs the deltas of every linear
            from infer.models.lora import LoraAdapter

            q_proj = "model.layers.0.self_attn.q_proj"
            engine.load_lora_adapter("a", LoraAdapter("a", 2, 1.0, {q_proj: (torch.ones(2, 64), torch.ones(64, 2))}))
            adapted = dataclasses.replace(GREEDY, lora_adapter="a")
            outputs = engine.generate(batch, [adapted, GREEDY])
            assert outputs[1].outputs[0].token_ids == hf_greedy(reference, batch[1], GREEDY.max_tokens)
            expert = f"model.layers.0.{block.moe.block}.experts.0.{block.moe.projections[2]}"  # sees routed rows only
            with pytest.raises(CheckpointError, match=f"has weights for '{expert}', which is not a linear layer"):
                engine.load_lora_adapter("b", LoraAdapter("b", 2, 1.0, {expert: (torch.ones(2, 64),
                                                                                   torch.ones(64, 2))}))


def test_stacked_awq_experts_equal_their_linears(tmp_path, monkeypatch):
    """With the fused Triton ops (the CUDA default; interpreted here) int4 AWQ experts, packed (Mixtral) or quantized
    on load (Qwen2-MoE), are stacked after loading for the grouped W4A16 GEMMs, which CUDA graphs capture: a layer's
    output equals the torch loop over the experts' Linears, and no expert's Linears outlive its layer's stacking
    (else loading would hold the experts twice). AutoAWQ's Qwen2-MoE, whose gate_proj stays float, keeps the loop,
    which graphs refuse by name (--no-fused-ops or not)."""
    import weakref

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton experts run on the CPU under TRITON_INTERPRET=1 only")
    packed, _ = rtn_copies(moe_model(tmp_path / "mixtral", "mixtral", num_layers=1), tmp_path / "mixtral-awq")
    qwen = moe_model(tmp_path / "qwen", "qwen2moe", num_layers=1, extra=AWQ_MOE["qwen2moe"])
    on_load = {"quant": "awq", "plugin_options": {"awq": {"group_size": 64}}}
    live_after_stacking = []
    stack = SparseMoe.stack_quantized

    def counted(block):
        linears = [weakref.ref(linear) for expert in block.experts for linear in expert.children()]
        stack(block)
        live_after_stacking.append(sum(ref() is not None for ref in linears))

    monkeypatch.setattr(SparseMoe, "stack_quantized", counted)
    for model, options in ((packed, {}), (qwen, on_load)):
        blocks = []
        for fused in (False, True):
            engine = Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=16, fused_ops=fused, **options))
            blocks.append(engine.loaded.model.model.layers[0].ffn())
            blocker = engine.loaded.model.spec.graph_blocker
            assert blocker is None if fused else "with --no-fused-ops runs its experts by the torch loop" in blocker
        loop, stacked = blocks
        count, hidden = stacked.gate.weight.shape
        assert stacked.experts is None and stacked.w13_qweight.dtype == torch.int32
        assert stacked.w13_qweight.shape == (count, hidden, 2 * stacked.moe.intermediate_size // 8)
        x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(count))
        torch.testing.assert_close(stacked(x), loop(x), atol=1e-5, rtol=1e-5)
    assert live_after_stacking == [0, 0]
    autoawq, _ = rtn_copies(qwen, tmp_path / "qwen-awq", not_convert=["gate"])
    for fused in (True, False):
        engine = Engine(EngineConfig(model=str(autoawq), device="cpu", num_kv_blocks=16, fused_ops=fused))
        assert "projections are all int4 (AWQ, GPTQ) or all 8-bit" in str(engine.loaded.model.spec.graph_blocker)
        assert engine.loaded.model.model.layers[0].ffn().experts is not None


def test_awq_experts_refuse_what_they_cannot_load(tmp_path):
    from infer.models.layers import UnquantizedMethod
    from infer.models.moe import experts_quant

    # --skinny-gemm-rows' unquantized method keeps the stacked (fused) experts
    assert experts_quant(UnquantizedMethod(8), "model.layers.0.mlp.experts", MoeConfig(
        4, 2, 64, True, True, "mlp", ("gate_proj", "up_proj", "down_proj"), (True,))) is None
    packed, _ = rtn_copies(moe_model(tmp_path / "m", "mixtral", num_layers=1), tmp_path)
    edit_tensors(packed, lambda tensors: tensors.pop("model.layers.0.block_sparse_moe.experts.2.w3.qzeros"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors, e\.g\. \['model\.layers\.0\.block_sparse_moe\."
                                              r"experts\.2\.w3\.qzeros'\]"):
        Engine(EngineConfig(model=str(packed), device="cpu", num_kv_blocks=16))


@pytest.mark.gpu
def test_awq_experts_on_cuda_equal_hf_on_their_dequantized_weights(tmp_path, hf_greedy):
    """On a GPU int4 experts run the grouped W4A16 GEMMs inside CUDA graphs (the default); AutoAWQ's Qwen2-MoE,
    whose gate_proj stays float, runs each expert's Linears (the Triton W4A16 GEMM up to 64 rows) without graphs,
    which cannot capture the torch loop and are refused by name."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    batch = prompts(1024, [5, 19], seed=3)
    mixtral, dense_mixtral = rtn_copies(moe_model(tmp_path / "mixtral", "mixtral"), tmp_path / "mixtral-awq")
    qwen = moe_model(tmp_path / "m", "qwen2moe", extra=AWQ_MOE["qwen2moe"])
    qwen, dense_qwen = rtn_copies(qwen, tmp_path / "qwen-awq", not_convert=["gate"])
    with pytest.raises(ConfigError, match="runs its quantized experts by the torch loop .* add --no-cuda-graphs"):
        Engine(EngineConfig(model=str(qwen), device="cuda", num_kv_blocks=32))
    for model, dense, graphs in ((mixtral, dense_mixtral, True), (qwen, dense_qwen, False)):
        engine = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", num_kv_blocks=32,
                                     cuda_graphs=graphs))
        assert (engine.runner.graphs is not None) == graphs
        for prompt, result in zip(batch, engine.generate(batch, GREEDY)):
            assert result.outputs[0].token_ids == hf_greedy(dense, prompt, GREEDY.max_tokens)


@pytest.mark.gpu
def test_moe_on_cuda_with_graphs_generates_what_hf_generates(tmp_path, hf_greedy):
    """The Triton experts inside CUDA graphs (the CUDA default): float32 greedy tokens equal HF's on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = moe_model(tmp_path / "m", "qwen3moe")
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64))
    assert engine.runner.graphs is not None and all(
        layer.ffn().fused for layer in engine.loaded.model.model.layers)
    batch = prompts(engine.loaded.model.spec.vocab_size, [7, 40, 19], seed=1)
    for prompt, result in zip(batch, engine.generate(batch, GREEDY)):
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize(("arch", "targets"), [
    ("qwen3moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("qwen2moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]),  # the MLP's: the shared expert's
])
def test_a_lora_adapter_on_a_moe_model_equals_peft(tmp_path, arch, targets):
    """Adapters on the attention of Qwen3-MoE, on Qwen2-MoE's shared expert: PEFT's greedy tokens."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = moe_model(tmp_path / "base", arch)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                    target_modules=targets)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "adapter"))
    engine = Engine(EngineConfig(model=str(base), device="cpu", num_kv_blocks=64,
                                 lora_adapters={"a": str(tmp_path / "adapter")}))
    prompt = prompts(engine.loaded.model.spec.vocab_size, [25], seed=2)[0]
    got = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   lora_adapter="a"))[0].outputs[0].token_ids
    ids, expected = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(10):
            expected.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[expected[-1]]])], 1)
    assert got == expected
    plain = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != expected  # the adapter changes them


def test_qwen2_moe_projects_q_k_v_with_biases_unless_its_config_says_not() -> None:
    """Qwen2-MoE's q/k/v have biases (transformers' Qwen2MoeConfig: qkv_bias=True by default), also in a
    config.json written before the key existed; qkv_bias false drops them. o_proj never has one."""
    from transformers import Qwen2MoeConfig

    from infer.models.llama import ArchConfig

    base = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}
    assert Qwen2MoeConfig().qkv_bias is True
    specs = [ArchConfig.from_hf({**base, **flag}) for flag in ({}, {"qkv_bias": True}, {"qkv_bias": False})]
    assert [(s.attention_bias, s.o_proj_bias) for s in specs] == [(True, False), (True, False), (False, False)]
