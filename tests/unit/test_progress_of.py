"""geomesh_p2p.dht.progress.progress_of: the round and run-config hash a bootstrap remembers for its run
(review: one record of another config, the newest round in view, made the bootstrap remember that config,
and every peer of the run's own config then failed at once in PeerNode._on_empty_swarm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.dht.progress import SwarmProgress, progress_of

pytestmark = pytest.mark.timeout(10)


def _rec(round: int, config_hash: str, leaving: bool = False):
    return SimpleNamespace(round=round, run_config_hash=config_hash, leaving=leaving)


def test_one_record_of_another_config_names_neither_the_config_nor_the_round():
    recs = [_rec(7, "run"), _rec(7, "run"), _rec(6, "run", leaving=True), _rec(10**9, "other")]
    assert progress_of(recs, "boot", 12.5) == SwarmProgress(7, 12.5, 3, "boot", "run")


def test_the_run_alone_and_a_tie_go_to_the_later_round():
    assert progress_of([_rec(4, "a", leaving=True)], "b", 1.0) == SwarmProgress(4, 1.0, 1, "b", "a")
    assert progress_of([_rec(3, "a"), _rec(5, "b")], "b", 1.0) == SwarmProgress(5, 1.0, 1, "b", "b")
    assert progress_of([_rec(2, ""), _rec(2, "")], "b", 1.0) == SwarmProgress(2, 1.0, 2, "b", "")
    assert progress_of([], "b", 1.0) is None


def test_one_identity_of_the_runs_config_at_round_1e9_does_not_name_the_round():
    """Red team (session 13): a fresh identity copying the run's config hash and announcing round 10^9 (live,
    then leaving) was the bootstrap's published round. The round is now the one more than half of the
    config's live records reached (the leaving records' when none is live)."""
    live = [_rec(2, "run"), _rec(2, "run"), _rec(3, "run")]
    assert progress_of(live + [_rec(10**9, "run")], "b", 1.0).round == 2
    assert progress_of(live + [_rec(10**9, "run", leaving=True)], "b", 1.0).round == 2
    # a swarm that ended: its leaving records, the last round most of them finished
    ended = [_rec(7, "run", leaving=True), _rec(7, "run", leaving=True), _rec(10**9, "run", leaving=True)]
    assert progress_of(ended, "b", 1.0).round == 7
    # the peer still training while the others stopped early: the live one's round
    assert (
        progress_of([_rec(9, "run"), _rec(5, "run", leaving=True), _rec(5, "run", leaving=True)], "b", 1.0).round == 9
    )


def test_a_live_record_behind_does_not_take_the_round_back_from_the_peers_that_finished():
    """Fresh user 46: p2 killed at round 11 (its record outlives it), p1 and p3 finished round 15 and left: the
    bootstrap said the run was at round 11, from the one live record, and a resumed p2 was told to resume from a
    checkpoint of round 11. A round more than half of all the records reached counts too."""
    assert progress_of([_rec(11, "run"), _rec(15, "run", True), _rec(15, "run", True)], "b", 1.0).round == 15
    # the resumed p2 announcing its checkpoint's round 10: the same
    recs = [_rec(10, "run"), _rec(11, "run"), _rec(15, "run", True), _rec(15, "run", True), _rec(15, "run", True)]
    assert progress_of(recs, "b", 1.0).round == 15
    # but not a minority of leaving records ahead of the live majority
    assert progress_of([_rec(11, "run"), _rec(11, "run"), _rec(15, "run", True)], "b", 1.0).round == 11


def test_the_run_config_remembered_is_the_one_most_records_of_the_hash_carry():
    """Red team, session 16: one identity copying the run's config hash with another (or an oversized) run
    config in its record, listed first, made the bootstrap remember that config; readers then dropped it (it
    does not hash to the entry's hash) and a newcomer of another config was not told which fields differ."""
    honest = {"run_id": "r", "seq_len": 32}

    def rec(cfg, round=7):
        return SimpleNamespace(round=round, run_config_hash="run", leaving=False, run_config=cfg)

    for stray in ({"run_id": "r", "seq_len": 64}, {"x": "y" * 9000}):
        recs = [rec(stray, round=8), rec(dict(honest)), rec(dict(honest)), rec(None)]
        assert progress_of(recs, "b", 1.0).config == honest
        assert progress_of(list(reversed(recs)), "b", 1.0).config == honest
    # a config too large to publish is never chosen, even alone
    assert progress_of([rec({"x": "y" * 9000})], "b", 1.0).config is None


def test_rounds_a_lone_peer_disowned_do_not_stay_the_runs():
    """Fresh user 48: restarted alone on round 214 (the others' leaving records gone), a peer trained it alone and
    ended "NOT the swarm's", exit 3; its live record of round 215 had raised the bootstrap's round to 215 for good.
    Its leaving record now carries no digest (node.report.disowned), and the rounds past the one remembered before
    the rise are given back when every record past it is such a record; never when one is live or holds a state."""
    from geomesh_p2p.dht.progress import disowned_rise

    before = SwarmProgress(214, 1.0, 2, "b", "run")

    def rec(round, leaving=True, digest=None, config="run"):
        return SimpleNamespace(round=round, run_config_hash=config, leaving=leaving, weights_digest=digest)

    old = [rec(214, digest="d214"), rec(214, digest="d214")]  # the others' leaving records, if still there
    assert disowned_rise(before, old + [rec(215)]) is True
    assert disowned_rise(before, [rec(215)]) is True
    assert disowned_rise(before, [rec(215, leaving=False, digest="f")]) is False  # still live
    assert disowned_rise(before, [rec(215, digest="f")]) is False  # left holding the run's state (synced)
    assert disowned_rise(before, [rec(215), rec(216, digest="g")]) is False  # another peer went on with it
    assert disowned_rise(before, old) is None  # nothing past the round: nothing to tell
    assert disowned_rise(before, [rec(215, config="other")]) is None
