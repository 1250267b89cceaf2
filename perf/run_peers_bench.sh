#!/usr/bin/env bash
# Pulls between two kvferryd peers (perf/kvf_peers_bench) against ucx_perftest's
# ucp_get of one object's size on the same transport, in the same run: tcp, then
# shared memory (KVF_PEER_SHM=1). Usage: perf/run_peers_bench.sh BUILD_DIR OUT_DIR
# (a build with -DKVF_BUILD_PERF=ON). Writes OUT_DIR/results.jsonl and prints it.
set -euo pipefail
build=${1:?build dir}
out=${2:?output dir}
mkdir -p "$out"
: > "$out/results.jsonl"
size=33554432 # one llama-3.1-8b canonical object of 256 tokens
perftest() { # TLS PORT
  (UCX_TLS=$1 timeout 120 ucx_perftest -t ucp_get -s $size -n 40 -w 4 -p "$2" >/dev/null 2>&1 &)
  sleep 1
  UCX_TLS=$1 timeout 120 ucx_perftest 127.0.0.1 -t ucp_get -s $size -n 40 -w 4 -p "$2" 2>/dev/null |
    awk -v tls="$1" -v size=$size '/^Final:/ {printf "{\"bench\": \"ucx_perftest-ucp_get\", \"ucx_tls\": \"%s\", \"object_bytes\": %d, \"gb_per_s\": %.3f, \"objects_per_s\": %.1f}\n", tls, size, $7 * 1048576 / 1e9, $9}'
}
for cfg in "tcp 0" "sm,self,tcp 1"; do
  set -- $cfg
  UCX_TLS=$1 KVF_PEER_SHM=$2 "$build/perf/kvf_peers_bench" --kvferryd "$build/tools/kvferryd" \
    --num-blocks 512 --tokens 4096 --rounds 5 2>/dev/null >> "$out/results.jsonl"
done
perftest tcp 24555 >> "$out/results.jsonl"
perftest sm,self 24556 >> "$out/results.jsonl"
cat "$out/results.jsonl"
