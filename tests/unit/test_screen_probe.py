"""A round's screens ordered by a probe (issue 28, session 47; verify_screen.Screening.probe_ts, verify_queue.reorder,
gain.cached_gain_rows).

The backdoor benchmark's screeners queued a round's screens in an order drawn from their selection signatures, so
the poisoner's screen waited behind 0-2 honest ones (each ~1-3 s of a loaded 2-core box: a round or more of its
verdict). Now a probe job runs first: each staged screen's first drawn batch against the first 2 controls, rows its
first stage reuses, and the screens run lowest probe t first. Every screen still runs, with the same statistic and
verdict to the bit; only when each verdict comes changes.

The world is tests/verify_util.py's (real tiny model, KJV corpus, batch 8 x 64, round 2): A is the backdoor poisoner
of tests/poison.py (H = 10), B and C contributed honestly (H = 10), the screener V too (its power reference).
"""

from __future__ import annotations

import copy
import hashlib
import threading

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.verify_queue import CheckJob, CheckQueue, Pacer
from tests.poison import PoisonedCorpus, trigger_ids
from tests.verify_util import B, L, ROUND, Counting, _fixed_identity, _plan, _train_round, _verifier, world_fixture

# one intra-op thread (conftest's one_thread) for the screens too, not only the world's training: under make test's
# load (3 workers on 2 cores) spin-waiting OpenMP threads made each screen's CPU steps many times slower
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]

world = pytest.fixture(scope="module", name="world")(world_fixture)

CFG = VT.VerifyConfig()


@pytest.fixture(scope="module")
def poisoner(world):
    """The backdoor poisoner of tests/poison.py as A (its own corpus copy, the trigger 16 % of its tokens), H = 10."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        poisoned = PoisonedCorpus(world.ds, trigger_ids(world.ds.vocab_size))
        return _train_round(world.base, poisoned, world.theta, world.b_state, 10, world.pid["A"])
    finally:
        torch.set_num_threads(threads)


def _round(world, poisoner, name: str):
    """Screener ``name``'s view of round ROUND: its identity, the plan, and every contribution as sign packets (A the
    poisoner, B and C honest, the screener's own honest one)."""
    v = _fixed_identity(name)
    vid = str(v.peer_id)
    plan = _plan(world, {"V": v}, steps={"A": 10})
    deltas = {world.pid["A"]: poisoner, world.pid["B"]: world.others["B"], world.pid["C"]: world.others["C"]}
    deltas[vid] = world.honest_of(vid)
    packets = {
        p: {j: compression.encode(d[s:e].contiguous(), 2048, 10 * B * L) for j, (s, e) in enumerate(world.part_ranges)}
        for p, d in deltas.items()
    }
    return v, plan, packets


def _drawn_order(wv, plan, accused: list[str]) -> list[str]:
    """The order queue_screens draws from the screener's selection signature (before the probe reorders)."""
    sel = wv.selection(ROUND, plan.start_digest)
    return sorted(accused, key=lambda a: hashlib.sha256(sel + a.encode()).digest())


def test_reorder_puts_the_named_jobs_of_the_first_lane_in_the_given_order_in_their_places():
    stop = threading.Event()
    q = CheckQueue(1.0, 8, pacer=Pacer(1.0, stop), stop=stop)
    gate, started = threading.Event(), threading.Event()
    try:
        q.submit(CheckJob(1, "screen", lambda pace: (started.set(), gate.wait(30)), key="running"))  # holds the worker
        assert started.wait(30)
        for key in ("x", "r1", "y", "r2", "r3"):
            q.submit(CheckJob(1, "rescreen" if key in "xy" else "screen", lambda pace: None, key=key))
        assert q.reorder(["r3", "r1", "gone", "r2"]) == ["x", "r3", "y", "r1", "r2"]
        assert q.reorder([]) == ["x", "r3", "y", "r1", "r2"]
    finally:
        gate.set()
        q.close()


def test_the_probe_runs_the_poisoners_screen_first_and_its_rows_are_the_first_stages(world, poisoner):
    """Screener V's drawn order puts A (the poisoner) after an honest screen; the screens run in the probe's order
    (lowest probe t first), not the drawn one. The probe is one batch against two controls: on an AMD EPYC box A
    probed t -0.4 against 2.5 and above for B and C, so A ran first; on an Intel AVX-512 box the same world's last bits
    differ and C probed -0.73 against A's -0.62 (both before B's 2.03). Each screen's statistic is the one a screen
    without the probe measures, to the bit, and the probe's passes are the first stage's: none repeated."""
    a, b, c = (world.pid[n] for n in ("A", "B", "C"))
    for name in (f"screener-V{i}" for i in range(40)):  # a screener whose drawn order does not start with A
        v, plan, packets = _round(world, poisoner, name)
        wv = _verifier(world, v, CFG, plan, packets)
        if _drawn_order(wv, plan, [a, b, c])[0] != a:
            break
        wv.close()
    else:
        raise AssertionError("every screener drew A first")
    try:
        kept = wv._kept[ROUND]
        wv._compute.acquire()  # the worker waits at the device lock until every job is queued (the probe first)
        try:
            assert wv.queue_screens(ROUND) == 3
            lane = [j.key for j in wv.queue._first if j.kind == "screen"]
        finally:
            wv._compute.release()
        assert lane == [(ROUND, acc) for acc in _drawn_order(wv, plan, [a, b, c])]  # as drawn, A not first
        assert wv.queue.wait_idle(500)
        ran = [acc for (r, acc) in wv.screen_results]  # measured in this order
        assert sorted(ran) == sorted([a, b, c])
        verdicts = {acc: wv.screen_results[(ROUND, acc)] for acc in ran}
        assert verdicts[a][1].outcome == VC.FAIL and verdicts[b][1].outcome == VC.PASS
        assert verdicts[c][1].outcome == VC.PASS

        # the same statistics as screens without a probe (a fresh cache each), to the bit
        preps = []
        for acc in (a, b, c):
            task = VT.derive_screen(
                CFG, plan=plan, verifier=str(v.peer_id), accused=acc, seed=kept.seed, packets=packets,
                part_ranges=world.part_ranges,
            )  # fmt: skip
            alone = VC.screen_contribution(
                CFG, task, model=copy.deepcopy(world.base), dataset=world.ds, theta=world.theta, seed=0,
                packets=packets, lr=1e-3, weight_decay=0.1, plan=plan, checker=str(v.peer_id), cache={},
            )  # fmt: skip
            assert alone[0].gain == verdicts[acc][0].gain and alone[1] == verdicts[acc][1]
            preps.append(task)

        # the probe's t, and its passes reused: a probe then the screen run what the screen alone runs
        from geomesh_p2p.trust.verify_screen import Prepared, probe_order

        counted = Counting(world.ds)
        wv.dataset = counted
        kept.controls.clear()
        ts = wv.probe_ts([Prepared(ROUND, kept, t, {}) for t in preps])
        assert ts[a] < 0.0 < ts[b], ts  # the poisoner probes below 0 (the probe's ts: one batch, noisy for honest C)
        assert ran == probe_order(_drawn_order(wv, plan, [a, b, c]), ts), (ran, ts)  # the order the screens ran in
        probed = counted.batches
        assert probed == 3 * (2 + 2) + 2  # each: its batch at both weights and 2 controls after; 2 controls before
        wv.screen_results.clear()
        wv._screen_result(preps[0], kept, world.theta, packets, None)
        with_probe = counted.batches - probed
        counted.batches = 0
        kept.controls.clear()
        wv.screen_results.clear()
        wv._screen_result(preps[0], kept, world.theta, packets, None)
        assert with_probe == counted.batches - 2 - 2 - 2  # A's batch (2), its 2 controls after (2) and before (2)
    finally:
        wv.close()


def test_an_unmeasured_screen_runs_after_the_suspects_and_before_the_cleared():
    """Session 47's combined run p4: the poisoner trained 7 steps, too few to stage, so its screen had no probe t and
    ran after both honest screens at every screener (ordered last before). It now ranks as t 0: after a suspect
    (t < 0), before every screen the probe cleared (t > 0); equal ts keep their drawn order."""
    from geomesh_p2p.trust.verify_screen import UNMEASURED_PROBE_T, probe_order

    assert UNMEASURED_PROBE_T == 0.0
    drawn = ["h-clear", "a-unstaged", "s-suspect", "h-weak", "b-unstaged"]
    ts = {"h-clear": 1.49, "s-suspect": -0.62, "h-weak": 0.08}
    assert probe_order(drawn, ts) == ["s-suspect", "a-unstaged", "b-unstaged", "h-weak", "h-clear"]
    assert probe_order(drawn, {}) == drawn  # nothing measured: the drawn order
    assert probe_order([], ts) == []
