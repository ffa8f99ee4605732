"""Red team 43: ``geomesh-peer checkpoints`` over a checkpoint record whose fields have the wrong types (a
hand-edited or damaged ``ckpt-NNNNNNNN.json``). The listing said "unreadable metadata" only for JSON that did not
parse; a record that parsed with ``"round": "x"``, ``"digest": 5``, ``"time": "noon"``... ended in a traceback
(int() in the listing, the table's slicing and formatting). Now the row says which field is wrong, the others are
listed, and the command exits 1."""

from __future__ import annotations

import json

import pytest

import torch

from geomesh_p2p.model.export import ExportError, list_checkpoint_info, load_checkpoint
from geomesh_p2p.model.state import save_checkpoint
from peer.cli import main

pytestmark = pytest.mark.timeout(120)

_BAD = [
    ("round", "x"),
    ("round", None),
    ("round", 1e999),
    ("round", True),
    ("digest", 5),
    ("num_params", "many"),
    ("time", "noon"),
    ("time", 1e300),
    ("has_momentum", "yes"),
    ("run_config_hash", [1]),
]


def _write(d, rnd: int, **fields) -> None:
    rec = {"format": "geomesh-ckpt-v1", "round": rnd, "digest": "ab" * 16, "time": 1.7e9, "num_params": 10}
    rec.update(fields)
    (d / f"ckpt-{rnd:08d}.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("field,value", _BAD)
def test_a_field_of_the_wrong_type_is_the_rows_problem(tmp_path, capsys, field, value):
    _write(tmp_path, 3, **{field: value})
    _write(tmp_path, 4)  # a sound one beside it is still listed
    rows = list_checkpoint_info(tmp_path)
    assert [r["round"] for r in rows] == [3, 4]
    assert rows[0]["problem"] is not None and rows[0]["problem"].startswith("unreadable metadata")
    assert field in rows[0]["problem"]
    # the weights file is missing for the sound record: its problem says so, its fields are read
    assert rows[1]["digest"] == "ab" * 16 and rows[1]["num_params"] == 10 and "missing" in rows[1]["problem"]
    for argv in (["checkpoints", str(tmp_path)], ["checkpoints", str(tmp_path), "--json"]):
        assert main(argv) == 1
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "unreadable metadata" in out.out


def test_meta_fields_of_the_wrong_type(tmp_path, capsys):
    _write(tmp_path, 2, meta={"peer_id": 7, "run_config": "not a dict"})
    rows = list_checkpoint_info(tmp_path)
    assert rows[0]["problem"].startswith("unreadable metadata") and "peer_id" in rows[0]["problem"]
    assert main(["checkpoints", str(tmp_path)]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["x", None, 1.5, -1])
def test_load_checkpoint_names_a_round_that_is_no_round(tmp_path, value):
    """export / generate load a round through :func:`load_checkpoint`: its int() of the record's round raised a
    ValueError / TypeError for "x" / null, and read 1.5 as round 1 (the node's own resume refuses all three)."""
    p = save_checkpoint(tmp_path, round=3, theta=torch.ones(10), momentum=None, meta={})
    rec = json.loads(p.read_text())
    assert load_checkpoint(tmp_path)[0] == 3
    rec["round"] = value
    p.write_text(json.dumps(rec))
    with pytest.raises(ExportError, match=r"corrupt checkpoint metadata .*ckpt-00000003.json: round .* is not a round"):
        load_checkpoint(tmp_path)
