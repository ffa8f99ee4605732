"""Calls and bytes of one healthy round's exchange, per peer, from the real specs (issue 26's growth rows).

:func:`exchange_traffic` walks the messages the collective sends for a spec: the one-level exchange (every peer
pushes every part it does not own to its owner and pulls every result it does not own), or, when
:func:`geomesh_p2p.exchange.groups.group_layout` groups the round, the three stages of
:mod:`geomesh_p2p.exchange.groups` with the specs :func:`~geomesh_p2p.exchange.groups.level_specs` builds. Bytes are
the codec's encoded sizes (:func:`geomesh_p2p.config.method.encoded_nbytes`: packets with their headers; no
envelopes, retries or long polls that come back empty). Used by ``benchmarks/groups.py --sim`` to take the
exchange to 1,024 peers where processes cannot go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geomesh_p2p.config.method import encoded_nbytes
from geomesh_p2p.exchange.groups import group_layout, level_specs
from geomesh_p2p.exchange.partition import CollectiveSpec

__all__ = ["Traffic", "exchange_traffic"]


@dataclass
class Traffic:
    """Per peer (base58 PeerID): calls it made (``made``), calls it served (``served``), payload bytes it sent and
    received (``sent``, ``received``)."""

    made: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def call(self, caller: str, server: str, up: int, down: int) -> None:
        """One call from ``caller`` to ``server``: ``up`` bytes to the server, ``down`` bytes back."""
        for d, k, n in ((self.made, caller, 1), (self.served, server, 1)):
            d[k] = d.get(k, 0) + n
        self.sent[caller] = self.sent.get(caller, 0) + up
        self.received[server] = self.received.get(server, 0) + up
        self.sent[server] = self.sent.get(server, 0) + down
        self.received[caller] = self.received.get(caller, 0) + down


def _one_level(spec: CollectiveSpec, t: Traffic, readers: list[str], offset: int = 0) -> None:
    """Pushes of every participant to every owner but itself, pulls of every reader from every owner but itself."""
    for o in spec.owners:
        push = encoded_nbytes(spec.push_encoding, o.size, spec.block_size)
        agg = encoded_nbytes(spec.aggregate_encoding, o.size, spec.block_size)
        for p in spec.participants:
            if p != o.peer_id:
                t.call(p, o.peer_id, push, 0)
        for p in readers:
            if p != o.peer_id:
                t.call(p, o.peer_id, 0, agg)


def exchange_traffic(spec: CollectiveSpec, group_size: int, max_message_bytes: int = 128 << 20) -> Traffic:
    """The calls and bytes of ``spec``'s round with groups of ``group_size`` (0: one group), every peer healthy.

    Grouped: group pushes (each member to its group's slice owners), the cross level (each slice owner's push of its
    group aggregate to the slice's leader and its pull of the leader's result) and the all-gather (each peer pulls
    every slice it does not own from its group's owner of that slice). Raises ValueError for a spec whose parts do
    not fit ``max_message_bytes``."""
    t = Traffic()
    for p in spec.participants:
        for d in (t.made, t.served, t.sent, t.received):
            d[p] = 0
    layout = group_layout(spec, group_size)
    if layout is None:
        _one_level(spec, t, list(spec.participants))
        return t
    gspecs, xspecs = level_specs(spec, layout, spec.deadline - 1.0, max_message_bytes)
    for gs in gspecs:
        for o in gs.owners:
            push = encoded_nbytes(gs.push_encoding, o.size, gs.block_size)
            for p in gs.participants:
                if p != o.peer_id:
                    t.call(p, o.peer_id, push, 0)
    for c, xs in enumerate(xspecs):
        _one_level(xs, t, list(xs.participants))
        cross = layout.cross_set(c)
        for g, members in enumerate(layout.groups):
            for p in members:
                if p == cross[g]:
                    continue
                for o in xs.owners:
                    t.call(p, cross[g], 0, encoded_nbytes(xs.aggregate_encoding, o.size, xs.block_size))
    return t
