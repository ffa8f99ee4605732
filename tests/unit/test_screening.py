"""Screening newcomers (issue 28; geomesh_p2p/trust/verify_screen.py): every contributor's first rounds get the
loss-gain test alone, ahead of the sampled checks; a newcomer trained on other data fails in its first round and
is excluded for everyone (every screener replays the same batches and rows, so one screener's measurement is its
re-check of another's evidence); an honest newcomer passes; nothing is skipped; rounds stay re-checkable with
their contributions on disk.

The world is tests/verify_util.py's (real tiny model, KJV corpus, batch 8 x 64). Its round under test is round 2,
one of the swarm's first ``screen_rounds`` = 3 rounds, so every contributor is a newcomer there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust import evidence as EV
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.verify_queue import CheckJob, CheckQueue
from tests.poison import PoisonedCorpus
from tests.verify_util import ROUND, RUN, FakeDHT, _fixed_identity, _packets, _plan, _signed, _verifier, world_fixture

# one intra-op thread (conftest's one_thread) for the screens too, not only the world's training: under make test's
# load (3 workers on 2 cores) spin-waiting OpenMP threads made each screen's CPU steps many times slower
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

world = pytest.fixture(scope="module", name="world")(world_fixture)

#: no sampled checks (share 0): what runs is the screening alone. duty 1: the background worker computes flat out
#: (the pacing is the Pacer's, tested in tests/unit/test_verify_queue.py; at the default 0.15 it only stretched
#: each ``wait_idle`` here by up to 1 / 0.15: ~50 s of this module's sleeps on two cores)
CFG = VT.VerifyConfig(share=0.0, duty=1.0)


def _signed_of(world, packets):
    a = world.pid["A"]
    signed = {j: _signed(world.ids["A"], packets[a][j], j, s, e) for j, (s, e) in enumerate(world.part_ranges)}
    return lambda part, sender: signed[part] if sender == a else None


def _case(world, contribution, H, names=("V", "W"), own=None):
    """The round with screeners ``names`` that contributed honestly too (a screener's own contribution is the
    loss-gain test's power reference: ``VerifyConfig.gain_t_gap``; ``own(peer_id)``: another one): everybody is a
    newcomer, so they are screened as well (A, B, C and the screeners)."""
    ids = {n: _fixed_identity(f"screener-{n}") for n in names}
    plan = _plan(world, ids)
    own = own or world.honest_of
    packets = _packets(world, contribution, H, extra={str(i.peer_id): own(str(i.peer_id)) for i in ids.values()})
    return ids, plan, packets


def test_a_newcomer_trained_on_other_data_fails_its_first_screen_and_is_excluded_by_every_screener(world):
    ids, plan, packets = _case(world, world.wrong_data, 10)
    a, b, c = world.pid["A"], world.pid["B"], world.pid["C"]
    v_id, w_id = str(ids["V"].peer_id), str(ids["W"].peer_id)
    # gain_first_round <= round 2 < gain_first_round + screen_rounds: all new, the screeners too
    assert VT.screen_candidates(CFG, plan, packets) == sorted([a, b, c, v_id, w_id])
    dht = FakeDHT()
    v = _verifier(world, ids["V"], CFG, plan, packets)
    w = _verifier(world, ids["W"], CFG, plan, packets)
    v.dht = w.dht = dht
    try:
        assert v.queue_screens(ROUND, signed_of=_signed_of(world, packets)) == 4  # everybody else
        assert v.queue_check(ROUND) is False  # share 0: no sampled check drawn
        assert v.queue.wait_idle(240)
        [ev] = asyncio.run(v.tend(ROUND))  # the round it was queued in: concluded, published
        assert (ev.task.kind, ev.accused, ev.round, ev.outcome) == (VT.SCREEN, a, ROUND, VC.FAIL)
        assert "no loss gain on its own batches" in ev.reason and ev.task.steps == () and ev.task.passes() == 0
        t_a = v.screen_results[(ROUND, a)][0].gain
        assert t_a is not None and t_a.t < CFG.gain_t_hard and t_a.k == 8 and t_a.m == CFG.gain_controls
        for p in (b, c, w_id):  # the honest contributors of the same round pass
            assert v.screen_results[(ROUND, p)][1].outcome == VC.PASS and p not in v.excluded
        assert a in v.excluded and a in v.lone  # its own measurement alone, so far
        assert list(dht.data[EV.screen_evidence_key(RUN, ROUND, a)]) == [str(ids["V"].peer_id)]
        assert v.counts()["screened"] == 4 and v.counts()["dropped"] == 0

        # W screens the same newcomer: the same batches and rows, so the same t to the bit, and V's evidence is
        # settled by W's own measurement (no second computation): A is out at W for everyone's reasons
        assert w.queue_screens(ROUND, signed_of=_signed_of(world, packets)) == 4
        assert w.queue.wait_idle(240)
        [ev_w] = asyncio.run(w.tend(ROUND))
        assert w.screen_results[(ROUND, a)][0].gain == t_a and ev_w.task == dataclasses.replace(
            ev.task, verifier=str(ids["W"].peer_id)
        )
        assert a in w.excluded and a not in w.lone
        assert w.counts()["queued"] == 5  # its four screens and the probe that orders them (session 47); no re-check
        asyncio.run(v.tend(ROUND))  # V reads W's evidence: confirmed by its own measurement
        assert a in v.excluded and a not in v.lone
        assert v.filter([types.SimpleNamespace(peer_id=a), types.SimpleNamespace(peer_id=b)]) == [
            types.SimpleNamespace(peer_id=b)
        ]
    finally:
        v.close()
        w.close()


def test_a_participant_that_screened_nothing_re_checks_the_evidence_with_the_same_screen(world):
    cfg = dataclasses.replace(CFG, screeners=1)
    ids, plan, packets = _case(world, world.wrong_data, 10)
    a = world.pid["A"]
    seed = VT.screen_seed(RUN, plan, packets)
    [screener] = VT.screeners_of(seed, a, [x.peer_id for x in plan.assignments], 1)
    everyone = {str(i.peer_id): i for i in [*ids.values(), world.ids["B"], world.ids["C"]]}
    observer_id = next(p for p in everyone if p != screener)
    dht = FakeDHT()
    s = _verifier(world, everyone[screener], cfg, plan, packets)
    o = _verifier(world, everyone[observer_id], cfg, plan, packets)
    s.dht = o.dht = dht
    try:
        assert s.queue_screens(ROUND, signed_of=_signed_of(world, packets)) >= 1
        assert s.queue.wait_idle(240)
        assert [e.accused for e in asyncio.run(s.tend(ROUND))] == [a]
        assert (ROUND, a) not in o.screen_results
        assert asyncio.run(o.tend(ROUND)) == []  # reads the evidence, queues its re-check in the first lane
        assert o.queue.wait_idle(240)
        asyncio.run(o.tend(ROUND))
        assert o.queue.counts.by_kind == {"rescreen": 1}  # the observer screened nothing itself
        assert o.screen_results[(ROUND, a)][0].gain == s.screen_results[(ROUND, a)][0].gain  # the same screen
        assert a in o.excluded and a not in o.lone and f"checked by {screener[:10]}" in o.excluded[a]
    finally:
        s.close()
        o.close()


def test_where_the_test_has_no_power_a_low_gain_is_inconclusive_not_a_failure(world):
    """Session 17: at a swarm's first rounds honest contributions measured t 0.8-1.25 (an update of a fresh model
    is what any text teaches) and honest peers excluded each other. A low t now counts only when the screener's
    own contribution of the round reaches t + gain_t_gap on its own batches. Here the screeners' own updates carry
    no trace of their batches (the last global update), so A's wrong-data contribution passes as inconclusive:
    no evidence, nobody excluded; with honest screeners (the first test) the same contribution fails. Since session
    45 a screener whose own reference has no power borrows 2 other contributions of the round (every one must show
    it: tests/unit/test_borrowed_reference.py), so B's and C's carry no trace of their batches here either: no
    power anywhere in the round, as at a swarm's first rounds."""
    ids, plan, packets = _case(world, world.wrong_data, 10, names=("V",), own=lambda _: world.prev_aggregate)
    for n in ("B", "C"):
        packets[world.pid[n]] = _packets(world, world.prev_aggregate, 10)[world.pid["A"]]
    a = world.pid["A"]
    v = _verifier(world, ids["V"], CFG, plan, packets)
    v.dht = FakeDHT()
    try:
        assert v.queue_screens(ROUND) == 3  # A, B, C (V's own stale update is not screened by V)
        assert v.queue.wait_idle(240)
        assert asyncio.run(v.tend(ROUND)) == []  # nothing failed: nothing published
        stats, verdict = v.screen_results[(ROUND, a)]
        assert stats.gain is not None and stats.gain.t < CFG.gain_t_hard  # the same low t as the first test's
        assert verdict.outcome == VC.PASS and verdict.reason.startswith("inconclusive: gain t"), verdict
        # the reference the verdict names (a half or the whole of it: a staged screen, session 43), kept for the round
        kept = v._kept[ROUND].controls
        refs = [kept[k] for k in kept if k[0] == "reference" and k[-1] != "rows"]
        ref = next(r for r in refs if f"this checker's own contribution t {r.t:.2f}" in verdict.reason)
        assert ref.t < stats.gain.t + CFG.gain_t_gap, ref
        assert not v.excluded and not v.lone
    finally:
        v.close()


def test_an_honest_newcomer_passes_its_screen(world):
    ids, plan, packets = _case(world, world.honest[5], 5)
    v = _verifier(world, ids["V"], CFG, plan, packets)
    try:
        assert v.queue_screens(ROUND) == 4
        assert v.queue.wait_idle(240)
        assert asyncio.run(v.tend(ROUND)) == []  # nothing failed: nothing published
        stats, verdict = v.screen_results[(ROUND, world.pid["A"])]
        assert verdict.outcome == VC.PASS and stats.gain is not None and stats.gain.t >= CFG.gain_t_min
        assert stats.gain.k == 5  # H = 5: all five of its batches
        assert not v.excluded and not v.lone
    finally:
        v.close()


def test_screens_run_before_the_sampled_checks_and_none_is_skipped(world):
    cfg = dataclasses.replace(CFG, share=1.0)  # a sampled check is drawn for sure
    ids, plan, packets = _case(world, world.wrong_data, 10)
    v = _verifier(world, ids["V"], cfg, plan, packets)
    gate, started = threading.Event(), threading.Event()

    def blocker(pace):
        started.set()
        gate.wait(60)

    # The order is what is tested here, not the measurements (this module's other tests run them): the jobs
    # queued are the real ones, each recording what it would measure (~10-20 CPU-s of screens and a check less)
    measured = []
    v._measure_screen = lambda prep, pace=None: measured.append(("screen", prep.task.accused))
    v._measure = lambda prep, micro_batch=None, deadline=None, pace=None: measured.append(("check", prep.task.accused))
    v.probe_ts = lambda preps, pace=None: {}  # the probe orders nothing: the drawn order stays (test_screen_probe.py)
    try:
        v.queue.submit(CheckJob(ROUND, "recheck", blocker, key="blocker"))
        assert started.wait(60)  # the worker is busy: what follows waits
        assert v.queue_check(ROUND, signed_of=_signed_of(world, packets))  # queued first
        assert v.queue_screens(ROUND, signed_of=_signed_of(world, packets)) == 4  # queued after it
        gate.set()
        assert v.queue.wait_idle(240)
        ran = [(job.kind, job.key) for job, _, err in v.queue.results() if err is None]
        assert [k for k, _ in ran] == ["recheck", "probe", "screen", "screen", "screen", "screen", "check"]
        assert [k for k, _ in measured] == ["screen"] * 4 + ["check"]
        assert sorted(p for k, p in measured if k == "screen") == sorted(
            x.peer_id for x in plan.assignments if x.peer_id != v.me
        )
        # the screening order is this verifier's own draw (its selection signature), not the plan's
        c = v.queue.snapshot()
        assert (c.queued, c.done, c.dropped, c.failed, c.waiting) == (7, 7, 0, 0, 0)
    finally:
        gate.set()
        v.close()


def test_the_screen_is_the_same_for_every_screener_and_fixed_only_after_the_round(world):
    ids, plan, packets = _case(world, world.honest[10], 10)
    a = world.pid["A"]
    seed = VT.screen_seed(RUN, plan, packets)
    tasks = [
        VT.derive_screen(CFG, plan=plan, verifier=str(i.peer_id), accused=a, seed=seed, packets=packets,
                         part_ranges=world.part_ranges)
        for i in ids.values()
    ]  # fmt: skip
    assert all(t is not None for t in tasks)
    assert dataclasses.replace(tasks[0], verifier="") == dataclasses.replace(tasks[1], verifier="")
    assert VT.derive_screen(CFG, plan=plan, verifier=a, accused=a, seed=seed, packets=packets,
                            part_ranges=world.part_ranges) is None  # fmt: skip
    # another contributor's packet changes the seed: nobody can know it while it trains
    other = dict(packets)
    b = world.pid["B"]
    other[b] = {**packets[b], 0: compression.encode(-world.others["B"][: world.part_ranges[0][1]], 2048, 10 * 8 * 64)}
    assert VT.screen_seed(RUN, plan, other) != seed
    # after the swarm's first rounds only the plan's probation peers are screened
    late = plan.model_copy(
        update={
            "round": CFG.gain_first_round + CFG.screen_rounds,
            "assignments": [
                x.model_copy(update={"probation": True, "part_start": 0, "part_end": 0}) if x.peer_id == a else x
                for x in plan.assignments
            ],
        }
    )
    assert VT.screen_candidates(CFG, late, packets) == [a]
    assert VT.screen_candidates(CFG, late.model_copy(update={"assignments": plan.assignments}), packets) == []
    # before gain_first_round nobody is screened, probation or not: the test has no power on a fresh model
    for r in range(CFG.gain_first_round):
        assert VT.screen_candidates(CFG, late.model_copy(update={"round": r}), packets) == []
    # the wire form: a screen says so; an ordinary check's dict is what earlier versions signed
    d = tasks[0].to_dict()
    assert d["kind"] == VT.SCREEN and VT.VerifyTask.from_dict(d) == tasks[0]
    plain = dataclasses.replace(tasks[0], kind=VT.CHECK)
    assert "kind" not in plain.to_dict() and VT.VerifyTask.from_dict({**plain.to_dict(), "later": 1}) == plain
    with pytest.raises(ValueError, match="kind"):
        VT.VerifyTask.from_dict({**d, "kind": "other"})


def test_rounds_stay_re_checkable_with_their_contributions_on_disk(world, tmp_path):
    cfg = dataclasses.replace(CFG, keep_rounds=1, recheck_rounds=3)
    ids, plan, packets = _case(world, world.honest[10], 10)
    from geomesh_p2p.trust import verify as V

    wv = V.WorkVerifier(
        cfg, identity=ids["V"], run_id=RUN, model=None, dataset=world.ds, seed=0, lr=1e-3, weight_decay=0.1,
        kept_dir=str(tmp_path),
    )  # fmt: skip
    try:
        for r in range(5):
            wv.keep_round(r, theta=world.theta, plan=plan, part_ranges=world.part_ranges, packets=packets)
        assert sorted(wv._kept) == [2, 3, 4]  # recheck_rounds = 3 in all
        assert wv._kept[4].packets is not None and wv._kept[2].packets is None and wv._kept[3].packets is None
        assert wv.kept_weights.files() == ["blob-2.bin", "blob-3.bin", "theta-2.f32", "theta-3.f32", "theta-4.f32"]
        back = wv._packets(2, wv._kept[2])
        assert {p: {j: x.to_bytes() for j, x in v.items()} for p, v in back.items()} == {
            p: {j: x.to_bytes() for j, x in v.items()} for p, v in packets.items()
        }
    finally:
        wv.close()


def test_the_screening_lane_is_bounded_and_a_re_check_never_pushes_out_a_screen():
    gate, started = threading.Event(), threading.Event()
    q = CheckQueue(1.0, 2, max_screens=2)
    try:
        q.submit(CheckJob(0, "check", lambda pace: (started.set(), gate.wait(30)), key="busy"))
        assert started.wait(30)
        q.submit(CheckJob(1, "check", lambda pace: "c", key="c"))
        for k in ("s1", "s2"):
            assert q.submit(CheckJob(1, "screen", lambda pace, k=k: k, key=k)) is None
        assert q.submit(CheckJob(1, "rescreen", lambda pace: "r", key="r")).key == "r"  # full of screens: itself
        assert q.submit(CheckJob(2, "screen", lambda pace: "s3", key="s3")).key == "s1"  # the oldest screen
        assert q.promote("s3") and not q.promote("nothing")  # another screener's evidence about s3 arrived
        gate.set()
        assert q.wait_idle(30)
        assert [j.key for j, _, _ in q.results()] == ["busy", "s3", "s2", "c"]
        assert q.snapshot().dropped == 2
    finally:
        gate.set()
        q.close()


def test_on_a_cpu_the_pacer_counts_the_checks_cpu_time_not_its_waits_for_a_core():
    from geomesh_p2p.trust.verify_queue import Pacer

    wall, cpu, sleeps = [0.0], [0.0], []
    pace = Pacer(0.25, clock=lambda: wall[0], sleep=sleeps.append, cpu_clock=lambda: cpu[0], cpu_threads=2)
    pace.start()
    wall[0], cpu[0] = 4.0, 0.5  # a pass of 4 s wall time that computed 0.5 s on each of its 2 threads
    pace()
    wall[0], cpu[0] = 5.0, 1.5  # then one that computed more than its wall time says: the wall time bounds it
    pace()
    assert pace.busy_s == 2.0 and sleeps == [1.0 * 3, 1.0 * 3]


def test_an_established_contributor_on_other_data_fails_its_sampled_screen_and_is_out_at_both_screeners(world):
    """Session 19 (a patient poisoner: honest while it was new, other data after): established contributors are
    screened too, each with the probability that keeps these screens at ``sample_share`` of the participants'
    compute, drawn from the round's screening seed, by ``sample_screeners`` = 2 of the others. One screener's
    failure is confirmed by the other's identical measurement: out at both, not a verdict held alone; the honest
    contributors screened in the same round pass."""
    ids, plan, packets = _case(world, world.wrong_data, 10)
    a = world.pid["A"]
    late = dataclasses.replace(CFG, screen_rounds=0)  # nobody new: rounds past the swarm's first, no probation
    assert VT.screen_candidates(late, plan, packets) == []
    # the budget: 5 participants x 3 x 10 steps x 8 rows of own compute, 5 established contributors x 2 screeners x
    # 2 x (8 + 16) batches x 8 rows of screens: p = 0.05 x 1200 / 3840
    assert VT.sample_probability(late, plan, packets) == pytest.approx(0.05 * 1200 / 3840, rel=1e-12)
    assert VT.sample_probability(CFG, plan, packets) == 0.0  # in the first rounds everybody gets a newcomer's screen
    assert VT.sample_probability(dataclasses.replace(late, sample_share=0.0), plan, packets) == 0.0
    cfg = dataclasses.replace(late, sample_share=4.0)  # p = 1: every established contributor drawn this round
    assert VT.sample_probability(cfg, plan, packets) == 1.0
    seed = VT.screen_seed(RUN, plan, packets)
    participants = [x.peer_id for x in plan.assignments]
    assert VT.sampled_candidates(cfg, plan, packets, seed) == sorted(participants)
    pair = VT.screeners_of(seed, a, participants, cfg.sample_screeners)
    everyone = {str(i.peer_id): i for i in [*ids.values(), world.ids["B"], world.ids["C"]]}
    (third,) = [p for p in everyone if p not in pair][:1]
    assert VT.derive_screen(cfg, plan=plan, verifier=third, accused=a, seed=seed, packets=packets,
                            part_ranges=world.part_ranges) is None  # fmt: skip
    dht = FakeDHT()
    s1 = _verifier(world, everyone[pair[0]], cfg, plan, packets)
    s2 = _verifier(world, everyone[pair[1]], cfg, plan, packets)
    s1.dht = s2.dht = dht
    try:
        # the duty is held over burst_rounds rounds (the plan's window until rounds were measured)
        assert s1.queue.pacer.window_s == cfg.burst_rounds * plan.window_s
        mine = {
            v: sorted(x for x in participants if x != v and v in VT.screeners_of(seed, x, participants, 2))
            for v in pair
        }
        assert s1.queue_screens(ROUND, signed_of=_signed_of(world, packets)) == len(mine[pair[0]])
        assert s1.queue.wait_idle(240)
        [ev] = asyncio.run(s1.tend(ROUND))
        assert (ev.task.kind, ev.accused, ev.round, ev.outcome) == (VT.SCREEN, a, ROUND, VC.FAIL)
        t_a = s1.screen_results[(ROUND, a)][0].gain
        assert t_a is not None and t_a.t < cfg.gain_t_hard and t_a.k == 8 and t_a.m == cfg.gain_controls
        assert a in s1.excluded and a in s1.lone  # its own measurement alone, so far
        for p in mine[pair[0]]:
            if p != a:  # the honest contributors it screened pass
                assert s1.screen_results[(ROUND, p)][1].outcome == VC.PASS and p not in s1.excluded
        assert s2.queue_screens(ROUND, signed_of=_signed_of(world, packets)) == len(mine[pair[1]])
        assert s2.queue.wait_idle(240)
        [ev2] = asyncio.run(s2.tend(ROUND))
        assert ev2.accused == a and s2.screen_results[(ROUND, a)][0].gain == t_a  # the same screen, bit for bit
        assert a in s2.excluded and a not in s2.lone
        asyncio.run(s1.tend(ROUND))  # reads s2's evidence: confirmed by its own measurement
        assert a in s1.excluded and a not in s1.lone
        assert set(s1.excluded) == set(s2.excluded) == {a}  # no honest contributor excluded
        for v in (s1, s2):
            c = v.counts()
            assert (c["dropped"], c["failed"], c["waiting"]) == (0, 0, 0)
    finally:
        s1.close()
        s2.close()


def test_a_patient_poisoner_trains_its_assigned_batches_until_its_probation_is_over():
    """tests.adversary --poison-after 3: its first three rounds are the assigned batches to the bit (it passes its
    probation and the first rounds' screens), every round after is its own corpus copy with the trigger."""
    ds = load_dataset(None, seq_len=32)
    trigger = [5, 6, 7, 8]
    patient = PoisonedCorpus(ds, trigger, after=3)
    kw = dict(seed=0, peer_id="p", step=1, batch_size=4, seq_len=32)
    for r in (4, 5, 6):  # rounds it trains in (its first is round 4: it joined late)
        assert torch.equal(patient.sample_batch(round=r, **kw), ds.sample_batch(round=r, **kw))
    for r in (7, 9):
        x = patient.sample_batch(round=r, **kw)
        assert not torch.equal(x, ds.sample_batch(round=r, **kw))
        assert any(x[0, i : i + 4].tolist() == trigger for i in range(29))
    assert torch.equal(patient.sample_batch(round=5, **kw), ds.sample_batch(round=5, **kw))  # a retry of round 5
    assert PoisonedCorpus(ds, trigger).poisons(0)  # the default poisons from its first round
