"""Fresh user 50: a stopped swarm restarted one peer at a time. The first peer resumed alone with ``--resume
--min-peers 3`` waited 60 s, trained a round ALONE ("starting with 1 of the 3 peers wanted"), ended "NOT the
swarm's" (exit 3), and the second, restarted 2 min later on the swarm's state, ended at once ("the swarm ended",
exit 3). Now a peer resumed on a checkpoint it trained with others waits for them past ``--wait-peers-s``, one
line every 30 s naming them (``gather.held_for_swarm``), and the swarm goes on once they are back.

Here: a bootstrap, ``a`` and ``b`` train rounds 0-1 (``--min-peers 2``) and stop; ``a`` is resumed alone with
``--wait-peers-s 5`` and says it waits for ``b`` instead of training; ``b`` is resumed after that line, and both
train round 2 together, on one lineage, exit 0."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(420)

NAMES = ["a", "b"]


def test_a_swarm_restarted_one_peer_at_a_time_waits_instead_of_forking(swarm, tmp_path):
    def ck(n: str) -> list[str]:
        return ["--checkpoint-dir", str(tmp_path / f"ck_{n}")]

    swarm.bootstrap("boot")
    entry = swarm.address("boot")
    for n in NAMES:
        swarm.peer(n, "--rounds", "2", "--min-peers", "2", *ck(n), bootstrap=entry)
    assert swarm.wait_exit(NAMES, 240) == {n: 0 for n in NAMES}, swarm.text("a")[-3000:]
    assert [(x["round"], x["peers"]) for x in swarm.rows("a")] == [(0, 2), (1, 2)], swarm.text("a")[-3000:]
    rows0 = {n: len(swarm.rows(n)) for n in NAMES}
    texts0 = {n: len(swarm.text(n)) for n in NAMES}

    # a alone first: past its --wait-peers-s it says whom it waits for, and trains nothing
    resume = ["--rounds", "3", "--min-peers", "2", "--resume", "--wait-peers-s", "5"]
    swarm.peer("a", *resume, *ck("a"), bootstrap=entry)
    swarm.wait_for(lambda: swarm.events("a", "waiting_for_resumed"), 180, "a waiting for b")
    [held] = swarm.events("a", "waiting_for_resumed")[:1]
    assert held["round"] == 2 and len(held["waiting_for"]) == 1 and held["waited_s"] >= 5.0, held
    assert len(swarm.rows("a")) == rows0["a"]  # no round trained alone
    swarm.peer("b", *resume, *ck("b"), bootstrap=entry)
    assert swarm.wait_exit(NAMES, 240) == {n: 0 for n in NAMES}, swarm.text("a")[texts0["a"] :][-3000:]
    for n in NAMES:
        assert [(x["round"], x["peers"]) for x in swarm.rows(n)[rows0[n] :]] == [(2, 2)], swarm.text(n)[-3000:]
        text = swarm.text(n)[texts0[n] :]
        assert "peers wanted (--min-peers): waited" not in text and "the swarm ended" not in text, text[-3000:]
    assert len({swarm.rows(n)[-1]["digest"] for n in NAMES}) == 1
    [b_resumed] = swarm.events("b", "resumed_from_checkpoint")
    assert held["waiting_for"] == [b_resumed["peer"]]  # it named the peer it trained its checkpoint with
