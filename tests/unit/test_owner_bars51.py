"""The owner penalties a planned-out peer takes from its voters' records (session 51: ``PeerRecord.owner_bars``,
``Penalties.owner_bars`` / ``take_owner_bars``, the ``owners_known`` run): who votes, what a majority is, what is
announced and when, and the run through a checkpoint and a re-sync. Plain rule objects and records, no I/O."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from geomesh_p2p.node.training import record_state

from geomesh_p2p.round.rules import Penalties, RoundState
from geomesh_p2p.round.rules.penalties import OWNER_PENALTY_ROUNDS
from geomesh_p2p.schema.peer import MAX_OWNER_BARS, PeerRecord
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)
ME, A, B, C, X = ("Me" * 22, "Aa" * 22, "Bb" * 22, "Cc" * 22, "Xx" * 22)
NO = "No" * 22  # no leader candidate (on probation, benched)
R = 31  # planned out of round 30, re-synced to round 31's state (digest "d")


def _out() -> Penalties:
    """A peer that applied rounds 0-29, was planned out of 30 and holds round 31's state."""
    pen = Penalties(RoundState(me=ME, round=R, digest="d"))
    pen.applied = pen.owners_known = pen.own_known = (0, 29)
    pen.note_own_known(30)
    return pen


def _rec(peer: str, bars, round: int = R, digest: str = "d") -> PeerRecord:
    return peer_record(peer, round=round, weights_digest=digest, owner_bars=bars)


def test_a_majority_of_the_voters_at_its_round_and_state_gives_the_owner_penalties_and_closes_the_gap():
    pen = _out()
    assert pen.lead_gap(R) == "it applied rounds 0-29 only, not each of rounds 26-30 (owner penalties)"
    assert pen.owner_bars() is None  # it does not hold them: it names none, so it never votes
    held = {X: 35, ME: 33}  # X's part failed in round 30; the holders' bar on this peer is its own to know
    recs = [_rec(A, held), _rec(B, dict(held)), _rec(C, None)]
    why = pen.take_owner_bars(recs, [A, B, C, ME])
    assert why == (
        "2 of 3 voters (3 at this round and state) name the owner penalties in force (1 on others): taken for "
        "rounds 26-30"
    )
    assert (pen.owner, pen.owners_known, pen.noted) == ({X: 35}, (0, 30), {("owner", X): 30})
    assert pen.lead_gap(R) is None and pen.barred() == [X]
    assert pen.take_owner_bars(recs, [A, B, C]) is None  # held now: nothing taken again
    pen.note_applied(R)
    pen.state.round = R + 1
    assert pen.owner_bars() == {X: 35} and pen.lead_gap(R + 1) is None


@pytest.mark.parametrize(
    "recs",
    [
        [_rec(A, {X: 35}), _rec(B, {}), _rec(C, None)],  # one vote each: no majority
        [_rec(A, {X: 35}), _rec(B, {X: 35}), _rec(C, {}), _rec("Dd" * 22, None), _rec(ME, {X: 35})],  # 2 of 4
        [_rec(A, {X: 35}), _rec(B, {}), _rec(NO, {X: 35})],  # a record of no leader candidate is no vote
        [_rec(A, {X: 35}), _rec(B, {X: 35}, round=R - 1), _rec(C, None)],  # another round's record votes not
        [_rec(A, {X: 35}), _rec(B, {X: 35}, digest="e"), _rec(C, None)],  # another state's neither
        [_rec(A, None), _rec(B, None)],  # nobody names one (all joined together): the gap stays
    ],
    ids=["split", "half", "candidate", "round", "digest", "none"],
)
def test_no_majority_takes_nothing_and_the_gap_stays(recs):
    voters = [x.peer_id for x in recs if x.peer_id != NO]  # its own record is never a vote either
    pen = _out()
    assert pen.take_owner_bars(recs, voters) is None
    assert (pen.owner, pen.owners_known) == ({}, (0, 29)) and pen.lead_gap(R) is not None


def test_a_voted_map_keeps_to_the_penalties_a_round_of_the_span_gives():
    """Only bars that end in rounds R..R+4 (taken in 26-30) are taken: an expired one or one past any round's reach
    (a rogue majority's) is no penalty of the span; a longer one held here is kept."""
    pen = _out()
    pen.owner = {A: 36}
    recs = [_rec(B, {X: 30, C: 99, A: 34, "Ee" * 22: R}), _rec(C, {X: 30, C: 99, A: 34, "Ee" * 22: R})]
    assert pen.take_owner_bars(recs, [B, C]) is not None
    assert pen.owner == {A: 36, "Ee" * 22: R}


def test_what_a_holder_announces_is_the_span_before_its_round():
    pen = Penalties(RoundState(me=ME, round=R, digest="d"))
    pen.held_since(0)
    pen.owner = {A: R - 1, B: R, C: R + OWNER_PENALTY_ROUNDS - 1, ME: R + 2}
    assert pen.owner_bars() == {B: R, C: R + OWNER_PENALTY_ROUNDS - 1, ME: R + 2}
    # X concluded in round R itself (its exchange done, the record still at round R): X may have been renewed there
    # (its bar of the span gone from the map), so the record names none (red team 51a,
    # tests/unit/test_owner_bars_redteam51.py)
    pen.owner[X] = R + OWNER_PENALTY_ROUNDS
    assert pen.owner_bars() is None
    pen.owner = {f"{k:044d}": R for k in range(MAX_OWNER_BARS + 1)}
    assert pen.owner_bars() is None  # over what a record carries: no vote rather than a cut one


def test_the_run_through_a_checkpoint_and_a_resync():
    pen = _out()
    pen.take_owner_bars([_rec(A, {}), _rec(B, {})], [A, B])
    meta = pen.to_meta()
    assert (meta["applied"], meta["owners_known"]) == ([0, 29], [0, 30])
    back = Penalties(RoundState(me=ME, round=R))
    back.restore(meta)
    assert (back.applied, back.owners_known) == ((0, 29), (0, 30)) and back.lead_gap(R) is None
    older = Penalties(RoundState(me=ME, round=R))
    older.restore({k: v for k, v in meta.items() if k != "owners_known"})  # a file of session 50: the applied run
    assert older.owners_known == (0, 29)
    assert pen.forget_marks_since(28) == [] and (pen.applied, pen.owners_known) == ((0, 27), (0, 27))


def test_the_record_field_is_bounded_and_absent_when_none():
    rec = _rec(A, {X: 35})
    assert PeerRecord.from_bytes(rec.to_bytes()).owner_bars == {X: 35}
    assert b"owner_bars" not in _rec(A, None).to_bytes() and b'"owner_bars":{}' in _rec(A, {}).to_bytes()
    for bad in ({"": 3}, {"x" * 65: 3}, {X: -1}, {X: 1 << 41}, {f"{k}": 1 for k in range(MAX_OWNER_BARS + 1)}):
        with pytest.raises(ValidationError):
            _rec(A, bad)


def test_the_record_names_the_map_only_while_in_sync_and_holding():
    """``node.training.record_state``: a holder in sync names its map ({} when none); syncing, or not holding (planned
    out of round 30), it names none, so its record is no vote."""
    held = Penalties(RoundState(me=ME, round=R, digest="d"))
    held.held_since(0)
    held.owner = {X: 33}
    for pen, syncing, want in ((held, False, {X: 33}), (held, True, None), (_out(), False, None)):
        node = SimpleNamespace(resync=SimpleNamespace(syncing=syncing), round=R, digest="d", penalties=pen)
        assert record_state(node)["owner_bars"] == want
    held.owner = {}
    node = SimpleNamespace(resync=SimpleNamespace(syncing=False), round=R, digest="d", penalties=held)
    assert record_state(node)["owner_bars"] == {}
