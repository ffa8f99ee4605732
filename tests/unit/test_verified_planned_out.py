"""Verified work while this peer sits a round out (session 27): the swarm's evidence is still read.

Before, only a round this peer applied tended verified work (:meth:`VerifiedWork.verify_round`): a peer planned out
for rounds neither published the verdicts its background worker reached nor read the swarm's evidence, and as a
leader it planned back in a peer everyone else had excluded. Accountable proofs had the same gap (closed in session
26, ``Accountability.read_in_background``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.rules_util import make_rules


class _Verifier:
    """Records each :meth:`tend` (round, micro-batch); ``gate`` holds one in flight until set."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, object]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def tend(self, round: int, *, micro_batch=None) -> list:
        self.calls.append((round, micro_batch))
        await self.gate.wait()
        return []


def _plan(mode: str = "relay"):
    def assignment(pid):
        raise KeyError(pid)

    return SimpleNamespace(mode=mode, seq_len=8, assignment=assignment)


@pytest.mark.timeout(30)
def test_a_planned_out_peer_tends_verified_work_at_the_micro_batch_of_its_last_round():
    wv = _Verifier()
    rules = make_rules(me="me", verifier=wv)

    async def main() -> None:
        rules.planned_out(2, _plan())  # before any round it trained: tended, at no micro-batch yet
        await rules.verified.task
        ar = SimpleNamespace(contributions={"a": {}}, aggregate=None, part_ranges=[])
        rules.verified.verify_round(3, _plan(), SimpleNamespace(micro_batch=6), ar)  # round 3 trained at 6
        await rules.verified.task
        for r in (4, 5):  # then out for two rounds, in both modes
            rules.planned_out(r, _plan("accountable" if r == 5 else "relay"))
            await rules.verified.task

    asyncio.run(main())
    assert wv.calls == [(2, None), (3, 6), (4, 6), (5, 6)]


@pytest.mark.timeout(30)
def test_one_tending_task_at_a_time_and_shutdown_cancels_it():
    wv = _Verifier()
    rules = make_rules(me="me", verifier=wv)

    async def main() -> None:
        wv.gate.clear()  # the first tend is still reading the DHT
        rules.planned_out(7, _plan())
        await asyncio.sleep(0)
        first = rules.verified.task
        rules.planned_out(8, _plan())  # left to the next: one task at a time
        assert rules.verified.task is first
        rules.verified.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())
    assert wv.calls == [(7, None)]


@pytest.mark.timeout(30)
def test_without_a_verifier_sitting_out_does_nothing():
    rules = make_rules(me="me")
    rules.planned_out(1, _plan())  # no event loop needed: nothing started
    assert rules.verified.task is None


@pytest.mark.timeout(30)
def test_the_agreement_of_a_round_is_measured_once_its_row_is_out(monkeypatch):
    """Issue 27 (session 38): the advisory agreement measurement (decoding every contribution) waited for nothing and
    ran beside the outer step and the digest on their core; it now starts when the round's row is published."""
    import torch

    from geomesh_p2p.round.rules import verified as verified_mod

    wv = _Verifier()
    rules = make_rules(me="me", verifier=wv)
    measured: list[int] = []

    def sign_agreements(contributions, aggregate, part_ranges):
        measured.append(int(aggregate.numel()))
        return {"a": 1.0}

    monkeypatch.setattr(verified_mod.agreement, "sign_agreements", sign_agreements)
    monkeypatch.setattr(verified_mod.agreement, "supports", lambda c, p: {})

    async def main() -> None:
        ar = SimpleNamespace(contributions={"a": {0: object()}}, aggregate=torch.zeros(8), part_ranges=[(0, 8)])
        rules.verified.verify_round(3, _plan(), SimpleNamespace(micro_batch=6), ar)
        for _ in range(20):
            await asyncio.sleep(0)
        assert measured == [] and not rules.verified.task.done()  # the round's finish is still under way
        rules.verified.counts = lambda: None  # type: ignore[method-assign]  # the fake verifier counts nothing
        rules.publish_record(SimpleNamespace(round=3, extra={}))  # round 3's row
        await rules.verified.task

    asyncio.run(main())
    assert measured == [8] and wv.calls == [(3, 6)] and rules.verified.agreement[0] == 3


@pytest.mark.timeout(30)
def test_the_agreement_is_measured_on_the_signs_with_the_aggregate_let_go(monkeypatch):
    """Issue 27 (session 39): the aggregate is the buffer of the next round's gradients; the measurement, which runs
    into the next round, holds its signs only (session 42: two bitmaps; the same figures: test_agreement_relative)."""
    import gc
    import weakref

    import torch

    from geomesh_p2p.round.rules import verified as verified_mod

    rules = make_rules(me="me", verifier=_Verifier())
    seen: list[tuple[type, list[int], bool]] = []
    ref: list[weakref.ref] = []

    def sign_agreements(contributions, signs, part_ranges):
        gc.collect()
        seen.append((type(signs), signs.span(0, signs.numel()).tolist(), ref[0]() is None))
        return {"a": 1.0}

    monkeypatch.setattr(verified_mod.agreement, "sign_agreements", sign_agreements)
    monkeypatch.setattr(verified_mod.agreement, "supports", lambda c, p: {})

    async def main() -> None:
        agg = torch.tensor([0.5, -2.0, 0.0, 3.0])
        ref.append(weakref.ref(agg))
        ar = SimpleNamespace(contributions={"a": {0: object()}}, aggregate=agg, part_ranges=[(0, 4)])
        rules.verified.verify_round(3, _plan(), SimpleNamespace(micro_batch=6), ar)
        del ar, agg  # the round's result is gone once its row is out
        rules.verified.counts = lambda: None  # type: ignore[method-assign]
        rules.publish_record(SimpleNamespace(round=3, extra={}))
        await rules.verified.task

    asyncio.run(main())
    assert seen == [(verified_mod.agreement.PackedSigns, [1, -1, 0, 1], True)]
