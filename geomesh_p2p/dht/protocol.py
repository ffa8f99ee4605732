"""The DHT's RPCs, both sides (as hivemind's ``dht/protocol.py``): the calls this node makes (``_call``,
:meth:`~DHTProtocol.ping`, find, store in chunks; replies are accepted only when signed by the PeerID the
contact names) and the handlers it serves (``_rpc_ping``, ``_rpc_store``, ``_rpc_find``,
``_rpc_check_reachable``: bounded, each request's sender checked against its signed envelope).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import grpc
from google.protobuf.message import DecodeError
from hivemind.dht.routing import DHTID

from geomesh_p2p import __version__
from geomesh_p2p.dht.records import RecordError, SignedRecord, VerifiedRecord, node_id_of, verify_record
from geomesh_p2p.net.addr import ip_of, parse_address
from geomesh_p2p.net.guard import peer_ip
from geomesh_p2p.net.identity import PeerID, Verified
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.net.methods import CONTROL_LANE, DHT_FIND, DHT_PING, DHT_STORE
from geomesh_p2p.wire import dht_pb2
from geomesh_p2p.dht.state import (
    _UNREACHABLE,
    DHT_CHECK_REACHABLE,
    DHT_PROTOCOL_VERSION,
    NOT_CHECKED,
    Contact,
    _valid_address,
    _WrongPeer,
)
from geomesh_p2p.dht.contacts import DHTContacts
from geomesh_p2p.dht.preflight import check_ping_protocol, ping_request

# Statuses of a dial-back answered by something that is no geomesh node (an HTTP/2 server: 404 ->
# UNIMPLEMENTED; a malformed reply: DATA_LOSS) or by a node of another run whose reply fails verification.
_NOT_GEOMESH = {
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}

# The node was one module: its parts log under that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")


#: The latest time (unix seconds) a ping answer may state, as ``PeerRecord.timestamp`` (year 5138).
MAX_PING_TIME = 1e11
#: Longest round trip (seconds, this machine's clock) of a ping whose answer replaces the clock sample of a contact that
#: has one: NTP's one-exchange estimate (:func:`ping_offset`) is off by up to half the round trip, and a peer paused or
#: whose event loop stalled mid-ping (the reply waits unread, or the request leaves late) measured 3-9 s round trips,
#: which moved its swarm time 1.5-4.5 s at once (red team 54; under ``CLOCK_JUMP_S`` a change is followed as drift).
#: A bootstrap's first sample is kept whatever its round trip (a join needs one), and on a slow link a round trip up to
#: ``CLOCK_RTT_SLACK`` x the shortest of its last ``CLOCK_RTT_WINDOW`` pings is still taken, up to
#: ``MAX_SLOW_CLOCK_RTT_S`` (an estimate off by at most 1.25 s, well under the rounds' 5 s ``late_pull_s``). The window,
#: not the shortest ever: a link fast at join and 1.2 s from then on was never followed again (red team 54b).
MAX_CLOCK_RTT_S = 1.0
CLOCK_RTT_SLACK = 2.0
MAX_SLOW_CLOCK_RTT_S = 2.5
CLOCK_RTT_WINDOW = 4


def ping_offset(their_time: float, t0: float, t1: float) -> Optional[float]:
    """NTP's offset estimate from one exchange: ``their_time`` (the answer's, unix seconds) less the call's midpoint
    (``t0``, ``t1``: this node's clock when the call went out and when the answer came). None when the answer states
    no time (0: a node that does not say it) or one that is no time: a double from the network may be inf, nan or
    1e308 (red team, session 16: "this machine's clock is inf s behind")."""
    if not (math.isfinite(their_time) and 0 < their_time <= MAX_PING_TIME):
        return None
    return their_time - (t0 + t1) / 2


def _check_count(n: int, limit: int, request: str, items: str, call: str) -> None:
    """Refuse a ``request`` holding ``n`` ``items``: none (INVALID_ARGUMENT) or over ``limit``
    (RESOURCE_EXHAUSTED), as a RecordError naming them (``call``: "store", "find")."""
    if not n:
        raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"{request} holds no {items}")
    if n > limit:
        raise RecordError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{n} {items} in one {call}, over the limit of {limit}")


def _parse(cls, payload: bytes, name: str):
    try:
        return cls.FromString(payload)
    except (DecodeError, ValueError) as e:
        raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: {e}") from None


class DHTProtocol(DHTContacts):
    """The DHT's RPCs, both sides (see the module doc)."""

    def _serve(self) -> None:
        """Register the DHT handlers on the transport (not on a client-only node); before it starts."""
        if not self.client_only:
            if self.transport.address is not None:
                raise RuntimeError("create the DHTNode before transport.start(), so that its handlers are served")
            self.transport.add_unary(DHT_PING, self._rpc_ping, max_payload_bytes=16 << 10)
            self.transport.add_unary(DHT_STORE, self._rpc_store, max_payload_bytes=self.limits.max_store_payload())
            self.transport.add_unary(
                DHT_FIND, self._rpc_find, max_payload_bytes=self.limits.max_keys_per_find * 64 + 4096
            )
            self.transport.add_unary(DHT_CHECK_REACHABLE, self._rpc_check_reachable, max_payload_bytes=16 << 10)

    # ------------------------------------------------------------------ outgoing RPCs
    async def _call(self, contact_or_address, method: str, request, response_cls, expected: Optional[PeerID] = None):
        """Call ``method``; returns (sender Contact, parsed response). Raises RpcError (incl. bad reply)."""
        if isinstance(contact_or_address, Contact):
            address, expected = contact_or_address.address, contact_or_address.peer_id
        else:
            address = contact_or_address
        self.stats.rpcs_sent += 1
        reply: Verified = await self.transport.call(
            address, method, request.SerializeToString(), timeout=self.rpc_timeout_s
        )
        contact = Contact(reply.sender, address)
        if expected is not None and reply.sender != expected:
            raise _WrongPeer(
                address,
                method,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reply signed by {reply.sender.short()}, expected {expected.short()}",
            )
        try:
            response = response_cls.FromString(reply.payload)
        except DecodeError as e:
            raise RpcError(address, method, grpc.StatusCode.DATA_LOSS, f"malformed reply: {e}") from None
        return contact, response

    def _clock_sample_ok(self, peer: PeerID, rtt: float) -> bool:
        """Whether a ping to bootstrap ``peer`` of round trip ``rtt`` (seconds, the steady clock) may replace its clock
        sample (:data:`MAX_CLOCK_RTT_S`): its first one, or a round trip from 0 to the larger of ``MAX_CLOCK_RTT_S``
        and ``CLOCK_RTT_SLACK`` x the shortest of its last ``CLOCK_RTT_WINDOW`` (this one included, which it
        records), at most ``MAX_SLOW_CLOCK_RTT_S``."""
        recent = self._rtts.setdefault(peer, collections.deque(maxlen=CLOCK_RTT_WINDOW))
        recent.append(max(0.0, rtt))
        if peer not in self._offsets:
            return True
        return 0.0 <= rtt <= max(MAX_CLOCK_RTT_S, min(CLOCK_RTT_SLACK * min(recent), MAX_SLOW_CLOCK_RTT_S))

    async def ping(self, address: str, *, expected: Optional[PeerID] = None) -> Contact:
        """Ping ``address``; on an answer, add the node to the routing table and return its Contact.

        Raises RpcError when it does not answer or refuses, DHTJoinError on a DHT protocol mismatch.
        """
        req = ping_request(self.self_info())
        t0, s0 = self._clock(), self._rtt_clock()
        try:
            contact, resp = await self._call(address, DHT_PING, req, dht_pb2.PingResponse, expected)
        except RpcError as err:
            if expected is not None:
                self._on_failure(Contact(expected, address))
            raise err
        t1, rtt = self._clock(), self._rtt_clock() - s0
        offset = ping_offset(resp.time, t0, t1)
        # only a bootstrap's time is followed (DHTJoin._measure_clock): the table holds those alone, so no eviction
        # ever drops a bootstrap's sample (a "first" sample is taken whatever its round trip: red team 54b)
        if offset is not None and address in self.bootstrap_addresses:
            fresh = self._clock_sample_ok(contact.peer_id, rtt)
            self._sample_fresh[contact.peer_id] = fresh
            recent = self._rtts[contact.peer_id]
            if fresh:
                self._offsets[contact.peer_id] = offset
            elif len(recent) == CLOCK_RTT_WINDOW and min(recent) > MAX_SLOW_CLOCK_RTT_S:
                # its time is no longer followed: say so once (red team 54c: a 2.8 s link never moved it, silently)
                self._once(
                    logging.WARNING,
                    f"bootstrap {address}",
                    f"its last {CLOCK_RTT_WINDOW} pings took {min(recent):.1f} s or more "
                    f"(a clock sample is off by up to half that): this peer's swarm time no longer follows its clock "
                    f"({self.clock_offset_s:+.1f} s kept); check this machine's link to it, or its load",
                )
        check_ping_protocol(address, resp)
        self._on_contact(contact)
        return contact

    async def _find(
        self,
        contact: Contact,
        key_ids: Sequence[DHTID],
        *,
        nodes_only: bool = False,
        subkeys: Optional[Collection[str]] = None,
    ) -> Optional[Dict[DHTID, Tuple[List[VerifiedRecord], Dict[DHTID, Contact]]]]:
        """FIND at ``contact``; None when it fails. Invalid records and contacts in the reply are dropped.
        ``nodes_only``: ask for the nearest nodes only (a store's lookup: no records in the reply, so no
        bytes and no signature checks for them). ``subkeys``: ask only for the records under these subkeys
        (a sampled read); records under other subkeys in the reply (a server that predates the field) are
        dropped unverified."""
        if contact.peer_id in self.blacklist:
            return None
        req = dht_pb2.FindRequest(
            sender=self.self_info(),
            keys=[k.to_bytes() for k in key_ids],
            nodes_only=nodes_only,
            subkeys=sorted(subkeys) if subkeys else [],
        )
        try:
            contact, resp = await self._call(contact, DHT_FIND, req, dht_pb2.FindResponse)
        except RpcError as err:
            log.debug("find at %r failed: %s", contact, err)
            self._on_failure(contact)
            return None
        self._on_contact(contact)
        if len(resp.results) != len(key_ids):
            self._once(logging.WARNING, contact.peer_id.short(), "find reply does not match the keys asked")
            return None
        now = self.now()
        out: Dict[DHTID, Tuple[List[VerifiedRecord], Dict[DHTID, Contact]]] = {}
        for key_id, result in zip(key_ids, resp.results):
            records: List[VerifiedRecord] = []
            for rec in result.records:
                if subkeys and (not rec.HasField("subkey") or rec.subkey not in subkeys):
                    continue  # not asked for: not verified, not kept
                try:
                    records.append(
                        verify_record(rec, run_id=self.run_id, now=now, limits=self.limits, expected_key_id=key_id)
                    )
                except RecordError as err:
                    self.stats.records_dropped_on_find += 1
                    self._once(
                        logging.WARNING,
                        contact.peer_id.short(),
                        f"dropped a record it returned: {err.code.name}: {err.reason}",
                    )
            nearest: Dict[DHTID, Contact] = {}
            for info in result.nearest:
                raw_peer, address = info.peer_id, info.address  # one read each: every read is a copy
                if len(raw_peer) != 32 or not _valid_address(address):
                    continue
                nid = node_id_of(raw_peer)
                if info.node_id != nid.to_bytes() or nid == self.node_id:
                    continue
                peer = PeerID(raw_peer)
                if peer in self.blacklist:
                    continue
                nearest[nid] = Contact(peer, address)
            out[key_id] = (records, nearest)
        return out

    async def _send_records(
        self, contact: Contact, records: List[SignedRecord]
    ) -> Optional[List[dht_pb2.StoreOutcome]]:
        """STORE ``records`` at ``contact`` in chunks; outcomes in order, None when it did not answer."""
        outcomes: List[dht_pb2.StoreOutcome] = []
        step = self.limits.max_records_per_store
        for i in range(0, len(records), step):
            chunk = records[i : i + step]
            req = dht_pb2.StoreRequest(sender=self.self_info(), records=chunk)
            try:
                contact, resp = await self._call(contact, DHT_STORE, req, dht_pb2.StoreResponse)
            except RpcError as err:
                if _unusable(err):
                    log.debug("store at %r failed: %s", contact, err)
                    self._on_failure(contact)
                    return None
                # the node answered but refused every record: report why
                outcomes.extend(
                    dht_pb2.StoreOutcome(stored=False, code=err.code.value[0], reason=err.reason) for _ in chunk
                )
                continue
            self._on_contact(contact)
            if len(resp.outcomes) != len(chunk):
                self._once(logging.WARNING, contact.peer_id.short(), "store reply does not match the records sent")
                return None
            outcomes.extend(resp.outcomes)
        return outcomes

    # ------------------------------------------------------------------ incoming RPCs
    def _note_sender(self, verified: Verified, info: dht_pb2.NodeInfo) -> None:
        """Check the request's sender NodeInfo against its signed envelope; when it names an address,
        refresh it if known there, else ping it back there before adding it (:meth:`_check_contact`)."""
        if info.peer_id and info.peer_id != bytes(verified.sender):
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "sender NodeInfo names another PeerID than the signer")
        if info.node_id and info.node_id != node_id_of(verified.sender).to_bytes():
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "sender node_id is not SHA-1 of its PeerID")
        address = info.address  # one read: each read of a protobuf string field is a copy
        if address:
            contact = Contact(verified.sender, address)
            if self.routing_table.get(node_id=contact.node_id) == contact:
                # Known at this address (it answered us there; checked then, as every address in the table
                # was, so not parsed again here): refresh it.
                self._on_contact(contact)
                return
            if not _valid_address(address):
                raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"sender address {address[:60]!r} is not host:port")
            self._check_contact(contact)  # the address is a claim until it answers there

    async def _rpc_ping(self, verified: Verified, context) -> bytes:
        self._alive_check()
        req = _parse(dht_pb2.PingRequest, verified.payload, "PingRequest")
        if req.dht_protocol != DHT_PROTOCOL_VERSION:
            raise RecordError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"DHT protocol {req.dht_protocol} vs {DHT_PROTOCOL_VERSION} on this node "
                f"(software {req.software_version or '?'} vs {__version__})",
            )
        self._note_sender(verified, req.sender)
        return dht_pb2.PingResponse(
            node=self.self_info(), time=self.now(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__
        ).SerializeToString()

    async def _rpc_check_reachable(self, verified: Verified, context) -> bytes:
        """Dial the caller back at the address its request names and say whether it answered there,
        signed by its PeerID: a StoreOutcome, ``stored`` True when it did, else a coarse ``reason``
        (:func:`_reach_class`: "refused", "timeout", "wrong identity", "not a geomesh node", "error
        reply"; never the raw gRPC error nor who else answered there).

        Only an address whose host is the IP the call comes from (``context.peer()``) is dialled, so
        this node dials no third party's address on request (it was a port scanner for anyone: red team,
        session 28). Any other address, a host name included (resolving it on request would be a DNS
        rebinding hole), is refused with PERMISSION_DENIED and not dialled. A peer behind a NAT that
        advertises the NAT's public IP and calls from behind it is seen at that same IP, so it is
        checked; one that calls the bootstrap over another path (same LAN or VPC, advertising its
        public IP) is refused: :meth:`~geomesh_p2p.dht.join.DHTJoin.check_reachable` counts that as not
        reachable (the node goes client-only, with a warning naming both IPs).
        At most one dial-back per caller at a time. Raises RecordError (the status answered) on a bad
        request."""
        self._alive_check()
        req = _parse(dht_pb2.PingRequest, verified.payload, "PingRequest")
        info = req.sender
        if info.peer_id and info.peer_id != bytes(verified.sender):
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "sender NodeInfo names another PeerID than the signer")
        address = info.address
        if not _valid_address(address):
            raise RecordError(
                grpc.StatusCode.INVALID_ARGUMENT, f"no address to dial back ({address[:60]!r} is not host:port)"
            )
        refusal = dial_back_refusal(address, context.peer())
        if refusal:
            raise RecordError(grpc.StatusCode.PERMISSION_DENIED, f"{NOT_CHECKED}: {refusal}")
        if verified.sender in self._dialing_back:
            raise RecordError(grpc.StatusCode.RESOURCE_EXHAUSTED, "a dial-back of this peer is under way")
        self._dialing_back.add(verified.sender)
        ping = ping_request(self.self_info())
        try:
            try:
                answered, resp = await self._call(address, DHT_PING, ping, dht_pb2.PingResponse, verified.sender)
            except RpcError as err:
                # A channel cached from an earlier process at that address (the caller restarted on the
                # same port) fails at once with its old "connection refused" while in reconnect backoff.
                # Transport.call already redials a lost connection once; this covers an UNAVAILABLE whose
                # wording it does not recognise. Only UNAVAILABLE (fast): a deadline is not retried.
                if err.code != grpc.StatusCode.UNAVAILABLE or not self.transport.drop_channel(
                    address, lane=CONTROL_LANE
                ):
                    raise
                answered, resp = await self._call(address, DHT_PING, ping, dht_pb2.PingResponse, verified.sender)
        except RpcError as err:
            code, reason = _reach_class(err)
            log.debug("dial-back of %s at %s failed: %s", verified.sender.short(), address, err)
            return dht_pb2.StoreOutcome(stored=False, code=code.value[0], reason=reason).SerializeToString()
        finally:
            self._dialing_back.discard(verified.sender)
        if resp.dht_protocol == DHT_PROTOCOL_VERSION:
            self._on_contact(answered)  # it answered at its address: it is a contact now
        return dht_pb2.StoreOutcome(stored=True, code=0, reason="").SerializeToString()

    async def _rpc_store(self, verified: Verified, context) -> bytes:
        self._alive_check()
        req = _parse(dht_pb2.StoreRequest, verified.payload, "StoreRequest")
        _check_count(len(req.records), self.limits.max_records_per_store, "StoreRequest", "records", "store")
        self._note_sender(verified, req.sender)
        outcomes = [self._store_local(rec, from_peer=verified.sender) for rec in req.records]
        refused = [o for o in outcomes if o.code != 0]
        for o in refused:
            self._once(
                logging.WARNING,
                f"refused record from {verified.sender.short()}",
                f"{grpc.StatusCode(_code(o.code)).name}: {o.reason}",
            )
        if refused and len(refused) == len(outcomes):
            first = refused[0]
            reason = (
                first.reason if len(outcomes) == 1 else f"all {len(outcomes)} records refused; first: {first.reason}"
            )
            raise RecordError(_code(first.code), reason)
        return dht_pb2.StoreResponse(outcomes=outcomes).SerializeToString()

    async def _rpc_find(self, verified: Verified, context) -> bytes:
        self._alive_check()
        req = _parse(dht_pb2.FindRequest, verified.payload, "FindRequest")
        _check_count(len(req.keys), self.limits.max_keys_per_find, "FindRequest", "keys", "find")
        if any(len(k) != DHTID.HASH_NBYTES for k in req.keys):
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"a key is not a {DHTID.HASH_NBYTES}-byte DHTID")
        self._note_sender(verified, req.sender)
        if req.subkeys:  # none asked: every record of the keys
            _check_count(len(req.subkeys), self.limits.max_keys_per_find, "FindRequest", "subkeys", "find")
        wanted = set(req.subkeys)
        exclude = node_id_of(verified.sender)
        resp = dht_pb2.FindResponse()
        budget = self.transport.config.max_message_bytes // 2  # room for the nearest lists and the envelope
        for raw in req.keys:
            key_id = DHTID.from_bytes(raw)
            result = resp.results.add(key=raw)
            for rec in () if req.nodes_only else self._local_records(key_id):
                if wanted and (not rec.HasField("subkey") or rec.subkey not in wanted):
                    continue
                budget -= rec.ByteSize() + 8
                if budget < 0:
                    self._once(logging.WARNING, "find", "reply truncated at the message size limit")
                    break
                result.records.append(rec)
            for nid, c in self.routing_table.get_nearest_neighbors(key_id, self.k, exclude=exclude):
                result.nearest.add(node_id=nid.to_bytes(), address=c.address, peer_id=bytes(c.peer_id))
        return resp.SerializeToString()


def _unusable(err: RpcError) -> bool:
    """True when a failed call means the node cannot serve us (not merely a refusal of our records)."""
    return err.code in _UNREACHABLE or isinstance(err, _WrongPeer) or err.reason.startswith("reply refused")


def dial_back_refusal(address: str, peer: str) -> str:
    """Why CheckReachable must not dial ``address`` (a valid ``host:port``) for a caller whose
    ``context.peer()`` is ``peer`` ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"); "" when it may: its host is an IP
    literal equal to the caller's (an IPv4-mapped IPv6 address counts as its IPv4 address)."""
    host = parse_address(address)[0]
    seen = ip_of(peer_ip(peer))
    if seen is None:
        return f"the caller's IP is unknown ({peer[:60]!r})"
    want = ip_of(host)
    if want is None:
        return f"the address names host name {host[:60]!r}, not an IP; only the caller's own IP is dialled back"
    if want != seen:
        return f"the address names {want}, but the call comes from {seen}; only the caller's own IP is dialled back"
    return ""


def _reach_class(err: RpcError) -> Tuple[grpc.StatusCode, str]:
    """The coarse class of a failed dial-back, as (code, reason) for the caller: what it needs to fix its
    address, and nothing about the remote (its PeerID, the raw gRPC error text)."""
    if isinstance(err, _WrongPeer):
        return grpc.StatusCode.FAILED_PRECONDITION, "wrong identity: another node answers at this address"
    if err.code == grpc.StatusCode.UNAVAILABLE:
        return grpc.StatusCode.UNAVAILABLE, "refused: no connection could be made to this address"
    if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timeout: nothing answered at this address in time"
    if err.code in _NOT_GEOMESH or err.reason.startswith("reply refused"):
        return grpc.StatusCode.UNIMPLEMENTED, "not a geomesh node of this run: something else answers at this address"
    return grpc.StatusCode.UNKNOWN, "error reply: the node at this address answered the ping with an error"


def _code(value: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN
