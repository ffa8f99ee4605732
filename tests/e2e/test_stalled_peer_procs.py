"""The process-level tests of ``tests/unit/test_stalled_peer.py`` (they start OS processes)."""

from __future__ import annotations

import os
import signal
import pytest

#: the peers' --rounds (GEOMESH_STALLED_ROUNDS overrides it). 5 since session 27: the split once seen at 5 was
#: traced and fixed (docs/round.md, "The split seen with a stopped peer"), then 3 runs passed at load 8-11.
ROUNDS = int(os.environ.get("GEOMESH_STALLED_ROUNDS", "5"))


# ------------------------------------------------------------------------------ processes (H1)
@pytest.mark.timeout(600)
def test_a_peer_stopped_while_the_swarm_finishes_ends_on_the_swarms_state_or_says_it_is_not(tmp_path):
    """Review H1: bootstrap + three peers (--rounds ROUNDS --min-peers 2); p1 is stopped (SIGSTOP) during round 3
    and continued (SIGCONT) once the others have exited. p1 must end on the others' final digest, or with
    a non-"done" exit; it never trains a round alone."""
    from tests.swarm_util import ProcSwarm

    swarm = ProcSwarm(tmp_path)
    try:
        swarm.bootstrap("boot")
        boot = swarm.address("boot")
        names = ["p0", "p1", "p2"]
        # --hold-leaving-s 5, not 40: p1 is continued only once p0 and p2 have exited, so no donor is left to retry
        # its catch-up against; either ending below holds after any hold (the default's 40 s were ~40 % of the test)
        argv = ["--rounds", str(ROUNDS), "--min-peers", "2", "--wait-peers-s", "30", "--hold-leaving-s", "5"]
        for n in names:
            swarm.peer(n, *argv, bootstrap=boot)
        for n in names:
            swarm.address(n)
        swarm.wait_for(lambda: any(r.get("round", -1) >= 2 for r in swarm.rows("p1")), 300, "round 2 on p1")
        pid = swarm.procs["p1"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            codes = swarm.wait_exit(["p0", "p2"], 300)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert codes == {"p0": 0, "p2": 0}
        code = swarm.wait_exit(["p1"], 300)["p1"]
    finally:
        swarm.stop_all()
    final = {n: [r for r in swarm.rows(n) if r.get("round") is not None] for n in names}
    # One lineage: p0 and p2 (never stopped) wrote the same digest at every round both applied (a row is written
    # per round applied, with the digest before any re-sync), and both applied the last one. Comparing the last
    # rows alone could not tell a fork from rows of different rounds (session 27, docs/round.md).
    seen = {n: {r["round"]: r for r in final[n]} for n in ("p0", "p2")}
    split = {
        k: [(n, seen[n][k]["digest"][:8], seen[n][k].get("digest_agree"), seen[n][k].get("leader")) for n in seen]
        for k in sorted(set(seen["p0"]) & set(seen["p2"]))
        if seen["p0"][k]["digest"] != seen["p2"][k]["digest"]
    }
    assert not split, f"p0 and p2 split at rounds {split} (round: (peer, digest, agreed, leader))"
    # Nor trained alone: a row of peers 1 is allowed only where the other was planned out of that round by the plan
    # the row's peer made or followed (the no-part penalty of a push the load made late, f24960e: it re-syncs, no
    # fork), the last round included (each trained it or was planned out of it). A split has both rows at peers 1.
    out = {"p0": swarm.planned_out("p0"), "p2": swarm.planned_out("p2")}
    assert all(final[n][-1]["round"] == ROUNDS - 1 or ROUNDS - 1 in out[n] for n in out), (final["p0"], final["p2"])
    alone = [(n, r["round"]) for n, m in (("p0", "p2"), ("p2", "p0")) for r in final[n]
             if r.get("peers") == 1 and r["round"] not in out[m]]  # fmt: skip
    assert not alone, (alone, out)
    p1_log = swarm.text("p1")
    # no round trained by p1 alone after the others left
    assert not [r for r in final["p1"] if r.get("peers") == 1], final["p1"]
    if code == 0:
        # it caught up to the swarm's last state: the others' final digest, announced at round ROUNDS
        assert f"digest {final['p0'][-1]['digest'][:8]}" in p1_log  # "state of round R adopted (...), digest D"
        assert "done (" in p1_log or "the swarm's last state" in p1_log
        assert "NOT the swarm's" not in p1_log
    else:
        assert code == 3 and "not done:" in p1_log and "done (" not in p1_log
