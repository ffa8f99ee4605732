"""Round protocol: rendezvous leader, take-over when the leader dies, one plan despite split views,
digest majority. The DHT is an in-memory stand-in with the same store/get contract (owner = signer),
so these tests isolate the round logic; the real DHT is covered in test_dht*.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.plan.wire import split_plan
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from geomesh_p2p.round import PlanStore, choose_plan, digest_majority, leader_order, leader_rank, obtain_plan
from geomesh_p2p.round import takeover_delay

pytestmark = pytest.mark.timeout(60)
RUN = "round-test"


class MemoryDHT:
    """Shared dict: key -> subkey -> (value, expiration, owner PeerID)."""

    def __init__(self):
        self.data: dict = {}
        self.fail_writes_from: set = set()
        self.stored = asyncio.Condition()  # notified after every successful store

    async def wait_until(self, condition, timeout: float = 10.0) -> None:
        """Wait (at most ``timeout`` s, else TimeoutError) until ``condition()`` holds after a store."""
        async with self.stored:
            await asyncio.wait_for(self.stored.wait_for(condition), timeout)

    def view(self):
        dht = self

        class View:
            async def store(self, key, value, expiration_time, subkey=None, owner=None):
                if owner is not None and owner.peer_id in dht.fail_writes_from:
                    return False
                dht.data.setdefault(key, {})[subkey] = (value, expiration_time, owner.peer_id if owner else None)
                async with dht.stored:
                    dht.stored.notify_all()
                return True

            async def get(self, key, latest=True, subkeys=None, quorum=None):
                return dict(dht.data.get(key, {}))

        return View()


def _record(ident: Identity, speed: float, address: str | None = "127.0.0.1:1") -> PeerRecord:
    return peer_record(
        ident,
        address=address,
        memory_bytes=8 << 30,
        tokens_per_s={4: 1000 * speed, 8: 1800 * speed},
        round=3,
        weights_digest="d0",
    )


CFG = PlanConfig(seq_len=64, target_batch=8, window_s=5.0, payload_bytes=10_000)


def _planner(round_):
    def make(members, leader):
        return plan_round(
            members,
            CFG,
            run_id=RUN,
            round=round_,
            leader=leader,
            numel=1000,
            start_time=time.time() + 1,
            start_digest="d0",
        )

    return make


def test_leader_order_is_rendezvous_and_view_independent():
    ids = [str(Identity.generate().peer_id) for _ in range(6)]
    full = leader_order(RUN, 3, ids)
    assert full == sorted(ids, key=lambda p: leader_rank(RUN, 3, p))
    # any subset keeps the relative order: the best of a subset is its best in the full order
    subset = ids[1:4]
    assert leader_order(RUN, 3, subset) == [p for p in full if p in subset]
    # another round gives another order (with 6 peers, equal orders for 5 rounds is ~(1/720)^5)
    assert any(leader_order(RUN, r, ids) != full for r in range(4, 9))


async def test_all_peers_follow_one_plan_and_leader_is_first_in_order():
    ids = [Identity.generate() for _ in range(4)]
    members = [_record(i, s) for i, s in zip(ids, (1.0, 0.55, 0.45, 0.4))]
    dht = MemoryDHT()
    plans = await asyncio.gather(
        *[
            obtain_plan(PlanStore(dht.view(), i, RUN), 3, members, _planner(3), plan_timeout_s=1.0, settle_s=0.1)
            for i in ids
        ]
    )
    assert len({p.to_bytes() for p in plans}) == 1
    assert plans[0].leader == leader_order(RUN, 3, [m.peer_id for m in members])[0]
    assert set(plans[0].participants()) == {m.peer_id for m in members}


async def test_leader_dies_before_publishing_next_takes_over_within_timeout():
    ids = [Identity.generate() for _ in range(3)]
    members = [_record(i, 1.0) for i in ids]
    order = leader_order(RUN, 5, [m.peer_id for m in members])
    dead = next(i for i in ids if str(i.peer_id) == order[0])
    alive = [i for i in ids if i is not dead]
    dht = MemoryDHT()
    with events.capture("plan_takeover") as takeovers:
        plans = await asyncio.gather(
            *[
                obtain_plan(PlanStore(dht.view(), i, RUN), 5, members, _planner(5), plan_timeout_s=1.0, settle_s=0.1)
                for i in alive
            ]
        )
    assert {p.leader for p in plans} == {order[1]}
    # the second-ranked took over once, after one plan timeout (its turn's delay), not before it
    [t] = takeovers
    assert (t["round"], t["peer"], t["turn"]) == (5, order[1], 1)
    assert t["delay_s"] == takeover_delay(1, 1.0, 0.1) == 1.0 and t["after_s"] >= t["delay_s"]


async def test_a_peer_stalled_through_its_turn_does_not_take_over_from_its_old_view(monkeypatch):
    """Review H1: a peer stopped (SIGSTOP) while the plan was agreed resumed past its turn as leader and
    published a plan from its view of before the stall (it trained the round alone: the others had
    finished). A read that overran by STALL_S now ends the agreement with PlanStalled, nothing published."""
    from geomesh_p2p.plan import agree

    monkeypatch.setattr(agree, "STALL_S", 0.5)
    ids = [Identity.generate() for _ in range(2)]
    members = [_record(i, 1.0) for i in ids]
    order = leader_order(RUN, 5, [m.peer_id for m in members])
    second = next(i for i in ids if str(i.peer_id) == order[1])  # the best-ranked never publishes
    dht = MemoryDHT()
    store = PlanStore(dht.view(), second, RUN)
    real_read, reads = store.read, []

    async def stalled_read(*a, **kw):
        reads.append(1)
        if len(reads) == 1:
            await asyncio.sleep(1.5)  # the process "stopped" across its turn (at 1.0 s)
        return await real_read(*a, **kw)

    monkeypatch.setattr(store, "read", stalled_read)
    with events.capture("plan_takeover") as takeovers, pytest.raises(agree.PlanStalled) as e:
        await obtain_plan(store, 5, members, _planner(5), plan_timeout_s=1.0, settle_s=0.1)
    assert e.value.round == 5 and e.value.stalled_s >= 1.4
    assert takeovers == [] and len(reads) == 2  # raised at the first read past its turn
    assert await PlanStore(dht.view(), ids[0], RUN).read(5) == []  # nothing was published


async def test_a_leader_whose_planner_fails_hands_the_round_to_the_next():
    """A record that breaks the first leader's planner must not end that node: it logs, steps aside,
    and every peer (itself included) follows the next leader's plan."""
    ids = [Identity.generate() for _ in range(3)]
    members = [_record(i, 1.0) for i in ids]
    order = leader_order(RUN, 6, [m.peer_id for m in members])
    broken = next(i for i in ids if str(i.peer_id) == order[0])
    good = _planner(6)

    def failing(members_, leader):
        raise ValueError("upload_bps=inf must be a positive finite bandwidth")

    dht = MemoryDHT()
    plans = await asyncio.gather(
        *[
            obtain_plan(
                PlanStore(dht.view(), i, RUN),
                6,
                members,
                failing if i is broken else good,
                plan_timeout_s=1.0,
                settle_s=0.1,
            )
            for i in ids
        ]
    )
    assert {p.leader for p in plans} == {order[1]}
    assert len({p.to_bytes() for p in plans}) == 1


async def test_split_views_still_follow_one_plan():
    """A sees {A,B,C,D}; B sees only {B,C}: if B thinks it leads, the better-ranked leader still wins."""
    ids = [Identity.generate() for _ in range(4)]
    recs = {str(i.peer_id): _record(i, 1.0) for i in ids}
    order = leader_order(RUN, 7, list(recs))
    by_id = {str(i.peer_id): i for i in ids}
    best, second = order[0], order[1]
    full_view = list(recs.values())
    partial_view = [recs[second], recs[order[2]]]  # misses the best-ranked peer
    dht = MemoryDHT()
    key = f"{RUN}/plan/7"
    # The partial-view peer publishes first (it believes it leads) ...
    t_second = asyncio.create_task(
        obtain_plan(
            PlanStore(dht.view(), by_id[second], RUN), 7, partial_view, _planner(7), plan_timeout_s=1.0, settle_s=0.5
        )
    )
    await dht.wait_until(lambda: key in dht.data)
    assert set(dht.data[key]) == {second}
    # ... then the best-ranked peer, seeing a worse-ranked plan, publishes its own anyway.
    r_best = await obtain_plan(
        PlanStore(dht.view(), by_id[best], RUN), 7, full_view, _planner(7), plan_timeout_s=1.0, settle_s=0.5
    )
    r_second = await t_second
    assert set(dht.data[key]) == {best, second}
    assert r_best.leader == r_second.leader == best
    assert r_best.to_bytes() == r_second.to_bytes()
    assert choose_plan(RUN, 7, [r_second, r_best]).leader == best


async def test_forged_or_misattributed_plan_is_ignored():
    ids = [Identity.generate() for _ in range(2)]
    members = [_record(i, 1.0) for i in ids]
    dht = MemoryDHT()
    plan = _planner(2)(members, str(ids[0].peer_id))
    # stored by ids[1] but claiming ids[0] leads: not signed by its leader -> ignored
    head = split_plan(plan).head  # the wire form PlanStore.publish stores
    await dht.view().store(f"{RUN}/plan/2", head, time.time() + 60, subkey=str(ids[0].peer_id), owner=ids[1])
    dht.data[f"{RUN}/plan/2"]["garbage"] = (b"{not json", time.time() + 60, ids[1].peer_id)
    # ids[1]'s own subkey, a head naming ids[0] as leader: signed, but not by the leader it names
    dht.data[f"{RUN}/plan/2"][str(ids[1].peer_id)] = (head, time.time() + 60, ids[1].peer_id)
    # version 1's wire form (the JSON as it is), even signed by its leader: refused as malformed
    dht.data[f"{RUN}/plan/3"] = {str(ids[0].peer_id): (plan.to_bytes(), time.time() + 60, ids[0].peer_id)}
    assert await PlanStore(dht.view(), ids[1], RUN).read(2) == []
    assert await PlanStore(dht.view(), ids[1], RUN).read(3) == []
    dht.data[f"{RUN}/plan/2"][str(ids[0].peer_id)] = (head, time.time() + 60, ids[0].peer_id)
    assert await PlanStore(dht.view(), ids[1], RUN).read(2) == [plan]  # the same head, signed by its leader


def test_client_only_peer_gets_no_partition():
    ids = [Identity.generate() for _ in range(3)]
    members = [_record(ids[0], 1.0), _record(ids[1], 0.5), _record(ids[2], 0.5, address=None)]
    plan = _planner(1)(members, str(ids[0].peer_id))
    a = plan.assignment(str(ids[2].peer_id))
    assert a.part_start == a.part_end and a.inner_steps >= 1
    owners = plan.owners()
    assert str(ids[2].peer_id) not in [o[0] for o in owners]
    assert owners[0][1] == 0 and owners[-1][2] == 1000


def test_digest_majority_flags_the_odd_one_out():
    ids = [Identity.generate() for _ in range(4)]
    recs = [
        _record(i, 1.0).model_copy(update={"round": 4, "weights_digest": d})
        for i, d in zip(ids, ["aa", "aa", "aa", "bb"])
    ]
    majority, agree, total = digest_majority(recs, 4)
    assert (majority, agree, total) == ("aa", 3, 4)
    assert digest_majority(recs, 5) == (None, 0, 0)
