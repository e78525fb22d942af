"""LoRA adapters: what serving them costs, against the base model and against PEFT on HF transformers.

The base is a checkpoint (default: the shipped pair's target); ``--adapters`` random adapters in PEFT's format
(rank ``--rank``, every q/k/v/o/gate/up/down projection) are written here (PEFT itself is not needed: the GPU image
lacks it). Requests: ``--requests`` prompts
of ``--prompt-len`` random token ids, ``--max-tokens`` greedy tokens each (EOS ignored), all at once. Arms, each in
its own engine, one warm-up round, then ``--rounds`` rounds taking turns (median output tok/s):
- ``base``: no adapter loaded;
- ``loaded, unused``: every adapter loaded, the requests on the base model;
- ``1 adapter``: one loaded, every request on it;
- ``N loaded, 1 in use``: every adapter loaded, every request on the first;
- ``N adapters``: N loaded, the requests spread over them in turn;
- ``1 of N slots, loaded at run time``: ``--max-lora-adapters N``, none at start, the first loaded into a slot
  while the engine runs (every linear then has room for N), every request on it.
The peer, in the same process when PEFT is installed: HF ``generate`` (one batch, no padding: the prompts have one
length) on the base model and on PEFT's model with the first adapter (unmerged, as PEFT serves one). Prints a
table last.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(base: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` adapters as PEFT's save_pretrained writes them: A ~ N(0, 1/in), B ~ N(0, 0.02), alpha = 2 rank."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, inner, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inner), "mlp.up_proj": (hidden, inner),
              "mlp.down_proj": (inner, hidden)}
    folders = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
        folder = out / f"adapter{index}"
        folder.mkdir()
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none",
            "task_type": "CAUSAL_LM"}))
        folders.append(folder)
    return folders


def infer_arms(base: Path, folders: list[Path], prompts: list[list[int]], max_tokens: int, rounds: int,
               device: str, dtype: str) -> dict[str, float]:
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    def params(name: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_adapter=name)

    every = {f"a{i}": str(folder) for i, folder in enumerate(folders)}
    arms = {"base": ({}, [params(None)] * len(prompts)),
            "loaded, unused": (every, [params(None)] * len(prompts)),
            "1 adapter": ({"a0": every["a0"]}, [params("a0")] * len(prompts)),
            f"{len(folders)} loaded, 1 in use": (every, [params("a0")] * len(prompts)),
            f"{len(folders)} adapters": (every, [params(f"a{i % len(folders)}") for i in range(len(prompts))]),
            f"1 of {len(folders)} slots, loaded at run time": ({}, [params("a0")] * len(prompts))}
    memory = None if device == "cpu" else 4.0  # GiB of KV each: the engines are resident at once
    engines = {name: Engine(EngineConfig(model=str(base), device=device, dtype=dtype, max_num_seqs=len(prompts),
                                         kv_cache_memory_gb=memory, lora_adapters=adapters,
                                         max_lora_adapters=len(folders) if "slots" in name else None))
               for name, (adapters, _) in arms.items()}
    engines[f"1 of {len(folders)} slots, loaded at run time"].load_lora_adapter("a0", every["a0"])
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(rounds + 1):  # round 0 warms up
        for name in (arms if index % 2 else reversed(arms)):
            start = time.perf_counter()
            outs = engines[name].generate(prompts, arms[name][1])
            if index:
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def hf_arms(base: Path, adapter: Path, prompts: list[list[int]], max_tokens: int, device: str,
            dtype: str) -> dict[str, float]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(prompts, device=device)
    rates = {}
    for name in ("HF generate, base", "HF generate, PEFT adapter"):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, dtype)).to(device).eval()
        if "PEFT" in name:
            model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
        with torch.no_grad():
            model.generate(ids[:2], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            torch.cuda.synchronize() if device == "cuda" else None
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            torch.cuda.synchronize() if device == "cuda" else None
            rates[name] = (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)
    return rates


def main() -> None:
    from infer.models.tiny import PRETRAINED_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=PRETRAINED_DIR / "target")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="[default: float32 on the CPU, bfloat16 on CUDA]")
    args = parser.parse_args()
    import torch

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device == "cpu":
        torch.set_num_threads(1)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_adapters(args.model, Path(tmp), args.adapters, args.rank)
        rates = infer_arms(args.model, folders, prompts, args.max_tokens, args.rounds, args.device, dtype)
        if importlib.util.find_spec("peft") is not None:
            rates |= hf_arms(args.model, folders[0], prompts, args.max_tokens, args.device, dtype)
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, prompts of {args.prompt_len}, rank {args.rank}, "
          f"{args.device} {dtype}, torch {torch.__version__}" + (", 1 thread" if args.device == "cpu" else "")
          + ("" if "HF generate, base" in rates else "; HF + PEFT: not measured (peft is not installed)"))
    print("| arm | output tok/s | / infer base | infer 1 adapter / this |\n|---|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / rates['base']:.2f} | {rates['1 adapter'] / rate:.2f} |")


if __name__ == "__main__":
    main()
