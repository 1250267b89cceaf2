/* perf/kvf_deferred_check.cpp - the bookkeeping of deferred calls
 * (kvf_xfer_gather_deferred, host/core/xfer.c) on a CUDA device, without
 * one: the real CUDA-backend code over perf/host_path_stub.c, as
 * kvf_host_path runs it. What kvf_host_path --deferred does not reach:
 *
 *   failures   calls whose objects are pageable host memory fail on the
 *              context's thread; each failure comes back once, in call
 *              order, from the first query, join or flush that covers it,
 *              naming the call and the field; 16 are kept, and once one
 *              is dropped none is kept (not even into a slot a report
 *              freed) until the report of the last kept one has counted
 *              the dropped; a failure after that is kept again;
 *   start      a device without 64-bit stream memory operations refuses the
 *              call (UNSUPPORTED, nothing taken) and a later call starts
 *              the thread once it has them;
 *   tickets    query and join answer for tickets given, refuse 0 and those
 *              not given (naming "ticket"), and a NULL done (naming "done");
 *              a synchronous call after deferred ones moves the right bytes.
 *
 * Calls into the stub stay ordered (it is single-threaded): each post is
 * followed by kvf_xfer_last_path, which waits for the thread to have
 * enqueued it, before the next. Exit status 0 when every check holds. */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <kvferry/copy.h>
#include <kvferry/geometry.h>
#include <kvferry/status.h>
#include <kvferry/transfer.h>

#include "bench_plan.h"
#include "host/core/xfer_internal.h"
#include "host_path_stub.h"

#include <cuda_runtime_api.h>

#ifndef KVF_PRESET_DIR_BUILD
#define KVF_PRESET_DIR_BUILD "geometry/presets"
#endif

using namespace kvfb;

namespace {

int g_failures = 0;

void check(bool ok, const std::string &what) {
  if (ok) return;
  std::printf("FAILED: %s\n", what.c_str());
  g_failures++;
}

bool has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

/* One chunk of a preset's gather: its cache in stub device memory, its
 * objects pageable (malloc) or pinned (the stub's). */
struct Setup {
  kvf_geometry *g = nullptr;
  std::vector<void *> cache;
  Tables t;
  ObjectLayout layout;
  char *pinned = nullptr, *pageable = nullptr;
  std::vector<void *> pinned_objects, pageable_objects;
  kvf_copy_request r = KVF_COPY_REQUEST_INIT;

  bool make(const std::string &preset, uint64_t tokens) {
    std::string path = std::string(KVF_PRESET_DIR_BUILD) + "/" + preset + ".json";
    kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
    lo.num_blocks_override = 64;
    if (kvf_geometry_load_file(path.c_str(), &lo, &g, nullptr)) return false;
    for (uint32_t i = 0; i < kvf_geometry_num_regions(g); i++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, i, &ri);
      void *p = kvf_host_stub_device_alloc(ri.size);
      if (!p) return false;
      std::memset(p, (int)(i + 1), ri.size);
      cache.push_back(p);
    }
    size_t next = 0;
    if (!plan_tables(g, tokens, plan_pool(64, 7), &next, &t) || !plan_objects(g, tokens, t, 256, &layout))
      return false;
    pinned = static_cast<char *>(kvf_host_stub_pinned_alloc(layout.span));
    pageable = static_cast<char *>(std::malloc(layout.span));
    if (!pinned || !pageable) return false;
    pinned_objects = plan_object_pointers(layout, pinned);
    pageable_objects = plan_object_pointers(layout, pageable);
    r.region_bases = cache.data();
    r.token_begin = 0;
    r.token_end = tokens;
    r.groups = t.groups.data();
    r.objects = pinned_objects.data();
    return true;
  }
  ~Setup() {
    for (void *p : cache) kvf_host_stub_free(p);
    if (pinned) kvf_host_stub_free(pinned);
    std::free(pageable);
    kvf_geometry_destroy(g);
  }
};

kvf_xfer *make_ctx(const kvf_geometry *g) {
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = 0;
  kvf_xfer *x = nullptr;
  if (kvf_xfer_create(g, &xo, &x)) std::printf("kvf_xfer_create: %s\n", kvf_last_error());
  return x;
}

/* Post a gather and wait until the thread has enqueued it. */
kvf_status post(kvf_xfer *x, const kvf_copy_request *r, cudaStream_t s, uint64_t *ticket) {
  kvf_status st = kvf_xfer_gather_deferred(x, r, (kvf_stream)s, ticket);
  kvf_xfer_path_info pi;
  kvf_xfer_last_path(x, &pi);
  return st;
}

void failures(Setup &s, cudaStream_t stream) {
  kvf_xfer *x = make_ctx(s.g);
  if (!x) return;
  kvf_copy_request bad = s.r;
  bad.objects = s.pageable_objects.data();
  const int kPosted = 20;
  auto post_bad = [&](int from, int to) {
    for (int i = from; i <= to; i++) {
      uint64_t ticket = 0;
      check(post(x, &bad, stream, &ticket) == KVF_SUCCESS, "a deferred call returns before its memory is looked at");
      check(ticket == (uint64_t)i, "ticket " + std::to_string(ticket) + " for call " + std::to_string(i));
    }
  };
  post_bad(1, kPosted); /* 1-16 kept, 17-20 dropped */
  /* The first, from a query: done, and named. Its slot is free when call
   * 21 fails, and must stay so: the count of the dropped goes with call
   * 16's report, and 21 is later than they are. */
  int done = 0;
  kvf_status st = kvf_xfer_query(x, 1, &done);
  std::string msg = kvf_last_error();
  check(st == KVF_ERR_INVALID_ARGUMENT, "query(1) reports call 1's failure: " + msg);
  check(has(msg, "deferred gather (call 1): ") && has(msg, "objects"), "the report names call 1 and objects: " + msg);
  check(done == 1, "a failed call still completes");
  check(kvf_xfer_query(x, 1, &done) == KVF_SUCCESS, "a failure is reported once");
  post_bad(kPosted + 1, kPosted + 1);
  /* The next from a join whose ticket covers more, then from flushes. */
  st = kvf_xfer_join(x, 5, (kvf_stream)stream);
  msg = kvf_last_error();
  check(st == KVF_ERR_INVALID_ARGUMENT && has(msg, "(call 2): "), "join(5) reports call 2: " + msg);
  for (int call = 3; call <= 16; call++) {
    st = kvf_xfer_flush(x);
    msg = kvf_last_error();
    check(st == KVF_ERR_INVALID_ARGUMENT && has(msg, "(call " + std::to_string(call) + "): "),
          "flush reports call " + std::to_string(call) + ": " + msg);
    const bool counts = has(msg, "and 5 later deferred calls failed");
    check(counts == (call == 16), "only the last kept report counts the 5 only logged: " + msg);
  }
  check(kvf_xfer_flush(x) == KVF_SUCCESS, "every kept failure was reported: " + std::string(kvf_last_error()));
  /* Kept again once the count is out. */
  uint64_t ticket = 0;
  check(post(x, &bad, stream, &ticket) == KVF_SUCCESS && ticket == kPosted + 2, "call 22 is posted");
  st = kvf_xfer_join(x, ticket, (kvf_stream)stream);
  msg = kvf_last_error();
  check(st == KVF_ERR_INVALID_ARGUMENT && has(msg, "(call 22): ") && !has(msg, "later deferred"),
        "call 22's failure is kept and reported alone: " + msg);
  kvf_xfer_destroy(x);
}

void start_and_tickets(Setup &s, cudaStream_t stream) {
  kvf_xfer *x = make_ctx(s.g);
  if (!x) return;
  int done = 0;
  kvf_status st = kvf_xfer_query(x, 1, &done);
  check(st == KVF_ERR_INVALID_ARGUMENT && has(kvf_last_error(), "ticket 1"), "no ticket is given before a call");
  kvf_host_stub_mem_ops(0);
  uint64_t ticket = 99;
  st = kvf_xfer_gather_deferred(x, &s.r, (kvf_stream)stream, &ticket);
  std::string msg = kvf_last_error();
  kvf_host_stub_mem_ops(1);
  check(st == KVF_ERR_UNSUPPORTED && ticket == 99, "a device without stream memory operations refuses: " + msg);
  check(msg == "deferred gather: starting the context's thread: device 0 cannot write or wait on 64-bit values "
               "from a stream; nothing was enqueued",
        "the refusal says why, once: " + msg);
  /* Started by the next call; the bytes against the reference. */
  std::memset(s.pinned, 0, s.layout.span);
  check(post(x, &s.r, stream, &ticket) == KVF_SUCCESS && ticket == 1, "the thread starts on a later call");
  check(kvf_xfer_join(x, ticket, (kvf_stream)stream) == KVF_SUCCESS, "join(1)");
  check(kvf_xfer_query(x, ticket, &done) == KVF_SUCCESS && done == 1, "query(1) after the join: done");
  std::vector<char> ref(s.layout.span, 0);
  kvf_copy_request rr = s.r;
  std::vector<void *> ref_objects = plan_object_pointers(s.layout, ref.data());
  rr.objects = ref_objects.data();
  check(kvf_reference_gather(s.g, &rr) == KVF_SUCCESS && std::memcmp(ref.data(), s.pinned, s.layout.span) == 0,
        "the deferred gather moved the reference's bytes");
  for (uint64_t bad : {0ull, 2ull}) {
    st = kvf_xfer_join(x, bad, (kvf_stream)stream);
    check(st == KVF_ERR_INVALID_ARGUMENT && has(kvf_last_error(), "ticket " + std::to_string(bad) + ": "),
          "join refuses ticket " + std::to_string(bad) + ": " + kvf_last_error());
    st = kvf_xfer_query(x, bad, &done);
    check(st == KVF_ERR_INVALID_ARGUMENT && has(kvf_last_error(), "ticket " + std::to_string(bad) + ": "),
          "query refuses ticket " + std::to_string(bad));
  }
  check(kvf_xfer_query(x, 1, nullptr) == KVF_ERR_INVALID_ARGUMENT && has(kvf_last_error(), "done: "),
        "query names a NULL done");
  check(kvf_xfer_gather_deferred(x, &s.r, (kvf_stream)stream, nullptr) == KVF_ERR_INVALID_ARGUMENT &&
            has(kvf_last_error(), "ticket: "),
        "a NULL ticket is refused, naming it");
  /* A synchronous call after a deferred one. */
  check(post(x, &s.r, stream, &ticket) == KVF_SUCCESS && ticket == 2, "call 2 posted");
  std::memset(s.pinned, 0, s.layout.span);
  check(kvf_xfer_gather(x, &s.r, (kvf_stream)stream) == KVF_SUCCESS, "a synchronous call after a deferred one");
  check(std::memcmp(ref.data(), s.pinned, s.layout.span) == 0, "the synchronous call moved the reference's bytes");
  check(kvf_xfer_flush(x) == KVF_SUCCESS, "flush with nothing failed");
  kvf_xfer_destroy(x);
}

} // namespace

int main() {
  Setup s;
  if (!s.make("llama-3.1-8b-fa-nhd", 64)) {
    std::printf("setup failed: %s\n", kvf_last_error());
    return 1;
  }
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  failures(s, stream);
  start_and_tickets(s, stream);
  cudaStreamDestroy(stream);
  std::printf("%s: %d failed check%s\n", g_failures ? "FAILED" : "ok", g_failures, g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}
