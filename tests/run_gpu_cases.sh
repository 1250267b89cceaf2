#!/usr/bin/env bash
# tests/run_gpu_cases.sh TEST_BINARY [gtest args...]: run a gtest binary's GPU
# cases in one process for ctest. Each case's name is printed as it starts
# (a run ctest kills at its timeout names the case it was in) and the whole
# log kept in ./<binary>_gpu_cases.log, or ./$KVF_GPU_CASES_LOG when set (two
# tests of one binary that ctest may run at once each need their own: one
# read the other's log and failed on 8 of 10 such runs). Exits with the binary's status after
# printing the failures; 77 (ctest: skipped) when every case it ran was
# skipped (no usable GPU), after printing the first case's reason; 1 when no
# case ran at all (a filter that names nothing).
set -uo pipefail
log="$PWD/${KVF_GPU_CASES_LOG:-$(basename "$1")_gpu_cases.log}"
"$@" 2>&1 | tee "$log" | grep --line-buffered -E '^\[ RUN      \] '
rc=${PIPESTATUS[0]}
summary() { grep -E '^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]' "$log"; }
if ((rc != 0)); then
  echo "---- failures (the whole log: $log)"
  grep -E -A12 '(Failure|error: .*)$' "$log" | head -n 400
  summary
  grep -E '^\[  FAILED  \] [A-Za-z]' "$log"
  exit "$rc"
fi
passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$')
skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$')
if [[ ${passed:-0} == 0 && -n $skipped && $skipped != 0 ]]; then
  # gtest prints a skipped case's reason on the line after "file:line: Skipped".
  grep -m1 -A1 -E ': Skipped$' "$log" | tail -n 1
  summary
  exit 77
fi
if [[ ${passed:-0} == 0 ]]; then
  echo "no case ran (the filter names none)"
  summary
  exit 1
fi
summary
exit 0
