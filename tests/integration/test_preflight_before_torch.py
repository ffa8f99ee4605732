"""Start-up mistakes named before torch's import (session 35: on a loaded 2-core box a fresh user waited ~60 s for
each): ``geomesh-peer join``'s ping of each ``--bootstrap`` (a wrong ``--run-id``, an address nobody answers at),
``geomesh-bootstrap``'s busy ``--port``, ``geomesh-peer checkpoints`` of a missing folder. Each runs the real CLI
in a fresh interpreter (this one has torch loaded) that says which of torch / hivemind / transformers were imported
when the check ran; the messages are the ones the node and the commands printed before."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.node import joining
from tests.dht_helpers import start_node, stop_node
from tests.swarm_util import dead_address

# a cold interpreter imports the CLI (1-10 s on a loaded 2-core box), no torch
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "hivemind", "transformers")

#: ``geomesh-peer join`` that reports the heavy packages imported when its pre-flight ping ended, then exits 7
#: (what comes after it, torch, the model and the proof of work, is not this test's).
JOIN = f"""
import sys
import peer.node_cli as nc
from peer.cli import main

ping = nc.ping_bootstraps_first

def first(ns):
    try:
        return ping(ns)
    finally:
        print("imported at the ping:", sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr, flush=True)
        if sys.exc_info()[0] is None:
            raise SystemExit(7)

nc.ping_bootstraps_first = first
sys.exit(main(sys.argv[1:]))
"""

#: ``MODULE.main(argv)``, then the heavy packages imported by then.
MAIN = f"""
import importlib, sys
rc = importlib.import_module(sys.argv[1]).main(sys.argv[2:])
print("imported at the end:", sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr, flush=True)
sys.exit(rc)
"""


async def _run(code: str, *argv: str) -> tuple[int, list[str]]:
    """``python -c code argv...`` from the repository root: (exit status, stderr lines). Run off the event loop's
    thread (asyncio's subprocess), so that a bootstrap of this loop answers meanwhile."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *argv,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 100)
    return proc.returncode, err.decode().splitlines()


def _join_argv(tmp_path, *args: str) -> list[str]:
    return ["join", "--identity", str(tmp_path / "id.key"), "--threads", "1", *args]


async def test_a_wrong_run_id_is_refused_before_torch(tmp_path):
    boot = await start_node(run_id="run-a")
    try:
        rc, err = await _run(JOIN, *_join_argv(tmp_path, "--bootstrap", boot.address, "--run-id", "run-b"))
    finally:
        await stop_node(boot)
    assert rc == 1, err  # as when the node raised it
    assert "imported at the ping: []" in err, err
    assert [x for x in err if x.startswith("geomesh-peer")] == [
        f"geomesh-peer join: could not join the DHT: bootstrap {boot.address} serves run 'run-a', not the run "
        "'run-b' asked for: check --run-id"
    ]
    assert list(tmp_path.iterdir()) == []  # no key made for a start refused this early


@pytest.mark.parametrize("kind", ["http", "unresolvable"])
async def test_a_bootstrap_address_that_can_never_work_fails_before_torch(tmp_path, kind):
    """Fresh user 48: --bootstrap at a bootstrap's status page (an HTTP server) or a host name that does not resolve
    was one WARNING ("the join tries again after the proof of work, with retries"), then torch, the proof of work
    (4-16 s) and "1 attempt(s) over 0.0s", exit 1 (with "its bootstrap ... is on another machine" for the name). No
    retry can help: one line naming the flag and why, exit 2, before torch, no key made."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}" if kind == "http" else "nosuch-host.invalid:31337"
    try:
        rc, err = await _run(JOIN, *_join_argv(tmp_path, "--bootstrap", address))
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 2, err
    assert "imported at the ping: []" in err, err
    why = (
        "not a gRPC server (an HTTP server? a bootstrap's status page is its --http-port, not its --port)"
        if kind == "http"
        else "host name does not resolve"
    )
    assert [x for x in err if x.startswith("geomesh-peer")] == [
        f"geomesh-peer join: --bootstrap {address}: {why}: check --bootstrap (the HOST:PORT the bootstrap printed: "
        "'peers join with: --bootstrap ...')"
    ], err
    assert [x for x in err if x[8:11] == " W "] == [], err
    assert list(tmp_path.iterdir()) == []  # no key made for a start refused this early


async def test_an_address_nothing_listens_at_fails_before_torch(tmp_path):
    """Nothing listens at --bootstrap (each connection refused): retried --join-attempts times (a line each), then
    one error naming the address, before torch (it failed after torch, the model and the proof of work: 63-76 s)."""
    with dead_address() as dead:
        rc, err = await _run(JOIN, *_join_argv(tmp_path, "--bootstrap", dead, "--join-attempts", "2"))
    assert rc == 1, err
    assert "imported at the ping: []" in err, err
    assert [x.split(" ", 1)[1] for x in err if x[8:11] in (" I ", " W ")] == [
        f"I geomesh_p2p.dht.node: no answer from {dead} (connection refused); retrying in 0.5 s (attempt 1 of 2)"
    ], err
    errors = [x for x in err if x.startswith("geomesh-peer")]
    assert len(errors) == 1 and errors[0].startswith(
        f"geomesh-peer join: could not join the DHT: nothing listens at {dead} (connection refused at each of 2 "
        "attempt(s) in "
    ), err
    assert errors[0].endswith(" s): check the --bootstrap address and port, and that the bootstrap runs"), err
    assert list(tmp_path.iterdir()) == []  # no key made for a start refused this early


async def test_a_silent_bootstrap_is_one_warning_before_torch(tmp_path):
    """A bootstrap that accepts TCP and never answers may be slow or far: one WARNING, and the join retries it."""
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts (the kernel's backlog), never reads nor answers
    silent = f"127.0.0.1:{hang.getsockname()[1]}"
    try:
        rc, err = await _run(JOIN, *_join_argv(tmp_path, "--bootstrap", silent))
    finally:
        hang.close()
    assert rc == 7, err
    assert "imported at the ping: []" in err, err
    warnings = [x.split(" ", 1)[1] for x in err if x[8:11] == " W "]
    assert warnings == [
        f"W geomesh_p2p.node.peer: --bootstrap {silent}: no answer (timed out); check the address and that "
        "the bootstrap runs (the join tries again after the proof of work, with retries while a bootstrap may be "
        "restarting)"
    ], err


async def test_the_ping_is_signed_with_the_identity_file_when_it_exists(tmp_path):
    """A private run's bootstrap admits only its listed keys: the ping is --identity's (no WARNING), not a
    throwaway key's (refused: a WARNING naming the bootstrap)."""
    key = Identity.load_or_create(tmp_path / "id.key")
    key.keep_created()
    transport = Transport(
        Identity.generate(), "run-a", TransportConfig(host="127.0.0.1", port=0), allow=lambda p: p == key.peer_id
    )
    boot = DHTNode(transport)
    await transport.start()
    try:
        rc, err = await _run(JOIN, *_join_argv(tmp_path, "--bootstrap", boot.address, "--run-id", "run-a"))
        assert rc == 7, err
        assert [x for x in err if x[8:11] == " W "] == [], err  # answered: nothing to say
        rc, err = await _run(
            JOIN, "join", "--identity", str(tmp_path / "none.key"), "--bootstrap", boot.address, "--run-id", "run-a"
        )
        assert rc == 7, err
        assert [x for x in err if x[8:11] == " W " and f"--bootstrap {boot.address}: failed (" in x], err
        assert not (tmp_path / "none.key").exists()  # the throwaway key was not stored
    finally:
        await stop_node(boot)


async def test_the_node_does_not_ping_again_after_the_cli(caplog):
    from geomesh_p2p.dht.preflight import NothingListensError

    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    with dead_address() as dead:
        node = SimpleNamespace(
            cfg=NodeConfig(bootstrap=[dead], host="127.0.0.1", port=0, join_attempts=1),
            run_cfg=RunConfig(seq_len=32, run_id="run-b", pow_bits=40),
            identity=Identity.generate(),
            bootstraps_pinged=True,
        )
        await asyncio.wait_for(joining.check_before_proof_of_work(node, None), 20)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        node.bootstraps_pinged = False  # a node started by other code (the simulator, tests) pings itself
        with pytest.raises(NothingListensError, match=f"^could not join the DHT: nothing listens at {dead} "):
            await asyncio.wait_for(joining.check_before_proof_of_work(node, None), 20)


async def test_a_busy_bootstrap_port_is_refused_before_torch(tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = await _run(MAIN, "bootstrap.cli", "--port", str(port), "--identity", str(tmp_path / "b.key"))
    assert rc == 2, err
    assert err == [
        f"geomesh-bootstrap: --port {port}: cannot listen on 0.0.0.0:{port}: the port is in use (another --port, or "
        "--port 0 for a free one)",
        "imported at the end: []",
    ]


async def test_a_missing_checkpoint_folder_is_named_before_torch(tmp_path):
    """Exit 2, the flag named (README: 2 = a bad flag or file; fresh user 49: these exited 1)."""
    nope = tmp_path / "nope"
    rc, err = await _run(MAIN, "peer.cli", "checkpoints", str(nope))
    assert (rc, err) == (2, [f"geomesh-peer checkpoints: DIR {nope}: no such directory", "imported at the end: []"])
    (tmp_path / "file").write_text("x")
    rc, err = await _run(MAIN, "peer.cli", "checkpoints", str(tmp_path / "file"))
    assert (rc, err) == (
        2,
        [f"geomesh-peer checkpoints: DIR {tmp_path / 'file'}: not a directory", "imported at the end: []"],
    )
    rc, err = await _run(MAIN, "peer.cli", "export", "--checkpoint-dir", str(tmp_path), "--out", str(nope))
    assert (rc, err) == (
        2,
        [
            f"geomesh-peer export: --checkpoint-dir {tmp_path}: no checkpoint (ckpt-NNNNNNNN.json) in this directory",
            "imported at the end: []",
        ],
    )
    assert not nope.exists()
    rc, err = await _run(MAIN, "peer.cli", "generate", "--checkpoint-dir", "nosuchdir", "--prompt", "x")
    assert (rc, err) == (
        2,
        ["geomesh-peer generate: --checkpoint-dir nosuchdir: no such directory", "imported at the end: []"],
    )


async def test_exports_data_and_out_are_named_before_torch(tmp_path):
    """``export``'s ``--data`` and ``--out`` are checked with its folder, before torch: exit 2 naming the flag."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "ckpt-00000003.json").write_text("{}")  # a checkpoint by its name: the folder check passes
    rc, err = await _run(
        MAIN, "peer.cli", "export", "--checkpoint-dir", str(ckpts), "--data", str(tmp_path / "no.txt"), "--out", "o"
    )
    assert (rc, err) == (
        2,
        [f"geomesh-peer export: --data {tmp_path / 'no.txt'}: no such file", "imported at the end: []"],
    )
    rc, err = await _run(MAIN, "peer.cli", "export", "--checkpoint-dir", str(ckpts), "--out", "/proc/nope/hf")
    assert rc == 2, err
    assert err[0].startswith("geomesh-peer export: --out /proc/nope/hf: cannot write there (") and len(err) == 2
