"""The main job end to end: peers as separate OS processes on 127.0.0.1 train a transformers model.

Slow by nature (each process imports torch and profiles its device), so the scenarios are few and
each checks several things."""

from __future__ import annotations

import re

import pytest

from tests.swarm_util import ProcSwarm, free_port

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def swarm(tmp_path):
    s = ProcSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


def _digests(swarm, names, r):
    return {n: next(x["digest"] for x in swarm.rows(n) if x["round"] == r) for n in names}


def test_three_peers_late_joiner_and_resume(swarm, tmp_path):
    port = free_port()
    entry = f"127.0.0.1:{port}"
    names = ["p0", "p1", "p2"]
    for i, n in enumerate(names):
        swarm.peer(n, "--rounds", "10", "--min-peers", "3", "--checkpoint-dir", str(tmp_path / f"ck_{n}"),
                   "--checkpoint-every", "1", "--speed-factor", ["1.0", "0.6", "0.4"][i],
                   port=port if i == 0 else 0, bootstrap=None if i == 0 else entry)
    # A fourth peer joins once the swarm is past round 1: it must download the state.
    swarm.wait_for(lambda: len(swarm.rows("p0")) >= 2, 240, "round 1 to finish")
    swarm.peer("late", "--rounds", "10", bootstrap=entry)
    codes = swarm.wait_exit(names + ["late"], 300)
    assert codes == {n: 0 for n in names + ["late"]}, codes

    rows = {n: swarm.rows(n) for n in names}
    assert [x["round"] for x in rows["p0"]] == list(range(10))
    for r in range(10):
        assert len(set(_digests(swarm, names, r).values())) == 1, f"digests differ after round {r}"
    ppl = [x["eval_ppl"] for x in rows["p0"]]
    assert ppl[-1] < ppl[0] * 0.8, ppl

    late = swarm.rows("late")
    assert late, "the late joiner never took part in a round:\n" + swarm.text("late")[-3000:]
    assert "downloaded state of round" in swarm.text("late")
    for x in late:
        assert x["digest"] == _digests(swarm, ["p0"], x["round"])["p0"], f"late joiner differs at round {x['round']}"
    assert max(x["peers"] for x in rows["p0"]) == 4

    # Stop-and-resume: the same three peers continue at round 10 from identical weights.
    for i, n in enumerate(names):
        swarm.peer(n, "--rounds", "12", "--min-peers", "3", "--resume", "--checkpoint-dir", str(tmp_path / f"ck_{n}"),
                   port=port if i == 0 else 0, bootstrap=None if i == 0 else entry)
    codes = swarm.wait_exit(names, 240)
    assert codes == {n: 0 for n in names}, codes
    last_digest = rows["p0"][-1]["digest"]
    for n in names:
        m = re.search(r"resumed from checkpoint at round (\d+) \(digest (\w+)\)", swarm.text(n))
        assert m, swarm.text(n)[-2000:]
        assert int(m.group(1)) == 10 and last_digest.startswith(m.group(2))
        assert [x["round"] for x in swarm.rows(n)][-2:] == [10, 11]
    for r in (10, 11):
        assert len(set(_digests(swarm, names, r).values())) == 1


def test_peer_killed_mid_round_others_finish(swarm):
    port = free_port()
    entry = f"127.0.0.1:{port}"
    names = ["k0", "k1", "k2"]
    for i, n in enumerate(names):
        swarm.peer(n, "--rounds", "4", "--min-peers", "3", port=port if i == 0 else 0,
                   bootstrap=None if i == 0 else entry)
    swarm.wait_for(lambda: len(swarm.rows("k2")) >= 1, 240, "round 0 to finish")
    swarm.kill("k2")  # SIGKILL while round 1 trains
    codes = swarm.wait_exit(["k0", "k1"], 180)
    assert codes == {"k0": 0, "k1": 0}
    for n in ("k0", "k1"):
        assert [x["round"] for x in swarm.rows(n)] == [0, 1, 2, 3]
    for r in (1, 2, 3):
        assert len(set(_digests(swarm, ["k0", "k1"], r).values())) == 1
    # The round after the kill is planned without the dead peer.
    assert swarm.rows("k0")[2]["peers"] == 2
