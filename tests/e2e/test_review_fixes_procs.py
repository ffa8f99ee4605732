"""The process-level tests of ``tests/integration/test_review_fixes.py`` (they start OS processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import pytest
from tests.integration.test_review_fixes import REPO, _join, binary  # noqa: F401


@pytest.mark.timeout(60)
def test_binary_config_file_fails_in_one_line_via_the_console_script(tmp_path, binary):  # noqa: F811 (fixture)
    r = subprocess.run(
        [sys.executable, "-m", "peer.cli", *_join(tmp_path, "--config", str(binary))],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(REPO), "GRPC_VERBOSITY": "NONE"},
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"geomesh-peer join: config file {binary} is not UTF-8 text (byte 0)"]
