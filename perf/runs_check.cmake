# perf/kvf_runs_check: host-only proof that the benchmark's run lists (the
# baselines') and the peers' tables move exactly the CPU reference's bytes
# (perf/README.md). A perf tool, and a check that needs no GPU, so built with
# the tests too: CI runs it. Included by the top-level CMakeLists.txt when
# tests or perf/ are built.
add_executable(kvf_runs_check ${PROJECT_SOURCE_DIR}/perf/kvf_runs_check.cpp
               ${PROJECT_SOURCE_DIR}/perf/bench_peers_plan.cpp ${PROJECT_SOURCE_DIR}/perf/bench_plan.cpp)
target_include_directories(kvf_runs_check PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(kvf_runs_check PRIVATE kvferry_static Threads::Threads)
target_compile_definitions(kvf_runs_check PRIVATE KVF_PRESET_DIR_BUILD="${PROJECT_SOURCE_DIR}/geometry/presets")
kvf_target_defaults(kvf_runs_check)
if(KVF_BUILD_TESTS)
  add_test(NAME perf_runs_check COMMAND kvf_runs_check ${PROJECT_SOURCE_DIR}/geometry/presets 256 1000)
  set_tests_properties(perf_runs_check PROPERTIES LABELS unit TIMEOUT 600)
endif()
