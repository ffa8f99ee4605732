"""RoundLog: the round table, --log-json lines and the Prometheus endpoint (--metrics-port)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.request

import pytest

from geomesh_p2p.telemetry.metrics import HEADER, RoundLog, RoundRecord, format_row

pytestmark = pytest.mark.timeout(30)


def _record(**over) -> RoundRecord:
    fields = dict(
        round=7,
        peers=3,
        leader="peerA",
        batch_size=16,
        inner_steps_planned=9,
        inner_steps_done=8,
        tokens=8192,
        train_loss=4.5,
        eval_ppl=250.25,
        compute_s=6.0,
        straggler_idle_s=1.0,
        network_idle_s=0.5,
        round_s=8.0,
        bytes_sent=200_000,
        bytes_received=300_000,
        digest="abcdef0123456789",
        digest_agree=True,
        contributors=3,
        missing_parts=0,
        time=1_700_000_000.5,
        loop_stall_ms=30.0,
        phase_s={"plan": 0.5, "train": 6.0, "exchange": 1.5},
        cycle_s=8.0,
    )
    fields.update(over)
    return RoundRecord(**fields)


def _scrape(port: int) -> dict[str, float]:
    """GET /metrics (no proxy, 5 s timeout) -> {sample name: value} for the geomesh_* samples."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        body = resp.read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("geomesh_") and not line.split()[0].endswith("_created"):
            name, value = line.split()
            out[name] = float(value)
    return out


@pytest.fixture
def served():
    """A RoundLog serving metrics on a free port of 127.0.0.1; closed (and checked closed) after."""
    before = set(threading.enumerate())
    printed: list[str] = []
    rl = RoundLog(metrics_port=0, metrics_host="127.0.0.1", print_fn=printed.append)
    thread = rl._thread
    try:
        yield rl, printed
    finally:
        port = rl.metrics_port
        rl.close()
    # close() stopped the server: the serving thread ended, the port refuses, no thread is left over
    assert rl.metrics_port is None and rl._thread is None
    assert thread is not None and not thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.02)  # a request handler thread may still be returning
    assert not set(threading.enumerate()) - before


def test_prometheus_gauges_exact(served):
    rl, printed = served
    port = rl.metrics_port
    assert isinstance(port, int) and port > 0
    assert rl._server.server_address[0] == "127.0.0.1"
    # before any evaluation the perplexity is NaN ("no value"), not 0 (fresh-user trial, session 28)
    assert math.isnan(_scrape(port)["geomesh_eval_perplexity"]) and math.isnan(_scrape(port)["geomesh_eval_round"])
    # a peer resumed at the state of round 7 finished round 6 (it said 0 until its first row: fresh-user trial)
    assert _scrape(port)["geomesh_round"] == 0.0
    rl.note_state_round(7)
    assert _scrape(port)["geomesh_round"] == 6.0
    rl.add(_record())
    assert printed == [HEADER, format_row(_record())]
    assert printed[1].split()[-3:-1] == ["30ms", "abcdef01"]  # the round's worst loop stall
    assert printed[1].split()[9] == "75.0"  # comp%: 6.0 s of compute in an 8.0 s cycle
    m = _scrape(port)
    stall = {k: m.pop(k) for k in list(m) if k.startswith("geomesh_round_loop_stall_seconds")}
    assert stall == {
        **{
            f'geomesh_round_loop_stall_seconds_bucket{{le="{b}"}}': float(float(b) >= 0.05)
            for b in ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0")
        },
        'geomesh_round_loop_stall_seconds_bucket{le="+Inf"}': 1.0,
        "geomesh_round_loop_stall_seconds_count": 1.0,
        "geomesh_round_loop_stall_seconds_sum": 0.03,
    }
    assert m == {
        "geomesh_round": 7.0,
        "geomesh_peers": 3.0,
        "geomesh_train_loss": 4.5,
        "geomesh_eval_perplexity": 250.25,
        "geomesh_eval_round": 7.0,
        "geomesh_straggler_idle_ratio": 0.125,  # 1.0 s of an 8.0 s round
        "geomesh_network_idle_ratio": 0.0625,  # 0.5 s of 8.0 s
        "geomesh_round_seconds": 8.0,
        "geomesh_loop_stall_seconds": 0.03,
        "geomesh_tokens_total": 8192.0,
        "geomesh_sent_bytes_total": 200_000.0,
        "geomesh_received_bytes_total": 300_000.0,
        "geomesh_underfilled_rounds_total": 0.0,
        "geomesh_compute_share_ratio": 0.75,  # 6.0 s of compute in an 8.0 s cycle
        'geomesh_round_phase_seconds{phase="plan"}': 0.5,
        'geomesh_round_phase_seconds{phase="train"}': 6.0,
        'geomesh_round_phase_seconds{phase="exchange"}': 1.5,
    }
    # next round: gauges are replaced, counters add up, a round without eval keeps the last ppl
    rl.add(
        _record(
            round=8,
            peers=2,
            train_loss=4.25,
            eval_ppl=None,
            straggler_idle_s=0.0,
            network_idle_s=2.0,
            round_s=4.0,
            tokens=1000,
            bytes_sent=1,
            bytes_received=2,
            loop_stall_ms=1500.0,
        )
    )
    assert printed[0] == HEADER and len(printed) == 3
    m = _scrape(port)
    assert (
        m.pop("geomesh_round_loop_stall_seconds_count"),
        m.pop("geomesh_round_loop_stall_seconds_sum"),
        m['geomesh_round_loop_stall_seconds_bucket{le="1.0"}'],
        m['geomesh_round_loop_stall_seconds_bucket{le="2.5"}'],
    ) == (2.0, 1.53, 1.0, 2.0)
    m = {k: v for k, v in m.items() if not k.startswith("geomesh_round_loop_stall_seconds")}
    assert m == {
        "geomesh_round": 8.0,
        "geomesh_peers": 2.0,
        "geomesh_train_loss": 4.25,
        "geomesh_eval_perplexity": 250.25,
        "geomesh_eval_round": 7.0,  # the perplexity kept is round 7's
        "geomesh_straggler_idle_ratio": 0.0,
        "geomesh_network_idle_ratio": 0.5,
        "geomesh_round_seconds": 4.0,
        "geomesh_loop_stall_seconds": 1.5,
        "geomesh_tokens_total": 9192.0,
        "geomesh_sent_bytes_total": 200_001.0,
        "geomesh_received_bytes_total": 300_002.0,
        "geomesh_underfilled_rounds_total": 0.0,
        "geomesh_compute_share_ratio": 0.75,
        'geomesh_round_phase_seconds{phase="plan"}': 0.5,
        'geomesh_round_phase_seconds{phase="train"}': 6.0,
        'geomesh_round_phase_seconds{phase="exchange"}': 1.5,
    }


def test_close_is_idempotent_and_no_server_without_port(tmp_path):
    rl = RoundLog(print_fn=lambda _: None)
    assert rl.metrics_port is None
    rl.add(_record())  # no gauges, no file: nothing to do but print
    rl.close()
    rl.close()
    served = RoundLog(metrics_port=0, print_fn=lambda _: None)
    thread = served._thread
    served.close()
    served.close()
    assert not thread.is_alive()


def test_json_lines_exact(tmp_path):
    path = tmp_path / "logs" / "rounds.jsonl"  # the folder is created
    rl = RoundLog(json_path=str(path), print_fn=lambda _: None)
    rl.add(_record())
    rl.add(
        _record(
            round=8,
            train_loss=math.nan,
            eval_ppl=None,
            digest_agree=None,
            round_s=0.0,
            extra={"note": "x"},
            loop_stall_ms=None,
        )
    )
    rl.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == {
        "round": 7,
        "peers": 3,
        "leader": "peerA",
        "batch_size": 16,
        "inner_steps_planned": 9,
        "inner_steps_done": 8,
        "tokens": 8192,
        "train_loss": 4.5,
        "eval_ppl": 250.25,
        "compute_s": 6.0,
        "straggler_idle_s": 1.0,
        "network_idle_s": 0.5,
        "round_s": 8.0,
        "bytes_sent": 200_000,
        "bytes_received": 300_000,
        "digest": "abcdef0123456789",
        "digest_agree": True,
        "contributors": 3,
        "missing_parts": 0,
        "applied": None,
        "time": 1_700_000_000.5,
        "loop_stall_ms": 30.0,
        "extra": {},
        "straggler_idle_pct": 12.5,
        "network_idle_pct": 6.25,
        "underfilled": False,
        "phase_s": {"plan": 0.5, "train": 6.0, "exchange": 1.5},
        "cycle_s": 8.0,
        "eval_round": None,
        "compute_share": 0.75,
        "other_s": 0.0,
    }
    second = json.loads(lines[1])  # strict JSON: NaN became null; a 0 s round gives 0 %
    assert "NaN" not in lines[1]
    assert {
        k: second[k]
        for k in (
            "round",
            "train_loss",
            "eval_ppl",
            "digest_agree",
            "round_s",
            "straggler_idle_pct",
            "network_idle_pct",
            "extra",
            "loop_stall_ms",
        )
    } == {
        "round": 8,
        "train_loss": None,
        "eval_ppl": None,
        "digest_agree": None,
        "round_s": 0.0,
        "loop_stall_ms": None,
        "straggler_idle_pct": 0.0,
        "network_idle_pct": 0.0,
        "extra": {"note": "x"},
    }
    # appending: a new RoundLog on the same file adds lines after the old ones
    rl2 = RoundLog(json_path=str(path), print_fn=lambda _: None)
    rl2.add(_record(round=9))
    assert [json.loads(l)["round"] for l in path.read_text().splitlines()] == [7, 8, 9]


def test_a_round_that_trains_less_than_half_its_plan_is_flagged():
    """Issue 14 #9: '0/4' rounds looked healthy. Flagged in the row ('!'), the JSON and Prometheus."""
    import json as _json

    from geomesh_p2p.telemetry.metrics import RoundRecord, format_row

    base = dict(
        round=3,
        peers=3,
        leader="x",
        batch_size=8,
        inner_steps_planned=4,
        tokens=0,
        train_loss=float("nan"),
        eval_ppl=None,
        compute_s=0.1,
        straggler_idle_s=0.0,
        network_idle_s=0.0,
        round_s=2.0,
        bytes_sent=0,
        bytes_received=0,
        digest="abcdef0123",
    )
    low = RoundRecord(inner_steps_done=1, **base)
    ok = RoundRecord(inner_steps_done=2, **base)
    assert low.underfilled and not ok.underfilled
    assert " 1/4! " in format_row(low) and " 2/4 " in format_row(ok)
    assert _json.loads(low.to_json())["underfilled"] is True


def test_a_row_whose_exchange_applied_nothing_says_so():
    """Fresh-user trial (session 29): a round in which every part was refused printed "ok" like any other."""
    from geomesh_p2p.telemetry.metrics import RoundRecord, format_row

    base = dict(round=8, peers=3, batch_size=8, inner_steps_done=79, inner_steps_planned=79, tokens=40448)
    kw = dict(train_loss=4.75, round_s=26.0, digest="323098d9" * 4, digest_agree=True, leader="L", eval_ppl=None)
    kw.update(compute_s=20.0, straggler_idle_s=0.0, network_idle_s=6.0, bytes_sent=0, bytes_received=0)
    lost = RoundRecord(**base, **kw, contributors=0, missing_parts=3)
    fine = RoundRecord(**base, **kw, contributors=3, missing_parts=0)
    assert format_row(lost).endswith("323098d9 ok (nothing applied)")
    assert format_row(fine).endswith("323098d9 ok")
    # fresh user 53 (make demo at load 12-24): every part had a result of 0 tokens (each claim under its token floor)
    zero = RoundRecord(**base, **kw, contributors=3, missing_parts=0, applied=False)
    assert format_row(zero).endswith("323098d9 ok (nothing applied)")
    assert json.loads(zero.to_json())["applied"] is False
    assert format_row(RoundRecord(**base, **kw, contributors=3, missing_parts=0, applied=True)).endswith("d9 ok")
