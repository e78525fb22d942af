"""The H200 anchor workload of issue 4, on infer and on HF transformers (static and continuous batching).

A Llama-3.2-1B-shaped model with random bf16 weights (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, vocab 128256, tied embeddings); 128 requests sent at once, prompts uniform over 32-512 tokens, outputs
lognormal(4.5, 0.9) clipped to 8-512, greedy, EOS ignored. ``random.Random(0)`` draws, for each request, the prompt
length (randint) then its tokens (randint(1, vocab - 1)), and after all prompts the output lengths: 36,840 prompt
and 18,530 output tokens. Then a single stream (one 128-token prompt, 256 tokens out) on infer and on HF.

Every arm runs through ``infer bench`` (the file workload), so the figures are the bench's own. Writes JSON under
``--out`` and prints a short table last. ``--smoke`` shrinks everything to check the script on a CPU.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

FULL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1024, max_position_embeddings=2048)


def anchor_requests(vocab: int, count: int = 128, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(32, 512)
        prompts.append([rng.randint(1, vocab - 1) for _ in range(length)])
    outputs = [int(min(512, max(8, rng.lognormvariate(4.5, 0.9)))) for _ in range(count)]
    return list(zip(prompts, outputs))


def build_model(folder: Path, shape: dict[str, int], device: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.models.tiny import train_tokenizer

    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(**shape, tie_word_embeddings=True, rms_norm_eps=1e-5, torch_dtype="bfloat16",
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    train_tokenizer(folder, vocab_size=1024)  # prompts are token ids; the tokenizer only detokenizes
    return folder


def run_bench(model: Path, out: Path, arms: list[str], bench_args: list[str], warmup: int) -> dict:
    cmd = [sys.executable, "-m", "infer.cli", "--model", str(model), "bench", *bench_args, "--ab", *arms,
           "--repeats", "1", "--warmup-rounds", str(warmup), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def output_tps(result: dict) -> dict[str, float]:
    return {arm["text"]: arm["summary"]["output_tokens_per_s"]["median"] for arm in result["arms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/infer-anchor-1b"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and 8 requests, to check on a CPU")
    parser.add_argument("--skip-hf", action="store_true", help="only infer (HF takes ~2 minutes on an H200)")
    parser.add_argument("--copy-gbps", type=float, default=4120.0, help="measured copy bandwidth, read+write")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SMOKE if args.smoke else FULL
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("the anchor benchmark needs a CUDA GPU; use --smoke to check the script on a CPU")
    model = build_model(args.model_dir.with_name(args.model_dir.name + ("-smoke" if args.smoke else "")), shape,
                        device)
    requests = anchor_requests(shape["vocab_size"], 8 if args.smoke else 128)
    workload = args.out / "anchor.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n" for p, n in requests))
    file_args = ["--workload", "file", "--file", str(workload)]
    single_args = ["--workload", "random", "--num-requests", "1", "--input-len", "128", "--output-len",
                   "32" if args.smoke else "256", "--len-sigma", "0"]
    infer_arm = "--no-prefix-caching"  # random prompts; the warm-up round must not serve the measured one
    results = {"anchor_infer": run_bench(model, args.out / "anchor_infer", [infer_arm], file_args, warmup=1),
               "single_infer": run_bench(model, args.out / "single_infer", [infer_arm], single_args, warmup=1)}
    if not args.skip_hf:
        results["anchor_hf"] = run_bench(model, args.out / "anchor_hf", ["hf:static", "hf:cb"],
                                         file_args + ["--hf-batch-size", "32"], warmup=0)
        results["single_hf"] = run_bench(model, args.out / "single_hf", ["hf:static"],
                                         single_args + ["--hf-batch-size", "1"], warmup=0)
    weights_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    floor_tps = args.copy_gbps * 1e9 / weights_bytes  # one read of every weight per decode step
    summary = {"prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": sum(n for _, n in requests),
               "anchor_infer_tps": output_tps(results["anchor_infer"])[infer_arm],
               "single_infer_tps": output_tps(results["single_infer"])[infer_arm],
               "single_floor_tps": floor_tps}
    if "anchor_hf" in results:
        hf = output_tps(results["anchor_hf"])
        summary.update(anchor_hf_static_tps=hf["hf:static"], anchor_hf_cb_tps=hf["hf:cb"],
                       single_hf_tps=output_tps(results["single_hf"])["hf:static"])
    (args.out / "anchor_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nanchor: {summary['prompt_tokens']} prompt / {summary['output_tokens']} output tokens")
    print(f"{'system':<34}{'output tok/s':>14}{'ratio':>10}")
    rows = [("infer (anchor)", summary["anchor_infer_tps"])]
    if "anchor_hf_cb_tps" in summary:
        rows += [("HF generate static, batch 32", summary["anchor_hf_static_tps"]),
                 ("HF continuous batching", summary["anchor_hf_cb_tps"])]
    for name, value in rows:
        ratio = summary["anchor_infer_tps"] / value if value else float("nan")
        print(f"{name:<34}{value:>14.1f}{ratio:>10.2f}")
    print(f"{'infer single stream':<34}{summary['single_infer_tps']:>14.1f}"
          f"{summary['single_infer_tps'] / floor_tps:>10.2f}  (fraction of the {floor_tps:.0f} tok/s floor)")
    if "single_hf_tps" in summary:
        print(f"{'HF single stream':<34}{summary['single_hf_tps']:>14.1f}")


if __name__ == "__main__":
    main()
