"""The gRPC methods every node serves or calls, by full name, and what the transport knows of each:
its connection lane (control or bulk), its default payload limit, its class for the concurrent-call
caps, whether a call may be retried after a lost connection. Also the message-size constants shared
by the server and the client side of :mod:`geomesh_p2p.net.transport`. Units: bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


# Full method names, as in geomesh_p2p/wire/envelope.proto.
DHT_PING = "/geomesh.wire.Dht/Ping"
DHT_STORE = "/geomesh.wire.Dht/Store"
DHT_FIND = "/geomesh.wire.Dht/Find"
STATE_GET = "/geomesh.wire.State/GetState"
STATE_STATUS = "/geomesh.wire.State/Status"
LINK_PROBE = "/geomesh.wire.Link/Probe"
STATE_UPDATE = "/geomesh.wire.State/GetUpdate"


@dataclass(frozen=True)
class CollectiveMethods:
    """The three methods of one collective service (one per level of the exchange: a node serves each level's
    parts under its own names, so that a round's group level and cross-group level keep their own per-round state
    -- :mod:`geomesh_p2p.exchange.groups`)."""

    push: str
    pull: str
    inputs: str

    @classmethod
    def named(cls, service: str) -> "CollectiveMethods":
        """The methods of gRPC service ``geomesh.wire.<service>``."""
        return cls(
            f"/geomesh.wire.{service}/PushPart",
            f"/geomesh.wire.{service}/PullPart",
            f"/geomesh.wire.{service}/PullInputs",
        )

    def all(self) -> tuple[str, str, str]:
        return (self.push, self.pull, self.inputs)


#: The one-level exchange (every round without groups) and the two levels of a grouped round (issue 26).
COLLECTIVE = CollectiveMethods.named("Collective")
COLLECTIVE_GROUP = CollectiveMethods.named("CollectiveGroup")
COLLECTIVE_CROSS = CollectiveMethods.named("CollectiveCross")
LEVELS = (COLLECTIVE, COLLECTIVE_GROUP, COLLECTIVE_CROSS)
COLLECTIVE_PUSH, COLLECTIVE_PULL, COLLECTIVE_INPUTS = COLLECTIVE.all()

#: Connection lanes. Calls that move bulk data (pseudo-gradient parts, the state, outer updates, link
#: probes) go over their own connection to a peer, the control calls (DHT, status) over another. Why: on a
#: slow uplink one connection's kernel send buffer holds seconds of queued part bytes, and a DHT store
#: queued behind them arrived after its record expired (a real-process DiLoCo run at 5-7 Mbit/s: peers
#: announced as dead, planned out every round). A second TCP connection shares the link fairly instead.
CONTROL_LANE, BULK_LANE = "control", "bulk"
BULK_METHODS = frozenset({*(m for lv in LEVELS for m in lv.all()), STATE_GET, STATE_UPDATE, LINK_PROBE})


def lane_of(method: str) -> str:
    """The connection lane of ``method``: :data:`BULK_LANE` for :data:`BULK_METHODS`, else :data:`CONTROL_LANE`."""
    return BULK_LANE if method in BULK_METHODS else CONTROL_LANE


DEFAULT_MAX_MESSAGE_BYTES = 128 << 20
RESPONSE_SUFFIX = "+resp"
# Bytes a SignedMessage adds to its payload: keys, signature, hashes, nonce, run id, kind, round,
# timestamp and protobuf tags (~250 bytes with a short run id); generous, so a payload at its
# method's limit always fits.
ENVELOPE_OVERHEAD = 4096

# Payload limits of methods registered without one (their requests are small, their replies are not).
DEFAULT_PAYLOAD_LIMITS: Dict[str, int] = {
    **{m: 4 << 10 for lv in LEVELS for m in (lv.pull, lv.inputs)},
    STATE_GET: 1 << 10,
    STATE_STATUS: 1 << 10,
}

# Method classes for the concurrent-call caps (class "other": any method not listed).
METHOD_CLASS: Dict[str, str] = {
    DHT_PING: "dht",
    DHT_STORE: "dht",
    DHT_FIND: "dht",
    **{m: "collective" for lv in LEVELS for m in lv.all()},
    STATE_GET: "state",
    STATE_STATUS: "state",
    LINK_PROBE: "probe",
}
# (calls in progress in total, calls in progress per verified sender), per class. Collective pulls are
# long polls (CollectiveService holds at most 256); a state download is one stream per donor piece.
DEFAULT_CALL_LIMITS: Dict[str, Tuple[int, int]] = {
    "dht": (512, 32),
    "collective": (1024, 128),
    "state": (32, 8),
    "probe": (16, 4),
    "other": (256, 32),
}


#: Payloads over this many bytes are hashed, signed or verified, and encoded, in a worker thread
#: (issue 13): SHA-256 of 1 MiB takes ~1 ms; of a 100 MiB part, ~0.1-0.5 s of a stalled loop.
BIG_PAYLOAD_BYTES = 1 << 20


# Methods whose call may be sent twice with no other effect than once (a read, a probe, or a store/push
# the server keeps once per sender): the transport redials and retries them once after a lost connection.
IDEMPOTENT_METHODS = frozenset(
    {DHT_PING, DHT_STORE, DHT_FIND, COLLECTIVE_PULL, COLLECTIVE_INPUTS, STATE_GET, STATE_STATUS, LINK_PROBE}
)
