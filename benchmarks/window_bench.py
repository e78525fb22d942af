"""Decode time per token with and without a sliding window, at a long context.

A random Mistral-shaped model (``--hidden`` wide, ``--layers`` deep, 8 heads, 2 KV heads) is written twice: once
with ``sliding_window`` ``--window``, once without. For each, a batch of ``--batch`` prompts of ``--context`` tokens
is prefilled, then ``--decodes`` greedy decode steps are timed (median ms per step, ``--repeats`` runs). The window
limits what each decode reads to the last ``--window`` keys; the KV cache keeps every position either way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def decode_ms(folder: Path, args: argparse.Namespace) -> float:
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    per_seq = -(-(args.context + args.decodes) // 16)
    engine = Engine(EngineConfig(model=str(folder), device=args.device, attention=args.attention or None,
                                 num_kv_blocks=args.batch * per_seq + 1, max_num_seqs=args.batch,
                                 max_num_batched_tokens=max(2048, args.context), cuda_graphs=False))
    params = SamplingParams(max_tokens=args.decodes + 1, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([(7 * i + j) % 1000 + 3 for j in range(args.context)], params)
    while any(seq.num_output_tokens == 0 for req in engine.requests.values() for seq in req.seqs):
        engine.step()  # the prefills
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", default="", help="the backend (default: the device's)")
    args = parser.parse_args()
    from infer.models.tiny import make_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("full", None), ("window", args.window)):
            folder = make_tiny_model(Path(tmp) / name, "mistral", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=8, num_kv_heads=2, intermediate_size=2 * args.hidden,
                                     max_position_embeddings=args.context + args.decodes + 16)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
            results[name] = [decode_ms(folder, args) for _ in range(args.repeats)]
    full, windowed = statistics.median(results["full"]), statistics.median(results["window"])
    print(json.dumps({"args": vars(args), "full_ms": results["full"], "window_ms": results["window"]}))
    print(f"decode step, batch {args.batch} at context {args.context}: full attention {full:.2f} ms, window "
          f"{args.window} {windowed:.2f} ms ({full / windowed:.2f}x)")


if __name__ == "__main__":
    main()
