"""How a DHT node joins the swarm and stays in it: :meth:`~DHTJoin.join` through bootstrap addresses
(retries with backoff; errors that say why: another run, TLS, identity in use), the clock offset
measured against the bootstraps (swarm time; :class:`~geomesh_p2p.dht.state.ClockSkewError` beyond the
tolerance), the reachability check (a bootstrap dials this node back), :meth:`~DHTJoin.rejoin`, and the
background refresh, republish and bootstrap-ping loops.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Dict, Iterable, List, Optional, Sequence

import grpc
from google.protobuf.message import DecodeError
from hivemind.dht.routing import DHTID

from geomesh_p2p import __version__
from geomesh_p2p.telemetry import events
from geomesh_p2p.net.addr import AddressError, parse_address
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.wire import dht_pb2
from geomesh_p2p.dht.state import (
    _UNREACHABLE,
    DHT_CHECK_REACHABLE,
    DHT_PROTOCOL_VERSION,
    ClockSkewError,
    Contact,
    DHTJoinError,
    NOT_CHECKED,
    IdentityInUseError,
    OtherRunError,
    Reachability,
    _valid_address,
)
from geomesh_p2p.dht.lookup import DHTLookup

# Shared with the CLI's pre-flight ping (importable without hivemind there), re-exported here.
from geomesh_p2p.dht.preflight import final_failure as final_failure
from geomesh_p2p.dht.preflight import NothingListensError, nothing_listens, nothing_listens_message, refused_wait
from geomesh_p2p.dht.preflight import other_run_message as other_run_message
from geomesh_p2p.dht.preflight import short_reason as short_reason

# The node was one module: its parts log under that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")

# The clock and the sleep of the join's retries (tests replace them: no real waits, the waits counted).
_now = time.monotonic
_sleep = asyncio.sleep

#: A re-measured clock offset that differs from the one in use by this much (seconds) or more is a jump,
#: followed once CLOCK_CONFIRMATIONS measurements in a row agree within CLOCK_CONFIRM_SPREAD_S (smaller changes:
#: drift, followed at once). Bootstraps are pinged every ``bootstrap_refresh_s`` (15 s by default).
CLOCK_JUMP_S = 5.0
CLOCK_CONFIRMATIONS = 3
CLOCK_CONFIRM_SPREAD_S = 2.0
#: After join, the bootstraps' time is followed only within ``max_clock_skew_s`` of where it stood at join,
#: measured against this machine's steady clock (CLOCK_BOOTTIME: steps of the wall clock and suspends leave it
#: comparable; an unsynchronised oscillator drifts ~4 s a day). A hostile or broken bootstrap could otherwise
#: walk a peer's swarm time away, in one confirmed jump or in steps under CLOCK_JUMP_S, until every honest
#: peer refuses its envelopes (a red-team run moved a peer by 100,000 s with one bootstrap).


def _with_code(error: str, short: str) -> str:
    """``short`` (a :func:`short_reason`) prefixed with the status code of ``error`` ("CODE: reason") when it
    does not carry one."""
    code = error.split(":", 1)[0]
    return short if short.startswith(code) or not code.isupper() else f"{code}: {short}"


def _tls_hint(errors: Iterable[str], tls: bool) -> str:
    """A hint for a join that failed on connections closed during set-up, the way a plaintext client
    meets a TLS server (UNAVAILABLE "Socket closed") or a TLS client a plaintext one (a failed handshake);
    "" otherwise. ``tls``: whether this node dials with TLS."""
    looks = any("socket closed" in e.lower() or "handshake" in e.lower() or "ssl" in e.lower() for e in errors)
    if not looks:
        return ""
    if tls:
        return "; the bootstrap may not use TLS, or its certificate is not signed by --tls-ca"
    return "; the bootstrap may require TLS: if the swarm uses TLS, pass --tls-cert/--tls-key/--tls-ca"


def _clock_refusal(result: object) -> bool:
    """``result`` (a ping's) is a refusal of this node's envelope timestamp (identity.Verifier's OUT_OF_RANGE)."""
    return (
        isinstance(result, RpcError)
        and result.code == grpc.StatusCode.OUT_OF_RANGE
        and "from this node's clock" in (result.reason or "")
    )


class DHTJoin(DHTLookup):
    """Joining and staying in the swarm (see the module doc)."""

    if TYPE_CHECKING:  # provided by node.py; declared for the type checker

        async def republish_once(self) -> int: ...

    async def join(self, bootstrap: Iterable[str] = (), *, attempts: Optional[int] = None) -> int:
        """Join the swarm through ``bootstrap`` addresses (``host:port``; several allowed; none = start a
        new swarm), then look up this node's own id to fill the routing table and make it known.

        Pings all bootstraps at once, ``attempts`` times (default ``join_attempts``) with backoff
        doubling from ``join_backoff_s``; while every bootstrap refuses every connection (nothing listens
        there), for ``refused_window_s`` seconds at most (the last wait cut to end with it). Starts the refresh
        and republish tasks. Returns the number of nodes in the routing table.

        Raises:
            NothingListensError: every bootstrap refused every connection until ``refused_window_s`` was over,
                naming the addresses (a mistyped port was retried for ~31 s, after the proof of work).
            DHTJoinError: naming each bootstrap and why it failed.
        """
        addresses = list(dict.fromkeys(a.strip() for a in bootstrap if a and a.strip()))
        for a in addresses:
            try:
                parse_address(a)
            except AddressError as e:
                raise DHTJoinError(f"bootstrap address is not host:port: {e}") from None
        addresses = [a for a in addresses if a != self.address]
        self.bootstrap_addresses = addresses
        self._start_background()
        if not addresses:
            return len(self.contacts())
        attempts = max(1, attempts or self.join_attempts)
        delay = self.join_backoff_s
        errors: Dict[str, str] = {}
        short: Dict[str, str] = {}  # the same, in a few words (short_reason): the retry lines
        refused: Dict[str, RpcError] = {}  # bootstraps that answered with a refusal (not silence)
        ok: List[Contact] = []
        listens_nowhere = True  # every connection of every attempt so far was refused
        t0 = _now()
        for attempt in range(attempts):
            results = await asyncio.gather(*(self.ping(a) for a in addresses), return_exceptions=True)
            ok = [r for r in results if isinstance(r, Contact)]
            twins = [r for r in ok if r.peer_id == self.peer_id]
            if twins:
                raise IdentityInUseError(
                    f"this PeerID ({self.peer_id.short()}) is already live at {twins[0].address}: "
                    f"another process runs with the same --identity key; give each peer its "
                    f"own key file"
                )
            if ok:
                break
            definitive = True
            refused.clear()  # this attempt's answers only
            for a, r in zip(addresses, results):
                if isinstance(r, RpcError):
                    errors[a] = f"{r.code.name}: {r.reason}" if r.reason else r.code.name
                    short[a] = short_reason(r)
                    # A name that does not resolve is a typo, not a bootstrap still starting: no retries
                    # (a fresh-user trial waited 41 s for nosuchhost.invalid, 8 attempts).
                    definitive &= final_failure(r)
                    if r.code not in _UNREACHABLE:
                        refused[a] = r
                else:
                    errors[a] = short[a] = str(r)
            listens_nowhere &= all(nothing_listens(r) for r in results)
            if definitive or attempt == attempts - 1:
                break
            wait = delay * random.uniform(0.8, 1.2)
            if listens_nowhere:
                wait = refused_wait(wait, _now() - t0, self.refused_window_s)
                if wait <= 0:
                    raise NothingListensError(nothing_listens_message(addresses, attempt + 1, _now() - t0))
            events.emit(
                log,
                logging.INFO,
                "dht_join_retry",
                "no bootstrap answered yet (%s); retrying in %.1f s (attempt %d of %d)",
                "; ".join(f"{a}: {e}" for a, e in short.items()),  # one short line, not gRPC's whole text
                wait,
                attempt + 1,
                attempts,
                peer=self.peer_id.to_string(),
                attempt=attempt + 1,
                attempts=attempts,
                wait_s=wait,
            )
            await _sleep(wait)
            delay = min(delay * 2, 8.0)
        if not ok:
            # the code, then the short reason unless it is a refusal (whose reason is the bootstrap's own sentence)
            detail = "; ".join(f"{a}: {errors[a] if a in refused else _with_code(errors[a], short[a])}" for a in errors)
            other_run = [
                a
                for a, r in refused.items()
                if r.code == grpc.StatusCode.FAILED_PRECONDITION and "this node serves" in r.reason
            ]
            if other_run:  # it answered: a wrong --run-id is not "no answer" (issue 14 #10)
                raise OtherRunError(
                    other_run_message(
                        other_run[0], refused[other_run[0]].reason, getattr(self.transport, "run_id", "?")
                    )
                )
            if refused and len(refused) == len(errors):
                raise DHTJoinError(f"could not join the DHT: every bootstrap node refused this node: {detail}")
            tls = getattr(getattr(self.transport, "config", None), "tls", None) is not None
            raise DHTJoinError(
                f"could not join the DHT: no bootstrap node answered "
                f"({attempt + 1} attempt(s) over {_now() - t0:.1f}s): {detail}"
                f"{_tls_hint(errors.values(), tls)}"
            )
        for c in ok:
            self.bootstrap_peers[c.peer_id] = c.address
        self._measure_clock(ok, refuse=True)
        if self.check_reachability and not self.client_only:
            self.reachability = await self.check_reachable([c.address for c in ok])
            if self.reachability.reachable is False:
                log.warning(
                    "nobody can dial this node at %s (bootstrap %s could not: %s); continuing as a "
                    "client-only node that owns no part. Check --advertise-host, --port and the firewall",
                    self.reachability.address,
                    self.reachability.checked_by[0],
                    self.reachability.reason,
                )
        await self.find_nearest_nodes([self.node_id])
        n = len(self.contacts())
        log.info("DHT node %s joined via %s: %d nodes known", self.peer_id.short(), ", ".join(addresses), n)
        return n

    def _start_background(self) -> None:
        if self._started:
            return
        self._started = True
        if self.refresh_period_s and self.refresh_period_s > 0:
            self.tasks.spawn(self._every(self.refresh_period_s, self.refresh_once, "refresh"), name="dht-refresh")
        if self.republish_period_s and self.republish_period_s > 0:
            self.tasks.spawn(
                self._every(self.republish_period_s, self.republish_once, "republish"), name="dht-republish"
            )
        if self.bootstrap_refresh_s and self.bootstrap_refresh_s > 0:
            self.tasks.spawn(
                self._every(self.bootstrap_refresh_s, self.ping_bootstraps, "bootstrap refresh"),
                name="dht-bootstrap-refresh",
            )

    async def _every(self, period_s: float, job: Callable[[], Awaitable[object]], what: str) -> None:
        """Run ``job`` every ``period_s`` seconds (+-10 % jitter, so that nodes started together do not
        act in step) while the node is alive; a failure is logged and the loop goes on."""
        while self._alive:
            await asyncio.sleep(period_s * random.uniform(0.9, 1.1))
            try:
                await job()
            except Exception as e:  # keep going whatever happens
                log.warning("DHT %s failed: %r", what, e)

    async def ping_bootstraps(self) -> int:
        """Ping every bootstrap address once (at once; failures are only counted). A bootstrap that
        restarted with an empty table pings this node back and adds it; one that is back after an
        outage re-enters this node's table. Returns the number that answered."""
        addresses = [a for a in self.bootstrap_addresses if a != self.address]
        if not addresses:
            return 0
        results = await asyncio.gather(*(self.ping(a) for a in addresses), return_exceptions=True)
        answered = [r for r in results if isinstance(r, Contact)]
        for c in answered:
            self.bootstrap_peers[c.peer_id] = c.address
        # the samples these pings replaced only (DHTProtocol._clock_sample_ok: one of a long round trip is neither
        # followed nor counted, nor is the older sample it left in place)
        self._measure_clock([c for c in answered if self._sample_fresh.get(c.peer_id)], refuse=False)
        if not answered and all(_clock_refusal(r) for r in results):
            self._on_clock_refused(results)
        return len(answered)

    def _on_clock_refused(self, results: Sequence[object]) -> None:
        """Every bootstrap refused this node's pings for their timestamps: a step correction in use is wrong
        (the steady clock stopped during a suspend, so the suspend looked like a step): drop it, so the next
        ping carries this machine's clock plus the measured offset and the bootstraps answer again. Without a
        correction in use: one WARNING line that says what to do (the node cannot re-measure by itself)."""
        if self._steps.moved():
            stepped = self._steps.moved()
            self.clock_offset_s = self._measured_offset_s  # the offset as measured, against the clock as it is
            log.warning(
                "every bootstrap refuses this node's time after a %+.0f s change of this machine's clock; "
                "dropping the correction for it and measuring the offset again",
                stepped,
            )
            return
        first = next(r for r in results if isinstance(r, RpcError))
        self._once(
            logging.WARNING,
            "clock",
            f"every bootstrap refuses this node's time ({first.reason}): this machine's clock moved; set it right "
            f"(NTP) or restart the peer",
        )

    def _measure_clock(self, bootstraps: Sequence[Contact], *, refuse: bool) -> None:
        """Set :attr:`clock_offset_s` to the median offset measured against ``bootstraps`` (kept when it
        moved less than 0.5 s: the estimate jitters by the calls' asymmetry).

        ``refuse`` (at join): raise :class:`ClockSkewError` when it is over ``max_clock_skew_s``. After join
        (issue 29 #3, rippled#3101: a peer that kept its old offset after a 90 s step was planned out for
        good, and one 150 s off had every call refused): a change under ``CLOCK_JUMP_S`` is followed at once
        (drift); a larger one, which no step of this machine's clock explains (those are corrected at once by
        :attr:`clock_offset_s`): the bootstraps' clock moved, or a suspend the steady clock did not count, is
        followed once ``CLOCK_CONFIRMATIONS`` measurements in a row agree within ``CLOCK_CONFIRM_SPREAD_S``,
        with one WARNING line (envelopes and deadlines are in swarm time). Either only when a majority of the
        bootstraps measured it (within ``CLOCK_CONFIRM_SPREAD_S``), and never past ``max_clock_skew_s`` from
        where the bootstraps' time stood at join against this machine's steady clock (one WARNING: a bootstrap
        whose clock is wrong, or lies, cannot walk this peer's swarm time away from the honest peers')."""
        samples = sorted(self._offsets[c.peer_id] for c in bootstraps if c.peer_id in self._offsets)
        if not samples:
            return
        offset = samples[len(samples) // 2]
        who = next(c.address for c in bootstraps if self._offsets.get(c.peer_id) == offset)
        off_by = (
            f"this machine's clock is {abs(offset):.0f} s {'behind' if offset > 0 else 'ahead of'} the clock "
            f"of bootstrap {who}"
        )
        if refuse:
            if abs(offset) > self.max_clock_skew_s:
                raise ClockSkewError(
                    f"{off_by}; the swarm tolerates {self.max_clock_skew_s:.0f} s: set the clock of the "
                    f"wrong one (enable NTP, e.g. timedatectl set-ntp true)"
                )
            if abs(offset) >= 1.0:
                log.info("clock offset to the bootstrap(s): %+.1f s; records are judged in swarm time", offset)
            self.clock_offset_s = offset
            self._clock_anchor = self._swarm_minus_steady(offset)
            self._clock_jumps.clear()
            return
        current = self.clock_offset_s
        change = offset - current
        if abs(change) < 0.5:
            self._clock_jumps.clear()
            return
        moved = self._swarm_minus_steady(offset) - self._clock_anchor if self._clock_anchor is not None else 0.0
        if abs(moved) > self.max_clock_skew_s:
            self._clock_jumps.clear()
            self._once(
                logging.WARNING,
                "clock",
                f"the bootstraps' time moved {moved:+.0f} s since this node joined (against this machine's steady "
                f"clock); not followed past {self.max_clock_skew_s:.0f} s: a bootstrap's clock is wrong (or it "
                f"lies); check the bootstraps' clocks and restart this peer to measure again",
            )
            return
        if 2 * sum(1 for x in samples if abs(x - offset) <= CLOCK_CONFIRM_SPREAD_S) <= len(samples):
            # No majority of the bootstraps says so (with two, the median is the larger: one hostile bootstrap
            # would decide): not a moved clock.
            log.debug(
                "clock offset %+.1f s measured by a minority of %d bootstraps: not followed", offset, len(samples)
            )
            self._clock_jumps.clear()
            return
        if abs(change) < CLOCK_JUMP_S:
            if abs(offset) >= 1.0:
                log.info("clock offset to the bootstrap(s): %+.1f s; records are judged in swarm time", offset)
            self.clock_offset_s = offset
            self._clock_jumps.clear()
            return
        # A jump: confirmed by several measurements before it moves every deadline of this peer (one reply
        # delayed in a queue is not a moved clock). The changes are against the offset in use, which a step of
        # this machine's clock moves too, so they stay comparable.
        self._clock_jumps.append(change)
        del self._clock_jumps[:-CLOCK_CONFIRMATIONS]
        jumps = self._clock_jumps
        if len(jumps) < CLOCK_CONFIRMATIONS or max(jumps) - min(jumps) > CLOCK_CONFIRM_SPREAD_S:
            log.debug("clock offset measured %+.1f s against %+.1f s in use: confirming", offset, current)
            return
        self._clock_jumps.clear()
        self.clock_offset_s = offset
        hint = f"; {off_by}: set it right (NTP)" if abs(offset) > self.max_clock_skew_s else ""
        events.emit(
            log,
            logging.WARNING,
            "clock_jump",
            "swarm time moved %+.1f s against this machine's clock (measured %d times: a clock step, a suspend, "
            "or the bootstraps' clock moved); following it: offset now %+.1f s%s",
            change,
            CLOCK_CONFIRMATIONS,
            offset,
            hint,
            peer=self.peer_id.to_string(),
            change_s=change,
            offset_s=offset,
        )

    def _swarm_minus_steady(self, offset: float) -> float:
        """Swarm time at ``offset`` minus this machine's steady clock, seconds: unchanged by steps of the wall
        clock and by suspends, so its change since join is how far the bootstraps' time moved (0-based when
        there is no steady clock)."""
        steady = self._steps.steady
        return offset + (self._steps.wall() - steady() if steady is not None else 0.0)

    async def rejoin(self, contacts: Sequence[Contact]) -> int:
        """Ping ``contacts`` (e.g. the routing table a bootstrap saved before a restart) once, each
        expected to answer signed by its PeerID, then look up this node's own id. Never raises.
        Returns the number of nodes in the routing table after."""
        contacts = [c for c in contacts if c.peer_id != self.peer_id and _valid_address(c.address)]
        if contacts:
            await asyncio.gather(*(self.ping(c.address, expected=c.peer_id) for c in contacts), return_exceptions=True)
            if self.contacts():
                await self.find_nearest_nodes([self.node_id])
        return len(self.contacts())

    async def refresh_once(self) -> None:
        """Re-dial bootstraps and recently dropped nodes if no node is known; look up a random id in
        each stale bucket."""
        if not self.contacts() and (self.bootstrap_addresses or self._removed):
            again = list(dict.fromkeys(self.bootstrap_addresses + list(self._removed)))
            await asyncio.gather(*(self.ping(a) for a in again), return_exceptions=True)
            if self.contacts():
                await self.find_nearest_nodes([self.node_id])
        threshold = time.time() - self.refresh_period_s
        stale = [
            DHTID(random.randint(b.lower, b.upper - 1))
            for b in self.routing_table.buckets
            if b.last_updated < threshold
        ]
        if stale:
            await self.find_nearest_nodes(stale)

    async def check_reachable(self, bootstraps: Sequence[str]) -> Reachability:
        """Ask each of ``bootstraps`` (at once) to dial this node back at its advertised address.

        Reachable when any of them reached it; unreachable when every one that answered failed to or
        refused to dial; None (unknown) when none supports it (older software) or none answered. Never
        raises. A bootstrap dials back only the IP it sees the call come from: an address naming another
        host (a wrong --advertise-host, a host name, or a public IP while this node reaches the bootstrap
        over a LAN or VPC) is refused ("not checked: ..." with both IPs) and counts as unreachable, so the
        node goes client-only (it still trains; it owns no part) rather than own parts at an address
        nobody may reach. A NAT that shows the advertised public IP to the bootstrap is checked as usual.
        Deadline of each call: 2 x ``rpc_timeout_s`` + 1 s (the dial-back itself has ``rpc_timeout_s``).
        """
        address = self.transport.address
        if self.client_only or address is None or not bootstraps:
            return Reachability(address, None)
        req = dht_pb2.PingRequest(
            sender=dht_pb2.NodeInfo(node_id=self.node_id.to_bytes(), address=address, peer_id=bytes(self.peer_id)),
            dht_protocol=DHT_PROTOCOL_VERSION,
            software_version=__version__,
        )

        async def ask(b: str) -> Optional[dht_pb2.StoreOutcome]:
            try:
                reply = await self.transport.call(
                    b, DHT_CHECK_REACHABLE, req.SerializeToString(), timeout=2 * self.rpc_timeout_s + 1.0
                )
                return dht_pb2.StoreOutcome.FromString(reply.payload)
            except RpcError as e:
                log.debug("reachability check at %s failed: %s", b, e)
                if e.code == grpc.StatusCode.PERMISSION_DENIED and e.reason.startswith(NOT_CHECKED):
                    return dht_pb2.StoreOutcome(stored=False, code=e.code.value[0], reason=e.reason)
            except DecodeError as e:
                log.debug("reachability check at %s failed: %s", b, e)
            return None

        outs = await asyncio.gather(*(ask(b) for b in bootstraps))
        asked = tuple(b for b, o in zip(bootstraps, outs) if o is not None)
        if any(o is not None and o.stored for o in outs):
            return Reachability(address, True, asked)
        if not asked:
            return Reachability(address, None)
        reason = next(o.reason for o in outs if o is not None)
        return Reachability(address, False, asked, reason)
