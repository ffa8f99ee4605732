"""The state a status view gives a peer's record (geomesh_p2p.status.swarm._state): a fresh user saw peers that had
exited listed as "leaving" until their last record expired (up to four rounds)."""

from __future__ import annotations

import pytest

from geomesh_p2p.status.swarm import _state
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)


def test_a_peer_that_announced_leaving_in_an_earlier_round_is_shown_as_left():
    rec = peer_record("p1", address="p1:1", round=7, weights_digest="d" * 16)
    assert _state(rec, {"p1"}, 7) == "training"
    gone = rec.model_copy(update={"leaving": True})
    assert _state(gone, {"p1"}, 7) == "leaving"  # announced in the swarm's round: still finishing it
    assert _state(gone, {"p1"}, 8) == "left"  # the swarm moved on: its last record, kept until it expires
    assert _state(gone, None, None) == "leaving"  # no round known: nothing to compare
    assert _state(rec.model_copy(update={"weights_digest": None}), {"p1"}, 7) == "syncing"
    assert _state(rec.model_copy(update={"round": 5}), {"p1"}, 7) == "behind"
    assert _state(rec, {"p2"}, 7) == "waiting"
