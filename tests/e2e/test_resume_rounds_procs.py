"""A swarm resumed from checkpoints of different rounds converges at once (docs/round.md, "Peers resumed at
different rounds"). A fresh-user trial, session 37: three peers stopped together; two checkpointed at round 46,
the third had trained round 46 alone (it had gathered the others just before they announced leaving) and
checkpointed at round 47. Resumed, each side waited the whole --min-peers wait (60 s) for the other, the third
trained round 47 alone again, and only its re-sync at round 49 joined the lineages (a round discarded).

Here: ``a`` and ``b`` checkpoint at round 1, ``c`` trains round 1 alone and checkpoints at round 2 (a solo
lineage); resumed with ``--min-peers 3``, ``c`` re-syncs to the others' round-1 state before training anything,
saying what it discards, and the three train rounds 1 and 2 together: the start-up wait ends once ``c`` is back
in step, not after its 60 s."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(360)

NAMES = ["a", "b", "c"]


def _in_step(swarm, name: str, n: int, since: int) -> bool:
    """Whether ``name`` said, in a start after its first ``since`` events, that ``n`` peers are in step."""
    return any(e.get("in_step") == n for e in swarm.events(name, "waiting_for_peers")[since:])


def test_a_swarm_resumed_at_rounds_r_r_and_r_plus_1_converges_without_the_whole_wait(swarm, tmp_path):
    def ck(n: str) -> list[str]:
        return ["--checkpoint-dir", str(tmp_path / f"ck_{n}")]

    # Round 0 together; a and b stop after it (checkpoint at round 1), c trains round 1 alone (--min-peers 1, as
    # the third peer of the trial that saw nobody left in its plan) and checkpoints at round 2.
    entry = swarm.start_peers(["a", "b"], "--rounds", "1", "--min-peers", "3", each=lambda i, n: ck(n))
    swarm.wait_for(lambda: _in_step(swarm, "a", 2, 0) and _in_step(swarm, "b", 2, 0), 180, "a and b in step")
    swarm.peer("c", "--rounds", "2", "--min-peers", "1", *ck("c"), bootstrap=entry)
    assert swarm.wait_exit(NAMES, 240) == {n: 0 for n in NAMES}
    assert [(x["round"], x["peers"]) for x in swarm.rows("c")] == [(0, 3), (1, 1)], swarm.text("c")[-3000:]
    solo = swarm.rows("c")[-1]["digest"]
    common = swarm.rows("a")[-1]["digest"]
    assert swarm.rows("b")[-1]["digest"] == common
    if solo == common:  # c's solo round trained no step at this load (a round that aggregates nothing applies nothing)
        pytest.skip(f"c's solo round applied nothing (inner steps {swarm.rows('c')[-1]['inner_steps_done']}): no fork")
    rows0 = {n: len(swarm.rows(n)) for n in NAMES}
    events0 = {n: len(swarm.events(n)) for n in NAMES}
    texts0 = {n: len(swarm.text(n)) for n in NAMES}

    # Resumed: a and b at round 1, c at round 2 (its solo lineage). c starts once a and b are in step with each
    # other, so that its first read sees both (with one of them alone, 1 against 1, nobody moves).
    waits0 = {n: len(swarm.events(n, "waiting_for_peers")) for n in NAMES}
    entry = swarm.start_peers(["a", "b"], "--rounds", "3", "--min-peers", "3", "--resume", each=lambda i, n: ck(n))
    swarm.wait_for(lambda: _in_step(swarm, "a", 2, waits0["a"]) and _in_step(swarm, "b", 2, waits0["b"]), 180, "a, b")
    swarm.peer("c", "--rounds", "3", "--min-peers", "3", "--resume", *ck("c"), bootstrap=entry)
    assert swarm.wait_exit(NAMES, 240) == {n: 0 for n in NAMES}, swarm.text("c")[texts0["c"] :][-3000:]

    new = {n: swarm.events(n)[events0[n] :] for n in NAMES}
    resumed = {
        n: [(e["round"], e["digest"][:8]) for e in new[n] if e["event"] == "resumed_from_checkpoint"] for n in NAMES
    }
    assert resumed == {"a": [(1, common[:8])], "b": [(1, common[:8])], "c": [(2, solo[:8])]}
    # each peer's inner optimizer state (AdamW moments, step counts) came back with its checkpoint, not zeros
    inner = {
        n: [(e["event"], e["round"], e.get("global_step", 0) > 0) for e in new[n] if "inner_state" in e["event"]]
        for n in NAMES
    }
    assert inner == {n: [("inner_state_resumed", 2 if n == "c" else 1, True)] for n in NAMES}
    # c re-synced to the others' state, saying what it discarded (its round 1), before any round of its own
    [rejoin] = [e for e in new["c"] if e["event"] == "rejoin_resync"]
    assert (rejoin["held_round"], rejoin["round"], rejoin["digest"][:8]) == (2, 1, common[:8])
    [back] = [e for e in new["c"] if e["event"] == "older_state_adopted"]
    assert (back["level"], back["held_round"], back["round"], back["discarded_rounds"]) == ("WARNING", 2, 1, [1])
    # every round after the resume trained by all three, on one lineage; none alone
    # (round 2: or one of them planned out of it by the no-part penalty of a round-1 push the load made late, and
    # re-synced after it: f24960e; every row of it counts its plan as the peers that wrote one, and none is alone)
    rows = {n: swarm.rows(n)[rows0[n] :] for n in NAMES}
    for n in NAMES:
        assert [(x["round"], x["peers"]) for x in rows[n]][:1] == [(1, 3)], swarm.text(n)[texts0[n] :][-3000:]
        assert [x["round"] for x in rows[n]] in ([1, 2], [1]), swarm.text(n)[texts0[n] :][-3000:]
    assert swarm.plan_problems(NAMES, [2]) == [] and all(x["peers"] >= 2 for xs in rows.values() for x in xs), rows
    for r in (1, 2):
        assert len({x["digest"] for xs in rows.values() for x in xs if x["round"] == r}) == 1, rows
    # the start-up wait ended with all three in step, not by its 60 s running out (no peer started short of 3)
    for n in NAMES:
        text = swarm.text(n)[texts0[n] :]
        assert "peers wanted (--min-peers): waited" not in text, text[-3000:]
        assert "re-synced to the state of round" not in text  # no partition healed later: nothing forked
