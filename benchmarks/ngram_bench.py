"""Host time of the `ngram` proposer per sequence and decode step, at long contexts.

``--seqs`` sequences of ``--context`` tokens each (random ids over ``--vocab``: few repeats, so most lookups scan
for a match that is not there, the proposer's worst case; ``--repetitive`` makes every sequence a repeated 50-token
phrase instead, where matches abound), then ``--steps`` decode steps: each appends one token to every sequence and
asks the proposer for ``--k`` drafts. Prints the median microseconds per sequence and step. On a GPU a decode step
of the anchor model takes a few milliseconds for the whole batch, so this host time adds to every step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import import_checkout  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repetitive", action="store_true", help="a repeated phrase instead of random ids")
    parser.add_argument("--source", type=Path, default=None, help="import infer from this checkout (an A/B)")
    args = parser.parse_args()
    if args.source is not None:
        import_checkout(args.source)
    from infer.core.request import SamplingParams, Sequence
    from infer.spec_decode.ngram import NgramProposer

    rng = random.Random(0)
    phrase = [rng.randrange(args.vocab) for _ in range(50)]

    def token(i: int) -> int:
        return phrase[i % len(phrase)] if args.repetitive else rng.randrange(args.vocab)

    params = SamplingParams(max_tokens=args.steps + 1)
    seqs = [Sequence(i, f"r{i}", [token(j) for j in range(args.context)], params, 0.0,
                     max_model_len=args.context + args.steps + 2) for i in range(args.seqs)]
    proposer = NgramProposer()
    times, drafted = [], 0
    for step in range(args.steps):
        for seq in seqs:
            seq.token_ids.append(token(args.context + step))
        start = time.perf_counter()
        proposal = proposer.propose(seqs, args.k)
        times.append(time.perf_counter() - start)
        drafted += sum(len(t) for t in proposal.token_ids.values())
    us = statistics.median(times) / args.seqs * 1e6
    text = "repetitive" if args.repetitive else "random"
    print(f"ngram propose, {args.seqs} sequences of {args.context} tokens ({text}), k={args.k}: {us:.1f} us per "
          f"sequence and step (median of {args.steps}); {drafted} drafts")


if __name__ == "__main__":
    main()
