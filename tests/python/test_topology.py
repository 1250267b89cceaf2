"""Topology (kvferry.topology): works with and without a GPU."""

import subprocess
import sys

from conftest import ROOT, subprocess_env

import kvferry


def test_the_machine_is_read():
    t = kvferry.topology()
    assert t.num_numa_nodes >= 1 and len(t.numa_nodes) == t.num_numa_nodes
    assert t.num_cores >= 1 and t.num_pus >= t.num_cores
    assert t.cpus
    assert all(n.cpus and n.num_cores >= 0 for n in t.numa_nodes)
    assert len(t.gpus) == t.num_gpus
    if t.num_gpus == 0:
        assert t.gpu_note
    for p in t.gpus:
        assert p.worker_cpu >= 0 and p.completion_cpu >= 0 and p.local_cpus


def test_without_a_driver_there_are_no_gpus_and_a_note():
    code = ("import sys; sys.path.insert(0, %r); import kvferry; t = kvferry.topology(); "
            "print(t.num_gpus); print(t.gpu_note)" % str(ROOT / "python"))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=subprocess_env(KVF_CUDA_DISABLE="1")).stdout.splitlines()
    assert out[0] == "0" and out[1]
