"""Dial-back: the addresses that vouch for a state, checked before a fresh joiner trusts them (issue 28).

A peer that knows nobody chooses the state to download by the *fresh vote* (:mod:`.standing`): one vote per
distinct address, identities nobody vouches for left out. The addresses in records are claims: only the
donor that serves a forged state has to be real, so identities that vouch for each other and announce many
made-up addresses could outvote the honest peers for the price of their proof of work. Here each voter's
address is dialled before the vote counts it: a signed ``State/Status`` call (one small RPC, its reply signed
by the key that answers) must come back from the record's own identity, holding the state the record
announces (or a later round: a donor moves on). A record whose address does not answer, answers with another
key or another state does not vote. That raises the price of an eclipse from identities to addresses that
serve a key and a state each (a port and a process holding the state per vote); counting distinct hosts
instead would cost the honest peers too, many of whom share one address behind a NAT.

Used by :meth:`geomesh_p2p.round.rules.state_sync.StateSync.catch_up` for the fresh and solo votes only: a
peer whose own ledger knows who delivered (the standing vote) needs no addresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable, Optional, Protocol

from geomesh_p2p.net.methods import STATE_STATUS
from geomesh_p2p.wire import state_pb2

log = logging.getLogger(__name__)

__all__ = ["DialBack", "DIAL_TIMEOUT_S", "DIAL_CONCURRENCY", "NO_CONNECTION", "no_connection"]

#: Deadline of one dial-back (seconds): a Status call is a few hundred bytes each way.
DIAL_TIMEOUT_S = 3.0
#: Dial-backs in flight at once (a vote over hundreds of records must not open hundreds of channels at once).
DIAL_CONCURRENCY = 16
#: Seconds an answer is reused for the same (identity, address, round, digest): a catch-up retries its vote
#: several times within a round.
OK_TTL_S = 60.0
FAIL_TTL_S = 10.0
#: How :meth:`DialBack.problem`'s reason ends when no connection reached the address (refused, no route:
#: ``RpcError.unreachable``): its peer most likely exited, its record outliving it by a TTL.
NO_CONNECTION = "(no connection)"


def no_connection(why: str) -> bool:
    """``why`` (a :meth:`DialBack.problem` reason) says that no connection reached the record's address."""
    return why.endswith(NO_CONNECTION)


class _Caller(Protocol):
    async def call(self, address: str, method: str, payload: bytes, *, timeout: Optional[float] = None): ...


class DialBack:
    """Checks that records' addresses answer as the records' identities, holding the states they announce.

    ``transport``: anything with :meth:`geomesh_p2p.net.transport.Transport.call` (the reply's ``sender`` is the
    PeerID whose key signed it). :meth:`verified` is a coroutine; results are cached per (peer id, address,
    round, digest) for :data:`OK_TTL_S` (answered) or :data:`FAIL_TTL_S` (not)."""

    def __init__(self, transport: _Caller, *, timeout_s: float = DIAL_TIMEOUT_S, concurrency: int = DIAL_CONCURRENCY):
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self._sem = asyncio.Semaphore(max(1, int(concurrency)))
        self._cache: dict[tuple, tuple[float, Optional[str]]] = {}  # key -> (expires, None | why not)
        self.dials = 0  # Status calls made (tests, logs)

    async def problem(self, rec) -> Optional[str]:
        """Why ``rec`` (a PeerRecord-like: ``peer_id``, ``address``, ``round``, ``weights_digest``) does not
        vote, or None when its address answered as its identity with its state. Never raises."""
        if not rec.address:
            return "no address"
        key = (rec.peer_id, rec.address, rec.round, rec.weights_digest)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        why = await self._dial(rec)
        self._cache[key] = (time.monotonic() + (OK_TTL_S if why is None else FAIL_TTL_S), why)
        if len(self._cache) > 4096:  # bounded whatever the records say
            for k in [k for k, (exp, _) in self._cache.items() if exp <= now][:2048] or list(self._cache)[:1024]:
                self._cache.pop(k, None)
        return why

    async def _dial(self, rec) -> Optional[str]:
        async with self._sem:
            self.dials += 1
            try:
                reply = await self.transport.call(rec.address, STATE_STATUS, b"", timeout=self.timeout_s)
            except Exception as e:  # RpcError, or a malformed address: the record does not vote
                why = NO_CONNECTION if getattr(e, "unreachable", False) else f"({type(e).__name__})"
                return f"its address {rec.address} did not answer {why}"
        if str(reply.sender) != rec.peer_id:
            return f"its address {rec.address} answers as {str(reply.sender)[:10]}, not as {rec.peer_id[:10]}"
        try:
            status = state_pb2.StatusResponse.FromString(reply.payload)
        except Exception:
            return f"its address {rec.address} sent a malformed status"
        if status.round > rec.round:
            return None  # it moved on since its record: a donor of a later round
        if (status.round, status.digest) != (rec.round, rec.weights_digest):
            return (
                f"its address {rec.address} holds round {status.round} ({status.digest[:8] or 'none'}), "
                f"not the round {rec.round} ({str(rec.weights_digest)[:8]}) its record announces"
            )
        return None

    async def verified(self, records: Iterable) -> tuple[list, dict[str, str]]:
        """``(records that vote, {peer id: why not} for the others)``: records without a digest or an address
        are kept as they are (they do not vote in the fresh vote anyway); the others are dialled, in
        parallel up to the concurrency bound."""
        recs = list(records)
        dial = [r for r in recs if r.weights_digest and r.address]
        whys = await asyncio.gather(*(self.problem(r) for r in dial))
        dropped = {r.peer_id: w for r, w in zip(dial, whys) if w is not None}
        return [r for r in recs if r.peer_id not in dropped], dropped
