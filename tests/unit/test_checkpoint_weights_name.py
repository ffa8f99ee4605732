"""A checkpoint record (``ckpt-NNNNNNNN.json``) names its weights file; that name is confined to the record's folder
(session 44: an absolute path or ``../`` was read as the weights, on ``--resume``, ``checkpoints``, ``export`` and
``generate``, and its size was ``stat``-ed). Each such name is refused naming the record, the name and why; a plain
name of the folder (and the default, absent or null) still loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from geomesh_p2p.model.export import ExportError, list_checkpoint_info, load_checkpoint
from geomesh_p2p.model.state import CheckpointError, load_latest_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)


def _checkpoint(tmp_path):
    """A real checkpoint of round 3 in ``tmp_path/ck`` and a sound copy of its weights outside that folder:
    (its record's path, the outside copy)."""
    ck = tmp_path / "ck"
    meta = save_checkpoint(ck, round=3, theta=torch.arange(8, dtype=torch.float32), momentum=None)
    outside = tmp_path / "elsewhere" / "stolen.safetensors"
    outside.parent.mkdir()
    shutil.copy(ck / "ckpt-00000003.safetensors", outside)
    return meta, outside


def _name_weights(meta, name) -> None:
    rec = json.loads(meta.read_text())
    rec["weights"] = name
    meta.write_text(json.dumps(rec))


@pytest.mark.parametrize(
    "name, why",
    [
        ("OUTSIDE", "is not in the checkpoint's folder (a file name, without a folder part)"),
        ("../elsewhere/stolen.safetensors", "is not in the checkpoint's folder (a file name, without a folder part)"),
        ("sub/ckpt-00000003.safetensors", "is not in the checkpoint's folder (a file name, without a folder part)"),
        ("..", "is not in the checkpoint's folder (a file name, without a folder part)"),
        ("ckpt-00000003.json", "is not a .safetensors file"),
        (5, "is not a file name"),
    ],
)
def test_a_weights_name_outside_the_folder_is_refused_naming_it(tmp_path, name, why):
    meta, outside = _checkpoint(tmp_path)
    name = str(outside) if name == "OUTSIDE" else name
    _name_weights(meta, name)
    want = f"corrupt checkpoint metadata {meta}: its weights file {name!r} {why}"
    with pytest.raises(CheckpointError) as ei:  # --resume
        load_latest_checkpoint(meta.parent)
    assert str(ei.value) == want
    with pytest.raises(ExportError) as ei:  # export, generate, checkpoints --verify
        load_checkpoint(meta.parent, 3)
    assert str(ei.value) == want
    (row,) = list_checkpoint_info(meta.parent)  # checkpoints: no stat of the named file
    # a name that is no text is the listing's field check's (red team 43)
    listed = "weights 5 is not str" if name == 5 else f"its weights file {name!r} {why}"
    assert row["problem"] == f"unreadable metadata ({listed})" and row["bytes"] is None


@pytest.mark.parametrize("name", ["ckpt-00000003.safetensors", None, "ABSENT"])
def test_a_weights_name_of_the_folder_loads(tmp_path, name):
    meta, _ = _checkpoint(tmp_path)
    if name == "ABSENT":
        rec = json.loads(meta.read_text())
        del rec["weights"]
        meta.write_text(json.dumps(rec))
    else:
        _name_weights(meta, name)
    rnd, theta, momentum, _ = load_latest_checkpoint(meta.parent)
    assert rnd == 3 and theta.tolist() == [float(i) for i in range(8)] and momentum is None
    assert load_checkpoint(meta.parent, 3)[0] == 3
    (row,) = list_checkpoint_info(meta.parent, verify=True)
    assert row["problem"] is None and row["bytes"] == (meta.parent / "ckpt-00000003.safetensors").stat().st_size + (
        meta.stat().st_size
    )


@pytest.mark.parametrize(
    "name, why",
    [
        # a lone surrogate (valid JSON: "\ud800"): no file name can hold it; `checkpoints` crashed on its stat with a
        # UnicodeEncodeError traceback (red team 44)
        ("\ud800.safetensors", "is not a file name this system can spell"),
        # over NAME_MAX: the stat's ENAMETOOLONG read as "weights file ... is missing"
        ("w" * 300 + ".safetensors", "is longer than a file name may be (255 bytes)"),
    ],
)
def test_a_weights_name_no_file_can_have_is_refused_naming_it(tmp_path, capsys, name, why):
    from peer.cli import main

    meta, _ = _checkpoint(tmp_path)
    _name_weights(meta, name)
    shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:197] + "..."
    with pytest.raises(CheckpointError) as ei:
        load_latest_checkpoint(meta.parent)
    assert str(ei.value) == f"corrupt checkpoint metadata {meta}: its weights file {shown} {why}"
    (row,) = list_checkpoint_info(meta.parent)
    # the listing's field check words a surrogate first (any text field: the table prints them)
    listed = f"weights {name!r:.40} is not UTF-8 text" if "\ud800" in name else f"its weights file {shown} {why}"
    assert row["problem"] == f"unreadable metadata ({listed})" and row["bytes"] is None
    assert main(["checkpoints", str(meta.parent)]) in (0, 1)  # a table with the problem, no traceback
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("field", ["digest", "run_config_hash", "weights", "meta.peer_id"])
def test_a_record_text_with_a_lone_surrogate_is_a_problem_row(tmp_path, field):
    """A record's text field holding JSON's ``"\\ud800"`` was listed as is, and the ``checkpoints`` table's print to a
    UTF-8 terminal raised UnicodeEncodeError, a traceback (red team 44): now the row's problem names it."""
    meta, _ = _checkpoint(tmp_path)
    rec = json.loads(meta.read_text())
    where, name = (rec.setdefault("meta", {}), "peer_id") if field == "meta.peer_id" else (rec, field)
    where[name] = "a\ud800"
    meta.write_text(json.dumps(rec))
    (row,) = list_checkpoint_info(meta.parent)
    assert row["problem"] == f"unreadable metadata ({name} 'a\\ud800' is not UTF-8 text)"
    assert row["bytes"] is None and row["digest"] is None
