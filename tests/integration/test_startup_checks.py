"""Start-up problems a fresh user hit (session 33): a wrong ``--bootstrap`` named before the proof of work, in one
line, and the join's retries logged one short line each; a busy ``--port`` / ``--metrics-port`` / ``--http-port``
refused at start naming the flag; a resume under another PeerID warned of; a donor that moved on logged at INFO
(WARNING on the last attempt); the proof-of-work line true; ``--version`` after a command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from types import SimpleNamespace

import grpc
import torch
import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht import DHTJoinError
from geomesh_p2p.dht.join import final_failure, short_reason
from geomesh_p2p.net.addr import listen_problem
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.node import joining
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.sync import download
from geomesh_p2p.trust.admission import pow_done_line
from tests.dht_helpers import start_node
from tests.swarm_util import dead_address

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def busy_port():
    """A port of 127.0.0.1 another socket listens on for the test's length."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ 1. a wrong --bootstrap
def test_short_reason_words_grpc_failures_in_a_few_words():
    refused = RpcError(
        "127.0.0.1:1",
        "/dht/Ping",
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote "
        "host: Connection refused",
    )
    assert short_reason(refused) == "connection refused"
    late = RpcError("10.0.0.1:5", "/dht/Ping", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert short_reason(late) == "timed out"
    typo = RpcError(
        "nosuch.invalid:5",
        "/dht/Ping",
        grpc.StatusCode.UNAVAILABLE,
        "errors resolving nosuch.invalid:5: [field:hostname lookup error:address lookup failed for nosuch.invalid:5: "
        "Domain name not found]",
    )
    assert short_reason(typo) == "host name does not resolve"
    # gRPC's words for an HTTP/1 server (a bootstrap's status page given as --bootstrap: a fresh user, session 34)
    http = RpcError(
        "127.0.0.1:8080",
        "/dht/Ping",
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8080: Failed parsing HTTP/2 "
        "(Expected SETTINGS frame as the first frame, got frame type 79)",
    )
    assert short_reason(http).startswith("not a gRPC server (an HTTP server? ")
    assert final_failure(http) and not final_failure(refused)  # no retries for it; a refused one may be restarting
    other = RpcError("h:5", "/dht/Ping", grpc.StatusCode.PERMISSION_DENIED, "x" * 200)
    assert short_reason(other) == "PERMISSION_DENIED: " + "x" * 80 + "..."


async def test_join_retry_lines_are_short_and_the_error_keeps_the_code(caplog):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.dht.node")
    with dead_address() as dead, pytest.raises(DHTJoinError) as ei:
        await start_node([dead], identity=Identity.generate(), join_attempts=3, join_backoff_s=0.05)
    retries = [r.getMessage() for r in caplog.records if "no bootstrap answered yet" in r.getMessage()]
    assert len(retries) == 2, retries
    assert retries[0].startswith(f"no bootstrap answered yet ({dead}: connection refused); retrying in "), retries
    assert retries[0].endswith("(attempt 1 of 3)") and len(retries[0]) < 100, retries
    assert str(ei.value).startswith("could not join the DHT: no bootstrap node answered (3 attempt(s) over ")
    assert str(ei.value).endswith(f"s): {dead}: UNAVAILABLE: connection refused"), str(ei.value)


def _node(bootstrap: list[str]) -> SimpleNamespace:
    """What check_before_proof_of_work reads of a PeerNode."""
    return SimpleNamespace(
        cfg=NodeConfig(bootstrap=bootstrap, host="127.0.0.1", port=0),
        run_cfg=RunConfig(seq_len=32, run_id="run-b", pow_bits=40),
        identity=Identity.generate(),
    )


async def test_no_bootstrap_answering_is_one_warning_naming_the_flag_and_why(caplog):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts, never answers: silent, not refused (a refused one is retried, then fails)
    silent = f"127.0.0.1:{hang.getsockname()[1]}"
    try:
        await asyncio.wait_for(joining.check_bootstrap_run(_node([silent]), None, 1.0), 20)  # not raised: retried later
    finally:
        hang.close()
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in lines] == [
        f"--bootstrap {silent}: no answer (timed out); check the address and that the bootstrap runs (the "
        "join tries again after the proof of work, with retries while a bootstrap may be restarting)"
    ]


async def test_an_answering_bootstrap_is_no_warning(caplog):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    boot = await start_node(run_id="run-b")
    try:
        with dead_address() as dead:
            await asyncio.wait_for(joining.check_bootstrap_run(_node([dead, boot.transport.address]), None, 2.0), 20)
    finally:
        await boot.shutdown()
        await boot.transport.stop(grace=0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# ------------------------------------------------------------------ 2. a busy port
def test_listen_problem_names_the_flag(busy_port):
    assert listen_problem("127.0.0.1", busy_port) == (
        f"--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port is in use (another --port, or "
        "--port 0 for a free one)"
    )
    assert listen_problem("127.0.0.1", busy_port, port_flag="--http-port").startswith(
        f"--http-port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port is in use (another --http-port"
    )
    assert listen_problem("127.0.0.1", _free_port()) is None
    assert listen_problem("127.0.0.1", 0) is None  # a free one, always
    assert listen_problem("203.0.113.1", 5000) == (  # TEST-NET-3: not this machine's
        "--host 203.0.113.1: cannot listen on 203.0.113.1:5000: not an address of this machine"
    )


async def test_the_node_checks_its_port_before_the_proof_of_work(busy_port):
    from geomesh_p2p.util.errors import StartInputError

    node = _node([])
    node.cfg = NodeConfig(host="127.0.0.1", port=busy_port)
    with pytest.raises(StartInputError, match=f"^--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: "):
        await joining.check_before_proof_of_work(node, None)
    node.cfg = NodeConfig(host="127.0.0.1", port=busy_port, client_only=True)  # listens on nothing
    await joining.check_before_proof_of_work(node, None)


def _join_ns(*argv: str) -> argparse.Namespace:
    from peer.cli import build_parser, parse

    return parse(build_parser(), ["join", *argv])


def test_join_checks_port_and_metrics_port_before_torch(busy_port):
    from peer.node_cli import check_fast

    with pytest.raises(ValueError, match=f"^--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port"):
        check_fast(_join_ns("--port", str(busy_port)))
    with pytest.raises(ValueError, match=f"^--metrics-port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: "):
        check_fast(_join_ns("--metrics-port", str(busy_port)))
    check_fast(_join_ns("--port", str(busy_port), "--client-only"))  # no server: nothing to check


def test_a_torchrun_follower_rank_leaves_the_ports_to_rank_0(busy_port, monkeypatch):
    from peer.node_cli import check_ports

    monkeypatch.setenv("RANK", "1")  # rank 0 may listen on them already
    check_ports(_join_ns("--port", str(busy_port), "--metrics-port", str(busy_port)))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=f"^--port {busy_port}: "):
        check_ports(_join_ns("--port", str(busy_port)))


def test_bootstrap_checks_port_and_http_port_at_start(busy_port):
    from bootstrap.cli import check_ports, parse

    assert check_ports(parse(["--host", "127.0.0.1", "--port", str(busy_port)])) == (
        f"--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port is in use (another --port, or "
        "--port 0 for a free one)"
    )
    ns = parse(["--host", "127.0.0.1", "--port", "0", "--http-port", str(busy_port)])
    assert check_ports(ns).startswith(f"--http-port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: ")
    assert check_ports(parse(["--host", "127.0.0.1", "--port", "0", "--http-port", "0"])) is None


# ------------------------------------------------------------------ 3. --resume under another identity
def test_resume_under_another_peer_id_warns_naming_both(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    ident = Identity.load_or_create(tmp_path / "typo.key")  # created now
    node = SimpleNamespace(
        me=str(ident.peer_id),
        identity=ident,
        cfg=NodeConfig(identity=str(tmp_path / "typo.key"), checkpoint_dir=str(tmp_path / "ck")),
    )
    old = str(Identity.generate().peer_id)
    line = joining.warn_if_other_identity(node, 6, {"peer_id": old, "identity": "/home/me/.geomesh/id.key"})
    assert line == (
        f"--resume: the checkpoint of round 6 in {tmp_path / 'ck'} was written by PeerID {old} (key "
        f"/home/me/.geomesh/id.key), but this peer runs as PeerID {node.me} from --identity {tmp_path / 'typo.key'} "
        "(a key created now): continuing under the new PeerID, without the standing the swarm gave the old one; "
        "if --identity is mistyped, stop (Ctrl+C) and pass the key file that wrote the checkpoint"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [line]
    assert joining.warn_if_other_identity(node, 6, {"peer_id": node.me}) is None  # the same key
    assert joining.warn_if_other_identity(node, 6, {}) is None  # a checkpoint that recorded none


# ------------------------------------------------------------------ 4. a donor that moved on
class _Refusing:
    """A transport whose state stream is refused by the donor with ``reason``."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        self.code, self.reason = code, reason

    async def call_stream(self, address, method, payload, *, round=None, timeout=None):
        raise RpcError(address, method, self.code, self.reason)
        yield  # an async generator


@pytest.mark.parametrize(
    "code, reason, last, level",
    [
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "state for round 5 asked, this node holds round 6 (kept: none)",
            False,
            "INFO",
        ),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "state for round 5 asked, this node holds round 6 (kept: none)",
            True,
            "WARNING",
        ),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "state for round 5 asked, this node holds round 4 (kept: none)",
            False,
            "WARNING",
        ),
        (grpc.StatusCode.UNAVAILABLE, "this node has no state yet", False, "WARNING"),
    ],
)
async def test_a_donor_that_moved_on_is_info_unless_last(caplog, code, reason, last, level):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.sync.transfer")
    with pytest.raises(download.StateSyncError):
        await download.download_state(
            _Refusing(code, reason), ["127.0.0.1:9"], round=5, numel=4, expected_digest="d", last_attempt=last
        )
    lines = [r for r in caplog.records if r.getMessage().startswith("state piece 0 from 127.0.0.1:9")]
    assert [r.levelno for r in lines] == [getattr(logging, level)]
    if reason.endswith("holds round 6 (kept: none)"):
        assert lines[0].getMessage() == (
            "state piece 0 from 127.0.0.1:9 failed: the donor moved on to round 6 (round 5 asked); asked again at "
            "the newer round"
        )
    else:
        assert reason in lines[0].getMessage()


# ------------------------------------------------------------------ 5. the proof-of-work line, --version
def test_pow_line_says_computed_or_reused():
    assert pow_done_line(22, 0.012, False, "/k.pow") == (
        "proof of work (22 bits) computed in 0.01s; saved in /k.pow for later starts of this key"
    )
    assert pow_done_line(22, 12.4, False, None) == "proof of work (22 bits) computed in 12s"
    assert pow_done_line(22, 0.0, True, "/k.pow") == (
        "proof of work (22 bits) reused from /k.pow, computed at an earlier start of this key"
    )


@pytest.mark.parametrize("command", ["join", "demo", "profile", "identity", "status"])
def test_version_after_a_command(capsys, command):
    from geomesh_p2p import __version__
    from peer.cli import main

    with pytest.raises(SystemExit) as ei:
        main([command, "--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out == f"geomesh-peer {__version__}\n"


async def test_resume_from_a_checkpoint_of_another_peer_id_warns_then_resumes(caplog, tmp_path):
    """resume_from itself: the warning comes before the state is taken, and the resume goes on."""
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    run = RunConfig(seq_len=32)
    ident = Identity.generate()
    taken = []
    node = SimpleNamespace(
        me=str(ident.peer_id),
        identity=ident,
        cfg=NodeConfig(identity=str(tmp_path / "id.key"), checkpoint_dir=str(tmp_path / "ck")),
        config_hash=run.config_hash(),
        run_cfg=run,
        state_numel=4,
        _set_state=lambda rnd, theta, momentum: taken.append(rnd),
        verified=SimpleNamespace(restore=lambda m: None),
        penalties=SimpleNamespace(restore=lambda m: None),
        profile=SimpleNamespace(restore_delivered=lambda m, r: None),
        digest=None,
        rs=RoundState(),
    )
    old = str(Identity.generate().peer_id)
    meta = {"run_config_hash": run.config_hash(), "meta": {"peer_id": old, "identity": "/old/id.key"}}
    await joining.resume_from(node, (7, torch.zeros(4), torch.zeros(4), meta))
    assert taken == [7]
    assert node.rs.written_by == old  # its leaving record backs no start of this peer (red team 48b)
    messages = [r.getMessage() for r in caplog.records]
    warned = [m for m in messages if m.startswith("--resume: the checkpoint of round 7")]
    assert len(warned) == 1 and old in warned[0] and node.me in warned[0] and "/old/id.key" in warned[0]
    assert messages.index(warned[0]) < next(
        i for i, m in enumerate(messages) if m.startswith("resumed from checkpoint")
    )


def test_a_checkpoint_records_the_peer_id_and_the_key_it_came_from(tmp_path, monkeypatch):
    """What the resume's warning reads: the writer's PeerID and its --identity as an absolute path."""
    from geomesh_p2p.model import state
    from geomesh_p2p.model.optim import OuterNesterov
    from geomesh_p2p.node.checkpoints import Checkpointer
    from geomesh_p2p.round.rules import RoundState
    from geomesh_p2p.trust.standing import Standing

    monkeypatch.chdir(tmp_path)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    theta = torch.arange(8, dtype=torch.float32)
    outer.buf = torch.zeros(8)
    writer = Checkpointer(
        RunConfig(),
        NodeConfig(checkpoint_dir=str(tmp_path / "ck"), identity="keys/p1.key"),
        RoundState(me="PEER-1", round=3, digest="d" * 64, standing=Standing()),
        "h",
        theta=lambda: theta,
        outer=lambda: outer,
    )
    assert writer.checkpoint() is not None
    meta = state.load_latest_checkpoint(tmp_path / "ck")[3]["meta"]
    assert (meta["peer_id"], meta["identity"]) == ("PEER-1", str(tmp_path / "keys" / "p1.key"))
