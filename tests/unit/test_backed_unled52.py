"""A peer's word on its own leader mark counts for a follower without the history only where its voters back it
(session 52, red team 50b: ``PeerRecord.unled_marks``, ``Penalties.unled_marks`` / ``backed_unled``). Exact sets:
who backs, what a majority is, what a holder announces and when. Plain rule objects and records, no I/O."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from geomesh_p2p.node.training import record_state
from geomesh_p2p.round.rules import Penalties, RoundState
from geomesh_p2p.schema.peer import MAX_UNLED_MARKS, PeerRecord
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)
ME, A, B, D, X = ("Me" * 22, "Aa" * 22, "Bb" * 22, "Dd" * 22, "Xx" * 22)
R = 40


def _joiner() -> Penalties:
    """A peer that joined at round R: it holds no mark."""
    return Penalties(RoundState(me=ME, round=R, digest="d"))


def _holder() -> Penalties:
    """A peer that applied rounds 0..R-1: it holds every mark of round R."""
    pen = Penalties(RoundState(me=ME, round=R, digest="d"))
    pen.held_since(0)
    return pen


def _rec(peer: str, round: int = R, until: int | None = None, marks: dict | None = None) -> PeerRecord:
    return peer_record(peer, round=round, weights_digest="d", unled_until=until, unled_marks=marks)


def test_a_claim_is_taken_where_more_than_half_of_all_voters_back_it():
    pen = _joiner()
    claim = _rec(X, until=R + 3)
    voters = [A, B, X, ME]  # this peer is left out: 3 voters
    assert pen.announced_unled([claim, _rec(A), _rec(B)]) == {X}  # the word itself, as session 50 read it
    assert pen.backed_unled([claim, _rec(A), _rec(B)], voters) == set()  # 1 of 3: its own word only (red team 50b)
    assert pen.backed_unled([claim, _rec(A, marks={X: R + 3}), _rec(B)], voters) == {X}  # 2 of 3
    assert pen.backed_unled([claim, _rec(A, marks={X: R}), _rec(B, marks={X: R + 9})], voters) == {X}  # 3 of 3
    # every voter counts: one without a record (D) makes 2 of 4, not a majority
    assert pen.backed_unled([claim, _rec(A, marks={X: R + 3}), _rec(B)], voters + [D]) == set()


def test_votes_that_do_not_count():
    pen = _joiner()
    claim = _rec(X, until=R + 3)
    voters = [A, B, X]
    assert pen.backed_unled([claim, _rec(A, round=R - 1, marks={X: R + 3}), _rec(B)], voters) == set()  # old round
    assert pen.backed_unled([claim, _rec(A, marks={X: R - 1}), _rec(B)], voters) == set()  # the mark ended
    assert pen.backed_unled([claim, _rec(A, marks={B: R + 3}), _rec(B)], voters) == set()  # names another peer
    assert pen.backed_unled([_rec(X, round=R - 1, until=R + 3), _rec(A, marks={X: R + 3}), _rec(B)], voters) == set()
    # a voter's word that is not among the voters (not established here): 1 of 3
    assert pen.backed_unled([claim, _rec(A), _rec(B), _rec(D, marks={X: R + 3})], voters) == set()


def test_a_majority_bars_only_a_peer_that_claims_its_own_mark_and_a_holder_takes_no_word():
    pen = _joiner()
    # A, B and X name a mark on B, which B does not announce: the others' word alone bars nobody
    recs = [_rec(A, marks={B: R + 3}), _rec(B), _rec(X, marks={B: R + 3})]
    assert pen.backed_unled(recs, [A, B, X]) == set()
    backed = [_rec(X, until=R + 3), _rec(A, marks={X: R + 3}), _rec(B, marks={X: R + 3})]
    assert pen.backed_unled(backed, [A, B, X]) == {X}
    assert _holder().backed_unled(backed, [A, B, X]) == set()  # it goes by the marks it holds


def test_a_holder_announces_its_marks_on_the_others_while_it_holds_them_and_has_not_concluded_its_round():
    pen = _holder()
    assert pen.unled_marks() is None  # none held: the field stays absent
    pen.noshow = {X: R + 2, ME: R + 5}
    pen.late = {X: (R + 10, 100.0), A: (R + 1, 50.0), B: (R - 1, 50.0)}  # B's mark ended at round R - 1
    assert pen.unled_marks() == {X: R + 10, A: R + 1}  # the later end of bench and late mark; its own left out
    assert pen.own_unled_until() == R + 5
    pen.note_applied(R)  # its exchange of round R done, the record still at round R until the commit
    assert pen.unled_marks() is None
    assert _joiner().unled_marks() is None  # holds no mark: no vote
    many = _holder()
    many.late = {f"P{i:03d}" * 11: (R + 3, 1.0) for i in range(MAX_UNLED_MARKS + 1)}
    assert many.unled_marks() is None  # more than a record carries: no vote
    del many.late["P000" * 11]
    assert len(many.unled_marks()) == MAX_UNLED_MARKS


def test_the_record_names_the_marks_only_in_sync_and_the_schema_bounds_them():
    pen = _holder()
    pen.late = {X: (R + 3, 1.0)}
    for syncing, want in ((False, {X: R + 3}), (True, None)):
        node = SimpleNamespace(resync=SimpleNamespace(syncing=syncing), round=R, digest="d", penalties=pen)
        assert record_state(node)["unled_marks"] == want
    rec = _rec(A, marks={X: R + 3})
    assert PeerRecord.from_bytes(rec.to_bytes()).unled_marks == {X: R + 3}
    assert b"unled_marks" not in _rec(A).to_bytes()  # absent when None: the record of the release before
    for bad in ({"": 3}, {X: -1}, {X: (1 << 40) + 1}, {f"P{i:03d}" * 11: 3 for i in range(MAX_UNLED_MARKS + 1)}):
        with pytest.raises(ValidationError, match="unled_marks: at most 64 entries"):
            _rec(A, marks=bad)
