#!/usr/bin/env bash
# HEAD (the 12 MiB deep window) on the H200: the GPU cases the window and the launch-shape
# helper touch, run_issue15 chunk,latency,interf,served,summary, then one round of d2d at
# 4096 tokens on every preset under larger tasks and one CTA an SM. Into $OUT.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/*.xz "$here"/lib/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done; chmod +x "$here"/bin/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets KVF_TEST_PRESET_DIR=$here/presets
x=/tmp/x15; mkdir -p $x
t0=$SECONDS
timeout -k 5 ${CONF_S:-110} "$here/bin/test_xfer" \
  --gtest_filter='XferTuning.*:XferGpu.*:Presets/XferGpuConformance.*device*:Presets/XferGpuRoutes.*_device_spread*:-XferGpu.ConcurrentCallsFromThreadsOnOneContext' \
  > $x/conf.log 2>&1
echo "conf rc=$? $((SECONDS - t0)) s $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]' $x/conf.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \] .*\.' $x/conf.log | head -5
ISSUE15_BUDGET=${B1:-330} bash "$here/run_issue15.sh" --bundle "$here" --steps ${STEPS:-chunk,latency,interf,served,summary} "$OUT/r15" > "$OUT/r15.stdout" 2>&1
echo "run_issue15 rc=$? at $((SECONDS - t0)) s"
grep -E '^- |missed:|MISSED' "$OUT/r15/results.md" 2>/dev/null | grep -v 'enqueue one chunk ≤ 10 µs (each' | head -40
all=$("$here/bin/kvf_bench" --list | paste -sd, -)
timeout --signal=INT -k 10 ${AB_S:-90} "$here/bin/kvf_bench" --preset "$all" --tokens 256,4096 --directions d2d \
  --sms-device 0 --baselines limit --peers none --tune task_bytes=16384 --tune task_bytes=32768 --tune spread_kb=0 \
  --target-ms 10 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --enqueue-reps 0 \
  --out $x/ab-1.json --label "d2d task shape ab" > $x/ab-1.log 2>&1
echo "task ab rc=$? at $((SECONDS - t0)) s"
python3 "$here/tables.py" ab $x | tail -8
tar czf "$OUT/x15.tar.gz" -C $x .
