"""Issue 29 #5: a peer alive but stuck. A checkpoint write that hung was awaited with no timeout while the
announcer kept the peer's record fresh: it was planned, failed its parts and stayed on the status page as a
live ghost. Liveness is progress now: the announcer refreshes the record only while the round loop advances
(``ProgressWatchdog``), and the write is abandoned after its timeout so the loop goes on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.dht.announce import PeerAnnouncer
from geomesh_p2p.model import state as gstate
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.node.checkpoints import Checkpointer
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig
from geomesh_p2p.node.watchdog import STALL_SLACK_S, ProgressWatchdog, stall_bound_s
from geomesh_p2p.round import Phase
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.round.rules.planning import plan_horizon_s
from geomesh_p2p.trust.standing import Standing
from tests.dht_helpers import wait_for
from tests.unit.test_round_driver import _peers

pytestmark = pytest.mark.timeout(60)

BOUND_S = 0.3  # the watchdog's bound in this test (the node derives it: stall_bound_s)
CHECKPOINT_TIMEOUT_S = 2.0  # longer than the bound: the watchdog sees the stuck loop first


class _FakeDHT:
    """What PeerAnnouncer uses of a DHTNode: counts the stores of the record."""

    def __init__(self, identity):
        self.identity, self.run_id, self.stores = identity, "run", 0
        self.tasks = SimpleNamespace(spawn=lambda coro, name=None: asyncio.ensure_future(coro))

    def now(self) -> float:
        return time.time()

    async def store(self, key, value, expiration, subkey=None, owner=None) -> bool:
        self.stores += 1
        return True

    async def get(self, key, latest=True, subkeys=None, quorum=None) -> dict:
        return {}


def test_the_bound_follows_the_window_and_the_checkpoint_timeout():
    assert stall_bound_s(6.0, 120.0) == max(plan_horizon_s(6.0), 120.0) + STALL_SLACK_S
    assert stall_bound_s(600.0, 120.0) == plan_horizon_s(600.0) + STALL_SLACK_S  # minutes-long rounds
    assert stall_bound_s(6.0, 900.0) == 900.0 + STALL_SLACK_S  # a large state's slow checkpoint


async def test_a_hung_checkpoint_stops_the_announcements_and_the_loop_goes_on(tmp_path, monkeypatch, caplog):
    (peer,) = _peers(1)  # a lone peer: it plans and trains its own rounds
    release = threading.Event()
    entered = threading.Event()

    def nfs(directory, **kw):  # a file system that does not answer (until the test ends)
        entered.set()
        release.wait(30)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(gstate, "save_checkpoint", nfs)
    ckpt = Checkpointer(
        RunConfig(),
        NodeConfig(checkpoint_dir=str(tmp_path)),
        RoundState(me=peer.me, round=0, digest="d" * 64, standing=Standing()),
        "h",
        theta=lambda: torch.zeros(8),
        outer=lambda: OuterNesterov(lr=0.7, momentum=0.9),
    )
    ckpt.timeout_override_s = CHECKPOINT_TIMEOUT_S
    peer.checkpoint_or_warn = ckpt.checkpoint_or_warn
    drv = peer.driver(rounds=3)
    drv.cfg = dataclasses.replace(drv.cfg, checkpointing=True, checkpoint_every=1)
    watchdog = ProgressWatchdog(lambda: drv, lambda: BOUND_S)
    dht = _FakeDHT(peer.ident)
    announcer = PeerAnnouncer(dht, peer.record, period_s=0.05, ttl_s=2.0, live=watchdog.problem)
    silenced: list[str] = []
    resumed = asyncio.Event()

    async def watch():  # what the announcer does while the loop is stuck and after
        await wait_for(lambda: _now(announcer.silenced is not None), 20, 0.02, "the announcer to stop")
        silenced.append(announcer.silenced)
        seen = []  # the count of stores at each look while the announcer is silent

        async def still_silent() -> bool:
            stores, quiet = dht.stores, announcer.silenced is not None
            if quiet:
                seen.append(stores)
            return not quiet

        await wait_for(still_silent, 20, 0.02, "the announcer to resume")
        assert len(seen) > 1 and len(set(seen)) == 1  # not one refresh while the loop was stuck
        resumed.set()

    caplog.set_level(logging.INFO)
    # The announcer's own logger too: another test of this worker may have left it (or a parent) at WARNING.
    caplog.set_level(logging.INFO, logger="geomesh_p2p.dht.announce")
    announcer.start()
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait_for(drv.run(), 30)  # the loop is not stuck on the write forever
        await asyncio.wait_for(watcher, 10)
    finally:
        release.set()
        watcher.cancel()
        await announcer.stop()
        if ckpt._stuck is not None:
            await asyncio.gather(ckpt._stuck, return_exceptions=True)
    assert entered.is_set() and resumed.is_set()
    assert [row.round for row in drv.history] == [0, 1, 2]  # training went on after the timeout
    assert drv.phase == Phase.DONE
    [why] = silenced
    assert "round loop has not advanced" in why and "phase finish" in why
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    stopped = [m for lv, m in lines if lv == logging.WARNING and "not announcing" in m]
    assert len(stopped) == 1 and "phase finish" in stopped[0]
    assert len([m for lv, m in lines if lv == logging.INFO and "again: it makes progress again" in m]) == 1
    # one WARNING for the write (its timeout), and the rounds after it skip theirs while its thread is stuck
    timeouts = [m for lv, m in lines if lv == logging.WARNING and "checkpoint failed (Timeout" in m]
    assert len(timeouts) == 1 and "abandoned" in timeouts[0]


async def _now(value: bool) -> bool:
    return value


def test_a_state_download_that_advances_is_progress_and_a_node_is_watched_from_its_first_round():
    """Inside RESYNC a large state over a slow link takes minutes: its bytes arriving count as progress."""
    clock = SimpleNamespace(t=100.0)
    clock.monotonic = lambda: clock.t
    drv = SimpleNamespace(phase=Phase.RESYNC, clock=clock, progressed_at=100.0, state=SimpleNamespace(round=7))
    drv.stalled_s = lambda: clock.t - drv.progressed_at
    done = {"bytes": 0}
    dog = ProgressWatchdog(lambda: drv, lambda: 10.0, lambda: done["bytes"])
    assert dog.problem() is None
    for _ in range(5):  # 5 x 8 s: longer than the bound, but the download advanced each time
        clock.t += 8.0
        done["bytes"] += 1 << 20
        assert dog.problem() is None
    clock.t += 11.0  # then nothing arrives for longer than the bound
    why = dog.problem()
    assert why is not None and "11 s" in why and "round 7, phase resync" in why and "bound is 10 s" in why
    drv.phase = Phase.DONE  # a loop that ended is not stuck
    assert dog.problem() is None

    node = PeerNode(RunConfig(), NodeConfig(), identity=Identity.generate())
    dog = ProgressWatchdog.for_node(node)
    assert dog.problem() is None  # no round driver yet: start-up is not watched here
    assert dog._bound_s() == stall_bound_s(node.run_cfg.window_s, node.checkpoints.timeout_s())
