#!/usr/bin/env bash
# The python_tests ctest: pytest over tests/python against this build's
# libkvferry.so, from the venv scripts/python-venv makes.
#   run_pytest.sh BUILD_DIR LIBRARY LAYOUT_DUMP SANITIZE C_COMPILER [pytest args...]
# A sanitized library (KVF_SANITIZE=address) cannot be loaded into python
# without the sanitizer runtime loaded first: its runtime is found with
# `C_COMPILER -print-file-name=...` and put in LD_PRELOAD (leak detection off:
# the interpreter keeps memory until exit by design).
set -uo pipefail
build=$1 library=$2 layout_dump=$3 sanitize=$4 cc=$5
shift 5
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

python=$("$root/scripts/python-venv" "$build")
rc=$?
if ((rc != 0)); then
  exit "$rc"
fi

export KVF_LIBRARY=$library
export KVF_LAYOUT_DUMP=$layout_dump
export KVF_PRESET_DIR=$root/geometry/presets
export PYTHONDONTWRITEBYTECODE=1
if [[ $sanitize == *address* ]]; then
  runtime=""
  for name in libclang_rt.asan-x86_64.so libclang_rt.asan.so libasan.so; do
    candidate=$("$cc" -print-file-name="$name" 2>/dev/null)
    if [[ $candidate == /* && -e $candidate ]]; then
      runtime=$candidate
      break
    fi
  done
  if [[ -z $runtime ]]; then
    echo "run_pytest: $library is built with AddressSanitizer, but $cc names no shared ASan runtime" >&2
    exit 1
  fi
  echo "run_pytest: LD_PRELOAD=$runtime (the library is built with KVF_SANITIZE=$sanitize)"
  export LD_PRELOAD=$runtime
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
  # kvferryd carries its own (static) sanitizer runtime: preloading the shared
  # one into it aborts it ("Shadow memory range interleaves..."). The tests and
  # the docs' examples start it through $KVF_KVFERRYD: a wrapper without the
  # preload.
  kvferryd=${KVF_KVFERRYD:-$build/tools/kvferryd}
  if [[ -x $kvferryd ]]; then
    wrapdir=$(mktemp -d /tmp/kvf-pytest-XXXXXX) || exit 1
    trap 'rm -rf "$wrapdir"' EXIT
    printf '#!/bin/sh\nunset LD_PRELOAD\nexec "%s" "$@"\n' "$kvferryd" > "$wrapdir/kvferryd"
    chmod +x "$wrapdir/kvferryd"
    export KVF_KVFERRYD=$wrapdir/kvferryd
  fi
fi
cd "$root" || exit 1
"$python" -m pytest -q -p no:cacheprovider -r s "$here" "$@"
