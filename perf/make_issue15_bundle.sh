#!/usr/bin/env bash
# perf/make_issue15_bundle.sh - gather what perf/run_issue15.sh needs on the GPU
# machine into one folder that the device tool carries (nothing is built there):
#
#   perf/make_issue15_bundle.sh [BUILD_DIR] DEST
#
# DEST gets bin/ (test_xfer, kvf_bench, kvf_served_bench, kvferryd, kvf_param_probe, kvf_hop_probe, kvf_copy_probe, kvf_handoff_probe, kvf_ce_probe, kvf_bulk_probe), lib/
# (shared libraries the binaries need that the GPU image may lack:
# libjansson.so.4, libhwloc, libcrypto.so.3; libkvf_trace.so and libcupti when built), presets/ (the geometry presets), run_issue15.sh,
# report.py, report_served.py, and pylib/ with run_gpu_pytest.sh (the Python
# tests against the bundle's libkvferry). Run there as: bash DEST/run_issue15.sh
# The binaries and libraries are compressed with xz (bin/*.xz, lib/*.xz),
# which run_issue15.sh unpacks in place: the device tool carries at most
# 64 MiB with the repository (about 53 MiB on 2026-12-04), and xz makes the
# whole bundle about 8 MiB where gzip made 14.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
if (($# == 2)); then build=$1; dest=$2; else build=$root/build/rel; dest=${1:?usage: make_issue15_bundle.sh [BUILD_DIR] DEST}; fi
mkdir -p "$dest/bin" "$dest/lib" "$dest/presets"
for b in tests/test_xfer perf/kvf_bench perf/kvf_served_bench tools/kvferryd; do
  [[ -x $build/$b ]] || { echo "make_issue15_bundle.sh: $build/$b not built" >&2; exit 2; }
  cp "$build/$b" "$dest/bin/"
done
for b in "$dest"/bin/*; do
  ldd "$b" | awk '/libjansson|libhwloc|libcrypto/ {print $3}' | while read -r lib; do [[ -f $lib ]] && cp -L "$lib" "$dest/lib/"; done
done
for b in kvf_param_probe kvf_hop_probe kvf_copy_probe kvf_handoff_probe kvf_ce_probe kvf_bulk_probe; do [[ -x $build/perf/$b ]] && cp "$build/perf/$b" "$dest/bin/"; done
# The CUPTI timeline (perf/kvf_trace.c) and the CUPTI it needs, when built.
if [[ -f $build/perf/libkvf_trace.so ]]; then
  cp "$build/perf/libkvf_trace.so" "$dest/lib/"
  ldd "$build/perf/libkvf_trace.so" | awk '/libcupti/ {print $3}' | while read -r lib; do [[ -f $lib ]] && cp -L "$lib" "$dest/lib/"; done
fi
# The Python tests' libraries (perf/run_gpu_pytest.sh), when built.
mkdir -p "$dest/pylib"
lib=$(readlink -f "$build/libkvferry.so" 2>/dev/null || true)
[[ -f $lib ]] && cp "$lib" "$dest/pylib/libkvferry.so"
[[ -f $build/libkvferry_torch_alloc.so ]] && cp -L "$build/libkvferry_torch_alloc.so" "$dest/pylib/"
[[ -x $build/tests/layout_dump ]] && cp "$build/tests/layout_dump" "$dest/pylib/"
xz -9 -f -T0 "$dest"/bin/* "$dest"/lib/* $(find "$dest/pylib" -type f)
cp "$root"/geometry/presets/*.json "$dest/presets/"
cp "$here/run_issue15.sh" "$here/report.py" "$here/report_served.py" "$here/run_gpu_pytest.sh" "$dest/"
git -C "$root" rev-parse --short=12 HEAD > "$dest/COMMIT" 2>/dev/null || true
du -sh "$dest"
