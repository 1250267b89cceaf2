#!/usr/bin/env bash
# tests/run_gpu_cases.sh TEST_BINARY [gtest args...]: run a gtest binary's GPU
# cases in one process for ctest. Exits with the binary's status, or 77
# (ctest: skipped) when it passed and every case it ran was skipped (no
# usable GPU), after printing the first case's reason.
set -uo pipefail
out=$("$@" 2>&1)
rc=$?
if ((rc != 0)); then
  printf '%s\n' "$out"
  exit "$rc"
fi
if grep -qE '^\[  PASSED  \] 0 tests' <<<"$out" && grep -qE '^\[  SKIPPED \] [0-9]+ test' <<<"$out"; then
  # The skip reason gtest prints before a skipped case's line.
  grep -m1 -B1 -E '^\[  SKIPPED \] [A-Za-z]' <<<"$out" | head -n 1
  grep -E '^\[  SKIPPED \] [0-9]+ test' <<<"$out"
  exit 77
fi
printf '%s\n' "$out" | grep -E '^\[  (PASSED|SKIPPED|FAILED) +\]' | grep -vE '^\[  SKIPPED \] [A-Za-z]'
exit 0
