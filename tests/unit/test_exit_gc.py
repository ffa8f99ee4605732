"""A peer's command registers the heap freeze that spares its exit the full collections over imported modules
(geomesh_p2p/util/exit_gc.py), once per process, and the handler leaves the heap frozen for finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import peer.cli
from geomesh_p2p.util import exit_gc

pytestmark = pytest.mark.timeout(60)


def test_main_registers_the_freeze_once(monkeypatch, capsys):
    registered: list = []
    monkeypatch.setattr(exit_gc, "_installed", False)
    monkeypatch.setattr(exit_gc.atexit, "register", registered.append)
    assert peer.cli.main([]) == 0  # no command: prints the help
    assert peer.cli.main([]) == 0
    capsys.readouterr()
    assert registered == [exit_gc.freeze_heap]


def test_the_heap_is_frozen_when_the_interpreter_finalizes():
    # A probe registered before the freeze runs after it (atexit is last-in-first-out) and prints how many
    # objects the collections of Py_FinalizeEx will skip; without the handler that count is 0.
    code = textwrap.dedent(
        """
        import atexit, gc
        atexit.register(lambda: print("frozen", gc.get_freeze_count(), flush=True))
        from geomesh_p2p.util import exit_gc
        exit_gc.skip_exit_collections()
        exit_gc.skip_exit_collections()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    frozen = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("frozen")]
    assert len(frozen) == 1 and frozen[0] > 1000, out
    assert out.stderr == ""
