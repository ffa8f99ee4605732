"""Exact undo of a proven forged part (issue 26; geomesh_p2p.round.rules.undo): rewinding to the kept start of the
forged round and replaying with the forged range idle gives, bitwise, the state of the run in which that range was
idle from the start (same later aggregates)."""

from __future__ import annotations

import zlib
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
        total = sum(s.nbytes() for s in files)
        assert total == UNDO_ROUNDS * undo_bytes_per_round(P) == 3 * 12 * P
    finally:
        log.close()


def test_the_plans_undo_list_is_absent_while_empty_and_round_trips_when_set():
    from geomesh_p2p.plan.schema import RoundPlan
    from geomesh_p2p.plan.wire import decode_body, encode_body
    from tests.plan_util import big_plan

    plan = big_plan(4, round=5)
    assert b"undo" not in plan.to_bytes()  # the bytes (and so the signatures) of plans without undos as before
    assert b"undo" not in zlib.decompress(encode_body(plan))
    listed = plan.model_copy(update={"undo": [(3, 1), (4, 0)]})
    assert RoundPlan.from_bytes(listed.to_bytes()).undo == [(3, 1), (4, 0)]
    assert decode_body(encode_body(listed)).undo == [(3, 1), (4, 0)]


def test_a_plans_undo_list_is_refused_by_content_only_when_the_plan_alone_says_so():
    from geomesh_p2p.plan.schema import ContentRefusal
    from geomesh_p2p.round.rules.accountable import Accountability
    from tests.plan_util import big_plan

    acc = Accountability(lambda: None, collective=lambda: None, dht=lambda: None, identity=None, run_id="r")
    plan = big_plan(4, round=5).model_copy(update={"mode": "accountable"})

    def listing(*undo):
        return plan.model_copy(update={"undo": list(undo)})

    assert acc.undo_problem(plan, True) is None
    # --undo-forged off; the plan's own round; past the kept rounds; a part twice; not an accountable round
    for bad, on in [
        (listing((4, 0)), False),
        (listing((5, 0)), True),
        (listing((1, 0)), True),
        (listing((3, 0), (3, 0)), True),
        (listing((4, 0)).model_copy(update={"mode": "reencode"}), True),
    ]:
        why = acc.undo_problem(bad, on)
        assert isinstance(why, ContentRefusal), (bad.undo, why)
    # a proof this peer has not read yet: a refusal of its view (read again), not a content refusal
    why = acc.undo_problem(listing((3, 1)), True)
    assert isinstance(why, str) and not isinstance(why, ContentRefusal) and "not read" in why
    acc.forged[(3, 1)] = (10, 20)
    assert acc.undo_problem(listing((3, 1)), True) is None
    assert acc.undo_list(5) == [(3, 1)] and acc.undo_list(7) == []  # round 3 is past the kept rounds at 7
    acc.undone.add((3, 1))
    assert acc.undo_list(5) == []


class _UndoPlan(_Plan):
    mode = "accountable"

    def __init__(self, undo=()):
        self.undo = list(undo)


def _rule_run(tmp_path, rounds: int, undo_at, write_between=None):
    """The node's path: :meth:`OuterStepRule.apply` with an :class:`UndoLog`, the plan of ``undo_at`` listing the
    forged part as (round, part) and the forgeries read from proofs mapping it to its range."""
    theta, outer = torch.linspace(-1, 1, P), OuterNesterov()
    forged, undone = {(FORGED_ROUND, 1): FORGED}, set()
    rule = OuterStepRule(
        SimpleNamespace(me="me"),
        lambda: theta,
        lambda: outer,
        UndoLog(dir=str(tmp_path)),
        lambda: forged,
        lambda: undone,
    )
    aggs = _aggregates(rounds)
    try:
        for r in range(rounds):
            if write_between == r:
                theta.add_(0.0)  # a write the rule did not make (a re-sync's load): the kept rounds are forgotten
            rule.apply(r, _UndoPlan([(FORGED_ROUND, 1)] if r == undo_at else []), aggs[r], [])
    finally:
        rule.undo.close()
    return theta, undone


def test_the_rule_undoes_what_the_plan_lists_once(tmp_path, caplog):
    want, _ = _run(OuterNesterov(), 5, idle_from_start=True)
    with caplog.at_level("WARNING"):
        theta, undone = _rule_run(tmp_path, 5, undo_at=3)
    assert torch.equal(theta, want) and undone == {(FORGED_ROUND, 1)}
    assert [r.getMessage() for r in caplog.records if "undone" in r.getMessage()] == [
        "round 3: forged part(s) [[1, 24, 48]] undone: outer steps of rounds 1..2 replayed with them idle"
    ]


def test_a_state_written_outside_the_steps_forgets_the_kept_rounds(tmp_path):
    forged, _ = _run(OuterNesterov(), 5, idle_from_start=False)
    theta, undone = _rule_run(tmp_path, 5, undo_at=3, write_between=2)
    assert torch.equal(theta, forged)  # no replay from a line the state left: left applied, as too old
    assert undone == {(FORGED_ROUND, 1)}


def test_the_run_memory_lists_the_kept_rounds_on_disk():
    from geomesh_p2p.config.models import RunConfig, NodeConfig
    from geomesh_p2p.node.training import run_memory

    def kept(**kw):
        est = run_memory(RunConfig(run_id="r", mode="accountable", **kw), NodeConfig(), 1000)
        return [(i.bytes, i.where) for i in est.items if i.name == "exact undo: kept rounds"]

    assert kept() == []
    assert kept(undo_forged=True) == [(UNDO_ROUNDS * undo_bytes_per_round(1000), "disk")]  # 3 x 12 P bytes
