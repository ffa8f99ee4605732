"""Eager updates in the round driver (DriverConfig.eager, docs/eager.md) with the in-memory fakes of
test_round_driver: 3 peers, real Nesterov outer steps on fp32 global weights and momentum, inner steps that
honour the StepTarget. Checked: equal global digests every round, the next round's steps started while the
exchange was in flight, the global weights equal a reference recomputed from the aggregates, each peer's
start equal to its eager start O(θ^r, v^r; w Δ_m^r), and the start error of ddp + eager."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.model.optim import OuterNesterov, eager_start
from tests.unit import test_round_driver as trd

pytestmark = pytest.mark.timeout(60)
LR, MOM = 0.7, 0.9


def _digest(theta: torch.Tensor, v: torch.Tensor) -> str:
    return hashlib.sha256(theta.numpy().tobytes() + v.numpy().tobytes()).hexdigest()[:16]


class EagerPeer(trd.FakePeer):
    """FakePeer with the eager state port: θ and v stepped by OuterNesterov, the model a flat vector."""

    def __init__(self, swarm, ident, rounds: int):
        super().__init__(swarm, ident)
        g = torch.Generator().manual_seed(7)
        self.theta = torch.randn(trd.NUMEL, generator=g)  # every peer starts from the same θ^0
        self.v = torch.zeros(trd.NUMEL)
        self.outer = OuterNesterov(lr=LR, momentum=MOM)
        self.outer.buf = self.v
        self.model = self.theta.clone()
        self.digest = _digest(self.theta, self.v)
        self.rounds = rounds
        self.starts: dict[int, torch.Tensor] = {}  # round -> the model when its inner steps began
        self.eager_calls: list[tuple] = []  # (round of θ, θ, v, delta, weight, result)
        self.spec_started: dict[int, threading.Event] = {}
        self.pushed: dict[int, torch.Tensor] = {}
        self.loaded_while_training = 0
        self._training = threading.Event()

    def _started(self, r: int) -> threading.Event:
        return self.spec_started.setdefault(r, threading.Event())

    # GlobalStatePort + EagerStatePort
    def outer_step(self, r, plan, aggregate, idle=()):
        self.outer.step(self.theta, aggregate.contiguous())

    def commit(self, round, load_model=True):
        if load_model and self._training.is_set():
            self.loaded_while_training += 1
        self.round, self.digest = round, _digest(self.theta, self.v)
        if load_model:
            self.model = self.theta.clone()
        return self.digest

    def eager_start(self, delta, weight):
        x = eager_start(self.theta, self.v, delta, weight, lr=LR, momentum=MOM)
        self.eager_calls.append((self.round, self.theta.clone(), self.v.clone(), delta.clone(), weight, x.clone()))
        return x

    def load_model(self, flat):
        self.model = flat.clone()

    def pseudo_gradient_from(self, start):
        return start - self.model

    def global_weights(self):
        return self.theta

    # Trainer: one emulated step = a fixed move and 2 ms of "compute"; the target is read before every step
    def run(
        self,
        *,
        round,
        inner_steps,
        batch_size,
        micro_batch=None,
        deadline=None,
        progress=None,
        should_stop=None,
        target=None,
    ):
        self.starts.setdefault(round, self.model.clone())
        self._started(round).set()
        self._training.set()
        k = 0
        try:
            while True:
                n = target.get()[0] if target is not None else inner_steps
                if k >= min(n, 40) or (should_stop is not None and should_stop()):
                    break
                self.model = self.model - 0.001 * (1 + trd.PEER_INDEX[self.me]) * torch.sign(self.model + k)
                time.sleep(0.002)  # emulated compute of one step (not a wait for anything)
                k += 1
        finally:
            self._training.clear()
        return SimpleNamespace(
            steps_done=k,
            tokens=k * batch_size * trd.CFG.seq_len,
            mean_loss=3.0,
            last_loss=3.0,
            compute_s=0.002 * k,
            stopped_early=False,
        )

    # Collective: returns only once this peer's next round has started (eager) or after 2 s
    async def all_reduce(self, spec, delta, tokens, compute_end=None, *, in_place=False):
        assert not in_place, "eager updates read the update during the exchange: never in place"
        self.pushed[spec.round] = delta.clone()
        ar = await super().all_reduce(spec, delta, tokens, compute_end)
        if spec.round + 1 < self.rounds:
            await asyncio.to_thread(self._started(spec.round + 1).wait, 2.0)
        return ar

    def driver(self, **kw):
        d = super().driver(**kw)
        d.cfg.eager = True
        return d


def _three(cls, swarm, *args):
    """Three peers of ``cls`` (built with ``swarm``, a fresh identity and ``args``), registered as the driver
    fakes expect: in ``trd.PEERS`` / ``trd.PEER_INDEX`` and with their records in the swarm."""
    peers = []
    for k in range(3):
        p = cls(swarm, trd.Identity.generate(), *args)
        trd.PEERS[p.me], trd.PEER_INDEX[p.me] = p, k
        swarm.records[p.me] = p.record()
        peers.append(p)
    return peers


async def test_eager_rounds_keep_equal_digests_overlap_the_exchange_and_follow_the_equations():
    swarm, rounds = trd.Swarm(), 5
    peers = _three(EagerPeer, swarm, rounds)
    await trd._run_all(peers, rounds=rounds, min_peers=3)

    for p in peers:
        assert [row.round for row in p.drv.history] == list(range(rounds))
        assert p.loaded_while_training == 0  # θ^{r+1} never loaded into the model under the speculative steps
    for r in range(rounds):
        assert len({p.drv.history[r].digest for p in peers}) == 1, f"round {r}: digests differ"
        for p in peers:
            e = p.drv.history[r].extra["eager"]
            assert e["steps"] == ("global" if r == 0 else "adopted")
            if r + 1 < rounds:  # round r+1's steps began while round r's exchange was in flight
                assert e["next_started"] and e["next_lead_s"] > 0, (r, e)
            else:
                assert not e["next_started"]

    # Reference: θ^{r+1} = O(θ^r, v^r; Δ^r) from θ^0 and the aggregates of the swarm's exchange.
    g = torch.Generator().manual_seed(7)
    theta, ref = torch.randn(trd.NUMEL, generator=g), OuterNesterov(lr=LR, momentum=MOM)
    thetas, vs = [theta.clone()], [torch.zeros(trd.NUMEL)]
    for r in range(rounds):
        pushed = next(v for (rr, _leader), v in swarm.pushes.items() if rr == r)  # the round's one plan
        got = {pid: d for pid, (d, t) in pushed.items() if t > 0}
        toks = {pid: t for pid, (d, t) in pushed.items() if t > 0}
        agg = sum(got[q] * toks[q] for q in got) / sum(toks.values())
        ref.step(theta, agg.contiguous())
        thetas.append(theta.clone())
        vs.append(ref.buf.clone())
    for p in peers:
        assert torch.equal(p.theta, thetas[-1]) and torch.equal(p.v, vs[-1])
        # Each round r+1 starts at x = O(θ^r, v^r; w Δ_m^r) of its own pushed Δ_m^r, and pushes x − y.
        assert [c[0] for c in p.eager_calls] == list(range(rounds - 1))
        for r, th, v, delta, w, x in p.eager_calls:
            assert torch.equal(th, thetas[r]) and torch.equal(v, vs[r]) and torch.equal(delta, p.pushed[r])
            assert 0 < w < 1
            assert torch.equal(p.starts[r + 1], x)
            assert not torch.equal(x, thetas[r + 1])  # its own start, not the global weights
    weights = [sum(c[4] for p in peers for c in p.eager_calls if c[0] == r) for r in range(rounds - 1)]
    assert weights == pytest.approx([1.0] * (rounds - 1))


async def test_a_digest_mismatch_aborts_the_speculative_steps_and_the_next_round_starts_from_the_global_weights(
    caplog,
):
    caplog.set_level("INFO", logger="geomesh_p2p.node.peer.round")
    swarm, rounds = trd.Swarm(), 4
    peers = _three(EagerPeer, swarm, rounds)
    bad = peers[2]
    real = bad.outer_step

    def corrupt(r, plan, aggregate, idle=()):
        real(r, plan, aggregate, idle)
        if r == 1:
            bad.theta[0] += 1.0

    bad.outer_step = corrupt
    await trd._run_all(peers, rounds=rounds, min_peers=3)
    assert bad.catch_ups >= 1
    assert bad.drv.history[1].digest_agree is False
    # its speculative round-2 steps were aborted; after the re-sync round 2 began from the global weights
    aborted = [r.getMessage() for r in caplog.records if "speculative inner steps aborted" in r.getMessage()]
    assert aborted == [
        "round 2: speculative inner steps aborted (digest mismatch); the model is back at the global weights"
    ]
    rows = {row.round: row for row in bad.drv.history}
    assert rows[2].extra["eager"]["steps"] == "global" and rows[3].extra["eager"]["steps"] == "adopted"
    assert len({p.digest for p in peers}) == 1


def test_ddp_with_eager_is_refused_at_start(capsys):
    from geomesh_p2p.config.models import RunConfig
    from peer.cli import main

    with pytest.raises(ValueError, match="method 'ddp' has none"):
        RunConfig(method="ddp", eager=True)
    with pytest.raises(ValueError, match="need mode 'reencode'"):
        RunConfig(method="geomesh", eager=True)
    assert RunConfig(method="geomesh", mode="reencode", eager=True).eager
    assert RunConfig(method="diloco", eager=True).config_hash() != RunConfig(method="diloco").config_hash()
    assert main(["join", "--eager", "--method", "ddp", "--pow-bits", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("geomesh-peer join: eager updates overlap") and "method 'ddp' has none" in err


class RecordingEagerPeer(EagerPeer):
    """EagerPeer that records every inner-step run (round, batch size, micro batch, start, end, stopped) and
    whose leader plans ``batch_at[round]`` sequences per step (target_batch) in the rounds named there."""

    def __init__(self, swarm, ident, rounds: int, batch_at: dict):
        super().__init__(swarm, ident, rounds)
        self.batch_at = batch_at
        self.hold = {r for r in batch_at} | {r + 1 for r in batch_at}  # rounds whose speculative steps are void
        self.runs: list[dict] = []

    def run(self, *, round, inner_steps, batch_size, micro_batch=None, should_stop=None, target=None, **kw):
        start = self.model.clone()
        if target is not None and round in self.hold and should_stop is not None:
            # Speculative steps of a round whose plan changes the shape: they train until aborted (2 ms of
            # emulated compute per step, at most 4 s), so the abort is seen whenever the plan comes.
            k = 0
            while not should_stop() and k < 2000:
                self.model = self.model - 0.001 * torch.sign(self.model + k)
                time.sleep(0.002)
                k += 1
            res = SimpleNamespace(steps_done=k, tokens=k * batch_size * trd.CFG.seq_len, compute_s=0.002 * k)
        else:
            res = super().run(
                round=round,
                inner_steps=inner_steps,
                batch_size=batch_size,
                micro_batch=micro_batch,
                should_stop=should_stop,
                target=target,
                **kw,
            )
        stopped = should_stop is not None and should_stop()
        self.runs.append(
            dict(round=round, batch=(batch_size, micro_batch), start=start, end=self.model.clone(), stopped=stopped)
        )
        return res

    def make_plan(self, members, leader):
        cfg = trd.CFG.model_copy(update={"target_batch": self.batch_at.get(self.round, trd.CFG.target_batch)})
        return trd.plan_round(
            members,
            cfg,
            run_id=trd.RUN,
            round=self.round,
            leader=leader,
            numel=trd.NUMEL,
            start_time=time.time() + 0.05,
            start_digest=self.digest,
        )


async def test_a_plan_with_another_batch_shape_restarts_the_speculative_steps_from_the_own_start():
    """Round 2 is planned at batch 16 (micro batch 8) where round 1 had 8: every peer's speculative round-2
    steps (started at batch 8) are aborted and the round restarts from the same own start x_m^2 with the plan's
    shape; round 3 (batch 8 again, its steps started at 16) restarts too; round 4 adopts. The update of a
    restarted round is x_m − y_m of the restarted steps, and the global state stays equal on every peer."""
    swarm, rounds = trd.Swarm(), 5
    batch_at = {2: 16}
    peers = _three(RecordingEagerPeer, swarm, rounds, batch_at)
    await trd._run_all(peers, rounds=rounds, min_peers=3)

    expect = ["global", "adopted", "restarted", "restarted", "adopted"]
    for p in peers:
        assert [row.extra["eager"]["steps"] for row in p.drv.history] == expect
        assert [row.batch_size for row in p.drv.history] == [8, 8, 16, 8, 8]
        starts = {c[0] + 1: c[5] for c in p.eager_calls}  # round -> its eager start x_m
        for r in (2, 3):
            spec, restart = [run for run in p.runs if run["round"] == r]
            assert spec["stopped"] and spec["batch"] != restart["batch"]  # the speculative steps were aborted
            assert restart["batch"] == ((16, 8) if r == 2 else (8, 8))  # the plan's shape
            # both began on the own start (the restart reloaded it), and the update is from the restart's steps
            assert torch.equal(spec["start"], starts[r]) and torch.equal(restart["start"], starts[r])
            assert torch.equal(p.pushed[r], starts[r] - restart["end"])
            assert not torch.equal(restart["end"], spec["end"])
        for r in (1, 4):
            (only,) = [run for run in p.runs if run["round"] == r]  # adopted: one run, not restarted
            assert torch.equal(only["start"], starts[r]) and torch.equal(p.pushed[r], starts[r] - only["end"])
    for r in range(rounds):
        assert len({p.drv.history[r].digest for p in peers}) == 1, f"round {r}: digests differ"


class _SignalledTarget:
    """Builds a StepTarget whose :meth:`wait_final` sets ``waiting`` first (the test's view of the loop)."""

    @staticmethod
    def make(inner_steps, deadline, waiting: threading.Event):
        from geomesh_p2p.model.training import StepTarget

        class T(StepTarget):
            def wait_final(self, timeout_s):
                waiting.set()
                return super().wait_final(timeout_s)

        return T(inner_steps, deadline, provisional=True)


@pytest.mark.parametrize("then", ["raise", "release", "deadline"])
def test_steps_that_reach_a_provisional_target_wait_for_the_plans(then):
    """Speculative steps reach round r's count before round r + 1's plan: the real InnerTrainer waits at the
    provisional target and goes on to the plan's count once it is set (before the fix the run ended there:
    the plan's extra steps were lost); released (aborted) or past its deadline, it ends at the count reached.
    The wait is not counted as compute."""
    import concurrent.futures

    from geomesh_p2p.net.swarm_time import swarm_time
    from tests.unit.test_lr_schedule import _trainer

    torch.set_num_threads(1)
    trainer = _trainer("p")
    waiting = threading.Event()
    # "deadline": far enough for the 2 steps under load (at 0.5 s a loaded CI host did 1 step before it), then
    # it passes during the wait at the provisional target
    deadline = swarm_time() + (8.0 if then == "deadline" else 60.0)
    target = _SignalledTarget.make(2, deadline, waiting)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        fut = pool.submit(
            lambda: trainer.run(round=0, inner_steps=2, batch_size=1, target=target, should_stop=lambda: False)
        )
        fut.add_done_callback(lambda _: waiting.set())  # without the wait the run just ends: seen as well
        assert waiting.wait(30)
        if then == "raise":
            target.set(5, deadline)
        elif then == "release":
            target.release()
        res = fut.result(30)
        wall = time.perf_counter() - t0
    assert res.steps_done == (5 if then == "raise" else 2)
    assert target.waited_s > 0 and target.waiting_since is None
    assert target.provisional == (then == "deadline")  # past its deadline nobody made it final
    assert res.compute_s <= wall - target.waited_s + 1e-6


class StartTrackingPeer(EagerPeer):
    """EagerPeer that notes, at each eager start, whether the previous round's own start (the tensor
    eager_start returned then) is still alive somewhere in the driver."""

    def __init__(self, swarm, ident, rounds: int):
        super().__init__(swarm, ident, rounds)
        self.prev_start = None  # weakref of the last start returned
        self.prev_alive: list[bool] = []

    def eager_start(self, delta, weight):
        import gc
        import weakref

        if self.prev_start is not None:
            # Only a reference that stays counts: not a dropped frame's cycle waiting for the collector, nor
            # the executor's work item that handed the start to pseudo_gradient_from (a worker thread drops
            # it right after setting the call's result; under load the loop can get here first, seen at
            # load ~7). Held past 2 s is the context keeping it.
            for _ in range(200):
                gc.collect()
                if self.prev_start() is None:
                    break
                time.sleep(0.01)
            self.prev_alive.append(self.prev_start() is not None)
        x = super().eager_start(delta, weight)
        self.prev_start = weakref.ref(x)
        return x


async def test_the_own_start_is_released_before_the_next_eager_start_allocates():
    """Review (memory at 124M parameters): round r's own start x_m^r is needed until round r's update
    x_m^r − y_m^r is computed, not while the exchange runs. Before the fix the round's context kept it
    through the next eager start, one more [P] (0.5 GB at 124M) on top of that call's three."""
    swarm, rounds = trd.Swarm(), 5
    peers = _three(StartTrackingPeer, swarm, rounds)
    await trd._run_all(peers, rounds=rounds, min_peers=3)
    for p in peers:
        # Under load (CI at ~10) a peer can fall a round or two behind and catch up by a download, which trains
        # no row: the rows it did train are eager from round 1 on, and that is what this test needs (one eager row
        # after the first is enough: session 35's suite, with 16 peer processes beside it, left a peer 2 rows).
        steps = [row.extra["eager"]["steps"] for row in p.drv.history]
        assert steps[0] == "global" and len(steps) >= 2 and set(steps[1:]) == {"adopted"}, steps
        # every eager start after the first found its predecessor's own start gone
        assert len(p.prev_alive) >= 1 and not any(p.prev_alive), p.prev_alive


async def test_cancelling_the_driver_while_it_waits_for_adopted_steps_stops_their_thread():
    """Review: train() takes the speculative steps out of the driver (``_spec``) and awaits their task. A
    cancellation there (the node's task cancelled, a second Ctrl+C) reached neither their abort nor
    run()'s final drop, so the worker thread went on training the model up to its deadline (here 20 s;
    a window at real scale) while the process shut down. Now it is aborted and ends at its next step."""
    from geomesh_p2p.round.context import RoundContext, Speculative
    from geomesh_p2p.model.training import StepTarget

    swarm = trd.Swarm()
    p = EagerPeer(swarm, trd.Identity.generate(), rounds=5)
    trd.PEERS[p.me], trd.PEER_INDEX[p.me] = p, 0
    swarm.records[p.me] = p.record()
    drv = p.driver()
    plan = trd.plan_round(
        [p.record()],
        trd.CFG,
        run_id=trd.RUN,
        round=0,
        leader=p.me,
        numel=trd.NUMEL,
        start_time=time.time(),
        start_digest=p.digest,
    )
    a = plan.assignment(p.me)
    started, ended = threading.Event(), threading.Event()
    spec = Speculative(
        round=0,
        start=p.model.clone(),
        batch_size=a.batch_size,
        micro_batch=a.micro_batch,
        target=StepTarget(a.inner_steps, time.time() + 20.0, provisional=True),
        abort=threading.Event(),
        weight=1.0,
        t_start=time.time(),
    )

    def steps():  # speculative steps that run until aborted or stopped (at most 20 s)
        started.set()
        try:
            t0 = time.monotonic()
            while not (p.stop.is_set() or spec.abort.is_set()) and time.monotonic() - t0 < 20.0:
                time.sleep(0.002)  # one emulated step
        finally:
            ended.set()
        return SimpleNamespace(steps_done=1, tokens=1, mean_loss=3.0, last_loss=3.0, compute_s=0.0)

    spec.task = asyncio.ensure_future(asyncio.to_thread(steps))
    drv._spec = spec
    ctx = RoundContext(round=0, t_round=time.time(), members=[p.record()], plan=plan)
    train = asyncio.ensure_future(drv.train(ctx))
    assert await asyncio.to_thread(started.wait, 10)
    await asyncio.sleep(0)  # one loop turn: train() runs to its await of the adopted steps
    assert drv._spec is None and not train.done() and not spec.target.provisional  # adopted, awaited
    train.cancel()
    with pytest.raises(asyncio.CancelledError):
        await train
    await drv._drop_speculative("the run ends")  # what run()'s finally does
    assert await asyncio.to_thread(ended.wait, 5.0), "the speculative thread outlived the cancelled driver"
    assert spec.abort.is_set() and not spec.target.provisional
