/* perf/kvf_bench.cu - kvferry's transfer benchmark.
 *
 * For each preset geometry, direction, request size and SM cap it times, with
 * CUDA events and medians over many repetitions:
 *   kvferry   kvf_xfer_gather / kvf_xfer_scatter, one call per request;
 *   limit     one contiguous cudaMemcpyAsync of the same payload bytes in the
 *             same direction (what the link or memory can do);
 *   memcpy    one cudaMemcpyAsync per contiguous run (what engines do today);
 *   batch     cudaMemcpyBatchAsync over the same runs;
 *   cub       cub::DeviceMemcpy::Batched over the same runs;
 *   peers     our implementations of LMCache's and SGLang's transfer kernels
 *             (bench_peers.h), on the same tables and objects.
 * kvferry also runs under tuning variants (--tune) that move the crossovers
 * the planner's routes follow, so one run measures where they lie.
 * Bandwidths count payload bytes only (padding never counted). Sources hold
 * random data; buffer sets rotate so that the working set is well above L2.
 * kvferry's result is checked byte for byte against the CPU reference once per
 * configuration before it is timed.
 *
 * Modes: sweep (the above), latency (one request, each call synchronized:
 * enqueue, GPU and end-to-end times), interference (the slowdown of a
 * compute-bound kernel on another stream while transfers run back to back).
 * Everything goes into one JSON file (perf/report.py renders it).
 *
 * Run with --help for the options; perf/run_bench.sh runs the standard sweep. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/device/device_memcpy.cuh>

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/kvferry.h>
#include <kvferry/transfer.h>

#include "bench_json.h"
#include "bench_peers.h"
#include "bench_plan.h"
#include "host/core/param.h"
#include "host/core/xfer_internal.h"

#ifndef KVF_PRESET_DIR_BUILD
#define KVF_PRESET_DIR_BUILD ""
#endif
#ifndef KVF_PRESET_DIR_INSTALL
#define KVF_PRESET_DIR_INSTALL ""
#endif
#ifndef KVF_GIT_COMMIT
#define KVF_GIT_COMMIT "unknown"
#endif

using namespace kvfb;

namespace {

/* ---- errors ------------------------------------------------------------------ */

struct CudaError : std::runtime_error {
  cudaError_t code;
  CudaError(cudaError_t c, const char *call, const char *file, int line)
      : std::runtime_error(std::string(call) + ": " + cudaGetErrorName(c) + " (" + cudaGetErrorString(c) + ") at " +
                           file + ":" + std::to_string(line)),
        code(c) {}
};

struct BenchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define CK(call)                                                         \
  do {                                                                   \
    cudaError_t e_ = (call);                                             \
    if (e_ != cudaSuccess) throw CudaError(e_, #call, __FILE__, __LINE__); \
  } while (0)

#define CK_LAUNCH() CK(cudaGetLastError())

void kvf_check(kvf_status st, const std::string &what) {
  if (st != KVF_SUCCESS) throw BenchError(what + ": " + kvf_status_string(st) + ": " + kvf_last_error());
}

/* ---- options ----------------------------------------------------------------- */

struct Options {
  std::string mode = "sweep";
  std::vector<std::string> presets;
  std::string preset_dir;
  std::vector<std::string> directions = {"d2h", "h2d", "d2d", "p2p"};
  std::vector<uint64_t> tokens = {256, 4096, 32768};
  std::vector<int> sms = {0};        /* 0: default, -1: all SMs; host <-> device directions */
  std::vector<int> sms_device = {0}; /* the same for d2d and p2p */
  bool base_limit = true, base_memcpy = true, base_batch = true, base_cub = true;
  kvf_object_format format = KVF_FORMAT_CANONICAL;
  double target_ms = 100;
  int min_reps = 5, max_reps = 200, warmup = 2;
  size_t max_memcpy_runs = 8192, max_batch_runs = 65536;
  uint32_t min_sets = 1, max_sets = 64;
  bool verify = true, prime = true;
  bool sustained = true;             /* also time each sweep contender back to back, host enqueue charged */
  int device = 0, peer = 1;
  uint64_t seed = 20261129;
  std::string gemm = "auto";
  int gemm_n = 8192;
  int latency_reps = 200;
  int idle_ms = 0;                    /* latency: the stream and GPU left idle this long before each call */
  int interference_samples = 7;
  double interference_ms = 25;
  std::string out = "kvf_bench.json";
  std::string label;
  bool plan = false;
  std::string peers = "all";          /* bench_peers.h names */
  uint64_t peers_max_tokens = 16384;  /* peers run at sizes up to this */
  std::vector<std::string> tunes;     /* kvferry tuning variants */
  int enqueue_reps = 15;              /* synchronized calls for the host enqueue time */
  std::vector<std::string> argv;
};

Options g_opt;

void usage(FILE *f) {
  fprintf(f,
          "usage: kvf_bench [options]\n"
          "\n"
          "  --mode sweep|latency|interference   what to measure (default sweep)\n"
          "  --preset NAME[,NAME...]   presets (names in the preset dir, or paths to geometry files);\n"
          "                            default: all in the preset dir\n"
          "                            (latency: deepseek-v3-mla-bf16, interference: llama-3.1-8b-fa-nhd)\n"
          "  --preset-dir DIR          where presets live (default $KVF_PRESET_DIR, the source tree, the install)\n"
          "  --directions LIST         d2h,h2d,d2d,d2d-scatter,p2p,p2p-scatter (default d2h,h2d,d2d,p2p)\n"
          "                            d2h: gather into pinned host objects; h2d: scatter from them; d2d: both\n"
          "                            on this GPU; p2p: cache on --device, objects on --peer-device (skipped\n"
          "                            when there is no peer GPU)\n"
          "  --tokens LIST             request sizes in tokens (default 256,4096,32768; rounded up to whole\n"
          "                            chunks); latency and interference use the first\n"
          "  --sms LIST                kvferry SM caps: 0 or default (the planner's choice), N, all (default 0)\n"
          "  --sms-pcie LIST           caps for d2h and h2d only; --sms-device LIST: for d2d and p2p only\n"
          "  --baselines LIST          limit,memcpy,batch,cub | all | none (default all)\n"
          "  --format canonical|native object format (default canonical)\n"
          "  --target-ms MS            timed time per measurement (default 100)\n"
          "  --min-reps N --max-reps N repetitions per measurement (default 5, 200)\n"
          "  --warmup N                untimed calls first (default 2)\n"
          "  --max-memcpy-runs N       per-run cudaMemcpyAsync: time a uniform sample of at most N runs and\n"
          "                            extrapolate by bytes (default 8192; 0: all)\n"
          "  --max-batch-runs N        the same for cudaMemcpyBatchAsync (default 65536)\n"
          "  --min-sets N --max-sets N buffer sets rotated between repetitions (default 1, 64; at least 2\n"
          "                            whenever one request's payload is under 4x the L2)\n"
          "  --no-verify               skip the byte-for-byte check against the CPU reference\n"
          "  --no-prime                do not hold the stream with a short spin kernel while queueing reps\n"
          "  --no-sustained            skip the sustained time per call: after each sweep measurement, n calls back\n"
          "                            to back from one host thread, no priming, wall time to the synchronize after\n"
          "                            the last (host enqueue charged; n = its reps, at most about --target-ms)\n"
          "  --device N --peer-device N   GPUs (default 0 and 1)\n"
          "  --seed S                  random seed (block ids and data)\n"
          "  --gemm auto|cublas|fma    interference workload (auto: cuBLAS bf16 GEMM if libcublas.so.13 loads)\n"
          "  --gemm-n N                GEMM size (default 8192)\n"
          "  --latency-reps N          synchronized calls per latency figure (default 200)\n"
          "  --idle-ms N               latency: sleep N ms before each call, so each finds the GPU and host idle\n"
          "                            (default 0: back to back)\n"
          "  --samples N               interference samples (default 7)\n"
          "  --out FILE                JSON output (default kvf_bench.json)\n"
          "  --label TEXT              free text stored in the JSON\n"
          "  --peers LIST              peer kernels: lmcache-mp,lmcache-mp-staged,lmcache-legacy,sglang-q<N>,\n"
          "                            sglang-qsm | all | none (default all; sweep and interference)\n"
          "  --peers-max-tokens N      run the peers at request sizes up to N tokens (default 16384)\n"
          "  --tune SPEC               also time kvferry with tuning SPEC = key=value[,key=value...] (repeatable; every\n"
          "                            mode: sweep, latency and interference);\n"
          "                            keys: pieces, growth, dma_batch, param_bytes, task_bytes, task_waves, device_task_waves,\n"
          "                            batch_min_run, batch_max_runs, batch_first_runs, batch_link_gbps, batch_back_to_back_us,\n"
          "                            batch_host_bound, batch_staged_cost,\n"
          "                            stage_sms, pcie_sms, staging_mb, kernel,\n"
          "                            small_stage_mb, small_stage_growth, small_stage_one_piece, edge_mb, multi_pieces,\n"
          "                            straight_kb, straight_min_run, straight_alone, spread_kb, spread_deep_kb,\n"
          "                            spread_deep_max_mb, cache_order, overlap,\n"
          "                            defer (1: deferred calls, each joined into the stream after its post)\n"
          "                            (host/core/xfer_internal.h),\n"
          "                            cap (the context's max_sms). Variants are checked like every contender.\n"
          "  --enqueue-reps N          synchronized calls timing the host enqueue of each kvferry entry (default 15;\n"
          "                            0: off)\n"
          "  --list                    list the presets and exit\n"
          "  --plan                    print what a run would measure (sizes, sets, payload, runs, memory)\n"
          "                            and a rough time estimate, without touching a GPU\n");
}

std::vector<std::string> split(const std::string &s, char sep = ',') {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(sep, a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

uint64_t parse_u64(const std::string &s, const char *opt) {
  char *end = nullptr;
  errno = 0;
  unsigned long long v = strtoull(s.c_str(), &end, 10);
  if (errno || !end || *end || s.empty() || s[0] == '-') throw BenchError(std::string(opt) + ": '" + s + "' is not a number");
  return v;
}

bool is_dir(const std::string &p) {
  struct stat st;
  return !p.empty() && stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string preset_dir() {
  if (!g_opt.preset_dir.empty()) return g_opt.preset_dir;
  const char *env = getenv("KVF_PRESET_DIR");
  if (env && is_dir(env)) return env;
  if (is_dir(KVF_PRESET_DIR_BUILD)) return KVF_PRESET_DIR_BUILD;
  if (is_dir(KVF_PRESET_DIR_INSTALL)) return KVF_PRESET_DIR_INSTALL;
  return "";
}

std::vector<std::string> list_presets() {
  std::vector<std::string> out;
  std::string dir = preset_dir();
  if (dir.empty()) return out;
  std::string cmd;
  if (DIR *d = opendir(dir.c_str())) {
    while (dirent *e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0) out.push_back(n.substr(0, n.size() - 5));
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void parse_args(int argc, char **argv) {
  Options &o = g_opt;
  for (int i = 0; i < argc; i++) o.argv.push_back(argv[i]);
  auto need = [&](int &i) -> std::string {
    if (i + 1 >= argc) throw BenchError(std::string(argv[i]) + ": needs a value");
    return argv[++i];
  };
  bool presets_set = false, tokens_set = false, dirs_set = false, list = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      exit(0);
    } else if (a == "--list") {
      list = true;
    } else if (a == "--plan") {
      o.plan = true;
    } else if (a == "--mode") {
      o.mode = need(i);
      if (o.mode != "sweep" && o.mode != "latency" && o.mode != "interference")
        throw BenchError("--mode: '" + o.mode + "' (sweep, latency, interference)");
    } else if (a == "--preset" || a == "--presets") {
      o.presets = split(need(i));
      presets_set = true;
    } else if (a == "--preset-dir") {
      o.preset_dir = need(i);
    } else if (a == "--directions" || a == "--direction") {
      o.directions = split(need(i));
      dirs_set = true;
    } else if (a == "--tokens") {
      o.tokens.clear();
      for (const std::string &t : split(need(i))) o.tokens.push_back(parse_u64(t, "--tokens"));
      tokens_set = true;
    } else if (a == "--sms" || a == "--sms-pcie" || a == "--sms-device") {
      std::vector<int> caps;
      for (const std::string &t : split(need(i))) {
        if (t == "all")
          caps.push_back(-1);
        else if (t == "default")
          caps.push_back(0);
        else
          caps.push_back((int)parse_u64(t, a.c_str()));
      }
      if (caps.empty()) throw BenchError(a + ": empty list");
      if (a != "--sms-device") o.sms = caps;
      if (a != "--sms-pcie") o.sms_device = caps;
    } else if (a == "--baselines") {
      std::string v = need(i);
      o.base_limit = o.base_memcpy = o.base_batch = o.base_cub = (v == "all");
      if (v != "all" && v != "none")
        for (const std::string &b : split(v)) {
          if (b == "limit") o.base_limit = true;
          else if (b == "memcpy") o.base_memcpy = true;
          else if (b == "batch") o.base_batch = true;
          else if (b == "cub") o.base_cub = true;
          else throw BenchError("--baselines: '" + b + "' (limit, memcpy, batch, cub, all, none)");
        }
    } else if (a == "--format") {
      std::string v = need(i);
      if (v == "canonical") o.format = KVF_FORMAT_CANONICAL;
      else if (v == "native") o.format = KVF_FORMAT_NATIVE;
      else throw BenchError("--format: '" + v + "' (canonical, native)");
    } else if (a == "--target-ms") {
      o.target_ms = atof(need(i).c_str());
    } else if (a == "--min-reps") {
      o.min_reps = (int)parse_u64(need(i), "--min-reps");
    } else if (a == "--max-reps") {
      o.max_reps = (int)parse_u64(need(i), "--max-reps");
    } else if (a == "--warmup") {
      o.warmup = (int)parse_u64(need(i), "--warmup");
    } else if (a == "--max-memcpy-runs") {
      o.max_memcpy_runs = parse_u64(need(i), a.c_str());
    } else if (a == "--max-batch-runs") {
      o.max_batch_runs = parse_u64(need(i), a.c_str());
    } else if (a == "--min-sets") {
      o.min_sets = (uint32_t)parse_u64(need(i), a.c_str());
    } else if (a == "--max-sets") {
      o.max_sets = (uint32_t)parse_u64(need(i), a.c_str());
    } else if (a == "--no-verify") {
      o.verify = false;
    } else if (a == "--no-prime") {
      o.prime = false;
    } else if (a == "--no-sustained") {
      o.sustained = false;
    } else if (a == "--device") {
      o.device = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--peer-device") {
      o.peer = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--seed") {
      o.seed = parse_u64(need(i), a.c_str());
    } else if (a == "--gemm") {
      o.gemm = need(i);
      if (o.gemm != "auto" && o.gemm != "cublas" && o.gemm != "fma") throw BenchError("--gemm: auto, cublas or fma");
    } else if (a == "--gemm-n") {
      o.gemm_n = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--latency-reps") {
      o.latency_reps = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--idle-ms") {
      o.idle_ms = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--samples") {
      o.interference_samples = (int)parse_u64(need(i), a.c_str());
    } else if (a == "--interference-ms") {
      o.interference_ms = atof(need(i).c_str());
    } else if (a == "--out") {
      o.out = need(i);
    } else if (a == "--label") {
      o.label = need(i);
    } else if (a == "--peers") {
      o.peers = need(i);
    } else if (a == "--no-peers") {
      o.peers = "none";
    } else if (a == "--peers-max-tokens") {
      o.peers_max_tokens = parse_u64(need(i), a.c_str());
    } else if (a == "--tune") {
      o.tunes.push_back(need(i));
    } else if (a == "--enqueue-reps") {
      o.enqueue_reps = (int)parse_u64(need(i), a.c_str());
    } else {
      throw BenchError("unknown option '" + a + "' (see --help)");
    }
  }
  if (list) {
    for (const std::string &p : list_presets()) printf("%s\n", p.c_str());
    exit(0);
  }
  if (o.min_reps < 1) o.min_reps = 1;
  if (o.max_reps < o.min_reps) o.max_reps = o.min_reps;
  if (o.min_sets < 1) o.min_sets = 1;
  if (o.max_sets < o.min_sets) o.max_sets = o.min_sets;
  if (!presets_set) {
    if (o.mode == "latency") o.presets = {"deepseek-v3-mla-bf16"};
    else if (o.mode == "interference") o.presets = {"llama-3.1-8b-fa-nhd"};
    else o.presets = list_presets();
  }
  if (!tokens_set) {
    if (o.mode == "latency") o.tokens = {256};
    if (o.mode == "interference") o.tokens = {4096};
  }
  if (!dirs_set) {
    if (o.mode == "latency") o.directions = {"d2h", "h2d", "d2d", "p2p"};
    if (o.mode == "interference") o.directions = {"d2h", "h2d"};
  }
  if (o.presets.empty()) throw BenchError("no presets found (set --preset-dir or KVF_PRESET_DIR)");
  for (uint64_t t : o.tokens)
    if (t == 0 || t > (1u << 24)) throw BenchError("--tokens: sizes must be 1 .. 16777216");
}

/* ---- small utilities --------------------------------------------------------- */

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

unsigned host_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 4 : std::min(n, 32u);
}

void parallel_for(size_t n, const std::function<void(size_t, size_t)> &fn) {
  unsigned t = (unsigned)std::min<size_t>(host_threads(), std::max<size_t>(n, 1));
  if (t <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> th;
  for (unsigned i = 0; i < t; i++) {
    size_t a = n * i / t, b = n * (i + 1) / t;
    th.emplace_back([&fn, a, b] { fn(a, b); });
  }
  for (auto &x : th) x.join();
}

/* Host memory that is not zero-filled, page-aligned: regions carved from it
 * must honour the geometry's region alignment like the device cache does. */
struct HostBuf {
  struct Free {
    void operator()(char *q) const { std::free(q); }
  };
  std::unique_ptr<char, Free> p;
  size_t bytes = 0;
  void ensure(size_t n) {
    if (n > bytes) {
      p.reset();
      p.reset(static_cast<char *>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)));
      if (!p) throw std::bad_alloc();
      bytes = n;
    }
  }
  char *get() { return p.get(); }
};

/* First differing byte, or SIZE_MAX. */
size_t pcompare(const char *x, const char *y, size_t n) {
  const size_t piece = 1 << 20;
  size_t pieces = (n + piece - 1) / piece;
  std::vector<size_t> first(pieces, SIZE_MAX);
  parallel_for(pieces, [&](size_t a, size_t b) {
    for (size_t i = a; i < b; i++) {
      size_t lo = i * piece, hi = std::min(n, lo + piece);
      if (memcmp(x + lo, y + lo, hi - lo) == 0) continue;
      for (size_t k = lo; k < hi; k++)
        if (x[k] != y[k]) {
          first[i] = k;
          break;
        }
    }
  });
  for (size_t f : first)
    if (f != SIZE_MAX) return f;
  return SIZE_MAX;
}

std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *f, ...) {
  char b[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(b, sizeof b, f, ap);
  va_end(ap);
  return b;
}

/* ---- kernels ------------------------------------------------------------------- */

__host__ __device__ inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/* Random words (never all zeros in practice) into device, peer or mapped host memory. */
__global__ void k_fill(uint64_t *p, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
    p[i] = mix64(seed + (i + 1) * 0x9e3779b97f4a7c15ull);
}

/* Holds a stream for ns nanoseconds, so the host can queue timed work behind it
 * and the events measure the GPU, not the host's launch rate. */
__global__ void k_spin(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

/* Compute-bound stand-in when cuBLAS is absent: 8 independent FMA chains per thread. */
__global__ void k_fma(float *out, int iters, float seed) {
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; j++) a[j] = seed + (float)(threadIdx.x + j);
  for (int i = 0; i < iters; i++) {
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = fmaf(a[j], 0.9999999f, 1e-7f);
  }
  float s = 0;
#pragma unroll
  for (int j = 0; j < 8; j++) s += a[j];
  out[blockIdx.x * (size_t)blockDim.x + threadIdx.x] = s;
}

__global__ void k_fill_bf16(__nv_bfloat16 *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float u = (float)(mix64(seed + i) >> 40) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16(2.0f * u - 1.0f);
  }
}

/* ---- device state ---------------------------------------------------------------- */

struct Gpu {
  int dev = 0, peer = -1, count = 0;
  bool peer_ok = false;
  std::string peer_reason;
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;  /* transfers and baselines */
  cudaStream_t stream2 = nullptr; /* the interference workload */
  std::vector<cudaEvent_t> ev;
};
Gpu g_gpu;

void fill_random(void *p, size_t bytes, uint64_t seed, int device) {
  int cur;
  CK(cudaGetDevice(&cur));
  CK(cudaSetDevice(device));
  size_t words = bytes / 8;
  k_fill<<<1024, 256>>>((uint64_t *)p, words, seed);
  CK_LAUNCH();
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(cur));
}

enum class Mem { Device, Host, Peer };

const char *mem_name(Mem m) {
  return m == Mem::Device ? "device" : m == Mem::Host ? "pinned_host" : "peer_device";
}

struct Buffer {
  char *p = nullptr;
  size_t bytes = 0;
  Mem kind = Mem::Device;
  void alloc(Mem k, size_t n) {
    release();
    kind = k;
    bytes = n;
    if (k == Mem::Host) {
      void *h = nullptr;
      CK(cudaHostAlloc(&h, n, cudaHostAllocPortable | cudaHostAllocMapped));
      void *d = nullptr;
      CK(cudaHostGetDevicePointer(&d, h, 0));
      if (d != h) throw BenchError("pinned host memory is not reachable at the same address (no UVA?)");
      p = (char *)h;
    } else {
      CK(cudaSetDevice(k == Mem::Peer ? g_gpu.peer : g_gpu.dev));
      void *d = nullptr;
      cudaError_t e = cudaMalloc(&d, n);
      cudaSetDevice(g_gpu.dev);
      CK(e);
      p = (char *)d;
    }
  }
  int device() const { return kind == Mem::Peer ? g_gpu.peer : g_gpu.dev; }
  void release() {
    if (!p) return;
    if (kind == Mem::Host)
      cudaFreeHost(p);
    else
      cudaFree(p);
    p = nullptr;
    bytes = 0;
  }
  ~Buffer() { release(); }
};

/* ---- timing ---------------------------------------------------------------------- */

struct Timing {
  bool ok = false;
  std::string error;
  int reps = 0;
  double median_us = NAN, p10_us = NAN, p90_us = NAN, min_us = NAN;
  double enqueue_us = NAN; /* median host time of one call */
  bool primed = false;
  double sustained_us = NAN; /* wall time per call, back to back from one thread (NAN: not measured) */
  int sustained_reps = 0;
};

double pct(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  double pos = q * (double)(v.size() - 1);
  size_t lo = (size_t)pos, hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - (double)lo);
}

void ensure_events(size_t n) {
  while (g_gpu.ev.size() < n) {
    cudaEvent_t e;
    CK(cudaEventCreate(&e));
    g_gpu.ev.push_back(e);
  }
}

/* Median GPU time of op(i) over many repetitions, each bracketed by events on
 * the stream. The first call is a pilot that sizes the repetition count. With
 * priming, a spin kernel holds the stream while the reps are queued (three
 * times the pilot's host time per rep, at most 20 ms), so short
 * device work is timed back to back rather than at the host's launch rate
 * (host-bound baselines stay host-bound: their queueing outlasts the spin). */
Timing measure(const std::function<void(int)> &op, cudaStream_t s, bool prime = true) {
  Timing t;
  for (int i = 0; i < g_opt.warmup; i++) op(i);
  CK(cudaStreamSynchronize(s));
  ensure_events(2 * (size_t)g_opt.max_reps + 2);
  cudaEvent_t *ev = g_gpu.ev.data();
  double h0 = now_s();
  CK(cudaEventRecord(ev[0], s));
  op(g_opt.warmup);
  CK(cudaEventRecord(ev[1], s));
  double pilot_enqueue = now_s() - h0;
  CK(cudaStreamSynchronize(s));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
  double pilot_us = std::max(ms * 1e3, 1.0);
  int reps = (int)std::ceil(g_opt.target_ms * 1e3 / pilot_us);
  reps = std::max(g_opt.min_reps, std::min(g_opt.max_reps, reps));
  if (prime && g_opt.prime) {
    /* Three times the pilot's enqueue: this host's enqueue can double between
     * one call and the next (a KVM guest whose host time per CUDA call is
     * bimodal), and a spin that ends before the last rep is queued times the
     * later reps at the host's pace. */
    double spin_us = std::min(20000.0, reps * pilot_enqueue * 1e6 * 3 + 20);
    k_spin<<<1, 1, 0, s>>>((uint64_t)(spin_us * 1e3));
    CK_LAUNCH();
    t.primed = true;
  }
  std::vector<double> enq(reps);
  for (int i = 0; i < reps; i++) {
    CK(cudaEventRecord(ev[2 * i], s));
    double a = now_s();
    op(i);
    enq[i] = (now_s() - a) * 1e6;
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<double> us(reps);
  for (int i = 0; i < reps; i++) {
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1e3;
  }
  t.ok = true;
  t.reps = reps;
  t.median_us = pct(us, 0.5);
  t.p10_us = pct(us, 0.1);
  t.p90_us = pct(us, 0.9);
  t.min_us = *std::min_element(us.begin(), us.end());
  t.enqueue_us = pct(enq, 0.5);
  return t;
}

/* Sustained time per call: n calls of op back to back from this thread with
 * nothing holding the stream, from just before the first to the return of the
 * synchronize after the last, over n. measure()'s events hide the host's
 * enqueue; this charges it, so a contender whose enqueue outlasts its copy
 * (cudaMemcpyBatchAsync over many runs) gets the rate one engine thread can
 * keep. n is measure()'s reps, cut to about target_ms, at least 5. */
void measure_sustained(const std::function<void(int)> &op, cudaStream_t s, Timing &t) {
  if (!g_opt.sustained || !t.ok) return;
  double per_call_us = std::max({t.median_us, t.enqueue_us, 1.0});
  int n = (int)std::min<double>(t.reps, std::floor(g_opt.target_ms * 1e3 / per_call_us));
  n = std::max(5, n);
  CK(cudaStreamSynchronize(s));
  double a = now_s();
  for (int i = 0; i < n; i++) op(i);
  CK(cudaStreamSynchronize(s));
  t.sustained_us = (now_s() - a) * 1e6 / n;
  t.sustained_reps = n;
}

/* What every sweep contender gets: GPU time (measure), then the sustained time. */
Timing measure_gpu_and_sustained(const std::function<void(int)> &op, cudaStream_t s) {
  Timing t = measure(op, s);
  measure_sustained(op, s, t);
  return t;
}

/* Latency: every call alone, synchronized: host enqueue, GPU (events) and
 * end-to-end (call to the return of the synchronize) times. */
struct Latency {
  bool ok = false;
  std::string error;
  int reps = 0;
  double gpu_us = NAN, gpu_p90_us = NAN, enqueue_us = NAN, wall_us = NAN, wall_p90_us = NAN;
};

/* settle, when given, runs after the call's host time is taken and before
 * the end event (a deferred call's join). */
Latency measure_latency(const std::function<void(int)> &op, cudaStream_t s, int reps,
                        const std::function<void()> &settle = {}) {
  Latency l;
  for (int i = 0; i < g_opt.warmup; i++) {
    op(i);
    if (settle) settle();
  }
  CK(cudaStreamSynchronize(s));
  ensure_events(2);
  std::vector<double> gpu(reps), enq(reps), wall(reps);
  for (int i = 0; i < reps; i++) {
    if (g_opt.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(g_opt.idle_ms));
    double a = now_s();
    CK(cudaEventRecord(g_gpu.ev[0], s));
    op(i);
    double b = now_s();
    if (settle) settle();
    CK(cudaEventRecord(g_gpu.ev[1], s));
    CK(cudaStreamSynchronize(s));
    double c = now_s();
    float ms;
    CK(cudaEventElapsedTime(&ms, g_gpu.ev[0], g_gpu.ev[1]));
    gpu[i] = ms * 1e3;
    enq[i] = (b - a) * 1e6;
    wall[i] = (c - a) * 1e6;
  }
  l.ok = true;
  l.reps = reps;
  l.gpu_us = pct(gpu, 0.5);
  l.gpu_p90_us = pct(gpu, 0.9);
  l.enqueue_us = pct(enq, 0.5);
  l.wall_us = pct(wall, 0.5);
  l.wall_p90_us = pct(wall, 0.9);
  return l;
}

double gbps(uint64_t bytes, double us) { return (us > 0 && std::isfinite(us)) ? (double)bytes / (us * 1e3) : NAN; }

void write_timing(JsonWriter &j, const Timing &t, uint64_t bytes, double scale = 1.0) {
  j.kv("ok", t.ok);
  if (!t.ok) {
    j.kv("error", t.error);
    return;
  }
  j.kv("reps", t.reps).kv("median_us", t.median_us * scale).kv("p10_us", t.p10_us * scale);
  j.kv("p90_us", t.p90_us * scale).kv("min_us", t.min_us * scale).kv("enqueue_us", t.enqueue_us * scale);
  j.kv("primed", t.primed).kv("gbps", gbps(bytes, t.median_us * scale));
  if (std::isfinite(t.sustained_us)) {
    j.kv("sustained_us", t.sustained_us * scale).kv("sustained_reps", t.sustained_reps);
    j.kv("sustained_gbps", gbps(bytes, t.sustained_us * scale));
  }
}

/* ---- directions ------------------------------------------------------------------- */

struct Direction {
  std::string name;
  bool gather;
  Mem objects;
};

bool direction_by_name(const std::string &n, Direction *d) {
  static const Direction all[] = {{"d2h", true, Mem::Host},     {"h2d", false, Mem::Host},
                                  {"d2d", true, Mem::Device},   {"d2d-scatter", false, Mem::Device},
                                  {"p2p", true, Mem::Peer},     {"p2p-scatter", false, Mem::Peer}};
  for (const Direction &x : all)
    if (x.name == n) {
      *d = x;
      return true;
    }
  return false;
}

/* ---- one preset's state ------------------------------------------------------------- */

struct SizePlan {
  uint64_t tokens_requested = 0, tokens = 0;
  uint32_t sets = 1;
  uint64_t need = 0;            /* block ids one set uses */
  uint64_t payload_estimate = 0;
  std::vector<Tables> tables;   /* per set */
  ObjectLayout layout;          /* identical for every set */
  std::string skip;             /* why this size is not measured ("" = measured) */
};

/* Contexts of a variant with defer=1: their calls go through
 * kvf_xfer_gather_deferred / kvf_xfer_scatter_deferred. Keyed by address,
 * so a context leaves both maps when it is destroyed: a later preset's
 * context at the same address must not inherit its mode. */
std::set<const kvf_xfer *> g_deferred_ctx;

/* The ticket of each deferred context's last call not yet joined. */
std::map<const kvf_xfer *, uint64_t> g_unjoined;

struct Preset {
  std::string name, path;
  kvf_geometry *g = nullptr;
  uint32_t num_blocks = 0;
  std::vector<SizePlan> sizes;
  Buffer cache;                     /* every region, carved from one allocation on the device */
  std::vector<void *> region_bases; /* device addresses */
  std::vector<uint64_t> region_off, region_size;
  HostBuf mirror;                   /* host copy of `cache`, for the reference */
  std::vector<void *> mirror_bases;
  bool mirror_valid = false;
  Buffer arena[3];                  /* objects, by Mem */
  size_t arena_bytes = 0;
  uint64_t cache_bytes = 0, max_align = 256;
  std::map<std::string, kvf_xfer *> ctx; /* by SM cap and tuning variant */
  double setup_s = 0;
  ~Preset() {
    for (auto &c : ctx) {
      g_deferred_ctx.erase(c.second);
      g_unjoined.erase(c.second);
      kvf_xfer_destroy(c.second);
    }
    kvf_geometry_destroy(g);
  }
};

/* Results collected so far (rendered JSON fragments). */
std::vector<std::string> g_results, g_skipped, g_errors;
std::string g_meta;
bool g_fatal = false;
void record_error(const std::string &where, const std::string &what);
bool cuda_healthy();

/* Run one baseline's measurement; a failure is recorded in its Timing rather
 * than losing the configuration, unless the CUDA context is gone. */
template <class F>
Timing guarded(F &&fn) {
  try {
    return fn();
  } catch (const std::exception &e) {
    if (!cuda_healthy()) throw;
    Timing t;
    t.ok = false;
    t.error = e.what();
    return t;
  }
}

void load_geometry(const std::string &path, uint32_t num_blocks, kvf_geometry **g) {
  kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  lo.num_blocks_override = num_blocks;
  kvf_geometry_error err;
  kvf_status st = kvf_geometry_load_file(path.c_str(), &lo, g, &err);
  if (st) throw BenchError(path + ": " + kvf_status_string(st) + ": " + kvf_last_error());
}

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Plan a preset without touching a GPU: sizes, buffer sets, the block count
 * that holds every size's sets, region offsets inside one allocation, block
 * tables and object layouts. l2 and free_b size the sets and the memory check. */
void preset_plan(Preset &p, uint64_t l2, uint64_t free_b) {
  /* A name from the preset directory, or a path to a geometry file. */
  bool is_path = p.name.find('/') != std::string::npos ||
                 (p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".json") == 0);
  p.path = is_path ? p.name : preset_dir() + "/" + p.name + ".json";
  kvf_geometry *small = nullptr;
  load_geometry(p.path, 4, &small);
  std::unique_ptr<kvf_geometry, void (*)(kvf_geometry *)> hold(small, kvf_geometry_destroy);
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(small, &pol);
  uint64_t blocks = 0;
  for (uint64_t req : g_opt.tokens) {
    SizePlan s;
    s.tokens_requested = req;
    s.tokens = round_up(req, pol.chunk_tokens); /* whole chunks: recurrent state moves, native holds whole blocks */
    s.need = plan_blocks_needed(small, s.tokens);
    for (uint32_t gi = 0; gi < kvf_geometry_num_groups(small); gi++) {
      kvf_group_info info = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(small, gi, &info);
      uint64_t first, end;
      if (info.kind == KVF_GROUP_RECURRENT) {
        if (!kvf_geometry_recurrent_state(small, s.tokens, &first)) s.payload_estimate += info.payload_per_block;
      } else if (!kvf_geometry_retained_blocks(small, gi, s.tokens, &first, &end)) {
        s.payload_estimate += (end - first) * info.payload_per_block;
      }
    }
    /* Working set well above L2: one set if a request alone is over 4x L2, else
     * enough sets (at least 2) to reach it. */
    uint64_t pe = std::max<uint64_t>(s.payload_estimate, 1);
    uint64_t sets = pe >= 4 * l2 ? 1 : std::max<uint64_t>(2, (4 * l2 + pe - 1) / pe);
    sets = std::max<uint64_t>(g_opt.min_sets, std::min<uint64_t>(g_opt.max_sets, sets));
    s.sets = (uint32_t)sets;
    if (s.need == 0) s.skip = "the request moves no block";
    p.sizes.push_back(s);
  }
  /* Drop sizes that would not fit in device memory (cache plus a device arena). */
  uint64_t per_block = 0; /* device bytes per block id, all regions */
  for (uint32_t r = 0; r < kvf_geometry_num_regions(small); r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(small, r, &ri);
    per_block += ri.size;
  }
  per_block = per_block / 4 + 1;
  for (SizePlan &s : p.sizes) {
    if (!s.skip.empty()) continue;
    uint64_t ids = s.sets * s.need;
    uint64_t est = ids * per_block * 9 / 8 + 2 * s.sets * s.payload_estimate + (1ull << 30);
    if (est > (uint64_t)(0.85 * (double)free_b))
      s.skip = fmt("needs about %.1f GiB of device memory, %.1f GiB free", est / 1073741824.0, free_b / 1073741824.0);
    else
      blocks = std::max(blocks, ids);
  }
  hold.reset();
  uint64_t nb = blocks + blocks / 16 + 16;
  if (nb > KVF_MAX_BLOCKS) nb = KVF_MAX_BLOCKS;
  p.num_blocks = (uint32_t)nb;
  load_geometry(p.path, p.num_blocks, &p.g);

  /* Regions carved from one allocation, each at its alignment. */
  uint32_t nr = kvf_geometry_num_regions(p.g);
  uint64_t total = 0;
  p.max_align = 256;
  for (uint32_t r = 0; r < nr; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(p.g, r, &ri);
    uint64_t align = std::max<uint64_t>(ri.align, 256);
    p.max_align = std::max(p.max_align, align);
    total = round_up(total, align);
    p.region_off.push_back(total);
    p.region_size.push_back(ri.size);
    total += round_up(std::max<uint64_t>(ri.size, 1), 256);
  }
  p.cache_bytes = total + p.max_align;

  /* Block tables: every set of every size draws distinct ids from one shuffled pool. */
  std::vector<uint32_t> pool = plan_pool(p.num_blocks, g_opt.seed);
  for (SizePlan &s : p.sizes) {
    if (!s.skip.empty()) continue;
    size_t next = 0;
    s.tables.resize(s.sets);
    for (uint32_t k = 0; k < s.sets; k++)
      if (!plan_tables(p.g, s.tokens, pool, &next, &s.tables[k])) throw BenchError("block pool too small");
    if (!plan_objects(p.g, s.tokens, s.tables[0], 256, &s.layout)) throw BenchError("object layout failed");
    p.arena_bytes = std::max<size_t>(p.arena_bytes, (size_t)s.sets * s.layout.span);
  }
}

/* Plan, then allocate and fill the device cache. */
void preset_setup(Preset &p) {
  double t0 = now_s();
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  preset_plan(p, (uint64_t)std::max(g_gpu.prop.l2CacheSize, 1 << 20), free_b);
  p.cache.alloc(Mem::Device, p.cache_bytes);
  char *base = (char *)round_up((uintptr_t)p.cache.p, p.max_align);
  size_t lead = base - p.cache.p;
  for (size_t r = 0; r < p.region_off.size(); r++) p.region_bases.push_back(base + p.region_off[r]);
  fill_random(p.cache.p, p.cache.bytes, g_opt.seed ^ 0xcace, g_gpu.dev);
  p.mirror.ensure(p.cache.bytes);
  for (size_t r = 0; r < p.region_off.size(); r++) p.mirror_bases.push_back(p.mirror.get() + lead + p.region_off[r]);
  p.setup_s = now_s() - t0;
}

Buffer &preset_arena(Preset &p, Mem kind) {
  Buffer &b = p.arena[(int)kind];
  if (!b.p) {
    b.alloc(kind, std::max<size_t>(p.arena_bytes, 256));
    fill_random(b.p, b.bytes, g_opt.seed ^ (0xab0 + (int)kind), b.device());
  }
  return b;
}

/* One kvferry call on s. A deferred context's call is posted after s's
 * work and joined back into s at once (later work on s then runs after it,
 * as after a synchronous call), unless join is false: then its ticket
 * waits in g_unjoined for join_deferred. */
void kvferry_call(kvf_xfer *x, bool gather, const kvf_copy_request *r, cudaStream_t s, bool join = true) {
  if (!g_deferred_ctx.count(x)) {
    kvf_status st = gather ? kvf_xfer_gather(x, r, (kvf_stream)s) : kvf_xfer_scatter(x, r, (kvf_stream)s);
    if (st) kvf_check(st, gather ? "kvf_xfer_gather" : "kvf_xfer_scatter");
    return;
  }
  uint64_t ticket = 0;
  kvf_status st = gather ? kvf_xfer_gather_deferred(x, r, (kvf_stream)s, &ticket)
                         : kvf_xfer_scatter_deferred(x, r, (kvf_stream)s, &ticket);
  if (st) kvf_check(st, gather ? "kvf_xfer_gather_deferred" : "kvf_xfer_scatter_deferred");
  if (join)
    kvf_check(kvf_xfer_join(x, ticket, (kvf_stream)s), "kvf_xfer_join");
  else
    g_unjoined[x] = ticket;
}

/* Join a deferred context's last unjoined call into s. */
void join_deferred(kvf_xfer *x, cudaStream_t s) {
  auto it = g_unjoined.find(x);
  if (it == g_unjoined.end()) return;
  uint64_t ticket = it->second;
  g_unjoined.erase(it);
  kvf_check(kvf_xfer_join(x, ticket, (kvf_stream)s), "kvf_xfer_join");
}

/* A tuning variant (--tune): key=value pairs over the context's tuning
 * (host/core/xfer_internal.h) and its SM cap; defer=1 makes the variant's
 * calls deferred (kvferry_call). */
void apply_tune(const std::string &spec, kvf_xfer_tuning *t, int *cap, bool *deferred = nullptr) {
  for (const std::string &kv : split(spec)) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) throw BenchError("--tune: '" + kv + "' is not key=value");
    std::string k = kv.substr(0, eq);
    int64_t v = (int64_t)parse_u64(kv.substr(eq + 1), "--tune");
    if (k == "pieces") t->stage_pieces = v;
    else if (k == "growth") t->stage_growth = v;
    else if (k == "edge_mb") t->stage_edge_mb = v;
    else if (k == "straight_kb") t->stage_straight_kb = v;
    else if (k == "straight_min_run") t->stage_straight_min_run = v;
    else if (k == "straight_alone") t->stage_straight_alone = v;
    else if (k == "multi_pieces") t->stage_multi_pieces = v;
    else if (k == "kernel") t->kernel = v;
    else if (k == "dma_batch") t->stage_dma_batch = v;
    else if (k == "param_bytes") t->param_bytes = v;
    else if (k == "task_bytes") t->task_bytes = v;
    else if (k == "task_waves") t->task_waves = v;
    else if (k == "device_task_waves") t->device_task_waves = v;
    else if (k == "batch_min_run") t->batch_min_run = v;
    else if (k == "batch_max_runs") t->batch_max_runs = v;
    else if (k == "batch_first_runs") t->batch_first_runs = v;
    else if (k == "batch_link_gbps") t->batch_link_gbps = v;
    else if (k == "batch_back_to_back_us") t->batch_back_to_back_us = v;
    else if (k == "batch_host_bound") t->batch_host_bound = v;
    else if (k == "batch_staged_cost") t->batch_staged_cost = v;
    else if (k == "stage_sms") t->stage_sms = v;
    else if (k == "pcie_sms") t->pcie_sms = v;
    else if (k == "staging_mb") t->staging_mb = v;
    else if (k == "small_stage_mb") t->small_stage_mb = v;
    else if (k == "small_stage_growth") t->small_stage_growth = v;
    else if (k == "small_stage_one_piece") t->small_stage_one_piece = v;
    else if (k == "spread_kb") t->spread_kb = v;
    else if (k == "spread_deep_kb") t->spread_deep_kb = v;
    else if (k == "spread_deep_max_mb") t->spread_deep_max_mb = v;
    else if (k == "cache_order") t->cache_order = v;
    else if (k == "overlap") t->overlap = v;
    else if (k == "defer") {
      if (v > 1) throw BenchError("--tune: defer must be 0 or 1");
      if (deferred) *deferred = v == 1;
    } else if (k == "cap") *cap = (int)v;
    else throw BenchError("--tune: unknown key '" + k + "'");
  }
}

/* The context for SM cap `cap` (0: the planner's default, -1: all SMs) and
 * tuning variant `tune` ("" : the library's defaults). */
kvf_xfer *preset_ctx(Preset &p, int cap, const std::string &tune = "") {
  std::string key = std::to_string(cap) + "|" + tune;
  auto it = p.ctx.find(key);
  if (it != p.ctx.end()) return it->second;
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = g_gpu.dev;
  xo.max_sms = cap < 0 ? (uint32_t)g_gpu.prop.multiProcessorCount : (uint32_t)cap;
  kvf_xfer *x = nullptr;
  kvf_check(kvf_xfer_create(p.g, &xo, &x), "kvf_xfer_create");
  /* Kept only once its tuning is in: a context whose tuning was refused
   * would otherwise serve the variant's later configurations untuned. */
  if (!tune.empty()) {
    try {
      kvf_xfer_tuning t;
      kvf_xfer_get_tuning(x, &t);
      int ignored = 0;
      bool deferred = false;
      apply_tune(tune, &t, &ignored, &deferred);
      kvf_check(kvf_xfer_set_tuning(x, &t), "--tune " + tune);
      if (deferred) g_deferred_ctx.insert(x);
    } catch (...) {
      kvf_xfer_destroy(x);
      throw;
    }
  }
  p.ctx[key] = x;
  return x;
}

/* The SM cap a variant asks for (cap=N in its spec), else 0. */
int tune_cap(const std::string &spec) {
  kvf_xfer_tuning t{};
  int cap = 0;
  apply_tune(spec, &t, &cap);
  return cap;
}

/* Whether a variant asks for deferred calls (defer=1 in its spec). */
bool tune_defers(const std::string &spec) {
  kvf_xfer_tuning t{};
  int cap = 0;
  bool deferred = false;
  apply_tune(spec, &t, &cap, &deferred);
  return deferred;
}

/* Why a variant's last call measured the wrong thing, or "": the library
 * says whether it ran the call deferred, and a variant timed in the other
 * mode than its spec asked for (a stale context, 5683951) would be recorded
 * as what it asked for. Every mode checks it after timing. */
std::string call_mode_mismatch(const kvf_xfer *x, const std::string &tune) {
  kvf_xfer_path_info path{};
  kvf_xfer_last_path(x, &path);
  const bool asked_deferred = tune_defers(tune);
  if ((path.deferred != 0) == asked_deferred) return "";
  return fmt("the calls ran %s, the variant asked for %s calls", path.deferred ? "deferred" : "directly",
             asked_deferred ? "deferred" : "direct");
}

void refresh_mirror(Preset &p) {
  if (p.mirror_valid) return;
  CK(cudaMemcpy(p.mirror.get(), p.cache.p, p.cache.bytes, cudaMemcpyDeviceToHost));
  p.mirror_valid = true;
}

/* ---- one configuration ---------------------------------------------------------------- */

struct Config {
  Preset *p;
  SizePlan *s;
  Direction d;
  Buffer *arena;
  std::vector<std::vector<void *>> objects; /* per set */
  std::vector<kvf_copy_request> req;        /* per set */
  std::vector<Runs> runs;                   /* per set (set 0 always) */
  uint64_t payload = 0;
};

void config_build(Config &c, bool all_runs) {
  SizePlan &s = *c.s;
  c.objects.resize(s.sets);
  c.req.resize(s.sets);
  for (uint32_t k = 0; k < s.sets; k++) {
    c.objects[k] = plan_object_pointers(s.layout, c.arena->p + (size_t)k * s.layout.span);
    kvf_copy_request r = KVF_COPY_REQUEST_INIT;
    r.region_bases = c.p->region_bases.data();
    r.token_begin = 0;
    r.token_end = s.tokens;
    r.format = g_opt.format;
    r.groups = s.tables[k].groups.data();
    r.objects = c.objects[k].data();
    c.req[k] = r;
  }
  c.runs.resize(all_runs ? s.sets : 1);
  for (size_t k = 0; k < c.runs.size(); k++) {
    std::string err;
    if (!plan_runs(c.p->g, &c.req[k], c.d.gather, &c.runs[k], &err)) throw BenchError("plan_runs: " + err);
  }
  c.payload = c.runs[0].bytes;
}

/* Reference copy on the host, chunks spread over threads (each chunk is a
 * valid request of its own, and chunks write disjoint bytes). */
void reference_parallel(const kvf_geometry *g, const kvf_copy_request &req, bool gather) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t chunks = kvf_copy_request_chunks(g, &req), C = pol.chunk_tokens;
  uint32_t nog = kvf_geometry_num_object_groups(g);
  std::vector<std::string> errs(host_threads());
  std::atomic<unsigned> slot{0};
  parallel_for(chunks, [&](size_t a, size_t b) {
    if (a >= b) return;
    kvf_copy_request sub = req;
    sub.token_begin = req.token_begin + a * C;
    sub.token_end = std::min<uint64_t>(req.token_begin + b * C, req.token_end);
    sub.objects = req.objects + a * nog;
    kvf_status st = gather ? kvf_reference_gather(g, &sub) : kvf_reference_scatter(g, &sub);
    if (st) errs[slot++ % errs.size()] = std::string(kvf_status_string(st)) + ": " + kvf_last_error();
  });
  for (const std::string &e : errs)
    if (!e.empty()) throw BenchError("reference copy: " + e);
}

struct Verify {
  bool ran = false, ok = false;
  std::string detail;
  uint64_t compared_bytes = 0;
  double seconds = 0;
  std::shared_ptr<HostBuf> expect; /* gathers: the expected bytes of set 0's objects */
};

/* Run kvferry once on set 0 and compare with the CPU reference: for a gather
 * the whole object span (poisoned first, so unwritten bytes show); for a
 * scatter the whole cache (so padding and other blocks must stay untouched). */
/* run0 enqueues the contender on set 0 on g_gpu.stream (default: kvferry's
 * default context). */
Verify verify(Config &c, std::function<void()> run0 = {}) {
  Verify v;
  v.ran = true;
  double t0 = now_s();
  Preset &p = *c.p;
  SizePlan &s = *c.s;
  size_t span = s.layout.span;
  if (!run0) {
    kvf_xfer *x = preset_ctx(p, 0);
    bool gather = c.d.gather;
    run0 = [x, &c, gather] { kvferry_call(x, gather, &c.req[0], g_gpu.stream); };
  }
  if (c.d.gather) {
    fill_random(c.arena->p, span, g_opt.seed ^ 0x9015011, c.arena->device()); /* poison */
    v.expect = std::make_shared<HostBuf>();
    HostBuf &expect = *v.expect, got;
    expect.ensure(span);
    CK(cudaMemcpy(expect.get(), c.arena->p, span, cudaMemcpyDefault));
    run0();
    CK(cudaStreamSynchronize(g_gpu.stream));
    const char *result = c.arena->p;
    if (c.arena->kind != Mem::Host) {
      got.ensure(span);
      CK(cudaMemcpy(got.get(), c.arena->p, span, cudaMemcpyDefault));
      result = got.get();
    }
    refresh_mirror(p);
    std::vector<void *> objs = plan_object_pointers(s.layout, expect.get());
    kvf_copy_request r = c.req[0];
    r.region_bases = p.mirror_bases.data();
    r.objects = objs.data();
    reference_parallel(p.g, r, true);
    size_t bad = pcompare(result, expect.get(), span);
    v.compared_bytes = span;
    v.ok = bad == SIZE_MAX;
    if (!v.ok) {
      size_t obj = 0;
      for (size_t i = 0; i < s.layout.offset.size(); i++)
        if (s.layout.offset[i] != UINT64_MAX && s.layout.offset[i] <= bad) obj = i;
      v.detail = fmt("objects differ from the reference at byte %zu of the set (object %zu, byte %llu)", bad, obj,
                     (unsigned long long)(bad - s.layout.offset[obj]));
    }
  } else {
    fill_random(c.arena->p, span, g_opt.seed ^ 0x5ca77e4, c.arena->device()); /* fresh objects */
    /* The mirror must be the cache as it is now: every timed scatter since
     * the last verification (kvferry's, the baselines', a peer's, the
     * limit's contiguous copy into the cache) rewrote it, and none of them
     * clears the flag. The first run's peers failed on exactly this (the
     * first peer after the baselines: "cache differs from the reference at
     * region 0 byte 0", where the limit's memcpy had written). */
    p.mirror_valid = false;
    refresh_mirror(p);
    HostBuf src;
    const char *objects = c.arena->p;
    if (c.arena->kind != Mem::Host) {
      src.ensure(span);
      CK(cudaMemcpy(src.get(), c.arena->p, span, cudaMemcpyDefault));
      objects = src.get();
    }
    run0();
    CK(cudaStreamSynchronize(g_gpu.stream));
    p.mirror_valid = false;
    std::vector<void *> objs = plan_object_pointers(s.layout, (char *)objects);
    kvf_copy_request r = c.req[0];
    r.region_bases = p.mirror_bases.data();
    r.objects = objs.data();
    reference_parallel(p.g, r, false);
    /* Compare the whole cache, piece by piece. */
    const size_t piece = 512ull << 20;
    HostBuf stage;
    stage.ensure(std::min(piece, p.cache.bytes));
    v.ok = true;
    for (size_t off = 0; off < p.cache.bytes && v.ok; off += piece) {
      size_t n = std::min(piece, p.cache.bytes - off);
      CK(cudaMemcpy(stage.get(), p.cache.p + off, n, cudaMemcpyDeviceToHost));
      size_t bad = pcompare(stage.get(), p.mirror.get() + off, n);
      if (bad != SIZE_MAX) {
        v.ok = false;
        size_t at = off + bad;
        size_t lead = (char *)p.region_bases[0] - p.cache.p;
        std::string where = "outside every region";
        for (size_t r = 0; r < p.region_off.size(); r++)
          if (at >= lead + p.region_off[r] && at < lead + p.region_off[r] + p.region_size[r])
            where = fmt("region %zu byte %llu", r, (unsigned long long)(at - lead - p.region_off[r]));
        v.detail = "cache differs from the reference at " + where;
      }
    }
    v.compared_bytes = p.cache.bytes;
    p.mirror_valid = v.ok; /* the mirror now holds the expected cache */
  }
  v.seconds = now_s() - t0;
  return v;
}

/* ---- baselines -------------------------------------------------------------------------- */

/* join false: a deferred context's call is left for join_deferred. */
std::function<void(int)> op_kvferry(Config &c, kvf_xfer *x, cudaStream_t s, bool join = true) {
  return [&c, x, s, join](int i) { kvferry_call(x, c.d.gather, &c.req[(size_t)i % c.req.size()], s, join); };
}

/* The limit: one contiguous copy of the payload's bytes between the same two memories. */
std::function<void(int)> op_limit(Config &c, cudaStream_t s) {
  return [&c, s](int i) {
    size_t k = (size_t)i % c.req.size();
    size_t coff = (k + 1) * c.payload <= c.p->cache.bytes ? k * c.payload : 0;
    char *dev = c.p->cache.p + coff, *obj = c.arena->p + k * c.s->layout.span;
    if (c.d.gather)
      CK(cudaMemcpyAsync(obj, dev, c.payload, cudaMemcpyDefault, s));
    else
      CK(cudaMemcpyAsync(dev, obj, c.payload, cudaMemcpyDefault, s));
  };
}

/* A compact record of one transfer configuration's results. */
struct KvfResult {
  int cap;
  std::string tune; /* "" : the library's defaults */
  Timing t;
  kvf_xfer_stats stats = KVF_XFER_STATS_INIT;
  bool stats_ok = false;
  bool checked = false; /* this cap's output was compared with the reference */
  kvf_xfer_path_info path{};
  bool path_ok = false;
  kvf_xfer_path_info sustained_path{}; /* the last call back to back (measure_sustained) */
  bool sustained_path_ok = false;
  double enqueue_alone_us = NAN, enqueue_alone_p90_us = NAN; /* host time of a call with nothing queued */
};

/* Host time of one call with nothing in flight: enqueue_reps calls, each
 * synchronized before the next (what an engine's thread pays per chunk).
 * settle, when given, runs after each call is timed (a deferred call's
 * join, so the synchronize waits for its work). */
void enqueue_alone(const std::function<void(int)> &op, cudaStream_t s, double *median, double *p90,
                   const std::function<void()> &settle = {}) {
  if (g_opt.enqueue_reps <= 0) return;
  std::vector<double> t;
  for (int i = 0; i < g_opt.enqueue_reps; i++) {
    CK(cudaStreamSynchronize(s));
    double a = now_s();
    op(i);
    t.push_back((now_s() - a) * 1e6);
    if (settle) settle();
  }
  CK(cudaStreamSynchronize(s));
  *median = pct(t, 0.5);
  *p90 = pct(t, 0.9);
}

std::string cap_label(int cap) { return cap == 0 ? "default" : cap < 0 ? "all" : std::to_string(cap); }

void write_config_head(JsonWriter &j, Config &c) {
  j.kv("preset", c.p->name).kv("direction", c.d.name).kv("op", c.d.gather ? "gather" : "scatter");
  j.key("memory").begin_object().kv("cache", "device").kv("objects", mem_name(c.d.objects)).end_object();
  j.kv("format", kvf_object_format_name(g_opt.format));
  j.kv("tokens", c.s->tokens).kv("tokens_requested", c.s->tokens_requested);
  {
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(c.p->g, &pol);
    j.kv("chunk_tokens", (uint64_t)pol.chunk_tokens);
  }
  j.kv("payload_bytes", c.payload).kv("runs", (uint64_t)c.runs[0].count()).kv("runs_unmerged", c.runs[0].raw_runs);
  j.kv("avg_run_bytes", c.runs[0].count() ? (double)c.payload / (double)c.runs[0].count() : 0.0);
  j.kv("objects", c.s->layout.objects).kv("sets", c.s->sets);
  j.kv("working_set_bytes", (uint64_t)c.s->sets * c.payload * 2);
  j.kv("cache_bytes", (uint64_t)c.p->cache.bytes).kv("num_blocks", c.p->num_blocks);
}

void write_verify(JsonWriter &j, const Verify &v) {
  j.key("verify").begin_object().kv("ran", v.ran);
  if (v.ran) {
    j.kv("ok", v.ok).kv("compared_bytes", v.compared_bytes).kv("seconds", v.seconds);
    if (!v.detail.empty()) j.kv("detail", v.detail);
  }
  j.end_object();
}

/* Baseline median times (us, extrapolated where sampled) for the speed-up ratios. */
struct BaseTimes {
  double limit = NAN, memcpy = NAN, batch = NAN, cub = NAN;
};

void write_kvf(JsonWriter &j, const std::vector<KvfResult> &kr, uint64_t payload, const BaseTimes &b) {
  j.key("kvferry").begin_array();
  for (const KvfResult &r : kr) {
    j.begin_object().kv("sms_cap", r.cap).kv("sms_cap_label", cap_label(r.cap));
    if (!r.tune.empty()) j.kv("tune", r.tune);
    if (r.stats_ok) {
      j.kv("sms_used", r.stats.sms).kv("route", kvf_xfer_route_name(r.stats.route)).kv("tasks", r.stats.tasks);
      j.kv("stats_payload_bytes", r.stats.payload_bytes);
    }
    if (r.path_ok) {
      j.key("path").begin_object().kv("name", kvf_xfer_path_name(r.path.path)).kv("launches", r.path.launches);
      j.kv("param_launches", r.path.param_launches).kv("spread_launches", r.path.spread_launches)
          .kv("deep_launches", r.path.deep_launches).kv("overlap_launches", r.path.overlap_launches)
          .kv("cache_order", r.path.cache_order).kv("uploads", r.path.uploads).kv("batches", r.path.batches);
      j.kv("pieces", r.path.pieces).kv("dma_ops", r.path.dma_ops).kv("dma_runs", r.path.dma_runs);
      j.kv("straight_runs", r.path.straight_runs).kv("straight_bytes", r.path.straight_bytes);
      j.kv("slice_bytes", r.path.slice_bytes).kv("host_us", r.path.host_us).kv("plan_us", r.path.plan_us).kv("deferred", r.path.deferred);
      j.kv("host_bound", r.path.host_bound).kv("staged_cost", r.path.staged_cost)
          .kv("staged_cost_measures", r.path.staged_cost_measures).end_object();
    }
    if (r.sustained_path_ok) {
      j.key("sustained_path").begin_object().kv("name", kvf_xfer_path_name(r.sustained_path.path));
      j.kv("host_bound", r.sustained_path.host_bound).kv("back_to_back", r.sustained_path.back_to_back)
          .kv("staged_cost", r.sustained_path.staged_cost)
          .kv("staged_cost_measures", r.sustained_path.staged_cost_measures).end_object();
    }
    if (std::isfinite(r.enqueue_alone_us)) j.kv("enqueue_alone_us", r.enqueue_alone_us).kv("enqueue_alone_p90_us", r.enqueue_alone_p90_us);
    j.kv("output_checked", r.checked);
    write_timing(j, r.t, payload);
    /* Ratios of times: > 1 means kvferry is faster (vs_limit: the share of the limit reached). */
    if (r.t.ok) {
      if (std::isfinite(b.limit)) j.kv("vs_limit", b.limit / r.t.median_us);
      if (std::isfinite(b.memcpy)) j.kv("speedup_vs_memcpy_per_run", b.memcpy / r.t.median_us);
      if (std::isfinite(b.batch)) j.kv("speedup_vs_batch", b.batch / r.t.median_us);
      if (std::isfinite(b.cub)) j.kv("speedup_vs_cub", b.cub / r.t.median_us);
    }
    j.end_object();
  }
  j.end_array();
}

/* Compare set 0's objects (a gather's output) with the expected bytes. */
bool objects_match(Config &c, const Verify &v, size_t *bad) {
  size_t span = c.s->layout.span;
  const char *result = c.arena->p;
  HostBuf got;
  if (c.arena->kind != Mem::Host) {
    got.ensure(span);
    CK(cudaMemcpy(got.get(), c.arena->p, span, cudaMemcpyDefault));
    result = got.get();
  }
  *bad = pcompare(result, v.expect->get(), span);
  return *bad == SIZE_MAX;
}

/* Time kvferry at every cap, then under every tuning variant (--tune); stats
 * and the path come from the last call. For a gather whose verification
 * kept the expected objects, each entry's own output (set 0, written by its
 * timed calls, nothing else writes there meanwhile) is compared with them
 * too, so every SM cap's and variant's kernels are checked, not just the
 * default; a variant's scatter is verified on its own before it is timed. */
std::vector<KvfResult> run_kvferry(Config &c, const std::vector<int> &caps, const Verify &v) {
  std::vector<KvfResult> out;
  std::vector<std::pair<int, std::string>> runs;
  for (int cap : caps) runs.push_back({cap, ""});
  for (const std::string &t : g_opt.tunes) runs.push_back({tune_cap(t), t});
  for (const auto &[cap, tune] : runs) {
    KvfResult r;
    r.cap = cap;
    r.tune = tune;
    try {
      kvf_xfer *x = preset_ctx(*c.p, cap, tune);
      /* A variant's scatter is checked on its own when the cache is small
       * enough to compare cheaply (test_xfer's XferGpuRoutes checks every
       * route's scatter on every preset in any case). */
      if (!tune.empty() && !c.d.gather && g_opt.verify && c.p->cache.bytes <= (128ull << 20)) {
        Verify vv = verify(c, [x, &c] {
          kvf_check(kvf_xfer_scatter(x, &c.req[0], (kvf_stream)g_gpu.stream), "kvf_xfer_scatter");
        });
        r.checked = true;
        if (!vv.ok) throw BenchError("variant " + tune + ": " + vv.detail);
      }
      r.t = measure_gpu_and_sustained(op_kvferry(c, x, g_gpu.stream), g_gpu.stream);
      r.stats_ok = kvf_xfer_last_stats(x, &r.stats) == KVF_SUCCESS;
      if (std::isfinite(r.t.sustained_us)) {
        kvf_xfer_last_path(x, &r.sustained_path);
        r.sustained_path_ok = true;
      }
      if (c.d.gather && v.expect) {
        size_t bad;
        r.checked = true;
        if (!objects_match(c, v, &bad)) {
          r.t.ok = false;
          r.t.error = fmt("at SM cap %s%s the objects differ from the reference at byte %zu of set 0",
                          cap_label(cap).c_str(), tune.empty() ? "" : (" tune " + tune).c_str(), bad);
        }
      }
      /* A deferred variant's enqueue is its post, the join left out. */
      if (r.t.ok && r.t.median_us < 20000)
        enqueue_alone(op_kvferry(c, x, g_gpu.stream, false), g_gpu.stream, &r.enqueue_alone_us,
                      &r.enqueue_alone_p90_us, [x] { join_deferred(x, g_gpu.stream); });
      kvf_xfer_last_path(x, &r.path);
      r.path_ok = true;
      const std::string mismatch = call_mode_mismatch(x, tune);
      if (r.t.ok && !mismatch.empty()) {
        r.t.ok = false;
        r.t.error = fmt("at SM cap %s%s %s", cap_label(cap).c_str(), tune.empty() ? "" : (" tune " + tune).c_str(),
                        mismatch.c_str());
      }
    } catch (const std::exception &e) {
      if (!cuda_healthy()) throw;
      r.t.ok = false;
      r.t.error = e.what();
    }
    out.push_back(r);
  }
  return out;
}

/* The peers on this configuration: tables per set, each peer checked
 * against the reference on set 0 (as kvferry is), then timed. */
struct PeerResult {
  std::string name, shape, error;
  Verify v;
  Timing t;
};

std::vector<PeerResult> run_peers(Config &c, const Verify &kv) {
  std::vector<PeerResult> out;
  std::vector<Peer> peers = peers_from_list(g_opt.peers, g_gpu.prop.multiProcessorCount);
  if (peers.empty() || c.s->tokens > g_opt.peers_max_tokens) return out;
  bool host = c.arena->kind == Mem::Host;
  std::vector<PeerTablesPtr> tables;
  std::string why;
  for (uint32_t k = 0; k < c.s->sets; k++) {
    tables.push_back(peer_prepare(c.p->g, c.req[k], c.d.gather, host, c.arena->p + (size_t)k * c.s->layout.span,
                                  c.s->layout, &why));
    if (!tables.back()) break;
  }
  for (const Peer &peer : peers) {
    PeerResult r;
    r.name = peer.name;
    if (tables.empty() || !tables.back()) {
      r.error = "not applicable: " + why;
      out.push_back(r);
      continue;
    }
    r.shape = peer_shape(peer, *tables[0]);
    try {
      std::string na = peer_launch(peer, *tables[0], g_gpu.stream); /* probe: applicability */
      CK(cudaStreamSynchronize(g_gpu.stream));
      if (!na.empty()) {
        r.error = "not applicable: " + na;
        out.push_back(r);
        continue;
      }
      if (g_opt.verify && c.d.gather && kv.expect) {
        /* kvferry's verification left the expected objects of set 0: poison
         * them the same way, run the peer, compare. */
        double t0 = now_s();
        fill_random(c.arena->p, c.s->layout.span, g_opt.seed ^ 0x9015011, c.arena->device());
        peer_launch(peer, *tables[0], g_gpu.stream);
        CK(cudaStreamSynchronize(g_gpu.stream));
        size_t bad;
        r.v.ran = true;
        r.v.ok = objects_match(c, kv, &bad);
        r.v.compared_bytes = c.s->layout.span;
        r.v.seconds = now_s() - t0;
        if (!r.v.ok) r.v.detail = fmt("objects differ from the reference at byte %zu of set 0", bad);
      } else if (g_opt.verify) {
        r.v = verify(c, [&] { peer_launch(peer, *tables[0], g_gpu.stream); });
      }
      if (g_opt.verify && !r.v.ok) {
        r.error = "verification failed: " + r.v.detail;
        out.push_back(r);
        continue;
      }
      r.t = measure_gpu_and_sustained(
          [&](int i) { peer_launch(peer, *tables[(size_t)i % tables.size()], g_gpu.stream); }, g_gpu.stream);
    } catch (const std::exception &e) {
      if (!cuda_healthy()) throw;
      r.t.ok = false;
      r.error = e.what();
    }
    out.push_back(r);
  }
  if (!c.d.gather) c.p->mirror_valid = false;
  return out;
}

void write_peers(JsonWriter &j, const std::vector<PeerResult> &pr, uint64_t payload, double limit_us) {
  j.key("peers").begin_object();
  for (const PeerResult &r : pr) {
    j.key(r.name).begin_object();
    if (!r.shape.empty()) j.kv("shape", r.shape);
    if (!r.error.empty()) {
      j.kv("ok", false).kv("error", r.error);
    } else {
      write_verify(j, r.v);
      write_timing(j, r.t, payload);
      if (r.t.ok && std::isfinite(limit_us)) j.kv("vs_limit", limit_us / r.t.median_us);
    }
    j.end_object();
  }
  j.end_object();
}

/* Device copies of each set's run list for cub. */
struct CubRuns {
  std::vector<void **> src, dst;
  std::vector<size_t *> size;
  std::vector<int64_t> count;
  void *temp = nullptr;
  size_t temp_bytes = 0;
  ~CubRuns() {
    for (auto p : src) cudaFree(p);
    for (auto p : dst) cudaFree(p);
    for (auto p : size) cudaFree(p);
    if (temp) cudaFree(temp);
  }
};

void sweep_config(Config &c, const std::vector<int> &caps) {
  bool any_runs = g_opt.base_memcpy || g_opt.base_batch || g_opt.base_cub;
  config_build(c, any_runs);
  Verify v;
  if (g_opt.verify) v = verify(c);
  std::vector<KvfResult> kr;
  std::vector<PeerResult> peers;
  Timing limit, mem, batch, cub;
  double mem_fraction = 1, batch_fraction = 1;
  size_t mem_runs = 0, batch_runs = 0;
  if (!g_opt.verify || v.ok) {
    kr = run_kvferry(c, caps, v);
    if (g_opt.base_limit)
      limit = guarded([&] { return measure_gpu_and_sustained(op_limit(c, g_gpu.stream), g_gpu.stream); });
    if (g_opt.base_memcpy) {
      std::vector<Runs> sample(c.runs.size());
      for (size_t k = 0; k < c.runs.size(); k++) sample[k] = plan_sample(c.runs[k], g_opt.max_memcpy_runs, &mem_fraction);
      mem_runs = sample[0].count();
      mem = guarded([&] {
        return measure_gpu_and_sustained(
            [&](int i) {
              const Runs &r = sample[(size_t)i % sample.size()];
              for (size_t k = 0; k < r.count(); k++)
                CK(cudaMemcpyAsync(r.dst[k], r.src[k], r.size[k], cudaMemcpyDefault, g_gpu.stream));
            },
            g_gpu.stream);
      });
    }
    if (g_opt.base_batch) {
      std::vector<Runs> sample(c.runs.size());
      for (size_t k = 0; k < c.runs.size(); k++)
        sample[k] = plan_sample(c.runs[k], g_opt.max_batch_runs, &batch_fraction);
      batch_runs = sample[0].count();
      cudaMemcpyAttributes attr;
      memset(&attr, 0, sizeof attr);
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; /* the engine's writes must land first */
      size_t attr_idx = 0;
      batch = guarded([&] {
        return measure_gpu_and_sustained(
            [&](int i) {
              Runs &r = sample[(size_t)i % sample.size()];
              CK(cudaMemcpyBatchAsync(r.dst.data(), r.src.data(), r.size.data(), r.count(), &attr, &attr_idx, 1,
                                      g_gpu.stream));
            },
            g_gpu.stream);
      });
    }
    if (g_opt.base_cub) cub = guarded([&] {
      CubRuns cr;
      size_t max_temp = 0;
      for (const Runs &r : c.runs) {
        void **s = nullptr, **d = nullptr;
        size_t *z = nullptr;
        CK(cudaMalloc(&s, r.count() * sizeof(void *)));
        cr.src.push_back(s);
        CK(cudaMalloc(&d, r.count() * sizeof(void *)));
        cr.dst.push_back(d);
        CK(cudaMalloc(&z, r.count() * sizeof(size_t)));
        cr.size.push_back(z);
        CK(cudaMemcpy(s, r.src.data(), r.count() * sizeof(void *), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d, r.dst.data(), r.count() * sizeof(void *), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(z, r.size.data(), r.count() * sizeof(size_t), cudaMemcpyHostToDevice));
        cr.count.push_back((int64_t)r.count());
        size_t tb = 0;
        CK(cub::DeviceMemcpy::Batched(nullptr, tb, s, d, z, (int64_t)r.count(), g_gpu.stream));
        max_temp = std::max(max_temp, tb);
      }
      CK(cudaMalloc(&cr.temp, std::max<size_t>(max_temp, 1)));
      cr.temp_bytes = max_temp;
      return measure_gpu_and_sustained(
          [&](int i) {
            size_t k = (size_t)i % cr.count.size(), tb = cr.temp_bytes;
            CK(cub::DeviceMemcpy::Batched(cr.temp, tb, cr.src[k], cr.dst[k], cr.size[k], cr.count[k], g_gpu.stream));
          },
          g_gpu.stream);
    });
    peers = run_peers(c, v);
  }
  if (!c.d.gather) c.p->mirror_valid = false; /* timed scatters rewrote the cache */

  JsonWriter j;
  j.begin_object().kv("kind", "transfer");
  write_config_head(j, c);
  write_verify(j, v);
  BaseTimes bt;
  if (limit.ok) bt.limit = limit.median_us;
  if (mem.ok) bt.memcpy = mem.median_us / mem_fraction;
  if (batch.ok) bt.batch = batch.median_us / batch_fraction;
  if (cub.ok) bt.cub = cub.median_us;
  write_kvf(j, kr, c.payload, bt);
  write_peers(j, peers, c.payload, bt.limit);
  j.key("baselines").begin_object();
  if (g_opt.base_limit) {
    j.key("limit").begin_object();
    write_timing(j, limit, c.payload);
    j.end_object();
  }
  if (g_opt.base_memcpy) {
    j.key("memcpy_per_run").begin_object().kv("timed_runs", (uint64_t)mem_runs).kv("total_runs", (uint64_t)c.runs[0].count());
    j.kv("timed_fraction", mem_fraction).kv("extrapolated", mem_fraction < 1.0);
    write_timing(j, mem, c.payload, 1.0 / mem_fraction);
    j.end_object();
  }
  if (g_opt.base_batch) {
    j.key("batch").begin_object().kv("timed_runs", (uint64_t)batch_runs).kv("total_runs", (uint64_t)c.runs[0].count());
    j.kv("timed_fraction", batch_fraction).kv("extrapolated", batch_fraction < 1.0);
    write_timing(j, batch, c.payload, 1.0 / batch_fraction);
    j.end_object();
  }
  if (g_opt.base_cub) {
    j.key("cub").begin_object().kv("timed_runs", (uint64_t)c.runs[0].count());
    write_timing(j, cub, c.payload);
    j.end_object();
  }
  j.end_object();
  j.end_object();
  g_results.push_back(j.str());

  /* One line per configuration on stdout. */
  printf("%-32s %-11s %6llu tok %9.1f MiB %8zu runs  verify %-4s", c.p->name.c_str(), c.d.name.c_str(),
         (unsigned long long)c.s->tokens, c.payload / 1048576.0, c.runs[0].count(),
         !v.ran ? "skip" : v.ok ? "ok" : "FAIL");
  for (const KvfResult &r : kr)
    printf("  kvf[%s]%s %.1f", cap_label(r.cap).c_str(), r.stats_ok ? fmt("(%usm)", r.stats.sms).c_str() : "",
           r.t.ok ? gbps(c.payload, r.t.median_us) : NAN);
  if (limit.ok) printf("  limit %.1f", gbps(c.payload, limit.median_us));
  if (mem.ok) printf("  memcpy %.2f", gbps(c.payload, mem.median_us / mem_fraction));
  if (batch.ok) printf("  batch %.2f", gbps(c.payload, batch.median_us / batch_fraction));
  if (cub.ok) printf("  cub %.1f", gbps(c.payload, cub.median_us));
  for (const PeerResult &pr : peers)
    if (pr.error.empty() && pr.t.ok) printf("  %s %.1f", pr.name.c_str(), gbps(c.payload, pr.t.median_us));
  printf(" GB/s\n");
  if (g_opt.sustained) {
    /* The same contenders back to back from this thread, host enqueue charged. */
    auto sus = [&](const Timing &t, double scale) { return gbps(c.payload, t.sustained_us * scale); };
    printf("    sustained:");
    for (const KvfResult &r : kr)
      if (r.t.ok)
        printf("  kvf[%s%s%s] %.1f", cap_label(r.cap).c_str(), r.tune.empty() ? "" : " ", r.tune.c_str(), sus(r.t, 1));
    if (limit.ok) printf("  limit %.1f", sus(limit, 1));
    if (mem.ok) printf("  memcpy %.2f", sus(mem, 1.0 / mem_fraction));
    if (batch.ok) printf("  batch %.2f", sus(batch, 1.0 / batch_fraction));
    if (cub.ok) printf("  cub %.1f", sus(cub, 1));
    for (const PeerResult &pr : peers)
      if (pr.error.empty() && pr.t.ok) printf("  %s %.1f", pr.name.c_str(), sus(pr.t, 1));
    printf(" GB/s\n");
  }
  for (const KvfResult &r : kr)
    if (r.path_ok)
      printf("    kvf[%s%s%s]: %s, %u launches (%u params, %u uploads), %u batches x %u pieces, %llu dma ops, "
             "%u-byte tasks, enqueue %.1f us alone\n",
             cap_label(r.cap).c_str(), r.tune.empty() ? "" : " ", r.tune.c_str(), kvf_xfer_path_name(r.path.path),
             r.path.launches, r.path.param_launches, r.path.uploads, r.path.batches, r.path.pieces,
             (unsigned long long)r.path.dma_ops, r.path.slice_bytes, r.enqueue_alone_us);
  for (const PeerResult &pr : peers)
    if (!pr.error.empty()) printf("    %s: %s\n", pr.name.c_str(), pr.error.c_str());
  if (v.ran && !v.ok) printf("    verify: %s\n", v.detail.c_str());
  for (const KvfResult &r : kr)
    if (!r.t.ok) printf("    kvferry[%s%s%s]: %s\n", cap_label(r.cap).c_str(), r.tune.empty() ? "" : " ", r.tune.c_str(), r.t.error.c_str());
  fflush(stdout);
}

/* ---- latency ---------------------------------------------------------------------------------- */

void write_latency(JsonWriter &j, const char *name, const Latency &l) {
  j.key(name).begin_object().kv("ok", l.ok);
  if (l.ok) {
    j.kv("reps", l.reps).kv("gpu_us", l.gpu_us).kv("gpu_p90_us", l.gpu_p90_us).kv("enqueue_us", l.enqueue_us);
    j.kv("wall_us", l.wall_us).kv("wall_p90_us", l.wall_p90_us);
  } else {
    j.kv("error", l.error);
  }
  j.end_object();
}

/* A latency measurement, or the error that stopped it while CUDA stays
 * healthy (an unhealthy context ends the run). */
Latency try_latency(const std::function<Latency()> &measure) {
  try {
    return measure();
  } catch (const std::exception &e) {
    if (!cuda_healthy()) throw;
    Latency l;
    l.error = e.what();
    return l;
  }
}

void latency_config(Config &c) {
  config_build(c, true);
  Verify v;
  if (g_opt.verify) v = verify(c);
  Latency kl, ml, rl;
  std::vector<std::pair<std::string, Latency>> variants;
  kvf_xfer_stats stats = KVF_XFER_STATS_INIT;
  bool stats_ok = false;
  if (!g_opt.verify || v.ok) {
    /* kvferry with tuning `tune` ("": the library's) at its cap. */
    auto kvferry = [&](const std::string &tune) {
      return try_latency([&] {
        kvf_xfer *x = preset_ctx(*c.p, tune.empty() ? 0 : tune_cap(tune), tune);
        /* A deferred call's enqueue is its post; its join is part of its
         * GPU and wall times. */
        Latency l = measure_latency(op_kvferry(c, x, g_gpu.stream, false), g_gpu.stream, g_opt.latency_reps,
                                    [x] { join_deferred(x, g_gpu.stream); });
        const std::string mismatch = call_mode_mismatch(x, tune);
        if (!mismatch.empty()) throw BenchError(mismatch);
        if (tune.empty()) stats_ok = kvf_xfer_last_stats(x, &stats) == KVF_SUCCESS;
        return l;
      });
    };
    kl = kvferry("");
    for (const std::string &t : g_opt.tunes) variants.push_back({t, kvferry(t)}); /* each --tune variant */
    ml = try_latency([&] { return measure_latency(op_limit(c, g_gpu.stream), g_gpu.stream, g_opt.latency_reps); });
    if (c.runs[0].count() > 4096) {
      rl.error = "more than 4096 runs: not measured";
    } else {
      rl = try_latency([&] {
        return measure_latency(
            [&](int i) {
              const Runs &r = c.runs[(size_t)i % c.runs.size()];
              for (size_t k = 0; k < r.count(); k++)
                CK(cudaMemcpyAsync(r.dst[k], r.src[k], r.size[k], cudaMemcpyDefault, g_gpu.stream));
            },
            g_gpu.stream, std::min(g_opt.latency_reps, 50));
      });
    }
  }
  if (!c.d.gather) c.p->mirror_valid = false;
  JsonWriter j;
  j.begin_object().kv("kind", "latency").kv("idle_ms", g_opt.idle_ms);
  write_config_head(j, c);
  write_verify(j, v);
  if (stats_ok) j.kv("sms_used", stats.sms).kv("route", kvf_xfer_route_name(stats.route));
  write_latency(j, "kvferry", kl);
  write_latency(j, "memcpy_same_bytes", ml);
  write_latency(j, "memcpy_per_run", rl);
  j.key("variants").begin_array();
  for (const auto &[t, l] : variants) {
    j.begin_object().kv("tune", t);
    write_latency(j, "kvferry", l);
    j.end_object();
  }
  j.end_array();
  j.end_object();
  g_results.push_back(j.str());
  printf("latency %-28s %-11s %6llu tok %8.2f MiB  verify %-4s  kvferry gpu %.1f us wall %.1f us (enqueue %.1f)"
         "  memcpy gpu %.1f us wall %.1f us\n",
         c.p->name.c_str(), c.d.name.c_str(), (unsigned long long)c.s->tokens, c.payload / 1048576.0,
         !v.ran ? "skip" : v.ok ? "ok" : "FAIL", kl.gpu_us, kl.wall_us, kl.enqueue_us, ml.gpu_us, ml.wall_us);
  if (!kl.error.empty()) printf("    kvferry: %s\n", kl.error.c_str());
  for (const auto &[t, l] : variants) {
    if (l.ok) printf("    tune %-24s gpu %.1f us wall %.1f us (enqueue %.1f)\n", t.c_str(), l.gpu_us, l.wall_us, l.enqueue_us);
    else printf("    tune %-24s %s\n", t.c_str(), l.error.c_str());
  }
  fflush(stdout);
}

/* ---- interference ------------------------------------------------------------------------------- */

/* cuBLAS, loaded at run time so the benchmark neither links nor needs it. */
typedef int (*cublasCreate_t)(void **);
typedef int (*cublasDestroy_t)(void *);
typedef int (*cublasSetStream_t)(void *, cudaStream_t);
typedef int (*cublasGemmEx_t)(void *, int, int, int, int, int, const void *, const void *, int, int, const void *,
                              int, int, const void *, void *, int, int, int, int);
enum { kCublasOpN = 0, kCudaR16BF = 14, kCublasCompute32F = 68, kCublasGemmDefault = -1 };

struct Workload {
  bool cublas = false;
  std::string desc;
  void *lib = nullptr, *handle = nullptr;
  cublasDestroy_t destroy = nullptr;
  cublasGemmEx_t gemm = nullptr;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  int n = 0;
  float *fma_out = nullptr;
  int fma_blocks = 0, fma_iters = 0;
  int per_sample = 1;
  double flops_per_op = 0;

  ~Workload() {
    if (handle && destroy) destroy(handle);
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    if (c) cudaFree(c);
    if (fma_out) cudaFree(fma_out);
  }

  bool try_cublas(std::string *why) {
    const char *names[] = {getenv("KVF_CUBLAS"), "libcublas.so.13", "/usr/local/cuda/lib64/libcublas.so.13",
                           "libcublas.so"};
    for (const char *nm : names) {
      if (!nm || !*nm) continue;
      std::string path = nm;
      size_t slash = path.rfind('/');
      if (slash != std::string::npos) /* its libcublasLt from the same folder, in case that is not on the path */
        dlopen((path.substr(0, slash) + "/libcublasLt.so.13").c_str(), RTLD_NOW | RTLD_GLOBAL);
      lib = dlopen(nm, RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        desc = nm;
        break;
      }
    }
    if (!lib) {
      *why = std::string("dlopen(libcublas.so.13): ") + (dlerror() ? dlerror() : "not found");
      return false;
    }
    auto create = (cublasCreate_t)dlsym(lib, "cublasCreate_v2");
    destroy = (cublasDestroy_t)dlsym(lib, "cublasDestroy_v2");
    auto set_stream = (cublasSetStream_t)dlsym(lib, "cublasSetStream_v2");
    gemm = (cublasGemmEx_t)dlsym(lib, "cublasGemmEx");
    if (!create || !destroy || !set_stream || !gemm) {
      *why = "libcublas lacks cublasCreate_v2/cublasGemmEx";
      return false;
    }
    int st = create(&handle);
    if (st != 0) {
      *why = "cublasCreate_v2 failed with status " + std::to_string(st);
      handle = nullptr;
      return false;
    }
    if (set_stream(handle, g_gpu.stream2) != 0) {
      *why = "cublasSetStream_v2 failed";
      return false;
    }
    n = g_opt.gemm_n;
    size_t elems = (size_t)n * n;
    CK(cudaMalloc(&a, elems * 2));
    CK(cudaMalloc(&b, elems * 2));
    CK(cudaMalloc(&c, elems * 2));
    k_fill_bf16<<<1024, 256>>>(a, elems, 1);
    k_fill_bf16<<<1024, 256>>>(b, elems, 2);
    k_fill_bf16<<<1024, 256>>>(c, elems, 3);
    CK_LAUNCH();
    CK(cudaDeviceSynchronize());
    cublas = true;
    flops_per_op = 2.0 * n * (double)n * n;
    desc = fmt("cuBLAS bf16 GEMM %dx%dx%d (cublasGemmEx, fp32 accumulate) from %s", n, n, n, desc.c_str());
    return true;
  }

  void setup_fma() {
    fma_blocks = g_gpu.prop.multiProcessorCount * 8;
    fma_iters = 1 << 16;
    CK(cudaMalloc(&fma_out, (size_t)fma_blocks * 256 * sizeof(float)));
    flops_per_op = 2.0 * 8 * fma_iters * (double)fma_blocks * 256;
    desc = fmt("built-in FMA-bound kernel (%d CTAs x 256 threads, 8 chains x %d FMAs)", fma_blocks, fma_iters);
  }

  void op(cudaStream_t s) {
    if (cublas) {
      float alpha = 1.0f, beta = 0.0f;
      int st = gemm(handle, kCublasOpN, kCublasOpN, n, n, n, &alpha, a, kCudaR16BF, n, b, kCudaR16BF, n, &beta, c,
                    kCudaR16BF, n, kCublasCompute32F, kCublasGemmDefault);
      if (st != 0) throw BenchError("cublasGemmEx failed with status " + std::to_string(st));
    } else {
      k_fma<<<fma_blocks, 256, 0, s>>>(fma_out, fma_iters, 1.0f);
      CK_LAUNCH();
    }
  }

  void sample(cudaStream_t s) {
    for (int i = 0; i < per_sample; i++) op(s);
  }
};

/* Median time of one workload sample alone on stream2. */
std::vector<double> workload_alone(Workload &w, int samples) {
  ensure_events(4);
  std::vector<double> out;
  for (int i = 0; i < samples; i++) {
    CK(cudaEventRecord(g_gpu.ev[0], g_gpu.stream2));
    w.sample(g_gpu.stream2);
    CK(cudaEventRecord(g_gpu.ev[1], g_gpu.stream2));
    CK(cudaStreamSynchronize(g_gpu.stream2));
    float ms;
    CK(cudaEventElapsedTime(&ms, g_gpu.ev[0], g_gpu.ev[1]));
    out.push_back(ms * 1e3);
  }
  return out;
}

struct Interference {
  std::string what; /* "kvferry", "memcpy" or "peer" */
  std::string name; /* a peer's name, or kvferry's tuning variant */
  int cap = 0;
  bool ok = false;
  std::string error;
  uint32_t sms_used = 0;
  double xfer_alone_us = NAN, xfer_gbps_alone = NAN;
  int transfers_per_sample = 0;
  double compute_us = NAN, slowdown = NAN, xfer_gbps_during = NAN, covered = NAN;
};

Interference interfere(Config &c, Workload &w, double alone_us, const std::function<void(int)> &op, int samples) {
  Interference r;
  Timing t = measure(op, g_gpu.stream, false);
  r.xfer_alone_us = t.median_us;
  r.xfer_gbps_alone = gbps(c.payload, t.median_us);
  int nx = (int)std::ceil(2.0 * alone_us / std::max(t.median_us, 1.0)) + 1;
  nx = std::min(nx, 4096);
  r.transfers_per_sample = nx;
  ensure_events(4);
  cudaEvent_t *e = g_gpu.ev.data();
  std::vector<double> comp, xfer, cov;
  for (int s = 0; s < samples; s++) {
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e[2], g_gpu.stream));
    for (int i = 0; i < nx; i++) op(s * nx + i);
    CK(cudaEventRecord(e[3], g_gpu.stream));
    CK(cudaEventRecord(e[0], g_gpu.stream2));
    w.sample(g_gpu.stream2);
    CK(cudaEventRecord(e[1], g_gpu.stream2));
    CK(cudaStreamSynchronize(g_gpu.stream2));
    CK(cudaStreamSynchronize(g_gpu.stream));
    float ms, tail, head;
    CK(cudaEventElapsedTime(&ms, e[0], e[1]));
    comp.push_back(ms * 1e3);
    CK(cudaEventElapsedTime(&ms, e[2], e[3]));
    xfer.push_back(ms * 1e3);
    CK(cudaEventElapsedTime(&tail, e[1], e[3])); /* > 0: transfers outlasted the workload */
    CK(cudaEventElapsedTime(&head, e[2], e[0])); /* >= 0: transfers started first */
    cov.push_back(tail > 0 && head >= 0 ? 1.0 : 0.0);
  }
  r.ok = true;
  r.compute_us = pct(comp, 0.5);
  r.slowdown = r.compute_us / alone_us - 1.0;
  r.xfer_gbps_during = gbps((uint64_t)nx * c.payload, pct(xfer, 0.5));
  double sum = 0;
  for (double x : cov) sum += x;
  r.covered = sum / (double)cov.size();
  return r;
}

void interference_run(Preset &p, SizePlan &s, const std::vector<Direction> &dirs) {
  Workload w;
  std::string why;
  bool use_cublas = g_opt.gemm != "fma" && w.try_cublas(&why);
  if (!use_cublas) {
    if (g_opt.gemm == "cublas") throw BenchError("--gemm cublas: " + why);
    w.setup_fma();
  }
  /* Size a sample to about interference_ms. */
  w.per_sample = 1;
  for (int i = 0; i < 3; i++) w.op(g_gpu.stream2);
  CK(cudaStreamSynchronize(g_gpu.stream2));
  double one = pct(workload_alone(w, 3), 0.5);
  w.per_sample = std::max(1, (int)std::ceil(g_opt.interference_ms * 1e3 / std::max(one, 1.0)));
  int S = g_opt.interference_samples;
  std::vector<double> before = workload_alone(w, S);
  double alone = pct(before, 0.5);
  std::vector<Interference> rows;
  std::vector<std::string> row_dirs;
  std::vector<uint64_t> row_payload;
  for (const Direction &d : dirs) {
    Config c;
    c.p = &p;
    c.s = &s;
    c.d = d;
    c.arena = &preset_arena(p, d.objects);
    config_build(c, false);
    Verify v;
    if (g_opt.verify) v = verify(c);
    if (g_opt.verify && !v.ok) {
      record_error("interference " + p.name + " " + d.name, "verification failed: " + v.detail);
      printf("interference %s %s: verification FAILED (%s)\n", p.name.c_str(), d.name.c_str(), v.detail.c_str());
      continue;
    }
    {
      Interference r;
      try {
        r = interfere(c, w, alone, op_limit(c, g_gpu.stream), S);
      } catch (const std::exception &e) {
        r.error = e.what();
      }
      r.what = "memcpy";
      rows.push_back(r);
      row_dirs.push_back(d.name);
      row_payload.push_back(c.payload);
    }
    size_t memcpy_row = rows.size() - 1;
    std::vector<std::pair<int, std::string>> runs;
    for (int cap : g_opt.sms) runs.push_back({cap, ""});
    for (const std::string &t : g_opt.tunes) runs.push_back({tune_cap(t), t});
    for (const auto &[cap, tune] : runs) {
      Interference r;
      try {
        kvf_xfer *x = preset_ctx(p, cap, tune);
        r = interfere(c, w, alone, op_kvferry(c, x, g_gpu.stream), S);
        const std::string mismatch = call_mode_mismatch(x, tune);
        if (!mismatch.empty()) throw BenchError(mismatch);
        kvf_xfer_stats st = KVF_XFER_STATS_INIT;
        if (kvf_xfer_last_stats(x, &st) == KVF_SUCCESS) r.sms_used = st.sms;
      } catch (const BenchError &e) {
        r.ok = false;
        r.error = e.what();
      }
      r.what = "kvferry";
      r.cap = cap;
      r.name = tune;
      rows.push_back(r);
      row_dirs.push_back(d.name);
      row_payload.push_back(c.payload);
      printf("interference %-24s %-4s kvferry[%s%s%s]%s: workload %+.2f%%  transfer %.1f GB/s during (%.1f alone)%s\n",
             p.name.c_str(), d.name.c_str(), cap_label(cap).c_str(), tune.empty() ? "" : " ", tune.c_str(),
             r.sms_used ? fmt("(%usm)", r.sms_used).c_str() : "", r.slowdown * 100, r.xfer_gbps_during,
             r.xfer_gbps_alone, r.ok ? "" : (" ERROR " + r.error).c_str());
      fflush(stdout);
    }
    /* The peers: their own grids (none takes an SM cap), writing host memory
     * directly except lmcache-mp-staged; each checked on set 0 first. */
    std::vector<Peer> peers = peers_from_list(g_opt.peers, g_gpu.prop.multiProcessorCount);
    std::vector<PeerTablesPtr> tables;
    std::string why;
    for (uint32_t k = 0; k < s.sets && !peers.empty(); k++) {
      tables.push_back(peer_prepare(p.g, c.req[k], d.gather, c.arena->kind == Mem::Host,
                                    c.arena->p + (size_t)k * s.layout.span, s.layout, &why));
      if (!tables.back()) break;
    }
    for (const Peer &peer : peers) {
      Interference r;
      r.what = "peer";
      r.name = peer.name;
      try {
        if (tables.empty() || !tables.back()) throw BenchError("not applicable: " + why);
        std::string na = peer_launch(peer, *tables[0], g_gpu.stream);
        CK(cudaStreamSynchronize(g_gpu.stream));
        if (!na.empty()) throw BenchError("not applicable: " + na);
        if (g_opt.verify) {
          Verify pv = verify(c, [&] { peer_launch(peer, *tables[0], g_gpu.stream); });
          if (!pv.ok) throw BenchError("verification failed: " + pv.detail);
        }
        r = interfere(c, w, alone, [&](int i) { peer_launch(peer, *tables[(size_t)i % tables.size()], g_gpu.stream); },
                      S);
        r.what = "peer";
        r.name = peer.name;
      } catch (const std::exception &e) {
        if (!cuda_healthy()) throw;
        r.ok = false;
        r.error = e.what();
      }
      rows.push_back(r);
      row_dirs.push_back(d.name);
      row_payload.push_back(c.payload);
      printf("interference %-24s %-4s peer %s: workload %+.2f%%  transfer %.1f GB/s during (%.1f alone)%s\n",
             p.name.c_str(), d.name.c_str(), peer.name.c_str(), r.slowdown * 100, r.xfer_gbps_during,
             r.xfer_gbps_alone, r.ok ? "" : (" ERROR " + r.error).c_str());
      fflush(stdout);
    }
    const Interference &m = rows[memcpy_row];
    printf("interference %-24s %-4s memcpy (copy engine): workload %+.2f%%  transfer %.1f GB/s during\n",
           p.name.c_str(), d.name.c_str(), m.slowdown * 100, m.xfer_gbps_during);
    if (!d.gather) p.mirror_valid = false;
  }
  std::vector<double> after = workload_alone(w, S);
  JsonWriter j;
  j.begin_object().kv("kind", "interference").kv("preset", p.name).kv("tokens", s.tokens);
  {
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(p.g, &pol);
    j.kv("chunk_tokens", (uint64_t)pol.chunk_tokens);
  }
  j.key("workload").begin_object().kv("desc", w.desc).kv("cublas", w.cublas).kv("ops_per_sample", w.per_sample);
  j.kv("alone_us", alone).kv("alone_after_us", pct(after, 0.5));
  j.kv("alone_spread", (pct(before, 0.9) - pct(before, 0.1)) / alone);
  j.kv("tflops_alone", w.flops_per_op * w.per_sample / (alone * 1e-6) / 1e12);
  if (!use_cublas) j.kv("cublas_unavailable", why);
  j.end_object();
  j.key("rows").begin_array();
  for (size_t i = 0; i < rows.size(); i++) {
    const Interference &r = rows[i];
    j.begin_object().kv("direction", row_dirs[i]).kv("transfer", r.what).kv("payload_bytes", row_payload[i]);
    if (r.what == "kvferry") j.kv("sms_cap", r.cap).kv("sms_cap_label", cap_label(r.cap)).kv("sms_used", r.sms_used);
    if (r.what == "kvferry" && !r.name.empty()) j.kv("tune", r.name);
    if (r.what == "peer") j.kv("peer", r.name);
    j.kv("ok", r.ok);
    if (!r.ok) j.kv("error", r.error);
    j.kv("transfers_per_sample", r.transfers_per_sample).kv("transfer_alone_us", r.xfer_alone_us);
    j.kv("transfer_gbps_alone", r.xfer_gbps_alone).kv("transfer_gbps_during", r.xfer_gbps_during);
    j.kv("workload_us", r.compute_us).kv("slowdown", r.slowdown).kv("covered", r.covered);
    j.end_object();
  }
  j.end_array().end_object();
  g_results.push_back(j.str());
  printf("interference workload: %s, %d per sample, alone %.0f us (after: %.0f us)\n", w.desc.c_str(), w.per_sample,
         alone, pct(after, 0.5));
}

/* ---- --plan: what a run would do, without a GPU --------------------------------------------------- */

/* Rough seconds one measurement takes (warm-up, pilot, reps, then the sustained
 * pass: up to the same reps, about target_ms, at least 5 calls) for a call of t seconds. */
double est_measure(double t) {
  double reps = std::min<double>(g_opt.max_reps, std::max<double>(g_opt.min_reps, g_opt.target_ms * 1e-3 / t));
  double sustained = g_opt.sustained ? std::max(5.0, std::min(reps, g_opt.target_ms * 1e-3 / t)) : 0;
  return (g_opt.warmup + 1 + reps + sustained) * t;
}

/* Print each preset's sizes, buffer sets, payload, run counts and memory, and
 * an estimate of the run time from H200 figures (FIELD-NOTES.md), so a sweep
 * can be sized on a machine without a GPU. */
int plan_only() {
  const uint64_t l2 = 60ull << 20, free_b = 140ull << 30;
  double total = 0;
  printf("%-32s %6s %4s %10s %9s %9s %9s %9s   est. seconds per direction\n", "preset", "tokens", "sets",
         "payload", "runs", "avg run", "cache", "arena");
  for (const std::string &name : g_opt.presets) {
    Preset p;
    p.name = name;
    try {
      preset_plan(p, l2, free_b);
    } catch (const std::exception &e) {
      printf("%-32s error: %s\n", name.c_str(), e.what());
      continue;
    }
    double preset_s = 1.5 + p.cache_bytes / 40e9 + p.arena_bytes / 5e9; /* start, fill, pinned allocation */
    char *fake_cache = (char *)(uintptr_t)0x100000000000ull, *fake_arena = (char *)(uintptr_t)0x300000000000ull;
    std::vector<void *> bases;
    for (uint64_t off : p.region_off) bases.push_back(fake_cache + off);
    for (SizePlan &s : p.sizes) {
      if (!s.skip.empty()) {
        printf("%-32s %6llu skipped: %s\n", name.c_str(), (unsigned long long)s.tokens, s.skip.c_str());
        continue;
      }
      std::vector<void *> objs = plan_object_pointers(s.layout, fake_arena);
      kvf_copy_request r = KVF_COPY_REQUEST_INIT;
      r.region_bases = bases.data();
      r.token_end = s.tokens;
      r.format = g_opt.format;
      r.groups = s.tables[0].groups.data();
      r.objects = objs.data();
      Runs runs;
      std::string err;
      if (!plan_runs(p.g, &r, true, &runs, &err)) {
        printf("%-32s %6llu plan_runs: %s\n", name.c_str(), (unsigned long long)s.tokens, err.c_str());
        continue;
      }
      double payload = (double)runs.bytes, n = (double)runs.count();
      printf("%-32s %6llu %4u %8.1fMi %9zu %8.0fB %7.2fGi %7.2fGi  ", name.c_str(), (unsigned long long)s.tokens,
             s.sets, payload / 1048576.0, runs.count(), payload / std::max(n, 1.0), p.cache_bytes / 1073741824.0,
             p.arena_bytes / 1073741824.0);
      for (const std::string &dn : g_opt.directions) {
        Direction d;
        if (!direction_by_name(dn, &d)) continue;
        bool peer = d.objects == Mem::Peer, dev = d.objects == Mem::Device;
        double bw = dev ? 1800e9 : peer ? 360e9 : 52e9;
        double per_run_memcpy = dev ? 5.8e-6 : peer ? 3e-6 : 2.5e-6, per_run_batch = dev ? 5e-6 : peer ? 1.2e-6 : 0.7e-6;
        double tx = payload / bw + 5e-6, sec = 0;
        if (g_opt.mode == "latency") {
          sec = 3 * g_opt.latency_reps * (tx + 30e-6 + g_opt.idle_ms * 1e-3) + std::min(n, 4096.0) * per_run_memcpy * 50;
        } else {
          sec += (dev || peer ? g_opt.sms_device : g_opt.sms).size() * est_measure(tx);
          if (g_opt.base_limit) sec += est_measure(tx);
          if (g_opt.base_cub) sec += est_measure(tx * 1.1) + n * 24 / 20e9;
          double fm = std::min(1.0, (double)g_opt.max_memcpy_runs / std::max(n, 1.0));
          if (g_opt.max_memcpy_runs == 0) fm = 1;
          if (g_opt.base_memcpy) sec += est_measure(std::max(n * fm * per_run_memcpy, payload * fm / bw));
          double fb = std::min(1.0, (double)g_opt.max_batch_runs / std::max(n, 1.0));
          if (g_opt.max_batch_runs == 0) fb = 1;
          if (g_opt.base_batch) sec += est_measure(n * fb * per_run_batch + payload * fb / bw);
        }
        if (g_opt.verify) sec += payload / 4e9 + (d.gather ? 0.0 : p.cache_bytes / 8e9) + s.layout.span / 10e9;
        printf(" %s %.1f", dn.c_str(), sec);
        preset_s += sec;
      }
      printf("\n");
    }
    total += preset_s;
  }
  printf("estimated total: %.0f s (H200 figures from FIELD-NOTES.md; a guide, not a measurement)\n", total);
  return 0;
}

/* ---- metadata and output ------------------------------------------------------------------------ */

std::string read_first_line(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return "";
  char b[512] = "";
  if (!fgets(b, sizeof b, f)) b[0] = 0;
  fclose(f);
  std::string s = b;
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

/* "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..." -> "580.159.04" */
std::string driver_version_string() {
  std::string l = read_first_line("/proc/driver/nvidia/version");
  /* The first word after "Kernel Module" shaped like 580.159.04 ("Open
   * Kernel Module for x86_64  580.159.04" has words in between). */
  size_t k = l.find("Kernel Module");
  for (size_t a = k; k != std::string::npos && a < l.size();) {
    a = l.find_first_not_of(' ', a);
    if (a == std::string::npos) break;
    size_t b = l.find(' ', a);
    std::string w = l.substr(a, b == std::string::npos ? std::string::npos : b - a);
    if (!w.empty() && isdigit((unsigned char)w[0]) && w.find('.') != std::string::npos) return w;
    a = b;
  }
  /* Some VMs hide /proc/driver/nvidia: ask nvidia-smi. */
  std::string v;
  if (FILE *f = popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null", "r")) {
    char b[64] = "";
    if (fgets(b, sizeof b, f)) v = b;
    pclose(f);
  }
  while (!v.empty() && (v.back() == '\n' || v.back() == '\r' || v.back() == ' ')) v.pop_back();
  return v.empty() ? "unknown" : v;
}

std::string iso_now() {
  time_t t = time(nullptr);
  struct tm tm;
  gmtime_r(&t, &tm);
  char b[64];
  strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

void build_meta() {
  JsonWriter j;
  const cudaDeviceProp &pr = g_gpu.prop;
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  char bus[64] = "";
  cudaDeviceGetPCIBusId(bus, sizeof bus, g_gpu.dev);
  const char *commit = getenv("KVF_GIT_COMMIT");
  j.begin_object();
  j.kv("date", iso_now()).kv("host", std::string(host));
  j.kv("gpu", std::string(pr.name)).kv("gpu_pci_bus_id", std::string(bus)).kv("device", g_gpu.dev);
  j.kv("sm_count", pr.multiProcessorCount).kv("l2_bytes", pr.l2CacheSize);
  j.kv("memory_bytes", (uint64_t)pr.totalGlobalMem).kv("compute_capability", fmt("%d.%d", pr.major, pr.minor));
  j.kv("device_count", g_gpu.count).kv("peer_device", g_gpu.peer).kv("peer_access", g_gpu.peer_ok);
  if (!g_gpu.peer_ok) j.kv("peer_reason", g_gpu.peer_reason);
  j.kv("driver_version", driver_version_string());
  j.kv("cuda_driver_api", fmt("%d.%d", drv / 1000, (drv % 1000) / 10));
  j.kv("cuda_runtime", fmt("%d.%d", rt / 1000, (rt % 1000) / 10));
  j.kv("kvferry_version", kvf_version_string());
  j.kv("git_commit", commit && *commit ? commit : KVF_GIT_COMMIT);
  j.kv("host_threads", host_threads());
  std::string cmd;
  for (const std::string &a : g_opt.argv) cmd += (cmd.empty() ? "" : " ") + a;
  j.kv("command", cmd).kv("label", g_opt.label).kv("mode", g_opt.mode);
  j.key("options").begin_object();
  j.kv("format", kvf_object_format_name(g_opt.format)).kv("target_ms", g_opt.target_ms);
  j.kv("min_reps", g_opt.min_reps).kv("max_reps", g_opt.max_reps).kv("warmup", g_opt.warmup);
  j.kv("max_memcpy_runs", (uint64_t)g_opt.max_memcpy_runs).kv("max_batch_runs", (uint64_t)g_opt.max_batch_runs);
  j.kv("verify", g_opt.verify).kv("prime", g_opt.prime).kv("sustained", g_opt.sustained).kv("seed", g_opt.seed);
  j.kv("preset_dir", preset_dir());
  j.end_object();
  // The library's KVF_* parameters this run set: a run on anything but the
  // defaults (a harness's kernel fallback, a hand-set crossover) must say so,
  // or its figures read as kvferry's (perf/report.py warns).
  j.key("library_env").begin_object();
  size_t num_params = 0;
  const kvf_param_info *params = kvf_param_table(&num_params);
  for (size_t i = 0; i < num_params; i++) {
    const char *set = getenv(params[i].env);
    if (set) j.kv(params[i].env, std::string(set));
  }
  j.end_object();
  j.kv("timing", "CUDA events around each call on one non-blocking stream; median over reps; payload bytes only; "
                 "GB/s = 1e9 bytes/s; sustained_us: wall time per call of calls back to back from one host thread, "
                 "no priming, to the synchronize after the last (host enqueue charged)");
  j.end_object();
  g_meta = j.str();
}

void write_output(bool complete, double seconds) {
  std::string s = "{\n\"schema\": \"kvferry-bench/1\",\n\"complete\": ";
  s += complete ? "true" : "false";
  s += ",\n\"seconds\": " + fmt("%.1f", seconds);
  s += ",\n\"meta\": " + g_meta + ",\n\"results\": [\n";
  for (size_t i = 0; i < g_results.size(); i++) s += (i ? ",\n" : "") + g_results[i];
  s += "\n],\n\"skipped\": [\n";
  for (size_t i = 0; i < g_skipped.size(); i++) s += (i ? ",\n" : "") + g_skipped[i];
  s += "\n],\n\"errors\": [\n";
  for (size_t i = 0; i < g_errors.size(); i++) s += (i ? ",\n" : "") + g_errors[i];
  s += "\n]\n}\n";
  std::string tmp = g_opt.out + ".tmp";
  FILE *f = fopen(tmp.c_str(), "w");
  if (!f || fwrite(s.data(), 1, s.size(), f) != s.size() || fclose(f) != 0) {
    fprintf(stderr, "kvf_bench: cannot write %s: %s\n", tmp.c_str(), strerror(errno));
    return;
  }
  rename(tmp.c_str(), g_opt.out.c_str());
}

void skip(const std::string &preset, const std::string &dir, uint64_t tokens, const std::string &why) {
  JsonWriter j;
  j.begin_object().kv("preset", preset).kv("direction", dir).kv("tokens", tokens).kv("reason", why).end_object();
  g_skipped.push_back(j.str());
  printf("skip %s %s %llu: %s\n", preset.c_str(), dir.c_str(), (unsigned long long)tokens, why.c_str());
}

void record_error(const std::string &where, const std::string &what) {
  JsonWriter j;
  j.begin_object().kv("where", where).kv("error", what).end_object();
  g_errors.push_back(j.str());
  fprintf(stderr, "kvf_bench: %s: %s\n", where.c_str(), what.c_str());
}

/* After an exception: is the CUDA context still usable? */
bool cuda_healthy() {
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  cudaGetLastError();
  return cudaDeviceSynchronize() == cudaSuccess;
}

void gpu_init() {
  CK(cudaGetDeviceCount(&g_gpu.count));
  if (g_opt.device >= g_gpu.count) throw BenchError(fmt("--device %d: only %d GPU(s)", g_opt.device, g_gpu.count));
  g_gpu.dev = g_opt.device;
  CK(cudaSetDevice(g_gpu.dev));
  CK(cudaGetDeviceProperties(&g_gpu.prop, g_gpu.dev));
  CK(cudaStreamCreateWithFlags(&g_gpu.stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&g_gpu.stream2, cudaStreamNonBlocking));
  g_gpu.peer = g_opt.peer;
  if (g_gpu.count < 2 || g_opt.peer >= g_gpu.count || g_opt.peer == g_gpu.dev) {
    g_gpu.peer_reason = fmt("needs a second GPU (%d visible)", g_gpu.count);
    g_gpu.peer = -1;
    return;
  }
  int a = 0, b = 0;
  CK(cudaDeviceCanAccessPeer(&a, g_gpu.dev, g_gpu.peer));
  CK(cudaDeviceCanAccessPeer(&b, g_gpu.peer, g_gpu.dev));
  if (!a || !b) {
    g_gpu.peer_reason = "cudaDeviceCanAccessPeer says no";
    return;
  }
  cudaError_t e = cudaDeviceEnablePeerAccess(g_gpu.peer, 0);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
  CK(cudaSetDevice(g_gpu.peer));
  e = cudaDeviceEnablePeerAccess(g_gpu.dev, 0);
  cudaSetDevice(g_gpu.dev);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
  cudaGetLastError();
  g_gpu.peer_ok = true;
}

int run() {
  double t0 = now_s();
  gpu_init();
  build_meta();
  std::vector<Direction> dirs;
  for (const std::string &n : g_opt.directions) {
    Direction d;
    if (!direction_by_name(n, &d)) throw BenchError("--directions: unknown '" + n + "'");
    dirs.push_back(d);
  }
  printf("kvf_bench %s: %s, %d SMs, driver %s, %zu preset(s), mode %s -> %s\n", kvf_version_string(),
         g_gpu.prop.name, g_gpu.prop.multiProcessorCount, driver_version_string().c_str(), g_opt.presets.size(),
         g_opt.mode.c_str(), g_opt.out.c_str());
  fflush(stdout);
  int rc = 0;
  for (const std::string &name : g_opt.presets) {
    auto p = std::make_unique<Preset>();
    p->name = name;
    try {
      preset_setup(*p);
    } catch (const std::exception &e) {
      record_error(name + " setup", e.what());
      rc = 1;
      if (!cuda_healthy()) {
        g_fatal = true;
        break;
      }
      continue;
    }
    for (SizePlan &s : p->sizes)
      if (!s.skip.empty()) skip(name, "*", s.tokens, s.skip);
    {
      JsonWriter j;
      j.begin_object().kv("kind", "preset").kv("preset", name).kv("num_blocks", p->num_blocks);
      j.kv("cache_bytes", (uint64_t)p->cache.bytes).kv("arena_bytes", (uint64_t)p->arena_bytes);
      j.kv("setup_s", p->setup_s).end_object();
      g_results.push_back(j.str());
    }
    if (g_opt.mode == "interference") {
      std::vector<Direction> ok;
      for (const Direction &d : dirs)
        if (d.objects == Mem::Peer && !g_gpu.peer_ok)
          skip(name, d.name, p->sizes[0].tokens, g_gpu.peer_reason);
        else
          ok.push_back(d);
      try {
        if (p->sizes[0].skip.empty()) interference_run(*p, p->sizes[0], ok);
      } catch (const std::exception &e) {
        record_error(name + " interference", e.what());
        rc = 1;
        if (!cuda_healthy()) g_fatal = true;
      }
    } else {
      for (const Direction &d : dirs) {
        if (d.objects == Mem::Peer && !g_gpu.peer_ok) {
          skip(name, d.name, 0, g_gpu.peer_reason);
          continue;
        }
        for (SizePlan &s : p->sizes) {
          if (!s.skip.empty()) continue;
          if (g_opt.mode == "latency" && &s != &p->sizes[0]) break;
          Config c;
          c.p = p.get();
          c.s = &s;
          c.d = d;
          try {
            c.arena = &preset_arena(*p, d.objects);
            if (g_opt.mode == "latency")
              latency_config(c);
            else
              sweep_config(c, d.objects == Mem::Host ? g_opt.sms : g_opt.sms_device);
          } catch (const std::exception &e) {
            record_error(fmt("%s %s %llu", name.c_str(), d.name.c_str(), (unsigned long long)s.tokens), e.what());
            rc = 1;
            if (!d.gather) p->mirror_valid = false;
            if (!cuda_healthy()) {
              g_fatal = true;
              break;
            }
          }
          write_output(false, now_s() - t0); /* a kill loses one configuration at most */
        }
        if (g_fatal) break;
      }
    }
    write_output(false, now_s() - t0);
    if (g_fatal) break;
  }
  if (g_fatal) record_error("cuda", "the CUDA context is no longer usable (a sticky error); stopped early");
  write_output(!g_fatal, now_s() - t0);
  printf("kvf_bench: %zu result(s), %zu skipped, %zu error(s) in %.1f s -> %s\n", g_results.size(), g_skipped.size(),
         g_errors.size(), now_s() - t0, g_opt.out.c_str());
  return g_fatal ? 2 : rc;
}

} // namespace

int main(int argc, char **argv) {
  try {
    parse_args(argc, argv);
    return g_opt.plan ? plan_only() : run();
  } catch (const std::exception &e) {
    fprintf(stderr, "kvf_bench: %s\n", e.what());
    if (!g_meta.empty()) {
      record_error("fatal", e.what());
      write_output(false, 0);
    }
    return 2;
  }
}
