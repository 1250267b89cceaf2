#!/usr/bin/env bash
# The batch route's ramp behind an event just recorded (ramped_batch_copy asks stream_idle_soon):
# the new case on the build before (exp/test_xfer-old: expected to fail) and after; the batch and
# host-bound GPU cases and memcheck of the new case; latency alone and the one-chunk rows of
# the batch-route presets, kvf_bench before (exp/kvf_bench-old) and after alternating; then
# (CONF=1) run_issue15 conf. Into $OUT.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/*.xz "$here"/lib/*.xz "$here"/exp/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done
chmod +x "$here"/bin/* "$here"/exp/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets KVF_TEST_PRESET_DIR=$here/presets
x=/tmp/x19; mkdir -p $x; t0=$SECONDS
new_case=XferGpu.BatchCallsRampBehindAnEventJustRecorded
timeout -k 5 120 "$here/exp/test_xfer-old" --gtest_filter=$new_case > $x/case-old.log 2>&1
echo "old build, new case: rc=$? $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]' $x/case-old.log | tr '\n' ' ') $(grep -c 'dma_ops' $x/case-old.log) dma_ops failures"
grep -m3 -A2 "dma_ops" $x/case-old.log
timeout -k 5 150 "$here/bin/test_xfer" \
  --gtest_filter="$new_case:XferGpu.Batch*:XferGpu.HostBound*:XferGpu.RequestOfTheListedShape*:XferGpu.StagedGatherAlone*:XferGpu.DefaultRoutesForOneChunk:XferBatchRamp.*" \
  > $x/cases-new.log 2>&1
echo "new build, batch cases: rc=$? $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]' $x/cases-new.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \] .*\.' $x/cases-new.log | head -5
timeout -k 5 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$here/bin/test_xfer" --gtest_filter=$new_case > $x/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $x/memcheck.log)"
echo "tests at $((SECONDS - t0)) s"
p=deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,deepseek-v3-mla-dcp4-rank1,qwen3-next-like-hybrid
for r in 1 2; do
  for v in old new; do
    b="$here/bin/kvf_bench"; [[ $v == old ]] && b="$here/exp/kvf_bench-old"
    timeout -k 5 60 "$b" --mode latency --preset $p --tokens 256 --directions d2h,h2d --latency-reps 60 \
      --target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --enqueue-reps 9 --out $x/lat-$v-$r.json > $x/lat-$v-$r.log 2>&1 || echo "lat $v $r rc=$?"
  done
done
for v in old new; do
  b="$here/bin/kvf_bench"; [[ $v == old ]] && b="$here/exp/kvf_bench-old"
  timeout -k 5 90 "$b" --preset $p --tokens 256 --directions d2h,h2d --sms-pcie 0 --baselines limit,batch --peers none \
    --target-ms 12 --min-reps 5 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --max-batch-runs 16384 --enqueue-reps 9 \
    --out $x/chunk-$v.json > $x/chunk-$v.log 2>&1 || echo "chunk $v rc=$?"
done
echo "bench at $((SECONDS - t0)) s"
for f in $x/lat-*-1.log; do echo "== $f"; grep -E '^latency' $f | sed 's/ verify ok//'; done
tar czf "$OUT/x19.tar.gz" -C $x .
[[ ${CONF:-0} == 1 ]] || exit 0
ISSUE15_BUDGET=${B1:-230} bash "$here/run_issue15.sh" --bundle "$here" --steps conf,summary "$OUT/r19" > "$OUT/r19.stdout" 2>&1
echo "run_issue15 rc=$? at $((SECONDS - t0)) s"
grep -E '^conf ' "$OUT/r19/issue15.log" | head -5
