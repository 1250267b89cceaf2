#!/usr/bin/env bash
# Cache hints on the warp walk's loads and stores (KVF_WALK_HINTS builds of kvf_bench:
# h3 = ld.global.cs + st.global.cs, h4 = ld.global.L2::256B, h2 = st.global.cs) against
# the default (h0), d2d every preset at one chunk and 4096 tokens, rounds alternating;
# each variant verified once (d2d, d2h, h2d) against the CPU reference. Then Nsight
# Compute on qwen3-like's 4352-token d2d: kvferry's kernel and whatever the memcpy runs.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/*.xz "$here"/lib/*.xz "$here"/exp/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done
chmod +x "$here"/bin/* "$here"/exp/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
x=/tmp/x17; mkdir -p $x; t0=$SECONDS
cp "$here/bin/kvf_bench" "$here/exp/kvf_bench-h0"
all=$("$here/bin/kvf_bench" --list | paste -sd, -)
common="--sms-device 0 --baselines limit --peers none --target-ms 10 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --enqueue-reps 0"
for v in h0 h3 h4 h2; do
  timeout --signal=INT -k 10 60 "$here/exp/kvf_bench-$v" --preset "$all" --tokens 256 --directions d2h,h2d,d2d $common \
    --no-sustained --out $x/verify-$v.json > $x/verify-$v.log 2>&1
  echo "verify $v rc=$? $(grep -c 'verify ok' $x/verify-$v.log) ok $(grep -c 'verify FAIL' $x/verify-$v.log) fail at $((SECONDS - t0)) s"
done
for r in 1 2 3; do
  for v in h0 h3 h4 h2; do
    timeout --signal=INT -k 10 30 "$here/exp/kvf_bench-$v" --preset "$all" --tokens 256,4096 --directions d2d $common \
      --no-verify --out $x/ab-$v-$r.json > $x/ab-$v-$r.log 2>&1 || echo "ab $v $r rc=$?"
  done
  echo "round $r at $((SECONDS - t0)) s"
done
ncu_bin=$(command -v ncu 2>/dev/null || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
for v in h0 h3; do
  timeout -k 5 60 "$ncu_bin" --clock-control none --launch-skip 6 --launch-count 10 --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis \
    "$here/exp/kvf_bench-$v" --preset qwen3-next-like-hybrid --tokens 4096 --directions d2d --sms-device 0 --baselines limit \
    --peers none --no-sustained --enqueue-reps 0 --min-reps 3 --max-reps 3 --warmup 1 --target-ms 1 --no-verify \
    --out $x/ncu-$v.json > $x/ncu-$v.log 2>&1
  echo "ncu $v rc=$? $(grep -E '^  [a-zA-Z_<].*\(' $x/ncu-$v.log | sed 's/(.*//' | sort | uniq -c | tr -s ' ' | head -5 | tr '\n' ';')"
done
echo "done at $((SECONDS - t0)) s"
tar czf "$OUT/x17.tar.gz" -C $x .
