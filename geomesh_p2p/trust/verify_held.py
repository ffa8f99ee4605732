"""Verified work in accountable mode, the verifier's side (:class:`HeldContributions`, a part of
:class:`~geomesh_p2p.trust.verify.WorkVerifier`): which of the accused's contributions this peer's check and screens
of an accountable round need (to fetch), and holding them once fetched and checked against their commitments.
The stand-ins, the screen seed and the bounded task: :mod:`.verify_commit`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Callable, Mapping, Optional

from geomesh_p2p.trust.evidence import Evidence, fetch_contributions
from geomesh_p2p.trust.verify_check import MARGINAL, Verdict
from geomesh_p2p.trust.verify_commit import Committed, materialize, narrow
from geomesh_p2p.trust.verify_task import derive_screen

__all__ = ["HeldContributions"]

log = logging.getLogger("geomesh_p2p.trust.verify")


class _Withheld:
    """What :meth:`~geomesh_p2p.trust.verify.WorkVerifier._record` reads of a task (its round and accused) for a
    contribution withheld from this peer (:meth:`HeldContributions.note_withheld`)."""

    def __init__(self, round: int, accused: str):
        self.round = round
        self.accused = accused


class HeldContributions:
    """Uses the verifier's ``cfg``, ``me``, ``run_id``, ``dht``, ``_kept``, ``_packets``, ``_seed_of``, ``settled``,
    ``screen_targets``, ``own_task`` and ``_record``."""

    cfg: Any
    me: str
    run_id: str
    dht: Any
    _kept: "OrderedDict[int, Any]"
    _packets: Callable[[int, Any], dict]
    _seed_of: Callable[..., bytes]
    own_task: Callable[[int], Optional[Any]]
    settled: Callable[[str], bool]
    screen_targets: Callable[..., list]
    _record: Callable[..., None]

    def accountable_wants(self, round: int) -> dict[str, tuple[int, ...]]:
        """Accountable mode: accused -> the parts of its contribution this peer's check and screens of kept round
        ``round`` need and does not hold (to fetch and :meth:`hold` before :meth:`queue_screens` /
        :meth:`queue_check`); {} in relay mode. Blocking (draws the tasks): off the event loop."""
        kept = self._kept.get(int(round))
        if kept is None or kept.committed is None:
            return {}
        packets = self._packets(round, kept)
        seed = self._seed_of(round, kept, packets)
        tasks = [self.own_task(round)] + [
            narrow(
                derive_screen(
                    self.cfg,
                    plan=kept.plan,
                    verifier=self.me,
                    accused=a,
                    seed=seed,
                    packets=packets,
                    part_ranges=kept.part_ranges,
                )
            )
            for a in self.screen_targets(round, kept, packets, seed)  # sampled screens included: fetched too
            if not self.settled(a)  # nothing to learn here: not fetched either
        ]
        out: dict[str, set[int]] = {}
        for t in tasks:
            if t is not None:
                out.setdefault(t.accused, set()).update(
                    j for j in t.parts if isinstance(packets.get(t.accused, {}).get(j), Committed)
                )
        return {a: tuple(sorted(js)) for a, js in out.items() if js}

    def note_withheld(self, round: int, accused: str, why: str) -> bool:
        """Accountable mode: ``accused``'s contribution to kept round ``round``, wanted by this peer's check or screen
        of it (:meth:`accountable_wants`), was served by none of its holders (``why``): a marginal failure of the
        accused measured here (lone; ``cfg.marginal_needed`` of them within ``cfg.marginal_window`` rounds exclude it
        from the plans this peer leads). False (nothing noted) when the round is not kept or ``accused`` is this
        peer or settled.

        Why (red team, session 31): the check or screen was "not run" and that counted nothing, so a poisoner with
        one colluding part owner (or, before :data:`~geomesh_p2p.exchange.fetch_input.OWNER_SHARE`, alone, by
        stalling its own part) skipped every screen at no cost. A non-delivery proves nothing to a third party, so
        it is no evidence and publishes nothing; but every honest screener observes it itself. It cannot frame an
        honest accused at an honest screener: the accused serves its own contribution when the part's owner does
        not (:func:`~geomesh_p2p.exchange.fetch_input.fetch_input`)."""
        kept = self._kept.get(int(round))
        if kept is None or accused == self.me or self.settled(accused):
            return False
        log.info(
            "round %d: verified work: the contribution of %s was not served to this peer (%s): a marginal failure",
            round,
            accused[:10],
            why,
        )
        self._record(
            _Withheld(int(round), accused),
            Verdict(MARGINAL, f"its contribution was not served to this peer's screen or check ({why})"),
            self.me,
        )
        return True

    def hold(self, round: int, accused: str, packets: Mapping[int, Any]) -> bool:
        """Accountable mode: keep ``accused``'s contributions to kept round ``round`` fetched and checked against
        their commitments (:func:`~.verify_commit.verified_packet`: part -> SignPacket). False when the round is not
        kept any more or its contributions left memory (the check of it is then not run)."""
        kept = self._kept.get(int(round))
        if kept is None or kept.packets is None or kept.committed is None:
            return False
        kept.packets.setdefault(accused, {}).update({int(j): p for j, p in packets.items()})
        return True

    async def hold_evidence_contributions(self, ev: Evidence) -> dict[int, str]:
        """Accountable mode: the accused's signed contributions that evidence ``ev`` published beside it
        (:func:`~.evidence.fetch_contributions`), each held here once it matches this peer's commitment
        (:func:`~.verify_commit.materialize`, in a worker thread), so that the evidence can be re-checked by a
        participant that did not fetch them itself. Returns part -> why refused ({} for a relay round)."""
        kept = self._kept.get(int(ev.round))
        if kept is None or getattr(kept, "committed", None) is None or self.dht is None:
            return {}
        mine = self._packets(int(ev.round), kept).get(ev.accused, {})
        if not any(isinstance(mine.get(j), Committed) for j in ev.packets):
            return {}  # held already (fetched for this peer's own screen of the same newcomer)
        got = await fetch_contributions(self.dht, ev)
        refused = await asyncio.to_thread(materialize, kept, ev.accused, got, self.run_id, int(ev.round))
        for j, why in refused.items():
            log.info(
                "round %d: evidence against %s: its contribution to part %d refused: %s",
                ev.round,
                ev.accused[:10],
                j,
                why,
            )
        return refused
