"""Exact undo of a proven forged part (issue 26; geomesh_p2p.round.rules.undo): rewinding to the kept start of the
forged round and replaying with the forged range idle gives, bitwise, the state of the run in which that range was
idle from the start (same later aggregates)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.model.optim import OuterNesterov, SyncAdamW
from geomesh_p2p.round.rules.outer import OuterStepRule
from geomesh_p2p.round.rules.undo import UNDO_ROUNDS, UndoLog, undo_bytes_per_round

pytestmark = pytest.mark.timeout(60)

P = 96
PARTS = [(0, 24), (24, 48), (48, 72), (72, 96)]
FORGED_ROUND, FORGED = 1, (24, 48)


class _Plan:
    def owners(self):
        return [(f"p{i}", s, e) for i, (s, e) in enumerate(PARTS)]


def _aggregates(rounds: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(P, generator=g) * 0.01 for _ in range(rounds)]
    out[FORGED_ROUND][FORGED[0] : FORGED[1]] = 3.0  # the forged part: far off the honest values
    return out


def _rule(theta, outer):
    return OuterStepRule(SimpleNamespace(me="me"), lambda: theta, lambda: outer)


def _run(outer, rounds: int, idle_from_start: bool, undo_at=None, log=None):
    """``rounds`` outer steps from a fixed start, as a peer's rounds apply them; with ``idle_from_start`` the forged
    range is idle in the forged round; ``undo_at``: at the start of that round, undo the forgery via ``log``."""
    theta = torch.linspace(-1, 1, P)
    rule = _rule(theta, outer)
    aggs = _aggregates(rounds)
    plan = _Plan()
    for r in range(rounds):
        if undo_at == r:
            done = log.undo([(FORGED_ROUND, *FORGED)], r, theta, outer)
            assert done == [(FORGED_ROUND, *FORGED)]
        idle = [FORGED] if (idle_from_start and r == FORGED_ROUND) else []
        if log is not None:
            log.keep_start(r, theta, outer)
        rule.apply(r, plan, aggs[r], idle)
        if log is not None:
            log.record(r, [(s, e) for _, s, e in plan.owners()], idle, aggs[r])
    return theta, outer


def _state(outer) -> list[torch.Tensor]:
    return [outer.buf.clone()] if outer.buf is not None else []


@pytest.mark.parametrize(
    "make",
    [
        lambda: OuterNesterov(lr=0.7, momentum=0.9),  # the fused step
        lambda: OuterNesterov(lr=0.7, momentum=0.9, momentum_clip=2.0, block_size=8),
        lambda: SyncAdamW(lambda r: 0.01),  # two state slices, the copy-and-check path
    ],
)
@pytest.mark.parametrize("undo_at", [2, 3, 1 + UNDO_ROUNDS])
def test_undo_is_bitwise_the_run_where_the_part_was_idle(tmp_path, make, undo_at):
    rounds = undo_at + 2
    want_theta, want_outer = _run(make(), rounds, idle_from_start=True)
    forged_theta, _ = _run(make(), rounds, idle_from_start=False)
    assert not torch.equal(forged_theta, want_theta)  # without the undo the forged round stays in the weights
    log = UndoLog(dir=str(tmp_path))
    try:
        theta, outer = _run(make(), rounds, idle_from_start=False, undo_at=undo_at, log=log)
        assert torch.equal(theta, want_theta)
        assert all(torch.equal(a, b) for a, b in zip(_state(outer), _state(want_outer)))
        assert outer.steps == want_outer.steps
        # kept rounds stay corrected: listing the same undo again changes nothing
        before = theta.clone()
        now = rounds
        if log.can_undo(FORGED_ROUND, now):
            log.undo([(FORGED_ROUND, *FORGED)], now, theta, outer)
            assert torch.equal(theta, before)
    finally:
        log.close()


def test_forgery_older_than_the_kept_rounds_is_left_applied(tmp_path, caplog):
    log = UndoLog(dir=str(tmp_path))
    try:
        theta, outer = _run(OuterNesterov(), 1 + UNDO_ROUNDS + 1, idle_from_start=False, log=log)
        now = 1 + UNDO_ROUNDS + 1
        assert FORGED_ROUND not in log.rounds()
        before = theta.clone()
        with caplog.at_level("INFO"):
            assert log.undo([(FORGED_ROUND, *FORGED)], now, theta, outer) == []
            assert log.undo([(FORGED_ROUND, *FORGED)], now, theta, outer) == []
        assert torch.equal(theta, before)
        assert sum("older than the kept rounds" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        log.close()


def test_kept_bytes_per_round(tmp_path):
    log = UndoLog(dir=str(tmp_path))
    try:
        _run(OuterNesterov(), 5, idle_from_start=False, log=log)
        assert log.rounds() == [2, 3, 4]
        files = [log._theta, log._state, log._agg]
        total = sum((tmp_path / s.path.split("/")[-1] / f).stat().st_size for s in files for f in s.files())
        assert total == UNDO_ROUNDS * undo_bytes_per_round(P) == 3 * 12 * P
    finally:
        log.close()
