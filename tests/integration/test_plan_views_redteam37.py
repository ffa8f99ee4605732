"""Red team of session 37: honest plans refused by honest followers whose view differs from the leader's in a way the
protocol allows (delivered-rate maps with missing entries, records one update apart, owner bars, light followers).

Each ``test_*_passes`` is a false refusal found by the randomised search (honest plans from one view, checked from a
perturbed one; 400 seeds per perturbation) and fixed; each ``xfail`` (strict) one still open, so a fix shows.
``test_rogue_gain_*`` measures what the tolerance of the fix concedes to a rogue leader.
"""

from __future__ import annotations

import math
import random

import pytest

from geomesh_p2p.plan.bounds import evidence_ceiling_range
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled, make_plan
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.schema.peer import PeerRecord
from tests.integration.test_plan_bounds import KW, T0, by_id, paper_cfg, rec
from tests.integration.test_under_plan_redteam36 import delivered, five_peers_small_batches, trained_tokens

pytestmark = pytest.mark.timeout(300)

NUMEL = 150_000_000
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def random_swarm(seed: int) -> tuple[list[PeerRecord], PlanConfig, dict[str, float], random.Random]:
    """2-10 peers of five speed classes (0.2x-4x), 16-64 max batch, 5-1000 Mbit/s; delivered rates: 15% of the peers
    newcomers, the others at their best figure or 20-100% of it."""
    R = random.Random(seed)
    recs = [
        rec(
            f"g{i:02d}",
            150_000 * R.choice((1.0, 0.55, 0.45, 0.2, 4.0)) * R.uniform(0.8, 1.25),
            R.choice((16, 32, 64)),
            math.exp(R.uniform(math.log(5), math.log(1000))),
            batches=BATCHES,
        )
        for i in range(R.randint(2, 10))
    ]
    sup: dict[str, float] = {}
    for r in recs:
        u = R.random()
        if u >= 0.15:
            sup[r.peer_id] = r.best_tokens_per_s() * (1.0 if u < 0.6 else R.uniform(0.2, 1.0))
    return recs, paper_cfg(window_s=R.uniform(5.0, 60.0)), sup, R


def fast_p0():
    """red team 36's F2 swarm: p0 4x the others, 800 Mbit/s, a 5 s window."""
    recs = [rec("p0", 160_000 * 4, 64, 800)] + [
        rec(f"p{i}", 160_000 * f, 64, 800) for i, f in ((1, 0.9), (2, 0.8), (3, 0.85), (4, 0.95))
    ]
    return recs, paper_cfg(window_s=5.0)


def share(tokens: dict[str, int], peers) -> float:
    return round(sum(tokens[p] for p in peers) / sum(tokens.values()), 3)


# ------------------------------------------------------------------------------------------------------ fixed


def test_a_leader_whose_delivered_map_lacks_one_rate_passes():
    """FALSE REFUSAL, fixed. The leader's delivered map lacks one entry the follower's has (it missed the parts
    listing that peer): the leader seeds the peer at the lower median of its map, the follower fitted it at 2x its
    rate (under-plan) or bounded a newcomer at its own median (over-plan). Before the fix 136 of 400 random swarms
    were refused (120 under-plan, 16 over the delivered work), e.g. seed 0 "g04 gets 43 inner steps (2818048 tokens),
    under the 15466496 ..."; now each peer is checked against the range of ceilings such a leader may use
    (bounds.evidence_ceiling_range). The first 150 seeds here."""
    refused = []
    for seed in range(150):
        recs, cfg, sup, R = random_swarm(seed)
        if not sup:
            continue
        gone = R.choice(sorted(sup))
        lacking = {p: v for p, v in sup.items() if p != gone}
        try:
            plan = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=lacking, **KW)
        except ValueError:
            continue
        reason = check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)
        if reason is not None:
            refused.append((seed, reason[:80]))
    assert not refused, (len(refused), refused[:3])


def test_ceiling_range_spans_the_rate_and_the_seeds_of_a_map_less_one_entry():
    """Five rates 1..5 (lower median 3): less the highest the seed is 2, less the lowest 3; a peer of rate 1 may be
    planned at 1..3 (2 x 1 = 2, or a seed), one of rate 5 at 2..10, a newcomer at 2..3. One rate: the seed is that
    rate (a leader without any evidence is not tolerated)."""
    got = evidence_ceiling_range(["a", "e", "new"], {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0})
    assert got == {"a": (2.0, 3.0), "e": (2.0, 10.0), "new": (2.0, 3.0)}
    assert evidence_ceiling_range(["a", "b"], {"a": 4.0}) == {"a": (4.0, 8.0), "b": (4.0, 4.0)}
    assert evidence_ceiling_range(["a"], {}) == {}


def test_a_light_follower_that_does_not_bar_the_leaders_barred_owner_passes():
    """FALSE REFUSAL, fixed. The leader bars owner p3 from owning (an owner penalty it saw: planned client-only,
    no address in the plan); a light follower that did not see the penalty and sampled p3 refused "p3 is placed at
    None, its record says p3.example:7000" -- in the search, 183 of 300 swarms where the leader barred some owners
    had a light follower refuse so. The full check accepts a minority of such bars from 4 possible owners; the light
    check now does the same (the peer counts as a possible owner)."""
    recs, cfg = fast_p0()
    sup = delivered(recs)
    barred = [r.model_copy(update={"address": None}) if r.peer_id == "p3" else r for r in recs]
    plan = make_plan(barred, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    assert plan.assignment("p3").address is None
    assert check_plan(plan, by_id(recs), cfg, now=T0, supported=sup) is None
    for sample in (["p3"], ["p3", "p0"], ["p1", "p3", "p4"]):
        sampled = {p: by_id(recs)[p] for p in sample}
        assert check_plan_sampled(plan, sampled, cfg, now=T0, supported=sup) is None, sample


def test_a_light_follower_still_refuses_a_leader_that_strips_most_owners():
    """What the light fix keeps: a rogue leader p0 that strips the addresses of the 4 other owners (over the minority
    the rule accepts) to own the whole vector is refused as by the full check, by a light follower that sampled two
    of them; stripping 2 of 5 (the minority) passes both."""
    recs, cfg = fast_p0()
    sup = delivered(recs)
    for stripped, refused in ((("p1", "p2", "p3", "p4"), True), (("p3", "p4"), False)):
        plan = make_plan(
            [r.model_copy(update={"address": None}) if r.peer_id in stripped else r for r in recs],
            cfg,
            numel=NUMEL,
            supported_tokens_per_s=sup,
            **KW,
        )
        sampled = {p: by_id(recs)[p] for p in ("p3", "p4")}
        light = check_plan_sampled(plan, sampled, cfg, now=T0, supported=sup)
        full = check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)
        assert (light is not None, full is not None) == (refused, refused), (light, full)
        assert not refused or "elements, over the" in str(light)


def test_rogue_gain_from_the_delivered_map_tolerance():
    """What the tolerance concedes, measured: a rogue leader may plan any peer at the lowest ceiling of its range (as
    if it lacked that peer's rate: the seed of the map less its highest rate), and every full follower accepts it. F2's
    swarm (p0 4x the others): rogue leader p1 and partner p2 under-plan p0 (and p3, p4) to that seed: p0 trains 524k
    tokens instead of 2.42M, and p1 + p2 go from 21.7 % to 38.5 % of the round's tokens. In B2's five peers within 20 %
    of each other (rogue p0 + partner p1) the seed is about every peer's own rate: 41.5 % -> 42.5 %."""
    for (recs, cfg), pair, victims, want in (
        (fast_p0(), ["p1", "p2"], ["p0", "p3", "p4"], (0.217, 0.385)),
        ((five_peers_small_batches(), paper_cfg(window_s=5.0)), ["p0", "p1"], ["p2", "p3", "p4"], (0.415, 0.425)),
    ):
        sup = delivered(recs)
        honest = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
        lo = evidence_ceiling_range(honest.participants(), sup)
        rogue_map = {p: (lo[p][0] / 2 if p in victims else v) for p, v in sup.items()}  # 2 x that = the lowest
        rogue = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=rogue_map, **KW)
        assert check_plan(rogue, by_id(recs), cfg, now=T0, supported=sup) is None
        fair, got = trained_tokens(honest, recs, cfg), trained_tokens(rogue, recs, cfg)
        assert (share(fair, pair), share(got, pair)) == want


def test_rogue_gain_from_the_highest_ceiling():
    """The other side of the tolerance, measured: a peer whose delivered rate is under half the seed may be planned
    at the seed (as if the leader lacked its rate), the budget a newcomer gets. F2's swarm, partner p2 delivered a
    quarter of its record last round: honest 3 steps, the rogue leader p1 plans it 7 (the seed of the map less its
    lowest rate), accepted; p1 + p2 from 16.9 % to 21.7 % of the round's tokens. What sitting a round out gets too."""
    recs, cfg = fast_p0()
    sup = delivered(recs)
    sup["p2"] *= 0.25
    honest = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    hi = evidence_ceiling_range(honest.participants(), sup)["p2"][1]
    rogue = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s={**sup, "p2": hi / 2}, **KW)
    assert check_plan(rogue, by_id(recs), cfg, now=T0, supported=sup) is None
    assert (honest.assignment("p2").inner_steps, rogue.assignment("p2").inner_steps) == (3, 7)
    fair, got = trained_tokens(honest, recs, cfg), trained_tokens(rogue, recs, cfg)
    assert (share(fair, ["p1", "p2"]), share(got, ["p1", "p2"])) == (0.169, 0.217)


# ------------------------------------------------------------------------------------------------------- open


@pytest.mark.xfail(
    strict=True,
    reason="open (session 37): a follower whose delivered map lacks a peer's rate bounds it at the newcomer seed; "
    "accepting more for every peer it lacks would lift the seed's bound on true newcomers",
)
def test_a_follower_whose_delivered_map_lacks_a_fast_peers_rate_refuses_the_honest_plan():
    """FALSE REFUSAL (plain: that follower sits the round out), the mirror of F2. The follower missed the parts
    listing p0 (4x the others): it bounds p0 at the lower median of its map, the leader planned it at its record.
    In the search 85 of 400 random swarms were refused when the follower lacked one rate (mostly over the delivered
    work, a few under-plan: a slow peer the leader planned at 2x its low rate, the follower at the seed)."""
    recs, cfg = fast_p0()
    sup = delivered(recs)
    plan = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    lacking = {p: v for p, v in sup.items() if p != "p0"}
    reason = check_plan(plan, by_id(recs), cfg, now=T0, supported=lacking)
    assert reason is None, reason  # "token budget 2424832 for p0 exceeds the 1010971 its delivered work supports ..."


@pytest.mark.xfail(
    strict=True,
    reason="open (session 37): a leader without the last round's evidence (it adopted the state instead of applying "
    "the round) plans by the records alone; accepting that from any leader would drop the evidence bound",
)
def test_a_leader_without_delivered_evidence_is_refused_by_followers_with_it():
    """FALSE REFUSAL (plain, at every follower that holds the map). The leader holds no delivered map (its evidence
    is of another round: ``delivered_evidence`` is None) and plans newcomer p0 at its record; the followers seed it at
    their lower median. 84 of 400 random swarms refused."""
    recs, cfg = fast_p0()
    sup = {p: v for p, v in delivered(recs).items() if p != "p0"}  # p0 a newcomer
    plan = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=None, **KW)
    reason = check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)
    assert reason is None, reason  # "token budget 2424832 for p0 exceeds the 1010971 ... (a newcomer ...)"


@pytest.mark.xfail(
    strict=True,
    reason="open (session 37): a record grows up to MAX_TPS_GROWTH_PER_UPDATE = 2x per update, the throughput "
    "ceiling's tolerance (PLAN_CHECK_TOLERANCE) is 1.5x",
)
def test_a_follower_that_read_the_record_one_update_older_than_the_leader_refuses():
    """FALSE REFUSAL (plain). The leader read p0's record after its figures doubled (one update: a record may grow
    2x), the follower the one before: p0's 18 steps exceed 1.5 x its older tokens/s x the window. The mirror (a
    follower newer, the figure down 1.4x) passes by design (test_plan_bounds). 22 of 400 random swarms refused with
    one record grown 1-2x."""
    recs, cfg = five_peers_small_batches(), paper_cfg(window_s=5.0)
    sup = delivered(recs)
    grown = recs[0].model_copy(update={"tokens_per_s": {b: 2 * v for b, v in recs[0].tokens_per_s.items()}})
    plan = make_plan([grown] + recs[1:], cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    reason = check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)
    assert reason is None, reason  # "token budget 1179648 for p0 exceeds the 1123301 its bounded throughput ..."


@pytest.mark.xfail(
    strict=True,
    reason="open (session 37): a link figure moves up to link_step_ratio = 4x per round, the window's tolerance "
    "(PLAN_CHECK_TOLERANCE) is 1.5x either way",
)
def test_a_slow_link_that_doubled_between_the_leaders_and_the_followers_read_refuses_the_window():
    """FALSE REFUSAL (plain, every follower of the other view). p4 on a 16 Mbit/s uplink needs 38.1 s for its
    exchange and minimum steps, which stretches the 20 s window (the exclusion rule keeps it: not over 2x); its link
    figure doubled in one update (4x is allowed), and a leader with the newer read plans 19.3 s: 2x from what the
    older read gives. 37 of 400 random swarms refused with one peer's links moved 1/4-4x (before the exclusion rule,
    which this case passes)."""
    recs = [rec(f"p{i}", 160_000 * f, 64, 800) for i, f in enumerate((1.0, 0.9, 0.8, 0.85))]
    recs.append(rec("p4", 160_000 * 0.95, 64, 16))
    cfg = paper_cfg(window_s=20.0)
    sup = delivered(recs)
    newer = recs[:4] + [
        recs[4].model_copy(update={"upload_bps": 2 * recs[4].upload_bps, "download_bps": 2 * recs[4].download_bps})
    ]
    plan = make_plan(newer, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    reason = check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)
    assert reason is None, reason  # "its window 19.3 s is far from the 38.1 s the records support"
