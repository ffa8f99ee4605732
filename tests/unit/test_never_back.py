"""Never back to an older round (docs/round.md, "Never back to an older round"): a catch-up whose vote backs
a state of a round below the one this peer holds keeps its state while newer donors may come back or the
peers behind would come up to it, and goes back only when that is the only way to rejoin the live swarm,
saying so in one WARNING with both rounds. rs7: a peer holding round 9 adopted a live peer's round-5 state
once the round-10 donors had left."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.sync import download as ss
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round.rules import RoundState, StateSync
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust.standing import Standing, attest_key, would_adopt
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)


def _pid() -> str:
    return str(Identity.generate().peer_id)


def _rec(pid, *, round, digest, port, attests=None, leaving=False) -> PeerRecord:
    return peer_record(
        pid,
        address=f"127.0.0.1:{port}",
        round=round,
        weights_digest=digest,
        standing={attest_key(p): n for p, n in (attests or {}).items()},
        leaving=leaving,
    )


def _node(me: str, standing: Standing, records: list, monkeypatch, *, round=9, digest="r9") -> tuple[StateSync, list]:
    """The re-sync rules of a node holding the state of ``round`` (``digest``) whose records are ``records``;
    downloads are faked (they return the state asked for) and listed."""
    state = RoundState(me=me, round=round, digest=digest, numel=2, state_numel=2, standing=standing, history=[object()])
    gstate = SimpleNamespace(round=round, digest=digest)
    downloads = []

    async def peers(include_leaving=False):
        return [r for r in records if include_leaving or not r.leaving]

    async def announce():
        pass

    def set_state(rnd, theta, momentum):
        state.round, state.digest = rnd, f"r{rnd}"
        gstate.round, gstate.digest = rnd, f"r{rnd}"

    async def fake_download(transport, donors, *, round, numel, expected_digest, state_numel=None, **kw):
        downloads.append((round, expected_digest))
        return ss.Snapshot(round, torch.zeros(2), torch.zeros(2), expected_digest)

    monkeypatch.setattr(ss, "download_state", fake_download)
    node = StateSync(
        SimpleNamespace(run_id="never-back", window_s=None),
        state,
        asyncio.Event(),
        peers=peers,
        announce=announce,
        set_state=set_state,
        gstate=lambda: gstate,  # type: ignore[arg-type,return-value]
        address=lambda: "127.0.0.1:7009",  # the address its record names
    )
    node.gstate = gstate  # type: ignore[attr-defined]  # what the tests read back
    return node, downloads


async def test_a_peer_holding_round_9_keeps_it_when_the_only_live_peer_is_at_round_5(monkeypatch):
    """rs7 as the logs show it: P2 holds round 9 (caught up, planned out since round 1: its ledger credits
    round 0 only); the round-10 donors left; P3 is live at round 5, and its record attests P2 (it saw it
    deliver round 0). P2's vote backs P3's round 5 (1 of the 1 rounds of standing it sees). Before: P2
    downloaded round 5 and adopted it. Now it keeps round 9: P3's own vote backs P2's state, so P3 comes
    up (P2 announces round 9 with its digest, and serves it)."""
    p0, p1, p2, p3 = (_pid() for _ in range(4))
    ledger = Standing()
    ledger.credit(0, [p0, p1, p2, p3])
    r3 = _rec(p3, round=5, digest="r5", port=7003, attests={p0: 2, p1: 2, p2: 1, p3: 1})
    node, downloads = _node(p2, ledger, [r3], monkeypatch)
    assert node.state_vote([r3]).choice.round == 5  # the vote that took P2 back in rs7
    with events.capture("older_state_declined") as declined, events.capture("older_state_adopted") as adopted:
        await node.catch_up()
        await node.catch_up()  # a catch-up retried: one line, not one per attempt
    assert downloads == [] and adopted == []
    assert (node.state.round, node.state.digest, node.gstate.round) == (9, "r9", 9)
    [e] = declined
    assert (e["peer"], e["round"], e["digest"], e["held_round"], e["held_digest"]) == (p2, 5, "r5", 9, "r9")
    assert "would adopt this peer's state" in e["reason"]
    # ... and P3's view agrees: by its own vote it adopts P2's round 9 (it comes up; nobody goes back)
    p3_ledger = Standing()
    p3_ledger.credit(0, [p0, p1, p2, p3])
    p3_ledger.credit(2, [p0, p1])
    p3_node = StateSync(
        SimpleNamespace(run_id="never-back", window_s=None),
        RoundState(me=p3, standing=p3_ledger, history=[1], round=5, digest="r5"),
        asyncio.Event(),
        peers=lambda include_leaving=False: asyncio.sleep(0, []),
    )
    r2 = _rec(p2, round=9, digest="r9", port=7009, attests={p0: 1, p1: 1, p3: 1})
    assert p3_node.swarm_round([r2]) == 9


async def test_a_live_peer_at_a_newer_round_is_waited_for(monkeypatch):
    """A live peer announces round 9 or later (syncing: its download may come back): no going back."""
    a, b, c, x, me = (_pid() for _ in range(5))
    ledger = Standing()
    for r in range(5):
        ledger.credit(r, [a, b, c, me])
    behind = [
        _rec(p, round=5, digest="r5", port=7000 + k, attests={q: 5 for q in (a, b, c, me)})
        for k, p in enumerate((a, b, c))
    ]
    syncing = _rec(x, round=10, digest=None, port=7100)
    node, downloads = _node(me, ledger, behind + [syncing], monkeypatch)
    with events.capture("older_state_declined") as declined:
        await node.catch_up()
    assert downloads == [] and (node.state.round, node.state.digest) == (9, "r9")
    assert [e["reason"].split(":")[0] for e in declined] == [f"1 live peer(s) announce round 9 or later ({x[:10]})"]


async def test_going_back_when_everybody_live_is_at_round_5_and_would_not_come_up(monkeypatch):
    """The newer lineage is gone (the two peers that trained rounds 5-8 with this one left; their records
    expired) and the three live peers at round 5 back their own state by their votes: going back is the only
    way to rejoin them. It does, with one WARNING naming both rounds."""
    a, b, c, x, y, me = (_pid() for _ in range(6))
    ledger = Standing()
    for r in range(5):
        ledger.credit(r, [a, b, c, me])
    for r in range(5, 9):
        ledger.credit(r, [x, y, me])
    behind = [
        _rec(p, round=5, digest="r5", port=7000 + k, attests={q: 5 for q in (a, b, c, me)})
        for k, p in enumerate((a, b, c))
    ]
    node, downloads = _node(me, ledger, behind, monkeypatch)
    mine = SimpleNamespace(peer_id=me, address="127.0.0.1:7009", round=9, weights_digest="r9", standing={})
    assert not any(would_adopt(r, [o for o in behind if o is not r] + [mine], 9, "r9") for r in behind)
    with events.capture("older_state_adopted") as adopted:
        await node.catch_up()
    assert downloads == [(5, "r5")] and (node.state.round, node.state.digest) == (5, "r5")
    [e] = adopted
    assert e["level"] == "WARNING"
    assert (e["round"], e["digest"], e["held_round"], e["held_digest"], sorted(e["live"])) == (
        5,
        "r5",
        9,
        "r9",
        sorted([a, b, c]),
    )
    assert "round 9" in e["message"] and "round 5" in e["message"]
