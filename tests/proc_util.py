"""Helpers of the tests that measure a server in its own process: start it, read its memory from
/proc/<pid>/status, stop it by PID in teardown; signed calls on a connection of their own."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import grpc

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.util.procs import ServingProcess, bootstrap_argv
from geomesh_p2p.wire import envelope_pb2

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
START_TIMEOUT = 90  # a cold interpreter imports torch + hivemind


def bootstrap_args(run_id: str, identity: Path, *extra: str) -> list[str]:
    """:func:`geomesh_p2p.util.procs.bootstrap_argv` (port 0 on 127.0.0.1) without the interpreter, for the
    starters that put ``sys.executable`` first themselves (:class:`Server`, test_bootstrap's ``procs``)."""
    return bootstrap_argv(run_id, identity, *extra)[1:]


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, VmHWM), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Server(ServingProcess):
    """A server process (stopped by PID in teardown, SIGTERM then SIGKILL); ``address`` from its first
    'serving on' line (:class:`geomesh_p2p.util.procs.ServingProcess`; RuntimeError when it does not start)."""

    def __init__(self, argv):
        super().__init__(
            "server",
            argv,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            timeout=START_TIMEOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "NONE"},
        )

    def kib(self, field: str) -> int:
        """A ``kB`` field of the server's /proc status (VmRSS, VmHWM), in KiB."""
        return status_kib(self.p.pid, field)


async def signed_call(
    address: str, identity: Identity, method: str, payload: bytes, *, run: str, timeout: float = 60.0
) -> grpc.StatusCode:
    """One signed call on its own connection (as a flood would make); returns the status code."""
    msg = identity.sign_message(run_id=run, round=0, kind=method, payload=payload)
    opts = [
        ("grpc.max_send_message_length", 1 << 30),
        ("grpc.max_receive_message_length", 1 << 30),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    async with grpc.aio.insecure_channel(address, options=opts) as ch:
        mc = ch.unary_unary(
            method,
            request_serializer=envelope_pb2.SignedMessage.SerializeToString,
            response_deserializer=envelope_pb2.SignedMessage.FromString,
        )
        try:
            await mc(msg, timeout=timeout)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


def closed_ports(n: int) -> list[int]:
    """``n`` local ports nobody listens on (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
