/* kvferry demo: the served round trip (DESIGN.md §2, shape 2).
 *
 * The parent starts kvferryd, then one engine process per GPU (one on the
 * host backend without a GPU). Each engine allocates its KV cache as one
 * exported allocation (cuMem on a GPU, memfd on the host), fills it, registers
 * it and stores a prefix into the server's L1. Then each engine in turn is
 * restarted: it unregisters and exits (the server's imports and aliases for it
 * go to 0 while L1 keeps the objects), and a new process with a fresh cache
 * and other block ids registers and retrieves the prefix: full groups
 * restored whole, sliding-window groups only their retained window, the
 * recurrent group its state at the prefix's end. Every byte is verified
 * against the first engine's cache with the CPU reference's rules
 * (demo_verify), and every other byte must still hold its poison.
 *
 * Engines are separate processes started with exec ("kvferry demo-engine"),
 * so no process inherits a CUDA context across fork. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <kvferry/kvferry.h>

#include "demo_util.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#define DEMO_MAX_ENGINES 16

/* ---- the engine ------------------------------------------------------------ */

typedef struct engine_args {
  const char *socket_dir, *geometry, *role, *name;
  uint64_t tokens, seed;
  int device; /* -1: host */
  int notify_fd;
  uint32_t requests; /* STORE requests the prefix is split into */
} engine_args;


/* One allocation holding every region, each at an aligned offset. */
typedef struct engine_cache {
  kvf_mem_alloc *alloc;
  uint64_t *offsets;
  uint32_t num_regions;
  int device;
} engine_cache;

static int engine_cache_create(const kvf_geometry *g, int device, engine_cache *c) {
  c->num_regions = kvf_geometry_num_regions(g);
  c->device = device;
  c->offsets = calloc(c->num_regions, sizeof *c->offsets);
  if (!c->offsets) return -1;
  uint64_t total = 0;
  for (uint32_t r = 0; r < c->num_regions; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    uint64_t align = ri.align < 4096 ? 4096 : ri.align;
    total = (total + align - 1) / align * align;
    c->offsets[r] = total;
    total += ri.size;
  }
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = device >= 0 ? KVF_MEM_PROVIDER_CUMEM : KVF_MEM_PROVIDER_HOST;
  o.device = device >= 0 ? device : 0;
  o.size = total;
  o.name = "kvferry-demo-kv";
  if (kvf_mem_alloc_create(&o, &c->alloc) != KVF_SUCCESS) {
    fprintf(stderr, "demo engine: allocating %" PRIu64 " bytes: %s\n", total, kvf_last_error());
    return -1;
  }
  return 0;
}

/* Copy host copies into the engine's memory (dir 0) or back (dir 1). */
static int engine_cache_copy(engine_cache *c, demo_cache *host, int back) {
  char *base = kvf_mem_alloc_ptr(c->alloc);
  for (uint32_t r = 0; r < c->num_regions; r++) {
    char *dev = base + c->offsets[r];
    if (c->device < 0) {
      if (back)
        memcpy(host->bases[r], dev, host->sizes[r]);
      else
        memcpy(dev, host->bases[r], host->sizes[r]);
      continue;
    }
#ifdef KVF_WITH_CUDA
    cudaSetDevice(c->device);
    cudaError_t e = back ? cudaMemcpy(host->bases[r], dev, host->sizes[r], cudaMemcpyDeviceToHost)
                         : cudaMemcpy(dev, host->bases[r], host->sizes[r], cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      fprintf(stderr, "demo engine: cudaMemcpy: %s\n", cudaGetErrorString(e));
      return -1;
    }
#else
    return -1;
#endif
  }
  return 0;
}

static void engine_cache_free(engine_cache *c) {
  kvf_mem_alloc_destroy(c->alloc);
  free(c->offsets);
  memset(c, 0, sizeof *c);
}

/* The prompt's token ids and its chunk keys (the same in every engine). */
static kvf_chunk_key *engine_keys(const kvf_geometry *g, const char *geometry, uint64_t tokens, uint64_t seed,
                                  uint64_t *n) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint32_t *ids = malloc(sizeof *ids * tokens);
  uint64_t chunks = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens;
  kvf_chunk_key *keys = malloc(sizeof *keys * chunks);
  if (!ids || !keys) {
    free(ids);
    free(keys);
    return NULL;
  }
  uint64_t rng = seed ^ 0x70c3e5;
  for (uint64_t i = 0; i < tokens; i++) ids[i] = (uint32_t)(splitmix(&rng) % 151552);
  /* The model's name seeds the chain (the demo's model is its geometry
   * file), so two models never share keys; the server scopes them by the
   * geometry and the shard besides. */
  kvf_chunk_key model;
  *n = 0;
  if (kvf_chunk_seed(geometry, strlen(geometry), &model) == KVF_SUCCESS)
    *n = kvf_chunk_keys(&model, ids, sizeof *ids, tokens, pol.chunk_tokens, keys);
  free(ids);
  return keys;
}

static void print_result(const char *name, const char *what, const kvf_client_result *r) {
  printf("  [%s] %s: status %s, prefix %" PRIu64 " tokens, %" PRIu64 " objects (%" PRIu64 " already held)\n", name,
         what, kvf_status_string(r->status), r->prefix_tokens, r->objects_done, r->objects_present);
}

int cmd_demo_engine(int argc, char **argv) {
  engine_args a = {0};
  a.device = -1;
  a.notify_fd = -1;
  a.requests = 16;
  a.name = "engine";
  for (int i = 0; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--socket-dir")) a.socket_dir = v;
    else if (!strcmp(k, "--geometry")) a.geometry = v;
    else if (!strcmp(k, "--role")) a.role = v;
    else if (!strcmp(k, "--name")) a.name = v;
    else if (!strcmp(k, "--tokens")) a.tokens = strtoull(v, NULL, 10);
    else if (!strcmp(k, "--seed")) a.seed = strtoull(v, NULL, 10);
    else if (!strcmp(k, "--device")) a.device = atoi(v);
    else if (!strcmp(k, "--notify-fd")) a.notify_fd = atoi(v);
    else if (!strcmp(k, "--requests")) a.requests = (uint32_t)strtoul(v, NULL, 10);
  }
  if (!a.socket_dir || !a.geometry || !a.role || !a.tokens || !a.requests) {
    fprintf(stderr, "demo-engine: --socket-dir, --geometry, --role, --tokens are required\n");
    return 2;
  }
  int store = !strcmp(a.role, "store");
  int rc = 1;
  kvf_geometry *g = NULL;
  uint32_t num_blocks = 0, *pool = NULL;
  demo_cache src = {0}, dst = {0}, poison = {0};
  demo_tables stored = {0}, restored = {0};
  engine_cache cache = {0};
  kvf_client *client = NULL;
  kvf_chunk_key *keys = NULL;
  uint64_t nkeys = 0;
  char *json = NULL;
  size_t json_len = 0;
  kvf_group_blocks gb[KVF_MAX_GROUPS];
  uint64_t *req_ids = NULL;
  if (demo_geometry_load(a.geometry, a.tokens, &g, &num_blocks) || !(pool = demo_pool_make(num_blocks, a.seed)))
    goto out;
  /* The first engine's cache and tables, regenerated the same way by the
   * restored engine (it checks against them). */
  uint64_t rng = a.seed ^ 0x5eed;
  if (cache_alloc(g, &src, &rng, 0) || tables_make(g, a.tokens, pool, num_blocks, &stored)) goto oom;
  if (!(keys = engine_keys(g, a.geometry, a.tokens, a.seed, &nkeys))) goto oom;
  /* The server loads the geometry from this text: it carries num_blocks. */
  if (kvf_geometry_to_json(g, &json, &json_len) != KVF_SUCCESS) {
    fprintf(stderr, "demo engine: %s: %s\n", a.geometry, kvf_last_error());
    goto out;
  }
  if (!store) {
    /* The restarted engine: other block ids, a cache full of poison. */
    for (uint32_t i = 0; i < num_blocks / 2; i++) {
      uint32_t x = pool[i];
      pool[i] = pool[num_blocks - 1 - i];
      pool[num_blocks - 1 - i] = x;
    }
    if (cache_alloc(g, &dst, &rng, 0) || tables_make(g, a.tokens, pool, num_blocks, &restored)) goto oom;
    poison.num_regions = dst.num_regions;
    poison.bases = calloc(dst.num_regions, sizeof *poison.bases);
    poison.sizes = calloc(dst.num_regions, sizeof *poison.sizes);
    if (!poison.bases || !poison.sizes) goto oom;
    for (uint32_t r = 0; r < dst.num_regions; r++) {
      poison.sizes[r] = dst.sizes[r];
      if (!(poison.bases[r] = malloc(dst.sizes[r] ? dst.sizes[r] : 1))) goto oom;
      memcpy(poison.bases[r], dst.bases[r], dst.sizes[r]);
    }
  }
  if (engine_cache_create(g, a.device, &cache) || engine_cache_copy(&cache, store ? &src : &dst, 0)) goto out;

  kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
  co.socket_dir = a.socket_dir;
  co.name = a.name;
  co.heartbeat_thread = 1;
  co.timeout_ms = 120000;
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  if (kvf_client_connect(&co, &client, &info) != KVF_SUCCESS) {
    fprintf(stderr, "demo engine %s: connect: %s\n", a.name, kvf_last_error());
    goto out;
  }
  kvf_client_region regions[KVF_MAX_REGIONS > 64 ? 64 : KVF_MAX_REGIONS];
  if (cache.num_regions > 64) goto out;
  for (uint32_t r = 0; r < cache.num_regions; r++)
    regions[r] = (kvf_client_region){cache.alloc, cache.offsets[r], src.sizes[r]};
  kvf_client_registration reg = KVF_CLIENT_REGISTRATION_INIT;
  if (kvf_client_register(client, json, json_len, a.device, regions, cache.num_regions, &reg) != KVF_SUCCESS) {
    fprintf(stderr, "demo engine %s: register: %s\n", a.name, kvf_last_error());
    goto out;
  }
  printf("  [%s] pid %d registered on %s: registration %" PRIu64 ", %u imports, %u aliases\n", a.name,
         (int)getpid(), a.device >= 0 ? "a GPU" : "the host backend", reg.registration_id, reg.imports, reg.aliases);
  fflush(stdout);

  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  const demo_tables *t = store ? &stored : &restored;
  for (uint32_t i = 0; i < t->num_groups; i++) gb[i] = (kvf_group_blocks){t->ids[i], t->first[i], t->count[i]};
  char buf[32];
  if (store) {
    const void *ready = NULL;
#ifdef KVF_WITH_CUDA
    /* The blocks were written by cudaMemcpy; an interprocess event recorded
     * after it is what a real engine hands over (its kernels wrote them). */
    cudaEvent_t ev = NULL;
    cudaIpcEventHandle_t handle;
    if (a.device >= 0) {
      if (cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(ev, 0) != cudaSuccess || cudaIpcGetEventHandle(&handle, ev) != cudaSuccess) {
        fprintf(stderr, "demo engine %s: interprocess event failed\n", a.name);
        goto out;
      }
      ready = &handle;
    }
#endif
    uint32_t nreq = a.requests > nkeys ? (uint32_t)nkeys : a.requests;
    uint64_t per = (nkeys + nreq - 1) / nreq;
    nreq = (uint32_t)((nkeys + per - 1) / per);
    req_ids = calloc(nreq, sizeof *req_ids);
    double *t_submit = calloc(nreq, sizeof *t_submit);
    if (!req_ids || !t_submit) {
      free(t_submit);
      goto oom;
    }
    double t0 = now_s(), lat_sum = 0, lat_max = 0;
    uint64_t bytes = 0, objects = 0;
    for (uint32_t q = 0; q < nreq; q++) {
      kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
      x.token_begin = q * per * pol.chunk_tokens;
      x.token_end = (q + 1) * per * pol.chunk_tokens < a.tokens ? (q + 1) * per * pol.chunk_tokens : a.tokens;
      x.format = pol.format;
      x.chunk_keys = keys + q * per;
      x.num_chunk_keys = (uint32_t)((x.token_end - x.token_begin + pol.chunk_tokens - 1) / pol.chunk_tokens);
      x.groups = gb;
      x.num_groups = t->num_groups;
      x.ready_event = ready;
      t_submit[q] = now_s();
      if (kvf_client_submit(client, KVF_CLIENT_STORE, &x, &req_ids[q]) != KVF_SUCCESS) {
        fprintf(stderr, "demo engine %s: store %u: %s\n", a.name, q, kvf_last_error());
        free(t_submit);
        goto out;
      }
    }
    int tty = isatty(STDERR_FILENO);
    for (uint32_t q = 0; q < nreq; q++) {
      kvf_client_result r = KVF_CLIENT_RESULT_INIT;
      kvf_status st = kvf_client_wait(client, req_ids[q], 0, &r);
      double lat = now_s() - t_submit[q];
      if (st != KVF_SUCCESS || r.status != KVF_SUCCESS) {
        fprintf(stderr, "demo engine %s: store %u: %s\n", a.name, q,
                st != KVF_SUCCESS ? kvf_last_error() : kvf_status_string(r.status));
        free(t_submit);
        goto out;
      }
      bytes += r.bytes_done;
      objects += r.objects_done;
      lat_sum += lat;
      if (lat > lat_max) lat_max = lat;
      fprintf(stderr, "%s  [%s] store: request %u/%u done (%" PRIu64 " objects so far)%s", tty ? "\r" : "", a.name,
              q + 1, nreq, objects, tty ? "" : "\n");
    }
    if (tty) fprintf(stderr, "\n");
    double dt = now_s() - t0;
    free(t_submit);
    human(bytes, buf, sizeof buf);
    printf("  [%s] stored %" PRIu64 " tokens: %" PRIu64 " objects, %s in %.3f s (%.2f GB/s), %u requests in flight, "
           "latency mean %.1f ms, max %.1f ms\n",
           a.name, a.tokens, objects, buf, dt, (double)bytes / dt / 1e9, nreq, lat_sum / nreq * 1e3, lat_max * 1e3);
    fflush(stdout);
#ifdef KVF_WITH_CUDA
    if (ev) cudaEventDestroy(ev);
#endif
    /* Tell the parent, then stay registered until it restarts us. */
    if (a.notify_fd >= 0) {
      char b = 'S';
      if (write(a.notify_fd, &b, 1) != 1) goto out;
      close(a.notify_fd);
    }
    char c;
    while (read(STDIN_FILENO, &c, 1) > 0) {
    }
    uint32_t state = 0;
    if (kvf_client_unregister(client, 0, &state) != KVF_SUCCESS) {
      fprintf(stderr, "demo engine %s: unregister: %s\n", a.name, kvf_last_error());
      goto out;
    }
    rc = 0;
    goto out;
  }
  /* Restore: the whole prefix in one request, so the server restores each
   * windowed group's window and the recurrent state at its end. */
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  x.token_begin = 0;
  x.token_end = a.tokens;
  x.format = pol.format;
  x.chunk_keys = keys;
  x.num_chunk_keys = (uint32_t)nkeys;
  x.groups = gb;
  x.num_groups = t->num_groups;
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  double t0 = now_s();
  kvf_status st = kvf_client_retrieve(client, &x, &r);
  double dt = now_s() - t0;
  if (st != KVF_SUCCESS) {
    fprintf(stderr, "demo engine %s: retrieve: %s (%s)\n", a.name, kvf_status_string(st), kvf_last_error());
    goto out;
  }
  human(r.bytes_done, buf, sizeof buf);
  printf("  [%s] retrieved %" PRIu64 " of %" PRIu64 " tokens: %" PRIu64 " objects, %s in %.3f s (%.2f GB/s, one "
         "request)\n",
         a.name, r.prefix_tokens, a.tokens, r.objects_done, buf, dt, (double)r.bytes_done / dt / 1e9);
  for (uint32_t i = 0; i < r.num_groups && i < t->num_groups; i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    printf("  [%s]   %-10s %-14s %6" PRIu64 " blocks restored (engine table: %u from block %" PRIu64 ")\n", a.name,
           gi.name, kvf_group_kind_name(gi.kind), r.group_blocks[i], t->count[i], t->first[i]);
  }
  fflush(stdout);
  if (r.prefix_tokens != a.tokens) {
    print_result(a.name, "retrieve", &r);
    fprintf(stderr, "demo engine %s: only %" PRIu64 " of %" PRIu64 " tokens came back\n", a.name, r.prefix_tokens,
            a.tokens);
    goto out;
  }
  if (engine_cache_copy(&cache, &dst, 1)) goto out;
  uint64_t checked = 0, untouched = 0;
  int bad = demo_verify(g, a.tokens, &src, &stored, &dst, &poison, &restored, &checked, &untouched);
  uint64_t want = moved_bytes(g, &restored, a.tokens);
  char b2[32];
  human(checked, buf, sizeof buf);
  human(untouched, b2, sizeof b2);
  printf("  [%s] verified: %s restored byte for byte, %s of padding and other blocks untouched: %s\n", a.name, buf,
         b2, !bad && checked == want ? "OK" : "MISMATCH");
  fflush(stdout);
  if (bad || checked != want) goto out;
  uint32_t state = 0;
  if (kvf_client_unregister(client, 0, &state) != KVF_SUCCESS) goto out;
  rc = 0;
  goto out;
oom:
  fprintf(stderr, "demo engine %s: out of memory\n", a.name);
out:
  kvf_client_disconnect(client);
  engine_cache_free(&cache);
  cache_free(&src);
  cache_free(&dst);
  cache_free(&poison);
  tables_free(&stored);
  tables_free(&restored);
  free(pool);
  free(keys);
  free(json);
  free(req_ids);
  kvf_geometry_destroy(g);
  return rc;
}

/* ---- the parent ------------------------------------------------------------ */

typedef struct child {
  pid_t pid;
  int stdin_fd;  /* write end: closed to restart a store engine */
  int notify_fd; /* read end: 'S' once the store is done */
} child;

static char self_dir[4096];

static const char *sibling(const char *name, const char *env, char *buf, size_t len) {
  const char *e = getenv(env);
  if (e && *e) return e;
  snprintf(buf, len, "%s/%s", self_dir, name);
  return buf;
}

/* fork + exec argv with stdout shared, stdin from a pipe we keep, and an
 * extra notify pipe passed as fd 3. */
static int spawn(char *const argv[], const char *log_path, child *c) {
  int in[2] = {-1, -1}, note[2] = {-1, -1};
  if (pipe2(in, O_CLOEXEC) || pipe2(note, O_CLOEXEC)) return -1;
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(note[1], 3);
    if (log_path) {
      int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (fd >= 0) dup2(fd, STDERR_FILENO);
    }
    execv(argv[0], argv);
    fprintf(stderr, "kvferry demo: exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  close(in[0]);
  close(note[1]);
  c->pid = pid;
  c->stdin_fd = in[1];
  c->notify_fd = note[0];
  return 0;
}

static int wait_exit(pid_t pid, int timeout_s) {
  for (int i = 0; i < timeout_s * 20; i++) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

static void print_stat(kvf_client *c, const char *when) {
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  if (kvf_client_stat(c, &s) != KVF_SUCCESS) {
    printf("  STAT failed: %s\n", kvf_last_error());
    return;
  }
  char a[32];
  human(s.l1_bytes, a, sizeof a);
  printf("  STAT %-34s registrations active %u, draining %u; imports %" PRIu64 ", aliases %" PRIu64
         ", leases %" PRIu64 "; L1 %" PRIu64 " objects, %s\n",
         when, s.active, s.draining, s.imports, s.aliases, s.leases, s.l1_objects, a);
  fflush(stdout);
}

int cmd_demo_served(int argc, char **argv, const char *geometry_path, const char *preset) {
  uint64_t tokens = 32768, seed = 20261129;
  int force_host = 0, keep = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
      tokens = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
      seed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--host"))
      force_host = 1;
    else if (!strcmp(argv[i], "--keep"))
      keep = 1;
    else if (!strcmp(argv[i], "--preset") && i + 1 < argc)
      i++; /* resolved by the caller */
  }
  if (tokens == 0 || tokens > (1u << 24)) {
    fprintf(stderr, "kvferry demo: --tokens must be 1..16777216\n");
    return 2;
  }
  ssize_t n = readlink("/proc/self/exe", self_dir, sizeof self_dir - 1);
  if (n <= 0) return 1;
  self_dir[n] = 0;
  char *slash = strrchr(self_dir, '/');
  if (slash) *slash = 0;
  char self_path[4200], daemon_path[4200];
  snprintf(self_path, sizeof self_path, "%s/kvferry", self_dir);
  const char *daemon = sibling("kvferryd", "KVF_KVFERRYD", daemon_path, sizeof daemon_path);

  int gpus = 0;
  kvf_cuda_info cuda = KVF_CUDA_INFO_INIT;
  kvf_status cst = force_host ? KVF_ERR_NO_DRIVER : kvf_cuda_probe(&cuda);
  if (cst == KVF_SUCCESS) gpus = cuda.device_count > DEMO_MAX_ENGINES ? DEMO_MAX_ENGINES : cuda.device_count;
  int engines = gpus > 0 ? gpus : 1;
  printf("kvferry %s demo (served): %s, %" PRIu64 " tokens, %d engine%s\n", kvf_version_string(), preset, tokens,
         engines, engines > 1 ? "s" : "");
  if (gpus > 0)
    printf("  backend: %d GPU%s (%s): KV caches in cuMem allocations shared with kvferryd over POSIX file "
           "descriptors, L1 in pinned host memory\n",
           gpus, gpus > 1 ? "s" : "", cuda.message);
  else
    printf("  backend: host (%s): KV caches in memfd memory shared with kvferryd, copied by CPU threads\n",
           force_host ? "--host" : kvf_last_error());

  /* L1 per lane: what one engine's prefix needs, twice over. */
  kvf_geometry *g = NULL;
  uint32_t num_blocks = 0;
  if (demo_geometry_load(geometry_path, tokens, &g, &num_blocks)) return 1;
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t chunks = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens, l1 = 0;
  for (uint64_t k = 0; k < chunks; k++)
    for (uint32_t og = 0; og < kvf_geometry_num_object_groups(g); og++) {
      uint64_t b = 0;
      kvf_geometry_object_size(g, og, k, tokens, &b);
      l1 += (b + 255) / 256 * 256;
    }
  kvf_geometry_destroy(g);
  uint64_t l1_mb = (l1 * 2 >> 20) + 64;

  char tmp[] = "/tmp/kvferry-demo-XXXXXX";
  if (!mkdtemp(tmp)) {
    fprintf(stderr, "kvferry demo: mkdtemp: %s\n", strerror(errno));
    return 1;
  }
  char sock[4200], log_path[4200], l1_arg[32], tok_arg[32], seed_arg[32];
  snprintf(sock, sizeof sock, "%s/sock", tmp);
  snprintf(log_path, sizeof log_path, "%s/kvferryd.log", tmp);
  snprintf(l1_arg, sizeof l1_arg, "%" PRIu64, l1_mb);
  snprintf(tok_arg, sizeof tok_arg, "%" PRIu64, tokens);

  int rc = 1, verified = 0;
  child server = {0}, eng[DEMO_MAX_ENGINES];
  memset(eng, 0, sizeof eng);
  kvf_client *stat_client = NULL;
  char *dargv[] = {(char *)daemon, "--socket-dir", sock, "--devices", gpus > 0 ? "all" : "none", "--l1-mb", l1_arg,
                   "--log-level", "info", NULL};
  fprintf(stderr, "  starting kvferryd (%s MiB of L1 per lane; log %s)\n", l1_arg, log_path);
  if (spawn(dargv, log_path, &server)) goto out;
  kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
  co.socket_dir = sock;
  co.name = "demo";
  co.heartbeat_thread = 1;
  for (int i = 0; i < 600 && !stat_client; i++) {
    if (kvf_client_connect(&co, &stat_client, NULL) == KVF_SUCCESS) break;
    if (waitpid(server.pid, NULL, WNOHANG) == server.pid) {
      server.pid = 0;
      fprintf(stderr, "kvferry demo: kvferryd exited at start (see %s)\n", log_path);
      goto out;
    }
    struct timespec ts = {0, 50000000};
    nanosleep(&ts, NULL);
  }
  if (!stat_client) {
    fprintf(stderr, "kvferry demo: kvferryd did not come up (see %s)\n", log_path);
    goto out;
  }
  print_stat(stat_client, "(server up):");

  /* Store: every engine at once. */
  for (int e = 0; e < engines; e++) {
    char dev[16], name[32];
    snprintf(dev, sizeof dev, "%d", gpus > 0 ? e : -1);
    snprintf(name, sizeof name, gpus > 0 ? "gpu%d" : "host", e);
    /* Each engine serves its own prompt: its own objects in L1. */
    snprintf(seed_arg, sizeof seed_arg, "%" PRIu64, seed + (uint64_t)e);
    char *eargv[] = {self_path, "demo-engine", "--socket-dir", sock, "--geometry", (char *)geometry_path,
                     "--role", "store", "--name", name, "--tokens", tok_arg, "--seed", seed_arg, "--device", dev,
                     "--notify-fd", "3", NULL};
    fprintf(stderr, "  starting engine %s (store)\n", name);
    if (spawn(eargv, NULL, &eng[e])) goto out;
  }
  for (int e = 0; e < engines; e++) {
    struct pollfd p = {eng[e].notify_fd, POLLIN, 0};
    char b = 0;
    if (poll(&p, 1, 600000) != 1 || read(eng[e].notify_fd, &b, 1) != 1 || b != 'S') {
      fprintf(stderr, "kvferry demo: engine %d did not finish its store (exit %d)\n", e, wait_exit(eng[e].pid, 5));
      eng[e].pid = 0;
      goto out;
    }
  }
  print_stat(stat_client, "(every engine stored):");

  /* Restart each engine in turn; the others stay registered meanwhile. */
  for (int e = 0; e < engines; e++) {
    char dev[16], name[32];
    snprintf(dev, sizeof dev, "%d", gpus > 0 ? e : -1);
    snprintf(name, sizeof name, gpus > 0 ? "gpu%d'" : "host'", e);
    snprintf(seed_arg, sizeof seed_arg, "%" PRIu64, seed + (uint64_t)e);
    fprintf(stderr, "  restarting engine %d: it unregisters and exits\n", e);
    close(eng[e].stdin_fd);
    eng[e].stdin_fd = -1;
    int st = wait_exit(eng[e].pid, 60);
    eng[e].pid = 0;
    if (st != 0) {
      fprintf(stderr, "kvferry demo: engine %d exited with %d\n", e, st);
      goto out;
    }
    char when[64];
    snprintf(when, sizeof when, "(engine %d exited):", e);
    print_stat(stat_client, when);
    char *eargv[] = {self_path, "demo-engine", "--socket-dir", sock, "--geometry", (char *)geometry_path,
                     "--role", "restore", "--name", name, "--tokens", tok_arg, "--seed", seed_arg, "--device", dev,
                     NULL};
    child r = {0};
    if (spawn(eargv, NULL, &r)) goto out;
    close(r.stdin_fd);
    close(r.notify_fd);
    st = wait_exit(r.pid, 600);
    if (st != 0) {
      fprintf(stderr, "kvferry demo: restored engine %d failed (exit %d)\n", e, st);
      goto out;
    }
    verified++;
  }
  print_stat(stat_client, "(every engine restored, exited):");
  rc = 0;
out:
  for (int e = 0; e < engines; e++) {
    if (eng[e].stdin_fd > 0) close(eng[e].stdin_fd);
    if (eng[e].notify_fd > 0) close(eng[e].notify_fd);
    if (eng[e].pid > 0) {
      kill(eng[e].pid, SIGKILL);
      waitpid(eng[e].pid, NULL, 0);
    }
  }
  kvf_client_disconnect(stat_client);
  if (server.pid > 0) {
    kill(server.pid, SIGTERM);
    int st = wait_exit(server.pid, 30);
    if (st != 0) {
      fprintf(stderr, "kvferry demo: kvferryd exited with %d (see %s)\n", st, log_path);
      rc = 1;
    }
    close(server.stdin_fd);
    close(server.notify_fd);
  }
  printf("  verdict: %s (%d of %d engine%s restored and verified)\n", rc == 0 ? "OK" : "FAILED", verified, engines,
         engines > 1 ? "s" : "");
  if (rc == 0 && !keep) {
    unlink(log_path);
    rmdir(sock);
    rmdir(tmp);
  } else {
    printf("  kvferryd's log: %s\n", log_path);
  }
  return rc;
}
