"""Every path flag of ``geomesh-peer`` and ``geomesh-bootstrap`` is checked at start: a bad one exits 2 with one line
naming the flag (README: "2 a bad flag or file"; fresh user 49: ``checkpoints nosuchdir``, ``generate
--checkpoint-dir nosuchdir`` and ``join --checkpoint-dir /proc/nope`` exited 1, ``--state-file /nonexist/dir/b.json``
made its folder). Also the default ``--run-id`` named as such, and the planned-out line's reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bootstrap.cli import main as bootstrap_main
from geomesh_p2p.config.models import DEFAULT_RUN_ID, run_named
from geomesh_p2p.dht.preflight import other_run_message
from geomesh_p2p.round.planning import left_out_why
from peer.cli import main

pytestmark = pytest.mark.timeout(60)


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["checkpoints", "nosuchdir"], "geomesh-peer checkpoints: DIR nosuchdir: no such directory"),
        (
            ["generate", "--checkpoint-dir", "nosuchdir", "--prompt", "x"],
            "geomesh-peer generate: --checkpoint-dir nosuchdir: no such directory",
        ),
        (
            ["export", "--checkpoint-dir", "nosuchdir", "--out", "o"],
            "geomesh-peer export: --checkpoint-dir nosuchdir: no such directory",
        ),
    ],
)
def test_a_missing_checkpoint_folder_exits_2_naming_the_flag(tmp_path, monkeypatch, capsys, argv, line):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert _err(capsys) == [line]
    assert not (tmp_path / "o").exists()


def test_generates_data_file_is_checked_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "ckpt-00000001.json").write_text("{}")
    assert main(["generate", "--checkpoint-dir", "ck", "--data", "no.txt", "--prompt", "x"]) == 2
    assert _err(capsys) == ["geomesh-peer generate: --data no.txt: no such file"]


def _join(tmp_path, *flags: str) -> list[str]:
    return ["join", "--client-only", "--identity", str(tmp_path / "id.key"), *flags]


def test_join_checkpoint_dir_that_cannot_be_made_exits_2_before_torch(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "ckpt"
    assert main(_join(tmp_path, "--checkpoint-dir", str(bad))) == 2
    assert _err(capsys) == [f"geomesh-peer join: --checkpoint-dir {bad}: cannot write there (Not a directory)"]
    assert not (tmp_path / "id.key").exists()


def test_join_identity_whose_folder_cannot_be_made_exits_2_and_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    ckpt = tmp_path / "new"  # tried (made, written, removed) before the identity's check refuses
    key = tmp_path / "file" / "k.key"
    assert main(["join", "--client-only", "--identity", str(key), "--checkpoint-dir", str(ckpt)]) == 2
    assert _err(capsys) == [
        f"geomesh-peer join: --identity {key}: its folder {tmp_path / 'file'} exists and is not a folder"
    ]
    assert not (tmp_path / "new").exists()


def test_status_identity_is_checked_at_start(tmp_path, capsys):
    (tmp_path / "dir.key").mkdir()
    assert main(["status", "--bootstrap", "127.0.0.1:1", "--identity", str(tmp_path / "dir.key")]) == 2
    assert _err(capsys) == [f"geomesh-peer status: --identity {tmp_path / 'dir.key'}: is a folder, expected a key file"]


def test_bootstrap_state_file_in_a_missing_folder_exits_2_and_makes_nothing(tmp_path, capsys):
    state = tmp_path / "nonexist" / "dir" / "b3.json"
    argv = ["--port", "0", "--identity", str(tmp_path / "b.key"), "--state-file", str(state)]
    assert bootstrap_main(argv) == 2
    assert _err(capsys) == [
        f"geomesh-bootstrap: --state-file {state}: folder {state.parent} does not exist (the file is created, its "
        "folder is not)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no key


def test_the_default_run_id_is_named_as_the_default():
    assert run_named(DEFAULT_RUN_ID) == "'geomesh-demo' (the default --run-id)"
    assert run_named("R") == "'R'"
    reason = "message is for run 'geomesh-demo', this node serves 'R'"
    assert other_run_message("127.0.0.1:31337", reason, DEFAULT_RUN_ID) == (
        "could not join the DHT: bootstrap 127.0.0.1:31337 serves run 'R', not the run 'geomesh-demo' (the default "
        "--run-id) asked for: check --run-id"
    )


def _drv(history_rounds, synced_to=None):
    return SimpleNamespace(history=[SimpleNamespace(round=r) for r in history_rounds], _synced_to=synced_to)


def test_a_catching_up_peer_is_not_told_it_is_too_slow():
    """Fresh user 49: a resumed peer syncing round by round read "too slow for the 6.0 s window" each round."""
    plan = SimpleNamespace(created_at=1000.0, window_s=6.0)
    assert left_out_why(_drv([], synced_to=(55, 1000.5)), 55, plan) == (
        "it was still catching up when the plan was made: it reached round 55's state by a sync 0.5 s after it; "
        "it is planned once it announces a round in step"
    )
    assert left_out_why(_drv([], None), 54, plan) == (
        "it had trained no round here yet (it joined or resumed just now): a leader plans a peer once it has "
        "announced itself in step before the plan"
    )
    # in step long before the plan, with rounds trained: the leader's reasons (speed among them)
    assert left_out_why(_drv([53, 54], synced_to=(55, 900.0)), 55, plan) == (
        "the leader left it out: it missed an earlier round's exchange, or its link or device is too slow for the "
        "6.0 s window; see the leader's log"
    )
