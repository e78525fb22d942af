"""Embeddings: infer's embedding requests against HF transformers' padded batches, same prompts, same process.

The prompts are slices of the Python standard library's sources, tokenized, of lengths uniform over
``--min-len``..``--max-len`` tokens (``random.Random(--seed)`` picks the files, offsets and lengths), each after a
shared instruction of ``--instruction-len`` tokens (Qwen3-Embedding's queries share one such prefix; 0: none). infer
embeds them all at once (`Engine.embed`, last and mean pooling, normalized); HF runs `AutoModel`'s forward on
batches of ``--hf-batch`` prompts sorted by length (sentence-transformers' order, least padding), right-padded with
an attention mask, pooling the last real position (or the masked mean), normalized. The arms take turns over
``--repeats`` rounds (infer's prefix cache is emptied before each of its rounds); reported: the median time per
round, prompts/s and prompt tokens/s of each, the ratio, and the largest difference between the arms' embeddings.
Run: ``python benchmarks/embed_bench.py`` (the shipped demo model on CPU); ``--device cuda`` on a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.pooling import PoolingParams
from infer.models.tiny import PRETRAINED_DIR


def workload(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    instruction = engine.tokenize(Path(files[0]).read_text(errors="replace"))[: args.instruction_len]
    prompts = []
    while len(prompts) < args.num_prompts:
        ids = engine.tokenize(rng.choice(files).read_text(errors="replace"))
        length = rng.randint(args.min_len, args.max_len)
        if len(ids) > length:
            start = rng.randrange(len(ids) - length)
            prompts.append(instruction + ids[start : start + length])
    return prompts


def hf_embed(model: torch.nn.Module, prompts: list[list[int]], method: str, batch: int, pad: int,
             device: str) -> list[torch.Tensor]:
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for first in range(0, len(order), batch):
            part = order[first : first + batch]
            width = max(len(prompts[i]) for i in part)
            ids = torch.tensor([prompts[i] + [pad] * (width - len(prompts[i])) for i in part], device=device)
            mask = torch.tensor([[1] * len(prompts[i]) + [0] * (width - len(prompts[i])) for i in part],
                                device=device)
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if method == "last":
                pooled = states[torch.arange(len(part)), mask.sum(1) - 1]
            else:
                pooled = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            for i, vector in zip(part, torch.nn.functional.normalize(pooled, dim=-1)):
                out[i] = vector.cpu()
    return out  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(PRETRAINED_DIR / "target"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--instruction-len", type=int, default=0, help="tokens of the instruction every prompt shares")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (both arms)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModel

    engine = Engine(EngineConfig(model=args.model, device=args.device,
                                 cpu_threads=args.threads if args.device == "cpu" else None))
    hf = AutoModel.from_pretrained(args.model, dtype=engine.loaded.dtype).to(args.device).eval()
    prompts = workload(engine, args)
    tokens = sum(map(len, prompts))
    pad = engine.tokenizer.pad_token_id or 0
    rows = []
    for method in ("last", "mean"):
        times: dict[str, list[float]] = {"infer": [], "hf": []}
        mine: list[list[float]] = []
        theirs: list[torch.Tensor] = []
        for _ in range(args.repeats):
            engine.kv.reset_prefix_cache()
            start = time.perf_counter()
            outs = engine.embed(prompts, PoolingParams(pooling=method, normalize=True))
            times["infer"].append(time.perf_counter() - start)
            mine = [out.embedding for out in outs]  # type: ignore[misc]
            start = time.perf_counter()
            theirs = hf_embed(hf, prompts, method, args.hf_batch, pad, args.device)
            if args.device != "cpu":
                torch.cuda.synchronize()
            times["hf"].append(time.perf_counter() - start)
        diff = max((torch.tensor(a) - b).abs().max().item() for a, b in zip(mine, theirs))
        med = {arm: statistics.median(t) for arm, t in times.items()}
        rows.append({"pooling": method, "infer_s": med["infer"], "hf_s": med["hf"],
                     "infer_prompts_per_s": len(prompts) / med["infer"], "hf_prompts_per_s": len(prompts) / med["hf"],
                     "infer_tokens_per_s": tokens / med["infer"], "hf_tokens_per_s": tokens / med["hf"],
                     "ratio": med["hf"] / med["infer"], "max_abs_diff": diff, "rounds": times})
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "device": args.device, "prompts": len(prompts), "prompt_tokens": tokens,
                      "instruction_len": args.instruction_len, "hf_batch": args.hf_batch, "rows": rows}, indent=1))
    print(f"{'pooling':8} {'infer s':>8} {'HF s':>8} {'infer tok/s':>12} {'HF tok/s':>10} {'ratio':>6} {'max diff':>9}")
    for r in rows:
        print(f"{r['pooling']:8} {r['infer_s']:8.3f} {r['hf_s']:8.3f} {r['infer_tokens_per_s']:12,.0f} "
              f"{r['hf_tokens_per_s']:10,.0f} {r['ratio']:6.2f} {r['max_abs_diff']:9.2e}")


if __name__ == "__main__":
    main()
