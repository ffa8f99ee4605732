"""Red team, session 18 (issue 25's sampled reads): a light follower's check that no better-ranked outsider leads
(:func:`geomesh_p2p.round.light.outsider_problem`) acts on a record's *absence* (none live: it stays light and
follows the worse-ranked plan), so it must not read from the sampled quorum of 2: a holder counts towards a quorum
once it answers with any of the subkeys asked for, and two stale or hostile holders answering first (with a Sybil's
record only, or the outsider's old leaving record) hid the outsider's live record while the full-view peers, reading
5 holders, followed its plan: a fork."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.node import joining
from geomesh_p2p.plan.agree import leader_order
from geomesh_p2p.round import light

pytestmark = pytest.mark.timeout(30)

RUN = "run-r"


class _Holders:
    """A membership whose sampled (quorum-2) read meets two stale holders that lack the outsider's live record;
    the full-quorum read reaches the holders that have it."""

    def __init__(self, live: list[str]):
        self.live, self.calls = live, []

    async def records_of(self, peer_ids, *, sampled=True):
        self.calls.append((tuple(peer_ids), sampled))
        if sampled:
            return []
        return [SimpleNamespace(peer_id=p, leaving=False) for p in peer_ids if p in self.live]


async def test_an_outsider_leading_a_better_plan_is_read_from_the_full_quorum():
    ids = [f"peer{i:02d}" for i in range(6)]
    order = leader_order(RUN, 7, ids)
    outsider, leader = order[0], order[-1]  # the outsider's plan ranks before the one the light follower read
    plan = SimpleNamespace(run_id=RUN, round=7, leader=leader)
    members = _Holders(live=[outsider])
    why = await light.outsider_problem(SimpleNamespace(membership=members), plan, {outsider})
    assert why is not None and "a better-ranked plan's leader (" + outsider[:10] in why, why
    assert members.calls == [((outsider,), False)]
    # an outsider ranked after the plan's leader is not read at all
    members.calls.clear()
    assert await light.outsider_problem(SimpleNamespace(membership=members), plan, {order[-1]}) is None
    assert members.calls == []


class _DHT:
    def __init__(self):
        self.kwargs: list[dict] = []

    async def get(self, key, latest=True, subkeys=None, **kw):
        self.kwargs.append(dict(kw, subkeys=sorted(subkeys or ())))
        return {}


@pytest.mark.parametrize("sampled, extra", [(True, {"quorum": joining.SAMPLED_READ_QUORUM}), (False, {})])
async def test_records_of_reads_the_sampled_quorum_unless_told_otherwise(sampled, extra):
    dht = _DHT()
    node = SimpleNamespace(
        me="me",
        dht=dht,
        config_hash="h",
        run_cfg=SimpleNamespace(run_id=RUN, record_shards=1),
        admission=SimpleNamespace(filter=list),
        my_record=lambda: None,
    )
    assert await joining.records_of(node, ["a", "b"], sampled=sampled) == []
    assert dht.kwargs == [dict(extra, subkeys=["a", "b"])]
