"""Red team, session 45: the round's end after this session's changes.

* the digest check keeps a voter's vote once its record shows the round (``round/finish.check_digest``): a vote kept
  so is still subject to this peer's exclusions, and a voter's record of another round is no vote;
* the outer update's spill starts at the seal and the next steps wait for it (``UpdateLog.wait_spilled`` through
  ``FlatGradBuffer.wait_release``): whether they wait long enough or not, the update served to a peer catching up
  is the aggregate bit for bit (the gradients' buffer is reused only once nothing else holds it);
* ``Turns.hold`` around the outer step and commit: an outer step that raises leaves the turns free."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

import geomesh_p2p.sync.server
from geomesh_p2p.model.grad_buffer import FlatGradBuffer
from geomesh_p2p.model.turns import Turns
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round import finish
from geomesh_p2p.sync.download import OuterUpdate
from geomesh_p2p.sync.server import UpdateLog
from geomesh_p2p.trust.kept_weights import KeptWeights
from tests.records_util import peer_record
from tests.unit.test_digest_check_reads import _driver

pytestmark = pytest.mark.timeout(60)

X, Z, OLD = "a" * 32, "b" * 32, "0" * 32


class _Script:
    """Membership whose records at the ``n``-th read are ``script(n)``: ``{peer: (round, digest)}``."""

    def __init__(self, me: str, script):
        self.me, self.script, self.reads = me, script, []

    async def records_of(self, peer_ids, *, sampled=True):
        self.reads.append(tuple(peer_ids))
        recs = self.script(len(self.reads))
        return [peer_record(p, round=recs[p][0], weights_digest=recs[p][1]) for p in peer_ids if p in recs]


async def test_a_kept_vote_of_a_voter_excluded_during_the_check_no_longer_counts():
    """b's vote (Z) is kept from the first read; b is excluded here before the check ends (verified work's verdict).
    Its vote must not count: counted, Z and X tie 2-2 and the tie breaks on the string for Z, a false mismatch of
    this honest peer (X) that would re-sync it onto the excluded peer's side."""
    me, b, c, d = (str(Identity.generate().peer_id) for _ in range(4))
    excluded: set[str] = set()

    def script(n: int) -> dict:
        if n >= 2:
            excluded.add(b)  # the verdict lands between two polls
        return {me: (9, X), b: (9, Z), c: (9, Z), d: (9, X) if n >= 3 else (8, OLD)}

    m = _Script(me, script)
    drv = _driver(m, X, lambda recs: [x for x in recs if x.peer_id not in excluded])
    assert await finish.check_digest(drv, 9, [me, b, c, d]) is True  # X 2 of 3 counted votes
    assert m.reads[0] == (me, b, c, d) and b not in m.reads[1]  # b's vote was kept (not read again)
    assert drv._confirmed_round == 9


async def test_a_record_of_another_round_is_no_vote_and_its_voter_is_read_again():
    """A voter already past the round (its record of round r + 1) or still syncing (no digest) casts no vote of
    round r and is read again; the majority of the votes of round r decides (a fork is told)."""
    me, b, c = (str(Identity.generate().peer_id) for _ in range(3))

    def script(n: int) -> dict:
        return {me: (5, X), b: (6, X) if n < 3 else (5, Z), c: (5, None) if n < 2 else (5, Z)}

    m = _Script(me, script)
    drv = _driver(m, X, list)
    assert await finish.check_digest(drv, 5, [me, b, c]) is False  # Z 2 of 3: this peer is the fork
    assert m.reads == [(me, b, c), (b, c), (b,)]


class _SlowStore(KeptWeights):
    """The spill store whose writes wait for ``release`` (a slow disk), ``writing`` set when one began."""

    writing = threading.Event()
    release = threading.Event()

    def put(self, round, theta):
        type(self).writing.set()
        assert type(self).release.wait(30)
        return super().put(round, theta)


def _grads_and_step(params, opt, g: FlatGradBuffer, k: float) -> None:
    g.zero(opt)
    (sum(p.sum() for p in params) * k).backward()
    g.settle()
    opt.step()


@pytest.mark.parametrize("wait_s", [30.0, 0.0])
async def test_the_update_served_is_the_aggregate_whether_the_next_steps_wait_for_the_spill_or_not(
    tmp_path, monkeypatch, wait_s
):
    """The aggregate is the gradients' buffer (``record(copy=False)``); the spill reads it after the seal while the
    next round's steps start. Waiting for it (30 s), they reuse the buffer once it is written; not waiting (0 s, a
    spill slower than SPILL_WAIT_S), they take a fresh one. Either way the bytes a catching-up peer is served are the
    aggregate's, and the steps' gradients are right."""
    monkeypatch.setattr(geomesh_p2p.sync.server, "KeptWeights", _SlowStore)
    _SlowStore.writing.clear()
    _SlowStore.release.clear()
    tasks: list[asyncio.Task] = []

    def spawn(coro, name=None):
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    log = UpdateLog(keep_rounds=2, spawn=spawn, spill=True, spill_dir=str(tmp_path))
    params = [torch.nn.Parameter(torch.zeros(600)), torch.nn.Parameter(torch.zeros(400))]
    opt = torch.optim.SGD(params, lr=0.1)
    g = FlatGradBuffer(params)
    g.wait_release = lambda: log.wait_spilled(wait_s)
    _grads_and_step(params, opt, g, 1.0)  # (the check step: fresh gradients)
    _grads_and_step(params, opt, g, 1.0)  # gradients in the buffer from now on
    for p in params:
        p.grad = None  # the steps are over
    agg = g.take()
    assert agg is not None and g.allocations == 1
    agg.copy_(torch.randn(1000, generator=torch.Generator().manual_seed(3)))  # the round's aggregate, in place
    want = agg.clone()
    log.record(0, X, [(0, 1000)], (), agg, copy=False)
    del agg
    await asyncio.to_thread(log.seal, 1, Z)  # the node seals in the outer step's worker thread
    assert await asyncio.to_thread(_SlowStore.writing.wait, 30)  # the spill is writing the buffer

    # the next round's first step, in its thread, while the write is under way; the write ends a moment later
    steps = asyncio.ensure_future(asyncio.to_thread(_grads_and_step, params, opt, g, 7.0))
    if wait_s == 0.0:
        await steps  # a fresh buffer at once: the write still reads the old one
        assert g.allocations == 2
    _SlowStore.release.set()
    await steps
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params)
    assert await asyncio.gather(*tasks) == [True] and log.spilled() == [0]
    assert g.allocations == (1 if wait_s else 2)  # waited: the buffer came back to the steps
    blob, _ = await log.blob(0)
    served = await asyncio.to_thread(OuterUpdate.decode, blob, 1000)
    assert served.start_digest == X and served.end_digest == Z and torch.equal(served.aggregate, want)
    log.close()


def test_an_outer_step_that_raises_leaves_the_turns_free():
    """``Turns.hold`` around the outer step and commit (round/finish.advance): a failure inside (an outer step that
    raises) must not leave new check passes out for good (the verified-work worker would wait for ever)."""
    turns = Turns()

    class State:
        state_lock = None

        def outer_step(self, r, plan, aggregate, idle=()):
            assert turns._holding == 1
            raise FloatingPointError("a non-finite outer step")

    drv = SimpleNamespace(state=State(), trainer=SimpleNamespace(turns=turns), _spec=None)
    with pytest.raises(FloatingPointError):
        finish.advance(drv, 3, None, torch.zeros(3), ())
    got = threading.Event()
    t = threading.Thread(target=lambda: (turns.take_check(), got.set()), daemon=True)
    t.start()
    t.join(20)
    assert got.is_set() and turns.checking and turns._holding == 0
    turns.give_check()
