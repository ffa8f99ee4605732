"""Red team (session 31): an accused that keeps its contribution from its screeners in accountable mode.

Since session 31 a screen in accountable mode covers the accused's *whole* contribution (every part), fetched by
the screener from each part's owner, else the accused, else (its own part) the witness
(:func:`~geomesh_p2p.exchange.fetch_input.fetch_input`). A screen missing any one part is "not run: its
contribution is not held here" (:meth:`~geomesh_p2p.trust.verify_screen.Screening.queue_screens`). Two ways a
poisoner kept every screener off its contribution at no cost:

* **alone, by stalling**: it owns a part, and the fetch of its own contribution to that part asks it (the owner)
  first, then its witness, *by one deadline*: it never answers, the deadline passes, and the witness (which holds
  the bytes, honestly) is never asked in time;
* **with one colluding part owner**: the owner refuses (or serves other bytes) and the accused refuses too.

Either way the screen was skipped with one INFO line and counted nothing: no marginal, no exclusion, and the
poisoner's pushes were credited (standing) as everyone's. What each side can prove: nobody can prove a
non-delivery to a third party, so it must not become evidence; but every honest screener observes it itself, so it
is noted *here* as a marginal failure of the accused (lone: the plans this peer leads leave it out after
``marginal_needed`` such rounds; a follower never refuses a plan over it), which a malicious screener cannot push
onto anybody else. An honest accused is served by its honest owner, or serves itself when the owner withholds, so
honest screeners do not mark it.
"""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.exchange.fetch_input import fetch_input
from geomesh_p2p.trust.verify_commit import Committed

from tests.integration.test_verify_accountable_fetch import _kept_round

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 2.0


def _stall_inputs(sw, k: int, seconds: float) -> None:
    """Peer ``k`` answers no PullInputs for ``seconds`` (then as before): a slow or malicious holder. (The
    transport's handlers are bound at start: the service's round lookup, the handler's first await, is slowed.)"""
    service = sw.services[k]
    real = service._round_for

    async def slow(*args, **kw):
        await asyncio.sleep(seconds)
        return await real(*args, **kw)

    service._round_for = slow


async def _screen_round(swarms, r: int = 2):
    """Round ``r`` kept by peer 0 (every other peer is a newcomer it screens, VerifyConfig(share=0)); the real
    :meth:`queue_screens` runs with the background queue recorded: (sw, plan, res, wv, vw, submitted keys)."""
    from geomesh_p2p.trust.verify_screen import Screening
    from geomesh_p2p.trust.verify_task import VerifyConfig

    sw, plan, res, wv, vw, _ = await _kept_round(swarms, r, VerifyConfig(share=0.0))
    submitted: list = []
    wv.queue_screens = Screening.queue_screens.__get__(wv)  # type: ignore[method-assign]  (the real one)
    wv.queue.submit = lambda job: submitted.append(job.key)  # type: ignore[method-assign]  (no model runs here)
    return sw, plan, res, wv, vw, submitted


async def test_a_stalling_owner_accused_keeps_its_own_part_from_the_witness_too(swarms):
    """Alone: the accused owns part j and stalls its PullInputs past the fetch deadline. Its witness holds its
    contribution to j (honestly) and must still be asked in time."""
    sw, spec_plan, res, wv, vw, _ = await _screen_round(swarms)
    try:
        accused = sw.pids[1]
        kept = wv._kept[2]
        j = sw.services[0]._rounds[2].spec.part_index_of(accused)[0]  # a part the accused owns
        _stall_inputs(sw, 1, TIMEOUT_S + 2.0)
        got, why, _ = await fetch_input(
            sw.services[0], 2, j, accused, kept.committed[accused][j].digest, timeout_s=TIMEOUT_S
        )
        assert got is not None, f"the witness was not asked in time: {why}"
    finally:
        wv.close()


async def _dodge(swarms, how: str):
    from geomesh_p2p.round.rules import verified_accountable

    sw, plan, res, wv, vw, submitted = await _screen_round(swarms)
    me, accused = sw.pids[0], sw.pids[1]
    spec = sw.services[0]._rounds[2].spec
    if how == "stall":
        _stall_inputs(sw, 1, TIMEOUT_S + 2.0)
    else:  # a colluding owner of another part serves other bytes; the accused holds nothing of that part
        j = next(j for j, o in enumerate(spec.owners) if o.peer_id not in (me, accused))
        owner = sw.services[sw.pids.index(spec.owners[j].peer_id)]
        part = owner._rounds[2].parts[j]
        part.inputs[part.input_senders.index(accused)] = b"\x00" * 64
        del sw.services[1]._rounds[2].pushed[j]
    figures = await verified_accountable.fetch_and_queue(vw, 2, plan, plan.assignments[0], res[0], timeout_s=TIMEOUT_S)
    return sw, wv, submitted, figures


@pytest.mark.parametrize("how", ["stall", "collude"])
async def test_an_accused_that_withholds_its_contribution_from_a_screener_is_marked_there(swarms, how):
    """The screen is not run (nothing to run it on), but the withholding is noted here: a marginal failure of the
    accused in that round (lone), never of the honest newcomers screened beside it."""
    sw, wv, submitted, figures = await _dodge(swarms, how)
    try:
        me, accused = sw.pids[0], sw.pids[1]
        honest = [p for p in sw.pids if p not in (me, accused)]
        kept = wv._kept[2]
        held = wv._packets(2, kept)
        if how == "collude":  # the stall is defeated by the witness (above); with a colluder it stays withheld
            assert any(isinstance(p, Committed) for p in held[accused].values())
            assert figures["refused"] >= 1
            assert (2, accused) not in submitted  # the screen did not run
        assert {(2, p) for p in honest} <= set(submitted)  # the honest newcomers' screens ran
        assert all(p not in wv._marginal and p not in wv.excluded for p in honest)
        if (2, accused) not in submitted:
            assert wv._marginal.get(accused) == {2}, "withheld from a screen at no cost"
    finally:
        wv.close()
