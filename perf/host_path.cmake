# kvferry's GPU routes on the CPU: the real kvf_xfer code over a CUDA runtime
# that does the work on the CPU when it is enqueued (host_path_stub.c, which
# also stands in for the kernel's entry points, so neither libcudart's nor
# xfer_kernel.cu's objects are linked). Verifies every preset's routes
# against the CPU reference without a GPU, and times kvferry's own host
# path per call (perf/README.md). Included by the top-level CMakeLists.txt
# with CUDA on when tests or perf/ are built: CI runs its checks.
add_executable(kvf_host_path ${PROJECT_SOURCE_DIR}/perf/kvf_host_path.cpp ${PROJECT_SOURCE_DIR}/perf/host_path_stub.c
               ${PROJECT_SOURCE_DIR}/perf/bench_plan.cpp)
target_include_directories(kvf_host_path PRIVATE ${PROJECT_SOURCE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
target_compile_definitions(kvf_host_path PRIVATE KVF_WITH_CUDA=1
  KVF_PRESET_DIR_BUILD="${PROJECT_SOURCE_DIR}/geometry/presets")
target_link_libraries(kvf_host_path PRIVATE kvferry_static Threads::Threads)
kvf_target_defaults(kvf_host_path)
# Deferred calls' bookkeeping (failures kept and reported once, the thread
# started late, tickets) over the same stub: kvf_deferred_check.cpp.
add_executable(kvf_deferred_check ${PROJECT_SOURCE_DIR}/perf/kvf_deferred_check.cpp
               ${PROJECT_SOURCE_DIR}/perf/host_path_stub.c ${PROJECT_SOURCE_DIR}/perf/bench_plan.cpp)
target_include_directories(kvf_deferred_check PRIVATE ${PROJECT_SOURCE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
target_compile_definitions(kvf_deferred_check PRIVATE KVF_WITH_CUDA=1
  KVF_PRESET_DIR_BUILD="${PROJECT_SOURCE_DIR}/geometry/presets")
target_link_libraries(kvf_deferred_check PRIVATE kvferry_static Threads::Threads)
kvf_target_defaults(kvf_deferred_check)
if(KVF_BUILD_TESTS)
  add_test(NAME perf_deferred_check COMMAND $<TARGET_FILE:kvf_deferred_check>)
  set_tests_properties(perf_deferred_check PROPERTIES LABELS unit TIMEOUT 120)
  # Each route the planner picks, byte for byte against the reference:
  # one chunk in four calls back to back with other block ids (staged, batch
  # and kernel routes as chosen by default, and as the rules that remember
  # earlier calls choose them; later staged calls must take their pieces'
  # runs from the context's cache, and later calls blobs from the context's
  # memo, which are then the ones checked), whole and with every fifth block
  # skipped; four
  # chunks with a partial last one, whole and with every fifth block skipped
  # (holes: objects a gather writes in part); the native format with skips;
  # one-chunk staging batches (the two buffers' pipeline and its edge
  # batches); the direct kernel to host memory (staging and the batch route
  # off); deferred calls, each joined after it (the context's thread plans
  # and enqueues them, and no wait may be enqueued ahead of what it waits
  # for).
  set(_kvf_hp $<TARGET_FILE:kvf_host_path> --verify-only)
  add_test(NAME perf_host_path_256 COMMAND ${_kvf_hp} --tokens 256 --calls 4 --expect-cached-runs --expect-cached-blobs)
  add_test(NAME perf_host_path_skips_256 COMMAND ${_kvf_hp} --tokens 256 --calls 4 --skip-every 5 --expect-cached-runs
           --expect-cached-blobs)
  add_test(NAME perf_host_path_deferred_256 COMMAND ${_kvf_hp} --tokens 256 --calls 4 --deferred --expect-cached-blobs)
  # The batch route behind an event the caller recorded just before the
  # call (the stream busy to the first query): its calls still ramp; behind
  # longer work (busy to every query within KVF_IDLE_WAIT_NS) one call.
  add_test(NAME perf_host_path_ramp_behind_event COMMAND ${_kvf_hp} --tokens 256 --calls 3 --directions d2h,h2d
           --presets deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,qwen3-next-like-hybrid --busy-queries 1
           --expect-batch-calls ramp)
  add_test(NAME perf_host_path_one_call_behind_work COMMAND ${_kvf_hp} --tokens 256 --calls 3 --directions d2h,h2d
           --presets deepseek-v3-mla-bf16,deepseek-v3-mla-fp8-656,qwen3-next-like-hybrid --busy-queries 1000000
           --expect-batch-calls one)
  add_test(NAME perf_host_path_1000 COMMAND ${_kvf_hp} --tokens 1000)
  add_test(NAME perf_host_path_skips_1000 COMMAND ${_kvf_hp} --tokens 1000 --skip-every 5)
  add_test(NAME perf_host_path_native_skips_1024 COMMAND ${_kvf_hp} --tokens 1024 --format native --skip-every 5)
  add_test(NAME perf_host_path_batches_1000 COMMAND ${_kvf_hp} --tokens 1000 --directions d2h,h2d)
  add_test(NAME perf_host_path_direct_1000 COMMAND ${_kvf_hp} --tokens 1000 --directions d2h,h2d)
  set_tests_properties(perf_host_path_256 perf_host_path_skips_256 perf_host_path_deferred_256 perf_host_path_ramp_behind_event
                       perf_host_path_one_call_behind_work perf_host_path_1000 perf_host_path_skips_1000
                       perf_host_path_native_skips_1024 perf_host_path_batches_1000 perf_host_path_direct_1000
                       PROPERTIES LABELS unit TIMEOUT 600)
  set_tests_properties(perf_host_path_batches_1000 PROPERTIES ENVIRONMENT KVF_XFER_STAGING_MB=1)
  set_tests_properties(perf_host_path_direct_1000 PROPERTIES
                       ENVIRONMENT "KVF_XFER_STAGING_MB=0;KVF_XFER_BATCH_MAX_RUNS=0")
endif()
