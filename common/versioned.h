/* Internal: the one rule for versioned structs, the structs that start with
 * `uint32_t struct_size; uint32_t version;` (the rule itself is documented
 * once, in kvferry/kvferry.h, "Versioned structs").
 *
 * Every function that takes such a struct, to read it or to fill it, goes
 * through these three functions and nothing else:
 *   - an input struct is copied into the library's own copy, pre-filled from
 *     its _INIT macro, with kvf_versioned_in: the caller's bytes up to its
 *     struct_size replace the defaults, so the fields an older caller does
 *     not know keep their defaults;
 *   - an output struct is checked with kvf_versioned_check before the call
 *     does anything (so a bad struct leaves everything untouched), filled in
 *     a local copy, and written back with kvf_versioned_out: only the bytes
 *     the library knows that fit in the caller's struct_size, never the
 *     caller's struct_size and version.
 * The KVF_VERSIONED_* macros take the type, so the name in messages and the
 * size always match the struct (and the compiler checks the pointers).
 *
 * Threading: pure functions of their arguments; kvf_fail's message is per
 * thread. */
#ifndef KVF_COMMON_VERSIONED_H
#define KVF_COMMON_VERSIONED_H

#include <stddef.h>

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of the header every versioned struct starts with (struct_size, version). */
#define KVF_VERSIONED_HEADER_BYTES 8u
/* The largest struct_size accepted: anything above is not a kvferry struct. */
#define KVF_VERSIONED_MAX_BYTES 65536u

/* Check the header of the caller's struct `caller` of type `name` (its type
 * name, "kvf_xfer_options"; its initializer is the upper-cased name plus
 * _INIT) against local_size, the library's sizeof of that type. Returns
 * KVF_SUCCESS when struct_size is in [8, 64 KiB], version is not 0 and any
 * bytes from local_size up to struct_size are zero; otherwise
 * KVF_ERR_INVALID_ARGUMENT with kvf_last_error() naming the struct and the
 * field ("kvf_client_options.struct_size 0: fill it from
 * KVF_CLIENT_OPTIONS_INIT"). A NULL caller is KVF_ERR_INVALID_ARGUMENT
 * ("kvf_xfer_stats is NULL"). Reads the caller's struct only. */
kvf_status kvf_versioned_check(const void *caller, size_t local_size, const char *name);

/* Input: check `caller` (kvf_versioned_check), then copy its bytes from the
 * end of the header up to min(struct_size, local_size) over `local`, which
 * the caller pre-filled with the library's defaults (the _INIT values); the
 * rest of `local`, its header included, keeps those defaults. `local` is
 * untouched on failure. local_size must be at least the header. */
kvf_status kvf_versioned_in(void *local, size_t local_size, const void *caller, const char *name);

/* Output: check `caller` (kvf_versioned_check), then copy `local`'s bytes
 * from the end of the header up to min(struct_size, local_size) into
 * `caller`. The caller's struct_size, version and any bytes past local_size
 * are never written; nothing is written on failure. */
kvf_status kvf_versioned_out(void *caller, const void *local, size_t local_size, const char *name);

/* The same, for a struct of type `type` (the type name is the message's). */
#define KVF_VERSIONED_CHECK(type, caller) kvf_versioned_check((const type *){(caller)}, sizeof(type), #type)
#define KVF_VERSIONED_IN(type, local, caller) \
  kvf_versioned_in((type *){(local)}, sizeof(type), (const type *){(caller)}, #type)
#define KVF_VERSIONED_OUT(type, caller, local) \
  kvf_versioned_out((type *){(caller)}, (const type *){(local)}, sizeof(type), #type)

#ifdef __cplusplus
}
#endif

#endif /* KVF_COMMON_VERSIONED_H */
