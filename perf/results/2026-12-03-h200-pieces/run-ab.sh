#!/usr/bin/env bash
# Pieces weighed by the bytes they move (b) against per-token weights (a): hybrids' staged rows; GPU tests.
cd "$(dirname "$0")/.."
gunzip -f .gpu/bin/*.gz .gpu/lib/*.gz 2>/dev/null; chmod +x .gpu/bin/*
B=$PWD/.gpu
export LD_LIBRARY_PATH=$B/lib KVF_PRESET_DIR=$B/presets KVF_TEST_PRESET_DIR=$B/presets
W=/tmp/p15; mkdir -p $W
P=glm-like-hybrid,gpt-oss-20b-like
C=(--target-ms 12 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --max-batch-runs 16384 --enqueue-reps 9)
for rep in 1 2; do
  for v in a b; do
    bin=$B/bin/kvf_bench; [[ $v == a ]] && bin=$B/bin/kvf_bench_a
    timeout 120 $bin --preset $P --tokens 256,4096 --directions d2h,h2d --sms-pcie 0,4 --baselines limit,batch --peers none "${C[@]}" \
      --out $W/ab-$v-$rep.json > $W/ab-$v-$rep.log 2>&1; echo "ab $v $rep rc $?"
  done
done
timeout 100 $B/bin/test_xfer --gtest_filter='XferPieces.*:XferStraight.*:*XferGpuRoutes*glm_like_hybrid*:*XferGpuRoutes*qwen3*:*XferGpuRoutes*gpt_oss*:XferGpu.Capped*:XferGpu.DefaultRoutes*:XferGpu.StagedCall*:XferGpu.Straight*' > $W/conf.log 2>&1; echo "conf rc $?"; grep -E "^\[  (PASSED|FAILED)" $W/conf.log
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 $B/bin/test_xfer --gtest_filter='*XferGpuRoutes*glm_like_hybrid_native*:XferGpu.Capped*' > $W/memcheck.log 2>&1; echo "memcheck rc $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" $W/memcheck.log | tail -3
tar czf $OUT/p15.tgz -C /tmp p15
