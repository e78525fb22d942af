"""Beam search: infer's (beams forked on shared KV blocks) against HF transformers' ``generate(num_beams=W)``.

Both run the same prompts, one at a time, greedy beam search to exactly ``--max-tokens`` tokens (no
end-of-sequence), W in ``--widths``; the arms take turns on every prompt over ``--repeats`` rounds. Reported per
W: the median wall time per prompt of each, their ratio, whether the best beams agree token for token, and, for the
last prompt (the first ``--long-prompt`` tokens of the standard library's textwrap.py), infer's peak KV blocks in use
against the blocks the same beams would hold unshared (W x the blocks of prompt + output).
``--no-repeat-ngram N`` bans repeated N-grams in both arms (infer's ``no-repeat-ngram`` logits processor, HF's
``no_repeat_ngram_size``). Run: ``python benchmarks/beam_bench.py`` (the shipped demo model on CPU); ``--device
cuda`` on a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from infer.core.beam_search import BeamSearchParams
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.plugins import PluginManager
from infer.models.tiny import PRETRAINED_DIR
from infer.plugins.paged_cache import PagedKVCache

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def push(self",
           "    for i, line in enumerate(lines):\n", "# Parse the configuration file and return a dict\n"]


class PeakPaged(PagedKVCache):
    """The paged cache, recording the most blocks in use after any allocation."""
    peak = 0

    def allocate(self, seq: Any, num_tokens: int) -> bool:
        done = super().allocate(seq, num_tokens)
        self.peak = max(self.peak, self.stats().used_blocks)
        return done


class PeakPlugin:
    @hookimpl
    def register_kv_caches(self, register: Any) -> None:
        register("peak-paged", lambda config, n, eviction: PeakPaged(n, config.block_size, eviction, True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(PRETRAINED_DIR / "target"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (both arms)")
    parser.add_argument("--long-prompt", type=int, default=400, help="tokens of the last prompt")
    parser.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                        help="both arms ban repeated N-grams: infer's no-repeat-ngram logits processor, HF's "
                             "no_repeat_ngram_size [default: 0, none]")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    plugins = PluginManager.from_entry_points()
    plugins.register(PeakPlugin(), name="peak")
    threads = args.threads if args.device == "cpu" else None
    engine = Engine(EngineConfig(model=args.model, device=args.device, kv_cache="peak-paged",
                                 enable_prefix_caching=False, cpu_threads=threads), plugins)
    dtype = engine.loaded.dtype
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    prompts = [engine.tokenize(p) for p in PROMPTS]
    prompts.append(engine.tokenize(Path(textwrap.__file__).read_text())[: args.long_prompt])
    block = engine.config.block_size
    rows = []
    for width in args.widths:
        processors = {"no-repeat-ngram": {"size": args.no_repeat_ngram}} if args.no_repeat_ngram else {}
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True,
                                  logits_processors=processors)
        times: dict[str, list[float]] = {"infer": [], "hf": []}
        agree, peaks, unshared = 0, [], []
        for _ in range(args.repeats):
            for ids in prompts:
                engine.kv.peak = 0
                start = time.perf_counter()
                ours = engine.beam_search([ids], params)[0].beams[0].token_ids
                times["infer"].append(time.perf_counter() - start)
                if ids is prompts[-1]:
                    peaks.append(engine.kv.peak)
                    unshared.append(width * -(-(len(ids) + args.max_tokens) // block))
                start = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(torch.tensor([ids], device=args.device), num_beams=width, do_sample=False,
                                      max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                      early_stopping=False, pad_token_id=0,
                                      no_repeat_ngram_size=args.no_repeat_ngram or None,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=args.device))
                if args.device != "cpu":
                    torch.cuda.synchronize()
                times["hf"].append(time.perf_counter() - start)
                agree += out[0, len(ids):].tolist() == ours
        infer_s, hf_s = statistics.median(times["infer"]), statistics.median(times["hf"])
        rows.append({"width": width, "infer_s": infer_s, "hf_s": hf_s, "speedup": hf_s / infer_s,
                     "best_beam_agrees": f"{agree}/{len(times['infer'])}",
                     "peak_blocks": statistics.median(peaks), "unshared_blocks": statistics.median(unshared)})
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "device": args.device, "model": args.model, "max_tokens": args.max_tokens,
                      "prompts": len(prompts), "repeats": args.repeats, "no_repeat_ngram": args.no_repeat_ngram}))
    print(f"{'W':>3} {'infer s/prompt':>15} {'HF s/prompt':>12} {'HF/infer':>9} {'best beam =':>12} "
          f"{'long: peak blocks':>18} {'unshared':>9}")
    for r in rows:
        print(f"{r['width']:>3} {r['infer_s']:>15.3f} {r['hf_s']:>12.3f} {r['speedup']:>8.2f}x "
              f"{r['best_beam_agrees']:>12} {r['peak_blocks']:>18.0f} {r['unshared_blocks']:>9.0f}")


if __name__ == "__main__":
    main()
