"""Throughput against HF transformers (static generate and continuous batching), in one run, on a fixed workload.

Presets:
- ``anchor`` (issue 4, needs CUDA): a Llama-3.2-1B-shaped model with random bf16 weights (hidden 2048, 16 layers,
  32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings); 128 requests sent at once, prompts
  uniform over 32-512 tokens, outputs lognormal(4.5, 0.9) clipped to 8-512, greedy, EOS ignored.
  ``random.Random(0)`` draws, for each request, the prompt length (randint) then its tokens (randint(1, vocab - 1)),
  and after all prompts the output lengths: 36,840 prompt and 18,530 output tokens. HF static runs batches of 32.
- ``cpu`` (issue 2): hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 512, float32; 64 requests, prompts
  uniform over 16-256, outputs lognormal(4.0, 0.8) clipped to 8-256, the same draw order. HF static: batches of 16.
- ``smoke``: tiny shapes and 8 requests, to check the script on a CPU.
Then a single stream (one 128-token prompt, 256 tokens out) on infer and on HF batch 1.

Every arm runs through ``infer bench`` (the file workload), so the figures are the bench's own. Writes JSON under
``--out`` and prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class Preset:
    shape: dict[str, int]
    dtype: str
    requests: int
    prompt_range: tuple[int, int]
    output_mu_sigma: tuple[float, float]
    output_range: tuple[int, int]
    hf_batch: int
    single_output: int


PRESETS = {
    "anchor": Preset(dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096),
                     "bfloat16", 128, (32, 512), (4.5, 0.9), (8, 512), 32, 256),
    "cpu": Preset(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=512, vocab_size=1024, max_position_embeddings=2048),
                  "float32", 64, (16, 256), (4.0, 0.8), (8, 256), 16, 128),
    "smoke": Preset(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1024, max_position_embeddings=2048),
                    "float32", 8, (32, 512), (4.5, 0.9), (8, 512), 32, 32),
}


HF_ARMS = ("static", "cb", "single")
INFER_FALLBACKS = ("", "--no-cuda-graphs", "--no-cuda-graphs --attention torch")


def workload_requests(preset: Preset, seed: int = 0) -> list[tuple[list[int], int]]:
    """Per request: the prompt length, then its tokens; after all prompts, the output lengths."""
    rng = random.Random(seed)
    vocab = preset.shape["vocab_size"]
    prompts = []
    for _ in range(preset.requests):
        length = rng.randint(*preset.prompt_range)
        prompts.append([rng.randint(1, vocab - 1) for _ in range(length)])
    low, high = preset.output_range
    outputs = [int(min(high, max(low, rng.lognormvariate(*preset.output_mu_sigma)))) for _ in prompts]
    return list(zip(prompts, outputs))


def build_model(folder: Path, shape: dict[str, int], dtype: str, device: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.models.tiny import train_tokenizer

    if list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")  # renamed when complete: a killed build is never reused
    shutil.rmtree(partial, ignore_errors=True)
    config = LlamaConfig(**shape, tie_word_embeddings=True, rms_norm_eps=1e-5, torch_dtype=dtype,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(partial))
    train_tokenizer(partial, vocab_size=1024)  # prompts are token ids; the tokenizer only detokenizes
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def run_bench(model: Path, out: Path, arms: list[str], bench_args: list[str], warmup: int) -> dict:
    cmd = [sys.executable, "-P", "-m", "infer.cli", "--model", str(model), "bench", *bench_args, "--ab", *arms,
           "--repeats", "1", "--warmup-rounds", str(warmup), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def run_arms(model: Path, out: Path, main_arm: str, extra_arms: dict[str, str], bench_args: list[str]
             ) -> dict[str, float | None]:
    """Output tok/s of the main arm and the extra arms, interleaved in one bench run; if that run fails, the main
    arm alone and then each extra arm in its own run, so a failing extra arm costs only its own figure (None)."""
    try:
        return output_tps(run_bench(model, out, [main_arm, *extra_arms.values()], bench_args, warmup=1))
    except subprocess.CalledProcessError:
        if not extra_arms:
            raise
        print("the interleaved run failed; running the arms one by one", file=sys.stderr)
    tps: dict[str, float | None] = dict(output_tps(run_bench(model, out / "main", [main_arm], bench_args, warmup=1)))
    for i, arm in enumerate(extra_arms.values()):
        try:
            tps.update(output_tps(run_bench(model, out / f"extra{i}", [arm], bench_args, warmup=1)))
        except subprocess.CalledProcessError as exc:
            print(f"arm {arm!r} failed (exit {exc.returncode}); see above", file=sys.stderr)
            tps[arm] = None
    return tps


def output_tps(result: dict) -> dict[str, float]:
    return {arm["text"]: arm["summary"]["output_tokens_per_s"]["median"] for arm in result["arms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="anchor")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the random model is built (reused)")
    parser.add_argument("--hf", default="static,cb,single", type=lambda s: [a for a in s.split(",") if a],
                        help="HF arms to run, comma-separated from static, cb, single; --hf= for none (HF static "
                             "takes ~1.5 minutes on an H200, continuous batching ~1)")
    parser.add_argument("--infer-options", default="", help="extra group options for the infer arm")
    parser.add_argument("--extra-arm", action="append", default=[], metavar="OPTIONS",
                        help="another infer arm on the anchor workload and the single stream: the infer arm's "
                             "options plus these (repeatable; arms take turns in one `infer bench --ab` run); "
                             "write --extra-arm=--async-scheduling")
    parser.add_argument("--copy-gbps", type=float, default=4120.0, help="measured copy bandwidth, read+write")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the model folder, print it, stop")
    parser.add_argument("--reuse-infer", action="store_true",
                        help="take infer's figures from --out's anchor_summary.json (an earlier run of this script "
                             "there) and run only the HF arms")
    args = parser.parse_args()
    if unknown := set(args.hf) - set(HF_ARMS):
        parser.error(f"--hf: unknown arm(s) {sorted(unknown)}; choose from {', '.join(HF_ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.preset]
    import tempfile

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.preset == "anchor":
        sys.exit("the anchor preset needs a CUDA GPU; use --preset cpu or --preset smoke on a CPU")
    folder = args.model_dir or Path(tempfile.gettempdir()) / f"infer-throughput-{args.preset}"
    model = build_model(folder, preset.shape, preset.dtype, device)
    if args.build_only:
        print(model)
        return
    requests = workload_requests(preset)
    if args.preset == "anchor":  # the issue's own figures: the draw order is reproduced exactly
        assert (sum(len(p) for p, _ in requests), sum(n for _, n in requests)) == (36840, 18530)
    workload = args.out / "anchor.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n" for p, n in requests))
    file_args = ["--workload", "file", "--file", str(workload)]
    single_args = ["--workload", "random", "--num-requests", "1", "--input-len", "128", "--output-len",
                   str(preset.single_output), "--len-sigma", "0"]
    # random prompts; the warm-up round must not serve the measured one from the prefix cache
    infer_arm = f"--no-prefix-caching --dtype {preset.dtype} {args.infer_options}".strip()
    weights_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    summary = {"prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": sum(n for _, n in requests),
               "single_floor_tps": args.copy_gbps * 1e9 / weights_bytes,  # one read of every weight per step
               "extra_arms_tps": {}, "single_extra_arms_tps": {}}  # keyed by the added options
    summary_file = args.out / "anchor_summary.json"
    if args.reuse_infer:
        if not summary_file.exists():
            sys.exit(f"--reuse-infer: {summary_file} does not exist; run this script with --out {args.out} first")
        summary = json.loads(summary_file.read_text())
    else:
        measure_infer(model, args.out, infer_arm, args.extra_arm, file_args, single_args, summary, summary_file)
    print_table(args.preset, summary, preset.hf_batch, device == "cuda")  # out before HF's long runs start
    if not args.hf:
        return
    hf_runs = {"static": ("anchor_hf_static_tps", "hf:static", file_args + ["--hf-batch-size", str(preset.hf_batch)]),
               "cb": ("anchor_hf_cb_tps", "hf:cb", file_args),
               "single": ("single_hf_tps", "hf:static", single_args + ["--hf-batch-size", "1"])}
    for key, arm, bench_args in (hf_runs[name] for name in HF_ARMS if name in args.hf):
        # each in its own process: one failing costs only its own figure
        try:
            summary[key] = output_tps(run_bench(model, args.out / key, [arm], bench_args, warmup=0))[arm]
        except subprocess.CalledProcessError as exc:
            print(f"{arm} ({key}) failed (exit {exc.returncode}); see above", file=sys.stderr)
            summary[key] = None
        summary_file.write_text(json.dumps(summary, indent=2))
    print_table(args.preset, summary, preset.hf_batch, device == "cuda")


def measure_infer(model: Path, out: Path, infer_arm: str, extras: list[str], file_args: list[str],
                  single_args: list[str], summary: dict, summary_file: Path) -> None:
    """infer's arms on the anchor workload, then on the single stream. If the main arm fails on the anchor workload,
    it is measured again without CUDA graphs, then also on the torch attention backend, and the table says so: a
    first GPU run still returns a figure and names the part that failed."""
    for fallback in INFER_FALLBACKS:
        arm = f"{infer_arm} {fallback}".strip()
        arms = {extra: f"{arm} {extra}" for extra in extras}
        try:
            tps = run_arms(model, out / ("anchor_infer" + fallback.replace(" ", "")), arm, arms, file_args)
            break
        except subprocess.CalledProcessError as exc:
            print(f"infer arm {arm!r} failed (exit {exc.returncode}); see above", file=sys.stderr)
    else:
        raise SystemExit("every infer arm failed on the anchor workload")
    summary.update(anchor_infer_tps=tps[arm], infer_fallback=fallback,
                   extra_arms_tps={extra: tps.get(a) for extra, a in arms.items()})
    summary_file.write_text(json.dumps(summary, indent=2))
    try:
        tps = run_arms(model, out / "single_infer", arm, arms, single_args)
    except subprocess.CalledProcessError as exc:
        print(f"infer single stream failed (exit {exc.returncode}); see above", file=sys.stderr)
        return
    summary.update(single_infer_tps=tps[arm], single_extra_arms_tps={extra: tps.get(a) for extra, a in arms.items()})
    summary_file.write_text(json.dumps(summary, indent=2))


def print_table(preset: str, summary: dict, hf_batch: int, on_gpu: bool) -> None:
    """Throughput of each system and infer's ratio to it; the rows measured so far."""
    infer_tps = summary["anchor_infer_tps"]
    fallback = summary.get("infer_fallback")
    rows = [(f"infer {fallback} (fallback)" if fallback else "infer", infer_tps)]
    rows += [(f"infer {extra}", tps) for extra, tps in summary["extra_arms_tps"].items()]
    rows += [(name, summary[key]) for name, key in ((f"HF generate static, batch {hf_batch}", "anchor_hf_static_tps"),
                                                     ("HF continuous batching", "anchor_hf_cb_tps")) if key in summary]
    print(f"\n{preset}: {summary['prompt_tokens']} prompt / {summary['output_tokens']} output tokens")
    print(f"{'system':<34}{'output tok/s':>14}{'ratio':>10}")
    for name, value in rows:
        if value is None:
            print(f"{name:<34}{'failed':>14}")
            continue
        print(f"{name:<34}{value:>14.1f}{infer_tps / value if value else float('nan'):>10.2f}")
    floor, single = summary["single_floor_tps"], summary.get("single_infer_tps")
    if single is not None:
        floor_note = (f"{single / floor:>10.2f}  (fraction of the {floor:.0f} tok/s bandwidth floor)" if on_gpu
                      else "")
        print(f"{'infer single stream':<34}{single:>14.1f}{floor_note}")
    for extra, tps in summary.get("single_extra_arms_tps", {}).items():
        name = "infer single stream " + extra
        print(f"{name:<34}{'failed':>14}" if tps is None else
              f"{name:<34}{tps:>14.1f}" + (f"{tps / floor:>10.2f}" if on_gpu else ""))
    if "single_hf_tps" in summary:
        hf_single = summary["single_hf_tps"]
        print(f"{'HF single stream':<34}" + (f"{'failed':>14}" if hf_single is None else f"{hf_single:>14.1f}"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
