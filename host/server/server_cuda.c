/* CUDA runtime calls of the server's data path (host/server_cuda.h). */
#define _GNU_SOURCE
#include "host/server/server_cuda.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <hwloc.h>

#include "common/error.h"
#include "host/core/log.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>

#include <kvferry/copy.h>
#include <kvferry/geometry.h>
#include <kvferry/transfer.h>

#include "host/core/xfer_internal.h"

struct kvf_scuda_event {
  int device;
  cudaEvent_t event;
};

/* Make `device` current; *prev gets the caller's. */
static kvf_status enter(int device, int *prev) {
  *prev = -1;
  (void)cudaGetDevice(prev);
  cudaError_t e = *prev == device ? cudaSuccess : cudaSetDevice(device);
  if (e != cudaSuccess) return kvf_fail(KVF_ERR_CUDA, "device %d: cudaSetDevice: %s", device, cudaGetErrorString(e));
  return KVF_SUCCESS;
}

static void leave(int device, int prev) {
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
}

kvf_status kvf_scuda_stream_create(int device, void **stream) {
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) return st;
  cudaStream_t s = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  leave(device, prev);
  if (e != cudaSuccess) return kvf_fail(KVF_ERR_CUDA, "device %d: cudaStreamCreate: %s", device, cudaGetErrorString(e));
  *stream = s;
  return KVF_SUCCESS;
}

void kvf_scuda_stream_destroy(int device, void *stream) {
  if (!stream) return;
  int prev;
  if (enter(device, &prev) != KVF_SUCCESS) return;
  (void)cudaStreamDestroy((cudaStream_t)stream);
  leave(device, prev);
}

struct kvf_scuda_ipc_event {
  int device;
  cudaEvent_t event;
};

kvf_status kvf_scuda_ipc_event_open(int device, const uint8_t handle[64], kvf_scuda_ipc_event **out) {
  *out = NULL;
  kvf_scuda_ipc_event *ev = calloc(1, sizeof(*ev));
  if (!ev) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "ready event: out of memory");
  ev->device = device;
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) {
    free(ev);
    return st;
  }
  cudaIpcEventHandle_t h;
  memcpy(&h, handle, sizeof(h));
  cudaError_t e = cudaIpcOpenEventHandle(&ev->event, h);
  leave(device, prev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    free(ev);
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.ready_handle: cudaIpcOpenEventHandle refused it: %s",
                    cudaGetErrorString(e));
  }
  *out = ev;
  return KVF_SUCCESS;
}

kvf_status kvf_scuda_ipc_event_wait(kvf_scuda_ipc_event *ev, void *stream) {
  int prev;
  kvf_status st = enter(ev->device, &prev);
  if (st != KVF_SUCCESS) return st;
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, ev->event, 0);
  if (e != cudaSuccess) (void)cudaGetLastError();
  leave(ev->device, prev);
  if (e != cudaSuccess) return kvf_fail(KVF_ERR_CUDA, "cudaStreamWaitEvent: %s", cudaGetErrorString(e));
  return KVF_SUCCESS;
}

void kvf_scuda_ipc_event_close(kvf_scuda_ipc_event *ev) {
  if (!ev) return;
  int prev;
  if (enter(ev->device, &prev) == KVF_SUCCESS) {
    (void)cudaEventDestroy(ev->event);
    leave(ev->device, prev);
  }
  free(ev);
}

kvf_status kvf_scuda_event_record(int device, void *stream, kvf_scuda_event **out) {
  *out = NULL;
  kvf_scuda_event *ev = calloc(1, sizeof(*ev));
  if (!ev) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "event: out of memory");
  ev->device = device;
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) {
    free(ev);
    return st;
  }
  cudaError_t e = cudaEventCreateWithFlags(&ev->event, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = cudaEventRecord(ev->event, (cudaStream_t)stream);
    if (e != cudaSuccess) (void)cudaEventDestroy(ev->event);
  }
  leave(device, prev);
  if (e != cudaSuccess) {
    free(ev);
    return kvf_fail(KVF_ERR_CUDA, "device %d: completion event: %s", device, cudaGetErrorString(e));
  }
  *out = ev;
  return KVF_SUCCESS;
}

int kvf_scuda_event_done(kvf_scuda_event *ev, kvf_status *error) {
  *error = KVF_SUCCESS;
  cudaError_t e = cudaEventQuery(ev->event); /* no current-device requirement */
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  *error = kvf_fail(KVF_ERR_CUDA, "device %d: completion event: %s", ev->device, cudaGetErrorString(e));
  return 1;
}

void kvf_scuda_event_destroy(kvf_scuda_event *ev) {
  if (!ev) return;
  (void)cudaEventDestroy(ev->event);
  free(ev);
}

kvf_status kvf_scuda_stream_sync(int device, void *stream) {
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) return st;
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  leave(device, prev);
  if (e != cudaSuccess) return kvf_fail(KVF_ERR_CUDA, "device %d: cudaStreamSynchronize: %s", device, cudaGetErrorString(e));
  return KVF_SUCCESS;
}

int kvf_scuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

kvf_status kvf_scuda_thread_bind(int device) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return kvf_fail(KVF_ERR_CUDA, "device %d: cudaSetDevice: %s", device, cudaGetErrorString(e));
  return KVF_SUCCESS;
}

/* The warm-up's geometry: one region, one full-attention group of two
 * 16-token blocks, four layers of 2 planes x 2 heads x 128 bytes, 16-token
 * chunks. A chunk of block 0 is one 32 KiB object, 8 runs of 4 KiB a side
 * (4 layers, so the staged route gets its pieces). */
#define WARM_LAYERS 4u
#define WARM_BLOCKS 2u
#define WARM_TOKENS 16u

static kvf_status warm_geometry(kvf_geometry **out) {
  kvf_geometry *g = NULL;
  kvf_status st = kvf_geometry_create(&g);
  if (st != KVF_SUCCESS) return st;
  kvf_region_desc rd = KVF_REGION_DESC_INIT;
  rd.name = "warm-up";
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "full";
  gd.block_size = WARM_TOKENS;
  gd.num_blocks = WARM_BLOCKS;
  uint32_t region = 0, group = 0;
  st = kvf_geometry_add_region(g, &rd, &region);
  if (st == KVF_SUCCESS) st = kvf_geometry_add_group(g, &gd, &group);
  for (uint32_t l = 0; st == KVF_SUCCESS && l < WARM_LAYERS; l++) {
    kvf_view_desc vd = KVF_VIEW_DESC_INIT;
    vd.region = region;
    vd.elem_bytes = 2;
    vd.planes = 2;
    vd.heads = 2;
    vd.head_bytes[0] = vd.head_bytes[1] = 128;
    vd.head_stride = 128;
    vd.token_stride = 2 * 128;
    vd.plane_stride = WARM_TOKENS * vd.token_stride;
    vd.block_stride = 2 * vd.plane_stride;
    vd.offset = (uint64_t)l * WARM_BLOCKS * vd.block_stride;
    st = kvf_geometry_add_view(g, group, &vd, NULL);
  }
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  pol.chunk_tokens = WARM_TOKENS;
  if (st == KVF_SUCCESS) st = kvf_geometry_set_policy(g, &pol);
  if (st == KVF_SUCCESS) st = kvf_geometry_finalize(g, NULL);
  if (st != KVF_SUCCESS) {
    kvf_geometry_destroy(g);
    return st;
  }
  *out = g;
  return KVF_SUCCESS;
}

/* One gather and one scatter of `req` on `stream` with the context's tuning
 * set to `t` (the route it forces). */
static kvf_status warm_route(kvf_xfer *x, const kvf_xfer_tuning *t, const kvf_copy_request *req, void *stream,
                             const char *route) {
  kvf_status st = kvf_xfer_set_tuning(x, t);
  if (st == KVF_SUCCESS) st = kvf_xfer_gather(x, req, (kvf_stream)stream);
  if (st == KVF_SUCCESS) st = kvf_xfer_scatter(x, req, (kvf_stream)stream);
  if (st != KVF_SUCCESS) kvf_error_prefix("warm-up, %s route: ", route);
  return st;
}

kvf_status kvf_scuda_lane_warm(int device, void *stream) {
  kvf_geometry *g = NULL;
  kvf_xfer *x = NULL;
  void *cache = NULL, *object = NULL;
  kvf_scuda_event *ev = NULL;
  cudaError_t e = cudaSuccess;
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) return st;
  if ((st = warm_geometry(&g)) != KVF_SUCCESS) {
    kvf_error_prefix("warm-up geometry: ");
    goto out;
  }
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  uint64_t object_bytes = 0;
  if ((st = kvf_geometry_region(g, 0, &ri)) != KVF_SUCCESS ||
      (st = kvf_geometry_object_size(g, 0, 0, WARM_TOKENS, &object_bytes)) != KVF_SUCCESS)
    goto out;
  e = cudaMalloc(&cache, ri.size);
  if (e == cudaSuccess) e = cudaMemsetAsync(cache, 0, ri.size, (cudaStream_t)stream);
  if (e == cudaSuccess) e = cudaHostAlloc(&object, object_bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    st = kvf_fail(KVF_ERR_CUDA, "warm-up buffers: %s", cudaGetErrorString(e));
    goto out;
  }
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = device;
  if ((st = kvf_xfer_create(g, &xo, &x)) != KVF_SUCCESS) goto out;
  static const uint32_t ids[1] = {0};
  kvf_group_blocks gb = {ids, 0, 1};
  void *bases[1] = {cache}, *objects[1] = {object};
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.region_bases = bases;
  req.token_begin = 0;
  req.token_end = WARM_TOKENS;
  req.groups = &gb;
  req.objects = objects;
  /* The routes a request between this GPU and L1 can take (launch_cuda in
   * host/core/xfer.c): the batch API when its runs qualify, the staged
   * route, the direct kernel (captured calls, objects written in part). */
  kvf_xfer_tuning base, t;
  kvf_xfer_get_tuning(x, &base);
  if (base.batch_max_runs > 0) {
    t = base;
    t.batch_min_run = 0;
    t.batch_host_bound = 0; /* the batch route itself, whatever the host's speed */
    if ((st = warm_route(x, &t, &req, stream, "copy-batch")) != KVF_SUCCESS) goto out;
  }
  t = base;
  t.batch_max_runs = 0;
  if (base.staging_mb > 0 && (st = warm_route(x, &t, &req, stream, "staged")) != KVF_SUCCESS) goto out;
  t.staging_mb = 0;
  if ((st = warm_route(x, &t, &req, stream, "kernel")) != KVF_SUCCESS) goto out;
  /* The proof a request's completion thread waits for. */
  if ((st = kvf_scuda_event_record(device, stream, &ev)) != KVF_SUCCESS) goto out;
  e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e != cudaSuccess) {
    st = kvf_fail(KVF_ERR_CUDA, "warm-up: cudaStreamSynchronize: %s", cudaGetErrorString(e));
    goto out;
  }
  kvf_status done_st;
  (void)kvf_scuda_event_done(ev, &done_st);
  st = done_st;
out:
  if (st != KVF_SUCCESS && cache) (void)cudaStreamSynchronize((cudaStream_t)stream); /* nothing left reading them */
  kvf_scuda_event_destroy(ev);
  kvf_xfer_destroy(x);
  if (object) (void)cudaFreeHost(object);
  if (cache) (void)cudaFree(cache);
  (void)cudaGetLastError();
  kvf_geometry_destroy(g);
  leave(device, prev);
  return st;
}

static kvf_status pin_pool(int device, void *base, uint64_t bytes) {
  int prev;
  kvf_status st = enter(device, &prev);
  if (st != KVF_SUCCESS) return st;
  cudaError_t e = cudaHostRegister(base, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  leave(device, prev);
  if (e != cudaSuccess)
    return kvf_fail(KVF_ERR_CUDA, "device %d: pinning %llu bytes of L1 memory: %s", device,
                    (unsigned long long)bytes, cudaGetErrorString(e));
  return KVF_SUCCESS;
}

static void unpin_pool(void *base) { (void)cudaHostUnregister(base); }

#else /* no CUDA in this build */

struct kvf_scuda_event {
  int unused;
};

static kvf_status no_cuda(void) { return kvf_fail(KVF_ERR_UNSUPPORTED, "this build of kvferry has no CUDA"); }
kvf_status kvf_scuda_stream_create(int device, void **stream) {
  (void)device;
  *stream = NULL;
  return no_cuda();
}
void kvf_scuda_stream_destroy(int device, void *stream) {
  (void)device;
  (void)stream;
}
struct kvf_scuda_ipc_event {
  int unused;
};
kvf_status kvf_scuda_ipc_event_open(int device, const uint8_t handle[64], kvf_scuda_ipc_event **out) {
  (void)device;
  (void)handle;
  *out = NULL;
  return no_cuda();
}
kvf_status kvf_scuda_ipc_event_wait(kvf_scuda_ipc_event *event, void *stream) {
  (void)event;
  (void)stream;
  return no_cuda();
}
void kvf_scuda_ipc_event_close(kvf_scuda_ipc_event *event) { (void)event; }
kvf_status kvf_scuda_event_record(int device, void *stream, kvf_scuda_event **out) {
  (void)device;
  (void)stream;
  *out = NULL;
  return no_cuda();
}
int kvf_scuda_event_done(kvf_scuda_event *event, kvf_status *error) {
  (void)event;
  *error = KVF_SUCCESS;
  return 1;
}
void kvf_scuda_event_destroy(kvf_scuda_event *event) { (void)event; }
kvf_status kvf_scuda_stream_sync(int device, void *stream) {
  (void)device;
  (void)stream;
  return no_cuda();
}
int kvf_scuda_device_count(void) { return 0; }
kvf_status kvf_scuda_thread_bind(int device) {
  (void)device;
  return no_cuda();
}
kvf_status kvf_scuda_lane_warm(int device, void *stream) {
  (void)device;
  (void)stream;
  return no_cuda();
}
static kvf_status pin_pool(int device, void *base, uint64_t bytes) {
  (void)device;
  (void)base;
  (void)bytes;
  return no_cuda();
}
static void unpin_pool(void *base) { (void)base; }
#endif

/* Bind [base, base + bytes) to NUMA node `node` through hwloc, before the
 * pages are touched (pinning faults them in there). Best effort: a machine
 * with one node, or a kernel refusing the policy, only costs locality. */
static void bind_to_node(void *base, uint64_t bytes, int node) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return;
  if (hwloc_topology_load(topo) == 0) {
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (set) {
      hwloc_bitmap_only(set, (unsigned)node);
      if (hwloc_set_area_membind(topo, base, bytes, set, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0)
        KVF_INFO(SERVER, "L1 pool: binding to NUMA node %d failed (%s); placement left to the kernel", node,
                 strerror(errno));
      hwloc_bitmap_free(set);
    }
  }
  hwloc_topology_destroy(topo);
}

kvf_status kvf_scuda_pool_alloc(int pin_device, int numa_node, uint64_t bytes, void **base) {
  *base = NULL;
  if (bytes == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "l1_bytes: 0");
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "L1 pool of %llu bytes: mmap: %s", (unsigned long long)bytes,
                    strerror(errno));
  kvf_status st = kvf_scuda_pool_pin(pin_device, numa_node, p, bytes);
  if (st != KVF_SUCCESS) {
    munmap(p, bytes);
    return st;
  }
  *base = p;
  return KVF_SUCCESS;
}

void kvf_scuda_pool_free(int pin_device, void *base, uint64_t bytes) {
  if (!base) return;
  kvf_scuda_pool_unpin(pin_device, base);
  munmap(base, bytes);
}

kvf_status kvf_scuda_pool_pin(int pin_device, int numa_node, void *base, uint64_t bytes) {
  if (numa_node >= 0) bind_to_node(base, bytes, numa_node);
  return pin_device >= 0 ? pin_pool(pin_device, base, bytes) : KVF_SUCCESS;
}

void kvf_scuda_pool_unpin(int pin_device, void *base) {
  if (base && pin_device >= 0) unpin_pool(base);
}
