"""The package's version is the library's and the headers'."""

import re

from conftest import ROOT

import kvferry


def test_one_version_everywhere():
    cmake = re.search(r"project\(kvferry VERSION (\d+)\.(\d+)\.(\d+)",
                      (ROOT / "CMakeLists.txt").read_text())
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "python" / "pyproject.toml").read_text(),
                          re.M)
    project = tuple(int(x) for x in cmake.groups())
    assert kvferry.HEADER_VERSION == project
    assert kvferry.__version__ == pyproject.group(1) == "%d.%d.%d" % project
    assert kvferry.version_info() == project
