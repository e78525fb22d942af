#!/usr/bin/env bash
# The one prepared GPU run (about 8 minutes on an H200; the timeouts below sum to 12.5): install infer into the device image's Python, run
# `pytest -m gpu`, then the benchmarks. Full logs go under $OUT; a short table is printed last.
#   run: bash benchmarks/gpu_check.sh            (the device tool sets $OUT; elsewhere a temp folder is used)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

# The device has no registry access: install without dependencies or build isolation (the image has them).
# Test modules that need packages the image lacks (grpcio-health-checking, ...) fail to collect; the gpu tests
# still run (--continue-on-collection-errors).
$PY -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
$PY - <<'PY' | tee "$OUT/versions.txt"
import torch, triton, transformers
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$OUT/nvidia-smi.csv" 2>&1

timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 90 --continue-on-collection-errors > "$OUT/pytest_gpu.log" 2>&1
note "pytest -m gpu: $(tail -1 "$OUT/pytest_gpu.log")"

timeout 60 $PY benchmarks/kernel_bench.py > "$OUT/kernel_bench.jsonl" 2> "$OUT/kernel_bench.err"
copy_gbps=$($PY -c "import json,sys
for line in open('$OUT/kernel_bench.jsonl'):
    row = json.loads(line)
    if 'copy' in json.dumps(row): print(row.get('gbps', 4120)); break" 2>/dev/null || echo 4120)
note "kernel bench: $(wc -l < "$OUT/kernel_bench.jsonl") rows (copy ${copy_gbps} GB/s)"

timeout 300 $PY benchmarks/throughput.py --preset anchor --out "$OUT/anchor" --copy-gbps "${copy_gbps:-4120}" > "$OUT/anchor.log" 2>&1
note "anchor: exit $?"

# issue 3 on the GPU: TTFT with prefix caching against without (target >= 8x), on the anchor's model
timeout 90 $PY -m infer.cli --model "${TMPDIR:-/tmp}/infer-throughput-anchor" bench --workload shared-prefix \
  --num-requests 32 --prefix-len 1000 --question-len 100 --output-len 16 --rate 16 --ab "" "--no-prefix-caching" \
  --repeats 2 --out "$OUT/shared_prefix" > "$OUT/shared_prefix.log" 2>&1
note "shared-prefix: exit $?"

timeout 90 $PY benchmarks/quant_bench.py > "$OUT/quant_bench.log" 2>&1
note "quant_bench: exit $?"
timeout 60 $PY benchmarks/spec_bench.py --device cuda > "$OUT/spec_bench.log" 2>&1
note "spec_bench: exit $?"

echo; echo "== kernel micro-benchmarks (decode attention GB/s vs copy) =="
cat "$OUT/kernel_bench.jsonl"
echo; echo "== anchor and single stream =="
tail -8 "$OUT/anchor.log"
echo; echo "== shared prefix (TTFT, hit rate) =="; grep -E "TTFT|hit rate|^A:|^B:" "$OUT/shared_prefix/table.txt"
echo; echo "== quantization =="; tail -12 "$OUT/quant_bench.log"
echo; echo "== speculative decoding =="; tail -8 "$OUT/spec_bench.log"
echo; echo "== summary =="; cat "$summary"
