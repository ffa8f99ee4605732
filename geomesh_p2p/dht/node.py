"""A Kademlia DHT node whose RPCs (ping, store, find) run over the project's gRPC transport.

Kademlia: Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information System Based on the XOR
Metric" (IPTPS 2002). Semantics follow hivemind's ``hivemind.dht.node.DHTNode`` (batched store and
find, values with expiration times, subkey dictionaries, newest expiration wins), and the
transport-free parts are hivemind's own: ``DHTID`` and ``RoutingTable`` (hivemind.dht.routing),
``traverse_dht`` (hivemind.dht.traverse, run in a geomesh_p2p.util.aio.TaskScope that owns its tasks),
``DHTLocalStorage`` (hivemind.dht.storage) and the ``Blacklist`` of unresponsive peers
(hivemind.dht.node). No libp2p daemon is started.

Differences from hivemind:

* every RPC is a signed envelope (geomesh_p2p.net.transport): the sender's PeerID is authenticated, and a
  node's DHTID is SHA-1 of its PeerID (checked), so nobody picks its place in the key space;
* values are :mod:`signed records <geomesh_p2p.dht.records>` with owner rules, checked on store and
  again by the reader on find (a lying node cannot forge, alter or revive a record);
* replies from a node are accepted only when signed by the PeerID its contact says;
* a node that calls us enters the routing table only after it answered a ping at the address it
  claims (so signed pings naming fake addresses cannot fill the table or Find answers), and at most
  ``max_contacts_per_ip`` identities per IP and ``max_contacts_per_subnet`` per /24 (IPv6: /48) are
  admitted (loopback exempt unless ``limit_loopback``); replacement lists are bounded (k per bucket);
* storage is bounded by :class:`~geomesh_p2p.dht.quota.StorageQuota` (per owner, per key, unsigned,
  total); values under the run's keys must be signed; an unsigned value lives at most
  ``RecordLimits.max_unsigned_ttl_s`` from when it was stored (a holder's republish does not extend
  it; its publisher's does), so a flood of them spreads at most that long, within every node's quota.

Usage::

    node = DHTNode(transport, k=20, alpha=3)   # registers DHT handlers: before transport.start()
    await transport.start()
    await node.join(["host:port", ...])        # DHTJoinError when no bootstrap answers
    await node.store("run/key", b"value", node.now() + 60)  # swarm time (see now())
    found = await node.get("run/key")          # {None: DHTValue(b"value", exp, None)}
    await node.shutdown()                      # then transport.stop() (the caller owns it)

Units: seconds and unix seconds for time, bytes for sizes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import grpc
from google.protobuf.message import DecodeError
from hivemind.dht.node import Blacklist
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.traverse import traverse_dht

from geomesh_p2p import __version__
from geomesh_p2p.telemetry import events
from geomesh_p2p.net.addr import AddressError, host_of, ip_of, parse_address, valid_address
from geomesh_p2p.util.aio import TaskScope, finish_or_cancel, runs
from geomesh_p2p.dht.records import (
    DEFAULT_LIMITS,
    RecordError,
    RecordLimits,
    SignedRecord,
    VerifiedRecord,
    key_id_of,
    make_record,
    node_id_of,
    verify_record,
)
from geomesh_p2p.dht.quota import DEFAULT_QUOTA, StorageLedger, StorageQuota
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID, Verified
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.net.transport import CONTROL_LANE, DHT_FIND, DHT_PING, DHT_STORE, RpcError, TaskOwner, Transport
from geomesh_p2p.wire import dht_pb2

log = logging.getLogger(__name__)

DHT_PROTOCOL_VERSION = 1
# "Dial me back" (as Petals' bootstraps do): request PingRequest naming the address to check; reply
# StoreOutcome with stored = reached, code = the gRPC status of the dial-back, reason = why not.
DHT_CHECK_REACHABLE = "/geomesh.wire.Dht/CheckReachable"

# RPC failures that mean "this node cannot serve us" (as opposed to "it refused this record").
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
}


class DHTJoinError(RuntimeError):
    """No bootstrap node answered (after retries with backoff), or all of them refused us."""


class IdentityInUseError(DHTJoinError):
    """A bootstrap answered signed by this node's own PeerID: another live process holds the same key."""


class OtherRunError(DHTJoinError):
    """A bootstrap answered, but it serves another run (``--run-id``): it was reached, so no "cannot reach"."""


class ClockSkewError(DHTJoinError, UserFacingError):
    """This machine's clock and its bootstrap's differ by more than the swarm tolerates
    (``DHTNode.max_clock_skew_s``): records and deadlines would be misjudged. One line, says what to do."""


class _WrongPeer(RpcError):
    """The node at an address is not the one its contact names (restarted with another key, or a lie)."""


@dataclass(frozen=True)
class Contact:
    """How to reach a DHT node: its PeerID and the ``host:port`` it serves on."""

    peer_id: PeerID
    address: str

    @property
    def node_id(self) -> DHTID:
        return node_id_of(self.peer_id)

    def __repr__(self) -> str:
        return f"Contact({self.peer_id.short()}@{self.address})"


@dataclass(frozen=True)
class Reachability:
    """Whether other nodes can dial this one at the address it advertises, as a bootstrap found by
    dialling it back during :meth:`DHTNode.join`.

    ``reachable``: True (a bootstrap reached it), False (every bootstrap asked failed to: the node then
    serves nobody and advertises no address, like a client-only node), None (not checked: client-only,
    no bootstrap, or no bootstrap supports the check). ``checked_by``: the bootstrap addresses asked;
    ``reason``: one line, why not reached.
    """

    address: Optional[str]
    reachable: Optional[bool]
    checked_by: Tuple[str, ...] = ()
    reason: str = ""


class DHTValue(NamedTuple):
    """One value found under a key (or one of its subkeys)."""

    value: bytes
    expiration_time: float  # unix seconds
    owner: Optional[PeerID]  # who signed it; None = unsigned


@dataclass
class LookupStats:
    """What one lookup cost. ``hops``: longest chain of find calls, each learnt from the previous
    answer (1 = answered by a node already in the routing table). ``found_hop``: hop of the first
    node that returned a value (0 = found locally; None = not found)."""

    rpcs: int = 0
    failures: int = 0
    hops: int = 0
    found_hop: Optional[int] = None
    seconds: float = 0.0


@dataclass
class DHTStats:
    """Counters of this node since start."""

    lookups: int = 0
    rpcs_sent: int = 0
    rpc_failures: int = 0
    stores_accepted: int = 0
    records_refused: int = 0
    records_dropped_on_find: int = 0
    republished: int = 0
    contacts_checked: int = 0  # callers pinged back at the address they claim
    contacts_unverified: int = 0  # ... that did not answer there
    contacts_refused: int = 0  # not admitted: per-IP/subnet limit, or too many checks pending


def _other_run_message(address: str, reason: str, own_run: str) -> str:
    """The join error for a bootstrap that answered for another run. ``reason``: its refusal, worded by
    :mod:`geomesh_p2p.net.identity` from the bootstrap's side ("message is for run 'a', this node serves 'b'")."""
    import re

    m = re.search(r"this node serves ('.*')", reason)
    theirs = m.group(1) if m else "another run"
    return f"could not join the DHT: bootstrap {address} serves run {theirs}, this peer asked for run {own_run!r}: check --run-id"


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


def _valid_address(address: str) -> bool:
    """``host:port`` with an IPv6 literal in brackets (geomesh_p2p.net.addr), at most 256 characters."""
    return valid_address(address)


class _Merge:
    """Best record per slot seen during a get: signed beats unsigned, then the latest expiration."""

    def __init__(self) -> None:
        self.best: Dict[Optional[str], VerifiedRecord] = {}

    def add(self, vr: VerifiedRecord) -> None:
        cur = self.best.get(vr.subkey)
        if cur is None or (vr.signed, vr.expiration_time) > (cur.signed, cur.expiration_time):
            self.best[vr.subkey] = vr

    def result(self, now: float) -> Dict[Optional[str], DHTValue]:
        return {
            sk: DHTValue(vr.value, vr.expiration_time, vr.owner)
            for sk, vr in self.best.items()
            if vr.expiration_time > now
        }


class DHTNode:
    """One Kademlia node over a :class:`~geomesh_p2p.net.transport.Transport` (k=20, alpha=3 by default).

    :param transport: not yet started (the constructor registers the DHT handlers on it), unless it
        is client-only. The caller owns it: :meth:`shutdown` does not stop it.
    :param k: bucket size and lookup beam width (Kademlia's k).
    :param alpha: concurrent find calls per lookup (Kademlia's alpha; traverse_dht's num_workers).
    :param num_replicas: nodes a value is stored on, default k.
    :param depth_modulo: hivemind RoutingTable's b: split a full bucket not holding our own id when
        its depth is not a multiple of this.
    :param rpc_timeout_s: deadline of every DHT call, seconds.
    :param refresh_period_s: refresh buckets not used for this long (random-id lookup); re-dial the
        bootstrap nodes when the routing table is empty. Seconds.
    :param republish_period_s: every period (±10%), re-store every held record expiring later than
        ``2 * rpc_timeout_s`` from now on the current k nearest nodes, unless it was received or
        republished within the period (Kademlia's hourly republish, scaled). Records this node
        published itself are republished until they expire, even on a client-only node.
    :param limits: record and request limits (see :class:`~geomesh_p2p.dht.records.RecordLimits`).
    :param blacklist_s: skip a node that did not answer for this long (doubling on repeats).
    :param max_failures: drop a node from the routing table after this many failed calls in a row
        (at once when a replacement is waiting in its bucket).
    :param join_attempts, join_backoff_s: :meth:`join` retries, with backoff doubling from this
        (±20% jitter), capped at 8 s.
    :param storage_size: max keys held (earliest expiring evicted first); None = unbounded.
    :param quota: bytes held per owner, per key, unsigned and in total (see :mod:`~geomesh_p2p.dht.quota`).
    :param max_contacts_per_ip, max_contacts_per_subnet: identities admitted into the routing table
        (replacements included) per IP and per /24 (IPv6 /48; private and loopback addresses: no
        subnet limit); 0 = no limit.
    :param limit_loopback: apply the per-IP limit to loopback addresses too (a local swarm shares one).
    :param max_contact_checks: ping-backs of unknown callers in flight (more callers: not admitted now;
        they are when they call again).
    :param bootstrap_refresh_s: ping every bootstrap address this often (default: the refresh period,
        at most 15 s; 0 = never), even while other nodes are known: a bootstrap that restarted with an
        empty routing table learns of this node again (it pings it back and adds it), so newcomers
        joining through it find the swarm (issue 14 #2). Seconds.
    :param max_clock_skew_s: :meth:`join` measures this node's clock against its bootstraps' (ping
        replies carry the responder's time; offset = their time - the midpoint of the call) and raises
        :class:`ClockSkewError` beyond this many seconds (half the envelope's 120 s window, which also
        covers time in flight). Within it, every record expiry this node writes or judges is in swarm
        time, :meth:`now` (= this clock + the measured offset), so a skewed peer agrees with the others.
    :param clock: this machine's wall clock, unix seconds (a test passes a skewed one).
    :param check_reachability: during :meth:`join`, ask the bootstraps to dial this node back at its
        advertised address; when none can, the node advertises no address (client-only) and logs a
        warning (:attr:`reachability`, :attr:`advertised_address`).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        k: int = 20,
        alpha: int = 3,
        num_replicas: Optional[int] = None,
        depth_modulo: int = 5,
        rpc_timeout_s: float = 3.0,
        refresh_period_s: float = 60.0,
        republish_period_s: float = 60.0,
        limits: RecordLimits = DEFAULT_LIMITS,
        blacklist_s: float = 2.0,
        max_failures: int = 3,
        join_attempts: int = 5,
        join_backoff_s: float = 0.5,
        storage_size: Optional[int] = None,
        quota: StorageQuota = DEFAULT_QUOTA,
        max_contacts_per_ip: int = 8,
        max_contacts_per_subnet: int = 32,
        limit_loopback: bool = False,
        max_contact_checks: int = 64,
        check_reachability: bool = True,
        bootstrap_refresh_s: Optional[float] = None,
        max_clock_skew_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        if k < 1 or alpha < 1:
            raise ValueError(f"k and alpha must be >= 1 (got k={k}, alpha={alpha})")
        self.transport = transport
        self.identity: Identity = transport.identity
        self.peer_id: PeerID = transport.identity.peer_id
        self.node_id: DHTID = node_id_of(self.peer_id)
        self.run_id: str = transport.run_id
        self.client_only: bool = transport.config.client_only
        self.k, self.alpha = k, alpha
        self.num_replicas = num_replicas or k
        self.rpc_timeout_s = rpc_timeout_s
        self.refresh_period_s = refresh_period_s
        self.republish_period_s = republish_period_s
        self.limits = limits
        self.join_attempts, self.join_backoff_s = join_attempts, join_backoff_s
        self.routing_table = RoutingTable(self.node_id, k, depth_modulo)
        self.storage = DHTLocalStorage(maxsize=storage_size)
        self.ledger = StorageLedger(quota)
        self.max_contacts_per_ip, self.max_contacts_per_subnet = max_contacts_per_ip, max_contacts_per_subnet
        self.limit_loopback = limit_loopback
        self.max_contact_checks = max_contact_checks
        self.check_reachability = check_reachability
        self.max_clock_skew_s = max_clock_skew_s
        self._clock = clock
        self.clock_offset_s = 0.0  # bootstraps' clock - this clock, seconds (0 until measured)
        self._offsets: Dict[PeerID, float] = {}  # last measured offset per node that answered a ping
        # Local storage (hivemind TimedStorage) evicts by time.time(): its expirations are shifted from
        # swarm time by this much (clock bias of an injected clock + measured offset).
        self._clock_bias = clock() - time.time()
        self.bootstrap_refresh_s = min(refresh_period_s, 15.0) if bootstrap_refresh_s is None else bootstrap_refresh_s
        self._checking: Dict[PeerID, str] = {}  # callers being pinged back -> claimed address
        self._unanswered: "OrderedDict[str, float]" = OrderedDict()  # address -> monotonic time of a failed check
        self.blacklist = Blacklist(blacklist_s, 2.0)
        self.stats = DHTStats()
        self.tasks = TaskOwner(f"dht {self.peer_id.short()}")
        self.bootstrap_addresses: List[str] = []
        self.bootstrap_peers: Dict[PeerID, str] = {}  # PeerIDs that answered at a bootstrap address
        self._published: Dict[Tuple[DHTID, Optional[str]], SignedRecord] = {}
        self._fresh: Dict[Tuple[DHTID, Optional[str]], float] = {}
        self._pinging: set = set()
        self._failures: Dict[PeerID, int] = {}
        self._removed: Dict[str, Contact] = {}  # recently dropped contacts, re-dialled if the table empties
        self.max_failures = max_failures
        self._started = False
        self._alive = True
        # Keys (who, reason head): a misbehaving peer cannot flood the log.
        self._once_log = LogOnce(log, capacity=4096)
        self.reachability = Reachability(None, None)
        self._dialing_back: set = set()  # PeerIDs whose CheckReachable is being answered
        if not self.client_only:
            if transport.address is not None:
                raise RuntimeError("create the DHTNode before transport.start(), so that its handlers are served")
            transport.add_unary(DHT_PING, self._rpc_ping, max_payload_bytes=16 << 10)
            transport.add_unary(DHT_STORE, self._rpc_store, max_payload_bytes=limits.max_store_payload())
            transport.add_unary(DHT_FIND, self._rpc_find, max_payload_bytes=limits.max_keys_per_find * 64 + 4096)
            transport.add_unary(DHT_CHECK_REACHABLE, self._rpc_check_reachable, max_payload_bytes=16 << 10)

    @classmethod
    async def create(cls, transport: Transport, *, bootstrap: Sequence[str] = (), **kwargs) -> "DHTNode":
        """Make a node, start ``transport`` if it is not started yet, and :meth:`join` ``bootstrap``.

        Raises DHTJoinError (see :meth:`join`), OSError when the port cannot be bound.
        """
        node = cls(transport, **kwargs)
        if not transport.config.client_only and transport.address is None:
            await transport.start()
        await node.join(bootstrap)
        return node

    # ------------------------------------------------------------------ small helpers
    def _once(self, level: int, who: str, msg: str) -> None:
        """Log ``"<who>: <msg>"`` at ``level`` once per (who, first 48 characters of msg)."""
        self._once_log((who, msg[:48]), level, "%s: %s", who, msg)

    @property
    def address(self) -> Optional[str]:
        """``host:port`` this node serves on; None for a client-only node (or before start)."""
        return self.transport.address

    @property
    def advertised_address(self) -> Optional[str]:
        """The ``host:port`` others should dial (put it in this peer's records); None when this node is
        client-only, not started, or a bootstrap could not dial it back at its address (see
        :attr:`reachability`)."""
        if self.client_only or self.reachability.reachable is False:
            return None
        return self.transport.address

    @property
    def serving(self) -> bool:
        return self.advertised_address is not None

    def self_info(self) -> dht_pb2.NodeInfo:
        if not self.serving:
            return dht_pb2.NodeInfo(peer_id=bytes(self.peer_id))
        return dht_pb2.NodeInfo(node_id=self.node_id.to_bytes(), address=self.address, peer_id=bytes(self.peer_id))

    def now(self) -> float:
        """Swarm time, unix seconds: this machine's clock corrected by the offset measured against the
        bootstraps at :meth:`join`. Every record expiration is written and judged in it."""
        return self._clock() + self.clock_offset_s

    def _to_storage(self, expiration_time: float) -> float:
        """A swarm-time expiration as the local storage (which evicts by time.time()) must hold it."""
        return expiration_time - self.clock_offset_s - self._clock_bias

    def contacts(self) -> List[Contact]:
        """Every node in the routing table (not replacements), nearest buckets first."""
        return [c for b in self.routing_table.buckets for c in b.nodes_to_peer_id.values()]

    def _alive_check(self) -> None:
        if not self._alive:
            raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "DHT node has shut down")

    # ------------------------------------------------------------------ routing table upkeep
    def _on_contact(self, contact: Contact) -> None:
        """``contact`` answered us at its address: add it (Kademlia 2.2) unless its IP or subnet already
        has its share of the table, and push it the values it should hold."""
        if contact.peer_id == self.peer_id:
            return
        node_id = contact.node_id
        self.blacklist.register_success(contact.peer_id)
        self._failures.pop(contact.peer_id, None)
        self._removed.pop(contact.address, None)
        old = self.routing_table.get(node_id=node_id)  # None: not in the table (nor a replacement)
        known = old == contact  # the usual case: a node we know answers or calls again
        if not known and not self._admissible(contact):
            self.stats.contacts_refused += 1
            return
        if old is None and self._started and self._alive:
            self._hand_over(node_id, contact)
        if old is not None and not known:
            self._forget(node_id)
        to_ping = self.routing_table.add_or_update_node(node_id, contact)
        if not known:  # a known node only moves within its list: no list grew
            self._trim_replacements(node_id)
        if to_ping is not None and self._alive and self._started:
            ping_id, ping_contact = to_ping
            if ping_id not in self._pinging:
                self._pinging.add(ping_id)
                self.tasks.spawn(self._check_stale(ping_id, ping_contact), name="dht-ping-stale")

    @staticmethod
    def _groups(address: str) -> Tuple[str, Optional[str], bool]:
        """(IP or host name, subnet or None, is loopback) of a ``host:port`` address."""
        host = host_of(address)
        ip = ip_of(host)
        if ip is None:
            return host.lower(), None, host.lower() == "localhost"
        if ip.is_loopback or ip.is_private or ip.is_link_local:
            return str(ip), None, ip.is_loopback
        bits = 24 if ip.version == 4 else 48
        return str(ip), str(ipaddress.ip_network(f"{ip}/{bits}", strict=False)), False

    def _admissible(self, contact: Contact) -> bool:
        """Whether the table (with replacements) has room for one more identity at this IP and subnet."""
        ip, subnet, loopback = self._groups(contact.address)
        per_ip = self.max_contacts_per_ip if (self.limit_loopback or not loopback) else 0
        per_subnet = self.max_contacts_per_subnet if subnet is not None else 0
        if not per_ip and not per_subnet:
            return True
        n_ip = n_subnet = 0
        for c in self.routing_table.uid_to_peer_id.values():
            if c.peer_id == contact.peer_id:
                continue
            cip, csub, _ = self._groups(c.address)
            n_ip += cip == ip
            n_subnet += subnet is not None and csub == subnet
        if per_ip and n_ip >= per_ip:
            self._once(logging.INFO, f"routing table {ip}", f"already holds {n_ip} nodes at {ip}; not adding more")
            return False
        if per_subnet and n_subnet >= per_subnet:
            self._once(
                logging.INFO, f"routing table {subnet}", f"already holds {n_subnet} nodes in {subnet}; not adding more"
            )
            return False
        return True

    def _trim_replacements(self, node_id: DHTID) -> None:
        """hivemind keeps every replacement candidate of a full bucket: keep the k most recent."""
        bucket = self.routing_table.buckets[self.routing_table.get_bucket_index(node_id)]
        while len(bucket.replacement_nodes) > self.k:
            old_id = next(iter(bucket.replacement_nodes))
            self._forget(old_id)

    def _check_contact(self, contact: Contact) -> None:
        """An unknown node called us naming ``contact.address``: ping it back there (in the background)
        and add it only if it answers, signed by the same PeerID. Bounded: one check per PeerID, at
        most ``max_contact_checks`` at once, an address that did not answer is not tried again for
        ``refresh_period_s``."""
        if not self._alive or contact.peer_id in self._checking:
            return
        failed_at = self._unanswered.get(contact.address)
        if failed_at is not None:
            if time.monotonic() - failed_at < self.refresh_period_s:
                return
            del self._unanswered[contact.address]
        if len(self._checking) >= self.max_contact_checks or not self._admissible(contact):
            self.stats.contacts_refused += 1
            return
        self._checking[contact.peer_id] = contact.address
        self.stats.contacts_checked += 1
        self.tasks.spawn(self._ping_back(contact), name="dht-check-contact")

    async def _ping_back(self, contact: Contact) -> None:
        # Not self.ping(): a caller that lied about its address is not blacklisted or counted as a failure
        # of a known node (those tables would grow with every fake identity).
        req = dht_pb2.PingRequest(
            sender=self.self_info(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__
        )
        try:
            answered, resp = await self._call(contact.address, DHT_PING, req, dht_pb2.PingResponse, contact.peer_id)
            if resp.dht_protocol != DHT_PROTOCOL_VERSION:
                raise RpcError(
                    contact.address,
                    DHT_PING,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"speaks DHT protocol {resp.dht_protocol}",
                )
            self._on_contact(answered)
        except RpcError as err:
            self.stats.contacts_unverified += 1
            self._unanswered[contact.address] = time.monotonic()
            while len(self._unanswered) > 4096:
                self._unanswered.popitem(last=False)
            log.debug("caller %r did not answer at its address: %s", contact, err)
        finally:
            self._checking.pop(contact.peer_id, None)

    def _forget(self, node_id: DHTID) -> None:
        try:
            del self.routing_table[node_id]
        except KeyError:
            pass

    def _on_failure(self, contact: Contact) -> None:
        """``contact`` did not answer: skip it for a while (blacklist with backoff) and drop it from the
        routing table after ``max_failures`` failures in a row, or at once when its bucket has a
        replacement waiting (Kademlia 4.1: do not empty the table on a transient outage)."""
        self.stats.rpc_failures += 1
        self.blacklist.register_failure(contact.peer_id)
        if len(self._failures) > 64 * self.k:  # bound the memory of peers met once and gone
            self._failures.clear()
        n = self._failures[contact.peer_id] = self._failures.get(contact.peer_id, 0) + 1
        node_id = contact.node_id
        if self.routing_table.get(node_id=node_id) != contact:
            return
        bucket = self.routing_table.buckets[self.routing_table.get_bucket_index(node_id)]
        if n >= self.max_failures or bucket.replacement_nodes:
            self._forget(node_id)
            self._failures.pop(contact.peer_id, None)
            self._removed[contact.address] = contact
            while len(self._removed) > 4 * self.k:
                self._removed.pop(next(iter(self._removed)))

    async def _check_stale(self, node_id: DHTID, contact: Contact) -> None:
        """A bucket is full: ping its least recently seen node; drop it if silent (its replacement moves in)."""
        try:
            await self.ping(contact.address, expected=contact.peer_id)
        except (RpcError, DHTJoinError):
            pass
        finally:
            self._pinging.discard(node_id)

    def _hand_over(self, new_id: DHTID, contact: Contact) -> None:
        """Send a newcomer the records it is now among the nearest for, when this node is the nearest
        holder it knows (hivemind DHTProtocol.update_routing_table; Kademlia section 2.5)."""
        records: List[SignedRecord] = []
        for key_id, _slot, rec in self._held_records(min_remaining_s=self.rpc_timeout_s):
            neighbors = self.routing_table.get_nearest_neighbors(key_id, self.num_replicas, exclude=self.node_id)
            if neighbors:
                if (
                    new_id.xor_distance(key_id) >= neighbors[-1][0].xor_distance(key_id)
                    and len(neighbors) >= self.num_replicas
                ):
                    continue
                if self.node_id.xor_distance(key_id) >= neighbors[0][0].xor_distance(key_id):
                    continue
            records.append(rec)
        if records:
            self.tasks.spawn(self._send_records(contact, records), name="dht-hand-over")

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

    async def ping(self, address: str, *, expected: Optional[PeerID] = None) -> Contact:
        """Ping ``address``; on an answer, add the node to the routing table and return its Contact.

        Raises RpcError when it does not answer or refuses, DHTJoinError on a DHT protocol mismatch.
        """
        req = dht_pb2.PingRequest(
            sender=self.self_info(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__
        )
        t0 = self._clock()
        try:
            contact, resp = await self._call(address, DHT_PING, req, dht_pb2.PingResponse, expected)
        except RpcError as err:
            if expected is not None:
                self._on_failure(Contact(expected, address))
            raise err
        if resp.time > 0:  # NTP's offset estimate from one exchange: their time - the call's midpoint
            if len(self._offsets) > 64 * self.k:
                self._offsets.clear()
            self._offsets[contact.peer_id] = resp.time - (t0 + self._clock()) / 2
        if resp.dht_protocol != DHT_PROTOCOL_VERSION:
            raise DHTJoinError(
                f"{address} speaks DHT protocol {resp.dht_protocol}, this node {DHT_PROTOCOL_VERSION} "
                f"(software {resp.software_version or '?'} vs {__version__})"
            )
        self._on_contact(contact)
        return contact

    async def _find(
        self, contact: Contact, key_ids: Sequence[DHTID]
    ) -> Optional[Dict[DHTID, Tuple[List[VerifiedRecord], Dict[DHTID, Contact]]]]:
        """FIND at ``contact``; None when it fails. Invalid records and contacts in the reply are dropped."""
        if contact.peer_id in self.blacklist:
            return None
        req = dht_pb2.FindRequest(sender=self.self_info(), keys=[k.to_bytes() for k in key_ids])
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

    # ------------------------------------------------------------------ lookups
    def _initial(self, key_ids: Iterable[DHTID], beam: int) -> Dict[DHTID, Contact]:
        """Per key, the ``beam`` nearest known nodes that are not blacklisted (looking further out
        when the nearest are); the blacklisted ones only when no other node is known."""
        nodes: Dict[DHTID, Contact] = {}
        fallback: Dict[DHTID, Contact] = {}
        for key_id in key_ids:
            want = beam
            while True:
                got = self.routing_table.get_nearest_neighbors(key_id, want, exclude=self.node_id)
                usable = [(nid, c) for nid, c in got if c.peer_id not in self.blacklist]
                if len(usable) >= beam or len(got) < want:
                    break
                want *= 2
            nodes.update(usable[:beam])
            fallback.update(got[:beam])
        return nodes or fallback

    async def _traverse(
        self,
        key_ids: Sequence[DHTID],
        *,
        beam: int,
        on_records: Optional[Callable[[DHTID, List[VerifiedRecord], int], bool]] = None,
        stats: Optional[LookupStats] = None,
        await_all: bool = True,
    ) -> Tuple[Dict[DHTID, List[DHTID]], Dict[DHTID, Contact]]:
        """Iterative Kademlia lookup of ``key_ids`` with hivemind's traverse_dht (alpha workers), in a
        TaskScope: no task of it is left pending when it returns or is cancelled.

        ``on_records(key_id, records, hop) -> stop`` sees every verified record returned.
        Returns (nearest node ids per key, nearest-first, never self; contact of every node seen).
        """
        stats = stats if stats is not None else LookupStats()
        self.stats.lookups += 1
        t0 = time.perf_counter()
        failures = stats.failures
        stopped: set = set()
        nearest, contacts = await self._traverse_once(key_ids, beam, on_records, stats, await_all, stopped)
        if stats.failures > failures and len(stopped) < len(key_ids):
            # hivemind's traverse_dht keeps a silent node in the beam, so nodes behind it may have been
            # skipped; silent nodes are now out of the routing table and blacklisted: look again.
            again = [q for q in key_ids if q not in stopped]
            nearest2, contacts2 = await self._traverse_once(again, beam, on_records, stats, await_all, stopped)
            nearest.update(nearest2)
            contacts.update(contacts2)
        stats.seconds += time.perf_counter() - t0
        return nearest, contacts

    async def _traverse_once(self, key_ids, beam, on_records, stats, await_all, stopped: set):
        contacts = self._initial(key_ids, beam)
        depth: Dict[DHTID, int] = {nid: 1 for nid in contacts}
        failed: set = set()

        async def get_neighbors(peer: DHTID, queries: Collection[DHTID]) -> Dict[DHTID, Tuple[Tuple[DHTID, ...], bool]]:
            queries = list(queries)
            hop = depth.get(peer, 1)
            stats.rpcs += 1
            stats.hops = max(stats.hops, hop)
            try:
                response = await self._find(contacts[peer], queries)
            except Exception as e:  # never let a worker die: it would end the whole lookup (an assert)
                log.exception("find failed unexpectedly: %r", e)
                response = None
            if response is None:
                stats.failures += 1
                failed.add(peer)
                return {q: ((), False) for q in queries}
            output = {}
            for q, (records, nearest) in response.items():
                for nid, c in nearest.items():
                    contacts.setdefault(nid, c)
                    depth.setdefault(nid, hop + 1)
                stop = on_records(q, records, hop) if (on_records is not None and records) else False
                if stop:
                    stopped.add(q)
                output[q] = tuple(nearest.keys()), stop
            return output

        # hivemind's traverse_dht leaves its workers and their waiters pending when it returns or is
        # cancelled ("Task was destroyed but it is pending!"): the scope cancels and awaits them, and hands
        # the find calls still in flight after an early end (await_all=False) to this node.
        async with TaskScope(adopt=self._adopt_calls, keep=runs(get_neighbors)):
            nearest, _visited = await traverse_dht(
                queries=list(key_ids),
                initial_nodes=list(contacts),
                beam_size=beam,
                num_workers=self.alpha,
                queries_per_call=max(1, min(int(len(key_ids) ** 0.5), 16)),
                get_neighbors=get_neighbors,
                visited_nodes={q: {self.node_id} for q in key_ids},
                await_all_tasks=await_all,
            )
        return {q: [n for n in ids if n not in failed] for q, ids in nearest.items()}, contacts

    def _adopt_calls(self, calls: set) -> None:
        """Own the find calls a lookup left in flight when it ended early (``get`` returns at the first
        record): they finish in the background (bounded by their RPC deadline) and are cancelled and
        awaited at :meth:`shutdown`, never left pending ("Task was destroyed but it is pending!")."""
        self.tasks.spawn(finish_or_cancel(calls), name="dht-lookup-tail")

    async def find_nearest_nodes(
        self, key_ids: Sequence[DHTID], k: Optional[int] = None, stats: Optional[LookupStats] = None
    ) -> Dict[DHTID, List[Tuple[DHTID, Contact]]]:
        """The ``k`` (default self.k) nearest live nodes to each id, nearest first, never this node."""
        k = k or self.k
        nearest, contacts = await self._traverse(list(key_ids), beam=max(k, self.k), stats=stats)
        return {q: [(nid, contacts[nid]) for nid in ids[:k]] for q, ids in nearest.items()}

    # ------------------------------------------------------------------ join
    async def join(self, bootstrap: Iterable[str] = (), *, attempts: Optional[int] = None) -> int:
        """Join the swarm through ``bootstrap`` addresses (``host:port``; several allowed; none = start a
        new swarm), then look up this node's own id to fill the routing table and make it known.

        Pings all bootstraps at once, ``attempts`` times (default ``join_attempts``) with backoff
        doubling from ``join_backoff_s``. Starts the refresh and republish tasks. Returns the number of
        nodes in the routing table. Raises DHTJoinError naming each bootstrap and why it failed.
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
        refused: Dict[str, RpcError] = {}  # bootstraps that answered with a refusal (not silence)
        ok: List[Contact] = []
        t0 = time.monotonic()
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
                    definitive &= r.code not in _UNREACHABLE
                    if r.code not in _UNREACHABLE:
                        refused[a] = r
                else:
                    errors[a] = str(r)
            if definitive or attempt == attempts - 1:
                break
            wait = delay * random.uniform(0.8, 1.2)
            events.emit(
                log,
                logging.INFO,
                "dht_join_retry",
                "no bootstrap answered yet (%s); retrying in %.1f s (attempt %d of %d)",
                "; ".join(f"{a}: {e}" for a, e in errors.items()),
                wait,
                attempt + 1,
                attempts,
                peer=self.peer_id.to_string(),
                attempt=attempt + 1,
                attempts=attempts,
                wait_s=wait,
            )
            await asyncio.sleep(wait)
            delay = min(delay * 2, 8.0)
        if not ok:
            detail = "; ".join(f"{a}: {e}" for a, e in errors.items())
            other_run = [
                a
                for a, r in refused.items()
                if r.code == grpc.StatusCode.FAILED_PRECONDITION and "this node serves" in r.reason
            ]
            if other_run:  # it answered: a wrong --run-id is not "no answer" (issue 14 #10)
                raise OtherRunError(
                    _other_run_message(
                        other_run[0], refused[other_run[0]].reason, getattr(self.transport, "run_id", "?")
                    )
                )
            if refused and len(refused) == len(errors):
                raise DHTJoinError(f"could not join the DHT: every bootstrap node refused this node: {detail}")
            tls = getattr(getattr(self.transport, "config", None), "tls", None) is not None
            raise DHTJoinError(
                f"could not join the DHT: no bootstrap node answered "
                f"({attempt + 1} attempt(s) over {time.monotonic() - t0:.1f}s): {detail}"
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
        self._measure_clock(answered, refuse=False)
        return len(answered)

    def _measure_clock(self, bootstraps: Sequence[Contact], *, refuse: bool) -> None:
        """Set :attr:`clock_offset_s` to the median offset measured against ``bootstraps`` (kept when it
        moved less than 0.5 s: the estimate jitters by the calls' asymmetry). ``refuse``: raise
        :class:`ClockSkewError` when it is over ``max_clock_skew_s``, else log it once."""
        samples = sorted(self._offsets[c.peer_id] for c in bootstraps if c.peer_id in self._offsets)
        if not samples:
            return
        offset = samples[len(samples) // 2]
        if abs(offset) > self.max_clock_skew_s:
            who = next(c.address for c in bootstraps if self._offsets.get(c.peer_id) == offset)
            msg = (
                f"this machine's clock is {abs(offset):.0f} s {'behind' if offset > 0 else 'ahead of'} the clock "
                f"of bootstrap {who}; the swarm tolerates {self.max_clock_skew_s:.0f} s: set the clock of the "
                f"wrong one (enable NTP, e.g. timedatectl set-ntp true)"
            )
            if refuse:
                raise ClockSkewError(msg)
            self._once(logging.WARNING, "clock", msg)
            return
        if abs(offset - self.clock_offset_s) >= 0.5 or refuse:
            if abs(offset) >= 1.0:
                log.info("clock offset to the bootstrap(s): %+.1f s; records are judged in swarm time", offset)
            self.clock_offset_s = offset

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

    # ------------------------------------------------------------------ local storage
    def _held_records(
        self, min_remaining_s: float = 0.0
    ) -> List[Tuple[DHTID, Tuple[DHTID, Optional[str]], SignedRecord]]:
        """Every record this node holds that expires later than now + ``min_remaining_s``."""
        horizon = time.time() + min_remaining_s
        out = []
        for key_id, item in list(self.storage.items()):
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, sub in list(item.value.items()):
                    if sub.expiration_time > horizon:
                        out.append((key_id, (key_id, subkey), SignedRecord.FromString(sub.value)))
            elif item.expiration_time > horizon:
                out.append((key_id, (key_id, None), SignedRecord.FromString(item.value)))
        return out

    def _local_records(self, key_id: DHTID) -> List[SignedRecord]:
        item = self.storage.get(key_id)
        if item is None:
            return []
        if isinstance(item.value, DictionaryDHTValue):
            return [SignedRecord.FromString(sub.value) for _, sub in list(item.value.items())]
        return [SignedRecord.FromString(item.value)]

    def _store_local(self, rec: SignedRecord, *, from_peer: Optional[PeerID]) -> dht_pb2.StoreOutcome:
        """Validate ``rec`` and keep it if it is newer than what this node holds for its slot.

        Never raises: the outcome carries the status code and reason. Note: compares expirations
        before calling DHTLocalStorage, whose TimedStorage.store (hivemind 1.1.12) re-arms the
        eviction of a held newer value at the older expiration when it rejects an older one.
        """
        now = self.now()
        try:
            vr = verify_record(rec, run_id=self.run_id, now=now, limits=self.limits)
            if vr.owner is None and vr.expiration_time > now + self.limits.max_unsigned_ttl_s:
                # an unsigned value is stored for a short while only (nobody is accountable for it)
                rec = SignedRecord()
                rec.CopyFrom(vr.record)
                rec.expiration_time = now + self.limits.max_unsigned_ttl_s
                vr = dataclasses.replace(vr, expiration_time=rec.expiration_time, record=rec)
            held = self.storage.get(vr.key_id)
            cur_bytes: Optional[bytes] = None
            cur_exp = float("-inf")
            if vr.subkey is None:
                if held is not None and isinstance(held.value, DictionaryDHTValue):
                    if len(held.value) > 0:
                        raise RecordError(
                            grpc.StatusCode.FAILED_PRECONDITION, "key holds values under subkeys; store with a subkey"
                        )
                elif held is not None:
                    cur_bytes = held.value
            elif held is not None:
                if isinstance(held.value, DictionaryDHTValue):
                    sub = held.value.get(vr.subkey)
                    if sub is not None:
                        cur_bytes = sub.value
                    elif len(held.value) >= self.limits.max_subkeys_per_key:
                        raise RecordError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"key already holds {self.limits.max_subkeys_per_key} subkeys",
                        )
                else:  # a plain value would be replaced by a dictionary
                    cur_bytes = held.value
            if cur_bytes is not None:
                cur = SignedRecord.FromString(cur_bytes)
                cur_exp = cur.expiration_time  # swarm time (the storage holds it shifted to local time)
                if cur.owner_public_key and cur.owner_public_key != vr.record.owner_public_key:
                    holder = PeerID.from_public_key(cur.owner_public_key).short()
                    raise RecordError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"slot is held by a record signed by {holder} for {cur_exp - now:.0f}s more",
                    )
                if cur_exp >= vr.expiration_time:
                    if from_peer is not None and cur_exp == vr.expiration_time and self.republish_period_s:
                        self._fresh[(vr.key_id, vr.subkey)] = now
                    if cur_bytes == rec.SerializeToString():
                        # A republish of exactly the record held here: it is stored, nothing to say.
                        return dht_pb2.StoreOutcome(stored=True, code=0, reason="")
                    return dht_pb2.StoreOutcome(
                        stored=False,
                        code=0,
                        reason=f"a value expiring {cur_exp - vr.expiration_time:+.1f}s later is held",
                    )
            data = rec.SerializeToString()
            slot = (vr.key_id, vr.subkey)
            self.ledger.charge(slot, vr.owner, len(data), vr.expiration_time, now)
            stored = self.storage.store(vr.key_id, data, self._to_storage(vr.expiration_time), subkey=vr.subkey)
            if not stored:
                self.ledger.forget(slot)
            elif vr.subkey is not None:
                self.ledger.forget((vr.key_id, None))  # a plain value it replaced, if any
        except RecordError as err:
            self.stats.records_refused += 1
            return dht_pb2.StoreOutcome(stored=False, code=err.code.value[0], reason=err.reason)
        if stored:
            self.stats.stores_accepted += 1
            if from_peer is not None and self.republish_period_s:
                self._fresh[(vr.key_id, vr.subkey)] = now
        return dht_pb2.StoreOutcome(stored=bool(stored), code=0, reason="" if stored else "not stored")

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
        signed by its PeerID (at most one dial-back per caller at a time; the address must be the one
        its NodeInfo claims, so this node dials no third party's address on request)."""
        self._alive_check()
        req = _parse(dht_pb2.PingRequest, verified.payload, "PingRequest")
        info = req.sender
        if info.peer_id and info.peer_id != bytes(verified.sender):
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "sender NodeInfo names another PeerID than the signer")
        if not _valid_address(info.address):
            raise RecordError(
                grpc.StatusCode.INVALID_ARGUMENT, f"no address to dial back ({info.address[:60]!r} is not host:port)"
            )
        if verified.sender in self._dialing_back:
            raise RecordError(grpc.StatusCode.RESOURCE_EXHAUSTED, "a dial-back of this peer is under way")
        self._dialing_back.add(verified.sender)
        ping = dht_pb2.PingRequest(
            sender=self.self_info(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__
        )
        try:
            try:
                answered, resp = await self._call(info.address, DHT_PING, ping, dht_pb2.PingResponse, verified.sender)
            except RpcError as err:
                # A channel cached from an earlier process at that address (the caller restarted on the
                # same port) fails at once with its old "connection refused" while in reconnect backoff.
                # Transport.call already redials a lost connection once; this covers an UNAVAILABLE whose
                # wording it does not recognise. Only UNAVAILABLE (fast): a deadline is not retried.
                if err.code != grpc.StatusCode.UNAVAILABLE or not self.transport.drop_channel(
                    info.address, lane=CONTROL_LANE
                ):
                    raise
                answered, resp = await self._call(info.address, DHT_PING, ping, dht_pb2.PingResponse, verified.sender)
        except RpcError as err:
            return dht_pb2.StoreOutcome(
                stored=False, code=err.code.value[0], reason=f"{err.code.name}: {err.reason or 'no answer'}"[:300]
            ).SerializeToString()
        finally:
            self._dialing_back.discard(verified.sender)
        if resp.dht_protocol == DHT_PROTOCOL_VERSION:
            self._on_contact(answered)  # it answered at its address: it is a contact now
        return dht_pb2.StoreOutcome(stored=True, code=0, reason="").SerializeToString()

    async def check_reachable(self, bootstraps: Sequence[str]) -> Reachability:
        """Ask each of ``bootstraps`` (at once) to dial this node back at its advertised address.

        Reachable when any of them reached it; unreachable when every one that supports the check
        failed to; None (unknown) when none supports it (older software) or none answered. Never raises.
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
            except (RpcError, DecodeError) as e:
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
        exclude = node_id_of(verified.sender)
        resp = dht_pb2.FindResponse()
        budget = self.transport.config.max_message_bytes // 2  # room for the nearest lists and the envelope
        for raw in req.keys:
            key_id = DHTID.from_bytes(raw)
            result = resp.results.add(key=raw)
            for rec in self._local_records(key_id):
                budget -= rec.ByteSize() + 8
                if budget < 0:
                    self._once(logging.WARNING, "find", "reply truncated at the message size limit")
                    break
                result.records.append(rec)
            for nid, c in self.routing_table.get_nearest_neighbors(key_id, self.k, exclude=exclude):
                result.nearest.add(node_id=nid.to_bytes(), address=c.address, peer_id=bytes(c.peer_id))
        return resp.SerializeToString()

    # ------------------------------------------------------------------ public API: store / get
    def _check_own(self, rec: SignedRecord) -> VerifiedRecord:
        return verify_record(rec, run_id=self.run_id, now=self.now(), limits=self.limits)

    async def store(
        self,
        key: str,
        value: bytes,
        expiration_time: float,
        subkey: Optional[str] = None,
        owner: Optional[Identity] = None,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) on the k nearest nodes until ``expiration_time``
        (unix seconds). Signed by ``owner`` when given; an owner-named key or subkey requires it.

        Returns True when at least one node (this one included, when it serves) accepted it; False when
        none did (unreachable, or each holds a newer value or refused it: reasons are logged).
        Raises RecordError at once when the record breaks a rule (size, lifetime, owner, unsigned under
        a run key). Nodes keep an unsigned value at most ``limits.max_unsigned_ttl_s``; its publisher
        re-stores it every ``republish_period_s``.
        This node republishes the record until it expires (see ``republish_period_s``).
        """
        rec = make_record(key, value, expiration_time, subkey=subkey, owner=owner, run_id=self.run_id)
        vr = self._check_own(rec)
        self._published[(vr.key_id, vr.subkey)] = rec
        ok = await self._replicate({vr.key_id: [rec]})
        return ok[vr.key_id][0]

    async def store_record(self, rec: SignedRecord) -> bool:
        """Store a record built elsewhere (e.g. by :func:`~geomesh_p2p.dht.records.make_record`); see :meth:`store`."""
        vr = self._check_own(rec)
        self._published[(vr.key_id, vr.subkey)] = rec
        ok = await self._replicate({vr.key_id: [rec]})
        return ok[vr.key_id][0]

    async def _replicate(
        self, by_key: Dict[DHTID, List[SignedRecord]], *, from_peer_self: bool = True
    ) -> Dict[DHTID, List[bool]]:
        """Store each key's records on its ``num_replicas`` nearest nodes (this one included when it
        serves); an unreachable target is replaced by the next nearest. Returns, per key, per record:
        accepted by at least one node."""
        key_ids = list(by_key)
        nearest, contacts = await self._traverse(key_ids, beam=max(self.k, self.num_replicas))
        result: Dict[DHTID, List[bool]] = {q: [False] * len(by_key[q]) for q in key_ids}

        async def store_key(q: DHTID) -> None:
            records = by_key[q]
            candidates: List[Optional[DHTID]] = list(nearest.get(q, []))
            if self.serving:
                candidates.append(None)  # None = this node
            candidates.sort(key=lambda nid: q.xor_distance(self.node_id if nid is None else nid))
            reasons: List[str] = []
            done = 0
            while candidates and done < self.num_replicas:
                batch = candidates[: self.num_replicas - done]
                candidates = candidates[len(batch) :]
                outs = await asyncio.gather(*(self._store_at(nid, contacts, records) for nid in batch))
                for out in outs:
                    if out is None:
                        continue
                    done += 1
                    for i, o in enumerate(out):
                        if o.stored:
                            result[q][i] = True
                        elif o.reason:
                            reasons.append(o.reason)
            if not all(result[q]) and reasons:
                self._once(logging.INFO, f"store {records[0].key!r}", f"not accepted: {reasons[0]}")

        await asyncio.gather(*(store_key(q) for q in key_ids))
        return result

    async def _store_at(self, nid: Optional[DHTID], contacts: Dict[DHTID, Contact], records: List[SignedRecord]):
        if nid is None:
            return [self._store_local(r, from_peer=None) for r in records]
        return await self._send_records(contacts[nid], records)

    async def get(
        self, key: str, latest: bool = True, *, stats: Optional[LookupStats] = None
    ) -> Dict[Optional[str], DHTValue]:
        """Find ``key``: ``{subkey or None: DHTValue(value, expiration_time, owner)}``, ``{}`` if absent.

        ``latest=True`` asks all k nearest nodes and keeps, per subkey, the signed record with the
        latest expiration (an unsigned one only when no signed one exists); ``latest=False`` stops at
        the first node that has any value (faster; a dictionary may then be partial). Every record is
        verified (signature, owner rule, expiry, size, key) before it is returned.
        """
        key_id = key_id_of(key)
        stats = stats if stats is not None else LookupStats()
        merge = _Merge()
        now = self.now()
        for rec in self._local_records(key_id):
            try:
                merge.add(verify_record(rec, run_id=self.run_id, now=now, limits=self.limits, expected_key_id=key_id))
                stats.found_hop = 0
            except RecordError:
                pass
        if merge.best and not latest:
            return merge.result(now)

        def on_records(q: DHTID, records: List[VerifiedRecord], hop: int) -> bool:
            for vr in records:
                merge.add(vr)
            if stats.found_hop is None:
                stats.found_hop = hop
            return not latest

        await self._traverse([key_id], beam=self.k, on_records=on_records, stats=stats, await_all=False)
        return merge.result(self.now())

    # ------------------------------------------------------------------ republish
    async def republish_once(self) -> int:
        """Re-store held and self-published records on their current nearest nodes (see class doc).
        Returns the number of records sent."""
        now = self.now()
        margin = 2 * self.rpc_timeout_s
        for slot, rec in list(self._published.items()):
            if rec.expiration_time <= now + margin:
                del self._published[slot]
        for slot, t in list(self._fresh.items()):
            if t < now - 2 * self.republish_period_s:
                del self._fresh[slot]
        by_key: Dict[DHTID, Dict[Optional[str], SignedRecord]] = {}
        for key_id, slot, rec in self._held_records(min_remaining_s=margin):
            if self._fresh.get(slot, 0.0) > now - self.republish_period_s * 0.9:
                continue
            by_key.setdefault(key_id, {})[slot[1]] = rec
        for (key_id, subkey), rec in self._published.items():
            by_key.setdefault(key_id, {})[subkey] = rec  # own records always, newest version
        if not by_key:
            return 0
        payload = {q: list(recs.values()) for q, recs in by_key.items()}
        n = sum(len(v) for v in payload.values())
        keys = list(payload)
        for i in range(0, len(keys), self.limits.max_keys_per_find):
            part = {q: payload[q] for q in keys[i : i + self.limits.max_keys_per_find]}
            await self._replicate(part)
        for q, recs in payload.items():
            for rec in recs:
                self._fresh[(q, rec.subkey if rec.HasField("subkey") else None)] = self.now()
        self.stats.republished += n
        return n

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        """Stop refresh/republish and every task of this node; answer DHT calls with UNAVAILABLE.
        Does not stop the transport (other services may share it)."""
        self._alive = False
        await self.tasks.close()


def _unusable(err: RpcError) -> bool:
    """True when a failed call means the node cannot serve us (not merely a refusal of our records)."""
    return err.code in _UNREACHABLE or isinstance(err, _WrongPeer) or err.reason.startswith("reply refused")


def _code(value: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN
