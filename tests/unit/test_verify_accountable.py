"""Verified work in accountable mode (issues 26 and 28; geomesh_p2p/trust/verify_commit.py, verify_held.py): each
participant holds its own contributions and, of the others, only what the owner-signed part results commit to
(tokens, SHA-256[:16]); the screens and checks are drawn from those commitments, the accused's contribution to the
parts checked (every part for a screen, at most CHECK_PARTS for a sampled check) is fetched, refused unless it is the
committed one, and the check runs unchanged.

The world is tests/verify_util.py's (real tiny model, KJV corpus, batch 8 x 64, 4 parts), its round under test
round 2 (every contributor is a newcomer there, so every one is screened). The fetch over gRPC:
tests/integration/test_verify_accountable_fetch.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import types

import pytest

from geomesh_p2p.trust import evidence as EV
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.verify_commit import (
    Committed,
    ContributionRefused,
    commitment_seed,
    narrow,
    verified_packet,
)
from geomesh_p2p.trust.verify_screen import Prepared
from tests.verify_util import ROUND, RUN, FakeDHT, _fixed_identity, _packets, _plan, _signed, _verifier, world_fixture

# one intra-op thread (conftest's one_thread) for the screens too, not only the world's training: under make test's
# load (3 workers on 2 cores) spin-waiting OpenMP threads made each screen's CPU steps many times slower
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

world = pytest.fixture(scope="module", name="world")(world_fixture)

#: no sampled checks (share 0): what runs is the screening alone
CFG = VT.VerifyConfig(share=0.0)


#: Before session 31 an accountable screen covered CHECK_PARTS of A's 4 parts, drawn from the round's commitments,
#: and the pair decided whether the loss-gain test had power: in this world a screener's own contribution reached
#: t 4.4-6.7 on every pair with part 0 or 1, only t 2.3 on parts (2, 3), where a wrong-data A passed as inconclusive.
#: A screen now covers the whole contribution (tests/unit/test_screen_coverage.py: the honest side of the same cut).
ALL_PARTS = (0, 1, 2, 3)


def _nonce(sender: str, part: int) -> bytes:
    return hashlib.sha256(f"{sender}/{part}/0".encode()).digest()[:16]


def _case(world, contribution, H, names=("V", "W")):
    """Round 2 in accountable mode with screeners ``names`` that contributed honestly too: the relay packets
    (what only the part owners received now), every contribution signed by its sender, and the commitments every
    participant holds (sender -> part -> Committed: tokens capped by the plan, SHA-256[:16] of the signed bytes).

    Every contribution is signed with a fixed nonce (:func:`~tests.verify_util._signed`): a fresh random one made
    the commitments, so the screen seed (and the steps a screen draws), differ on every run."""
    ids = {n: _fixed_identity(f"screener-{n}") for n in names}
    plan = _plan(world, ids)
    packets = _packets(
        world, contribution, H, extra={str(i.peer_id): world.honest_of(str(i.peer_id)) for i in ids.values()}
    )
    everyone = {**{str(i.peer_id): i for i in world.ids.values()}, **{str(i.peer_id): i for i in ids.values()}}
    budget = {x.peer_id: x.token_budget for x in plan.assignments}
    signed = {
        p: {j: _signed(everyone[p], pk, j, *world.part_ranges[j], nonce=_nonce(p, j)) for j, pk in parts_of.items()}
        for p, parts_of in packets.items()
    }
    committed = {
        p: {
            j: Committed(min(pk.tokens, budget[p]), hashlib.sha256(signed[p][j]).digest()[:16])
            for j, pk in parts_of.items()
        }
        for p, parts_of in packets.items()
    }
    return types.SimpleNamespace(ids=ids, plan=plan, packets=packets, signed=signed, committed=committed)


def _accountable_verifier(world, case, name, cfg=CFG, before=None):
    """A participant of the accountable round: it holds its own packets and the commitments; then it fetches (here:
    takes from ``case.signed``, as a holder serves them) what its screens and check want, each checked against its
    commitment, and holds it. ``before(wv)``: called on the new verifier before it keeps the round (e.g. to give it
    verdicts). Returns the verifier and what it fetched ((accused, part) pairs)."""
    ident = case.ids.get(name) or world.ids[name]
    me = str(ident.peer_id)
    wv = _verifier(world, ident, cfg, case.plan, {me: case.packets[me]})
    if before is not None:
        before(wv)
    wv.keep_round(
        ROUND,
        theta=world.theta,
        plan=case.plan,
        part_ranges=world.part_ranges,
        packets={me: case.packets[me]},
        committed=case.committed,
    )
    fetched = []
    for accused, parts in wv.accountable_wants(ROUND).items():
        held = {}
        for j in parts:
            held[j] = verified_packet(
                case.signed[accused][j],
                case.committed[accused][j],
                run_id=RUN,
                accused=accused,
                round=ROUND,
                part=j,
                part_range=world.part_ranges[j],
            )
            fetched.append((accused, j))
        assert wv.hold(ROUND, accused, held)
    return wv, fetched


def _signed_of(case):
    return lambda part, sender: case.signed.get(sender, {}).get(part)


def test_in_accountable_mode_a_wrong_data_newcomer_fails_its_screen_and_is_excluded_by_every_screener(world):
    case = _case(world, world.wrong_data, 10)
    a, b, c = world.pid["A"], world.pid["B"], world.pid["C"]
    v_id, w_id = str(case.ids["V"].peer_id), str(case.ids["W"].peer_id)
    dht = FakeDHT()
    v, v_fetched = _accountable_verifier(world, case, "V")
    w, w_fetched = _accountable_verifier(world, case, "W")
    v.dht = w.dht = dht
    try:
        # each screen covers the whole contribution (session 31): every part of the 4 others is fetched (V holds
        # its own only), nothing else
        assert len(v_fetched) == 4 * len(ALL_PARTS) and {p for p, _ in v_fetched} == {a, b, c, w_id}
        assert {p for p, _ in w_fetched} == {a, b, c, v_id}
        assert sorted(j for p, j in v_fetched if p == a) == sorted(j for p, j in w_fetched if p == a) == [*ALL_PARTS]
        assert v.queue_screens(ROUND, signed_of=_signed_of(case)) == 4
        assert v.queue.wait_idle(240)
        [ev] = asyncio.run(v.tend(ROUND))
        assert (ev.task.kind, ev.accused, ev.outcome) == (VT.SCREEN, a, VC.FAIL)
        assert ev.task.parts == ALL_PARTS and set(ev.contributions) == set(ev.task.parts)
        assert "no loss gain on its own batches" in ev.reason
        t_a = v.screen_results[(ROUND, a)][0].gain
        assert t_a is not None and t_a.t < CFG.gain_t_hard
        for p in (b, c, w_id):  # the honest newcomers of the same round pass
            assert v.screen_results[(ROUND, p)][1].outcome == VC.PASS and p not in v.excluded
        assert a in v.excluded and a in v.lone
        assert list(dht.data[EV.screen_evidence_key(RUN, ROUND, a)]) == [v_id]

        assert w.queue_screens(ROUND, signed_of=_signed_of(case)) == 4
        assert w.queue.wait_idle(240)
        [ev_w] = asyncio.run(w.tend(ROUND))
        assert w.screen_results[(ROUND, a)][0].gain == t_a  # the same screen, to the bit
        assert ev_w.task == dataclasses.replace(ev.task, verifier=w_id)
        assert a in w.excluded and a not in w.lone  # W's own measurement and V's evidence agree
        asyncio.run(v.tend(ROUND))
        assert a in v.excluded and a not in v.lone
        for x in (v, w):
            assert [m.peer_id for m in x.filter([types.SimpleNamespace(peer_id=p) for p in (a, b, c)])] == [b, c]
    finally:
        v.close()
        w.close()


def test_in_accountable_mode_a_non_screener_re_checks_with_the_contributions_the_evidence_carries(world):
    cfg = dataclasses.replace(CFG, screeners=1)
    case = _case(world, world.wrong_data, 10)
    a = world.pid["A"]
    seed = commitment_seed(RUN, case.plan, case.committed)
    [screener] = VT.screeners_of(seed, a, [x.peer_id for x in case.plan.assignments], 1)
    names = {str(i.peer_id): n for n, i in [*case.ids.items(), *((n, world.ids[n]) for n in ("B", "C"))]}
    observer = next(n for p, n in names.items() if p != screener)
    s, _ = _accountable_verifier(world, case, names[screener], cfg)
    o, _ = _accountable_verifier(world, case, observer, cfg)
    dht = FakeDHT()
    s.dht = o.dht = dht
    try:
        assert s.queue_screens(ROUND, signed_of=_signed_of(case)) >= 1
        assert s.queue.wait_idle(240)
        assert [e.accused for e in asyncio.run(s.tend(ROUND))] == [a]
        # the observer holds none of A's contributions: its re-check takes them from the evidence, each checked
        # against its own commitment, and runs the same screen
        assert not [j for j, x in o._packets(ROUND, o._kept[ROUND])[a].items() if not isinstance(x, Committed)]
        assert asyncio.run(o.tend(ROUND)) == []
        assert o.queue.wait_idle(240)
        asyncio.run(o.tend(ROUND))
        assert o.queue.counts.by_kind == {"rescreen": 1}
        assert o.screen_results[(ROUND, a)][0].gain == s.screen_results[(ROUND, a)][0].gain
        assert a in o.excluded and a not in o.lone
    finally:
        s.close()
        o.close()


def test_in_accountable_mode_an_honest_newcomer_passes_its_screen(world):
    case = _case(world, world.honest[5], 5)
    v, fetched = _accountable_verifier(world, case, "V")
    try:
        assert v.queue_screens(ROUND, signed_of=_signed_of(case)) == 4
        assert v.queue.wait_idle(240)
        assert asyncio.run(v.tend(ROUND)) == []  # nothing failed: nothing published
        stats, verdict = v.screen_results[(ROUND, world.pid["A"])]
        assert verdict.outcome == VC.PASS and stats.gain is not None and stats.gain.t >= CFG.gain_t_min, verdict
        assert not v.excluded and not v.lone
    finally:
        v.close()


def test_in_accountable_mode_the_contributions_of_sampled_screens_are_fetched_and_the_screens_run(world):
    """Session 31 (100 honest rounds, 4 peers): each of the 8 sampled screens of established contributors drawn was
    "not run: its contribution is not held here": the fetch asked only for the newcomers' screens (the sampled ones
    are drawn when the screens are queued, after the fetch). Now it fetches theirs too."""
    cfg = dataclasses.replace(CFG, screen_rounds=0, sample_share=10.0)  # round 2: nobody new; every one sampled
    case = _case(world, world.honest[10], 10)
    me = str(case.ids["V"].peer_id)
    v, fetched = _accountable_verifier(world, case, "V", cfg)
    try:
        kept = v._kept[ROUND]
        packets = v._packets(ROUND, kept)
        seed = v._seed_of(ROUND, kept, packets)
        assert VT.sample_probability(cfg, case.plan, packets) == 1.0
        # nobody new: what is screened is what the seed drew (recorded by the fetch, Screening.screen_targets)
        assert kept.screened == VT.sampled_candidates(cfg, case.plan, packets, seed)
        everyone = [x.peer_id for x in case.plan.assignments]
        mine = [
            x
            for x in VT.sampled_candidates(cfg, case.plan, packets, seed)
            if x != me and me in VT.screeners_of(seed, x, everyone, cfg.sample_screeners)
        ]
        assert len(mine) >= 1  # V is one of the 2 screeners of these
        assert sorted(fetched) == sorted((x, j) for x in mine for j in ALL_PARTS)  # their whole contributions
        assert v.queue_screens(ROUND, signed_of=_signed_of(case)) == len(mine)
        assert v.queue.wait_idle(240)
        assert asyncio.run(v.tend(ROUND)) == []
        for x in mine:  # honest, measured on the whole contribution: a pass with a t, not "not held here"
            stats, verdict = v.screen_results[(ROUND, x)]
            assert verdict.outcome == VC.PASS and stats.gain is not None and stats.gain.t >= cfg.gain_t_min, verdict
    finally:
        v.close()


def test_the_accountable_screen_seed_is_the_same_at_every_participant_and_follows_every_commitment(world):
    case = _case(world, world.honest[10], 10)
    seed = commitment_seed(RUN, case.plan, case.committed)
    v, _ = _accountable_verifier(world, case, "V")
    w, _ = _accountable_verifier(world, case, "W")
    try:
        # each participant holds other packets (its own, what it fetched; here V's fetch of one of B's parts failed),
        # the same commitments: the same seed
        kv, kw = v._kept[ROUND], w._kept[ROUND]
        del kv.packets[world.pid["B"]][1]
        assert {p: set(x) for p, x in kv.packets.items()} != {p: set(x) for p, x in kw.packets.items()}
        assert v._seed_of(ROUND, kv, v._packets(ROUND, kv)) == w._seed_of(ROUND, kw, w._packets(ROUND, kw)) == seed
        a = world.pid["A"]
        tv = VT.derive_screen(CFG, plan=case.plan, verifier=str(case.ids["V"].peer_id), accused=a, seed=seed,
                              packets=v._packets(ROUND, kv), part_ranges=world.part_ranges)  # fmt: skip
        tw = VT.derive_screen(CFG, plan=case.plan, verifier=str(case.ids["W"].peer_id), accused=a, seed=seed,
                              packets=w._packets(ROUND, kw), part_ranges=world.part_ranges)  # fmt: skip
        assert tv is not None and dataclasses.replace(tv, verifier="") == dataclasses.replace(tw, verifier="")
        # the same participants and tokens as relay mode's draw (the stand-ins carry what the draw reads)
        assert VT.screen_candidates(CFG, case.plan, v._packets(ROUND, kv)) == VT.screen_candidates(
            CFG, case.plan, case.packets
        )
        # any one committed contribution moves the seed (nobody knew them all while it trained)
        b = world.pid["B"]
        other = {p: dict(parts) for p, parts in case.committed.items()}
        other[b][1] = Committed(other[b][1].tokens, bytes(16))
        assert commitment_seed(RUN, case.plan, other) != seed
        assert commitment_seed(RUN, case.plan.model_copy(update={"start_digest": "x"}), case.committed) != seed
    finally:
        v.close()
        w.close()


def test_a_fetched_contribution_that_is_not_the_committed_one_is_refused_with_a_reason(world):
    case = _case(world, world.honest[10], 10, names=("V",))
    a, b = world.pid["A"], world.pid["B"]
    j = 1
    kw = dict(run_id=RUN, accused=a, round=ROUND, part=j, part_range=world.part_ranges[j])
    good = verified_packet(case.signed[a][j], case.committed[a][j], **kw)
    assert good.to_bytes() == case.packets[a][j].to_bytes()  # the committed bytes: its packet, bit for bit
    # A signs another packet for the same part: a valid signature, not the bytes the owner's result commits to
    forged = _signed(world.ids["A"], case.packets[a][0], j, *world.part_ranges[j])
    with pytest.raises(ContributionRefused, match="does not match the hash its owner's result commits to"):
        verified_packet(forged, case.committed[a][j], **kw)
    # B's committed contribution offered as A's: the hash matches B's commitment, not A's signature
    with pytest.raises(ContributionRefused, match=f"not signed by {a[:10]}"):
        verified_packet(case.signed[b][j], case.committed[b][j], **kw)
    # A's contribution to part 0 offered for part 1 under its own commitment
    with pytest.raises(ContributionRefused, match="not the accused's to part 1"):
        verified_packet(case.signed[a][0], case.committed[a][0], **kw)
    # a byte flipped inside the signed message (its hash committed as if it were real): the signature refuses it
    bad = bytearray(case.signed[a][j])
    bad[-40] ^= 1
    with pytest.raises(ContributionRefused, match="signature|malformed"):
        verified_packet(bytes(bad), Committed(1, hashlib.sha256(bytes(bad)).digest()[:16]), **kw)
    # a check whose contribution is not held is not run (never on the stand-in): nothing queued, nobody excluded
    v = _verifier(world, case.ids["V"], CFG, case.plan, {})
    me = str(case.ids["V"].peer_id)
    v.keep_round(ROUND, theta=world.theta, plan=case.plan, part_ranges=world.part_ranges,
                 packets={me: case.packets[me]}, committed=case.committed)  # fmt: skip
    try:
        assert v.accountable_wants(ROUND)  # it wants some
        assert v.queue_screens(ROUND) == 0 and not v.excluded
    finally:
        v.close()


def test_a_newcomer_excluded_here_on_more_than_this_peers_own_measurement_is_neither_fetched_nor_screened(world):
    """Session 30: the backdoor runs re-screened an excluded poisoner's rounds 3-4 up to round 11, on the budget the
    honest newcomers' screens wait for. A verdict confirmed here (or a proof) settles the accused: its later screens
    are not fetched, not queued, and a queued one is not run; a verdict held alone (``lone``) still screens it."""
    case = _case(world, world.honest[5], 5)
    a = world.pid["A"]

    def verdicts(excluded: bool, lone: bool):
        def give(wv) -> None:
            if excluded:
                wv.excluded[a] = "round 2: no loss gain on its own batches (checked by another verifier)"
            if lone:
                wv.lone.add(a)

        return give

    (settled, got_s), (alone, got_a), (none, got_n) = (
        _accountable_verifier(world, case, "V", before=verdicts(x, lone)) for x, lone in ((1, 0), (1, 1), (0, 0))
    )
    me = str(case.ids["V"].peer_id)
    try:
        assert settled.settled(a) and not alone.settled(a) and not none.settled(a)
        assert [j for p, j in got_s if p == a] == []  # not fetched
        assert len([j for p, j in got_a if p == a]) == len(ALL_PARTS) == len([j for p, j in got_n if p == a])
        assert settled.queue_screens(ROUND, signed_of=_signed_of(case)) == 3  # B, C and W; not A
        assert alone.queue_screens(ROUND, signed_of=_signed_of(case)) == 4
        assert settled.queue.wait_idle(240) and alone.queue.wait_idle(240)
        assert (ROUND, a) not in settled.screen_results and (ROUND, a) in alone.screen_results
        # a screen queued before the verdict was confirmed here is not run once it is (the job checks first)
        assert none.queue_screens(ROUND, signed_of=_signed_of(case)) == 4
        assert none.queue.wait_idle(240) and (ROUND, a) in none.screen_results
        none.screen_results.clear()
        none.excluded[a] = "a proof"
        kept = none._kept[ROUND]
        packets = none._packets(ROUND, kept)
        task = VT.derive_screen(
            CFG,
            plan=case.plan,
            verifier=me,
            accused=a,
            seed=none._seed_of(ROUND, kept, packets),
            packets=packets,
            part_ranges=world.part_ranges,
        )
        prep = Prepared(ROUND, kept, narrow(task), {})
        assert none._measure_screen(prep) is None and (ROUND, a) not in none.screen_results
    finally:
        settled.close()
        alone.close()
        none.close()
