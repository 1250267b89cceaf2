#!/usr/bin/env bash
# The python_torch_tests ctest (label torch): tests/python/test_torch_alloc.py
# with torch, from the venv scripts/torch-venv makes (torch pinned, from PyPI).
#   run_torch_pytest.sh BUILD_DIR LIBRARY ALLOC_LIBRARY SANITIZE [pytest args...]
# Skipped (exit 77) for sanitized builds (torch's own libraries are not built
# for them) and when the venv cannot be made (offline).
set -uo pipefail
build=$1 library=$2 alloc_library=$3 sanitize=$4
shift 4
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

if [[ -n $sanitize ]]; then
  echo "run_torch_pytest: skipped: this build uses KVF_SANITIZE=$sanitize; the torch tests run on plain builds"
  exit 77
fi
python=$("$root/scripts/torch-venv" "$build")
rc=$?
if ((rc != 0)); then
  exit "$rc"
fi
export KVF_LIBRARY=$library
export KVF_TORCH_ALLOC_LIBRARY=$alloc_library
export PYTHONDONTWRITEBYTECODE=1
cd "$root" || exit 1
exec "$python" -m pytest -q -p no:cacheprovider -r s "$here/test_torch_alloc.py" "$@"
