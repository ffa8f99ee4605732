"""One rank of a multi-rank trainer in its own OS process, for tests/e2e/test_rank_trainer.py (issue 30).

    python tests/rank_worker.py RANK WORLD INIT_METHOD SCENARIO OUT

Rank 0 runs :class:`RankedTrainer` inner steps on :class:`FakeData` (3 steps of batch 5, micro-batch 2: an
uneven split over 2 ranks), the followers :meth:`RankedTrainer.follow`. Every rank writes ``OUT.rank<R>.pt``:
its flat weights and its AdamW ``exp_avg`` after the steps, and (rank 0) the InnerResult and the failures
seen. SCENARIO ``die``: rank 1 exits (``os._exit(9)``) on its second STEP; rank 0 must return the one step done.
``rank0dies``: rank 0 exits (``os._exit(9)``) after one step; the follower must see it and exit 1.
``shard``: two runs ("rounds", the second from other weights) of a DDP trainer, then the same of a sharded
(FSDP2) one, on one channel; every rank writes its per-parameter local sizes, its bytes of parameters, gradients
and AdamW state (measured before the last optimizer step of each trainer) and rank 0 each run's pseudo-gradient.
``shard_die``: a sharded trainer whose rank 1 exits on its second STEP.
``independent``: two runs of a ``--rank-sync round`` trainer (each rank its rows alone, weights averaged at the
end); ``independent_die``: its rank 1 exits at its second step of the first run.
"""

from __future__ import annotations

import os
import sys

import torch

from geomesh_p2p.model import ranks as ranks_mod
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.rank_channel import EXIT, Command, RankChannel
from geomesh_p2p.model.ranks import NoData, RankedTrainer

VOCAB, SEQ, STEPS, BATCH, MICRO = 64, 16, 3, 5, 2
KWARGS = dict(seq_len=SEQ, lr=1e-3, warmup_steps=0, total_steps=100, seed=0)


class FakeData:
    """Deterministic token rows: the batch of ``(round, step)`` from a seeded generator."""

    vocab_size = VOCAB

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):
        g = torch.Generator().manual_seed(1000 * round + step + seed)
        return torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)


def model():
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=VOCAB, seed=0)


def exp_avg(trainer) -> torch.Tensor:
    st = trainer.optimizer.state
    return torch.cat([st[p]["exp_avg"].reshape(-1) for p in trainer.model.parameters() if p in st])


def reference() -> dict:
    """The same steps on one process (InnerTrainer): what the ranks must reproduce."""
    from geomesh_p2p.model.training import InnerTrainer

    t = InnerTrainer(model(), FakeData(), **KWARGS)
    res = t.run(round=0, inner_steps=STEPS, batch_size=BATCH, micro_batch=MICRO)
    return {"flat": flat_params(t.model), "exp_avg": exp_avg(t), "steps": res.steps_done, "loss": res.mean_loss}


def _measure_at_first_step(t: RankedTrainer, into: dict) -> None:
    """Record ``t.memory_bytes()`` (gradients present) just before each optimizer step of ``t``."""
    real = t.optimizer.step

    def step(*a, **k):
        into.update(t.memory_bytes())  # the last step's: its gradients and the state of the steps before it
        return real(*a, **k)

    t.optimizer.step = step  # type: ignore[method-assign]


def _local_sizes(t: RankedTrainer) -> dict:
    """Per trained parameter: its global numel, this rank's numel, this rank's AdamW exp_avg numel."""
    out = {}
    for p in t._trained_parameters():
        loc = p.to_local() if hasattr(p, "to_local") else p
        m = t.optimizer.state[p]["exp_avg"]
        out[len(out)] = (p.numel(), loc.numel(), (m.to_local() if hasattr(m, "to_local") else m).numel())
    return out


#: The ``shard`` scenario's trainers, one after the other on one channel: (name, sharded, grad clip, micro-batch).
#: Without a clip and with one micro-batch per step a sharded step is DDP's bit for bit; with them, not quite.
SHARD_CASES = [
    ("ddp", False, 0.0, None),
    ("fsdp", True, 0.0, None),
    ("ddp_clip", False, 1.0, MICRO),
    ("fsdp_clip", True, 1.0, MICRO),
]


def _die_at_second_step(t: RankedTrainer) -> None:
    """Make follower ``t`` exit (code 9, no cleanup: a dead rank) at the second inner step it is told to run."""
    real, n = t._follow_step, {"steps": 0}

    def dying(cmd, batch):
        n["steps"] += 1
        if n["steps"] == 2:
            os._exit(9)
        real(cmd, batch)

    t._follow_step = dying  # type: ignore[method-assign]


def shard_main(rank: int, ch: RankChannel, out: str, die: bool = False) -> int:
    """The ``shard`` / ``shard_die`` scenarios (see the module's docstring)."""
    starts = [flat_params(model()), flat_params(build_model("tiny", vocab_size=VOCAB, seed=1))]
    cases = [("fsdp_clip", True, 1.0, MICRO)] if die else SHARD_CASES
    res: dict = {"rounds": {}, "grad": {}, "mem": {}, "sizes": {}, "failures": []}
    if rank == 0:
        ch.on_failure = res["failures"].append
        ch.start_keepalive(period_s=0.5)
    code = 0
    for name, shard, clip, micro in cases:
        if rank == 0:
            t = RankedTrainer(model(), FakeData(), channel=ch, shard=shard, **KWARGS)
        else:
            assert ch.wait_setup() == VOCAB and ch.setup_shard == shard
            t = RankedTrainer(model(), NoData(VOCAB), channel=ch, shard=ch.setup_shard, **KWARGS)
        t.grad_clip = clip
        res["mem"][name] = {}
        _measure_at_first_step(t, res["mem"][name])
        if rank != 0:
            if die:
                _die_at_second_step(t)
            code = t.follow()
            res["sizes"][name] = _local_sizes(t)
            continue
        for rnd, start in enumerate(starts[: 1 if die else 2]):
            load_flat_(t.model, start)  # the round's global start weights, as the node loads them
            r = t.run(round=rnd, inner_steps=STEPS, batch_size=BATCH, micro_batch=micro)
            res["rounds"][(name, rnd)] = {
                "pg": start - flat_params(t.model),
                "steps": r.steps_done,
                "tokens": r.tokens,
                "loss": r.mean_loss,
                "early": r.stopped_early,
            }
        if not die:
            res["grad"][name] = t.gradient(round=2, batch_size=BATCH, micro_batch=micro)[0]
            res["sizes"][name] = _local_sizes(t)
            ch.send(Command(EXIT))  # the follower's trainer ends; the next SETUP builds the next one
    res["code"] = code
    torch.save(res, f"{out}.rank{rank}.pt")
    ch.close(exit_followers=False)
    return code


class SliceData(FakeData):
    """Rows ``[start, stop)`` of :class:`FakeData`'s ``BATCH``-row batches: one independent rank's share."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):
        return super().sample_batch(
            seed=seed, peer_id=peer_id, round=round, step=step, batch_size=BATCH, seq_len=seq_len
        )[self.start : self.stop]


#: ``independent``: rank 0's rank speeds before its second run (the first splits evenly, 3 + 2), and the rows per
#: rank they give (rank_split: one row each, the 3 others by 1 : 4 with the largest remainder to rank 0)
SECOND_RUN_SPEEDS, SECOND_RUN_SPLIT = [1.0, 4.0], [2, 3]


def independent_reference(splits: list[list[int]]) -> dict:
    """``--rank-sync round`` on one process: one InnerTrainer per rank, each on its rows of every step (``splits``:
    rows per rank, one list per run; micro-batch ``MICRO // ranks``), their weights averaged token-weighted after
    each run and loaded into all of them."""
    from geomesh_p2p.model.training import InnerTrainer

    world = len(splits[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (main()): the kernels' reduction order, hence the bits
    try:
        ts = [InnerTrainer(model(), SliceData(0, 0), **KWARGS) for _ in range(world)]
        out: dict = {"flat": [], "exp_avg": []}
        for rnd, split in enumerate(splits):
            shares = [(sum(split[:r]), sum(split[: r + 1])) for r in range(world)]
            for t, (s, e) in zip(ts, shares):
                t.dataset.start, t.dataset.stop = s, e
            results = [
                t.run(round=rnd, inner_steps=STEPS, batch_size=e - s, micro_batch=MICRO // world)
                for t, (s, e) in zip(ts, shares)
            ]
            total = sum(r.tokens for r in results)
            avg = sum(flat_params(t.model) * (r.tokens / total) for t, r in zip(ts, results))
            for t in ts:
                load_flat_(t.model, avg)
            out["flat"].append(avg)
        out["exp_avg"] = [exp_avg(t) for t in ts]
        return out
    finally:
        torch.set_num_threads(threads)


def independent_main(rank: int, ch: RankChannel, out: str, die: bool = False) -> int:
    """The ``independent`` / ``independent_die`` scenarios (see the module's docstring)."""
    res: dict = {"flat": [], "results": [], "failures": []}
    if rank == 0:
        ch.on_failure = res["failures"].append
        ch.start_keepalive(period_s=0.5)
        t = RankedTrainer(model(), FakeData(), channel=ch, independent=True, **KWARGS)
        for rnd in range(1 if die else 2):
            if rnd == 1:
                t.rank_speeds = list(SECOND_RUN_SPEEDS)
            r = t.run(round=rnd, inner_steps=STEPS, batch_size=BATCH, micro_batch=MICRO)
            res["results"].append(
                {"steps": r.steps_done, "tokens": r.tokens, "loss": r.mean_loss, "early": r.stopped_early}
            )
            res["flat"].append(flat_params(t.model))
        res["speeds"] = t.rank_speeds
        code = 0
        if not die:
            ch.send(Command(EXIT))
    else:
        assert ch.wait_setup() == VOCAB
        t = RankedTrainer(model(), NoData(VOCAB), channel=ch, **KWARGS)
        if die:
            real, n = t._step_batch, {"steps": 0}

            def dying(rnd, step, b):
                n["steps"] += 1
                if n["steps"] == 2:
                    os._exit(9)
                return real(rnd, step, b)

            t._step_batch = dying  # type: ignore[method-assign]
        code = t.follow()
        res["flat"].append(flat_params(t.model))
    res["exp_avg"] = exp_avg(t)
    res["code"] = code
    torch.save(res, f"{out}.rank{rank}.pt")
    ch.close(exit_followers=False)
    return code


def main() -> int:
    rank, world, init, scenario, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback (tests/rank_procs.py)
    torch.set_num_threads(1)
    ch = RankChannel.init(rank, world, "cpu", init, timeout_s=60)
    if scenario in ("shard", "shard_die"):
        return shard_main(rank, ch, out, die=scenario == "shard_die")
    if scenario in ("independent", "independent_die"):
        return independent_main(rank, ch, out, die=scenario == "independent_die")
    failures: list[str] = []
    if rank == 0:
        ch.on_failure = failures.append
        ch.start_keepalive(period_s=0.5)
        t = RankedTrainer(model(), FakeData(), channel=ch, **KWARGS)
        if scenario == "rank0dies":
            t.run(round=0, inner_steps=1, batch_size=BATCH, micro_batch=MICRO)
            os._exit(9)  # mid-run for the follower: it waits for the next command
        res = t.run(round=0, inner_steps=STEPS, batch_size=BATCH, micro_batch=MICRO)
        result = {"steps": res.steps_done, "tokens": res.tokens, "loss": res.mean_loss, "early": res.stopped_early}
        torch.save(
            {"flat": flat_params(t.model), "exp_avg": exp_avg(t), "result": result, "failures": failures},
            f"{out}.rank0.pt",
        )
        ch.close()
        return 0
    assert ch.wait_setup() == VOCAB
    t = RankedTrainer(model(), NoData(VOCAB), channel=ch, **KWARGS)
    if scenario == "die":
        _die_at_second_step(t)
    code = t.follow()
    torch.save({"flat": flat_params(t.model), "exp_avg": exp_avg(t), "code": code}, f"{out}.rank{rank}.pt")
    ch.close(exit_followers=False)
    return code


if __name__ == "__main__":
    assert ranks_mod is not None
    sys.exit(main())
