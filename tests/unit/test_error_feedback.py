"""Error feedback in the real peer (issue 15): ``--error-feedback`` pushes delta + residual and keeps what
the sign codec dropped, bit for bit the simulator's rule (compression.ErrorFeedback), checkpointed next to
the state and zeroed on a re-sync to another lineage."""

from __future__ import annotations


from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.telemetry import events
from geomesh_p2p.exchange.codec.feedback import RESIDUAL_FILE, PushFeedback

B = 64  # codec block
P = 5 * B + 17  # the last block is short
RANGES = [(0, 2 * B), (2 * B, 4 * B), (4 * B, P)]  # part ranges aligned to the block (part_align = block_size)


def _same_packet(a, b) -> bool:
    return (
        (a.numel, a.block_size, a.tokens) == (b.numel, b.block_size, b.tokens)
        and torch.equal(a.signs, b.signs)
        and torch.equal(a.scales, b.scales)
    )


@pytest.mark.timeout(30)
def test_pushed_parts_equal_the_simulators_rule_bit_for_bit_over_3_rounds():
    """The parts the collective encodes from PushFeedback.apply's vector are the slices of the simulator's
    whole-vector ErrorFeedback.encode packet, and both residuals are bitwise equal, round after round."""
    g = torch.Generator().manual_seed(7)
    sim, real = compression.ErrorFeedback(P, B), PushFeedback(P, B)
    for r in range(3):
        delta = torch.randn(P, generator=g) * (r + 1) * 1e-3
        tokens = 100 + r
        want = sim.encode(delta.clone(), tokens)
        pushed = real.apply(delta, tokens, RANGES, round=r)
        assert not torch.equal(pushed, delta) or r == 0  # round 0: residual 0, so delta + 0
        for s, e in RANGES:
            # what collective.messages.contribution_bytes encodes for part [s, e)
            got = compression.encode(pushed[s:e], block_size=B, tokens=tokens)
            assert _same_packet(got, compression.slice_packet(want, s, e)), (r, s, e)
        assert torch.equal(real.residual, sim.residual), r
        assert real.round == r
    assert real.residual.abs().sum() > 0


@pytest.mark.timeout(30)
def test_a_push_of_0_tokens_keeps_the_residual_and_bad_input_changes_nothing():
    fb = PushFeedback(P, B)
    fb.apply(torch.randn(P), 10, RANGES)
    kept = fb.residual.clone()
    zeros = torch.zeros(P)
    assert fb.apply(zeros, 0, RANGES) is zeros  # an abstention: nothing counted, nothing carried
    assert torch.equal(fb.residual, kept)
    bad = torch.randn(P)
    bad[5] = float("nan")
    with pytest.raises(compression.CodecError, match="non-finite"):
        fb.apply(bad, 10, RANGES)
    with pytest.raises(compression.CodecError, match="do not cover"):
        fb.apply(torch.randn(P), 10, RANGES[:2])
    with pytest.raises(compression.CodecError, match="elements"):
        fb.apply(torch.randn(P + 1), 10, RANGES)
    assert torch.equal(fb.residual, kept)


@pytest.mark.timeout(30)
def test_residual_checkpoint_resumes_only_with_its_state(tmp_path):
    fb = PushFeedback(P, B)
    fb.apply(torch.randn(P), 10, RANGES, round=4)
    fb.save(tmp_path, state_round=5, digest="ab" * 32)
    assert (tmp_path / RESIDUAL_FILE).exists()
    other = PushFeedback(P, B)
    assert other.load(tmp_path, state_round=5, digest="ab" * 32) == "loaded"
    assert torch.equal(other.residual, fb.residual) and other.round == 4
    why = other.load(tmp_path, state_round=5, digest="cd" * 32)
    assert why.startswith("another state") and other.residual.abs().sum() == 0
    assert PushFeedback(P, B).load(tmp_path / "none", state_round=5, digest="ab" * 32) == "missing"
    assert PushFeedback(P + 1, B).load(tmp_path, state_round=5, digest="ab" * 32).startswith("unreadable")
    (tmp_path / RESIDUAL_FILE).write_bytes(b"garbage")
    assert PushFeedback(P, B).load(tmp_path, state_round=5, digest="ab" * 32).startswith("unreadable")


# ------------------------------------------------------------------ the driver's exchange phase (fakes)
class _Spec:
    push_encoding = "sign"

    def __init__(self):
        self.owners = [type("O", (), {"start": s, "end": e})() for s, e in RANGES]


class _Collective:
    def __init__(self):
        self.pushed = []

    async def all_reduce(self, spec, delta, tokens, compute_end=None, *, in_place=False):
        self.pushed.append(delta.clone())
        return object()


class _Policy:
    def after_exchange(self, spec, plan, ar):
        pass

    def forget_marks_since(self, round):
        return []


class _State:
    round = 3
    digest = "11" * 32
    syncing = False

    async def catch_up(self):
        self.digest = "22" * 32


@pytest.mark.timeout(30)
async def test_driver_exchange_pushes_delta_plus_residual_and_a_foreign_resync_zeroes_it():
    import asyncio

    from geomesh_p2p.round.driver import DriverConfig, LineageEntry, RoundContext, RoundDriver

    fb, sim = PushFeedback(P, B), compression.ErrorFeedback(P, B)
    coll = _Collective()
    d = RoundDriver(
        membership=None,
        plans=None,
        trainer=None,
        collective=coll,
        state=_State(),
        policy=_Policy(),
        cfg=DriverConfig(),
        stop=asyncio.Event(),
        feedback=fb,
    )
    g = torch.Generator().manual_seed(3)
    for r in range(2):
        delta = torch.randn(P, generator=g)
        ctx = RoundContext(
            round=r,
            t_round=0.0,
            delta=delta.clone(),
            spec=_Spec(),
            plan=SimpleNamespace(train_deadline=0.0, exchange_deadline=0.0),
            result=type("R", (), {"tokens": 50})(),
        )  # the plan is only handed to the policy
        assert await d.exchange(ctx)
        want = sim.encode(delta, 50)
        got = compression.encode(coll.pushed[-1], block_size=B, tokens=50)
        assert _same_packet(got, want)
    assert torch.equal(fb.residual, sim.residual) and fb.residual.abs().sum() > 0

    # A re-sync that discards a round of this peer's lineage zeroes the residual, with one INFO line.
    d.lineage.append(LineageEntry(2, "11" * 32, frozenset({"me"}), 50, 50))

    async def peers(include_leaving=False):
        return []

    d.membership = type("M", (), {"peers": staticmethod(peers), "me": "me"})()
    d._log_dropped = lambda before, recs: d.lineage.pop()  # the partition rule decided: round 2 discarded
    with events.capture("residual_zeroed") as zeroed:
        await d._catch_up()
    assert fb.residual.abs().sum() == 0 and fb.round == -1
    assert [(e["peer"], e["round"]) for e in zeroed] == [("me", d.state.round)]


def test_method_memory_counts_the_residual_only_for_sign_pushes():
    """memory.method_min_memory: --error-feedback adds a [P] fp32 residual to geomesh/css (sign pushes),
    nothing to the fp32 methods, which keep none (the peer allocates it only for sign pushes)."""
    from geomesh_p2p.model.memory import method_min_memory

    assert method_min_memory(1000, "geomesh", error_feedback=True).error_feedback == 4000
    assert method_min_memory(1000, "css", error_feedback=True).error_feedback == 4000
    for fp32 in ("diloco", "awb", "ddp"):
        assert method_min_memory(1000, fp32, error_feedback=True).error_feedback == 0
