"""The ``self-succession`` rogue's pieces (``tests/adversary_lead.py``) on stand-ins: it publishes a plan of its own
for round r only after it led round r - 1, then agrees as the honest agreement does; ``--plan-out`` leaves peers out of
the plans it may lead and of none of its self-succession plans. The process run: ``tests/e2e/test_fork_procs.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.adversary_lead import SuccessionAgreement, planned_members, wrap_driver

pytestmark = pytest.mark.timeout(30)


class _Agreement:
    """A plan agreement stand-in: ``store.publish`` records the plans stored, ``agree`` what it was asked."""

    def __init__(self):
        self.stored, self.agreed = [], []
        self.store = SimpleNamespace(publish=self._publish)

    async def _publish(self, plan):
        self.stored.append(plan)
        return True

    async def agree(self, round, members, make_plan, **kw):  # noqa: A002
        self.agreed.append(round)
        return "followed"

    def plan_of(self):
        return "inner"


def _node(plan_out=()):
    notes = []
    node = SimpleNamespace(me="L", attack="self-succession", plan_out=list(plan_out), _succeeding=False, notes=notes)
    node._note = lambda r, kind, *a, **kw: notes.append((r, kind))
    return node


async def test_it_publishes_its_own_plan_only_after_leading_the_round_before_and_still_agrees():
    inner, node = _Agreement(), _node(plan_out=["N"])
    members = [SimpleNamespace(peer_id=p, leaving=False) for p in "LHN"]
    seen, gathered = [], []

    def make_plan(ms, leader):  # as the rogue's hooked planner: --plan-out applies only to plans it may lead
        seen.append([m.peer_id for m in planned_members(node, ms)])
        return SimpleNamespace(leader=leader, assignments=ms)

    async def gather(expected, *, first):
        gathered.append((first, len(inner.stored)))
        return members

    async def peers():
        return members

    drv = SimpleNamespace(
        plans=inner,
        _plans_by_round={0: SimpleNamespace(leader="L")},
        gather=gather,
        state=SimpleNamespace(round=1),
        membership=SimpleNamespace(peers=peers),
        policy=SimpleNamespace(make_plan=make_plan),
    )
    assert wrap_driver(drv, node) is drv and isinstance(drv.plans, SuccessionAgreement)
    assert wrap_driver(drv, node).plans.inner is inner and drv.plans.plan_of() == "inner"  # wrapped once
    assert await drv.gather(set(), first=False) == members and gathered == [(False, 1)]  # published before gathering
    assert await drv.plans.agree(1, members, make_plan) == "followed"  # once a round: not again at its agreement
    assert (seen, len(inner.stored), inner.agreed, node.notes) == ([["L", "H", "N"]], 1, [1], [(1, "succession")])
    drv._plans_by_round = {1: SimpleNamespace(leader="H")}  # round 1 led by another: no plan of its own for round 2
    assert await drv.plans.agree(2, members, make_plan) == "followed"
    assert (len(inner.stored), inner.agreed) == (1, [1, 2])
    assert [m.peer_id for m in planned_members(node, members)] == ["L", "H"]  # a round it may lead: N left out
    node.attack = "flip"
    assert [m.peer_id for m in planned_members(node, members)] == ["L", "H", "N"]
