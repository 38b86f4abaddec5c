"""A newcomer's first hour (tools/newcomer.py): serve as the quick start says, run every example of the
README against that server (and the keyed and CurveZMQ ones against theirs), make the mistakes of
issue 24; every step must pass."""
from __future__ import annotations

import subprocess
import sys

import pytest

from orca_mq.server.process import ROOT

pytestmark = pytest.mark.e2e


def test_the_readme_works_for_a_newcomer(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "newcomer.py"), "--out", str(tmp_path / "newcomer.json")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " 0 failed" in out.stdout
