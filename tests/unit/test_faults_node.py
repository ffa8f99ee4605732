"""Network faults of issue 14 at the node's level (the DHT-level tests are in test_faults_net.py):
an advertised address nobody can dial (#5), a run whose peers all left (#2), skewed clocks (#1)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.net import swarm_time as clock
from geomesh_p2p.telemetry import events
from geomesh_p2p.node import joining as joining_mod
from geomesh_p2p.model import state as gstate
from geomesh_p2p.dht import IncompatibleSwarmError
from geomesh_p2p.dht.state import Reachability
from geomesh_p2p.dht.progress import SwarmProgress
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig, StoppedBeforeJoining
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(60)

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


# ---------------------------------------------------------------- 5. unreachable advertised address
class _FakeDHT:
    """What PeerNode.record_address reads of a DHTNode: the address it found dialable (or None)."""

    def __init__(self, address, reachable):
        self.reachability = Reachability(address, reachable)
        self.advertised_address = None if reachable is False else address
        self.clock_offset_s = 0.0


def _bare_node(**cfg) -> PeerNode:
    node = PeerNode(RunConfig(seq_len=32), NodeConfig(**cfg), identity=Identity.generate())
    node.transport = SimpleNamespace(address="127.0.0.9:4000")
    return node


@pytest.mark.parametrize("reachable, named", [(True, "127.0.0.9:4000"), (None, "127.0.0.9:4000"), (False, None)])
def test_records_name_the_address_a_bootstrap_could_dial(reachable, named):
    node = _bare_node()
    assert node._placeholder_record().address == "127.0.0.9:4000"  # before the DHT exists: the transport's
    node.dht = _FakeDHT("127.0.0.9:4000", reachable)
    rec = node._placeholder_record()
    assert rec.address == named and rec.client_only is (named is None)


# ---------------------------------------------------------------- 2. a run whose peers all left
def _progress(rnd=7):
    """The bootstrap saw round ``rnd`` 30 s ago, in swarm time (another test of this worker may have left a clock
    offset set: ``time.time()`` alone made ``seen_ago_s`` off by that offset, a failure seen once in a parallel run)."""
    return SwarmProgress(round=rnd, seen_at=clock.swarm_time() - 30, peers=3, by="BootstrapPeerIdBase58")


def _rec(peer_id: str, rnd: int, digest="ab" * 32) -> PeerRecord:
    return peer_record(
        peer_id,
        address="127.0.0.1:7000",
        memory_bytes=1,
        tokens_per_s={},
        max_batch=1,
        upload_bps=1e6,
        download_bps=1e6,
        version="0",
        protocol_version=0,
        run_config_hash="x",
        round=rnd,
        weights_digest=digest,
    )


def _empty_swarm_node(monkeypatch, progress, peers_seq=(), **cfg):
    """A node whose DHT reports ``progress`` and whose peers() returns each list of ``peers_seq`` in turn
    (then the last one); catch-up and resume are recorded, not run."""
    node = _bare_node(**cfg)
    node.dht = _FakeDHT("127.0.0.1:1", True)

    async def fake_progress(dht, run_id=None):
        assert dht is node.dht and run_id == node.run_cfg.run_id
        return progress

    monkeypatch.setattr(joining_mod, "swarm_progress", fake_progress)
    calls = {"peers": 0, "catch_up": 0, "set_state": []}
    seq = list(peers_seq)

    async def peers(include_leaving=False):
        calls["peers"] += 1
        return [joining_mod.placeholder_record(node)] + (seq.pop(0) if len(seq) > 1 else seq[0] if seq else [])

    async def catch_up():
        calls["catch_up"] += 1

    node.peers = peers
    node.resync.catch_up = catch_up  # type: ignore[method-assign]
    node._set_state = lambda rnd, theta, mom: calls["set_state"].append((rnd, theta.clone(), mom.clone()))
    node.digest = "cd" * 32
    return node, calls


async def test_no_known_progress_starts_from_the_seed_silently(monkeypatch):
    for progress in (None, _progress(0)):
        node, calls = _empty_swarm_node(monkeypatch, progress)
        with events.capture() as said:
            await node._on_empty_swarm()
        assert calls == {"peers": 0, "catch_up": 0, "set_state": []}
        assert said == []


async def test_empty_swarm_seed_says_so_and_keeps_round_0(monkeypatch):
    progress = _progress(7)
    node, calls = _empty_swarm_node(monkeypatch, progress, on_empty_swarm="seed")
    with events.capture() as said:
        await node._on_empty_swarm()
    elapsed = clock.swarm_time() - progress.seen_at  # >= 30: the node's set-up may be slow on a loaded host
    assert [e["event"] for e in said] == ["empty_swarm"]
    (e,) = said
    assert (e["peer"], e["run_id"], e["round"], e["bootstrap"], e["peers"], e["action"]) == (
        node.me,
        "geomesh-demo",
        7,
        "BootstrapPeerIdBase58",
        3,
        "seed",
    )
    assert 30 <= e["seen_ago_s"] <= elapsed and e["level"] == "WARNING"
    assert calls == {"peers": 0, "catch_up": 0, "set_state": []}


async def test_empty_swarm_resume_without_checkpoint_fails_in_one_line(monkeypatch, tmp_path):
    node, _ = _empty_swarm_node(monkeypatch, _progress(7), on_empty_swarm="resume")
    with pytest.raises(UserFacingError, match=r"^--on-empty-swarm resume needs --checkpoint-dir"):
        await node._on_empty_swarm()
    node, _ = _empty_swarm_node(
        monkeypatch, _progress(7), on_empty_swarm="resume", checkpoint_dir=str(tmp_path / "empty")
    )
    with pytest.raises(UserFacingError, match=rf"^--on-empty-swarm resume: no checkpoint in {tmp_path}/empty$"):
        await node._on_empty_swarm()


async def test_empty_swarm_resume_takes_the_newest_checkpoint(monkeypatch, tmp_path):
    node, calls = _empty_swarm_node(monkeypatch, _progress(7), on_empty_swarm="resume", checkpoint_dir=str(tmp_path))
    node.state_numel = 4
    theta, mom = torch.arange(4, dtype=torch.float32), torch.full((4,), 0.5)
    gstate.save_checkpoint(tmp_path, round=5, theta=theta, momentum=mom, meta={"run_config_hash": node.config_hash})
    await node._on_empty_swarm()
    [(rnd, t, m)] = calls["set_state"]
    assert rnd == 5 and torch.equal(t, theta) and torch.equal(m, mom)


async def test_empty_swarm_wait_continues_from_its_own_checkpoint_of_the_runs_round(monkeypatch, tmp_path):
    """Fresh-user trial: the README's one-machine swarm run again with the same run id (the bootstrap remembered
    round 12) had every peer wait for a peer of the run, none of them announced, for good. A peer whose own
    checkpoint holds the round the run was at continues from it; an older one is named in the waiting line."""
    node, calls = _empty_swarm_node(monkeypatch, _progress(7), checkpoint_dir=str(tmp_path))
    node.state_numel = 4
    theta, mom = torch.arange(4, dtype=torch.float32), torch.full((4,), 0.5)
    gstate.save_checkpoint(tmp_path, round=7, theta=theta, momentum=mom, meta={"run_config_hash": node.config_hash})
    await asyncio.wait_for(node._on_empty_swarm(), 10)
    [(rnd, t, m)] = calls["set_state"]
    assert rnd == 7 and torch.equal(t, theta) and calls["peers"] == 0
    older = tmp_path / "older"
    node, calls = _empty_swarm_node(
        monkeypatch, _progress(7), peers_seq=[[], [_rec("PeerBack", 9)]], checkpoint_dir=str(older)
    )
    node.state_numel = 4
    gstate.save_checkpoint(older, round=5, theta=theta, momentum=mom, meta={"run_config_hash": node.config_hash})

    async def no_wait(event, seconds):
        return event.is_set()

    monkeypatch.setattr(joining_mod, "wait_event", no_wait)
    with events.capture() as said:
        await asyncio.wait_for(node._on_empty_swarm(), 10)
    assert calls["set_state"] == [] and calls["catch_up"] == 1  # it waited, then caught up with the peer back
    [waiting] = [e for e in said if e["event"] == "empty_swarm_waiting"]
    assert f"checkpoint in {older} is at round 5: --on-empty-swarm resume continues from it" in waiting["message"]


async def test_empty_swarm_wait_polls_until_a_peer_is_back_then_catches_up(monkeypatch):
    monkeypatch.setattr(joining_mod, "EMPTY_SWARM_POLL_MAX_S", 1.0)
    waits = []

    async def no_wait(event, seconds):  # the backoff's pauses, recorded instead of slept
        waits.append(seconds)
        return event.is_set()

    monkeypatch.setattr(joining_mod, "wait_event", no_wait)
    back = [_rec("PeerBack", 9)]
    node, calls = _empty_swarm_node(monkeypatch, _progress(7), peers_seq=[[], [], back])
    with events.capture() as said:
        await node._on_empty_swarm()
    assert calls["peers"] == 3 and calls["catch_up"] == 1 and waits == [1.0, 1.0, 1.0]
    # one waiting line for the whole wait, not one per poll
    assert [(e["event"], e.get("action")) for e in said] == [
        ("empty_swarm", "wait"),
        ("empty_swarm_waiting", None),
        ("swarm_back", None),
    ]
    assert said[2]["peers"] == ["PeerBack"] and said[2]["run_id"] == "geomesh-demo"


async def test_empty_swarm_of_another_run_config_fails_at_once_instead_of_waiting(monkeypatch):
    other = SwarmProgress(round=7, seen_at=time.time() - 30, peers=3, by="B", config_hash="f00d" * 16)
    node, calls = _empty_swarm_node(monkeypatch, other, peers_seq=[[]])
    node.config_hash = "beef" * 16
    with pytest.raises(IncompatibleSwarmError, match=r"round 7 with another run config \(hash f00df00df00d there, "):
        await asyncio.wait_for(node._on_empty_swarm(), 10)
    assert calls["peers"] == 0 and calls["catch_up"] == 0
    same = SwarmProgress(round=7, seen_at=time.time() - 30, peers=3, by="B", config_hash="beef" * 16)
    node, calls = _empty_swarm_node(monkeypatch, same, peers_seq=[[], [_rec("PeerBack", 9)]])
    node.config_hash = "beef" * 16

    async def no_wait(event, seconds):  # the backoff's pauses, not slept
        return event.is_set()

    monkeypatch.setattr(joining_mod, "wait_event", no_wait)
    await asyncio.wait_for(node._on_empty_swarm(), 10)  # the same config: waits, then catches up
    assert calls["catch_up"] == 1


async def test_empty_swarm_of_another_run_config_names_the_fields_that_differ(monkeypatch):
    theirs = RunConfig(seq_len=32, inner_lr=0.0003)
    good = SwarmProgress(7, time.time() - 30, 3, "B", theirs.config_hash(), theirs.model_dump())
    node, _ = _empty_swarm_node(monkeypatch, good, peers_seq=[[]])
    with pytest.raises(IncompatibleSwarmError) as e:
        await asyncio.wait_for(node._on_empty_swarm(), 10)
    here = node.run_cfg.inner_lr
    assert f"; inner_lr: {here!r} here vs 0.0003 in the swarm): its peers could not" in str(e.value)
    # A config that does not hash to the entry's hash is the bootstrap's word only: the hashes alone are shown.
    forged = SwarmProgress(7, time.time() - 30, 3, "B", theirs.config_hash(), {**theirs.model_dump(), "seq_len": 64})
    node, _ = _empty_swarm_node(monkeypatch, forged, peers_seq=[[]])
    with pytest.raises(IncompatibleSwarmError) as e:
        await asyncio.wait_for(node._on_empty_swarm(), 10)
    assert f"{node.config_hash[:12]} here): its peers could not" in str(e.value) and "in the swarm" not in str(e.value)


def test_the_fields_that_differ_are_shown_cut_to_a_line():
    """Red team, session 16: a hostile bootstrap's entry (or a peer's record) may carry a valid run config with a
    60 KB run id or a 4,300-digit seed that hashes to its own hash: the refusal names the field, not all of it."""
    theirs = RunConfig(seq_len=32, run_id="x" * 60_000, seed=int("9" * 4299))
    node = SimpleNamespace(run_cfg=RunConfig(seq_len=64))
    diff = joining_mod.announced_config_differences(node, theirs.model_dump(), theirs.config_hash())
    assert [d.split(":")[0] for d in diff] == ["run_id", "seed", "seq_len"]
    assert diff[2] == "seq_len: 64 here vs 32 in the swarm"
    assert all(len(d) < 200 for d in diff)
    assert diff[0].startswith("run_id: 'geomesh-demo' here vs 'xxxx") and diff[0].endswith("... in the swarm")


def test_progress_entries_carry_the_run_config_within_a_size_cap():
    cfg = RunConfig(seq_len=32).model_dump()
    p = SwarmProgress(7, 12.5, 3, "B", "ab" * 8, cfg)
    assert json.loads(p.to_bytes())["config"] == cfg and SwarmProgress.from_bytes(p.to_bytes(), by="B") == p
    big = SwarmProgress(7, 12.5, 3, "B", "ab" * 8, {"x": "y" * 9000})
    assert "config" not in json.loads(big.to_bytes())
    assert "config" not in json.loads(SwarmProgress(7, 12.5, 3, "B", "", cfg).to_bytes())  # no hash: no config
    with pytest.raises(ValueError, match="malformed"):
        SwarmProgress.from_bytes(b'{"peers": 3, "round": 7, "seen_at": 12.5, "config_hash": "ab", "config": [1]}')


def test_progress_entries_carry_the_config_hash_and_read_older_entries():
    p = SwarmProgress(7, 12.5, 3, "B", "ab" * 8)
    assert p.to_bytes() == b'{"config_hash": "abababababababab", "peers": 3, "round": 7, "seen_at": 12.5}'
    assert SwarmProgress.from_bytes(p.to_bytes(), by="B") == p
    old = SwarmProgress.from_bytes(b'{"peers": 3, "round": 7, "seen_at": 12.5}')
    assert old.config_hash == "" and old.to_bytes() == b'{"peers": 3, "round": 7, "seen_at": 12.5}'
    with pytest.raises(ValueError, match="malformed"):
        SwarmProgress.from_bytes(b'{"peers": 3, "round": 7, "seen_at": 12.5, "config_hash": 5}')


async def test_empty_swarm_wait_ends_on_stop(monkeypatch):
    node, calls = _empty_swarm_node(monkeypatch, _progress(7), peers_seq=[[]])
    waiter = asyncio.ensure_future(node._on_empty_swarm())
    await asyncio.sleep(0)  # it logs the line and pauses for its first backoff
    assert not waiter.done()
    node.request_stop()  # Ctrl+C
    with pytest.raises(StoppedBeforeJoining, match="waiting for a peer of the run"):
        await asyncio.wait_for(waiter, 10)
    assert calls["catch_up"] == 0


# ---------------------------------------------------------------- 1. swarm time
def test_swarm_clock_follows_the_dht_offset(monkeypatch):
    # This machine's wall clock, injected: swarm time is exactly it plus the offset.
    monkeypatch.setattr(clock, "time", SimpleNamespace(time=lambda: 5000.0))
    try:
        clock.set_offset(30.0)
        assert clock.swarm_time() == 5030.0
        assert clock.to_local(1000.0) == 970.0
        dht = SimpleNamespace(clock_offset_s=-12.0)
        clock.follow(lambda: dht.clock_offset_s)
        assert clock.offset() == -12.0
        dht.clock_offset_s = 4.0  # a re-measurement applies at the next read, no hook needed
        assert clock.offset() == 4.0
        clock.follow(None)
        dht.clock_offset_s = 99.0
        assert clock.offset() == 4.0  # the last value read stays
        with pytest.raises(ValueError):
            clock.set_offset(float("nan"))
    finally:
        clock.set_offset(0.0)


# ---------------------------------------------------------------- flags: addresses and metrics host
def test_join_flags_parse_addresses_with_the_one_parser_and_take_a_metrics_host():
    from peer.cli import build_parser
    from peer.node_cli import node_config_from, reachability_warning

    p = build_parser()
    ns = p.parse_args(["join", "--bootstrap", "[::1]:31337", "--bootstrap", "127.0.0.1:5", "--metrics-port", "9100"])
    cfg = node_config_from(ns)
    assert cfg.bootstrap == ["[::1]:31337", "127.0.0.1:5"]
    assert (cfg.metrics_host, cfg.metrics_port, cfg.on_empty_swarm) == ("127.0.0.1", 9100, "wait")
    ns = p.parse_args(["join", "--metrics-host", "0.0.0.0", "--on-empty-swarm", "resume"])
    assert (node_config_from(ns).metrics_host, node_config_from(ns).on_empty_swarm) == ("0.0.0.0", "resume")
    # a loopback bootstrap, bracketed IPv6 included, is no reason to warn about a loopback --host
    assert reachability_warning(p.parse_args(["join", "--bootstrap", "[::1]:5"])) is None
    warn = reachability_warning(p.parse_args(["join", "--bootstrap", "[2001:db8::1]:5"]))
    assert warn is not None and "[2001:db8::1]:5 is on another machine" in warn


@pytest.mark.parametrize(
    "bad, why", [("::1:5", "needs brackets"), ("host", "has no port"), ("h:70000", "not a number in 1..65535")]
)
def test_a_bad_bootstrap_address_is_refused_naming_why(bad, why, capsys):
    from peer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--bootstrap", bad])
    err = capsys.readouterr().err
    assert repr(bad) in err and "HOST:PORT" in err and why in err, err
    assert err.count("HOST:PORT") == 1, (
        err
    )  # said once (fresh user 41: "expected HOST:PORT, got ... expected HOST:PORT")


# ---------------------------------------------------------------- process tests (peer.cli join)
def _digests(swarm, names, r):
    return {n: next((x["digest"] for x in swarm.rows(n) if x["round"] == r), None) for n in names}


def _start_entry(swarm, name, *args) -> str:
    """Start ``name`` on port 0; returns the address it bound (HOST:PORT), for the others' --bootstrap."""
    swarm.peer(name, *args)
    return swarm.address(name)


async def test_a_leaving_peer_serves_its_last_parts_and_gives_the_replies_until_the_deadline():
    """Before its server stops, a leaving peer waits for the participants still pulling its last round's
    parts, and the server's stop then gives the replies on the wire up to that round's exchange deadline
    (rs10: the 0.5 s grace cut a 2.8 MB relay result on a 4.64 Mbit/s link)."""
    node = _bare_node()
    lingered = []

    class Collective:
        left = {0: ["SlowPeer"]}

        def unserved(self):
            return dict(self.left)

        async def linger(self, until):
            lingered.append(until)
            self.left = {}
            return {}

    node.collective = Collective()
    assert await node._serve_last_parts() == 0.5  # no round exchanged yet
    deadline = clock.swarm_time() + 30
    node._round_driver = SimpleNamespace(last_plan=SimpleNamespace(round=4, exchange_deadline=deadline))
    with events.capture("serving_last_parts") as said:
        grace = await node._serve_last_parts()
    assert lingered == [deadline] and [e["readers"] for e in said] == [["SlowPeer"]]
    assert 28 < grace <= 30  # nothing left to hand out, but what was handed out may still be on the wire
    node._round_driver = SimpleNamespace(last_plan=SimpleNamespace(round=4, exchange_deadline=deadline - 60))
    assert await node._serve_last_parts() == 0.5  # the deadline passed: the readers gave up already


async def test_resuming_behind_a_run_the_bootstrap_saw_further_along_says_so(monkeypatch):
    """--resume from round 6 of a run a bootstrap saw at round 12, no peer live: one WARNING naming both
    rounds (the peer trains alone from an older state); nothing when the checkpoint is the newest round."""
    node, _ = _empty_swarm_node(monkeypatch, _progress(12), peers_seq=[[]])
    node.round = 6
    with events.capture("resumed_behind_swarm") as said:
        await node._warn_if_resumed_behind()
    assert [(e["round"], e["swarm_round"]) for e in said] == [(6, 12)]
    assert "if none does, this peer trains alone from round 6, a fork of the run" in said[0]["message"]
    # a checkpoint trained with others, --min-peers 2 or more: it waits for them (fresh user 50), and says so
    node.rs.resumed_with, node.cfg.min_peers = ("Other",), 3
    with events.capture("resumed_behind_swarm") as said:
        await node._warn_if_resumed_behind()
    assert (
        "if none does, this peer waits for the peers it trained its checkpoint with, then trains with them from "
        "round 6, a fork of the run (to avoid that, resume from a checkpoint of round 12)"
    ) in said[0]["message"]
    node.round = 12
    with events.capture("resumed_behind_swarm") as said:
        await node._warn_if_resumed_behind()
    assert said == []


async def test_resuming_behind_names_the_newest_round_the_leaving_peers_records_show(monkeypatch):
    """Fresh user 46: resumed at round 10, the warning said the bootstrap saw round 11 ("resume from a checkpoint of
    round 11") while the two peers that finished had left records of round 15, which the same peer read a second
    later ("the swarm was last seen at round 15"). The newest round known is the one named and advised."""
    gone = [
        _rec(f"Finished{i}", 15, digest="ef" * 32).model_copy(update={"leaving": True, "address": f"127.0.0.1:700{i}"})
        for i in (1, 3)
    ]
    node, _ = _empty_swarm_node(monkeypatch, _progress(11), peers_seq=[gone])
    node.round = 10
    with events.capture("resumed_behind_swarm") as said:
        await node._warn_if_resumed_behind()
    assert [(e["round"], e["swarm_round"], e["bootstrap_round"]) for e in said] == [(10, 15, 11)]
    assert "reached round 15 (bootstrap Bootstra saw run" in said[0]["message"]
    assert said[0]["message"].endswith("resume from a checkpoint of round 15)")


async def test_the_join_notes_the_round_it_knew_the_run_at_for_the_whole_swarm_end(monkeypatch, tmp_path):
    """Red team 46: the round a bootstrap or the leaving peers' records showed the run at, as the peer joined, is
    kept (``rs.known_round``): a peer resumed (or ``--on-empty-swarm resume``) at round 0 behind it is no whole
    swarm at its end (``RoundDriver.run(known_round=...)``); ``--on-empty-swarm seed`` starts the run anew (0)."""
    node, _ = _empty_swarm_node(monkeypatch, _progress(15), peers_seq=[[]])
    node.round = 0
    await node._warn_if_resumed_behind()
    assert node.rs.known_round == 15
    node, _ = _empty_swarm_node(monkeypatch, _progress(15), on_empty_swarm="resume", checkpoint_dir=str(tmp_path))
    node.state_numel = 4
    meta = {"run_config_hash": node.config_hash}
    gstate.save_checkpoint(tmp_path, round=0, theta=torch.zeros(4), momentum=torch.zeros(4), meta=meta)
    await node._on_empty_swarm()
    assert node.rs.known_round == 15
    node, _ = _empty_swarm_node(monkeypatch, _progress(15), on_empty_swarm="seed")
    await node._on_empty_swarm()
    assert node.rs.known_round == 0


@pytest.mark.parametrize("where", ["start", "initial_state"])
async def test_a_peer_refused_before_it_took_the_runs_state_writes_no_checkpoint(monkeypatch, tmp_path, where):
    """Fresh-user trial 41: a join refused after start-up (the remembered swarm had another run config) wrote a
    679 MB round-0 checkpoint of the seed on its way out, which a later ``--resume`` would have started from."""
    from geomesh_p2p.node import joining

    node = _bare_node(checkpoint_dir=str(tmp_path / "ck"))
    refused = IncompatibleSwarmError("run 'R' was at round 7 with another run config")

    async def ok(*a, **k):
        return None

    async def refuse(*a, **k):
        raise refused

    monkeypatch.setattr(node, "start", refuse if where == "start" else ok)
    monkeypatch.setattr(joining, "initial_state", refuse if where == "initial_state" else ok)
    shut = []

    async def shutdown():
        shut.append(node.checkpoints.skip)
        assert await node.checkpoints.final_checkpoint() is None

    monkeypatch.setattr(node, "shutdown", shutdown)
    with pytest.raises(IncompatibleSwarmError):
        await node.run()
    assert shut == [True] and not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "ckpt_round, unanswered, raises, continued, leaving",
    [
        (7, 7, False, True, False),  # the holder exited (its dial-back refused): its own checkpoint of round 7
        (7, 7, False, True, True),  # its leaving record only, the bootstrap knowing no round yet: the same
        (7, 7, True, True, False),  # downloads refused at the connection until the catch-up gave up
        (5, 7, False, False, False),  # its checkpoint is behind the run: the seed's state, as before
        (7, None, False, False, False),  # a holder answered with another state: not its checkpoint
    ],
)
async def test_a_fresh_peer_whose_state_holders_all_left_continues_from_its_checkpoint_of_the_runs_round(
    monkeypatch, tmp_path, ckpt_round, unanswered, raises, continued, leaving
):
    """Fresh user 47: two peers ran --rounds 2 with --checkpoint-dir; one restarted 1 s later without --resume read
    the other's record (not leaving: it had just exited), whose address did not answer, and trained the seed's state
    alone (exit 3), its own checkpoint of round 2 unused. When every holder of a state did not answer (no connection)
    and its checkpoint holds the run's known round, it continues from it, as with an empty swarm."""
    from geomesh_p2p.sync.download import StateSyncError

    node, calls = _empty_swarm_node(
        monkeypatch,
        None,
        peers_seq=[[_rec("PeerGone", 7).model_copy(update={"leaving": leaving})]],
        checkpoint_dir=str(tmp_path),
    )
    node.state_numel = 4
    theta, mom = torch.arange(4, dtype=torch.float32), torch.full((4,), 0.5)
    gstate.save_checkpoint(
        tmp_path, round=ckpt_round, theta=theta, momentum=mom, meta={"run_config_hash": node.config_hash}
    )

    async def no_check(node):
        pass

    async def catch_up():
        calls["catch_up"] += 1
        node.resync.unanswered = unanswered
        if raises:
            raise StateSyncError("could not download the swarm's state after 3 attempt(s)")

    monkeypatch.setattr(joining_mod, "check_swarm", no_check)
    monkeypatch.setattr(joining_mod, "flat_params", lambda model, out: out)
    node.resync.catch_up = catch_up  # type: ignore[method-assign]
    node.model, node.gstate = None, SimpleNamespace(theta=torch.zeros(4), opt_state=torch.ones(4))
    if raises and not continued:
        with pytest.raises(StateSyncError):
            await asyncio.wait_for(joining_mod.initial_state(node), 10)
    else:
        await asyncio.wait_for(joining_mod.initial_state(node), 10)
    assert calls["catch_up"] == 1 and calls["set_state"][0][0] == 0  # the seed first, then the download's try
    assert [s[0] for s in calls["set_state"][1:]] == ([7] if continued else [])
    if continued:
        assert torch.equal(calls["set_state"][1][1], theta) and node.rs.known_round == 7
