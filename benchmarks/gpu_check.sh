#!/usr/bin/env bash
# The prepared GPU run: install infer into the device image's Python, then the named stages. A short table is
# printed last; every log goes into $OUT/logs.tgz (the device tool returns at most 8 files from $OUT), rebuilt after
# each stage so that a run cut short still returns what finished. A failed stage prints its log's tail at once.
# One device call is capped at 600 s and a session has 15 device minutes in all, start-up included, so the stages
# run in order of importance under one deadline (DEADLINE_S, default 570 s from the start): each stage's limit is
# cut to the time left, a stage with too little left is not started, and the summary's last line names the stages
# still to run, for a second call on the still-warm machine (a machine idle for 30 s goes back, Triton's cache and
# the model folders with it):
#   bash benchmarks/gpu_check.sh        tests kernels profile anchor prefix spec quant host hfstatic
#   COPY_GBPS=N DEADLINE_S=T bash benchmarks/gpu_check.sh STAGE...   the stages left; COPY_GBPS: the first call's
#                                       measured copy bandwidth
#   (not run by default, when device time allows: prefix3k, shared-prefix with a 3,000-token prefix; beam, beam
#   search against HF generate(num_beams) with the shipped demo model, also with no-repeat-ngram; controls, host time
#   per output token with every request penalized, asking for prompt logprobs, or with a logits processor (128k
#   vocabulary); lora, LoRA adapters' cost on the anchor model;
#   structured, structured output (regex, GBNF grammar, JSON schema) with speculation, grammar-guided drafts,
#   unguided and jump-forward, with the shipped pair; embed, embedding requests against HF AutoModel's padded
#   batches on the anchor model; moe, the MoE experts (Triton grouped GEMMs, eager and graphed; the torch loop) against HF's on
#   Qwen3-30B-A3B and Mixtral-8x7B layer shapes)
# profile runs torch.profiler over the anchor model's prefill, extend and decode steps (kernels and host ops per
# step; Chrome traces in the logs). anchor measures infer (with and without merged projections, with the skinny
# GEMM) on the anchor workload and single stream, then HF continuous batching; hfstatic adds HF generate (static
# batches) and HF single stream to the same table.
# The device tool sets $OUT; elsewhere a temp folder is used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${*:-tests kernels profile anchor prefix spec quant host hfstatic}
DEADLINE=${DEADLINE_S:-570}
# logs, outside $OUT (only summary.txt and logs.tgz go there), kept on the machine for a second call: its
# hfstatic stage reads the anchor stage's figures, and its logs.tgz holds both calls' logs
WORK=${TMPDIR:-/tmp}/infer-gpu-check
mkdir -p "$WORK"
MODEL=${TMPDIR:-/tmp}/infer-throughput-anchor
summary="$OUT/summary.txt"
: > "$summary"
export PYTHONUNBUFFERED=1  # a stage cut off by its time limit still leaves its log
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: a hub lookup would only retry and stall
note() { echo "$*" | tee -a "$summary"; }
want() { [[ " $STAGES " == *" $1 "* ]] && CURRENT=$1; }
pack() { tar czf "$OUT/logs.tgz.tmp" -C "$WORK" . && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"; }
# stage NAME LOG TIMEOUT CMD...: run, note the exit status, show the log's tail on failure, repack the logs
# A stage is skipped when under MIN_STAGE_S would be left to it; the skipped stages are listed at the end.
MIN_STAGE_S=25
skipped=""
stage() {
  local name=$1 log=$WORK/$2 limit=$3; shift 3
  local left=$((DEADLINE - SECONDS - 5))
  if ((left < MIN_STAGE_S)); then
    note "$name: not run ($left s left before the deadline)"; skipped="$skipped $CURRENT"; return 125
  fi
  ((limit > left)) && limit=$left
  local start=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  note "$name: exit $rc$([[ $rc == 124 ]] && echo " (time limit ${limit}s)") in $((SECONDS - start)) s"
  [[ $rc != 0 ]] && { echo "---- tail of ${log##*/} ----"; tail -25 "$log"; echo "----"; }
  pack
  return $rc
}

# The device has no registry access: install without dependencies or build isolation (the image has them); where
# the image's site-packages is not writable, into a folder on PYTHONPATH instead.
if ! $PY -m pip install --no-deps --no-build-isolation -e . > "$WORK/install.log" 2>&1; then
  $PY -m pip install --no-deps --no-build-isolation --target /tmp/infer-site . >> "$WORK/install.log" 2>&1 \
    || { tail -20 "$WORK/install.log"; pack; exit 1; }
  export PYTHONPATH=/tmp/infer-site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'PY' | tee "$WORK/versions.txt" | tee -a "$summary"
import torch, triton, transformers
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$WORK/nvidia-smi.csv" 2>&1

if want tests; then
  # the server tests skip without grpc_health, which the image lacks (they hold no gpu test); any other module
  # that fails to collect is reported, and the gpu tests still run. -v: a run cut by its limit still names each
  # result (tracebacks come at the end). Cold Triton compiles of ~100 kernel variants took about a minute in one
  # process: pytest-xdist (on the image) spreads them over 8 (the gpu tests size their KV pools explicitly, so
  # they can share the card)
  parallel=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
  stage "pytest -m gpu" pytest_gpu.log 150 $PY -m pytest -m gpu -v --tb=short -p no:cacheprovider --timeout 90 \
    --continue-on-collection-errors $parallel
  note "pytest -m gpu: $(tail -1 "$WORK/pytest_gpu.log")"
fi

copy_gbps=${COPY_GBPS:-4120}
if want kernels; then
  # the engine's split count, then a sweep (the first run's 3 splits at batch 32 reached 67% of copy at 32k);
  # batch 128 at 512 tokens is the anchor's early decode steps
  stage "kernel bench" kernel_bench.jsonl 90 $PY benchmarks/kernel_bench.py --splits 0 8 16 32 64 \
    --batch 1 32 128 --context 512 4096 32768
  copy_gbps=$($PY -c "import json
for line in open('$WORK/kernel_bench.jsonl'):
    if not line.startswith('{'): continue  # stderr shares the log
    row = json.loads(line)
    if 'copy' in json.dumps(row): print(row.get('gbps', 4120)); break" 2>/dev/null || echo 4120)
  note "copy bandwidth: ${copy_gbps:-4120} GB/s"
fi

build_anchor() {  # the anchor model (random weights), built once per machine
  stage "anchor model" build.log 45 $PY benchmarks/throughput.py --preset anchor --model-dir "$MODEL" \
    --out "$WORK/build" --build-only
}

if want profile; then  # where a step's time goes: the first run's misses were explained from step timings alone
  build_anchor
  stage "profile" profile.log 100 $PY benchmarks/profile_steps.py --model-dir "$MODEL" --steps 8 --out "$WORK/traces"
fi

if want anchor; then  # infer (the CUDA defaults; without merged projections; with the skinny GEMM for decode
  # batches of up to 16) on the anchor workload and single stream, then HF CB (the first run measured async
  # scheduling against none: 1.39x; not repeated, for device time)
  stage "anchor (infer, HF CB)" anchor.log 300 $PY benchmarks/throughput.py --preset anchor --model-dir "$MODEL" \
    --out "$WORK/anchor" --copy-gbps "${copy_gbps:-4120}" --extra-arm=--no-fuse-projections \
    --extra-arm=--skinny-gemm-rows=16 --hf cb
fi

if want prefix; then  # issue 3 on the GPU: TTFT with prefix caching against without (target >= 8x), and with
  # prefill steps run eagerly (C: the first run's prefill steps cost ~8 ms whatever their size); then the same in
  # float32, where the outputs should match (half of them differed in bf16 in the first run); then a 3,500-token
  # prompt arriving among 16 decodes, whole against chunked (target: p99 TPOT <= 1.5x the steady TPOT)
  build_anchor
  shared=(bench --workload shared-prefix --num-requests 32 --prefix-len 1000 --question-len 100 --output-len 16
          --rate 16)
  stage "shared-prefix" shared_prefix.log 75 $PY -m infer.cli --model "$MODEL" "${shared[@]}" --repeats 3 \
    --ab "" "--no-prefix-caching" "--cuda-graph-max-tokens 0" --out "$WORK/shared_prefix"
  stage "shared-prefix fp32" shared_prefix_fp32.log 50 $PY -m infer.cli --model "$MODEL" --dtype float32 \
    "${shared[@]}" --ab "" "--no-prefix-caching" --repeats 1 --out "$WORK/shared_prefix_fp32"
  stage "long-prompt" long_prompt.log 50 $PY -m infer.cli --model "$MODEL" bench --workload long-prompt-arrival \
    --num-requests 16 --long-len 3500 --output-len 64 --repeats 2 --out "$WORK/long_prompt" \
    --ab "--scheduler continuous" "--scheduler chunked-prefill --max-num-batched-tokens 256"
fi

if want prefix3k; then  # not a default stage: the shared-prefix A/B with a 3,000-token prefix, where PERF's
  # arithmetic puts the 8x TTFT target within reach (about 2.6x at 1,000 tokens)
  build_anchor
  stage "shared-prefix 3k" shared_prefix_3k.log 60 $PY -m infer.cli --model "$MODEL" bench --workload shared-prefix \
    --num-requests 24 --prefix-len 3000 --question-len 100 --output-len 16 --rate 8 --repeats 2 \
    --ab "" "--no-prefix-caching" --out "$WORK/shared_prefix_3k"
fi

if want beam; then  # not a default stage: beam search (KV forks) against HF generate(num_beams) on the demo model
  stage "beam_bench" beam_bench.log 60 $PY benchmarks/beam_bench.py --device cuda --repeats 2
  stage "beam_bench no-repeat-ngram 3" beam_ngram.log 60 $PY benchmarks/beam_bench.py --device cuda --repeats 2 \
    --widths 4 --no-repeat-ngram 3
fi

if want embed; then  # not a default stage: embedding requests against HF AutoModel's padded batches, anchor model
  [[ -d $MODEL ]] || build_anchor
  stage "embed_bench" embed_bench.log 90 $PY benchmarks/embed_bench.py --model "$MODEL" --device cuda \
    --num-prompts 256 --repeats 2 --hf-batch 32
  stage "embed_bench shared instruction" embed_shared.log 90 $PY benchmarks/embed_bench.py --model "$MODEL" \
    --device cuda --num-prompts 256 --repeats 2 --hf-batch 32 --instruction-len 64
fi

if want moe; then  # not a default stage: one MoE layer's experts, infer's Triton and torch paths against HF's
  stage "moe_bench" moe_bench.log 90 $PY benchmarks/moe_bench.py --device cuda --tokens 1 16 128 1024
fi

if want lora; then  # not a default stage: LoRA adapters on the anchor model (loaded unused, 1 and 4 adapters)
  [[ -d $MODEL ]] || build_anchor
  stage "lora_bench" lora_bench.log 120 $PY benchmarks/lora_bench.py --model "$MODEL" --device cuda --requests 64 \
    --prompt-len 128 --max-tokens 128 --rounds 2
fi

if want spec; then  # issue 6: single-stream speedup for K in {2, 4, 6} with the shipped pair; K = 4 again with
  # each draft step its own forward pass (the A/B of the round graphs)
  stage "spec_bench" spec_bench.log 100 $PY benchmarks/spec_bench.py --device cuda --repeats 2 --step-by-step-ks 4
fi

if want quant; then  # issue 5; the sweep times the reworked AWQ kernel's tiles and split-K at M = 1 and 16, and
  # the skinny bf16 GEMM's against cuBLAS (issue 4: batch-1 GEMVs); FP8 at batch 256 too (compute-bound GEMMs)
  stage "quant_bench" quant_bench.log 280 $PY benchmarks/quant_bench.py --awq-sweep --batch 128 256
fi

if want host; then  # host time per output token by engine phase, on a minuscule model
  stage "host_overhead" host_overhead.log 60 $PY benchmarks/host_overhead.py --device cuda \
    --json "$WORK/host_overhead.json"
fi

if want controls; then  # what logit controls and prompt logprobs cost per output token on the device (untimed)
  for field in repetition_penalty=1.1 prompt_logprobs=0; do
    stage "host_overhead $field" "host_${field%%=*}.log" 60 $PY benchmarks/host_overhead.py --device cuda \
      --sampling "$field"
  done
  for processor in 'no-repeat-ngram={"size":3}' 'allowed-tokens={"token_ids":[5,6,7,8,9,10,11,12]}'; do
    stage "host_overhead ${processor%%=*}" "host_${processor%%=*}.log" 60 $PY benchmarks/host_overhead.py \
      --device cuda --vocab 128256 --logits-processor "$processor"
  done
fi

if want structured; then  # structured output with the draft model: guided drafts, unguided, none (untimed on a GPU)
  for guided in true false; do
    stage "structured_bench guided=$guided" "structured_$guided.log" 90 $PY benchmarks/structured_bench.py \
      --device cuda --vocab --spec-option structured=true --spec-option guided=$guided
  done
  stage "structured_bench jump-forward" "structured_jump.log" 60 $PY benchmarks/structured_bench.py --device cuda \
    --vocab --proposer jump-forward --num-speculative-tokens 6
fi

if want hfstatic; then  # HF generate (static batches of 32) and HF single stream beside the anchor stage's figures
  stage "HF static, HF single" anchor_hf.log 200 $PY benchmarks/throughput.py --preset anchor --model-dir "$MODEL" \
    --out "$WORK/anchor" --copy-gbps "${copy_gbps:-4120}" --reuse-infer --hf static,single
fi

show() { [[ -s $WORK/$2 ]] && { echo; echo "== $1 =="; tail -"$3" "$WORK/$2"; }; }
want kernels && [[ -s $WORK/kernel_bench.jsonl ]] && { echo; echo "== attention kernels =="
  $PY - "$WORK/kernel_bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
best = {}
for r in rows:
    if r.get("kernel") == "decode_attention":
        key = (r["batch"], r["context"])
        if r.get("splits_chosen_by") == "engine":
            best.setdefault(key, {})["engine"] = r
        if r["fraction_of_copy"] > best.setdefault(key, {}).get("best", {"fraction_of_copy": -1})["fraction_of_copy"]:
            best[key]["best"] = r
for (batch, context), pair in sorted(best.items()):
    e, b = pair.get("engine", {}), pair["best"]
    print(f"decode b{batch} ctx{context}: engine {e.get('num_splits')} splits {e.get('gbps')} GB/s "
          f"({e.get('fraction_of_copy')} of copy); best {b['num_splits']} splits {b['fraction_of_copy']}")
for r in rows:
    if r.get("kernel") == "prefill_attention":
        print(f"prefill b{r['batch']} q{r['query_len']} ctx{r['context']}: {r['tflops']} TFLOP/s"
              + (f", SDPA {r['sdpa_tflops']}" if "sdpa_tflops" in r else ""))
PY
}
want profile && show "ms per engine step (profile_steps.py)" profile.log 7
want anchor && show "anchor and single stream, infer against HF CB" anchor.log 12
want prefix && [[ -s $WORK/shared_prefix/table.txt ]] && { echo; echo "== shared prefix (TTFT, hit rate) =="
                 grep -E "TTFT|hit rate|outputs =|^A:|^B:|^C:" "$WORK/shared_prefix/table.txt"; }
want prefix && [[ -s $WORK/shared_prefix_fp32/table.txt ]] && { echo; echo "== shared prefix, float32 =="
                 grep -E "TTFT p50|outputs =" "$WORK/shared_prefix_fp32/table.txt"; }
want prefix3k && [[ -s $WORK/shared_prefix_3k/table.txt ]] && { echo; echo "== shared prefix, 3,000 tokens =="
                 grep -E "TTFT|hit rate|^A:|^B:" "$WORK/shared_prefix_3k/table.txt"; }
want prefix && [[ -s $WORK/long_prompt/table.txt ]] && { echo; echo "== long prompt among decodes =="
                 grep -E "TPOT|ITL p99|TTFT p99|^A:|^B:" "$WORK/long_prompt/table.txt"; }
want spec && show "speculative decoding" spec_bench.log 10
want beam && show "beam search against HF" beam_bench.log 5
want beam && show "beam search with no-repeat-ngram 3 against HF" beam_ngram.log 3
want lora && show "LoRA adapters" lora_bench.log 8
want moe && show "MoE experts against HF (ms per layer call)" moe_bench.log 9
want embed && show "embeddings against HF AutoModel" embed_bench.log 3
want embed && show "embeddings against HF AutoModel, 64-token shared instruction" embed_shared.log 3
want hfstatic && show "anchor and single stream, infer against HF" anchor_hf.log 9
want structured && show "structured output, guided drafts" structured_true.log 13
want structured && show "structured output, unguided drafts" structured_false.log 13
want structured && show "structured output, jump-forward drafts" structured_jump.log 13
want quant && show "quantization" quant_bench.log 52
want host && show "host overhead per output token" host_overhead.log 8
want controls && show "host overhead, repetition_penalty=1.1" host_repetition_penalty.log 8
want controls && show "host overhead, prompt_logprobs=0" host_prompt_logprobs.log 8
want controls && show "host overhead, no-repeat-ngram, vocab 128,256" host_no-repeat-ngram.log 8
want controls && show "host overhead, allowed-tokens, vocab 128,256" host_allowed-tokens.log 8
note "stages left:$(echo $skipped | tr " " "\n" | awk '!seen[$0]++' | tr "\n" " " | sed "s/^/ /;s/ $//")"
echo; echo "== summary =="; cat "$summary"
pack
