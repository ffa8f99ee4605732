"""--allow-peers (issue 15): a node of a private run refuses a peer not on its allow-list, with the reason
in the refusing node's log and in the refused peer's error; listed peers work as before."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from geomesh_p2p.dht import DHTJoinError, DHTNode
from geomesh_p2p.identity import Identity, allow_list
from geomesh_p2p.transport import Transport, TransportConfig
from tests.swarm_util import free_port

RUN = "allow-test-run"
REASON = "not on this node's allow-list, --allow-peers"


async def _node(identity, allow, bootstrap=(), **kw) -> DHTNode:
    t = Transport(identity, RUN, TransportConfig(host="127.0.0.1", port=0), allow=allow)
    node = DHTNode(t, rpc_timeout_s=2.0, **kw)
    await t.start()
    await node.join(list(bootstrap))
    return node


@pytest.mark.timeout(60)
async def test_a_peer_off_the_allow_list_is_refused_with_the_reason_on_both_sides(caplog):
    boot_id, insider_id, outsider_id = Identity.generate(), Identity.generate(), Identity.generate()
    members = [str(boot_id.peer_id), str(insider_id.peer_id)]
    nodes: list[DHTNode] = []
    try:
        boot = await _node(boot_id, allow_list(members))
        nodes.append(boot)
        insider = await _node(insider_id, allow_list(members), [boot.address])
        nodes.append(insider)
        assert await insider.store("private/key", b"members only", time.time() + 120)
        assert (await boot.get("private/key"))[None].value == b"members only"

        t = Transport(outsider_id, RUN, TransportConfig(host="127.0.0.1", port=0))
        outsider = DHTNode(t, rpc_timeout_s=2.0, join_attempts=1)
        nodes.append(outsider)
        await t.start()
        with caplog.at_level(logging.WARNING, logger="geomesh_p2p.transport"):
            with pytest.raises(DHTJoinError) as ei:
                await outsider.join([boot.address])
        # the refused peer's error: who refused, the status and why
        msg = str(ei.value)
        assert boot.address in msg and "PERMISSION_DENIED" in msg and REASON in msg, msg
        assert outsider_id.peer_id.short() in msg
        # the refusing node's log: one line with the method, the caller and the same reason
        lines = [r.getMessage() for r in caplog.records if REASON in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("refused /geomesh.wire.Dht/Ping from ipv4:127.0.0.1:"), lines
        assert outsider_id.peer_id.short() in lines[0]
        # nothing of the outsider entered the members' routing tables
        assert outsider_id.peer_id not in {c.peer_id for n in nodes[:2] for c in n.contacts()}
    finally:
        for n in nodes:
            await n.shutdown()
            await n.transport.stop(grace=0)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_bootstrap_with_allow_peers_refuses_a_peer_process_off_the_list(swarm, tmp_path):
    """geomesh-bootstrap --allow-peers FILE (PeerIDs, '#' comments): a geomesh-peer whose key is not listed
    exits non-zero saying it is not on the allow-list; the bootstrap logs the refusal and keeps serving."""
    boot_key, member_key, outsider_key = (tmp_path / f"{n}.key" for n in ("boot", "member", "outsider"))
    member = Identity.load_or_create(member_key)
    outsider = Identity.load_or_create(outsider_key)
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# the members of this private run\n{member.peer_id}  # member\n\n")
    port = free_port()
    swarm._spawn("boot", [sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(port),
                          "--run-id", "test-swarm", "--identity", str(boot_key), "--allow-peers", str(allow),
                          "--state-file", ""])
    swarm.wait_for(lambda: "serving on" in swarm.text("boot"), 120, "the bootstrap to listen")
    assert "private run: 1 allowed peer(s)" in swarm.text("boot")
    swarm.peer("outsider", "--rounds", "1", bootstrap=f"127.0.0.1:{port}")
    code = swarm.wait_exit(["outsider"], 150)["outsider"]
    text = swarm.text("outsider")
    assert code != 0 and REASON in text and outsider.peer_id.short() in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    swarm.wait_for(lambda: REASON in swarm.text("boot"), 30, "the bootstrap's refusal line")
    assert swarm.procs["boot"].poll() is None  # still serving
