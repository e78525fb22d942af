"""Single-stream speculative decoding: decode speedup against no speculation, acceptance, tokens per round.

For each K the same greedy requests run one at a time through an engine with the draft-model proposer and through
a plain engine (the peer, measured in the same run; the arms take turns on every prompt, and the speedup is the
median over repeats of the paired ratio of decode times). Decode
time runs from a request's first streamed token to its last, so the prefill is excluded. The measured tokens per
verification round are compared with Leviathan et al.'s (1 - a^(K+1)) / (1 - a), both at the engine's acceptance
rate a = accepted / proposed and at the per-draft acceptance probability alpha = accepted / (accepted + rejections),
the i.i.d. estimate the formula assumes (a drafted token after a rejection is proposed but never judged).
With the draft-model proposer the draft also runs alone, as a plain engine, in the same rotation: c = its decode time
per token / the target's, and Leviathan et al.'s speedup bound (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)) (eq. 2,
no overhead beyond the c of whole engine steps) says what the pair can give at best. Per arm, the host time per
output token of each engine phase (the draft's K steps are in `schedule`, verification in `sample`) is the profile
that explains a gap to the bound.
Run: ``python benchmarks/spec_bench.py`` (the shipped pair on CPU); ``--device cuda`` on a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.metrics import StepStats
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams
from infer.models.tiny import PRETRAINED_DIR
from infer.spec_decode.rejection import expected_tokens_per_round

DRAFT_ALONE = "draft model alone"
PROMPTS = [  # greedy acceptance comes in path-dependent runs: eight starts, so that no one path decides alpha
    "def fibonacci(n):\n",
    "class Parser:\n    def __init__(self, text):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "    def __repr__(self):\n        return",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    for i, line in enumerate(lines):\n",
    "    @property\n    def name(self):\n",
    "try:\n    import json\nexcept ImportError:\n",
]


PHASES = ("schedule", "execute", "sample", "postprocess")


class RoundLog:
    """An on_step observer: a single stream verifies at most one round per step. Sums the phase times too."""

    def __init__(self) -> None:
        self.accepted = self.judged = 0
        self.phase_s = dict.fromkeys(PHASES, 0.0)

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        if stats.num_draft_tokens:
            self.accepted += stats.num_accepted_tokens
            self.judged += stats.num_accepted_tokens + (stats.num_accepted_tokens < stats.num_draft_tokens)
        for phase in PHASES:
            self.phase_s[phase] += getattr(stats, f"{phase}_s")


@dataclass
class Arm:
    name: str
    k: int
    plugin_options: dict[str, Any] = field(default_factory=dict)
    decode_s: list[float] = field(default_factory=list)  # per repeat: summed decode time of all prompts
    tokens: int = 0  # decode tokens per repeat
    acceptance: float = 0.0  # accepted / proposed
    alpha: float = 0.0  # accepted / judged
    tokens_per_round: float = 0.0
    phase_ms: dict[str, float] = field(default_factory=dict)  # host ms per output token, by engine phase
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / statistics.median(self.decode_s)

    def speedup(self, base: Arm) -> float:
        return statistics.median(b / a for a, b in zip(self.decode_s, base.decode_s))


def make_engine(args: argparse.Namespace, arm: Arm, log: RoundLog) -> Engine:
    spec: dict[str, Any] = {"proposer": args.proposer, "num_speculative_tokens": arm.k,
                             "plugin_options": arm.plugin_options} if arm.k else {}
    if arm.k and args.proposer == "draft-model":
        spec["draft_model"] = args.draft
    plugins = PluginManager.from_entry_points()
    plugins.register(log, name="spec-bench-rounds")
    # one request at a time: max_num_seqs 4 keeps the CUDA graph ladders (target, verification, draft) at 1, 2, 4
    model = args.draft if arm.name == DRAFT_ALONE else args.target
    return Engine(EngineConfig(model=model, device=args.device, num_kv_blocks=512, seed=0, max_num_seqs=4,
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
    arms += [Arm(f"{args.proposer} K={k}, step by step", k, {"spec_decode": {"round_graphs": False}})
             for k in args.step_by_step_ks]
    if args.proposer == "draft-model":
        arms.append(Arm(DRAFT_ALONE, 0))
    logs = [RoundLog() for _ in arms]
    engines = [make_engine(args, arm, log) for arm, log in zip(arms, logs)]
    for engine in engines:  # warm-up on the measured work: every kernel variant (Triton specializes on block-table
        for prompt in PROMPTS:  # widths) compiles and every graph is captured before the clock starts
            engine.generate([prompt], params)
    for log in logs:
        log.phase_s = dict.fromkeys(PHASES, 0.0)
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
        arm.phase_ms = {phase: round(1000 * seconds / (arm.tokens * args.repeats), 4)
                        for phase, seconds in log.phase_s.items()}
    return arms


def speedup_bound(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023, eq. 2: expected walltime improvement with K drafts at cost ratio c."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1)


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
    parser.add_argument("--step-by-step-ks", default=[], type=lambda s: [int(k) for k in s.split(",")],
                        help="also these K with spec_decode.round_graphs off: each draft step its own forward pass "
                             "(the round graphs' A/B; they run with CUDA graphs only)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arms = run(args)
    base = arms[0]
    alone = next((arm for arm in arms if arm.name == DRAFT_ALONE), None)
    c = 1 / alone.speedup(base) if alone is not None else None  # the draft's time per token / the target's
    print("| arm | decode tok/s | speedup | bound at alpha, c | a = accepted/proposed | alpha = accepted/judged | "
          "tokens/round | (1-a^(K+1))/(1-a) | same at alpha | same tokens | host ms/token: schedule, execute, "
          "sample, postprocess |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        at_a = expected_tokens_per_round(arm.acceptance, arm.k) if arm.k else 1.0
        at_alpha = expected_tokens_per_round(arm.alpha, arm.k) if arm.k else 1.0
        bound = f"{speedup_bound(arm.alpha, arm.k, c):.2f}x" if arm.k and c is not None else "-"
        same = "-" if not arm.k or args.temperature else str(arm.outputs == base.outputs).lower()
        phases = ", ".join(f"{arm.phase_ms[p]:.3f}" for p in PHASES)
        print(f"| {arm.name} | {arm.tok_per_s:.1f} | {arm.speedup(base):.2f}x | {bound} | {arm.acceptance:.3f} | "
              f"{arm.alpha:.3f} | {arm.tokens_per_round:.2f} | {at_a:.2f} | {at_alpha:.2f} | {same} | {phases} |")
    if c is not None:
        print(f"c = {c:.3f} (the draft alone, per token, against the target alone, same rotation)")
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "threads": args.threads,
              "device": args.device, "max_tokens": args.max_tokens, "temperature": args.temperature, "c": c,
              "arms": [{k: v for k, v in asdict(a).items() if k != "outputs"}
                       | {"tok_per_s": a.tok_per_s, "speedup": a.speedup(base)} for a in arms]}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
