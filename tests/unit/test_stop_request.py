"""``PeerNode.request_stop`` (the SIGINT/SIGTERM handler): one INFO line per request, the second one saying the stop
is already under way (a fresh user's second Ctrl+C was silent, session 35)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from geomesh_p2p.node.peer import PeerNode

pytestmark = pytest.mark.timeout(30)


def test_a_second_stop_request_is_said_and_changes_nothing(caplog):
    node = SimpleNamespace(_stop=threading.Event(), _in_exchange=False)
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer"):
        PeerNode.request_stop(node)  # type: ignore[arg-type]
        node._in_exchange = True
        PeerNode.request_stop(node)  # type: ignore[arg-type]
    assert node._stop.is_set()
    assert [r.getMessage() for r in caplog.records] == [
        "stop requested: leaving",
        "stop requested again (already under way): finishing the exchange first cleanly (seconds: the round's "
        "exchange and a checkpoint; SIGKILL forces it, and the others then wait out this peer's parts)",
    ]
