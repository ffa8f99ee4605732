"""Fresh user 52: ``geomesh-peer join --modle tiny`` suggested ``--mode`` (difflib's ratio) where ``--model`` is one
swap away, and a YAML config holding both ``min-peers: 3`` and ``min_peers: 2`` was taken silently (the last won)."""

from __future__ import annotations

import pytest

from geomesh_p2p.config.flags import _edit_distance, closest
from peer.cli import main

pytestmark = pytest.mark.timeout(60)


def test_edit_distance_counts_a_swap_as_one_edit():
    assert _edit_distance("--modle", "--model") == 1
    assert _edit_distance("--modle", "--mode") == 1
    assert _edit_distance("abc", "abc") == 0
    assert _edit_distance("", "abc") == 3
    assert _edit_distance("kitten", "sitting") == 3


def test_closest_prefers_fewest_edits_then_the_nearest_length_then_the_longer():
    assert closest("--modle", ["--mode", "--model", "--min-peers"]) == "--model"
    assert closest("--thread", ["--threads", "--thread-pool"]) == "--threads"
    assert closest("--mod", ["--mode", "--model"]) == "--mode"  # one insert beats two
    assert closest("zzz", ["--mode", "--model"]) is None  # nothing near: no hint


def test_a_swapped_flag_suggests_the_flag_it_swaps(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["join", "--modle", "tiny"])
    assert ei.value.code == 2
    assert capsys.readouterr().err == (
        "geomesh-peer join: error: unrecognized arguments: --modle tiny (--modle: did you mean --model?) "
        "(see geomesh-peer join --help)\n"
    )


def test_a_config_key_with_dashes_and_underscores_both_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("min-peers: 3\nmin_peers: 2\n")
    assert main(["join", "--config", str(cfg), "--identity", str(tmp_path / "id.key")]) == 2
    assert capsys.readouterr().err == (
        f"geomesh-peer join: config file {cfg}: 'min-peers' and 'min_peers' are the same option (--min-peers): "
        "keep one\n"
    )
    assert not (tmp_path / "id.key").exists()  # refused before anything starts
    cfg.write_text("modle: tiny\n")
    assert main(["join", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        f"geomesh-peer join: config file {cfg}: unknown option 'modle' (did you mean model?)\n"
    )
