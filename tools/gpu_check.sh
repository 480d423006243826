#!/usr/bin/env bash
# The GPU pass a session runs when it is lent a GPU: `oelm doctor --json`, the medium512 bench in fp32 and bf16 (one MFU
# basis), bf16 eager against torch.compile, a two-run papermill batch on GPU 0 ending in a report, and the scale ladder
# (qk-freeze at medium512, 3 variants x 2 seeds). Each step has its own time limit, so one that hangs still leaves the
# others' results. Everything lands in OUT (default gpu-check/): doctor.json, bench*.json, logs, the reports.
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
show_bench() {  # one line per row: time, tokens/s, MFU on the row's named basis, the measured peak beside it
"$py" - "$1" <<'PY'
import json, sys
try: rows = json.load(open(sys.argv[1]))
except Exception as e: sys.exit(f'no bench JSON: {e}')
for r in rows:
    if r.get('note'): print(f"{r['variant']:>12} {r['dtype']:>9} {r.get('mode', 'eager'):>8}  {r['note']}"); continue
    print(f"{r['variant']:>12} {r['dtype']:>9} {r.get('mode', 'eager'):>8}  {r['step_time_median_s']*1e3:8.2f} ms/step"
          f"  first step {r.get('first_step_s') or 0:7.2f} s  {r['tokens_per_s']:>10.0f} tok/s"
          f"  MFU {r['fraction_of_peak']:.3f} of {r['peak_source']}"
          f"  ({r.get('fraction_of_measured_peak') or 0:.3f} of the measured matmul peak)  peak mem {r.get('peak_memory_bytes')}")
PY
}
show_bench "$out/bench.json"

step 'oelm bench --preset medium512 --compile: bf16 eager and compiled in one run, batch 8 and 32'
for b in 8 32; do
  timeout 200 "$py" -m oelm_nb.app.cli bench --preset medium512 --variants gpt --no-reference --dtypes auto --compile \
    --batch-size $b --steps 20 --json > "$out/bench-compile-b$b.json" 2> "$out/bench-compile-b$b.err"
  echo "bench --compile batch $b exit: $?"; tail -3 "$out/bench-compile-b$b.err"; show_bench "$out/bench-compile-b$b.json"
done

step 'a two-run papermill batch on GPU 0'
timeout 120 "$py" -m oelm_nb.app.cli run qk-freeze --variants gpt,oelm-freeze --seeds 0 --steps 300 --gpus 0 \
  --out /tmp/gpu-batch 2>&1 | tee "$out/batch.txt" | tail -25
echo "batch exit: ${PIPESTATUS[0]}"
cp /tmp/gpu-batch/report.html "$out/" 2>/dev/null
for d in /tmp/gpu-batch/*/; do [ -f "$d/summary.json" ] && echo "$(basename "$d"): $(cat "$d/summary.json" | head -c 600)"; done

step 'the scale ladder: qk-freeze at medium512, gpt, oelm and oelm-freeze x 2 seeds, then the report'
# The Q/K freeze log's question measured at its own model size. The data are the embedded stories, generated here
# without a network, at the medium512 data preset's 10,000-token BPE vocabulary (40,000 training stories). The token
# budget per run is LADDER_STEPS (default 1500) x 8 x 512: in bf16 about 30-45 s of training per run on an H100 or
# H200, so six runs, their start-ups and the data preparation fit the step's limit. A run cut off by the limit leaves
# the finished ones, and `oelm report` renders what is there.
timeout 360 "$py" -m oelm_nb.app.cli run qk-freeze --preset medium512 --variants gpt,oelm,oelm-freeze --seeds 0 1 \
  --steps "${LADDER_STEPS:-1500}" --gpus 0 --set data.n_train_stories=40000 --set data.n_val_stories=2000 \
  --set train.warmup_steps=150 --set train.eval_every=300 --out /tmp/gpu-ladder 2>&1 | tee "$out/ladder.txt" | tail -25
echo "ladder exit: ${PIPESTATUS[0]}"
[ -f /tmp/gpu-ladder/report.html ] || timeout 90 "$py" -m oelm_nb.app.cli report /tmp/gpu-ladder 2>&1 | tail -3
cp /tmp/gpu-ladder/report.html "$out/ladder-report.html" 2>/dev/null
for d in /tmp/gpu-ladder/*/; do [ -f "$d/summary.json" ] && echo "$(basename "$d"): $(head -c 400 "$d/summary.json")"; done
