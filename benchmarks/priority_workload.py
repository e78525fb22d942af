"""Write an `infer bench --workload file` JSONL of mixed priorities, to A/B `--scheduling-policy fcfs` and `priority`.

``--num-requests`` lines of random token ids (3 to 258, inside any byte-level vocabulary): prompt and output lengths
lognormal around ``--input-len`` and ``--output-len`` (sigma 0.5), and a share ``--top-share`` of the lines, drawn
at random, of priority 1 (the rest 0). Seeded (``--seed``), so every run writes the same file. Then, for example:

    infer --max-num-seqs 8 bench --workload file --file prio.jsonl --rate 40 \\
        --ab "--scheduling-policy fcfs" "--scheduling-policy priority" --repeats 3

and read the "TTFT p50/p99, top priority" rows beside the overall ones.
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
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top-share", type=float, default=0.125, help="share of lines of priority 1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.top_share <= 1:
        parser.error(f"--top-share must be in [0, 1], got {args.top_share}")
    rng = random.Random(args.seed)
    lines = []
    for _ in range(args.num_requests):
        prompt = [rng.randrange(3, 259) for _ in range(lognormal(rng, args.input_len))]
        lines.append({"prompt": prompt, "max_tokens": lognormal(rng, args.output_len),
                      "priority": int(rng.random() < args.top_share)})
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    top = sum(line["priority"] for line in lines)
    print(f"wrote {args.out}: {len(lines)} requests, {top} of priority 1")


if __name__ == "__main__":
    main()
