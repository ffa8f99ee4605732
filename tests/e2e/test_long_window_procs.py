"""Issue 29 #2 as processes: lifetimes follow the run's window. Two peers train one round of a 170 s window (their
steps slowed by ``--speed-factor`` and more of them planned than fit, so the round takes the whole window); 130 s
into it, past the 120 s every plan
used to live whatever the window, the bootstrap's status page (which reads the plan from the DHT) still shows the
round's plan. Before, it had expired: the page lost it and a joiner's busy-donor map emptied mid-round.

A process test because the kind is the DHT's expiry between processes that each keep their own clocks; the
in-process twin with shifted clocks is ``tests/integration/test_plan_lifetime.py``. ~3 minutes of mostly idle
processes (the peers sleep between slowed steps)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

from tests.swarm_util import ProcSwarm

WINDOW_S = 170.0
PAST_OLD_LIFETIME_S = 130.0  # the old fixed plan lifetime was 120 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(port: int):
    """The status page's current plan (round, window) or None."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/swarm", timeout=10) as r:
        plan = json.loads(r.read()).get("plan")
    return None if plan is None else (plan["round"], plan["window_s"])


@pytest.mark.timeout(420)
def test_a_plan_of_a_long_window_is_still_read_past_the_old_120_s_lifetime(tmp_path: Path) -> None:
    sw = ProcSwarm(tmp_path)
    http = _free_port()
    try:
        sw.bootstrap("boot", "--http-port", str(http))
        entry = sw.address("boot")
        # More uniform inner steps than the window holds: the train deadline, not the planned steps, ends the round
        # (geomesh plans the steps the profile predicts, and a peer faster than its profile ended at 87 s in CI).
        slow = ["--window-s", str(WINDOW_S), "--speed-factor", "0.02", "--rounds", "1", "--min-peers", "2"]
        slow += ["--method", "diloco", "--uniform-inner-steps", "1000"]
        for n in ("a", "b"):
            sw.peer(n, *slow, "--eval-every", "1000", bootstrap=entry)
        seen: list = []

        def planned() -> bool:
            p = _plan(http)
            if p is not None and p[0] == 0:
                seen.append((time.monotonic(), p))
            return bool(seen)

        sw.wait_for(planned, 200, "round 0's plan on the status page")
        t_plan = seen[0][0]
        assert seen[0][1][1] >= WINDOW_S * 0.9  # the round's window is the long one
        # Past the old lifetime, still inside the round (the peers are still training: no row of round 0 yet).
        sw.wait_for(lambda: time.monotonic() - t_plan >= PAST_OLD_LIFETIME_S, PAST_OLD_LIFETIME_S + 30, "130 s")
        assert not sw.rows("a") and not sw.rows("b"), "the round ended before the old lifetime: not a long round"
        assert _plan(http) == seen[0][1], "the plan of a round still under way expired from the DHT"
    finally:
        sw.stop_all(10)


def test_a_real_bootstrap_under_slowloris_still_answers_its_page_and_its_dht(tmp_path: Path) -> None:
    """Issue 29 #1 as processes (netdata#3578's slowloris): 300 idle connections from 10 client addresses against
    a running ``geomesh-bootstrap --http-port``; a normal GET still answers, and a DHT node joins through the
    same process, stores and reads back. Before, every idle socket was accepted and held, and a GET got no answer
    within 5 s. (The in-process twin with a lowered descriptor limit: tests/integration/test_status_listener.py.)"""
    import asyncio

    from tests.dht_helpers import start_node, stop_node

    sw = ProcSwarm(tmp_path)
    http = _free_port()
    socks: list[socket.socket] = []
    try:
        sw.bootstrap("boot", "--http-port", str(http))
        entry = sw.address("boot")
        sw.wait_for(lambda: _plan_or_none_answers(http), 60, "the status page to answer")
        for i in range(10):
            for _ in range(30):
                s = socket.socket()
                s.settimeout(10)
                s.bind((f"127.0.0.{2 + i}", 0))
                s.connect(("127.0.0.1", http))  # never sends a byte
                socks.append(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/swarm", timeout=5) as r:
            assert r.status == 200 and b"run_id" in r.read()

        async def dht_round_trip() -> Optional[bytes]:
            node = await start_node([entry], run_id=sw_run_id())
            try:
                assert await node.store("slowloris-check", b"still-here", node.now() + 60)
                got = await node.get("slowloris-check", latest=True)
                return got[None].value if None in got else None
            finally:
                await stop_node(node)

        assert asyncio.run(asyncio.wait_for(dht_round_trip(), 60)) == b"still-here"
        assert sw.procs["boot"].poll() is None  # the bootstrap serves on
    finally:
        for s in socks:
            s.close()
        sw.stop_all(10)


def _plan_or_none_answers(port: int) -> bool:
    try:
        _plan(port)
        return True
    except OSError:
        return False


def sw_run_id() -> str:
    from tests.swarm_util import RUN_ID

    return RUN_ID
