"""The round state machine (geomesh_p2p.round.driver.RoundDriver) with in-memory fakes: no processes, no
gRPC. Records live in a shared dict, plans in an in-memory DHT with the real store/get contract (owner =
signer) and the real plan agreement (obtain_plan), the collective averages the participants' updates.
Waiting for peers runs on an injected virtual clock where timing matters (the lone peer's wait)."""

from __future__ import annotations

import asyncio
import logging
import hashlib
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.schema.peer import PeerRecord, SyncProgress
from tests.records_util import peer_record
from geomesh_p2p.round import DhtPlanAgreement, DriverConfig, Phase, PlanStore, RoundDriver, leader_order
from geomesh_p2p.round.last_plan import record_ref
from geomesh_p2p.round.driver import PROBATION_SYNC_GRANTS, ROUND_END_SLACK_S, SYNC_WAIT_MARGIN_S, SYNC_WAIT_SLACK
from geomesh_p2p.round.rules.state_sync import StateSync
from geomesh_p2p.sync.progress import SyncMeter
from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.sync.download import StateSyncError
from geomesh_p2p.trust.probation import may_lead

pytestmark = pytest.mark.timeout(60)
RUN = "driver-test"
NUMEL = 64
CFG = PlanConfig(seq_len=16, target_batch=8, window_s=5.0, payload_bytes=1000)


def _digest(theta: torch.Tensor) -> str:
    return hashlib.sha256(theta.numpy().tobytes()).hexdigest()[:16]


class MemoryDHT:
    """key -> subkey -> (value, expiration, owner PeerID): the DHT's store/get contract for plans."""

    def __init__(self):
        self.data: dict = {}

    async def store(self, key, value, expiration_time, subkey=None, owner=None):
        self.data.setdefault(key, {})[subkey] = (value, expiration_time, owner.peer_id if owner else None)
        return True

    async def get(self, key, latest=True, subkeys=None, quorum=None):
        return dict(self.data.get(key, {}))


class Swarm:
    """Shared records, plans and one exchange per round."""

    def __init__(self):
        self.records: dict[str, PeerRecord] = {}
        self.dht = MemoryDHT()
        self.pushes: dict[tuple[int, str], dict] = {}  # (round, leader) -> peer -> (delta, tokens)
        self.pushed: dict[tuple[int, str], asyncio.Event] = {}


class FakeClock:
    """Virtual time: a wait advances it at once (no real sleep); ``on_wait`` sees every wait."""

    def __init__(self, on_wait=None):
        self.t = 1000.0
        self.on_wait = on_wait

    def time(self):
        return time.time()  # plans' deadlines are real wall-clock times

    def monotonic(self):
        return self.t

    async def wait(self, event, seconds):
        self.t += seconds
        if self.on_wait is not None:
            self.on_wait(self.t)
        await asyncio.sleep(0)
        return event.is_set()


class FakePeer:
    """Every port of one peer: membership, global state, trainer, collective and policy."""

    #: peers every fake plans on probation (a subclass names them)
    PROBATION: frozenset = frozenset()

    def __init__(self, swarm: Swarm, ident: Identity, *, exchange_timeout_s: float = 2.0):
        self.swarm, self.ident, self.me = swarm, ident, str(ident.peer_id)
        self.round, self.syncing, self.leaving = 0, False, False
        self.theta = torch.zeros(NUMEL)
        self.model = self.theta.clone()
        self.digest = _digest(self.theta)
        self.exchange_timeout_s = exchange_timeout_s
        self.rows, self.catch_ups, self.agreements = [], 0, 0
        self.corrupt_outer_step = False
        self.aggregate_nothing = False  # every part of its exchange missed: a zero aggregate
        self.plan_only = None  # a leader planning only these peers
        self.hooks: dict = {}  # phase name -> callable run inside it
        self.full_reads: list[int] = []  # the round of every peers() call (_read_round)
        self.sampled_reads: list[tuple] = []  # (round, peer ids) of every records_of() call
        self.stop = asyncio.Event()
        self.excluded: set[str] = set()  # peers whose digest votes this peer leaves out (policy.digest_voters)

    # Membership
    def record(self) -> PeerRecord:
        return peer_record(
            self.me,
            address=f"127.0.0.1:{7000 + len(self.me) % 100}",
            tokens_per_s={8: 2000.0},
            round=self.round,
            weights_digest=None if self.syncing else self.digest,
            leaving=self.leaving,
            last_plan=None if self.syncing else record_ref(getattr(self, "drv", None), self.round),
        )

    async def peers(self, include_leaving=False):
        self._hook("peers")
        self.full_reads.append(self._read_round())
        self.swarm.records[self.me] = self.record()
        return [r for r in self.swarm.records.values() if include_leaving or not r.leaving]

    def _read_round(self) -> int:
        """The round a read belongs to (the digest check of round r runs after the commit of r + 1)."""
        drv = getattr(self, "drv", None)
        return self.round - 1 if drv is not None and drv.phase is Phase.FINISH else self.round

    async def records_of(self, peer_ids, *, sampled=True):
        self._hook("records_of")
        self.sampled_reads.append((self._read_round(), tuple(peer_ids)))
        self.swarm.records[self.me] = self.record()
        return [self.swarm.records[p] for p in peer_ids if p in self.swarm.records]

    async def announce(self):
        self.swarm.records[self.me] = self.record()

    async def remeasure(self):
        self.remeasured = getattr(self, "remeasured", 0) + 1

    # GlobalStatePort
    state_lock = None  # the fake's state changes only on the driver's worker thread

    def pseudo_gradient(self):
        return self.theta - self.model

    def reset_model(self):
        self.model = self.theta.clone()

    def outer_step(self, r, plan, aggregate, idle=()):
        self.theta -= aggregate
        if self.corrupt_outer_step:
            self.theta[0] += 1.0

    def commit(self, round):
        self.round, self.model, self.digest = round, self.theta.clone(), _digest(self.theta)
        return self.digest

    async def catch_up(self, target=None):
        self.catch_ups += 1
        others = [r for r in self.swarm.records.values() if r.peer_id != self.me and r.weights_digest]
        if target is not None:  # that state only (StateSync.catch_up's target)
            others = [r for r in others if (r.round, r.weights_digest) == target]
        if not others:
            raise StateSyncError("no donor")
        donor = max(others, key=lambda r: (r.round, r.weights_digest))
        peer = PEERS[donor.peer_id]
        self.theta, self.syncing = peer.theta.clone(), False
        self.commit(donor.round)
        await self.announce()

    async def checkpoint_or_warn(self):
        return None

    # Trainer (called in a worker thread)
    def run(self, *, round, inner_steps, batch_size, micro_batch=None, deadline=None, progress=None, should_stop=None):
        self._hook("train")
        done = 0 if should_stop is not None and should_stop() else inner_steps
        self.model = self.model - 0.01 * done * (1 + PEER_INDEX[self.me])
        return SimpleNamespace(
            steps_done=done,
            tokens=done * batch_size * CFG.seq_len,
            mean_loss=3.0,
            last_loss=3.0,
            compute_s=0.1,
            stopped_early=done < inner_steps,
        )

    def evaluate(self, max_batches=8):
        self._hook("finish")
        return 100.0

    # Collective
    async def all_reduce(self, spec, delta, tokens, compute_end=None, *, in_place=False):
        self._hook("exchange")
        # one exchange per plan (round, leader): peers following two plans of a round do not meet, as in the
        # real collective (their specs differ)
        plan, sw, key = spec, self.swarm, (spec.round, spec.leader)
        pushes = sw.pushes.setdefault(key, {})
        pushes[self.me] = (delta.clone(), tokens)
        ev = sw.pushed.setdefault(key, asyncio.Event())
        if set(plan.participants()) <= set(pushes):
            ev.set()
        try:
            await asyncio.wait_for(ev.wait(), self.exchange_timeout_s)  # a silent participant: its part is missed
        except asyncio.TimeoutError:
            pass
        got = {p: v for p, v in pushes.items() if v[1] > 0}
        total = sum(t for _, t in got.values())
        agg = (sum(d * t for d, t in got.values()) / total) if total else torch.zeros(NUMEL)
        if self.aggregate_nothing:
            agg = torch.zeros(NUMEL)
        if in_place:  # as the real collective: the aggregate in the update's own storage
            agg = delta.copy_(agg)
        return SimpleNamespace(
            aggregate=agg,
            contributors={0: [(p, t) for p, (_, t) in sorted(got.items())]},
            missing_parts=[],
            last_compute_end=None,
            idle_ranges=lambda: [],
        )

    # RoundPolicy
    def make_plan(self, members, leader):
        if self.plan_only is not None:
            members = [m for m in members if m.peer_id in self.plan_only]
        return plan_round(
            members,
            CFG,
            run_id=RUN,
            round=self.round,
            leader=leader,
            numel=NUMEL,
            start_time=time.time() + 0.05,
            start_digest=self.digest,
            probation=self.PROBATION,
        )

    def plan_problem(self, plan, live):
        if plan.numel != NUMEL:
            return f"it is for {plan.numel} parameters, the model has {NUMEL}"
        return None if plan.leader in live else "its leader is not a live peer of this run"

    def sampled_plan_problem(self, plan, sampled, sample):
        if plan.numel != NUMEL:
            return f"it is for {plan.numel} parameters, the model has {NUMEL}"
        missing = [p[:10] for p in sample if p not in sampled]
        return f"it names peers that are not live: {missing}" if missing else None

    def records_needed(self, plan):
        return []  # the fake's plans are all one-device peers (planner.records_needed: none)

    def leader_candidates(self, members, live):
        return list(members), [m.peer_id for m in members]

    def collective_spec(self, plan):
        return plan

    def swarm_round(self, records):
        rounds = [r.round for r in records if r.peer_id != self.me and r.weights_digest]
        return max(rounds) if rounds and all(x == rounds[0] for x in rounds) else None

    def rejoin_state(self, records, among=None):
        return None  # the fakes' peers never hold a state ahead of a live swarm that will not follow it

    def digest_voters(self, records):
        return [r for r in records if r.peer_id not in self.excluded]

    def standing_established(self, records, peer_id):
        return True

    def standing_established_ids(self, records, peer_ids=None):
        # by standing_established, which tests replace per peer
        ids = [r.peer_id for r in records] if peer_ids is None else peer_ids
        return frozenset(p for p in ids if self.standing_established(records, p))

    def may_lead_ids(self, records, peer_ids):
        # the real bar rule over this fake's standing (standing_established_ids, replaced per peer by tests)
        view = SimpleNamespace(established_ids=lambda ids: self.standing_established_ids(records, ids))
        return may_lead(view, peer_ids)

    def after_exchange(self, spec, plan, ar):
        pass

    def note_own_failures(self, spec, plan, ar, *, stalled=False):
        pass

    def forget_marks_since(self, round):
        return []

    async def before_outer_step(self, r, plan, assignment, ar):
        pass

    def after_outer_step(self, r, plan, assignment, result, ar):
        pass

    def planned_out(self, r, plan):
        self.sat_out = [*getattr(self, "sat_out", []), r]

    def note_sat_out(self, plan):
        self.marked_sat_out = [*getattr(self, "marked_sat_out", []), plan.round]

    def publish_record(self, rec):
        self.rows.append(rec)

    def _hook(self, phase):
        fn = self.hooks.get(phase)
        if fn is not None:
            fn()

    def driver(
        self, *, rounds=None, min_peers=1, wait_peers_s=3.0, clock=None, plans=None, full_view_peers=8
    ) -> RoundDriver:
        agreement = plans or DhtPlanAgreement(PlanStore(self.swarm.dht, self.ident, RUN))
        me = self

        class Counting:
            async def agree(self, *a, **k):
                me.agreements += 1
                me._hook("agree")
                return await agreement.agree(*a, **k)

            def publish_background(self, plan):
                publish = getattr(agreement, "publish_background", None)
                if publish is not None:
                    publish(plan)

            async def names(self, *a, **k):
                names = getattr(agreement, "names", None)
                return False if names is None else await names(*a, **k)

            if hasattr(agreement, "plan_of"):  # round/last_plan.py: an agreement without it recovers nothing

                async def plan_of(self, *a, **k):
                    return await agreement.plan_of(*a, **k)

        cfg = DriverConfig(
            min_peers=min_peers,
            wait_peers_s=wait_peers_s,
            gather_wait_s=1.0,
            plan_timeout_s=0.3,
            digest_wait_s=1.0,
            rounds=rounds,
            full_view_peers=full_view_peers,
            eval_every=1,  # every row evaluated (auto would follow the fakes' timings: eval_schedule.py)
        )
        self.drv = RoundDriver(
            membership=self,
            plans=Counting(),
            trainer=self,
            collective=self,
            state=self,
            policy=self,
            cfg=cfg,
            stop=self.stop,
            clock=clock,
            leaving=lambda v: setattr(self, "leaving", v),
        )
        return self.drv


PEERS: dict[str, FakePeer] = {}
PEER_INDEX: dict[str, int] = {}


def _peers(n: int, swarm: Swarm | None = None, cls: type[FakePeer] = FakePeer, **kw) -> list:
    """``n`` peers of class ``cls`` sharing ``swarm`` (a new one by default), each with its record announced."""
    swarm = swarm or Swarm()
    out = []
    for k in range(n):
        p = cls(swarm, Identity.generate(), **kw)
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        swarm.records[p.me] = p.record()
        out.append(p)
    return out


async def _run_all(peers, **kw):
    await asyncio.wait_for(asyncio.gather(*[p.driver(**kw).run() for p in peers]), 30)


async def test_three_peers_agree_on_one_plan_per_round_and_end_with_equal_digests():
    peers = _peers(3)
    await _run_all(peers, rounds=2, min_peers=3)
    ids = [p.me for p in peers]
    for r in range(2):
        leaders = {p.drv.history[r].leader for p in peers}
        assert leaders == {_leader_of(ids, r)[:10]}  # not the last round's leader (session 30)
        assert all(p.drv.history[r].inner_steps_done > 0 and p.drv.history[r].peers == 3 for p in peers)
    assert len({p.digest for p in peers}) == 1 and all(p.round == 2 for p in peers)
    assert all(row.digest_agree is True for p in peers for row in p.drv.history)
    assert all(torch.equal(p.theta, peers[0].theta) for p in peers)
    assert all(p.drv.phase is Phase.DONE and p.leaving for p in peers)


async def test_the_next_leader_takes_over_when_the_first_is_silent():
    swarm = Swarm()
    peers = _peers(3, swarm, exchange_timeout_s=0.5)
    order = leader_order(RUN, 0, [p.me for p in peers])
    silent = PEERS[order[0]]  # announced, never plans nor trains
    live = [p for p in peers if p is not silent]
    with events.capture("plan_takeover") as takeovers:
        await _run_all(live, rounds=1)
    assert [p.drv.history[0].leader for p in live] == [order[1][:10]] * 2
    assert [(e["peer"], e["round"], e["turn"]) for e in takeovers] == [(order[1], 0, 1)]
    assert live[0].digest == live[1].digest
    assert all(p.drv.history[0].contributors == 2 for p in live)  # the silent peer's update is missing


async def test_a_planned_out_peer_waits_for_the_round_and_resyncs():
    peers = _peers(3)
    ids = [p.me for p in peers]
    order = leader_order(RUN, 0, ids)
    leader = PEERS[order[0]]
    out = PEERS[order[2]]
    leader.plan_only = {order[0], order[1]}
    with events.capture("planned_out") as planned_out:
        await _run_all(peers, rounds=1)
    assert [(e["peer"], e["round"], e["leader"], e["reason"]) for e in planned_out] == [
        (out.me, 0, order[0], "not_in_plan")
    ]
    assert out.drv.history == [] and out.catch_ups == 1
    assert getattr(out, "sat_out", []) == [0] and not hasattr(leader, "sat_out")  # the policy heard (proofs read)
    # the planned-out peer re-measured its link and device (its next record must not keep what left it out)
    assert getattr(out, "remeasured", 0) == 1 and getattr(leader, "remeasured", 0) == 0
    assert (out.round, out.digest) == (1, leader.digest) and torch.equal(out.theta, leader.theta)
    assert [p.drv.history[0].peers for p in (leader, PEERS[order[1]])] == [2, 2]


async def test_a_digest_mismatch_resyncs_from_the_majority():
    peers = _peers(3)
    odd = peers[2]
    odd.corrupt_outer_step = True
    with events.capture("digest_mismatch") as mismatches:
        await _run_all(peers, rounds=1)
    assert [p.drv.history[0].digest_agree for p in peers] == [True, True, False]
    assert [(e["peer"], e["round"], e["majority_digest"], e["agree"], e["total"]) for e in mismatches] == [
        (odd.me, 1, peers[0].digest, 2, 3)  # the round of the state the outer step made
    ]
    assert mismatches[0]["digest"] != peers[0].digest and mismatches[0]["level"] == "ERROR"
    assert mismatches[0]["behind"] is False
    assert odd.catch_ups == 1 and odd.digest == peers[0].digest and torch.equal(odd.theta, peers[0].theta)


async def test_a_peer_that_applied_nothing_of_a_round_is_behind_the_majority_a_warning_not_an_error():
    """32 processes on 2 cores (session 28): three peers followed a plan that lost the agreement, every part was
    refused, they applied a zero update and held the round's start state; the digest check re-synced them with
    an ERROR each. Their state is the majority's ancestor, not a state off the swarm's line: a WARNING, marked
    ``behind``, and the same re-sync."""
    peers = _peers(3)
    late = peers[2]
    late.aggregate_nothing = True
    start = late.digest
    with events.capture("digest_mismatch") as mismatches:
        await _run_all(peers, rounds=1)
    assert [p.drv.history[0].digest_agree for p in peers] == [True, True, False]
    assert [(e["peer"], e["digest"], e["majority_digest"], e["behind"], e["level"]) for e in mismatches] == [
        (late.me, start, peers[0].digest, True, "WARNING")
    ]
    assert late.catch_ups == 1 and late.digest == peers[0].digest and torch.equal(late.theta, peers[0].theta)


async def test_a_rogue_plan_is_left_unread_and_the_next_leaders_plan_followed(caplog):
    """A plan signed by an identity that is no live peer: no follower could take it (its leader must be live),
    so it is left unread (session 10: parsing and fetching every stranger's head let Sybils slow each read),
    said once per peer; the best-ranked live leader's plan is followed."""
    swarm = Swarm()
    peers = _peers(2, swarm)
    rogue = Identity.generate()
    members = [p.record() for p in peers]
    bad = plan_round(
        members,
        CFG,
        run_id=RUN,
        round=0,
        leader=str(rogue.peer_id),
        numel=7,
        start_time=time.time() + 0.05,
        start_digest=peers[0].digest,
    )
    await PlanStore(swarm.dht, rogue, RUN).publish(bad)  # signed by its leader, but not a live peer's
    with events.capture("plan_refused") as refused, caplog.at_level(logging.INFO, logger="geomesh_p2p.plan.agree"):
        await _run_all(peers, rounds=1)
    best = leader_order(RUN, 0, [p.me for p in peers])[0]
    assert [p.drv.history[0].leader for p in peers] == [best[:10]] * 2
    # each peer says it once (not once per read of the plan store); nothing parsed, so nothing refused
    unread = [r for r in caplog.records if "1 plan(s) under the subkeys of no known peer left unread" in r.message]
    assert len(unread) == 2 and refused == []
    assert peers[0].digest == peers[1].digest


async def test_a_lone_peer_trains_its_own_rounds_without_the_plan_store():
    (lone,) = _peers(1)
    await asyncio.wait_for(lone.driver(rounds=3, min_peers=1).run(), 30)
    assert [row.round for row in lone.drv.history] == [0, 1, 2]
    assert all(row.inner_steps_done > 0 and row.inner_steps_done == row.inner_steps_planned for row in lone.drv.history)
    assert lone.agreements == 0  # no DHT round trips to eat its window
    assert lone.swarm.dht.data == {}


async def test_a_lone_peer_below_min_peers_waits_with_one_log_line():
    (lone,) = _peers(1)
    clock = FakeClock(on_wait=lambda t: t > 1000.0 + 50 and lone.stop.set())
    with events.capture("waiting_for_peers") as waiting:  # one event per line: not one per DHT read
        await asyncio.wait_for(lone.driver(min_peers=2, wait_peers_s=600.0, clock=clock).run(), 30)
    assert [(e["peer"], e["round"], e["min_peers"], e["live"], e["wait_s"]) for e in waiting] == [
        (lone.me, 0, 2, 1, 600.0)
    ]
    assert lone.drv.history == [] and lone.agreements == 0
    assert clock.t > 1050.0  # waited 50 virtual seconds: about 60 backoff reads, no real sleep


@pytest.mark.parametrize("phase", ["gather", "plan", "train", "exchange", "finish"])
async def test_stop_in_each_phase_ends_cleanly(phase):
    swarm = Swarm()
    if phase in ("gather", "plan"):
        # gather: stopped while waiting for a second peer; plan: a silent peer makes it a real agreement
        (p,) = _peers(1, swarm, exchange_timeout_s=0.3)
        other = FakePeer(swarm, Identity.generate())
        if phase == "plan":
            swarm.records[other.me] = other.record()
        PEERS[other.me], PEER_INDEX[other.me] = other, 1
    else:
        (p,) = _peers(1, swarm)
    min_peers = 2 if phase == "gather" else 1

    def stop_here():
        if p.drv.phase.value == phase or phase in ("train", "exchange", "finish"):
            p.stop.set()

    p.hooks[{"gather": "peers", "plan": "agree"}.get(phase, phase)] = stop_here
    await asyncio.wait_for(p.driver(rounds=5, min_peers=min_peers, wait_peers_s=2.0).run(), 30)
    assert p.drv.phase is Phase.DONE and not p.drv.in_exchange
    if phase == "gather":
        assert p.drv.history == []
    else:  # a round that had a plan is finished (its parts stay served), then the peer leaves
        assert len(p.drv.history) == 1 and p.round == 1
        # a stop request announces at once that the peer leaves, whatever the phase (_say_leaving_on_stop)
        assert p.leaving
    if phase in ("plan", "train"):
        # stopped before its inner steps (plan: at the start of the agreement, so none start on a
        # provisional plan during the settle)
        assert p.drv.history[0].inner_steps_done == 0


def test_outer_step_per_part_equals_one_whole_step_and_keeps_bad_and_idle_parts():
    from geomesh_p2p.model.optim import OuterNesterov

    theta = torch.linspace(-1, 1, 12)
    agg = torch.linspace(0.5, -0.5, 12)
    whole, parts = OuterNesterov(0.7, 0.9), OuterNesterov(0.7, 0.9)
    whole.buf, parts.buf = torch.full((12,), 0.25), torch.full((12,), 0.25)
    t_whole, t_parts = theta.clone(), theta.clone()
    whole.step(t_whole, agg)
    bad, bad_in = outer_step_per_part(parts, t_parts, agg, [(0, 4), (4, 8), (8, 12)], r=0)
    assert bad == [] and torch.equal(t_parts, t_whole) and torch.equal(parts.buf, whole.buf)
    assert parts.steps == whole.steps == 1
    agg[1] = float("nan")
    t2, buf2 = t_parts.clone(), parts.buf.clone()
    bad, bad_in = outer_step_per_part(parts, t_parts, agg, [(0, 4), (4, 8), (8, 12)], r=1, idle=[(8, 10)])
    assert bad == [(0, 4)] and bad_in == {(0, 4)}
    assert torch.equal(t_parts[:4], t2[:4]) and torch.equal(parts.buf[:4], buf2[:4])  # NaN part untouched
    assert torch.equal(t_parts[8:10], t2[8:10]) and torch.equal(parts.buf[8:10], buf2[8:10])  # idle
    assert not torch.equal(t_parts[4:8], t2[4:8]) and not torch.equal(t_parts[10:], t2[10:])


# ---------------------------------------------------------------- issue 14 #3: the wait for a syncing joiner
MB = 1 << 20


def _syncing(peer: FakePeer, done: int, total: int = 100 * MB, rate: float = 10 * MB) -> PeerRecord:
    """``peer``'s record while it downloads round ``peer.round``'s state: no digest, its progress."""
    return peer.record().model_copy(
        update={
            "weights_digest": None,
            "sync_progress": SyncProgress(done_bytes=done, total_bytes=total, bytes_per_s=rate),
        }
    )


class Download:
    """A joiner downloading the leader's state at ``rate`` bytes/s from virtual time ``t0``; its record is
    re-announced every ``period`` virtual seconds (the announcer's refresh) and, once the last byte is in,
    carries the leader's digest. ``stall_at``: bytes where the download stops moving."""

    def __init__(self, joiner, leader, clock, *, total=100 * MB, rate=10 * MB, period=2.0, stall_at=None):
        self.joiner, self.leader, self.clock = joiner, leader, clock
        self.total, self.rate, self.period, self.stall_at = total, rate, period, stall_at
        self.t0, self.announced_at = clock.t, None
        self.publish(clock.t)

    def publish(self, t):
        if self.announced_at is not None and t - self.announced_at < self.period:
            return
        self.announced_at = t
        done = min(self.total, int((t - self.t0) * self.rate) + 10 * MB)
        if self.stall_at is not None:
            done = min(done, self.stall_at)
        rec = (
            self.joiner.record().model_copy(update={"weights_digest": self.leader.digest})
            if done >= self.total
            else _syncing(self.joiner, done, self.total, self.rate if self.stall_at is None else 1.0 * MB)
        )
        self.joiner.swarm.records[self.joiner.me] = rec


def _gather_setup(**cfg):
    swarm = Swarm()
    leader, joiner = _peers(2, swarm)
    clock = FakeClock()
    drv = leader.driver(clock=clock)
    for k, v in cfg.items():
        setattr(drv.cfg, k, v)
    return leader, joiner, clock, drv


async def test_the_leader_waits_for_a_syncing_joiner_as_long_as_its_announced_download_needs():
    leader, joiner, clock, drv = _gather_setup()
    dl = Download(joiner, leader, clock)  # 10 of 100 MiB at 10 MiB/s: the last byte at +9 s
    clock.on_wait = dl.publish
    t0 = clock.t
    with events.capture("waiting_for_syncing_peer") as waits:
        members = await drv.gather({leader.me}, first=False)
    assert {m.peer_id for m in members} == {leader.me, joiner.me}  # planned in, not left to re-download
    assert 9.0 <= clock.t - t0 < 11.0  # virtual seconds: until its in-sync record (re-announced every 2 s)
    assert [(e["peer"], e["round"], e["syncing_peer"]) for e in waits] == [(leader.me, 0, joiner.me)]
    (w,) = waits
    assert (w["done_bytes"] >> 20, w["total_bytes"] >> 20, w["bytes_per_s"] / 2**20) == (10, 100, 10.0)
    assert w["wait_s"] == pytest.approx(9.0 * SYNC_WAIT_SLACK + SYNC_WAIT_MARGIN_S, abs=0.1)  # 9 s of download left


async def test_without_announced_progress_the_wait_is_the_gather_wait_as_before():
    leader, joiner, clock, drv = _gather_setup()
    joiner.swarm.records[joiner.me] = joiner.record().model_copy(update={"weights_digest": None})  # older peer
    t0 = clock.t
    members = await drv.gather({leader.me}, first=False)
    assert [m.peer_id for m in members] == [leader.me]
    assert 1.0 < clock.t - t0 < 1.1  # gather_wait_s = 1.0


async def test_a_stalled_download_is_waited_for_only_as_its_last_progress_said_then_a_capped_wait():
    leader, joiner, clock, drv = _gather_setup()
    dl = Download(joiner, leader, clock, stall_at=10 * MB)  # announced 10 of 100 MiB at 1 MiB/s, then no byte
    clock.on_wait = dl.publish
    t0 = clock.t
    members = await drv.gather({leader.me}, first=False)
    assert [m.peer_id for m in members] == [leader.me]
    # 90 MiB at 1 MiB/s is 90 s x 1.25 + 2 s: capped at sync_wait_cap_s from the gather's start
    assert drv.cfg.sync_wait_cap_s == 30.0 and 30.0 < clock.t - t0 < 30.1


async def test_a_download_whose_progress_stops_is_not_waited_for_past_its_derived_wait():
    leader, joiner, clock, drv = _gather_setup()
    joiner.swarm.records[joiner.me] = _syncing(joiner, 90 * MB)  # 10 MiB left at 10 MiB/s, never moves again
    t0 = clock.t
    members = await drv.gather({leader.me}, first=False)
    assert [m.peer_id for m in members] == [leader.me]
    assert 3.25 < clock.t - t0 < 3.35  # 1 s x 1.25 + 2 s margin, although re-announced with the same bytes


async def test_a_joiner_on_probation_holds_the_round_by_its_progress_only_a_few_times():
    leader, joiner, clock, drv = _gather_setup()
    leader.standing_established = lambda records, peer_id: peer_id == leader.me  # the joiner is on probation
    joiner.swarm.records[joiner.me] = _syncing(joiner, 90 * MB)  # never arrives
    waited = []
    for _ in range(PROBATION_SYNC_GRANTS + 1):
        t0 = clock.t
        members = await drv.gather({leader.me}, first=False)
        assert [m.peer_id for m in members] == [leader.me]
        waited.append(clock.t - t0)
    # 1 s x 1.25 + 2 s twice, then only PROBATION_SYNC_WAIT_S (1.5 s): a fake download cannot stall every round
    assert [round(w, 1) for w in waited[:2]] == [3.3, 3.3] and 1.5 < waited[2] < 1.6


def test_sync_progress_is_optional_in_the_record_and_left_out_of_its_bytes_when_unset():
    (p,) = _peers(1)
    plain = p.record()
    assert b"sync_progress" not in plain.to_bytes()  # what a peer of the previous version writes and reads
    assert PeerRecord.from_bytes(plain.to_bytes()) == plain
    syncing = PeerRecord.model_validate(
        dict(
            plain.model_dump(),
            weights_digest=None,
            sync_progress={"done_bytes": 5, "total_bytes": 20, "bytes_per_s": 3.0},
        )
    )
    back = PeerRecord.from_bytes(syncing.to_bytes())
    assert back == syncing and back.sync_progress.remaining_s() == 5.0
    assert SyncProgress(done_bytes=0, total_bytes=20, bytes_per_s=0.0).remaining_s() is None
    assert SyncProgress(done_bytes=20, total_bytes=20, bytes_per_s=0.0).remaining_s() == 0.0
    with pytest.raises(ValueError):
        SyncProgress(done_bytes=21, total_bytes=20, bytes_per_s=1.0)


async def test_sync_meter_counts_a_wrapped_transports_stream_and_measures_the_recent_rate():
    t = [0.0]
    notes = []
    meter = SyncMeter(10 * MB, on_progress=lambda: notes.append(meter.done_bytes), clock=lambda: t[0])

    class Streams:
        address = "127.0.0.1:1"

        async def call_stream(self, addr, method, payload, **kw):
            for _ in range(4):
                t[0] += 0.25
                yield SimpleNamespace(payload=b"x" * MB)

    wrapped = meter.wrap(Streams())
    assert wrapped.address == "127.0.0.1:1"  # everything but call_stream passes through
    got = [len(m.payload) async for m in wrapped.call_stream("a", "m", b"")]
    assert got == [MB] * 4 and meter.done_bytes == 4 * MB
    assert notes == [2 * MB, 4 * MB]  # at most every NOTIFY_EVERY_S (0.5 s)
    assert meter.progress() == SyncProgress(done_bytes=4 * MB, total_bytes=10 * MB, bytes_per_s=4 * MB)
    t[0] += 3.0  # a stall lowers the announced rate
    assert meter.bytes_per_s() == pytest.approx(1 * MB)
    meter.add(7 * MB)  # capped at the total; the last byte is announced at once
    assert meter.done_bytes == 10 * MB and notes[-1] == 10 * MB
    sync = SimpleNamespace(syncing=True, meter=meter)  # what StateSync.progress reads of its rule object
    assert StateSync.progress(sync).done_bytes == 10 * MB
    sync.syncing = False
    assert StateSync.progress(sync) is None


# ------------------------------------------- a contributor of the last round still finishing its exchange
def _finishing_setup(deadline_in_s: float):
    """A leader that applied round 0 (now at round 1) whose plan's exchange deadline is ``deadline_in_s`` from
    now, and a slow contributor of round 0 whose record still shows round 0 at the plan's start digest. The
    driver's wall clock is virtual too (it moves with ``clock.t`` only): the waits until that deadline are exact
    in virtual seconds, however long the test's real steps take on a loaded machine."""
    leader, slow, clock, drv = _gather_setup()
    wall0, t_start = time.time(), clock.t
    clock.time = lambda: wall0 + (clock.t - t_start)  # type: ignore[method-assign]
    plan = leader.make_plan([leader.record(), slow.record()], leader.me)
    drv._last_plan = plan.model_copy(update={"exchange_deadline": wall0 + deadline_in_s})
    leader.theta += 1.0
    leader.commit(1)  # round 0 applied: the leader gathers round 1
    slow.swarm.records[slow.me] = slow.record()  # round 0, the start digest: still in round 0's exchange
    assert slow.record().weights_digest == plan.start_digest
    return leader, slow, clock, drv


async def test_a_contributor_still_in_the_last_exchange_is_waited_for_until_it_arrives():
    leader, slow, clock, drv = _finishing_setup(deadline_in_s=20.0)
    t0 = clock.t

    def arrive(t):  # its pulls end 6 s into the gather (before the deadline): it announces round 1
        if t - t0 >= 6.0 and slow.round == 0:
            slow.theta, slow.round, slow.digest = leader.theta.clone(), 1, leader.digest
            slow.swarm.records[slow.me] = slow.record()

    clock.on_wait = arrive
    with events.capture("waiting_for_late_peer") as waits:
        members = await drv.gather({leader.me, slow.me}, first=False)
    # before: planned out after gather_wait_s (1 s), then a state download behind the others' exchange
    assert {m.peer_id for m in members} == {leader.me, slow.me}
    assert 6.0 <= clock.t - t0 < 7.1
    assert [(e["round"], e["finishing_peer"]) for e in waits] == [(1, slow.me)]
    assert waits[0]["wait_s"] == pytest.approx(20.0 + ROUND_END_SLACK_S)  # said at the gather's start


async def test_a_dead_contributor_is_waited_for_no_longer_than_the_last_exchange_deadline_plus_slack():
    leader, slow, clock, drv = _finishing_setup(deadline_in_s=8.0)
    t0 = clock.t
    members = await drv.gather({leader.me, slow.me}, first=False)  # its record stays at round 0: it died
    assert [m.peer_id for m in members] == [leader.me]
    assert 8.0 + ROUND_END_SLACK_S <= clock.t - t0 < 8.0 + ROUND_END_SLACK_S + 0.1  # virtual seconds


async def test_a_late_contributor_whose_record_expired_or_deadline_passed_gets_the_plain_wait():
    leader, slow, clock, drv = _finishing_setup(deadline_in_s=-30.0)  # the deadline passed long ago
    t0 = clock.t
    members = await drv.gather({leader.me, slow.me}, first=False)
    assert [m.peer_id for m in members] == [leader.me]
    assert 1.0 < clock.t - t0 < 1.1  # gather_wait_s: its deadline plus the slack lies in the past
    leader, slow, clock, drv = _finishing_setup(deadline_in_s=20.0)
    del slow.swarm.records[slow.me]  # record expired: it is not live
    t0 = clock.t
    members = await drv.gather({leader.me, slow.me}, first=False)
    assert [m.peer_id for m in members] == [leader.me]
    assert 1.0 < clock.t - t0 < 1.1  # gather_wait_s


async def test_a_stop_request_is_announced_at_once_not_at_the_rounds_end():
    """A stop during the inner steps is announced (record ``leaving``) before the round's exchange: announced
    only at the round's end it raced the others' gather of the next round, and a leader could plan a peer
    about to exit (fresh-user trial, with --eager: half the model without an update that round)."""
    swarm = Swarm()
    (p,) = _peers(1, swarm)
    seen_at_exchange = []
    p.hooks["train"] = p.stop.set
    p.hooks["exchange"] = lambda: seen_at_exchange.append(swarm.records[p.me].leaving)
    with events.capture("leaving_announced") as said:
        await asyncio.wait_for(p.driver(rounds=5, min_peers=1).run(), 30)
    assert seen_at_exchange == [True]
    assert [(e["reason"], e["round"]) for e in said] == [("stop", 0)]  # said once, while round 0 ran
    assert len(p.drv.history) == 1  # the round under way was still finished


def _leader_of(ids, r):
    """Round ``r``'s leader when every round's plan names all of ``ids``: the first ranked among them but the last
    round's leader (no self-succession, round/planning.last_round_leaders)."""
    last = None
    for k in range(r + 1):
        last = leader_order(RUN, k, [i for i in ids if i != last])[0]
    return last


def _light_of(ids, r, full_view_peers):
    """The peers ranked ``full_view_peers`` or later to lead round ``r`` among ``ids`` but round ``r - 1``'s leader:
    its light followers."""
    last = _leader_of(ids, r - 1)
    return set(leader_order(RUN, r, [i for i in ids if i != last])[full_view_peers:])


async def test_light_followers_follow_the_plan_and_check_a_sample_without_reading_every_record():
    # Issue 25: only the peers ranked first to lead (full_view_peers) read every record; the others follow the
    # signed plan, check it against a sample of records and their digest against a sample of digests.
    peers = _peers(5)
    ids = [p.me for p in peers]
    await _run_all(peers, rounds=4, min_peers=5, full_view_peers=2)
    assert len({p.digest for p in peers}) == 1 and all(p.round == 4 for p in peers)
    assert all(torch.equal(p.theta, peers[0].theta) for p in peers)
    for r in range(4):
        light = _light_of(ids, r, 2) if r > 0 else set()  # round 0 follows no plan yet: everyone is full
        assert len(light) == (2 if r else 0)  # 5 less the 2 full-view candidates and the last round's leader
        assert {p.me for p in peers if p.drv.history[r].extra.get("light")} == light
        assert len({p.drv.history[r].leader for p in peers}) == 1
        assert all(p.drv.history[r].digest_agree is True for p in peers)
        for p in peers:
            if p.me in light:
                # no full read in a light round (after the last one, one: the run's end check, resync.check_end);
                # two sampled reads at least (the plan's and the digest's)
                assert p.full_reads.count(r) == (1 if r == 3 else 0), (r, p.full_reads)
                reads = [ids_ for rr, ids_ in p.sampled_reads if rr == r]
                assert len(reads) >= 2
                plan_sample = reads[0]
                assert p.drv.history[r].leader == plan_sample[0][:10]  # the leader's record comes first
                assert len(plan_sample) == 4 and p.me not in plan_sample  # every other participant (5 - 1)
            else:
                assert r in p.full_reads


async def test_a_light_follower_whose_sample_is_missing_takes_the_full_path_for_that_round():
    # A check it cannot make from the plan and the sample (here: the sampled records cannot be read) sends the
    # round back to the full path (gather, full agreement): the same plan is followed, one INFO line says why.
    peers = _peers(4)
    ids = [p.me for p in peers]
    light1 = _light_of(ids, 1, 1)
    victim = PEERS[sorted(light1)[0]]

    def fail() -> None:
        # round 1's own reads; round 0's digest check (FINISH, at round 1 after its commit) reads its voters'
        # records too (records_of since session 45), and must not fail here
        if victim.round == 1 and victim.drv.phase is not Phase.FINISH:
            raise ConnectionError("DHT unreachable")

    victim.hooks["records_of"] = fail
    with events.capture("light_fallback") as fallbacks:
        await _run_all(peers, rounds=3, min_peers=4, full_view_peers=1)
    assert len({p.digest for p in peers}) == 1
    assert [(e["peer"], e["round"]) for e in fallbacks] == [(victim.me, 1)]
    assert "reading the sample's records failed (ConnectionError: DHT unreachable)" in fallbacks[0]["reason"]
    assert not victim.drv.history[1].extra.get("light") and 1 in victim.full_reads
    assert bool(victim.drv.history[2].extra.get("light")) is (victim.me in _light_of(ids, 2, 1))
    assert len({p.drv.history[1].leader for p in peers}) == 1


async def test_a_plan_agreement_says_whether_the_plans_of_a_round_name_a_peer():
    """``DhtPlanAgreement.names`` (asked by a peer stopped between rounds, session 34): True once a signed plan of the
    round names the peer; False at its first read that finds plans naming others only (its leaving was read); False
    after the wait when there is no plan at all."""
    a, b, c = _peers(3)
    store = PlanStore(a.swarm.dht, a.ident, RUN)
    reads: list[int] = []
    read = store.read

    async def counted(round, *args, **kw):
        reads.append(round)
        return await read(round, *args, **kw)

    store.read = counted  # type: ignore[method-assign]
    agreement = DhtPlanAgreement(store)
    assert not await agreement.names(0, c.me, 0.3, poll_s=0.1)
    assert 2 <= len(reads) <= 4  # polled through the wait
    await store.publish(a.make_plan([a.record(), b.record()], a.me))  # c left out
    assert await agreement.names(0, b.me, 5.0)
    reads.clear()
    assert not await agreement.names(0, c.me, 5.0, poll_s=0.1)
    assert reads == [0]  # one read: the round is planned without it
    assert not await agreement.names(1, b.me, 0.0)  # another round: none


async def test_a_peer_stopped_between_rounds_asks_once_whether_the_next_plan_names_it():
    """Session 34: stopped between rounds, a peer asks whether a plan of the next round names it (a leader that read
    its record before it announced leaving planned it; it then takes part with 0 inner steps, its part served). A peer
    alone does not ask (nobody will plan: the wait cost every Ctrl+C of a 2-peer swarm whose other peer had ended
    4 s) and leaves after its round; with another peer live it asks once: after one round taken part in, never again
    (a leader that kept naming it cannot keep it from leaving)."""
    asked: list[int] = []

    class Naming(DhtPlanAgreement):
        async def names(self, round, peer_id, wait_s, poll_s=0.25):
            asked.append(round)
            return True

    (lone,) = _peers(1)
    lone.hooks["finish"] = lone.stop.set
    await asyncio.wait_for(lone.driver(rounds=5, plans=Naming(PlanStore(lone.swarm.dht, lone.ident, RUN))).run(), 30)
    assert lone.drv.phase is Phase.DONE and lone.leaving
    assert [x.round for x in lone.drv.history] == [0] and asked == []

    p, _other = _peers(2)
    drv = p.driver(plans=Naming(PlanStore(p.swarm.dht, p.ident, RUN)))
    assert await drv._planned_after_stop() is True and asked == [0]
    assert await drv._planned_after_stop() is False and asked == [0]  # not asked again


def test_a_light_follower_is_ranked_among_the_peers_that_may_lead():
    """``light.is_light`` ranks this peer among the last plan's participants (its leader left out) that its own
    ledger holds established, as the full path's leader candidates are (trust.probation.leader_candidates). Session
    38's e2e run: the others' underfilled round 0 earned them no standing, the one established peer ranked second
    among all four ran light and waited a whole plan attempt for plans from peers that deferred to it."""
    import threading
    from types import SimpleNamespace

    from geomesh_p2p.round.light import is_light

    ids = [f"peer{i}" for i in range(5)]
    leader, took = ids[0], ids[1:]
    order = leader_order(RUN, 1, took)
    lone = order[1]  # the only established peer, ranked second among all participants

    def drv(me, established):
        return SimpleNamespace(
            cfg=SimpleNamespace(full_view_peers=1, eager=False),
            _last_plan=SimpleNamespace(round=0, leader=leader, run_id=RUN, participants=lambda: ids),
            state=SimpleNamespace(round=1, syncing=False),
            _light_ok_round=1,
            _light_fallback_round=None,
            stop=threading.Event(),
            leaving=False,
            me=me,
            policy=SimpleNamespace(
                may_lead_ids=lambda records, peer_ids: may_lead(
                    SimpleNamespace(established_ids=lambda ids: frozenset(established)), peer_ids
                )
            ),
        )

    assert not is_light(drv(lone, {lone}))  # the full path's only candidate reads every record
    assert is_light(drv(order[0], {lone}))  # ranked first among all, but no candidate: light
    # nobody established in its ledger (a fresh swarm): every participant is a candidate, as before
    assert [is_light(drv(p, set())) for p in order] == [False, True, True, True]
    assert not is_light(drv(leader, {lone}))  # the last round's leader is no participant of the ranking
