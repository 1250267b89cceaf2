#!/usr/bin/env bash
# exp-prefetch: the deep spread prefetching its whole first round (--tune spread_prefetch_round=1)
# and the shallow spread everywhere (--tune spread_deep_kb=0) against the default, d2d, every
# preset, one chunk and 4096 tokens, three rounds; first the device conformance cases and
# the spread routes with the whole-round prefetch on every spread.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/test_xfer.xz "$here"/bin/kvf_bench.xz "$here"/lib/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done; chmod +x "$here"/bin/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
x=/tmp/x12; mkdir -p $x
KVF_XFER_SPREAD_PREFETCH_ROUND=1 KVF_XFER_SPREAD_DEEP_KB=1 timeout -k 5 ${CONF_S:-90} "$here/bin/test_xfer" \
  --gtest_filter='XferGpu.DefaultRoutesForOneChunk:XferGpu.Overlap*:Presets/XferGpuConformance.*device*:Presets/XferGpuRoutes.*_device_spread*' \
  > $x/conf.log 2>&1
echo "conf rc=$? $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]' $x/conf.log | tr '\n' ' ')"
grep -E '^\[  FAILED  \] .*\.' $x/conf.log | head -5
all=$("$here/bin/kvf_bench" --list | paste -sd, -)
for r in $(seq 1 ${ROUNDS:-3}); do
  timeout --signal=INT -k 10 ${AB_S:-120} "$here/bin/kvf_bench" --preset "$all" --tokens ${TOKENS:-256,4096} --directions d2d \
    --sms-device 0 --baselines limit --peers none --tune spread_prefetch_round=1 --tune spread_deep_kb=0 \
    --target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --enqueue-reps 0 \
    --out $x/ab-$r.json --label "exp-prefetch ab $r" > $x/ab-$r.log 2>&1
  echo "ab $r rc=$?"
done
python3 "$here/ab_dense.py" $x/ab-*.json | tail -6
tar czf "$OUT/x12.tar.gz" -C $x .
