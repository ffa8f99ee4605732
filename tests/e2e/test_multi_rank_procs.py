"""One peer on 2 gloo ranks (``--local-devices cpu,cpu``, issue 30) trains with one-rank peers; killing one of
its ranks makes it leave while the others keep training.

A process test because the point is the processes: rank 0 starts its follower itself, the ranks form a
torch.distributed group, and a dead rank must end the peer (exit status 1, one ERROR line) without a hang or an
orphan. ``--method diloco`` plans every peer the same steps, so the tokens are exact: the 2-rank peer trains
each device's batch on each of its ranks, twice the one-rank peer's tokens in every round both complete. The same
with ``--shard`` (the ranks train an FSDP2 model): the same digests as a one-rank peer, both exit 0, no orphan. And
without ``--shard`` under a ``--memory-budget-gb`` too small for a whole copy per rank but enough sharded: the peer
shards by itself (one INFO line with the bytes) and trains with a one-rank peer; below even the shard it is
refused at start (exit 2, one line). And with the default ``--rank-sync auto``, on CPU ranks ``round`` (each rank
steps alone, the ranks meet once a round): one peer to the swarm, the same digests, twice the tokens.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from geomesh_p2p.model.build import count_params
from tests.swarm_util import FAST, ProcSwarm

RANKS = ["--local-devices", "cpu,cpu"]
COMMON = ["--method", "diloco", "--uniform-inner-steps", "2", "--min-peers", "3"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.timeout(180)
def test_two_rank_peer_trains_and_a_dead_rank_makes_it_leave(tmp_path: Path) -> None:
    sw = ProcSwarm(tmp_path)
    try:
        entry = sw.start_peers(["b", "c"], *COMMON, "--rounds", "6")
        # DDP (a meeting every step), as on a box of GPUs; the default on CPU ranks is tested below
        sw.peer("a", *COMMON, *RANKS, "--rank-sync", "step", bootstrap=entry)

        def shared() -> int:  # rounds "a" trained that b and c both trained too
            rounds = {n: {r["round"] for r in sw.rows(n)} for n in "bc"}
            return sum(r["round"] in rounds["b"] and r["round"] in rounds["c"] for r in sw.rows("a"))

        # three rounds, two of them with both others, then one rank of "a" dies (under the suite's load a one-rank
        # peer may sit a round out: the fresh-clone run of session 35 killed it after 1 shared round of 3)
        sw.wait_for(lambda: len(sw.rows("a")) >= 3 and shared() >= 2, 150, "a to train 3 rounds, 2 with b and c")
        follower = _children(sw.procs["a"].pid)
        assert len(follower) == 1, follower
        os.kill(follower[0], signal.SIGKILL)
        assert sw.wait_exit(["a"], 60) == {"a": 1}
        gone = sw.procs.pop("a")  # exited: the swarm's waits below watch the others only
        assert sw.wait_exit(["b", "c"], 120) == {"b": 0, "c": 0}
        # no orphan: the follower is gone with its peer
        assert gone.returncode == 1 and not Path(f"/proc/{follower[0]}").exists()
    finally:
        sw.stop_all(10)
    a, b, c = (sw.rows(n) for n in "abc")
    by_round = {n: {r["round"]: r for r in rows} for n, rows in (("a", a), ("b", b), ("c", c))}
    # every round a trained: the same digest as the others that trained it (under load a one-rank peer may be
    # planned out of a round and re-sync after it: a fresh-clone run of session 31 had b out of round 0)
    for rnd, ra in by_round["a"].items():
        others = [by_round[n][rnd]["digest"] for n in "bc" if rnd in by_round[n]]
        assert others and all(d == ra["digest"] for d in others), rnd
    assert sum(rnd in by_round["b"] and rnd in by_round["c"] for rnd in by_round["a"]) >= 2, by_round
    # the 2-rank peer's batch is twice the one-rank peers', and so are its tokens when both did every step
    assert all(r["batch_size"] == 2 * by_round["b"][r["round"]]["batch_size"] for r in a if r["round"] in by_round["b"])
    full = [
        r["round"]
        for r in a
        if r["round"] in by_round["b"] and _trained_fully(r) and _trained_fully(by_round["b"][r["round"]])
    ]
    assert full, a
    assert all(by_round["a"][x]["tokens"] == 2 * by_round["b"][x]["tokens"] for x in full)
    # after a left, b and c trained on together and agree
    after = [x for x in by_round["b"] if x > max(by_round["a"])]
    assert after and all(by_round["b"][x]["digest"] == by_round["c"][x]["digest"] for x in after)
    assert any(by_round["b"][x]["peers"] == 2 for x in after)
    log = sw.text("a")
    assert log.count("this peer's ranks failed") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


SEQ_LEN = int(FAST[FAST.index("--seq-len") + 1])  # the test peers' sequence length


def _trained_fully(row: dict) -> bool:
    """Whether a row's peer trained every planned step on every rank: its tokens are ``H x batch x seq_len``.
    Not ``inner_steps_done == planned``: a multi-rank peer reports its ranks' tokens in steps rounded up, so a rank
    that stopped a step short at the deadline still reads 2/2 (one CI run: 384 of 512 tokens)."""
    return row["inner_steps_planned"] > 0 and row["tokens"] == row["inner_steps_planned"] * row["batch_size"] * SEQ_LEN


def _two_rank_peer_with_a_one_rank_peer(tmp_path: Path, *flags: str) -> str:
    """A 2-rank peer started with ``flags`` and a one-rank peer train 3 rounds of diloco together (2 steps each):
    both exit 0, the follower is gone, the digests agree every round, and the 2-rank peer's batch and (in rounds
    both trained fully) tokens are twice the other's. Returns the 2-rank peer's log."""
    common = ["--method", "diloco", "--uniform-inner-steps", "2", "--min-peers", "2", "--rounds", "3"]
    sw = ProcSwarm(tmp_path)
    try:
        entry = sw.start_peers(["b"], *common)
        sw.peer("a", *common, *RANKS, *flags, bootstrap=entry)
        sw.wait_for(lambda: len(sw.rows("a")) >= 1, 90, "a to train a round")
        follower = _children(sw.procs["a"].pid)
        assert len(follower) == 1, follower
        assert sw.wait_exit(["a", "b"], 90) == {"a": 0, "b": 0}
        assert not Path(f"/proc/{follower[0]}").exists()
    finally:
        sw.stop_all(10)
    a = {r["round"]: r for r in sw.rows("a")}
    b = {r["round"]: r for r in sw.rows("b")}
    # the logs' ends, so that a failure under CI load says what happened (one did: a had only round 0)
    tails = f"\n--- a ---\n{sw.text('a')[-5000:]}\n--- b ---\n{sw.text('b')[-3000:]}"
    # both trained every round, or one was planned out of a round by the no-part penalty of a push the load made late
    # (f24960e: it re-syncs, and the other's row of it counts a plan of 1); a skipped or forked round fails
    both = sorted(set(a) & set(b))
    assert sw.plan_problems(["a", "b"], range(3)) == [] and both, tails
    assert all(a[x]["digest"] == b[x]["digest"] for x in both), tails
    assert len({x["digest"] for x in [*a.values(), *b.values()]}) == 3  # and they moved
    assert all(a[x]["batch_size"] == 2 * b[x]["batch_size"] for x in both)
    # tokens 2x in the rounds both trained fully (under load a deadline can cut every round short: then none). Both
    # trained in some round; not in every one: a CI run's one-rank peer trained 0 of 2 steps in round 0's 0.4 s window
    assert any(a[x]["tokens"] > 0 and b[x]["tokens"] > 0 for x in both), tails
    full = [x for x in both if _trained_fully(a[x]) and _trained_fully(b[x])]
    assert all(a[x]["tokens"] == 2 * b[x]["tokens"] for x in full), tails
    log = sw.text("a")
    assert "rank 1 of 2 on cpu: following" in log
    assert "Traceback" not in log and "ranks failed" not in log, log[-3000:]
    return log


@pytest.mark.timeout(120)
def test_sharded_two_rank_peer_trains_with_a_one_rank_peer(tmp_path: Path) -> None:
    log = _two_rank_peer_with_a_one_rank_peer(tmp_path, "--shard")
    assert "the model sharded over them (FSDP2, --shard)" in log


@pytest.mark.timeout(120)
def test_independent_two_rank_peer_trains_with_a_one_rank_peer(tmp_path: Path) -> None:
    """--rank-sync auto (the default) on CPU ranks, which share the cores: the ranks step alone and meet once a
    round; the peer is one peer to the swarm."""
    log = _two_rank_peer_with_a_one_rank_peer(tmp_path)
    assert "meeting once a round (--rank-sync auto)" in log


def _needs(text: str) -> tuple[int, int]:
    """(sharded, whole copy) bytes per rank from a refused start's one line (choose_sharding's message)."""
    sharded = re.search(r"sharded over 2 ranks it needs ([\d,]+) ", text)
    whole = re.search(r"a whole copy needs ([\d,]+) ", text)
    assert sharded and whole, text[-3000:]
    return int(sharded.group(1).replace(",", "")), int(whole.group(1).replace(",", ""))


# Opt-in: its budget must sit between the sharded and the whole-copy need per rank, a gap of p = 49 MB for the
# small preset on 2 ranks, while the profile's first step adds 40-60 MB of transient RSS that varies with the
# host's load (two fresh-clone CI runs of session 14 refused the start in the profile: "predicted peak of one
# sequence ... 0.86 GiB" against a 0.854 GiB budget). The decision itself is tested with exact bytes in
# tests/unit/test_auto_shard.py (and the node's start path with stand-ins there).
_MEMORY_EDGE = os.environ.get("GEOMESH_MEMORY_EDGE_TESTS") == "1"


@pytest.mark.skipif(
    not _MEMORY_EDGE, reason="a budget window of ~49 MB against a load-dependent RSS: GEOMESH_MEMORY_EDGE_TESTS=1"
)
@pytest.mark.timeout(150)
def test_a_two_rank_peer_shards_by_itself_when_a_whole_copy_does_not_fit(tmp_path: Path) -> None:
    # The small preset (12.3M parameters): a whole copy's AdamW state and a 2-rank shard's differ by one copy of
    # the weights (47 MiB), more than what the profile predicts for a sequence in a fresh process (~35 MiB at
    # seq_len 32: its first step's one-time allocations count), so a budget can fall between.
    common = ["--model", "small", "--method", "diloco", "--uniform-inner-steps", "1", "--min-peers", "2"]
    common += ["--rounds", "1", "--target-batch", "1", "--speed-factor", "1"]
    sw = ProcSwarm(tmp_path)
    try:
        # 1. a budget below even the sharded state: refused at start in one line (exit 2), naming the flag; its
        # bytes (the memory in use now is this machine's) place the next budget between sharded and whole
        sw.peer("a0", *common, *RANKS, "--memory-budget-gb", "0.5")
        assert sw.wait_exit(["a0"], 60) == {"a0": 2}
        sw.procs.pop("a0")  # exited: the swarm's waits below watch the others only
        refused = sw.text("a0")
        assert "not even sharded" in refused and "--memory-budget-gb 0.5 is divided by the ranks" in refused
        assert "Traceback" not in refused, refused[-3000:]
        sharded, whole = _needs(refused)
        # fp32 AdamW: a whole copy counts gradients + 2 moments (3 x 4P bytes), a shard half of weights,
        # gradients and moments (4 x 4P / 2): they differ by 4P bytes
        assert whole - sharded == 4 * count_params("small", vocab_size=4096)
        # 2. a budget per rank 2 MiB below the whole copy's need (the memory in use varies by ~0.1 MiB between
        # starts), the rest left above the sharded need for a sequence: the peer shards by itself and trains with
        # a one-rank peer
        per_rank = whole - (2 << 20)
        entry = sw.start_peers(["a"], *common, *RANKS, "--memory-budget-gb", repr(2 * per_rank / 2**30))
        sw.peer("b", *common, bootstrap=entry)
        assert sw.wait_exit(["a", "b"], 90) == {"a": 0, "b": 0}
    finally:
        sw.stop_all(10)
    a = {r["round"]: r for r in sw.rows("a")}
    b = {r["round"]: r for r in sw.rows("b")}
    assert sorted(a) == sorted(b) == [0] and a[0]["digest"] == b[0]["digest"]
    assert a[0]["batch_size"] == 2 * b[0]["batch_size"] and a[0]["inner_steps_done"] == b[0]["inner_steps_done"] == 1
    assert a[0]["tokens"] == 2 * b[0]["tokens"] > 0
    log = sw.text("a")
    line = re.search(
        r"a whole copy needs [\d.]+ GiB per rank \(([\d,]+) bytes\), a rank's budget is [\d.]+ GiB "
        r"\(([\d,]+) bytes\): training sharded over 2 ranks \(FSDP2\)",
        log,
    )
    assert line, log[-3000:]
    need, budget = (int(g.replace(",", "")) for g in line.groups())
    assert need >= budget and abs(budget - per_rank) <= 1
    assert log.count("training sharded over 2 ranks") == 1 and "following rank 0, the model sharded (FSDP2)" in log
    # the profile's line: it counted the shard
    assert "x 2 ranks (the peer's batches and tokens/s: 2 x rank 0's profile) (sharded, FSDP2)" in log
    assert "Traceback" not in log and not re.search(r"^\S+ E ", log, re.M), log[-3000:]
