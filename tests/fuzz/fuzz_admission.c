/* libFuzzer target for kvferryd's request admission (host/server/dataplane.h).
 *
 * Once per process it builds what a live server holds: an import table, a
 * registry, a data plane with its host lane, and one registration made
 * through the server's own REGISTER path (kvf_register_submit) of the
 * glm-like-hybrid preset (a full-attention group, a sliding-window group
 * and a recurrent group: three object groups) over a host allocation.
 *
 * Each input is a STORE or RETRIEVE as a client could send it: byte 0 picks
 * the type (even STORE, odd RETRIEVE), the rest is the payload. It is
 * decoded by the server's decoder (kvf_proto_decode) and, when it decodes,
 * handed to kvf_dataplane_submit, exactly as the event loop does. An
 * admitted request runs to its retirement (the host lane copies for real)
 * before the next input. Any crash, sanitizer report, hang (the -timeout of
 * run_fuzzer.cmake) or broken reply invariant is a bug:
 *   - a refused request names a field ("payload..." or "quota...");
 *   - a reply's counts fit the request: prefix_tokens in [token_begin,
 *     token_end], a group's whole blocks at most the ids it named, a
 *     failed outcome reports nothing done;
 *   - the registration's memory outside its regions is never written (the
 *     allocation has a guard of poison after the last region). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "common/error.h"
#include "host/ipc/protocol.h"
#include "host/server/dataplane.h"
#include "host/server/register.h"
#include "host/server/registry.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define CLIENT_ID 7u
#define GUARD_BYTES 65536u
#define NUM_BLOCKS 32u

static struct {
  kvf_import_table *table;
  kvf_registry *registry;
  kvf_dataplane *dp;
  kvf_register_worker *worker;
  kvf_dp_binding *binding;
  kvf_mem_alloc *alloc;
  uint8_t *guard; /* GUARD_BYTES after the regions */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kvf_register_req *registered; /* the REGISTER's answer */
  int replied;                  /* the request's reply came */
  kvf_proto_xfer_reply reply;
  uint64_t group_blocks[KVF_MAX_GROUPS];
  /* What the inputs came to, printed at exit. */
  uint64_t inputs, decoded, refused, admitted, done, moved_bytes;
} S = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void die(const char *what) {
  fprintf(stderr, "fuzz_admission: %s: %s\n", what, kvf_last_error());
  abort();
}

static void on_reply(void *ctx, uint64_t client_id, const kvf_proto_msg *r) {
  (void)ctx;
  if (client_id != CLIENT_ID) abort();
  pthread_mutex_lock(&S.mu);
  S.reply = r->u.xfer_reply;
  uint32_t n = r->u.xfer_reply.num_groups;
  if (n > KVF_MAX_GROUPS) abort();
  if (n) memcpy(S.group_blocks, r->u.xfer_reply.group_blocks, n * sizeof(uint64_t));
  S.reply.group_blocks = S.group_blocks;
  S.reply.og_prefix_tokens = NULL;
  S.replied++;
  pthread_cond_broadcast(&S.cv);
  pthread_mutex_unlock(&S.mu);
}

static void on_registered(void *ctx, kvf_register_req *req) {
  (void)ctx;
  pthread_mutex_lock(&S.mu);
  S.registered = req;
  pthread_cond_broadcast(&S.cv);
  pthread_mutex_unlock(&S.mu);
}

/* The server's state with the hybrid registration, through its own code. */
static void setup(void) {
  setenv("KVF_SERVER_L1_PREFAULT_MB", "0", 1);
  kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  lo.num_blocks_override = NUM_BLOCKS;
  kvf_geometry *g = NULL;
  if (kvf_geometry_load_file(KVF_PRESET_DIR "/glm-like-hybrid.json", &lo, &g, NULL) != KVF_SUCCESS) die("preset");
  char *json = NULL;
  size_t json_len = 0;
  if (kvf_geometry_to_json(g, &json, &json_len) != KVF_SUCCESS) die("to_json");
  uint32_t nreg = kvf_geometry_num_regions(g);
  uint64_t *offsets = calloc(nreg, sizeof(uint64_t)), total = 0;
  kvf_proto_region *regions = calloc(nreg, sizeof(*regions));
  if (!offsets || !regions) abort();
  for (uint32_t r = 0; r < nreg; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    if (kvf_geometry_region(g, r, &ri) != KVF_SUCCESS) die("region");
    uint64_t align = ri.align < 4096 ? 4096 : ri.align;
    total = (total + align - 1) / align * align;
    offsets[r] = total;
    regions[r].length = ri.size;
    total += ri.size;
  }
  kvf_geometry_destroy(g);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = total + GUARD_BYTES;
  if (kvf_mem_alloc_create(&ao, &S.alloc) != KVF_SUCCESS) die("allocation");
  uint8_t *base = kvf_mem_alloc_ptr(S.alloc);
  memset(base, 0x5a, total);
  S.guard = base + total;
  memset(S.guard, 0xee, GUARD_BYTES);
  int fd = -1;
  kvf_mem_identity id;
  if (kvf_mem_alloc_export(S.alloc, &fd, &id) != KVF_SUCCESS) die("export");

  if (kvf_import_table_create(NULL, &S.table) != KVF_SUCCESS) die("import table");
  if (kvf_registry_create(S.table, NULL, &S.registry) != KVF_SUCCESS) die("registry");
  kvf_dataplane_options dpo;
  memset(&dpo, 0, sizeof(dpo));
  dpo.registry = S.registry;
  dpo.l1_bytes = 64ull << 20;
  dpo.job_timeout_ms = 8000;
  dpo.reply = on_reply;
  if (kvf_dataplane_create(&dpo, &S.dp) != KVF_SUCCESS) die("data plane");
  kvf_register_options ro;
  memset(&ro, 0, sizeof(ro));
  ro.registry = S.registry;
  ro.dp = S.dp;
  ro.done = on_registered;
  if (kvf_register_worker_create(&ro, &S.worker) != KVF_SUCCESS) die("register worker");
  if (kvf_registry_client_open(S.registry, CLIENT_ID, 0) != KVF_SUCCESS) die("client");

  kvf_register_req *req = calloc(1, sizeof(*req));
  if (!req) abort();
  req->client_id = CLIENT_ID;
  req->request_id = 1;
  req->peer_pid = getpid();
  req->reg.device = -1;
  req->reg.shard_index = 0;
  req->reg.shard_count = 1;
  req->reg.num_fds = 1;
  req->reg.geometry_json = json;
  req->reg.geometry_json_len = (uint32_t)json_len;
  req->reg.num_regions = nreg;
  req->reg.regions = regions;
  for (uint32_t r = 0; r < nreg; r++) {
    regions[r].instance_id = id.instance_id;
    regions[r].allocation_id = id.allocation_id;
    regions[r].generation = id.generation;
    regions[r].size = id.size;
    memcpy(regions[r].device_uuid, id.device_uuid, sizeof(regions[r].device_uuid));
    regions[r].provider = id.provider;
    regions[r].offset = offsets[r];
    regions[r].fd_index = 0;
  }
  free(offsets);
  req->fds[0] = fd;
  req->num_fds = 1;
  kvf_register_submit(S.worker, req);
  pthread_mutex_lock(&S.mu);
  while (!S.registered) pthread_cond_wait(&S.cv, &S.mu);
  req = S.registered;
  pthread_mutex_unlock(&S.mu);
  if (req->status != KVF_SUCCESS) {
    kvf_proto_msg m;
    if (req->frame && kvf_proto_frame_decode(req->frame, req->frame_len, &m) == KVF_SUCCESS)
      fprintf(stderr, "fuzz_admission: REGISTER refused: %s: %s\n", m.u.error.field, m.u.error.message);
    abort();
  }
  S.binding = req->binding;
  req->binding = NULL;
  kvf_register_req_free(req);
}

static void report(void) {
  fprintf(stderr,
          "fuzz_admission: %llu inputs, %llu decoded as STORE/RETRIEVE: %llu refused naming a field, %llu "
          "admitted (%llu done, %llu payload bytes moved)\n",
          (unsigned long long)S.inputs, (unsigned long long)S.decoded, (unsigned long long)S.refused,
          (unsigned long long)S.admitted, (unsigned long long)S.done, (unsigned long long)S.moved_bytes);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  setup();
  atexit(report);
  return 0;
}

static void check_guard(void) {
  for (uint32_t i = 0; i < GUARD_BYTES; i++)
    if (S.guard[i] != 0xee) {
      fprintf(stderr, "fuzz_admission: byte %u past the last region was written\n", i);
      abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  S.inputs++;
  if (size < 1 || size - 1 > KVF_PROTO_MAX_PAYLOAD) return 0;
  kvf_proto_header h;
  memset(&h, 0, sizeof(h));
  h.magic = KVF_PROTO_MAGIC;
  h.version = KVF_PROTO_VERSION;
  h.type = (data[0] & 1) ? KVF_PROTO_RETRIEVE : KVF_PROTO_STORE;
  static uint64_t next_id = 100;
  h.request_id = next_id++;
  h.payload_len = (uint32_t)(size - 1);
  kvf_proto_msg m;
  if (kvf_proto_decode(&h, data + 1, &m) != KVF_SUCCESS) return 0;
  S.decoded++;
  const kvf_proto_xfer *x = &m.u.xfer;
  pthread_mutex_lock(&S.mu);
  int before = S.replied;
  pthread_mutex_unlock(&S.mu);
  kvf_status st = kvf_dataplane_submit(S.dp, S.binding, CLIENT_ID, &m);
  if (st != KVF_SUCCESS) {
    /* Refused: the caller's ERROR names the field ("field: message"). */
    const char *e = kvf_last_error();
    if (strncmp(e, "payload", 7) != 0 && strncmp(e, "quota.", 6) != 0) {
      fprintf(stderr, "fuzz_admission: a refusal that names no field: %s\n", e);
      abort();
    }
    S.refused++;
    pthread_mutex_lock(&S.mu);
    if (S.replied != before) abort(); /* refused, yet answered */
    pthread_mutex_unlock(&S.mu);
    kvf_proto_msg_clear(&m);
    check_guard();
    return 0;
  }
  /* Admitted: wait for the reply (the host lane copies on its threads). */
  pthread_mutex_lock(&S.mu);
  while (S.replied == before) pthread_cond_wait(&S.cv, &S.mu);
  kvf_proto_xfer_reply r = S.reply;
  pthread_mutex_unlock(&S.mu);
  S.admitted++;
  if (r.outcome == 1) {
    S.done++;
    S.moved_bytes += r.bytes_done;
    if (r.status != KVF_SUCCESS) abort();
    if (r.prefix_tokens < x->token_begin || r.prefix_tokens > x->token_end) {
      fprintf(stderr, "fuzz_admission: prefix_tokens %llu outside [%llu, %llu]\n", (unsigned long long)r.prefix_tokens,
              (unsigned long long)x->token_begin, (unsigned long long)x->token_end);
      abort();
    }
    for (uint32_t gi = 0; gi < r.num_groups && gi < x->num_groups; gi++)
      if (r.group_blocks[gi] > x->groups[gi].count) {
        fprintf(stderr, "fuzz_admission: group %u: %llu blocks moved, %u named\n", gi,
                (unsigned long long)r.group_blocks[gi], x->groups[gi].count);
        abort();
      }
  } else if (r.objects_done || r.bytes_done || r.prefix_tokens != x->token_begin) {
    abort(); /* not done: nothing counts */
  }
  /* Wait for retirement too (a timed-out answer comes before it). */
  if (kvf_registry_wait_idle(S.registry, CLIENT_ID, 20000) != KVF_SUCCESS) die("requests never retired");
  kvf_proto_msg_clear(&m);
  check_guard();
  return 0;
}
