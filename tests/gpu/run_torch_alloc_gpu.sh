#!/usr/bin/env bash
# The exportable allocator for torch on a GPU machine: the C test binary
# (test_torch_alloc: the module without torch) and
# tests/python/test_torch_alloc.py with the machine's python3 and its torch
# (ctypes + cudart cases, then tensors from kvferry.torch.exportable_mem_pool).
# Binaries are built elsewhere and carried; nothing is fetched.
#
# Usage: tests/gpu/run_torch_alloc_gpu.sh BUILD_DIR
#   BUILD_DIR holds libkvferry.so*, libkvferry_torch_alloc.so and tests/test_torch_alloc.
# Environment: OUT (logs; default /tmp/kvf-torch-alloc-logs), PYTHON (default python3).
# Shared libraries the machine lacks (libhwloc.so.15, libjansson.so.4) are
# looked for in <repo>/.gpu/lib. Prints one line per run; exits 0 only when
# both passed.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=$(cd "${1:?usage: run_torch_alloc_gpu.sh BUILD_DIR}" && pwd)
OUT=${OUT:-/tmp/kvf-torch-alloc-logs}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
# The binaries' run paths name the machine they were built on.
export LD_LIBRARY_PATH="$BUILD:$REPO/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVF_LIBRARY=$BUILD/libkvferry.so
export KVF_TORCH_ALLOC_LIBRARY=$BUILD/libkvferry_torch_alloc.so
export KVF_PRESET_DIR=$REPO/geometry/presets
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null 2>&1 &&
  echo "gpu: $(nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | paste -sd ';' -)"
echo "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -n 1)"
status=0
report() { # report NAME RC LOG
  if [ "$2" -eq 0 ]; then echo "PASS  $1  (log: $3)"; else echo "FAIL  $1 (status $2, log: $3)"; status=1; fi
  tail -n 4 "$3" | sed 's/^/    /'
}
timeout -k 10 300 "$BUILD/tests/test_torch_alloc" --gtest_output="xml:$OUT/test_torch_alloc.xml" \
  > "$OUT/test_torch_alloc.log" 2>&1
report test_torch_alloc $? "$OUT/test_torch_alloc.log"
(cd "$REPO" && timeout -k 10 300 "$PYTHON" -m pytest -q -p no:cacheprovider -r s \
   --junitxml="$OUT/test_torch_alloc_py.xml" tests/python/test_torch_alloc.py) > "$OUT/test_torch_alloc_py.log" 2>&1
report test_torch_alloc.py $? "$OUT/test_torch_alloc_py.log"
exit $status
