/* kvferryd: the cache server engine workers share their KV caches with.
 * Runs in the foreground; SIGTERM or SIGINT drains every client and exits. */
#define _POSIX_C_SOURCE 200809L /* sigaction */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvferry/device.h>
#include <kvferry/status.h>

#include "host/core/log.h"
#include "host/core/param.h"
#include "host/server/server.h"

static kvf_server *g_server; /* for the signal handler */

static void on_signal(int sig) {
  (void)sig;
  kvf_server_stop(g_server); /* async-signal-safe */
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: kvferryd --socket-dir DIR [options]\n"
          "\n"
          "Serve KV-cache registrations from engine workers on DIR/kvferryd.sock, in the\n"
          "foreground. SIGTERM or SIGINT drains every client and exits with status 0.\n"
          "\n"
          "  --socket-dir DIR            the socket directory: created 0700 when missing, or an\n"
          "                              existing directory owned by this user with no group or\n"
          "                              other permissions. One server per directory: a second\n"
          "                              is refused; a stale socket of a crashed one is replaced.\n"
          "  --heartbeat-timeout-ms N    a client silent for longer is reaped: its registrations\n"
          "                              drain and are unmapped (default 10000)\n"
          "  --max-clients N             connections served at once (default 256). When every slot\n"
          "                              is taken, a new connection takes the slot of the oldest one\n"
          "                              that has not said HELLO; only clients that said HELLO keep\n"
          "                              a new one out\n"
          "  --hello-timeout-ms N        a connection that has not said HELLO this long after\n"
          "                              connecting is dropped (default 5000)\n"
          "  --frame-timeout-ms N        a frame must be whole this long after its first byte\n"
          "                              arrived (time the server held it back not counted): a\n"
          "                              slower sender is dropped (default 5000)\n"
          "  --max-frame-kb N            per client: the largest frame payload, in KiB, from 4 to\n"
          "                              16384 (default 16384, the protocol's limit)\n"
          "  --max-buffered-mb N         server-wide: frames over 64 KiB being received share this\n"
          "                              much memory, in MiB; one that does not fit waits, unread,\n"
          "                              while smaller frames of every client go on (default 64)\n"
          "  --max-requests-in-flight N  per client: STORE/RETRIEVE admitted and not answered; one\n"
          "                              more gets an ERROR naming quota.requests_in_flight\n"
          "                              (default 1024)\n"
          "  --max-reply-queue-mb N      per client: replies it has not read, in MiB; at half of it\n"
          "                              the server stops reading the client's requests, and a\n"
          "                              client that reads nothing for 2 s is dropped (default 16)\n"
          "  --devices LIST              CUDA devices to serve, each with its own L1 pool on the\n"
          "                              GPU's NUMA node and a worker and a completion thread on\n"
          "                              its local cores: \"all\" (default: every visible GPU),\n"
          "                              \"none\" (host backend only), or ordinals (\"0,1\").\n"
          "                              Host-backend engines are always served.\n"
          "  --l1-mb N                   L1 object store per device, in MiB (default 1024)\n"
          "  --host-l1-mb N              L1 for host-backend engines when GPUs are served, in MiB\n"
          "                              (default 256; pinned, since GPU engines may read it);\n"
          "                              without GPUs the host lane gets --l1-mb\n"
          "  --request-timeout-ms N      a STORE or RETRIEVE not complete by then is reported\n"
          "                              timed out (its memory is released only once the work\n"
          "                              is proven done) (default 60000)\n"
          "  --max-client-mapped-gb N    GiB of engine memory one client process (all its\n"
          "                              connections) may have mapped; a REGISTER claiming more is\n"
          "                              refused (quota.mapped_bytes) (default: 2 x physical\n"
          "                              memory, at least 2048)\n"
          "  --max-mapped-gb N           GiB of engine memory the server may have mapped in all\n"
          "                              (quota.server_mapped_bytes) (default 65536: half of a\n"
          "                              47-bit address space)\n"
          "  --max-client-registrations N  live and draining registrations per connection\n"
          "                              (quota.registrations) (default 8)\n"
          "  --max-pins N                per client: LOOKUP pins held at once (quota.pins)\n"
          "                              (default 256)\n"
          "  --max-pinned-chunks N       per client: chunks its LOOKUP pins hold at once\n"
          "                              (quota.pinned_chunks) (default 65536)\n"
          "  --listen ADDR:PORT          accept kvferryd peers there (UCX; numeric IPv4; docs/peers.md)\n"
          "  --peer ADDR:PORT            a kvferryd peer to connect to (repeatable, at most 32): a\n"
          "                              RETRIEVE that misses here fetches the missing objects from\n"
          "                              the peers that hold them. Reconnects every second when lost\n"
          "  --peer-secret-file FILE     required with --listen or --peer: the secret peers prove at\n"
          "                              connect (HMAC-SHA-256 challenge-response, never sent); a\n"
          "                              file of this user with mode 0600, 16 to 4096 bytes\n"
          "  --peer-fetch-timeout-ms N   a peer's answer taking longer, or a pull from it making no\n"
          "                              progress that long, fails and drops the connection\n"
          "                              (default 5000)\n"
          "  --log-level LEVEL           none, warn, info or trace (default: KVF_DEBUG, else warn)\n"
          "  --help                      this text\n"
          "\n"
          "Exit status: 0 after a clean stop, 1 when the server could not start or failed,\n"
          "2 for bad arguments.\n");
}

/* "all", "none" or a comma-separated list of ordinals. */
static int parse_devices(const char *text, int *devices, uint32_t *n, int *all) {
  *n = 0;
  *all = 0;
  if (!strcmp(text, "all")) {
    *all = 1;
    return 0;
  }
  if (!strcmp(text, "none")) return 0;
  const char *p = text;
  while (*p) {
    char *end = NULL;
    long v = strtol(p, &end, 10);
    if (end == p || v < 0 || v > 1023 || *n >= 64 || (*end && *end != ',')) {
      fprintf(stderr, "kvferryd: --devices: '%s' is not all, none or a list of device ordinals\n", text);
      return -1;
    }
    devices[(*n)++] = (int)v;
    p = *end ? end + 1 : end;
  }
  return 0;
}

static int parse_u32(const char *flag, const char *text, uint32_t *out) {
  int64_t v = 0;
  if (!text || kvf_param_parse_int(text, &v) != 0 || v < 0 || v > UINT32_MAX) {
    fprintf(stderr, "kvferryd: %s: '%s' is not a number from 0 to %u\n", flag, text ? text : "", UINT32_MAX);
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

int main(int argc, char **argv) {
  kvf_server_options opt = KVF_SERVER_OPTIONS_INIT;
  int devices[64];
  uint32_t num_devices = 0;
  int all_devices = 1;
  const char *peers[32];
  uint32_t num_peers = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(a, "--socket-dir") && v) {
      opt.socket_dir = v;
      i++;
    } else if (!strcmp(a, "--heartbeat-timeout-ms") && v) {
      if (parse_u32(a, v, &opt.heartbeat_timeout_ms) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--max-clients") && v) {
      if (parse_u32(a, v, &opt.max_clients) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--hello-timeout-ms") && v) {
      if (parse_u32(a, v, &opt.hello_timeout_ms) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--frame-timeout-ms") && v) {
      if (parse_u32(a, v, &opt.frame_timeout_ms) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--max-frame-kb") && v) {
      uint32_t kb = 0;
      if (parse_u32(a, v, &kb) != 0) return 2;
      if (kb < 4 || kb > 16384) {
        fprintf(stderr, "kvferryd: --max-frame-kb: %u is not from 4 to 16384\n", kb);
        return 2;
      }
      opt.max_frame_bytes = kb << 10;
      i++;
    } else if (!strcmp(a, "--max-buffered-mb") && v) {
      uint32_t mb = 0;
      if (parse_u32(a, v, &mb) != 0) return 2;
      if (mb == 0) {
        fprintf(stderr, "kvferryd: --max-buffered-mb: must be at least 1\n");
        return 2;
      }
      opt.max_buffered_bytes = (uint64_t)mb << 20;
      i++;
    } else if (!strcmp(a, "--max-requests-in-flight") && v) {
      if (parse_u32(a, v, &opt.max_requests_in_flight) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--max-reply-queue-mb") && v) {
      uint32_t mb = 0;
      if (parse_u32(a, v, &mb) != 0) return 2;
      if (mb == 0) {
        fprintf(stderr, "kvferryd: --max-reply-queue-mb: must be at least 1\n");
        return 2;
      }
      opt.max_reply_queue_bytes = (uint64_t)mb << 20;
      i++;
    } else if (!strcmp(a, "--devices") && v) {
      if (parse_devices(v, devices, &num_devices, &all_devices) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--l1-mb") && v) {
      uint32_t mb = 0;
      if (parse_u32(a, v, &mb) != 0) return 2;
      if (mb == 0) {
        fprintf(stderr, "kvferryd: --l1-mb: must be at least 1\n");
        return 2;
      }
      opt.l1_bytes = (uint64_t)mb << 20;
      i++;
    } else if (!strcmp(a, "--host-l1-mb") && v) {
      uint32_t mb = 0;
      if (parse_u32(a, v, &mb) != 0) return 2;
      if (mb == 0) {
        fprintf(stderr, "kvferryd: --host-l1-mb: must be at least 1\n");
        return 2;
      }
      opt.host_l1_bytes = (uint64_t)mb << 20;
      i++;
    } else if (!strcmp(a, "--request-timeout-ms") && v) {
      if (parse_u32(a, v, &opt.request_timeout_ms) != 0) return 2;
      i++;
    } else if ((!strcmp(a, "--max-client-mapped-gb") || !strcmp(a, "--max-mapped-gb")) && v) {
      uint32_t gb = 0;
      if (parse_u32(a, v, &gb) != 0) return 2;
      if (gb == 0) {
        fprintf(stderr, "kvferryd: %s: must be at least 1\n", a);
        return 2;
      }
      if (!strcmp(a, "--max-mapped-gb"))
        opt.max_mapped_bytes = (uint64_t)gb << 30;
      else
        opt.max_client_mapped_bytes = (uint64_t)gb << 30;
      i++;
    } else if (!strcmp(a, "--max-client-registrations") && v) {
      if (parse_u32(a, v, &opt.max_client_registrations) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--max-pins") && v) {
      if (parse_u32(a, v, &opt.max_client_pins) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--max-pinned-chunks") && v) {
      if (parse_u32(a, v, &opt.max_client_pinned_chunks) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--listen") && v) {
      opt.peer_listen = v;
      i++;
    } else if (!strcmp(a, "--peer") && v) {
      if (num_peers >= 32) {
        fprintf(stderr, "kvferryd: --peer: at most 32\n");
        return 2;
      }
      peers[num_peers++] = v;
      i++;
    } else if (!strcmp(a, "--peer-secret-file") && v) {
      opt.peer_secret_file = v;
      i++;
    } else if (!strcmp(a, "--peer-fetch-timeout-ms") && v) {
      if (parse_u32(a, v, &opt.peer_fetch_timeout_ms) != 0) return 2;
      i++;
    } else if (!strcmp(a, "--log-level") && v) {
      kvf_log_level level;
      if (kvf_log_parse_level(v, &level) != 0) {
        fprintf(stderr, "kvferryd: --log-level: '%s' is not none, warn, info or trace\n", v);
        return 2;
      }
      kvf_log_override(level, KVF_LOG_ALL);
      i++;
    } else {
      fprintf(stderr, "kvferryd: %s: unknown flag or missing value\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (!opt.socket_dir) {
    fprintf(stderr, "kvferryd: --socket-dir is required\n");
    usage(stderr);
    return 2;
  }
  if (all_devices) {
    kvf_cuda_info info = KVF_CUDA_INFO_INIT;
    if (kvf_cuda_probe(&info) == KVF_SUCCESS)
      for (int d = 0; d < info.device_count && d < 64; d++) devices[num_devices++] = d;
  }
  opt.devices = devices;
  opt.num_devices = num_devices;
  opt.peers = peers;
  opt.num_peers = num_peers;
  kvf_status st = kvf_server_create(&opt, &g_server);
  if (st != KVF_SUCCESS) {
    fprintf(stderr, "kvferryd: %s\n", kvf_last_error());
    return 1;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  fprintf(stderr, "kvferryd: serving on %s (pid %ld)\n", kvf_server_socket_path(g_server), (long)getpid());
  st = kvf_server_run(g_server);
  if (st != KVF_SUCCESS) fprintf(stderr, "kvferryd: %s\n", kvf_last_error());
  kvf_server_destroy(g_server);
  g_server = NULL;
  return st == KVF_SUCCESS ? 0 : 1;
}
