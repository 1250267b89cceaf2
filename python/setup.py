"""Build hook for the kvferry package (the metadata is in pyproject.toml).

When the package is built from a kvferry source checkout (``pip install
./python``), it records the checkout's root in kvferry/_install_info.py, so
the installed package finds the library in that checkout's build tree
(build/, build/release, ...) without KVF_LIBRARY. Nothing is recorded when
the source is not a checkout (a wheel built from an sdist elsewhere).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyRecordingCheckout(build_py):
    def run(self):
        super().run()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isfile(os.path.join(root, "include", "kvferry", "kvferry.h")):
            return
        target = os.path.join(self.build_lib, "kvferry", "_install_info.py")
        with open(target, "w", encoding="utf-8") as f:
            f.write('"""Written by python/setup.py: the checkout this package was installed from."""\n')
            f.write("SOURCE_ROOT = %r\n" % root)


setup(cmdclass={"build_py": BuildPyRecordingCheckout})
