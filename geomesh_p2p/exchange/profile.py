"""The exchange's CPU cost on this machine: :func:`measure_codec`, seconds per element pass of a
relay round's real code (encode and sign, check, build, read), which the planner's exchange window
uses (:func:`geomesh_p2p.plan.planner.exchange_cpu_s`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from geomesh_p2p.exchange import messages
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner, _pid_bytes
from geomesh_p2p.net.identity import Identity, Verifier
from geomesh_p2p.net.swarm_time import swarm_time


def measure_codec(
    numel: int = 1 << 20,
    *,
    block_size: int = 2048,
    push_encoding: str = "sign",
    rule: str = "mean",
    weight_cap: Optional[float] = None,
    min_agreement: Optional[float] = None,
    min_support: Optional[float] = None,
    clip_k: Optional[float] = 4.0,
    contributors: int = 3,
    repeats: int = 1,
) -> float:
    """Seconds per element of one pass of the collective's CPU work on this machine (float, > 0).

    Runs the real code of a relay round on a part of ``numel`` elements with ``contributors``
    throwaway identities: each encodes and signs its contribution
    (:func:`geomesh_p2p.exchange.messages.contribution_bytes`), the owner checks them
    (``check_contribution``) and builds its result (``build_result``), a reader verifies and
    aggregates them under the run's ``rule`` (``read_result``: the robust rules decode and vote on
    every contribution, ~20x the cost of ``"mean"``). The best of ``repeats`` total times over the
    ``2 x contributors`` element passes made (encode each, read each). The planner multiplies it by
    the model's size and the passes of a round (:func:`geomesh_p2p.plan.planner.exchange_cpu_s`).
    Default size: ~0.1-0.5 s (robust rules) on one CPU thread.

    Raises ValueError for ``numel < 1``, ``contributors < 1`` or ``repeats < 1``.
    """
    if numel < 1 or repeats < 1 or contributors < 1:
        raise ValueError(f"numel={numel}, contributors={contributors} and repeats={repeats} must be >= 1")
    idents = [Identity.generate() for _ in range(contributors)]
    pids = [str(i.peer_id) for i in idents]
    now = swarm_time()  # the deadlines are judged in swarm time, as the envelopes are
    spec = CollectiveSpec(
        run_id="codec-probe",
        round=0,
        participants={p: 1 for p in pids},
        numel=numel,
        deadline=now + 600,
        pull_deadline=now + 600,
        owners=(PartOwner(peer_id=pids[0], address="127.0.0.1:1", start=0, end=numel),),
        mode="relay",
        push_encoding=push_encoding,
        block_size=block_size,
        rule=rule,
        weight_cap=weight_cap,
        min_agreement=min_agreement,
        min_support=min_support,
        clip_k=clip_k,
    )
    verifier = Verifier("codec-probe")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen)
    # Correlated contributions, as honest pseudo-gradients of one round are (the agreement filter keeps them).
    deltas = [(base + 0.5 * torch.randn(numel, generator=gen)) * 1e-3 for _ in range(contributors)]
    out = torch.empty(numel, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        checked = []
        for ident, pid, d in zip(idents, pids, deltas):
            signed = messages.contribution_bytes(ident, spec, 0, d, 1)
            checked.append(messages.check_contribution(verifier, spec, None, signed, pid)[1])
        checked.sort(key=lambda c: _pid_bytes(c.sender))
        res = messages.build_result(idents[0], spec, 0, spec.owners[0], "all pushed", checked)
        messages.read_result(verifier, spec, 0, res, out=out)
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-6) / (2 * contributors * numel)
