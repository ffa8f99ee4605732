"""Kademlia DHT over gRPC with signed, owner-protected records (DESIGN.md, "DHT").

Main entry points:

* :class:`DHTNode` — join / store / get over a :class:`~geomesh_p2p.net.transport.Transport`
  (reuses hivemind's DHTID, RoutingTable, traverse_dht, DHTLocalStorage);
* :mod:`~geomesh_p2p.dht.records` — record signing and the owner rule;
* :mod:`~geomesh_p2p.dht.progress` — a bootstrap's saved state and the run's last known round
  (:func:`swarm_progress`), kept across its restarts;
* :class:`PeerAnnouncer`, :func:`announce_loop`, :func:`live_peers`, :func:`check_compatible`,
  :func:`record_ttl_s` — ``<run>/peers`` announcements.

The names above load on first use (PEP 562): importing a light module of this package
(:mod:`~geomesh_p2p.dht.preflight`, :mod:`~geomesh_p2p.dht.progress`) imports neither hivemind nor torch, so the
CLIs check a bootstrap and their files before torch's import (seconds, not a minute, on a loaded machine).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for the type checker; at run time, __getattr__ imports them
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

#: Each exported name -> the module that defines it.
_EXPORTS = {
    "IncompatibleSwarmError": "geomesh_p2p.dht.announce",
    "PeerAnnouncer": "geomesh_p2p.dht.announce",
    "announce_loop": "geomesh_p2p.dht.announce",
    "check_compatible": "geomesh_p2p.dht.announce",
    "live_peers": "geomesh_p2p.dht.announce",
    "peers_key": "geomesh_p2p.dht.announce",
    "record_ttl_s": "geomesh_p2p.dht.announce",
    "DHTNode": "geomesh_p2p.dht.node",
    "DHT_CHECK_REACHABLE": "geomesh_p2p.dht.state",
    "DHT_PROTOCOL_VERSION": "geomesh_p2p.dht.state",
    "ClockSkewError": "geomesh_p2p.dht.state",
    "Contact": "geomesh_p2p.dht.state",
    "DHTJoinError": "geomesh_p2p.dht.state",
    "DHTStats": "geomesh_p2p.dht.state",
    "DHTValue": "geomesh_p2p.dht.state",
    "LookupStats": "geomesh_p2p.dht.state",
    "Reachability": "geomesh_p2p.dht.state",
    "BootstrapState": "geomesh_p2p.dht.progress",
    "SwarmProgress": "geomesh_p2p.dht.progress",
    "progress_key": "geomesh_p2p.dht.progress",
    "publish_progress": "geomesh_p2p.dht.progress",
    "swarm_progress": "geomesh_p2p.dht.progress",
    "RecordError": "geomesh_p2p.dht.records",
    "RecordLimits": "geomesh_p2p.dht.records",
    "VerifiedRecord": "geomesh_p2p.dht.records",
    "key_id_of": "geomesh_p2p.dht.records",
    "make_record": "geomesh_p2p.dht.records",
    "node_id_of": "geomesh_p2p.dht.records",
    "owned_key": "geomesh_p2p.dht.records",
    "required_owner": "geomesh_p2p.dht.records",
    "verify_record": "geomesh_p2p.dht.records",
}

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


def __getattr__(name: str) -> Any:
    """``geomesh_p2p.dht.NAME``: the exported name from its module (imported now; hivemind with most of them), or a
    submodule not imported yet (``geomesh_p2p.dht.node`` as an attribute, as when this package imported them all)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
