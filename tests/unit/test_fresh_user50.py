"""Fresh user 50's start-up findings: a missing ``--bootstrap`` said only at INFO that a new swarm starts; a
restart without ``--resume`` ignored the checkpoint in ``--checkpoint-dir`` silently; typed ``--identity`` and
``--checkpoint-dir`` paths made chains of missing folders (a mistyped folder became a new identity); the bootstrap
blamed its derived ``--state-file`` for a bad ``--identity``."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from bootstrap.cli import main as bootstrap_main
from geomesh_p2p.model import state as gstate
from geomesh_p2p.node import joining
from peer.cli import main

pytestmark = pytest.mark.timeout(60)


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_a_typed_identity_in_a_missing_folder_exits_2_and_makes_nothing(tmp_path, capsys):
    key = tmp_path / "nodir" / "p.key"
    assert main(["join", "--client-only", "--identity", str(key)]) == 2
    assert _err(capsys) == [
        f"geomesh-peer join: --identity {key}: its folder {key.parent} does not exist (a new key file is created, its "
        "folder is not: check the path)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_dir_may_be_made_but_not_its_missing_parents(tmp_path, capsys):
    ckpt = tmp_path / "nodir" / "ck"
    assert main(["join", "--client-only", "--identity", str(tmp_path / "id.key"), "--checkpoint-dir", str(ckpt)]) == 2
    assert _err(capsys) == [
        f"geomesh-peer join: --checkpoint-dir {ckpt}: its parent folder {ckpt.parent} does not exist (only the last "
        "folder is created: check the path)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_bootstraps_bad_identity_folder_is_blamed_on_identity(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    key = tmp_path / "file" / "b.key"
    assert bootstrap_main(["--port", "0", "--identity", str(key)]) == 2
    assert _err(capsys) == [f"geomesh-bootstrap: --identity {key}: its folder {key.parent} exists and is not a folder"]


def test_joins_help_says_that_without_bootstrap_the_peer_starts_a_new_swarm(capsys):
    with pytest.raises(SystemExit) as e:
        main(["join", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--bootstrap HOST:PORT a bootstrap (or any live peer) to join through; repeatable. Without it the peer starts "
        "a NEW swarm of its own (a swarm of one until others join through it)"
    ) in text


def _node(tmp_path, *, resume: bool, round: int, digest):
    return SimpleNamespace(cfg=SimpleNamespace(resume=resume, checkpoint_dir=str(tmp_path)), round=round, digest=digest)


def test_a_start_without_resume_names_the_checkpoint_it_does_not_use(tmp_path, caplog):
    path = gstate.save_checkpoint(tmp_path, round=79, theta=torch.ones(4), momentum=torch.zeros(4))

    own = json.loads(path.read_text())["digest"]
    cases = [
        (
            False,
            82,
            "other",
            [
                f"--checkpoint-dir {tmp_path} holds a checkpoint of round 79, NOT used: this peer started without --resume "
                "(it took the swarm's state of round 82, without that checkpoint's inner optimizer state and standing); to "
                "continue from it, restart with --resume"
            ],
        ),
        (
            False,
            0,
            "seed",
            [
                f"--checkpoint-dir {tmp_path} holds a checkpoint of round 79, NOT used: this peer started without --resume "
                "(it starts from the seed at round 0, without that checkpoint's inner optimizer state and standing); to "
                "continue from it, restart with --resume"
            ],
        ),
        (False, 79, own, []),  # continued from it (an empty swarm, joining._continue_from_own)
        (True, 79, own, []),  # --resume
    ]
    for resume, rnd, digest, said in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=joining.log.name):
            asyncio.run(joining.warn_unused_checkpoint(_node(tmp_path, resume=resume, round=rnd, digest=digest)))
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, m) for m in said], rnd
    caplog.clear()
    asyncio.run(joining.warn_unused_checkpoint(_node(tmp_path / "empty", resume=False, round=0, digest=None)))
    assert caplog.records == []
