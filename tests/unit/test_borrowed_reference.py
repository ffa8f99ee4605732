"""A power reference for a screener that sent nothing itself (issue 28, session 44; verify_task.borrowed_references,
gain_stages.staged_gain): the loss-gain test of 2 other contributions of the round, each measured as the screener's
own would be; the test has power only when every one of them shows it. Session 43's fifth benchmark run: h0 trained
3 steps in round 2 (under ``min_steps``: no reference of its own), passed the backdoor poisoner as inconclusive, and
the plans it led kept the poisoner for good.

What a reference can and cannot do: it only decides whether a low t counts (``gain_decides``); a contribution fails
on its own t < ``gain_t_hard`` alone. So a reference of any value, an inflated one included, cannot fail a contribution
whose t clears the threshold, and the lowest of 2 is at most an honest t of the round unless both are hostile.

The world is tests/verify_util.py's (real tiny model, KJV corpus, batch 8 x 64, round 2): A is the accused, B and C
contributed honestly (H = 10), the screener V contributed nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import flat_params, load_flat_
from geomesh_p2p.trust import gain_stages as GS
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.gain import GainStats
from geomesh_p2p.trust.verify_commit import Committed
from tests.poison import PoisonedCorpus, trigger_ids
from tests.verify_util import Counting, B, L, ROUND, _fixed_identity, _new_trainer, _plan, _train_round, world_fixture

# one intra-op thread (conftest's one_thread) for the screens too, not only the world's training: under make test's
# load (3 workers on 2 cores) spin-waiting OpenMP threads made each screen's CPU steps many times slower
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]

world = pytest.fixture(scope="module", name="world")(world_fixture)

CFG = VT.VerifyConfig()
WHOLE = dataclasses.replace(CFG, gain_staged=False)
SEED = hashlib.sha256(b"s44").digest()


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def poisoner(world):
    """The backdoor poisoner of tests/poison.py as A (its own corpus copy, the trigger 16 % of its tokens), H = 10."""
    poisoned = PoisonedCorpus(world.ds, trigger_ids(world.ds.vocab_size))
    return _one_thread(lambda: _train_round(world.base, poisoned, world.theta, world.b_state, 10, world.pid["A"]))


@pytest.fixture(scope="module")
def inflated(world):
    """A colluder's contribution as B that inflates its t: 3 passes over its 10 assigned batches, claimed as 10 steps
    (it memorises them: what a colluder can do to lend a screener "power")."""

    def train():
        m = copy.deepcopy(world.base)
        load_flat_(m, world.theta)
        t = _new_trainer(m, world.ds, world.pid["B"])
        t.load_state_dict(copy.deepcopy(world.b_state))
        for _ in range(3):  # the same batches each pass: they are drawn from (seed, peer, round, step)
            t.run(round=ROUND, inner_steps=10, batch_size=B)
        return world.theta - flat_params(m)

    return _one_thread(train)


def _packets(world, a, H, *, others=None, own=None, held=("B", "C")):
    """sender -> part -> SignPacket: A's ``a`` of ``H`` steps, B and C (``others``: name -> delta, default the
    world's honest ones; only ``held``'s, the rest as accountable mode's Committed stand-ins, not fetched) and the
    screener V's ``own`` (None: it sent nothing)."""
    others = {**world.others, **(others or {})}
    v = str(_fixed_identity("screener-V").peer_id)
    out = {}
    for peer, delta, steps in (
        [(world.pid["A"], a, H)]
        + [(world.pid[n], others[n], 10) for n in ("B", "C")]
        + ([(v, own, 10)] if own is not None else [])
    ):
        out[peer] = {
            j: compression.encode(delta[s:e].contiguous(), 2048, steps * B * L)
            for j, (s, e) in enumerate(world.part_ranges)
        }
    for n in ("B", "C"):
        if n not in held:
            out[world.pid[n]] = {j: Committed(10 * B * L, bytes(16)) for j in out[world.pid[n]]}
    return out


#: the losses of the round's control batches at theta (gain_rows' ``("control", ...)`` cache entries), measured by the
#: first screen that needs each and reused by the later ones: every screen here loads the same theta and draws the
#: same control batches (seed 0, round 2, B x L), so they are the same bits (a third of a screen's forward passes)
_CONTROLS: dict = {}


def _screen(world, cfg, a, H=10, *, cache=None, dataset=None, **kw):
    """Screener V screens A's ``a`` of round 2 (``H`` steps). Returns (stats, verdict, the task, the packets). Without
    ``cache`` and ``dataset`` the screen's cache starts with the module's control losses (:data:`_CONTROLS`); a
    screen that counts the batches it draws (``dataset``) or is given a ``cache`` measures them itself."""
    shared = cache is None and dataset is None
    if shared:
        cache = {k: list(v) for k, v in _CONTROLS.get(id(world), {}).items()}
    v = _fixed_identity("screener-V")
    vid = str(v.peer_id)
    packets = _packets(world, a, H, **kw)
    plan = _plan(world, {"V": v}, steps={"A": H})
    task = VT.derive_screen(
        cfg, plan=plan, verifier=vid, accused=world.pid["A"], seed=SEED, packets=packets, part_ranges=world.part_ranges
    )
    assert task is not None and task.steps_done == H
    stats, verdict = VC.screen_contribution(
        cfg, task, model=copy.deepcopy(world.base), dataset=dataset or world.ds, theta=world.theta, seed=0,
        packets=packets, lr=1e-3, weight_decay=0.1, plan=plan, checker=vid, cache={} if cache is None else cache,
    )  # fmt: skip
    assert stats.gain is not None
    if shared:
        _CONTROLS.setdefault(id(world), {}).update((k, list(v)) for k, v in cache.items() if k[0] == "control")
    return stats, verdict, task, (plan, packets, vid)


def test_a_screener_without_a_contribution_of_its_own_fails_the_poisoner_on_two_borrowed_references(world, poisoner):
    """Session 43's "never" run: no own reference, so the poisoner passed as inconclusive. B's and C's honest
    contributions of the round show power now (t 7.10 and 5.18 whole); the accused's statistic is the one every
    screener measures (the same to the bit as at a screener with its own reference: the screen's batches follow
    from the round's seed), t 0.43 here, its halves between the stage bounds, so the whole test runs."""
    vid = str(_fixed_identity("screener-V").peer_id)
    own_stats, own_verdict, _, _ = _screen(world, CFG, poisoner, own=world.honest_of(vid))
    assert own_verdict.outcome == VC.FAIL and 0.3 < own_stats.gain.t < 0.6
    for cfg, passes in ((CFG, 48 + 2 * 16), (WHOLE, 48 + 2 * 32)):
        ds = Counting(world.ds)
        stats, verdict, task, (plan, packets, _) = _screen(world, cfg, poisoner, dataset=ds)
        assert VT.reference_task(cfg, task, plan=plan, packets=packets, checker=vid) is None  # it sent nothing
        assert verdict.outcome == VC.FAIL, verdict
        assert "2 other contributions of the round (borrowed)" in verdict.reason, verdict
        assert stats.gain == own_stats.gain and stats.gain.t < CFG.gain_t_hard
        # the whole screen, then both references' halves (staged: each clears its bound on its half) or wholes
        assert ds.batches == passes, (cfg.gain_staged, ds.batches)
        # one other contribution held (C's not fetched, accountable mode): fewer than 2, no power, as before
        stats, verdict, _, _ = _screen(world, cfg, poisoner, held=("B",))
        assert verdict.outcome == VC.PASS and verdict.reason.startswith("inconclusive"), verdict
        assert "no contribution of its own" in verdict.reason and stats.gain == own_stats.gain


def test_the_borrowed_references_are_two_other_held_contributions_drawn_from_the_screens_seed(world, poisoner):
    stats, verdict, task, (plan, packets, vid) = _screen(world, CFG, poisoner)
    refs = VT.borrowed_references(CFG, task, plan=plan, packets=packets, checker=vid)
    assert sorted(r.accused for r in refs) == sorted([world.pid["B"], world.pid["C"]])  # not A, not V
    assert all(r.steps_done == 10 and r.parts == task.parts and r.kind == VT.SCREEN for r in refs)
    # their batches are drawn from the screen's seed (unknown while they trained), not from the fixed seed of
    # their own reference (reference_task: known in advance to the contributor)
    own = {r.accused: VT.reference_task(CFG, task, plan=plan, packets=packets, checker=r.accused) for r in refs}
    assert all(r.element_seed != own[r.accused].element_seed for r in refs)
    assert VT.borrowed_references(CFG, task, plan=plan, packets=packets, checker=vid) == refs  # pure
    other = dataclasses.replace(task, element_seed=task.element_seed ^ 1)
    assert VT.borrowed_references(CFG, other, plan=plan, packets=packets, checker=vid) != refs
    assert VT.borrowed_references(CFG, task, plan=plan, packets=packets, checker=vid, n=3) == []  # only 2 held


def _inflate(cfg, task, plan, packets, vid, t=1e6):
    """A cache holding borrowed references of any t (their halves and wholes): what the most hostile references
    could measure."""
    cache: dict = {}
    for r in VT.borrowed_references(cfg, task, plan=plan, packets=packets, checker=vid):
        key = GS._ref_key(r)
        cache[key] = cache[key + ("half",)] = GainStats(1.0, 0.0, t, 8, 16, steps=10)
    return cache


@pytest.mark.parametrize("H", [5, 10, 20])
def test_a_reference_of_any_value_cannot_fail_an_honest_contribution(world, poisoner, H):
    """An honest contribution (H = 5, 10, 20) passes with the borrowed references; a reference only says whether a
    low t counts: with both at t 1e6 it passes with the same statistic as without; only a t under gain_t_hard fails
    (the poisoner's)."""
    for cfg in (CFG, WHOLE):
        plain, verdict, task, (plan, packets, vid) = _screen(world, cfg, world.honest[H], H)
        # an honest contribution passes with the borrowed references as they are (not as inconclusive)
        assert verdict.outcome == VC.PASS and plain.gain.t >= CFG.gain_t_min, (H, cfg.gain_staged, verdict)
        assert not verdict.reason.startswith("inconclusive")
        stats, verdict, _, _ = _screen(world, cfg, world.honest[H], H, cache=_inflate(cfg, task, plan, packets, vid))
        assert verdict.outcome == VC.PASS and stats.gain == plain.gain and stats.gain.t >= CFG.gain_t_min, verdict
    if H == 10:  # only a t under gain_t_hard fails (the poisoner's), inflated references or not
        _, _, task, (plan, packets, vid) = _screen(world, CFG, poisoner)
        _, verdict, _, _ = _screen(world, CFG, poisoner, cache=_inflate(CFG, task, plan, packets, vid))
        assert verdict.outcome == VC.FAIL


def test_one_colluder_cannot_lend_power_alone(world, poisoner, inflated):
    """B a colluder that memorised its batches (t 16.6 against its honest self's 7.1), C a contribution in which the
    test shows no power (another peer's batches: t -0.18): the lowest counts, so no power, and the poisoner's screen
    is inconclusive as without a reference. With C honest the power is C's (the lower of the two)."""
    for cfg in (CFG, WHOLE):
        stats, verdict, task, (plan, packets, vid) = _screen(
            world, cfg, poisoner, others={"B": inflated, "C": world.wrong_data}
        )
        assert verdict.outcome == VC.PASS and verdict.reason.startswith("inconclusive"), verdict
        refs = VT.borrowed_references(cfg, task, plan=plan, packets=packets, checker=vid)
        ts = {
            r.accused: VC._reference_of(
                cfg, r, copy.deepcopy(world.base), world.ds, world.theta, packets, seed=0, deadline=None, pace=None,
                cache=None,
            ).t
            for r in refs
        }  # fmt: skip
        assert ts[world.pid["B"]] >= stats.gain.t + CFG.gain_t_gap > ts[world.pid["C"]], ts  # B alone would lend it
    _, verdict, _, _ = _screen(world, CFG, poisoner, others={"B": inflated})
    assert verdict.outcome == VC.FAIL


def test_a_screener_whose_own_reference_has_no_power_borrows_two_others(world, poisoner):
    """Session 45's benchmark: h1's own contribution (many more steps than the poisoner's 7, scaled down to them) had
    no power, so it passed the poisoner's round-2 screen as inconclusive while h0 and h2 failed it, and its own
    verdict came a round later (the plans it led kept the poisoner meanwhile). Now the 2 borrowed references are
    measured when the own one shows no power, with the same rule (every one must show it). V's own contribution here
    trained on another peer's batches (no power on its own): before, inconclusive; now a failure on B's and C's."""
    vid = str(_fixed_identity("screener-V").peer_id)
    for cfg in (CFG, WHOLE):
        stats, verdict, task, (plan, packets, _) = _screen(world, cfg, poisoner, own=world.wrong_data)
        own = VT.reference_task(cfg, task, plan=plan, packets=packets, checker=vid)
        assert own is not None  # it sent a contribution of its own, which shows no power
        ref = VC._reference_of(
            cfg, own, copy.deepcopy(world.base), world.ds, world.theta, packets, seed=0, deadline=None, pace=None,
            cache=None,
        )  # fmt: skip
        assert not VC.gain_decides(cfg, stats.gain, ref), ref
        assert verdict.outcome == VC.FAIL, (cfg.gain_staged, verdict)
        assert "2 other contributions of the round (borrowed)" in verdict.reason, verdict
        assert stats.gain.t < CFG.gain_t_hard
        # only B held (C's not fetched): nothing to borrow, the own reference's verdict as before
        _, verdict, _, _ = _screen(world, cfg, poisoner, own=world.wrong_data, held=("B",))
        assert verdict.outcome == VC.PASS and verdict.reason.startswith("inconclusive"), verdict
        assert "this checker's own contribution t" in verdict.reason, verdict


@pytest.mark.parametrize("H", [5, 20])
def test_an_honest_contribution_passes_whatever_the_screeners_own_reference(world, H):
    """The lent power only decides whether a low t counts: honest H = 5 and 20 pass at a screener whose own
    contribution shows no power, with the same statistic as at one whose own does."""
    vid = str(_fixed_identity("screener-V").peer_id)
    for cfg in (CFG, WHOLE):
        plain, _, _, _ = _screen(world, cfg, world.honest[H], H, own=world.honest_of(vid))
        stats, verdict, _, _ = _screen(world, cfg, world.honest[H], H, own=world.wrong_data)
        assert verdict.outcome == VC.PASS and not verdict.reason.startswith("inconclusive"), verdict
        assert stats.gain == plain.gain and stats.gain.t >= CFG.gain_t_min


def test_nothing_is_borrowed_for_a_contribution_under_the_tests_token_floor(world):
    """Red team 45: under ``gain_min_tokens`` a screen passes as inconclusive whatever the reference (the floor), yet
    a screener whose own reference had no power measured 2 borrowed ones for it, and so did one that sent nothing:
    2 references' batches more per screen of every small contribution with a low t (a swarm's first rounds: every t
    ~1; batch 4 x 32 makes 5 steps 640 tokens). Here the floor is raised over A's wrong-data update (10 steps of
    8 x 64, 5,120 tokens): the same batches drawn whether B's and C's contributions are held or not, and the same
    verdict."""
    for base in (CFG, WHOLE):
        cfg = dataclasses.replace(base, gain_min_tokens=8192)
        for own in (world.wrong_data, None):
            counts, verdicts = [], []
            for held in (("B", "C"), ("B",)):
                ds = Counting(world.ds)
                stats, verdict, task, _ = _screen(world, cfg, world.wrong_data, dataset=ds, own=own, held=held)
                assert VC._tokens(task) < cfg.gain_min_tokens and stats.gain.t < cfg.gain_t_min, stats.gain
                counts.append(ds.batches)
                verdicts.append(verdict)
            assert verdicts[0] == verdicts[1] and verdicts[0].outcome == VC.PASS, verdicts
            assert "under the test's floor" in verdicts[0].reason, verdicts[0]
            assert counts[0] == counts[1], (cfg.gain_staged, own is None, counts)
