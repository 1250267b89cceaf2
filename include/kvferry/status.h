/*
 * kvferry/status.h - the status codes every kvferry function returns, the
 * thread-local detail message, and the library version at run time.
 *
 * Error convention (applies to the whole API):
 *   - Every function that can fail returns a kvf_status. KVF_SUCCESS is 0.
 *   - On failure the calling thread's detail message, kvf_last_error(), names
 *     the field or the call that failed. It stays until the next failure on
 *     that thread; a success does not clear it.
 *   - Results come back through out-parameters; an out-parameter is left
 *     untouched on failure unless the function's comment says otherwise.
 *   - destroy(NULL) is always a no-op.
 *   - Structs that start with struct_size and version are filled from their
 *     _INIT macro and checked by one rule, the same for structs passed in
 *     and structs the library fills: see "Versioned structs" in
 *     kvferry/kvferry.h. A struct that breaks it is KVF_ERR_INVALID_ARGUMENT
 *     naming the struct and the field.
 *
 * Threading: everything in this header is safe to call from any thread.
 */
#ifndef KVFERRY_STATUS_H
#define KVFERRY_STATUS_H

#include <stddef.h>
#include <stdint.h>

#if defined(KVF_STATIC_DEFINE)
#  define KVF_API
#elif defined(__GNUC__)
#  define KVF_API __attribute__((visibility("default")))
#else
#  define KVF_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Status codes. The numeric values are pinned forever: new codes are only
 * ever appended, and no value is reused or renumbered.
 */
typedef enum kvf_status {
  KVF_SUCCESS = 0,
  KVF_ERR_INVALID_ARGUMENT = 1,   /* a parameter is NULL, out of range or inconsistent */
  KVF_ERR_INVALID_GEOMETRY = 2,   /* a geometry broke a validation rule */
  KVF_ERR_OUT_OF_MEMORY = 3,      /* a host allocation failed */
  KVF_ERR_OVERFLOW = 4,           /* a size or offset product overflowed 64 bits */
  KVF_ERR_NOT_FOUND = 5,          /* a named thing (file, preset, group, key) does not exist */
  KVF_ERR_PARSE = 6,              /* a file is not valid JSON or does not follow its schema */
  KVF_ERR_IO = 7,                 /* reading or writing a file failed */
  KVF_ERR_NO_DRIVER = 8,          /* no CUDA driver is installed or it is too old */
  KVF_ERR_NO_DEVICE = 9,          /* a CUDA driver is present but no usable GPU is */
  KVF_ERR_CUDA = 10,              /* a CUDA driver or runtime call failed */
  KVF_ERR_UNSUPPORTED = 11,       /* the request is valid but this build or device cannot do it */
  KVF_ERR_GEOMETRY_MISMATCH = 12, /* an object was made by a different geometry or format */
  KVF_ERR_STATE = 13,             /* the object is in the wrong state for the call */
  KVF_ERR_SYSTEM = 14,            /* a system call failed (the message carries errno's text) */
  KVF_ERR_INTERNAL = 15,          /* a bug in kvferry: please report it */
  KVF_ERR_TIMEOUT = 16,           /* a deadline passed; nothing was released because of it */
  KVF_ERR_BUSY = 17,              /* a resource is in use (leases held, a second server) */
  KVF_ERR_PROTOCOL = 18,          /* a peer sent a malformed or unexpected message */
  KVF_ERR_PERMISSION = 19,        /* a peer or a path failed an ownership or mode check */
  KVF_ERR_DISCONNECTED = 20,      /* the peer closed the connection */
} kvf_status;

/* A short, static, human-readable name for a status ("invalid geometry").
 * Unknown values return "unknown status". Never returns NULL. */
KVF_API const char *kvf_status_string(kvf_status status);

/* The calling thread's detail message for its most recent failure, or "" if
 * none. The pointer stays valid until the next kvferry call on this thread. */
KVF_API const char *kvf_last_error(void);

/* The library's version at run time, as MAJOR*10000 + MINOR*100 + PATCH.
 * Compare with KVF_VERSION_NUMBER from kvferry/version.h to detect a header
 * and library mismatch. */
KVF_API unsigned kvf_version(void);

/* The library's version at run time as "MAJOR.MINOR.PATCH". */
KVF_API const char *kvf_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_STATUS_H */
