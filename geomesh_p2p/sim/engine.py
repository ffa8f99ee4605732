"""Virtual-time simulator: real training, planner, codec, collective arithmetic and outer optimizer
for every simulated peer; time charged from a hardware profile on a virtual clock.

What is *trained* and what is *charged* (DESIGN.md "Measuring"):

* **Trained** (real computation, deterministic for a seed): every peer's inner steps on the small
  proxy model (``profile.train.preset``, e.g. ``tiny``, 0.94M parameters) with its own
  :class:`~geomesh_p2p.model.training.InnerTrainer` (inner AdamW or Lion state kept across rounds, as in
  DiLoCo); pseudo-gradients encoded with :mod:`geomesh_p2p.exchange.codec` (sign packets, error
  feedback, int8/fp16 re-encoding); aggregated with
  :func:`geomesh_p2p.exchange.token_weighted_mean` (the collective's pure helper: the same bits as
  the gRPC collective, sorted-PeerID order, scale clipping); applied with
  :class:`~geomesh_p2p.model.optim.OuterNesterov`. Eval perplexity is measured on the held-out split.
* **Charged** (virtual seconds, never measured): compute time of the *reference* workload
  (``profile.reference``, e.g. the paper's 150M LLaMA-style model: ``batch * seq_len / tokens_per_s``
  per inner step) and communication time of its bytes (``reference.params`` x bytes per element of
  the method's encoding) over the profile's links (:mod:`geomesh_p2p.sim.link_time`).

Mapping between the two: each round is planned by the real planner
(:func:`geomesh_p2p.plan.awb.plan_round` for AWB, :func:`~geomesh_p2p.plan.uniform.plan_uniform` for the
DiLoCo-style plans) from the peers' :class:`~geomesh_p2p.schema.peer.PeerRecord` for the reference
workload. Peer ``i`` then trains the proxy for exactly its planned inner steps ``H_i`` (fewer if a
slowed peer hits the window deadline), with ``round(batch_i / batch_div)`` proxy sequences of
``train.seq_len`` tokens per step: the reference token budgets scaled down by one constant, so the
ratios between peers (and the tokens per outer step) are kept. The token weights of the aggregate
are the proxy tokens actually trained.

Every method gets the same token budget: ``train.rounds`` x DiLoCo's reference tokens per round.

Sources: GeoMesh (arXiv 2609.18388): AWB + CSS; DiLoCo (Douillard et al. 2023, arXiv 2311.08105):
inner/outer optimisation, outer Nesterov lr 0.7 momentum 0.9; HALoS-like asynchronous local SGD for
the ``async`` baseline (updates applied on arrival, with staleness, no barrier).
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.sim.charge import Charger, RoundCharge, speed_factor
from geomesh_p2p.sim.link_time import RoundTiming, async_exchange_s, encoded_nbytes
from geomesh_p2p.sim.hardware import Profile, SimPeer
from geomesh_p2p.sim.methods import MethodSpec
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import token_weighted_mean
from geomesh_p2p.exchange.robust import aggregate_part

__all__ = ["RoundLog", "MethodResult", "Simulator", "ProgressFn", "time_to_target"]

#: progress(label, tokens_done, tokens_budget, virtual_s, last_ppl)
ProgressFn = Callable[[str, float, float, float, Optional[float]], None]


@dataclass
class _Charged:
    """What the clock charged, per peer (lists of length n_peers) and in tokens: the fields a round's
    log and a method's totals (their per-peer sums over the rounds) share. Units: virtual seconds,
    bytes, tokens (``tokens_ref``: reference workload, charged; ``tokens_trained``: proxy, trained)."""

    compute_s: list[float]
    straggler_s: list[float]
    network_s: list[float]
    sent: list[int]
    received: list[int]
    tokens_ref: int
    tokens_trained: int


@dataclass
class RoundLog(_Charged):
    """One charged round (sync) or one applied update (async): the charges of :class:`_Charged` and
    the round's own figures (virtual seconds)."""

    index: int
    t_end_s: float
    round_s: float
    train_loss: float
    eval_ppl: Optional[float] = None
    window_s: Optional[float] = None
    inner_steps: list[int] = field(default_factory=list)
    staleness: Optional[int] = None
    peer: Optional[int] = None  # async: who updated


@dataclass
class MethodResult(_Charged):
    """Everything one method produced (the charges of :class:`_Charged` summed over its rounds);
    ``summary()`` gives the table's numbers."""

    spec: MethodSpec
    peers: list[SimPeer]
    fastest: int
    rounds: list[RoundLog]
    curve: list[tuple[float, float, float]]  # (virtual s, eval ppl, reference tokens so far)
    total_s: float
    wall_s: float
    plan_info: dict[str, Any]

    def summary(self, target_ppl: Optional[float]) -> dict[str, Any]:
        """Table figures. Charged: times, idle, bytes, utilisation. Trained: perplexities."""
        n = len(self.peers)
        T = self.total_s if self.total_s > 0 else float("nan")
        f = self.fastest
        cross = _crossing(self.curve, target_ppl) if target_ppl else None
        return {
            "method": self.spec.label,
            "time_to_target_h": None if cross is None else cross[0] / 3600.0,
            "tokens_to_target_M": None if cross is None else cross[1] / 1e6,
            "throughput_ktok_s": self.tokens_ref / T / 1e3,
            "final_ppl": self.curve[-1][1] if self.curve else None,
            "best_ppl": min(c[1] for c in self.curve) if self.curve else None,
            "straggler_idle_fastest_pct": 100.0 * self.straggler_s[f] / T,
            "straggler_idle_mean_pct": 100.0 * sum(self.straggler_s) / (n * T),
            "network_idle_pct": 100.0 * sum(self.network_s) / (n * T),
            "network_idle_fastest_pct": 100.0 * self.network_s[f] / T,
            "compute_util_pct": 100.0 * sum(self.compute_s) / (n * T),
            "compute_fastest_pct": 100.0 * self.compute_s[f] / T,
            "gb_sent_per_peer": sum(self.sent) / n / 1e9,
            "gb_received_per_peer": sum(self.received) / n / 1e9,
            "mb_sent_per_peer_per_round": sum(self.sent) / n / max(1, len(self.rounds)) / 1e6,
            "rounds": len(self.rounds),
            "total_h": self.total_s / 3600.0,
            "tokens_ref": self.tokens_ref,
            "tokens_trained": self.tokens_trained,
            "wall_s": self.wall_s,
            "fastest_peer": self.peers[f].name,
        }


def _overlapped(timing: RoundTiming, last: bool) -> RoundTiming:
    """The charge of a round whose exchange overlaps the next round's inner steps (eager updates): only
    the exchange time past the next compute window (taken as this round's, ``max(compute)``) is network
    idle; the last round's exchange is not overlapped (nothing follows it)."""
    if last:
        return timing
    last_done = max(timing.compute_s)
    net = max(0.0, timing.network_s - last_done)
    return RoundTiming(
        compute_s=list(timing.compute_s),
        straggler_s=list(timing.straggler_s),
        network_s=net,
        round_s=last_done + net,
        end_s=list(timing.end_s),
    )


def _crossing(curve: list[tuple[float, float, float]], target: Optional[float]) -> Optional[tuple[float, float]]:
    """(virtual s, reference tokens) at which eval perplexity first reaches ``target``, linear in
    log-perplexity between the two evaluations around the crossing; None if it never does."""
    if target is None:
        return None
    for k, (t, p, n) in enumerate(curve):
        if p <= target:
            if k == 0:
                return t, n
            t0, p0, n0 = curve[k - 1]
            a, b = math.log(p0), math.log(p)
            w = (a - math.log(target)) / (a - b) if a != b else 1.0
            return t0 + w * (t - t0), n0 + w * (n - n0)
    return None


def time_to_target(curve: list[tuple[float, float, float]], target: Optional[float]) -> Optional[float]:
    """Virtual seconds at which eval perplexity first reaches ``target`` (linear in log-perplexity
    between the two evaluations around the crossing), or None if it never does."""
    c = _crossing(curve, target)
    return None if c is None else c[0]


class Simulator:
    """Runs methods on one profile. Build once (loads data, initial weights), then :meth:`run`.

    Args:
        profile: a :class:`~geomesh_p2p.sim.hardware.Profile`.
        rounds: token budget in DiLoCo rounds (default ``profile.train.rounds``).
        seed: data/initialisation seed (default ``profile.train.seed``).
        data: corpus path (None: the shipped KJV corpus); ``dataset``: an already loaded one.
        progress: optional callback, see :data:`ProgressFn`.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        rounds: Optional[int] = None,
        seed: Optional[int] = None,
        data: Optional[str] = None,
        progress: Optional[ProgressFn] = None,
        dataset=None,
    ):
        self.profile = profile
        self.ref = profile.reference
        self.tr = profile.train
        self.rounds = int(rounds if rounds is not None else self.tr.rounds)
        self.seed = int(seed if seed is not None else self.tr.seed)
        self.progress = progress
        self.dataset = dataset if dataset is not None else load_dataset(data, self.tr.seq_len)
        self.base_model = build_model(self.tr.preset, vocab_size=self.dataset.vocab_size, seed=self.seed)
        self.theta0 = flat_params(self.base_model)
        self.numel = self.theta0.numel()
        self.block = self.tr.block_size
        self.charger = Charger(profile, self.numel)
        self.peers = self.charger.peers
        self.n = self.charger.n
        self.fastest = self.charger.fastest
        self._eval_trainer = InnerTrainer(copy.deepcopy(self.base_model), self.dataset, seq_len=self.tr.seq_len)
        # DiLoCo's tokens per round fix every method's budget
        self.diloco_tokens_per_round = self.charger.diloco_tokens_per_round
        self.budget_ref = self.rounds * self.diloco_tokens_per_round

    # ------------------------------------------------------------------------------ helpers
    def evaluate(self, theta: torch.Tensor) -> float:
        """Held-out perplexity of the proxy model with weights ``theta`` (trained figure)."""
        load_flat_(self._eval_trainer.model, theta)
        return self._eval_trainer.evaluate(max_batches=self.tr.eval_batches, batch_size=self.tr.eval_batch_size)

    def _tiny_batch(self, ref_batch: int) -> int:
        return max(1, int(round(ref_batch / self.tr.batch_div)))

    def _trainer(self, spec: MethodSpec, idx: int) -> InnerTrainer:
        lr = (
            spec.inner_lr
            if spec.inner_lr is not None
            else (self.tr.lion_lr if spec.inner == "lion" else self.tr.inner_lr)
        )
        return InnerTrainer(
            copy.deepcopy(self.base_model),
            self.dataset,
            seq_len=self.tr.seq_len,
            optimizer=spec.inner,
            lr=lr,
            seed=self.seed,
            peer_id=self.peers[idx].peer_id,
            min_lr_ratio=self.tr.min_lr_ratio,
            total_steps=1,
        )

    def _schedule(self, trainer: InnerTrainer, total_steps: int) -> None:
        trainer.total_steps = max(1, int(total_steps))
        trainer.warmup_steps = int(round(self.tr.warmup_frac * trainer.total_steps))

    def _report(self, label: str, done: float, t: float, ppl: Optional[float]) -> None:
        if self.progress is not None:
            self.progress(label, min(done, self.budget_ref), self.budget_ref, t, ppl)

    def plan_info(self, plan: RoundPlan) -> dict[str, Any]:
        """The plan in the units of the tables (reference batch, H, window) plus proxy batches."""
        return {
            "window_s": plan.window_s,
            "tokens_ref_per_round": plan.total_token_budget(),
            "peers": [
                {
                    "name": p.name,
                    "batch": a.batch_size,
                    "micro_batch": a.micro_batch,
                    "inner_steps": a.inner_steps,
                    "proxy_batch": self._tiny_batch(a.batch_size),
                    "predicted_compute_s": a.predicted_compute_s,
                    "predicted_comm_s": a.predicted_comm_s,
                    "part": [a.part_start, a.part_end],
                }
                for p, a in zip(self.peers, plan.assignments)
            ],
        }

    def _log(self, r: int, t: float, ch: RoundCharge, tokens_trained: int, loss: float, ppl, window) -> RoundLog:
        tm = ch.timing
        return RoundLog(
            index=r,
            t_end_s=t,
            round_s=tm.round_s,
            compute_s=tm.compute_s,
            straggler_s=tm.straggler_s,
            network_s=[tm.network_s] * self.n,
            sent=[ch.xb.sent(i) for i in range(self.n)],
            received=[ch.xb.received(i) for i in range(self.n)],
            tokens_ref=ch.tokens_ref,
            tokens_trained=tokens_trained,
            train_loss=loss,
            eval_ppl=ppl,
            window_s=window,
            inner_steps=ch.steps,
        )

    # ------------------------------------------------------------------------------ methods
    def run(self, spec: MethodSpec) -> MethodResult:
        """Simulate one method until it has trained the token budget."""
        if spec.base == "async":
            return self._run_async(spec)
        if spec.base == "ddp":
            return self._run_ddp(spec)
        return self._run_sync(spec)

    def _aggregate(
        self, spec: MethodSpec, deltas: list[torch.Tensor], tokens: list[int], efs, plan: RoundPlan
    ) -> Optional[torch.Tensor]:
        """The update every peer applies: the collective's arithmetic, without gRPC."""
        if sum(tokens) == 0:
            return None
        if spec.contribution == "fp32":
            return token_weighted_mean(list(zip(tokens, deltas)), self.numel, clip_k=None, encoding="fp32")
        # Sign contributions. Parts are aligned to the codec block (part_align = block_size), so the
        # blocks of a part are the blocks of the whole vector: encoding the whole vector once gives
        # the same bytes per part as encoding part by part (and the same per-block clipping).
        packets = []
        for d, n, ef in zip(deltas, tokens, efs):
            packets.append(ef.encode(d, n) if ef is not None else compression.encode(d, self.block, n))
        if spec.rule == "mean":
            mean = token_weighted_mean(list(zip(tokens, packets)), self.numel, clip_k=self.tr.clip_k)
        else:  # robust rules are per part (their medians and agreement are per owner's range)
            mean = torch.empty(self.numel)
            for _, s, e in plan.owners():
                parts = [(n, compression.slice_packet(p, s, e)) for n, p in zip(tokens, packets)]
                mean[s:e] = aggregate_part(parts, e - s, rule=spec.rule, clip_k=self.tr.clip_k)
        if spec.mode == "relay":
            return mean
        out = torch.empty_like(mean)
        for _, s, e in plan.owners():
            pkt = compression.encode_as(spec.aggregate, mean[s:e].contiguous(), self.block, sum(tokens))
            out[s:e] = compression.decode_any(pkt)
        return out

    def _run_sync(self, spec: MethodSpec) -> MethodResult:
        """Synchronous rounds (diloco, awb, css, geomesh), optionally with eager updates (``spec.eager``).

        **Eager updates** (issue 17), after "Eager Updates for Overlapped Communication and Computation in
        DiLoCo" (Kale, Douillard, Donchev, 2025): the exchange of round ``r`` runs during the inner steps of
        round ``r + 1``. With M peers, token weights ``w_m`` (the aggregate's), ``O(θ, v; g)`` the outer
        Nesterov step of the global weights ``θ`` and momentum ``v`` by the outer gradient ``g``:

        * global weights (bitwise the same on every peer: only aggregates touch them), applied one round
          late, when round r's aggregate ``Δ^r = Σ_m w_m Δ_m^r`` arrives: ``(θ^{r+1}, v^{r+1}) = O(θ^r, v^r; Δ^r)``;
        * peer m starts round r + 1 at once from ``x_m^{r+1} = O(θ^r, v^r; w_m Δ_m^r)`` (on copies): the
          global weights corrected by its own local outer gradient, its share of the aggregate not yet
          arrived. The paper's eager estimate is ``Δ̃_m^r = w_m Δ_m^r + Σ_{k≠m} w_k Δ_k^{r-1}`` applied to
          weights that lag the aggregate by one round; here the others' ``Δ_k^{r-1}`` are already in
          ``θ^r`` (applied when ``Δ^{r-1}`` arrived), so what is left of the estimate is the own fresh share
          (applying ``Δ^{r-1}`` again would count it twice: measured, final ppl 344 vs 275 on paper4);
        * its outer gradient of round r + 1 is taken from its own start: ``Δ_m^{r+1} = x_m^{r+1} − y_m^{r+1}``
          (``y``: its weights after the inner steps), and is aggregated and applied to ``θ^{r+1}`` as above.

        Charged time: the exchange of round r overlaps the next round's compute, so a round costs its
        compute window plus only the part of its exchange that does not fit under the next window
        (``max(0, network − last compute end)``); the last round's exchange is not overlapped. Eval is of
        the global weights, at the moment the aggregate that made them arrived (the same point as
        synchronous rounds at equal tokens)."""
        wall0 = time.perf_counter()
        ch_ = self.charger
        sigma = self.profile.speed_jitter
        est = [1.0] * self.n  # re-profiled speed factor each peer announces
        plans: dict[tuple, RoundPlan] = {}

        def get_plan() -> RoundPlan:
            key = tuple(round(x, 6) for x in est)
            if key not in plans:
                plans[key] = ch_.plan(spec, ch_.records(est) if sigma > 0 else None)
            return plans[key]

        plan0 = get_plan()
        rounds_est = math.ceil(self.budget_ref / max(1, plan0.total_token_budget()))
        trainers = [self._trainer(spec, i) for i in range(self.n)]
        for tr, a in zip(trainers, plan0.assignments):
            self._schedule(tr, rounds_est * a.inner_steps)
        efs = [
            compression.ErrorFeedback(self.numel, self.block) if spec.error_feedback else None for _ in range(self.n)
        ]
        outer = OuterNesterov(lr=spec.outer_lr or self.tr.outer_lr, momentum=self.tr.outer_momentum)
        theta = self.theta0.clone()
        t = 0.0
        ppl = self.evaluate(theta)
        curve = [(0.0, ppl, 0.0)]
        logs: list[RoundLog] = []
        done_ref = 0
        tok_trained = 0
        self._report(spec.label, 0, 0.0, ppl)
        starts = [theta] * self.n  # eager updates: each peer's start weights of the round
        r = 0
        while done_ref < self.budget_ref:
            plan = get_plan()
            f = [speed_factor(self.seed, r, i, sigma) for i in range(self.n)]
            ch = ch_.charge(spec, plan, f)
            # ---- real training of the proxy, peer by peer in PeerID order
            deltas, tokens, losses = [], [], []
            for i, tr in enumerate(trainers):
                start = starts[i] if spec.eager else theta
                load_flat_(tr.model, start)
                res = tr.run(
                    round=r, inner_steps=ch.steps[i], batch_size=self._tiny_batch(plan.assignments[i].batch_size)
                )
                deltas.append(start - flat_params(tr.model))
                tokens.append(res.tokens)
                if res.steps_done:
                    losses.append(res.mean_loss)
            agg = self._aggregate(spec, deltas, tokens, efs, plan)
            timing = ch.timing
            if spec.eager:
                starts = self._eager_starts(theta, outer, deltas, tokens)
                last = done_ref + ch.tokens_ref >= self.budget_ref
                timing = _overlapped(ch.timing, last)
            if agg is not None:
                outer.step(theta, agg)
            t_landed = t + ch.timing.round_s  # when round r's aggregate (and so these global weights) exists
            t += timing.round_s
            done_ref += ch.tokens_ref
            tok_trained += sum(tokens)
            ppl = self.evaluate(theta)
            curve.append((t_landed, ppl, float(done_ref)))
            logs.append(
                self._log(
                    r,
                    t,
                    RoundCharge(steps=ch.steps, step_s=ch.step_s, xb=ch.xb, timing=timing, tokens_ref=ch.tokens_ref),
                    sum(tokens),
                    float(np.mean(losses)) if losses else float("nan"),
                    ppl,
                    plan.window_s,
                )
            )
            # re-profiling (DESIGN.md "Round r" step 7): EMA of the measured speed factor
            if sigma > 0:
                est = [0.7 * e + 0.3 * fi for e, fi in zip(est, f)]
            self._report(spec.label, done_ref, t, ppl)
            r += 1
        return self._result(spec, logs, curve, t, done_ref, tok_trained, wall0, self.plan_info(plan0))

    def _eager_starts(
        self, theta: torch.Tensor, outer: OuterNesterov, deltas: list[torch.Tensor], tokens: list[int]
    ) -> list[torch.Tensor]:
        """Eager updates (see :meth:`_run_sync`): each peer's start weights of the next round,
        ``x_m = O(θ, v; w_m Δ_m^r)`` with ``w_m = tokens_m / Σ tokens``, on copies of the global weights and
        outer state. fp32 CPU ``[P]`` tensors; ``theta`` and ``outer`` are not modified."""
        total = float(sum(tokens))
        starts = []
        for d, n in zip(deltas, tokens):
            share = d * (float(n) / total) if total > 0 else torch.zeros_like(d)
            x = theta.clone()
            o = copy.deepcopy(outer)
            o.step(x, share.contiguous())
            starts.append(x)
        return starts

    def _run_ddp(self, spec: MethodSpec) -> MethodResult:
        """fp32 sync every step. Charged: per step, the slowest peer's step plus an fp32 all-reduce.
        Trained: one trainer on the summed batch (the gradient of the peers' averaged batches)."""
        wall0 = time.perf_counter()
        plan = self.charger.plan(spec)
        big_batch = sum(self._tiny_batch(a.batch_size) for a in plan.assignments)
        steps_total = math.ceil(self.budget_ref / plan.total_token_budget())
        trainer = self._trainer(spec, 0)
        trainer.peer_id = "ddp"
        self._schedule(trainer, steps_total)
        sigma = self.profile.speed_jitter
        eval_every = max(1, self.profile.plan.inner_steps)
        theta = self.theta0.clone()
        t, done_ref, tok_trained = 0.0, 0, 0
        ppl0 = self.evaluate(theta)
        curve = [(0.0, ppl0, 0.0)]
        logs: list[RoundLog] = []
        self._report(spec.label, 0, 0.0, ppl0)
        for r in range(steps_total):
            ch = self.charger.charge(spec, plan, [speed_factor(self.seed, r, i, sigma) for i in range(self.n)])
            res = trainer.run(round=r, inner_steps=1, batch_size=big_batch)
            theta = flat_params(trainer.model)
            t += ch.timing.round_s
            done_ref += ch.tokens_ref
            tok_trained += res.tokens
            ppl = None
            if (r + 1) % eval_every == 0 or r == steps_total - 1:
                ppl = self.evaluate(theta)
                curve.append((t, ppl, float(done_ref)))
                self._report(spec.label, done_ref, t, ppl)
            logs.append(self._log(r, t, ch, res.tokens, res.mean_loss, ppl, plan.window_s))
        return self._result(spec, logs, curve, t, done_ref, tok_trained, wall0, self.plan_info(plan))

    def _run_async(self, spec: MethodSpec) -> MethodResult:
        """Asynchronous DiLoCo-style updates (HALoS-like baselines): each peer trains H steps from the
        weights it last pulled, pushes its fp32 pseudo-gradient, which is applied to the global
        weights (outer Nesterov, scaled by its share of a round's tokens) when it arrives, then
        pulls the current weights and starts again. No barrier, so no straggler idle; an update is
        stale by the number of others' updates applied since its pull."""
        wall0 = time.perf_counter()
        sigma = self.profile.speed_jitter
        plan = self.charger.plan(spec)
        nbytes = encoded_nbytes("fp32", self.ref.params, self.block)
        max_lat = max(p.latency_s for p in self.peers)
        xfer = [async_exchange_s(lk, max_lat, nbytes) for lk in self.charger.links]  # (push_s, pull_s)
        asg = plan.assignments
        H = [a.inner_steps for a in asg]
        tb = [self._tiny_batch(a.batch_size) for a in asg]
        step_s = self.charger.step_s(plan)
        ref_tok = [h * a.batch_size * self.ref.seq_len for h, a in zip(H, asg)]
        round_trained = sum(h * b * self.tr.seq_len for h, b in zip(H, tb))
        cycle = [xfer[i][1] + H[i] * step_s[i] + xfer[i][0] for i in range(self.n)]
        rate = sum(ref_tok[i] / cycle[i] for i in range(self.n))
        t_end_est = self.budget_ref / rate
        trainers = [self._trainer(spec, i) for i in range(self.n)]
        for i, tr in enumerate(trainers):
            self._schedule(tr, math.ceil(t_end_est / cycle[i]) * H[i])
        outer = OuterNesterov(
            lr=spec.outer_lr or self.tr.async_outer_lr or self.tr.outer_lr, momentum=self.tr.outer_momentum
        )
        theta = self.theta0.clone()
        version = 0
        local_round = [0] * self.n
        pending: dict[int, tuple[torch.Tensor, int, int, float, float, float]] = {}
        heap: list[tuple[float, int]] = []

        def start_cycle(i: int, t_start: float, first: bool) -> None:
            pull = 0.0 if first else xfer[i][1]
            f = speed_factor(self.seed, local_round[i], i, sigma)
            comp = H[i] * step_s[i] / f
            tr = trainers[i]
            snap = theta.clone()
            load_flat_(tr.model, snap)
            res = tr.run(round=local_round[i], inner_steps=H[i], batch_size=tb[i])
            delta = snap - flat_params(tr.model)
            arrive = t_start + pull + comp + xfer[i][0]
            pending[i] = (delta, res.tokens, version, comp, pull + xfer[i][0], res.mean_loss)
            local_round[i] += 1
            heapq.heappush(heap, (arrive, i))

        ppl0 = self.evaluate(theta)
        curve = [(0.0, ppl0, 0.0)]
        logs: list[RoundLog] = []
        self._report(spec.label, 0, 0.0, ppl0)
        for i in range(self.n):
            start_cycle(i, 0.0, first=True)
        comp_acc = [0.0] * self.n
        net_acc = [0.0] * self.n
        sent = [0] * self.n
        recv = [0] * self.n
        done_ref, tok_trained, since_eval, t = 0, 0, 0, 0.0
        k = 0
        while done_ref < self.budget_ref:
            t, i = heapq.heappop(heap)
            delta, ntok, v0, comp, net, loss = pending.pop(i)
            if ntok > 0:
                delta.mul_(float(ntok) / float(round_trained))
                outer.step(theta, delta)
            staleness = version - v0
            version += 1
            comp_acc[i] += comp
            net_acc[i] += net
            first = local_round[i] == 1
            sent[i] += nbytes
            recv[i] += 0 if first else nbytes
            done_ref += ref_tok[i]
            since_eval += ref_tok[i]
            tok_trained += ntok
            ppl = None
            if since_eval >= self.diloco_tokens_per_round or done_ref >= self.budget_ref:
                since_eval = 0
                ppl = self.evaluate(theta)
                curve.append((t, ppl, float(done_ref)))
                self._report(spec.label, done_ref, t, ppl)
            logs.append(
                RoundLog(
                    index=k,
                    t_end_s=t,
                    round_s=0.0,
                    compute_s=[comp if j == i else 0.0 for j in range(self.n)],
                    straggler_s=[0.0] * self.n,
                    network_s=[net if j == i else 0.0 for j in range(self.n)],
                    sent=[nbytes if j == i else 0 for j in range(self.n)],
                    received=[(0 if first else nbytes) if j == i else 0 for j in range(self.n)],
                    tokens_ref=ref_tok[i],
                    tokens_trained=ntok,
                    train_loss=loss,
                    eval_ppl=ppl,
                    inner_steps=[H[i] if j == i else 0 for j in range(self.n)],
                    staleness=staleness,
                    peer=i,
                )
            )
            k += 1
            if done_ref < self.budget_ref:
                start_cycle(i, t, first=False)
        res = self._result(spec, logs, curve, t, done_ref, tok_trained, wall0, self.plan_info(plan))
        res.compute_s, res.network_s, res.sent, res.received = comp_acc, net_acc, sent, recv
        res.straggler_s = [0.0] * self.n
        res.plan_info["mean_staleness"] = float(np.mean([lg.staleness for lg in logs])) if logs else 0.0
        return res

    def _result(self, spec, logs: list[RoundLog], curve, t, done_ref, tok_trained, wall0, plan_info) -> MethodResult:
        n = self.n

        def col(name: str) -> list:
            return [sum(getattr(lg, name)[i] for lg in logs) for i in range(n)]

        return MethodResult(
            spec=spec,
            peers=self.peers,
            fastest=self.fastest,
            rounds=logs,
            curve=curve,
            total_s=t,
            compute_s=col("compute_s"),
            straggler_s=col("straggler_s"),
            network_s=col("network_s"),
            sent=col("sent"),
            received=col("received"),
            tokens_ref=int(done_ref),
            tokens_trained=int(tok_trained),
            wall_s=time.perf_counter() - wall0,
            plan_info=plan_info,
        )
