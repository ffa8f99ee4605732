"""Simulator (geomesh_p2p.sim): clock arithmetic with known answers, a tiny method comparison,
profile and CLI errors. Fast: the only training is a few steps of the tiny model."""

from __future__ import annotations

import math
import textwrap

import pytest

from geomesh_p2p.sim import (
    Link,
    ProfileError,
    charge_round,
    encoded_nbytes,
    exchange_bytes,
    load_profile,
    parse_method,
    parse_profile,
    shipped_profiles,
)
from geomesh_p2p.sim.link_time import collective_end_times
from geomesh_p2p.sim.methods import MethodError

# Two peers: "fast" (speed 1.0) and "slow" (speed 0.5); reference model of 1000 parameters, 10-token
# sequences, 100 tokens/s at speed 1 whatever the batch (batch_half 0), batch 1, H = 5 inner steps;
# links 0.008 Mbit/s = 1000 bytes/s each way, no latency.
TOY = textwrap.dedent("""
    name: toy2
    reference:
      model: toy
      params: 1000
      seq_len: 10
      peak_tokens_per_s: 100
      batch_half: 0
      fixed_memory_gb: 0
      activation_gb_per_seq: 1
      measured_batches: [1]
    plan: {target_batch: 1, inner_steps: 5, comm_share: 0.1}
    train: {seq_len: 16, batch_div: 1, rounds: 2, eval_batches: 1, eval_batch_size: 4, warmup_frac: 0.0}
    peers:
      - {name: fast, speed: 1.0, memory_gb: 1, up_mbps: 0.008}
      - {name: slow, speed: 0.5, memory_gb: 1, up_mbps: 0.008}
""")


# ------------------------------------------------------------------------------------------ clock


def test_encoded_sizes_match_the_codec():
    from geomesh_p2p.exchange import codec as compression
    import torch

    v = torch.randn(5000)
    assert encoded_nbytes("sign", 5000, 256) == compression.encode(v, 256, 3).nbytes()
    assert encoded_nbytes("int8", 5000, 256) == compression.encode_int8(v, 256, 3).nbytes()
    assert encoded_nbytes("fp16", 5000, 256) == compression.encode_fp16(v, 3).nbytes()
    assert encoded_nbytes("fp32", 5000, 256) == 20000
    assert encoded_nbytes("sign", 0, 256) == compression.encode(torch.zeros(0), 256, 3).nbytes() == 32


def test_exchange_bytes_two_peers_and_relay_growth():
    xb = exchange_bytes([500, 500], contribution="fp32", aggregate="fp32", mode="reencode", block_size=2048)
    assert xb.push_up == xb.push_down == xb.pull_up == xb.pull_down == [2000, 2000]
    assert xb.sent(0) == xb.received(1) == 4000
    # 4 owners + 1 client-only: relay forwards N-1 contributions per part to each of N-1 pullers
    parts = [250, 250, 250, 250, 0]
    s = encoded_nbytes("sign", 250, 64)
    rel = exchange_bytes(parts, contribution="sign", aggregate="sign", mode="relay", block_size=64)
    ree = exchange_bytes(parts, contribution="sign", aggregate="sign", mode="reencode", block_size=64)
    assert rel.push_up == ree.push_up == [3 * s, 3 * s, 3 * s, 3 * s, 4 * s]
    assert ree.pull_up[:4] == [4 * s] * 4 and ree.pull_up[4] == 0
    assert rel.pull_up[:4] == [16 * s] * 4
    assert rel.pull_down == [4 * 3 * s] * 4 + [4 * 4 * s]
    assert ree.pull_down == [3 * s] * 4 + [4 * s]


def test_clock_two_peers_known_answer():
    """done = (1, 3) s, 2000 bytes each way per phase at 1000 B/s (worked by hand):
    push ends at 3 and 5; parts ready at 5 (A's) and 3 (B's); A has all at 5, B at 7."""
    xb = exchange_bytes([500, 500], contribution="fp32", aggregate="fp32", mode="reencode", block_size=2048)
    links = [Link(1000.0, 1000.0, 0.0), Link(1000.0, 1000.0, 0.0)]
    assert collective_end_times([1.0, 3.0], links, xb, [True, True]) == pytest.approx([5.0, 7.0])
    tm = charge_round([1.0, 3.0], links, xb, [True, True])
    assert tm.round_s == pytest.approx(7.0)
    assert tm.straggler_s == pytest.approx([2.0, 0.0])
    assert tm.network_s == pytest.approx(4.0)
    tm.check()
    # 0.1 s one-way latency per peer: every phase pays l_AB = 0.2 s -> 7.4
    lat = [Link(1000.0, 1000.0, 0.1), Link(1000.0, 1000.0, 0.1)]
    assert charge_round([1.0, 3.0], lat, xb, [True, True]).round_s == pytest.approx(7.4)
    # a slower download at B makes B's ingest of A's push the bottleneck: ready_B = 1 + 2000/500 = 5
    slow_dn = [Link(1000.0, 1000.0, 0.0), Link(1000.0, 500.0, 0.0)]
    assert collective_end_times([1.0, 3.0], slow_dn, xb, [True, True]) == pytest.approx([7.0, 9.0])
    # one participant: no exchange
    one = exchange_bytes([7], contribution="fp32", aggregate="fp32", mode="reencode", block_size=4)
    assert charge_round([2.5], [Link(1.0, 1.0)], one, [True]).round_s == 2.5


def test_charger_on_toy_profile_known_answers():
    from geomesh_p2p.sim.charge import Charger

    prof = parse_profile(TOY, "toy2.yaml")
    ch = Charger(prof, numel=4096)  # parts of 2048 = 500 reference elements each
    diloco = parse_method("diloco")
    plan = ch.plan(diloco)
    assert [a.inner_steps for a in plan.assignments] == [5, 5]
    assert ch.step_s(plan) == pytest.approx([0.1, 0.2])  # 1 seq x 10 tokens / (100 or 50 tokens/s)
    # planner: c = 2000/1000 + 2000/1000 = 4 s, T = H*s_slow + c = 1 + 4
    assert plan.window_s == pytest.approx(5.0)
    rc = ch.charge(diloco, plan)
    # compute (0.5, 1.0); push ends 2.5 / 3.0; parts ready 3.0 / 2.5; fast has all at 4.5, slow at 5.0
    assert rc.timing.compute_s == pytest.approx([0.5, 1.0])
    assert rc.timing.end_s == pytest.approx([4.5, 5.0])
    assert rc.timing.round_s == pytest.approx(5.0)
    assert rc.timing.straggler_s == pytest.approx([0.5, 0.0])
    assert rc.timing.network_s == pytest.approx(4.0)
    assert rc.tokens_ref == 2 * 5 * 10
    assert ch.diloco_tokens_per_round == 100
    # a peer slowed to half speed stops at the window deadline: floor(5.0 / 0.4) = 12 >= 5 -> all 5
    rc2 = ch.charge(diloco, plan, [1.0, 0.5])
    assert rc2.steps == [5, 5] and rc2.timing.compute_s == pytest.approx([0.5, 2.0])
    # ... but at 1/20 speed (4 s per step) only one whole step fits in 5 s
    assert ch.charge(diloco, plan, [1.0, 0.05]).steps == [5, 1]
    # sign compression: 99-byte parts (32 + 63 + 4)
    css = ch.charge(parse_method("css"), ch.plan(parse_method("css")))
    assert css.xb.push_up == [99, 99]
    assert css.timing.round_s < rc.timing.round_s


# ------------------------------------------------------------------------------- methods, profiles


def test_method_names_and_variants():
    g = parse_method("geomesh+ef+relay+int8+lion+lr=3e-4")
    assert (g.base, g.error_feedback, g.mode, g.aggregate, g.inner, g.inner_lr) == (
        "geomesh",
        True,
        "relay",
        "int8",
        "lion",
        3e-4,
    )
    assert parse_method("diloco").contribution == "fp32" and not parse_method("diloco").balanced
    assert parse_method("awb+window=share").window == "comm_share"
    with pytest.raises(MethodError, match="unknown method 'hogwild'"):
        parse_method("hogwild")
    with pytest.raises(MethodError, match="css/geomesh only"):
        parse_method("diloco+ef")
    with pytest.raises(MethodError, match="unknown modifier 'turbo'"):
        parse_method("geomesh+turbo")


def test_shipped_profiles_parse():
    assert {"paper4", "homogeneous4", "volunteer32"} <= set(shipped_profiles())
    p = load_profile("paper4")
    assert [x.speed for x in p.peers] == [1.0, 0.55, 0.45, 0.40]
    assert [x.memory_gb for x in p.peers] == [80, 80, 48, 48]
    assert all(580 <= x.up_mbps <= 940 for x in p.peers)
    v = load_profile("volunteer32").sim_peers()
    assert len(v) == 32 and any(x.client_only for x in v)
    assert min(x.up_bps for x in v) == pytest.approx(20e6 / 8) and max(x.up_bps for x in v) == pytest.approx(1e9 / 8)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda t: t.replace("speed: 0.5", "speed: -1"), r"toy2.yaml: peers\[1\]\.speed: .*greater than 0"),
        (lambda t: t.replace("  params: 1000\n", ""), r"toy2.yaml: reference\.params: missing required field"),
        (lambda t: t.replace("speed: 0.5", "sped: 0.5"), r"toy2.yaml: peers\[1\]"),
        (lambda t: t.replace("up_mbps: 0.008}", "up_mbps: fast}", 1), r"peers\[0\]\.up_mbps: .*number"),
        (lambda t: t.replace("name: slow", "name: fast"), r"duplicate peer name 'fast'"),
        (lambda t: t.replace("peers:", "peers: [\n"), r"toy2.yaml: invalid YAML at line \d+"),
        (
            lambda t: t.replace("memory_gb: 1, up_mbps: 0.008}\n  ", "memory_gb: 0.5, up_mbps: 0.008}\n  ", 1),
            r"peer fast: memory_gb=0.5 cannot hold one sequence",
        ),
        (lambda t: "- just\n- a list\n", r"expected a mapping"),
    ],
)
def test_profile_errors_are_one_clear_line(mutate, expect):
    with pytest.raises(ProfileError, match=expect) as ei:
        parse_profile(mutate(TOY), "toy2.yaml")
    assert "\n" not in str(ei.value)


def test_unknown_profile_and_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"unknown profile 'paper5' \(shipped: .*paper4"):
        load_profile("paper5")
    with pytest.raises(ProfileError, match="profile file not found"):
        load_profile(str(tmp_path / "nope.yaml"))


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys):
    from geomesh_p2p.sim.cli import main

    assert main(["--methods", "diloco,warp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown method 'warp'" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(TOY.replace("speed: 0.5", "speed: zero"))
    assert main(["--profile", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.yaml" in err and "peers[1].speed" in err
    assert main(["--profile", "nosuch", "--no-progress"]) == 2
    assert "unknown profile 'nosuch'" in capsys.readouterr().err


# ------------------------------------------------------------------------- tiny method comparison


@pytest.fixture(scope="module")
def toy_sim():
    import torch

    from geomesh_p2p.sim.engine import Simulator

    torch.set_num_threads(1)
    return Simulator(parse_profile(TOY, "toy2.yaml"), rounds=2)


def test_tiny_comparison_straggler_idle_and_determinism(toy_sim):
    from geomesh_p2p.sim import report

    res = {m: toy_sim.run(parse_method(m)) for m in ("diloco", "geomesh", "async")}
    rows = {r["method"]: r for r in report.summaries(list(res.values()), target_ppl=None)}
    # the clock of the toy diloco round is known: 5 s per round, fast peer idles 0.5 s of it
    assert [lg.round_s for lg in res["diloco"].rounds] == pytest.approx([5.0, 5.0])
    assert rows["diloco"]["straggler_idle_fastest_pct"] == pytest.approx(10.0)
    assert rows["diloco"]["network_idle_pct"] == pytest.approx(80.0)
    assert rows["geomesh"]["straggler_idle_fastest_pct"] < rows["diloco"]["straggler_idle_fastest_pct"]
    assert rows["geomesh"]["network_idle_pct"] < rows["diloco"]["network_idle_pct"]
    assert rows["async"]["straggler_idle_fastest_pct"] == 0.0
    for r in res.values():  # everybody trained the same budget and the proxy learned something
        assert r.tokens_ref >= toy_sim.budget_ref
        assert math.isfinite(r.curve[-1][1]) and r.curve[-1][1] < r.curve[0][1]
    # deterministic for a seed: the same method again gives the same perplexities bit for bit
    again = toy_sim.run(parse_method("geomesh"))
    assert [p for _, p, _ in again.curve] == [p for _, p, _ in res["geomesh"].curve]
    assert report.format_table(list(rows.values())).count("\n") == 4


def test_cli_charged_only_prints_the_toy_round(tmp_path, capsys):
    from geomesh_p2p.sim.cli import main

    prof = tmp_path / "toy2.yaml"
    prof.write_text(TOY)
    assert main(["--profile", str(prof), "--methods", "diloco,css,async", "--charged-only"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| diloco"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # window 5 s, round 5 s, 100 tokens; fast peer idles 0.5 of 5 s; network 4 of 5 s
    assert cells[1:4] == ["5.00", "5.00", "0.00"] and cells[6:8] == ["10.0", "80.0"]
    assert "async" in out.splitlines()[-1]
