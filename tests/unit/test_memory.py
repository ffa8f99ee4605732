def test_malloc_arenas_are_capped_unless_the_environment_sets_them(monkeypatch):
    """limit_malloc_arenas: glibc's mallopt(M_ARENA_MAX, 2) succeeds (True); a MALLOC_ARENA_MAX in the environment
    is the user's choice and is left alone (False)."""
    from geomesh_p2p.model.memory import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_malloc_arenas() is True


def test_the_peer_cli_caps_the_arenas_before_anything_else(monkeypatch):
    """Session 41: glibc fixes its arena limit when a second thread first allocates, so the cap must come before
    the parser, the imports of torch and the node's threads: ``geomesh-peer``'s main calls it first."""
    import peer.cli as cli

    order: list[str] = []
    monkeypatch.setattr(cli, "limit_malloc_arenas", lambda: order.append("arenas"))
    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: (order.append("parser"), real())[1])
    assert cli.main([]) == 0  # no command: the help
    assert order == ["arenas", "parser"]


def test_a_late_cap_is_too_late_and_an_early_one_holds(tmp_path):
    """Why the cap comes first: in a fresh process, threads that allocated before ``mallopt(M_ARENA_MAX)`` leave glibc
    with its default limit (8 per core); capped first, every later thread shares the 2 arenas (``malloc_info``)."""
    import subprocess
    import sys

    script = tmp_path / "arenas.py"
    script.write_text(
        """
import ctypes, os, sys, tempfile, threading
from geomesh_p2p.util.malloc import limit_malloc_arenas

def burst():
    def work():
        for _ in range(50):
            blocks = [ctypes.create_string_buffer(100_000) for _ in range(20)]
    ts = [threading.Thread(target=work) for _ in range(6)]
    [t.start() for t in ts]
    [t.join() for t in ts]

if sys.argv[1] == "early":
    assert limit_malloc_arenas()
burst()
if sys.argv[1] == "late":
    assert limit_malloc_arenas()
burst()
libc = ctypes.CDLL("libc.so.6")
libc.fdopen.restype = ctypes.c_void_p
f = tempfile.TemporaryFile()
fp = libc.fdopen(os.dup(f.fileno()), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp))
libc.fflush(ctypes.c_void_p(fp))
f.seek(0)
print(f.read().decode().count("<heap nr="))
"""
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def arenas(when: str) -> int:
        out = subprocess.run([sys.executable, str(script), when], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert arenas("early") <= 2
    assert arenas("late") > 2


def test_the_mmap_threshold_is_fixed_unless_the_environment_sets_it_and_refused_out_of_glibcs_range(monkeypatch):
    """set_mmap_threshold (issue 27, session 42): glibc's mallopt(M_MMAP_THRESHOLD) succeeds (True) in 1 .. 32 MiB;
    a MALLOC_MMAP_THRESHOLD_ in the environment is the user's (False); outside the range a ValueError."""
    import pytest

    from geomesh_p2p.util.malloc import set_mmap_threshold

    with pytest.raises(ValueError, match="outside 1 .. 32 MiB"):
        set_mmap_threshold(0)
    with pytest.raises(ValueError, match="outside 1 .. 32 MiB"):
        set_mmap_threshold((32 << 20) + 1)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert set_mmap_threshold(4 << 20) is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert set_mmap_threshold(32 << 20) is True  # glibc's default maximum: the dynamic threshold's own ceiling


def test_join_fixes_the_mmap_threshold_from_its_flag_or_the_memory_budget(monkeypatch):
    """``--mmap-threshold-mib`` wins; unset, ``--memory-budget-gb`` means 4 MiB (LOW_MEMORY_MMAP_MIB); neither:
    glibc's own threshold is left alone; 0 leaves it alone too."""
    from types import SimpleNamespace

    import peer.node_cli as node_cli

    calls: list[int] = []
    monkeypatch.setattr(node_cli, "set_mmap_threshold", lambda n: calls.append(n) or True)
    for mib, budget, want in [
        (None, None, []),
        (None, 6.0, [4 << 20]),
        (0.0, 6.0, []),
        (2.5, None, [int(2.5 * 2**20)]),
        (16, 6.0, [16 << 20]),
    ]:
        calls.clear()
        node_cli._mmap_threshold(SimpleNamespace(mmap_threshold_mib=mib, memory_budget_gb=budget))
        assert calls == want, (mib, budget)
