"""The red team's ``drop-owner`` (tests/adversary.py, issue 26, session 26) in accountable mode, in-process gRPC on
127.0.0.1: an owner that receipts every push, then leaves receipted contributions out of its result with a
consistent commitment (its input list and aggregate both lack them), so a validator's recomputation matches and
only the dropped sender's receipt proves it. Checked: each dropped sender holds a drop proof that verifies from its
bytes, the validators find nothing, every honest peer excludes the owner once the proof is in the DHT (the owner
itself excludes nobody), and no honest peer is excluded anywhere.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.exchange import CollectiveService, accountable
from geomesh_p2p.trust import fraud

from tests.adversary import drop_contributions
from tests.integration.test_collective_accountable import NUMEL, _accountability, _round, _settle, _validate_all
from tests.integration.test_collective_robust import ROBUST, _honest_deltas
from tests.collective_util import RUN
from tests.unit.test_evidence_chunks import LimitedDHT

pytestmark = pytest.mark.timeout(120)


def _drop_owner(k: int) -> type:
    class _DropOwner(CollectiveService):
        """As an owner, the adversary's cut: the first ``k`` other senders (0: all) out of inputs and aggregate."""

        def _build_result(self, spec, part, contributions):
            kept, _ = drop_contributions(contributions, self.peer_id, k)
            part.inputs = [c.signed for c in kept]  # the commitment follows: validators see a rule-exact result
            part.input_senders = [c.sender for c in kept]
            return super()._build_result(spec, part, kept)

    return _DropOwner


def test_drop_contributions_cuts_the_first_other_senders_and_keeps_the_owners_own():
    cs = [SimpleNamespace(sender=s) for s in ("a", "me", "b", "c")]
    kept, gone = drop_contributions(cs, "me", 1)
    assert [c.sender for c in kept] == ["me", "b", "c"] and gone == ["a"]
    kept, gone = drop_contributions(cs, "me", 2)
    assert [c.sender for c in kept] == ["me", "c"] and gone == ["a", "b"]
    kept, gone = drop_contributions(cs, "me", 0)
    assert [c.sender for c in kept] == ["me"] and gone == ["a", "b", "c"]
    assert drop_contributions(cs[1:2], "me", 1) == (cs[1:2], [])


@pytest.mark.parametrize("k", [1, 0])
async def test_a_dropping_owner_is_proven_by_its_victims_and_excluded_by_every_honest_peer(swarms, k):
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_drop_owner(k)], validators=3, seed=11)
    evil = sw.pids[3]
    parts = spec.part_index_of(evil)
    assert parts and all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # one set of bytes everywhere
    # the victims (the first other sender in the owner's order, or all 3 honest peers) hold a verified drop proof
    holders = [i for i, r in enumerate(res) if r.proofs]
    assert len(holders) == (1 if k == 1 else 3) and 3 not in holders
    for i in holders:
        v = accountable.verify_proof(RUN, res[i].proofs[0])  # from the bytes alone, as any third peer
        assert (v.kind, v.accused, v.round, v.part) == ("drop", evil, spec.round, parts[0])
        assert "not in the result" in v.reason
    # its commitment is consistent: every other peer validating its part recomputes the same bytes, no proof
    assert await _validate_all(sw, spec, parts=parts) == []
    # after the round: the victims publish, every peer reads and re-checks (the forger test's sequence)
    accs = await _settle(sw, spec, res, LimitedDHT())
    assert sum(acc.published for acc, _ in accs) == len(holders)
    for i in range(3):
        verdicts = accs[i][1]
        assert set(verdicts.excluded) == {evil} and evil not in verdicts.lone
        assert "owner drop proven" in verdicts.excluded[evil]
        assert verdicts.plan_problem(SimpleNamespace(participants=lambda: sw.pids, leader=evil, round=spec.round + 3))
    assert accs[3][1].excluded == {}  # the accused's own verdicts: nobody (an honest peer is never excluded)


class _VictimDropper(CollectiveService):
    """As an owner, leaves ``victim``'s receipted contribution out (inputs and aggregate): colluding droppers that
    all pick one victim, so that victim alone holds every proof."""

    victim = ""

    def _build_result(self, spec, part, contributions):
        kept = [c for c in contributions if c.sender != type(self).victim]
        part.inputs, part.input_senders = [c.signed for c in kept], [c.sender for c in kept]
        return super()._build_result(spec, part, kept)


async def test_two_owners_dropping_one_victim_are_both_excluded_from_its_first_publication(swarms):
    """Before session 26 an accuser published one proof a round: k owners that all dropped one victim were out only
    after k rounds. Now its first record bundles one proof per owner, and every honest peer excludes both."""
    sw = await swarms(5, service_cls=[CollectiveService] * 3 + [_VictimDropper] * 2)
    _VictimDropper.victim = sw.pids[0]
    deltas = _honest_deltas(sw.pids, NUMEL, seed=12)
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=3.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    evil = set(sw.pids[3:])
    assert {accountable.verify_proof(RUN, p).accused for p in res[0].proofs} == evil
    assert all(r.proofs == [] for r in res[1:])
    accs = await _settle(sw, spec, res, LimitedDHT())
    assert accs[0][0].published == 2 and accs[0][0].pending == []  # both in this round's one record
    for i in range(3):
        assert set(accs[i][1].excluded) == evil, i
        assert all("owner drop proven" in accs[i][1].excluded[e] for e in evil)
    assert all(set(accs[i][1].excluded) == evil - {sw.pids[i]} for i in (3, 4))  # never an honest peer


def test_a_bundle_round_trips_and_a_broken_one_is_refused():
    assert fraud.unbundle(fraud.bundle([b"\x0aone"])) == [b"\x0aone"]  # one proof: the plain form
    assert fraud.unbundle(fraud.bundle([b"a", b"bc", b"def"])) == [b"a", b"bc", b"def"]
    whole = fraud.bundle([b"a", b"bc"])
    for bad in (whole[:-1], whole + b"\x01", b"gmpb/1\0" + bytes(4) + b"x"):
        with pytest.raises(ValueError):
            fraud.unbundle(bad)
    with pytest.raises(ValueError):
        fraud.bundle([])
    with pytest.raises(ValueError):
        fraud.unbundle(b"gmpb/1\0" + b"".join((1).to_bytes(4, "little") + b"x" for _ in range(17)))
    assert fraud.accused_of(b"junk") == ""


async def test_a_peer_sitting_rounds_out_still_reads_the_proofs_and_excludes_the_owner(swarms):
    """Session 26, 16 peers: an honest peer planned out for 7 rounds never read a proof (only an applied round read
    them), then followed an excluded forger's plan. A peer that sits a round out now reads them all the same."""
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_drop_owner(1)], seed=13)
    dht = LimitedDHT()
    await _settle(sw, spec, res, dht, read=False)
    plan = SimpleNamespace(mode="accountable")
    # an honest peer that took no part in the round (its own Accountability, nothing applied, nothing validated)
    out, verdicts = _accountability(sw, 0, dht)
    out.read_in_background(spec.round + 1, SimpleNamespace(mode="reencode"))  # not accountable: nothing read
    assert out.task is None
    out.read_in_background(spec.round + 1, plan)
    await out.task
    assert set(verdicts.excluded) == {sw.pids[3]} and "owner drop proven" in verdicts.excluded[sw.pids[3]]
    assert out.published == 0 and out.counts() is None  # it read; it published and validated nothing


def test_a_plan_the_proven_owner_leads_is_followed_within_the_grace_then_refused():
    """Session 26, 8 peers: the drop's victim holds its proof a round before the others; refusing the dropper's
    round-1 plan at once, it split that round from the honest peers that followed it. The grace holds for leaders."""
    from geomesh_p2p.trust.verify import Verdicts

    v = Verdicts("me")
    v.exclude_proven("evil", "owner drop proven (round 0, part 1): gone", 0)
    led = lambda r: SimpleNamespace(participants=lambda: ["me", "evil", "h"], leader="evil", round=r)  # noqa: E731
    assert v.plan_problem(led(1)) is None and v.plan_problem(led(2)) is None
    assert "excluded by a proof" in v.plan_problem(led(3))
    named = SimpleNamespace(participants=lambda: ["me", "evil"], leader="me", round=3)
    assert "evil" in v.plan_problem(named)


async def test_a_proof_held_by_a_peer_that_sits_rounds_out_is_still_published(swarms):
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_drop_owner(1)], seed=14)
    dht = LimitedDHT()
    holder = next(i for i, r in enumerate(res) if r.proofs)
    acc, _ = _accountability(sw, holder, dht)
    acc.pending.extend(res[holder].proofs)  # found in its last round, not published yet (then planned out)
    acc.read_in_background(spec.round + 1, SimpleNamespace(mode="accountable"))
    await acc.task
    assert acc.published == 1 and acc.pending == [] and list(dht.data) == [fraud.proofs_key(RUN, spec.round + 1)]
    other, verdicts = _accountability(sw, (holder + 1) % 3, dht)
    await other.read(spec.round + 1)
    assert set(verdicts.excluded) == {sw.pids[3]}
