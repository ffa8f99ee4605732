"""One rank of a ``--rank-sync round`` trainer under attack, for tests/e2e/test_rank_rounds_faults.py (issue 30).

    python tests/rank_round_worker.py RANK WORLD INIT_METHOD SCENARIO OUT TIMEOUT_S

Like tests/rank_worker.py (the same tiny model and :class:`FakeData`), with the collective timeout given. Every
rank writes ``OUT.rank<R>.pt``; rank 0 its runs' results (or the error a run raised) and seconds, the failures
seen, its flat weights after each run; a follower its exit code, flat weights and the commands it took (opcodes
in order, keep-alive pings left out). SCENARIO:

``nanweights``: rank 1's last optimizer step of the run leaves a NaN weight (its losses stay finite);
``stop``: rank 1 stops itself (SIGSTOP) at its second step; rank 0 must end its run after the collective timeout;
``edges``: runs of 0 steps, with the deadline already past, of batch 1 (< the ranks), with speeds that overflow a
float sum, then a normal run and one with a token floor: no hang, the ranks stay in step;
``rank0error``: rank 0's second step raises a RuntimeError (not a non-finite loss); the next run must work;
``long``: a run longer than the collective timeout (both ranks slow), keep-alive on: no failure;
``eager``: a run with a StepTarget (eager updates) runs in lockstep, then a run once a round;
``rank0dies``: rank 0 exits (``os._exit(9)``) at its second step of a 12-step run (the follower's 0.5 s each);
``floor``: a run whose train deadline is already past, with a token floor of 2 steps and its grace (round/steps.py):
every rank trains the floor's steps, as a one-device peer does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import distributed_c10d

from geomesh_p2p.model.build import flat_params
from geomesh_p2p.model.rank_channel import EXIT, PING, Command, RankChannel
from geomesh_p2p.model.ranks import NoData, RankedTrainer
from geomesh_p2p.model.training import StepTarget
from geomesh_p2p.net.swarm_time import swarm_time
from tests.rank_worker import BATCH, KWARGS, MICRO, STEPS, VOCAB, FakeData, exp_avg, model


#: ``long``: steps of 0.5 s a rank; with the test's 5 s collective timeout the run lasts 8 s (the margin of 5 s between
#: the ranks absorbs a loaded machine's skew; a 3 s timeout failed once under a parallel test run)
LONG_STEPS = 16


#: Collective timeout (seconds) while the ranks form and build their trainers: a loaded CI machine (3 test workers
#: on 2 cores) took over 4 s for the follower's DDP set-up; the scenario's own, shorter timeout applies after it.
SETUP_TIMEOUT_S = 60.0
#: the scenario's collective timeout (seconds, argv[6]), set by main()
TIMEOUT_S = [0.0]


def _scenario_timeout(ch: RankChannel, seconds: float) -> None:
    """Both process groups' collective timeout from now on (this process only: each rank sets its own)."""
    for group in (ch.main, ch.cmd):
        distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    ch.timeout_s = seconds


def _moments(t: RankedTrainer) -> torch.Tensor:
    """AdamW's ``exp_avg`` of ``t`` (empty before its first step)."""
    return exp_avg(t) if t.optimizer.state else torch.empty(0)


def _slow(t: RankedTrainer, seconds: float) -> None:
    real = t._step_batch

    def slow(rnd, step, b):
        time.sleep(seconds)
        return real(rnd, step, b)

    t._step_batch = slow  # type: ignore[method-assign]


def rank0(ch: RankChannel, scenario: str, out: str) -> int:
    res: dict = {"runs": [], "flat": [], "failures": []}
    ch.on_failure = res["failures"].append
    ch.start_keepalive(period_s=0.5)
    t = RankedTrainer(model(), FakeData(), channel=ch, independent=True, **KWARGS)
    _scenario_timeout(ch, TIMEOUT_S[0])
    runs = [dict(inner_steps=STEPS, batch_size=BATCH, micro_batch=MICRO)]
    if scenario == "edges":
        runs = [
            dict(inner_steps=0, batch_size=BATCH),
            dict(inner_steps=STEPS, batch_size=BATCH, deadline=swarm_time() - 1.0),
            dict(inner_steps=STEPS, batch_size=1),
            dict(inner_steps=STEPS, batch_size=BATCH, speeds=[1e308, 1.0]),
            dict(inner_steps=STEPS, batch_size=BATCH, speeds=[1e308, 1e308]),
            dict(inner_steps=STEPS, batch_size=BATCH, micro_batch=MICRO),
            # a relay round's token floor (round/steps.py passes it): not a TypeError of the independent run
            dict(inner_steps=STEPS, batch_size=BATCH, floor_steps=2, floor_grace_s=0.5),
        ]
    elif scenario == "rank0error":
        real, n = t.accumulate_grad, {"steps": 0}

        def failing(batch, micro_batch=None):
            n["steps"] += 1
            if n["steps"] == 2:
                raise RuntimeError("simulated device error")
            return real(batch, micro_batch)

        t.accumulate_grad = failing  # type: ignore[method-assign]
        runs = runs * 2
    elif scenario == "long":
        _slow(t, 0.5)
        runs = [dict(inner_steps=LONG_STEPS, batch_size=BATCH)]
    elif scenario == "eager":  # a run with a StepTarget (eager updates): lockstep, then a run once a round
        runs = [dict(inner_steps=STEPS, batch_size=BATCH, target=StepTarget(STEPS, None))] + runs
    elif scenario == "floor":  # the deadline spent, the floor's grace not: 2 steps of 3 on every rank
        runs = [
            dict(inner_steps=STEPS, batch_size=BATCH, deadline=swarm_time() - 1.0, floor_steps=2, floor_grace_s=60.0)
        ]
    elif scenario == "rank0dies":
        real, n = t.accumulate_grad, {"steps": 0}

        def dying(batch, micro_batch=None):
            n["steps"] += 1
            if n["steps"] == 2:
                os._exit(9)  # the follower took the RUN and is training its rows
            time.sleep(0.5)
            return real(batch, micro_batch)

        t.accumulate_grad = dying  # type: ignore[method-assign]
        runs = [dict(inner_steps=12, batch_size=BATCH)]
    for rnd, kw in enumerate(runs):
        kw = dict(kw)
        if "speeds" in kw:
            t.rank_speeds = kw.pop("speeds")
        t0 = time.monotonic()
        try:
            r = t.run(round=rnd, **kw)
            out_r = {"steps": r.steps_done, "tokens": r.tokens, "early": r.stopped_early}
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out_r = {"error": f"{type(e).__name__}: {e}"}
        out_r["seconds"] = time.monotonic() - t0
        out_r["pending"] = ch._pending is not None  # a RUN's batches still held after its meeting
        out_r["exp_avg"] = _moments(t)
        res["runs"].append(out_r)
        res["flat"].append(flat_params(t.model))
        torch.save(res, f"{out}.rank0.pt")  # as it goes: a hung run still leaves the runs before it
    if ch.broken is None:
        ch.send(Command(EXIT))
    torch.save(res, f"{out}.rank0.pt")
    ch.close(exit_followers=False)
    return 0


def follower(ch: RankChannel, scenario: str, out: str) -> int:
    assert ch.wait_setup() == VOCAB
    t = RankedTrainer(model(), NoData(VOCAB), channel=ch, **KWARGS)
    taken: list[int] = []
    recv = ch.recv

    def recording() -> Command:
        cmd = recv()
        if cmd.op != PING:  # as many as the runs' lengths allow: not counted
            taken.append(cmd.op)
        return cmd

    ch.recv = recording  # type: ignore[method-assign]
    _scenario_timeout(ch, TIMEOUT_S[0])
    if scenario == "nanweights":
        real_step, n = t.optimizer.step, {"steps": 0}

        def step(*a, **k):
            ret = real_step(*a, **k)
            n["steps"] += 1
            if n["steps"] == STEPS:
                with torch.no_grad():
                    next(t.model.parameters()).view(-1)[0] = float("nan")
            return ret

        t.optimizer.step = step  # type: ignore[method-assign]
    elif scenario == "stop":
        real, n = t._step_batch, {"steps": 0}

        def stopping(rnd, step, b):
            n["steps"] += 1
            if n["steps"] == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(rnd, step, b)

        t._step_batch = stopping  # type: ignore[method-assign]
    elif scenario in ("long", "rank0dies"):
        _slow(t, 0.5)
    code = t.follow()
    torch.save(
        {"code": code, "flat": flat_params(t.model), "exp_avg": _moments(t), "commands": taken},
        f"{out}.rank{ch.rank}.pt",
    )
    ch.close(exit_followers=False)
    return code


def main() -> int:
    rank, world, init, scenario, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback (tests/rank_procs.py)
    torch.set_num_threads(1)
    TIMEOUT_S[0] = float(sys.argv[6])
    ch = RankChannel.init(rank, world, "cpu", init, timeout_s=SETUP_TIMEOUT_S)
    return rank0(ch, scenario, out) if rank == 0 else follower(ch, scenario, out)


if __name__ == "__main__":
    sys.exit(main())
