#!/usr/bin/env bash
# The prepared GPU run: install infer into the device image's Python, then the named stages (default: all but
# quant). Full logs go under $OUT; a short table is printed last. One device call is capped at 600 s, so:
#   bash benchmarks/gpu_check.sh             tests kernels anchor prefix spec  (timeouts sum to 510 s; ~7 min expected)
#   bash benchmarks/gpu_check.sh quant host  quant_bench.py and host_overhead.py, a second call (340 s; ~4 min)
# The device tool sets $OUT; elsewhere a temp folder is used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
STAGES=${*:-tests kernels anchor prefix spec}
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }

# The device has no registry access: install without dependencies or build isolation (the image has them); where
# the image's site-packages is not writable, into a folder on PYTHONPATH instead.
if ! $PY -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  $PY -m pip install --no-deps --no-build-isolation --target /tmp/infer-site . >> "$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/infer-site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'PY' | tee "$OUT/versions.txt"
import torch, triton, transformers
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$OUT/nvidia-smi.csv" 2>&1

if want tests; then
  # modules that need packages the image lacks fail to collect; the gpu tests still run
  timeout 110 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --continue-on-collection-errors \
    > "$OUT/pytest_gpu.log" 2>&1
  note "pytest -m gpu: $(tail -1 "$OUT/pytest_gpu.log")"
fi

copy_gbps=4120
if want kernels; then
  timeout 35 $PY benchmarks/kernel_bench.py > "$OUT/kernel_bench.jsonl" 2> "$OUT/kernel_bench.err"
  copy_gbps=$($PY -c "import json
for line in open('$OUT/kernel_bench.jsonl'):
    row = json.loads(line)
    if 'copy' in json.dumps(row): print(row.get('gbps', 4120)); break" 2>/dev/null || echo 4120)
  note "kernel bench: $(wc -l < "$OUT/kernel_bench.jsonl") rows (copy ${copy_gbps:-4120} GB/s)"
fi

if want anchor; then  # infer (and without async output), HF static and HF continuous batching, then single streams
  timeout 270 $PY benchmarks/throughput.py --preset anchor --out "$OUT/anchor" --copy-gbps "${copy_gbps:-4120}" \
    --extra-arm=--no-async-output > "$OUT/anchor.log" 2>&1
  note "anchor: exit $?"
fi

if want prefix; then  # issue 3 on the GPU: TTFT with prefix caching against without (target >= 8x)
  timeout 50 $PY -m infer.cli --model "${TMPDIR:-/tmp}/infer-throughput-anchor" bench --workload shared-prefix \
    --num-requests 32 --prefix-len 1000 --question-len 100 --output-len 16 --rate 16 --ab "" "--no-prefix-caching" \
    --repeats 2 --out "$OUT/shared_prefix" > "$OUT/shared_prefix.log" 2>&1
  note "shared-prefix: exit $?"
fi

if want spec; then  # issue 6: single-stream speedup for K in {2, 4, 6} with the shipped pair
  timeout 45 $PY benchmarks/spec_bench.py --device cuda --repeats 2 > "$OUT/spec_bench.log" 2>&1
  note "spec_bench: exit $?"
fi

if want quant; then  # issue 5
  timeout 280 $PY benchmarks/quant_bench.py > "$OUT/quant_bench.log" 2>&1
  note "quant_bench: exit $?"
fi

if want host; then  # host time per output token by engine phase, on a minuscule model
  timeout 60 $PY benchmarks/host_overhead.py --device cuda --json "$OUT/host_overhead.json" > "$OUT/host_overhead.log" 2>&1
  note "host_overhead: exit $?"
fi

want kernels && { echo; echo "== kernel micro-benchmarks (decode attention GB/s vs copy) =="; cat "$OUT/kernel_bench.jsonl"; }
want anchor && { echo; echo "== anchor and single stream =="; tail -9 "$OUT/anchor.log"; }
want prefix && { echo; echo "== shared prefix (TTFT, hit rate) =="
                 grep -E "TTFT|hit rate|^A:|^B:" "$OUT/shared_prefix/table.txt"; }
want spec && { echo; echo "== speculative decoding =="; tail -8 "$OUT/spec_bench.log"; }
want quant && { echo; echo "== quantization =="; tail -12 "$OUT/quant_bench.log"; }
want host && { echo; echo "== host overhead per output token =="; tail -8 "$OUT/host_overhead.log"; }
echo; echo "== summary =="; cat "$summary"
