#!/usr/bin/env bash
# HEAD on the H200: run_issue15 conf (every GPU case, the deferred case alone, memcheck,
# racecheck) and latency (the bench's call-mode check on its deferred variants), the
# Python GPU tests, then two rounds of the 12 MiB window's d2d A/B (default against
# spread_deep_max_mb=512 and spread_deep_kb=0). Into $OUT.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
ISSUE15_BUDGET=${B1:-270} bash "$here/run_issue15.sh" --bundle "$here" --steps ${STEPS:-conf,latency,summary} "$OUT/r16" > "$OUT/r16.stdout" 2>&1
echo "run_issue15 rc=$? at $((SECONDS - t0)) s"
grep -E '^conf |latency' "$OUT/r16/issue15.log" | head -12
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
PYTEST_S=${PYTEST_S:-140} OUT=$OUT bash "$here/run_gpu_pytest.sh" 2>&1 | tail -4
echo "pytest at $((SECONDS - t0)) s"
x=/tmp/x16; mkdir -p $x
all=$("$here/bin/kvf_bench" --list | paste -sd, -)
for r in 1 2; do
  timeout --signal=INT -k 10 ${AB_S:-60} "$here/bin/kvf_bench" --preset "$all" --tokens 256,4096 --directions d2d \
    --sms-device 0 --baselines limit --peers none --tune spread_deep_max_mb=512 --tune spread_deep_kb=0 \
    $( ((r > 1)) && echo --no-verify) --target-ms 10 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 \
    --enqueue-reps 0 --out $x/ab-$r.json --label "deep window ab $r" > $x/ab-$r.log 2>&1
  echo "ab $r rc=$? at $((SECONDS - t0)) s"
done
python3 "$here/tables.py" ab $x | tail -4
tar czf "$OUT/x16.tar.gz" -C $x .
