"""Child processes for the demo, the benchmarks and the process tests: owned by one object, stopped by
PID, and a server's address read back from its own "serving on HOST:PORT" line.

Servers here are started with ``--port 0``: the OS picks a free port when the server binds it, and the
server prints the address it bound (``geomesh-bootstrap``: "DHT node serving on HOST:PORT";
``geomesh-peer join``: "peer … serving on HOST:PORT"). Picking a port first and starting the server on it
later races with every other process on the machine, which can take the port in between.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

# The line both geomesh-bootstrap and geomesh-peer print once they listen; group 1 is HOST:PORT.
SERVING_RE = re.compile(r"serving on (\S+)")


def bootstrap_argv(run_id: str, identity: Path | str, *extra: str, host: str = "127.0.0.1", port: int = 0) -> list[str]:
    """The command line that starts a bootstrap node with this interpreter (``python -m bootstrap.cli``)
    for run ``run_id`` on ``host:port`` (0: the OS picks a free port; read it back with
    :func:`wait_for_address`), its key in file ``identity`` (created when absent); ``extra`` flags come
    last, so a flag given again there wins."""
    argv = [sys.executable, "-m", "bootstrap.cli", "--host", host, "--port", str(port)]
    return argv + ["--run-id", run_id, "--identity", str(identity), *extra]


def join_argv(bootstrap: str, identity: Path | str, *extra: str, run_id: str | None = None) -> list[str]:
    """The command line that starts a training peer with this interpreter (``python -m peer.cli join``)
    joining through ``bootstrap`` (``host:port``), its key in file ``identity``, in run ``run_id`` (None:
    the default run); ``extra`` flags come last."""
    argv = [sys.executable, "-m", "peer.cli", "join", "--bootstrap", bootstrap, "--identity", str(identity)]
    return argv + (["--run-id", run_id] if run_id is not None else []) + list(extra)


def read_json_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file (a peer's ``--log-json``), in file order; a line that does
    not parse (the peer is writing it) is skipped. An absent file gives ``[]``. Raises nothing else than
    OSError (unreadable file)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


class ProcGroup:
    """Owns the processes it starts, by name (``procs``: name -> Popen, in start order); :meth:`stop_all`
    ends each of them by its PID: SIGINT (a peer finishes its exchange and leaves), SIGKILL to whatever still
    runs ``grace_s`` seconds later."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        *,
        append: bool = False,
        cwd: Optional[Path] = None,
        new_session: bool = False,
    ) -> subprocess.Popen:
        """Start ``argv`` with stdout and stderr to ``log`` (appended to when ``append``, else truncated),
        unbuffered Python output; ``new_session`` puts it in a session of its own (a Ctrl+C on the terminal
        does not reach it: :meth:`stop_all` stops it). A process of the same name is replaced in ``procs``
        (stop it first). Raises OSError when ``argv[0]`` cannot be run or ``log`` cannot be opened."""
        with open(log, "a" if append else "w") as out:
            p = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=new_session,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        self.procs[name] = p
        return p

    def stop_all(self, grace_s: float = 30.0) -> None:
        """SIGINT to each running process, then wait for all of them together for ``grace_s`` seconds and
        SIGKILL (and reap) those still running. Idempotent: stopped processes are only reaped."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass  # exited between poll() and the signal
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def address_in_log(log: Path, offset: int = 0) -> Optional[str]:
    """HOST:PORT from the first "serving on HOST:PORT" line of ``log`` at or after byte ``offset``
    (where this start's output begins in a log appended to); None if there is none yet."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    m = SERVING_RE.search(text)
    return m.group(1) if m else None


def wait_for_address(log: Path, proc: subprocess.Popen, timeout: float, offset: int = 0, poll_s: float = 0.1) -> str:
    """Wait for ``proc``'s "serving on HOST:PORT" line in ``log`` (see :func:`address_in_log`) and return
    HOST:PORT. The process signals its start by no event we can wait on, so its log is read every
    ``poll_s`` seconds. Raises RuntimeError (with the log's tail) when the process exits first or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        address = address_in_log(log, offset)
        if address is not None:
            return address
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not serving after {timeout}s"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{log.stem} {why}:\n{tail}")
        time.sleep(poll_s)


def stop_process(p: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> Optional[int]:
    """Stop one child by PID: send ``sig`` if it still runs, wait ``grace_s`` seconds, then SIGKILL and
    reap (10 s). Idempotent. Returns its exit status (negative: killed by that signal)."""
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


class ServingProcess:
    """A Python server process whose output a thread reads: ``lines`` keeps its last ``keep_lines`` lines
    (all when None) and ``address`` is HOST:PORT from its first "serving on" line, read before the
    constructor returns. The caller stops it by PID with :meth:`stop` (in teardown / finally).

    Raises RuntimeError when the process ends or prints no such line within ``timeout`` seconds (it is
    stopped first)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cwd: Optional[Path],
        env: dict,
        timeout: float,
        stdin=subprocess.DEVNULL,
        keep_lines: Optional[int] = None,
    ):
        self.name = name
        self.p = subprocess.Popen(
            [sys.executable, *argv],
            cwd=cwd,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.address: Optional[str] = None
        found = threading.Event()
        stdout = self.p.stdout
        if stdout is None:  # stdout=PIPE above always gives one
            raise RuntimeError(f"{name}: no stdout pipe to read")

        def pump() -> None:  # reads until EOF so that the pipe never fills and blocks the server
            for line in stdout:
                self.lines.append(line.rstrip("\n"))
                if keep_lines is not None:
                    del self.lines[:-keep_lines]
                m = SERVING_RE.search(line)
                if m and self.address is None:
                    self.address = m.group(1)
                    found.set()
            found.set()  # EOF: the process ended without the line

        threading.Thread(target=pump, name=f"{name}-stdout", daemon=True).start()
        if not found.wait(timeout) or self.address is None:
            self.stop()
            raise RuntimeError(f"{name} did not start: {self.lines[-20:]}")

    @property
    def pid(self) -> int:
        """The process's PID."""
        return self.p.pid

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """Send ``sig`` if it still runs, wait ``grace_s`` seconds, then SIGKILL and reap. Idempotent."""
        stop_process(self.p, sig, grace_s)
