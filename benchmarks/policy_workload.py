"""Write an `infer bench --workload file` JSONL to A/B the `--scheduling-policy` values on.

``--num-requests`` lines of random token ids (3 to 258, inside any byte-level vocabulary): prompt and output lengths
lognormal around ``--input-len`` and ``--output-len`` (sigma 0.5); a share ``--top-share`` of the lines, drawn at
random, of priority 1 (the rest 0); and with ``--prefix-groups G``, each prompt begins with one of G shared prefixes
of ``--prefix-len`` tokens, drawn at random (what a system prompt per application looks like). Seeded (``--seed``),
so every run writes the same file. Then, for example:

    infer --max-num-seqs 8 bench --workload file --file prio.jsonl --rate 40 \\
        --ab "--scheduling-policy fcfs" "--scheduling-policy priority" --repeats 3

and read the "TTFT p50/p99, top priority" rows beside the overall ones; or, with prefix groups and a KV pool that
holds only some of them, `--ab "--scheduling-policy fcfs" "--scheduling-policy lpm"` and the prefix hit rate; or,
with ``--low-first 16 --top-share 1``, `--ab "--scheduling-policy priority" "--scheduling-policy priority
--priority-aging-s 1"` and the "TTFT max, lowest priority" row (how long the first 16 wait behind the rest).
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path


def lognormal(rng: random.Random, mean: int, sigma: float = 0.5) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64, help="mean prompt tokens after the shared prefix")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top-share", type=float, default=0.125, help="share of lines of priority 1")
    parser.add_argument("--low-first", type=int, default=0, metavar="N",
                        help="the first N lines of priority 0, whatever --top-share draws for them (with "
                             "--top-share 1: N requests that more important traffic arriving after them could "
                             "starve, to A/B --priority-aging-s)")
    parser.add_argument("--prefix-groups", type=int, default=0, help="shared prefixes; 0: none")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.top_share <= 1:
        parser.error(f"--top-share must be in [0, 1], got {args.top_share}")
    if not 0 <= args.low_first <= args.num_requests:
        parser.error(f"--low-first must be in [0, --num-requests], got {args.low_first}")
    if args.prefix_groups < 0 or args.prefix_len < 1:
        parser.error("--prefix-groups must be >= 0 and --prefix-len >= 1")
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 259) for _ in range(args.prefix_len)] for _ in range(args.prefix_groups)]
    lines = []
    for i in range(args.num_requests):
        prefix = rng.choice(prefixes) if prefixes else []
        prompt = prefix + [rng.randrange(3, 259) for _ in range(lognormal(rng, args.input_len))]
        lines.append({"prompt": prompt, "max_tokens": lognormal(rng, args.output_len),
                      "priority": int(rng.random() < args.top_share and i >= args.low_first)})
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    top = sum(line["priority"] for line in lines)
    groups = f", {args.prefix_groups} shared prefixes of {args.prefix_len} tokens" if prefixes else ""
    print(f"wrote {args.out}: {len(lines)} requests, {top} of priority 1{groups}")


if __name__ == "__main__":
    main()
