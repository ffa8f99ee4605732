"""``ProcSwarm.planned_out`` / ``plan_problems`` (tests/swarm_util.py), on rows and events written as peers write them:
what the e2e tests' "every peer in every round" checks pass (a plan-out by the no-part penalty) and what they fail
(a fork, a skipped round, an outsider planned)."""

from __future__ import annotations

import json

import pytest

from tests.swarm_util import ProcSwarm

pytestmark = pytest.mark.timeout(30)


def _swarm(tmp_path, rows: dict, out: dict | None = None) -> ProcSwarm:
    """A swarm whose peer ``n`` wrote ``rows[n]`` ((round, peers) pairs) and was planned out of ``out[n]``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    s = ProcSwarm(tmp_path)
    for n, rs in rows.items():
        s.log_path(n).write_text("".join(json.dumps({"round": r, "peers": p, "digest": "d"}) + "\n" for r, p in rs))
        evs = [{"event": "planned_out", "round": r, "reason": "not_in_plan"} for r in (out or {}).get(n, ())]
        evs.append({"event": "planned_out", "round": 9, "reason": "weights_differ"})  # not a plan-out
        (tmp_path / f"{n}.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    return s


def test_a_peer_planned_out_of_a_round_passes_and_its_round_is_named(tmp_path):
    s = _swarm(tmp_path, {"a": [(0, 2), (1, 1), (2, 2)], "b": [(0, 2), (2, 2)]}, {"b": [1]})
    assert s.planned_out("b") == {1} and s.planned_out("a") == set()
    assert s.plan_problems(["a", "b"], range(3)) == []


def test_a_fork_a_skipped_round_and_an_outsider_in_the_plan_are_listed(tmp_path):
    # both at peers 1 in round 1: two runs of their own
    s = _swarm(tmp_path, {"a": [(0, 2), (1, 1)], "b": [(0, 2), (1, 1)]})
    assert s.plan_problems(["a", "b"], range(2)) == [(1, "a", "peers 1, 2 rows"), (1, "b", "peers 1, 2 rows")]
    # b has no row of round 1 and was not planned out of it
    s = _swarm(tmp_path / "x", {"a": [(0, 2), (1, 1)], "b": [(0, 2)]})
    assert s.plan_problems(["a", "b"], range(2)) == [(1, "b", "neither a row nor planned out")]
    # a third peer (c2 after it left, an attacker) in the plan: rows count 2, the plan 3
    s = _swarm(tmp_path / "y", {"a": [(0, 3)], "b": [(0, 3)]})
    assert s.plan_problems(["a", "b"], [0]) == [(0, "a", "peers 3, 2 rows"), (0, "b", "peers 3, 2 rows")]
    # a row of a round it says it was planned out of
    s = _swarm(tmp_path / "z", {"a": [(0, 2)], "b": [(0, 2)]}, {"b": [0]})
    assert s.plan_problems(["a", "b"], [0]) == [(0, "b", "both a row and planned out")]
