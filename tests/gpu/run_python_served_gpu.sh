#!/usr/bin/env bash
# kvferry.client on a GPU machine, with binaries built elsewhere and carried:
#   gpu   tests/python/test_client_gpu.py: a GPU engine's KV cache in kvferry's exportable
#         cuMem memory (CUDA through ctypes, no torch), registered with a real kvferryd serving
#         the GPU; STORE, RETRIEVE into other blocks, the whole cache checked to the byte
#         against host copies (4 geometries, 8 requests in flight, a ready event, GPU <-> host
#         engines, a RETRIEVE timed out under a 1 ms request timeout and then retired).
#         Every test must run: a skip counts as a failure here, except the LOOKUP/RETIRED
#         case on a library without kvf_client_lookup (i13-lookup), which is reported.
#   host  tests/python/test_client.py: the host-backend client tests with the same binaries
#         (skips allowed: LOOKUP/RETIRED cases skip on a library without them).
# Nothing is fetched or built here.
#
# Usage: tests/gpu/run_python_served_gpu.sh BUILD_DIR [gpu] [host]   (default: both)
#   BUILD_DIR: a CMake build directory holding libkvferry.so* and tools/kvferryd.
# Environment: OUT (logs, junit XML, kvferryd logs; default /tmp/kvf-pyserved-logs),
#   PYTHON (default python3: it needs numpy and pytest), KVF_TEST_DEVICE (default 0).
# Shared libraries the binaries need that the machine lacks (libhwloc.so.15,
# libjansson.so.4) are looked for in <repo>/.gpu/lib.
# Prints a preflight, then one PASS/FAIL line per run with pytest's summary;
# exits 0 only when every run passed.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=$(cd "${1:?usage: run_python_served_gpu.sh BUILD_DIR [gpu] [host]}" && pwd) || exit 2
shift
RUNS=${*:-gpu host}
OUT=${OUT:-/tmp/kvf-pyserved-logs}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
# The binaries' run paths name the machine they were built on.
export LD_LIBRARY_PATH="$BUILD:$REPO/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVF_LIBRARY=$BUILD/libkvferry.so
export KVF_KVFERRYD=$BUILD/tools/kvferryd
export KVF_PRESET_DIR=$REPO/geometry/presets
export KVF_TEST_DEVICE=${KVF_TEST_DEVICE:-0}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
unset KVF_TEST_GPU_EMULATE

# ---- preflight: say what is there, so a failure below can be read without a second run ----
echo "repo: $REPO; build: $BUILD; logs: $OUT"
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu: $(nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | paste -sd ';' -)"
else
  echo "gpu: nvidia-smi not found"
fi
echo "python: $("$PYTHON" -c 'import sys, numpy, pytest; print(sys.version.split()[0], "numpy", numpy.__version__, "pytest", pytest.__version__)' 2>&1 | tail -n 1)"
for f in "$KVF_LIBRARY" "$KVF_KVFERRYD"; do
  [ -e "$f" ] || echo "MISSING: $f"
done
for f in "$KVF_LIBRARY" "$KVF_KVFERRYD"; do
  if [ -e "$f" ] && command -v ldd >/dev/null 2>&1; then
    missing=$(ldd "$f" 2>&1 | grep "not found")
    [ -n "$missing" ] && echo "ldd $f: $missing"
  fi
done
"$KVF_KVFERRYD" --help > "$OUT/kvferryd-help.log" 2>&1
echo "kvferryd --help: status $? ($(head -n 1 "$OUT/kvferryd-help.log"))"
(cd "$REPO" && PYTHONPATH="$REPO/python" "$PYTHON" -c '
import kvferry
from kvferry import client
i = kvferry.cuda_probe()
print("kvferry", kvferry.version(), "from", kvferry.library_path(), "| cuda:", i.message,
      "| key bytes", client.KEY_BYTES, "| lookup", client.has_lookup())
if i.available:
    print("cumem granularity:", kvferry.mem_granularity("cumem", 0))
' 2>&1 | tail -n 3)

status=0
run() { # run NAME MODULE LIMIT_S ALLOW_SKIPS
  local name=$1 module=$2 limit=$3 allow_skips=$4 log="$OUT/$1.log" xml="$OUT/$1.xml"
  rm -rf "$OUT/tmp-$name"
  (cd "$REPO" && timeout -k 10 "$limit" "$PYTHON" -m pytest -v -p no:cacheprovider -r a \
     -o faulthandler_timeout=200 --basetemp="$OUT/tmp-$name" --junitxml="$xml" \
     "tests/python/$module") > "$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "^=+ .*(passed|failed|error|skipped).* =+$" "$log" | tail -n 1)
  local skipped
  skipped=$("$PYTHON" - "$xml" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
# A case that needs LOOKUP may skip on a library without it (said in the summary).
print(sum(1 for s in suites for case in s.iter("testcase") for skip in case.iter("skipped")
          if "kvf_client_lookup" not in (skip.get("message") or "")))
EOF
)
  if [ "$rc" -eq 0 ] && [ "$allow_skips" != yes ] && [ "${skipped:-1}" != 0 ]; then
    echo "  $name: ${skipped:-?} test(s) skipped where every one must run:"
    grep -E "^SKIPPED" "$log" | sed 's/^/    /'
    rc=1
  fi
  if [ "$rc" -eq 0 ]; then
    echo "PASS  $name  ($summary; log: $log)"
  else
    echo "FAIL  $name (status $rc; $summary; log: $log)"
    status=1
    # What failed, and the servers' last words.
    sed -n '/short test summary info/,$p' "$log" | head -n 40 | sed 's/^/    /'
    [ "$rc" -eq 124 ] && { echo "    timed out after $limit s; the last lines:"; tail -n 30 "$log" | sed 's/^/    /'; }
    echo "    kvferryd warnings and errors (every server of the run; logs under $OUT/tmp-$name/*/):"
    grep -h -E "WARN|ERROR|error|refused|failed" "$OUT/tmp-$name"/*/kvferryd-*.log 2>/dev/null |
      tail -n 20 | sed 's/^/    /' 
  fi
}

for r in $RUNS; do
  case $r in
    gpu) run gpu test_client_gpu.py 360 no ;;
    host) run host test_client.py 180 yes ;;
    *) echo "unknown run $r (gpu, host)"; status=1 ;;
  esac
done
exit $status
