"""``--rank-sync round`` under faults (issue 30): 2 OS processes over gloo (tests/rank_round_worker.py), no swarm.

What must hold: a rank whose trained weights went non-finite adds nothing to the peer's average; a run longer
than the collective timeout is no failure (the keep-alive waits for the meeting); an error in rank 0's own steps
still meets the followers (the next run works, no wait for the timeout); runs of 0 steps, past the deadline, of
a batch smaller than the ranks or with overflowing speeds neither hang nor desync the ranks; a stopped follower
(SIGSTOP) ends rank 0's run after the collective timeout with one failure.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest
import torch

from geomesh_p2p.model.rank_channel import EXIT, RUN, WEIGHTS
from tests import rank_worker
from tests.rank_procs import reap, spawn_ranks
from tests.rank_round_worker import LONG_STEPS

ROOT = Path(__file__).resolve().parents[2]
#: A hang guard, not a bound: each rank imports torch and joins a gloo group before its first step, ~5 s idle and
#: past 50 s at load ~10 (a fresh-clone CI run in session 25 timed out two tests at 50 s).
WAIT_S = 150


def _run(tmp_path: Path, scenario: str, timeout_s: float, follower_exits: bool = True) -> tuple[dict, dict, str]:
    """Both ranks of ``scenario``; returns rank 0's results, their exit codes and the logs. A follower that does
    not exit on its own (``follower_exits`` False: it stopped itself) is killed once rank 0 is done."""
    out = str(tmp_path / "out")
    procs = spawn_ranks("rank_round_worker.py", 2, scenario, out, str(timeout_s))
    codes = {}
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):  # None below, with the ranks' logs
            procs[0].wait(timeout=WAIT_S)
        codes[0] = procs[0].returncode
        if follower_exits:
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[1].wait(timeout=WAIT_S // 3)
            codes[1] = procs[1].returncode
    finally:
        logs = reap(procs)
    assert codes[0] == 0 and None not in codes.values(), f"exit codes {codes} (None: still running)\n{logs[-3000:]}"
    return torch.load(tmp_path / "out.rank0.pt"), codes, logs


@pytest.mark.timeout(4 * WAIT_S)
def test_a_rank_with_non_finite_weights_adds_nothing_to_the_average(tmp_path: Path) -> None:
    r0, codes, logs = _run(tmp_path, "nanweights", 30)
    assert codes[1] == 0, logs[-3000:]
    res = r0["runs"][0]
    # rank 1's steps count for nothing: the peer's tokens are rank 0's 3 rows of each of the 3 steps
    assert res["tokens"] == rank_worker.STEPS * 3 * rank_worker.SEQ, res
    assert torch.isfinite(r0["flat"][0]).all()
    r1 = torch.load(tmp_path / "out.rank1.pt")
    assert torch.equal(r1["flat"], r0["flat"][0])  # the follower took the peer's (finite) weights too
    assert r0["failures"] == []


@pytest.mark.timeout(4 * WAIT_S)
def test_a_run_longer_than_the_collective_timeout_is_no_failure(tmp_path: Path) -> None:
    # 16 steps of 0.5 s on each rank (8 s), a 5 s collective timeout, a keep-alive every 0.5 s
    r0, codes, logs = _run(tmp_path, "long", 5)
    assert r0["failures"] == [], r0["failures"]
    assert codes[1] == 0, logs[-3000:]
    res = r0["runs"][0]
    assert res["seconds"] > 5 and res["tokens"] == LONG_STEPS * rank_worker.BATCH * rank_worker.SEQ, res
    # and rank 0 holds no batch of the run after its meeting (no keep-alive settled the RUN's broadcasts)
    assert res["pending"] is False, res


@pytest.mark.timeout(4 * WAIT_S)
def test_an_error_in_rank_0s_steps_still_meets_the_followers(tmp_path: Path) -> None:
    r0, codes, logs = _run(tmp_path, "rank0error", 20)
    first, second = r0["runs"]
    assert first["error"] == "RuntimeError: simulated device error", first
    # the next run needs no collective timeout to pass (one would be a failure): the follower met rank 0 after
    # the failed run and took the next run's commands, in order
    assert "error" not in second, second
    assert second["tokens"] == rank_worker.STEPS * rank_worker.BATCH * rank_worker.SEQ, second
    assert r0["failures"] == [] and codes[1] == 0, logs[-3000:]
    assert torch.load(tmp_path / "out.rank1.pt")["commands"] == [WEIGHTS, RUN, WEIGHTS, RUN, EXIT]


@pytest.mark.timeout(4 * WAIT_S)
def test_degenerate_runs_neither_hang_nor_desync_the_ranks(tmp_path: Path) -> None:
    r0, codes, logs = _run(tmp_path, "edges", 20)
    assert codes[1] == 0 and r0["failures"] == [], logs[-3000:]
    zero, past, small, huge, inf, normal, floored = r0["runs"]
    assert (zero["steps"], zero["tokens"]) == (0, 0) and (past["steps"], past["tokens"]) == (0, 0)
    assert small["tokens"] == rank_worker.STEPS * 1 * rank_worker.SEQ  # one row: rank 0's, rank 1 trains none
    for res in (huge, inf, normal, floored):  # speeds of 1e308: a split that sums to the batch, no OverflowError
        assert "error" not in res, res
        assert res["tokens"] == rank_worker.STEPS * rank_worker.BATCH * rank_worker.SEQ, res
    r1 = torch.load(tmp_path / "out.rank1.pt")
    assert torch.equal(r1["flat"], r0["flat"][-1])
    # in step: the follower took every run's weights, and the RUN of each run of steps (none for 0 steps), in order
    # (a run that waited for the collective timeout would have failed the peer: no failure above)
    assert r1["commands"] == [WEIGHTS] + [WEIGHTS, RUN] * (len(r0["runs"]) - 1) + [EXIT], r1["commands"]


@pytest.mark.timeout(4 * WAIT_S)
def test_independent_ranks_train_the_token_floors_steps_within_its_grace(tmp_path: Path) -> None:
    """A relay round's token floor (session 46: the gain test's S steps for every peer planned S or more) counts a
    claim under it 0 tokens; a one-device peer the deadline stops within the floor's steps trains on to them within
    the floor's grace (``InnerTrainer.run(floor_steps=, floor_grace_s=)``). A ``--rank-sync round`` peer's ranks must
    too: before, they stopped at the deadline (the grace was dropped for them), so an honest multi-rank peer planned
    exactly S that the deadline stopped at S - 1 lost its round. Here the deadline is spent: 2 floor steps of 3, on
    both ranks."""
    r0, codes, logs = _run(tmp_path, "floor", 30)
    assert codes[1] == 0 and r0["failures"] == [], logs[-3000:]
    res = r0["runs"][0]
    assert "error" not in res, res
    assert (res["steps"], res["tokens"]) == (2, 2 * rank_worker.BATCH * rank_worker.SEQ), res
    r1 = torch.load(tmp_path / "out.rank1.pt")
    assert torch.equal(r1["flat"], r0["flat"][0])


@pytest.mark.timeout(4 * WAIT_S)
def test_a_stopped_follower_ends_rank_0s_run_after_the_collective_timeout(tmp_path: Path) -> None:
    r0, _, logs = _run(tmp_path, "stop", 4, follower_exits=False)
    res = r0["runs"][0]
    # rank 0's own 3 rows of each step are the peer's; one failure, at the meeting, not before the 4 s timeout (a
    # lower bound; the run's end is the hang guard of _run)
    assert res["tokens"] == rank_worker.STEPS * 3 * rank_worker.SEQ and res["early"], res
    assert res["seconds"] > 3.5, res
    assert len(r0["failures"]) == 1 and "meeting" in r0["failures"][0], r0["failures"]


@pytest.mark.timeout(4 * WAIT_S)
def test_a_run_with_a_step_target_falls_back_to_lockstep(tmp_path: Path) -> None:
    """Eager updates pass a StepTarget (its steps may change while they run): that run is lockstep (STEP commands,
    DDP), the next one once a round again; the ranks stay in step through both."""
    r0, codes, logs = _run(tmp_path, "eager", 20)
    assert codes[1] == 0 and r0["failures"] == [], logs[-3000:]
    full = rank_worker.STEPS * rank_worker.BATCH * rank_worker.SEQ
    assert [r["tokens"] for r in r0["runs"]] == [full, full], r0["runs"]
    r1 = torch.load(tmp_path / "out.rank1.pt")
    assert torch.equal(r1["flat"], r0["flat"][-1])
    # after the round run the inner optimizers are each rank's own (lockstep alone would keep them equal)
    assert not torch.equal(r1["exp_avg"], r0["runs"][-1]["exp_avg"])


@pytest.mark.timeout(4 * WAIT_S)
def test_a_follower_whose_rank_0_died_mid_run_exits_at_the_meeting(tmp_path: Path) -> None:
    """Rank 0 dies while the follower trains its rows (a torchrun follower: no parent to watch): the follower
    finishes its run (12 steps of 0.5 s), then its meeting fails at once (a closed connection), one ERROR line,
    exit 1."""
    procs = spawn_ranks("rank_round_worker.py", 2, "rank0dies", str(tmp_path / "out"), "30")
    try:
        assert procs[0].wait(timeout=WAIT_S) == 9
        assert procs[1].wait(timeout=20) == 1  # well before the 30 s collective timeout
    finally:
        reap(procs[:1])
        log1 = reap(procs[1:])
    errors = [line for line in log1.splitlines() if "; exiting" in line]
    assert len(errors) == 1 and "meeting failed" in errors[0], log1[-2000:]
    assert torch.load(tmp_path / "out.rank1.pt")["code"] == 1
