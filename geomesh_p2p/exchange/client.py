"""The client side of the collective: :class:`CollectiveService` (owner side from :mod:`.owner`)
with ``all_reduce``, its push / pull retry loops, and the round's :class:`AllReduceResult`.

Memory (issue 13): the round's aggregate is one preallocated fp32 buffer [numel]; every part's
result is decoded (reencode) or aggregated (relay) straight into its slice in a worker thread, so
no per-part or per-contributor full-size tensor is kept and nothing is concatenated. With
``in_place=True`` (issue 27) that buffer is the update itself: a part's result overwrites the update's
slice once this node's push of that part is encoded, so the exchange holds no [numel] beyond the update.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Optional, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.telemetry import events
from geomesh_p2p.exchange.codec._format import all_finite
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.exchange import accountable, audit, messages, own_entry
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.witness import receipt_problem
from geomesh_p2p.exchange.commitment import contribution_digest
from geomesh_p2p.exchange.owner import OwnerService, _RoundState
from geomesh_p2p.exchange.partition import CollectiveSpec, _pid_bytes, _short
from geomesh_p2p.exchange.result import AllReduceResult
from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.links import link_sample
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.wire import collective_pb2

__all__ = ["AllReduceResult", "CollectiveService"]

log = logging.getLogger(__name__)

Code = grpc.StatusCode
# OUT_OF_RANGE: the envelope's timestamp aged past the skew window between signing and
# verification (a large message on a slow or congested link): re-signing and resending can succeed.
# RESOURCE_EXHAUSTED: the owner's transport is busy (per-caller / per-class call caps): try again.
_RETRY_PUSH = {Code.UNAVAILABLE, Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED}
_RETRY_PULL = {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.UNKNOWN, Code.INTERNAL, Code.OUT_OF_RANGE}


def _held(stated: float, call_s: float) -> float:
    """A server's stated hold (seconds), clamped to [0, call_s]; a bogus value counts as 0."""
    return min(max(0.0, float(stated)), call_s) if math.isfinite(stated) else 0.0


class CollectiveService(OwnerService):
    """One per node: serves ``PushPart`` / ``PullPart`` for the parts it owns (:class:`.owner.OwnerService`,
    whose docstring gives the refusals and the per-round state) and runs all-reduces (:meth:`all_reduce`).

    Create it before ``await transport.start()`` (it registers its handlers); ``await close()`` on shutdown.
    """

    #: relay mode: owners are asked to leave this peer's own contribution out of the results they serve it
    #: (:mod:`.own_entry`; False: the whole results, as before 0.6.0: for side-by-side measurements)
    omit_own: bool = True

    # ----------------------------------------------------------------------------- peer side
    async def all_reduce(
        self,
        spec: CollectiveSpec,
        delta: torch.Tensor,
        tokens: int,
        compute_end: Optional[float] = None,
        *,
        in_place: bool = False,
        read: Optional[Sequence[int]] = None,
    ) -> AllReduceResult:
        """Contribute ``delta`` (trained on ``tokens`` tokens) and return the round's aggregate.

        Args:
            spec: the round's :class:`CollectiveSpec`; this node must be a participant.
            delta: fp32 tensor with ``spec.numel`` elements (any shape, flattened), finite; must not
                be modified by the caller until this call returns. Not modified by it unless ``in_place``.
            tokens: tokens this peer trained on this round (>= 0; capped by the receivers).
            compute_end: unix seconds when this peer's inner steps ended (default: now); carried
                in its contributions so that every peer can tell straggler from network idle.
            in_place: write the aggregate into ``delta``'s own storage (when ``delta`` is a contiguous
                fp32 CPU tensor; otherwise into the CPU fp32 copy made of it) instead of a new [numel]
                buffer: part ``j``'s result overwrites ``delta``'s slice of ``j`` once this node's push of
                ``j`` is encoded (or will never be), missing parts are zeroed; the result's ``aggregate``
                is then ``delta`` (flattened) and its values are bitwise those of ``in_place=False``.
                ``delta`` is garbage if the call raises. The caller must not read ``delta`` as its update
                meanwhile (eager updates do: they pass False).
            read: the parts whose results this node reads (default all); the others are pushed only, left out
                of ``contributors`` and ``missing_parts``, and their slices are not written (a reduce-scatter:
                the group level of a grouped round reads its own parts, :mod:`.groups`).

        Returns:
            :class:`AllReduceResult`. It returns by ``spec.pull_deadline`` (plus the time to decode),
            whatever the other peers do, unless an owner could not be reached by then: its part is asked for
            ``late_pull_s`` more at most (:meth:`_pull`); parts with no result, or a result its owner signed
            after the pull deadline, are zeros and listed as missing.

        Raises:
            ValueError: a bad spec / delta, not a participant, the round already run on this node.
            compression.CodecError: ``delta`` holds NaN or Inf.
        """
        t0, started = swarm_time(), time.monotonic()  # compute_end is read by other peers: swarm time (issue 29 #3)
        me = self.peer_id
        if me not in spec.participants:
            raise ValueError(f"this node ({_short(me)}) is not a participant of round {spec.round}")
        if not isinstance(delta, torch.Tensor) or delta.numel() != spec.numel:
            raise ValueError(f"delta must be a tensor with {spec.numel} elements")
        if int(tokens) < 0:
            raise ValueError("tokens must be >= 0")
        # A copy only when delta is not already a CPU fp32 vector; both steps touch the whole vector.
        delta = await asyncio.to_thread(_cpu_fp32_finite, delta)
        state = self.register(spec)
        if state.contributing:
            raise ValueError(f"round {spec.round} was already run on this node")
        state.contributing = True
        state.compute_end = t0 if compute_end is None else float(compute_end)
        s_before = self._collective_bytes()

        n_parts = len(spec.owners)
        if in_place:
            # Issue 27: no second [numel]; each part's slice of delta is read by its push's encoding, then
            # becomes that part's aggregate (_obtain waits for the event before it writes).
            state.delta_free = {j: asyncio.Event() for j in range(n_parts)}
            zeros = delta
        else:
            # Zero-filled in a worker thread, before any task starts: at 100M+ elements the fill and its page
            # faults stalled the loop ~1 s.
            zeros = await asyncio.to_thread(lambda: torch.zeros(spec.numel, dtype=torch.float32))
        # Butterfly order: start with the part after "mine" so that not every sender hits owner 0
        # first; at most max_concurrent_pushes uploads at once, so each upload gets the link to
        # itself and arrives soon after it was signed (the receiver checks the envelope's age).
        me_rank = sorted(spec.participants, key=_pid_bytes).index(me)
        order = [(me_rank + 1 + k) % n_parts for k in range(n_parts)]
        uploads = asyncio.Semaphore(self.max_concurrent_pushes)
        by_part = {j: asyncio.ensure_future(self._deliver(state, j, delta, int(tokens), uploads)) for j in order}
        pushes = [by_part[j] for j in range(n_parts)]
        state.push_tasks = by_part
        # The round's one full-size buffer: every part's result is written into its slice.
        aggregate = state.aggregate = zeros
        # At most max_pulls_per_owner pulls (long polls) in flight per owner: an owner of many parts (parts
        # are cut small so that transfers and reductions overlap) would otherwise see more calls from this
        # node than its per-sender call cap; per owner, so an unreachable owner stalls only its own parts.
        state.pull_slots = {o.peer_id: asyncio.Semaphore(self.max_pulls_per_owner) for o in spec.owners}
        reading = list(range(n_parts)) if read is None else sorted(set(read))
        pulls = [asyncio.ensure_future(self._obtain(state, j)) for j in reading]
        try:
            outcomes = await asyncio.gather(*pulls)
            pushed = dict(enumerate(await asyncio.gather(*pushes)))
        finally:
            for t in pushes + pulls:
                t.cancel()
            await asyncio.gather(*pushes, *pulls, return_exceptions=True)
            state.aggregate = None  # the result owns it now; the kept round state must not pin it
            state.delta_free = {}
            state.push_tasks, state.own_pushed = {}, {}  # relay: the own pushes were put back where needed

        contributors, missing = {}, []
        packets: dict[str, dict[int, Any]] = {}
        last_compute_end = 0.0
        for j, out in zip(reading, outcomes):
            if out is None:
                missing.append(j)  # its slice is zeros (_obtain zeroes a refused part)
                continue
            contributors[j] = out[1]
            last_compute_end = max(last_compute_end, out[2])
            for sender, packet in out[3].items():
                packets.setdefault(sender, {})[j] = packet
        if missing:
            log.warning(
                "round %d: parts %s have no result (owner gone or refused): zero update for %s",
                spec.round,
                missing,
                ", ".join(f"[{spec.owners[j].start}, {spec.owners[j].end})" for j in missing),
            )
        if in_place and missing:
            # their slices still hold this node's update (every push has returned: nothing reads them now)
            ranges = [(spec.owners[j].start, spec.owners[j].end) for j in missing]
            await asyncio.to_thread(_zero_ranges, aggregate, ranges)
        proofs = list(state.proofs)
        s_after = self._collective_bytes()
        up = link_sample((n, a, b) for d, n, a, b in state.transfers if d == "up")
        down = link_sample((n, a, b) for d, n, a, b in state.transfers if d == "down")
        return AllReduceResult(
            aggregate,
            contributors,
            missing,
            pushed,
            s_after[0] - s_before[0],
            s_after[1] - s_before[1],
            time.monotonic() - started,
            last_compute_end,
            up,
            down,
            packets,
            [(o.start, o.end) for o in spec.owners],
            dict(state.result_hashes),
            proofs,
        )

    async def validate_round(
        self, round: int, *, timeout_s: float = 10.0, parts: Optional[list[int]] = None
    ) -> list[audit.Finding]:
        """Accountable mode, after ``round``'s all-reduce returned: re-check the parts this node is drawn to
        validate (:func:`.audit.validate_round`: inputs pulled with a deadline, the rule recomputed in a
        worker thread). Returns the findings (proofs re-checked here); ``[]`` for other modes."""
        return await audit.validate_round(self, round, timeout_s=timeout_s, parts=parts)

    def _read_slot(self) -> asyncio.Semaphore:
        """The semaphore that serialises this node's part reads (created on first use, in the loop)."""
        sem = getattr(self, "_reads", None)
        if sem is None:
            sem = self._reads = asyncio.Semaphore(1)
        return sem

    def _collective_bytes(self) -> tuple[int, int]:
        by = self.transport.stats.by_method
        a, b, c = (by.get(m, (0, 0)) for m in self.methods.all())
        return a[0] + b[0] + c[0], a[1] + b[1] + c[1]

    def _contribution_bytes(
        self, spec: CollectiveSpec, j: int, delta: torch.Tensor, tokens: int, compute_end: float = 0.0
    ) -> bytes:
        """Part ``j`` of ``delta``, encoded and signed (:func:`.messages.contribution_bytes`). Worker thread."""
        return messages.contribution_bytes(self.transport.identity, spec, j, delta, tokens, compute_end)

    def _push_payload(
        self, spec: CollectiveSpec, j: int, delta: torch.Tensor, tokens: int, compute_end: float
    ) -> bytes:
        """The PushPartRequest bytes of part ``j`` (the signed contribution is not kept apart). Worker thread."""
        # Joined once: the fp32 packet is copied from ``delta`` straight into the request bytes.
        return messages.push_request_bytes(
            messages.contribution_parts(self.transport.identity, spec, j, delta, tokens, compute_end)
        )

    async def _deliver(
        self, state: _RoundState, j: int, delta: torch.Tensor, tokens: int, uploads: Optional[asyncio.Semaphore] = None
    ) -> bool:
        """Encode, sign and push part ``j`` to its owner, retrying UNAVAILABLE / OUT_OF_RANGE until
        the deadline. ``uploads`` bounds the pushes in flight (the local part does not count)."""
        spec = state.spec
        owner = spec.owners[j]
        try:
            await self._before_push(spec, j)
            if owner.peer_id != self.peer_id and uploads is not None:
                async with uploads:
                    return await self._deliver_now(state, j, delta, tokens)
            return await self._deliver_now(state, j, delta, tokens)
        finally:
            free = state.delta_free.get(j)
            if free is not None and j not in state.encoding:
                free.set()  # no encoding thread started (done without one, refused, or cancelled before it)

    async def _encode(self, state: _RoundState, j: int, fn, *args):
        """``fn(*args)`` in a worker thread: the encoding of part ``j`` from the update. In-place all-reduce:
        ``state.delta_free[j]`` is set when that thread returns, not when the awaiting task is cancelled
        (a cancelled ``to_thread`` keeps running and reading the update's slice)."""
        free = state.delta_free.get(j)
        if free is None:
            return await asyncio.to_thread(fn, *args)
        loop = asyncio.get_running_loop()

        def run():
            try:
                return fn(*args)
            finally:
                try:
                    loop.call_soon_threadsafe(free.set)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

        state.encoding.add(j)
        return await asyncio.to_thread(run)

    async def _deliver_now(self, state: _RoundState, j: int, delta: torch.Tensor, tokens: int) -> bool:
        spec = state.spec
        owner = spec.owners[j]
        if owner.peer_id == self.peer_id:
            part = state.parts[j]
            if spec.push_encoding == "fp32" and spec.mode == "reencode":
                # The own fp32 part is neither forwarded nor re-checked by anyone: signing it and verifying
                # that signature cost a join and two SHA-256 passes over the part for nothing. It is a view
                # of ``delta`` (finite, checked above; the caller leaves it unchanged until we return).
                end = state.compute_end if math.isfinite(state.compute_end) else 0.0
                self._accept(
                    state,
                    part,
                    messages.Contribution(
                        self.peer_id, tokens, delta[owner.start : owner.end], b"", min(end, swarm_time())
                    ),
                )
                return True
            signed = await self._encode(state, j, self._contribution_bytes, spec, j, delta, tokens, state.compute_end)
            try:
                c = await asyncio.to_thread(self._check_contribution, spec, j, signed, self.peer_id)
                self._accept(state, part, c)
                witness = accountable.witness_of(spec, j) if spec.mode == "accountable" else None
                if witness is not None and part.witness_task is None:
                    part.witness_task = self._tasks.spawn(
                        self._hand_to_witness(state, part, witness, signed, c.digest),
                        name=f"witness r{spec.round} p{j}",
                    )
                return True
            except EnvelopeError as err:
                log.warning("round %d: own part %d refused my contribution: %s", spec.round, j, err.reason)
                return False
        payload = await self._encode(state, j, self._push_payload, spec, j, delta, tokens, state.compute_end)
        delay = 0.05
        while True:
            remaining = spec.deadline - swarm_time()
            if remaining <= 0:
                log.warning(
                    "round %d: part %d not delivered to %s before the deadline", spec.round, j, _short(owner.peer_id)
                )
                return False
            try:
                t_call = time.monotonic()
                reply = await self.transport.call(
                    owner.address, self.methods.push, payload, round=spec.round, timeout=remaining + self.push_grace_s
                )
                t_reply = time.monotonic()
            except RpcError as e:
                if e.code in _RETRY_PUSH and spec.deadline - swarm_time() > 0:
                    await asyncio.sleep(min(delay, max(0.0, spec.deadline - swarm_time())))
                    delay = min(2 * delay, 0.5)
                    continue
                self._log_once(
                    (spec.round, owner.peer_id, "push-failed", j),
                    logging.WARNING,
                    "round %d: push of part %d to %s failed: %s: %s",
                    spec.round,
                    j,
                    _short(owner.peer_id),
                    e.code.name,
                    e.reason,
                )
                return False
            if reply.sender.to_string() != owner.peer_id:
                log.warning(
                    "round %d: part %d: %s answered instead of owner %s",
                    spec.round,
                    j,
                    reply.sender.short(),
                    _short(owner.peer_id),
                )
                return False
            resp = collective_pb2.PushPartResponse.FromString(reply.payload)
            # The bytes were on the wire before the owner's handler ran: its hold ends the interval early.
            state.transfers.append(("up", len(payload), t_call, t_reply - _held(resp.held_s, t_reply - t_call)))
            if resp.accepted and spec.mode == "relay" and self.omit_own:
                state.own_pushed[j] = payload  # put back into its result, which the owner serves without it
            if resp.accepted and spec.mode == "accountable":
                state.pushed.setdefault(j, payload)  # served to validators whose owner withholds (from_sender)
                await self._keep_receipt(state, j, payload, resp.receipt)
            return resp.accepted

    async def _hand_to_witness(self, state: _RoundState, part, witness, signed: bytes, digest: bytes) -> None:
        """Accountable mode: hand this owner's own signed contribution to part ``part.index`` to the part's
        witness (a witness push, retried like a push until the deadline) and keep its checked receipt in
        ``part.witness_receipt`` (the result lists the own contribution only with it). Never raises."""
        spec, j = state.spec, part.index
        payload = messages.push_request_bytes(signed, witness=True)
        delay, why = 0.05, "deadline passed"
        while spec.deadline - swarm_time() > 0:
            try:
                reply = await self.transport.call(
                    witness.address, self.methods.push, payload, round=spec.round, timeout=spec.deadline - swarm_time()
                )
                resp = collective_pb2.PushPartResponse.FromString(reply.payload)
                rc = await asyncio.to_thread(accountable.open_receipt, self._inner, resp.receipt)
                # the readers' own rule (witness_problem): a receipt they would refuse costs this owner the part
                why_not = receipt_problem(spec, j, rc, digest)
                if why_not is not None:
                    raise EnvelopeError(Code.INVALID_ARGUMENT, why_not)
                part.witness_receipt = bytes(resp.receipt)
                return
            except RpcError as e:
                why = f"{e.code.name}: {e.reason}"
                if e.code not in _RETRY_PUSH:
                    break
                await asyncio.sleep(min(delay, max(0.0, spec.deadline - swarm_time())))
                delay = min(2 * delay, 0.5)
            except (EnvelopeError, DecodeError) as e:
                why = getattr(e, "reason", "malformed reply")
                break
        log.warning(
            "round %d: witness %s did not receipt this owner's own contribution to part %d (%s)",
            spec.round,
            _short(witness.peer_id),
            j,
            why,
        )

    async def _keep_receipt(self, state: _RoundState, j: int, payload: bytes, receipt: bytes) -> None:
        """Accountable mode: check the owner's receipt of this node's push of part ``j`` (its signer, part,
        spec, tokens and the hash of the contribution pushed) and keep it (``state.receipts``); a missing or
        wrong receipt is logged (no drop of that push can be proven then)."""
        spec, owner = state.spec, state.spec.owners[j]
        try:
            rc, mine = await asyncio.to_thread(self._open_receipt, payload, receipt)
            if (rc.owner, rc.round, rc.part, rc.spec_id, rc.sender) != (
                owner.peer_id,
                spec.round,
                j,
                spec.spec_id,
                self.peer_id,
            ) or rc.sha256 != mine:
                raise EnvelopeError(Code.INVALID_ARGUMENT, "the receipt is not of this push")
            state.receipts[j] = rc
        except EnvelopeError as err:
            self._log_once(
                (spec.round, owner.peer_id, "receipt", j),
                logging.WARNING,
                "round %d: owner %s accepted part %d without a valid receipt (%s): a drop of it cannot be proven",
                spec.round,
                _short(owner.peer_id),
                j,
                err.reason,
            )

    def _open_receipt(self, payload: bytes, receipt: bytes) -> tuple[accountable.Receipt, bytes]:
        """(the receipt opened, SHA-256 of the contribution a PushPartRequest ``payload`` carries). Worker
        thread. Raises EnvelopeError when the receipt is absent, malformed or forged."""
        if not receipt:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "no receipt")
        mine = contribution_digest(messages.push_request_contribution(payload))
        return accountable.open_receipt(self._inner, receipt), mine

    def _check_inclusion(self, spec: CollectiveSpec, j: int, signed: wire.Buffer) -> tuple[bytes, Optional[bytes]]:
        """Accountable mode, a worker thread: (the result's hash, a drop proof or None). The proof when this
        node holds the owner's receipt of its push of ``j`` and the result omits it (or lists other tokens)."""
        opened = accountable.open_result(self._inner, signed, len(spec.participants))
        state = self._rounds.get(spec.round)
        rc = None if state is None else state.receipts.get(j)
        if rc is None:
            return opened.payload_sha256, None
        problem = accountable.inclusion_problem(spec, opened, rc)
        if problem is None:
            return opened.payload_sha256, None
        proof = accountable.drop_proof(rc.signed, signed, spec)
        accountable.verify_proof(spec.run_id, proof)  # the check any peer makes: never keep a proof that fails it
        return opened.payload_sha256, proof

    async def _obtain(
        self, state: _RoundState, j: int
    ) -> Optional[tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]]:
        """Result of part ``j`` as (fp32 [size], contributors, last compute end, relayed packets by sender),
        or None if none by the pull deadline. The values are written into the part's slice of
        ``state.aggregate`` (when set: the round's one fp32 buffer); a refused result leaves it zeros."""
        spec = state.spec
        owner = spec.owners[j]
        out = None if state.aggregate is None else state.aggregate[owner.start : owner.end]
        signed: Optional[wire.Buffer]
        if owner.peer_id == self.peer_id:
            part = state.parts[j]
            left = spec.pull_deadline - swarm_time()
            if not await wait_event(part.ready, left):
                part.late = True  # left out here: a result landing from now on is never served either (_finish)
                log.warning("round %d: my own part %d is not reduced by the pull deadline", spec.round, j)
                return None
            signed = part.result()
        else:
            slot = state.pull_slots.get(owner.peer_id)
            if slot is None:
                signed = await self._pull(spec, j)
            else:
                async with slot:
                    signed = await self._pull(spec, j)
            if signed is None:
                return None
            if spec.round in self._rounds:
                # Serve it to peers that cannot reach the owner from now on, before it is decoded (which can
                # take a while: the read slot, a loaded CPU): an owner gone meanwhile otherwise left them
                # without a copy, and they gave up on a part this peer applies. Its verdict (signature,
                # signed time) is the same on every peer, so the bytes are served before this peer's own.
                state.cache[j] = signed
                state.cache_event(j).set()
        free = state.delta_free.get(j)
        if free is not None and out is not None:
            # In place: the slice is this node's update until its push of part j is encoded. A result of
            # a part its owner closed without this node cannot wait long: that push is then refused at once.
            await free.wait()
        try:
            # One part read at a time: a robust rule decodes every contribution of the part to fp32 (about
            # (contributors + 5) x the part's bytes while it runs); reading the parts concurrently held that
            # for every part at once (~3 GB at gpt2-124m) for no gain on a CPU the peers already saturate.
            async with self._read_slot():
                res = await asyncio.to_thread(self._read_result, spec, j, signed, out)
        except EnvelopeError as err:
            # A hostile or broken owner, not a fault of this node: every reader refuses the same bytes.
            log.warning(
                "round %d: result of part %d from %s refused: %s: %s",
                spec.round,
                j,
                _short(owner.peer_id),
                err.code.name,
                err.reason,
            )
            if out is not None:
                out.zero_()  # a refused result may have been decoded in part: the part is a zero update
            if spec.mode == "accountable":
                # refused, yet still the owner's signed word: an owner that drops enough receipted pushes to
                # fall under the quorum must not escape its drop proof (session 26's drop-owner, K = all); one
                # above the scale bound is validated as if applied (every reader refuses it alike, so its hash
                # seeds the same validator draw everywhere), so its forger is proven, not only refused
                over = isinstance(err, messages.OverBoundError)
                await self._note_accountable(state, j, signed, applied=over)
            return None
        signed_at = _signed_at(signed)
        if signed_at > spec.pull_deadline:
            # The same rule on every peer, from the owner's signed timestamp: readers that got the result late
            # and those that gave up agree (see _pull). The owner itself waits for its part only until the
            # deadline, so it never applies such a result either; and one that reaches the owner's loop after
            # the deadline, though signed before it, is served to nobody (OwnerService._finish).
            log.warning(
                "round %d: result of part %d from %s was signed %.1f s after the pull deadline: left out (as on "
                "every peer)",
                spec.round,
                j,
                _short(owner.peer_id),
                signed_at - spec.pull_deadline,
            )
            if out is not None:
                out.zero_()
            if spec.mode == "accountable":
                await self._note_accountable(state, j, signed, applied=False)
            return None
        if spec.mode == "accountable":
            await self._note_accountable(state, j, signed)
        return res

    async def _note_accountable(self, state: _RoundState, j: int, signed: wire.Buffer, applied: bool = True) -> None:
        """Keep the applied result's hash of part ``j`` (``applied``: only then, it seeds the validator draw) and
        check that this node's receipted push is in it; a drop proof is kept in ``state.proofs`` and logged
        (event ``owner_dropped_contribution``). A result every reader refuses (quorum, a late signature) still
        proves a drop: the receipt and the result are both the owner's signed word, whatever the readers did."""
        spec, owner = state.spec, state.spec.owners[j]
        try:
            digest, proof = await asyncio.to_thread(self._check_inclusion, spec, j, signed)
        except (EnvelopeError, accountable.ProofError) as e:
            # an applied result was accepted by read_result: should not happen; a refused one may be malformed
            (log.warning if applied else log.debug)(
                "round %d: part %d: accountable result unreadable: %s", spec.round, j, e
            )
            return
        if applied:
            state.result_hashes[j] = digest
        if proof is not None:
            state.proofs.append(proof)
            events.emit(
                log,
                logging.WARNING,
                "owner_dropped_contribution",
                "round %d: owner %s dropped this peer's receipted contribution to part %d (drop proof held)",
                spec.round,
                _short(owner.peer_id),
                j,
                peer=self.peer_id,
                round=spec.round,
                part=j,
                owner=owner.peer_id,
            )

    async def _pull(self, spec: CollectiveSpec, j: int) -> Optional[wire.Buffer]:
        """The owner-signed result of part ``j`` (the owner's, or a helper's cached copy when the owner is
        unreachable), or None.

        Until the pull deadline: long polls. Past it, only quick asks, for at most ``late_pull_s`` more
        seconds, and only while no ask sent after the deadline was answered: an owner that answers "not
        ready" then will sign its result after the deadline, and :meth:`_obtain` leaves such results out on
        every peer. So whether a part is applied depends on when its owner signed it, not on when each
        reader got it: a reader whose pulls ran late (an overloaded host) still applies what the others
        applied, instead of ending the round on another state (issue 25, run 8 of docs/scale.md)."""
        await self._before_pull(spec, j)
        # relay: the own push to j, left out of j's result when asked (own_entry); waited for, so the first pull asks
        state = self._rounds.get(spec.round)
        own = None
        if state is not None and spec.mode == "relay":
            push = state.push_tasks.get(j)
            if push is not None:
                await asyncio.wait({push})
            own = state.own_pushed.get(j)
        owner = spec.owners[j]
        helpers = [
            o.address
            for o in {o.peer_id: o for o in spec.owners}.values()
            if o.peer_id not in (owner.peer_id, self.peer_id)
        ]
        delay, last_err = 0.05, "no answer"
        gone = False  # no connection to the owner even after the transport's redial: its process is gone
        late_end = spec.pull_deadline + self.late_pull_s
        while True:
            now = swarm_time()
            remaining = late_end - now
            past = now >= spec.pull_deadline  # this ask is sent after the deadline
            if remaining <= 0:
                log.warning(
                    "round %d: part %d: no result from owner %s by the pull deadline (+%.0f s) (%s)",
                    spec.round,
                    j,
                    _short(owner.peer_id),
                    self.late_pull_s,
                    last_err,
                )
                return None
            wait_s = 0.0 if past else max(0.0, min(self.long_poll_s, spec.pull_deadline - now - 0.25))
            req = collective_pb2.PullPartRequest(
                round=spec.round, part=j, wait_s=wait_s, spec_id=spec.spec_id, omit_caller=own is not None
            )
            try:
                t_call = time.monotonic()
                reply = await self.transport.call(
                    owner.address, self.methods.pull, req.SerializeToString(), round=spec.round, timeout=remaining
                )
                t_reply = time.monotonic()
                resp = await messages.parse_pull(reply.payload)
                if resp.ready:
                    # The long poll comes first, the result's bytes after it: the hold starts the interval late.
                    state = self._rounds.get(spec.round)
                    if state is not None:
                        state.transfers.append(
                            ("down", len(reply.payload), t_call + _held(resp.held_s, t_reply - t_call), t_reply)
                        )
                    if own is None:
                        return resp.signed_result
                    try:
                        return await own_entry.restore(resp.signed_result, messages.push_request_contribution(own))
                    except EnvelopeError as e:  # not restorable: read as served, refused as tampered (the reason)
                        log.warning("round %d: part %d: %s", spec.round, j, e.reason)
                        return resp.signed_result
                if past:
                    # no result at the owner after the deadline: one it signs later is left out by every peer
                    log.warning(
                        "round %d: part %d: owner %s had no result by the pull deadline",
                        spec.round,
                        j,
                        _short(owner.peer_id),
                    )
                    return None
                if wait_s < 0.05:
                    await asyncio.sleep(min(0.05, max(0.0, spec.pull_deadline - swarm_time())))
                continue
            except RpcError as e:
                last_err = f"{e.code.name}: {e.reason}"
                gone = gone or e.unreachable
                if e.code not in _RETRY_PULL:
                    log.warning(
                        "round %d: part %d refused by owner %s: %s", spec.round, j, _short(owner.peer_id), last_err
                    )
                    return None
            except DecodeError:
                last_err = "malformed reply"
            # The owner is unreachable: maybe another serving peer got the owner's signed result.
            for h in helpers:
                left = late_end - swarm_time()
                if left <= 0:
                    break
                req = collective_pb2.PullPartRequest(round=spec.round, part=j, wait_s=0.0, spec_id=spec.spec_id)
                try:
                    reply = await self.transport.call(
                        h, self.methods.pull, req.SerializeToString(), round=spec.round, timeout=min(1.0, left)
                    )
                    resp = await messages.parse_pull(reply.payload)
                    if resp.ready:  # a helper's copy is whole (only the owner leaves the caller's entry out)
                        log.info(
                            "round %d: part %d obtained from %s (owner unreachable)",
                            spec.round,
                            j,
                            reply.sender.short(),
                        )
                        return resp.signed_result
                except (RpcError, DecodeError):
                    pass
            if gone:
                # Waiting for the pull deadline would stretch every puller's round to it (15.8 s instead
                # of ~3.5 s with a killed owner); nobody else had its result just now: the part is missing.
                events.emit(
                    log,
                    logging.WARNING,
                    "owner_unreachable",
                    "round %d: part %d: owner %s is unreachable (%s); giving up on the part",
                    spec.round,
                    j,
                    _short(owner.peer_id),
                    last_err,
                    peer=str(self.transport.identity.peer_id),
                    round=spec.round,
                    part=j,
                    owner=owner.peer_id,
                    error=str(last_err),
                )
                return None
            await asyncio.sleep(min(delay, max(0.0, late_end - swarm_time())))
            delay = min(2 * delay, 0.5)

    def _read_result(
        self, spec: CollectiveSpec, j: int, signed: wire.Buffer, out: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]:
        """Verify the owner-signed PartResult of part ``j`` and turn it into (fp32 [size] -- ``out`` if
        given --, contributors, last compute end, relayed sign packets): :func:`.messages.read_result`.
        Synchronous: a worker thread. Raises EnvelopeError for a result every reader refuses.

        Relay: every forwarded contribution is re-verified; invalid ones and repeated senders are
        dropped (the same bytes give the same choice on every peer), the rest are sorted by raw
        PeerID, capped, clipped and averaged with :func:`token_weighted_mean`.
        """
        o = spec.owners[j]

        def bad(reason: str) -> None:
            self._log_once(
                (spec.round, o.peer_id, "relay-bad", j),
                logging.WARNING,
                "round %d: part %d: owner %s relayed an invalid contribution, dropped: %s",
                spec.round,
                j,
                _short(o.peer_id),
                reason,
            )

        return messages.read_result(self._inner, spec, j, signed, out=out, on_bad_relay=bad)


def _zero_ranges(v: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    """``v[s:e] = 0`` for every ``(s, e)`` of ``ranges`` (a worker thread: parts are large)."""
    for s, e in ranges:
        v[s:e].zero_()


def _cpu_fp32_finite(delta: torch.Tensor) -> torch.Tensor:
    """``delta`` as a flat CPU fp32 tensor (no copy when it is one already); CodecError on NaN / Inf."""
    delta = delta.detach().to("cpu", torch.float32).reshape(-1)
    if not all_finite(delta):
        raise compression.CodecError("delta contains NaN or Inf; refusing to contribute")
    return delta


def _signed_at(signed: wire.Buffer) -> float:
    """Swarm time (unix seconds) at which the owner signed a part result (its envelope's timestamp; the
    signature over it was checked by :func:`~geomesh_p2p.exchange.messages.read_result`). +inf when the
    envelope cannot be read (never after a successful read)."""
    try:
        env = wire.SignedView(signed).envelope
    except wire.WireError:
        return math.inf
    return float(env.timestamp) if env is not None and math.isfinite(env.timestamp) else math.inf
