"""A handle on a worker subprocess that speaks JSON lines on stdin/stdout, shared by the collective tests
(tests/integration/test_collective_failures.py) and benchmarks (benchmarks/collective*.py)."""

from __future__ import annotations

import asyncio
import json
import sys


class JsonLineProc:
    """One worker started with ``stdin=PIPE, stdout=PIPE``: commands go in as one JSON object a line, events
    come out as one JSON object a line (non-JSON lines, e.g. library chatter, are skipped)."""

    def __init__(self, proc: asyncio.subprocess.Process, timeout: float = 60.0):
        self.proc = proc
        self.timeout = timeout  # seconds: the default wait for one event

    @classmethod
    async def start(cls, script: str, *args: str, env: dict, stderr=None, timeout: float = 60.0) -> JsonLineProc:
        """Start ``python script args...`` with its stdin and stdout piped (stderr: inherited, or ``stderr``)
        and return its handle; ``timeout`` is the default wait for one event, seconds. Raises OSError when
        the interpreter cannot be started."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            script,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        return cls(proc, timeout=timeout)

    async def read(self, timeout: float | None = None) -> dict:
        """The next JSON event (a dict). Raises :class:`EOFError` if the worker closed stdout (exited),
        :class:`asyncio.TimeoutError` after ``timeout`` seconds (default ``self.timeout``) without a line."""
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout or self.timeout)
            if not line:
                raise EOFError(f"worker {self.proc.pid} exited (rc={self.proc.returncode}); see its stderr")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue

    def send(self, obj) -> None:
        """Writes ``obj`` as one line: a str as it is (e.g. a malformed command), anything else as JSON."""
        self.proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n")


async def exit_workers(procs: list[JsonLineProc], timeout: float = 60.0) -> None:
    """Sends ``{"cmd": "exit"}`` to every worker, then waits (``timeout`` seconds each) for each to end."""
    for p in procs:
        p.send({"cmd": "exit"})
    for p in procs:
        await asyncio.wait_for(p.proc.wait(), timeout)


async def kill_workers(procs: list[JsonLineProc]) -> None:
    """SIGKILLs every worker still running (by its own PID) and reaps it; for teardown / ``finally``."""
    for p in procs:
        if p.proc.returncode is None:
            try:
                p.proc.kill()
            except ProcessLookupError:  # it ended between the check and the kill
                pass
            await p.proc.wait()


async def commands():
    """The worker side: each JSON command read from stdin (one object a line), until EOF or ``{"cmd": "exit"}``.
    stdin is read in the default executor so the worker's event loop keeps serving meanwhile."""
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            return
        yield cmd
