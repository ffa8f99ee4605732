"""Verified work in accountable mode, the round's side (issues 26 and 28): keep the round with the committed inputs
standing in for the contributions this peer never received, fetch the few its own check and screens need, check
each against its commitment, then queue them exactly as in relay mode (:mod:`geomesh_p2p.trust.verify_commit`).

Before the outer step (awaited: the start weights are read then): the round's committed inputs and this peer's own
contributions are kept (:func:`keep`). Then, in a task of its own (:func:`fetch_and_queue`, off the round's path:
the accused serves its push only once it applied the part, and a stalling holder must not hold the outer step),
each wanted contribution is fetched by one deadline (:func:`~geomesh_p2p.exchange.fetch_input.fetch_input`),
refused unless it is the committed one (:func:`~geomesh_p2p.trust.verify_commit.verified_packet`), and the
screens and the sampled check whose contributions arrived are queued in the background worker. A check whose
contribution nobody served is not run (logged with the reasons, counted as ``refused``): withholding one's own
contribution is a suspicion nobody else can re-check, never evidence; but this peer notes it as a marginal
failure of the accused (:meth:`~geomesh_p2p.trust.verify_held.HeldContributions.note_withheld`, lone: red team,
session 31), so that a poisoner cannot skip every screen at no cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from geomesh_p2p.exchange.fetch_input import committed_round, fetch_input
from geomesh_p2p.trust.verify_commit import Committed, ContributionRefused, own_packet, verified_packet

if TYPE_CHECKING:
    from geomesh_p2p.round.rules.verified import VerifiedWork

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["keep", "fetch_and_queue", "FETCH_TIMEOUT_S", "CONCURRENT_FETCHES"]

#: Deadline of one round's fetches of contributions to check (seconds from their start).
FETCH_TIMEOUT_S = 10.0
#: Contributions fetched at once.
CONCURRENT_FETCHES = 4


async def keep(vw: "VerifiedWork", r: int, plan, ar) -> bool:
    """Keep accountable round ``r`` for verified work (its start weights, its committed inputs, this peer's own
    contributions as the checks' basis). True when kept (False: the collective no longer holds the round)."""
    collective = vw._collective() if vw._collective is not None else None
    if collective is None:
        return False
    cr = await asyncio.to_thread(committed_round, collective, r)
    if cr is None or not cr.inputs:
        return False
    committed = {
        s: {j: Committed(tokens, digest, dropped) for j, (tokens, dropped, digest) in parts.items()}
        for s, parts in cr.inputs.items()
    }
    me = vw.state.me or ""

    def run() -> None:
        own: dict[int, Any] = {}
        for j, signed in cr.own.items():
            try:
                p = own_packet(signed)
            except ContributionRefused:
                continue
            if p is not None:
                own[j] = p
        if vw.verifier is None:
            vw.verifier = vw._new_verifier()
        vw.verifier.keep_round(
            r,
            theta=vw._global_theta(),
            plan=plan,
            part_ranges=ar.part_ranges,
            packets={me: own} if own else {},
            committed=committed,
        )

    await asyncio.to_thread(run)
    return True


async def fetch_and_queue(vw: "VerifiedWork", r: int, plan, a, ar, *, timeout_s: float = FETCH_TIMEOUT_S) -> dict:
    """Fetch the contributions kept round ``r``'s own check and screens need, check them against their commitments,
    hold them, queue the screens and the check, then tend (:meth:`VerifiedWork.verify_round`). Returns this round's
    fetch figures (``wanted``, ``fetched``, ``refused`` contributions, ``bytes`` received), also added to
    ``vw.fetch_counts``. Never raises for what a holder does."""
    wv = vw.verifier
    collective = vw._collective() if vw._collective is not None else None
    out = {"wanted": 0, "fetched": 0, "refused": 0, "bytes": 0}
    if wv is None or collective is None:
        return out
    wants = await asyncio.to_thread(wv.accountable_wants, r)
    kept = wv._kept.get(int(r))
    signed: dict[tuple[int, str], bytes] = {}
    if kept is not None and kept.committed is not None:
        slots = asyncio.Semaphore(CONCURRENT_FETCHES)
        committed = kept.committed

        async def one(accused: str, j: int) -> Optional[tuple[int, Any]]:
            c = committed[accused][j]
            async with slots:
                got, why, n = await fetch_input(collective, r, j, accused, c.digest, timeout_s=timeout_s)
            out["bytes"] += n
            if got is None:
                out["refused"] += 1
                log.info(
                    "round %d: verified work: the contribution of %s to part %d was not served (%s): not checked",
                    r,
                    accused[:10],
                    j,
                    "; ".join(why),
                )
                return None
            try:
                packet = await asyncio.to_thread(
                    verified_packet,
                    got,
                    c,
                    run_id=wv.run_id,
                    accused=accused,
                    round=int(r),
                    part=j,
                    part_range=kept.part_ranges[j],
                )
            except ContributionRefused as e:
                out["refused"] += 1
                log.warning("round %d: verified work: a fetched contribution refused: %s", r, e)
                return None
            out["fetched"] += 1
            signed[(j, accused)] = got
            return j, packet

        for accused, parts in wants.items():
            out["wanted"] += len(parts)
        results = await asyncio.gather(*(one(acc, j) for acc, parts in wants.items() for j in parts))
        by: dict[str, dict[int, Any]] = {}
        for (acc, _), res in zip([(acc, j) for acc, parts in wants.items() for j in parts], results):
            if res is not None:
                by.setdefault(acc, {})[res[0]] = res[1]
        for acc, packets in by.items():
            wv.hold(r, acc, packets)
        if out["fetched"] > 0:  # this peer could fetch (it was not itself cut off or stalled): a withholding
            for acc, parts in wants.items():
                missing = [j for j in parts if j not in by.get(acc, {})]
                if missing:
                    wv.note_withheld(r, acc, f"part(s) {', '.join(map(str, missing))} served by none of its holders")
    for k, v in out.items():
        vw.fetch_counts[k] = vw.fetch_counts.get(k, 0) + v
    due = time.time() + max(1.0, wv.cfg.time_share * float(plan.window_s))

    def signed_of(part: int, sender: str) -> Optional[bytes]:
        return signed.get((part, sender))

    def queue() -> None:
        wv.queue_screens(r, due=due, signed_of=signed_of)
        wv.queue_check(r, micro_batch=a.micro_batch, due=due, signed_of=signed_of)

    try:
        await asyncio.to_thread(queue)
    except Exception as e:  # the round goes on; the evidence of the others is still read and re-checked
        log.warning("round %d: verified work: this round's checks could not be queued: %s", r, e)
    vw.verify_round(r, plan, a, ar)
    return out
