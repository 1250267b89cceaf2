#!/usr/bin/env bash
# The served path on a GPU machine (kvferryd + engine processes, cuMem IPC):
#   demo-all     `kvferry demo` on every visible GPU (one engine per GPU)
#   demo-one     `kvferry demo` on GPU 0 alone
#   sanitizer    `kvferry demo` (4096 tokens) with kvferryd under compute-sanitizer memcheck
#   kill         one engine per GPU registers with one kvferryd; STAT shows one import and
#                one alias per region each; SIGKILL engine 0: it is reaped to 0 while the
#                other engine keeps its registration
#   bench        perf/kvf_served_bench on GPU 0 (llama-3.1-8b fa nhd, 256 and 4096 tokens
#                per request, 1/8/64 in flight)
#   demo-512k    `kvferry demo --tokens 524288` on GPU 0: one 512k-token request round trip
#   multi        one kvferryd serving every GPU, kvf_served_bench on each GPU at once
#   cross        a host-backend engine stores, a GPU engine retrieves those objects (the
#                host lane's L1 is pinned when GPUs are served) and verifies every byte
# Binaries are built elsewhere and carried: BIN (kvferry, kvferryd, kvf_served_bench).
#
# Usage: tests/gpu/run_served_gpu.sh BIN_DIR [STEPS...]   (default: every step)
# Environment: OUT (logs; default /tmp/kvf-served-logs), COMPUTE_SANITIZER.
# Prints one PASS/FAIL line per step; exits 0 only when every step passed.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$(cd "${1:?usage: run_served_gpu.sh BIN_DIR [STEPS...]}" && pwd)
shift
STEPS=${*:-demo-all demo-one sanitizer kill bench demo-512k multi cross}
OUT=${OUT:-/tmp/kvf-served-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$REPO/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVF_PRESET_DIR="$REPO/geometry/presets"
export KVF_KVFERRYD="$BIN/kvferryd"
failed=0
result() { # result NAME STATUS
  if [ "$2" -eq 0 ]; then echo "PASS  $1"; else echo "FAIL  $1 (status $2, log $OUT/$1.log)"; failed=1; fi
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "gpus: $gpus; binaries: $BIN; logs: $OUT"

for step in $STEPS; do
  case $step in
    demo-all)
      timeout 500 "$BIN/kvferry" demo --keep > "$OUT/demo-all.log" 2>&1
      result demo-all $? ;;
    demo-one)
      CUDA_VISIBLE_DEVICES=0 timeout 400 "$BIN/kvferry" demo > "$OUT/demo-one.log" 2>&1
      result demo-one $? ;;
    sanitizer)
      SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)}
      wrapper="$OUT/kvferryd-memcheck.sh"
      # compute-sanitizer runs kvferryd as its child: the demo's SIGTERM must reach that child.
      cat > "$wrapper" <<EOF
#!/bin/bash
"$SAN" --tool memcheck --error-exitcode 9 --log-file "$OUT/memcheck-kvferryd.%p.log" "$BIN/kvferryd" "\$@" &
san=\$!
trap 'pkill -TERM -f "^$BIN/kvferryd --socket-dir"' TERM
while :; do wait \$san; st=\$?; kill -0 \$san 2>/dev/null || break; done
exit \$st
EOF
      chmod +x "$wrapper"
      CUDA_VISIBLE_DEVICES=0 KVF_KVFERRYD="$wrapper" timeout 500 "$BIN/kvferry" demo --tokens 4096 --keep \
        > "$OUT/sanitizer.log" 2>&1
      st=$?
      # The server must exit 0 (memcheck's --error-exitcode would make the demo fail) and report no error.
      if ! grep -h "ERROR SUMMARY" "$OUT"/memcheck-kvferryd.*.log >> "$OUT/sanitizer.log" 2>/dev/null; then st=${st:-1}; fi
      grep -hq "ERROR SUMMARY: 0 errors" "$OUT"/memcheck-kvferryd.*.log 2>/dev/null || st=1
      result sanitizer $st ;;
    kill)
      (
        set -e
        dir=$(mktemp -d /tmp/kvf-kill-XXXXXX)
        "$BIN/kvferryd" --socket-dir "$dir/sock" --devices all --l1-mb 2048 --heartbeat-timeout-ms 3000 \
          --log-level info 2> "$OUT/kill-kvferryd.log" &
        server=$!
        for _ in $(seq 100); do "$BIN/kvferry" stat --socket-dir "$dir/sock" >/dev/null 2>&1 && break; sleep 0.1; done
        n=$((gpus < 2 ? 1 : 2))
        pids=()
        for d in $(seq 0 $((n - 1))); do
          # stdin stays open (sleep) so the engine stays registered until killed.
          sleep 600 | "$BIN/kvferry" demo-engine --socket-dir "$dir/sock" --geometry "$REPO/geometry/presets/glm-like-hybrid.json" \
            --role store --name "gpu$d" --tokens 4096 --seed $((7 + d)) --device "$d" --notify-fd 3 \
            3> "$dir/notify$d" > "$OUT/kill-engine$d.log" 2>&1 &
          pids+=($!)
        done
        for d in $(seq 0 $((n - 1))); do
          for _ in $(seq 600); do [ -s "$dir/notify$d" ] && break; sleep 0.1; done
          [ -s "$dir/notify$d" ] || { echo "engine $d did not store"; exit 1; }
        done
        "$BIN/kvferry" stat --socket-dir "$dir/sock" --json | tee "$dir/before.json"
        # The engine is the last process of its pipeline; kill it by its name in the process list.
        epid=$(pgrep -f "demo-engine .*--name gpu0 " | head -n 1)
        echo "SIGKILL engine gpu0 (pid $epid)"
        kill -9 "$epid"
        for _ in $(seq 100); do
          "$BIN/kvferry" stat --socket-dir "$dir/sock" --json > "$dir/after.json"
          python3 - "$dir/after.json" "$n" <<'EOF' && break
import json, sys
s = json.load(open(sys.argv[1])); n = int(sys.argv[2])
sys.exit(0 if s["imports"] == n - 1 and s["registrations"]["active"] == n - 1 and s["leases"] == 0 else 1)
EOF
          sleep 0.1
        done
        cat "$dir/after.json"
        python3 - "$dir/before.json" "$dir/after.json" "$n" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1])); a = json.load(open(sys.argv[2])); n = int(sys.argv[3])
assert b["imports"] == n and b["aliases"] == 8 * n, b       # one allocation, 8 region views per engine
assert b["registrations"]["active"] == n, b
assert a["imports"] == n - 1 and a["aliases"] == 8 * (n - 1), a
assert a["registrations"]["active"] == n - 1 and a["leases"] == 0, a
assert a["l1"]["objects"] == b["l1"]["objects"] > 0, (a, b)  # L1 keeps what the dead engine stored
print("kill: OK (%d engines; after the kill: %d imports, %d aliases; L1 %d objects)" % (n, a["imports"], a["aliases"], a["l1"]["objects"]))
EOF
        pkill -f "demo-engine .*--socket-dir $dir/sock" || true
        kill -TERM $server
        wait $server
      ) > "$OUT/kill.log" 2>&1
      result kill $? ;;
    bench)
      (
        set -e
        for t in 256 4096; do
          q=1,8,64; r=64
          [ "$t" = 4096 ] && { q=1,8; r=16; }
          timeout 250 "$BIN/kvf_served_bench" --geometry "$REPO/geometry/presets/llama-3.1-8b-fa-nhd.json" \
            --device 0 --tokens-per-request $t --inflight $q --requests $r --rounds 5 --kvferryd "$BIN/kvferryd" \
            --json "$OUT/served-$t.jsonl"
        done
      ) > "$OUT/bench.log" 2>&1
      result bench $? ;;
    demo-512k)
      CUDA_VISIBLE_DEVICES=0 timeout 500 "$BIN/kvferry" demo --tokens 524288 > "$OUT/demo-512k.log" 2>&1
      result demo-512k $? ;;
    multi)
      (
        set -e
        dir=$(mktemp -d /tmp/kvf-multi-XXXXXX)
        "$BIN/kvferryd" --socket-dir "$dir/sock" --devices all --l1-mb 4096 --log-level info \
          2> "$OUT/multi-kvferryd.log" &
        server=$!
        for _ in $(seq 100); do "$BIN/kvferry" stat --socket-dir "$dir/sock" >/dev/null 2>&1 && break; sleep 0.1; done
        pids=()
        for d in $(seq 0 $((gpus - 1))); do
          timeout 250 "$BIN/kvf_served_bench" --geometry "$REPO/geometry/presets/llama-3.1-8b-fa-nhd.json" \
            --device "$d" --tokens-per-request 256 --inflight 8,64 --requests 64 --rounds 5 \
            --socket-dir "$dir/sock" --json "$OUT/multi-gpu$d.jsonl" > "$OUT/multi-gpu$d.log" 2>&1 &
          pids+=($!)
        done
        st=0
        for p in "${pids[@]}"; do wait "$p" || st=1; done
        "$BIN/kvferry" stat --socket-dir "$dir/sock"
        kill -TERM $server
        wait $server
        exit $st
      ) > "$OUT/multi.log" 2>&1
      result multi $? ;;
    cross)
      (
        set -e
        dir=$(mktemp -d /tmp/kvf-cross-XXXXXX)
        "$BIN/kvferryd" --socket-dir "$dir/sock" --devices all --log-level info 2> "$OUT/cross-kvferryd.log" &
        server=$!
        for _ in $(seq 100); do "$BIN/kvferry" stat --socket-dir "$dir/sock" >/dev/null 2>&1 && break; sleep 0.1; done
        g="$REPO/geometry/presets/glm-like-hybrid.json"
        # stdin at EOF: the host engine unregisters and exits once it has stored.
        "$BIN/kvferry" demo-engine --socket-dir "$dir/sock" --geometry "$g" --role store --name host \
          --tokens 4096 --seed 31 --device -1 < /dev/null
        "$BIN/kvferry" demo-engine --socket-dir "$dir/sock" --geometry "$g" --role restore --name "gpu0'" \
          --tokens 4096 --seed 31 --device 0
        "$BIN/kvferry" stat --socket-dir "$dir/sock"
        kill -TERM $server
        wait $server
      ) > "$OUT/cross.log" 2>&1
      result cross $? ;;
    *) echo "unknown step $step"; failed=1 ;;
  esac
done
# The demos' server logs (kept by --keep) next to the others.
for f in /tmp/kvferry-demo-*/kvferryd.log; do
  [ -f "$f" ] && cp "$f" "$OUT/kvferryd-$(basename "$(dirname "$f")").log"
done
exit $failed
