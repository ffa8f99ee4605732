"""Red team (session 16): ``RunConfig(inner_lr=inf)`` was accepted (``gt=0`` lets +inf through) and would have reached
training. Every float of the config models (run, node, bootstrap, plan) refuses inf and nan and has a range that fits
its meaning, naming the field; ``geomesh-peer join`` and ``geomesh-bootstrap`` refuse such a flag (or config file
value) at start, naming the flag, before a node starts; and where a float from the network is not a typed field
(a record's run config, a bootstrap's progress entry, a ping's time) a non-finite one is refused too."""

from __future__ import annotations

import json
import math
import typing

import pytest
from pydantic import BaseModel, ValidationError

from geomesh_p2p.config import models as M
from geomesh_p2p.config.models import BootstrapConfig, NodeConfig, RunConfig
from geomesh_p2p.plan.schema import PlanConfig

pytestmark = pytest.mark.timeout(60)

#: Required fields of the models without defaults (PlanConfig).
BASE: dict[type, dict] = {PlanConfig: dict(seq_len=32, target_batch=8, payload_bytes=1000)}
MODELS = (RunConfig, NodeConfig, BootstrapConfig, PlanConfig)
#: Float fields with no upper bound by design: a larger factor only clips less (its product with an fp32 scale at
#: worst overflows to inf: no clip), a larger ratio lets a sample move the link figure more, a perplexity target
#: can be as loose as wished; and PlanConfig, which the node builds from the bounded run and node configs and its own
#: measurements (finite only).
UNBOUNDED_ABOVE = {
    (RunConfig, "clip_k"),
    (RunConfig, "weight_cap"),
    (RunConfig, "outer_momentum_clip"),
    (NodeConfig, "target_ppl"),
    (NodeConfig, "link_step_ratio"),
    *((PlanConfig, n) for n in ("window_s", "latency_s", "exchange_timeout_s", "max_window_s")),
}


def _is_float(ann) -> bool:
    return ann is float or float in typing.get_args(ann)


def _float_fields(model: type[BaseModel]) -> list[str]:
    return [n for n, f in model.model_fields.items() if _is_float(f.annotation)]


def _bounds(model: type[BaseModel], name: str) -> dict:
    out = {}
    for m in model.model_fields[name].metadata:
        for k in ("ge", "gt", "le", "lt"):
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


FLOATS = [(model, name) for model in MODELS for name in _float_fields(model)]


def _id(p) -> str:
    return f"{p[0].__name__}.{p[1]}"


def test_the_float_fields_are_all_found():
    names = {(m.__name__, n) for m, n in FLOATS}
    assert ("RunConfig", "inner_lr") in names and ("RunConfig", "window_s") in names  # Optional[float] too
    assert ("NodeConfig", "upload_bps") in names and ("BootstrapConfig", "rpc_timeout") in names
    assert len(FLOATS) >= 30, sorted(names)


@pytest.mark.parametrize("field", FLOATS, ids=_id)
def test_every_float_field_refuses_inf_and_nan_naming_the_field(field):
    model, name = field
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValidationError, match=rf"(?m)^{name}\n\s+Input should be a finite number"):
            model(**BASE.get(model, {}), **{name: bad})


@pytest.mark.parametrize("field", FLOATS, ids=_id)
def test_every_float_field_has_a_range_and_its_default_lies_in_it(field):
    model, name = field
    b = _bounds(model, name)
    assert "ge" in b or "gt" in b, f"{name} has no lower bound"
    if field not in UNBOUNDED_ABOVE:
        assert "le" in b or "lt" in b, f"{name} has no upper bound: give it one, or say why not in UNBOUNDED_ABOVE"
    default = model.model_fields[name].get_default(call_default_factory=True)
    if default is not None:
        model(**BASE.get(model, {}), **{name: default})  # the default itself is valid


def _outside(b: dict) -> list[float]:
    """Values just outside the range ``b`` (below its lower bound, above its upper bound)."""
    out = []
    if "gt" in b:
        out.append(b["gt"])
    if "ge" in b:
        out.append(b["ge"] - max(1.0, abs(b["ge"])) * 0.5)
    if "lt" in b:
        out.append(b["lt"])
    if "le" in b:
        out.append(b["le"] * 2 if b["le"] > 0 else b["le"] + 1)
    return out


@pytest.mark.parametrize("field", FLOATS + [(NodeConfig, "memory_budget_bytes")], ids=_id)
def test_a_finite_value_out_of_range_is_refused_naming_the_field(field):
    model, name = field
    b = _bounds(model, name)
    for bad in _outside(b):
        with pytest.raises(ValidationError, match=rf"(?m)^{name}\n\s+Input should be (greater|less)"):
            model(**BASE.get(model, {}), **{name: bad})
    for edge in (b.get("ge"), b.get("le")):  # closed ends are in the range
        if edge is not None:
            model(**BASE.get(model, {}), **{name: edge})


def test_the_red_teams_values_and_the_bounds_that_follow_from_the_records():
    from geomesh_p2p.dht.records import RecordLimits
    from geomesh_p2p.schema.peer import MAX_LINK_BPS, MIN_LINK_BPS, PeerRecord

    for kw in (dict(inner_lr=math.inf), dict(inner_lr=5.0), dict(outer_lr=1e6), dict(window_s=1e9)):
        with pytest.raises(ValidationError, match=next(iter(kw))):
            RunConfig(**kw)
    assert RunConfig(inner_lr=1e-3, outer_lr=0.7, window_s=6.0).window_s == 6.0
    # waits outlive no record; a round of 4x the window (a record's lifetime) fits the DHT's too
    assert M.MAX_WAIT_S == RecordLimits().max_ttl_s and 4 * M.MAX_WINDOW_S <= RecordLimits().max_ttl_s
    # a stated link or memory budget is what a record may announce
    assert (
        _bounds(NodeConfig, "upload_bps")
        == _bounds(NodeConfig, "download_bps")
        == dict(ge=MIN_LINK_BPS, le=MAX_LINK_BPS)
    )
    assert _bounds(NodeConfig, "memory_budget_bytes")["le"] == _bounds(PeerRecord, "memory_bytes")["le"]


# ----------------------------------------------------------------------------------- the CLIs, at start
@pytest.fixture
def join_started(monkeypatch):
    """The ``join`` handler replaced by a stub: the list of namespaces it was called with (a started node)."""
    import peer.node_cli as node_cli

    calls: list = []
    monkeypatch.setattr(node_cli, "cmd_join", lambda ns: calls.append(ns) or 0)
    return calls


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--inner-lr", "inf"], "argument --inner-lr: must be a finite number, got inf"),
        (["--inner-lr", "nan"], "argument --inner-lr: must be a finite number, got nan"),
        (["--inner-lr", "5"], "argument --inner-lr: must be in (0, 1], got 5"),
        (["--outer-lr=-inf"], "argument --outer-lr: must be a finite number, got -inf"),
        (["--window-s", "inf"], "argument --window-s: must be a finite number, got inf"),
        (["--window-s", "1e9"], f"argument --window-s: must be <= {M.MAX_WINDOW_S}, got 1e9"),
        (["--wait-peers-s", "nan"], "argument --wait-peers-s: must be a finite number, got nan"),
        (["--target-ppl", "inf"], "argument --target-ppl: must be a finite number, got inf"),
        (["--memory-budget-gb", "inf"], "argument --memory-budget-gb: must be a finite number, got inf"),
        (["--memory-budget-gb", "1e9"], "argument --memory-budget-gb: must be <= 1048576, got 1e9"),
        (["--upload-mbps", "nan"], "argument --upload-mbps: must be a finite number, got nan"),
        (["--added-latency-ms", "1e9"], "argument --added-latency-ms: must be in [0, 60000], got 1e9"),
        (["--plan-timeout-s", "inf"], "argument --plan-timeout-s: must be a finite number, got inf"),
    ],
)
def test_join_refuses_a_bad_float_flag_at_start_naming_it(tmp_path, capsys, join_started, argv, message):
    from peer.cli import main

    key = tmp_path / "id.key"
    with pytest.raises(SystemExit) as e:
        main(["join", "--identity", str(key), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("geomesh-peer join: error: ") and message in err, err
    assert join_started == [] and not key.exists()  # refused before anything started


def test_join_starts_with_good_float_flags(tmp_path, join_started):
    from peer.cli import main

    argv = ["join", "--identity", str(tmp_path / "id.key"), "--inner-lr", "3e-4", "--window-s", "21600"]
    assert main([*argv, "--memory-budget-gb", "1048576", "--min-agreement", "0"]) == 0  # 0 = off, not "> 0"
    (ns,) = join_started
    assert (ns.inner_lr, ns.window_s, ns.min_agreement) == (3e-4, 21600.0, 0.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("inner_lr: .inf\n", "inner_lr: must be a finite number, got inf"),
        ("wait-peers-s: .nan\n", "wait-peers-s: must be a finite number, got nan"),
        ("window-s: 1000000000\n", f"window-s: must be <= {M.MAX_WINDOW_S}, got 1000000000"),
    ],
)
def test_join_refuses_a_bad_float_in_its_config_file_naming_the_key(tmp_path, capsys, join_started, text, message):
    from peer.cli import main

    cfg = tmp_path / "peer.yaml"
    cfg.write_text(text)
    assert main(["join", "--config", str(cfg), "--identity", str(tmp_path / "id.key")]) == 2
    assert capsys.readouterr().err.strip() == f"geomesh-peer join: config file {cfg}: {message}"
    assert join_started == []


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--rpc-timeout", "inf"], "--rpc-timeout"),
        (["--status-interval", "nan"], "--status-interval"),
        (["--refresh-period", "1e9"], "--refresh-period"),
        (["--http-poll=-inf"], "--http-poll"),
    ],
)
def test_bootstrap_refuses_a_bad_float_flag_at_start_naming_it(capsys, argv, flag):
    from bootstrap.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"geomesh-bootstrap: error: argument {flag}: must be ")


# ------------------------------------------------------------------------------ floats from the network
def test_a_peer_record_whose_run_config_holds_a_non_finite_number_is_refused():
    from tests.records_util import peer_record

    from geomesh_p2p.schema.peer import PeerRecord

    good = peer_record("p1", run_config={"inner_lr": 0.001, "nested": [{"x": 1.5}]})
    assert PeerRecord.from_bytes(good.to_bytes()).run_config == good.run_config
    for bad in (b"Infinity", b"-Infinity", b"NaN", b"1e999"):
        data = good.to_bytes().replace(b'"x":1.5', b'"x":' + bad)
        assert bad in data
        with pytest.raises(ValidationError, match=r"run_config holds a number that is not finite at nested\[0\]\.x"):
            PeerRecord.from_bytes(data)


def test_a_progress_entry_with_a_non_finite_number_is_refused():
    from geomesh_p2p.dht.progress import SwarmProgress

    ok = b'{"peers": 3, "round": 7, "seen_at": 12.5, "config_hash": "ab", "config": {"inner_lr": 0.001}}'
    assert SwarmProgress.from_bytes(ok).seen_at == 12.5
    for bad in (
        ok.replace(b"12.5", b"Infinity"),
        ok.replace(b"12.5", b"NaN"),
        ok.replace(b"12.5", b"1e999"),
        ok.replace(b"12.5", b"1" + b"0" * 400),  # an int no float holds
        ok.replace(b"12.5", b"true"),
        ok.replace(b"0.001", b"NaN"),
        b"[1, 2]",  # not an object
    ):
        with pytest.raises(ValueError, match="malformed progress entry"):
            SwarmProgress.from_bytes(bad)


def test_a_ping_answer_states_no_time_unless_it_is_a_finite_one():
    from geomesh_p2p.dht.protocol import ping_offset

    assert ping_offset(1_000_010.0, 1_000_000.0, 1_000_002.0) == 9.0
    for bogus in (0.0, -5.0, math.inf, -math.inf, math.nan, 1e308):
        assert ping_offset(bogus, 1_000_000.0, 1_000_002.0) is None


def test_non_finite_names_where_the_number_is():
    from geomesh_p2p.util.untrusted import non_finite

    assert non_finite({"a": [1, 2.5, "inf", None, True], "b": {"c": 10**400}}) is None  # strings and ints are finite
    assert non_finite({"a": [1, {"b": math.nan}]}) == "a[1].b"
    assert non_finite(json.loads("[Infinity]")) == "[0]" and non_finite(-math.inf) == "the value"
    deep: list = []
    for _ in range(5000):  # iterative: no RecursionError
        deep = [deep]
    assert non_finite(deep) is None


def test_the_simulator_refuses_non_finite_numbers(capsys):
    from geomesh_p2p.sim.cli import main
    from geomesh_p2p.sim.methods import MethodError, parse_method

    for label in ("geomesh+lr=inf", "diloco+outer_lr=nan", "geomesh+outer_lr=-inf"):
        with pytest.raises(MethodError, match="must be a finite number > 0"):
            parse_method(label)
    assert parse_method("geomesh+lr=3e-4").inner_lr == 3e-4
    assert main(["--target-ppl", "inf"]) == 2
    assert "--target-ppl must be a finite number > 1, got inf" in capsys.readouterr().err
