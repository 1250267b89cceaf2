#!/usr/bin/env bash
# The deep spread's payload window on this GPU: d2d, default (deep 8..512 MiB) against
# --tune spread_deep_kb=0 (shallow everywhere), payloads from 2 to about 200 MiB, ROUNDS
# rounds, rounds after the first unverified; then run_issue15's chunk step with the bench
# fixed for stale deferred contexts. Everything into $OUT/x13.tar.gz and $OUT/r15.
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in "$here"/bin/*.xz "$here"/lib/*.xz; do [[ -f $f ]] && xz -d -f "$f"; done; chmod +x "$here"/bin/*
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-} KVF_PRESET_DIR=$here/presets
x=/tmp/x13; mkdir -p $x
presets=${PRESETS:-glm-like-hybrid,gpt-oss-20b-like,deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,llama-3.1-8b-fp8-inline-scales,llama-3.1-8b-fa-nhd,llama-3.1-8b-fa-hnd,llama-3.1-70b-tp4-rank2-slice,qwen3-next-like-hybrid}
for r in $(seq 1 ${ROUNDS:-3}); do
  v=""; ((r > 1)) && v=--no-verify
  timeout --signal=INT -k 10 ${AB_S:-110} "$here/bin/kvf_bench" --preset "$presets" --tokens ${TOKENS:-64,128,192,256,384,512,768,1024,1536} \
    --directions d2d --sms-device 0 --baselines limit --peers none --tune spread_deep_kb=0 $v \
    --target-ms 10 --min-reps 3 --max-reps 60 --warmup 1 --max-memcpy-runs 1024 --enqueue-reps 0 \
    --out $x/sweep-$r.json --label "deep window sweep $r" > $x/sweep-$r.log 2>&1
  echo "sweep $r rc=$? $(grep -c 'verify ok' $x/sweep-$r.log) verified rows"
done
python3 "$here/ab_dense.py" $x/sweep-*.json | tail -4
tar czf "$OUT/x13.tar.gz" -C $x .
ISSUE15_BUDGET=${B1:-200} bash "$here/run_issue15.sh" --bundle "$here" --steps ${STEPS:-chunk,summary} "$OUT/r15" > "$OUT/r15.stdout" 2>&1
echo "run_issue15 rc=$?"
grep -E '^- |missed:|MISSED' "$OUT/r15/results.md" 2>/dev/null | head -40
