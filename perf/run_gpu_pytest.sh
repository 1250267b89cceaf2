#!/usr/bin/env bash
# perf/run_gpu_pytest.sh - the Python tests on the GPU machine, from a bundle
# of perf/make_issue15_bundle.sh (nothing is built there):
#
#   bash BUNDLE/run_gpu_pytest.sh [pytest args...]   (from the repository root)
#
# Uses the bundle's pylib/ (libkvferry.so, libkvferry_torch_alloc.so,
# layout_dump) and bin/kvferryd with the repository's python/ and
# tests/python, under the image's torch venv (/opt/torch/.venv: numpy,
# pytest, torch) when present, else python3. Without arguments it runs the
# tests that need a GPU (-k "gpu or cuda": the vLLM mover's GPU cases are
# named by their device). Writes $OUT/pytest/pytest.log (OUT defaults to
# ./out); PYTEST_S bounds the run (default 240 s).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$PWD/out}
# Unpacked in place, as run_issue15.sh unpacks bin/ and lib/ (it skips what
# is unpacked already).
for f in "$here"/pylib/*.xz "$here"/bin/kvferryd.xz "$here"/lib/*.xz; do
  [[ -f $f ]] && { xz -d -f "$f" || exit 2; }
done
chmod +x "$here/bin/kvferryd" "$here/pylib/layout_dump" 2>/dev/null
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-}
export KVF_LIBRARY=$here/pylib/libkvferry.so KVF_TORCH_ALLOC_LIBRARY=$here/pylib/libkvferry_torch_alloc.so
export KVF_LAYOUT_DUMP=$here/pylib/layout_dump KVF_KVFERRYD=$here/bin/kvferryd
export KVF_PRESET_DIR=$here/presets PYTHONDONTWRITEBYTECODE=1
py=python3
[[ -x /opt/torch/.venv/bin/python3 ]] && py=/opt/torch/.venv/bin/python3
(($# == 0)) && set -- -k "gpu or cuda"
mkdir -p "$out/pytest"
cd tests/python || exit 2
timeout -k 5 "${PYTEST_S:-240}" "$py" -m pytest -v -rs -p no:cacheprovider "$@" . > "$out/pytest/pytest.log" 2>&1
rc=$?
echo "run_gpu_pytest: pytest exit $rc"
tail -n 30 "$out/pytest/pytest.log"
exit $rc
