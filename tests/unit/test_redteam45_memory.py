"""Red team, session 45: ``join``'s start-up check of ``--memory-budget-gb`` (peer/node_cli.py ``check_memory``) for a
multi-rank peer. The check at start is a lower bound of the node's own (``build_training``): it must never refuse a
budget the node would train in. A multi-rank peer's node checks one rank's share of the budget, whole copy or sharded
(``choose_rank_training``), never the whole run against one rank's device."""

from __future__ import annotations

import pytest
import torch

import geomesh_p2p.model.profile
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.model.build import count_params
from geomesh_p2p.model.run_memory import choose_sharding
from geomesh_p2p.node.training import run_memory
from geomesh_p2p.util.errors import UserFacingError
from peer.node_cli import check_memory

pytestmark = pytest.mark.timeout(60)


def _two_gpus(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_two_gpus_that_hold_the_model_only_sharded_start_past_the_check(monkeypatch):
    """``--local-devices cuda:0,cuda:1``: a budget of one GPU below a whole copy's need and above the sharded need
    trains sharded (the node turns sharding on by itself, or with ``--shard``); the check at start refused it with
    the whole run's static memory on one GPU."""
    _two_gpus(monkeypatch)
    monkeypatch.setattr(geomesh_p2p.model.profile, "memory_in_use", lambda device: 0)
    run = RunConfig(model="tiny")
    n = count_params("tiny", vocab_size=run.vocab_size)
    p = 4 * n
    est = run_memory(run, NodeConfig(), n)
    opt = sum(i.bytes for i in est.items if i.name == "inner optimizer state")

    def rank_need(budget: int, shard: bool) -> bool:  # the node's own check (choose_rank_training): rank 0 holds p
        try:
            choose_sharding(p, p, budget, 2, shard=shard, optimizer_bytes=opt, extra_bytes=est.profile_extra("cuda"))
        except ValueError:
            return False
        return True

    sharded_need = p + -(-(2 * p + opt) // 2) + est.profile_extra("cuda")
    whole_need = p + p + opt + est.profile_extra("cuda")
    assert sharded_need < whole_need
    budget = (sharded_need + whole_need) // 2  # fits sharded, not a whole copy
    assert rank_need(budget, False) and rank_need(budget, True) and est.total("cuda") >= budget
    for shard in (False, True):
        cfg = NodeConfig(local_devices=["cuda:0", "cuda:1"], memory_budget_bytes=budget, shard=shard)
        check_memory(run, cfg)  # no refusal: the node trains it sharded


def test_cpu_ranks_are_left_to_the_nodes_check_per_rank(monkeypatch):
    """``--local-devices cpu,cpu`` under a budget the whole run's estimate and this process's RSS exceed: left to the
    node, which refuses it in one line with what a rank needs whole and sharded (tests/e2e/test_multi_rank_procs.py
    reads those bytes); the check at start refused it with the whole run's bytes, saying nothing of the shard."""
    _two_gpus(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(geomesh_p2p.model.profile, "memory_in_use", lambda device: 500 * 2**20)
    run = RunConfig(model="tiny")
    budget = 2**29  # 0.5 GiB: below the 500 MiB in use + the estimate of a verified-work run
    n = count_params("tiny", vocab_size=run.vocab_size)
    assert run_memory(run, NodeConfig(), n).total("cpu") + 500 * 2**20 >= budget
    check_memory(run, NodeConfig(local_devices=["cpu", "cpu"], memory_budget_bytes=budget))
    # one device: refused at start, as before
    with pytest.raises(UserFacingError, match="--memory-budget-gb"):
        check_memory(run, NodeConfig(device="cpu", memory_budget_bytes=budget))


def test_an_unreadable_rss_is_no_traceback_at_start(monkeypatch):
    """Where this process's RSS cannot be read (no /proc/self/statm), the check at start counts the estimate alone
    (``join_inputs`` reports ValueError and UserFacingError in one line; an OSError was a traceback)."""

    def unreadable(device):
        raise OSError("/proc/self/statm is not readable: cannot measure RSS on this system")

    monkeypatch.setattr(geomesh_p2p.model.profile, "memory_in_use", unreadable)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = RunConfig(model="tiny")
    check_memory(run, NodeConfig(device="cpu", memory_budget_bytes=2**30))
    with pytest.raises(UserFacingError, match="--memory-budget-gb"):
        check_memory(run, NodeConfig(device="cpu", memory_budget_bytes=2**20))
