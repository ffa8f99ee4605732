"""Fixes of the adversarial review's MEDIUM/LOW findings (session 5): the state server's request tables are
bounded and a cheap request costs a donor no copy (M1, M2); start-up checks of the CLIs (M3, L1, L2); every
background evaluation lands in the round log (L3). In-process where possible (real transports on
127.0.0.1), the CLI checks by running the console script's module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.model.state import GlobalState
from geomesh_p2p.sync.download import download_state
from geomesh_p2p.sync import server as state_server
from geomesh_p2p.sync.server import StateServer
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import STATE_GET, STATE_UPDATE
from geomesh_p2p.wire import state_pb2

RUN = "review-fixes"
REPO = Path(__file__).resolve().parents[2]
P = 1 << 14
CHUNK = 8 << 10


def _state(round: int = 5) -> GlobalState:
    g = torch.Generator().manual_seed(3)
    gs = GlobalState(P, 1)
    gs.load(round, torch.randn(P, generator=g), torch.randn(P, generator=g) * 1e-2)
    return gs


def _advance(gs: GlobalState, srv: StateServer, outer: OuterNesterov, r: int) -> None:
    """Round ``r``'s outer step as the node makes it: retain, record, step, seal."""
    agg = torch.full((P,), 1e-3)
    with gs.lock:
        srv.retain()
        srv.updates.record(r, gs.digest, [(0, P)], (), agg)
        outer_step_per_part(outer, gs.theta, agg, [(0, P)], r, [])
        gs.commit(r + 1)
        srv.updates.seal(r + 1, gs.digest)


async def _get(t: Transport, addr: str, req: state_pb2.StateRequest) -> int:
    """Bytes of a GetState stream (raises RpcError when refused)."""
    n = 0
    async for v in t.call_stream(addr, STATE_GET, req.SerializeToString(), round=req.round, timeout=10):
        n += len(state_pb2.StateChunk.FromString(v.payload).data)
    return n


@pytest.fixture
async def donor():
    gs = _state()
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buf = gs.opt_state
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    srv = StateServer(t, chunk_bytes=CHUNK, state=gs)
    addr = await t.start()
    clients: list[Transport] = []

    def client() -> Transport:
        c = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
        clients.append(c)
        return c

    try:
        yield gs, srv, addr, outer, client
    finally:
        for c in clients:
            await c.stop()
        await t.stop(grace=0)


# --- M1: per-round request tables are bounded --------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_requests_for_rounds_not_held_are_refused_before_anything_is_recorded(donor):
    gs, srv, addr, _, client = donor
    atk = client()
    for i in range(200):  # the review's attack: descending rounds never expired
        with pytest.raises(RpcError, match="holds round 5") as e:
            await _get(atk, addr, state_pb2.StateRequest(round=10**6 - i, length=1))
        assert e.value.code.name == "FAILED_PRECONDITION"
    assert srv.tracked() == 0
    assert await _get(atk, addr, state_pb2.StateRequest(round=5, length=1)) == 1
    assert srv.tracked() == 1


@pytest.mark.timeout(60)
async def test_callers_tracked_are_lru_capped(donor, monkeypatch):
    gs, srv, addr, _, client = donor
    monkeypatch.setattr(state_server, "MAX_TRACKED_CALLERS", 3)
    for _ in range(5):  # five outsiders, one byte each
        assert await _get(client(), addr, state_pb2.StateRequest(round=5, length=1)) == 1
    assert srv.tracked() == 3


@pytest.mark.timeout(60)
async def test_a_caller_is_served_a_rounds_state_three_times_not_in_a_loop(donor):
    """A donor serves one caller at most STATE_SERVES_PER_CALLER (3) whole states of a round (a download, a restart,
    a digest retry); the request that would pass it is refused with the reason before any byte (PERMISSION_DENIED: the
    joiner takes its pieces elsewhere), while another caller is served. A state is ~4P bytes: a loop of downloads
    made the donor's upload an amplifier."""
    gs, srv, addr, _, client = donor
    assert state_server.STATE_SERVES_PER_CALLER == 3
    looper = client()
    for _ in range(3):
        assert await _get(looper, addr, state_pb2.StateRequest(round=5)) == gs.nbytes
    with pytest.raises(RpcError) as e:
        await _get(looper, addr, state_pb2.StateRequest(round=5, length=1))
    assert e.value.code.name == "PERMISSION_DENIED"
    assert "the state of round 5 was served to this caller 3 times already" in e.value.reason
    assert await _get(client(), addr, state_pb2.StateRequest(round=5)) == gs.nbytes


# --- M2: a cheap request costs no copy; a real download still gets its snapshot ---------------------------


@pytest.mark.timeout(60)
async def test_a_one_byte_request_makes_no_copy_and_no_eager_encoding(donor):
    gs, srv, addr, outer, client = donor
    atk = client()
    for r in (5, 6, 7):
        assert await _get(atk, addr, state_pb2.StateRequest(round=r, length=1)) == 1
        _advance(gs, srv, outer, r)
        assert srv.kept_rounds() == []
        # not eager: only the newest round's raw update is kept, nothing is encoded
        assert srv.updates.rounds() == [r] and srv.updates.get(r) is not None
        assert not srv.updates.catching_up


@pytest.mark.timeout(60)
async def test_a_real_download_keeps_its_rounds_snapshot(donor):
    gs, srv, addr, outer, client = donor
    joiner = client()
    want = gs.digest
    # a joiner's piece of 1/8 of the state (eight donors): above the 1/MIN_SHARE share
    assert await _get(joiner, addr, state_pb2.StateRequest(round=5, length=gs.nbytes // 8)) == gs.nbytes // 8
    _advance(gs, srv, outer, 5)
    assert srv.kept_rounds() == [5]
    snap = await download_state(joiner, [addr], round=5, numel=P, expected_digest=want)
    assert snap.round == 5 and snap.digest == want


@pytest.mark.timeout(60)
async def test_a_one_byte_update_request_does_not_make_the_donor_eager(donor):
    gs, srv, addr, outer, client = donor
    _advance(gs, srv, outer, 5)
    atk = client()
    req = state_pb2.StateRequest(round=5, length=1)
    got = [v async for v in atk.call_stream(addr, STATE_UPDATE, req.SerializeToString(), round=5, timeout=10)]
    assert len(state_pb2.StateChunk.FromString(got[0].payload).data) == 1
    assert not srv.updates.catching_up  # rounds sealed from now on are not encoded eagerly
    # a real catch-up (the whole update) does
    got = [
        v
        async for v in atk.call_stream(
            addr, STATE_UPDATE, state_pb2.StateRequest(round=5).SerializeToString(), round=5, timeout=10
        )
    ]
    assert srv.updates.catching_up


# --- M3, L1, L2: start-up checks in one line, before any network --------------------------------------------


def _peer(argv, capsys, monkeypatch) -> tuple[int, str]:
    """``geomesh-peer ARGV`` in-process: (exit status, stderr). Exits before joining (the bootstrap given
    does not exist: reaching the join would take its ~30 s of retries and print other lines)."""
    from peer.cli import main

    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


def _join(tmp_path, *extra) -> list[str]:
    return [
        "join",
        "--bootstrap",
        "127.0.0.1:1",
        "--run-id",
        "x",
        "--rounds",
        "1",
        "--identity",
        str(tmp_path / "id.key"),
        *extra,
    ]


@pytest.fixture
def binary(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_bytes(b"\xff\xfe\x00\x81")
    p.chmod(0o600)
    return p


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--allow-peers", "geomesh-peer join: --allow-peers {p} is not UTF-8 text (byte 0)"),
        ("--model-config", "geomesh-peer join: --model-config {p} is not UTF-8 text (byte 0)"),
        (
            "--identity",
            "geomesh-peer join: identity file {p} is corrupt: expected a 32-byte Ed25519 key, found 4 bytes",
        ),
    ],
)
def test_binary_files_read_at_start_fail_in_one_line(tmp_path, binary, capsys, monkeypatch, flag, expected):
    rc, err = _peer(_join(tmp_path, flag, str(binary)), capsys, monkeypatch)
    assert rc == 2
    assert err.strip().splitlines()[-1] == expected.format(p=binary)
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_log_json_in_a_missing_folder_is_refused_at_start(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "nonexistent" / "x.jsonl"
    rc, err = _peer(_join(tmp_path, "--log-json", str(bad)), capsys, monkeypatch)
    assert rc == 2
    assert err.strip().splitlines()[-1] == (f"geomesh-peer join: --log-json {bad}: folder {bad.parent} does not exist")
    assert not bad.parent.exists()  # nothing created (the events file neither)


@pytest.mark.timeout(60)
def test_summary_json_that_is_a_folder_is_refused_at_start(tmp_path, capsys, monkeypatch):
    rc, err = _peer(_join(tmp_path, "--summary-json", str(tmp_path)), capsys, monkeypatch)
    assert rc == 2
    assert (
        err.strip().splitlines()[-1]
        == f"geomesh-peer join: --summary-json {tmp_path}: is a folder, expected a file path"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--run-id", "--host", "--identity", "--device", "--model"])
def test_empty_identifiers_are_refused(tmp_path, capsys, monkeypatch, flag):
    rc, err = _peer(_join(tmp_path, flag, ""), capsys, monkeypatch)
    assert rc == 2
    assert (
        err.strip().splitlines()[-1]
        == f"geomesh-peer join: error: argument {flag}: must not be empty (see geomesh-peer join --help)"
    )


def test_the_config_models_refuse_an_empty_run_id():
    from pydantic import ValidationError

    from geomesh_p2p.config.models import BootstrapConfig, NodeConfig, RunConfig

    for make in (
        lambda: RunConfig(run_id=""),
        lambda: BootstrapConfig(run_id=""),
        lambda: NodeConfig(host=""),
        lambda: NodeConfig(identity=""),
    ):
        with pytest.raises(ValidationError, match="at least 1 character"):
            make()


# --- L3: every background evaluation lands in a row -------------------------------------------------------


@pytest.mark.timeout(60)
async def test_every_background_evaluation_lands_in_a_row():
    from tests.unit.test_round_driver import _peers

    (peer,) = _peers(1)
    snaps = []
    peer.snapshot_for_eval = lambda: snaps.append(peer.theta.clone())
    peer.evaluate_snapshot = lambda max_batches=8: 1000.0 - float(snaps[-1].sum())  # tells snapshots apart
    drv = peer.driver(rounds=3)
    drv.cfg.eval_background = True
    await drv.run()
    rows = drv.history
    assert len(snaps) == 2  # rounds 0 and 1 in the background; round 2, the last, at once (the fakes' 100.0)
    evals = {r.eval_round: r.eval_ppl for r in rows if r.eval_round is not None}
    evals.update(
        {
            r.extra["eval_background"]["eval_round"]: r.extra["eval_background"]["eval_ppl"]
            for r in rows
            if "eval_background" in r.extra
        }
    )
    assert evals == {0: 1000.0 - float(snaps[0].sum()), 1: 1000.0 - float(snaps[1].sum()), 2: 100.0}
    # round 1's evaluation is in the last row, with its round, beside the last round's own
    assert rows[2].extra["eval_background"] == {"eval_ppl": 1000.0 - float(snaps[1].sum()), "eval_round": 1}
    assert (rows[2].eval_ppl, rows[2].eval_round) == (100.0, 2)
    assert '"eval_background": {"eval_ppl"' in rows[2].to_json()
