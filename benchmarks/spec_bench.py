"""Single-stream speculative decoding: decode speedup against no speculation, acceptance, tokens per round.

For each K the same greedy requests run one at a time through an engine with the draft-model proposer and through
a plain engine (the peer, measured in the same run; the arms take turns on every prompt, and the speedup is the
median over repeats of the paired ratio of decode times). Decode
time runs from a request's first streamed token to its last, so the prefill is excluded. The measured tokens per
verification round are compared with Leviathan et al.'s (1 - a^(K+1)) / (1 - a), both at the engine's acceptance
rate a = accepted / proposed and at the per-draft acceptance probability alpha = accepted / (accepted + rejections),
the i.i.d. estimate the formula assumes (a drafted token after a rejection is proposed but never judged).
Run: ``python benchmarks/spec_bench.py`` (the shipped pair on CPU); ``--device cuda`` on a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.metrics import StepStats
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams
from infer.models.tiny import PRETRAINED_DIR
from infer.spec_decode.rejection import expected_tokens_per_round

PROMPTS = [
    "def fibonacci(n):\n",
    "class Parser:\n    def __init__(self, text):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "    def __repr__(self):\n        return",
]


class RoundLog:
    """An on_step observer: a single stream verifies at most one round per step."""

    def __init__(self) -> None:
        self.accepted = self.judged = 0

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        if stats.num_draft_tokens:
            self.accepted += stats.num_accepted_tokens
            self.judged += stats.num_accepted_tokens + (stats.num_accepted_tokens < stats.num_draft_tokens)


@dataclass
class Arm:
    name: str
    k: int
    decode_s: list[float] = field(default_factory=list)  # per repeat: summed decode time of all prompts
    tokens: int = 0  # decode tokens per repeat
    acceptance: float = 0.0  # accepted / proposed
    alpha: float = 0.0  # accepted / judged
    tokens_per_round: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / statistics.median(self.decode_s)

    def speedup(self, base: Arm) -> float:
        return statistics.median(b / a for a, b in zip(self.decode_s, base.decode_s))


def make_engine(args: argparse.Namespace, k: int, log: RoundLog) -> Engine:
    spec = {"proposer": args.proposer, "num_speculative_tokens": k} if k else {}
    if k and args.proposer == "draft-model":
        spec["draft_model"] = args.draft
    plugins = PluginManager.from_entry_points()
    plugins.register(log, name="spec-bench-rounds")
    # one request at a time: max_num_seqs 4 keeps the CUDA graph ladders (target, verification, draft) at 1, 2, 4
    return Engine(EngineConfig(model=args.target, device=args.device, num_kv_blocks=512, seed=0, max_num_seqs=4,
                               freeze_gc=True, **spec), plugins)  # as `infer serve` runs; no engine is dropped


def decode_time(engine: Engine, prompt: str, params: SamplingParams) -> tuple[float, list[int]]:
    """Seconds from the first streamed token to the last, and the tokens."""
    tokens: list[int] = []
    first = last = 0.0
    for delta in engine.stream(prompt, params):
        now = time.perf_counter()
        if delta.outputs and delta.outputs[0].token_ids:
            if not tokens:
                first = now
            tokens += delta.outputs[0].token_ids
            last = now
    return last - first, tokens


def run(args: argparse.Namespace) -> list[Arm]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=1)
    arms = [Arm("no speculation", 0)] + [Arm(f"{args.proposer} K={k}", k) for k in args.ks]
    logs = [RoundLog() for _ in arms]
    engines = [make_engine(args, arm.k, log) for arm, log in zip(arms, logs)]
    for engine in engines:  # warm-up on the measured work: every kernel variant (Triton specializes on block-table
        for prompt in PROMPTS:  # widths) compiles and every graph is captured before the clock starts
            engine.generate([prompt], params)
    for _ in range(args.repeats):
        totals = [0.0] * len(arms)
        for arm in arms:
            arm.outputs = []
        for prompt in PROMPTS:
            for i, (arm, engine) in enumerate(zip(arms, engines)):
                seconds, tokens = decode_time(engine, prompt, params)
                totals[i] += seconds
                arm.outputs.append(tokens)
        for arm, total in zip(arms, totals):
            arm.decode_s.append(total)
            arm.tokens = sum(len(t) - 1 for t in arm.outputs)
    for arm, engine, log in zip(arms, engines, logs):
        s = engine.stats
        arm.acceptance = s.acceptance_rate
        arm.alpha = log.accepted / log.judged if log.judged else 0.0
        arm.tokens_per_round = s.spec_emitted / s.spec_rounds if s.spec_rounds else 1.0
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(PRETRAINED_DIR / "target"))
    parser.add_argument("--draft", default=str(PRETRAINED_DIR / "draft"))
    parser.add_argument("--proposer", default="draft-model", choices=["draft-model", "ngram"])
    parser.add_argument("--ks", default="2,4,6", type=lambda s: [int(k) for k in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arms = run(args)
    base = arms[0]
    print("| arm | decode tok/s | speedup | a = accepted/proposed | alpha = accepted/judged | tokens/round | "
          "(1-a^(K+1))/(1-a) | same at alpha | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        at_a = expected_tokens_per_round(arm.acceptance, arm.k) if arm.k else 1.0
        at_alpha = expected_tokens_per_round(arm.alpha, arm.k) if arm.k else 1.0
        same = "-" if not arm.k or args.temperature else str(arm.outputs == base.outputs).lower()
        print(f"| {arm.name} | {arm.tok_per_s:.1f} | {arm.speedup(base):.2f}x | {arm.acceptance:.3f} | "
              f"{arm.alpha:.3f} | {arm.tokens_per_round:.2f} | {at_a:.2f} | {at_alpha:.2f} | {same} |")
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "threads": args.threads,
              "device": args.device, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "arms": [{k: v for k, v in asdict(a).items() if k != "outputs"}
                       | {"tok_per_s": a.tok_per_s, "speedup": a.speedup(base)} for a in arms]}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
