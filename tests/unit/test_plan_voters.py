"""The end-of-run voters (:func:`geomesh_p2p.round.resync.plan_voters`) and a gather's syncing peers
(:func:`geomesh_p2p.round.gather.note_standing`) ask who is established from ONE standing view over the
records, not one view per record (O(N^2) on the event loop at hundreds of records), with the same answer as before.

The view is this peer's real one (:class:`~geomesh_p2p.round.policy.NodeRoundPolicy` over a ledger, tests/rules_util):
at round 10 it credited rounds 5-9 only, so it missed 5 and also reads what trusted records attest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.round import resync
from geomesh_p2p.round.gather import SyncWaits, note_standing
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.trust.standing import Standing, attest_key
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

ROUND = 10


def _id(name: str) -> str:
    """A PeerID-like string: attestations name a peer by its first 16 characters, so those differ."""
    return f"{name:<16}".replace(" ", "_") + "tail"


ME, A, B, C, D, E = (_id(n) for n in ("me", "a", "b", "c", "d", "e"))
SYBILS = [_id(f"sybil{i}") for i in range(50)]


def _rec(peer_id: str, standing: dict | None = None):
    return SimpleNamespace(peer_id=peer_id, standing=standing or {})


def _setup(monkeypatch):
    """(the policy, the records, the number of standing views built so far as a one-item list).

    a, b: this peer's last plan's participants (with one Sybil); c: established by this peer's ledger; d: by a's and
    b's attestations (4 and 5 rounds: two trusted attestors vouch for 4, within the 5 this peer missed); e: delivered once here, b attests 1 (on probation);
    the Sybils: fresh identities vouching for each other (32 rounds), which nobody trusted attests."""
    ledger = Standing()
    for r in range(5, ROUND):
        ledger.credit(r, [ME, A, B, C] + ([E] if r == ROUND - 1 else []))
    rules = make_rules(me=ME, round=ROUND, standing=ledger)
    vouch = {attest_key(s): 32 for s in SYBILS[:16]}
    records = (
        [_rec(s, vouch) for s in SYBILS[:20]]
        + [_rec(D), _rec(A, {attest_key(D): 4}), _rec(E)]
        + [_rec(s, vouch) for s in SYBILS[20:35]]
        + [_rec(C), _rec(B, {attest_key(E): 1, attest_key(D): 5})]
        + [_rec(s, vouch) for s in SYBILS[35:]]
    )
    views = [0]
    build = rules.planning.standing_view

    def counting(recs):
        views[0] += 1
        return build(recs)

    monkeypatch.setattr(rules.planning, "standing_view", counting)
    return rules, records, views


def _before(rules, records, members: set[str]) -> list[str]:
    """plan_voters as it was: a fresh view of all records for each record outside the plan."""
    s = rules.state

    def established(pid: str) -> bool:
        return pb.StandingView(s.standing, records, round=s.round, me=s.me).established(pid)

    return [x.peer_id for x in records if x.peer_id in members or established(x.peer_id)]


def test_plan_voters_keeps_the_same_records_from_one_standing_view(monkeypatch):
    rules, records, views = _setup(monkeypatch)
    members = [ME, A, B, SYBILS[7]]
    drv = SimpleNamespace(policy=rules, _last_plan=SimpleNamespace(round=ROUND - 1, participants=lambda: members))
    voters = resync.plan_voters(drv, records, ROUND)
    assert [x.peer_id for x in voters] == [SYBILS[7], D, A, C, B]  # records' order; e and the other Sybils left out
    assert all(v is x for v, x in zip(voters, [records[7], records[20], records[21], records[38], records[39]]))
    assert views[0] == 1  # 52 records outside the plan, one view
    assert [x.peer_id for x in voters] == _before(rules, records, set(members))
    # no plan of round r - 1 followed: every record, and no view at all
    drv._last_plan = SimpleNamespace(round=ROUND - 2, participants=lambda: members)
    assert resync.plan_voters(drv, records, ROUND) == records
    assert views[0] == 1


def test_standing_established_of_one_id_is_unchanged(monkeypatch):
    rules, records, views = _setup(monkeypatch)
    expect = {ME: True, A: True, C: True, D: True, E: False, SYBILS[0]: False, _id("unseen"): False}
    assert {p: rules.standing_established(records, p) for p in expect} == expect  # ME has no record: asked anyway
    assert views[0] == len(expect)
    assert rules.standing_established_ids(records) == frozenset({A, B, C, D})
    assert rules.standing_established_ids(records, [ME, E, SYBILS[3]]) == frozenset({ME})


def test_a_gather_asks_the_standing_of_its_syncing_peers_from_one_view(monkeypatch):
    rules, records, views = _setup(monkeypatch)
    drv = SimpleNamespace(policy=rules)
    waits = SyncWaits(0.0)
    syncing = [x for x in records if x.peer_id not in (A, B)]  # 50 Sybils, c, d, e
    note_standing(drv, syncing, records, waits)
    assert views[0] == 1
    assert waits.established == {C, D}
    assert waits.probation == {E, *SYBILS}
    note_standing(drv, syncing, records, waits)  # asked once per gather: no view for peers already asked about
    assert views[0] == 1
    note_standing(drv, syncing + [records[21]], records, waits)  # a newly syncing: one more view, for it only
    assert views[0] == 2
    assert A in waits.established
