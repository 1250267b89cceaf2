#!/usr/bin/env bash
# Timelines (CUPTI) of the missed rows; the 4-SM straight part's size.
cd "$(dirname "$0")/.."
gunzip -f .gpu/bin/*.gz .gpu/lib/*.gz 2>/dev/null; chmod +x .gpu/bin/*
B=$PWD/.gpu
export LD_LIBRARY_PATH=$B/lib KVF_PRESET_DIR=$B/presets KVF_TEST_PRESET_DIR=$B/presets
W=/tmp/p12; mkdir -p $W/tr
C=(--target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --max-batch-runs 16384 --enqueue-reps 9)
T=(--baselines limit --peers none --no-sustained --min-reps 40 --max-reps 40 --target-ms 1 --warmup 1 --enqueue-reps 1)
tr() { local name=$1; shift; CUDA_INJECTION64_PATH=$B/lib/libkvf_trace.so KVF_TRACE_FILE=$W/tr/$name.csv timeout 120 "$@" --out $W/tr/$name.json > $W/tr/$name.log 2>&1; echo "trace $name rc $?"; }
tr glm-h2d-cap4 $B/bin/kvf_bench --preset glm-like-hybrid --tokens 256 --directions h2d --sms-pcie 4 "${T[@]}"
tr glm-h2d-cap0 $B/bin/kvf_bench --preset glm-like-hybrid --tokens 256 --directions h2d --sms-pcie 0 "${T[@]}"
tr mla-lat $B/bin/kvf_bench --mode latency --preset deepseek-v3-mla-bf16 --tokens 256 --directions d2h,h2d --latency-reps 40
tr hyb-d2d-4096 $B/bin/kvf_bench --preset qwen3-next-like-hybrid,glm-like-hybrid --tokens 4096 --directions d2d --sms-device 0 "${T[@]}"
ls -la $W/tr; gzip $W/tr/*.csv
for rep in 1 2; do
  timeout 150 $B/bin/kvf_bench --tokens 256 --directions d2h,h2d --sms-pcie 4 --baselines limit --peers none --no-sustained "${C[@]}" \
    --tune straight_kb=2048,cap=4 --tune straight_kb=1536,cap=4 --tune straight_kb=1024,cap=4 --out $W/cap4-straight-$rep.json > $W/cap4-straight-$rep.log 2>&1; echo "cap4 $rep rc $?"
done
tar czf $OUT/p12.tgz -C /tmp p12
