// Shared by the server, client and data-path tests: a tiny geometry and a
// kvferryd server object run on a thread of the test process.
#ifndef KVF_TESTS_SERVER_TEST_UTIL_H
#define KVF_TESTS_SERVER_TEST_UTIL_H

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "host/server/server.h"

namespace kvf_server_test {

// Two regions of 16 KiB (2 planes x 4 blocks x 2048 bytes), one layer each.
inline constexpr char kTinyGeometry[] = R"({
  "format": "kvferry-geometry", "version": 1, "name": "tiny",
  "regions": [{"name": "kv", "count": 2, "size": 0}],
  "groups": [{"name": "full", "kind": "full", "block_size": 16, "num_blocks": 4,
    "layers": [{"count": 2, "name": "layer", "region": "kv", "region_step": 1, "offset": 0,
      "elem_bytes": 2, "block_stride": 2048, "planes": 2, "heads": 1, "head_bytes": 128,
      "plane_stride": "num_blocks * block_stride", "token_stride": 128, "head_stride": 128}]}],
  "objects": {"chunk_tokens": 16, "format": "canonical"}
})";

// kvf_server_run on its own thread; stop() (or the destructor) stops it and
// expects a clean run.
struct InProcessServer {
  kvf_server *s = nullptr;
  std::thread loop;
  std::atomic<int> run_status{-1};

  InProcessServer() = default;
  InProcessServer(const InProcessServer &) = delete;
  InProcessServer &operator=(const InProcessServer &) = delete;
  ~InProcessServer() { stop(); }

  kvf_status start(const kvf_server_options &o) {
    kvf_status st = kvf_server_create(&o, &s);
    if (st != KVF_SUCCESS) return st;
    loop = std::thread([this] { run_status = kvf_server_run(s); });
    return KVF_SUCCESS;
  }
  void stop() {
    if (!s) return;
    kvf_server_stop(s);
    loop.join();
    EXPECT_EQ(run_status.load(), (int)KVF_SUCCESS);
    kvf_server_destroy(s);
    s = nullptr;
  }
};

}  // namespace kvf_server_test

#endif  // KVF_TESTS_SERVER_TEST_UTIL_H
