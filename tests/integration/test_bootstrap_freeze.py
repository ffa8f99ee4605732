"""``geomesh-bootstrap`` freezes its start-up heap as ``geomesh-peer join`` does (geomesh_p2p/util/exit_gc.py): once
its imports, servers and saved state are built, when ``main()`` runs as the process itself (its arguments from the
command line), never for ``main([...])`` in a test process. Session 44: the bootstrap never froze it, so each full
collection of its run went over the imports' objects (hivemind loads torch). A real bootstrap is served in this
process; the freeze is undone at once (``gc.unfreeze``)."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest

from bootstrap import cli
from geomesh_p2p.util import exit_gc

pytestmark = pytest.mark.timeout(120)


def _argv(tmp_path) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--identity",
        str(tmp_path / "b.key"),
        "--state-file",
        "",
        "--pow-bits",
        "0",
    ]


def _serve_once(main_call) -> int:
    """Run ``main_call()`` (a bootstrap serving in this process): the ``spy`` fixture stops it with SIGINT once it
    reached its freeze; a timer does after 60 s if it never does."""
    fallback = threading.Timer(60.0, os.kill, (os.getpid(), signal.SIGINT))
    fallback.start()
    try:
        return main_call()
    finally:
        fallback.cancel()


@pytest.fixture
def spy(monkeypatch, capsys):
    """``bootstrap.cli.freeze_startup_heap`` wrapped: each call appends ``(froze, objects frozen, what the
    bootstrap had printed by then)``, undoes the freeze, and stops the bootstrap (SIGINT: its stop event)."""
    monkeypatch.setattr(exit_gc, "_armed", False)
    seen: list = []
    real = exit_gc.freeze_startup_heap

    def freeze() -> bool:
        froze = real()
        count = gc.get_freeze_count()
        gc.unfreeze()  # this test process's objects stay collectable
        seen.append((froze, count, capsys.readouterr().out))
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return froze

    monkeypatch.setattr(cli, "freeze_startup_heap", freeze, raising=False)
    return seen


def test_the_bootstrap_freezes_its_start_up_heap_as_its_own_process(tmp_path, monkeypatch, spy, capsys):
    monkeypatch.setattr(sys, "argv", ["geomesh-bootstrap", *_argv(tmp_path)])
    assert gc.get_freeze_count() == 0
    assert _serve_once(cli.main) == 0
    assert len(spy) == 1, spy
    froze, count, printed = spy[0]
    assert froze is True
    # its imports (grpc, hivemind, torch: this process has them too) and more: ~10^5 objects, not a handful
    assert count > 50_000, count
    # after its server listened and it said how to join it: the start's objects are in
    assert "DHT node serving on 127.0.0.1:" in printed and "peers join with: --bootstrap 127.0.0.1:" in printed
    assert exit_gc._armed is False and gc.get_freeze_count() == 0


def test_main_with_arguments_never_freezes(tmp_path, spy, capsys):
    """``main([...])`` (a test, or code that embeds it): its process's objects would never be collected again."""
    assert _serve_once(lambda: cli.main(_argv(tmp_path))) == 0
    assert [(froze, count) for froze, count, _ in spy] == [(False, 0)]
