#!/usr/bin/env bash
# The GPU pass a session runs when it is lent a GPU: `oelm doctor --json`, the medium512 bench in fp32 and bf16, and a
# two-run papermill batch on GPU 0 ending in a report. Each step has its own time limit, so one that hangs still leaves
# the others' results. Everything lands in OUT (default gpu-check/): doctor.json, bench.json, logs, the batch's report.
#   bash tools/gpu_check.sh [OUT]          (in the repository root, with `oelm_nb` installed in python3's environment)
set -u
out=${1:-gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
oelm() { "$py" -m oelm_nb.app.cli "$@"; }
step() { echo; echo "=== $1 ($(date -u +%T))"; }

step 'machine'
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
"$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'

step 'oelm doctor --json'
timeout 200 "$py" -m oelm_nb.app.cli doctor --json "$out/doctor.json" 2>&1 | tee "$out/doctor.txt"
echo "doctor exit: ${PIPESTATUS[0]}"

step 'oelm bench --preset medium512, fp32 and bf16 in one run'
timeout 90 "$py" -m oelm_nb.app.cli bench --preset medium512 --dtypes float32,auto --batch-size 8 --steps 20 \
  --json > "$out/bench.json" 2> "$out/bench.err"
echo "bench exit: $?"; tail -5 "$out/bench.err"
"$py" - "$out/bench.json" <<'PY'
import json, sys
try: rows = json.load(open(sys.argv[1]))
except Exception as e: sys.exit(f'no bench JSON: {e}')
for r in rows:
    print(f"{r['variant']:>12} {r['dtype']:>9}  {r['step_time_median_s']*1e3:8.2f} ms/step  "
          f"{r['tokens_per_s']:>10.0f} tok/s  MFU {r['fraction_of_peak']:.3f}  peak mem {r.get('peak_memory_bytes')}")
PY

step 'a two-run papermill batch on GPU 0'
timeout 120 "$py" -m oelm_nb.app.cli run qk-freeze --variants gpt,oelm-freeze --seeds 0 --steps 300 --gpus 0 \
  --out /tmp/gpu-batch 2>&1 | tee "$out/batch.txt" | tail -25
echo "batch exit: ${PIPESTATUS[0]}"
cp /tmp/gpu-batch/report.html "$out/" 2>/dev/null
for d in /tmp/gpu-batch/*/; do [ -f "$d/summary.json" ] && echo "$(basename "$d"): $(cat "$d/summary.json" | head -c 600)"; done
