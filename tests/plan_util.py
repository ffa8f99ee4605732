"""Synthetic round plans of any size for tests of the plan's wire form (no planner, no records: fast)."""

from __future__ import annotations

import random
import time

import base58

from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan


def big_plan(n: int, *, run_id: str = "run", round: int = 3, leader: str | None = None, seed: int = 0) -> RoundPlan:
    """A valid plan of ``n`` participants with realistic field values: random PeerIDs (base58 of 32
    bytes), IPv4 addresses (every 9th peer client-only), batch sizes, inner steps, float predictions,
    and parts tiling ``[0, numel)`` among the owners in peer_id order. ``leader`` defaults to the first
    participant (it need not be one). Deterministic for a seed, except ``created_at`` (now)."""
    rnd = random.Random(seed)
    ids = sorted({base58.b58encode(rnd.randbytes(32)).decode() for _ in range(n)})
    assert len(ids) == n
    seq_len, per_part = 256, 120_000
    owners = [i for i in range(n) if i % 9 != 4]
    numel = per_part * len(owners)
    rows, pos = [], 0
    for i, pid in enumerate(ids):
        owns = i % 9 != 4
        micro, accum, steps = rnd.choice((2, 4, 8)), rnd.choice((1, 1, 2)), rnd.randrange(5, 120)
        rows.append(
            PeerAssignment(
                peer_id=pid,
                address=f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(256)}:{rnd.randrange(1024, 65535)}"
                if owns
                else None,
                batch_size=micro * accum,
                micro_batch=micro,
                accum_steps=accum,
                inner_steps=steps,
                token_budget=micro * accum * seq_len * steps,
                part_start=pos,
                part_end=pos + per_part if owns else pos,
                predicted_compute_s=rnd.uniform(20, 60),
                predicted_comm_s=rnd.uniform(0.5, 20),
                predicted_idle_s=rnd.uniform(0, 2),
            )
        )
        pos += per_part if owns else 0
    now = time.time()
    return RoundPlan(
        run_id=run_id,
        round=round,
        leader=leader or ids[0],
        method="geomesh",
        mode="reencode",
        numel=numel,
        seq_len=seq_len,
        window_s=60.0,
        train_deadline=now + 61,
        exchange_deadline=now + 91,
        start_digest="d" * 64,
        created_at=now + 1,
        assignments=rows,
    )
