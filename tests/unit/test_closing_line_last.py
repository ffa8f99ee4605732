"""A stopping peer's closing line is its last: it waits (``VerifiedWork.settle``, up to ``SETTLE_S``) for the last
round's tending task, whose "contributions (agreement ...)" line came after "done" (fresh-user trial 44). Red team 44:
the other closing line, a swarm that ended first ("stopped early" / "not done"), came before that task's line still."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node import joining
from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig
from geomesh_p2p.round.context import SwarmEnded

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("how", [None, "synced", "behind"])
async def test_the_closing_line_comes_after_the_last_rounds_tending_lines(monkeypatch, caplog, how):
    node = PeerNode(RunConfig(seq_len=32), NodeConfig(), identity=Identity.generate())
    node.transport = SimpleNamespace(address="127.0.0.9:4000")
    tend_log = logging.getLogger("geomesh_p2p.round.rules.verified")

    async def tending() -> None:
        for _ in range(5):  # a few turns of the loop (its worker threads' answers), then its line
            await asyncio.sleep(0)
        tend_log.info("round 3: contributions (agreement / support / claimed steps): x 0.9 / 0.8 / 5")

    async def nothing(*a, **k) -> None:
        return None

    class Driver:
        eval_schedule = SimpleNamespace(note_eval=lambda *a: None)
        ended = (
            None
            if how is None
            else SwarmEnded(round=3, swarm_round=3, synced=how == "synced", why="every other peer left the run")
        )

        async def run(self, known_round: int = 0, written_by=None, resumed_with=()) -> None:
            node.verified.task = asyncio.ensure_future(tending())  # the last round's, started as its row went out

    monkeypatch.setattr(node, "start", nothing)
    monkeypatch.setattr(joining, "initial_state", nothing)
    monkeypatch.setattr(node, "shutdown", nothing)
    monkeypatch.setattr(node, "_driver", lambda: Driver())
    node.announcer = SimpleNamespace(start=lambda: None)
    node.trainer = SimpleNamespace(evaluate=lambda max_batches: 100.0)
    caplog.set_level(logging.INFO)
    await node.run()
    lines = [r.getMessage() for r in caplog.records]
    closing = [i for i, m in enumerate(lines) if m.startswith(("done (", "stopped early", "not done"))]
    tended = [i for i, m in enumerate(lines) if ": contributions (agreement" in m]
    assert len(closing) == 1 and len(tended) == 1, lines
    assert tended[0] < closing[0] and closing[0] == len(lines) - 1, lines


async def test_settle_is_bounded_and_a_cancellation_goes_through():
    """``settle`` waits at most ``timeout_s`` and never cancels the tending task (``cancel`` does, at shutdown); a
    cancellation of the stopping peer's task during it is not swallowed; a failed task is not re-raised."""
    from geomesh_p2p.round.rules.verified import VerifiedWork

    vw = VerifiedWork.__new__(VerifiedWork)  # settle reads the task only
    never = asyncio.Event()
    vw.task = asyncio.ensure_future(never.wait())
    await vw.settle(timeout_s=0.01)
    assert not vw.task.done()
    waiting = asyncio.ensure_future(vw.settle(timeout_s=600.0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not vw.task.done()  # the stop's cancellation is its own, not the tending task's
    vw.task.cancel()

    async def fails() -> None:
        raise RuntimeError("a check failed")

    vw.task = asyncio.ensure_future(fails())
    await vw.settle()
    assert isinstance(vw.task.exception(), RuntimeError)
