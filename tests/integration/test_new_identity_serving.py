"""A key file created by the bootstrap's own process (fresh-user trial, session 32), over a real listening socket:
its creation is said last of its start lines, once it serves; a start that fails (a busy port) says nothing of it,
and its caller (bootstrap.cli._main) removes it. The rest: tests/unit/test_new_identity.py."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from bootstrap import cli as boot_cli
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.trust.admission import discard_new_identity
from tests.dht_helpers import RUN, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_bootstrap_says_a_created_key_last_once_it_serves(tmp_path, capsys):
    key = tmp_path / "b.key"
    ns = boot_cli.parse(
        ["--host", "127.0.0.1", "--port", "0", "--run-id", RUN, "--identity", str(key), "--state-file", ""]
        + ["--status-interval", "3600", "--pow-bits", "0"]
    )
    identity = Identity.load_or_create(key)
    stop = asyncio.Event()
    served = asyncio.ensure_future(boot_cli._serve(ns, identity, None, None, stop))
    out: list[str] = []

    async def said() -> bool:
        assert not served.done(), capsys.readouterr()
        out.extend(capsys.readouterr().out.splitlines())
        return any("created a new identity" in x for x in out)

    try:
        await wait_for(said, 30, 0.05, "the bootstrap's start lines")
    finally:
        stop.set()
        assert await asyncio.wait_for(served, 30) == 0
    starts = out[: out.index(next(x for x in out if x.startswith("created a new identity"))) + 1]
    assert starts[0].endswith("loading the DHT's libraries (seconds; longer on a loaded machine)")  # said first
    assert re.search(r"DHT node serving on \S+", starts[1])
    assert starts[-1] == (
        f"created a new identity at {key} (peer id {identity.peer_id.short()}…); pass the same --identity to keep it"
    )
    assert discard_new_identity(identity) is None and len(key.read_bytes()) == 32  # kept: a later stop leaves it


async def test_bootstrap_on_a_busy_port_says_nothing_of_the_key_and_its_caller_removes_it(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        key = tmp_path / "b.key"
        ns = boot_cli.parse(["--host", "127.0.0.1", "--port", str(port), "--run-id", RUN, "--identity", str(key)])
        identity = Identity.load_or_create(key)
        assert await boot_cli._serve(ns, identity, None, None, asyncio.Event()) == 2
    captured = capsys.readouterr()
    assert "created a new identity" not in captured.out + captured.err
    assert captured.err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in captured.err
    assert discard_new_identity(identity) == key and not key.exists()
