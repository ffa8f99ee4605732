"""The process-level tests of ``tests/unit/test_cli.py`` (they start OS processes)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_console_scripts_help():
    for exe in ("geomesh-peer", "geomesh-bootstrap"):
        path = os.path.join(os.path.dirname(sys.executable), exe)
        r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "usage:" in r.stdout
    r = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "geomesh-peer"), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr
