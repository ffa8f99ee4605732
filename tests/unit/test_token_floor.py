"""The token floor (issue 28, the ``min_steps`` dodge, 0.12.0): a contribution claiming fewer tokens than
``VerifyConfig.min_steps`` steps at its planned batch never gets screened, so it counts 0 tokens.

Here: which peers of a plan get a floor (:func:`screen_token_floor`), and the spec's field (validation, the
counted tokens, and a spec_id unchanged for specs without a floor). The aggregate with a dodger in it, at every
mode's owners, readers and validators: ``tests/integration/test_token_floor_collective.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.exchange import CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round.rules.spec import screen_token_floor
from geomesh_p2p.trust.verify_task import VerifyConfig

pytestmark = pytest.mark.timeout(30)


def _plan(mode: str, steps: list[int]):
    rows = [SimpleNamespace(peer_id=f"p{k}", batch_size=4 + k, inner_steps=h) for k, h in enumerate(steps)]
    return SimpleNamespace(round=0, mode=mode, seq_len=16, assignments=rows)


def test_peers_planned_at_least_min_steps_get_the_tokens_of_min_steps_steps_in_screened_modes():
    assert VerifyConfig.min_steps == 5  # the draws' eligibility (verify_task._eligible) and the floor agree
    plan = _plan("relay", [20, 5, 4, 0])
    # p0: 5 steps x batch 4 x 16 tokens; p1 at exactly min_steps; p2 planned 4 (a check could not draw it anyway)
    assert screen_token_floor(plan, "sign") == {"p0": 5 * 4 * 16, "p1": 5 * 5 * 16}
    assert screen_token_floor(_plan("accountable", [20, 5, 4, 0]), "sign") == {"p0": 320, "p1": 400}
    # where nobody checks a contribution (reencode's owners alone see it) or nothing is sign-compressed: no floor
    assert screen_token_floor(_plan("reencode", [20, 20]), "sign") == {}
    assert screen_token_floor(_plan("relay", [20, 20]), "fp32") == {}


def _spec(**kw) -> CollectiveSpec:
    ids = [Identity.generate().peer_id.to_string() for _ in range(3)]
    owners = [PartOwner(p, f"127.0.0.1:{1000 + k}", k * 64, (k + 1) * 64) for k, p in enumerate(ids)]
    return CollectiveSpec("run", 4, {p: 1000 for p in ids}, owners, 3 * 64, 10.0, 11.0, mode="relay", **kw)


def test_counted_tokens_cap_then_floor():
    base = _spec()
    a, b, c = base.participants
    spec = CollectiveSpec.from_dict({**base.to_dict(), "token_floor": {a: 320, b: 0}})
    assert spec.token_floor == {a: 320}  # a zero floor is no floor
    assert [spec.counted_tokens(a, n) for n in (0, 319, 320, 999, 5000)] == [0, 0, 320, 999, 1000]
    assert [spec.counted_tokens(b, n) for n in (0, 1, 5000)] == [0, 1, 1000]
    with pytest.raises(KeyError):
        spec.counted_tokens("nobody", 10)
    # the floor is part of what every peer agrees on
    assert spec.spec_id != base.spec_id
    assert CollectiveSpec.from_dict(spec.to_dict()).spec_id == spec.spec_id
    # a spec without a floor hashes as before the field existed (peers of 0.11 compute the same spec_id)
    assert "token_floor" not in base._canonical_json()
    assert CollectiveSpec.from_dict({**base.to_dict(), "token_floor": {}}).spec_id == base.spec_id


def test_a_bad_floor_is_refused_with_its_reason():
    base = _spec()
    a = next(iter(base.participants))
    with pytest.raises(ValueError, match="names no participant"):
        CollectiveSpec.from_dict({**base.to_dict(), "token_floor": {Identity.generate().peer_id.to_string(): 5}})
    with pytest.raises(ValueError, match="negative"):
        CollectiveSpec.from_dict({**base.to_dict(), "token_floor": {a: -1}})


def test_standing_credits_only_contributions_that_counted_tokens():
    from geomesh_p2p.trust.standing import Standing, delivered

    # part -> (peer, tokens counted): "z" claimed 0 or fell below its floor in every part, "b" counted in one
    contributors = {0: [("a", 320), ("b", 0), ("z", 0)], 1: [("a", 320), ("b", 99), ("z", 0)]}
    assert delivered(contributors) == {"a", "b"}
    s = Standing(window=8)
    for r in range(6):
        s.credit(r, delivered(contributors))
    assert s.weight("z") == 0 and s.weight("a") == 6 and s.weight("b") == 6


def test_a_peer_with_a_floor_may_finish_its_floor_steps_a_grace_past_the_train_deadline():
    """``round.steps.floor_steps`` / ``floor_grace_s`` (session 34): the steps the trainer may run past the train
    deadline are exactly the floor's (``min_steps``) for a peer that has one, none otherwise; the grace is two
    windows, at most 40% of the exchange window (the owners close a part at 75% of it; session 45: one window and a
    quarter before, too short for the screened rounds' 7 steps at the tests' 1.5 s windows)."""
    from geomesh_p2p.round.steps import floor_grace_s, floor_steps

    plan = _plan("relay", [20, 5, 4])
    plan.window_s, plan.train_deadline, plan.exchange_deadline = 6.0, 100.0, 130.0
    drv = lambda me, push="sign": SimpleNamespace(me=me, cfg=SimpleNamespace(push_encoding=push))  # noqa: E731
    a = {x.peer_id: x for x in plan.assignments}
    assert [floor_steps(drv(p), plan, a[p]) for p in ("p0", "p1", "p2")] == [VerifyConfig.min_steps] * 2 + [0]
    assert floor_steps(drv("p0", push="fp32"), plan, a["p0"]) == 0  # no floor where nothing is screened
    assert floor_grace_s(plan) == 12.0  # two windows (session 45; one before)
    plan.exchange_deadline = 108.0  # an exchange window of 8 s: 40% of it, 3.2 s (a quarter before)
    assert floor_grace_s(plan) == pytest.approx(3.2)


def test_an_unscreenable_contribution_at_a_large_batch_counts_its_steps_at_the_median_batch():
    """``screen_token_cap`` (red team, session 34): a newcomer announcing a batch 64x the others' was planned 1 step,
    exempt from every budget bound, and weighed a whole honest round unscreened. In screened modes a peer planned
    fewer than ``min_steps`` steps at a batch above the plan's lower median counts at most its steps at that median;
    peers at an ordinary batch, peers planned ``min_steps`` or more (their floor applies) and unscreened modes are
    not capped; the spec's participants carry the cap, so every owner, reader and validator counts alike."""
    from geomesh_p2p.round.rules.spec import _capped_budgets, screen_token_cap

    rows = [
        SimpleNamespace(peer_id="big", batch_size=256, inner_steps=1, token_budget=256 * 16),
        SimpleNamespace(peer_id="slow", batch_size=4, inner_steps=3, token_budget=3 * 4 * 16),
        SimpleNamespace(peer_id="h1", batch_size=4, inner_steps=20, token_budget=20 * 4 * 16),
        SimpleNamespace(peer_id="h2", batch_size=8, inner_steps=12, token_budget=12 * 8 * 16),
    ]
    plan = SimpleNamespace(round=0, mode="relay", seq_len=16, assignments=rows)
    assert screen_token_cap(plan, "sign") == {"big": 1 * 4 * 16}  # lower median of (4, 4, 8, 256): 4
    assert _capped_budgets(plan, "sign") == {"big": 64, "slow": 192, "h1": 1280, "h2": 1536}
    assert screen_token_cap(SimpleNamespace(mode="reencode", seq_len=16, assignments=rows), "sign") == {}
    assert screen_token_cap(plan, "fp32") == {}
    # the cap and the floor never meet: one binds under min_steps steps, the other from min_steps on
    assert not set(screen_token_cap(plan, "sign")) & set(screen_token_floor(plan, "sign"))
