"""A swarm resumed at once (fresh-user trial, session 31): every peer left itself out of the leader candidates for
lack of delivered-work evidence of the last round, deferred to the others, and the first round waited a whole plan
attempt and a take-over. The checkpoint now keeps that evidence (``node_verdicts``) and ``--resume`` restores it
(``Reprofiler.restore_delivered``), for the round that made the checkpoint's state only."""

from __future__ import annotations

import math

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round.rules.profiling import MAX_RESTORED_RATES
from geomesh_p2p.trust.standing import Standing
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(30)


def _swarm(n: int = 3):
    ids = [Identity.generate() for _ in range(n)]
    pids = [str(i.peer_id) for i in ids]
    ledger = Standing()
    for r in range(26, 30):
        ledger.credit(r, pids)
    return ids, pids, ledger


def test_a_resumed_peer_with_the_last_rounds_evidence_is_a_leader_candidate_again():
    ids, pids, ledger = _swarm()
    me = pids[0]
    before = make_rules(me=me, round=29, standing=ledger)
    before.profile.supported_tps = (29, {p: 500.0 + k for k, p in enumerate(pids)})  # it applied round 29
    meta = before.profile.delivered_meta()
    assert meta == {"round": 29, "tps": {p: 500.0 + k for k, p in enumerate(pids)}}

    live = {p: peer_record(i, address=f"127.0.0.1:{7000 + k}", round=30) for k, (i, p) in enumerate(zip(ids, pids))}
    resumed = make_rules(me=me, round=30, standing=ledger)  # a fresh process from the round-30 checkpoint
    _, cands = resumed.leader_candidates(list(live.values()), live)
    assert me not in cands and sorted(cands) == sorted(pids[1:])  # before: it defers (and so does every other)
    assert resumed.profile.restore_delivered(meta, 30)
    assert resumed.planning.delivered_evidence(30) == meta["tps"]
    _, cands = resumed.leader_candidates(list(live.values()), live)
    assert sorted(cands) == sorted(pids)


@pytest.mark.parametrize(
    "meta, state_round",
    [
        ({"round": 29, "tps": {"a" * 10: 1.0}}, 31),  # evidence of another round than the one that made the state
        ({"round": 29.0, "tps": {"a" * 10: 1.0}}, 30),
        ({"round": 29, "tps": {"a" * 10: math.nan}}, 30),
        ({"round": 29, "tps": {"a" * 10: -1.0}}, 30),
        ({"round": 29, "tps": {"a" * 10: True}}, 30),
        ({"round": 29, "tps": {"a" * 65: 1.0}}, 30),
        ({"round": 29, "tps": {f"p{k}": 1.0 for k in range(MAX_RESTORED_RATES + 1)}}, 30),
        ({"round": 29, "tps": [1.0]}, 30),
        ("junk", 30),
        (None, 30),
    ],
)
def test_an_edited_or_stale_evidence_is_ignored(meta, state_round):
    rules = make_rules(me="x" * 10, round=state_round)
    assert not rules.profile.restore_delivered(meta, state_round)
    assert rules.profile.supported_tps is None
