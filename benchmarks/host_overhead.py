"""Host overhead per output token: the anchor workload's requests on a minuscule model, split by engine phase.

The model (hidden 64, one layer, vocabulary 1024) makes the forward pass nearly free, so what is left is the
Python around it: scheduling, building the batch tensors, sampling, appending tokens, detokenizing, outputs.
On a GPU the anchor model's decode step is a few milliseconds for up to 128 tokens; these microseconds per token
are added to it (the engine does not yet overlap host work with the device).

The phases come from the engine's own per-step timings (``StepStats``, summed in ``EngineStats.phase_s``). Prints
a table last; ``--json FILE`` keeps the figures.

``--logits-processor NAME[=JSON]`` gives every request a logits processor; ``--vocab N`` a larger vocabulary (the
model stays minuscule otherwise; its tokenizer keeps 1,024 tokens, the others detokenize to nothing); ``--peer``
then times the processors alone against HF transformers' on the same batches (processor_replay.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import Preset, build_model, workload_requests  # noqa: E402

HOST = Preset(dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                   intermediate_size=64, vocab_size=1024, max_position_embeddings=2048),
              "float32", 128, (32, 512), (4.5, 0.9), (8, 512), 32, 256)
PHASES = ("schedule", "execute", "sample", "postprocess")


def import_checkout(root: Path) -> None:
    """Make ``import infer`` load the package at ``root`` (a repository root is the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("infer", root / "__init__.py", submodule_search_locations=[str(root)])
    if spec is None or spec.loader is None:
        sys.exit(f"--source {root}: no __init__.py there")
    module = importlib.util.module_from_spec(spec)
    sys.modules["infer"] = module
    spec.loader.exec_module(module)


def minuscule_engine(**options: Any) -> Any:
    """An Engine on the minuscule model, on the CPU with one torch thread, no prefix caching, max_num_seqs for
    HOST's requests; ``options``: other EngineConfig fields. Call after any ``import_checkout``."""
    import torch

    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    torch.set_num_threads(1)
    model = build_model(Path(tempfile.gettempdir()) / "infer-host-overhead", HOST.shape, HOST.dtype, "cpu")
    return Engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=HOST.requests, enable_prefix_caching=False,
                               **options))


def processor_calls(items: list[str]) -> list[tuple[str, str]]:
    """``NAME`` or ``NAME=JSON`` items as SamplingParams.logits_processors' (name, JSON text) pairs."""
    return [(name, text or "{}") for name, _, text in (item.partition("=") for item in items)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--requests", type=int, default=HOST.requests, help="requests sent at once")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs after one warm-up run")
    parser.add_argument("--attention", default=None, help="attention backend (default: the engine's)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--sampling", action="append", default=[], metavar="FIELD=NUMBER",
                        help="a SamplingParams field for every request, e.g. repetition_penalty=1.1 (repeatable)")
    parser.add_argument("--logits-processor", action="append", default=[], metavar="NAME[=JSON]",
                        help="a logits processor and its arguments for every request (repeatable)")
    parser.add_argument("--vocab", type=int, default=HOST.shape["vocab_size"], help="the model's vocabulary size")
    parser.add_argument("--peer", action="store_true",
                        help="then time the processors alone against HF transformers' on the last run's batches")
    parser.add_argument("--source", type=Path, default=None,
                        help="import infer from this checkout instead (e.g. a git worktree of an older commit, for "
                             "an A/B; commits before the phase timings report totals only)")
    args = parser.parse_args()
    if args.source is not None:
        import_checkout(args.source)
    import torch

    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    shape = {**HOST.shape, "vocab_size": args.vocab}
    suffix = "" if args.vocab == HOST.shape["vocab_size"] else f"-vocab{args.vocab}"
    model = build_model(Path(tempfile.gettempdir()) / f"infer-host-overhead{suffix}", shape, HOST.dtype, "cpu")
    requests = workload_requests(Preset(**{**HOST.__dict__, "shape": shape, "requests": args.requests}))
    import dataclasses

    serving = {"freeze_gc": True} if "freeze_gc" in {f.name for f in dataclasses.fields(EngineConfig)} else {}
    engine = Engine(EngineConfig(model=str(model), device=device, attention=args.attention,
                                 max_num_seqs=max(args.requests, 1), enable_prefix_caching=False,
                                 num_kv_blocks=args.requests * 1024 // 16 + 1, **serving))  # as `infer serve` runs
    prompts = [p for p, _ in requests]
    extra = {key: float(value) if "." in value else int(value)
             for key, _, value in (item.partition("=") for item in args.sampling)}
    calls = processor_calls(args.logits_processor)
    processors = {"logits_processors": calls} if calls else {}  # older code (--source) may not know the field
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra, **processors)
              for _, n in requests]
    runs = []
    for repeat in range(args.repeats + 1):
        before = dict(getattr(engine.stats, "phase_s", {}))
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        after = getattr(engine.stats, "phase_s", {})
        phases = {p: (after[p] - before.get(p, 0.0)) / tokens * 1e6 if p in after else float("nan") for p in PHASES}
        if repeat:  # the first run warms up allocators and kernels
            runs.append({"tok_per_s": tokens / seconds, "us_per_token": seconds / tokens * 1e6, **phases})
        print(f"run {repeat}: {tokens} tokens, {tokens / seconds:,.0f} tok/s", file=sys.stderr)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    peer = None
    if args.peer and calls:
        from processor_replay import replay
        from transformers import AutoTokenizer

        times = replay(engine, prompts, [r.outputs[0].token_ids for r in results], calls, args.vocab,
                       AutoTokenizer.from_pretrained(str(model)))
        peer = {"steps": times.steps, "tokens": times.tokens, "infer_us_per_token": times.infer_s / times.tokens * 1e6,
                "transformers_us_per_token": times.peer_s / times.tokens * 1e6}
    if args.json:
        args.json.write_text(json.dumps({"device": device, "requests": args.requests, "vocab": args.vocab,
                                         "logits_processors": calls, "runs": runs, "median": median, "peer": peer},
                                        indent=2))
    print(f"\nhost overhead, {args.requests} requests on a minuscule model ({device}, vocabulary {args.vocab:,}"
          f"{', ' + ' '.join(name for name, _ in calls) if calls else ''}), median of {args.repeats}:")
    print(f"{'phase':<14}{'us/token':>10}")
    for phase in PHASES:
        print(f"{phase:<14}{median[phase]:>10.2f}")
    print(f"{'all':<14}{median['us_per_token']:>10.2f}   ({median['tok_per_s']:,.0f} tok/s)")
    if peer is not None:
        print(f"logits processors alone over {peer['steps']} replayed steps, us/token: infer "
              f"{peer['infer_us_per_token']:.2f}, transformers {peer['transformers_us_per_token']:.2f} (x"
              f"{peer['transformers_us_per_token'] / peer['infer_us_per_token']:.2f})")


if __name__ == "__main__":
    main()
