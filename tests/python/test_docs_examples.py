"""The examples of docs/python.md run as written.

Every ```python block runs in a fresh namespace, in a temporary directory,
except a block right after a line `<!-- not run: REASON -->` (it is reported
as skipped with the reason)."""

import re

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "python.md"


def _blocks():
    text = DOC.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[:m.start()].rstrip().splitlines()
        line = text.count("\n", 0, m.start()) + 1
        reason = None
        if before:
            skip = re.match(r"<!-- not run: (.*) -->$", before[-1].strip())
            reason = skip.group(1) if skip else None
        out.append(pytest.param(m.group(1), reason, id="line%d" % line))
    return out


BLOCKS = _blocks()


def test_the_page_has_examples():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("code, reason", BLOCKS)
def test_example(code, reason, tmp_path, monkeypatch, capsys):
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__docs__"})
