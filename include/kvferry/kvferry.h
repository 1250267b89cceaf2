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
 * Structs passed in or filled start with struct_size and version: fill them
 * from their _INIT macro (the rule is below). Details in kvferry/status.h.
 *
 * Versioned structs, the one rule. A struct that starts with
 * `uint32_t struct_size; uint32_t version;` is filled from its _INIT macro
 * (KVF_XFER_OPTIONS_INIT for kvf_xfer_options, and so on), which sets
 * struct_size to the sizeof the caller was compiled with. The size decides:
 *   - an older caller (a smaller struct_size) keeps working: the library
 *     starts from its own _INIT values and takes the caller's bytes only up
 *     to struct_size, so the fields the caller does not know take their
 *     defaults;
 *   - a newer caller (a struct_size larger than the library's sizeof) is
 *     accepted when every byte past the library's sizeof is zero, and
 *     refused otherwise (it asks for something this library cannot do);
 *   - struct_size below the 8-byte header or above 64 KiB, and version 0,
 *     are refused. version is otherwise informational: any nonzero value.
 * Refusals are KVF_ERR_INVALID_ARGUMENT, with kvf_last_error() naming the
 * struct and the field ("kvf_client_options.struct_size 0: fill it from
 * KVF_CLIENT_OPTIONS_INIT"). Structs the library fills (stats, infos,
 * results, kvf_view_desc and kvf_object_policy read back) follow the same
 * rule: the library writes only the fields it knows that fit in the
 * caller's struct_size, never the caller's struct_size and version, and
 * nothing when it fails (unless the function says otherwise, as
 * kvf_cuda_probe does; never for a struct that breaks the rule). The
 * server's internal structs follow the same rule. Fields are only ever
 * appended, each new one
 * starting at or after the old sizeof (explicit padding first where the old
 * struct ended in padding), with a default of 0 where one can serve, so a
 * newer caller that leaves it alone still works with an older library.
 *
 * Versioned: kvf_region_desc, kvf_group_desc, kvf_view_desc,
 * kvf_object_policy, kvf_geometry_load_options, kvf_region_info,
 * kvf_group_info, kvf_object_group_info (geometry.h); kvf_copy_request
 * (copy.h); kvf_cuda_info (device.h); kvf_xfer_options, kvf_xfer_stats
 * (transfer.h); kvf_mem_alloc_options, kvf_import_table_options,
 * kvf_import_stats (memory.h); kvf_topology_info, kvf_numa_node_info,
 * kvf_gpu_placement (topology.h); kvf_client_options, kvf_client_info,
 * kvf_client_register_desc, kvf_client_registration, kvf_client_stats,
 * kvf_client_xfer, kvf_client_result (client.h).
 *
 * Fixed layouts, never extended (a change would be a new struct), so they
 * carry no header:
 *   - array elements, whose stride is the element's size: kvf_group_blocks,
 *     kvf_state_desc, kvf_import_view, kvf_import_view_info,
 *     kvf_client_region, kvf_client_stat_record, kvf_client_peer_record, kvf_chunk_key;
 *   - layouts that travel between processes or are stored with objects:
 *     kvf_mem_identity, kvf_object_header (their own version fields, where
 *     they have one, belong to that format);
 *   - kvf_geometry_error, the detail of a failure: filled on failure, so a
 *     header the caller forgot to set would hide the real error.
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
