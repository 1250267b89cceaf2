#!/usr/bin/env bash
# The 12 MiB deep window: the GPU cases it touches, run_issue15's chunk and latency steps,
# then a 2-round d2d A/B: default against --tune spread_deep_max_mb=512 (the old window) and
# spread_deep_kb=0 (shallow everywhere). Into $OUT/r15 and $OUT/x14.tar.gz.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/*.xz "$here"/lib/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done; chmod +x "$here"/bin/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
x=/tmp/x14; mkdir -p $x
timeout -k 5 ${CONF_S:-120} "$here/bin/test_xfer" \
  --gtest_filter='XferTuning.*:XferGpu.DefaultRoutesForOneChunk:XferGpu.Overlap*:Presets/XferGpuConformance.*device*:Presets/XferGpuRoutes.*_device_spread*' \
  > $x/conf.log 2>&1
echo "conf rc=$? $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]' $x/conf.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \] .*\.' $x/conf.log | head -5
ISSUE15_BUDGET=${B1:-200} bash "$here/run_issue15.sh" --bundle "$here" --steps ${STEPS:-chunk,latency,summary} "$OUT/r15" > "$OUT/r15.stdout" 2>&1
echo "run_issue15 rc=$?"
grep -E '^- |missed:|MISSED' "$OUT/r15/results.md" 2>/dev/null | grep -v 'enqueue one chunk ≤ 10 µs (each' | head -30
all=$("$here/bin/kvf_bench" --list | paste -sd, -)
for r in $(seq 1 ${ROUNDS:-2}); do
  v=""; ((r > 1)) && v=--no-verify
  timeout --signal=INT -k 10 ${AB_S:-100} "$here/bin/kvf_bench" --preset "$all" --tokens ${TOKENS:-256,384,4096} --directions d2d \
    --sms-device 0 --baselines limit --peers none --tune spread_deep_max_mb=512 --tune spread_deep_kb=0 $v \
    --target-ms 10 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --enqueue-reps 0 \
    --out $x/ab-$r.json --label "deep window ab $r" > $x/ab-$r.log 2>&1
  echo "ab $r rc=$?"
done
python3 "$here/ab_dense.py" $x/ab-*.json | tail -4
tar czf "$OUT/x14.tar.gz" -C $x .
