"""`geomesh-peer join` with bad input: one line on stderr naming the problem, non-zero exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import zygote
from tests.swarm_util import FAST, ProcSwarm, dead_address

pytestmark = pytest.mark.timeout(240)


def _join(tmp_path, *args, timeout=180, fork=True):
    """``geomesh-peer join`` run to its end (stdout, stderr, exit code), forked from the worker's zygote when it
    can be (tests/zygote.py: ~2.5 s instead of ~5 s for a join that imports torch). ``fork=False``: a cold
    interpreter, cheaper for a command line refused by argparse (0.3 s; a forked child imports the project first,
    ~1.7 s)."""
    argv = [sys.executable, "-m", "peer.cli", "join", "--identity", str(tmp_path / "id.key"), *FAST, *args]
    if fork:
        return zygote.run(argv, timeout=timeout)
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


def _one_line_error(r) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("geomesh-peer")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_missing_data_path(tmp_path):
    line = _one_line_error(_join(tmp_path, "--data", str(tmp_path / "nope.txt")))
    assert f"--data {tmp_path / 'nope.txt'}: no such file" in line


def test_unreadable_data_path(tmp_path):
    if os.geteuid() == 0:
        # root reads anything: a folder stands in for an unreadable file
        line = _one_line_error(_join(tmp_path, "--data", str(tmp_path)))
        assert f"--data {tmp_path}: not a file" in line
        return
    f = tmp_path / "secret.txt"
    f.write_text("x")
    f.chmod(0)
    assert "cannot read" in _one_line_error(_join(tmp_path, "--data", str(f)))


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("tiny.txt", b"hello world", "too few tokens for seq_len 32 (train "),
        ("binary.txt", b"\x00\xff\xfe\x00 some text after it", "not valid UTF-8 text (byte 1)"),
    ],
)
def test_data_too_short_or_not_text_is_a_bad_file_named_before_the_proof_of_work(tmp_path, name, content, said):
    """Fresh user 47: both exited 1, after torch, the proof of work and the DHT join (10-15 s); an empty file exits 2
    at once. They are bad files too: exit 2, said before the proof of work and before anything listens."""
    f = tmp_path / name
    f.write_bytes(content)
    r = _join(tmp_path, "--data", str(f))
    line = _one_line_error(r)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert line.startswith(f"geomesh-peer join: --data {f}: {said}"), line
    assert "proof of work (" not in r.stderr and "serving on" not in r.stderr, r.stderr  # neither done nor joined
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("id.key")) == []  # the new key removed


def test_model_config_that_does_not_parse(tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text('{"n_layer": 2,, }')
    line = _one_line_error(_join(tmp_path, "--model-config", str(cfg)))
    assert f"--model-config {cfg} is not valid JSON" in line


def test_bootstrap_that_does_not_answer(tmp_path):
    with dead_address() as entry:  # bound, never listening: connections are refused
        r = _join(tmp_path, "--bootstrap", entry, "--join-attempts", "3")  # 1.5 s of backoff, not the default 15 s
    line = _one_line_error(r)
    assert line.startswith(
        f"geomesh-peer join: could not join the DHT: nothing listens at {entry} (connection refused at each of 3 "
        "attempt(s) in "
    ), line
    # named before the proof of work and the join (session 33: ~52 s in; 63-76 s with the join's retries, s44)
    assert "proof of work" not in r.stderr, r.stderr
    # each retry one short line (no ~250-character gRPC text), naming the address
    retries = [x for x in r.stderr.splitlines() if "retrying in" in x]
    assert [x.split(": ", 1)[1] for x in retries] == [
        f"no answer from {entry} (connection refused); retrying in 0.5 s (attempt 1 of 3)",
        f"no answer from {entry} (connection refused); retrying in 1.0 s (attempt 2 of 3)",
    ], retries
    # no key file made (nor a proof of work cached beside it) for a start refused this early (session 32)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("id.key")) == []


def test_bad_flag_values_fail_at_start(tmp_path):
    for args, text in [
        (["--bootstrap", "notaport"], "expected HOST:PORT"),
        (["--window-s", "0"], "argument --window-s: must be a finite number > 0"),
        (["--speed-factor", "-1"], "argument --speed-factor: must be a finite number > 0"),
        (["--speed-factor", "2"], "argument --speed-factor: must be in (0, 1]"),
        (["--upload-mbps", "1e-320"], "argument --upload-mbps: must be between 0.001"),
        (["--download-mbps", "inf"], "argument --download-mbps: must be a finite number"),
        (["--port", "70000"], "argument --port: must be in [0, 65535]"),
        (["--eval-every", "0"], "argument --eval-every: must be >= 1"),
        (["--profile-batches", "4,x"], "argument --profile-batches: expected comma-separated"),
        (["--outer-momentum", "1"], "argument --outer-momentum: must be in [0, 1)"),
    ]:
        r = _join(tmp_path, *args, timeout=60, fork=False)
        assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_incompatible_run_config_is_refused_saying_what_differs(tmp_path):
    swarm = ProcSwarm(tmp_path)
    try:
        # port 0: it binds a free port and prints it. --min-peers 2 (a node flag, not the run config the joiners
        # are compared with): it waits, live and announced, for a second peer instead of training alone meanwhile
        # (it trained alone through the whole test before: ~15 CPU-s)
        swarm.peer("a", "--rounds", "50", "--min-peers", "2", "--wait-peers-s", "3600")
        entry = swarm.address("a")
        swarm.wait_for(lambda: "round 0: eval perplexity" in swarm.text("a"), 180, "the first peer to start")
        r = _join(tmp_path, "--bootstrap", entry, "--inner-lr", "0.0003")
        line = _one_line_error(r)
        assert "use another run config" in line
        assert "inner_lr: 0.0003 here vs 0.001 in the swarm" in line
        assert "give another --run-id" in line  # and what to do about it (fresh user 51)
        # refused right after joining the DHT: no data loading, no device profiling first
        assert "tokens/s per batch" not in r.stdout + r.stderr
        # the same key in a second process (issue 14 #7): refused, naming where it already runs
        # with a --checkpoint-dir that did not exist: the refused start leaves no empty folder (fresh user, s37)
        ckpt = tmp_path / "new"  # only its last folder is missing (a chain is refused: fresh user 50)
        r = _join(tmp_path, "--bootstrap", entry, "--identity", str(tmp_path / "a.key"), "--checkpoint-dir", str(ckpt))
        line = _one_line_error(r)
        assert "is already live at 127.0.0.1:" in line and "own key file" in line
        assert not (tmp_path / "new").exists()
        assert swarm.procs["a"].poll() is None  # the first one goes on
    finally:
        swarm.stop_all()


def test_resume_from_a_checkpoint_of_another_run_config_is_refused(tmp_path):
    """A ddp checkpoint resumed as geomesh: one line naming the differing field, no traceback."""
    import torch

    from geomesh_p2p.node.peer import RunConfig
    from geomesh_p2p.model.state import save_checkpoint

    other = RunConfig(method="ddp")
    save_checkpoint(
        tmp_path / "ck",
        round=4,
        theta=torch.zeros(10),
        momentum=torch.zeros(20),
        meta={"run_config_hash": other.config_hash(), "run_config": other.model_dump()},
    )
    line = _one_line_error(_join(tmp_path, "--resume", "--checkpoint-dir", str(tmp_path / "ck")))
    assert "is from another run config" in line and "method: 'ddp' there vs 'geomesh' here" in line
    # the refused peer took no state: its shutdown writes no round-0 checkpoint of an empty buffer there
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-00000004.json", "ckpt-00000004.safetensors"]


def _join_until(tmp_path, bootstrap: str, line: str, name: str):
    """``geomesh-peer join --bootstrap BOOTSTRAP`` started (forked from the worker's zygote when it can be: ~4 CPU-s
    of imports less), then SIGINT once its log has ``line``: (exit status, log text)."""
    import signal
    import time

    argv = [sys.executable, "-m", "peer.cli", "join", "--identity", str(tmp_path / "id.key"), *FAST]
    argv += ["--bootstrap", bootstrap]
    log = tmp_path / name
    p = zygote.spawn(argv, log, append=False)
    if p is None:
        with log.open("w") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.time() + 120
        while line not in log.read_text() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert line in log.read_text(), log.read_text()
        p.send_signal(signal.SIGINT)
        return p.wait(timeout=30), log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ctrl_c_while_the_bootstrap_is_unreachable_exits_0_at_once(tmp_path):
    """Review finding: Ctrl+C during the join's retries took ~25 s and exited 1; each retry is now logged.
    "At once": the join does not go on to its last attempt (each retry logs "attempt k of n"). A bootstrap that
    accepts TCP and never answers (silent: retried by the join, after the proof of work)."""
    import re
    import socket

    with socket.socket() as hang:
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)  # accepts (the kernel's backlog), never reads nor answers
        status, text = _join_until(tmp_path, f"127.0.0.1:{hang.getsockname()[1]}", "no bootstrap answered yet", "a.log")
    assert status == 0, text
    assert "stop requested before this peer joined the swarm" in text
    assert "Traceback" not in text
    attempts = [(int(k), int(n)) for k, n in re.findall(r"\(attempt (\d+) of (\d+)\)", text)]
    assert attempts and max(k for k, _ in attempts) < attempts[0][1] - 1, attempts


def test_ctrl_c_while_nothing_listens_at_the_bootstrap_exits_0_at_once(tmp_path):
    """Nothing listens at --bootstrap: its retries come before torch (session 44); Ctrl+C during them ends the start
    at once, exit 0, one line, no key file left."""
    status, text = _join_until(tmp_path, "127.0.0.1:1", "retrying in", "b.log")
    assert status == 0, text
    assert text.splitlines()[-1] == "geomesh-peer join: stopped during start-up", text
    assert "Traceback" not in text and "proof of work" not in text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("id.key")] == []
