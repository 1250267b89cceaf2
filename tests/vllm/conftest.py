"""Tests of kvferry.vllm against the real vLLM package, on the CPU.

Run with an interpreter that has vLLM (tests/vllm/run_pytest.sh finds one:
the ctest ``vllm_tests``, label ``vllm``); every test skips, saying why,
where vLLM is missing or is not the pinned release.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import kvferry.vllm  # noqa: E402  (imports neither vLLM nor torch)

try:
    import vllm  # noqa: F401

    VLLM_ERROR = None
    if vllm.__version__.split("+")[0] != kvferry.vllm.VLLM_VERSION and \
            not os.environ.get("KVF_VLLM_ANY_VERSION"):
        VLLM_ERROR = ("vLLM %s is installed, the adapters are pinned to %s (scripts/vllm-venv "
                      "makes that venv; KVF_VLLM_ANY_VERSION=1 runs anyway)"
                      % (vllm.__version__, kvferry.vllm.VLLM_VERSION))
except ImportError as exc:
    VLLM_ERROR = ("vLLM is not installed for %s (%s): make the venv with scripts/vllm-venv "
                  "BUILD_DIR and run ctest -L vllm" % (sys.executable, exc))


def pytest_collection_modifyitems(config, items):
    if VLLM_ERROR is None:
        return
    skip = pytest.mark.skip(reason=VLLM_ERROR)
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    import kvferry

    return ["kvferry %s from %s" % (kvferry.version(), kvferry.library_path()),
            "vllm: %s" % (VLLM_ERROR or vllm.__version__)]
