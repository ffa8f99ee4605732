"""Accountable mode in the round rules (:class:`Accountability`, issue 26): after each accountable round's outer
step, in the background of the next round's inner steps, this peer validates the parts it is drawn for
(:meth:`~geomesh_p2p.exchange.CollectiveService.validate_round`), publishes a proof it holds (a drop its own
receipt shows, or a validator's forgery / equivocation proof) in the DHT (:mod:`geomesh_p2p.trust.fraud`),
reads the proofs of the last rounds, re-checks each from its bytes, and only then excludes the accused through
the verified-work verdicts (:meth:`~geomesh_p2p.trust.verify.Verdicts.exclude_proven`: left out of the plans,
plans naming it refused after the grace rounds, kept in the checkpoint).

Why a verdict cannot fork the swarm: a peer acts on a proof only once it is in the DHT and re-checked here, so
every peer that reads the same slots reaches the same verdict within a round or two (the plan check's grace);
a suspicion (inputs withheld) is logged, never acted on. BTARD (Gorbunov et al., ICML 2022), ACCUSE and ban.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from geomesh_p2p.exchange import accountable
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round.rules.undo import UNDO_ROUNDS
from geomesh_p2p.trust import fraud
from geomesh_p2p.trust.verify import Verdicts

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["Accountability"]

#: Publication slots (rounds) read back each round.
READ_SLOTS = 3
#: Proofs live this long in the DHT at least, seconds.
PROOF_TTL_S = 900.0


class Accountability:
    """This peer's side of accountable mode after each round.

    Args:
        verdicts: the verdicts in force (verified work's: :meth:`VerifiedWork.verdicts`).
        collective: the node's :class:`~geomesh_p2p.exchange.CollectiveService` (None before it starts).
        dht: the node's DHT (None: nothing published or read; proofs then never take effect).
        identity: this peer's identity (signs what it publishes).
        run_id: the run.
        validate_timeout_s: deadline of each validated part's pulls, seconds.
    """

    def __init__(
        self,
        verdicts: Callable[[], Verdicts],
        *,
        collective: Callable[[], Any],
        dht: Callable[[], Any],
        identity: Any,
        run_id: str,
        validate_timeout_s: float = 10.0,
    ):
        self._verdicts = verdicts
        self._collective = collective
        self._dht = dht
        self.identity = identity
        self.run_id = run_id
        self.validate_timeout_s = float(validate_timeout_s)
        self.pending: list[bytes] = []  # proofs held here, not published yet (one per round's slot)
        self.task: Optional[asyncio.Future] = None
        self.proven: dict[str, accountable.ProofVerdict] = {}  # accused -> the proof that excluded it here
        self._reader: Optional[fraud.ProofReader] = None
        self._seen: set[str] = set()  # proof records already decided here (bounded: cleared past 4,096)
        self.active = False  # an accountable round was applied here (rows then carry extra["accountable"])
        self.published = 0  # proofs this peer stored in the DHT
        # exact undo (issue 26, RunConfig.undo_forged): forgeries proven here, (round, part) -> [start, end) of [P]
        self.forged: dict[tuple[int, int], tuple[int, int]] = {}
        self.undone: set[tuple[int, int]] = set()  # forgeries this peer's state no longer holds (undone, or too old)
        self.undo_on = False  # RunConfig.undo_forged (set by the policy): every forgery proof is published

    def after_round(self, r: int, plan, ar) -> None:
        """Round ``r`` was applied: start its validation, publication and the read of recent proofs in the
        background (one task at a time: a round whose predecessor's task still runs only queues its drop
        proofs). Never raises."""
        try:
            if getattr(plan, "mode", None) != "accountable":
                return
            self.active = True
            self.pending.extend(getattr(ar, "proofs", None) or [])
            if self.task is not None and not self.task.done():
                log.debug("round %d: accountable validation skipped: the previous one still runs", r)
                return
            self._start(self.run(r), r, "accountable validation failed")
        except Exception as e:  # the round must go on
            log.warning("round %d: accountable validation not started: %s", r, e)

    def read_in_background(self, r: int, plan) -> None:
        """Round ``r`` runs without this peer (planned out, syncing): publish the proofs it holds and read and act on
        those of the last slots all the same, in the background (one task at a time, as :meth:`after_round`; a
        validator planned out after its validation otherwise never published what it found). Before session 26 only an
        applied round read them: at 16 peers an honest peer planned out for 7 rounds (a loaded machine's timings)
        never learnt that the swarm had excluded a forger, followed that forger's 2-peer plan once the others had
        left and applied its forged part. Never raises."""
        try:
            if getattr(plan, "mode", None) != "accountable" or self._dht() is None:
                return
            if self.task is not None and not self.task.done():
                return
            self._start(self.publish_and_read(r), r, "publishing or reading accountability proofs failed")
        except Exception as e:  # the wait for the round's end must go on
            log.warning("round %d: accountability proofs not read: %s", r, e)

    def _start(self, coro, r: int, failure: str) -> None:
        """Own ``coro`` as :attr:`task` (cancelled by the node's shutdown); its exception, if any, is logged as
        ``round r: <failure>: <exception>`` (one WARNING), never left unretrieved."""
        self.task = asyncio.ensure_future(coro)

        def failed(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.warning("round %d: %s: %s", r, failure, t.exception())

        self.task.add_done_callback(failed)

    async def run(self, r: int) -> None:
        """Validate round ``r``'s drawn parts, publish one held proof in slot ``r``, then read and act on the
        proofs of the last :data:`READ_SLOTS` slots."""
        collective = self._collective()
        if collective is not None:
            for f in await collective.validate_round(r, timeout_s=self.validate_timeout_s):
                if f.proof is not None:
                    self.pending.append(f.proof)
        await self.publish_and_read(r)

    async def publish_and_read(self, r: int) -> None:
        """Publish the proofs held here in slot ``r`` (one record: :meth:`_next_batch`), then :meth:`read`."""
        dht = self._dht()
        if dht is None:
            return
        batch = self._next_batch()
        if batch:
            ok = await self._publish(dht, r, batch)
            if not ok and len(batch) > 1:  # too large together: the first alone, the others in the next slots
                self.pending[:0] = batch[1:]
                batch = batch[:1]
                ok = await self._publish(dht, r, batch)
            if not ok:
                self.pending[:0] = batch  # next round's slot
            else:
                self.published += len(batch)
        await self.read(r)

    def _next_batch(self) -> list[bytes]:
        """The proofs to publish in this round's slot, taken from :attr:`pending`: the oldest proof against each
        owner not yet excluded here, at most :data:`~geomesh_p2p.trust.fraud.MAX_BUNDLE_PROOFS` (one record, a
        bundle). Other proofs against those owners, and any against an owner a proof already excluded here, are
        dropped: one proof excludes an owner, and a slot a round spent on a second one delayed the next owner's
        (k colluding owners that all dropped one victim were out only after k rounds, session 26). With the exact undo
        on (:attr:`undo_on`), forgery proofs are all kept: each one's part can be undone."""
        batch: list[bytes] = []
        rest: list[bytes] = []
        owners: set[str] = set()
        for proof in self.pending:
            who = fraud.accused_of(proof)
            # with the exact undo on, every forgery's proof is worth its slot: each one lets its part be undone
            undoable = self.undo_on and accountable.forged_range(proof) is not None
            if who and (who in self.proven or who in owners) and not undoable:
                continue
            if len(batch) < fraud.MAX_BUNDLE_PROOFS:
                batch.append(proof)
                if who:
                    owners.add(who)
            else:
                rest.append(proof)
        self.pending = rest
        return batch

    async def _publish(self, dht, r: int, batch: list[bytes]) -> bool:
        """Store ``batch`` as one record of slot ``r``; True when stored or when it can never be (too large for
        the DHT: logged, dropped), False to try again."""
        try:
            return await fraud.publish_proof(
                dht,
                fraud.bundle(batch),
                self.identity,
                run_id=self.run_id,
                slot=r,
                expiration_time=swarm_time() + PROOF_TTL_S,
            )
        except ValueError as e:
            if len(batch) > 1:
                return False
            log.warning("round %d: a proof cannot be published in the DHT (%s): it is not acted on", r, e)
            return True  # dropped, not retried

    async def read(self, r: int, slots: int = READ_SLOTS) -> None:
        """Read the proofs of slots ``r - slots + 1 .. r``, re-check each, exclude the accused."""
        dht = self._dht()
        if dht is None:
            return
        if self._reader is None or self._reader.dht is not dht:
            self._reader = fraud.ProofReader(dht)
        if len(self._seen) > 4096:
            self._seen.clear()
        valid, refused = await fraud.read_proofs(
            dht, self._reader, self.run_id, range(max(0, r - slots + 1), r + 1), seen=self._seen
        )
        for why in refused:
            log.info("accountable: %s", why)
        for p in valid:
            self.note_forgery(p.verdict, p.proof)
            self.apply(p.verdict)

    def note_forgery(self, verdict: accountable.ProofVerdict, proof: bytes) -> None:
        """Keep the part a re-checked forgery proof is about (:attr:`forged`), for an exact undo: every forgery,
        not only the first one that excluded its owner. Other kinds are not undone (a drop left out an input, an
        equivocation split the readers: the digest check repairs those)."""
        if verdict.kind != "forgery":
            return
        span = accountable.forged_range(proof)
        if span is not None:
            self.forged.setdefault((int(verdict.round), int(verdict.part)), span)
        for key in [k for k in self.forged if k[0] < verdict.round - 64]:  # bounded: far past any kept round
            self.forged.pop(key, None)
            self.undone.discard(key)

    def undo_list(self, r: int) -> list[tuple[int, int]]:
        """What the leader's plan of round ``r`` lists to undo (``RoundPlan.undo``): forgeries re-checked here, of
        rounds ``r - UNDO_ROUNDS .. r - 1``, that this peer's state still holds; sorted, at most 16."""
        keys = sorted(k for k in self.forged if r - UNDO_ROUNDS <= k[0] < r and k not in self.undone)
        return keys[:16]

    def undo_problem(self, plan, enabled: bool) -> Optional[str]:
        """Why this peer refuses the undo list of ``plan`` (None: no objection). From the plan and the run config
        alone (a :class:`~geomesh_p2p.plan.schema.ContentRefusal`: every honest follower gives it, the next leader
        takes over): an undo listed while ``enabled`` (RunConfig.undo_forged) is off or the round is not
        accountable, a round outside ``plan.round - UNDO_ROUNDS .. plan.round - 1``, a duplicate. From this peer's
        view (a plain reason, read again until the plan's settle ends: docs/security.md, "What the rogue-leader row
        found"): a listed forgery whose proof this peer has not read and re-checked yet; the read starts now in
        the background (:meth:`fetch_soon`), so a proof in the DHT lets this peer follow the plan within its settle,
        and a leader that lists a forgery nobody can prove is followed by nobody."""
        listed = [(int(a), int(b)) for a, b in (getattr(plan, "undo", None) or [])]
        if not listed:
            return None
        if not enabled or getattr(plan, "mode", None) != "accountable":
            return ContentRefusal("it lists undos, and this run does not undo forged parts (--undo-forged off)")
        if len(set(listed)) != len(listed):
            return ContentRefusal("its undo list names a part twice")
        out = [k for k in listed if not plan.round - UNDO_ROUNDS <= k[0] < plan.round]
        if out:
            return ContentRefusal(f"it lists undos of rounds {sorted({k[0] for k in out})} outside the kept rounds")
        unknown = [k for k in listed if k not in self.forged]
        if unknown:
            self.fetch_soon(plan.round)
            return f"it lists forged parts {unknown} whose proofs this peer has not read and re-checked yet"
        return None

    def fetch_soon(self, r: int) -> None:
        """Read the proofs of the last slots now, in the background, unless a task runs (a plan lists an undo
        whose proof this peer has not read yet: the plan's refusal is read again until its settle ends, so a
        proof read meanwhile lets this peer follow it). Never raises."""
        try:
            if self._dht() is None or (self.task is not None and not self.task.done()):
                return
            # from the oldest round an undo may name (UNDO_ROUNDS back) to this one
            self._start(self.read(r, slots=UNDO_ROUNDS + 2), r, "reading accountability proofs failed")
        except Exception as e:  # the plan check must go on
            log.warning("round %d: accountability proofs not read: %s", r, e)

    def apply(self, verdict: accountable.ProofVerdict) -> None:
        """Exclude ``verdict.accused`` for good (a proof re-checked here)."""
        if verdict.accused in self.proven:
            return
        self.proven[verdict.accused] = verdict
        self._verdicts().exclude_proven(
            verdict.accused,
            f"owner {verdict.kind} proven (round {verdict.round}, part {verdict.part}): {verdict.reason}",
            verdict.round,
        )

    def counts(self) -> Optional[dict]:
        """A round row's ``extra["accountable"]`` (None before any accountable round): the newest validation
        this peer finished (``validated_round`` and :class:`~geomesh_p2p.exchange.audit.ValidationStats`: parts
        validated, inputs fetched from owners / from senders, proofs found, suspicions, unvalidatable parts,
        input bytes), plus the proofs it published in the DHT and the owners it excluded on proofs, so far."""
        if not self.active:
            return None
        out: dict[str, Any] = {"published": self.published, "excluded": len(self.proven)}
        stats = getattr(self._collective(), "validation_stats", None) or {}
        if stats:
            newest = dict(stats[max(stats)].as_dict())
            out["validated_round"] = newest.pop("round")
            out.update(newest)
        return out

    def cancel(self) -> None:
        """Stop a validation in flight (shutdown)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
