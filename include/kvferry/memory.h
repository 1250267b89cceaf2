/*
 * kvferry/memory.h - memory that can be shared between processes: providers,
 * export and import of allocations, descriptor passing over a Unix socket,
 * and the import table a cache server keeps.
 *
 * Two providers sit behind one interface, so everything above them is the
 * same on a GPU machine and on a machine without one:
 *   - KVF_MEM_PROVIDER_CUMEM: CUDA virtual memory management (cuMemCreate)
 *     with POSIX file descriptor handles;
 *   - KVF_MEM_PROVIDER_HOST: memfd_create + mmap (shared host memory).
 *
 * The exporter side (an engine worker) creates allocations or finds the
 * allocation under a pointer it was given (kvf_mem_alloc_*), exports each as
 * a file descriptor plus an identity (kvf_mem_identity) and passes both to the
 * importer with kvf_ipc_send. The importer (a cache server) registers the
 * views each client uses (kvf_import_table_register): one mapping per
 * identity however many views alias it, all or nothing, and an unregister
 * whose every step can be retried. See docs/memory.md.
 *
 * Descriptors: every function that is handed a descriptor says whether it
 * takes it over. kvf_import_table_register always closes every descriptor it
 * is given; kvf_ipc_send closes its descriptors when asked to
 * (KVF_IPC_CLOSE_FDS). Descriptors kvferry creates are close-on-exec.
 *
 * Threading: allocation functions are safe from any thread (a process-wide
 * lock guards the list of live allocations). An import table serializes its
 * calls on an internal lock; a registration's view accessors may be called
 * from any thread while the registration is active. kvf_ipc_* functions are
 * safe from any thread, but two threads must not send (or receive) on one
 * socket at once. Nothing here touches a CUDA stream; mapping, unmapping and
 * setting access may synchronize the device inside the driver, so keep them
 * off the hot path.
 */
#ifndef KVFERRY_MEMORY_H
#define KVFERRY_MEMORY_H

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_MEM_VERSION 1u

/* Which provider an allocation belongs to. Values are pinned (they travel in
 * identities between processes). */
typedef enum kvf_mem_provider {
  KVF_MEM_PROVIDER_HOST = 1,  /* memfd + mmap */
  KVF_MEM_PROVIDER_CUMEM = 2, /* CUDA VMM, POSIX file descriptor handles */
} kvf_mem_provider;

/* What an exporter says about an allocation it exports. The importer keys
 * its mappings by (instance_id, allocation_id, generation); size, provider
 * and device_uuid must then agree with the mapping already held. A plain
 * struct of fixed-width fields (64 bytes), so it can be sent as it is
 * between processes of the same machine: a fixed layout (kvferry/kvferry.h). */
typedef struct kvf_mem_identity {
  uint64_t instance_id;   /* the exporting process (kvf_mem_instance) */
  uint64_t allocation_id; /* unique within the instance, never reused */
  uint64_t generation;    /* the exporter's generation (kvf_mem_instance) */
  uint64_t size;          /* bytes of the allocation (a multiple of its granularity) */
  uint8_t device_uuid[16];/* cumem: the GPU holding the memory; host: all zero */
  uint32_t provider;      /* kvf_mem_provider */
  uint32_t reserved0;     /* zero */
  uint64_t reserved1;     /* zero */
} kvf_mem_identity;

/* ---- exporter side: allocations ----------------------------------------- */

typedef struct kvf_mem_alloc kvf_mem_alloc;

typedef struct kvf_mem_alloc_options {
  uint32_t struct_size;
  uint32_t version;
  kvf_mem_provider provider;
  int device;                /* cumem: the device ordinal the memory lives on; host: ignored */
  uint64_t size;             /* bytes wanted; rounded up to the provider's granularity */
  const int *access_devices; /* cumem: devices given read/write access in this process;
                                NULL or none: `device` alone. host: ignored */
  uint32_t num_access_devices;
  const char *name;          /* host: the memfd's name in /proc (debugging); NULL: "kvferry" */
} kvf_mem_alloc_options;
#define KVF_MEM_ALLOC_OPTIONS_INIT \
  {sizeof(kvf_mem_alloc_options), KVF_MEM_VERSION, KVF_MEM_PROVIDER_HOST, 0, 0, NULL, 0, NULL}

/* Set the instance id and generation that identities of allocations created
 * or found afterwards carry. By default the instance id is random (drawn once
 * per process, again in a forked child) and the generation is 1; an engine
 * worker may set a stable id and count its restarts in the generation, so a
 * restarted worker's allocations never share an identity with the old ones.
 * instance_id 0 draws a new random id. Returns KVF_SUCCESS, or
 * KVF_ERR_SYSTEM when no random bytes can be had. Thread-safe; allocations
 * already created keep their identity. */
KVF_API kvf_status kvf_mem_instance_set(uint64_t instance_id, uint64_t generation);

/* The current instance id and generation (either pointer may be NULL).
 * Returns KVF_SUCCESS or KVF_ERR_SYSTEM (no random bytes). Thread-safe. */
KVF_API kvf_status kvf_mem_instance(uint64_t *instance_id, uint64_t *generation);

/* The allocation granularity of a provider on a device (cumem: the
 * recommended granularity for POSIX-FD-exportable device memory, 2 MiB on
 * H200; host: the page size). Sizes and map offsets are multiples of it.
 * Returns KVF_SUCCESS, KVF_ERR_INVALID_ARGUMENT (NULL out, unknown provider
 * or device), KVF_ERR_NO_DRIVER / KVF_ERR_NO_DEVICE / KVF_ERR_CUDA (cumem).
 * Thread-safe. */
KVF_API kvf_status kvf_mem_granularity(kvf_mem_provider provider, int device, uint64_t *out);

/* Allocate exportable memory (for an engine's KV pool, say): the size is
 * rounded up to the granularity; cumem memory is created with the POSIX-FD
 * handle type on options->device, mapped, and made readable and writable by
 * every device in options->access_devices; host memory is a sealed memfd
 * (it cannot shrink under an importer) mapped read/write. Contents start as
 * zero for host memory and undefined for cumem.
 * Returns KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT (NULL or bad
 * options: size 0, unknown provider or device), KVF_ERR_OVERFLOW (size too
 * large to round), KVF_ERR_UNSUPPORTED (the device cannot export POSIX file
 * descriptors), KVF_ERR_NO_DRIVER / KVF_ERR_NO_DEVICE / KVF_ERR_CUDA,
 * KVF_ERR_SYSTEM, KVF_ERR_OUT_OF_MEMORY. Nothing is left allocated on
 * failure. Thread-safe. */
KVF_API kvf_status kvf_mem_alloc_create(const kvf_mem_alloc_options *options, kvf_mem_alloc **out);

/* Find the allocation that holds `ptr` (any byte inside it), for memory
 * someone else allocated: a tensor's data pointer, say. If a live
 * kvf_mem_alloc of this process holds ptr, that one is returned with one
 * more reference (so its identity is the same); otherwise, for cumem, the
 * allocation is found with cuMemGetAddressRange and cuMemRetainAllocationHandle
 * and a new kvf_mem_alloc holds the retained handle (the memory itself stays
 * its owner's: destroying the kvf_mem_alloc releases only that handle).
 * Returns KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT (NULL pointers,
 * ptr not in any allocation of the provider); KVF_ERR_UNSUPPORTED when the
 * memory exists but cannot be exported (cudaMalloc'd memory, or cuMem memory
 * created without the POSIX-FD handle type): the message says what to
 * allocate instead; KVF_ERR_NO_DRIVER / KVF_ERR_NO_DEVICE / KVF_ERR_CUDA.
 * For the host provider only allocations made by kvf_mem_alloc_create are
 * found. Thread-safe. */
KVF_API kvf_status kvf_mem_alloc_find(kvf_mem_provider provider, const void *ptr, kvf_mem_alloc **out);

/* Drop one reference; the last one unmaps and frees memory this process
 * created (or releases the handle kvf_mem_alloc_find retained). Importers
 * that still map the memory keep it alive until they unmap. NULL is a
 * no-op. Thread-safe; the caller must not use the allocation afterwards. */
KVF_API void kvf_mem_alloc_destroy(kvf_mem_alloc *alloc);

/* Base address of the allocation in this process (a device address for
 * cumem), or NULL for a NULL alloc. */
KVF_API void *kvf_mem_alloc_ptr(const kvf_mem_alloc *alloc);

/* Size in bytes (after rounding), or 0 for a NULL alloc. */
KVF_API uint64_t kvf_mem_alloc_size(const kvf_mem_alloc *alloc);

/* The allocation's identity. Returns KVF_SUCCESS or KVF_ERR_INVALID_ARGUMENT
 * (NULL pointers). */
KVF_API kvf_status kvf_mem_alloc_identity(const kvf_mem_alloc *alloc, kvf_mem_identity *out);

/* Export the allocation: a new close-on-exec descriptor in *fd and, when
 * identity is not NULL, the identity. The caller owns the descriptor and
 * should close it as soon as it is passed on (kvf_ipc_send with
 * KVF_IPC_CLOSE_FDS does). Each call returns a new descriptor for the same
 * identity. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL pointers),
 * KVF_ERR_CUDA / KVF_ERR_NO_DRIVER (cumem), KVF_ERR_SYSTEM; *fd is -1 on
 * failure. Thread-safe. */
KVF_API kvf_status kvf_mem_alloc_export(kvf_mem_alloc *alloc, int *fd, kvf_mem_identity *identity);

/* The device ordinal, in this process, whose UUID is `uuid` (16 bytes, as in
 * kvf_mem_identity). Returns KVF_SUCCESS and *device; KVF_ERR_NOT_FOUND (no
 * visible device has it: check CUDA_VISIBLE_DEVICES), KVF_ERR_INVALID_ARGUMENT,
 * KVF_ERR_NO_DRIVER / KVF_ERR_NO_DEVICE / KVF_ERR_CUDA. Thread-safe. */
KVF_API kvf_status kvf_mem_device_from_uuid(const uint8_t uuid[16], int *device);

/* Write "host:<instance>:<allocation>:<generation> (<size> bytes)" (or
 * "cumem:...") into buf, for logs. Returns buf; "" for NULL identity. */
KVF_API const char *kvf_mem_identity_format(const kvf_mem_identity *identity, char *buf, size_t cap);

/* ---- descriptor passing over a Unix stream socket ----------------------- */

/* The most descriptors one message may carry (the kernel's SCM_MAX_FD). */
#define KVF_IPC_MAX_FDS 253u

/* kvf_ipc_send flag: close the descriptors passed in, whether or not the
 * send succeeds (they have been passed on, or the connection is lost). */
#define KVF_IPC_CLOSE_FDS 1u

/* A connected pair of close-on-exec Unix stream sockets. Returns KVF_SUCCESS
 * and out[0], out[1]; KVF_ERR_INVALID_ARGUMENT (NULL), KVF_ERR_SYSTEM. */
KVF_API kvf_status kvf_ipc_socketpair(int out[2]);

/* Send all `len` bytes of buf on a blocking Unix stream socket, with
 * num_fds descriptors attached (SCM_RIGHTS) to the first byte; interrupted
 * calls (EINTR) are retried and partial writes continued. A message that
 * carries descriptors needs at least one byte. SIGPIPE is never raised.
 * flags: 0 or KVF_IPC_CLOSE_FDS.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL buf with len > 0,
 * num_fds > KVF_IPC_MAX_FDS, descriptors with len 0, a negative descriptor,
 * unknown flags), KVF_ERR_DISCONNECTED (the peer is gone), KVF_ERR_TIMEOUT
 * (SO_SNDTIMEO expired or the socket is non-blocking; part of the message
 * may have been sent: drop the connection), KVF_ERR_SYSTEM. */
KVF_API kvf_status kvf_ipc_send(int sock, const void *buf, size_t len, const int *fds, uint32_t num_fds,
                                uint32_t flags);

/* Receive exactly `len` bytes into buf from a blocking Unix stream socket,
 * and the descriptors sent with them (close-on-exec, MSG_CMSG_CLOEXEC), at
 * most max_fds, into fds[0 .. *num_fds). EINTR is retried. The caller owns
 * the received descriptors. If the sender attached more descriptors than
 * max_fds (the kernel truncates them: MSG_CTRUNC), or the peer closes in the
 * middle of the message, every descriptor that did arrive is closed and an
 * error is returned; on any failure *num_fds is 0 and no descriptor is left
 * open. num_fds may be NULL only when max_fds is 0.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (len 0, NULL buf, fds NULL
 * with max_fds > 0, max_fds > KVF_IPC_MAX_FDS); KVF_ERR_DISCONNECTED (the
 * peer closed before the first byte); KVF_ERR_PROTOCOL (closed mid-message,
 * descriptors truncated or more than max_fds); KVF_ERR_TIMEOUT (SO_RCVTIMEO
 * expired or non-blocking socket; drop the connection); KVF_ERR_SYSTEM. */
KVF_API kvf_status kvf_ipc_recv(int sock, void *buf, size_t len, int *fds, uint32_t max_fds,
                                uint32_t *num_fds);

/* ---- importer side: the import table ------------------------------------ */

typedef struct kvf_import_table kvf_import_table;
typedef struct kvf_import_reg kvf_import_reg;

typedef struct kvf_import_table_options {
  uint32_t struct_size;
  uint32_t version;
  const int *access_devices; /* cumem: devices (ordinals in this process) that will run kernels on
                                imported memory; the device holding the memory always gets access */
  uint32_t num_access_devices;
} kvf_import_table_options;
#define KVF_IMPORT_TABLE_OPTIONS_INIT {sizeof(kvf_import_table_options), KVF_MEM_VERSION, NULL, 0}

/* One view of a registration: a byte range of an allocation a client
 * exported. Views with the same identity share one mapping. An array
 * element: a fixed layout (kvferry/kvferry.h), never extended. */
typedef struct kvf_import_view {
  kvf_mem_identity identity;
  int fd;          /* the exported descriptor, or -1 when another view of this call carries one
                      for the same identity or the table already maps the identity */
  uint64_t offset; /* bytes from the start of the allocation */
  uint64_t size;   /* bytes the view uses; offset + size <= identity.size */
} kvf_import_view;

/* Registration states. A registration handle exists only from active on:
 * an attempt that fails is rolled back (failed) and returns no handle. */
typedef enum kvf_import_reg_state {
  KVF_IMPORT_REG_REGISTERING = 0, /* inside kvf_import_table_register */
  KVF_IMPORT_REG_ACTIVE = 1,      /* every view mapped and usable */
  KVF_IMPORT_REG_CLOSING = 2,     /* unregister began; a close step is left to retry */
  KVF_IMPORT_REG_CLOSED = 3,      /* (internal: freed when reached) */
  KVF_IMPORT_REG_FAILED = 4,      /* (internal: a rolled-back attempt) */
} kvf_import_reg_state;

/* Where a registered view lives in this process. Filled per view index, like
 * an array element: a fixed layout (kvferry/kvferry.h), never extended. */
typedef struct kvf_import_view_info {
  void *base;              /* the mapping's base (the allocation's first byte): a region base */
  void *ptr;               /* base + offset: the view's first byte */
  uint64_t offset;
  uint64_t size;
  uint64_t mapping_size;   /* bytes mapped (identity.size) */
  int device;              /* cumem: device ordinal holding the memory; host: -1 */
  kvf_mem_identity identity;
} kvf_import_view_info;

/* Counters. Read for the whole table or for one client; fields marked
 * (table) are 0 in a client's counters. */
typedef struct kvf_import_stats {
  uint32_t struct_size;
  uint32_t version;
  uint64_t registrations;   /* live registrations (active or closing) */
  uint64_t imports;         /* mappings held (distinct identities, and mappings whose close is pending) */
  uint64_t aliases;         /* views of active registrations */
  uint64_t bytes_mapped;    /* bytes of the mappings held that are still mapped */
  uint64_t handles;         /* (table) import handles not released yet (normally 0: released after mapping) */
  uint64_t reservations;    /* (table) address ranges not freed yet */
  uint64_t pending_closes;  /* mappings with a close step left to retry (failed unregister or rollback) */
  uint64_t imports_total;   /* (table) imports done since the table was created */
  uint64_t dedup_total;     /* (table) views that found their identity already mapped */
  uint64_t rollbacks_total; /* (table) registrations rolled back */
} kvf_import_stats;
#define KVF_IMPORT_STATS_INIT {sizeof(kvf_import_stats), KVF_MEM_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* Create an empty import table. options may be NULL (no extra access
 * devices). Returns KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT (NULL out,
 * bad options), KVF_ERR_OUT_OF_MEMORY. Thread-safe. */
KVF_API kvf_status kvf_import_table_create(const kvf_import_table_options *options, kvf_import_table **out);

/* Unregister every registration, retry pending closes, and free the table.
 * Anything that still cannot be closed is logged and left behind (never a
 * device reset). NULL is a no-op. Must not race other calls on the table. */
KVF_API void kvf_import_table_destroy(kvf_import_table *table);

/* Register a client's set of views, all or nothing. For each identity not
 * mapped yet: import its descriptor, reserve an address range, map, grant
 * access to the memory's own device and every access device of the table,
 * and release the import handle (the mapping keeps the memory alive); an
 * identity already mapped (by an earlier registration of any client, or by
 * an earlier view of this call) is reused, and each view adds one alias to
 * its mapping. If any step fails, every step of this attempt is undone
 * (closes that fail are kept for kvf_import_table_collect) and earlier
 * registrations, of this client or others, are untouched.
 * Every descriptor in views is closed by this call, on success and on
 * failure (each distinct descriptor number once); a descriptor number may
 * appear in several views of one identity, never in two identities.
 * client: the caller's id for the peer (a connection id); the table only
 * groups counters by it. A client may hold several registrations.
 * Returns KVF_SUCCESS and *out (state active); KVF_ERR_INVALID_ARGUMENT
 * (NULL pointers, num_views 0, a view out of its allocation, an identity
 * with no descriptor that is not mapped yet, a descriptor shared by two
 * identities), KVF_ERR_PROTOCOL (an identity whose size, provider or device
 * disagrees with the mapping held, or a descriptor that is not what the
 * identity says), KVF_ERR_UNSUPPORTED (unknown provider), KVF_ERR_NO_DRIVER /
 * KVF_ERR_NO_DEVICE / KVF_ERR_CUDA, KVF_ERR_SYSTEM, KVF_ERR_OUT_OF_MEMORY.
 * Serialized with other calls on the table. */
KVF_API kvf_status kvf_import_table_register(kvf_import_table *table, uint64_t client,
                                             const kvf_import_view *views, uint32_t num_views,
                                             kvf_import_reg **out);

/* Unregister: drop the registration's aliases (once), and close every
 * mapping whose alias count reaches zero: unmap, free the address range,
 * release any handle still held. Each step is recorded when done, so if one
 * fails this returns its status with the registration left closing, and a
 * later call retries only the steps left. On KVF_SUCCESS the registration
 * is freed. Memory is never unmapped while another registration uses it.
 * The caller must have drained every use of the views (transfers in
 * flight) first: this function does not wait for GPU work.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL or another table's
 * registration); KVF_ERR_CUDA / KVF_ERR_SYSTEM from a close step (retry).
 * Serialized with other calls on the table. */
KVF_API kvf_status kvf_import_table_unregister(kvf_import_table *table, kvf_import_reg *reg);

/* Retry the close steps of mappings left over by rolled-back registrations.
 * Returns KVF_SUCCESS when none is left; otherwise the first failure (the
 * rest are still tried). KVF_ERR_INVALID_ARGUMENT for NULL. */
KVF_API kvf_status kvf_import_table_collect(kvf_import_table *table);

/* Counters for the whole table. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT
 * (NULL, or an out that breaks the versioned-struct rule, kvferry/kvferry.h:
 * fill it from KVF_IMPORT_STATS_INIT). */
KVF_API kvf_status kvf_import_table_stats(kvf_import_table *table, kvf_import_stats *out);

/* Counters for one client's registrations (imports: distinct mappings its
 * registrations use). Same statuses as kvf_import_table_stats. */
KVF_API kvf_status kvf_import_table_client_stats(kvf_import_table *table, uint64_t client,
                                                 kvf_import_stats *out);

/* The registration's state (active, or closing after a failed unregister);
 * KVF_IMPORT_REG_FAILED for NULL. Thread-safe. */
KVF_API kvf_import_reg_state kvf_import_reg_get_state(const kvf_import_reg *reg);

/* The client id the registration was made for (0 for NULL). */
KVF_API uint64_t kvf_import_reg_client(const kvf_import_reg *reg);

/* Number of views (0 for NULL). */
KVF_API uint32_t kvf_import_reg_num_views(const kvf_import_reg *reg);

/* Where view `index` lives. Valid while the registration is active.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL, index out of range),
 * KVF_ERR_STATE (the registration is closing). Thread-safe. */
KVF_API kvf_status kvf_import_reg_view(const kvf_import_reg *reg, uint32_t index, kvf_import_view_info *out);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_MEMORY_H */
