"""A second process with this peer's key, started seconds after it (fresh-user trial, session 10): at start
neither saw the other's record, both trained apart on two lineages and nothing said why. A membership read
that holds a record of this PeerID at another address runs the start's duplicate check again (a ping that
only the key's holder can answer), at most once per ``IDENTITY_RECHECK_S``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.node import joining
from geomesh_p2p.node.joining import DuplicateIdentityError, watch_identity

pytestmark = pytest.mark.timeout(30)


def _rec(peer_id: str, address: str):
    return SimpleNamespace(peer_id=peer_id, address=address)


async def test_a_record_of_this_peer_id_elsewhere_runs_the_duplicate_check_once_per_period(monkeypatch):
    checks: list[str] = []
    clock = [1000.0]

    async def check(node):
        checks.append(node.me)
        if node.record_address == "127.0.0.1:1":
            raise DuplicateIdentityError("this PeerID (me) is already live at 127.0.0.1:2")

    monkeypatch.setattr(joining, "check_identity_unique", check)
    monkeypatch.setattr(joining.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(joining, "_identity_checked", {})
    node = SimpleNamespace(me="me", record_address="127.0.0.1:9")
    await watch_identity(node, [_rec("me", "127.0.0.1:9"), _rec("other", "127.0.0.1:5")])
    assert checks == []  # only its own record (and others'): nothing to check
    await watch_identity(node, [_rec("me", "127.0.0.1:7")])  # a stale record of a restart: pinged, silent
    await watch_identity(node, [_rec("me", "127.0.0.1:7")])
    assert checks == ["me"]  # not again within the period
    clock[0] += joining.IDENTITY_RECHECK_S
    node.record_address = "127.0.0.1:1"
    with pytest.raises(DuplicateIdentityError, match="already live at 127.0.0.1:2"):
        await watch_identity(node, [_rec("me", "127.0.0.1:2")])
    assert checks == ["me", "me"]


async def test_a_duplicate_marks_the_identity_taken_so_the_refused_process_announces_no_leaving(monkeypatch):
    """The refused process's shutdown announces no leaving under the PeerID (PeerNode.shutdown reads
    ``identity_taken``): that record would be the live process's, and the others would drop it."""
    me = SimpleNamespace(short=lambda: "me")

    class Transport:
        address = "127.0.0.1:9"

        async def call(self, address, method, payload, timeout):
            assert address == "127.0.0.1:2" and timeout > 0
            return SimpleNamespace(sender=me)

    async def live(*a, **k):
        return [_rec("me", "127.0.0.1:2")]

    monkeypatch.setattr(joining, "live_peers", live)
    ping = SimpleNamespace(PingRequest=lambda **k: SimpleNamespace(SerializeToString=lambda: b""))
    monkeypatch.setattr(joining, "dht_pb2", ping)
    dht = SimpleNamespace(self_info=lambda: None)
    node = SimpleNamespace(
        me="me",
        identity=SimpleNamespace(peer_id=me),
        identity_taken=False,
        dht=dht,
        run_cfg=SimpleNamespace(run_id="r", record_shards=1),
        _started_transport=lambda: Transport(),
    )
    with pytest.raises(DuplicateIdentityError, match="already live at 127.0.0.1:2"):
        await joining.check_identity_unique(node)
    assert node.identity_taken is True
