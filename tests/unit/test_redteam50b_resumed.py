"""Red team 50b of ux50's hold (``round.gather.held_for_swarm``): a peer resumed with ``--min-peers`` 2 or more on a
checkpoint trained with others waits for them past ``--wait-peers-s``. What holds: a partner back in step under a new
identity ends the wait at once; a partner ahead is caught up to (no hold). Fixed: a checkpoint of a state caught up to
(planned out of the last round) named no peer of its swarm, so the hold did not apply (``Standing.trained_with``);
ux50's ``--identity`` folder rule compared the path with the default as text, so the default typed out (the shell
expands ``~``) was refused on a machine without ``~/.geomesh``; a partner live at the same round with another digest
(a 1-1 tie ``policy.rejoin_state`` did not break) held the peer for ever, its line naming the live partner as one to
restart (session 51: round/tie.py settles the tie, bounded; tests/unit/test_resumed_tie.py). Fakes of tests/unit/test_resumed_wait.py (virtual clock, no timing)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.telemetry import events
from tests.unit.test_resumed_wait import _at
from tests.unit.test_round_driver import FakeClock, _peers

pytestmark = pytest.mark.timeout(60)


def _resumed(me, q, partners: tuple[str, ...], min_peers: int = 2):
    """``me``'s driver resumed on a checkpoint trained with ``partners``; ``q``'s record announced as it is now."""
    me.swarm.records[q.me] = q.record()
    drv = me.driver(min_peers=min_peers, wait_peers_s=3.0, clock=FakeClock())
    drv._start, drv._resumed_with = (me.round, me.digest), partners
    return drv


async def test_a_partner_back_in_step_under_a_new_identity_ends_the_hold_at_once():
    me, q = _peers(2)
    _at(me, 86, 0.25)
    _at(q, 86, 0.25)  # q lost its key: back with --resume under a new PeerID, the same state
    drv = _resumed(me, q, ("an-identity-gone-for-good",))
    with events.capture("waiting_for_resumed") as held:
        members = await asyncio.wait_for(drv.gather(set(), first=True), 10)
    assert sorted(m.peer_id for m in members) == sorted([me.me, q.me]) and held == [] and drv.ended is None


async def test_a_partner_back_ahead_is_caught_up_to_not_waited_for():
    me, q = _peers(2)
    _at(me, 86, 0.25)
    _at(q, 88, 0.5)
    drv = _resumed(me, q, (q.me,))
    with events.capture("waiting_for_resumed") as held:
        assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None  # the driver catches up
    assert held == [] and drv.ended is None


async def test_a_partner_live_at_the_same_round_with_another_digest_does_not_hold_the_peer_forever():
    me, q = _peers(2)
    _at(me, 86, 0.25)
    _at(q, 86, 0.5)  # the same round, another digest: one of the two checkpoints is a fork
    drv = _resumed(me, q, (q.me,))
    with events.capture("waiting_for_resumed") as held:
        try:
            # 600 virtual s (the fake clock advances on every pause): far past --wait-peers-s 3
            await asyncio.wait_for(drv.gather(set(), first=True), 5)
        except asyncio.TimeoutError:
            pass
    # wanted: bounded (it trains or ends once --wait-peers-s ran out), or at least no line asking to restart a live peer
    assert held == [] or all(q.me[:8] not in e["message"].split("Live now:")[1] for e in held), held[-1]["message"]


def test_the_default_identity_typed_out_by_the_shell_is_the_default(tmp_path, monkeypatch):
    """``--identity ~/.geomesh/identity.key`` reaches the peer expanded (the shell's ``~``): the default's folder is
    made for it as for the default itself, not refused as a typed path in a missing folder (exit 2 on a fresh
    machine); another missing folder still is."""
    from peer.node_cli import check_path_flags

    monkeypatch.setenv("HOME", str(tmp_path))
    flags = dict(checkpoint_dir=None, tls_cert=None, tls_key=None, tls_ca=None)
    check_path_flags(SimpleNamespace(identity=str(tmp_path / ".geomesh" / "identity.key"), **flags))
    check_path_flags(SimpleNamespace(identity="~/.geomesh/identity.key", **flags))
    with pytest.raises(ValueError, match="does not exist"):
        check_path_flags(SimpleNamespace(identity=str(tmp_path / ".geomesh2" / "identity.key"), **flags))
    assert list(tmp_path.iterdir()) == []  # checked, nothing made yet


async def test_a_checkpoint_of_a_state_caught_up_to_still_waits_for_the_swarm():
    """A peer credits only the rounds it exchanged in (``policy.after_outer_step``): planned out of round 85, it caught
    up to round 86 and the swarm stopped (``final_checkpoint`` writes the held state). Its checkpoint named nobody
    (``Standing.trained_with`` read round 85 only), so ``--resume --min-peers 2`` trained alone after
    ``--wait-peers-s``, fresh user 50's fork; the newest round of the ledger before it names the swarm now."""
    from geomesh_p2p.trust.standing import Standing

    me, other = _peers(2)
    _at(me, 86, 0.25)
    ledger = Standing()
    for r in range(80, 85):  # it trained rounds 80-84 with `other`; planned out of 85, it caught up to 86
        ledger.credit(r, [me.me, other.me])
    del me.swarm.records[other.me]  # the swarm stopped; me is restarted first, alone
    drv = me.driver(min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    assert ledger.trained_with(86, me.me) == (other.me,)
    drv._start, drv._resumed_with = (86, me.digest), ledger.trained_with(86, me.me)
    with events.capture("waiting_for_resumed") as held:
        try:
            members = await asyncio.wait_for(drv.gather(set(), first=True), 5)
        except asyncio.TimeoutError:
            members = None  # held: waits for the swarm (what is wanted)
    assert members is None and held, f"trained alone: {[m.peer_id[:8] for m in members or []]}"
