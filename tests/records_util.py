"""PeerRecords for tests: one factory with the small CPU-peer figures most tests use, and keyword overrides."""

from __future__ import annotations

from typing import Any

from geomesh_p2p import __version__
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.schema.peer import PeerRecord

#: What a record holds unless the test says otherwise: a CPU peer of 1 GiB, 1,000 tokens/s at batch 8,
#: 10 MB/s both ways (units as in :class:`PeerRecord`: bytes, tokens/s, bytes/s).
DEFAULTS: dict[str, Any] = dict(
    device="cpu",
    memory_bytes=1 << 30,
    tokens_per_s={8: 1000.0},
    max_batch=8,
    upload_bps=1e7,
    download_bps=1e7,
    version=__version__,
    run_config_hash="h",
)


def peer_record(peer: Identity | str, **fields: Any) -> PeerRecord:
    """A valid :class:`PeerRecord` of ``peer`` (an Identity, or a PeerID string taken as it is) with
    :data:`DEFAULTS`; ``fields`` override them or set any other field (``address`` stays None, client-only,
    unless given). Raises pydantic's ValidationError for a field the record refuses."""
    peer_id = str(peer.peer_id) if isinstance(peer, Identity) else peer
    # a fresh throughput dict each time: no record shares the module's default object
    return PeerRecord(**{**DEFAULTS, "tokens_per_s": dict(DEFAULTS["tokens_per_s"]), "peer_id": peer_id, **fields})
