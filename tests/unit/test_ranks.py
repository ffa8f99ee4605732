"""A peer on several local devices (issue 30) without processes: the command protocol, the batch split, the
peer's figures from one rank's profile, the record's new fields, the planner's multiple-of-ranks batches, and
the flags' checks at start."""

from __future__ import annotations

import argparse

import pytest
import torch

from geomesh_p2p.config.flags import PARSERS
from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.model.rank_channel import (
    EXIT,
    GATHER,
    PING,
    RUN,
    SETUP,
    STEP,
    WEIGHTS,
    Command,
    collective_timeout_s,
    rank_profile,
    split_rows,
)
from geomesh_p2p.model.rank_rounds import independent_ranks, rank_split, update_speeds
from geomesh_p2p.model.ranks import ddp_bucket_cap_mb
from geomesh_p2p.node.ranks import RankLayout, layout_from, layout_from_env
from geomesh_p2p.plan.cost import peer_uniform_micro, rank_micro, uniform_micro
from geomesh_p2p.plan.bounds import bound_records, budget_limit, max_token_share
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled, make_plan, records_needed
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record

PLAN_KW = dict(run_id="run", round=3, leader="a", start_time=1_700_000_000.0, start_digest="d0", numel=10_000)


# ---------------------------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("op", [PING, SETUP, WEIGHTS, STEP, EXIT, GATHER, RUN])
def test_command_round_trips_through_its_tensor(op: int) -> None:
    c = Command(op, round=7, step=3, batch_size=24, micro_batch=8, seq_len=1024, lr=2.5e-4 / 3, arg=1)
    t = c.to_tensor()
    assert t.dtype == torch.float64 and t.shape == (8,)
    assert Command.from_tensor(t) == c  # lr too, bit for bit (a float64 carries it)


def test_command_refuses_unknown_opcodes_and_shapes() -> None:
    with pytest.raises(ValueError, match="opcode"):
        Command.from_tensor(torch.tensor([9.0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    with pytest.raises(ValueError, match="opcode"):
        Command.from_tensor(torch.tensor([1.5, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    with pytest.raises(ValueError, match="8 float64"):
        Command.from_tensor(torch.zeros(7, dtype=torch.float64))


@pytest.mark.parametrize("rows,world", [(8, 2), (5, 2), (7, 3), (1, 2), (0, 4), (16, 1), (3, 8)])
def test_split_rows_tiles_the_micro_batch(rows: int, world: int) -> None:
    parts = [split_rows(rows, world, r) for r in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == rows
    assert all(parts[i][1] == parts[i + 1][0] for i in range(world - 1))  # contiguous, in rank order
    sizes = [e - s for s, e in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_rows_exact_shares() -> None:
    assert [split_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [split_rows(16, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(ValueError):
        split_rows(4, 2, 2)
    with pytest.raises(ValueError):
        split_rows(4, 0, 0)


def test_rank_profile_states_the_peers_sum() -> None:
    tps, mb = rank_profile({4: 1000.0, 8: 1500.0}, 40, 4)
    assert tps == {16: 4000.0, 32: 6000.0} and mb == 160
    assert rank_profile({4: 1000.0}, 40, 1) == ({4: 1000.0}, 40)
    with pytest.raises(ValueError):
        rank_profile({4: 1.0}, 4, 0)


def test_collective_timeout_follows_the_window() -> None:
    assert collective_timeout_s(1.5) == 60.0  # the floor: a step of a large model, a follower's model build
    assert collective_timeout_s(30.0) == 120.0
    assert collective_timeout_s(None) == 300.0


def test_a_cpu_peer_all_reduces_its_gradients_in_one_bucket() -> None:
    # 3,000,000 fp32 = 12,000,000 bytes = 11.44 MiB: 12 MiB holds them all, + 1 MiB (one bucket, one all-reduce)
    model = torch.nn.Linear(3000, 1000, bias=False)
    assert ddp_bucket_cap_mb(model, torch.device("cpu")) == 13
    assert ddp_bucket_cap_mb(torch.nn.Linear(1, 1), torch.device("cpu")) == 2  # 8 bytes
    assert ddp_bucket_cap_mb(model, torch.device("cuda", 0)) is None  # torch's buckets: NCCL overlaps backward


# ---------------------------------------------------------------------------------------------- record
def test_record_without_ranks_is_byte_identical_and_old_json_parses() -> None:
    rec = peer_record("p1", address="h:1")
    data = rec.to_bytes()
    assert b"ranks" not in data and b"rank_memory_bytes" not in data
    back = PeerRecord.from_bytes(data)
    assert back.ranks == 1 and back.rank_memory_bytes is None
    multi = peer_record("p2", address="h:2", ranks=4, rank_memory_bytes=80 << 30, memory_bytes=320 << 30)
    parsed = PeerRecord.from_bytes(multi.to_bytes())
    assert (parsed.ranks, parsed.rank_memory_bytes) == (4, 80 << 30)
    with pytest.raises(ValueError):
        peer_record("p3", ranks=0)
    with pytest.raises(ValueError):
        peer_record("p3", ranks=65)


# ---------------------------------------------------------------------------------------------- planner
def _rec(pid: str, ranks: int, per_rank_tps: dict[int, float], per_rank_max: int) -> PeerRecord:
    tps, mb = rank_profile(per_rank_tps, per_rank_max, ranks)
    return peer_record(
        pid, address=f"{pid}:1", ranks=ranks, tokens_per_s=tps, max_batch=mb, upload_bps=1e8, download_bps=1e8
    )


def test_rank_micro_rounds_to_a_multiple_of_the_ranks() -> None:
    r3 = _rec("x", 3, {4: 100.0}, 8)  # max batch 24
    assert [rank_micro(m, r3) for m in (1, 2, 3, 4, 7, 24)] == [3, 3, 3, 3, 6, 24]
    r1 = _rec("y", 1, {4: 100.0}, 8)
    assert [rank_micro(m, r1) for m in (1, 3, 7)] == [1, 3, 7]
    tight = peer_record("z", address="z:1", ranks=4, max_batch=2)  # (a clamped record) K rows do not fit
    assert rank_micro(2, tight) == 2


def test_uniform_micro_is_per_device() -> None:
    recs = [_rec("a", 2, {4: 100.0}, 6), _rec("b", 1, {4: 100.0}, 16)]  # a: 12 = 2 ranks x 6
    cfg = PlanConfig(seq_len=16, target_batch=8, payload_bytes=1000)
    assert uniform_micro(recs, cfg) == 6
    assert [peer_uniform_micro(6, r) for r in recs] == [12, 6]


@pytest.mark.parametrize("method", ["geomesh", "awb", "diloco", "css"])
def test_plans_give_a_multi_rank_peer_a_multiple_of_its_ranks(method: str) -> None:
    recs = [
        _rec("a2", 2, {4: 1000.0, 8: 1500.0}, 16),
        _rec("b1", 1, {4: 1000.0, 8: 1500.0}, 16),
        _rec("c3", 3, {4: 900.0, 8: 1300.0}, 16),
    ]
    cfg = PlanConfig(seq_len=32, target_batch=6, payload_bytes=10_000, window_s=10.0, method=method)
    plan = make_plan(recs, cfg, **PLAN_KW)
    by = {a.peer_id: a for a in plan.assignments}
    ranks = {r.peer_id: r.ranks for r in recs}
    for pid, a in by.items():
        assert a.batch_size % ranks[pid] == 0 and a.micro_batch % ranks[pid] == 0, (pid, a)
        # target_batch is a floor per device
        assert a.batch_size >= cfg.target_batch * ranks[pid]
    if method in ("diloco", "css"):  # the same rows per device: each rank trains what a one-device peer does
        assert by["a2"].batch_size == 2 * by["b1"].batch_size and by["c3"].batch_size == 3 * by["b1"].batch_size
        assert by["a2"].token_budget == 2 * by["b1"].token_budget
    else:  # same speed per device: the 2-rank peer's step is as long with twice the rows
        assert by["a2"].token_budget >= 1.8 * by["b1"].token_budget
    assert check_plan(plan, {r.peer_id: r for r in recs}, cfg, now=plan.created_at) is None


def test_a_follower_refuses_a_uniform_plan_that_ignores_the_ranks() -> None:
    recs = [_rec("a2", 2, {4: 1000.0}, 16), _rec("b1", 1, {4: 1000.0}, 16)]
    cfg = PlanConfig(seq_len=32, target_batch=4, payload_bytes=10_000, window_s=10.0, method="diloco")
    plan = make_plan(recs, cfg, **PLAN_KW)
    assert [(a.peer_id, a.micro_batch, a.accum_steps) for a in plan.assignments] == [("a2", 8, 1), ("b1", 4, 1)]
    # a leader that plans the 2-rank peer one device's micro-batch (accumulated to its batch) is refused
    rows = [
        a.model_copy(update={"micro_batch": 4, "accum_steps": 2}) if a.peer_id == "a2" else a for a in plan.assignments
    ]
    rogue = plan.model_copy(update={"assignments": rows})
    reason = check_plan(rogue, {r.peer_id: r for r in recs}, cfg, now=plan.created_at)
    assert (
        reason is not None
        and "micro-batch 4; method diloco gives everyone 20 of 4 per device (8 for this peer)" in str(reason)
    )


# The round-0 records of benchmarks/multi_rank.py --speed-factor 1 --other-speed-factor 0.2 --peer-args="--seq-len
# 128 --window-s 6" (/tmp/s17/mrbq): the box's rank profile {4: 6828, 8: 7847} tokens/s, max batch 232 per rank;
# the ordinary peer {4: 1303, 8: 1424}, max batch 256.
BOX_RANK_TPS = {4: 6828.0, 8: 7847.0}
SLOW_TPS = {4: 1303.0, 8: 1424.0}
BENCH_CFG = PlanConfig(seq_len=128, target_batch=8, payload_bytes=181_000, window_s=6.0)


def _plan_rows(plan) -> dict:
    return {a.peer_id: (a.micro_batch, a.accum_steps, a.inner_steps, a.token_budget) for a in plan.assignments}


def test_a_multi_rank_peer_is_bounded_per_device() -> None:
    """Issue 30: the spread caps (tokens/s 8x the lower median, budgets 8x the lower-median budget) are per
    device. The 2-rank box (15,694 tokens/s, 11x the slow peer) was clamped to 8 x 1424 = 11,392 tokens/s and
    capped at 8 x 8192 tokens: 32 steps of 16 in a 5.86 s window (4.2 s of compute at its rate), where two
    one-rank peers on the same cores (5.5x each) got 44 steps of 8 each. Now it gets what they get together."""
    box = _rec("box", 2, BOX_RANK_TPS, 232)
    other = _rec("other", 1, SLOW_TPS, 256)
    assert bound_records([box, other]) == [box, other]  # 15,694 <= 2 x 8 x 1424: no claim clamped
    plan = make_plan([box, other], BENCH_CFG, **PLAN_KW)
    assert _plan_rows(plan) == {"box": (16, 1, 44, 90_112), "other": (8, 1, 8, 8_192)}
    assert plan.window_s == pytest.approx(5.8564, abs=1e-4)  # 8 steps of the slow peer + its exchange
    one_rank = make_plan(
        [_rec("box1", 1, BOX_RANK_TPS, 232), _rec("box2", 1, BOX_RANK_TPS, 232), other], BENCH_CFG, **PLAN_KW
    )
    assert _plan_rows(one_rank) == {
        "box1": (8, 1, 44, 45_056),
        "box2": (8, 1, 44, 45_056),
        "other": (8, 1, 8, 8_192),
    }
    assert plan.window_s == one_rank.window_s
    records = {r.peer_id: r for r in (box, other)}
    assert check_plan(plan, records, BENCH_CFG, now=plan.created_at) is None
    # a light follower must read the box's record (only its ranks allow a budget over 8x the median) and then
    # accepts; without it the plan is over the one-device bounds
    assert records_needed(plan, BENCH_CFG) == ["box"]
    assert check_plan_sampled(plan, records, BENCH_CFG, now=plan.created_at) is None
    # without it the bound is any K's (session 53: the light agreement's record-less check refused a 2-rank
    # newcomer's plan): the light follower reads records_needed's records before it follows (round/light.py)
    assert check_plan_sampled(plan, {"other": other}, BENCH_CFG, now=plan.created_at) is None
    one = box.model_copy(update={"ranks": 1})  # read, the record's K decides
    reason = check_plan_sampled(plan, {"other": other, "box": one}, BENCH_CFG, now=plan.created_at)
    assert reason == "token budget 90112 for box is over 8x the plan's median budget (8192)"
    # the same figures claimed by one device are still bounded as before: 8 x 1424 tokens/s, 8 x 8192 tokens
    solo = peer_record(
        "box", address="box:1", tokens_per_s=box.tokens_per_s, max_batch=464, upload_bps=1e8, download_bps=1e8
    )
    assert bound_records([solo, other])[0].tokens_per_s == {8: 11_392.0, 16: 11_392.0}
    assert _plan_rows(make_plan([solo, other], BENCH_CFG, **PLAN_KW))["box"] == (16, 1, 32, 65_536)
    # and a 2-rank peer past its per-device bound is refused: 2 x 8 x 8192 tokens at most
    rows = [
        a.model_copy(update={"inner_steps": 65, "token_budget": 133_120}) if a.peer_id == "box" else a
        for a in plan.assignments
    ]
    rogue = plan.model_copy(update={"assignments": rows})
    assert check_plan(rogue, records, BENCH_CFG, now=plan.created_at) == (
        "token budget 133120 for box (2 ranks) is over 16x the plan's median budget (8192)"
    )
    assert max_token_share(2, 2) == 16 / 17 and max_token_share(2) == 8 / 9


def test_a_ranks_claim_loosens_the_caps_at_most_eightfold() -> None:
    """``ranks`` is a claim: 64 ranks (MAX_RANKS) loosen the per-device caps as 8 would (BOUND_RANKS_MAX), so a
    liar buys no more than one 8-GPU server's share; the message names the bound it applied."""
    fast = {b: 4 * v for b, v in SLOW_TPS.items()}
    liar = _rec("liar", 64, fast, 4 * 232)  # 256 x a slow device's rate, 256 x its max_batch
    others = [_rec(f"o{i}", 1, SLOW_TPS, 232) for i in range(3)]
    bounded = bound_records([liar, *others])[0]
    # 8 devices x (8 x the lower median, 1424 tokens/s and 232 rows); 64 would allow 729,088 and 118,784
    assert bounded.best_tokens_per_s() == 8 * 8 * 1424.0 == 91_136.0
    assert bounded.max_batch == 8 * 8 * 232
    assert budget_limit(100.0, 64) == budget_limit(100.0, 8) == 6_400.0 and budget_limit(100.0, 0) == 800.0
    assert max_token_share(4, 64) == max_token_share(4, 8) == 64 / 66
    plan = make_plan([liar, *others], BENCH_CFG, **PLAN_KW)
    median = sorted(a.token_budget for a in plan.assignments)[1]
    mine = next(a for a in plan.assignments if a.peer_id == "liar")
    steps = 64 * median // (mine.batch_size * 128) + 1  # just over the 8-rank bound; 64 ranks would allow 8x more
    assert steps <= 500
    rows = [
        a.model_copy(update={"inner_steps": steps, "token_budget": steps * a.batch_size * 128}) if a is mine else a
        for a in plan.assignments
    ]
    records = {r.peer_id: r for r in (liar, *others)}
    rogue = plan.model_copy(update={"assignments": rows})
    reason = check_plan(rogue, records, BENCH_CFG, now=plan.created_at)
    assert reason is not None and f"(64 ranks) is over 64x the plan's median budget ({median})" in reason


# ---------------------------------------------------------------------------------------------- flags
def test_local_devices_flag_type() -> None:
    parse = PARSERS["device_list"]
    assert parse("cpu,cpu") == ["cpu", "cpu"]
    assert parse("cuda:0, CUDA:1") == ["cuda:0", "cuda:1"]
    assert parse("cuda,cuda,cuda") == ["cuda", "cuda", "cuda"]
    for bad, words in [
        ("cpu", "give 2 to 64"),
        ("cpu,cuda:0", "mixes cpu and cuda"),
        ("cpu,gpu", "'gpu' is not a device"),
        ("cuda:x,cuda:1", "not a device"),
        ("cpu:1,cpu", "not a device"),
        ("cpu,,cpu", "has an empty entry"),  # fresh-user review: was taken as cpu,cpu
        ("cpu,cpu,", "has an empty entry"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(bad)


def test_layout_from_flags_and_environment() -> None:
    assert layout_from(NodeConfig(), env={}) is None
    lay = layout_from(NodeConfig(local_devices=["cpu", "cpu", "cpu"]), env={})
    assert (lay.rank, lay.world, lay.device, lay.spawn) == (0, 3, "cpu", True)
    assert lay.init_method == "" and lay.device_share == 3  # rank 0 makes its rendezvous file when it starts them
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    tr = layout_from(NodeConfig(device="cpu"), env=env)
    assert tr == RankLayout(1, 2, "cpu") and tr.device_share == 2
    assert layout_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None  # torchrun with one process: one device
    # --shard is a property of the ranks (rank 0's SETUP tells the followers), not of the layout
    assert layout_from(NodeConfig(local_devices=["cpu", "cpu"], shard=True), env={}) == RankLayout(
        0, 2, "cpu", ("cpu", "cpu"), "", True
    )
    assert layout_from(NodeConfig(device="cpu", shard=True), env=env) == tr


@pytest.mark.parametrize(
    "cfg,env,flag",
    [
        (NodeConfig(shard=True), {}, "--shard shards the model over the ranks of a multi-rank peer and needs >= 2"),
        (NodeConfig(shard=True, device="cpu"), {"RANK": "0", "WORLD_SIZE": "1"}, "--shard .* needs >= 2 ranks"),
        (NodeConfig(local_devices=["cpu", "cpu"], device="cpu"), {}, "--local-devices sets each rank's device"),
        (NodeConfig(local_devices=["cpu", "cpu"]), {"RANK": "0", "WORLD_SIZE": "2"}, "--local-devices under torchrun"),
        (NodeConfig(device="cuda:1"), {"RANK": "0", "WORLD_SIZE": "2"}, "--device cuda:1 under torchrun"),
        (NodeConfig(), {"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 outside"),
        (NodeConfig(), {"RANK": "x", "WORLD_SIZE": "2"}, "not integers"),
        (
            NodeConfig(local_devices=["cpu", "cpu"], shard=True, rank_sync="round"),
            {},
            "--rank-sync round runs each rank's inner steps on a whole model of its own; --shard",
        ),
    ],
)
def test_bad_combinations_fail_at_start_naming_the_flag(cfg: NodeConfig, env: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")):
        layout_from(cfg, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_devices_without_cuda_fail_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--local-devices cuda:0,cuda:1: CUDA is not available"):
        layout_from(NodeConfig(local_devices=["cuda:0", "cuda:1"]), env={})


def test_rank_sync_auto_meets_once_a_round_where_ranks_share_a_device() -> None:
    # (rank_sync, ranks on rank 0's device, shard) -> once a round
    assert independent_ranks("auto", 2, False) and independent_ranks("auto", 4, False)  # CPU ranks, cuda:0,cuda:0
    assert not independent_ranks("auto", 1, False)  # a GPU each: DDP
    assert independent_ranks("round", 1, False) and not independent_ranks("step", 2, False)
    assert not independent_ranks("auto", 2, True) and not independent_ranks("round", 2, True)  # FSDP: every step
    with pytest.raises(ValueError, match="rank_sync 'epoch'"):
        independent_ranks("epoch", 2, False)


def test_rank_sync_is_a_checked_choice() -> None:
    assert NodeConfig().rank_sync == "auto"
    assert NodeConfig(rank_sync="round").rank_sync == "round"
    with pytest.raises(ValueError, match="rank_sync"):
        NodeConfig(rank_sync="epoch")


def test_rank_split_follows_the_ranks_speeds_and_sums_to_the_batch() -> None:
    assert rank_split(5, None, 2) == [3, 2]  # unknown speeds: split_rows' even shares
    assert rank_split(5, [1.0, float("nan")], 2) == [3, 2] and rank_split(5, [1.0], 2) == [3, 2]
    assert rank_split(16, [1.0, 1.0], 2) == [8, 8]
    assert rank_split(16, [1.0, 3.0], 2) == [5, 11]  # 1 each, then 14 by 1 : 3 = 3.5 / 10.5, the tie to rank 0
    assert rank_split(5, [1.0, 4.0], 2) == [2, 3]
    assert rank_split(4, [1e-9, 1.0, 1.0, 1.0], 4) == [1, 1, 1, 1]  # at least one row each
    assert rank_split(1, [1.0, 5.0], 2) == [0, 1]  # fewer rows than ranks: by speed, no floor
    for b in range(0, 40):
        for speeds in ([1.0, 2.0, 3.0], [0.1, 10.0, 0.5], None):
            split = rank_split(b, speeds, 3)
            assert sum(split) == b and min(split) >= (1 if b >= 3 else 0)
    with pytest.raises(ValueError, match="ranks"):
        rank_split(4, None, 0)


def test_update_speeds_smooths_and_keeps_what_a_run_did_not_measure() -> None:
    assert update_speeds(None, [100.0, 300.0], [1.0, 1.0]) == [100.0, 300.0]
    assert update_speeds([100.0, 300.0], [200.0, 300.0], [1.0, 1.0]) == [150.0, 300.0]
    # rank 1 trained nothing this run: it keeps its figure; without one it gets the others' mean
    assert update_speeds([100.0, 300.0], [100.0, 0.0], [1.0, 0.0]) == [100.0, 300.0]
    assert update_speeds(None, [100.0, 0.0], [1.0, 0.0]) == [100.0, 100.0]


@pytest.mark.parametrize(
    "speeds",
    [[1e308, 1.0], [1e308, 1e308], [1.0, 5e-324], [1e308, 5e-324, 1e-300], [2.0**1023, 2.0**1023, 2.0**1023]],
)
@pytest.mark.parametrize("batch", [0, 1, 2, 5, 64, 1001])
def test_rank_split_with_extreme_speeds_sums_to_the_batch(speeds: list[float], batch: int) -> None:
    # speeds near the float range once raised OverflowError (spare x 1e308) or ValueError (inf / inf), and every
    # later run with them too
    rows = rank_split(batch, speeds, len(speeds))
    assert sum(rows) == batch and min(rows) >= (1 if batch >= len(speeds) else 0), rows


def test_update_speeds_ignores_a_rate_that_is_not_finite() -> None:
    assert update_speeds([2.0, 3.0], [1e300, 100.0], [1e-300, 10.0]) == [2.0, 0.5 * 10.0 + 0.5 * 3.0]


@pytest.mark.timeout(60)
def test_self_started_ranks_meet_at_a_private_file_removed_when_the_start_fails(monkeypatch, tmp_path) -> None:
    """Rank 0's own ranks rendezvous at ``file://<fresh folder>/store``, not at a port found free and bound later
    (another socket took one in CI: rank 0 died, its follower waited to the timeout); a failed start removes it."""
    from geomesh_p2p.config.models import RunConfig
    from geomesh_p2p.model.rank_channel import RankFailure
    from geomesh_p2p.node import ranks as node_ranks
    from geomesh_p2p.util.errors import UserFacingError

    monkeypatch.setattr(node_ranks.tempfile, "tempdir", str(tmp_path))
    seen: list[str] = []

    def refuse(rank, world, device, init, timeout_s, backend=None):
        seen.append(init)
        raise RankFailure("rank 0 of 2: the peer's ranks did not form (test)")

    monkeypatch.setattr(node_ranks.RankChannel, "init", refuse)
    layout = RankLayout(0, 2, "cpu", ("cpu", "cpu"), "", spawn=False)  # no follower processes: rank 0's side only
    with pytest.raises(UserFacingError, match="did not form"):
        node_ranks.LocalRanks.start(RunConfig(), NodeConfig(), layout)
    assert len(seen) == 1 and seen[0].startswith(f"file://{tmp_path}/geomesh-ranks-") and seen[0].endswith("/store")
    assert list(tmp_path.iterdir()) == []  # the folder went with the failed start
