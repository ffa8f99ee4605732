"""Issue 29 #7, the kind "a resource that comes back", at the bootstrap: its --state-file cannot be written
(a full disk, a read-only mount) and then can. It serves on, says so once (not once per --status-interval),
and once when the state is saved again."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from bootstrap import cli as boot_cli
from geomesh_p2p.net.identity import Identity
from tests.dht_helpers import RUN, wait_for

pytestmark = pytest.mark.timeout(240)  # four waits of up to 60 s: load ~16 once took over 30 s for the first


async def test_a_state_file_that_cannot_be_written_warns_once_and_is_saved_when_it_can(tmp_path, capsys, caplog):
    blocker = tmp_path / "ro"
    blocker.write_text("a file where the state's folder should be")  # every save fails (NotADirectoryError)
    state = blocker / "boot.state.json"
    ns = boot_cli.parse(
        ["--host", "127.0.0.1", "--port", "0", "--run-id", RUN, "--identity", str(tmp_path / "b.key")]
        + ["--state-file", str(state), "--status-interval", "0.05"]
    )
    caplog.set_level(logging.DEBUG, logger="geomesh.bootstrap")
    stop = asyncio.Event()
    served = asyncio.ensure_future(boot_cli._serve(ns, Identity.load_or_create(ns.identity), None, None, stop))

    def lines(text: str, level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]

    async def failed_saves(n: int) -> bool:
        assert not served.done(), capsys.readouterr()
        return len(lines("could not save the bootstrap state", logging.DEBUG)) >= n

    try:
        await wait_for(lambda: failed_saves(4), 60, 0.05, "five failed saves")  # 1 WARNING + 4 DEBUG
        blocker.unlink()  # the space comes back
        await wait_for(lambda: _now(state.exists()), 60, 0.05, "the state file")
        await wait_for(lambda: _now(bool(lines("saved to", logging.INFO))), 60, 0.05, "the line saying so")
        stop.set()
        assert await asyncio.wait_for(served, 60) == 0
    finally:
        stop.set()
        if not served.done():
            served.cancel()
        await asyncio.gather(served, return_exceptions=True)
    warnings = lines("could not save the bootstrap state", logging.WARNING)
    assert len(warnings) == 1 and str(state) in warnings[0]
    assert lines("saved to", logging.INFO) == [f"bootstrap state saved to {state} again"]
    assert json.loads(state.read_text())["run_id"] == RUN
    assert re.search(r"serving on \S+", capsys.readouterr().out)


async def _now(value: bool) -> bool:
    return value
