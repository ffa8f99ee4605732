"""Verified work's evidence in the DHT, the node's side (:class:`EvidenceExchange`, a part of
:class:`~geomesh_p2p.trust.verify.WorkVerifier`): publish this node's evidence, and read what others published
about the kept rounds (their sampled checks' under :func:`~geomesh_p2p.trust.evidence.evidence_key`, the screening
checks' of each newcomer under :func:`~geomesh_p2p.trust.evidence.screen_evidence_key`), checked on arrival and
queued for a re-check. The wire form: :mod:`geomesh_p2p.trust.evidence`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import Any, Iterable, Optional

from geomesh_p2p.dht.chunked import ChunksPending
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.trust.evidence import (
    Evidence,
    EvidenceReader,
    evidence_key,
    publish_evidence,
    screen_evidence_key,
)
from geomesh_p2p.trust.verify_check import FAIL
from geomesh_p2p.trust.verify_task import SCREEN, evidence_lifetime_s

log = logging.getLogger("geomesh_p2p.trust.verify")

__all__ = ["EvidenceExchange"]


class EvidenceExchange:
    """Publishing and reading evidence for :class:`~geomesh_p2p.trust.verify.WorkVerifier` (it holds the state
    used here: ``dht``, ``identity``, ``run_id``, ``cfg``, ``me``, the kept rounds and the pending evidence)."""

    dht: Any
    identity: Any
    run_id: str
    cfg: Any
    me: str
    excluded: dict
    lone: set
    _kept: "OrderedDict[int, Any]"
    _reader: Optional[EvidenceReader]
    _seen: set
    _pending: "OrderedDict[str, bytes]"
    _pending_round: dict
    _pending_ev: dict
    _log_once: Any
    hold_evidence_contributions: Any

    async def publish(self, ev: Evidence) -> bool:
        """Store ``ev`` (chunked when over one DHT value) and the accused's signed contributions it carries
        in the DHT (:func:`~geomesh_p2p.trust.evidence.publish_evidence`: bounded concurrency, a deadline
        per store). True when the evidence itself was stored; a contribution stored nowhere is logged."""
        if self.dht is None:
            return False
        kept = self._kept.get(int(ev.round))
        round_s = None if kept is None else float(kept.plan.exchange_deadline) - float(kept.plan.created_at)
        try:
            out = await publish_evidence(
                self.dht, ev, self.identity, expiration_time=swarm_time() + evidence_lifetime_s(self.cfg, round_s)
            )
        except Exception as e:  # never let publishing break a round (e.g. over MAX_EVIDENCE_CHUNKS)
            log.warning("round %d: could not publish verified-work evidence: %s", ev.round, e)
            return False
        if not out.evidence:
            log.warning(
                "round %d: verified-work evidence against %s (%d parts, %d chunks) was stored nowhere",
                ev.round,
                ev.accused[:10],
                len(ev.packets),
                out.chunks,
            )
        elif out.contributions < out.contributions_total or out.contributions_left_out:
            log.info(
                "round %d: %d of %d contributions of %s published (%d over the limit, %d stored nowhere; "
                "the round's peers hold them)",
                ev.round,
                out.contributions,
                len(ev.contributions),
                ev.accused[:10],
                out.contributions_left_out,
                out.contributions_total - out.contributions,
            )
        return out.evidence

    def pending_accused(self, among: Iterable[str]) -> dict[str, int]:
        """The peers of ``among`` that published hard evidence (outcome FAIL) accuses and whose accusation is not
        settled here yet (read by :meth:`fetch`, its re-check or this node's own screen of it still to come), with
        the number of distinct verifiers accusing each: only evidence of a kept round whose verifier and accused
        were both its participants, never about this node, never of a peer excluded here already. The leader
        names them in its plan (``RoundPlan.accused``, issue 28, session 47). Cheap: no computation, no read."""
        want = set(among) - {self.me}
        by: dict[str, set] = {}
        for h, ev in self._pending_ev.items():
            kept = self._kept.get(self._pending_round.get(h, int(ev.round)))
            if ev.outcome != FAIL or ev.accused not in want or ev.accused in self.excluded or kept is None:
                continue
            took = set(kept.plan.participants())
            if ev.accused in took and ev.verifier in took and ev.verifier != ev.accused:
                by.setdefault(ev.accused, set()).add(ev.verifier)
        return {p: len(v) for p, v in by.items()}

    async def fetch(self) -> int:
        """Queue the evidence published about the kept rounds that this node has not seen yet (assembled
        from its chunks; one whose chunks are not all there yet is retried on the next call, logged once)."""
        if self.dht is None:
            return 0
        if self._reader is None or self._reader.dht is not self.dht:
            self._reader = EvidenceReader(self.dht)
        n = 0
        for r, kept in list(self._kept.items()):
            keys = [evidence_key(self.run_id, r)]
            keys += [
                screen_evidence_key(self.run_id, r, a)
                for a in kept.screened
                if a != self.me and (a not in self.excluded or a in self.lone)
            ]
            for key in keys:
                n += await self._fetch_key(r, key)
        return n

    async def _fetch_key(self, r: int, key: str) -> int:
        """Queue the evidence under ``key`` (of kept round ``r``) not seen yet; see :meth:`fetch`."""
        assert self.dht is not None and self._reader is not None
        n = 0
        try:
            found = await self.dht.get(key)
        except Exception as e:
            log.debug("reading evidence of round %d failed: %s", r, e)
            return 0
        for subkey, entry in (found or {}).items():
            value, owner = entry[0], entry[2]
            if owner is None or str(owner) != subkey:
                continue
            h = hashlib.sha256(value).hexdigest()
            if h in self._seen or h in self._pending:
                continue
            try:
                data = await self._reader.load(key, subkey, value)
            except ChunksPending as e:
                self._log_once(
                    (h, str(e)), logging.INFO, "round %d: evidence of %s not usable yet: %s", r, subkey[:10], e
                )
                continue
            except ValueError as e:
                self._log_once(h, logging.INFO, "round %d: evidence of %s refused: %s", r, subkey[:10], e)
                self._seen.add(h)  # the same bytes stay malformed
                continue
            try:  # signatures and framing now (cheap), not when its re-check's turn comes (red team)
                opened = Evidence.open(data, self.run_id)
            except Exception as e:  # noqa: BLE001  (hostile bytes: any failure refuses the record)
                self._log_once(h, logging.INFO, "round %d: evidence of %s refused: %s", r, subkey[:10], e)
                self._seen.add(h)
                continue
            if (opened.task.kind == SCREEN) != (key != evidence_key(self.run_id, r)):
                self._seen.add(h)  # a screen's evidence under a check's key, or the reverse: not where it goes
                continue
            await self.hold_evidence_contributions(opened)  # accountable mode: the accused's, checked (verify_held)
            self._pending[h] = data
            self._pending_round[h] = r
            self._pending_ev[h] = opened
            n += 1
        return n
