#!/usr/bin/env bash
# run_issue15 chunk,summary with a790df6's step options (chunk-4096 at 5 reps), then the
# one-chunk latency of the MLA caches d2h/h2d under the batch route's first call of 4 and
# 16 runs and staged (batch_min_run=1048576), twice. Into $OUT.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
ISSUE15_BUDGET=${B1:-200} bash "$here/run_issue15.sh" --bundle "$here" --steps chunk,summary "$OUT/r18" > "$OUT/r18.stdout" 2>&1
echo "run_issue15 rc=$? at $((SECONDS - t0)) s"
grep -E '^== chunk-4096' "$OUT/r18/issue15.log" | head -3
grep -E '^- |missed:|MISSED' "$OUT/r18/results.md" 2>/dev/null | grep -v 'µs, (staged|copy-batch)$' | head -30
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
x=/tmp/x18; mkdir -p $x
for r in 1 2; do
  timeout -k 5 60 "$here/bin/kvf_bench" --mode latency --preset deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,deepseek-v3-mla-dcp4-rank1 \
    --tokens 256 --directions d2h,h2d --latency-reps 60 --tune batch_first_runs=4 --tune batch_first_runs=16 \
    --tune batch_min_run=1048576 --target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --enqueue-reps 9 \
    --out $x/lat-$r.json > $x/lat-$r.log 2>&1
  echo "lat $r rc=$?"; grep -E "^latency|tune" $x/lat-$r.log
done
tar czf "$OUT/x18.tar.gz" -C $x .
