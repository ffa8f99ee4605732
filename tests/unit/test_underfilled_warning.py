"""An underfilled round's WARNING names verified work when its checks computed in that round (fresh-user trial of
session 32: "device slower than profiled, or busy" on an idle machine, in the rounds of the first screens)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from geomesh_p2p.round.finish import publish_row
from geomesh_p2p.telemetry.metrics import RoundRecord


def _record(rnd: int, done: int) -> RoundRecord:
    base = dict(round=rnd, peers=2, batch_size=4, inner_steps_done=done, inner_steps_planned=10, tokens=512)
    base.update(train_loss=5.0, round_s=10.0, digest="ab" * 16, digest_agree=True, leader="L", eval_ppl=None)
    base.update(compute_s=6.0, straggler_idle_s=1.0, network_idle_s=0.5, bytes_sent=1, bytes_received=2)
    return RoundRecord(**base)


class _Policy:
    """Publishes rows as RoundPolicy.publish_record does: verified work's cumulative counts into the row."""

    def __init__(self, busy: list[float]) -> None:
        self.busy, self.rows = busy, []

    def publish_record(self, rec: RoundRecord) -> None:
        rec.extra["verify"] = {"done": 1, "busy_s": self.busy[len(self.rows)]}
        self.rows.append(rec)


@pytest.mark.timeout(30)
def test_the_warning_names_verified_works_seconds_of_this_round_only(caplog) -> None:
    policy = _Policy([3.25, 3.4, 7.0])  # cumulative: 3.25 s, then 0.15 s, then 3.6 s in the rounds
    drv = SimpleNamespace(
        clock=SimpleNamespace(monotonic=lambda: 100.0),
        _phases={},
        _phase_cpu={},
        _phase_rss={},
        _t_row=None,
        _traffic_row={},
        _verify_busy_row=0.0,
        traffic_classes=lambda: {},
        history=[],
        stop=threading.Event(),
        policy=policy,
    )
    with caplog.at_level(logging.WARNING, logger="geomesh_p2p.node.peer.round"):
        publish_row(drv, _record(5, done=2))
        publish_row(drv, _record(6, done=3))
        publish_row(drv, _record(7, done=10))  # not underfilled: no line, but its seconds are counted
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "round 5: trained 2 of 10 planned inner steps (verified work computed 3.2 s of this round on the same "
        "cores; or the device slower than profiled, or busy)",
        "round 6: trained 3 of 10 planned inner steps (device slower than profiled, or busy)",  # 0.15 s: not named
    ]
    assert [r.round for r in policy.rows] == [5, 6, 7] and drv._verify_busy_row == 7.0
