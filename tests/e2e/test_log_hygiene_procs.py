"""The process-level tests of ``tests/integration/test_log_hygiene.py`` (they start OS processes)."""

from __future__ import annotations

import pytest
from tests.swarm_util import dead_address
from tests.integration.test_log_hygiene import _bad_lines  # noqa: F401


@pytest.mark.timeout(420)
def test_a_healthy_three_peer_swarm_logs_no_error_traceback_or_pending_task(swarm):
    """A demo-like swarm (a bootstrap and three peers, --rounds 3) runs and stops: no log has a bad line."""
    swarm.bootstrap("boot")  # port 0: it binds a free port and prints it
    entry = swarm.address("boot", 180)
    names = ["p0", "p1", "p2"]
    for n in names:
        swarm.peer(n, "--rounds", "3", "--min-peers", "3", bootstrap=entry)
    assert swarm.wait_exit(names, 360) == {n: 0 for n in names}
    swarm.interrupt("boot")
    assert swarm.wait_exit(["boot"], 60) == {"boot": 0}
    # each peer trained rounds 0-2, or was planned out of one by the no-part penalty of a push the load made late
    # (its lines about it are INFO, not bad lines): a peer that skipped or forked a round fails it
    assert swarm.plan_problems(names, range(3)) == [], {n: swarm.text(n)[-3000:] for n in names}
    for n in names + ["boot"]:
        assert _bad_lines(swarm.text(n)) == [], (n, swarm.text(n)[-3000:])


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
