/* A small memo of a pure step's answers (common/memo.h). */
#include "common/memo.h"

#include <stdlib.h>
#include <string.h>

unsigned char *kvf_memo_scratch(kvf_memo *m, size_t size) {
  if (m->scratch_cap < size) {
    unsigned char *p = realloc(m->scratch, size);
    if (!p) return NULL;
    m->scratch = p;
    m->scratch_cap = size;
  }
  return m->scratch;
}

const kvf_memo_slot *kvf_memo_find(kvf_memo *m, const void *key, size_t size) {
  for (uint32_t i = 0; i < KVF_MEMO_SLOTS; i++) {
    const kvf_memo_slot *s = &m->slots[i];
    if (size > 0 && s->key_size == size && memcmp(s->key, key, size) == 0) {
      m->hits++;
      return s;
    }
  }
  m->misses++;
  return NULL;
}

/* Room for `size` bytes in *buf (of *cap), kept when large enough. */
static int room(unsigned char **buf, size_t *cap, size_t size) {
  if (*cap >= size) return 1;
  free(*buf);
  *cap = 0;
  if (!(*buf = malloc(size ? size : 1))) return 0;
  *cap = size;
  return 1;
}

/* The next slot, emptied for an answer. */
static kvf_memo_slot *next_slot(kvf_memo *m) {
  kvf_memo_slot *s = &m->slots[m->next];
  m->next = (m->next + 1) % KVF_MEMO_SLOTS;
  s->key_size = 0;
  s->value_size = 0;
  return s;
}

/* The answer's results and a copy of its key (none without memory). */
static const kvf_memo_slot *finish(kvf_memo_slot *s, const void *key, size_t key_size, uint64_t result0,
                                   uint64_t result1) {
  s->result[0] = result0;
  s->result[1] = result1;
  if (key_size && room(&s->key, &s->key_cap, key_size)) {
    memcpy(s->key, key, key_size);
    s->key_size = key_size;
  }
  return s;
}

const kvf_memo_slot *kvf_memo_keep(kvf_memo *m, const void *key, size_t key_size, const void *value,
                                   size_t value_size, uint64_t result0, uint64_t result1) {
  kvf_memo_slot *s = next_slot(m);
  if (!room(&s->value, &s->value_cap, value_size)) return NULL;
  if (value_size) memcpy(s->value, value, value_size);
  s->value_size = value_size;
  return finish(s, key, key_size, result0, result1);
}

const kvf_memo_slot *kvf_memo_keep_taking(kvf_memo *m, const void *key, size_t key_size, void *value,
                                          size_t value_size, uint64_t result0, uint64_t result1) {
  kvf_memo_slot *s = next_slot(m);
  free(s->value);
  s->value = value;
  s->value_cap = value ? value_size : 0;
  s->value_size = value_size;
  return finish(s, key, key_size, result0, result1);
}

void kvf_memo_free(kvf_memo *m) {
  for (uint32_t i = 0; i < KVF_MEMO_SLOTS; i++) {
    free(m->slots[i].key);
    free(m->slots[i].value);
  }
  free(m->scratch);
  memset(m, 0, sizeof *m);
}
