"""The simulator's virtual clock: bytes of an exchange and the time it is charged (pure functions).

Units: elements, bytes, bytes/s, virtual seconds. Nothing here trains, sleeps or reads a clock.

Bytes of one round (DESIGN.md "Round r", step 4; GeoMesh arXiv 2609.18388, CSS)
-------------------------------------------------------------------------------
The flat vector is split into contiguous parts, one per owner (peers that accept connections);
owner ``j`` holds ``e_j`` elements. With ``N`` participants:

* **push** (reduce-scatter): every participant ``i`` sends part ``j`` (encoded as the
  *contribution* kind: fp32 for DiLoCo/AWB, sign for CSS/GeoMesh) to every owner ``j != i``;
  owner ``j`` receives ``N - 1`` such parts.
* **pull** (all-gather): every participant fetches every part it does not own.
  ``reencode`` (and the fp32 baselines): owner ``j`` sends its mean, encoded as the *aggregate*
  kind (fp32, sign, int8, fp16), to each of the ``N - 1`` others. ``relay``: owner ``j`` sends each
  other peer the ``N - 1`` contributions that are not that peer's own (sign packets), so bytes grow
  with the group.

Encoded sizes are those of ``geomesh_p2p.exchange.codec`` (32-byte header per packet): sign
``32 + ceil(e/8) + 4 ceil(e/B)``, int8 ``32 + e + 4 ceil(e/B)``, fp16 ``32 + 2e``; fp32 ``4e``.
Signatures and protobuf framing (~100 bytes per message) are not charged.

Time of one synchronous round (a fluid model of the same two phases)
--------------------------------------------------------------------
Peer ``i`` ends its inner steps at ``done_i`` (seconds after the round started). A transfer
between ``i`` and ``j`` pays the one-way latency ``l_ij = lat_i + lat_j`` once per phase.
Transfers that share a link share its bandwidth, which is charged as "a peer cannot move its bytes
faster than its own link":

* ``push_end_i = done_i + max_j l_ij + push_up_i / up_i`` (``done_i`` if it pushes nothing);
* part ``j`` is ready (all contributions in) at
  ``ready_j = max(done_j, max_{i != j} push_end_i, min_{i != j} done_i + min_i l_ij + push_down_j / down_j)``;
* ``end_i = max(ready_i if i owns a part,  max_{j != i} (ready_j + l_ij + pull_up_j / up_j),
  min_{j != i} ready_j + min_j l_ij + pull_down_i / down_i)``: an owner serves all its pullers
  through its upload, a puller receives everything through its download;
* the round ends at ``R = max_i end_i`` (the next round starts from the common aggregate).

Idle accounting (the critical path, as the paper's breakdown of DiLoCo's round): the **straggler
idle** of peer ``i`` is ``max_j done_j - done_i`` (its GPU waits while others still compute); the
**network idle** of every peer is ``R - max_j done_j`` (every GPU waits on the network);
``compute_i = done_i``. So ``compute_i + straggler_i + network = R`` for every peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

# The one codec-size formula (pure Python, no torch): the codec's packets, the collective's part
# limits and the planner's payload estimate use it too. Re-exported here for the simulator's users.
from geomesh_p2p.config.method import CODEC_HEADER_BYTES as HEADER_BYTES
from geomesh_p2p.config.method import encoded_nbytes

__all__ = [
    "HEADER_BYTES",
    "encoded_nbytes",
    "ExchangeBytes",
    "exchange_bytes",
    "Link",
    "RoundTiming",
    "charge_round",
    "collective_end_times",
    "async_exchange_s",
]


@dataclass(frozen=True)
class ExchangeBytes:
    """Bytes each peer moves in one exchange, per phase (lists indexed like the peers)."""

    push_up: list[int]
    push_down: list[int]
    pull_up: list[int]
    pull_down: list[int]

    def sent(self, i: int) -> int:
        return self.push_up[i] + self.pull_up[i]

    def received(self, i: int) -> int:
        return self.push_down[i] + self.pull_down[i]

    @property
    def n(self) -> int:
        return len(self.push_up)


def exchange_bytes(
    part_elems: Sequence[int], *, contribution: str, aggregate: str, mode: str, block_size: int, validators: int = 1
) -> ExchangeBytes:
    """Bytes of one push/pull exchange among ``len(part_elems)`` participants.

    ``part_elems[i]``: elements owned by peer ``i`` (0: owns nothing, e.g. client-only).
    ``contribution``: encoding of the pushed parts ("fp32" or "sign"); ``aggregate``: encoding of
    the owner's mean in ``reencode`` / ``accountable`` mode (ignored by ``relay``, which forwards contributions).
    ``accountable``: as ``reencode`` plus ``validators`` validations per part, each pulling the part's
    contributions but the validator's own (``n - 1``: it holds its own push) from its owner; they are charged to the pull of the owner (up) and spread evenly
    over the other peers (down), as the validators are drawn uniformly (receipts and input lists ignored:
    under 1% of a part); and each owner's push of its own contribution to its part's witness (the next owner,
    :func:`geomesh_p2p.exchange.accountable.witness_of`), one contribution more in the push phase.
    """
    if mode not in ("relay", "reencode", "accountable"):
        raise ValueError(f"unknown mode {mode!r} (relay, reencode, accountable)")
    n = len(part_elems)
    # a peer that owns nothing (e == 0) is sent no message about it
    c = [encoded_nbytes(contribution, e, block_size) if e > 0 else 0 for e in part_elems]
    a = [encoded_nbytes(aggregate, e, block_size) if e > 0 else 0 for e in part_elems]
    total_c = sum(c)
    push_up = [total_c - c[i] for i in range(n)]
    push_down = [(n - 1) * c[j] for j in range(n)]
    if mode in ("reencode", "accountable"):
        total_a = sum(a)
        pull_up = [(n - 1) * a[j] for j in range(n)]
        pull_down = [total_a - a[i] for i in range(n)]
        if mode == "accountable" and n > 1:
            # each owner hands its own contribution to its part's witness (the next owner): one part more
            owning = [j for j in range(n) if c[j] > 0]
            for k, j in enumerate(owning):
                w = owning[(k + 1) % len(owning)]
                if w != j:
                    push_up[j] += c[j]
                    push_down[w] += c[j]
            v = min(max(0, int(validators)), n - 1)
            pull_up = [pull_up[j] + v * (n - 1) * c[j] for j in range(n)]
            # part j's v validations, n - 1 contributions each (not the validator's own), drawn among the n - 1 others
            pull_down = [pull_down[i] + sum(v * c[j] for j in range(n) if j != i) for i in range(n)]
    else:
        pull_up = [(n - 1) * (n - 1) * c[j] for j in range(n)]
        pull_down = [(n - 1) * (total_c - c[i]) for i in range(n)]
    return ExchangeBytes(push_up, push_down, pull_up, pull_down)


@dataclass(frozen=True)
class Link:
    """A peer's access link: bytes/s each way and one-way latency (seconds) to the WAN core."""

    up_bps: float
    down_bps: float
    latency_s: float = 0.0


def collective_end_times(
    done: Sequence[float], links: Sequence[Link], xb: ExchangeBytes, owners: Sequence[bool]
) -> list[float]:
    """Virtual seconds (from the round start) at which each peer holds the whole aggregate.

    ``done[i]``: end of peer i's inner steps; ``owners[i]``: peer i owns a non-empty part. See the
    module docstring for the model. A single participant finishes at ``done``.
    """
    n = len(done)
    if not (len(links) == len(owners) == xb.n == n):
        raise ValueError("done, links, owners and bytes must describe the same peers")
    if n == 1:
        return [float(done[0])]
    lat = [lk.latency_s for lk in links]
    own = [j for j in range(n) if owners[j]]

    def l(i: int, j: int) -> float:
        return lat[i] + lat[j]

    push_end = []
    for i in range(n):
        targets = [j for j in own if j != i]
        if xb.push_up[i] > 0 and targets:
            push_end.append(done[i] + max(l(i, j) for j in targets) + xb.push_up[i] / links[i].up_bps)
        else:
            push_end.append(float(done[i]))
    ready = [0.0] * n
    for j in own:
        others = [i for i in range(n) if i != j]
        r = max(float(done[j]), max(push_end[i] for i in others))
        if xb.push_down[j] > 0:
            r = max(
                r, min(done[i] for i in others) + min(l(i, j) for i in others) + xb.push_down[j] / links[j].down_bps
            )
        ready[j] = r
    end = []
    for i in range(n):
        src = [j for j in own if j != i]
        e = ready[i] if owners[i] else float(done[i])
        if src:
            e = max(e, max(ready[j] + l(i, j) + xb.pull_up[j] / links[j].up_bps for j in src))
            if xb.pull_down[i] > 0:
                e = max(e, min(ready[j] for j in src) + min(l(i, j) for j in src) + xb.pull_down[i] / links[i].down_bps)
        end.append(e)
    return end


@dataclass(frozen=True)
class RoundTiming:
    """Charged time of one synchronous round (virtual seconds; lists indexed like the peers)."""

    compute_s: list[float]
    straggler_s: list[float]
    network_s: float
    round_s: float
    end_s: list[float] = field(default_factory=list)

    def check(self, tol: float = 1e-9) -> None:
        """compute + straggler + network == round for every peer (raises AssertionError)."""
        for c, s in zip(self.compute_s, self.straggler_s):
            assert abs(c + s + self.network_s - self.round_s) <= tol * max(1.0, self.round_s)


def charge_round(
    compute_s: Sequence[float], links: Sequence[Link], xb: ExchangeBytes, owners: Sequence[bool]
) -> RoundTiming:
    """Charge one synchronous round: compute (given), then the exchange (``collective_end_times``),
    split into compute / straggler idle / network idle as in the module docstring."""
    end = collective_end_times(compute_s, links, xb, owners)
    last_done = max(compute_s)
    R = max(max(end), last_done)
    return RoundTiming(
        compute_s=[float(c) for c in compute_s],
        straggler_s=[last_done - c for c in compute_s],
        network_s=R - last_done,
        round_s=R,
        end_s=end,
    )


def async_exchange_s(link: Link, max_peer_latency_s: float, nbytes: int) -> tuple[float, float]:
    """(push seconds, pull seconds) of one asynchronous update of ``nbytes`` each way: the peer
    pushes its pseudo-gradient to the (sharded) global model through its upload, then pulls the
    current weights through its download; each pays one latency ``lat_i + max_j lat_j``.
    Contention at the owners is not charged (optimistic for the async baseline)."""
    lat = link.latency_s + max_peer_latency_s
    return lat + nbytes / link.up_bps, lat + nbytes / link.down_bps
