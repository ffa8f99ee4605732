"""The process-level tests of ``tests/integration/test_allow_list.py`` (they start OS processes)."""

from __future__ import annotations

import pytest
from geomesh_p2p.net.identity import Identity
from tests.integration.test_allow_list import REASON  # noqa: F401


@pytest.mark.timeout(180)
def test_bootstrap_with_allow_peers_refuses_a_peer_process_off_the_list(swarm, tmp_path):
    """geomesh-bootstrap --allow-peers FILE (PeerIDs, '#' comments): a geomesh-peer whose key is not listed
    exits non-zero saying it is not on the allow-list; the bootstrap logs the refusal and keeps serving."""
    member_key, outsider_key = (tmp_path / f"{n}.key" for n in ("member", "outsider"))
    member = Identity.load_or_create(member_key)
    outsider = Identity.load_or_create(outsider_key)
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# the members of this private run\n{member.peer_id}  # member\n\n")
    # Port 0: the bootstrap binds a free port and prints it; the address is read back from that line.
    swarm.bootstrap("boot", "--allow-peers", str(allow), "--state-file", "")
    entry = swarm.address("boot")
    assert "private run: 1 allowed peer(s)" in swarm.text("boot")
    swarm.peer("outsider", "--rounds", "1", bootstrap=entry)
    code = swarm.wait_exit(["outsider"], 150)["outsider"]
    text = swarm.text("outsider")
    assert code != 0 and REASON in text and outsider.peer_id.short() in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    swarm.wait_for(lambda: REASON in swarm.text("boot"), 30, "the bootstrap's refusal line")
    assert swarm.procs["boot"].poll() is None  # still serving
