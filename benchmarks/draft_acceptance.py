"""How well a draft serves the shipped target on held-out text: greedy tokens per verification round and acceptance.

The prompts are cut from the standard-library files that ``python -m infer.spec_decode.train_pair`` holds out (every
40th), at up to ``--per-file`` evenly spaced ``def``/``class`` lines, ``--prompt-chars`` characters each; every
request decodes ``--max-tokens`` greedy tokens. A wider sample than spec_bench.py's eight prompts, for choosing a
draft; it measures no time (greedy acceptance does not depend on batching, so the prompts run as one batch).

    python benchmarks/draft_acceptance.py models/pretrained/draft OTHER_DRAFT_DIR ...
"""
from __future__ import annotations

import argparse
import re

from infer import LLM, SamplingParams
from infer.models.tiny import stdlib_corpus

TARGET = "models/pretrained/target"


def heldout_prompts(per_file: int, chars: int) -> list[str]:
    prompts = []
    for path in stdlib_corpus()[::40]:  # train_pair's validation files
        text = path.read_text(encoding="utf-8", errors="replace")
        starts = [m.start() for m in re.finditer(r"^\s*(def|class) ", text, re.M)]
        prompts += [text[s: s + chars] for s in starts[:: max(1, len(starts) // per_file)][:per_file]]
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft model folders")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per round")
    parser.add_argument("--per-file", type=int, default=6)
    parser.add_argument("--prompt-chars", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = heldout_prompts(args.per_file, args.prompt_chars)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"{len(prompts)} held-out prompts, {args.max_tokens} greedy tokens each, K = {args.k}")
    print("| draft | a = accepted/proposed | tokens/round |\n|---|---|---|")
    for draft in args.drafts:
        llm = LLM(model=args.target, device="cpu", proposer="draft-model", draft_model=draft,
                  num_speculative_tokens=args.k, cpu_threads=1)
        llm.generate(prompts, params)
        stats = llm.engine.stats.summary()
        print(f"| {draft} | {stats['spec_acceptance_rate']:.3f} | {stats['spec_tokens_per_round']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
