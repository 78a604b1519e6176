"""The JupyterLab extension's unit tests (jest: labextension/test/*.spec.ts), run from pytest.

The package build (``pip install -e .``) runs ``npm install`` in labextension/, which brings jest
and ts-jest (devDependencies); the specs test the status bar's and the panel's words read from
the server's status JSON, the countdown and ETAs, and the kinds generated from the Python tables.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent.parent / "labextension"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (the extension's build needs it too)")
def test_the_lab_extension_unit_tests_pass():
    jest = LAB / "node_modules" / ".bin" / "jest"
    assert jest.exists(), "labextension/node_modules has no jest: run `npm install` in labextension/ (pip install -e . does)"
    r = subprocess.run([str(jest), "--ci", "--colors=false"], check=False, cwd=LAB, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "Tests:" in out and " passed" in out and "failed" not in out, out[-3000:]
