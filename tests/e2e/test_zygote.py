"""The test zygote (tests/zygote.py) starts a process as ``python -m`` would: a forked child of the pre-imported
interpreter sees the same ``__name__``, argv, ``sys.path[0]``, working directory, environment, signal dispositions
and empty stdin as a cold interpreter started by ``subprocess.Popen``, runs the project's code from the same
files (the zygote's preloaded library modules and ``peer`` CLI modules, but not ``peer.cli``, which runs as the
program, nor the ``bootstrap`` package), and ends with the same exit status (a code, an uncaught Ctrl+C, a SIGKILL)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import zygote

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-m", "tests.zygote_probe"]


def _cold(args, tmp_path: Path, name: str, argv=None, cwd: Path = ROOT) -> subprocess.Popen:
    """The probe with ``args`` (or the whole command ``argv``) as a cold process in ``cwd``, output to ``name``."""
    with open(tmp_path / name, "w") as out:
        return subprocess.Popen(
            argv or PROBE + args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )


def _forked(args, tmp_path: Path, name: str, argv=None, cwd: Path = ROOT):
    """The same as :func:`_cold`, forked by the zygote (the test skips where this worker's zygote cannot fork)."""
    child = zygote.spawn(argv or PROBE + args, tmp_path / name, append=False, cwd=cwd)
    if child is None and zygote.last_refusal.startswith("env:"):
        # an earlier test of this worker started the zygote under a changed environment: this worker's processes
        # start cold, which is correct; what this test compares cannot be seen here
        pytest.skip(f"the zygote cannot fork in this worker: {zygote.last_refusal}")
    assert child is not None, f"the zygote did not fork: {zygote.last_refusal}"
    return child


def _seen(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name).read_text().splitlines()[0])


def _same_but_preload(forked: dict, cold: dict) -> None:
    """``forked`` saw what ``cold`` saw, but for the modules preloaded by the zygote: the project's code from the
    same files, neither ``peer.cli`` (the program a child runs) nor the ``bootstrap`` package (whose import reads
    argv) imported before its start,
    and nothing of the project a cold start had not imported beyond what the zygote preloaded."""
    assert {k: v for k, v in forked.items() if k != "project_imported"} == {
        k: v for k, v in cold.items() if k != "project_imported"
    }
    assert cold["project_imported"] == []
    preloaded = zygote._zygote.project if zygote._zygote is not None else []
    assert forked["project_imported"] == preloaded
    assert "peer.cli" not in preloaded and not [m for m in preloaded if m.split(".")[0] == "bootstrap"]


@pytest.mark.skipif(not zygote.ENABLED, reason="GEOMESH_TEST_ZYGOTE=0")
def test_a_forked_child_sees_what_a_cold_python_m_sees_and_exits_the_same_way(tmp_path):
    cold, forked = _cold(["exit", "3"], tmp_path, "cold.log"), _forked(["exit", "3"], tmp_path, "forked.log")
    assert (cold.wait(120), forked.wait(120)) == (3, 3)
    seen = _seen(tmp_path, "forked.log")
    _same_but_preload(seen, _seen(tmp_path, "cold.log"))
    assert seen["name"] == "__main__" and seen["argv"] == ["exit", "3"] and seen["argv0"] == "zygote_probe.py"
    assert seen["path0"] == str(ROOT) and seen["unbuffered"] == "1" and seen["sigterm"]
    # Python's SIGINT handler, unless this test runs with SIGINT ignored (a background job of a script): then both
    # keep it ignored
    assert seen["sigint"] is (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    assert seen["stdin"] == "" and seen["project_files"]["geomesh_p2p"] == str(ROOT / "geomesh_p2p" / "__init__.py")

    # Ctrl+C: an uncaught KeyboardInterrupt ends both by SIGINT; SIGKILL: -9; poll() says so after wait(). With
    # SIGINT ignored here (a background job of a script) both children inherit SIG_IGN, as asserted above, and
    # neither can be ended by it: only SIGKILL is compared then (a run started with `&` waited 60 s and failed)
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    for sig in (signal.SIGKILL,) if ignored else (signal.SIGINT, signal.SIGKILL):
        cold, forked = _cold(["wait"], tmp_path, "cold.log"), _forked(["wait"], tmp_path, "forked.log")
        for p, log in ((cold, "cold.log"), (forked, "forked.log")):
            _wait_text(p, tmp_path / log, "waiting")
            p.send_signal(sig)
        assert (cold.wait(60), forked.wait(60)) == (-sig, -sig)
        assert forked.poll() == forked.returncode == -sig


def test_a_piped_child_streams_its_stdout_and_stderr(tmp_path):
    child = zygote.spawn_piped(PROBE + ["exit", "0"], cwd=ROOT)
    if child is None:
        pytest.skip("the zygote is off (GEOMESH_TEST_ZYGOTE=0) or refuses to fork")
    out = child.stdout.read()
    assert json.loads(out)["argv"] == ["exit", "0"]
    assert child.stderr.read() == "" and child.wait(60) == 0


@pytest.mark.skipif(not zygote.ENABLED, reason="GEOMESH_TEST_ZYGOTE=0")
def test_the_zygote_preloads_the_library_without_threads_and_a_child_elsewhere_imports_its_own(tmp_path):
    """The zygote's project preload leaves it with one thread, the OS's count (no gRPC poller, no pool), and
    imports the library's modules and the ``peer`` CLI's (tests/zygote.py's PRELOAD_CLI), but not ``peer.cli`` (run
    as the program) nor the ``bootstrap`` package (whose import reads argv). A child whose working directory holds another
    ``geomesh_p2p`` (first on its ``sys.path``) runs that one's code, as a cold interpreter does there."""
    child = _forked(["exit", "0"], tmp_path, "forked.log")
    assert child.wait(120) == 0
    z = zygote._zygote
    assert z is not None and z.threads == [] and z.usable
    assert "geomesh_p2p.node.peer" in z.project and "geomesh_p2p.config.flags" in z.project
    assert {"peer", *zygote.PRELOAD_CLI, "peer.path_checks"} <= set(z.project)
    assert "peer.cli" not in z.project and not [m for m in z.project if m.split(".")[0] == "bootstrap"]

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "geomesh_p2p" / "config").mkdir(parents=True)
    (elsewhere / "geomesh_p2p" / "__init__.py").write_text("")
    (elsewhere / "geomesh_p2p" / "config" / "__init__.py").write_text("")
    (elsewhere / "geomesh_p2p" / "config" / "flags.py").write_text("")
    # a probe of its own name there: the zygote's ``tests`` package is the repository's
    (elsewhere / "zprobe.py").write_text((ROOT / "tests" / "zygote_probe.py").read_text())
    argv = [sys.executable, "-m", "zprobe", "exit", "5"]
    cold = _cold([], tmp_path, "cold.log", argv=argv, cwd=elsewhere)
    forked = _forked([], tmp_path, "forked.log", argv=argv, cwd=elsewhere)
    assert (cold.wait(120), forked.wait(120)) == (5, 5)
    seen, cold_seen = _seen(tmp_path, "forked.log"), _seen(tmp_path, "cold.log")
    assert seen == cold_seen
    assert seen["project_files"]["geomesh_p2p.config.flags"] == str(elsewhere / "geomesh_p2p" / "config" / "flags.py")
    assert seen["project_imported"] == []


def _netns_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and Path("/proc/self/ns/net").exists()


@pytest.mark.skipif(not zygote.ENABLED, reason="GEOMESH_TEST_ZYGOTE=0")
@pytest.mark.skipif(not _netns_usable(), reason="needs root and ip (ip netns add)")
def test_a_child_behind_ip_netns_exec_runs_in_that_namespace_as_a_cold_one_does(tmp_path):
    """``ip netns exec NAME python -m ...`` (test_slow_link's joiner) forks too: the child joins the namespace itself
    and sees what the cold command sees, that namespace included; exits the same way."""
    ns = f"gmzyg{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"ip netns add is not permitted: {made.stderr.strip()}")
    try:
        wrapped = ["ip", "netns", "exec", ns, *PROBE, "exit", "4"]
        cold = _cold([], tmp_path, "cold.log", argv=wrapped)
        forked = _forked([], tmp_path, "forked.log", argv=wrapped)
        assert (cold.wait(120), forked.wait(120)) == (4, 4)
        seen = _seen(tmp_path, "forked.log")
        _same_but_preload(seen, _seen(tmp_path, "cold.log"))
        assert seen["netns"] != os.readlink("/proc/self/ns/net")
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _wait_text(p, log: Path, text: str) -> None:
    """Until ``log`` holds ``text`` (the probe wrote it and now waits for a signal); fails if ``p`` exits first."""
    deadline = time.monotonic() + 120
    while text not in log.read_text():
        assert p.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no {text!r} in {log}"
        time.sleep(0.05)
