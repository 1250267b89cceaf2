# Run a libFuzzer binary for SECONDS on a fresh copy of SEEDS ('|'-separated
# files) in WORKDIR. Used by the fuzz_* ctest entries (tests/fuzz/CMakeLists.txt).
foreach(_var FUZZER SEEDS WORKDIR DICT SECONDS)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "run_fuzzer.cmake: ${_var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORKDIR})
file(MAKE_DIRECTORY ${WORKDIR}/corpus ${WORKDIR}/artifacts)
string(REPLACE "|" ";" _seeds "${SEEDS}")
foreach(_seed IN LISTS _seeds)
  if(_seed)
    file(COPY ${_seed} DESTINATION ${WORKDIR}/corpus)
  endif()
endforeach()

# -timeout: one input may take at most 10 s; -rss_limit_mb: far above what a
# 16 MiB-capped geometry needs. A crash, leak, timeout or OOM fails the test
# and leaves the input in WORKDIR/artifacts.
execute_process(
  COMMAND ${FUZZER} -max_total_time=${SECONDS} -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
          -dict=${DICT} -artifact_prefix=${WORKDIR}/artifacts/ ${WORKDIR}/corpus
  WORKING_DIRECTORY ${WORKDIR}
  RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  file(GLOB _found ${WORKDIR}/artifacts/*)
  message(FATAL_ERROR "fuzzer failed (exit ${_rc}); reproducer(s): ${_found}\n"
                      "rerun one with: ${FUZZER} <file>")
endif()
