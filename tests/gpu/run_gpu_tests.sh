#!/usr/bin/env bash
# Run the GPU test binary on a GPU machine: once plainly, then under
# compute-sanitizer memcheck and racecheck (GPU kernel cases only). The
# binaries are built elsewhere and carried; no build tools are needed here.
#
# Usage: tests/gpu/run_gpu_tests.sh [path/to/test_xfer]
#   default binary: $KVF_TEST_XFER, else the first of build/, build-xfertests/,
#   build-lead/ (tests/test_xfer) under the repository root.
# Environment:
#   OUT                 where logs and gtest XML go (default /tmp/kvf-gpu-logs)
#   KVF_GPU_FILTER      gtest filter of the plain run (default: everything)
#   KVF_SAN_FILTER      gtest filter of the sanitizer runs
#                       (default: the GPU cases, without the timing check)
#   KVF_GPU_RUNS        runs to do, any of "plain memcheck racecheck" (default all three)
#   KVF_RUN_TIMEOUT     seconds per run (default 170: three runs fit in 10 minutes)
#   COMPUTE_SANITIZER   the compute-sanitizer binary (default: PATH, then /usr/local/cuda*/bin)
# Shared libraries the binary needs that the machine lacks (libhwloc.so.15,
# libjansson.so.4) are looked for in <repo>/.gpu/lib.
# Prints one summary line per run; exits 0 only when every run passed.
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/kvf-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$REPO/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The binary was built against another checkout's path: read presets from this one.
export KVF_TEST_PRESET_DIR="$REPO/geometry/presets"

BIN=${1:-${KVF_TEST_XFER:-}}
if [ -z "$BIN" ]; then
  for d in build build-xfertests build-lead; do
    if [ -x "$REPO/$d/tests/test_xfer" ]; then BIN="$REPO/$d/tests/test_xfer"; break; fi
  done
fi
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  echo "run_gpu_tests: no test_xfer binary (pass its path, or set KVF_TEST_XFER)" >&2
  exit 2
fi

PLAIN_FILTER=${KVF_GPU_FILTER:-*}
SAN_FILTER=${KVF_SAN_FILTER:-*XferGpu*:-*CallDoesNotSynchronize*}
RUNS=${KVF_GPU_RUNS:-plain memcheck racecheck}
LIMIT=${KVF_RUN_TIMEOUT:-170}

SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
  SAN=$(command -v compute-sanitizer 2>/dev/null || true)
  if [ -z "$SAN" ]; then
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
             /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
      if [ -x "$c" ]; then SAN=$c; break; fi
    done
  fi
fi

{
  echo "binary: $BIN"
  echo "repo: $REPO"
  echo "LD_LIBRARY_PATH: $LD_LIBRARY_PATH"
  command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  [ -n "$SAN" ] && "$SAN" --version | tail -n 1
  echo "--- ldd"
  ldd "$BIN"
} > "$OUT/environment.txt" 2>&1
if ldd "$BIN" | grep -q "not found"; then
  echo "run_gpu_tests: missing shared libraries (carry them in $REPO/.gpu/lib):" >&2
  ldd "$BIN" | grep "not found" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu: $(nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>&1 | paste -sd ';' -)"
else
  echo "gpu: nvidia-smi not found"
fi
echo "binary: $BIN; logs: $OUT"

# count PATTERN FILE: the number gtest prints in "[  PATTERN  ] N tests", or 0.
count() { sed -n "s/^\[  $1 *\] \([0-9][0-9]*\) tests\{0,1\}.*/\1/p" "$2" | tail -n 1 | grep . || echo 0; }

status=0
run() {  # run NAME FILTER [sanitizer args...]
  local name=$1 filter=$2
  shift 2
  local log="$OUT/$name.log" start end rc verdict extra=""
  start=$(date +%s)
  timeout -k 10 "$LIMIT" "$@" "$BIN" --gtest_filter="$filter" --gtest_output="xml:$OUT/$name.xml" \
    > "$log" 2>&1
  rc=$?
  end=$(date +%s)
  local passed failed skipped
  passed=$(count PASSED "$log"); failed=$(count FAILED "$log"); skipped=$(count SKIPPED "$log")
  case $name in
    memcheck) extra=" | $(grep -o 'ERROR SUMMARY: [0-9]* errors\{0,1\}' "$log" | tail -n 1)" ;;
    racecheck) extra=" | $(grep -o 'RACECHECK SUMMARY: .*' "$log" | tail -n 1)" ;;
  esac
  if [ "$rc" -eq 0 ]; then verdict=PASS; else verdict=FAIL; status=1; fi
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="FAIL (timed out after ${LIMIT} s)"
  printf '%-9s %s rc=%d  passed %s, failed %s, skipped %s  (%ss)%s  log: %s\n' \
    "$name" "$verdict" "$rc" "$passed" "$failed" "$skipped" "$((end - start))" "$extra" "$log"
  if [ "$rc" -ne 0 ]; then
    grep -E '^\[  FAILED  \] .*\(|^=+ (Invalid|Race|ERROR|Error|Leaked)|Program hit' "$log" | head -n 15 | sed 's/^/    /'
  fi
}

for r in $RUNS; do
  case $r in
    plain) run plain "$PLAIN_FILTER" ;;
    memcheck|racecheck)
      if [ -z "$SAN" ]; then
        printf '%-9s FAIL: compute-sanitizer not found (set COMPUTE_SANITIZER)\n' "$r"
        status=1
        continue
      fi
      if [ "$r" = memcheck ]; then
        run memcheck "$SAN_FILTER" "$SAN" --tool memcheck --leak-check full --error-exitcode 1 --print-limit 50
      else
        run racecheck "$SAN_FILTER" "$SAN" --tool racecheck --error-exitcode 1 --print-limit 50
      fi
      ;;
    *) echo "run_gpu_tests: unknown run '$r'" >&2; status=2 ;;
  esac
done
exit $status
