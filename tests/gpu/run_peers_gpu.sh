#!/usr/bin/env bash
# kvferryd peers on a GPU machine (issue 16, docs/peers.md): two kvferryd on
# one host serving GPU 0, peered over UCX on loopback; a GPU engine stores a
# prefix through kvferryd A, a GPU engine on kvferryd B restores it (B pulls
# every object from A) and verifies every byte.
#
#   tcp        UCX_TLS=tcp: store through A, restore through B, verified
#   sanitizer  the same with kvferryd B under compute-sanitizer memcheck
#              (its scatter reads the pulled objects from its pinned L1)
#   killed     A SIGKILLed while B pulls: B answers, keeps serving (a
#              second restore through B from a restarted A verifies)
#
# Binaries are built elsewhere and carried with the UCX libraries, as hwloc's:
#   tests/gpu/run_peers_gpu.sh --bundle BUILD_DIR DEST   (here: gathers bin/, lib/, lib/ucx/, presets/)
#   bash DEST/run_peers_gpu.sh DEST [STEPS...]           (there; default: every step)
# Environment: OUT (logs; default $OUT or /tmp/kvf-peers-logs), COMPUTE_SANITIZER, DEVICE (the GPU;
# default 0; -1 runs the same steps on the host backend, to check the script without a GPU).
# Prints one PASS/FAIL line per step; exits 0 only when every step passed.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = "--bundle" ]; then
  set -e
  build=${2:?usage: run_peers_gpu.sh --bundle BUILD_DIR DEST}
  dest=${3:?usage: run_peers_gpu.sh --bundle BUILD_DIR DEST}
  mkdir -p "$dest/bin" "$dest/lib/ucx" "$dest/presets"
  cp "$build/tools/kvferryd" "$build/tools/kvferry" "$dest/bin/"
  for b in "$dest"/bin/*; do
    ldd "$b" | awk '/libjansson|libhwloc|libucp|libuct|libucs|libucm|libcrypto/ {print $3}' |
      while read -r lib; do [ -f "$lib" ] && cp -L "$lib" "$dest/lib/"; done
  done
  # UCX loads its transports as modules from <dir of libucs>/ucx.
  ucs=$(ldd "$build/tools/kvferryd" | awk '/libucs\.so/ {print $3}')
  for m in "$(dirname "$ucs")"/ucx/libuct_*.so.0 "$(dirname "$ucs")"/ucx/libucm_*.so.0; do
    [ -f "$m" ] && cp -L "$m" "$dest/lib/ucx/"
  done
  cp "$here/../../geometry/presets/"*.json "$dest/presets/"
  cp "$here/run_peers_gpu.sh" "$dest/"
  git -C "$here" rev-parse --short=12 HEAD > "$dest/COMMIT" 2>/dev/null || true
  du -sh "$dest"
  exit 0
fi

DEST=$(cd "${1:?usage: run_peers_gpu.sh BUNDLE_DIR [STEPS...]}" && pwd)
shift
STEPS=${*:-tcp sanitizer killed}
OUT=${OUT:-/tmp/kvf-peers-logs}
mkdir -p "$OUT"
BIN=$DEST/bin
export LD_LIBRARY_PATH="$DEST/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVF_PRESET_DIR="$DEST/presets"
export UCX_TLS=${UCX_TLS:-tcp}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer 2>/dev/null || true)}
[ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SAN=/usr/local/cuda/bin/compute-sanitizer
G=$KVF_PRESET_DIR/llama-3.1-8b-fa-nhd.json
DEVICE=${DEVICE:-0}
DEVICES=$DEVICE
[ "$DEVICE" = "-1" ] && DEVICES=none
failed=0
result() { # result NAME STATUS
  if [ "$2" -eq 0 ]; then echo "PASS  $1"; else echo "FAIL  $1 (status $2, log $OUT/$1.log)"; failed=1; fi
}
echo "commit $(cat "$DEST/COMMIT" 2>/dev/null); gpus: $(nvidia-smi -L 2>/dev/null | wc -l); UCX_TLS=$UCX_TLS; logs: $OUT"
ldd "$BIN/kvferryd" | grep -i "not found" && failed=1

work=$(mktemp -d /tmp/kvf-peers-gpu-XXXXXX)
head -c 32 /dev/urandom | base64 > "$work/secret"
chmod 600 "$work/secret"
port=$((20000 + $$ % 10000))

start_a() { # start_a LOG [WRAPPER...]
  local log=$1; shift
  "$@" "$BIN/kvferryd" --socket-dir "$work/a" --devices "$DEVICES" --l1-mb 4096 --listen 127.0.0.1:$port \
    --peer-secret-file "$work/secret" --log-level info 2>> "$log" &
  A=$!
  for _ in $(seq 300); do "$BIN/kvferry" stat --socket-dir "$work/a" > /dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}
start_b() { # start_b LOG [WRAPPER...]
  local log=$1; shift
  "$@" "$BIN/kvferryd" --socket-dir "$work/b" --devices "$DEVICES" --l1-mb 4096 --peer 127.0.0.1:$port \
    --peer-secret-file "$work/secret" --log-level info 2>> "$log" &
  B=$!
  for _ in $(seq 600); do "$BIN/kvferry" stat --socket-dir "$work/b" 2> /dev/null | grep -q " ready " && return 0; sleep 0.1; done
  return 1
}
engine() { # engine DIR ROLE NAME SEED
  "$BIN/kvferry" demo-engine --socket-dir "$1" --geometry "$G" --role "$2" --name "$3" --tokens 8192 \
    --seed "$4" --device "$DEVICE" < /dev/null
}
stop_all() {
  # Under compute-sanitizer, B is the sanitizer and kvferryd its child: the
  # child gets the SIGTERM (the sanitizer does not pass it on), the sanitizer
  # then exits with kvferryd's status or its own error exit code. A is stopped
  # whatever B's status (the steps run under set -e).
  local rb=0
  if [ -n "${B:-}" ]; then
    if pgrep -P "$B" > /dev/null 2>&1; then pkill -TERM -P "$B"; else kill -TERM "$B" 2> /dev/null; fi
    wait "$B" || rb=$?
  fi
  if [ -n "${A:-}" ]; then kill -TERM "$A" 2> /dev/null; wait "$A" || true; fi
  B=; A=
  return $rb
}

for step in $STEPS; do
  case $step in
    tcp)
      (
        set -e
        start_a "$OUT/tcp-a.log"
        start_b "$OUT/tcp-b.log"
        engine "$work/a" store gpu0-prefill 41
        engine "$work/b" restore gpu0-decode 41
        "$BIN/kvferry" stat --socket-dir "$work/b"
        "$BIN/kvferry" stat --socket-dir "$work/b" --json | grep -q '"objects_pulled": [1-9]'
        stop_all
      ) > "$OUT/tcp.log" 2>&1
      result tcp $? ;;
    sanitizer)
      if [ -z "$SAN" ]; then echo "SKIP  sanitizer (no compute-sanitizer)"; continue; fi
      (
        set -e
        start_a "$OUT/sanitizer-a.log"
        start_b "$OUT/sanitizer-b.log" "$SAN" --tool memcheck --error-exitcode 9 --target-processes all
        engine "$work/a" store gpu0-prefill 43
        engine "$work/b" restore gpu0-decode 43
        # The sanitizer's own exit status may not be kvferryd's ("couldn't find
        # exit code"): its summary decides.
        stop_all || true
        grep -hq "ERROR SUMMARY: 0 errors" "$OUT/sanitizer.log" "$OUT/sanitizer-b.log"
        ! grep -hq "ERROR SUMMARY: [1-9]" "$OUT/sanitizer.log" "$OUT/sanitizer-b.log"
      ) > "$OUT/sanitizer.log" 2>&1
      result sanitizer $? ;;
    killed)
      (
        set -e
        start_a "$OUT/killed-a.log"
        start_b "$OUT/killed-b.log"
        engine "$work/a" store gpu0-prefill 45
        # A dies while B pulls: the restore reports what it restored (it may
        # fail verification of a shorter prefix: that is the engine's report,
        # not the test's), B keeps serving.
        ( for _ in $(seq 1000); do grep -q "asking" "$OUT/killed-b.log" && break; sleep 0.01; done
          kill -KILL "$A" ) &
        engine "$work/b" restore gpu0-decode 45 || true
        wait "$A" 2> /dev/null || true
        A=
        "$BIN/kvferry" stat --socket-dir "$work/b"
        "$BIN/kvferry" stat --socket-dir "$work/b" --json | grep -q '"in_flight": 0'
        rm -f "$work/a/kvferryd.sock"
        start_a "$OUT/killed-a2.log"
        for _ in $(seq 300); do "$BIN/kvferry" stat --socket-dir "$work/b" | grep -q " ready " && break; sleep 0.1; done
        engine "$work/a" store gpu0-prefill 47
        engine "$work/b" restore gpu0-decode 47
        stop_all
      ) > "$OUT/killed.log" 2>&1
      result killed $? ;;
    *) echo "unknown step $step"; failed=1 ;;
  esac
  # A step's subshell that failed may have left its servers running (their
  # pids were the subshell's): stop whatever still serves this run's folders.
  pkill -TERM -f "kvferryd --socket-dir $work/" 2> /dev/null && sleep 1
  rm -rf "$work/a" "$work/b"
done
rm -rf "$work"
exit $failed
