"""Exact undo of a proven forged part (issue 26, ``--undo-forged``) over an in-process accountable round on 127.0.0.1:
a forging owner's round is applied by every honest peer, a validator's proof goes into the DHT, the next leader's
plan lists the forged (round, part); a follower that has not read the proof refuses that plan with a plain reason
(not a content refusal: no fork), reads the proof and then accepts it; at that round's outer step every honest
peer rewinds and replays with the forged range idle, and all end bitwise equal to the run in which that range had
been idle from the start (the forger's range rewound, the others untouched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round.rules.outer import OuterStepRule
from geomesh_p2p.round.rules.undo import UndoLog
from geomesh_p2p.exchange import CollectiveService

from tests.integration.test_collective_accountable import NUMEL, _accountability, _Forger, _round, _settle
from tests.unit.test_evidence_chunks import LimitedDHT

pytestmark = pytest.mark.timeout(120)


class _Plan:
    mode = "accountable"

    def __init__(self, spec, round, undo=()):
        self.round, self.undo, self._owners = round, list(undo), [(o.peer_id, o.start, o.end) for o in spec.owners]

    def owners(self):
        return self._owners


def _later_aggregates():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(NUMEL, generator=g) * 0.01 for _ in range(2)]


async def test_a_proven_forgery_is_undone_bitwise_by_every_honest_peer(swarms, tmp_path):
    _Forger.how = "scale"
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_Forger], validators=1, seed=6)
    r0 = spec.round
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # forged, the same bits everywhere
    dht = LimitedDHT()
    accs = await _settle(sw, spec, res, dht, read=False)  # validation and publication in the background
    evil = spec.part_index_of(sw.pids[3])
    span = (spec.owners[evil[0]].start, spec.owners[evil[0]].end)
    readers = [acc for acc, _ in accs[:3] if (r0, evil[0]) in acc.forged]
    assert readers, "no honest peer read the proof in its validation task"
    leader = readers[0]
    assert leader.forged[(r0, evil[0])] == span
    later = _later_aggregates()
    undo_plan = _Plan(spec, r0 + 2, leader.undo_list(r0 + 2))
    assert undo_plan.undo == [(r0, evil[0])]

    # a follower that has not read the proof: a plain refusal, the read starts; then it accepts the same plan
    late, _ = _accountability(sw, 2, dht)  # peer 2 before its read of the proofs
    why = late.undo_problem(undo_plan, True)
    assert why and not isinstance(why, ContentRefusal)
    if late.task is not None:
        await late.task
    assert late.undo_problem(undo_plan, True) is None and late.forged == {(r0, evil[0]): span}

    def run(k, idle_from_start: bool, undo: bool):
        acc = accs[k][0]
        theta, outer = torch.linspace(-1, 1, NUMEL), OuterNesterov()
        log = UndoLog(dir=str(tmp_path)) if undo else None
        rule = OuterStepRule(SimpleNamespace(me=sw.pids[k]), lambda: theta, lambda: outer, log, lambda: acc.forged, set)
        try:
            rule.apply(r0, _Plan(spec, r0), res[k].aggregate, [span] if idle_from_start else [])
            rule.apply(r0 + 1, _Plan(spec, r0 + 1), later[0], [])
            rule.apply(r0 + 2, undo_plan if undo else _Plan(spec, r0 + 2), later[1], [])
        finally:
            if log is not None:
                log.close()
        return theta

    for acc, _ in accs[:3]:  # as each follower's plan check makes sure (undo_problem), all have read the proof now
        if acc.undo_problem(undo_plan, True) is not None:
            await acc.read(r0 + 1)
        assert acc.undo_problem(undo_plan, True) is None
    honest = [run(k, idle_from_start=False, undo=True) for k in range(3)]
    want = run(0, idle_from_start=True, undo=False)
    kept_forgery = run(0, idle_from_start=False, undo=False)
    assert all(torch.equal(t, honest[0]) for t in honest)  # every honest peer bitwise equal after the undo
    assert torch.equal(honest[0], want)  # ... and equal to the run where the forged part was idle
    s, e = span
    assert not torch.equal(kept_forgery[s:e], want[s:e])  # the forger's range was rewound
    assert torch.equal(kept_forgery[:s], want[:s]) and torch.equal(kept_forgery[e:], want[e:])  # the rest untouched
