"""The global state in one contiguous buffer (issue 13): its digest equals the historical
``state.digest(theta, momentum)`` bitwise, checkpoints keep their format (the previous writer's
header and data bytes, readable by load_latest_checkpoint and export), reads for the state server are
byte ranges of the buffer and refuse a round the state no longer holds."""

from __future__ import annotations

import json
import struct
import threading

import pytest
import torch

from geomesh_p2p import state
from geomesh_p2p.state import GlobalState, StateChanged, StateError, digest

pytestmark = pytest.mark.timeout(60)

P = 1000


def _values(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(P, generator=g)
    theta[3] = -0.0  # signed zero and NaN payloads must survive bitwise
    theta[4] = float("nan")
    return theta, (torch.randn(k * P, generator=g) if k else None)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_digest_equals_the_two_tensor_digest_bitwise(k):
    theta, opt = _values(k)
    gs = GlobalState(P, k)
    assert gs.buffer.numel() == (1 + k) * P and gs.buffer.is_contiguous()
    assert gs.theta.data_ptr() == gs.buffer.data_ptr()  # views, not copies
    assert gs.opt_state.numel() == k * P
    dg = gs.load(7, theta, opt)
    assert dg == gs.digest == digest(theta, opt) == gs.compute_digest()
    assert gs.round == 7
    assert torch.equal(gs.theta.view(torch.int32), theta.view(torch.int32))
    if k:
        assert torch.equal(gs.opt_state.view(torch.int32), opt.view(torch.int32))
    # a one-bit change anywhere changes it
    gs.buffer.view(torch.int32)[-1] ^= 1
    assert gs.compute_digest() != dg


def test_load_without_optimizer_state_zeroes_it_and_commit_rehashes_in_place():
    theta, opt = _values(1)
    gs = GlobalState(P, 1)
    gs.load(1, theta, opt)
    gs.load(2, theta)  # no optimizer state given: zeros, as a fresh OuterNesterov's buffer
    assert torch.equal(gs.opt_state, torch.zeros(P)) and gs.digest == digest(theta, torch.zeros(P))
    with gs.lock:  # an outer step on the views, then commit (re-entrant: commit takes the lock too)
        gs.opt_state.mul_(0.9).add_(theta.nan_to_num())
        gs.theta.sub_(gs.opt_state, alpha=0.7)
        dg = gs.commit(3)
    assert gs.round == 3 and dg == digest(gs.theta.clone(), gs.opt_state.clone())


def test_bad_sizes_and_dtypes_are_refused():
    gs = GlobalState(P, 1)
    with pytest.raises(StateError, match=r"theta must be fp32 \[1000\]"):
        gs.load(1, torch.zeros(P + 1))
    with pytest.raises(StateError, match="theta must be fp32"):
        gs.load(1, torch.zeros(P, dtype=torch.float64))
    with pytest.raises(StateError, match=r"optimizer state must be fp32 \[1000\]"):
        gs.load(1, torch.zeros(P), torch.zeros(2 * P))
    with pytest.raises(StateError, match="buffer must be"):
        GlobalState(P, 1, buffer=torch.zeros(3 * P))
    with pytest.raises(StateError):
        GlobalState(0, 1)


def test_read_serves_byte_ranges_and_refuses_another_round():
    theta, opt = _values(1)
    gs = GlobalState(P, 1)
    gs.load(5, theta, opt)
    whole = theta.numpy().tobytes() + opt.numpy().tobytes()
    assert gs.read(0, gs.nbytes) == whole
    assert gs.read(100, 4100, round=5) == whole[100:4100]
    # the concatenation of reads is the stream payload a joiner assembles
    assert b"".join(gs.read(o, min(gs.nbytes, o + 777)) for o in range(0, gs.nbytes, 777)) == whole
    with pytest.raises(StateChanged, match="state of round 4 asked, this node now holds round 5"):
        gs.read(0, 8, round=4)
    with pytest.raises(StateError, match="outside"):
        gs.read(0, gs.nbytes + 1)


def test_a_read_while_the_state_changes_is_refused_without_blocking():
    gs = GlobalState(P, 1)
    gs.load(1, torch.ones(P))
    held, release = threading.Event(), threading.Event()

    def step():  # an outer step in a worker thread, holding the lock
        with gs.lock:
            held.set()
            release.wait(10)
            gs.theta.add_(1)
            gs.commit(2)

    t = threading.Thread(target=step)
    t.start()
    try:
        assert held.wait(10)
        with pytest.raises(StateChanged, match="being changed"):
            gs.read(0, 8, round=1, blocking=False)
    finally:
        release.set()
        t.join(10)
    with pytest.raises(StateChanged, match="now holds round 2"):
        gs.read(0, 8, round=1)
    assert gs.read(0, 4, round=2) == torch.tensor([2.0]).numpy().tobytes()


def _safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_checkpoint_has_the_tensor_writers_format_and_loads_back(tmp_path, k):
    theta, opt = _values(k, seed=k)
    gs = GlobalState(P, k)
    gs.load(12, theta, opt)
    path = gs.save_checkpoint(tmp_path / "gs", run_config_hash="abc", peer_id="me")
    ref = state.save_checkpoint(tmp_path / "ref", round=12, theta=theta, momentum=opt,
                                meta={"run_config_hash": "abc", "peer_id": "me"})
    # same safetensors header (parsed: its metadata map's key order is not stable) and same data bytes
    ours, theirs = (_safetensors(p.with_suffix(".safetensors")) for p in (path, ref))
    assert ours == theirs
    rnd, th, mom, record = state.load_latest_checkpoint(tmp_path / "gs")
    assert rnd == 12 and record["digest"] == gs.digest and record["meta"] == {"run_config_hash": "abc",
                                                                              "peer_id": "me"}
    assert torch.equal(th.view(torch.int32), theta.view(torch.int32))
    if k:
        assert torch.equal(mom.view(torch.int32), opt.view(torch.int32))
    else:
        assert mom is None and record["has_momentum"] is False


def test_checkpoint_before_any_digest_is_refused(tmp_path):
    with pytest.raises(StateError, match="no digest yet"):
        GlobalState(P, 1).save_checkpoint(tmp_path)
