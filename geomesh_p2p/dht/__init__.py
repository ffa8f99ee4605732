"""Kademlia DHT over gRPC with signed, owner-protected records (DESIGN.md, "DHT").

Main entry points:

* :class:`DHTNode` — join / store / get over a :class:`~geomesh_p2p.net.transport.Transport`
  (reuses hivemind's DHTID, RoutingTable, traverse_dht, DHTLocalStorage);
* :mod:`~geomesh_p2p.dht.records` — record signing and the owner rule;
* :mod:`~geomesh_p2p.dht.progress` — a bootstrap's saved state and the run's last known round
  (:func:`swarm_progress`), kept across its restarts;
* :class:`PeerAnnouncer`, :func:`announce_loop`, :func:`live_peers`, :func:`check_compatible`,
  :func:`record_ttl_s` — ``<run>/peers`` announcements.
"""

from geomesh_p2p.dht.announce import (
    IncompatibleSwarmError,
    PeerAnnouncer,
    announce_loop,
    check_compatible,
    live_peers,
    peers_key,
    record_ttl_s,
)
from geomesh_p2p.dht.node import DHTNode
from geomesh_p2p.dht.state import (
    DHT_CHECK_REACHABLE,
    DHT_PROTOCOL_VERSION,
    ClockSkewError,
    Contact,
    DHTJoinError,
    DHTStats,
    DHTValue,
    LookupStats,
    Reachability,
)
from geomesh_p2p.dht.progress import (
    BootstrapState,
    SwarmProgress,
    progress_key,
    publish_progress,
    swarm_progress,
)
from geomesh_p2p.dht.records import (
    RecordError,
    RecordLimits,
    VerifiedRecord,
    key_id_of,
    make_record,
    node_id_of,
    owned_key,
    required_owner,
    verify_record,
)

__all__ = [
    "DHT_CHECK_REACHABLE",
    "DHT_PROTOCOL_VERSION",
    "ClockSkewError",
    "Contact",
    "Reachability",
    "DHTJoinError",
    "DHTNode",
    "DHTStats",
    "DHTValue",
    "LookupStats",
    "IncompatibleSwarmError",
    "PeerAnnouncer",
    "announce_loop",
    "check_compatible",
    "live_peers",
    "peers_key",
    "record_ttl_s",
    "RecordError",
    "RecordLimits",
    "VerifiedRecord",
    "key_id_of",
    "make_record",
    "node_id_of",
    "owned_key",
    "required_owner",
    "verify_record",
    "BootstrapState",
    "SwarmProgress",
    "progress_key",
    "publish_progress",
    "swarm_progress",
]
