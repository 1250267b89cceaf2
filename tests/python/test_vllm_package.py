"""kvferry.vllm without vLLM: importing it imports neither vLLM nor torch, and
its config helper gives the documented --kv-transfer-config (docs/vllm.md;
tests/vllm checks vLLM takes it)."""

import subprocess
import sys

from conftest import ROOT, subprocess_env

SCRIPT = r'''
import sys
import kvferry, kvferry.vllm
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
assert not heavy, heavy
config = kvferry.vllm.offloading_transfer_config(1 << 30)
assert config["kv_connector"] == "KvferryOffloadingConnector", config
assert config["kv_connector_extra_config"]["spec_module_path"] == "kvferry.vllm.offloading"
plain = kvferry.vllm.offloading_transfer_config(1 << 30, report_failures=False, blocks_per_chunk=4)
assert plain["kv_connector"] == "OffloadingConnector" and "kv_connector_module_path" not in plain
assert plain["kv_connector_extra_config"]["blocks_per_chunk"] == 4
print(kvferry.vllm.VLLM_VERSION)
'''


def test_import_kvferry_vllm_is_light():
    out = subprocess.run([sys.executable, "-c", SCRIPT],
                         env=subprocess_env(PYTHONPATH=str(ROOT / "python")),
                         capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.33.0"


def test_vllm_version_is_the_one_the_venv_script_installs():
    text = (ROOT / "scripts" / "vllm-venv").read_text()
    assert "python/kvferry/vllm/__init__.py" in text
    import kvferry.vllm

    assert kvferry.vllm.VLLM_VERSION == "0.33.0"
