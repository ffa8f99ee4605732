"""When does the verdict on a wrong-data contributor land? A queue simulation of the screening rules (session 19).

Each honest peer's background worker is simulated with the shipped :class:`~geomesh_p2p.trust.verify_queue.Pacer`
on a virtual clock (no model, no sleeping): the jobs the shipped rules queue at the end of each round (the
newcomers' screens of rounds ``gain_first_round .. + screen_rounds``, the sampled screens of established
contributors with the shipped :func:`~geomesh_p2p.trust.verify_task.sample_probability`, the sampled full checks
at ``share``), each a list of forward passes of one batch, run in the worker's order (the screening lane first, a
screen order drawn per peer), paced at ``duty`` per pass (``--window 0``, before session 19) or over a window of
``burst_rounds`` rounds (session 19). One wrong-data contributor (a poisoner) among ``--peers``, poisoning from
round ``--first`` on (0: from the start; 5: a patient one, honest through its probation and the first rounds'
screens). Its screens fail from its first poisoned round (measured: 88-100% of the draws at H = 5-40,
``benchmarks/verify_gain.py``; the simulation counts every one as failing); a verdict is applied at the end of
the round it completes in, another screener's evidence moves this peer's own screen of it to the front of its
lane from then on (``CheckQueue.promote``), a peer that was not a screener re-screens it (same cost) then, and the
poisoner is out from the round after every honest peer holds the verdict.

Units: one forward pass of a batch is 1; a training step 3 (forward and backward); a round ``H x 3 / 0.8`` (a
fifth of it exchanging). Time to a verdict is in rounds, so the unit drops out. Prints, per H and pacing: the
round the first verdict lands, the round every honest peer holds it and the poisoner is out (median and 90th
percentile over ``--seeds`` draws), the share of draws out within 3 (patient: of its first poisoned round) and
5 rounds, and the worker's compute as a share of the wall time over the run (mean of the peers, its maximum
over any ``burst_rounds`` window)::

    python benchmarks/screen_latency.py                      # a poisoner from round 0, 4 peers
    python benchmarks/screen_latency.py --first 5            # a patient poisoner
    python benchmarks/screen_latency.py --peers 7 --Hs 5,20,100
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import types
from typing import Optional

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust.verify_queue import Pacer
from geomesh_p2p.trust.verify_task import STEP_FORWARDS, VerifyConfig, sample_probability

TRAIN_SHARE = 0.8  # of a round spent in inner steps (the rest exchanging)
SEQ = 32


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@dataclasses.dataclass
class Job:
    round: int
    kind: str  # screen | rescreen | check
    accused: str
    passes: int
    arrive: float


def plan_of(cfg: VerifyConfig, r: int, peers: list[str], H: int, B: int):
    """A stand-in RoundPlan and contributions for :func:`sample_probability` (what it reads of them)."""
    a = [
        types.SimpleNamespace(peer_id=p, inner_steps=H, batch_size=B, token_budget=H * B * SEQ, probation=False)
        for p in peers
    ]
    pk = compression.encode(torch.zeros(2048), 2048, H * B * SEQ)
    return types.SimpleNamespace(round=r, assignments=a, seq_len=SEQ), {p: {0: pk} for p in peers}


def simulate(cfg: VerifyConfig, n: int, H: int, B: int, rounds: int, first: int, seed: int, window: bool) -> dict:
    rng = random.Random(seed)
    peers = [f"p{i}" for i in range(n)]
    bad, honest = peers[-1], peers[:-1]
    R = H * STEP_FORWARDS / TRAIN_SHARE
    k = min(cfg.gain_assigned, H)
    m = cfg.gain_controls
    # the jobs each honest peer gets at the end of each round
    arrivals: dict[str, list[Job]] = {p: [] for p in honest}
    for r in range(rounds):
        end = (r + 1) * R
        if r < cfg.gain_first_round:
            screened, n_scr = [], 0
        elif r < cfg.gain_first_round + cfg.screen_rounds:
            screened, n_scr = list(peers), cfg.screeners
        else:
            plan, packets = plan_of(cfg, r, peers, H, B)
            q = sample_probability(cfg, plan, packets)
            screened, n_scr = [p for p in peers if rng.random() < q], cfg.sample_screeners
        for v in honest:
            own = []
            for i, x in enumerate(screened):
                if x == v or v not in rng.sample([p for p in peers if p != x], min(n_scr, n - 1)):
                    continue
                wrong = x == bad and r >= first
                cost = 2 * k + m + (2 * k if wrong else 0)  # a low t also measures the checker's reference
                own.append(Job(r, "screen", x, cost + (m if not own else 0), end))  # the first pays the controls
            rng.shuffle(own)  # each verifier's own order (its selection signature)
            arrivals[v] += own
            # a sampled full check: drawn for share of its compute; the gain test, then k + 4 gradient passes
            k_chk = max(cfg.k_min, min(cfg.k_max, -(-H // 4)))
            p_chk = min(1.0, cfg.share * H * B / ((k_chk + cfg.controls) * B))
            if r >= 0 and rng.random() < p_chk:
                x = rng.choice([p for p in peers if p != v])
                wrong = x == bad and r >= first and r >= cfg.gain_first_round
                cost = 2 * (min(cfg.gain_assigned, H) + m) + (0 if wrong else STEP_FORWARDS * (k_chk + cfg.controls))
                arrivals[v].append(Job(r, "check", x, cost, end))
    # run each worker; a verdict on the poisoner at one peer promotes the others' screens of it
    verdict: dict[str, float] = {}
    busy: dict[str, list[tuple[float, float]]] = {}
    first_ev: Optional[float] = None
    for _ in range(2):  # a second pass with the first evidence's time known (promotion)
        verdict, busy = {}, {}
        for v in honest:
            t_v, log = run_worker(cfg, arrivals[v], R, window, bad, first, first_ev)
            if t_v is not None:
                verdict[v] = t_v
            busy[v] = log
        times = sorted(verdict.values())
        first_ev = times[0] if times else None
    land = {v: int(t // R) for v, t in verdict.items()}
    # over the run, or until the worker's backlog ended when it ran past the run
    shares = [sum(b for _, b in busy[v]) / max(rounds * R, max((t for t, _ in busy[v]), default=0.0)) for v in honest]
    W = cfg.burst_rounds * R
    peak = max(
        (sum(b for t, b in busy[v] if e - W < t <= e) / W for v in honest for e, _ in busy[v]),
        default=0.0,
    )
    return {
        "first": min(land.values()) if land else None,
        "all": max(land.values()) if len(land) == len(honest) else None,
        "share": statistics.mean(shares),
        "peak": peak,
    }


def run_worker(cfg, jobs, R, window, bad, first, first_ev) -> tuple[Optional[float], list]:
    """One honest peer's worker: returns when its verdict on the poisoner lands (None: never) and its passes."""
    clock = Clock()
    pace = Pacer(cfg.duty, clock=clock, sleep=clock.sleep, window_s=cfg.burst_rounds * R if window else 0.0)
    pending = sorted(jobs, key=lambda j: j.arrive)
    screened_bad = {j.round for j in jobs if j.kind == "screen" and j.accused == bad}
    waiting: list[Job] = []
    log: list[tuple[float, float]] = []
    verdict = None
    rescreen_queued = False
    while pending or waiting:
        while pending and pending[0].arrive <= clock.t:
            waiting.append(pending.pop(0))
        # another screener's evidence: read at the end of the round it was published in
        if first_ev is not None and verdict is None and clock.t >= (int(first_ev // R) + 1) * R:
            own = [j for j in waiting if j.kind == "screen" and j.accused == bad and j.round >= first]
            if own:
                waiting.remove(own[0])
                waiting.insert(0, own[0])  # promoted
            elif not rescreen_queued and not any(r >= first for r in screened_bad):
                k = min(cfg.gain_assigned, int(R * TRAIN_SHARE / STEP_FORWARDS))
                waiting.insert(0, Job(0, "rescreen", bad, 2 * (k + cfg.gain_controls) + 2 * k, clock.t))
                rescreen_queued = True
        if not waiting:
            clock.t = max(clock.t, pending[0].arrive)
            continue
        lane = [j for j in waiting if j.kind in ("screen", "rescreen")] or waiting
        job = lane[0]
        waiting.remove(job)
        pace.start()
        for _ in range(job.passes):
            clock.t += 1.0
            log.append((clock.t, 1.0))
            pace()
        fails = job.accused == bad and (
            job.kind == "rescreen" or (job.round >= first and job.round >= cfg.gain_first_round)
        )
        if fails and verdict is None:
            verdict = clock.t
    return verdict, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--Hs", default="5,20,40,100")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--first", type=int, default=0, help="the poisoner's first poisoned round (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--screeners", type=int, default=None, help="VerifyConfig.screeners (default: the shipped one)")
    a = ap.parse_args(argv)
    cfg = VerifyConfig()
    if a.screeners is not None:
        cfg = dataclasses.replace(cfg, screeners=a.screeners)
    base = a.first if a.first >= cfg.gain_first_round else cfg.gain_first_round
    print(
        f"{a.peers} peers, 1 poisoner from round {a.first} (its first screenable contribution: round {base}), "
        f"{a.seeds} draws, {a.rounds} rounds, {cfg.screeners} screeners a newcomer\n"
    )
    print(
        "| H | pacing | first verdict (round, median / p90) | out from (median / p90) | out within 3 / 5 rounds of "
        f"round {base} | never | compute / wall (mean) | max over a {cfg.burst_rounds:g}-round window |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for H in (int(x) for x in a.Hs.split(",")):
        for window in (False, True):
            res = [simulate(cfg, a.peers, H, a.batch, a.rounds, a.first, s, window) for s in range(a.seeds)]
            firsts = sorted(x["first"] for x in res if x["first"] is not None)
            outs = sorted(x["all"] + 1 for x in res if x["all"] is not None)
            never = sum(1 for x in res if x["all"] is None) / len(res)

            def q(v, f):
                return v[min(len(v) - 1, int(f * len(v)))] if v else None

            w3 = sum(1 for o in outs if o <= base + 3) / len(res)
            w5 = sum(1 for o in outs if o <= base + 5) / len(res)
            print(
                f"| {H} | {'window ' + format(cfg.burst_rounds, 'g') + ' rounds' if window else 'per pass'} "
                f"| {q(firsts, 0.5)} / {q(firsts, 0.9)} | {q(outs, 0.5)} / {q(outs, 0.9)} | {w3:.0%} / {w5:.0%} "
                f"| {never:.0%} | {statistics.mean(x['share'] for x in res):.3f} | {max(x['peak'] for x in res):.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
