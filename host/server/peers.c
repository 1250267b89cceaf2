/* kvferryd peers: handshake, keys, HAS/HAS_REPLY, pulls (host/server/peers.h).
 *
 * Wire format (little-endian, docs/peers.md): every message starts with
 *   u32 magic "KVFP", u16 type, u16 version (1), u32 length (the whole
 *   message), u32 reserved (0), u64 id
 * and its payload follows:
 *   HELLO     nonce[32], u64 boot_token
 *   AUTH      mac[32] = HMAC-SHA-256(secret, "kvferry-peer-auth-v1" ||
 *             receiver's nonce || sender's nonce || sender's boot token)
 *   KEYS      u32 n, u32 0, then n x {i32 device, u32 key_len, u64 base, u64 size,
 *             key bytes padded to 8}
 *   HAS       u32 n, u32 0, then n x {L1 key: chunk key (32 bytes), u64 canonical
 *             fingerprint, u32 shard_index, u32 shard_count; object header (48 bytes)}
 *   HAS_REPLY u32 n, u32 0, then n x {u32 found, u32 pool, u64 offset, header}
 *             (found 1: at pool/offset, pinned; 2: not in the asked scope but
 *             held for another model: offset is that scope's fingerprint,
 *             header its object's)
 *   RELEASE   (id: the HAS whose pins may go)
 *   ERROR     u32 status, text
 *   OFFER     (push) u32 n, u32 0, then n x {L1 key, header, u32 pool, u32 0,
 *             u64 offset}: pinned here until the OFFER_DONE of the same id
 *   OFFER_DONE u32 n, u32 0, then n x u8 (0 refused or failed, 1 committed,
 *             2 held already)
 * HELLO, AUTH first; KEYS only once the sender verified the receiver's AUTH;
 * anything else before both are verified is refused. */
#define _GNU_SOURCE
#include "host/server/peers.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "common/clock.h"
#include "common/error.h"
#include "host/core/log.h"
#include "host/server/peer_transport.h"

#define PM_MAGIC 0x5046564Bu /* "KVFP" */
#define PM_VERSION 1u
#define PM_HDR 24u
#define PM_NONCE 32u
#define PM_MAC 32u
#define PM_HEADER_BYTES 48u
#define PM_KEY_BYTES 48u /* kvf_l1_key: the chunk key and its scope */
#define PM_HAS_ENTRY (PM_KEY_BYTES + PM_HEADER_BYTES)
#define PM_MAX_POOLS 65u
#define PM_MAX_KEY 4096u
#define PM_PIN_MS 30000u
#define PM_RETRY_MS 1000u
#define PM_OFFER_ENTRY (PM_KEY_BYTES + PM_HEADER_BYTES + 16u)
#define PM_MAX_PINS_PER_PEER 64u   /* HAS answers holding pins for one peer; past it a HAS is answered "none" */
#define PM_MAX_OFFERS_PER_PEER 4u  /* OFFERs one peer may have this side pulling at once */
#define PM_PUSH_BYTES_PER_MS 50000u /* a push's deadline grows 1 ms per 50 kB (a 50 MB/s floor) */

_Static_assert(sizeof(kvf_object_header) == PM_HEADER_BYTES, "the object header travels as its 48 bytes");
_Static_assert(sizeof(kvf_l1_key) == PM_KEY_BYTES, "an L1 key travels as its 48 bytes");

enum {
  PM_HELLO = 1,
  PM_AUTH = 2,
  PM_KEYS = 3,
  PM_HAS = 4,
  PM_HAS_REPLY = 5,
  PM_RELEASE = 6,
  PM_ERROR = 7,
  PM_OFFER = 8,
  PM_OFFER_DONE = 9,
};

static const char *pm_name(uint32_t t) {
  switch (t) {
    case PM_HELLO: return "HELLO";
    case PM_AUTH: return "AUTH";
    case PM_KEYS: return "KEYS";
    case PM_HAS: return "HAS";
    case PM_HAS_REPLY: return "HAS_REPLY";
    case PM_RELEASE: return "RELEASE";
    case PM_ERROR: return "ERROR";
    case PM_OFFER: return "OFFER";
    case PM_OFFER_DONE: return "OFFER_DONE";
    default: return "unknown";
  }
}

typedef struct remote_pool {
  int32_t device;
  uint64_t base, size;
  kvf_pt_rkey *rkey;
} remote_pool;

/* L1 pins held while a peer reads the objects a HAS_REPLY pointed it to. */
typedef struct serve_pin {
  struct serve_pin *next;
  uint64_t id;
  kvf_l1_pin *pin;
  uint64_t deadline_ns;
} serve_pin;

typedef struct peer {
  struct peer *next;
  uint64_t uid; /* order of creation; fetches ask peers in this order */
  char addr[64];
  int outgoing;
  kvf_pt_conn *conn;
  uint32_t state; /* kvf_peer_state */
  uint8_t my_nonce[PM_NONCE], their_nonce[PM_NONCE];
  int got_hello, verified, got_keys;
  uint64_t boot_token;
  uint64_t deadline_ns; /* handshake */
  uint64_t retry_ns;    /* outgoing, DOWN: the next attempt */
  int doomed;           /* close at the next turn */
  char doom_why[192];
  remote_pool pools[PM_MAX_POOLS];
  uint32_t num_pools;
  serve_pin *pins;
  kvf_peer_info info; /* counters (p->mu for readers) */
} peer;

typedef enum fetch_state { F_NEXT = 0, F_ASKED = 1, F_PULLING = 2 } fetch_state;

typedef struct fetch {
  struct fetch *next;
  uint64_t id;
  int device;
  kvf_l1_object_spec *specs;
  uint32_t n;
  uint8_t *have;      /* [n] 1: local now, or no longer asked for */
  uint32_t *asked;    /* spec indices of the HAS in flight */
  uint32_t num_asked;
  fetch_state state;
  uint64_t last_uid;  /* the last peer asked */
  peer *at;           /* the peer asked or pulled from */
  uint64_t deadline_ns;
  uint64_t timeout_ns;  /* fetch_timeout_ms */
  kvf_l1_reservation *res;
  uint32_t *pulling;  /* spec indices being pulled into res */
  uint32_t num_pulling;
  uint64_t pull_bytes;
  uint32_t gets_out;
  int get_failed;
  uint64_t committed;
  kvf_status mismatch;      /* KVF_SUCCESS, or why a peer's object cannot serve this geometry */
  uint32_t mismatch_spec;
  char mismatch_msg[256];
  kvf_peers_fetch_done done;  /* NULL for an offer */
  void *arg;
  /* An OFFER a peer pushed: pulled from it (at), then answered with
   * OFFER_DONE (id: the peer's) and never asked of anyone else. */
  int offer;
  uint64_t offer_uid;  /* the peer that offered */
  uint8_t *result;     /* [n] what OFFER_DONE says of each */
} fetch;

/* A PUSH: objects of this L1, pinned, offered to one peer. */
typedef struct push_job {
  struct push_job *next;
  uint64_t id;
  char peer_name[64];
  kvf_l1_object_spec *specs;
  uint32_t n;
  uint8_t *result;     /* [n] KVF_PEERS_PUSH_* */
  uint32_t *offered;   /* spec indices in the OFFER */
  uint32_t num_offered;
  uint64_t bytes;      /* payload of the offered objects */
  kvf_l1_pin *pin;
  uint64_t at_uid;     /* the peer offered to (0: not sent yet) */
  uint64_t at_connects; /* its handshakes then: a reconnect is another connection */
  uint64_t deadline_ns;
  kvf_peers_push_done done;
  void *arg;
} push_job;

struct kvf_peers {
  kvf_peers_options opt;
  uint8_t secret[4096];
  size_t secret_len;
  kvf_pt *t;
  kvf_pt_mem *mems[PM_MAX_POOLS];
  kvf_l1_pool_desc pools[PM_MAX_POOLS];
  uint32_t num_pools;
  uint16_t port;
  char **addrs;
  pthread_t thread;
  int thread_started;
  int stop;                 /* atomic */
  pthread_mutex_t mu;       /* the new-fetch queue, peers' info copies, counters */
  fetch *incoming;          /* fetches posted, not taken by the thread yet (mu) */
  uint64_t next_fetch_id;   /* mu */
  peer *peers;              /* the thread's; the list itself changes under mu */
  uint64_t next_uid;
  fetch *fetches;           /* the thread's */
  push_job *push_incoming;  /* posted, not taken by the thread yet (mu) */
  uint64_t next_push_id;    /* mu */
  push_job *pushes;         /* the thread's */
  kvf_peers_counters counters; /* mu */
};

/* ---- bytes ------------------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* The first 8 bytes of a chunk key, big-endian, for logs. */
static uint64_t key_prefix(const kvf_l1_key *k) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = (v << 8) | k->chunk.bytes[i];
  return v;
}

static void hdr_fill(uint8_t *m, uint32_t type, uint32_t len, uint64_t id) {
  put32(m, PM_MAGIC);
  uint16_t t16 = (uint16_t)type, v16 = PM_VERSION;
  memcpy(m + 4, &t16, 2);
  memcpy(m + 6, &v16, 2);
  put32(m + 8, len);
  put32(m + 12, 0);
  put64(m + 16, id);
}

/* ---- peers -------------------------------------------------------------------- */

static void peer_doom(peer *pr, const char *fmt, ...) KVF_PRINTF(2, 3);
static void peer_doom(peer *pr, const char *fmt, ...) {
  if (pr->doomed) return;
  pr->doomed = 1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pr->doom_why, sizeof(pr->doom_why), fmt, ap);
  va_end(ap);
}

static void count_failure(kvf_peers *p, peer *pr) {
  pthread_mutex_lock(&p->mu);
  if (pr) pr->info.failures++;
  p->counters.failures++;
  pthread_mutex_unlock(&p->mu);
}

static void peer_send(peer *pr, const uint8_t *m, size_t len) {
  if (!pr->conn || pr->doomed) return;
  if (kvf_pt_send(pr->conn, m, len) != KVF_SUCCESS) peer_doom(pr, "send: %s", kvf_last_error());
}

/* Tell pr what was wrong, then drop it. */
static void peer_refuse(kvf_peers *p, peer *pr, kvf_status st, const char *fmt, ...) KVF_PRINTF(4, 5);
static void peer_refuse(kvf_peers *p, peer *pr, kvf_status st, const char *fmt, ...) {
  char why[192];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof(why), fmt, ap);
  va_end(ap);
  uint8_t m[PM_HDR + 4 + sizeof(why)];
  size_t tl = strlen(why);
  hdr_fill(m, PM_ERROR, (uint32_t)(PM_HDR + 4 + tl), 0);
  put32(m + PM_HDR, (uint32_t)st);
  memcpy(m + PM_HDR + 4, why, tl);
  peer_send(pr, m, PM_HDR + 4 + tl);
  count_failure(p, pr);
  peer_doom(pr, "%s", why);
}

static void peer_drop_keys(peer *pr) {
  for (uint32_t i = 0; i < pr->num_pools; i++) kvf_pt_rkey_destroy(pr->pools[i].rkey);
  memset(pr->pools, 0, sizeof(pr->pools));
  pr->num_pools = 0;
}

static void peer_drop_pins(kvf_peers *p, peer *pr) {
  while (pr->pins) {
    serve_pin *sp = pr->pins;
    pr->pins = sp->next;
    kvf_l1_unpin(p->opt.l1, sp->pin);
    free(sp);
    pthread_mutex_lock(&p->mu);
    p->counters.serve_pins--;
    pthread_mutex_unlock(&p->mu);
  }
}

static void peer_set_state(kvf_peers *p, peer *pr, uint32_t state) {
  pthread_mutex_lock(&p->mu);
  pr->state = state;
  pr->info.state = state;
  pthread_mutex_unlock(&p->mu);
}

/* Close pr's connection (in-flight gets fail first: their fetches abort at
 * their next step). An incoming peer is forgotten; an outgoing one retries. */
static void peer_close(kvf_peers *p, peer *pr) {
  if (pr->conn) {
    /* A peer we heard from is worth a warning; a reconnect attempt to one
     * that is down (every second) is not. */
    if (pr->got_hello)
      KVF_WARN(SERVER, "peer %s: disconnected: %s", pr->addr, pr->doom_why[0] ? pr->doom_why : "closed");
    else
      KVF_INFO(SERVER, "peer %s: no connection: %s", pr->addr, pr->doom_why[0] ? pr->doom_why : "closed");
    peer_drop_keys(pr);
    kvf_pt_close(pr->conn);
    pr->conn = NULL;
  }
  peer_drop_pins(p, pr);
  pr->got_hello = pr->verified = pr->got_keys = 0;
  pr->doomed = 0;
  pr->doom_why[0] = 0;
  pr->retry_ns = kvf_now_ns() + (uint64_t)PM_RETRY_MS * 1000000ull;
  peer_set_state(p, pr, KVF_PEER_DOWN);
}

static peer *peer_new(kvf_peers *p, const char *addr, int outgoing) {
  peer *pr = calloc(1, sizeof(*pr));
  if (!pr) return NULL;
  pr->uid = ++p->next_uid;
  snprintf(pr->addr, sizeof(pr->addr), "%s", addr);
  pr->outgoing = outgoing;
  snprintf(pr->info.addr, sizeof(pr->info.addr), "%s", addr);
  pr->info.outgoing = (uint32_t)outgoing;
  pthread_mutex_lock(&p->mu);
  peer **tail = &p->peers;
  while (*tail) tail = &(*tail)->next;
  *tail = pr;
  pthread_mutex_unlock(&p->mu);
  return pr;
}

static void peer_free(kvf_peers *p, peer *pr) {
  pthread_mutex_lock(&p->mu);
  for (peer **pp = &p->peers; *pp; pp = &(*pp)->next)
    if (*pp == pr) {
      *pp = pr->next;
      break;
    }
  pthread_mutex_unlock(&p->mu);
  free(pr);
}

static void send_hello(kvf_peers *p, peer *pr) {
  uint8_t m[PM_HDR + PM_NONCE + 8];
  if (getrandom(pr->my_nonce, PM_NONCE, 0) != (ssize_t)PM_NONCE) {
    peer_doom(pr, "getrandom: %s", strerror(errno));
    return;
  }
  hdr_fill(m, PM_HELLO, sizeof(m), 0);
  memcpy(m + PM_HDR, pr->my_nonce, PM_NONCE);
  put64(m + PM_HDR + PM_NONCE, p->opt.boot_token);
  peer_send(pr, m, sizeof(m));
}

/* The MAC `sender` proves the secret with, to the holder of receiver_nonce. */
static int auth_mac(const kvf_peers *p, const uint8_t *receiver_nonce, const uint8_t *sender_nonce, uint64_t boot,
                    uint8_t *mac) {
  static const char label[] = "kvferry-peer-auth-v1";
  uint8_t data[sizeof(label) - 1 + 2 * PM_NONCE + 8];
  memcpy(data, label, sizeof(label) - 1);
  memcpy(data + sizeof(label) - 1, receiver_nonce, PM_NONCE);
  memcpy(data + sizeof(label) - 1 + PM_NONCE, sender_nonce, PM_NONCE);
  put64(data + sizeof(label) - 1 + 2 * PM_NONCE, boot);
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), p->secret, (int)p->secret_len, data, sizeof(data), mac, &len) || len != PM_MAC) return -1;
  return 0;
}

static void send_keys(kvf_peers *p, peer *pr) {
  size_t len = PM_HDR + 8;
  for (uint32_t i = 0; i < p->num_pools; i++) {
    const void *k;
    size_t kl;
    kvf_pt_mem_key(p->mems[i], &k, &kl);
    len += 24 + ((kl + 7) & ~(size_t)7);
  }
  uint8_t *m = calloc(1, len);
  if (!m) {
    peer_doom(pr, "keys: out of memory");
    return;
  }
  hdr_fill(m, PM_KEYS, (uint32_t)len, 0);
  put32(m + PM_HDR, p->num_pools);
  size_t off = PM_HDR + 8;
  for (uint32_t i = 0; i < p->num_pools; i++) {
    const void *k;
    size_t kl;
    kvf_pt_mem_key(p->mems[i], &k, &kl);
    int32_t dev = p->pools[i].device;
    memcpy(m + off, &dev, 4);
    put32(m + off + 4, (uint32_t)kl);
    put64(m + off + 8, (uint64_t)(uintptr_t)p->pools[i].base);
    put64(m + off + 16, p->pools[i].size);
    memcpy(m + off + 24, k, kl);
    off += 24 + ((kl + 7) & ~(size_t)7);
  }
  peer_send(pr, m, len);
  free(m);
}

static void on_hello(kvf_peers *p, peer *pr, const uint8_t *b, size_t n) {
  if (pr->got_hello) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HELLO: a second HELLO");
  if (n != PM_NONCE + 8) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HELLO: %zu payload bytes, expected %u", n, PM_NONCE + 8);
  memcpy(pr->their_nonce, b, PM_NONCE);
  if (CRYPTO_memcmp(pr->their_nonce, pr->my_nonce, PM_NONCE) == 0)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HELLO: the nonce is ours (a reflection)");
  uint64_t boot = get64(b + PM_NONCE);
  if (boot == 0) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HELLO: boot_token 0");
  pr->got_hello = 1;
  if (pr->boot_token && pr->boot_token != boot)
    KVF_WARN(SERVER, "peer %s: restarted (boot token %016llx, was %016llx): its old keys are gone", pr->addr,
             (unsigned long long)boot, (unsigned long long)pr->boot_token);
  pr->boot_token = boot;
  pthread_mutex_lock(&p->mu);
  pr->info.boot_token = boot;
  pthread_mutex_unlock(&p->mu);
  uint8_t m[PM_HDR + PM_MAC];
  hdr_fill(m, PM_AUTH, sizeof(m), 0);
  if (auth_mac(p, pr->their_nonce, pr->my_nonce, p->opt.boot_token, m + PM_HDR) != 0)
    return peer_doom(pr, "HMAC failed");
  peer_send(pr, m, sizeof(m));
}

static void on_auth(kvf_peers *p, peer *pr, const uint8_t *b, size_t n) {
  if (!pr->got_hello || pr->verified) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "AUTH: out of order");
  if (n != PM_MAC) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "AUTH: %zu payload bytes, expected %u", n, PM_MAC);
  uint8_t want[PM_MAC];
  if (auth_mac(p, pr->my_nonce, pr->their_nonce, pr->boot_token, want) != 0) return peer_doom(pr, "HMAC failed");
  if (CRYPTO_memcmp(want, b, PM_MAC) != 0) {
    KVF_WARN(SERVER, "peer %s: refused: it does not know the peer secret (--peer-secret-file)", pr->addr);
    return peer_refuse(p, pr, KVF_ERR_PERMISSION, "AUTH: wrong peer secret");
  }
  pr->verified = 1;
  send_keys(p, pr);
}

static void on_keys(kvf_peers *p, peer *pr, const uint8_t *b, size_t n) {
  if (pr->got_keys) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: a second KEYS");
  if (n < 8) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: truncated");
  uint32_t np = get32(b);
  if (np == 0 || np > PM_MAX_POOLS) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: n %u (1..%u)", np, PM_MAX_POOLS);
  size_t off = 8;
  for (uint32_t i = 0; i < np; i++) {
    if (n - off < 24) {
      peer_drop_keys(pr);
      return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: pools[%u]: truncated", i);
    }
    int32_t dev;
    memcpy(&dev, b + off, 4);
    uint32_t kl = get32(b + off + 4);
    uint64_t base = get64(b + off + 8), size = get64(b + off + 16);
    size_t padded = ((size_t)kl + 7) & ~(size_t)7;
    if (kl == 0 || kl > PM_MAX_KEY || n - off - 24 < padded) {
      peer_drop_keys(pr);
      return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: pools[%u].key_len: %u", i, kl);
    }
    if (size == 0 || base + size < base) {
      peer_drop_keys(pr);
      return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: pools[%u]: base %llx size %llu wraps", i,
                         (unsigned long long)base, (unsigned long long)size);
    }
    remote_pool *rp = &pr->pools[i];
    if (kvf_pt_rkey_unpack(pr->conn, b + off + 24, kl, base, size, &rp->rkey) != KVF_SUCCESS) {
      peer_drop_keys(pr);
      return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: pools[%u]: %s", i, kvf_last_error());
    }
    rp->device = dev;
    rp->base = base;
    rp->size = size;
    pr->num_pools = i + 1;
    off += 24 + padded;
  }
  if (off != n) {
    peer_drop_keys(pr);
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "KEYS: %zu trailing bytes", n - off);
  }
  pr->got_keys = 1;
  pthread_mutex_lock(&p->mu);
  pr->info.connects++;
  pthread_mutex_unlock(&p->mu);
  peer_set_state(p, pr, KVF_PEER_READY);
  KVF_WARN(SERVER, "peer %s: connected (boot token %016llx, %u pools)", pr->addr, (unsigned long long)pr->boot_token,
           np);
}

/* A peer asks which of n objects we hold: pin those we do, say where. */
static void on_has(kvf_peers *p, peer *pr, uint64_t id, const uint8_t *b, size_t n) {
  if (n < 8) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS: truncated");
  uint32_t cnt = get32(b);
  if (cnt == 0 || cnt > KVF_PEERS_MAX_OBJECTS)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS: n %u (1..%u)", cnt, KVF_PEERS_MAX_OBJECTS);
  if (n != 8 + (size_t)cnt * PM_HAS_ENTRY)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS: %zu payload bytes for %u objects", n, cnt);
  for (serve_pin *sp = pr->pins; sp; sp = sp->next)
    if (sp->id == id) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS: id %llu repeated", (unsigned long long)id);
  kvf_l1_query *q = calloc(cnt, sizeof(*q));
  kvf_l1_found *f = calloc(cnt, sizeof(*f));
  kvf_object_header *want = calloc(cnt, sizeof(*want));
  size_t rlen = PM_HDR + 8 + (size_t)cnt * (16 + PM_HEADER_BYTES);
  uint8_t *r = calloc(1, rlen);
  kvf_l1_pin *pin = NULL;
  if (!q || !f || !want || !r) {
    peer_doom(pr, "HAS: out of memory");
    goto out;
  }
  for (uint32_t i = 0; i < cnt; i++) {
    const uint8_t *e = b + 8 + (size_t)i * PM_HAS_ENTRY;
    memcpy(&q[i].key, e, PM_KEY_BYTES);
    memcpy(&want[i], e + PM_KEY_BYTES, PM_HEADER_BYTES);
    q[i].object_group = want[i].object_group;
    static const kvf_chunk_key zero;
    if (memcmp(&q[i].key.chunk, &zero, sizeof(zero)) == 0 || q[i].object_group >= KVF_MAX_GROUPS) {
      peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS: objects[%u]: an all-zero key or object group %u", i,
                  q[i].object_group);
      goto out;
    }
  }
  uint32_t held = 0;
  for (serve_pin *sp = pr->pins; sp; sp = sp->next) held++;
  hdr_fill(r, PM_HAS_REPLY, (uint32_t)rlen, id);
  put32(r + PM_HDR, cnt);
  if (held >= PM_MAX_PINS_PER_PEER) {
    /* One peer cannot hold this L1 pinned without bound: answered "none". */
    KVF_WARN(SERVER, "peer %s: HAS %llu answered with no objects: it holds %u answers' pins already (at most %u)",
             pr->addr, (unsigned long long)id, held, PM_MAX_PINS_PER_PEER);
    count_failure(p, pr);
    peer_send(pr, r, rlen);
    goto out;
  }
  if (kvf_l1_lookup_pin(p->opt.l1, q, cnt, f, &pin) != KVF_SUCCESS) {
    peer_refuse(p, pr, KVF_ERR_INTERNAL, "HAS: lookup: %s", kvf_last_error());
    goto out;
  }
  uint64_t served = 0;
  for (uint32_t i = 0; i < cnt; i++) {
    uint8_t *e = r + PM_HDR + 8 + (size_t)i * (16 + PM_HEADER_BYTES);
    /* Found with another header too: the asker names the difference (a
     * different model is refused, another token range is a miss). */
    if (!f[i].found) {
      kvf_l1_key other;
      kvf_object_header oh;
      if (kvf_l1_other_scope(p->opt.l1, &q[i].key, q[i].object_group, &other, &oh)) {
        put32(e, 2);
        put64(e + 8, other.fingerprint);
        memcpy(e + 16, &oh, PM_HEADER_BYTES);
      }
      continue;
    }
    uint32_t pool = UINT32_MAX;
    for (uint32_t k = 0; k < p->num_pools; k++) {
      uintptr_t base = (uintptr_t)p->pools[k].base, d = (uintptr_t)f[i].data;
      if (d >= base && d - base < p->pools[k].size) pool = k;
    }
    if (pool == UINT32_MAX) continue;
    put32(e, 1);
    put32(e + 4, pool);
    put64(e + 8, (uint64_t)((uintptr_t)f[i].data - (uintptr_t)p->pools[pool].base));
    memcpy(e + 16, &f[i].header, PM_HEADER_BYTES);
    served++;
  }
  if (served) {
    serve_pin *sp = calloc(1, sizeof(*sp));
    if (!sp) {
      peer_doom(pr, "HAS: out of memory");
      goto out;
    }
    sp->id = id;
    sp->pin = pin;
    pin = NULL;
    sp->deadline_ns = kvf_now_ns() + (uint64_t)PM_PIN_MS * 1000000ull;
    sp->next = pr->pins;
    pr->pins = sp;
    pthread_mutex_lock(&p->mu);
    p->counters.serve_pins++;
    pr->info.objects_served += served;
    pthread_mutex_unlock(&p->mu);
  }
  KVF_INFO(SERVER, "peer %s: HAS %llu: %llu of %u objects here", pr->addr, (unsigned long long)id,
           (unsigned long long)served, cnt);
  peer_send(pr, r, rlen);
out:
  kvf_l1_unpin(p->opt.l1, pin);
  free(q);
  free(f);
  free(want);
  free(r);
}

static void on_release(kvf_peers *p, peer *pr, uint64_t id, size_t n) {
  if (n != 0) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "RELEASE: %zu payload bytes, expected 0", n);
  for (serve_pin **pp = &pr->pins; *pp; pp = &(*pp)->next)
    if ((*pp)->id == id) {
      serve_pin *sp = *pp;
      *pp = sp->next;
      kvf_l1_unpin(p->opt.l1, sp->pin);
      free(sp);
      pthread_mutex_lock(&p->mu);
      p->counters.serve_pins--;
      pthread_mutex_unlock(&p->mu);
      return;
    }
  /* Unknown: it had nothing pinned (none found), or the pin expired. */
}

/* ---- fetches ------------------------------------------------------------------ */

static void fetch_release_remote(peer *pr, uint64_t id) {
  uint8_t m[PM_HDR];
  hdr_fill(m, PM_RELEASE, sizeof(m), id);
  peer_send(pr, m, sizeof(m));
}

static void on_get_done(void *arg, kvf_status st) {
  fetch *f = arg;
  f->gets_out--;
  if (st != KVF_SUCCESS) f->get_failed = 1;
  /* A completed get is progress: a large pull times out only when it stalls. */
  f->deadline_ns = kvf_now_ns() + f->timeout_ns;
}

/* Reserve specs[0 .. f->num_pulling) in f's pool and start the gets from
 * pr (addr/pool: where each lies there). Nothing reserved: f->num_pulling 0. */
static void fetch_pull(kvf_peers *p, fetch *f, peer *pr, const kvf_l1_object_spec *specs, const uint64_t *addr,
                       const uint32_t *pool, kvf_l1_slot *slots) {
  if (f->num_pulling == 0) return;
  uint32_t bad = UINT32_MAX;
  if (kvf_l1_reserve(p->opt.l1, f->device, specs, f->num_pulling, slots, &f->res, &bad) != KVF_SUCCESS) {
    KVF_WARN(SERVER, "peer %s: %s %llu: no room in L1 for %u objects: %s", pr->addr, f->offer ? "offer" : "fetch",
             (unsigned long long)f->id, f->num_pulling, kvf_last_error());
    f->res = NULL;
    f->num_pulling = 0;
    return;
  }
  f->pull_bytes = 0;
  for (uint32_t i = 0; i < f->num_pulling; i++) {
    if (slots[i].state != KVF_L1_SLOT_RESERVED) {
      if (f->offer) f->result[f->pulling[i]] = 2; /* held here already */
      continue;
    }
    kvf_status st = kvf_pt_get(pr->conn, pr->pools[pool[i]].rkey, addr[i], slots[i].data,
                               (size_t)specs[i].header.payload_bytes, on_get_done, f);
    if (st != KVF_SUCCESS) {
      f->get_failed = 1;
      break;
    }
    f->gets_out++;
    f->pull_bytes += specs[i].header.payload_bytes;
  }
}

/* The answer to the HAS f asked at: check each claimed object, reserve
 * what is good, start the gets. */
static void on_has_reply(kvf_peers *p, peer *pr, uint64_t id, const uint8_t *b, size_t n) {
  fetch *f = p->fetches;
  while (f && !(f->id == id && f->state == F_ASKED && f->at == pr)) f = f->next;
  if (!f) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS_REPLY: id %llu answers no HAS", (unsigned long long)id);
  if (n < 8) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS_REPLY: truncated");
  uint32_t cnt = get32(b);
  if (cnt != f->num_asked || n != 8 + (size_t)cnt * (16 + PM_HEADER_BYTES))
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "HAS_REPLY: %u objects in %zu bytes, %u asked", cnt, n, f->num_asked);
  kvf_l1_object_spec *specs = calloc(cnt, sizeof(*specs));
  kvf_l1_slot *slots = calloc(cnt, sizeof(*slots));
  uint64_t *addr = calloc(cnt, sizeof(*addr));
  uint32_t *pool = calloc(cnt, sizeof(*pool));
  f->pulling = calloc(cnt, sizeof(*f->pulling));
  f->num_pulling = 0;
  f->state = F_PULLING;
  f->deadline_ns = kvf_now_ns() + (uint64_t)p->opt.fetch_timeout_ms * 1000000ull;
  uint32_t refused = 0;
  if (!specs || !slots || !addr || !pool || !f->pulling) goto out;
  for (uint32_t i = 0; i < cnt; i++) {
    const uint8_t *e = b + 8 + (size_t)i * (16 + PM_HEADER_BYTES);
    uint32_t found = get32(e), pi = get32(e + 4);
    uint64_t off = get64(e + 8);
    if (found == 0) continue;
    const kvf_l1_object_spec *want = &f->specs[f->asked[i]];
    kvf_object_header h;
    memcpy(&h, e + 16, PM_HEADER_BYTES);
    const char *bad = NULL;
    if (found == 2) {
      /* Not held for this model, but for another one under the same key: a
       * peer pairing meant for one model serves a different one. Refused by
       * name rather than silently recomputed (docs/peers.md). */
      if (f->mismatch == KVF_SUCCESS) {
        f->mismatch = KVF_ERR_GEOMETRY_MISMATCH;
        f->mismatch_spec = f->asked[i];
        snprintf(f->mismatch_msg, sizeof(f->mismatch_msg),
                 "geometry.fingerprint: peer %s holds this chunk key for a different model (canonical fingerprint "
                 "%016llx; this registration's is %016llx)", pr->addr, (unsigned long long)off,
                 (unsigned long long)want->key.fingerprint);
      }
      continue;
    }
    if (found == 1 && h.magic == want->header.magic && h.header_version == want->header.header_version &&
        h.object_group == want->header.object_group &&
        (h.fingerprint != want->header.fingerprint || h.format != want->header.format)) {
      /* The peer holds this key through another geometry or format: what a
       * RETRIEVE refuses in its own L1, it refuses from a peer. */
      if (f->mismatch == KVF_SUCCESS) {
        f->mismatch = KVF_ERR_GEOMETRY_MISMATCH;
        f->mismatch_spec = f->asked[i];
        if (h.format != want->header.format)
          snprintf(f->mismatch_msg, sizeof(f->mismatch_msg),
                   "format: peer %s holds it as %s, the request asks for %s", pr->addr,
                   kvf_object_format_name((kvf_object_format)h.format),
                   kvf_object_format_name((kvf_object_format)want->header.format));
        else
          snprintf(f->mismatch_msg, sizeof(f->mismatch_msg),
                   "fingerprint %016llx: peer %s holds it from a different geometry (this one is %016llx): another "
                   "model, or another layout in native format", (unsigned long long)h.fingerprint, pr->addr,
                   (unsigned long long)want->header.fingerprint);
      }
      continue;
    }
    if (found == 1 && h.magic == want->header.magic && h.object_group == want->header.object_group &&
        h.fingerprint == want->header.fingerprint && h.format == want->header.format &&
        (h.token_begin != want->header.token_begin || h.token_end != want->header.token_end))
      continue; /* another token range (a partial chunk): a miss, as in local L1 */
    if (found != 1) bad = "found";
    else if (h.magic != want->header.magic || h.header_version != want->header.header_version) bad = "header.magic";
    else if (h.object_group != want->header.object_group) bad = "header.object_group";
    else if (h.dcp_rank != want->header.dcp_rank) bad = "header.dcp_rank";
    else if (h.payload_bytes != want->header.payload_bytes) bad = "header.payload_bytes";
    else if (pi >= pr->num_pools) bad = "pool";
    else if (off > pr->pools[pi].size || h.payload_bytes > pr->pools[pi].size - off) bad = "offset";
    if (bad) {
      if (refused++ == 0)
        KVF_WARN(SERVER, "peer %s: HAS_REPLY %llu: objects[%u] (chunk key %016llx..., object group %u): %s does not "
                 "match: not pulled", pr->addr, (unsigned long long)id, i, (unsigned long long)key_prefix(&want->key),
                 (unsigned)want->object_group, bad);
      continue;
    }
    specs[f->num_pulling] = *want;
    addr[f->num_pulling] = pr->pools[pi].base + off;
    pool[f->num_pulling] = pi;
    f->pulling[f->num_pulling++] = f->asked[i];
  }
  if (refused) {
    if (refused > 1) KVF_WARN(SERVER, "peer %s: HAS_REPLY %llu: %u objects refused in all", pr->addr, (unsigned long long)id, refused);
    count_failure(p, pr);
  }
  fetch_pull(p, f, pr, specs, addr, pool, slots);
out:
  free(specs);
  free(slots);
  free(addr);
  free(pool);
}

/* The pull from f->at is over (every get called back): commit or abort. */
static void fetch_finish_pull(kvf_peers *p, fetch *f) {
  peer *pr = f->at;
  if (f->res) {
    if (!f->get_failed) {
      kvf_l1_commit(p->opt.l1, f->res);
      for (uint32_t i = 0; i < f->num_pulling; i++) {
        f->have[f->pulling[i]] = 1;
        if (f->offer && f->result[f->pulling[i]] == 0) f->result[f->pulling[i]] = 1;
      }
      f->committed += f->num_pulling;
      pthread_mutex_lock(&p->mu);
      if (pr) {
        pr->info.objects_pulled += f->num_pulling;
        pr->info.bytes_pulled += f->pull_bytes;
      }
      p->counters.objects_pulled += f->num_pulling;
      pthread_mutex_unlock(&p->mu);
      KVF_INFO(SERVER, "peer %s: fetch %llu: %u objects, %llu bytes pulled and committed", pr ? pr->addr : "?",
               (unsigned long long)f->id, f->num_pulling, (unsigned long long)f->pull_bytes);
    } else {
      kvf_l1_abort(p->opt.l1, f->res);
      KVF_WARN(SERVER, "peer %s: fetch %llu: a pull failed: its %u objects were dropped, nothing committed",
               pr ? pr->addr : "(gone)", (unsigned long long)f->id, f->num_pulling);
      count_failure(p, pr);
    }
    f->res = NULL;
  }
  if (!f->offer && pr && pr->conn && !pr->doomed) fetch_release_remote(pr, f->id);
  free(f->pulling);
  f->pulling = NULL;
  f->num_pulling = 0;
  f->get_failed = 0;
  f->at = NULL;
  f->state = F_NEXT;
}

/* Ask the next ready peer for what f still lacks; 1 when asked. */
static int fetch_ask(kvf_peers *p, fetch *f) {
  peer *pr = p->peers;
  while (pr && !(pr->uid > f->last_uid && pr->state == KVF_PEER_READY && !pr->doomed)) pr = pr->next;
  if (!pr) return 0;
  f->last_uid = pr->uid;
  uint32_t cnt = 0;
  for (uint32_t i = 0; i < f->n; i++)
    if (!f->have[i]) f->asked[cnt++] = i;
  if (!cnt) return 0;
  f->num_asked = cnt;
  size_t len = PM_HDR + 8 + (size_t)cnt * PM_HAS_ENTRY;
  uint8_t *m = calloc(1, len);
  if (!m) return 0;
  hdr_fill(m, PM_HAS, (uint32_t)len, f->id);
  put32(m + PM_HDR, cnt);
  for (uint32_t i = 0; i < cnt; i++) {
    uint8_t *e = m + PM_HDR + 8 + (size_t)i * PM_HAS_ENTRY;
    memcpy(e, &f->specs[f->asked[i]].key, PM_KEY_BYTES);
    memcpy(e + PM_KEY_BYTES, &f->specs[f->asked[i]].header, PM_HEADER_BYTES);
  }
  peer_send(pr, m, len);
  free(m);
  f->at = pr;
  f->state = F_ASKED;
  f->deadline_ns = kvf_now_ns() + (uint64_t)p->opt.fetch_timeout_ms * 1000000ull;
  return 1;
}

static void fetch_free(fetch *f) {
  free(f->result);
  free(f->specs);
  free(f->have);
  free(f->asked);
  free(f->pulling);
  free(f);
}

static void offer_answer(kvf_peers *p, fetch *f);

/* Move the fetches posted by kvf_peers_fetch into the thread's list. */
static void fetches_take_incoming(kvf_peers *p) {
  pthread_mutex_lock(&p->mu);
  fetch *in = p->incoming;
  p->incoming = NULL;
  pthread_mutex_unlock(&p->mu);
  while (in) {
    fetch *f = in;
    in = in->next;
    f->next = p->fetches;
    p->fetches = f;
  }
}
static void push_finish(kvf_peers *p, struct push_job *j, kvf_status st, const char *why);

/* Advance every fetch; finished ones call back and go. */
static void fetches_step(kvf_peers *p) {
  uint64_t now = kvf_now_ns();
  for (fetch **fp = &p->fetches; *fp;) {
    fetch *f = *fp;
    if (f->state == F_ASKED && (!f->at || !f->at->conn || f->at->doomed || now > f->deadline_ns)) {
      if (f->at && now > f->deadline_ns) {
        count_failure(p, f->at);
        peer_doom(f->at, "fetch %llu: no answer to HAS in %u ms", (unsigned long long)f->id, p->opt.fetch_timeout_ms);
      }
      f->at = NULL;
      f->state = F_NEXT;
    }
    if (f->state == F_PULLING && f->gets_out && now > f->deadline_ns && f->at && !f->at->doomed) {
      /* Closing the connection fails the gets (their callbacks run in the close). */
      count_failure(p, f->at);
      peer_doom(f->at, "fetch %llu: the pull made no progress in %u ms", (unsigned long long)f->id,
                p->opt.fetch_timeout_ms);
    }
    if (f->state == F_PULLING && f->gets_out == 0) fetch_finish_pull(p, f);
    if (f->state == F_NEXT && f->offer) {
      offer_answer(p, f);
      *fp = f->next;
      fetch_free(f);
      continue;
    }
    if (f->state == F_NEXT && (f->mismatch != KVF_SUCCESS || !fetch_ask(p, f))) {
      /* Nobody else to ask: done. */
      *fp = f->next;
      pthread_mutex_lock(&p->mu);
      p->counters.fetches_in_flight--;
      pthread_mutex_unlock(&p->mu);
      f->done(f->arg, f->committed, f->mismatch_spec, f->mismatch, f->mismatch_msg);
      fetch_free(f);
      continue;
    }
    fp = &f->next;
  }
}

/* Forget pr in every fetch (pr is closed: its gets have called back). */
static void fetches_forget(kvf_peers *p, peer *pr) {
  for (fetch *f = p->fetches; f; f = f->next)
    if (f->at == pr) {
      f->at = NULL;
      if (f->state == F_ASKED) f->state = F_NEXT;
      if (f->state == F_PULLING && f->gets_out) f->get_failed = 1;
    }
}

/* ---- pushes: OFFER (receiver) ------------------------------------------------- */

/* Tell the peer that offered f what became of each object. */
static void offer_answer(kvf_peers *p, fetch *f) {
  peer *pr = p->peers;
  while (pr && pr->uid != f->offer_uid) pr = pr->next;
  uint32_t committed = 0;
  for (uint32_t i = 0; i < f->n; i++) committed += f->result[i] == 1;
  KVF_INFO(SERVER, "peer %s: offer %llu: %u of %u objects committed", pr ? pr->addr : "(gone)",
           (unsigned long long)f->id, committed, f->n);
  pthread_mutex_lock(&p->mu);
  p->counters.offers_in_flight--;
  pthread_mutex_unlock(&p->mu);
  if (!pr || !pr->conn || pr->doomed) return;
  size_t len = PM_HDR + 8 + f->n;
  uint8_t *m = calloc(1, len);
  if (!m) return peer_doom(pr, "OFFER_DONE: out of memory");
  hdr_fill(m, PM_OFFER_DONE, (uint32_t)len, f->id);
  put32(m + PM_HDR, f->n);
  memcpy(m + PM_HDR + 8, f->result, f->n);
  peer_send(pr, m, len);
  free(m);
}

/* The field of an offered object's header that cannot be right, or NULL. */
static const char *offer_header_bad(const kvf_peers *p, const peer *pr, const kvf_l1_key *key,
                                    const kvf_object_header *h, uint32_t pool, uint64_t off) {
  static const kvf_chunk_key zero;
  if (memcmp(&key->chunk, &zero, sizeof(zero)) == 0) return "key.chunk";
  if (key->shard_count == 0 || key->shard_index >= key->shard_count) return "key.shard_index";
  if (h->magic != KVF_OBJECT_MAGIC || h->header_version != 1) return "header.magic";
  if (h->format > KVF_FORMAT_NATIVE) return "header.format";
  if (h->object_group >= KVF_MAX_GROUPS) return "header.object_group";
  if (h->format == KVF_FORMAT_CANONICAL && h->fingerprint != key->fingerprint) return "header.fingerprint";
  if (h->token_end <= h->token_begin) return "header.token_end";
  if (h->payload_bytes == 0) return "header.payload_bytes";
  (void)p;
  if (pool >= pr->num_pools) return "pool";
  if (off > pr->pools[pool].size || h->payload_bytes > pr->pools[pool].size - off) return "offset";
  return NULL;
}

/* A peer pushes objects: check each, skip what is held here, pull the rest
 * into a reservation and commit them whole (the fetch's rules), then answer
 * OFFER_DONE. */
static void on_offer(kvf_peers *p, peer *pr, uint64_t id, const uint8_t *b, size_t n) {
  if (n < 8) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER: truncated");
  uint32_t cnt = get32(b);
  if (cnt == 0 || cnt > KVF_PEERS_MAX_OBJECTS)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER: n %u (1..%u)", cnt, KVF_PEERS_MAX_OBJECTS);
  if (n != 8 + (size_t)cnt * PM_OFFER_ENTRY)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER: %zu payload bytes for %u objects", n, cnt);
  uint32_t open = 0;
  for (fetch *g = p->fetches; g; g = g->next)
    if (g->offer && g->offer_uid == pr->uid) {
      if (g->id == id) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER: id %llu repeated", (unsigned long long)id);
      open++;
    }
  fetch *f = calloc(1, sizeof(*f));
  kvf_l1_query *q = calloc(cnt, sizeof(*q));
  kvf_l1_found *fd = calloc(cnt, sizeof(*fd));
  kvf_l1_object_spec *specs = calloc(cnt, sizeof(*specs));
  kvf_l1_slot *slots = calloc(cnt, sizeof(*slots));
  uint64_t *addr = calloc(cnt, sizeof(*addr));
  uint32_t *pool = calloc(cnt, sizeof(*pool));
  kvf_l1_pin *pin = NULL;
  if (f) {
    f->specs = calloc(cnt, sizeof(*f->specs));
    f->have = calloc(cnt, 1);
    f->result = calloc(cnt, 1);
    f->pulling = calloc(cnt, sizeof(*f->pulling));
  }
  if (!f || !q || !fd || !specs || !slots || !addr || !pool || !f->specs || !f->have || !f->result || !f->pulling) {
    if (f) fetch_free(f);
    f = NULL;
    peer_doom(pr, "OFFER: out of memory");
    goto out;
  }
  f->offer = 1;
  f->offer_uid = pr->uid;
  f->id = id;
  f->n = cnt;
  f->at = pr;
  f->timeout_ns = (uint64_t)p->opt.fetch_timeout_ms * 1000000ull;
  f->state = F_PULLING;
  f->deadline_ns = kvf_now_ns() + f->timeout_ns;
  /* The pool named like the offering side's, else this side's first. */
  f->device = p->pools[0].device;
  uint32_t refused = 0;
  for (uint32_t i = 0; i < cnt; i++) {
    const uint8_t *e = b + 8 + (size_t)i * PM_OFFER_ENTRY;
    memcpy(&f->specs[i].key, e, PM_KEY_BYTES);
    memcpy(&f->specs[i].header, e + PM_KEY_BYTES, PM_HEADER_BYTES);
    f->specs[i].object_group = f->specs[i].header.object_group;
    uint32_t pi = get32(e + PM_KEY_BYTES + PM_HEADER_BYTES);
    uint64_t off = get64(e + PM_KEY_BYTES + PM_HEADER_BYTES + 8);
    const char *bad = offer_header_bad(p, pr, &f->specs[i].key, &f->specs[i].header, pi, off);
    if (bad) {
      if (refused++ == 0)
        KVF_WARN(SERVER, "peer %s: OFFER %llu: objects[%u] (chunk key %016llx...): %s is not valid: refused", pr->addr,
                 (unsigned long long)id, i, (unsigned long long)key_prefix(&f->specs[i].key), bad);
      f->have[i] = 2; /* refused: result 0 */
      continue;
    }
    if (i == 0)
      for (uint32_t k = 0; k < p->num_pools; k++)
        if (p->pools[k].device == pr->pools[pi].device) f->device = p->pools[k].device;
    q[i] = (kvf_l1_query){f->specs[i].key, f->specs[i].object_group};
    addr[i] = pr->pools[pi].base + off;
    pool[i] = pi;
  }
  if (refused) {
    if (refused > 1) KVF_WARN(SERVER, "peer %s: OFFER %llu: %u objects refused in all", pr->addr, (unsigned long long)id, refused);
    count_failure(p, pr);
  }
  if (open >= PM_MAX_OFFERS_PER_PEER) {
    KVF_WARN(SERVER, "peer %s: OFFER %llu refused: %u of its offers are being pulled already (at most %u)", pr->addr,
             (unsigned long long)id, open, PM_MAX_OFFERS_PER_PEER);
    count_failure(p, pr);
    memset(f->have, 2, cnt);
  }
  /* What L1 holds already: the same object is "held", another header refused. */
  uint32_t nq = 0;
  for (uint32_t i = 0; i < cnt; i++)
    if (!f->have[i]) q[nq++] = q[i];
  if (nq && kvf_l1_lookup_pin(p->opt.l1, q, nq, fd, &pin) != KVF_SUCCESS) {
    fetch_free(f);
    f = NULL;
    peer_refuse(p, pr, KVF_ERR_INTERNAL, "OFFER: lookup: %s", kvf_last_error());
    goto out;
  }
  kvf_l1_unpin(p->opt.l1, pin);
  pin = NULL;
  uint32_t k = 0, np = 0;
  for (uint32_t i = 0; i < cnt; i++) {
    if (f->have[i]) continue;
    const kvf_l1_found *h = &fd[k++];
    if (h->found) {
      if (memcmp(&h->header, &f->specs[i].header, sizeof(h->header)) == 0) {
        f->result[i] = 2;
      } else {
        KVF_WARN(SERVER, "peer %s: OFFER %llu: objects[%u] (chunk key %016llx...): held here with another header: "
                 "refused", pr->addr, (unsigned long long)id, i, (unsigned long long)key_prefix(&f->specs[i].key));
        count_failure(p, pr);
      }
      continue;
    }
    specs[np] = f->specs[i];
    addr[np] = addr[i];
    pool[np] = pool[i];
    f->pulling[np++] = i;
  }
  f->num_pulling = np;
  pthread_mutex_lock(&p->mu);
  p->counters.offers_in_flight++;
  pthread_mutex_unlock(&p->mu);
  fetch_pull(p, f, pr, specs, addr, pool, slots); /* nothing pulled: answered at the next step */
  f->next = p->fetches;
  p->fetches = f;
  f = NULL;
out:
  free(q);
  free(fd);
  free(specs);
  free(slots);
  free(addr);
  free(pool);
}

/* ---- pushes: the sending side ------------------------------------------------ */

static void push_finish(kvf_peers *p, push_job *j, kvf_status st, const char *why) {
  kvf_l1_unpin(p->opt.l1, j->pin);
  j->pin = NULL;
  pthread_mutex_lock(&p->mu);
  p->counters.pushes_in_flight--;
  pthread_mutex_unlock(&p->mu);
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < j->num_offered; i++)
    if (j->result[j->offered[i]] == KVF_PEERS_PUSH_COPIED) bytes += j->specs[j->offered[i]].header.payload_bytes;
  j->done(j->arg, j->result, j->n, bytes, st, why);
  free(j->specs);
  free(j->result);
  free(j->offered);
  free(j);
}

/* The ready peer `name` names: its --peer address, or its boot token. */
static peer *peer_by_name(kvf_peers *p, const char *name) {
  char *end = NULL;
  unsigned long long boot = strlen(name) == 16 ? strtoull(name, &end, 16) : 0;
  if (end && *end) boot = 0;
  for (peer *pr = p->peers; pr; pr = pr->next) {
    if (pr->state != KVF_PEER_READY || pr->doomed) continue;
    if ((pr->outgoing && strcmp(pr->addr, name) == 0) || (boot && pr->boot_token == boot)) return pr;
  }
  return NULL;
}

/* Pin what j names, offer it to its peer. 0: j is finished (and freed). */
static int push_start(kvf_peers *p, push_job *j) {
  peer *pr = peer_by_name(p, j->peer_name);
  if (!pr) {
    char names[512] = "";
    size_t used = 0;
    for (peer *q = p->peers; q && used < sizeof(names) - 80; q = q->next)
      used += (size_t)snprintf(names + used, sizeof(names) - used, "%s%s %016llx (%s)", used ? ", " : "",
                               q->outgoing ? q->addr : "incoming", (unsigned long long)q->boot_token,
                               q->state == KVF_PEER_READY ? "ready" : "not ready");
    char why[768];
    snprintf(why, sizeof(why), "payload.peer: no ready peer is named '%s' (its --peer ADDR:PORT or its boot token); "
             "peers: %s", j->peer_name, used ? names : "none");
    push_finish(p, j, KVF_ERR_NOT_FOUND, why);
    return 0;
  }
  kvf_l1_query *q = calloc(j->n, sizeof(*q));
  kvf_l1_found *fd = calloc(j->n, sizeof(*fd));
  if (!q || !fd) {
    free(q);
    free(fd);
    push_finish(p, j, KVF_ERR_OUT_OF_MEMORY, "push: out of memory");
    return 0;
  }
  for (uint32_t i = 0; i < j->n; i++) q[i] = (kvf_l1_query){j->specs[i].key, j->specs[i].object_group};
  if (kvf_l1_lookup_pin(p->opt.l1, q, j->n, fd, &j->pin) != KVF_SUCCESS) {
    free(q);
    free(fd);
    push_finish(p, j, KVF_ERR_INTERNAL, kvf_last_error());
    return 0;
  }
  size_t len = PM_HDR + 8;
  uint8_t *m = calloc(1, len + (size_t)j->n * PM_OFFER_ENTRY);
  if (!m) {
    free(q);
    free(fd);
    push_finish(p, j, KVF_ERR_OUT_OF_MEMORY, "push: out of memory");
    return 0;
  }
  for (uint32_t i = 0; i < j->n; i++) {
    const kvf_object_header *want = &j->specs[i].header, *h = &fd[i].header;
    /* Only the object this registration would read: the same header. */
    if (!fd[i].found || memcmp(h, want, sizeof(*h)) != 0) {
      j->result[i] = KVF_PEERS_PUSH_MISSING;
      continue;
    }
    uint32_t pool = UINT32_MAX;
    for (uint32_t k = 0; k < p->num_pools; k++) {
      uintptr_t base = (uintptr_t)p->pools[k].base, d = (uintptr_t)fd[i].data;
      if (d >= base && d - base < p->pools[k].size) pool = k;
    }
    if (pool == UINT32_MAX) {
      j->result[i] = KVF_PEERS_PUSH_MISSING;
      continue;
    }
    uint8_t *e = m + len;
    memcpy(e, &j->specs[i].key, PM_KEY_BYTES);
    memcpy(e + PM_KEY_BYTES, h, PM_HEADER_BYTES);
    put32(e + PM_KEY_BYTES + PM_HEADER_BYTES, pool);
    put64(e + PM_KEY_BYTES + PM_HEADER_BYTES + 8, (uint64_t)((uintptr_t)fd[i].data - (uintptr_t)p->pools[pool].base));
    len += PM_OFFER_ENTRY;
    j->offered[j->num_offered++] = i;
    j->bytes += h->payload_bytes;
  }
  free(q);
  free(fd);
  if (j->num_offered == 0) {
    free(m);
    push_finish(p, j, KVF_SUCCESS, "");
    return 0;
  }
  hdr_fill(m, PM_OFFER, (uint32_t)len, j->id);
  put32(m + PM_HDR, j->num_offered);
  peer_send(pr, m, len);
  free(m);
  j->at_uid = pr->uid;
  j->at_connects = pr->info.connects;
  /* The peer pulls at its own pace; a push that outlives this was lost. */
  j->deadline_ns = kvf_now_ns() + ((uint64_t)p->opt.fetch_timeout_ms + j->bytes / PM_PUSH_BYTES_PER_MS) * 1000000ull;
  KVF_INFO(SERVER, "peer %s: push %llu: %u objects (%llu bytes) offered", pr->addr, (unsigned long long)j->id,
           j->num_offered, (unsigned long long)j->bytes);
  return 1;
}

static void on_offer_done(kvf_peers *p, peer *pr, uint64_t id, const uint8_t *b, size_t n) {
  push_job **jp = &p->pushes;
  while (*jp && !((*jp)->id == id && (*jp)->at_uid == pr->uid)) jp = &(*jp)->next;
  if (!*jp) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER_DONE: id %llu answers no OFFER", (unsigned long long)id);
  push_job *j = *jp;
  if (n < 8 || get32(b) != j->num_offered || n != 8 + (size_t)j->num_offered)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER_DONE: %zu payload bytes, %u objects offered", n, j->num_offered);
  for (uint32_t i = 0; i < j->num_offered; i++) {
    uint8_t r = b[8 + i];
    if (r > 2) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "OFFER_DONE: objects[%u]: result %u (0..2)", i, r);
    j->result[j->offered[i]] = r == 1 ? KVF_PEERS_PUSH_COPIED : r == 2 ? KVF_PEERS_PUSH_PRESENT : KVF_PEERS_PUSH_FAILED;
  }
  uint64_t copied = 0, bytes = 0;
  for (uint32_t i = 0; i < j->num_offered; i++)
    if (j->result[j->offered[i]] == KVF_PEERS_PUSH_COPIED) {
      copied++;
      bytes += j->specs[j->offered[i]].header.payload_bytes;
    }
  pthread_mutex_lock(&p->mu);
  pr->info.objects_pushed += copied;
  pr->info.bytes_pushed += bytes;
  pthread_mutex_unlock(&p->mu);
  *jp = j->next;
  push_finish(p, j, KVF_SUCCESS, "");
}

/* The pushes posted by kvf_peers_push, oldest first (posting prepends). */
static push_job *pushes_take_incoming(kvf_peers *p) {
  pthread_mutex_lock(&p->mu);
  push_job *in = p->push_incoming;
  p->push_incoming = NULL;
  pthread_mutex_unlock(&p->mu);
  push_job *rev = NULL;
  while (in) {
    push_job *j = in;
    in = in->next;
    j->next = rev;
    rev = j;
  }
  return rev;
}

/* Start new pushes; fail those whose peer went or that ran out of time. */
static void pushes_step(kvf_peers *p) {
  push_job *rev = pushes_take_incoming(p);
  while (rev) {
    push_job *j = rev;
    rev = rev->next;
    if (push_start(p, j)) {
      j->next = p->pushes;
      p->pushes = j;
    }
  }
  uint64_t now = kvf_now_ns();
  for (push_job **jp = &p->pushes; *jp;) {
    push_job *j = *jp;
    peer *pr = p->peers;
    while (pr && pr->uid != j->at_uid) pr = pr->next;
    int gone = !pr || !pr->conn || pr->doomed || pr->state != KVF_PEER_READY || pr->info.connects != j->at_connects;
    if (!gone && now <= j->deadline_ns) {
      jp = &j->next;
      continue;
    }
    if (!gone) {
      /* Its pulls may still be reading the pinned objects: closing the
       * connection ends them before the pins go (at the next turn). */
      count_failure(p, pr);
      peer_doom(pr, "push %llu: no OFFER_DONE in time", (unsigned long long)j->id);
      jp = &j->next;
      continue;
    }
    *jp = j->next;
    for (uint32_t i = 0; i < j->num_offered; i++) j->result[j->offered[i]] = KVF_PEERS_PUSH_FAILED;
    push_finish(p, j, KVF_ERR_DISCONNECTED, "the peer was lost before it answered the push");
  }
}

/* ---- the transport's callbacks (peer thread) ------------------------------------ */

static void cb_accept(void *ctx, kvf_pt_conn *c) {
  kvf_peers *p = ctx;
  uint32_t incoming = 0;
  for (peer *pr = p->peers; pr; pr = pr->next) incoming += !pr->outgoing;
  peer *pr = peer_new(p, "incoming", 0);
  if (!pr) {
    KVF_WARN(SERVER, "peers: an incoming peer left unanswered: out of memory");
    return;
  }
  pr->conn = c;
  kvf_pt_conn_set_user(c, pr);
  pr->deadline_ns = kvf_now_ns() + (uint64_t)p->opt.handshake_timeout_ms * 1000000ull;
  peer_set_state(p, pr, KVF_PEER_HANDSHAKE);
  if (incoming >= KVF_PEERS_MAX) {
    count_failure(p, pr);
    peer_doom(pr, "refused: %u incoming peers connected already", incoming);
    return;
  }
  send_hello(p, pr);
}

static void cb_message(void *ctx, kvf_pt_conn *c, const void *data, size_t len) {
  kvf_peers *p = ctx;
  peer *pr = kvf_pt_conn_user(c);
  if (!pr || pr->doomed) return;
  const uint8_t *m = data;
  if (len < PM_HDR) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "a message of %zu bytes (the header is %u)", len, PM_HDR);
  if (len > KVF_PT_MAX_MESSAGE)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "a message of %zu bytes (at most %u)", len, KVF_PT_MAX_MESSAGE);
  uint16_t type, version;
  memcpy(&type, m + 4, 2);
  memcpy(&version, m + 6, 2);
  if (get32(m) != PM_MAGIC) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "header.magic: %08x", get32(m));
  if (version != PM_VERSION) return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "header.version: %u (this side speaks %u)", version, PM_VERSION);
  if (get32(m + 8) != len)
    return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "header.length: %u, the message has %zu bytes", get32(m + 8), len);
  uint64_t id = get64(m + 16);
  const uint8_t *b = m + PM_HDR;
  size_t n = len - PM_HDR;
  if (type == PM_ERROR) {
    char text[200];
    size_t tl = n > 4 ? n - 4 : 0;
    if (tl >= sizeof(text)) tl = sizeof(text) - 1;
    for (size_t i = 0; i < tl; i++) text[i] = (b[4 + i] >= 32 && b[4 + i] < 127) ? (char)b[4 + i] : '?';
    text[tl] = 0;
    count_failure(p, pr);
    return peer_doom(pr, "the peer refused us: %s", text);
  }
  if (type == PM_HELLO) return on_hello(p, pr, b, n);
  if (type == PM_AUTH) return on_auth(p, pr, b, n);
  if (!pr->verified) return peer_refuse(p, pr, KVF_ERR_PERMISSION, "%s before authentication", pm_name(type));
  switch (type) {
    case PM_KEYS: return on_keys(p, pr, b, n);
    case PM_HAS: return on_has(p, pr, id, b, n);
    case PM_HAS_REPLY: return on_has_reply(p, pr, id, b, n);
    case PM_RELEASE: return on_release(p, pr, id, n);
    case PM_OFFER: return on_offer(p, pr, id, b, n);
    case PM_OFFER_DONE: return on_offer_done(p, pr, id, b, n);
    default: return peer_refuse(p, pr, KVF_ERR_PROTOCOL, "header.type: %u is not a peer message", type);
  }
}

static void cb_error(void *ctx, kvf_pt_conn *c, kvf_status st, const char *why) {
  (void)ctx;
  (void)st;
  peer *pr = kvf_pt_conn_user(c);
  if (pr) peer_doom(pr, "%s", why);
}

/* ---- the peer thread --------------------------------------------------------------- */

static void peers_turn(kvf_peers *p) {
  uint64_t now = kvf_now_ns();
  fetches_take_incoming(p);
  for (peer *pr = p->peers; pr; pr = pr->next) {
    if (pr->state == KVF_PEER_HANDSHAKE && !pr->got_keys && now > pr->deadline_ns) {
      count_failure(p, pr);
      peer_doom(pr, "not authenticated within %u ms", p->opt.handshake_timeout_ms);
    }
    if (pr->state == KVF_PEER_HANDSHAKE && pr->got_keys && pr->verified) peer_set_state(p, pr, KVF_PEER_READY);
    for (serve_pin **pp = &pr->pins; *pp;) {
      serve_pin *sp = *pp;
      if (now > sp->deadline_ns) {
        *pp = sp->next;
        kvf_l1_unpin(p->opt.l1, sp->pin);
        free(sp);
        pthread_mutex_lock(&p->mu);
        p->counters.serve_pins--;
        pthread_mutex_unlock(&p->mu);
      } else {
        pp = &sp->next;
      }
    }
  }
  /* Doomed connections close here, outside every callback. */
  for (peer *pr = p->peers, *next; pr; pr = next) {
    next = pr->next;
    if (!pr->doomed) continue;
    peer_close(p, pr); /* in-flight gets call back with errors in here */
    fetches_forget(p, pr);
    if (!pr->outgoing) peer_free(p, pr);
  }
  /* Outgoing peers that are down: (re)connect. */
  for (peer *pr = p->peers; pr; pr = pr->next) {
    if (!pr->outgoing || pr->conn || now < pr->retry_ns) continue;
    if (kvf_pt_connect(p->t, pr->addr, &pr->conn) != KVF_SUCCESS) {
      KVF_INFO(SERVER, "peer %s: %s", pr->addr, kvf_last_error());
      pr->conn = NULL;
      pr->retry_ns = now + (uint64_t)PM_RETRY_MS * 1000000ull;
      continue;
    }
    kvf_pt_conn_set_user(pr->conn, pr);
    pr->deadline_ns = now + (uint64_t)p->opt.handshake_timeout_ms * 1000000ull;
    peer_set_state(p, pr, KVF_PEER_HANDSHAKE);
    send_hello(p, pr);
  }
  fetches_step(p);
  pushes_step(p);
}

static void *peers_thread(void *arg) {
  kvf_peers *p = arg;
  while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
    kvf_pt_progress(p->t);
    peers_turn(p);
    if (!kvf_pt_progress(p->t)) kvf_pt_wait(p->t, 20);
  }
  return NULL;
}

/* ---- create / destroy ------------------------------------------------------------ */

static kvf_status read_secret(kvf_peers *p, const char *path) {
  if (!path) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer-secret-file: required with --listen or --peer");
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return kvf_fail(errno == ENOENT ? KVF_ERR_NOT_FOUND : KVF_ERR_PERMISSION, "--peer-secret-file %s: %s", path, strerror(errno));
  struct stat sb;
  kvf_status st = KVF_SUCCESS;
  if (fstat(fd, &sb) != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "--peer-secret-file %s: fstat: %s", path, strerror(errno));
  } else if (!S_ISREG(sb.st_mode)) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer-secret-file %s: not a regular file", path);
  } else if (sb.st_uid != geteuid()) {
    st = kvf_fail(KVF_ERR_PERMISSION, "--peer-secret-file %s: owned by uid %u, not by this user (%u)", path,
                  (unsigned)sb.st_uid, (unsigned)geteuid());
  } else if (sb.st_mode & 077) {
    st = kvf_fail(KVF_ERR_PERMISSION, "--peer-secret-file %s: mode %03o lets group or others read it; it must be 0600",
                  path, (unsigned)(sb.st_mode & 0777));
  } else {
    ssize_t n = read(fd, p->secret, sizeof(p->secret));
    uint8_t extra;
    if (n < 0) {
      st = kvf_fail(KVF_ERR_SYSTEM, "--peer-secret-file %s: read: %s", path, strerror(errno));
    } else if ((size_t)n == sizeof(p->secret) && read(fd, &extra, 1) > 0) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer-secret-file %s: longer than %zu bytes", path, sizeof(p->secret));
    } else {
      while (n > 0 && (p->secret[n - 1] == '\n' || p->secret[n - 1] == '\r')) n--;
      if (n < 16)
        st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer-secret-file %s: %zd bytes; at least 16 (e.g. head -c 32 "
                      "/dev/urandom | base64)", path, n);
      p->secret_len = (size_t)n;
    }
  }
  close(fd);
  return st;
}

kvf_status kvf_peers_create(const kvf_peers_options *opt, kvf_peers **out) {
  if (!opt || !out || !opt->l1 || !opt->pools || !opt->num_pools || !opt->boot_token)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_peers_create: NULL argument");
  *out = NULL;
  if (opt->num_peers > KVF_PEERS_MAX)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer: at most %u peers", KVF_PEERS_MAX);
  if (opt->num_pools > PM_MAX_POOLS) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_peers_create: too many pools");
  kvf_peers *p = calloc(1, sizeof(*p));
  if (!p) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
  pthread_mutex_init(&p->mu, NULL);
  p->opt = *opt;
  if (!p->opt.fetch_timeout_ms) p->opt.fetch_timeout_ms = 5000;
  if (!p->opt.handshake_timeout_ms) p->opt.handshake_timeout_ms = 5000;
  kvf_status st = read_secret(p, opt->secret_file);
  if (st != KVF_SUCCESS) goto fail;
  kvf_pt_callbacks cb = {p, cb_accept, cb_message, cb_error};
  st = kvf_pt_create(opt->transport_context, &cb, &p->t);
  if (st != KVF_SUCCESS) goto fail;
  p->num_pools = opt->num_pools;
  for (uint32_t i = 0; i < opt->num_pools; i++) {
    p->pools[i] = opt->pools[i];
    st = kvf_pt_mem_register(p->t, opt->pools[i].base, (size_t)opt->pools[i].size, &p->mems[i]);
    if (st != KVF_SUCCESS) goto fail;
  }
  if (opt->listen) {
    st = kvf_pt_listen(p->t, opt->listen, &p->port);
    if (st != KVF_SUCCESS) goto fail;
    KVF_WARN(SERVER, "peers: listening on %s (port %u)", opt->listen, (unsigned)p->port);
  }
  for (uint32_t i = 0; i < opt->num_peers; i++) {
    if (!peer_new(p, opt->peers[i], 1)) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
      goto fail;
    }
  }
  p->opt.peers = NULL;
  p->opt.listen = NULL;
  p->opt.secret_file = NULL;
  p->opt.pools = NULL;
  int rc = pthread_create(&p->thread, NULL, peers_thread, p);
  if (rc != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "peers: thread: %s", strerror(rc));
    goto fail;
  }
  p->thread_started = 1;
  *out = p;
  return KVF_SUCCESS;
fail:
  kvf_peers_destroy(p);
  return st;
}

void kvf_peers_destroy(kvf_peers *p) {
  if (!p) return;
  __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
  if (p->thread_started) {
    kvf_pt_signal(p->t);
    pthread_join(p->thread, NULL);
  }
  /* Close every connection first: gets in flight call back with errors. */
  for (peer *pr = p->peers; pr; pr = pr->next) {
    if (pr->conn) peer_doom(pr, "the server is stopping");
    peer_close(p, pr);
    fetches_forget(p, pr);
  }
  fetches_take_incoming(p);
  while (p->fetches) {
    fetch *f = p->fetches;
    p->fetches = f->next;
    if (f->res) kvf_l1_abort(p->opt.l1, f->res);
    if (f->done) f->done(f->arg, f->committed, f->mismatch_spec, f->mismatch, f->mismatch_msg);
    fetch_free(f);
  }
  for (push_job *j = pushes_take_incoming(p), *next; j; j = next) {
    next = j->next;
    push_finish(p, j, KVF_ERR_STATE, "the server is stopping");
  }
  while (p->pushes) {
    push_job *j = p->pushes;
    p->pushes = j->next;
    push_finish(p, j, KVF_ERR_STATE, "the server is stopping");
  }
  while (p->peers) peer_free(p, p->peers);
  for (uint32_t i = 0; i < p->num_pools; i++) kvf_pt_mem_deregister(p->mems[i]);
  kvf_pt_destroy(p->t);
  OPENSSL_cleanse(p->secret, sizeof(p->secret));
  pthread_mutex_destroy(&p->mu);
  free(p);
}

uint16_t kvf_peers_port(const kvf_peers *p) { return p ? p->port : 0; }

uint32_t kvf_peers_ready(kvf_peers *p) {
  if (!p) return 0;
  uint32_t n = 0;
  pthread_mutex_lock(&p->mu);
  for (peer *pr = p->peers; pr; pr = pr->next) n += pr->info.state == KVF_PEER_READY;
  pthread_mutex_unlock(&p->mu);
  return n;
}

kvf_status kvf_peers_fetch(kvf_peers *p, int device, const kvf_l1_object_spec *specs, uint32_t n,
                           kvf_peers_fetch_done done, void *arg) {
  if (!p || !specs || !done || n == 0 || n > KVF_PEERS_MAX_OBJECTS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_peers_fetch: %u objects (1..%u)", n, KVF_PEERS_MAX_OBJECTS);
  if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return kvf_fail(KVF_ERR_STATE, "peers: stopping");
  fetch *f = calloc(1, sizeof(*f));
  if (!f) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
  f->specs = malloc((size_t)n * sizeof(*specs));
  f->have = calloc(n, 1);
  f->asked = calloc(n, sizeof(*f->asked));
  if (!f->specs || !f->have || !f->asked) {
    fetch_free(f);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
  }
  memcpy(f->specs, specs, (size_t)n * sizeof(*specs));
  f->n = n;
  f->timeout_ns = (uint64_t)p->opt.fetch_timeout_ms * 1000000ull;
  f->device = device;
  f->done = done;
  f->arg = arg;
  pthread_mutex_lock(&p->mu);
  f->id = ++p->next_fetch_id;
  f->next = p->incoming;
  p->incoming = f;
  p->counters.fetches_in_flight++;
  p->counters.fetches_total++;
  pthread_mutex_unlock(&p->mu);
  kvf_pt_signal(p->t);
  return KVF_SUCCESS;
}

kvf_status kvf_peers_push(kvf_peers *p, const char *peer_name, const kvf_l1_object_spec *specs, uint32_t n,
                          kvf_peers_push_done done, void *arg) {
  if (!p || !peer_name || !specs || !done || n == 0 || n > KVF_PEERS_MAX_OBJECTS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_peers_push: %u objects (1..%u)", n, KVF_PEERS_MAX_OBJECTS);
  push_job *j = calloc(1, sizeof(*j));
  if (!j) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
  if (strlen(peer_name) >= sizeof(j->peer_name)) {
    free(j);
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "peer: longer than %zu bytes", sizeof(j->peer_name) - 1);
  }
  if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
    free(j);
    return kvf_fail(KVF_ERR_STATE, "peers: stopping");
  }
  snprintf(j->peer_name, sizeof(j->peer_name), "%s", peer_name);
  j->specs = malloc((size_t)n * sizeof(*specs));
  j->result = calloc(n, 1);
  j->offered = calloc(n, sizeof(*j->offered));
  if (!j->specs || !j->result || !j->offered) {
    free(j->specs);
    free(j->result);
    free(j->offered);
    free(j);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peers: out of memory");
  }
  memcpy(j->specs, specs, (size_t)n * sizeof(*specs));
  j->n = n;
  j->done = done;
  j->arg = arg;
  pthread_mutex_lock(&p->mu);
  j->id = ++p->next_push_id;
  j->next = p->push_incoming;
  p->push_incoming = j;
  p->counters.pushes_in_flight++;
  pthread_mutex_unlock(&p->mu);
  kvf_pt_signal(p->t);
  return KVF_SUCCESS;
}

uint32_t kvf_peers_info(kvf_peers *p, kvf_peer_info *out, uint32_t max) {
  if (!p) return 0;
  uint32_t n = 0;
  pthread_mutex_lock(&p->mu);
  for (peer *pr = p->peers; pr; pr = pr->next, n++)
    if (out && n < max) out[n] = pr->info;
  pthread_mutex_unlock(&p->mu);
  return n;
}

void kvf_peers_counters_get(kvf_peers *p, kvf_peers_counters *out) {
  memset(out, 0, sizeof(*out));
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  *out = p->counters;
  pthread_mutex_unlock(&p->mu);
}
