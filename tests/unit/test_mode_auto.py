"""``--mode auto``, the default for open swarms (issue 26): each round's exchange mode follows from the plan's
participant count, relay below :data:`~geomesh_p2p.config.method.AUTO_ACCOUNTABLE_FROM` participants and accountable
from it (sign-compressed methods), so a swarm pays relay's ~N P/8 only where it is the cheaper of the two
(docs/collective.md, "Cheaper than relay from N = 4"). Every follower derives the same mode from the plan and refuses
a plan of another."""

from __future__ import annotations

import time

import pytest

from geomesh_p2p.config.method import AUTO_ACCOUNTABLE_FROM, MethodRule, round_mode
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan import planner
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import PlanConfig
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

NUMEL = 40_000


def test_round_mode_is_relay_below_five_participants_and_accountable_from_five():
    assert AUTO_ACCOUNTABLE_FROM == 5
    assert [round_mode("auto", n) for n in range(1, 8)] == ["relay"] * 4 + ["accountable"] * 3
    assert round_mode("auto", 5, "css") == "accountable"
    # fp32 methods keep relay (accountable's robust rule and its proofs are the sign codec's)
    assert {round_mode("auto", n, m) for n in (2, 5, 64) for m in ("diloco", "awb", "ddp")} == {"relay"}
    for mode in ("relay", "reencode", "accountable"):
        assert {round_mode(mode, n) for n in (1, 5, 1024)} == {mode}
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        round_mode("fast", 5)


def test_auto_charges_the_rounds_mode_bytes():
    """The planner's payload (the window it sizes) under auto is exactly relay's below 5 and accountable's from 5."""
    auto, relay, acct = (MethodRule.of("geomesh", mode=m) for m in ("auto", "relay", "accountable"))
    for n in (2, 3, 4):
        assert auto.payload_bytes(NUMEL, n) == relay.payload_bytes(NUMEL, n)
    for n in (5, 16, 1024):
        assert auto.payload_bytes(NUMEL, n) == acct.payload_bytes(NUMEL, n) < relay.payload_bytes(NUMEL, n)
    assert planner.exchange_passes(4, "auto") == planner.exchange_passes(4, "relay")
    assert planner.exchange_passes(9, "auto") == planner.exchange_passes(9, "accountable")


def _plan(n: int, mode: str = "auto"):
    run = RunConfig(seq_len=32, window_s=5.0, mode=mode)
    ids = [Identity.generate() for _ in range(n)]
    recs = [peer_record(i, address=f"127.0.0.1:{1001 + k}", round=2, weights_digest="d") for k, i in enumerate(ids)]
    cfg = PlanConfig(seq_len=32, target_batch=8, window_s=5.0, payload_bytes=1000, mode=run.mode, method=run.method)
    plan = plan_round(
        recs, cfg, run_id=run.run_id, round=2, leader=recs[0].peer_id, numel=NUMEL,
        start_time=time.time() + 1, start_digest="d",
    )  # fmt: skip
    return run, recs, plan


@pytest.mark.parametrize("n, mode", [(4, "relay"), (5, "accountable")])
def test_an_auto_leaders_plan_carries_the_rounds_mode_and_followers_accept_only_that(n, mode):
    run, recs, plan = _plan(n)
    assert RunConfig().mode == "auto" and len(plan.assignments) == n and plan.mode == mode
    rules = make_rules(run, NodeConfig(), me=recs[1].peer_id, numel=NUMEL).planning
    assert rules._settings_problem(plan) is None
    other = "accountable" if mode == "relay" else "relay"
    forged = plan.model_copy(update={"mode": other})
    assert "mode differ from the run config" in str(rules._settings_problem(forged))
    cfg = rules.plan_config(n)
    assert cfg.mode == "auto"
    assert f"{plan.method}/{other}" in str(planner._settings_problem(forged, cfg))
    assert planner._settings_problem(plan, cfg) is None
    # a run of one fixed mode still refuses the other
    fixed = make_rules(run.model_copy(update={"mode": other}), NodeConfig(), me=recs[1].peer_id, numel=NUMEL).planning
    assert "mode differ" in str(fixed._settings_problem(plan))


def test_auto_is_refused_with_eager_and_allows_groups_for_sign_methods_only():
    with pytest.raises(ValueError, match=r"need mode 'reencode' \(--mode; mode 'auto' runs relay rounds\)"):
        RunConfig(eager=True)
    assert RunConfig(group_size=None).group_size is None  # auto groups: grouped rounds (>= 9) are accountable
    with pytest.raises(
        ValueError, match="needs re-encoding rounds, which mode 'auto' runs only for methods css, geomesh"
    ):
        RunConfig(method="diloco", group_size=4)
    assert RunConfig(method="diloco", mode="reencode", group_size=4).group_size == 4
    assert RunConfig().config_hash() != RunConfig(mode="relay").config_hash()
