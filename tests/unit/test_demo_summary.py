"""The demo's closing summary says how its idle shares are computed (fresh-user report: its straggler % matched no
row of the round table): per peer, idle seconds over round seconds summed over all its rounds, round 0 included."""

from __future__ import annotations

import argparse
import json

import pytest

from peer.demo import _print_summary, _reached_at, _summarize

pytestmark = pytest.mark.timeout(30)


def _row(round_s: float, strag_s: float, net_s: float, sent: int) -> dict:
    return {
        "round_s": round_s,
        "straggler_idle_s": strag_s,
        "network_idle_s": net_s,
        "straggler_idle_pct": 100 * strag_s / round_s,
        "bytes_sent": sent,
        "bytes_received": sent,
        "eval_ppl": None,
        "time": 0.0,
        "digest": "d",
    }


def test_summary_idle_is_time_weighted_over_all_rounds_and_says_so(tmp_path, capsys):
    # peer0: round 0 (start-up) 10 s with 4 s straggler idle, then two 5 s rounds with 0.5 s each:
    # (4 + 0.5 + 0.5) / 20 = 25%, not the mean of the rows' 40%, 10%, 10% (20%) nor the worst row (40%)
    rows = [
        [_row(10.0, 4.0, 1.0, 1000), _row(5.0, 0.5, 0.0, 1000), _row(5.0, 0.5, 1.0, 1000)],
        [_row(10.0, 0.0, 0.0, 2000), _row(5.0, 0.0, 0.0, 2000), _row(5.0, 0.0, 0.0, 2000)],
    ]
    for i, r in enumerate(rows):
        (tmp_path / f"peer{i}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in r))
    ns = argparse.Namespace(peers=2, target_ppl=None, method="geomesh")
    s = _summarize(ns, tmp_path, 0.0)
    assert s["rounds"] == 3
    assert s["per_peer"][0] == {
        "peer": 0,
        "rounds": 3,
        "straggler_idle_pct": 25.0,
        "network_idle_pct": 10.0,
        "bytes_sent": 3000,
        "bytes_received": 3000,
    }
    assert s["per_peer"][1]["straggler_idle_pct"] == 0.0 and s["per_peer"][1]["bytes_sent"] == 6000
    _print_summary(s)
    out = capsys.readouterr().out.splitlines()
    i = out.index("summary:")
    assert out[i + 2 : i + 5] == [
        "  idle per peer: its idle seconds / its round seconds, summed over all its rounds (round 0 included),"
        " not the table's per-round worst peer",
        "  peer0: straggler idle 25.0%, network idle 10.0% over 3 round(s), sent 0.00 MB",
        "  peer1: straggler idle 0.0%, network idle 0.0% over 3 round(s), sent 0.01 MB",
    ]
    assert not any(line.startswith("summary (JSON)") for line in out)  # none written: none named
    _print_summary(s, "runs/demo/summary.json")  # the Makefile's demo writes one: the last lines name it
    assert "summary (JSON): runs/demo/summary.json" in capsys.readouterr().out.splitlines()


def test_the_target_round_is_said_in_both_numberings(tmp_path, capsys):
    """Fresh user 47: the demo said "target eval perplexity 250.0 reached at round 3" while ``geomesh-peer checkpoints``
    listed the same state as round 4 (a round row evaluates the state after its exchange; a checkpoint is named by
    the round it starts). Both lines now give both numbers; a background evaluation's row names its own round."""
    rows = [_row(5.0, 0.0, 0.0, 10) for _ in range(5)]
    rows[3] = {**rows[3], "eval_ppl": 240.0, "eval_round": 3, "time": 40.0}
    (tmp_path / "peer0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    s = _summarize(argparse.Namespace(peers=1, target_ppl=250.0, method="geomesh"), tmp_path, 0.0)
    assert (s["reached_target"], s["target_round"], s["time_to_target_s"]) == (True, 3, 40.0)
    _print_summary(s)
    out = capsys.readouterr().out
    assert "(target 250.0: reached at round 3, checkpoint round 4 in 40s)" in out
    assert _reached_at(rows[3], 3) == "reached at round 3 (the state after round 3: checkpoint round 4 in ckptN/)"
    # a background evaluation of round 2 carried by row 3: round 2, checkpoint 3
    assert _reached_at({**rows[3], "eval_round": 2}, 3).startswith(
        "reached at round 2 (the state after round 2: checkpoint round 3"
    )
