"""The owner (server) side of the collective: per-round state, ``PushPart`` / ``PullPart`` handlers,
closing parts at the deadline, building the signed part results (:mod:`.messages`, in worker threads).

:class:`OwnerService` is the base of :class:`~geomesh_p2p.exchange.CollectiveService` (which adds
the client side, :mod:`.client`); the two share one per-round state (:class:`_RoundState`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
from google.protobuf.message import DecodeError

from geomesh_p2p.telemetry import events
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.exchange import accountable, messages, own_entry
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.group_commitment import commitment_of_contribution
from geomesh_p2p.exchange.messages import Contribution
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner, _pid_bytes, _short
from geomesh_p2p.net.identity import EnvelopeError, Verified, Verifier
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.net.transport import TaskOwner, Transport
from geomesh_p2p.net.methods import COLLECTIVE, CollectiveMethods
from geomesh_p2p.wire import collective_pb2

__all__ = ["OwnerService"]

log = logging.getLogger(__name__)

Code = grpc.StatusCode

#: replies (results) larger than this are serialized in a worker thread, not on the event loop
_THREAD_BYTES = 1 << 20
#: a PullInputs reply holds inputs up to about this many bytes (at least one): the validator pages on
_INPUTS_PAGE_BYTES = 16 << 20

_Contribution = Contribution  # the name older code and tests use


@dataclass
class _OwnedPart:
    index: int
    owner: PartOwner
    contributions: dict[str, _Contribution] = field(default_factory=dict)
    closed_by: Optional[str] = None
    closing_early: bool = False  # every established participant pushed: the close is scheduled
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    signed_result: Optional[bytes] = None
    #: the pull deadline passed on this node before the result reached its event loop (or a wait for it gave up
    #: there): the result is never served, so every peer, this owner included, leaves the part out (_finish)
    late: bool = False
    #: PeerIDs this owner handed the result to (a pull answered ready): what a leaving owner waits for
    pulled_by: set = field(default_factory=set)
    #: accountable mode: the signed contributions the result commits to, in its order (served to validators)
    inputs: list = field(default_factory=list)
    #: accountable mode: the sender of each of ``inputs`` (base58 PeerIDs, same order)
    input_senders: list = field(default_factory=list)
    #: accountable mode: the witness's signed receipt of this owner's own contribution (empty: none yet), and
    #: the task handing it over (the result waits for it, then leaves the own contribution out without one)
    witness_receipt: bytes = b""
    witness_task: Optional[asyncio.Future] = None
    #: relay mode: raw PeerID -> position of its contribution in the signed result (read from the result once, on
    #: the first pull that asks to leave the caller's entry out: :func:`.own_entry.entry_positions`)
    relay_positions: Optional[dict] = None

    def result(self) -> bytes:
        """The signed result (envelope bytes), once ``ready`` is set (it is set only after the result is built).

        Raises:
            RuntimeError: read before the result was built (a caller that did not wait for ``ready``).
        """
        if self.signed_result is None:
            raise RuntimeError(f"part {self.index}: its result is read before it was built")
        return self.signed_result


@dataclass
class _RoundState:
    spec: CollectiveSpec
    parts: dict[int, _OwnedPart]
    cache: dict[int, wire.Buffer] = field(default_factory=dict)  # owner-signed results pulled from others
    # part -> set once this node holds the part's result in ``cache`` (grouped rounds' readers wait on it)
    cached: dict[int, asyncio.Event] = field(default_factory=dict)
    contributing: bool = False
    compute_end: float = 0.0  # this node's, carried in its contributions
    # (direction "up"/"down", payload bytes, start, end) in monotonic seconds, server hold taken out
    transfers: list[tuple[str, int, float, float]] = field(default_factory=list)
    # fp32 [numel] CPU tensor: this node's aggregate of the round, every part decoded into its slice
    aggregate: Optional[Any] = None
    # in-place all-reduce (the aggregate written into the update's own storage): part -> set once this node
    # no longer reads the update's slice of that part (its push encoded, or never to be); empty otherwise
    delta_free: dict[int, asyncio.Event] = field(default_factory=dict)
    # in-place all-reduce: parts whose push encoding started in a worker thread (that thread sets delta_free)
    encoding: set[int] = field(default_factory=set)
    # owner PeerID -> semaphore bounding this node's pulls in flight to that owner (set by all_reduce)
    pull_slots: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    # accountable mode: part -> the owner's receipt of this node's contribution (accountable.Receipt)
    receipts: dict[int, Any] = field(default_factory=dict)
    # accountable mode: part -> SHA-256 of the payload of the owner-signed result this node applied
    result_hashes: dict[int, bytes] = field(default_factory=dict)
    # accountable mode: proofs this node holds against owners (AccountabilityProof bytes)
    proofs: list[bytes] = field(default_factory=list)
    # accountable mode: part -> this node's PushPartRequest bytes of its contribution to that part, kept with the
    # round (max_rounds_kept) so that validators whose owner withholds can fetch it here (PullInputs from_sender)
    pushed: dict[int, bytes] = field(default_factory=dict)
    # accountable mode: part -> the owner's own contribution it handed to this node, the part's witness
    witnessed: dict[int, Contribution] = field(default_factory=dict)
    # accountable mode: (caller, part, from_sender) -> input bytes served to that caller this round (a validator's
    # pull, or a sender's copy), at most INPUT_SERVES_PER_CALLER x the inputs: a repeated pull is a retry, not a
    # loop that turns this node's upload into someone's amplifier
    served_inputs: dict[tuple[str, int, bool], int] = field(default_factory=dict)
    # (caller, part) -> whole results of that part served to that caller this round (PullPart, the owner's or a
    # cached copy): at most RESULT_SERVES_PER_CALLER, the same rule for results as served_inputs for inputs
    served_results: dict[tuple[str, int], int] = field(default_factory=dict)
    # relay mode: part -> this node's accepted PushPartRequest bytes to that part's owner, whose result it is served
    # without them (PullPartRequest.omit_caller) and puts them back into; dropped when the round's all-reduce ends
    own_pushed: dict[int, bytes] = field(default_factory=dict)
    # part -> the task pushing this node's contribution to it (set by all_reduce for its duration)
    push_tasks: dict[int, Any] = field(default_factory=dict)

    def cache_event(self, j: int) -> asyncio.Event:
        """The event set once part ``j``'s result is in :attr:`cache` (created on first use)."""
        ev = self.cached.get(j)
        if ev is None:
            ev = self.cached[j] = asyncio.Event()
            if j in self.cache:
                ev.set()
        return ev


class _TooFarAhead(EnvelopeError):
    """A push/pull for a round too far ahead of this node's newest registered round
    (FAILED_PRECONDITION); logged once per sender, not per round, since a flood names a new round
    each time."""


#: How many times over one caller may be served a part's inputs (accountable mode's PullInputs) in one round: the
#: validation it needs (1) and one retry of it (a reply lost to a timeout). Beyond: refused (PERMISSION_DENIED,
#: not retried by an honest validator), so a peer cannot pull the same inputs in a loop.
INPUT_SERVES_PER_CALLER = 2

#: Whole results of one part a node serves one caller in one round (``PullPart``, as owner or from its cache): the
#: pull every participant makes and two retries of it (a reply lost to a timeout after it was sent). A relay result
#: carries every contribution of the part, ~P/8 bytes at N peers, so an unbounded re-pull was a ~P/8-per-call
#: amplifier on this node's upload (the flood kind ``INPUT_SERVES_PER_CALLER`` closed for inputs). Beyond it:
#: PERMISSION_DENIED, which the puller does not retry. "Not ready" answers and the equivocation check's hash
#: answer (``same``) send no result and do not count.
RESULT_SERVES_PER_CALLER = 3


def _charge_inputs(state: "_RoundState", caller: str, part: int, from_sender: bool, size: int, whole: int) -> None:
    """Count ``size`` bytes of part ``part``'s inputs served to ``caller`` this round, against
    ``INPUT_SERVES_PER_CALLER`` x ``whole`` (the bytes of all of them). Raises EnvelopeError (PERMISSION_DENIED)
    past it, before anything is served."""
    key = (caller, int(part), bool(from_sender))
    done = state.served_inputs.get(key, 0)
    if done + size > INPUT_SERVES_PER_CALLER * max(1, whole):
        raise EnvelopeError(
            Code.PERMISSION_DENIED,
            f"the inputs of part {part} of round {state.spec.round} were served to this caller "
            f"{INPUT_SERVES_PER_CALLER} times already",
        )
    state.served_inputs[key] = done + size


def _omitted(part: "_OwnedPart", signed: bytes, caller: bytes) -> Optional[list]:
    """``signed`` (part ``part``'s relay result) without ``caller``'s (raw PeerID) entry, as buffers to join; None to
    serve it whole (the caller is not listed, or the result does not parse as relayed entries)."""
    try:
        if part.relay_positions is None:
            part.relay_positions = own_entry.entry_positions(signed)
        k = part.relay_positions.get(bytes(caller))
        return None if k is None else own_entry.omit_entry(signed, k)
    except (IndexError, wire.WireError, DecodeError):
        part.relay_positions = {}
        return None


def _with_inputs(reply: Any, held: list) -> bytes:
    """``reply`` (a PullInputsResponse) with the contributions ``held`` appended, serialized."""
    reply.contributions.extend(bytes(h) for h in held)
    return reply.SerializeToString()


def _request(cls, verified: Verified):
    """``verified``'s payload parsed as ``cls`` (a request message with a ``round`` field). Raises EnvelopeError
    (INVALID_ARGUMENT) when it does not parse or names another round than its envelope."""
    try:
        req = cls.FromString(verified.payload)
    except DecodeError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"{cls.__name__} is malformed") from None
    if req.round != verified.round:
        raise EnvelopeError(
            Code.INVALID_ARGUMENT, f"payload round {req.round} differs from envelope round {verified.round}"
        )
    return req


class OwnerService:
    """The owner side of a node's :class:`~geomesh_p2p.exchange.CollectiveService`: serves ``PushPart`` / ``PullPart`` for the parts it owns and runs all-reduces.

    Create it before ``await transport.start()`` (it registers its handlers). Per-round state
    (accepted contributions, signed results, cached results of others' parts) is kept for the
    ``max_rounds_kept`` newest rounds, so slow peers can still pull after this node has finished.

    Unknown rounds: a push or pull for a round whose spec this node has not registered yet is
    *held* up to ``hold_unknown_round_s`` seconds (the spec usually arrives within milliseconds,
    when this node's own round starts); after that the push is refused with ``UNAVAILABLE`` and the
    sender retries until its deadline (pulls simply answer "not ready"). At most
    ``max_held_requests`` requests are held at once (more: ``UNAVAILABLE`` right away). Rounds older
    than the kept window are refused with ``FAILED_PRECONDITION``, and so are rounds more than
    ``max_rounds_ahead`` past the newest round this node has registered (before any is registered,
    a node just starting, any round is held): an outsider naming far-future rounds must not take the
    held slots that honest early pushes for the next round need. That refusal is logged once per
    sender.

    Client side (:class:`~geomesh_p2p.exchange.CollectiveService`): at most ``max_concurrent_pushes``
    uploads at once, and at most ``max_pulls_per_owner`` pulls in flight to one owner (an owner of
    many small parts would otherwise get more calls from this node than the transport's per-sender
    cap allows). A result is applied only when its owner signed it by the pull deadline; a reader that
    could not reach the owner by then keeps trying for ``late_pull_s`` seconds more (the client's
    ``_pull``: "one lineage under overload").

    Refusals (status: reason), each logged once per (round, sender, status): sender not a
    participant (PERMISSION_DENIED), contribution signed by someone other than the caller
    (PERMISSION_DENIED), forged/tampered inner signature (UNAUTHENTICATED / DATA_LOSS), round in
    payload differs from envelope (INVALID_ARGUMENT), stale round / other spec / part already closed
    (FAILED_PRECONDITION), wrong range, length, block size, encoding, malformed packet, NaN/Inf or
    negative scales (INVALID_ARGUMENT), part not owned here (NOT_FOUND).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        max_rounds_kept: int = 3,
        long_poll_s: float = 5.0,
        hold_unknown_round_s: float = 2.0,
        max_held_requests: int = 256,
        max_rounds_ahead: int = 2,
        push_grace_s: float = 0.5,
        max_concurrent_pushes: int = 2,
        max_pulls_per_owner: int = 8,
        late_pull_s: float = 5.0,
        methods: CollectiveMethods = COLLECTIVE,
    ):
        if transport.address is not None:
            raise RuntimeError("create the CollectiveService before transport.start()")
        self.transport = transport
        self.methods = methods
        self.peer_id = transport.identity.peer_id.to_string()
        self.max_rounds_kept = max_rounds_kept
        self.long_poll_s = long_poll_s
        self.hold_unknown_round_s = hold_unknown_round_s
        self.max_held_requests = max_held_requests
        self.max_rounds_ahead = max(0, int(max_rounds_ahead))
        self.push_grace_s = push_grace_s
        self.max_concurrent_pushes = max(1, int(max_concurrent_pushes))
        self.max_pulls_per_owner = max(1, int(max_pulls_per_owner))
        self.late_pull_s = max(0.0, float(late_pull_s))
        self._rounds: dict[int, _RoundState] = {}
        #: accountable mode: round -> this node's validation figures (audit.ValidationStats, the newest few)
        self.validation_stats: dict[int, Any] = {}
        self._oldest_kept = 0  # rounds below this were pruned
        self._newest: Optional[int] = None  # newest round ever registered here (None: none yet)
        self._noted: Optional[int] = None  # newest round this node holds the state of (note_round)
        self._round_events: dict[int, asyncio.Event] = {}
        self._held = 0
        self._tasks = TaskOwner(f"collective {_short(self.peer_id)}")
        self._pulled = asyncio.Event()  # set at every result handed out (linger's wake-up)
        # Keys (round, peer, what, code): a caller retrying the same bad push logs one line.
        self._log_once = LogOnce(log, capacity=10_000)
        # Inner signatures (contributions, part results) are checked without skew or replay
        # windows: they are forwarded, and replay is already checked on the outer envelope.
        self._inner = Verifier(
            transport.run_id, max_skew_s=float("inf"), max_payload_bytes=transport.config.max_message_bytes
        )
        transport.add_unary(methods.push, self._handle_push)
        transport.add_unary(methods.pull, self._handle_pull)
        transport.add_unary(methods.inputs, self._handle_inputs)

    # --------------------------------------------------------------------------- registration
    def register(self, spec: CollectiveSpec) -> _RoundState:
        """Make this node ready to accept pushes for ``spec`` (idempotent for the same spec).

        ``all_reduce`` calls it; an owner that does not contribute (a pure aggregator) calls it
        directly. Prunes rounds older than the ``max_rounds_kept`` newest. Raises ValueError for
        another run, a different spec for a registered round, a pruned round, or a client-only
        transport that owns a part.
        """
        if spec.run_id != self.transport.run_id:
            raise ValueError(f"spec is for run {spec.run_id!r}, the transport serves {self.transport.run_id!r}")
        state = self._rounds.get(spec.round)
        if state is not None:
            if state.spec.spec_id != spec.spec_id:
                raise ValueError(f"round {spec.round} is already registered with a different spec")
            return state
        if spec.round < self._oldest_kept or (
            len(self._rounds) >= self.max_rounds_kept and spec.round < min(self._rounds)
        ):
            raise ValueError(
                f"round {spec.round} is older than the rounds kept here "
                f"({self.rounds_kept() or 'from ' + str(self._oldest_kept)})"
            )
        mine = spec.part_index_of(self.peer_id)
        if mine and self.transport.config.client_only:
            raise ValueError("a client-only peer cannot own a part")
        state = _RoundState(spec, {j: _OwnedPart(j, spec.owners[j]) for j in mine})
        self._rounds[spec.round] = state
        self._newest = spec.round if self._newest is None else max(self._newest, spec.round)
        ev = self._round_events.pop(spec.round, None)
        if ev is not None:
            ev.set()
        if len(self._rounds) > self.max_rounds_kept:
            keep = sorted(self._rounds)[-self.max_rounds_kept :]
            self._oldest_kept = max(self._oldest_kept, keep[0])
            for r in [r for r in self._rounds if r < keep[0]]:
                del self._rounds[r]
        if state.parts:
            self._tasks.spawn(self._close_at_deadline(state), name=f"close r{spec.round}")
        return state

    def note_round(self, round: int) -> None:
        """This node now holds the state of ``round`` (it caught up by a download or the donors' updates): the
        rounds up to ``max_rounds_ahead`` past it are held until registered, not refused as too far ahead of
        the last round it registered. Thread-safe enough to call from a worker thread (one int store)."""
        self._noted = int(round) if self._noted is None else max(self._noted, int(round))

    def rounds_kept(self) -> list[int]:
        return sorted(self._rounds)

    def unserved(self) -> dict[int, list[str]]:
        """Of the newest round registered here: owned part index -> the round's other participants that have
        not pulled that part's result from this owner yet (sorted PeerIDs). Empty when there is no round, or
        every owned part went to every other participant."""
        state = self._rounds.get(self._newest) if self._newest is not None else None
        if state is None:
            return {}
        others = [p for p in state.spec.participants if p != self.peer_id]
        out = {idx: sorted(p for p in others if p not in part.pulled_by) for idx, part in state.parts.items()}
        return {idx: left for idx, left in out.items() if left}

    async def linger(self, until: float) -> dict[int, list[str]]:
        """Keep serving the newest round's owned parts until every other participant pulled each of them, or
        until ``until`` (swarm seconds): a leaving owner that stopped at once cut off the slower peers still
        pulling its part (rs9: the last round's owner exited while a peer on a 4.6 Mbit/s link pulled, and
        that peer ended on another digest). Returns what is left unserved (:meth:`unserved`); waits on
        pulls, not a poll."""
        while True:
            left = self.unserved()
            remaining = until - swarm_time()
            if not left or remaining <= 0:
                return left
            self._pulled.clear()
            await wait_event(self._pulled, remaining)

    async def close(self) -> None:
        """Cancel background tasks (deadline timers, reductions). The transport is the caller's."""
        await self._tasks.close()

    # ---------------------------------------------------------------- test hooks (fault injection)
    async def _before_push(self, spec: CollectiveSpec, part: int) -> None:
        """Called before this node delivers part ``part`` (also its own). Tests override it."""

    async def _before_pull(self, spec: CollectiveSpec, part: int) -> None:
        """Test hook (fault injection): called before this node pulls ``part``'s result."""

    async def _before_reduce(self, spec: CollectiveSpec, part: int) -> None:
        """Called when an owned part closed, before its result is built. Tests override it."""

    # ------------------------------------------------------------------------------ owner side
    async def _round_for(self, round: int, hold_s: float) -> Optional[_RoundState]:
        """The state of ``round``; waits up to ``hold_s`` seconds for it to be registered (None: not yet).

        Raises EnvelopeError FAILED_PRECONDITION for a round already pruned here, and
        :class:`_TooFarAhead` (FAILED_PRECONDITION) for one more than ``max_rounds_ahead`` past the
        newest registered round: those take no held slot.
        """
        state = self._rounds.get(round)
        if state is not None:
            return state
        if round < self._oldest_kept:
            raise EnvelopeError(
                Code.FAILED_PRECONDITION, f"round {round} is over on this node (oldest kept: {self._oldest_kept})"
            )
        known = max((r for r in (self._newest, self._noted) if r is not None), default=None)
        if known is not None and round > known + self.max_rounds_ahead:
            raise _TooFarAhead(Code.FAILED_PRECONDITION, f"round {round} is too far ahead of this node's round {known}")
        if hold_s <= 0 or self._held >= self.max_held_requests:
            return None
        ev = self._round_events.setdefault(round, asyncio.Event())
        self._held += 1
        try:
            await wait_event(ev, hold_s)
        finally:
            self._held -= 1
            if self._held == 0:
                self._round_events.clear()  # nobody waits on the rest
        return self._rounds.get(round)

    def _check_contribution(
        self, spec: CollectiveSpec, part: int, signed: bytes, caller: Optional[str]
    ) -> Contribution:
        """Verify a sender-signed contribution to ``part`` (:func:`.messages.check_contribution`);
        EnvelopeError (status + reason) if bad. Synchronous: call it in a worker thread.

        Used by the owner (on push) and by relay-mode readers (on every forwarded contribution).
        """
        return messages.check_contribution(self._inner, spec, part, signed, caller)[1]

    def _check_push(self, spec: CollectiveSpec, payload: bytes, caller: str) -> tuple[int, Contribution]:
        """A PushPartRequest's contribution, checked: (part index, Contribution). Worker thread."""
        signed = messages.push_request_contribution(payload)  # a view of the request: no copy
        return messages.check_contribution(self._inner, spec, None, signed, caller)

    async def _handle_push(self, verified: Verified, context) -> bytes:
        t_in = time.monotonic()
        caller = verified.sender.to_string()
        round_, part_ix = verified.round, None
        try:
            state = await self._round_for(verified.round, self.hold_unknown_round_s)
            if state is None:
                raise EnvelopeError(Code.UNAVAILABLE, f"round {verified.round} is not open on this node yet")
            spec = state.spec
            # Parsing, the part index (a part beyond the spec is told so before the signature is
            # checked), verification and the packet's decoding touch the whole part: a worker thread.
            part_ix, c = await asyncio.to_thread(self._check_push, spec, verified.payload, caller)
            if messages.push_request_witness(verified.payload):
                resp = self._witness(state, part_ix, c)
                resp.held_s = time.monotonic() - t_in
                return resp.SerializeToString()
            part = state.parts.get(part_ix)
            if part is None:
                raise EnvelopeError(Code.NOT_FOUND, f"this node does not own part {part_ix} of round {spec.round}")
            resp = self._accept(state, part, c)
            if spec.mode == "accountable" and resp.accepted:
                # BTARD-like accountability: a signed receipt of what was accepted (the first push of a sender)
                resp.receipt = self._receipt(spec, part.index, part.contributions[c.sender])
            resp.held_s = time.monotonic() - t_in  # lets the sender time its upload without our work
            return resp.SerializeToString()
        except EnvelopeError as err:
            # A round not open here yet is flow control (the sender retries until its deadline), not a
            # fault: DEBUG, or every round of a healthy swarm printed a WARNING (issue 14 #10).
            quiet = err.code == Code.UNAVAILABLE and part_ix is None
            key = (caller, "push", "ahead") if isinstance(err, _TooFarAhead) else (round_, caller, "push", err.code)
            self._log_once(
                key,
                logging.DEBUG if quiet else logging.WARNING,
                "round %d: refused a push%s from %s: %s: %s",
                round_,
                "" if part_ix is None else f" of part {part_ix}",
                _short(caller),
                err.code.name,
                err.reason,
                event="push_refused",
                peer=self.peer_id,
                round=round_,
                part=part_ix,
                sender=caller,
                code=err.code.name,
                reason=err.reason,
            )
            raise

    def _accept(self, state: _RoundState, part: _OwnedPart, c: _Contribution) -> collective_pb2.PushPartResponse:
        spec = state.spec
        if c.sender in part.contributions:
            return collective_pb2.PushPartResponse(accepted=True, reason="duplicate push ignored (first one kept)")
        if part.closed_by is not None:
            raise EnvelopeError(
                Code.FAILED_PRECONDITION,
                f"part {part.index} of round {spec.round} closed ({part.closed_by}) before this push arrived",
            )
        part.contributions[c.sender] = c
        if len(part.contributions) == len(spec.participants):
            self._close(state, part, "all pushed")
        elif spec.probation and not part.closing_early and all(p in part.contributions for p in spec.established()):
            # Every established participant pushed: the peers on probation get a short grace, not the deadline.
            part.closing_early = True
            self._tasks.spawn(self._close_after_grace(state, part), name=f"grace r{spec.round} p{part.index}")
        return collective_pb2.PushPartResponse(accepted=True, reason="")

    def _witness(self, state: _RoundState, j: int, c: Contribution) -> collective_pb2.PushPartResponse:
        """A witness push (accountable mode): part ``j``'s owner hands this node, the part's witness
        (:func:`.accountable.witness_of`), its own contribution to ``j`` (``c``, signature checked); kept with
        the round (the first one) and served to validators; answered with this node's signed receipt.
        Raises EnvelopeError: not an accountable round, this node is not the witness, the caller is not the
        part's owner."""
        spec = state.spec
        if spec.mode != "accountable":
            raise EnvelopeError(Code.FAILED_PRECONDITION, f"round {spec.round} is not an accountable round")
        w = accountable.witness_of(spec, j)
        if w is None or w.peer_id != self.peer_id:
            raise EnvelopeError(Code.PERMISSION_DENIED, f"this node is not the witness of part {j}")
        if c.sender != spec.owners[j].peer_id:
            raise EnvelopeError(Code.PERMISSION_DENIED, f"only the owner of part {j} hands its contribution over")
        kept = state.witnessed.setdefault(j, c)
        return collective_pb2.PushPartResponse(accepted=True, receipt=self._receipt(spec, j, kept))

    def _receipt(self, spec: CollectiveSpec, part: int, c: Contribution) -> bytes:
        """The signed receipt of accepted contribution ``c`` (:func:`.accountable.build_receipt`: a small
        message, its contribution's hash computed when it was checked). Subclasses (tests) override it."""
        return accountable.build_receipt(self.transport.identity, spec, part, c)

    async def _close_after_grace(self, state: _RoundState, part: _OwnedPart) -> None:
        if state.spec.grace_s >= state.spec.deadline - swarm_time():
            # a grace that runs to the deadline is the deadline's close (_close_at_deadline, due at the same instant:
            # which one fired first decided the reason and the log line; red team 43b)
            return
        await asyncio.sleep(state.spec.grace_s)
        if self._rounds.get(state.spec.round) is state:
            self._close(state, part, "established pushed")

    def _close(self, state: _RoundState, part: _OwnedPart, reason: str) -> None:
        if part.closed_by is not None:
            return
        part.closed_by = reason
        absent = [p for p in state.spec.participants if p not in part.contributions]
        fields: dict[str, Any] = dict(round=state.spec.round, part=part.index, reason=reason, absent=sorted(absent))
        if absent and reason == "established pushed":
            events.emit(
                log,
                logging.INFO,
                "part_closed",
                "round %d: part %d closed %.1fs after every established participant pushed, without %s (on probation)",
                state.spec.round,
                part.index,
                state.spec.grace_s,
                ", ".join(_short(p) for p in sorted(absent)),
                **fields,
            )
        elif absent:
            events.emit(
                log,
                logging.WARNING,
                "part_closed",
                "round %d: part %d closed at the deadline without %s (left out of this part)",
                state.spec.round,
                part.index,
                ", ".join(_short(p) for p in sorted(absent)),
                **fields,
            )
        else:
            events.emit(
                log,
                logging.DEBUG,
                "part_closed",
                "round %d: part %d closed (%s)",
                state.spec.round,
                part.index,
                reason,
                **fields,
            )
        self._tasks.spawn(self._finish(state, part), name=f"reduce r{state.spec.round} p{part.index}")

    async def _close_at_deadline(self, state: _RoundState) -> None:
        await asyncio.sleep(max(0.0, state.spec.deadline - swarm_time()))
        if self._rounds.get(state.spec.round) is not state:
            return  # pruned meanwhile
        for part in state.parts.values():
            self._close(state, part, "deadline")

    async def _finish(self, state: _RoundState, part: _OwnedPart) -> None:
        spec = state.spec
        try:
            await self._before_reduce(spec, part.index)
            if part.witness_task is not None:
                # the own contribution is listed only with the witness's receipt (readers refuse it otherwise)
                await asyncio.wait({part.witness_task}, timeout=max(0.0, spec.deadline - swarm_time()) + 1.0)
                if not part.witness_receipt and part.contributions.pop(self.peer_id, None) is not None:
                    log.warning(
                        "round %d: part %d: no witness receipt of this owner's own contribution: left out",
                        spec.round,
                        part.index,
                    )
            contributions = sorted(part.contributions.values(), key=lambda c: _pid_bytes(c.sender))
            if spec.mode == "accountable":
                part.inputs = [c.signed for c in contributions]  # what the result commits to, for validators
                part.input_senders = [c.sender for c in contributions]

            signed = await asyncio.to_thread(self._build_result, spec, part, contributions)
            if part.late or swarm_time() > spec.pull_deadline:
                # Signed in the worker thread, possibly before the pull deadline, but on this loop only after it
                # (a loaded host): this owner already left its part out, readers past the deadline were told
                # "not ready" (they leave it out), and one asking now would apply it by its signed time. Served,
                # it split the round (the stalled-peer fork, docs/round.md); one decision on this loop instead.
                part.late = True
                events.emit(
                    log,
                    logging.WARNING,
                    "part_late",
                    "round %d: the result of part %d was built only after the pull deadline: not served (every "
                    "peer leaves the part out)",
                    spec.round,
                    part.index,
                    round=spec.round,
                    part=part.index,
                )
                return
            part.signed_result = signed
            part.ready.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("round %d: building the result of part %d failed; it will be missing", spec.round, part.index)

    def _build_result(self, spec: CollectiveSpec, part: _OwnedPart, contributions: list[Contribution]) -> bytes:
        """The owner-signed result of ``part`` (:func:`.messages.build_result`). Worker thread.
        Subclasses (tests, the adversary) override it to alter what an owner serves."""
        own = any(c.sender == self.peer_id for c in contributions)
        return messages.build_result(
            self.transport.identity,
            spec,
            part.index,
            part.owner,
            part.closed_by or "",
            contributions,
            part.witness_receipt if own else b"",
        )

    async def _handle_pull(self, verified: Verified, context) -> bytes:
        caller = verified.sender.to_string()
        try:
            req = _request(collective_pb2.PullPartRequest, verified)
            wait_s = max(0.0, min(float(req.wait_s), 60.0)) if math.isfinite(req.wait_s) else 0.0
            t0 = time.monotonic()
            state = await self._round_for(req.round, min(wait_s, self.hold_unknown_round_s))
            not_ready = collective_pb2.PullPartResponse(round=req.round, part=req.part, ready=False)
            if state is None:
                return not_ready.SerializeToString()
            spec = state.spec
            if req.spec_id != spec.spec_id:
                raise EnvelopeError(Code.FAILED_PRECONDITION, f"pull is for another spec of round {spec.round}")
            if not spec.may_read(caller):
                raise EnvelopeError(Code.PERMISSION_DENIED, f"{_short(caller)} is not in round {spec.round}")
            part = state.parts.get(req.part)
            omitted: Optional[list] = None
            if part is None:
                cached = state.cache.get(req.part)
                if (
                    cached is None
                    and spec.readers
                    and state.contributing
                    and wait_s > 0
                    and req.part < len(spec.owners)
                ):
                    # a grouped round's reader asks the group mate that reads the part for it (groups.py): a long
                    # poll until this node's own pull of the part has landed (it pulls until the late end at most)
                    late_end = spec.pull_deadline + self.late_pull_s
                    left = min(wait_s - (time.monotonic() - t0), late_end - swarm_time())
                    await wait_event(state.cache_event(req.part), left)
                    cached = state.cache.get(req.part)
                if cached is None:
                    raise EnvelopeError(Code.NOT_FOUND, f"part {req.part} of round {spec.round} is not held here")
                if req.unless_sha256 and state.result_hashes.get(req.part) == bytes(req.unless_sha256):
                    # an equivocation check whose copy is the one applied here: the hash answers it, not P/(8N) bytes
                    same = collective_pb2.PullPartResponse(round=req.round, part=req.part, ready=True, same=True)
                    return same.SerializeToString()
                signed = cached
            else:
                left = wait_s - (time.monotonic() - t0)
                if not await wait_event(part.ready, left):
                    if swarm_time() >= spec.pull_deadline:
                        part.late = True  # "not ready" after the deadline is final for the reader: so it is here
                    return not_ready.SerializeToString()
                signed = part.result()
                part.pulled_by.add(caller)
                self._pulled.set()
                if req.omit_caller and spec.mode == "relay":
                    # relay: the caller holds its own signed push; it puts it back (own_entry.restore_entry)
                    omitted = _omitted(part, signed, verified.sender)
            served = state.served_results.get((caller, req.part), 0)
            if served >= RESULT_SERVES_PER_CALLER:
                raise EnvelopeError(
                    Code.PERMISSION_DENIED,
                    f"the result of part {req.part} of round {spec.round} was served to this caller "
                    f"{RESULT_SERVES_PER_CALLER} times already",
                )
            state.served_results[(caller, req.part)] = served + 1
            head = collective_pb2.PullPartResponse(
                round=req.round, part=req.part, ready=True, held_s=time.monotonic() - t0
            ).SerializeToString()
            parts = [head, *wire.bytes_field(4, omitted if omitted is not None else [signed])]
            # a whole part's result is copied into the reply (once): off the event loop when large
            return await asyncio.to_thread(b"".join, parts) if len(signed) > _THREAD_BYTES else b"".join(parts)
        except EnvelopeError as err:
            if err.code != Code.NOT_FOUND:
                key = (
                    (caller, "pull", "ahead")
                    if isinstance(err, _TooFarAhead)
                    else (verified.round, caller, "pull", err.code)
                )
                self._log_refused(key, "pull", "pull_refused", verified.round, caller, err)
            raise

    def _log_refused(self, key, what: str, event: str, round: int, caller: str, err: EnvelopeError) -> None:
        """One WARNING (once per ``key``) and event ``event`` for a refused ``what`` (a pull, a pull of inputs)."""
        self._log_once(
            key,
            logging.WARNING,
            f"round %d: refused {what} from %s: %s: %s",
            round,
            _short(caller),
            err.code.name,
            err.reason,
            event=event,
            peer=self.peer_id,
            round=round,
            sender=caller,
            code=err.code.name,
            reason=err.reason,
        )

    def _own_inputs(self, state: _RoundState, j: int) -> list:
        """``PullInputs(from_sender)``: what this node holds of part ``j``'s inputs (views): its own signed push
        to ``j``, and, as the part's witness, the owner's own contribution; served once part ``j``'s result is
        out (applied here, or the round's deadline passed: a contribution is not shown to others while they can
        still push). Raises EnvelopeError: UNAVAILABLE before that, NOT_FOUND when nothing is held for ``j``
        (not pushed, refused, or pruned with the round: ``max_rounds_kept``)."""
        spec = state.spec
        if j not in state.result_hashes and swarm_time() < spec.deadline:
            raise EnvelopeError(Code.UNAVAILABLE, f"part {j} of round {spec.round} has no result here yet")
        held: list = [messages.push_request_contribution(state.pushed[j])] if j in state.pushed else []
        if j in state.witnessed:
            held.append(state.witnessed[j].signed)
        if not held:
            raise EnvelopeError(Code.NOT_FOUND, f"this node holds no contribution to part {j} of round {spec.round}")
        return held

    async def _handle_inputs(self, verified: Verified, context) -> bytes:
        """``PullInputs`` (accountable mode): the signed contributions part ``req.part``'s result commits to,
        in its order, from ``req.first`` on, about :data:`_INPUTS_PAGE_BYTES` per reply (at least one).
        Served to the round's participants once the result is built; refusals as for pulls."""
        caller = verified.sender.to_string()
        try:
            req = _request(collective_pb2.PullInputsRequest, verified)
            state = await self._round_for(req.round, 0.0)
            if state is None:
                raise EnvelopeError(Code.NOT_FOUND, f"round {req.round} is not held here")
            spec = state.spec
            if spec.mode != "accountable":
                raise EnvelopeError(Code.FAILED_PRECONDITION, f"round {spec.round} is not an accountable round")
            if req.spec_id != spec.spec_id:
                raise EnvelopeError(Code.FAILED_PRECONDITION, f"request is for another spec of round {spec.round}")
            if not spec.may_read(caller):  # a grouped round's cross spec: its readers validate the hand-offs
                raise EnvelopeError(Code.PERMISSION_DENIED, f"{_short(caller)} is not in round {spec.round}")
            if req.from_sender:
                held = self._own_inputs(state, int(req.part))
                size = sum(len(h) for h in held)
                _charge_inputs(state, caller, int(req.part), True, size, size)
                reply = collective_pb2.PullInputsResponse(round=req.round, part=req.part, total=len(held))
                # whole contributions are copied into the reply: off the event loop
                return await asyncio.to_thread(_with_inputs, reply, held)
            part = state.parts.get(req.part)
            if part is None:
                raise EnvelopeError(Code.NOT_FOUND, f"this node does not own part {req.part} of round {spec.round}")
            if not part.ready.is_set():
                raise EnvelopeError(Code.UNAVAILABLE, f"part {req.part} of round {spec.round} has no result yet")
            first = int(req.first)
            if req.commitments_only:  # a level-1 drop check (issue 26): each input's small signed commitment only
                want = part.inputs[first : first + (int(req.count) or len(part.inputs))]
                page = [commitment_of_contribution(c) for c in want]
                return collective_pb2.PullInputsResponse(
                    round=req.round, part=req.part, contributions=page, total=len(part.inputs)
                ).SerializeToString()
            page = []
            size = 0
            for signed, sender in zip(part.inputs[first:], part.input_senders[first:]):
                if req.omit_caller and sender == caller:
                    page.append(b"")  # the validator holds its own signed push (1/N of the inputs not sent)
                    continue
                if page and (size + len(signed) > _INPUTS_PAGE_BYTES or (req.count and len(page) >= req.count)):
                    break  # a page, or the ``count`` asked for (verified work fetches one contribution)
                page.append(bytes(signed))
                size += len(signed)
            _charge_inputs(state, caller, int(req.part), False, size, sum(len(c) for c in part.inputs))
            resp = collective_pb2.PullInputsResponse(
                round=req.round, part=req.part, contributions=page, total=len(part.inputs)
            )
            return await asyncio.to_thread(resp.SerializeToString) if size > _THREAD_BYTES else resp.SerializeToString()
        except EnvelopeError as err:
            self._log_refused(
                (verified.round, caller, "inputs", err.code),
                "a pull of inputs",
                "inputs_refused",
                verified.round,
                caller,
                err,
            )
            raise
