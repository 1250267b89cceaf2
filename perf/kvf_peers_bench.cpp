// kvf_peers_bench: objects pulled per second and GB/s between two kvferryd
// (docs/peers.md): a RETRIEVE through kvferryd B of what an engine stored
// through kvferryd A, every round with fresh chunk keys (so every object is
// pulled), against a RETRIEVE that B serves from its own L1 (the same
// request again) in the same run.
//
//   kvf_peers_bench --kvferryd PATH [--geometry FILE] [--num-blocks N]
//                   [--tokens T] [--rounds K] [--l1-mb M]
//
// Both kvferryd run here, on loopback, with this process's UCX_TLS (and
// KVF_PEER_SHM); the engines are host-backend clients in this process.
// Results: one JSON object per line on stdout; figures are medians over K
// rounds of payload bytes / wall time of the RETRIEVE (round_gb_per_s:
// each round's pull, in order).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include <kvferry/kvferry.h>

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0;
}

static pid_t spawn(const std::vector<std::string> &args) {
  std::vector<char *> argv; // built before fork: the child only calls execv and _exit
  for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

static bool wait_socket(const std::string &dir) {
  std::string s = dir + "/kvferryd.sock";
  for (int i = 0; i < 1000; i++) {
    struct stat sb;
    if (stat(s.c_str(), &sb) == 0) return true;
    usleep(10000);
  }
  return false;
}

struct Engine {
  kvf_geometry *g = nullptr;
  std::string json;
  std::vector<uint64_t> offsets, sizes;
  uint64_t total = 0;
  kvf_mem_alloc *alloc = nullptr;
  kvf_client *c = nullptr;
  bool open(const std::string &dir, const std::string &path, uint32_t nb, uint8_t fill) {
    kvf_geometry_load_options o = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
    o.num_blocks_override = nb;
    if (kvf_geometry_load_file(path.c_str(), &o, &g, nullptr) != KVF_SUCCESS) return false;
    char *j = nullptr;
    size_t len = 0;
    if (kvf_geometry_to_json(g, &j, &len) != KVF_SUCCESS) return false;
    json.assign(j, len);
    free(j);
    for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, r, &ri);
      total = (total + 4095) / 4096 * 4096;
      offsets.push_back(total);
      sizes.push_back(ri.size);
      total += ri.size;
    }
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.provider = KVF_MEM_PROVIDER_HOST;
    ao.size = total;
    ao.name = "kvf-peers-bench";
    if (kvf_mem_alloc_create(&ao, &alloc) != KVF_SUCCESS) return false;
    memset(kvf_mem_alloc_ptr(alloc), fill, total);
    kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
    co.socket_dir = dir.c_str();
    co.name = "kvf_peers_bench";
    co.timeout_ms = 60000;
    if (kvf_client_connect(&co, &c, nullptr) != KVF_SUCCESS) return false;
    std::vector<kvf_client_region> regions;
    for (size_t r = 0; r < offsets.size(); r++) regions.push_back({alloc, offsets[r], sizes[r]});
    kvf_client_registration reg = KVF_CLIENT_REGISTRATION_INIT;
    return kvf_client_register(c, json.data(), json.size(), -1, regions.data(), (uint32_t)regions.size(), &reg) ==
           KVF_SUCCESS;
  }
};

int main(int argc, char **argv) {
  std::string daemon, geometry = std::string(KVF_PRESET_DIR) + "/llama-3.1-8b-fa-nhd.json";
  uint32_t nb = 1024, rounds = 5, l1_mb = 2048;
  uint64_t tokens = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--kvferryd") daemon = v;
    else if (a == "--geometry") geometry = v;
    else if (a == "--num-blocks") nb = (uint32_t)strtoul(v.c_str(), nullptr, 10);
    else if (a == "--tokens") tokens = strtoull(v.c_str(), nullptr, 10);
    else if (a == "--rounds") rounds = (uint32_t)strtoul(v.c_str(), nullptr, 10);
    else if (a == "--l1-mb") l1_mb = (uint32_t)strtoul(v.c_str(), nullptr, 10);
    else {
      fprintf(stderr, "kvf_peers_bench: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (daemon.empty()) {
    fprintf(stderr, "kvf_peers_bench: --kvferryd PATH is required\n");
    return 2;
  }
  char tmpl[] = "/tmp/kvf-peers-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  std::string tmp = tmpl, secret = tmp + "/secret", dir_a = tmp + "/a", dir_b = tmp + "/b";
  int fd = open(secret.c_str(), O_WRONLY | O_CREAT, 0600);
  if (fd < 0 || write(fd, "kvf_peers_bench shared secret 0123456789", 40) != 40) return 1;
  close(fd);
  int port = 20000 + (int)(getpid() % 10000);
  std::string addr = "127.0.0.1:" + std::to_string(port), l1 = std::to_string(l1_mb);
  pid_t a = spawn({daemon, "--socket-dir", dir_a, "--devices", "none", "--l1-mb", l1, "--heartbeat-timeout-ms", "600000", "--listen", addr,
                   "--peer-secret-file", secret});
  pid_t b = spawn({daemon, "--socket-dir", dir_b, "--devices", "none", "--l1-mb", l1, "--heartbeat-timeout-ms", "600000", "--peer", addr,
                   "--peer-secret-file", secret});
  int rc = 1;
  Engine src, dst;
  if (!wait_socket(dir_a) || !wait_socket(dir_b) || !src.open(dir_a, geometry, nb, 1) || !dst.open(dir_b, geometry, nb, 2)) {
    fprintf(stderr, "kvf_peers_bench: setup: %s\n", kvf_last_error());
    goto out;
  }
  {
    // Wait for B's peer to be ready.
    for (int i = 0; i < 1000; i++) {
      kvf_client_peer_record rec[2];
      uint32_t n = 0;
      if (kvf_client_stat_peers(dst.c, rec, 2, &n) == KVF_SUCCESS && n && rec[0].state == 2) break;
      usleep(10000);
    }
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(src.g, &pol);
    uint32_t C = pol.chunk_tokens;
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(src.g, 0, &gi);
    std::vector<uint32_t> ids(tokens / gi.block_size);
    for (size_t i = 0; i < ids.size(); i++) ids[i] = (uint32_t)((i * 7919) % gi.num_blocks);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    if (ids.size() != tokens / gi.block_size) {
      fprintf(stderr, "kvf_peers_bench: --num-blocks too small for --tokens\n");
      goto out;
    }
    kvf_group_blocks gb = {ids.data(), 0, (uint32_t)ids.size()};
    std::vector<double> pull_gbs, pull_objs, local_gbs, local_objs;
    uint64_t bytes = 0, objects = 0;
    for (uint32_t r = 0; r < rounds + 1; r++) {
      std::vector<uint32_t> toks(tokens);
      for (uint64_t t = 0; t < tokens; t++) toks[t] = (uint32_t)(t * 31 + r * 1000003 + 7);
      std::vector<kvf_chunk_key> keys((tokens + C - 1) / C);
      kvf_chunk_key model;
      kvf_chunk_seed("kvf_peers_bench", 15, &model);
      kvf_chunk_keys(&model, toks.data(), 4, tokens, C, keys.data());
      kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
      x.token_end = tokens;
      x.chunk_keys = keys.data();
      x.num_chunk_keys = (uint32_t)keys.size();
      x.groups = &gb;
      x.num_groups = 1;
      kvf_client_result res = KVF_CLIENT_RESULT_INIT;
      if (kvf_client_store(src.c, &x, &res) != KVF_SUCCESS || res.prefix_tokens != tokens) {
        fprintf(stderr, "kvf_peers_bench: store: %s\n", kvf_last_error());
        goto out;
      }
      double t0 = now_s();
      kvf_status st = kvf_client_retrieve(dst.c, &x, &res);
      double t1 = now_s();
      if (st != KVF_SUCCESS || res.prefix_tokens != tokens) {
        fprintf(stderr, "kvf_peers_bench: pull retrieve: %s (prefix %llu)\n", kvf_last_error(),
                (unsigned long long)res.prefix_tokens);
        goto out;
      }
      bytes = res.bytes_done;
      objects = res.objects_done;
      kvf_client_result again = KVF_CLIENT_RESULT_INIT;
      double t2 = now_s();
      st = kvf_client_retrieve(dst.c, &x, &again);
      double t3 = now_s();
      if (st != KVF_SUCCESS || again.prefix_tokens != tokens) goto out;
      if (r == 0) continue; // warm-up
      pull_gbs.push_back((double)bytes / (t1 - t0) / 1e9);
      pull_objs.push_back((double)objects / (t1 - t0));
      local_gbs.push_back((double)bytes / (t3 - t2) / 1e9);
      local_objs.push_back((double)objects / (t3 - t2));
    }
    const char *tls = getenv("UCX_TLS");
    // Each round's pull too: the first reads of a peer's pool through a
    // shared-memory mapping fault its pages in (docs/peers.md).
    std::string each;
    for (size_t i = 0; i < pull_gbs.size(); i++) {
      char v[32];
      snprintf(v, sizeof v, "%s%.3f", i ? ", " : "", pull_gbs[i]);
      each += v;
    }
    printf("{\"bench\": \"peer-pull\", \"ucx_tls\": \"%s\", \"peer_shm\": \"%s\", \"geometry\": \"%s\", \"tokens\": %llu, "
           "\"objects\": %llu, \"object_bytes\": %llu, \"bytes\": %llu, \"rounds\": %u, \"gb_per_s\": %.3f, "
           "\"objects_per_s\": %.1f, \"local_gb_per_s\": %.3f, \"local_objects_per_s\": %.1f, \"round_gb_per_s\": [%s]}\n",
           tls ? tls : "", getenv("KVF_PEER_SHM") ? getenv("KVF_PEER_SHM") : "0",
           strrchr(geometry.c_str(), '/') ? strrchr(geometry.c_str(), '/') + 1 : geometry.c_str(),
           (unsigned long long)tokens, (unsigned long long)objects,
           (unsigned long long)(objects ? bytes / objects : 0), (unsigned long long)bytes, rounds, median(pull_gbs),
           median(pull_objs), median(local_gbs), median(local_objs), each.c_str());
    rc = 0;
  }
out:
  kvf_client_disconnect(src.c);
  kvf_client_disconnect(dst.c);
  kill(b, SIGTERM);
  kill(a, SIGTERM);
  waitpid(b, nullptr, 0);
  waitpid(a, nullptr, 0);
  std::string rm = "rm -rf " + tmp;
  if (system(rm.c_str()) != 0) rc = rc ? rc : 1;
  return rc;
}
