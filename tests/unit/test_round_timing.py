"""Per-phase timing of the round driver (issue 17): every row carries the seconds of each phase of its
cycle (``RoundRecord.phase_s``), the cycle's length and the compute share, with the in-memory fakes of
``tests/test_round_driver.py`` (no processes). Phases are made to take known virtual time through the
fakes' hooks on an injected clock whose monotonic time the hooks advance, so the values are exact."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from geomesh_p2p.telemetry.metrics import PHASES
from tests.unit.test_round_driver import FakeClock, _peers

pytestmark = pytest.mark.timeout(60)


class SteppingClock(FakeClock):
    """A FakeClock whose monotonic time the fakes' hooks move (``advance``): a phase 'takes' what its hook
    adds. Waits add nothing here, so only the hooks' seconds show up in the phases."""

    async def wait(self, event, seconds):
        return await super().wait(event, 0.0)

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def test_a_lone_peers_rows_carry_the_seconds_of_each_phase_and_the_cycle():
    (peer,) = _peers(1)
    clock = SteppingClock()
    peer.hooks = {
        "train": lambda: clock.advance(5.0),
        "exchange": lambda: clock.advance(0.25),
        "finish": lambda: clock.advance(0.5),
    }  # "finish": the fakes' evaluate
    drv = peer.driver(rounds=3, clock=clock)
    await drv.run()
    rows = drv.history
    assert [r.round for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(row.phase_s) <= set(PHASES)
        assert row.phase_s["train"] == 5.0
        assert row.phase_s["exchange"] == 0.25
        assert row.phase_s["eval"] == 0.5
        # nothing else takes virtual time in the fakes
        assert sum(v for k, v in row.phase_s.items() if k not in ("train", "exchange", "eval")) == 0.0
    assert rows[0].cycle_s is None and rows[0].compute_share is None
    # the cycle of rows 1 and 2: exactly the phases of that round (train 5 + exchange 0.25 + eval 0.5)
    assert [r.cycle_s for r in rows[1:]] == [5.75, 5.75]
    assert [r.other_s for r in rows[1:]] == [0.0, 0.0]
    assert rows[1].compute_s == 0.1  # the fakes' InnerResult; the share is compute_s / cycle_s
    assert rows[1].compute_share == pytest.approx(0.1 / 5.75, abs=1e-12)


async def test_rows_carry_the_anonymous_memory_each_phase_added():
    """Issue 27's memory by phase: a train phase that keeps 64 MiB (written, so resident) shows it in that row's
    ``phase_rss_mib["train"]``; the next row's train phase keeps nothing more; every row says the process's RssAnon."""
    (peer,) = _peers(1)
    kept: list[bytes] = []
    peer.hooks = {"train": lambda: kept.append(bytes(range(256)) * (2**18)) if not kept else None}
    drv = peer.driver(rounds=2, clock=SteppingClock())
    await drv.run()
    first, second = drv.history
    assert len(kept[0]) == 64 * 2**20
    assert first.extra["phase_rss_mib"]["train"] >= 63.0  # the allocator may round up, never down
    assert abs(second.extra["phase_rss_mib"].get("train", 0.0)) < 16.0
    assert all(r.extra["rss_mib"]["RssAnon"] >= 64.0 for r in (first, second))


def test_status_bytes_reads_the_named_fields_and_leaves_out_unknown_ones():
    from geomesh_p2p.util.procstat import status_bytes

    got = status_bytes("RssAnon", "VmHWM", "NoSuchField")
    assert set(got) == {"RssAnon", "VmHWM"}
    assert 0 < got["RssAnon"] <= got["VmHWM"] and got["RssAnon"] % 1024 == 0


# ---------------------------------------------------------------- training during the plan's settle


async def test_the_settle_hands_out_the_likely_plan_first_and_still_follows_the_best_ranked():
    """Split views (as tests/test_round.py): the partial-view peer publishes first and is handed its own
    plan as provisional before the settle; the best-ranked leader's plan, published meanwhile, is the one
    returned (the rule of which plan is followed is unchanged)."""
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.round import PlanStore, leader_order, obtain_plan
    from geomesh_p2p.plan.awb import plan_round
    from tests.unit.test_round import CFG, RUN as RRUN, MemoryDHT, _record

    ids = [Identity.generate() for _ in range(4)]
    recs = {str(i.peer_id): _record(i, 1.0) for i in ids}
    order = leader_order(RRUN, 7, list(recs))
    by_id = {str(i.peer_id): i for i in ids}
    best, second = order[0], order[1]
    dht = MemoryDHT()
    seen, handed = [], asyncio.Event()

    def planner(members, leader):  # starts well in the future: the best-ranked leader may still publish
        return plan_round(
            members,
            CFG,
            run_id=RRUN,
            round=7,
            leader=leader,
            numel=1000,
            start_time=time.time() + 30,
            start_digest="d0",
        )

    def provisional(plan):
        seen.append(plan)
        handed.set()

    t_second = asyncio.create_task(
        obtain_plan(
            PlanStore(dht.view(), by_id[second], RRUN),
            7,
            [recs[second], recs[order[2]]],
            planner,
            plan_timeout_s=1.0,
            settle_s=3.0,
            provisional=provisional,
        )
    )
    await asyncio.wait_for(handed.wait(), 20)  # it published, read its own plan and began to settle
    r_best = await obtain_plan(
        PlanStore(dht.view(), by_id[best], RRUN), 7, list(recs.values()), planner, plan_timeout_s=1.0, settle_s=0.1
    )
    r_second = await t_second
    assert [p.leader for p in seen] == [second]  # provisional: its own plan, the only one it had seen
    assert r_second.leader == r_best.leader == best and r_second.to_bytes() == r_best.to_bytes()


async def test_inner_steps_start_during_the_settle_and_are_not_run_twice():
    """3 fake peers with the real plan agreement (settle 0.5 s): every peer's inner steps of a round start
    while the driver is still in PLAN (the settle), run once per round, and the swarm ends with equal
    digests."""
    from geomesh_p2p.round import Phase

    peers = _peers(3)
    runs = {p.me: [] for p in peers}
    for p in peers:
        p.hooks = {"train": (lambda p=p: runs[p.me].append((p.round, p.drv.phase)))}
    await asyncio.wait_for(asyncio.gather(*[p.driver(rounds=2, min_peers=3).run() for p in peers]), 30)
    for p in peers:
        assert [r for r, _ in runs[p.me]] == [0, 1]  # once per round
        assert all(ph is Phase.PLAN for _, ph in runs[p.me])  # started during the settle
        assert [row.round for row in p.drv.history] == [0, 1]
    assert len({p.digest for p in peers}) == 1 and all(p.round == 2 for p in peers)


async def test_steps_started_on_a_plan_that_loses_the_settle_are_discarded():
    """The agreement hands out plan A as provisional, then returns plan B (a better-ranked leader's): the
    steps trained on A are stopped and thrown away (the model goes back to the global weights), B's
    are trained, and the row follows B."""
    from geomesh_p2p.telemetry import events

    peers = _peers(2)
    a_leader, b_leader = peers[0].me, peers[1].me

    class Switching:
        def __init__(self, peer):
            self.peer = peer

        async def agree(self, round, members, make_plan, *, accept, candidates, plan_timeout_s, provisional=None, **kw):
            plan_a, plan_b = make_plan(members, a_leader), make_plan(members, b_leader)
            provisional(plan_a)
            await asyncio.sleep(0)  # the early steps start
            return plan_b

    calls = {p.me: 0 for p in peers}
    resets = {p.me: 0 for p in peers}
    for p in peers:
        p.hooks = {"train": (lambda p=p: calls.__setitem__(p.me, calls[p.me] + 1))}
        orig = p.reset_model
        p.reset_model = lambda p=p, orig=orig: (resets.__setitem__(p.me, resets[p.me] + 1), orig())
    with events.capture("early_steps_discarded") as discarded:
        await asyncio.wait_for(
            asyncio.gather(*[p.driver(rounds=1, min_peers=2, plans=Switching(p)).run() for p in peers]), 30
        )
    for p in peers:
        assert calls[p.me] == 2 and resets[p.me] == 1  # A's steps, discarded; then B's
        assert p.drv.history[0].leader == b_leader[:10]
    assert sorted((e["peer"], e["round"], e["started_leader"], e["followed_leader"]) for e in discarded) == sorted(
        (p.me, 0, a_leader, b_leader) for p in peers
    )
    assert peers[0].digest == peers[1].digest


# ---------------------------------------------------------------- evaluation off the critical path


async def test_background_evaluation_measures_a_snapshot_and_lands_in_the_next_row():
    """eval_background: round r's evaluation runs on a snapshot of the global weights taken right after
    its commit and lands in row r + 1 (``eval_round`` r); the last round is evaluated at once."""
    (peer,) = _peers(1)
    snaps = []
    peer.snapshot_for_eval = lambda: snaps.append(peer.theta.clone())
    # a value that tells the snapshots apart: minus the sum of the weights it measured
    peer.evaluate_snapshot = lambda max_batches=8: 1000.0 - float(snaps[-1].sum())
    drv = peer.driver(rounds=3)
    drv.cfg.eval_background = True
    await drv.run()
    rows = drv.history
    assert len(snaps) == 2  # rounds 0 and 1; round 2 is the last: evaluated at once (the fakes' 100.0)
    assert (rows[0].eval_ppl, rows[0].eval_round) == (None, None)
    assert (rows[1].eval_ppl, rows[1].eval_round) == (1000.0 - float(snaps[0].sum()), 0)
    assert (rows[2].eval_ppl, rows[2].eval_round) == (100.0, 2)
    assert snaps[0].sum() != 0 and not torch.equal(snaps[0], snaps[1])  # the weights after rounds 0 and 1
    assert drv._eval_task is None


async def test_without_background_evaluation_rows_are_evaluated_in_place():
    (peer,) = _peers(1)
    drv = peer.driver(rounds=2)
    await drv.run()
    assert [(r.eval_ppl, r.eval_round) for r in drv.history] == [(100.0, 0), (100.0, 1)]


@pytest.mark.timeout(120)
def test_the_trainers_eval_snapshot_gives_evaluates_value_while_the_model_trains_on(tmp_path):
    """InnerTrainer.snapshot_for_eval / evaluate_snapshot: the snapshot's perplexity equals evaluate() on
    the weights it copied (bitwise: same batches, same model), also after the model trained on."""
    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.build import build_model
    from geomesh_p2p.model.training import InnerTrainer

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = load_dataset(None, seq_len=32, cache_dir=tmp_path)
        tr = InnerTrainer(
            build_model("tiny", vocab_size=ds.vocab_size, seed=0),
            ds,
            device="cpu",
            seq_len=32,
            lr=1e-3,
            weight_decay=0.1,
            warmup_steps=1,
            total_steps=20,
            seed=0,
            peer_id="p0",
        )
        with pytest.raises(RuntimeError):
            tr.evaluate_snapshot(max_batches=1)
        before = tr.evaluate(max_batches=2)
        tr.snapshot_for_eval()
        tr.run(round=0, inner_steps=2, batch_size=2)
        assert tr.evaluate_snapshot(max_batches=2) == before  # the copy, not the trained model
        after = tr.evaluate(max_batches=2)
        assert after != before
        tr.snapshot_for_eval()  # in place the second time
        assert tr.evaluate_snapshot(max_batches=2) == after
    finally:
        torch.set_num_threads(n)


async def test_each_row_carries_its_cycles_traffic_per_method_class():
    """``extra["traffic"]``: the change of the driver's ``traffic_classes()`` between two rows (the first
    row: since the start), DHT and exchange apart -- here a counter that grows by a known amount per row."""
    (peer,) = _peers(1)
    drv = peer.driver(rounds=3)
    calls = {"n": 0}

    def traffic_classes() -> dict:
        calls["n"] += 1
        n = calls["n"]
        return {"dht": {"sent": 100 * n, "received": 300 * n, "calls": 2 * n, "served": 5 * n}}

    drv.traffic_classes = traffic_classes
    await drv.run()
    rows = drv.history
    assert [r.extra["traffic"] for r in rows] == [{"dht": {"sent": 100, "received": 300, "calls": 2, "served": 5}}] * 3
    assert calls["n"] == 3  # read once per row


async def test_the_settle_lasts_as_long_as_the_slowest_recent_dht_store(monkeypatch):
    """Issue 25 (32 processes on 2 cores): stores took seconds, so a better-ranked plan became visible after a
    0.5 s settle had ended for some followers, and one round ended on two states. The agreement's settle is the
    longest of the node's recent DHT stores, at least SETTLE_S (0.5 s); a DHT that measures none keeps 0.5 s."""
    from types import SimpleNamespace

    import geomesh_p2p.round as round_mod
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.plan.agree import SETTLE_S
    from geomesh_p2p.round import DhtPlanAgreement, PlanStore
    from tests.unit.test_round import RUN as RRUN, MemoryDHT

    ident = Identity.generate()
    assert PlanStore(MemoryDHT().view(), ident, RRUN).settle_s() == SETTLE_S == 0.5
    times = [0.2]
    slow = SimpleNamespace(recent_store_s=lambda: max(times))
    store = PlanStore(slow, ident, RRUN)
    assert store.settle_s() == 0.5
    times.append(2.75)
    assert store.settle_s() == 2.75
    got = {}

    async def fake_obtain(*args, **kwargs):
        got.update(kwargs)

    monkeypatch.setattr(round_mod, "obtain_plan", fake_obtain)
    await DhtPlanAgreement(store).agree(7, [], None, accept=None, candidates=[], plan_timeout_s=1.0)
    assert got["settle_s"] == 2.75


def test_a_follower_settles_twice_as_long_for_plans_that_may_be_chunked():
    """Red team (session 18): a plan body over 4 KB (PLAN_INLINE_BYTES, ~40 participants) is published in two steps
    (its chunks, then the head), so it becomes visible two store latencies after its leader starts: from
    CHUNKED_SETTLE_PEERS (32) participants a follower settles twice PlanStore.settle_s, still ended by the middle of
    the window (at least SETTLE_S)."""
    from geomesh_p2p.plan.agree import CHUNKED_SETTLE_PEERS, SETTLE_S, settle_for
    from geomesh_p2p.plan.wire import PLAN_INLINE_BYTES, split_plan
    from tests.plan_util import big_plan

    small, large = big_plan(CHUNKED_SETTLE_PEERS - 1), big_plan(CHUNKED_SETTLE_PEERS)
    assert not split_plan(small).chunks  # below the count every plan is inline ...
    assert any(split_plan(big_plan(n)).chunks for n in range(CHUNKED_SETTLE_PEERS, 64))  # ... above it some are not
    assert PLAN_INLINE_BYTES == 4096
    window = small.window_s
    assert settle_for(small, 1.0) == min(1.0, max(SETTLE_S, window / 2))
    assert settle_for(large.model_copy(update={"window_s": 60.0}), 1.0) == 2.0
    assert settle_for(large.model_copy(update={"window_s": 2.0}), 1.0) == 1.0  # the middle of a 2 s window
    assert settle_for(large.model_copy(update={"window_s": 0.4}), 1.0) == SETTLE_S  # the floor of the window's cap


async def test_each_phase_carries_the_cpu_seconds_the_process_used_in_it():
    """Issue 27 (session 38): ``extra["phase_cpu_s"]`` holds, for every timed phase, the process's CPU seconds
    meanwhile: a hook that burns 0.05 s of CPU in the inner steps shows at least that in "train"."""
    (peer,) = _peers(1)
    clock = SteppingClock()

    def burn() -> None:
        c0 = time.process_time()
        while time.process_time() - c0 < 0.05:
            pass
        clock.advance(5.0)

    peer.hooks = {"train": burn}
    drv = peer.driver(rounds=2, clock=clock)
    await drv.run()
    for row in drv.history:
        cpu = row.extra["phase_cpu_s"]
        assert set(cpu) == set(row.phase_s) and all(v >= 0.0 for v in cpu.values())
        assert cpu["train"] >= 0.05
