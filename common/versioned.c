/* The one rule for versioned structs (common/versioned.h; the rule is
 * documented in kvferry/kvferry.h). The model is Linux's
 * copy_struct_from_user(): the size decides, an older caller's missing
 * fields take their defaults, and a newer caller's extra fields are
 * accepted only when they are zero. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "common/versioned.h"

/* "kvf_xfer_options" -> "KVF_XFER_OPTIONS_INIT" (cut to fit `cap`). */
static const char *init_macro(const char *name, char *buf, size_t cap) {
  size_t n = 0;
  for (; name[n] && n + sizeof "_INIT" < cap; n++) buf[n] = (char)toupper((unsigned char)name[n]);
  memcpy(buf + n, "_INIT", sizeof "_INIT");
  return buf;
}

/* The caller's header; the struct may be unaligned for all we know. */
static void read_header(const void *caller, uint32_t *size, uint32_t *version) {
  memcpy(size, caller, sizeof *size);
  memcpy(version, (const char *)caller + sizeof *size, sizeof *version);
}

kvf_status kvf_versioned_check(const void *caller, size_t local_size, const char *name) {
  char init[96];
  if (name == NULL) name = "struct";
  if (caller == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s is NULL", name);
  uint32_t size, version;
  read_header(caller, &size, &version);
  if (size < KVF_VERSIONED_HEADER_BYTES)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.struct_size %u%s: fill it from %s", name, size,
                    size == 0 ? "" : " is smaller than its 8-byte header", init_macro(name, init, sizeof init));
  if (size > KVF_VERSIONED_MAX_BYTES)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "%s.struct_size %u is larger than the %u bytes any kvferry struct may have: fill it from %s",
                    name, size, KVF_VERSIONED_MAX_BYTES, init_macro(name, init, sizeof init));
  if (version == 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.version 0: fill it from %s", name,
                    init_macro(name, init, sizeof init));
  /* A newer caller's fields this library does not know must be zero: a
   * nonzero one asks for something this library cannot do. */
  const unsigned char *bytes = caller;
  for (size_t i = local_size; i < size; i++)
    if (bytes[i] != 0)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "%s: struct_size %u is larger than this library's %zu and byte %zu is not zero: "
                      "built against a newer kvferry?",
                      name, size, local_size, i);
  return KVF_SUCCESS;
}

/* Bytes after the header that both sides know. */
static size_t common_bytes(const void *caller, size_t local_size) {
  uint32_t size, version;
  read_header(caller, &size, &version);
  size_t n = size < local_size ? size : local_size;
  return n > KVF_VERSIONED_HEADER_BYTES ? n - KVF_VERSIONED_HEADER_BYTES : 0;
}

kvf_status kvf_versioned_in(void *local, size_t local_size, const void *caller, const char *name) {
  if (local == NULL || local_size < KVF_VERSIONED_HEADER_BYTES)
    return kvf_fail(KVF_ERR_INTERNAL, "%s: no room for the library's copy", name ? name : "struct");
  kvf_status st = kvf_versioned_check(caller, local_size, name);
  if (st != KVF_SUCCESS) return st;
  memcpy((char *)local + KVF_VERSIONED_HEADER_BYTES, (const char *)caller + KVF_VERSIONED_HEADER_BYTES,
         common_bytes(caller, local_size));
  return KVF_SUCCESS;
}

kvf_status kvf_versioned_out(void *caller, const void *local, size_t local_size, const char *name) {
  if (local == NULL || local_size < KVF_VERSIONED_HEADER_BYTES)
    return kvf_fail(KVF_ERR_INTERNAL, "%s: no library copy to write", name ? name : "struct");
  kvf_status st = kvf_versioned_check(caller, local_size, name);
  if (st != KVF_SUCCESS) return st;
  memcpy((char *)caller + KVF_VERSIONED_HEADER_BYTES, (const char *)local + KVF_VERSIONED_HEADER_BYTES,
         common_bytes(caller, local_size));
  return KVF_SUCCESS;
}
