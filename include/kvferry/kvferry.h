/*
 * kvferry/kvferry.h - the whole public API of kvferry in one include.
 *
 * kvferry moves paged LLM KV-cache blocks between an inference engine's KV
 * cache and contiguous cache objects.
 *
 * Error convention, the same everywhere: every function that can fail
 * returns a kvf_status (KVF_SUCCESS is 0, values pinned forever); on failure
 * kvf_last_error() holds a per-thread message naming the field or call that
 * failed; results come back through out-parameters, which stay untouched on
 * failure unless a function says otherwise; destroy(NULL) is a no-op.
 * Structs passed in start with struct_size and version: fill them from their
 * _INIT macro. Details in kvferry/status.h.
 *
 * Subsystem headers (each opens with its threading and stream rules):
 *   kvferry/status.h    status codes, kvf_last_error(), kvf_version()
 *   kvferry/version.h   KVF_VERSION_* of these headers (compare with kvf_version())
 *   kvferry/geometry.h  where the KV cache's bytes live and how they map to objects
 *   kvferry/copy.h      copy requests and the CPU reference gather/scatter
 *   kvferry/device.h    probing the CUDA driver and devices
 *   kvferry/transfer.h  gather/scatter on a GPU (one kernel launch) or on the host
 *   kvferry/memory.h    exportable allocations, descriptor passing, the import table
 *   kvferry/topology.h  GPUs, NUMA nodes and the cores each GPU's threads are pinned to
 *   kvferry/client.h    an engine's connection to kvferryd: register, heartbeat, stat
 */
#ifndef KVFERRY_KVFERRY_H
#define KVFERRY_KVFERRY_H

#include <kvferry/status.h>
#include <kvferry/version.h>
#include <kvferry/geometry.h>
#include <kvferry/copy.h>
#include <kvferry/device.h>
#include <kvferry/transfer.h>
#include <kvferry/memory.h>
#include <kvferry/topology.h>
#include <kvferry/client.h>

#endif /* KVFERRY_KVFERRY_H */
