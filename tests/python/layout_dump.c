/*
 * layout_dump - prints, as one JSON object, what the Python package's ctypes
 * definitions must agree with: sizeof, _Alignof and every field's offset and
 * size of each public struct, the bytes each _INIT macro puts in every field,
 * the values of every public enum, and the numeric macros the package mirrors.
 *
 * tests/python/test_layout.py compares this with kvferry/_structs.py, and
 * checks that the lists below name every struct, field and enum value the
 * headers declare, so a header change that is not carried into the package
 * fails loudly instead of corrupting calls.
 *
 * Built from the public headers only; it calls nothing in the library.
 * When a header gains a field: add it to the struct's list here, and to the
 * ctypes definition in python/kvferry/_structs.py.
 */
#include <kvferry/kvferry.h>

#include <stddef.h>
#include <stdio.h>

/* ---- the lists: one per struct, fields in declaration order ------------- */

#define L_kvf_region_desc(F) F(struct_size) F(version) F(name) F(size) F(align)
#define L_kvf_group_desc(F) \
  F(struct_size) F(version) F(name) F(kind) F(block_size) F(num_blocks) F(window) F(chunk)
#define L_kvf_state_desc(F) F(offset) F(bytes)
#define L_kvf_view_desc(F)                                                                          \
  F(struct_size) F(version) F(name) F(region) F(elem_bytes) F(offset) F(block_stride) F(planes)  \
  F(heads) F(plane_stride) F(token_stride) F(head_stride) F(head_bytes) F(num_states) F(states) \
  F(alias_group) F(alias_layer)
#define L_kvf_object_policy(F) \
  F(struct_size) F(version) F(chunk_tokens) F(format) F(separate_windowed) F(separate_recurrent)
#define L_kvf_geometry_error(F) F(status) F(group) F(layer) F(field) F(message)
#define L_kvf_region_info(F) F(struct_size) F(version) F(name) F(size) F(align) F(num_views)
#define L_kvf_group_info(F)                                                                     \
  F(struct_size) F(version) F(name) F(kind) F(block_size) F(num_blocks) F(window) F(chunk) F(num_layers) F(object_group) \
  F(payload_per_block) F(max_block_stride)
#define L_kvf_object_group_info(F) \
  F(struct_size) F(version) F(num_groups) F(groups) F(has_attention) F(has_recurrent) F(bytes_per_token) F(recurrent_bytes)
#define L_kvf_object_header(F)                                                                  \
  F(magic) F(header_version) F(format) F(fingerprint) F(object_group) F(dcp_rank) F(token_begin) \
  F(token_end) F(payload_bytes)
#define L_kvf_geometry_load_options(F) F(struct_size) F(version) F(num_blocks_override)
#define L_kvf_group_blocks(F) F(block_ids) F(first_block) F(count)
#define L_kvf_copy_request(F) \
  F(struct_size) F(version) F(region_bases) F(token_begin) F(token_end) F(format) F(groups) F(objects)
#define L_kvf_cuda_info(F) \
  F(struct_size) F(version) F(driver_version) F(runtime_version) F(device_count) F(message)
#define L_kvf_xfer_options(F) F(struct_size) F(version) F(device) F(max_sms) F(host_threads)
#define L_kvf_xfer_stats(F) F(struct_size) F(version) F(route) F(sms) F(tasks) F(payload_bytes)
#define L_kvf_mem_identity(F) \
  F(instance_id) F(allocation_id) F(generation) F(size) F(device_uuid) F(provider) F(reserved0) F(reserved1)
#define L_kvf_mem_alloc_options(F) \
  F(struct_size) F(version) F(provider) F(device) F(size) F(access_devices) F(num_access_devices) F(name)
#define L_kvf_import_table_options(F) F(struct_size) F(version) F(access_devices) F(num_access_devices)
#define L_kvf_import_view(F) F(identity) F(fd) F(offset) F(size)
#define L_kvf_import_view_info(F) F(base) F(ptr) F(offset) F(size) F(mapping_size) F(device) F(identity)
#define L_kvf_import_stats(F)                                                                    \
  F(struct_size) F(version) F(registrations) F(imports) F(aliases) F(bytes_mapped) F(handles) \
  F(reservations) F(pending_closes) F(imports_total) F(dedup_total) F(rollbacks_total)
#define L_kvf_topology_info(F) \
  F(struct_size) F(version) F(num_numa_nodes) F(num_cores) F(num_pus) F(num_gpus) F(has_pci) F(cpus) F(gpu_note)
#define L_kvf_numa_node_info(F) F(struct_size) F(version) F(os_index) F(num_cores) F(memory_bytes) F(cpus)
#define L_kvf_gpu_placement(F)                                                                       \
  F(struct_size) F(version) F(device) F(pci_bus_id) F(located) F(numa_node) F(numa_nodes) F(local_cpus) \
  F(worker_cpu) F(completion_cpu) F(note)
#define L_kvf_client_options(F) \
  F(struct_size) F(version) F(socket_dir) F(name) F(timeout_ms) F(heartbeat_thread) F(heartbeat_period_ms)
#define L_kvf_client_info(F) \
  F(struct_size) F(version) F(client_id) F(boot_token) F(server_pid) F(heartbeat_period_ms) F(heartbeat_timeout_ms) F(protocol_version)
#define L_kvf_client_region(F) F(alloc) F(offset) F(length)
#define L_kvf_client_registration(F) F(struct_size) F(version) F(registration_id) F(fingerprint) F(imports) F(aliases)
#define L_kvf_client_stats(F)                                                                         \
  F(struct_size) F(version) F(boot_token) F(registering) F(active) F(draining) F(closed_total) F(failed_total) F(imports)       \
  F(aliases) F(leases) F(l1_objects) F(l1_bytes) F(l1_pool_bytes) F(l1_evicted_total) F(stores_total) \
  F(retrieves_total) F(in_flight) F(lanes)
#define L_kvf_client_stat_record(F) \
  F(client_id) F(pid) F(name) F(registering) F(active) F(draining) F(imports) F(aliases) F(leases)
#define L_kvf_chunk_key(F) F(bytes)
#define L_kvf_client_register_desc(F)                                                             \
  F(struct_size) F(version) F(geometry_json) F(geometry_len) F(device) F(regions) F(num_regions) \
  F(shard_index) F(shard_count)
#define L_kvf_client_peer_record(F) \
  F(addr) F(state) F(outgoing) F(boot_token) F(connects) F(objects_pulled) F(bytes_pulled) F(objects_served) F(failures) \
  F(objects_pushed) F(bytes_pushed)
#define L_kvf_client_xfer(F)                                                                       \
  F(struct_size) F(version) F(registration_id) F(token_begin) F(token_end) F(format) F(chunk_keys) \
  F(num_chunk_keys) F(groups) F(num_groups) F(ready_event)
#define L_kvf_client_result(F)                                                                     \
  F(struct_size) F(version) F(status) F(outcome) F(prefix_tokens) F(objects_done) F(objects_present) \
  F(bytes_done) F(num_groups) F(group_blocks) F(num_object_groups) F(object_group_prefix)
#define L_kvf_client_lookup_desc(F)                                                                \
  F(struct_size) F(version) F(registration_id) F(token_begin) F(token_end) F(format) F(chunk_keys) \
  F(num_chunk_keys) F(pin_ms)
#define L_kvf_client_lookup_result(F)                                                              \
  F(struct_size) F(version) F(prefix_tokens) F(num_object_groups) F(object_group_prefix) F(pin_id) \
  F(pinned_chunks)
#define L_kvf_client_push_desc(F)                                                                  \
  F(struct_size) F(version) F(registration_id) F(token_begin) F(token_end) F(format) F(chunk_keys) \
  F(num_chunk_keys) F(peer)
#define L_kvf_client_push_result(F)                                                                \
  F(struct_size) F(version) F(objects_pushed) F(objects_present) F(objects_missing)                \
  F(objects_failed) F(bytes_pushed) F(chunks_on_peer)

/* Every struct: (type). */
#define STRUCTS(S)                                                                                 \
  S(kvf_region_desc) S(kvf_group_desc) S(kvf_state_desc) S(kvf_view_desc) S(kvf_object_policy)   \
  S(kvf_geometry_error) S(kvf_region_info) S(kvf_group_info) S(kvf_object_group_info)            \
  S(kvf_object_header) S(kvf_geometry_load_options) S(kvf_group_blocks) S(kvf_copy_request)      \
  S(kvf_cuda_info) S(kvf_xfer_options) S(kvf_xfer_stats) S(kvf_mem_identity)                     \
  S(kvf_mem_alloc_options) S(kvf_import_table_options) S(kvf_import_view) S(kvf_import_view_info) \
  S(kvf_import_stats) S(kvf_topology_info) S(kvf_numa_node_info) S(kvf_gpu_placement)            \
  S(kvf_client_options) S(kvf_client_info) S(kvf_client_region) S(kvf_client_registration)       \
  S(kvf_client_stats) S(kvf_client_stat_record) S(kvf_client_peer_record) S(kvf_chunk_key) S(kvf_client_xfer) S(kvf_client_result) \
  S(kvf_client_lookup_desc) S(kvf_client_lookup_result) S(kvf_client_push_desc) S(kvf_client_push_result)

/* Structs declared as a tag only (struct kvf_client_register_desc: a typedef
 * cannot share the name of the function that takes it). */
#define TAG_STRUCTS(S) S(kvf_client_register_desc)
#define TAG_INITS(I) I(kvf_client_register_desc, KVF_CLIENT_REGISTER_DESC_INIT)

/* Every _INIT macro: (type, macro). */
#define INITS(I)                                                                                  \
  I(kvf_region_desc, KVF_REGION_DESC_INIT) I(kvf_group_desc, KVF_GROUP_DESC_INIT)                 \
  I(kvf_view_desc, KVF_VIEW_DESC_INIT) I(kvf_object_policy, KVF_OBJECT_POLICY_INIT)               \
  I(kvf_geometry_load_options, KVF_GEOMETRY_LOAD_OPTIONS_INIT)                                    \
  I(kvf_copy_request, KVF_COPY_REQUEST_INIT) I(kvf_cuda_info, KVF_CUDA_INFO_INIT)                 \
  I(kvf_xfer_options, KVF_XFER_OPTIONS_INIT) I(kvf_xfer_stats, KVF_XFER_STATS_INIT)               \
  I(kvf_mem_alloc_options, KVF_MEM_ALLOC_OPTIONS_INIT)                                            \
  I(kvf_import_table_options, KVF_IMPORT_TABLE_OPTIONS_INIT) I(kvf_import_stats, KVF_IMPORT_STATS_INIT) \
  I(kvf_topology_info, KVF_TOPOLOGY_INFO_INIT) I(kvf_numa_node_info, KVF_NUMA_NODE_INFO_INIT)     \
  I(kvf_gpu_placement, KVF_GPU_PLACEMENT_INIT) I(kvf_client_options, KVF_CLIENT_OPTIONS_INIT)     \
  I(kvf_client_info, KVF_CLIENT_INFO_INIT) I(kvf_client_registration, KVF_CLIENT_REGISTRATION_INIT) \
  I(kvf_client_stats, KVF_CLIENT_STATS_INIT) I(kvf_client_xfer, KVF_CLIENT_XFER_INIT)            \
  I(kvf_client_result, KVF_CLIENT_RESULT_INIT)                                                \
  I(kvf_client_lookup_desc, KVF_CLIENT_LOOKUP_DESC_INIT)                                          \
  I(kvf_client_lookup_result, KVF_CLIENT_LOOKUP_RESULT_INIT)                                      \
  I(kvf_client_push_desc, KVF_CLIENT_PUSH_DESC_INIT) I(kvf_client_push_result, KVF_CLIENT_PUSH_RESULT_INIT)

/* Every enum: (type, values...). */
#define ENUMS(E, V)                                                                                  \
  E(kvf_status, V(KVF_SUCCESS) V(KVF_ERR_INVALID_ARGUMENT) V(KVF_ERR_INVALID_GEOMETRY)              \
    V(KVF_ERR_OUT_OF_MEMORY) V(KVF_ERR_OVERFLOW) V(KVF_ERR_NOT_FOUND) V(KVF_ERR_PARSE) V(KVF_ERR_IO) \
    V(KVF_ERR_NO_DRIVER) V(KVF_ERR_NO_DEVICE) V(KVF_ERR_CUDA) V(KVF_ERR_UNSUPPORTED)                 \
    V(KVF_ERR_GEOMETRY_MISMATCH) V(KVF_ERR_STATE) V(KVF_ERR_SYSTEM) V(KVF_ERR_INTERNAL)             \
    V(KVF_ERR_TIMEOUT) V(KVF_ERR_BUSY) V(KVF_ERR_PROTOCOL) V(KVF_ERR_PERMISSION)                    \
    V(KVF_ERR_DISCONNECTED))                                                                         \
  E(kvf_group_kind, V(KVF_GROUP_FULL) V(KVF_GROUP_SLIDING_WINDOW) V(KVF_GROUP_CHUNKED_LOCAL)        \
    V(KVF_GROUP_RECURRENT))                                                                          \
  E(kvf_object_format, V(KVF_FORMAT_CANONICAL) V(KVF_FORMAT_NATIVE))                               \
  E(kvf_xfer_route, V(KVF_ROUTE_HOST) V(KVF_ROUTE_D2D) V(KVF_ROUTE_D2H) V(KVF_ROUTE_H2D)           \
    V(KVF_ROUTE_PEER) V(KVF_ROUTE_HOST_TO_HOST))                                                     \
  E(kvf_mem_provider, V(KVF_MEM_PROVIDER_HOST) V(KVF_MEM_PROVIDER_CUMEM))                          \
  E(kvf_import_reg_state, V(KVF_IMPORT_REG_REGISTERING) V(KVF_IMPORT_REG_ACTIVE)                   \
    V(KVF_IMPORT_REG_CLOSING) V(KVF_IMPORT_REG_CLOSED) V(KVF_IMPORT_REG_FAILED))                     \
  E(kvf_client_outcome, V(KVF_CLIENT_DONE) V(KVF_CLIENT_FAILED) V(KVF_CLIENT_CANCELLED)            \
    V(KVF_CLIENT_TIMED_OUT))                                                                         \
  E(kvf_client_op, V(KVF_CLIENT_STORE) V(KVF_CLIENT_RETRIEVE))

/* Numeric macros (all fit in an unsigned long long, KVF_DEVICE_HOST aside). */
#define CONSTANTS(C)                                                                                \
  C(KVF_MAX_REGIONS) C(KVF_MAX_GROUPS) C(KVF_MAX_LAYERS_PER_GROUP) C(KVF_MAX_PLANES) C(KVF_MAX_HEADS) \
  C(KVF_MAX_HEAD_BYTES) C(KVF_MAX_BLOCK_SIZE) C(KVF_MAX_BLOCKS) C(KVF_MAX_STATES)                   \
  C(KVF_MAX_DCP_WORLD) C(KVF_MAX_CHUNK_TOKENS) C(KVF_NAME_MAX) C(KVF_BLOCK_SKIP) C(KVF_DESC_VERSION) \
  C(KVF_OBJECT_MAGIC) C(KVF_CUDA_INFO_VERSION) C(KVF_MEM_VERSION) C(KVF_IPC_MAX_FDS)                 \
  C(KVF_IPC_CLOSE_FDS) C(KVF_TOPO_VERSION) C(KVF_TOPO_CPULIST_MAX) C(KVF_TOPO_NOTE_MAX)              \
  C(KVF_CLIENT_VERSION) C(KVF_CHUNK_KEY_BYTES) C(KVF_CLIENT_MAX_SHARDS) C(KVF_CLIENT_MAX_PIN_MS)    \
  C(KVF_VERSION_MAJOR) C(KVF_VERSION_MINOR) C(KVF_VERSION_PATCH)                                 \
  C(KVF_VERSION_NUMBER)

/* ---- printing ------------------------------------------------------------ */

static const char *sep = "";

static void field(const char *name, size_t offset, size_t size) {
  printf("%s\n      [\"%s\", %zu, %zu]", sep, name, offset, size);
  sep = ",";
}

static void init_field(const char *name, const unsigned char *bytes, size_t size) {
  printf("%s\n      \"%s\": \"", sep, name);
  for (size_t i = 0; i < size; i++) printf("%02x", bytes[i]);
  printf("\"");
  sep = ",";
}

#define FIELD(f) field(#f, offsetof(cur_t, f), sizeof(((cur_t *)0)->f));
#define INIT_FIELD(f) init_field(#f, bytes + offsetof(cur_t, f), sizeof(((cur_t *)0)->f));

#define DUMP_STRUCT_AS(T, TYPE)                                                                      \
  static void dump_##T(void) {                                                                \
    typedef TYPE cur_t;                                                                          \
    printf("%s\n    \"%s\": {\"size\": %zu, \"align\": %zu, \"fields\": [", struct_sep, #T,   \
           sizeof(cur_t), (size_t)_Alignof(cur_t));                                           \
    struct_sep = ",";                                                                         \
    sep = "";                                                                                 \
    L_##T(FIELD) printf("]}");                                                                \
  }
#define DUMP_STRUCT(T) DUMP_STRUCT_AS(T, T)
#define DUMP_TAG_STRUCT(T) DUMP_STRUCT_AS(T, struct T)
#define DUMP_INIT_AS(T, TYPE, NAME, ...)                                                              \
  static void init_##T(void) {                                                                \
    typedef TYPE cur_t;                                                                          \
    const cur_t value = __VA_ARGS__;                                                          \
    const unsigned char *bytes = (const unsigned char *)&value;                               \
    printf("%s\n    \"%s\": {\"macro\": \"%s\", \"fields\": {", struct_sep, #T, NAME);        \
    struct_sep = ",";                                                                         \
    sep = "";                                                                                 \
    L_##T(INIT_FIELD) printf("}}");                                                           \
  }
/* INIT is named before it is expanded: its braces hold commas. */
#define DUMP_INIT(T, INIT) DUMP_INIT_AS(T, T, #INIT, INIT)
#define DUMP_TAG_INIT(T, INIT) DUMP_INIT_AS(T, struct T, #INIT, INIT)

static const char *struct_sep = "";
STRUCTS(DUMP_STRUCT)
TAG_STRUCTS(DUMP_TAG_STRUCT)
INITS(DUMP_INIT)
TAG_INITS(DUMP_TAG_INIT)

#define CALL_STRUCT(T) dump_##T();
#define CALL_INIT(T, INIT) init_##T();
#define ENUM_VALUE(v) printf("%s\n      \"%s\": %lld", sep, #v, (long long)(v)), sep = ",";
#define ENUM_BLOCK(T, VALUES)                                             \
  printf("%s\n    \"%s\": {", struct_sep, #T), struct_sep = ",", sep = ""; \
  VALUES printf("}");
#define CONSTANT(c) printf("%s\n    \"%s\": %llu", sep, #c, (unsigned long long)(c)), sep = ",";

int main(void) {
  printf("{\n  \"structs\": {");
  STRUCTS(CALL_STRUCT)
  TAG_STRUCTS(CALL_STRUCT)
  printf("\n  },\n  \"defaults\": {");
  struct_sep = "";
  INITS(CALL_INIT)
  TAG_INITS(CALL_INIT)
  printf("\n  },\n  \"enums\": {");
  struct_sep = "";
  ENUMS(ENUM_BLOCK, ENUM_VALUE)
  printf("\n  },\n  \"constants\": {");
  sep = "";
  CONSTANTS(CONSTANT)
  printf(",\n    \"KVF_DEVICE_HOST\": %d", KVF_DEVICE_HOST);
  printf("\n  }\n}\n");
  return 0;
}
