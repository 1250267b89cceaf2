/*
 * The L1 object store (host/l1.h): objects carved out of caller-owned pools,
 * an index by (key, object group), LRU eviction of whole entries.
 *
 * Allocator. Each pool is the byte range [0, size) (size rounded down to
 * KVF_L1_ALIGN) at the pool's base. Every object takes one extent of its
 * payload rounded up to KVF_L1_ALIGN, so every extent offset and length is
 * aligned. The free extents of a pool live in one array sorted by offset;
 * neighbours are always merged (a freed extent coalesces with the free
 * extents just before and after it), so no two free extents touch.
 * Allocation is first fit from the front of the first extent large enough:
 * O(free extents). A pool never has more free extents than live extents + 1
 * (free extents are the gaps between live ones), and reserve grows the free
 * array to that bound *before* it allocates, so freeing (abort, eviction)
 * never allocates memory and cannot fail.
 *
 * Eviction. A reservation first tries its extents (in spec order, first fit)
 * on a copy of the pool's free list. If they do not fit, it simulates
 * eviction on that copy: it walks the LRU list from the least recently used
 * entry, takes each evictable entry (holds an object in the pool, no
 * reserved or pinned object, not named by this call's specs), adds its
 * extents in the pool to the copy, and retries until everything fits. Only
 * when the simulation fits are the same entries evicted for real (one more
 * walk over the same list, under the same lock), so a refused reservation
 * evicts nothing. Fitting is about contiguous extents, which the
 * simulation's trial allocation decides exactly.
 *
 * Index. An open-addressing hash table (linear probing, backward-shift
 * deletion, load <= 1/2) from key (kvf_l1_key) to entry. Clients choose
 * chunk keys (an engine may send its own block hashes), so a key's home slot
 * is a hash of the whole key under a secret drawn at create: a client cannot
 * aim many keys at one probe run. An entry holds its objects
 * in a short singly linked list (one per object group present) and sits in
 * one doubly linked LRU list, most recently used at the head.
 *
 * Locking: one mutex (l1->lock) guards every field below except the fixed
 * pool descriptions (device, base, size), which never change after create.
 * Bytes are never copied under it.
 */
#define _GNU_SOURCE
#include "host/server/l1.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/error.h"
#include "host/core/log.h"

#define L1_MAX_POOLS 64u
#define L1_MAX_SCOPES KVF_L1_MAX_SCOPES
#define L1_MIN_TABLE 16u

typedef struct l1_extent {
  uint64_t off, len;
} l1_extent;

enum { L1_RESERVED = 1, L1_COMMITTED = 2 };

struct l1_entry;

typedef struct l1_object {
  struct l1_entry *entry;
  struct l1_object *next; /* the entry's next object */
  uint32_t pool;          /* index into l1->pools */
  uint32_t object_group;
  int state;              /* L1_RESERVED / L1_COMMITTED */
  uint64_t off, len;      /* the extent */
  uint64_t pins;          /* pin handles' references (committed objects only) */
  kvf_object_header header;
} l1_object;

typedef struct l1_entry {
  kvf_l1_key key;
  l1_object *objects;
  struct l1_entry *prev, *next; /* LRU list: prev toward the head (MRU) */
  uint32_t reserved;            /* objects in state L1_RESERVED */
  uint32_t pinned;              /* objects with pins > 0 */
  uint64_t mark;                /* the reserve call that named it last (l1->gen) */
} l1_entry;

typedef struct l1_pool {
  int device;
  unsigned char *base;
  uint64_t size; /* usable bytes: the caller's size rounded down to KVF_L1_ALIGN */

  l1_extent *free;  /* free extents, sorted by off, never touching */
  l1_extent *sim;   /* scratch: the free list during an eviction simulation */
  l1_extent *trial; /* scratch: the trial allocation on sim */
  uint64_t nfree, cap; /* cap (of all three arrays) >= live + 1 */
  uint64_t live;       /* extents allocated (objects in the pool) */

  uint64_t bytes_free, entries, objects, bytes_committed, objects_reserved, bytes_reserved, objects_pinned;
  uint64_t evicted_entries_total, evicted_bytes_total, committed_total, aborted_total;
} l1_pool;

/* The part every handle shares: the store's list of live handles, so
 * destroy can report and free what callers still hold. */
typedef struct l1_handle {
  struct l1_handle *prev, *next;
  uint32_t n;
} l1_handle;

struct kvf_l1_reservation {
  l1_handle h;
  l1_object *objs[]; /* the objects reserved (PRESENT slots have none) */
};

struct kvf_l1_pin {
  l1_handle h;
  l1_object *objs[]; /* one reference per found query */
};

struct kvf_l1 {
  /* Guards everything below (see the top of the file). */
  pthread_mutex_t lock;
  l1_pool pools[L1_MAX_POOLS];
  uint32_t num_pools;

  l1_entry **table; /* open addressing; NULL is an empty slot */
  uint64_t table_cap, table_count;
  uint64_t table_secret; /* seeds key_hash; fixed at create */
  l1_entry *lru_head, *lru_tail; /* most / least recently used */
  uint64_t gen;                  /* reserve calls so far (marks entries a call names) */

  /* The scopes (fingerprint, shard) entries are filed under, with their
   * entry counts, so that a miss can tell "held for another model" from
   * "not held" (kvf_l1_other_scope) without a second index. Scopes past
   * L1_MAX_SCOPES are not tracked: their entries are only found directly. */
  struct {
    uint64_t fingerprint;
    uint32_t shard_index, shard_count;
    uint64_t entries;
  } scopes[L1_MAX_SCOPES];
  uint32_t num_scopes;

  l1_handle *reservations, *pins; /* live handles */
  uint64_t num_reservations, num_pins;
  uint64_t evicted_entries_total; /* entries, each counted once however many pools it spans */
};

/* ---- helpers ---------------------------------------------------------------- */

static int align_up(uint64_t v, uint64_t *out) {
  if (v > UINT64_MAX - (KVF_L1_ALIGN - 1)) return 0;
  *out = (v + KVF_L1_ALIGN - 1) & ~(uint64_t)(KVF_L1_ALIGN - 1);
  return 1;
}

static int pool_index(const kvf_l1 *l1, int device) {
  for (uint32_t i = 0; i < l1->num_pools; i++)
    if (l1->pools[i].device == device) return (int)i;
  return -1;
}

/* ---- extents ---------------------------------------------------------------- */

/* First fit: take len bytes from the front of the first free extent that
 * holds them. Returns 1 and *off, or 0 when no extent is large enough. */
static int extents_alloc(l1_extent *ext, uint64_t *n, uint64_t len, uint64_t *off) {
  for (uint64_t i = 0; i < *n; i++) {
    if (ext[i].len < len) continue;
    *off = ext[i].off;
    ext[i].off += len;
    ext[i].len -= len;
    if (ext[i].len == 0) {
      memmove(&ext[i], &ext[i + 1], (size_t)(*n - i - 1) * sizeof *ext);
      (*n)--;
    }
    return 1;
  }
  return 0;
}

/* Return [off, off + len) to a sorted, coalesced free list whose array has
 * room for one more extent. Returns the length of the free extent that now
 * holds it (after merging with its neighbours). */
static uint64_t extents_free(l1_extent *ext, uint64_t *n, uint64_t off, uint64_t len) {
  /* pos: the first extent after off (binary search). */
  uint64_t lo = 0, hi = *n;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (ext[mid].off < off) lo = mid + 1;
    else hi = mid;
  }
  uint64_t pos = lo;
  int join_prev = pos > 0 && ext[pos - 1].off + ext[pos - 1].len == off;
  int join_next = pos < *n && off + len == ext[pos].off;
  if (join_prev && join_next) {
    ext[pos - 1].len += len + ext[pos].len;
    memmove(&ext[pos], &ext[pos + 1], (size_t)(*n - pos - 1) * sizeof *ext);
    (*n)--;
    return ext[pos - 1].len;
  }
  if (join_prev) {
    ext[pos - 1].len += len;
    return ext[pos - 1].len;
  }
  if (join_next) {
    ext[pos].off = off;
    ext[pos].len += len;
    return ext[pos].len;
  }
  memmove(&ext[pos + 1], &ext[pos], (size_t)(*n - pos) * sizeof *ext);
  ext[pos].off = off;
  ext[pos].len = len;
  (*n)++;
  return len;
}

/* Grow the pool's three extent arrays to hold at least `need` extents. */
static kvf_status pool_reserve_cap(l1_pool *p, uint64_t need) {
  if (need <= p->cap) return KVF_SUCCESS;
  uint64_t cap = p->cap ? p->cap : 16;
  while (cap < need) cap *= 2;
  if (cap > SIZE_MAX / sizeof(l1_extent))
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "l1: pool %d: %" PRIu64 " extents", p->device, cap);
  l1_extent **arrays[3] = {&p->free, &p->sim, &p->trial};
  for (int i = 0; i < 3; i++) {
    l1_extent *grown = realloc(*arrays[i], (size_t)cap * sizeof(l1_extent));
    if (grown == NULL)
      return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "l1: pool %d: no memory for %" PRIu64 " extents", p->device, cap);
    *arrays[i] = grown;
  }
  p->cap = cap;
  return KVF_SUCCESS;
}

/* ---- index -------------------------------------------------------------------- */

_Static_assert(sizeof(kvf_l1_key) == KVF_CHUNK_KEY_BYTES + 16, "kvf_l1_key has no padding: memcmp compares it");

static int key_eq(const kvf_l1_key *a, const kvf_l1_key *b) { return memcmp(a, b, sizeof *a) == 0; }

static int key_zero(const kvf_l1_key *k) {
  uint8_t any = 0;
  for (unsigned i = 0; i < KVF_CHUNK_KEY_BYTES; i++) any |= k->chunk.bytes[i];
  return any == 0;
}

/* The first 8 bytes of the chunk key, for logs. */
static uint64_t key_head(const kvf_l1_key *k) {
  uint64_t v = 0;
  for (unsigned i = 0; i < 8; i++) v = v << 8 | k->chunk.bytes[i];
  return v;
}

static uint64_t key_mix(uint64_t h) {
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  h *= 0x94D049BB133111EBull;
  return h ^ (h >> 32);
}

/* A hash of every word of the key, chained from the store's secret. */
static uint64_t key_hash(const kvf_l1 *l1, const kvf_l1_key *k) {
  uint64_t w[6], h = l1->table_secret;
  memcpy(w, k, sizeof w);
  for (unsigned i = 0; i < 6; i++) h = key_mix(h ^ w[i]) + 0x9E3779B97F4A7C15ull;
  return h;
}

static uint64_t table_home(const kvf_l1 *l1, const kvf_l1_key *key) {
  return (key_hash(l1, key) >> 17) & (l1->table_cap - 1);
}

static l1_entry *table_find(const kvf_l1 *l1, const kvf_l1_key *key) {
  for (uint64_t i = table_home(l1, key);; i = (i + 1) & (l1->table_cap - 1)) {
    l1_entry *e = l1->table[i];
    if (e == NULL) return NULL;
    if (key_eq(&e->key, key)) return e;
  }
}

/* Insert an entry whose key is absent; the table has room (load <= 1/2). */
static void table_insert(kvf_l1 *l1, l1_entry *e) {
  uint64_t i = table_home(l1, &e->key);
  while (l1->table[i] != NULL) i = (i + 1) & (l1->table_cap - 1);
  l1->table[i] = e;
  l1->table_count++;
}

/* Remove a present entry, shifting later members of its probe run back so
 * that lookups never need tombstones. */
static void table_remove(kvf_l1 *l1, const l1_entry *e) {
  uint64_t mask = l1->table_cap - 1, i = table_home(l1, &e->key);
  while (l1->table[i] != e) i = (i + 1) & mask;
  for (uint64_t j = (i + 1) & mask; l1->table[j] != NULL; j = (j + 1) & mask) {
    uint64_t k = table_home(l1, &l1->table[j]->key);
    /* Move j into the hole at i unless its home lies cyclically in (i, j]. */
    int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (!stays) {
      l1->table[i] = l1->table[j];
      i = j;
    }
  }
  l1->table[i] = NULL;
  l1->table_count--;
}

/* Make room for `more` new entries at load <= 1/2. */
static kvf_status table_grow(kvf_l1 *l1, uint64_t more) {
  uint64_t need = l1->table_count + more, cap = l1->table_cap;
  while (need > cap / 2) {
    if (cap > (SIZE_MAX / sizeof(l1_entry *)) / 2)
      return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "l1: index of %" PRIu64 " entries", need);
    cap *= 2;
  }
  if (cap == l1->table_cap) return KVF_SUCCESS;
  l1_entry **old = l1->table, **grown = calloc((size_t)cap, sizeof *grown);
  if (grown == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "l1: no memory for an index of %" PRIu64 " slots", cap);
  uint64_t old_cap = l1->table_cap;
  l1->table = grown;
  l1->table_cap = cap;
  l1->table_count = 0;
  for (uint64_t i = 0; i < old_cap; i++)
    if (old[i] != NULL) table_insert(l1, old[i]);
  free(old);
  return KVF_SUCCESS;
}

static l1_object *entry_object(const l1_entry *e, uint32_t object_group) {
  for (l1_object *o = e->objects; o != NULL; o = o->next)
    if (o->object_group == object_group) return o;
  return NULL;
}

static int entry_in_pool(const l1_entry *e, uint32_t pool) {
  for (const l1_object *o = e->objects; o != NULL; o = o->next)
    if (o->pool == pool) return 1;
  return 0;
}

static void lru_unlink(kvf_l1 *l1, l1_entry *e) {
  if (e->prev) e->prev->next = e->next;
  else l1->lru_head = e->next;
  if (e->next) e->next->prev = e->prev;
  else l1->lru_tail = e->prev;
  e->prev = e->next = NULL;
}

static void lru_push_head(kvf_l1 *l1, l1_entry *e) {
  e->prev = NULL;
  e->next = l1->lru_head;
  if (l1->lru_head) l1->lru_head->prev = e;
  else l1->lru_tail = e;
  l1->lru_head = e;
}

static void lru_touch(kvf_l1 *l1, l1_entry *e) {
  if (l1->lru_head == e) return;
  lru_unlink(l1, e);
  lru_push_head(l1, e);
}

/* Link a new object into its entry and pool counters (the extent is
 * already allocated). */
static void object_link(kvf_l1 *l1, l1_entry *e, l1_object *o) {
  l1_pool *p = &l1->pools[o->pool];
  if (!entry_in_pool(e, o->pool)) p->entries++;
  o->entry = e;
  o->next = e->objects;
  e->objects = o;
  p->live++;
}

/* Unlink an object from its entry, return its extent, free it. The entry
 * may be left empty; the caller removes it. */
static void object_drop(kvf_l1 *l1, l1_object *o) {
  l1_entry *e = o->entry;
  l1_pool *p = &l1->pools[o->pool];
  for (l1_object **pp = &e->objects; *pp != NULL; pp = &(*pp)->next)
    if (*pp == o) {
      *pp = o->next;
      break;
    }
  if (!entry_in_pool(e, o->pool)) p->entries--;
  /* cap >= live + 1 held before this extent was allocated: room to free. */
  extents_free(p->free, &p->nfree, o->off, o->len);
  p->bytes_free += o->len;
  p->live--;
  free(o);
}

static int scope_find(const kvf_l1 *l1, const kvf_l1_key *k) {
  for (uint32_t i = 0; i < l1->num_scopes; i++)
    if (l1->scopes[i].fingerprint == k->fingerprint && l1->scopes[i].shard_index == k->shard_index &&
        l1->scopes[i].shard_count == k->shard_count)
      return (int)i;
  return -1;
}

static void scope_add(kvf_l1 *l1, const kvf_l1_key *k) {
  int i = scope_find(l1, k);
  if (i < 0) {
    if (l1->num_scopes == L1_MAX_SCOPES) return;
    i = (int)l1->num_scopes++;
    l1->scopes[i].fingerprint = k->fingerprint;
    l1->scopes[i].shard_index = k->shard_index;
    l1->scopes[i].shard_count = k->shard_count;
    l1->scopes[i].entries = 0;
  }
  l1->scopes[i].entries++;
}

static void scope_remove(kvf_l1 *l1, const kvf_l1_key *k) {
  int i = scope_find(l1, k);
  if (i < 0) return;
  if (--l1->scopes[i].entries == 0) l1->scopes[i] = l1->scopes[--l1->num_scopes];
}

static void entry_remove(kvf_l1 *l1, l1_entry *e) {
  scope_remove(l1, &e->key);
  table_remove(l1, e);
  lru_unlink(l1, e);
  free(e);
}

static int entry_evictable(const kvf_l1 *l1, const l1_entry *e, uint32_t pool) {
  return e->reserved == 0 && e->pinned == 0 && e->mark != l1->gen && entry_in_pool(e, pool);
}

/* Evict a whole entry (committed, unpinned objects only), in every pool. */
static void entry_evict(kvf_l1 *l1, l1_entry *e) {
  uint64_t pools_hit = 0; /* bit per pool that held an object of it */
  while (e->objects != NULL) {
    l1_object *o = e->objects;
    l1_pool *p = &l1->pools[o->pool];
    p->objects--;
    p->bytes_committed -= o->header.payload_bytes;
    p->evicted_bytes_total += o->header.payload_bytes;
    pools_hit |= 1ull << o->pool;
    object_drop(l1, o);
  }
  for (uint32_t i = 0; i < l1->num_pools; i++)
    if (pools_hit >> i & 1) l1->pools[i].evicted_entries_total++;
  l1->evicted_entries_total++;
  KVF_TRACE(SERVER, "l1: evicted chunk key %016" PRIx64 "...", key_head(&e->key));
  entry_remove(l1, e);
}

/* ---- create / destroy --------------------------------------------------------- */

kvf_status kvf_l1_create(const kvf_l1_pool_desc *pools, uint32_t num_pools, kvf_l1 **out) {
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_l1_create: out is NULL");
  if (pools == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_l1_create: pools is NULL");
  if (num_pools == 0 || num_pools > L1_MAX_POOLS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "num_pools: %u (1 .. %u)", num_pools, L1_MAX_POOLS);
  for (uint32_t i = 0; i < num_pools; i++) {
    const kvf_l1_pool_desc *d = &pools[i];
    if (d->device < -1)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].device: %d (a device ordinal, or -1 for the host)", i,
                      d->device);
    if (d->base == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].base: NULL", i);
    if ((uintptr_t)d->base % KVF_L1_ALIGN != 0)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].base: %p is not aligned to %u bytes", i, d->base,
                      KVF_L1_ALIGN);
    if (d->size < KVF_L1_ALIGN)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].size: %" PRIu64 " (at least %u bytes)", i, d->size,
                      KVF_L1_ALIGN);
    if (d->size > UINTPTR_MAX - (uintptr_t)d->base)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].size: %" PRIu64 " runs past the address space", i,
                      d->size);
    for (uint32_t j = 0; j < i; j++) {
      if (pools[j].device == d->device)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].device: %d repeats pools[%u].device", i, d->device, j);
      uintptr_t a = (uintptr_t)d->base, b = (uintptr_t)pools[j].base;
      if (a < b + pools[j].size && b < a + d->size)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pools[%u].base: [%p, +%" PRIu64 ") overlaps pools[%u]", i, d->base,
                        d->size, j);
    }
  }

  kvf_status st = KVF_SUCCESS;
  kvf_l1 *l1 = calloc(1, sizeof *l1);
  if (l1 == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_create: no memory");
  l1->table_cap = L1_MIN_TABLE;
  /* Not a cryptographic secret, only one a client cannot read: the clock
   * stands in if the kernel's pool is not ready. */
  if (getrandom(&l1->table_secret, sizeof l1->table_secret, GRND_NONBLOCK) != (ssize_t)sizeof l1->table_secret) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    l1->table_secret = key_mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)(uintptr_t)l1);
  }
  l1->table = calloc(L1_MIN_TABLE, sizeof *l1->table);
  if (l1->table == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_create: no memory for the index");
    goto out;
  }
  for (uint32_t i = 0; i < num_pools; i++) {
    l1_pool *p = &l1->pools[i];
    l1->num_pools = i + 1; /* so the cleanup below frees this pool's arrays */
    p->device = pools[i].device;
    p->base = pools[i].base;
    p->size = pools[i].size & ~(uint64_t)(KVF_L1_ALIGN - 1);
    st = pool_reserve_cap(p, 16);
    if (st != KVF_SUCCESS) goto out;
    p->free[0].off = 0;
    p->free[0].len = p->size;
    p->nfree = 1;
    p->bytes_free = p->size;
  }
  st = pthread_mutex_init(&l1->lock, NULL) == 0 ? KVF_SUCCESS
                                                 : kvf_fail(KVF_ERR_SYSTEM, "kvf_l1_create: pthread_mutex_init failed");
out:
  if (st != KVF_SUCCESS) {
    for (uint32_t i = 0; i < l1->num_pools; i++) {
      free(l1->pools[i].free);
      free(l1->pools[i].sim);
      free(l1->pools[i].trial);
    }
    free(l1->table);
    free(l1);
    return st;
  }
  KVF_INFO(SERVER, "l1: store over %u pool(s)", num_pools);
  *out = l1;
  return KVF_SUCCESS;
}

static void handles_free(l1_handle *h) {
  while (h != NULL) {
    l1_handle *next = h->next;
    free(h);
    h = next;
  }
}

void kvf_l1_destroy(kvf_l1 *l1) {
  if (l1 == NULL) return;
  if (l1->num_reservations != 0 || l1->num_pins != 0)
    KVF_WARN(SERVER, "l1: destroyed with %" PRIu64 " reservation(s) and %" PRIu64 " pin handle(s) still held",
             l1->num_reservations, l1->num_pins);
  handles_free(l1->reservations);
  handles_free(l1->pins);
  for (uint64_t i = 0; i < l1->table_cap; i++) {
    l1_entry *e = l1->table[i];
    if (e == NULL) continue;
    while (e->objects != NULL) {
      l1_object *o = e->objects;
      e->objects = o->next;
      free(o);
    }
    free(e);
  }
  free(l1->table);
  for (uint32_t i = 0; i < l1->num_pools; i++) {
    free(l1->pools[i].free);
    free(l1->pools[i].sim);
    free(l1->pools[i].trial);
  }
  pthread_mutex_destroy(&l1->lock);
  free(l1);
}

static void handle_link(l1_handle **list, l1_handle *h) {
  h->prev = NULL;
  h->next = *list;
  if (*list) (*list)->prev = h;
  *list = h;
}

static void handle_unlink(l1_handle **list, l1_handle *h) {
  if (h->prev) h->prev->next = h->next;
  else *list = h->next;
  if (h->next) h->next->prev = h->prev;
}

/* ---- reserve ------------------------------------------------------------------- */

/* Per-spec scratch of one reserve call. */
typedef struct l1_spec_work {
  kvf_l1_key key;
  uint32_t object_group;
  uint32_t index;  /* into specs */
  uint64_t len;    /* extent bytes to reserve; 0 for PRESENT */
  uint64_t off;    /* the extent's offset once allocated */
  l1_object *obj;  /* preallocated object (len > 0) */
  l1_entry *entry; /* preallocated entry, in case its key has none */
} l1_spec_work;

static int work_cmp(const void *a, const void *b) {
  const l1_spec_work *x = a, *y = b;
  int c = memcmp(&x->key, &y->key, sizeof x->key);
  if (c != 0) return c < 0 ? -1 : 1;
  if (x->object_group != y->object_group) return x->object_group < y->object_group ? -1 : 1;
  return x->index < y->index ? -1 : x->index > y->index;
}

/* The first header field that differs, by name (magic and header_version
 * were validated, object_group is the key). */
static kvf_status header_compare(uint32_t i, const kvf_object_header *a, const kvf_object_header *b) {
#define L1_FIELD(f)                                                                                                 \
  if (a->f != b->f)                                                                                                 \
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH,                                                                      \
                    "specs[%u].header." #f ": %" PRIu64 " differs from the stored object's %" PRIu64, i,            \
                    (uint64_t)a->f, (uint64_t)b->f);
  L1_FIELD(format)
  if (a->fingerprint != b->fingerprint)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH,
                    "specs[%u].header.fingerprint: %016" PRIx64 " differs from the stored object's %016" PRIx64
                    " (made by another geometry)",
                    i, a->fingerprint, b->fingerprint);
  L1_FIELD(dcp_rank)
  L1_FIELD(token_begin)
  L1_FIELD(token_end)
  L1_FIELD(payload_bytes)
  L1_FIELD(magic)
  L1_FIELD(header_version)
  L1_FIELD(object_group)
#undef L1_FIELD
  return KVF_SUCCESS;
}

/* Under l1->lock: try the work's extents, in order, on a copy of src (n
 * extents) made in pool->trial. Returns 1 when all fit. */
static int trial_fits(l1_pool *p, const l1_extent *src, uint64_t n, const l1_spec_work *w, uint32_t nw) {
  memcpy(p->trial, src, (size_t)n * sizeof *src);
  uint64_t off;
  for (uint32_t i = 0; i < nw; i++)
    if (w[i].len != 0 && !extents_alloc(p->trial, &n, w[i].len, &off)) return 0;
  return 1;
}

/* Under l1->lock: make room for the work's extents in pool pi, evicting
 * only when the simulation shows everything then fits. */
static kvf_status make_room(kvf_l1 *l1, uint32_t pi, const l1_spec_work *w, uint32_t nw, uint64_t need,
                            uint64_t need_max, uint32_t n_alloc) {
  l1_pool *p = &l1->pools[pi];
  if (need <= p->bytes_free && trial_fits(p, p->free, p->nfree, w, nw)) return KVF_SUCCESS;

  uint64_t nsim = p->nfree, sim_free = p->bytes_free, sim_largest = 0;
  memcpy(p->sim, p->free, (size_t)nsim * sizeof *p->sim);
  for (uint64_t i = 0; i < nsim; i++)
    if (p->sim[i].len > sim_largest) sim_largest = p->sim[i].len;
  l1_entry *last = NULL;
  int fits = 0;
  for (l1_entry *e = l1->lru_tail; e != NULL; e = e->prev) {
    if (!entry_evictable(l1, e, pi)) continue;
    for (const l1_object *o = e->objects; o != NULL; o = o->next) {
      if (o->pool != pi) continue;
      uint64_t merged = extents_free(p->sim, &nsim, o->off, o->len);
      if (merged > sim_largest) sim_largest = merged;
      sim_free += o->len;
    }
    last = e;
    /* The cheap necessary conditions first; the trial decides contiguity. */
    if (sim_free >= need && sim_largest >= need_max && trial_fits(p, p->sim, nsim, w, nw)) {
      fits = 1;
      break;
    }
  }
  if (!fits)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY,
                    "pool %d: the reservation needs %" PRIu64 " bytes in %u extent(s) (largest %" PRIu64
                    "); %" PRIu64 " bytes are free and %" PRIu64
                    " more evictable (pinned and reserved entries are not), and they do not fit even after "
                    "evicting everything evictable; nothing was evicted",
                    p->device, need, n_alloc, need_max, p->bytes_free, sim_free - p->bytes_free);

  /* The same walk again, for real, up to the last entry the simulation took. */
  for (l1_entry *e = l1->lru_tail; e != NULL;) {
    l1_entry *prev = e->prev;
    if (entry_evictable(l1, e, pi)) {
      int done = e == last;
      entry_evict(l1, e);
      if (done) break;
    }
    e = prev;
  }
  return KVF_SUCCESS;
}

kvf_status kvf_l1_reserve(kvf_l1 *l1, int device, const kvf_l1_object_spec *specs, uint32_t n, kvf_l1_slot *slots,
                          kvf_l1_reservation **out, uint32_t *failed_spec) {
  uint32_t no_spec;
  if (failed_spec == NULL) failed_spec = &no_spec;
  *failed_spec = UINT32_MAX;
  if (l1 == NULL || specs == NULL || slots == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_l1_reserve: %s is NULL",
                    l1 == NULL ? "l1" : specs == NULL ? "specs" : slots == NULL ? "slots" : "out");
  if (n == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "n: 0 (at least one spec)");
  for (uint32_t i = 0; i < n; i++) {
    const kvf_l1_object_spec *s = &specs[i];
    const kvf_object_header *h = &s->header;
    uint64_t len;
    *failed_spec = i; /* for the returns below; reset after the loop */
    if (key_zero(&s->key))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].key.chunk: all zero is not a chunk key", i);
    if (s->object_group >= KVF_MAX_GROUPS)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].object_group: %u (at most %u)", i, s->object_group,
                      KVF_MAX_GROUPS - 1);
    if (h->magic != KVF_OBJECT_MAGIC)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].header.magic: 0x%08x is not KVF_OBJECT_MAGIC", i, h->magic);
    if (h->header_version != 1)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].header.header_version: %u (this build knows 1)", i,
                      h->header_version);
    if (h->object_group != s->object_group)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "specs[%u].header.object_group: %u differs from specs[%u].object_group %u", i,
                      h->object_group, i, s->object_group);
    if (h->payload_bytes == 0)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].header.payload_bytes: 0", i);
    if (!align_up(h->payload_bytes, &len))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "specs[%u].header.payload_bytes: %" PRIu64 " is too large", i,
                      h->payload_bytes);
  }
  *failed_spec = UINT32_MAX;

  kvf_status st = KVF_SUCCESS;
  kvf_l1_reservation *res = NULL;
  int locked = 0;
  l1_spec_work *w = calloc(n, sizeof *w);
  if (w == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_reserve: no memory for %u specs", n);
  for (uint32_t i = 0; i < n; i++) {
    w[i].key = specs[i].key;
    w[i].object_group = specs[i].object_group;
    w[i].index = i;
  }
  /* Sorted by (key, group, index): a repeat sits right after its first. */
  qsort(w, n, sizeof *w, work_cmp);
  for (uint32_t i = 1; i < n; i++)
    if (key_eq(&w[i].key, &w[i - 1].key) && w[i].object_group == w[i - 1].object_group) {
      *failed_spec = w[i].index;
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "specs[%u]: repeats specs[%u] (chunk key %016" PRIx64 "..., object group %u)", w[i].index,
                    w[i - 1].index, key_head(&w[i].key), w[i].object_group);
      goto out;
    }
  /* Back in spec order: allocation and the slots follow the caller's order. */
  for (uint32_t i = 0; i < n; i++) w[i].index = i;
  for (uint32_t i = 0; i < n; i++) {
    w[i].key = specs[i].key;
    w[i].object_group = specs[i].object_group;
  }

  pthread_mutex_lock(&l1->lock);
  locked = 1;
  int pi = pool_index(l1, device);
  if (pi < 0) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "device: no pool %d in this store", device);
    goto out;
  }
  l1_pool *p = &l1->pools[pi];
  l1->gen++;

  /* Classify: PRESENT (same header), mismatch, or to reserve. */
  uint32_t n_alloc = 0, n_new_keys = 0;
  uint64_t need = 0, need_max = 0;
  for (uint32_t i = 0; i < n; i++) {
    l1_entry *e = table_find(l1, &w[i].key);
    l1_object *o = e ? entry_object(e, w[i].object_group) : NULL;
    if (e) e->mark = l1->gen; /* named by this call: never its victim */
    if (o != NULL) {
      st = header_compare(i, &specs[i].header, &o->header);
      if (st != KVF_SUCCESS) {
        *failed_spec = i;
        goto out;
      }
      continue;
    }
    align_up(specs[i].header.payload_bytes, &w[i].len); /* checked above */
    if (!kvf_add_u64(need, w[i].len, &need)) need = UINT64_MAX;
    if (w[i].len > need_max) need_max = w[i].len;
    n_alloc++;
    if (e == NULL) n_new_keys++;
  }

  /* Everything that can fail to allocate, before anything changes. */
  res = calloc(1, sizeof *res + (size_t)n_alloc * sizeof res->objs[0]);
  if (res == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_reserve: no memory for a handle of %u objects", n_alloc);
    goto out;
  }
  if (n_alloc != 0) {
    if ((st = table_grow(l1, n_new_keys)) != KVF_SUCCESS) goto out;
    if ((st = pool_reserve_cap(p, p->live + n_alloc + 1)) != KVF_SUCCESS) goto out;
    for (uint32_t i = 0; i < n; i++) {
      if (w[i].len == 0) continue;
      /* An entry too where the key has none (an existing one is marked, so
       * eviction below cannot take it). */
      int new_key = table_find(l1, &w[i].key) == NULL;
      w[i].obj = calloc(1, sizeof *w[i].obj);
      if (new_key) w[i].entry = calloc(1, sizeof(l1_entry));
      if (w[i].obj == NULL || (new_key && w[i].entry == NULL)) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_reserve: no memory for specs[%u]", i);
        goto out;
      }
    }
    if (need > p->size || need_max > p->size) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY,
                    "pool %d: the reservation needs %" PRIu64 " bytes (largest object %" PRIu64
                    "), more than the pool's %" PRIu64,
                    device, need, need_max, p->size);
      goto out;
    }
    if ((st = make_room(l1, (uint32_t)pi, w, n, need, need_max, n_alloc)) != KVF_SUCCESS) goto out;
    /* The free list now equals the successful trial's input: this cannot fail. */
    for (uint32_t i = 0; i < n; i++) {
      if (w[i].len != 0 && !extents_alloc(p->free, &p->nfree, w[i].len, &w[i].off)) {
        for (uint32_t j = 0; j < i; j++)
          if (w[j].len != 0) extents_free(p->free, &p->nfree, w[j].off, w[j].len);
        st = kvf_fail(KVF_ERR_INTERNAL, "l1: pool %d: the trial allocation fitted but the real one did not", device);
        goto out;
      }
    }
  }

  /* Commit the bookkeeping: nothing fails from here. */
  for (uint32_t i = 0; i < n; i++) {
    if (w[i].len == 0) {
      slots[i].state = KVF_L1_SLOT_PRESENT;
      slots[i].data = NULL;
      continue;
    }
    l1_entry *e = table_find(l1, &w[i].key);
    if (e == NULL) {
      e = w[i].entry;
      w[i].entry = NULL;
      e->key = w[i].key;
      e->mark = l1->gen;
      table_insert(l1, e);
      scope_add(l1, &e->key);
      lru_push_head(l1, e);
    }
    l1_object *o = w[i].obj;
    w[i].obj = NULL;
    o->pool = (uint32_t)pi;
    o->object_group = w[i].object_group;
    o->state = L1_RESERVED;
    o->off = w[i].off;
    o->len = w[i].len;
    o->header = specs[i].header;
    object_link(l1, e, o);
    e->reserved++;
    p->bytes_free -= o->len;
    p->objects_reserved++;
    p->bytes_reserved += o->header.payload_bytes;
    res->objs[res->h.n++] = o;
    slots[i].state = KVF_L1_SLOT_RESERVED;
    slots[i].data = p->base + o->off;
  }
  handle_link(&l1->reservations, &res->h);
  l1->num_reservations++;
  *out = res;
  res = NULL;

out:
  if (locked) pthread_mutex_unlock(&l1->lock);
  free(res);
  for (uint32_t i = 0; i < n; i++) {
    free(w[i].obj);
    free(w[i].entry);
  }
  free(w);
  return st;
}

void kvf_l1_commit(kvf_l1 *l1, kvf_l1_reservation *reservation) {
  if (l1 == NULL || reservation == NULL) return;
  pthread_mutex_lock(&l1->lock);
  for (uint32_t i = 0; i < reservation->h.n; i++) {
    l1_object *o = reservation->objs[i];
    l1_pool *p = &l1->pools[o->pool];
    o->state = L1_COMMITTED;
    o->entry->reserved--;
    p->objects_reserved--;
    p->bytes_reserved -= o->header.payload_bytes;
    p->objects++;
    p->bytes_committed += o->header.payload_bytes;
    p->committed_total++;
    lru_touch(l1, o->entry);
  }
  handle_unlink(&l1->reservations, &reservation->h);
  l1->num_reservations--;
  pthread_mutex_unlock(&l1->lock);
  free(reservation);
}

void kvf_l1_abort(kvf_l1 *l1, kvf_l1_reservation *reservation) {
  if (l1 == NULL || reservation == NULL) return;
  pthread_mutex_lock(&l1->lock);
  for (uint32_t i = 0; i < reservation->h.n; i++) {
    l1_object *o = reservation->objs[i];
    l1_entry *e = o->entry;
    l1_pool *p = &l1->pools[o->pool];
    e->reserved--;
    p->objects_reserved--;
    p->bytes_reserved -= o->header.payload_bytes;
    p->aborted_total++;
    object_drop(l1, o);
    if (e->objects == NULL) entry_remove(l1, e);
  }
  handle_unlink(&l1->reservations, &reservation->h);
  l1->num_reservations--;
  pthread_mutex_unlock(&l1->lock);
  free(reservation);
}

/* ---- lookup ---------------------------------------------------------------------- */

kvf_status kvf_l1_lookup_pin(kvf_l1 *l1, const kvf_l1_query *queries, uint32_t n, kvf_l1_found *found,
                             kvf_l1_pin **out) {
  /* n 0 is allowed (an empty handle): a request with no chunks needs no special case. */
  if (l1 == NULL || out == NULL || (n != 0 && (queries == NULL || found == NULL)))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_l1_lookup_pin: %s is NULL",
                    l1 == NULL ? "l1" : out == NULL ? "out" : queries == NULL ? "queries" : "found");
  for (uint32_t i = 0; i < n; i++) {
    if (key_zero(&queries[i].key))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "queries[%u].key.chunk: all zero is not a chunk key", i);
    if (queries[i].object_group >= KVF_MAX_GROUPS)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "queries[%u].object_group: %u (at most %u)", i,
                      queries[i].object_group, KVF_MAX_GROUPS - 1);
  }
  kvf_l1_pin *pin = calloc(1, sizeof *pin + (size_t)n * sizeof pin->objs[0]);
  if (pin == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_l1_lookup_pin: no memory for %u queries", n);

  pthread_mutex_lock(&l1->lock);
  for (uint32_t i = 0; i < n; i++) {
    l1_entry *e = table_find(l1, &queries[i].key);
    l1_object *o = e ? entry_object(e, queries[i].object_group) : NULL;
    if (o == NULL || o->state != L1_COMMITTED) {
      memset(&found[i], 0, sizeof found[i]);
      continue;
    }
    if (o->pins++ == 0) {
      e->pinned++;
      l1->pools[o->pool].objects_pinned++;
    }
    lru_touch(l1, e);
    pin->objs[pin->h.n++] = o;
    found[i].found = 1;
    found[i].data = l1->pools[o->pool].base + o->off;
    found[i].header = o->header;
  }
  handle_link(&l1->pins, &pin->h);
  l1->num_pins++;
  pthread_mutex_unlock(&l1->lock);
  *out = pin;
  return KVF_SUCCESS;
}

void kvf_l1_unpin(kvf_l1 *l1, kvf_l1_pin *pin) {
  if (l1 == NULL || pin == NULL) return;
  pthread_mutex_lock(&l1->lock);
  for (uint32_t i = 0; i < pin->h.n; i++) {
    l1_object *o = pin->objs[i];
    if (--o->pins == 0) {
      o->entry->pinned--;
      l1->pools[o->pool].objects_pinned--;
    }
  }
  handle_unlink(&l1->pins, &pin->h);
  l1->num_pins--;
  pthread_mutex_unlock(&l1->lock);
  free(pin);
}

int kvf_l1_other_scope(kvf_l1 *l1, const kvf_l1_key *key, uint32_t object_group, kvf_l1_key *other,
                       kvf_object_header *header) {
  if (l1 == NULL || key == NULL || key_zero(key) || object_group >= KVF_MAX_GROUPS) return 0;
  int hit = 0;
  pthread_mutex_lock(&l1->lock);
  for (uint32_t i = 0; i < l1->num_scopes && !hit; i++) {
    if (l1->scopes[i].fingerprint == key->fingerprint) continue;
    kvf_l1_key k = *key;
    k.fingerprint = l1->scopes[i].fingerprint;
    k.shard_index = l1->scopes[i].shard_index;
    k.shard_count = l1->scopes[i].shard_count;
    l1_entry *e = table_find(l1, &k);
    l1_object *o = e ? entry_object(e, object_group) : NULL;
    if (o == NULL || o->state != L1_COMMITTED) continue;
    hit = 1;
    if (other) *other = k;
    if (header) *header = o->header;
  }
  pthread_mutex_unlock(&l1->lock);
  return hit;
}

/* ---- counters ---------------------------------------------------------------------- */

static void stats_add(kvf_l1_stats *s, const l1_pool *p) {
  s->entries += p->entries;
  s->objects += p->objects;
  s->bytes_committed += p->bytes_committed;
  s->objects_reserved += p->objects_reserved;
  s->bytes_reserved += p->bytes_reserved;
  s->objects_pinned += p->objects_pinned;
  s->pool_bytes += p->size;
  s->bytes_free += p->bytes_free;
  s->evicted_entries_total += p->evicted_entries_total;
  s->evicted_bytes_total += p->evicted_bytes_total;
  s->committed_total += p->committed_total;
  s->aborted_total += p->aborted_total;
}

kvf_status kvf_l1_stats_get(kvf_l1 *l1, int device, kvf_l1_stats *out) {
  if (l1 == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_l1_stats_get: %s is NULL", l1 == NULL ? "l1" : "out");
  kvf_l1_stats s;
  memset(&s, 0, sizeof s);
  pthread_mutex_lock(&l1->lock);
  int pi = device == KVF_L1_ALL_POOLS ? -1 : pool_index(l1, device);
  if (device != KVF_L1_ALL_POOLS && pi < 0) {
    pthread_mutex_unlock(&l1->lock);
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "device: no pool %d in this store", device);
  }
  if (pi >= 0) {
    stats_add(&s, &l1->pools[pi]);
  } else {
    for (uint32_t i = 0; i < l1->num_pools; i++) stats_add(&s, &l1->pools[i]);
    /* An entry spans pools: count each once. */
    s.entries = l1->table_count;
    s.evicted_entries_total = l1->evicted_entries_total;
  }
  pthread_mutex_unlock(&l1->lock);
  *out = s;
  return KVF_SUCCESS;
}
