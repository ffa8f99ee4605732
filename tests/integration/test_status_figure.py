"""``geomesh-peer status`` against a dead port says how long it took in all (fresh user 49: it took 7.6 s and said
"(2 attempt(s) over 0.3s)", the join's tries only, the DHT's imports left out)."""

from __future__ import annotations

import re

import pytest

from peer.cli import main
from tests.swarm_util import dead_address

pytestmark = pytest.mark.timeout(60)


def test_status_against_a_dead_port_says_the_whole_time(capsys):
    """The join's "2 attempt(s) over 0.3s" was the only figure while the command took 7.6 s (the DHT's imports)."""
    with dead_address() as dead:
        assert main(["status", "--bootstrap", dead, "--timeout", "0.5"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(
        rf"geomesh-peer status: cannot reach the bootstrap {dead} \((\d+\.\d) s in all, (\d+\.\d) s of it loading the "
        rf"DHT's libraries\): could not join the DHT: .*\(\d+ attempt\(s\) over \d+\.\ds\): .*",
        line,
    ), line
    total, loading = map(float, re.search(r"\((\d+\.\d) s in all, (\d+\.\d) s", line).groups())
    assert loading <= total
