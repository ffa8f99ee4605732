"""What a round costs on the virtual clock: the real planner's plan for the reference workload,
the bytes of the method's exchange and the charged time (no torch, no training).

:class:`Charger` is the part of the simulator that decides *time*; :mod:`geomesh_p2p.sim.engine`
adds the *training*. Units: reference tokens, bytes, bytes/s, virtual seconds.

Planning (DESIGN.md "Round r", step 2; GeoMesh arXiv 2609.18388, AWB):

* ``diloco``, ``css``, ``async`` (and ``ddp`` with H = 1): :func:`geomesh_p2p.plan.uniform.plan_uniform`
  — the same micro-batch (``min(target_batch, min max_batch)``), batch and ``H = plan.inner_steps``
  for every peer; the window is set by the slowest peer.
* ``awb``, ``geomesh``: :func:`geomesh_p2p.plan.awb.plan_round` with the profile's window rule:
  ``comm_share`` (T = predicted comm / comm_share) or ``match_diloco`` (the smallest T at which the
  group trains DiLoCo's tokens per round).

The planner's communication estimate uses ``payload_bytes = max_i max(push_up_i, pull_down_i)``
(what a peer itself sends and fetches); the clock charges the full two-phase exchange
(:func:`geomesh_p2p.sim.link_time.charge_round`), owners' serving traffic included, so a planner
misprediction shows up as idle time, as it would in a real swarm. Parts are aligned to the codec
block (``part_align = block_size``); the reference model's parts have the same fractions as the
proxy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.plan.assign import partition
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import Method, PlanConfig, RoundPlan
from geomesh_p2p.plan.uniform import plan_uniform
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.sim.link_time import ExchangeBytes, Link, RoundTiming, charge_round, exchange_bytes
from geomesh_p2p.sim.hardware import Profile
from geomesh_p2p.sim.methods import MethodSpec

__all__ = ["Charger", "RoundCharge", "speed_factor"]


def speed_factor(seed: int, round: int, idx: int, sigma: float) -> float:
    """Deterministic lognormal speed factor (mean 1) of peer ``idx`` in ``round`` (1.0 if sigma=0)."""
    if sigma <= 0:
        return 1.0
    g = np.random.default_rng([int(seed), int(round), int(idx), 0x5EED])
    return float(math.exp(sigma * g.standard_normal() - 0.5 * sigma * sigma))


@dataclass(frozen=True)
class RoundCharge:
    """One round on the clock: inner steps each peer really does (a slowed peer stops at the window
    deadline), reference step seconds, the exchange's bytes and the timing."""

    steps: list[int]
    step_s: list[float]
    xb: ExchangeBytes
    timing: RoundTiming
    tokens_ref: int


class Charger:
    """Plans and charges rounds of a profile for a proxy vector of ``numel`` elements.

    Args:
        profile: the hardware profile.
        numel: elements of the proxy model's flat vector (parts are planned on it and their
            fractions applied to the reference model's ``params``).
    """

    def __init__(self, profile: Profile, numel: int):
        self.profile = profile
        self.ref = profile.reference
        self.numel = int(numel)
        self.block = profile.train.block_size
        self.peers = profile.sim_peers()
        self.n = len(self.peers)
        self.links = [Link(p.up_bps, p.down_bps, p.latency_s) for p in self.peers]
        self.fastest = max(range(self.n), key=lambda i: (self.peers[i].speed, -i))
        self.records0 = [p.record(self.ref) for p in self.peers]
        pair = [a.latency_s + b.latency_s for i, a in enumerate(self.peers) for b in self.peers[i + 1 :]]
        self.mean_pair_latency_s = float(np.mean(pair)) if pair else 0.0
        self._parts: dict[bool, list[tuple[str, int, int]]] = {}
        self.diloco_tokens_per_round = self.uniform_plan(None, "diloco").total_token_budget()

    # ------------------------------------------------------------------------------ bytes
    def parts(self, equal: bool) -> list[tuple[str, int, int]]:
        """The planner's partition of the proxy vector (equal: the uniform plans' equal split)."""
        if equal not in self._parts:
            self._parts[equal] = partition(self.numel, self.records0, align=self.block, equal=equal)
        return self._parts[equal]

    def ref_part_elems(self, parts: Sequence[tuple[str, int, int]]) -> list[int]:
        """Reference-model elements owned by each peer (the proxy parts' fractions of ``params``)."""
        P = self.ref.params
        elems = [int(round(P * (e - s) / self.numel)) for _, s, e in parts]
        owned = [i for i, x in enumerate(elems) if x > 0]
        if owned:
            elems[owned[-1]] += P - sum(elems)
        return elems

    def exchange(self, spec: Optional[MethodSpec], parts) -> ExchangeBytes:
        """Bytes of one exchange of ``spec`` (None: fp32 DiLoCo) over the reference model."""
        return exchange_bytes(
            self.ref_part_elems(parts),
            contribution=spec.contribution if spec else "fp32",
            aggregate=spec.aggregate if spec else "fp32",
            mode=spec.mode if spec is not None and spec.compressed else "reencode",
            block_size=self.block,
        )

    # ------------------------------------------------------------------------------ plans
    def plan_config(self, spec: Optional[MethodSpec], xb: ExchangeBytes, planner_method: Method, **kw) -> PlanConfig:
        payload = max(max(xb.push_up[i], xb.pull_down[i]) for i in range(self.n))
        pl = self.profile.plan
        return PlanConfig(
            seq_len=self.ref.seq_len,
            target_batch=pl.target_batch,
            payload_bytes=int(payload),
            latency_s=self.mean_pair_latency_s,
            comm_share=pl.comm_share,
            min_inner_steps=pl.min_inner_steps,
            max_inner_steps=pl.max_inner_steps,
            uniform_inner_steps=pl.inner_steps,
            window_slack=pl.window_slack,
            part_align=self.block,
            method=planner_method,
            mode=spec.mode if spec is not None and spec.compressed else "reencode",
            **kw,
        )

    def uniform_plan(
        self, spec: Optional[MethodSpec], planner_method: Method, records=None, inner_steps: Optional[int] = None
    ) -> RoundPlan:
        records = records or self.records0
        cfg = self.plan_config(spec, self.exchange(spec, self.parts(True)), planner_method)
        return plan_uniform(
            records,
            cfg,
            run_id="sim",
            round=0,
            leader=records[0].peer_id,
            numel=self.numel,
            start_time=0.0,
            inner_steps=inner_steps,
        )

    def balanced_plan(self, spec: MethodSpec, records=None) -> RoundPlan:
        records = records or self.records0
        rule = spec.window or self.profile.plan.window.get(spec.base, "comm_share")
        kw = {"target_tokens_per_round": self.diloco_tokens_per_round} if rule == "match_diloco" else {}
        cfg = self.plan_config(spec, self.exchange(spec, self.parts(False)), spec.planner_method, **kw)
        return plan_round(
            records, cfg, run_id="sim", round=0, leader=records[0].peer_id, numel=self.numel, start_time=0.0
        )

    def plan(self, spec: MethodSpec, records: Optional[list[PeerRecord]] = None) -> RoundPlan:
        """The plan of ``spec`` (ddp: uniform with H = 1; async: the uniform plan)."""
        if spec.balanced:
            return self.balanced_plan(spec, records)
        base = spec.planner_method
        rule = MethodRule.of(base, uniform_inner_steps=self.profile.plan.inner_steps)
        return self.uniform_plan(spec, base, records, inner_steps=rule.uniform_inner_steps)

    def records(self, factors: Sequence[float]) -> list[PeerRecord]:
        """Records announcing re-profiled speeds (``factors`` x the nominal throughput)."""
        return [p.record(self.ref, f) for p, f in zip(self.peers, factors)]

    # ------------------------------------------------------------------------------ time
    def step_s(self, plan: RoundPlan, factors: Optional[Sequence[float]] = None) -> list[float]:
        """Reference seconds per inner step of each peer: ``batch * seq_len / tokens_per_s(micro)``."""
        factors = factors or [1.0] * self.n
        return [
            a.batch_size * self.ref.seq_len / p.tokens_per_s(self.ref, a.micro_batch, f)
            for p, a, f in zip(self.peers, plan.assignments, factors)
        ]

    def charge(self, spec: MethodSpec, plan: RoundPlan, factors: Optional[Sequence[float]] = None) -> RoundCharge:
        """Charge one synchronous round of ``plan`` with the peers' actual speed ``factors``."""
        step_s = self.step_s(plan, factors)
        T = plan.window_s
        steps = []
        for s_i, a in zip(step_s, plan.assignments):
            h = a.inner_steps
            if h * s_i > T * (1 + 1e-9):  # the train deadline stops a slowed peer (whole steps only)
                h = min(h, int(math.floor(T / s_i + 1e-9)))
            steps.append(h)
        parts = [(a.peer_id, a.part_start, a.part_end) for a in plan.assignments]
        xb = self.exchange(spec, parts)
        elems = self.ref_part_elems(parts)
        timing = charge_round([h * s for h, s in zip(steps, step_s)], self.links, xb, [e > 0 for e in elems])
        tokens_ref = sum(h * a.batch_size * self.ref.seq_len for h, a in zip(steps, plan.assignments))
        return RoundCharge(steps=steps, step_s=step_s, xb=xb, timing=timing, tokens_ref=tokens_ref)
