"""``geomesh-peer join --mode accountable`` (issue 26) as OS processes: 3 peers train a few rounds in accountable
mode with equal digests every round, and an honest swarm logs no proof and no exclusion."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(420)
def test_three_peers_train_in_accountable_mode_with_equal_digests(swarm):
    names = ["a0", "a1", "a2"]
    swarm.start_peers(names, "--rounds", "3", "--min-peers", "3", "--mode", "accountable")
    assert swarm.wait_exit(names, 360) == {n: 0 for n in names}
    for r in range(3):
        d = {n: next((x["digest"] for x in swarm.rows(n) if x["round"] == r), None) for n in names}
        assert None not in d.values() and len(set(d.values())) == 1, f"round {r}: {d}"
    for n in names:
        log = (swarm.dir / f"{n}.log").read_text()
        assert "proven" not in log and "forged its result" not in log and "Traceback" not in log
        assert "accountable validation failed" not in log and "without a valid receipt" not in log
        assert all(x["contributors"] == 3 and x["missing_parts"] == 0 for x in swarm.rows(n))
    # the validators drawn after each round re-checked their parts, and found nothing
    validated = [e for n in names for e in swarm.events(n, "parts_validated")]
    assert validated and all(e["findings"] == 0 for e in validated)
    assert {e["round"] for e in validated} >= {0, 1}
