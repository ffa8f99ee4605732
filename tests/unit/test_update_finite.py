"""The round's update check (round/train.py ``_update``, issue 27 session 38): one aminmax pass over the ``[P]``
update instead of ``isfinite(delta).all()`` (no 89 MB bool temporary at gpt2-124m). A single NaN or infinity anywhere
in a large update still makes it a zero contribution of 0 tokens with the model reset; a finite one passes as it is."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from geomesh_p2p.round.context import no_work
from geomesh_p2p.round.train import _update
from geomesh_p2p.telemetry import events

pytestmark = pytest.mark.timeout(60)

N = (1 << 20) + 7  # above all_finite's numpy cut: the aminmax path


def _run(delta: torch.Tensor):
    resets: list[int] = []
    drv = types.SimpleNamespace(me="me", state=types.SimpleNamespace(reset_model=lambda: resets.append(1)))
    ctx = types.SimpleNamespace(round=7, start=None)
    result = types.SimpleNamespace(steps_done=3, tokens=384, compute_s=1.5)
    with events.capture("contributing_nothing") as said:
        out, res = asyncio.run(_update(drv, ctx, delta, result))  # type: ignore[arg-type]
    return out, res, resets, said


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, N // 2, N - 1])
def test_one_non_finite_element_makes_a_zero_contribution(bad, where):
    delta = torch.randn(N)
    delta[where] = bad
    out, res, resets, said = _run(delta)
    want = no_work(1.5)
    assert torch.equal(out, torch.zeros(N)) and resets == [1]
    assert (res.tokens, res.steps_done, res.compute_s) == (want.tokens, want.steps_done, 1.5) == (0, 0, 1.5)
    assert [(e["round"], e["reason"]) for e in said] == [(7, "update_not_finite")]


def test_a_finite_update_passes_unchanged():
    delta = torch.randn(N)
    delta[3] = 3.4e38  # large but finite
    out, res, resets, said = _run(delta)
    assert out is delta and res.tokens == 384 and resets == [] and said == []
