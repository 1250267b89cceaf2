/* kvf_served_bench: STORE and RETRIEVE through kvferryd against the
 * in-process kernel and a contiguous memcpy of the same bytes.
 *
 *   kvf_served_bench --geometry FILE [--device D] [--tokens-per-request N]
 *                    [--inflight 1,8,64] [--requests R] [--rounds K]
 *                    [--kvferryd PATH | --socket-dir DIR] [--json OUT]
 *
 * This process is the engine: it allocates its KV cache (cuMem on device D,
 * memfd with --device -1), starts kvferryd on a fresh socket directory,
 * registers (--socket-dir: with a kvferryd already running there, which
 * several benches on several GPUs can share), and for each in-flight depth Q keeps Q requests outstanding
 * (submit, wait for the oldest, submit the next) until R requests of N
 * tokens are done, every request with its own chunk keys (so every object is
 * written): each key chain starts from a seed naming the phase, round and
 * request (kvf_chunk_seed), over the request's token ids (kvf_chunk_keys).
 * Retrieve reads back the objects of the last round. Each figure is
 * the median over K rounds of payload bytes / wall time; latency is the
 * median of submit-to-reply over the requests of those rounds (mean, p90 and
 * max beside it: a round's wall time pays for its slow requests). In the same
 * run: kvf_xfer gather/scatter of one request's bytes into pinned objects in
 * this process (the in-process kernel: the median of single calls, and
 * rounds of R calls measured as the served rounds are), and cudaMemcpy of the same bytes
 * between one device buffer and one pinned buffer (the link's limit); with
 * --device -1, the host backend in this process and a memcpy of the same
 * bytes between two touched buffers. First, the first STORE after the
 * registration against the four after it and against STOREs that follow
 * 100 ms of idleness ("served-first").
 * Results: one JSON object per line (--json, else stdout). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <kvferry/kvferry.h>

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0;
}

typedef struct bench {
  const char *geometry_path, *daemon, *json_path;
  const char *socket_dir; /* an already running kvferryd (several benches share it), or NULL */
  int device;
  uint64_t tokens_per_request;
  int inflight[8], num_inflight;
  int requests, rounds;
  kvf_geometry *g;
  char *json;
  size_t json_len;
  uint32_t num_blocks, chunk_tokens, num_groups;
  kvf_mem_alloc *alloc;
  uint64_t *offsets;
  kvf_client *client;
  pid_t server;
  FILE *out;
  uint32_t **ids; /* per slot (request modulo slots), per group */
  uint32_t slots;
  uint32_t *tokens; /* a request's token ids: 0 .. tokens_per_request - 1 */
  char tmp_dir[64];  /* the socket directory's parent this run made ("" with --socket-dir) */
  double inproc_rounds_gbps[2]; /* store, retrieve: in-process rounds measured as the served ones (0: not measured) */
} bench;


static int setup(bench *b) {
  /* Blocks: one distinct range per slot, so requests in flight never share a block. */
  kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  lo.num_blocks_override = 16;
  kvf_geometry_error err;
  if (kvf_geometry_load_file(b->geometry_path, &lo, &b->g, &err)) {
    fprintf(stderr, "kvf_served_bench: %s: %s\n", b->geometry_path, kvf_last_error());
    return -1;
  }
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(b->g, &pol);
  b->chunk_tokens = pol.chunk_tokens;
  b->num_groups = kvf_geometry_num_groups(b->g);
  uint32_t max_bs = 1;
  for (uint32_t i = 0; i < b->num_groups; i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(b->g, i, &gi);
    if (gi.kind == KVF_GROUP_RECURRENT || gi.kind == KVF_GROUP_SLIDING_WINDOW || gi.kind == KVF_GROUP_CHUNKED_LOCAL) {
      fprintf(stderr, "kvf_served_bench: use a geometry of full-attention groups only\n");
      return -1;
    }
  }
  for (uint32_t i = 0; i < b->num_groups; i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(b->g, i, &gi);
    if (gi.block_size > max_bs) max_bs = gi.block_size;
  }
  int maxq = 1;
  for (int i = 0; i < b->num_inflight; i++)
    if (b->inflight[i] > maxq) maxq = b->inflight[i];
  b->slots = (uint32_t)maxq;
  uint64_t blocks_per_request = (b->tokens_per_request + max_bs - 1) / max_bs;
  b->num_blocks = (uint32_t)(blocks_per_request * b->slots);
  kvf_geometry_destroy(b->g);
  b->g = NULL;
  lo.num_blocks_override = b->num_blocks;
  if (kvf_geometry_load_file(b->geometry_path, &lo, &b->g, &err)) return -1;
  if (kvf_geometry_to_json(b->g, &b->json, &b->json_len)) return -1;
  b->ids = calloc((size_t)b->slots * b->num_groups, sizeof *b->ids);
  b->tokens = malloc(sizeof *b->tokens * b->tokens_per_request);
  if (!b->ids || !b->tokens) return -1;
  for (uint64_t t = 0; t < b->tokens_per_request; t++) b->tokens[t] = (uint32_t)t;
  for (uint32_t s = 0; s < b->slots; s++)
    for (uint32_t gidx = 0; gidx < b->num_groups; gidx++) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(b->g, gidx, &gi);
      uint64_t n = (b->tokens_per_request + gi.block_size - 1) / gi.block_size;
      uint32_t *v = malloc(sizeof *v * n);
      if (!v) return -1;
      for (uint64_t k = 0; k < n; k++) v[k] = (uint32_t)(s * n + k);
      b->ids[s * b->num_groups + gidx] = v;
    }
  /* The cache: one allocation holding every region. */
  uint32_t nreg = kvf_geometry_num_regions(b->g);
  b->offsets = calloc(nreg, sizeof *b->offsets);
  uint64_t total = 0;
  for (uint32_t r = 0; r < nreg; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(b->g, r, &ri);
    uint64_t align = ri.align < 4096 ? 4096 : ri.align;
    total = (total + align - 1) / align * align;
    b->offsets[r] = total;
    total += ri.size;
  }
  kvf_mem_alloc_options mo = KVF_MEM_ALLOC_OPTIONS_INIT;
  mo.provider = b->device >= 0 ? KVF_MEM_PROVIDER_CUMEM : KVF_MEM_PROVIDER_HOST;
  mo.device = b->device >= 0 ? b->device : 0;
  mo.size = total;
  if (kvf_mem_alloc_create(&mo, &b->alloc)) {
    fprintf(stderr, "kvf_served_bench: cache of %" PRIu64 " bytes: %s\n", total, kvf_last_error());
    return -1;
  }
#ifdef KVF_WITH_CUDA
  if (b->device >= 0) cudaMemset(kvf_mem_alloc_ptr(b->alloc), 0x5a, total);
#endif
  if (b->device < 0) memset(kvf_mem_alloc_ptr(b->alloc), 0x5a, total);
  /* The server: started here unless --socket-dir names a running one. */
  static char sock[256], l1[32], dev[16];
  if (b->socket_dir) {
    snprintf(sock, sizeof sock, "%s", b->socket_dir);
  } else {
    snprintf(b->tmp_dir, sizeof b->tmp_dir, "/tmp/kvf-served-bench-XXXXXX");
    if (!mkdtemp(b->tmp_dir)) {
      b->tmp_dir[0] = 0;
      return -1;
    }
    snprintf(sock, sizeof sock, "%s/sock", b->tmp_dir);
  }
  uint64_t request_bytes = 0;
  for (uint32_t og = 0; og < kvf_geometry_num_object_groups(b->g); og++)
    for (uint64_t k = 0; k * b->chunk_tokens < b->tokens_per_request; k++) {
      uint64_t s = 0;
      kvf_geometry_object_size(b->g, og, k, b->tokens_per_request, &s);
      request_bytes += s;
    }
  /* Room for the largest round's objects, with slack: nothing is evicted mid-round. */
  snprintf(l1, sizeof l1, "%" PRIu64, (request_bytes * (uint64_t)b->requests * 5 / 4 >> 20) + 256);
  snprintf(dev, sizeof dev, "%d", b->device);
  fflush(stdout);
  b->server = b->socket_dir ? -1 : fork();
  if (b->server == 0) {
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0 && !getenv("KVF_BENCH_SERVER_LOG")) dup2(fd, STDERR_FILENO);
    execl(b->daemon, b->daemon, "--socket-dir", sock, "--devices", b->device >= 0 ? dev : "none", "--l1-mb", l1,
          (char *)NULL);
    _exit(127);
  }
  kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
  co.socket_dir = sock;
  co.name = "served-bench";
  co.heartbeat_thread = 1;
  co.timeout_ms = 600000;
  for (int i = 0; i < 1200 && !b->client; i++) {
    if (kvf_client_connect(&co, &b->client, NULL) == KVF_SUCCESS) break;
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  if (!b->client) {
    fprintf(stderr, "kvf_served_bench: kvferryd (%s) did not come up\n", b->daemon);
    return -1;
  }
  kvf_client_region regs[64];
  if (nreg > 64) return -1;
  for (uint32_t r = 0; r < nreg; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(b->g, r, &ri);
    regs[r] = (kvf_client_region){b->alloc, b->offsets[r], ri.size};
  }
  if (kvf_client_register(b->client, b->json, b->json_len, b->device, regs, nreg, NULL)) {
    fprintf(stderr, "kvf_served_bench: register: %s\n", kvf_last_error());
    return -1;
  }
  return 0;
}

/* The chunk keys of request `request` of round `round` of `phase`, as an
 * engine makes them: a chain over the request's token ids from a seed that
 * names the device, the phase, the round and the request. Every (phase,
 * round, request, chunk) gets a key of its own, and a key always names the
 * same chunk of the same tokens: kvferryd refuses a key stored at another
 * token range (header.token_begin differs), as the old scheme (a counter
 * plus the chunk index, so one request's chunk 1 was the next one's chunk
 * 0) found at 4096 tokens a request. The device goes in so that benches
 * sharing one server never share objects. Returns 0, or -1 with a message. */
static int request_keys(const bench *b, const char *phase, int round, int request, kvf_chunk_key *keys,
                        uint64_t chunks) {
  char name[160];
  int n = snprintf(name, sizeof name, "kvf_served_bench device %d %s round %d request %d", b->device, phase, round,
                   request);
  kvf_chunk_key seed;
  if (n < 0 || (size_t)n >= sizeof name || kvf_chunk_seed(name, (size_t)n, &seed) != KVF_SUCCESS ||
      kvf_chunk_keys(&seed, b->tokens, sizeof *b->tokens, b->tokens_per_request, b->chunk_tokens, keys) != chunks) {
    fprintf(stderr, "kvf_served_bench: the keys of %s round %d request %d: %s\n", phase, round, request,
            kvf_last_error());
    return -1;
  }
  return 0;
}

/* One round: `total` requests of type op, q in flight, with the keys of
 * (phase, round) (request_keys). Returns seconds, or -1 on failure; adds
 * each request's latency to lat[] and its bytes to *bytes. */
static double round_run(bench *b, kvf_client_op op, int q, int total, const char *phase, int round, double *lat,
                        uint64_t *bytes) {
  uint64_t chunks = (b->tokens_per_request + b->chunk_tokens - 1) / b->chunk_tokens;
  kvf_chunk_key *keys = calloc(chunks * (size_t)total, sizeof *keys);
  uint64_t *ids = malloc(sizeof *ids * (size_t)total);
  double *t_sub = malloc(sizeof *t_sub * (size_t)total);
  kvf_group_blocks gb[64];
  if (!keys || !ids || !t_sub) return -1;
  for (int r = 0; r < total; r++)
    if (request_keys(b, phase, round, r, keys + (size_t)r * chunks, chunks)) return -1;
  int next = 0, done = 0;
  double t0 = now_s();
  while (done < total) {
    while (next < total && next - done < q) {
      uint32_t slot = (uint32_t)(next % (int)b->slots);
      for (uint32_t gidx = 0; gidx < b->num_groups; gidx++) {
        kvf_group_info gi = KVF_GROUP_INFO_INIT;
        kvf_geometry_group(b->g, gidx, &gi);
        gb[gidx] = (kvf_group_blocks){b->ids[slot * b->num_groups + gidx], 0,
                                       (uint32_t)((b->tokens_per_request + gi.block_size - 1) / gi.block_size)};
      }
      kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
      x.token_begin = 0;
      x.token_end = b->tokens_per_request;
      x.chunk_keys = keys + (size_t)next * chunks;
      x.num_chunk_keys = (uint32_t)chunks;
      x.groups = gb;
      x.num_groups = b->num_groups;
      t_sub[next] = now_s();
      if (kvf_client_submit(b->client, op, &x, &ids[next])) {
        fprintf(stderr, "kvf_served_bench: submit: %s\n", kvf_last_error());
        return -1;
      }
      next++;
    }
    kvf_client_result res = KVF_CLIENT_RESULT_INIT;
    kvf_status st = kvf_client_wait(b->client, ids[done], 0, &res);
    if (st != KVF_SUCCESS || res.status != KVF_SUCCESS) {
      fprintf(stderr, "kvf_served_bench: request: %s\n", st ? kvf_last_error() : kvf_status_string(res.status));
      return -1;
    }
    lat[done] = now_s() - t_sub[done];
    *bytes += res.bytes_done;
    done++;
  }
  double dt = now_s() - t0;
  free(keys);
  free(ids);
  free(t_sub);
  return dt;
}

/* The served rows' own measure, in this process: rounds of b->requests
 * calls one after another, each waited for, payload bytes over the round's
 * wall time, median over b->rounds, into b->inproc_rounds_gbps (store,
 * retrieve). A median of single calls (the baselines' other figure) leaves
 * out the slow calls that a round's wall time keeps. `stream` is the CUDA
 * stream the calls go on (NULL on the host backend, whose calls return
 * done). */
static void inproc_rounds(bench *b, kvf_xfer *x, const kvf_copy_request *req, kvf_stream stream,
                          uint64_t request_bytes) {
  double *rate = calloc((size_t)b->rounds, sizeof *rate);
  if (!rate) return;
  for (int dir = 0; dir < 2; dir++) {
    for (int r = 0; r < b->rounds; r++) {
      double t = now_s();
      for (int i = 0; i < b->requests; i++) {
        kvf_status st = dir == 0 ? kvf_xfer_gather(x, req, stream) : kvf_xfer_scatter(x, req, stream);
        if (st) {
          free(rate);
          return;
        }
#ifdef KVF_WITH_CUDA
        if (stream) cudaStreamSynchronize(stream);
#endif
      }
      rate[r] = (double)request_bytes * (double)b->requests / (now_s() - t) / 1e9;
    }
    b->inproc_rounds_gbps[dir] = median(rate, b->rounds);
  }
  free(rate);
}

/* The in-process request of the baselines: one request's tokens from block
 * 0 of every group, into `objs`; bases and gb (64 each) are its arrays. */
static kvf_copy_request inproc_request(const bench *b, void **objs, void **bases, kvf_group_blocks *gb) {
  uint32_t nreg = kvf_geometry_num_regions(b->g);
  for (uint32_t r = 0; r < nreg; r++) bases[r] = (char *)kvf_mem_alloc_ptr(b->alloc) + b->offsets[r];
  for (uint32_t gidx = 0; gidx < b->num_groups; gidx++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(b->g, gidx, &gi);
    gb[gidx] = (kvf_group_blocks){b->ids[gidx], 0, (uint32_t)((b->tokens_per_request + gi.block_size - 1) / gi.block_size)};
  }
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.region_bases = bases;
  req.token_begin = 0;
  req.token_end = b->tokens_per_request;
  req.groups = gb;
  req.objects = objs;
  return req;
}

/* The host backend's baselines (--device -1): kvf_xfer of one request's
 * bytes between the memfd cache and objects in this process's memory, and a
 * memcpy of the same bytes between two buffers, interleaved so both see the
 * same machine load. Every buffer is touched first: first-touch page faults
 * are the served path's to avoid, not the baselines'. */
static int host_baselines(bench *b, double *inproc_store, double *inproc_retrieve, double *memcpy_gbps,
                          uint64_t *request_bytes) {
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = KVF_DEVICE_HOST;
  kvf_xfer *x = NULL;
  if (kvf_xfer_create(b->g, &xo, &x)) return -1;
  uint32_t nog = kvf_geometry_num_object_groups(b->g);
  uint64_t chunks = (b->tokens_per_request + b->chunk_tokens - 1) / b->chunk_tokens, total = 0;
  void **objs = calloc(chunks * nog, sizeof *objs);
  if (!objs) return -1;
  for (uint64_t k = 0; k < chunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      uint64_t s = 0;
      kvf_geometry_object_size(b->g, og, k, b->tokens_per_request, &s);
      objs[k * nog + og] = aligned_alloc(4096, (s + 4095) / 4096 * 4096);
      if (!objs[k * nog + og]) return -1;
      memset(objs[k * nog + og], 0x33, s);
      total += s;
    }
  *request_bytes = total;
  void *bases[64];
  kvf_group_blocks gb[64];
  kvf_copy_request req = inproc_request(b, objs, bases, gb);
  char *src = aligned_alloc(4096, (total + 4095) / 4096 * 4096), *dst = aligned_alloc(4096, (total + 4095) / 4096 * 4096);
  if (!src || !dst) return -1;
  memset(src, 1, total);
  memset(dst, 2, total);
  enum { REPS = 15 };
  double v[3][REPS];
  for (int rep = -2; rep < REPS; rep++) { /* two warm-ups */
    double t = now_s();
    if (kvf_xfer_gather(x, &req, NULL)) return -1;
    if (rep >= 0) v[0][rep] = now_s() - t;
    t = now_s();
    if (kvf_xfer_scatter(x, &req, NULL)) return -1;
    if (rep >= 0) v[1][rep] = now_s() - t;
    t = now_s();
    memcpy(dst, src, total);
    if (rep >= 0) v[2][rep] = now_s() - t;
  }
  *inproc_store = (double)total / median(v[0], REPS) / 1e9;
  *inproc_retrieve = (double)total / median(v[1], REPS) / 1e9;
  *memcpy_gbps = (double)total / median(v[2], REPS) / 1e9;
  inproc_rounds(b, x, &req, NULL, total);
  free(src);
  free(dst);
  for (uint64_t i = 0; i < chunks * nog; i++) free(objs[i]);
  free(objs);
  kvf_xfer_destroy(x);
  return 0;
}

/* In-process: kvf_xfer of one request's bytes into pinned objects, and a
 * contiguous cudaMemcpy of the same bytes. Medians of `reps`. */
static int baselines(bench *b, double *inproc_store, double *inproc_retrieve, double *memcpy_d2h, double *memcpy_h2d,
                     uint64_t *request_bytes) {
  *inproc_store = *inproc_retrieve = *memcpy_d2h = *memcpy_h2d = 0;
  if (b->device < 0) {
    int rc = host_baselines(b, inproc_store, inproc_retrieve, memcpy_d2h, request_bytes);
    *memcpy_h2d = *memcpy_d2h;
    return rc;
  }
#ifdef KVF_WITH_CUDA
  cudaSetDevice(b->device);
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = b->device;
  kvf_xfer *x = NULL;
  if (kvf_xfer_create(b->g, &xo, &x)) return -1;
  uint32_t nog = kvf_geometry_num_object_groups(b->g);
  uint64_t chunks = (b->tokens_per_request + b->chunk_tokens - 1) / b->chunk_tokens, total = 0;
  void **objs = calloc(chunks * nog, sizeof *objs);
  for (uint64_t k = 0; k < chunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      uint64_t s = 0;
      kvf_geometry_object_size(b->g, og, k, b->tokens_per_request, &s);
      if (cudaHostAlloc(&objs[k * nog + og], s ? s : 1, cudaHostAllocDefault) != cudaSuccess) return -1;
      total += s;
    }
  *request_bytes = total;
  void *bases[64];
  kvf_group_blocks gb[64];
  kvf_copy_request req = inproc_request(b, objs, bases, gb);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void *dbuf = NULL, *hbuf = NULL;
  cudaMalloc(&dbuf, total);
  cudaHostAlloc(&hbuf, total, cudaHostAllocDefault);
  enum { REPS = 20 };
  double v[4][REPS];
  for (int rep = -2; rep < REPS; rep++) { /* two warm-ups */
    double t;
    t = now_s();
    kvf_xfer_gather(x, &req, s);
    cudaStreamSynchronize(s);
    if (rep >= 0) v[0][rep] = now_s() - t;
    t = now_s();
    kvf_xfer_scatter(x, &req, s);
    cudaStreamSynchronize(s);
    if (rep >= 0) v[1][rep] = now_s() - t;
    t = now_s();
    cudaMemcpyAsync(hbuf, dbuf, total, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    if (rep >= 0) v[2][rep] = now_s() - t;
    t = now_s();
    cudaMemcpyAsync(dbuf, hbuf, total, cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    if (rep >= 0) v[3][rep] = now_s() - t;
  }
  *inproc_store = (double)total / median(v[0], REPS) / 1e9;
  *inproc_retrieve = (double)total / median(v[1], REPS) / 1e9;
  *memcpy_d2h = (double)total / median(v[2], REPS) / 1e9;
  *memcpy_h2d = (double)total / median(v[3], REPS) / 1e9;
  inproc_rounds(b, x, &req, s, total);
  cudaFree(dbuf);
  cudaFreeHost(hbuf);
  for (uint64_t i = 0; i < chunks * nog; i++) cudaFreeHost(objs[i]);
  free(objs);
  cudaStreamDestroy(s);
  kvf_xfer_destroy(x);
#else
  (void)b;
  (void)request_bytes;
#endif
  return 0;
}

int main(int argc, char **argv) {
  bench b;
  memset(&b, 0, sizeof b);
  b.device = 0;
  b.tokens_per_request = 256;
  b.requests = 128;
  b.rounds = 5;
  b.inflight[0] = 1;
  b.inflight[1] = 8;
  b.inflight[2] = 64;
  b.num_inflight = 3;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = 0;
  char *slash = strrchr(self, '/');
  static char daemon[4200];
  if (slash) *slash = 0;
  snprintf(daemon, sizeof daemon, "%s/../tools/kvferryd", self);
  b.daemon = getenv("KVF_KVFERRYD") ? getenv("KVF_KVFERRYD") : daemon;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "usage: see the comment at the top of perf/kvf_served_bench.c\n");
      return 2;
    }
    if (!strcmp(a, "--geometry")) b.geometry_path = v;
    else if (!strcmp(a, "--device")) b.device = atoi(v);
    else if (!strcmp(a, "--tokens-per-request")) b.tokens_per_request = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--requests")) b.requests = atoi(v);
    else if (!strcmp(a, "--rounds")) b.rounds = atoi(v);
    else if (!strcmp(a, "--kvferryd")) b.daemon = v;
    else if (!strcmp(a, "--json")) b.json_path = v;
    else if (!strcmp(a, "--socket-dir")) b.socket_dir = v;
    else if (!strcmp(a, "--inflight")) {
      b.num_inflight = 0;
      for (char *p = (char *)v; *p && b.num_inflight < 8;) {
        b.inflight[b.num_inflight++] = (int)strtol(p, &p, 10);
        if (*p == ',') p++;
      }
    } else {
      fprintf(stderr, "kvf_served_bench: unknown option %s\n", a);
      return 2;
    }
    i++;
  }
  if (!b.geometry_path || b.tokens_per_request == 0 || b.requests <= 0 || b.rounds <= 0) {
    fprintf(stderr, "kvf_served_bench: --geometry is required; counts must be positive\n");
    return 2;
  }
  b.out = b.json_path ? fopen(b.json_path, "w") : stdout;
  if (!b.out) return 1;
  int rc = 1;
  if (setup(&b)) goto out;
  double in_store, in_retr, lim_d2h, lim_h2d;
  uint64_t request_bytes = 0;
  if (baselines(&b, &in_store, &in_retr, &lim_d2h, &lim_h2d, &request_bytes)) goto out;
  char when[32];
  time_t now = time(NULL);
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  {
    /* The first STORE after the registration, alone, then four more: the
     * first must cost what later ones do (nothing left to set up on first use). */
    double first[5];
    uint64_t bytes = 0;
    for (int i = 0; i < 5; i++) {
      double dt = round_run(&b, KVF_CLIENT_STORE, 1, 1, "served-first", i, &first[i], &bytes);
      if (dt <= 0) goto out;
    }
    double later = median(first + 1, 4);
    /* The control: a STORE after the server sat idle far longer than any
     * of its spin windows (2 ms), so its threads sleep as they did before
     * the first STORE. first / idle near 1 says nothing is left to set up
     * on first use; what first / later still shows is the wake-up of idle
     * threads, which every request after a pause pays. */
    double idle[3];
    uint64_t idle_bytes = 0;
    for (int i = 0; i < 3; i++) {
      struct timespec gap = {0, 100 * 1000 * 1000};
      nanosleep(&gap, NULL);
      if (round_run(&b, KVF_CLIENT_STORE, 1, 1, "served-idle", i, &idle[i], &idle_bytes) <= 0) goto out;
    }
    double after_idle = median(idle, 3);
    fprintf(b.out,
            "{\"date\": \"%s\", \"bench\": \"served-first\", \"geometry\": \"%s\", \"device\": %d, "
            "\"tokens_per_request\": %" PRIu64 ", \"bytes_per_request\": %" PRIu64
            ", \"first_store_ms\": %.3f, \"later_store_ms_p50\": %.3f, \"first_over_later\": %.3f"
            ", \"idle_store_ms_p50\": %.3f, \"first_over_idle\": %.3f}\n",
            when, kvf_geometry_name(b.g), b.device, b.tokens_per_request, bytes / 5, first[0] * 1e3, later * 1e3,
            later > 0 ? first[0] / later : 0, after_idle * 1e3, after_idle > 0 ? first[0] / after_idle : 0);
    fflush(b.out);
    fprintf(stderr,
            "served first store %.3f ms, the next four %.3f ms (median): %.2fx; after 100 ms idle %.3f ms "
            "(median of 3): first %.2fx of it\n",
            first[0] * 1e3, later * 1e3, later > 0 ? first[0] / later : 0, after_idle * 1e3,
            after_idle > 0 ? first[0] / after_idle : 0);
  }
  for (int qi = 0; qi < b.num_inflight; qi++) {
    int q = b.inflight[qi];
    char phase[64]; /* by index too: --inflight may name one depth twice */
    snprintf(phase, sizeof phase, "served inflight[%d] %d", qi, q);
    for (int dir = 0; dir < 2; dir++) {
      double *gbps = calloc((size_t)b.rounds, sizeof(double));
      double *lat = calloc((size_t)b.rounds * (size_t)b.requests, sizeof(double));
      uint64_t bytes_round = 0;
      for (int r = 0; r < b.rounds; r++) {
        uint64_t bytes = 0;
        /* Stores write new keys every round; retrieves read the last round's. */
        double dt = round_run(&b, dir == 0 ? KVF_CLIENT_STORE : KVF_CLIENT_RETRIEVE, q, b.requests, phase,
                              dir == 0 ? r : b.rounds - 1, lat + (size_t)r * (size_t)b.requests, &bytes);
        if (dt <= 0) goto out;
        gbps[r] = (double)bytes / dt / 1e9;
        bytes_round = bytes;
      }
      const int nlat = b.rounds * b.requests;
      double lat_sum = 0;
      for (int i = 0; i < nlat; i++) lat_sum += lat[i];
      double g = median(gbps, b.rounds), l = median(lat, nlat); /* lat sorted from here */
      double l_mean = lat_sum / nlat, l_p90 = lat[nlat * 9 / 10], l_max = lat[nlat - 1];
      double inproc = dir == 0 ? in_store : in_retr, limit = dir == 0 ? lim_d2h : lim_h2d;
      double rounds_inproc = b.inproc_rounds_gbps[dir];
      fprintf(b.out,
              "{\"date\": \"%s\", \"bench\": \"served\", \"geometry\": \"%s\", \"device\": %d, \"direction\": \"%s\", "
              "\"inflight\": %d, \"tokens_per_request\": %" PRIu64 ", \"bytes_per_request\": %" PRIu64
              ", \"requests\": %d, \"rounds\": %d, \"served_gbps\": %.3f, \"latency_ms_p50\": %.3f, "
              "\"latency_ms_mean\": %.3f, \"latency_ms_p90\": %.3f, \"latency_ms_max\": %.3f, "
              "\"inproc_gbps\": %.3f, \"inproc_rounds_gbps\": %.3f, \"memcpy_gbps\": %.3f, \"ratio_to_inproc\": %.4f, "
              "\"ratio_to_inproc_rounds\": %.4f, \"ratio_to_memcpy\": %.4f}\n",
              when, kvf_geometry_name(b.g), b.device, dir == 0 ? "store" : "retrieve", q, b.tokens_per_request,
              bytes_round / (uint64_t)b.requests, b.requests, b.rounds, g, l * 1e3, l_mean * 1e3, l_p90 * 1e3,
              l_max * 1e3, inproc, rounds_inproc, limit, inproc > 0 ? g / inproc : 0,
              rounds_inproc > 0 ? g / rounds_inproc : 0, limit > 0 ? g / limit : 0);
      fflush(b.out);
      fprintf(stderr,
              "served %-8s q=%-3d %8.2f GB/s (in-process %.2f per call, %.2f in rounds; memcpy %.2f), latency p50 "
              "%.3f mean %.3f p90 %.3f max %.3f ms\n",
              dir == 0 ? "store" : "retrieve", q, g, inproc, rounds_inproc, limit, l * 1e3, l_mean * 1e3,
              l_p90 * 1e3, l_max * 1e3);
      free(gbps);
      free(lat);
    }
  }
  rc = 0;
out:
  kvf_client_disconnect(b.client);
  if (b.server > 0) {
    kill(b.server, SIGTERM);
    waitpid(b.server, NULL, 0);
  }
  /* The socket directory this run made, with what kvferryd left there (its lock file). */
  if (b.tmp_dir[0]) nftw(b.tmp_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
  kvf_mem_alloc_destroy(b.alloc);
  if (b.out && b.out != stdout) fclose(b.out);
  return rc;
}
