"""kvferry inside vLLM: adapters loaded by vLLM by module path (no vLLM fork).

Importing this package imports neither vLLM nor torch; the adapters import
them when vLLM loads them (or when an attribute below is first read).

- :mod:`kvferry.vllm.offloading` (in process): an offloading spec for vLLM's
  ``OffloadingConnector``. vLLM's own CPU-side manager (LRU/ARC policies,
  the CPU chunk pool) decides what is stored and loaded; kvferry moves the
  blocks between the KV cache and pinned host memory, one kvf_xfer call per
  job on the job's own stream, with kvferry's canonical objects in the CPU
  pool. :class:`KvferryOffloadingConnector` is vLLM's ``OffloadingConnector``
  plus two things its spec API cannot do alone: it hands the registered KV
  cache tensors and the KV cache config to the spec (so the geometry has
  tokens, heads and K/V planes), and it reports failed loads to the
  scheduler instead of vLLM's assertion.
- :mod:`kvferry.vllm.connector` (served): :class:`KvferryConnector`, a KV
  connector over kvferryd (kvferry.client): the KV cache is registered with
  kvferryd, hits are LOOKUPs, loads RETRIEVEs and finished chunks STOREs,
  named by keys derived from vLLM's block hashes; the objects outlive the
  engine.

docs/vllm.md has the ``--kv-transfer-config`` lines, what moves when, and
the limits. The adapters are written against vLLM :data:`VLLM_VERSION`.
"""

from __future__ import annotations

from typing import Any, Dict

#: The vLLM release the adapters are written and tested against.
VLLM_VERSION = "0.33.0"

#: ``spec_module_path`` / ``kv_connector_module_path`` for vLLM's config.
OFFLOADING_MODULE = "kvferry.vllm.offloading"
#: ``kv_connector_module_path`` of the served connector.
CONNECTOR_MODULE = "kvferry.vllm.connector"

_LAZY = {
    "KvferryOffloadingSpec": OFFLOADING_MODULE,
    "KvferryOffloadingWorker": OFFLOADING_MODULE,
    "KvferryOffloadingConnector": OFFLOADING_MODULE,
    "KvferryConnector": CONNECTOR_MODULE,
    "served_transfer_config": CONNECTOR_MODULE,
    "host_kv_caches": CONNECTOR_MODULE,
}

__all__ = ["VLLM_VERSION", "OFFLOADING_MODULE", "CONNECTOR_MODULE", "offloading_transfer_config",
           *_LAZY]


def offloading_transfer_config(cpu_bytes_to_use: int, *, report_failures: bool = True,
                               **extra_config: Any) -> Dict[str, Any]:
    """The ``--kv-transfer-config`` of the in-process offloading, as a dict
    (``json.dumps`` it for the command line, or pass it to
    ``vllm.config.KVTransferConfig(**...)``).

    Args:
        cpu_bytes_to_use: bytes of pinned host memory for the CPU pool, all
            workers of the engine together (vLLM's ``cpu_bytes_to_use``).
        report_failures: use :class:`KvferryOffloadingConnector` (failed
            loads are reported and recomputed, the geometry has tokens,
            heads and planes) rather than vLLM's plain
            ``OffloadingConnector`` (vLLM asserts on a failed transfer, and
            the spec sees only pages).
        extra_config: more ``kv_connector_extra_config`` keys
            (``blocks_per_chunk``, ``eviction_policy``, ``kvferry_max_sms``...).
    """
    extra: Dict[str, Any] = {
        "spec_name": "KvferryOffloadingSpec",
        "spec_module_path": OFFLOADING_MODULE,
        "cpu_bytes_to_use": int(cpu_bytes_to_use),
    }
    extra.update(extra_config)
    config: Dict[str, Any] = {}
    if report_failures:
        config["kv_connector"] = "KvferryOffloadingConnector"
        config["kv_connector_module_path"] = OFFLOADING_MODULE
    else:
        config["kv_connector"] = "OffloadingConnector"
    config["kv_role"] = "kv_both"
    if report_failures:
        config["kv_load_failure_policy"] = "recompute"
    config["kv_connector_extra_config"] = extra
    return config


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    import importlib

    return getattr(importlib.import_module(module), name)
