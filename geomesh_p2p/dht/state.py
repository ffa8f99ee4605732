"""What every part of a DHT node shares: :class:`DHTNodeState` (the constructor: routing table, local
storage, counters, clock offset, background tasks; small helpers such as :meth:`~DHTNodeState.now`), the
value types (:class:`Contact`, :class:`DHTValue`, :class:`LookupStats`, :class:`DHTStats`,
:class:`Reachability`), the join errors and the DHT protocol constants.

The node is built in layers, each a module, each class deriving from the one below:
``state`` < :mod:`~geomesh_p2p.dht.storage` (local records) < :mod:`~geomesh_p2p.dht.contacts` (routing
table upkeep) < :mod:`~geomesh_p2p.dht.protocol` (RPC handlers and calls) < :mod:`~geomesh_p2p.dht.lookup`
(iterative search) < :mod:`~geomesh_p2p.dht.join` (join, clock, reachability, refresh) <
:mod:`~geomesh_p2p.dht.node` (:class:`~geomesh_p2p.dht.node.DHTNode`: store, get, republish, shutdown).

Units: seconds and unix seconds for time, bytes for sizes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import grpc
from hivemind.dht.node import Blacklist
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.dht.storage import DHTLocalStorage

from geomesh_p2p.net.addr import valid_address
from geomesh_p2p.net.swarm_time import StepWatch
from geomesh_p2p.net.swarm_time import steady_clock as steady_clock_default
from geomesh_p2p.dht.records import DEFAULT_LIMITS, RecordLimits, SignedRecord, node_id_of
from geomesh_p2p.dht.quota import DEFAULT_QUOTA, StorageLedger, StorageQuota
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.net.transport import RpcError, TaskOwner, Transport
from geomesh_p2p.wire import dht_pb2

# Defined where they import without hivemind (the CLI's pre-flight ping, before torch), re-exported here.
from geomesh_p2p.dht.preflight import _UNREACHABLE as _UNREACHABLE
from geomesh_p2p.dht.preflight import DHT_PROTOCOL_VERSION as DHT_PROTOCOL_VERSION
from geomesh_p2p.dht.preflight import ClockSkewError as ClockSkewError
from geomesh_p2p.dht.preflight import DHTJoinError as DHTJoinError
from geomesh_p2p.dht.preflight import IdentityInUseError as IdentityInUseError
from geomesh_p2p.dht.preflight import OtherRunError as OtherRunError
from geomesh_p2p.dht.preflight import REFUSED_WINDOW_S

#: ``(key, subkey, value, owner) -> reason or None``: a check of a signed record's content by the layers above
#: the DHT, run on every store this node accepts (``owner``: the signer's PeerID; bytes of the value).
#: ``(key, subkey, value, owner, pow_nonce) -> reason or None``: a layer above's content rule for a signed record
#: offered here (``pow_nonce``: the record's proof-of-work nonce, None when it carries none)
StoreCheck = Callable[[str, Optional[str], bytes, PeerID, Optional[int]], Optional[str]]

# The node was one module: its parts log under that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")

# "Dial me back" (as Petals' bootstraps do): request PingRequest naming the address to check; reply
# StoreOutcome with stored = reached, code = the gRPC status of the dial-back, reason = why not.
DHT_CHECK_REACHABLE = "/geomesh.wire.Dht/CheckReachable"
#: How a CheckReachable refusal to dial begins (PERMISSION_DENIED: the address's host is not the IP the call
#: comes from); the caller counts it as "not reachable" (it goes client-only: see DHTJoin.check_reachable).
NOT_CHECKED = "not checked"


#: A ``get(latest=True)`` ends once this many nodes have answered with records of the key (the local store
#: counts as one): every writer stores on the key's k (20) nearest nodes, so a few of them hold what all of
#: them do, and asking all 20 moved 20 x N records per read of a key held by N peers (issue 25). A node that
#: withholds or lags is outvoted per record by the latest expiration among the others.
DEFAULT_READ_QUORUM = 5

#: Nodes a peer record (a key :func:`is_peer_records_key`) is stored on (the DHT's k = 20 for every other key).
#: Every peer re-stores its record about once a round, and a read ends at a quorum of ``DEFAULT_READ_QUORUM``
#: holders, so 8 copies leave 3 spare for nodes that leave or lag between two refreshes; 20 made each
#: announcement 20 Store calls and each node near the key hold (and serve) every record (issue 25, session 16).
PEER_RECORD_REPLICAS = 8
#: A store of a peer record reuses the nodes the last lookup of its key found this many times in all (one lookup,
#: then stores on the same targets) before it looks the key up again; a target that fails ends the reuse at once
#: (:meth:`~geomesh_p2p.dht.node.DHTNode.store`). 1: every store looks the key up (the rule before session 16).
STORE_TARGET_REUSE = 4
#: A sampled read of a peer-records key (an explicit, small ``quorum``: a light follower's plan and digest checks)
#: asks the holders that answered the last lookup read of that key this many times in all before it looks the key
#: up again; a cached holder that fails or holds none of the records asked ends the reuse at once (the read then
#: looks the key up). A lookup at N = 1,024 costs ~6 hops before the key's holders; a reused read costs the quorum's
#: calls alone (issue 25, session 22: 8). 32 since session 26: a sampled read tolerates a stale record (it sends the
#: light follower to the full path), and a holder that left or lost the records ends the reuse at once, so only a
#: node that joined nearer to the key than the cached holders goes unasked for longer (its records are also on them:
#: stores reach 8 holders). 1: every read looks the key up (the rule before session 22).
READ_TARGET_REUSE = 32
#: A full read (the node's quorum, no subkeys) that opts in (``DHTNode.get(..., cached=True)``: a run with record
#: shards S > 1, whose full-view peers read S keys three times a round) asks the holders the last lookup of the key
#: found, at most this many times in all, then looks the key up again. Such a read decides from a record's absence
#: (a peer that left), so a record the previous read of the key found and that has not expired, missing from the
#: cached holders' answers, is looked up before it is taken as gone (issue 25, session 26).
FULL_READ_TARGET_REUSE = 8


def is_peer_records_key(key: str, run_id: str) -> bool:
    """True for the key of a run's peer records, ``<run>/peers`` (and ``<run>/peers/<shard>``): the keys whose
    records every peer re-stores every round, stored on fewer nodes (``PEER_RECORD_REPLICAS``) through cached
    store targets (``STORE_TARGET_REUSE``)."""
    base = f"{run_id}/peers"
    return key == base or key.startswith(base + "/")


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

    ``reachable``: True (a bootstrap reached it), False (every bootstrap asked failed to, or refused to
    dial an address whose host is not the IP it sees the node call from: the node then serves nobody and
    advertises no address, like a client-only node), None (not checked: client-only, no bootstrap, or no
    bootstrap supports the check). ``checked_by``: the bootstrap addresses that answered the check;
    ``reason``: one line, why not reached (a coarse class, or "not checked: ..." naming both IPs).
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


def _valid_address(address: str) -> bool:
    """``host:port`` with an IPv6 literal in brackets (geomesh_p2p.net.addr), at most 256 characters."""
    return valid_address(address)


class DHTNodeState:
    """The state every part of a :class:`~geomesh_p2p.dht.node.DHTNode` reads and writes (its routing
    table, local storage, counters, clock offset, background tasks), and the small helpers they share.
    Parameters: see :class:`~geomesh_p2p.dht.node.DHTNode`."""

    def __init__(
        self,
        transport: Transport,
        *,
        k: int = 20,
        alpha: int = 3,
        num_replicas: Optional[int] = None,
        peer_record_replicas: int = PEER_RECORD_REPLICAS,
        store_target_reuse: int = STORE_TARGET_REUSE,
        read_target_reuse: int = READ_TARGET_REUSE,
        full_read_reuse: int = FULL_READ_TARGET_REUSE,
        read_quorum: Optional[int] = DEFAULT_READ_QUORUM,
        depth_modulo: int = 5,
        rpc_timeout_s: float = 3.0,
        refresh_period_s: float = 60.0,
        republish_period_s: float = 60.0,
        limits: RecordLimits = DEFAULT_LIMITS,
        blacklist_s: float = 2.0,
        max_failures: int = 3,
        join_attempts: int = 5,
        join_backoff_s: float = 0.5,
        refused_window_s: float = REFUSED_WINDOW_S,
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
        steady_clock: Optional[Callable[[], float]] = None,
        store_check: Optional[StoreCheck] = None,
        pow_nonce: Optional[int] = None,
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
        if min(peer_record_replicas, store_target_reuse, read_target_reuse, full_read_reuse) < 1:
            raise ValueError(
                f"peer_record_replicas, store_target_reuse, read_target_reuse and full_read_reuse must be >= 1 "
                f"(got {peer_record_replicas}, {store_target_reuse}, {read_target_reuse}, {full_read_reuse})"
            )
        self.peer_record_replicas = peer_record_replicas
        self.store_target_reuse = store_target_reuse
        self.read_target_reuse = read_target_reuse
        self.full_read_reuse = full_read_reuse
        if read_quorum is not None and read_quorum < 1:
            raise ValueError(f"read_quorum must be >= 1 or None (got {read_quorum})")
        self.read_quorum = read_quorum
        self.rpc_timeout_s = rpc_timeout_s
        self.refresh_period_s = refresh_period_s
        self.republish_period_s = republish_period_s
        self.limits = limits
        #: content rules of the layers above for a signed record offered here (e.g. a run's peer records must be
        #: PeerRecords with the run's proof of work): a reason refuses the store (:meth:`DHTStorage._store_local`)
        self.store_check = store_check
        #: this node's identity's proof of work for the run, attached to the records it signs (0.10.0: a node with a
        #: ``store_check`` of :func:`geomesh_p2p.trust.admission.run_record_store_check` asks for it on run keys)
        self.pow_nonce = pow_nonce
        self.join_attempts, self.join_backoff_s = join_attempts, join_backoff_s
        self.refused_window_s = refused_window_s
        self.routing_table = RoutingTable(self.node_id, k, depth_modulo)
        self.storage = DHTLocalStorage(maxsize=storage_size)
        self.ledger = StorageLedger(quota)
        self.max_contacts_per_ip, self.max_contacts_per_subnet = max_contacts_per_ip, max_contacts_per_subnet
        self.limit_loopback = limit_loopback
        self.max_contact_checks = max_contact_checks
        self.check_reachability = check_reachability
        self.max_clock_skew_s = max_clock_skew_s
        self._clock = clock
        # Steps of this machine's clock since the offset was measured (issue 29 #3); an injected clock without
        # a steady partner is never seen to step (tests that skew it by a constant).
        if steady_clock is None and clock is time.time:
            steady_clock = steady_clock_default
        self._steps = StepWatch(clock, steady_clock)
        self._measured_offset_s = 0.0
        self._clock_jumps: List[float] = []  # unconfirmed offset changes, seconds (see DHTJoin._measure_clock)
        self._clock_anchor: Optional[float] = None  # swarm time minus the steady clock at join (DHTJoin)
        self._offsets: Dict[PeerID, float] = {}  # last measured offset per bootstrap that answered a ping
        # each bootstrap's last CLOCK_RTT_WINDOW ping round trips, seconds (DHTProtocol._clock_sample_ok), measured on
        # the steady clock (a step of the wall clock mid-ping is no round trip)
        self._rtts: Dict[PeerID, Deque[float]] = {}
        self._rtt_clock: Callable[[], float] = steady_clock if steady_clock is not None else clock
        # whether each bootstrap's last ping replaced its sample (a refused one neither votes nor is followed: it was
        # measured against the wall clock of its time, which a step since moved; red team 54b)
        self._sample_fresh: Dict[PeerID, bool] = {}
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

    # ------------------------------------------------------------------ small helpers
    def replicas_for(self, key: str) -> int:
        """Nodes a record under ``key`` is stored on: ``peer_record_replicas`` (at most ``num_replicas``) for the
        run's peer records (:func:`is_peer_records_key`), ``num_replicas`` (k) for every other key. Every node of
        a run applies the same rule when it stores, republishes or hands a record over."""
        if is_peer_records_key(key, self.run_id):
            return min(self.num_replicas, self.peer_record_replicas)
        return self.num_replicas

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

    @property
    def clock_offset_s(self) -> float:
        """Swarm time minus this machine's clock, seconds (0 until measured): the offset measured against the
        bootstraps, corrected by the steps of this machine's clock since (a step moves both: swarm time stays
        continuous, issue 29 #3). Setting it records a measurement."""
        return self._measured_offset_s - self._steps.moved()

    @clock_offset_s.setter
    def clock_offset_s(self, seconds: float) -> None:
        self._measured_offset_s = float(seconds)
        self._steps.mark()

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
