"""Helpers for the collective tests: an in-process swarm on 127.0.0.1 and an independent reference.

The reference (:func:`reference_part`) re-implements the aggregation rule documented in
``geomesh_p2p.exchange.token_weighted_mean`` with numpy, from the decoded packets, so the tests
check the collective against the written rule, not against itself.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange import CONTRIBUTION_KIND, CollectiveService, CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import Identity, PeerID
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.wire import collective_pb2

RUN = "collective-test"


def pid_order(pids) -> list[str]:
    """Peer ids sorted by raw PeerID bytes (the collective's fixed order)."""
    return sorted(pids, key=lambda p: bytes(PeerID.from_string(p)))


class Swarm:
    """``n_servers`` peers that accept connections (and own one equal part each) plus ``n_clients``
    client-only peers, each with its own Identity, Transport and CollectiveService."""

    def __init__(self, n_servers: int, n_clients: int = 0, service_cls=None, **service_kw):
        self.ids = [Identity.generate() for _ in range(n_servers + n_clients)]
        self.n_servers = n_servers
        classes = service_cls if isinstance(service_cls, (list, tuple)) else [service_cls] * len(self.ids)
        self.transports = [
            Transport(ident, RUN, TransportConfig(client_only=k >= n_servers, default_timeout_s=5.0))
            for k, ident in enumerate(self.ids)
        ]
        self.services = [(cls or CollectiveService)(t, **service_kw) for cls, t in zip(classes, self.transports)]
        self.addresses: list[Optional[str]] = []
        self._stopped: set[int] = set()

    @property
    def pids(self) -> list[str]:
        return [i.peer_id.to_string() for i in self.ids]

    async def start(self) -> "Swarm":
        self.addresses = [await t.start() for t in self.transports]
        return self

    def owners(self, numel: int, block_size: int = 2048, which: Optional[Sequence[int]] = None) -> list[PartOwner]:
        which = list(range(self.n_servers)) if which is None else list(which)
        units = -(-numel // block_size)
        out, start = [], 0
        for k, idx in enumerate(which):
            n = units // len(which) + (1 if k < units % len(which) else 0)
            end = min(numel, start + n * block_size)
            out.append(PartOwner(self.pids[idx], self.addresses[idx], start, end))
            start = end
        return out

    def spec(
        self,
        numel: int,
        *,
        mode: str = "reencode",
        round: int = 1,
        deadline_s: float = 1.5,
        pull_s: float = 1.0,
        caps: Optional[dict] = None,
        owners=None,
        block_size: int = 2048,
        **kw,
    ) -> CollectiveSpec:
        now = time.time()
        caps = caps or {p: 10**9 for p in self.pids}
        return CollectiveSpec(
            RUN,
            round,
            caps,
            owners or self.owners(numel, block_size),
            numel,
            now + deadline_s,
            now + deadline_s + pull_s,
            mode=mode,
            block_size=block_size,
            **kw,
        )

    async def stop_one(self, k: int) -> None:
        if k not in self._stopped:
            self._stopped.add(k)
            await self.services[k].close()
            await self.transports[k].stop(grace=0.1)

    async def stop(self) -> None:
        for k in range(len(self.ids)):
            await self.stop_one(k)


def deltas_for(pids: Sequence[str], numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p: torch.randn(numel, generator=g) * (0.5 + k) for k, p in enumerate(pids)}


def reference_part(
    spec: CollectiveSpec, j: int, deltas: dict[str, torch.Tensor], tokens: dict[str, int], contributors: Sequence[str]
) -> tuple[torch.Tensor, list[tuple[str, int]]]:
    """Aggregate of part ``j`` by the documented rule, with numpy, from each sender's decoded packet.

    Returns (fp32 tensor [part size], [(peer, tokens used)] in the fixed order).
    """
    o = spec.owners[j]
    B = spec.block_size
    order = pid_order(contributors)
    used = [(p, min(tokens[p], spec.participants[p])) for p in order]
    active = [(p, n) for p, n in used if n > 0]
    size = o.end - o.start
    if spec.push_encoding == "fp32":
        acc = np.zeros(size, np.float32)
        total = sum(n for _, n in active)
        for p, n in active:
            acc = acc + deltas[p][o.start : o.end].numpy() * np.float32(n / total)
        out = torch.from_numpy(acc)
    else:
        acc = np.zeros(size, np.float32)
        if active:
            packets = [compression.encode(deltas[p][o.start : o.end], B, n) for p, n in active]
            decoded = [compression.decode(pk).numpy() for pk in packets]
            scales = np.stack([pk.scales.numpy() for pk in packets])  # [C, blocks]
            if spec.clip_k is not None:
                med = np.median(scales, axis=0).astype(np.float32)
                cap = med * np.float32(spec.clip_k)
            total = sum(n for _, n in active)
            for (p, n), dec, s in zip(active, decoded, scales):
                unit = np.where(dec < 0, np.float32(-1), np.float32(1))  # the sign bits
                sc = s if spec.clip_k is None else np.minimum(s, cap)
                c = (sc * np.float32(n / total)).astype(np.float32)
                acc = acc + unit * np.repeat(c, B)[:size]
        out = torch.from_numpy(acc)
    if spec.mode == "reencode":
        if spec.aggregate_encoding == "fp32":
            pass
        else:
            out = compression.decode_any(
                compression.encode_as(spec.aggregate_encoding, out, B, sum(n for _, n in used))
            )
    return out, used


def reference(spec: CollectiveSpec, deltas, tokens, contributors: dict[int, Sequence[str]]) -> torch.Tensor:
    """Whole aggregate: parts not in ``contributors`` are zero (missing)."""
    agg = torch.zeros(spec.numel)
    for j, who in contributors.items():
        o = spec.owners[j]
        agg[o.start : o.end] = reference_part(spec, j, deltas, tokens, who)[0]
    return agg


def craft_contribution(
    identity: Identity,
    spec: CollectiveSpec,
    j: int,
    packet: bytes,
    tokens: int = 1,
    *,
    round: Optional[int] = None,
    start: Optional[int] = None,
    end: Optional[int] = None,
    spec_id: Optional[bytes] = None,
    encoding: str = "sign",
    part: Optional[int] = None,
) -> bytes:
    """A signed PartContribution (SignedMessage bytes) with any field overridden."""
    o = spec.owners[j]
    c = collective_pb2.PartContribution(
        round=spec.round if round is None else round,
        part=j if part is None else part,
        start=o.start if start is None else start,
        end=o.end if end is None else end,
        tokens=tokens,
        spec_id=spec.spec_id if spec_id is None else spec_id,
        encoding=encoding,
        packet=packet,
    )
    return identity.sign_message(
        run_id=spec.run_id,
        round=spec.round if round is None else round,
        kind=CONTRIBUTION_KIND,
        payload=c.SerializeToString(),
    ).SerializeToString()
