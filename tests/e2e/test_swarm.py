"""The main job end to end: peers as separate OS processes on 127.0.0.1 train a transformers model.

Slow by nature (each process imports torch and profiles its device), so the scenarios are few and
each checks several things."""

from __future__ import annotations

import json


import pytest

from tests.integration.test_log_hygiene import _bad_lines


pytestmark = pytest.mark.timeout(480)


#: rounds of test_three_peers_train_then_resume_with_identical_weights' first run
ROUNDS = 3


def _digest(swarm, name, r):
    return next(x["digest"] for x in swarm.rows(name) if x["round"] == r)


def test_three_peers_train_then_resume_with_identical_weights(swarm, tmp_path):
    """A demo-like swarm (a bootstrap and three peers) trains and stops, and no log has a bad line (issue 14 #10: an
    ERROR record, a traceback, a task left pending, a closed loop, gRPC's C-core lines: until session 50 the swarm of
    tests/e2e/test_log_hygiene_procs.py, the same bootstrap and three peers); then the three resume."""
    names = ["p0", "p1", "p2"]
    swarm.bootstrap("boot")  # port 0: it binds a free port and prints it
    boot = swarm.address("boot", 180)

    def start(*args, bootstrap=None):
        def each(i, n):
            return ["--checkpoint-dir", str(tmp_path / f"ck_{n}"), "--speed-factor", ["1.0", "0.6", "0.4"][i],
                    "--summary-json", str(tmp_path / f"{n}.summary.json")]  # fmt: skip

        if bootstrap is None:  # the first peer is the others' entry
            swarm.start_peers(names, *args, "--min-peers", "3", each=each)
            return
        for i, n in enumerate(names):
            swarm.peer(n, *args, "--min-peers", "3", *each(i, n), bootstrap=bootstrap)

    # 3 rounds, then one resumed (4 and 5 until session 48: the perplexity halves by round 2, and every check below is
    # per round; a round of ~5 s less)
    start("--rounds", str(ROUNDS), bootstrap=boot)
    assert swarm.wait_exit(names, 300) == {n: 0 for n in names}
    swarm.interrupt("boot")
    assert swarm.wait_exit(["boot"], 60) == {"boot": 0}
    for n in names + ["boot"]:
        assert _bad_lines(swarm.text(n)) == [], (n, swarm.text(n)[-3000:])
    # each peer, a `geomesh-peer join` process of its own, froze its start-up heap once built (issue 27: the run's
    # full collections skip the imports' and the model's ~350,000 objects). A peer forked from the test zygote
    # starts with the zygote's ~417,000 imported objects frozen (tests/zygote.py, the library's modules included): its
    # own freeze adds what it built after the fork (peer.cli, the model: ~3,500), and without it the count
    # stays the zygote's exactly.
    frozen = [json.loads((tmp_path / f"{n}.summary.json").read_text())["gc"]["frozen"] for n in names]
    at_fork = [getattr(swarm.procs[n], "frozen_at_fork", 0) for n in names]
    assert all(f - z > (1_000 if z else 100_000) for f, z in zip(frozen, at_fork)), (frozen, at_fork)
    for n in names:  # "done" is a peer's closing line: the last round's agreement line comes before it (fresh user 44)
        t = swarm.text(n)
        assert "done (" in t and ": contributions (agreement" not in t[t.rindex("done (") :], t[-2000:]
    # Every peer trained every round, or was planned out of it by the no-part penalty of a late push (a loaded CI
    # machine gives an honest peer that: f24960e, fe9f50e) and re-synced; every row counts its round's plan as the
    # peers that wrote one. A peer that skipped or forked a round, or a round planned without one of them, fails it.
    assert swarm.plan_problems(names, range(ROUNDS)) == [], {n: swarm.rows(n) for n in names}
    for r in range(ROUNDS):
        d = {x["digest"] for n in names for x in swarm.rows(n) if x["round"] == r}
        assert len(d) == 1, f"digests differ after round {r}"
    ppl = [max(x["eval_ppl"] for n in names for x in swarm.rows(n) if x["round"] == r) for r in range(ROUNDS)]
    assert ppl[-1] < ppl[0] < 4500, ppl

    # Stop-and-resume: the same three peers continue at round ROUNDS from identical weights (one round shows it: a
    # second one, --rounds 6 before, repeated the same check). Without the bootstrap, as before session 50: behind the
    # same bootstrap p0 read the others' leaving records of the first run (their identities are the same), said "the
    # swarm ended" and exited 0 without training (seen once, session 50)
    start("--rounds", str(ROUNDS + 1), "--resume")
    assert swarm.wait_exit(names, 300) == {n: 0 for n in names}
    last = next(iter({x["digest"] for n in names for x in swarm.rows(n) if x["round"] == ROUNDS - 1}))
    for n in names:
        resumed = swarm.events(n, "resumed_from_checkpoint")
        assert [(e["round"], e["digest"][: len(last)]) for e in resumed] == [(ROUNDS, last)], swarm.text(n)[-2000:]
        assert swarm.rows(n)[-1]["round"] == ROUNDS, swarm.text(n)[-2000:]
        # each restored its evidence of its last round's deliveries, so none defers its lead to the others (session 31: all
        # three did, and the resumed round waited a whole plan attempt for a last resort)
        assert swarm.events(n, "plan_last_resort") == [], swarm.text(n)[-2000:]
    assert len({_digest(swarm, n, ROUNDS) for n in names}) == 1


def test_peer_killed_mid_round_then_restarts_and_catches_up(swarm, tmp_path):
    names = ["k0", "k1", "k2"]
    entry = swarm.start_peers(names, "--rounds", "60", "--min-peers", "3")
    swarm.wait_for(lambda: len(swarm.rows("k2")) >= 1, 240, "round 0 to finish")
    swarm.kill("k2")  # SIGKILL while round 1 trains
    # Survivors finish the round it was killed in and go on without it.
    swarm.wait_for(lambda: len(swarm.rows("k0")) >= 3 and len(swarm.rows("k1")) >= 3, 120, "two more rounds")
    # round 2 is planned without k2: its rows count their plan as the survivors that wrote one (not "k0's third row
    # says peers 2": a survivor's push the load made late can plan it out of round 2, the no-part penalty, f24960e;
    # a plan that still held k2 reads one more than the rows); equal digests where both trained, at least once
    assert swarm.plan_problems(["k0", "k1"], [2]) == [], {n: swarm.rows(n) for n in ("k0", "k1")}
    both = [r for r in (1, 2) if r not in swarm.planned_out("k0") | swarm.planned_out("k1")]
    assert both and all(_digest(swarm, "k0", r) == _digest(swarm, "k1", r) for r in both), both

    # The killed peer comes back with the same identity mid-run (its old record may still be in the
    # DHT): it downloads the state and trains in step with the others.
    swarm.peer("late", "--rounds", "60", "--identity", str(tmp_path / "k2.key"), bootstrap=entry)

    # Its first two rounds with all three in the plan: a survivor slowed by the load may be planned out of a few
    # rounds meanwhile (session 47's CI: k0 pushed no part in round 5, so the leader left it out of rounds 6-15 every
    # other round, the late joiner's first two among them): that is the planner's penalty, not this test's subject.
    def together() -> list[int]:
        return [x["round"] for x in swarm.rows("late") if x["peers"] == 3][:2]

    swarm.wait_for(lambda: len(together()) >= 2, 300, "the late joiner to train two rounds with both survivors")
    # each survivor writes its row of a round a moment after the late joiner may (session 33's CI: k0 had no row
    # yet for the round "late" wrote when all were stopped)
    joined = together()
    swarm.wait_for(
        lambda: all({x["round"] for x in swarm.rows(n)} >= set(joined) for n in ("k0", "k1")),
        120,
        "the survivors' rows of the late joiner's first two rounds with both of them",
    )
    swarm.stop_all()
    assert {n: swarm.procs[n].returncode for n in ("k0", "k1", "late")} == {"k0": 0, "k1": 0, "late": 0}
    assert swarm.events("late", "state_downloaded"), swarm.text("late")[-2000:]
    late = {x["round"]: x for x in swarm.rows("late")}
    for r in joined:
        assert late[r]["digest"] == _digest(swarm, "k0", r) == _digest(swarm, "k1", r)
    # and from its first row on, it holds the state of every survivor that trained the same round
    first = min(late)
    held = [n for n in ("k0", "k1") if any(x["round"] == first for x in swarm.rows(n))]
    assert held and all(_digest(swarm, n, first) == late[first]["digest"] for n in held)


def test_ddp_baseline_runs_as_a_swarm_mode(swarm, tmp_path):
    """``--method ddp``: two peers exchange fp32 gradients every step and apply the same AdamW step;
    digests equal after every round, perplexity falls, and a resumed peer keeps the AdamW moments."""
    names = ["d0", "d1"]
    ddp = ["--method", "ddp", "--min-peers", "2", "--eval-every", "3"]

    def checkpoints(i, n):
        return ["--checkpoint-dir", str(tmp_path / f"ck_{n}")]

    swarm.start_peers(names, *ddp, "--rounds", "6", each=checkpoints)
    assert swarm.wait_exit(names, 300) == {n: 0 for n in names}
    rows = swarm.rows("d0")
    assert [x["round"] for x in rows] == list(range(6))
    assert all(x["inner_steps_planned"] == 1 and x["inner_steps_done"] == 1 for x in rows)
    for r in range(6):
        assert len({_digest(swarm, n, r) for n in names}) == 1, f"digests differ after round {r}"
    # evaluated every 3 rounds and at the last
    assert [x["round"] for x in rows if x["eval_ppl"] is not None] == [2, 5]
    ppl = [x["eval_ppl"] for x in rows if x["eval_ppl"] is not None]
    assert ppl[-1] < ppl[0], ppl

    # Resume: the checkpoint holds the AdamW moments ([2P]); both continue in step from round 6 (one round).
    swarm.start_peers(names, *ddp, "--rounds", "7", "--resume", each=checkpoints)
    assert swarm.wait_exit(names, 300) == {n: 0 for n in names}
    last = rows[-1]["digest"]
    for n in names:
        resumed = swarm.events(n, "resumed_from_checkpoint")
        assert [(e["round"], e["digest"][: len(last)]) for e in resumed] == [(6, last)], swarm.text(n)[-2000:]
    assert len({_digest(swarm, n, 6) for n in names}) == 1, "digests differ after round 6"


def test_ctrl_c_peer_leaves_cleanly_and_the_others_plan_without_it(swarm):
    """SIGINT: the peer finishes its exchange, announces that it leaves and exits 0; the next round
    of the others is planned without it, so no part goes missing and nobody waits for it."""
    names = ["c0", "c1", "c2"]
    rounds = {"c0": "60", "c1": "4", "c2": "60"}  # c1 leaves by --rounds (issue 14 #4), c2 by Ctrl+C
    swarm.start_peers(names, "--min-peers", "3", each=lambda i, n: ["--rounds", rounds[n]])
    swarm.wait_for(lambda: len(swarm.rows("c2")) >= 1, 240, "round 0 to finish")
    swarm.interrupt("c2")
    assert swarm.wait_exit(["c2"], 120) == {"c2": 0}
    # said with its last round's record (the driver: "stop"), or at shutdown when Ctrl+C came between rounds
    left = [e["reason"] for e in swarm.events("c2", "leaving_announced")]
    assert len(left) == 1 and left[0] in ("stop", "shutdown"), swarm.text("c2")[-2000:]
    last = swarm.rows("c2")[-1]["round"]
    # both rows of each round: c1 may write its row a moment after c0 (seen under load)
    swarm.wait_for(
        lambda: all(any(x["round"] >= last + 2 for x in swarm.rows(n)) for n in ("c0", "c1")),
        120,
        "two rounds without c2",
    )
    after = [x for x in swarm.rows("c0") if x["round"] > last]
    # Under load the leader of round last+1 may have read c2's record before the one saying it leaves and
    # planned it: that round misses c2's parts, and both survivors follow that one plan (issue 25: before,
    # the survivor that saw c2 leave refused the plan and led its own, and they forked: exit 3, rerun once
    # by a flaky mark). From the round after, c2 is never planned.
    raced = after[:1] if after and after[0]["peers"] == 3 else []
    assert after and all(x["missing_parts"] == 0 for x in after[len(raced) :]), after
    # c2 is in none of those plans: each of c0's and c1's rows counts its plan as the survivors that wrote one (not
    # "peers 2": under load a survivor's late push can plan it out of a round, the no-part penalty, f24960e; a plan
    # with c2 in it reads one more than the rows). Equal digests where both trained, and at least one such round.
    planned = [r for r in (last + 1, last + 2) if not raced or r != raced[0]["round"]]
    assert swarm.plan_problems(["c0", "c1"], planned) == [], {n: swarm.rows(n) for n in ("c0", "c1")}
    both = [r for r in (last + 1, last + 2) if r not in swarm.planned_out("c1") | swarm.planned_out("c0")]
    assert both and all(_digest(swarm, "c0", r) == _digest(swarm, "c1", r) for r in both), both
    # --rounds 4: c1 announces that it leaves with its round-4 record, before c0 gathers round 4, so c0
    # does not wait for it. Left alone with --min-peers 3, c0 does not train alone (review H1, docs/round.md):
    # the swarm ended on the state it holds, so it ends with a WARNING (not "done") and exit 0.
    assert swarm.wait_exit(["c1"], 120) == {"c1": 0}
    assert max(x["round"] for x in swarm.rows("c1")) == 3
    assert swarm.wait_exit(["c0"], 120) == {"c0": 0}
    assert max(x["round"] for x in swarm.rows("c0")) == 3
    assert [(e["synced"], e["exit_code"]) for e in swarm.events("c0", "run_not_done")] == [(True, 0)]
