"""A peer's command registers the heap freeze that spares its exit the full collections over imported modules
(geomesh_p2p/util/exit_gc.py), once per process, and the handler leaves the heap frozen for finalization; so do
the other programs whose exit something waits for (a self-started follower rank, the tests' attacker, the DHT tool)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

import geomesh_p2p.dht.__main__ as dht_tool
import peer.cli
from geomesh_p2p.node import ranks
from geomesh_p2p.util import exit_gc
from tests import adversary

pytestmark = pytest.mark.timeout(60)


def test_main_registers_the_freeze_once(monkeypatch, capsys):
    registered: list = []
    monkeypatch.setattr(exit_gc, "_installed", False)
    monkeypatch.setattr(exit_gc.atexit, "register", registered.append)
    assert peer.cli.main([]) == 0  # no command: prints the help
    assert peer.cli.main([]) == 0
    capsys.readouterr()
    assert registered == [exit_gc.freeze_heap]


def test_the_heap_is_frozen_when_the_interpreter_finalizes():
    # A probe registered before the freeze runs after it (atexit is last-in-first-out) and prints how many
    # objects the collections of Py_FinalizeEx will skip; without the handler that count is 0.
    code = textwrap.dedent(
        """
        import atexit, gc
        atexit.register(lambda: print("frozen", gc.get_freeze_count(), flush=True))
        from geomesh_p2p.util import exit_gc
        exit_gc.skip_exit_collections()
        exit_gc.skip_exit_collections()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    frozen = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("frozen")]
    assert len(frozen) == 1 and frozen[0] > 1000, out
    assert out.stderr == ""


def _follower_main(monkeypatch) -> int:
    """A self-started follower rank's entry (what ``LocalRanks`` runs with ``python -c``), its work stubbed out:
    rank 0's close() waits for that process to exit."""
    spec = ranks.FollowerSpec(
        rank=1, world=2, device="cpu", init_method="file:///nowhere", timeout_s=1.0, run={},
        model_config_file=None, threads=1, speed_factor=1.0, amp=False,
    )  # fmt: skip
    monkeypatch.setenv(ranks.SPEC_ENV, json.dumps(dataclasses.asdict(spec)))
    monkeypatch.setattr(ranks, "run_follower", lambda s: 7 if s == spec else 1)
    monkeypatch.setattr(ranks.signal, "signal", lambda *a: None)  # pytest keeps its SIGINT handler
    monkeypatch.setattr(ranks.logging, "basicConfig", lambda **kw: None)
    return ranks.worker_main()


@pytest.mark.parametrize(
    "entry, status",
    [
        (_follower_main, 7),
        (lambda mp: adversary.main(["list"]), 0),  # the attackers of the e2e attack tests
        (lambda mp: dht_tool.main(["--put", "novalue"]), 2),  # python -m geomesh_p2p.dht: refused before any dial
    ],
    ids=["follower-rank", "adversary", "dht-tool"],
)
def test_other_process_entry_points_register_the_freeze(monkeypatch, capsys, entry, status):
    # each is a process holding torch's or grpc's ~200,000-400,000 objects, and something waits for its exit
    registered: list = []
    monkeypatch.setattr(exit_gc, "_installed", False)
    monkeypatch.setattr(exit_gc, "_armed", False)  # the follower's entry arms it: undone after (red team 44)
    monkeypatch.setattr(exit_gc.atexit, "register", registered.append)
    assert entry(monkeypatch) == status
    capsys.readouterr()
    assert registered == [exit_gc.freeze_heap]


def test_a_self_started_follower_rank_arms_the_start_up_freeze(monkeypatch, capsys):
    """A follower rank started by ``LocalRanks`` is always its own process: it freezes its start-up heap once its
    model is built (session 44: only rank 0, the node's process, did)."""
    monkeypatch.setattr(exit_gc, "_installed", False)
    monkeypatch.setattr(exit_gc.atexit, "register", lambda f: None)
    monkeypatch.setattr(exit_gc, "_armed", False)
    assert _follower_main(monkeypatch) == 7
    assert exit_gc._armed is True


def test_a_follower_rank_freezes_once_its_model_and_trainer_are_built(monkeypatch):
    """:func:`ranks.run_follower` freezes after the model and its trainer are built, before it follows rank 0's
    steps (a full collection over the start's objects holds its step, and every rank's all-reduce waits for it);
    only when armed (never in a test that calls it)."""
    import gc

    import torch

    from geomesh_p2p.config.models import RunConfig

    frozen: list = []
    did: list = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(gc.get_count()))
    monkeypatch.setattr(exit_gc, "_armed", False)

    class Channel:
        setup_shard = False

        def wait_setup(self) -> int:
            return 64

        def close(self, exit_followers: bool) -> None:
            did.append("close")

    class Trainer:
        def __init__(self, model, *args, **kwargs):
            did.append("trainer")

        def follow(self) -> int:
            did.append(("follow", len(frozen)))
            return 0

    monkeypatch.setattr(ranks.RankChannel, "init", staticmethod(lambda *a, **k: Channel()))
    monkeypatch.setattr(ranks, "RankedTrainer", Trainer)
    monkeypatch.setattr(ranks, "trainer_kwargs", lambda run, cfg: {})
    spec = ranks.FollowerSpec(
        rank=1, world=2, device="cpu", init_method="file:///nowhere", timeout_s=1.0, run=RunConfig().model_dump(),
        model_config_file=None, threads=None, speed_factor=1.0, amp=False,
    )  # fmt: skip

    def build(*args, **kwargs):
        did.append("model")
        return torch.nn.Linear(2, 2)

    assert ranks.run_follower(spec, build) == 0  # not armed: a test's call never freezes
    assert frozen == [] and did == ["model", "trainer", ("follow", 0), "close"]
    did.clear()
    exit_gc.arm_startup_freeze()
    assert ranks.run_follower(spec, build) == 0
    assert len(frozen) == 1 and did == ["model", "trainer", ("follow", 1), "close"]
    assert exit_gc._armed is False  # once
