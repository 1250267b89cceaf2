#!/usr/bin/env bash
# The vllm_tests ctest (label vllm, not in scripts/run-tests): pytest over
# tests/vllm (kvferry.vllm against the real vLLM package, on the CPU) and
# tests/python/test_vllm_mover.py, with a Python that has vLLM.
#   run_pytest.sh BUILD_DIR LIBRARY SANITIZE [pytest args...]
# The Python: $KVF_VLLM_PYTHON, else BUILD_DIR/vllm-venv/bin/python (made by
# scripts/vllm-venv BUILD_DIR). Without one, or in a sanitizer build, it exits
# 77 (ctest counts the test as skipped) and says why. When that Python has no
# pytest, pytest is installed once into BUILD_DIR/vllm-pytest (pip --target),
# leaving the venv as it is.
set -uo pipefail
build=$1 library=$2 sanitize=$3
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

if [[ -n $sanitize ]]; then
  echo "vllm_tests: skipped: this build has KVF_SANITIZE=$sanitize; the vLLM tests load the" \
       "library into vLLM's torch, run them against a build without sanitizers" >&2
  exit 77
fi
python=${KVF_VLLM_PYTHON:-$build/vllm-venv/bin/python}
if [[ ! -x $python ]]; then
  echo "vllm_tests: skipped: no Python with vLLM ($python does not exist): make one with" \
       "scripts/vllm-venv $build (vllm==0.33.0, about 9.4 GB and 4-5 minutes), or set" \
       "KVF_VLLM_PYTHON to a python that has vLLM 0.33.0" >&2
  exit 77
fi
if ! version=$("$python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null); then
  echo "vllm_tests: skipped: $python cannot import vllm" >&2
  exit 77
fi
extra=""
if ! "$python" -c 'import pytest' >/dev/null 2>&1; then
  extra=$build/vllm-pytest
  if ! PYTHONPATH=$extra "$python" -c 'import pytest' >/dev/null 2>&1; then
    mkdir -p "$build"
    exec 9>"$build/vllm-pytest.lock"
    flock 9
    if ! PYTHONPATH=$extra "$python" -c 'import pytest' >/dev/null 2>&1 &&
       ! "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$extra" \
           pytest iniconfig pluggy >"$build/vllm-pytest.log" 2>&1; then
      echo "vllm_tests: skipped: $python has no pytest and pip could not install it" \
           "(see $build/vllm-pytest.log; offline?)" >&2
      exit 77
    fi
  fi
fi
echo "vllm_tests: vLLM $version from $python"
export KVF_LIBRARY=$library
export PYTHONPATH=$root/python${extra:+:$extra}
export PYTHONDONTWRITEBYTECODE=1
cd "$root" || exit 1
exec "$python" -m pytest -q -p no:cacheprovider -r s "$here" "$root/tests/python/test_vllm_mover.py" \
  --rootdir "$root" "$@"
