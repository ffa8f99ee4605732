"""Per-phase timing of the round driver (issue 17): every row carries the seconds of each phase of its
cycle (``RoundRecord.phase_s``), the cycle's length and the compute share, with the in-memory fakes of
``tests/test_round_driver.py`` (no processes). Phases are made to take known virtual time through the
fakes' hooks on an injected clock whose monotonic time the hooks advance, so the values are exact."""

from __future__ import annotations

import pytest

from geomesh_p2p.metrics import PHASES
from tests.test_round_driver import FakeClock, _peers

pytestmark = pytest.mark.timeout(60)


class SteppingClock(FakeClock):
    """A FakeClock whose monotonic time the fakes' hooks move (``advance``): a phase 'takes' what its hook
    adds. Waits add nothing here, so only the hooks' seconds show up in the phases."""

    async def wait(self, event, seconds):
        return await super().wait(event, 0.0)

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def test_a_lone_peers_rows_carry_the_seconds_of_each_phase_and_the_cycle():
    (peer,) = _peers(1)
    clock = SteppingClock()
    peer.hooks = {"train": lambda: clock.advance(5.0), "exchange": lambda: clock.advance(0.25),
                  "finish": lambda: clock.advance(0.5)}  # "finish": the fakes' evaluate
    drv = peer.driver(rounds=3, clock=clock)
    await drv.run()
    rows = drv.history
    assert [r.round for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(row.phase_s) <= set(PHASES)
        assert row.phase_s["train"] == 5.0
        assert row.phase_s["exchange"] == 0.25
        assert row.phase_s["eval"] == 0.5
        # nothing else takes virtual time in the fakes
        assert sum(v for k, v in row.phase_s.items() if k not in ("train", "exchange", "eval")) == 0.0
    assert rows[0].cycle_s is None and rows[0].compute_share is None
    # the cycle of rows 1 and 2: exactly the phases of that round (train 5 + exchange 0.25 + eval 0.5)
    assert [r.cycle_s for r in rows[1:]] == [5.75, 5.75]
    assert [r.other_s for r in rows[1:]] == [0.0, 0.0]
    assert rows[1].compute_s == 0.1  # the fakes' InnerResult; the share is compute_s / cycle_s
    assert rows[1].compute_share == pytest.approx(0.1 / 5.75, abs=1e-12)
