"""The closing "done" line names the state its perplexity measured (fresh-user report, session 38: a peer restarted
from its round-6 checkpoint that caught up to round 12 and trained nothing printed round 6's perplexity as if it
were the state it ended with)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from geomesh_p2p.node import report

pytestmark = pytest.mark.timeout(30)


def _node(history, round_, initial_ppl=298.76, initial_round=6):
    return SimpleNamespace(
        history=history,
        round=round_,
        initial_ppl=initial_ppl,
        initial_round=initial_round,
        _stop=threading.Event(),
        _reached_target=lambda: False,
        cfg=SimpleNamespace(rounds=12, target_ppl=None),
    )


def _row(round_, ppl, eval_round=None):
    return SimpleNamespace(round=round_, eval_ppl=ppl, eval_round=eval_round)


def _done(caplog, node) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=report.log.name):
        report.log_done(node)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done (")]
    return line


def test_a_peer_that_caught_up_and_trained_nothing_says_its_figure_is_of_the_old_state(caplog):
    line = _done(caplog, _node([], 12))
    assert line == (
        "done (--rounds 12 reached): 0 round(s) trained here, now at round 12, eval perplexity 298.76 of round 6's "
        "state (round 12's was not evaluated here) (from 298.76)"
    )


def test_a_peer_whose_last_row_measured_its_end_state_prints_the_plain_line(caplog):
    node = _node([_row(10, 250.0), _row(11, 209.59)], 12)
    assert _done(caplog, node) == (
        "done (--rounds 12 reached): 2 round(s) trained here, now at round 12, eval perplexity 209.59 (from 298.76)"
    )
    # a background evaluation lags: the row of round 11 measured round 10's end state, i.e. round 11's start
    node = _node([_row(11, 220.0, eval_round=10)], 12)
    assert "eval perplexity 220.00 of round 11's state (round 12's was not evaluated here)" in _done(caplog, node)
    assert report.last_eval(node) == (220.0, 11)
