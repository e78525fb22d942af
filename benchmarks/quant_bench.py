"""Quantization on one CUDA GPU: AWQ and FP8 against bf16 on a Llama-3.2-1B-shaped model with random weights.

Figures, one JSON line each, then a table:

- ``awq_decode``: single-stream decode, AWQ (int4 RTN on load, group 128: the fused W4A16 kernel and the same
  layout a calibrated checkpoint has) vs bf16. ``step_ms`` is one CUDA-graph decode step replayed alone (GPU time);
  ``tpot_ms`` is the engine's time per output token, host work included. ``awq_decode_lm_head``: the same with
  ``awq.lm_head=true`` (the tied 128,256 x 2,048 head in int4 too: a batch-1 step reads about 0.65 GB instead of 1.03).
- ``fp8_throughput``: decode at each batch of ``--batch`` (>= 64; default 128), FP8 W8A8 (``torch._scaled_mm``)
  vs bf16, same two views; ``fp8_throughput_lm_head`` at the first batch: the same with ``fp8.lm_head=true``.
- ``awq_gemm`` / ``awq_crossover``: the 1B's merged qkv, gate_up and down GEMMs for M in 1..256, fused W4A16
  kernel and dequantize+matmul vs a bf16 matmul, each timed from a CUDA graph over weight replicas larger than L2;
  the crossover is the smallest M from which bf16 is at least as fast as the faster AWQ path. The same rows time
  FP8 W8A8 as the ``fp8`` method runs it and its ``_scaled_mm`` alone (the first run's FP8 step was 0.80x bf16's),
  ``bf16_linear`` (F.linear on the [N, K] weight: the engine's call), ``fp8_block`` (a block-wise FP8 checkpoint's
  linear: per-token-group quantization and kernels/fp8_block.py's GEMM, 128 x 128 blocks; untuned) and, for
  M <= 16, kernels/skinny_gemm.py.
- ``awq_sweep`` (with ``--awq-sweep``): the fused kernel at M = 1 and 16 on the same shapes for each block_n x
  block_k x split_k of AWQ_SWEEP (split "auto" is the kernel's own choice; ``splits`` is what launched), then one
  ``awq_sweep_best`` row per shape and M: the fastest configuration beside the defaults and bf16. Alone,
  ``--awq-sweep --skip decode fp8 gemm kv``, it takes well under a minute (mostly Triton compiles). The same flag
  sweeps the skinny bf16 GEMM's block_n x block_k x num_stages (SKINNY_SWEEP; ``skinny_sweep`` rows) against
  cuBLAS: whether the engine should use it at small batches (cuBLAS reached ~2/3 of copy bandwidth at M = 1).
- ``fp8_kv_capacity``: KV blocks and concurrent sequences at a fixed ``--kv-gb``, fp8 vs bf16 KV: the capacity the
  block count gives, and the peak of running sequences seen on a burst of requests.

Run from the repository root: ``python benchmarks/quant_bench.py`` (about 3 minutes on an H200).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kernel_bench import graph_ms_per_call, time_ms  # the sibling script's CUDA-event and CUDA-graph timers

# (K, N) of the 1B's GEMMs as the engine runs them on CUDA (q/k/v and gate/up merged); the first GPU run (2026-11-30)
# timed "gate_up" as one 2048 x 8192 projection
GEMM_SHAPES = {"qkv": (2048, 3072), "gate_up": (2048, 16384), "down": (8192, 2048)}
GEMM_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
L2_BYTES = 256 << 20  # weight replicas per timed round: far above the 50 MB L2
AWQ_SWEEP = {"block_n": (64, 128, 256), "block_k": (64, 128), "split_k": (None, 4, 8, 16, 32)}  # None: auto
SKINNY_SWEEP = {"block_n": (16, 32, 64), "block_k": (128, 256, 512), "num_stages": (3, 4)}
SWEEP_ROWS = (1, 16)


@dataclass(frozen=True)
class ModelShape:
    """Llama-3.2-1B."""

    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 8192
    vocab_size: int = 128256


def write_model(folder: Path, shape: ModelShape, seed: int = 0) -> Path:
    """config.json, bf16 random weights (std 0.02, tied embeddings) and a small local tokenizer in ``folder``."""
    from safetensors.torch import save_file

    from infer.models.tiny import stdlib_corpus, train_tokenizer

    tokenizer = train_tokenizer(folder, 1024, stdlib_corpus(max_files=20))
    head_dim = shape.hidden_size // shape.num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": head_dim, "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(seed)
    h, kv, inter = shape.hidden_size, shape.num_kv_heads * head_dim, shape.intermediate_size

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=g, device=g.device) * 0.02).to(torch.bfloat16).cpu()

    state = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": torch.ones(h).bfloat16()}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        state.update({
            f"{p}.self_attn.q_proj.weight": rand(h, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, h),
            f"{p}.mlp.gate_proj.weight": rand(inter, h), f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter), f"{p}.input_layernorm.weight": torch.ones(h).bfloat16(),
            f"{p}.post_attention_layernorm.weight": torch.ones(h).bfloat16()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def emit(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(row), flush=True)
    return row


# ---------------------------------------------------------------- engine-level decode
def decode_figures(model: Path, batch: int, prompt_len: int, new_tokens: int, **options: Any) -> dict[str, float]:
    """Decode of ``batch`` sequences: engine time per output token, and one decode step's CUDA-graph replay."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    engine = Engine(EngineConfig(model=str(model), max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 8,
                                 max_num_batched_tokens=max(8192, batch * prompt_len), kv_cache_memory_gb=8.0,
                                 enable_prefix_caching=False,
                                 **options))
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, 1000, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    def seconds(tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    seconds(4)  # warm-up: Triton compiles, caches fill
    seconds(1)  # and a prefill-only run: its first run on the GPU (2026-11-30) held a one-off cost of ~0.3 s,
    # which made (full - prefill_only) smaller than the decode steps' own replay time
    prefill_only = seconds(1)
    full = seconds(new_tokens + 1)
    tpot_ms = (full - prefill_only) / new_tokens * 1e3
    graphs = engine.runner.graphs
    # graphs are keyed by (batch size, query length); a decode step is query length 1
    size = next((s for s, q in sorted(graphs.graphs) if q == 1 and s >= batch), None) if graphs is not None else None
    step_ms = time_ms(lambda _: graphs.graphs[size, 1][0].replay(), 50) if size is not None else float("nan")
    result = {"tpot_ms": round(tpot_ms, 3), "tok_per_s": round(batch * 1e3 / tpot_ms, 1),
              "step_ms": round(step_ms, 4)}
    del engine
    release()
    return result


def release() -> None:
    """Free a dropped engine's weights, KV pool and graphs (reference cycles included) before the next one."""
    gc.collect()
    torch.cuda.empty_cache()


def compare(figure: str, base: dict[str, float], quant: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
    return emit({"figure": figure, **extra, "bf16": base, "quant": quant,
                 "speedup_tokens": round(base["tpot_ms"] / quant["tpot_ms"], 3),
                 "speedup_step": round(base["step_ms"] / quant["step_ms"], 3)})


# ---------------------------------------------------------------- GEMM micro-benchmark
def weight_replicas(k: int, n: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]],
                                             list[tuple[torch.Tensor, torch.Tensor]]]:
    """A random bf16 weight [K, N], its int4 RTN quantization (group 128) and its per-channel FP8 one, each
    copied until the copies of one timed round exceed L2: (bf16 [K, N], (qweight, qzeros, scales), (fp8 [N, K],
    scales [N]))."""
    from infer.quant import awq, fp8

    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qweight, qzeros, scales = awq.quantize_rtn(dense, 128)
    w_fp8, w_scale = fp8.quantize_weight_per_channel(dense)
    copies = max(2, min(16, math.ceil(L2_BYTES / dense.numel() / 2)))
    return ([dense.t().contiguous().clone() for _ in range(copies)],
            [(qweight.clone(), qzeros.clone(), scales.clone()) for _ in range(copies)],
            [(w_fp8.clone(), w_scale.clone()) for _ in range(copies)])


def gemm_rows(k: int, n: int, rows: tuple[int, ...], replays: int) -> list[dict[str, Any]]:
    """Per M, microseconds per call: bf16 matmul; fused W4A16 kernel and dequantize+matmul (the Triton dequantize
    kernel the engine runs above fused_max_rows, and the torch ops it ran before); FP8 W8A8 as the
    ``fp8`` method runs it (per-token activation quantization, then ``torch._scaled_mm`` with row-wise scales),
    and the ``_scaled_mm`` alone on an already quantized input (the rest is the quantization's cost); W8A16 (8-bit
    GPTQ and compressed-tensors checkpoints): the fused kernel and dequantize+matmul, group 128."""
    from infer.kernels.awq_gemm import awq_dequantize, awq_gemm
    from infer.kernels.w8a16_gemm import w8a16_dequantize, w8a16_gemm
    from infer.kernels.fp8 import per_token_quant
    from infer.kernels.fp8_block import per_token_group_quant, w8a8_block_gemm
    from infer.kernels.skinny_gemm import MAX_ROWS, skinny_gemm
    from infer.quant import awq
    from infer.quant.fp8_method import scaled_mm

    w_bf16, w_awq, w_fp8 = weight_replicas(k, n)
    copies = len(w_bf16)
    w_linear = [w.t().contiguous() for w in w_bf16]  # [N, K], as nn.Linear stores it
    # block-wise FP8 (DeepSeek-V3 / Qwen3 FP8 checkpoints): the per-channel codes with 128 x 128 block scales
    w_block = [(w, torch.rand(n // 128, k // 128, device="cuda") * 1e-3) for w, _ in w_fp8]
    w_int8 = [(torch.randint(0, 256, (k, n), dtype=torch.uint8, device="cuda"),
               torch.randint(0, 256, (k // 128, n), dtype=torch.uint8, device="cuda"),
               torch.rand(k // 128, n, device="cuda", dtype=torch.float16) * 1e-3) for _ in range(copies)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, x_scale = per_token_quant(x)
        timers: dict[str, Callable[[int], object]] = {
            "bf16": lambda i: x @ w_bf16[i % copies],
            "bf16_linear": lambda i: torch.nn.functional.linear(x, w_linear[i % copies]),  # the engine's call
            **({"skinny": lambda i: skinny_gemm(x, w_linear[i % copies], num_sms=sms)} if m <= MAX_ROWS else {}),
            "awq_fused": lambda i: awq_gemm(x, *w_awq[i % copies], 128),
            "awq_dequant": lambda i: x @ awq_dequantize(*w_awq[i % copies], 128, torch.bfloat16),  # the engine's
            "awq_dequant_torch": lambda i: x @ awq.dequantize(*w_awq[i % copies], 128, dtype=torch.bfloat16),
            "w8a16_fused": lambda i: w8a16_gemm(x, *w_int8[i % copies], 128),
            "w8a16_dequant": lambda i: x @ w8a16_dequantize(*w_int8[i % copies], 128, torch.bfloat16),
            "fp8_w8a8": lambda i: scaled_mm(*per_token_quant(x), *w_fp8[i % copies], torch.bfloat16),
            "fp8_scaled_mm": lambda i: scaled_mm(xq, x_scale, *w_fp8[i % copies], torch.bfloat16),
            "fp8_block": lambda i: w8a8_block_gemm(*per_token_group_quant(x, 128), *w_block[i % copies], (128, 128),
                                                   torch.bfloat16),
        }
        row = {name: round(graph_ms_per_call(fn, copies, replays) * 1e3, 2) for name, fn in timers.items()}
        out.append({"M": m, **row})
    return out


def awq_sweep(k: int, n: int, rows: tuple[int, ...], replays: int) -> list[dict[str, Any]]:
    """Per M and configuration of AWQ_SWEEP: the fused kernel's microseconds per call (``default``: the kernel's
    own choice of all three), with bf16 matmul's beside it."""
    import triton

    from infer.kernels.awq_gemm import auto_split_k, awq_gemm

    w_bf16, w_awq, _ = weight_replicas(k, n)
    copies, sms = len(w_bf16), torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = round(graph_ms_per_call(lambda i: x @ w_bf16[i % copies], copies, replays) * 1e3, 2)
        default = round(graph_ms_per_call(lambda i: awq_gemm(x, *w_awq[i % copies], 128), copies, replays) * 1e3, 2)
        for bn, bk, split in itertools.product(*AWQ_SWEEP.values()):
            asked = split or auto_split_k(m, triton.cdiv(m, 16) * triton.cdiv(n, bn), k, bk, sms)  # block_m 16
            splits = triton.cdiv(k, triton.cdiv(triton.cdiv(k, asked), bk) * bk)  # awq_gemm's whole K blocks

            def fused(i: int, bn: int = bn, bk: int = bk, split: int | None = split) -> torch.Tensor:
                return awq_gemm(x, *w_awq[i % copies], 128, block_n=bn, block_k=bk, split_k=split)

            us = round(graph_ms_per_call(fused, copies, replays) * 1e3, 2)
            out.append({"M": m, "block_n": bn, "block_k": bk, "split_k": split or "auto", "splits": splits,
                        "awq_fused": us, "default": default, "bf16": bf16})
    return out


def skinny_sweep(k: int, n: int, rows: tuple[int, ...], replays: int) -> list[dict[str, Any]]:
    """Per M and configuration of SKINNY_SWEEP: kernels/skinny_gemm.py's microseconds per call, with the engine's
    bf16 call (F.linear on an [N, K] weight, cuBLAS) beside it."""
    from infer.kernels.skinny_gemm import skinny_gemm

    w_linear = [w.t().contiguous() for w in weight_replicas(k, n)[0]]
    copies = len(w_linear)
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        linear = graph_ms_per_call(lambda i: torch.nn.functional.linear(x, w_linear[i % copies]), copies, replays)
        for bn, bk, stages in itertools.product(*SKINNY_SWEEP.values()):
            def run(i: int, bn: int = bn, bk: int = bk, stages: int = stages) -> torch.Tensor:
                return skinny_gemm(x, w_linear[i % copies], block_n=bn, block_k=bk, num_stages=stages)

            us = round(graph_ms_per_call(run, copies, replays) * 1e3, 2)
            out.append({"M": m, "block_n": bn, "block_k": bk, "num_stages": stages, "skinny": us,
                        "bf16_linear": round(linear * 1e3, 2)})
    return out


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """Smallest M from which bf16 is at least as fast as the faster AWQ path at every larger measured M."""
    worse = [r["M"] for r in rows if min(r["awq_fused"], r["awq_dequant"]) >= r["bf16"]]
    for r in rows:
        if all(o["M"] in worse for o in rows if o["M"] >= r["M"]):
            return int(r["M"])
    return None


# ---------------------------------------------------------------- fp8 KV capacity
def kv_capacity(model: Path, kv_gb: float, seq_tokens: int, kv_dtype: str) -> dict[str, Any]:
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    engine = Engine(EngineConfig(model=str(model), kv_cache_memory_gb=kv_gb, kv_cache_dtype=kv_dtype,
                                 max_num_seqs=1024, max_model_len=seq_tokens + 16, cuda_graphs=False,
                                 enable_prefix_caching=False, max_num_batched_tokens=32768))
    per_seq = math.ceil(seq_tokens / engine.config.block_size)
    capacity = engine.num_blocks // per_seq
    new = 8
    for i in range(int(capacity * 1.5) + 8):  # more than fit: the scheduler admits what the blocks allow
        engine.add_request([10 + (i + j) % 900 for j in range(seq_tokens - new)],
                           SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.scheduler.num_running())
    result = {"kv_dtype": kv_dtype, "blocks": engine.num_blocks, "capacity": capacity, "peak_running": peak}
    del engine
    release()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[128],
                        help="batches of the FP8 throughput figure (each >= 64)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-gb", type=float, default=2.0, help="KV budget of the capacity figure (GiB)")
    parser.add_argument("--kv-seq-tokens", type=int, default=1024, help="tokens per sequence in the capacity figure")
    parser.add_argument("--replays", type=int, default=20, help="CUDA-graph replays per GEMM timing")
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "fp8", "gemm", "kv"])
    parser.add_argument("--awq-sweep", action="store_true",
                        help="also time the fused AWQ kernel over AWQ_SWEEP's tiles and split-K, and the skinny "
                             "bf16 GEMM over SKINNY_SWEEP's, at M = 1 and 16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_bench needs a CUDA GPU (the AWQ/FP8 kernels and torch._scaled_mm run there); none is visible. "
              "On CPU the quant methods dequantize, so there is nothing to time.", file=sys.stderr)
        return 2
    if min(args.batch) < 64:
        parser.error("--batch must be >= 64 (the FP8 throughput figure is defined at large batch)")
    props = torch.cuda.get_device_properties(0)
    emit({"figure": "setup", "device": props.name, "torch": torch.__version__, "model": asdict(ModelShape()),
          **{k: v for k, v in vars(args).items() if k != "skip"}})
    summary: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="quant-bench-") as tmp:
        model = write_model(Path(tmp), ModelShape()) if {"decode", "fp8", "kv"} - set(args.skip) else Path(tmp)
        if "decode" not in args.skip:
            base = decode_figures(model, 1, args.prompt_len, args.new_tokens)
            awq = decode_figures(model, 1, args.prompt_len, args.new_tokens, quant="awq")
            row = compare("awq_decode", base, awq, {"batch": 1})
            summary.append(("AWQ decode, batch 1 (tok/s)", str(base["tok_per_s"]), str(awq["tok_per_s"]),
                            f"{row['speedup_tokens']}x (step {row['speedup_step']}x; target 2.5x)"))
            head = decode_figures(model, 1, args.prompt_len, args.new_tokens, quant="awq",
                                  plugin_options={"awq": {"lm_head": True}})
            row = compare("awq_decode_lm_head", base, head, {"batch": 1})
            summary.append(("AWQ + int4 head, batch 1 (tok/s)", str(base["tok_per_s"]), str(head["tok_per_s"]),
                            f"{row['speedup_tokens']}x (step {row['speedup_step']}x; target 2.5x)"))
        for batch in args.batch if "fp8" not in args.skip else ():
            base = decode_figures(model, batch, args.prompt_len, args.new_tokens)
            fp8 = decode_figures(model, batch, args.prompt_len, args.new_tokens, quant="fp8")
            row = compare("fp8_throughput", base, fp8, {"batch": batch})
            summary.append((f"FP8 decode, batch {batch} (tok/s)", str(base["tok_per_s"]), str(fp8["tok_per_s"]),
                            f"{row['speedup_tokens']}x (step {row['speedup_step']}x; target 1.5x)"))
            if batch == args.batch[0]:
                head = decode_figures(model, batch, args.prompt_len, args.new_tokens, quant="fp8",
                                      plugin_options={"fp8": {"lm_head": True}})
                row = compare("fp8_throughput_lm_head", base, head, {"batch": batch})
                summary.append((f"FP8 + fp8 head, batch {batch} (tok/s)", str(base["tok_per_s"]),
                                str(head["tok_per_s"]),
                                f"{row['speedup_tokens']}x (step {row['speedup_step']}x; target 1.5x)"))
        if "gemm" not in args.skip:
            for name, (k, n) in GEMM_SHAPES.items():
                rows = gemm_rows(k, n, GEMM_ROWS, args.replays)
                for r in rows:
                    emit({"figure": "awq_gemm", "shape": name, "K": k, "N": n, **r, "unit": "us"})
                m = crossover(rows)
                fused_best = [r["M"] for r in rows if r["awq_fused"] <= r["awq_dequant"]]
                emit({"figure": "awq_crossover", "shape": name, "crossover_M": m,
                      "fused_beats_dequant_up_to_M": max(fused_best) if fused_best else None})
                summary.append((f"AWQ vs bf16 GEMM crossover ({name})", "", "", f"M = {m}"))
                for r in rows:
                    if r["M"] in (128, 256):
                        summary.append((f"FP8 W8A8 GEMM, {name} M={r['M']} (us)", str(r["bf16"]), str(r["fp8_w8a8"]),
                                        f"{r['bf16'] / r['fp8_w8a8']:.2f}x (scaled_mm alone {r['fp8_scaled_mm']} us)"))
                    if r["M"] in (1, 128):
                        summary.append((f"block FP8 GEMM (Triton), {name} M={r['M']} (us)", str(r["bf16"]),
                                        str(r["fp8_block"]), f"{r['bf16'] / r['fp8_block']:.2f}x"))
                        w8 = min(r["w8a16_fused"], r["w8a16_dequant"])
                        summary.append((f"W8A16 GEMM, {name} M={r['M']} (us)", str(r["bf16"]), str(w8),
                                        f"{r['bf16'] / w8:.2f}x (fused {r['w8a16_fused']}, dequant "
                                        f"{r['w8a16_dequant']})"))
        if args.awq_sweep:
            for name, (k, n) in GEMM_SHAPES.items():
                rows = awq_sweep(k, n, SWEEP_ROWS, args.replays)
                for r in rows:
                    emit({"figure": "awq_sweep", "shape": name, "K": k, "N": n, **r, "unit": "us"})
                for m in SWEEP_ROWS:
                    best = min((r for r in rows if r["M"] == m), key=lambda r: r["awq_fused"])
                    emit({"figure": "awq_sweep_best", "shape": name, "K": k, "N": n, **best, "unit": "us",
                          "speedup_vs_bf16": round(best["bf16"] / best["awq_fused"], 3)})
                    summary.append((f"AWQ sweep best, {name} M={m} (us)", str(best["bf16"]), str(best["awq_fused"]),
                                    f"{best['bf16'] / best['awq_fused']:.2f}x (block_n {best['block_n']}, block_k "
                                    f"{best['block_k']}, {best['splits']} splits; default {best['default']} us)"))
                rows = skinny_sweep(k, n, SWEEP_ROWS, args.replays)
                for r in rows:
                    emit({"figure": "skinny_sweep", "shape": name, "K": k, "N": n, **r, "unit": "us"})
                for m in SWEEP_ROWS:
                    best = min((r for r in rows if r["M"] == m), key=lambda r: r["skinny"])
                    summary.append((f"skinny GEMM best, {name} M={m} (us)", str(best["bf16_linear"]),
                                    str(best["skinny"]), f"{best['bf16_linear'] / best['skinny']:.2f}x vs cuBLAS "
                                    f"(block_n {best['block_n']}, block_k {best['block_k']}, {best['num_stages']} "
                                    "stages)"))
        if "kv" not in args.skip:
            base = kv_capacity(model, args.kv_gb, args.kv_seq_tokens, "auto")
            fp8kv = kv_capacity(model, args.kv_gb, args.kv_seq_tokens, "fp8")
            emit({"figure": "fp8_kv_capacity", "kv_gb": args.kv_gb, "seq_tokens": args.kv_seq_tokens,
                  "bf16": base, "fp8": fp8kv, "ratio": round(fp8kv["peak_running"] / max(base["peak_running"], 1), 3)})
            summary.append((f"max concurrent seqs, {args.kv_gb} GiB KV", str(base["peak_running"]),
                            str(fp8kv["peak_running"]), f"{fp8kv['peak_running'] / max(base['peak_running'], 1):.2f}x"))
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "bf16", "quantized", "ratio", title=f"quant_bench on {props.name}")
    for cells in summary:
        table.add_row(*cells)
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
