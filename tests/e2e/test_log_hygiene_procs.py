"""The process-level tests of ``tests/integration/test_log_hygiene.py`` (they start OS processes)."""

from __future__ import annotations

import pytest
from tests.swarm_util import dead_address
from tests.integration.test_log_hygiene import _bad_lines


# A healthy swarm's logs (a bootstrap and three peers, --rounds 3, stopped: no bad line) are asserted on the swarm of
# tests/e2e/test_swarm.py::test_three_peers_train_then_resume_with_identical_weights, the same bootstrap and three
# peers (session 50: this file's own swarm of them, ~15 s of a 4-process swarm, is gone).


@pytest.mark.timeout(240)
def test_a_bootstrap_stopped_while_joining_stops_at_once_and_cleanly(swarm):
    """SIGINT while the bootstrap still retries its --bootstrap (a closed port, ~30 s of backoff): it ends
    the join at once (no 'serving alone' after it), exits 0 and prints no bad line."""
    with dead_address() as dead:  # bound, never listening: its connections are refused
        swarm.bootstrap("boot", "--bootstrap", dead)
        swarm.address("boot", 180)
        swarm.interrupt("boot")
        assert swarm.wait_exit(["boot"], 60) == {"boot": 0}
    text = swarm.text("boot")
    assert "stopped" in text.splitlines()[-1], text
    assert "serving alone" not in text, text  # the join's retries did not run to their end
    assert _bad_lines(text) == [], text
