"""Issue 27 (session 42): verified work's agreement measurement lets the round's aggregate go before the round's
row, so the next round's inner steps take the same gradient buffer again (``FlatGradBuffer``: reused only when
nobody else holds its storage). Held until the row, every round's steps took a fresh ``[P]``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.model.grad_buffer import storage_shared
from geomesh_p2p.trust.agreement import sign_agreements
from tests.rules_util import make_rules
from tests.unit.test_agreement_relative import noisy_contributions

P = 6000
PARTS = [(0, 3000), (3000, 6000)]


class _Verifier:
    def __init__(self) -> None:
        self.calls: list[int] = []

    async def tend(self, round: int, *, micro_batch=None) -> list:
        self.calls.append(round)
        return []


@pytest.mark.timeout(60)
def test_the_aggregate_is_let_go_before_the_row_and_the_agreement_measured_after_it():
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(P, generator=g)
    contributions = noisy_contributions(truth, PARTS, g, 512, 100)
    # the next round's gradient buffer; the round's aggregate is a view of it, as FlatGradBuffer.take gives it
    buf = truth.clone()
    want = sign_agreements(contributions, buf, PARTS)
    wv = _Verifier()
    rules = make_rules(me="me", verifier=wv)
    vw = rules.verified
    plan = SimpleNamespace(mode="relay", seq_len=8, assignment=lambda pid: (_ for _ in ()).throw(KeyError(pid)))

    async def main() -> None:
        ar = SimpleNamespace(contributions=contributions, aggregate=buf.view(-1), part_ranges=PARTS)
        assert storage_shared(buf)
        vw.verify_round(5, plan, SimpleNamespace(micro_batch=1), ar)
        del ar
        for _ in range(2000):  # until the signs are taken (a worker thread), at most ~20 s
            if not storage_shared(buf):
                break
            await asyncio.sleep(0.01)
        assert not storage_shared(buf), "verified work still holds the aggregate before the round's row"
        assert not vw.task.done() and vw.agreement is None and wv.calls == []  # measured only after the row
        vw.round_done(5)
        await vw.task

    asyncio.run(main())
    assert wv.calls == [5]
    assert vw.agreement is not None and vw.agreement[0] == 5
    assert vw.support is not None and vw.support[0] == 5 and set(vw.support[1]) == set(want)
