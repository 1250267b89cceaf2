"""ctypes mirrors of the public C structs, enums and constants.

Every class here is named exactly as its C struct and lists the C fields in
declaration order; ``init()`` gives what the struct's _INIT macro gives.
tests/python/test_layout.py compares all of it with what tests/python/
layout_dump.c prints from the headers (sizes, offsets, _INIT bytes, enum
values, constants), so a header change that is not carried here fails
there. When a header gains a field, add it here and in layout_dump.c.
"""

from __future__ import annotations

import ctypes
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_int32, c_uint8, c_uint16,
                    c_uint32, c_uint64, c_void_p)
from typing import Any, Dict, Type

# ---- constants (kvferry/*.h) -------------------------------------------------

MAX_REGIONS = 4096
MAX_GROUPS = 64
MAX_LAYERS_PER_GROUP = 1024
MAX_PLANES = 2
MAX_HEADS = 4096
MAX_HEAD_BYTES = 1 << 20
MAX_BLOCK_SIZE = 65536
MAX_BLOCKS = 1 << 31
MAX_STATES = 8
MAX_DCP_WORLD = 1024
MAX_CHUNK_TOKENS = 1 << 24
NAME_MAX = 64
BLOCK_SKIP = 0xFFFFFFFF
DESC_VERSION = 1
OBJECT_MAGIC = 0x4B56464F
CUDA_INFO_VERSION = 1
MEM_VERSION = 1
IPC_MAX_FDS = 253
IPC_CLOSE_FDS = 1
TOPO_VERSION = 1
TOPO_CPULIST_MAX = 256
TOPO_NOTE_MAX = 256
CLIENT_VERSION = 2
CLIENT_MAX_PIN_MS = 60000
CHUNK_KEY_BYTES = 32
CLIENT_MAX_SHARDS = 65536
DEVICE_HOST = -1
# The headers this package mirrors (kvferry/version.h).
HEADER_VERSION = (0, 1, 0)

# C macro name -> value, for the layout test.
CONSTANTS: Dict[str, int] = {
    "KVF_MAX_REGIONS": MAX_REGIONS,
    "KVF_MAX_GROUPS": MAX_GROUPS,
    "KVF_MAX_LAYERS_PER_GROUP": MAX_LAYERS_PER_GROUP,
    "KVF_MAX_PLANES": MAX_PLANES,
    "KVF_MAX_HEADS": MAX_HEADS,
    "KVF_MAX_HEAD_BYTES": MAX_HEAD_BYTES,
    "KVF_MAX_BLOCK_SIZE": MAX_BLOCK_SIZE,
    "KVF_MAX_BLOCKS": MAX_BLOCKS,
    "KVF_MAX_STATES": MAX_STATES,
    "KVF_MAX_DCP_WORLD": MAX_DCP_WORLD,
    "KVF_MAX_CHUNK_TOKENS": MAX_CHUNK_TOKENS,
    "KVF_NAME_MAX": NAME_MAX,
    "KVF_BLOCK_SKIP": BLOCK_SKIP,
    "KVF_DESC_VERSION": DESC_VERSION,
    "KVF_OBJECT_MAGIC": OBJECT_MAGIC,
    "KVF_CUDA_INFO_VERSION": CUDA_INFO_VERSION,
    "KVF_MEM_VERSION": MEM_VERSION,
    "KVF_IPC_MAX_FDS": IPC_MAX_FDS,
    "KVF_IPC_CLOSE_FDS": IPC_CLOSE_FDS,
    "KVF_TOPO_VERSION": TOPO_VERSION,
    "KVF_TOPO_CPULIST_MAX": TOPO_CPULIST_MAX,
    "KVF_TOPO_NOTE_MAX": TOPO_NOTE_MAX,
    "KVF_CLIENT_VERSION": CLIENT_VERSION,
    "KVF_CLIENT_MAX_PIN_MS": CLIENT_MAX_PIN_MS,
    "KVF_CHUNK_KEY_BYTES": CHUNK_KEY_BYTES,
    "KVF_CLIENT_MAX_SHARDS": CLIENT_MAX_SHARDS,
    "KVF_VERSION_MAJOR": HEADER_VERSION[0],
    "KVF_VERSION_MINOR": HEADER_VERSION[1],
    "KVF_VERSION_PATCH": HEADER_VERSION[2],
    "KVF_VERSION_NUMBER": HEADER_VERSION[0] * 10000 + HEADER_VERSION[1] * 100 + HEADER_VERSION[2],
    "KVF_DEVICE_HOST": DEVICE_HOST,
}

c_enum = c_int  # C enums are ints in the x86-64 and aarch64 ABIs


class _Struct(Structure):
    """A C struct; ``init()`` fills it as its _INIT macro does."""

    _init_version_: int = 0  # the version an _INIT macro puts in `version`
    _defaults_: Dict[str, Any] = {}

    @classmethod
    def init(cls):
        value = cls()
        names = [f[0] for f in cls._fields_]
        if names[:2] == ["struct_size", "version"]:
            value.struct_size = ctypes.sizeof(cls)
            value.version = cls._init_version_
        for key, item in cls._defaults_.items():
            setattr(value, key, item)
        return value


# ---- geometry.h ------------------------------------------------------------------

class kvf_region_desc(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("name", c_char_p),
                ("size", c_uint64), ("align", c_uint64)]
    _init_version_ = DESC_VERSION
    _defaults_ = {"align": 256}


class kvf_group_desc(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("name", c_char_p),
                ("kind", c_enum), ("block_size", c_uint32), ("num_blocks", c_uint32),
                ("window", c_uint32), ("chunk", c_uint32)]
    _init_version_ = DESC_VERSION
    _defaults_ = {"block_size": 16}


class kvf_state_desc(_Struct):
    _fields_ = [("offset", c_uint64), ("bytes", c_uint64)]


class kvf_view_desc(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("name", c_char_p),
                ("region", c_uint32), ("elem_bytes", c_uint32), ("offset", c_uint64),
                ("block_stride", c_uint64), ("planes", c_uint32), ("heads", c_uint32),
                ("plane_stride", c_uint64), ("token_stride", c_uint64), ("head_stride", c_uint64),
                ("head_bytes", c_uint32 * MAX_PLANES), ("num_states", c_uint32),
                ("states", kvf_state_desc * MAX_STATES), ("alias_group", c_int32),
                ("alias_layer", c_int32)]
    _init_version_ = DESC_VERSION
    _defaults_ = {"elem_bytes": 1, "alias_group": -1, "alias_layer": -1}


class kvf_object_policy(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("chunk_tokens", c_uint32),
                ("format", c_enum), ("separate_windowed", c_int), ("separate_recurrent", c_int)]
    _init_version_ = DESC_VERSION
    _defaults_ = {"chunk_tokens": 256, "separate_windowed": 1}


class kvf_geometry_error(_Struct):
    _fields_ = [("status", c_enum), ("group", c_int32), ("layer", c_int32),
                ("field", c_char * 32), ("message", c_char * 320)]


class kvf_region_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("name", c_char_p), ("size", c_uint64), ("align", c_uint64),
                ("num_views", c_uint32)]
    _init_version_ = DESC_VERSION


class kvf_group_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("name", c_char_p), ("kind", c_enum), ("block_size", c_uint32),
                ("num_blocks", c_uint32), ("window", c_uint32), ("chunk", c_uint32),
                ("num_layers", c_uint32), ("object_group", c_uint32),
                ("payload_per_block", c_uint64), ("max_block_stride", c_uint64)]
    _init_version_ = DESC_VERSION


class kvf_object_group_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("num_groups", c_uint32), ("groups", POINTER(c_uint32)),
                ("has_attention", c_int), ("has_recurrent", c_int),
                ("bytes_per_token", c_uint64), ("recurrent_bytes", c_uint64)]
    _init_version_ = DESC_VERSION


class kvf_object_header(_Struct):
    _fields_ = [("magic", c_uint32), ("header_version", c_uint16), ("format", c_uint16),
                ("fingerprint", c_uint64), ("object_group", c_uint32), ("dcp_rank", c_uint32),
                ("token_begin", c_uint64), ("token_end", c_uint64), ("payload_bytes", c_uint64)]


class kvf_geometry_load_options(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32),
                ("num_blocks_override", c_uint32)]
    _init_version_ = DESC_VERSION


# ---- copy.h ------------------------------------------------------------------------

class kvf_group_blocks(_Struct):
    _fields_ = [("block_ids", POINTER(c_uint32)), ("first_block", c_uint64), ("count", c_uint32)]


class kvf_copy_request(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32),
                ("region_bases", POINTER(c_void_p)), ("token_begin", c_uint64),
                ("token_end", c_uint64), ("format", c_enum),
                ("groups", POINTER(kvf_group_blocks)), ("objects", POINTER(c_void_p))]
    _init_version_ = DESC_VERSION


# ---- device.h ----------------------------------------------------------------------

class kvf_cuda_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("driver_version", c_int),
                ("runtime_version", c_int), ("device_count", c_int), ("message", c_char * 256)]
    _init_version_ = CUDA_INFO_VERSION


# ---- transfer.h --------------------------------------------------------------------

class kvf_xfer_options(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("device", c_int),
                ("max_sms", c_uint32), ("host_threads", c_uint32)]
    _init_version_ = DESC_VERSION
    _defaults_ = {"device": DEVICE_HOST}


class kvf_xfer_stats(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("route", c_enum),
                ("sms", c_uint32), ("tasks", c_uint32), ("payload_bytes", c_uint64)]
    _init_version_ = DESC_VERSION


# ---- memory.h ----------------------------------------------------------------------

class kvf_mem_identity(_Struct):
    _fields_ = [("instance_id", c_uint64), ("allocation_id", c_uint64), ("generation", c_uint64),
                ("size", c_uint64), ("device_uuid", c_uint8 * 16), ("provider", c_uint32),
                ("reserved0", c_uint32), ("reserved1", c_uint64)]


class kvf_mem_alloc_options(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("provider", c_enum),
                ("device", c_int), ("size", c_uint64), ("access_devices", POINTER(c_int)),
                ("num_access_devices", c_uint32), ("name", c_char_p)]
    _init_version_ = MEM_VERSION
    _defaults_ = {"provider": 1}


# ---- topology.h --------------------------------------------------------------------

class kvf_topology_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("num_numa_nodes", c_uint32),
                ("num_cores", c_uint32), ("num_pus", c_uint32), ("num_gpus", c_uint32),
                ("has_pci", c_int), ("cpus", c_char * TOPO_CPULIST_MAX),
                ("gpu_note", c_char * TOPO_NOTE_MAX)]
    _init_version_ = TOPO_VERSION


class kvf_numa_node_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("os_index", c_uint32),
                ("num_cores", c_uint32), ("memory_bytes", c_uint64),
                ("cpus", c_char * TOPO_CPULIST_MAX)]
    _init_version_ = TOPO_VERSION


class kvf_gpu_placement(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("device", c_int),
                ("pci_bus_id", c_char * 32), ("located", c_int), ("numa_node", c_int),
                ("numa_nodes", c_char * 64), ("local_cpus", c_char * TOPO_CPULIST_MAX),
                ("worker_cpu", c_int), ("completion_cpu", c_int), ("note", c_char * TOPO_NOTE_MAX)]
    _init_version_ = TOPO_VERSION


# ---- client.h ------------------------------------------------------------------------

class kvf_client_options(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("socket_dir", c_char_p),
                ("name", c_char_p), ("timeout_ms", c_uint32), ("heartbeat_thread", c_int),
                ("heartbeat_period_ms", c_uint32)]
    _init_version_ = CLIENT_VERSION


class kvf_client_info(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("client_id", c_uint64),
                ("boot_token", c_uint64), ("server_pid", c_uint32),
                ("heartbeat_period_ms", c_uint32), ("heartbeat_timeout_ms", c_uint32),
                ("protocol_version", c_uint16)]
    _init_version_ = CLIENT_VERSION


class kvf_client_region(_Struct):
    _fields_ = [("alloc", c_void_p), ("offset", c_uint64), ("length", c_uint64)]


class kvf_client_registration(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("registration_id", c_uint64),
                ("fingerprint", c_uint64), ("imports", c_uint32), ("aliases", c_uint32)]
    _init_version_ = CLIENT_VERSION


class kvf_client_stats(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("boot_token", c_uint64),
                ("registering", c_uint32), ("active", c_uint32), ("draining", c_uint32),
                ("closed_total", c_uint32), ("failed_total", c_uint32),
                ("imports", c_uint64), ("aliases", c_uint64), ("leases", c_uint64),
                ("l1_objects", c_uint64), ("l1_bytes", c_uint64), ("l1_pool_bytes", c_uint64),
                ("l1_evicted_total", c_uint64), ("stores_total", c_uint64),
                ("retrieves_total", c_uint64), ("in_flight", c_uint64), ("lanes", c_uint32)]
    _init_version_ = CLIENT_VERSION


class kvf_client_stat_record(_Struct):
    _fields_ = [("client_id", c_uint64), ("pid", c_uint32), ("name", c_char * 64),
                ("registering", c_uint32), ("active", c_uint32), ("draining", c_uint32),
                ("imports", c_uint64), ("aliases", c_uint64), ("leases", c_uint64)]


class kvf_chunk_key(_Struct):
    _fields_ = [("bytes", c_uint8 * CHUNK_KEY_BYTES)]


class kvf_client_xfer(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("registration_id", c_uint64),
                ("token_begin", c_uint64), ("token_end", c_uint64), ("format", c_enum),
                ("chunk_keys", c_void_p), ("num_chunk_keys", c_uint32),
                ("groups", POINTER(kvf_group_blocks)), ("num_groups", c_uint32),
                ("ready_event", c_void_p)]
    _init_version_ = CLIENT_VERSION


class kvf_client_result(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("status", c_enum),
                ("outcome", c_enum), ("prefix_tokens", c_uint64), ("objects_done", c_uint64),
                ("objects_present", c_uint64), ("bytes_done", c_uint64), ("num_groups", c_uint32),
                ("group_blocks", c_uint64 * MAX_GROUPS), ("num_object_groups", c_uint32),
                ("object_group_prefix", c_uint64 * MAX_GROUPS)]
    _init_version_ = CLIENT_VERSION
    _defaults_ = {"outcome": 1}


class kvf_client_register_desc(_Struct):
    """struct kvf_client_register_desc (a tag only in C: the function has the name)."""
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("geometry_json", c_char_p),
                ("geometry_len", ctypes.c_size_t), ("device", c_int), ("regions", c_void_p),
                ("num_regions", c_uint32), ("shard_index", c_uint32), ("shard_count", c_uint32)]
    _init_version_ = CLIENT_VERSION
    _defaults_ = {"device": DEVICE_HOST, "shard_count": 1}


class kvf_client_lookup_desc(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("registration_id", c_uint64),
                ("token_begin", c_uint64), ("token_end", c_uint64), ("format", c_enum),
                ("chunk_keys", c_void_p), ("num_chunk_keys", c_uint32), ("pin_ms", c_uint32)]
    _init_version_ = CLIENT_VERSION


class kvf_client_lookup_result(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("prefix_tokens", c_uint64),
                ("num_object_groups", c_uint32), ("object_group_prefix", c_uint64 * MAX_GROUPS),
                ("pin_id", c_uint64), ("pinned_chunks", c_uint32)]
    _init_version_ = CLIENT_VERSION


class kvf_client_push_desc(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("registration_id", c_uint64),
                ("token_begin", c_uint64), ("token_end", c_uint64), ("format", c_enum),
                ("chunk_keys", c_void_p), ("num_chunk_keys", c_uint32), ("peer", c_char_p)]
    _init_version_ = CLIENT_VERSION


class kvf_client_push_result(_Struct):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("objects_pushed", c_uint64),
                ("objects_present", c_uint64), ("objects_missing", c_uint64),
                ("objects_failed", c_uint64), ("bytes_pushed", c_uint64), ("chunks_on_peer", c_uint64)]
    _init_version_ = CLIENT_VERSION


class kvf_client_peer_record(_Struct):
    _fields_ = [("addr", c_char * 64), ("state", c_uint32), ("outgoing", c_uint32),
                ("boot_token", c_uint64), ("connects", c_uint64), ("objects_pulled", c_uint64),
                ("bytes_pulled", c_uint64), ("objects_served", c_uint64), ("failures", c_uint64),
                ("objects_pushed", c_uint64), ("bytes_pushed", c_uint64)]


# Every struct the package binds, by C name. Structs of the headers that the
# package does not bind yet are listed in UNBOUND, with the reason; the
# layout test requires every header struct to be in one of the two.
STRUCTS: Dict[str, Type[_Struct]] = {
    cls.__name__: cls
    for cls in (kvf_region_desc, kvf_group_desc, kvf_state_desc, kvf_view_desc,
                kvf_object_policy, kvf_geometry_error, kvf_region_info, kvf_group_info,
                kvf_object_group_info, kvf_object_header, kvf_geometry_load_options,
                kvf_group_blocks, kvf_copy_request, kvf_cuda_info, kvf_xfer_options,
                kvf_xfer_stats, kvf_mem_identity, kvf_mem_alloc_options, kvf_topology_info,
                kvf_numa_node_info, kvf_gpu_placement, kvf_client_options, kvf_client_info,
                kvf_client_region, kvf_client_registration, kvf_client_stats,
                kvf_client_stat_record, kvf_chunk_key, kvf_client_xfer, kvf_client_result,
                kvf_client_register_desc, kvf_client_lookup_desc, kvf_client_lookup_result,
                kvf_client_push_desc, kvf_client_push_result, kvf_client_peer_record)
}

UNBOUND: Dict[str, str] = {
    "kvf_import_table_options": "the import table comes in a later part of issue 13",
    "kvf_import_view": "the import table comes in a later part of issue 13",
    "kvf_import_view_info": "the import table comes in a later part of issue 13",
    "kvf_import_stats": "the import table comes in a later part of issue 13",
}

# Enums the package does not mirror yet (the import table).
UNBOUND_ENUMS: Dict[str, str] = {
    "kvf_import_reg_state": "the import table comes in a later part of issue 13",
}


def text(raw: bytes) -> str:
    """A fixed char array or char* from the library as str ("" for NULL)."""
    if raw is None:
        return ""
    return raw.decode("utf-8", errors="replace")

