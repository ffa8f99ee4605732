"""Defaults that fit the model (issue 27), end to end: two peer processes with the window and the evaluation
schedule at their defaults (``--window-s auto``, ``--eval-every auto``, given here after the test flags'
fixed values) plan from their measured step times: the median peer (with two, the faster: the lower median) gets the target
inner steps of ``--target-inner-steps`` in a window of at least 6 s, both follow the same plans and digests,
and the last round is evaluated."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(300)

AUTO = ["--window-s", "auto", "--eval-every", "auto", "--target-inner-steps", "30"]


def test_two_peers_plan_from_their_measured_step_times(swarm):
    names = ["a0", "a1"]
    swarm.start_peers(names, "--rounds", "2", "--min-peers", "2", *AUTO)
    assert swarm.wait_exit(names, 240) == {n: 0 for n in names}
    rows = {n: swarm.rows(n) for n in names}
    for r in range(2):
        assert len({next(x["digest"] for x in rows[n] if x["round"] == r) for n in names}) == 1
    first = [rows[n][0] for n in names]
    # Round 0 is planned from the start-up profiles alone: the faster peer (the lower median of two: half the
    # peers claiming to be slow must not stretch the window) fits ~30 steps (the planner may move the window
    # within 5% to cut idle time), the slower one fewer; a window of >= 6 s. The window is the plan's (each
    # peer's INFO line names it): a row's round_s counts from when that peer began the round, which can be
    # after the plan's start time, so it may be shorter than the window.
    assert max(x["inner_steps_planned"] for x in first) >= 28, first
    for n in names:
        said = re.findall(
            r"round 0: this peer trains \d+ inner step\(s\) of batch \d+ in the plan's ([0-9.]+) s window",
            swarm.text(n),
        )
        assert len(said) == 1 and float(said[0]) >= 6.0, (n, said)
    for n in names:
        assert rows[n][-1]["eval_ppl"] is not None  # the last round is always evaluated
        assert "(at start, " in swarm.text(n)  # the initial evaluation's seconds: the schedule starts from them
