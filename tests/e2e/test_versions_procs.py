"""Issue 29 #4: two versions of the code in one swarm, as OS processes (docs/compat.md).

A copy of this package with a bumped PATCH version and one more PeerRecord field (always written) runs as
its own process (``geomesh_p2p.dht``'s tool, ``--announce``), next to this version (a bootstrap node and an
announcing peer in this process); a copy with a bumped MINOR version runs too. This version lists the
newer patch's peer as live (its record, with the unknown field, parsed and its signature checked by the
DHT) and drops the other minor's with the reason; the newer patch lists this version's peer. Before the
policy, the newer patch's record was dropped as malformed ("Extra inputs are not permitted").
What this does not run: a round of training across the two versions (the plan side is covered in process
by tests/integration/test_versions_mix.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

import geomesh_p2p
from geomesh_p2p.dht import PeerAnnouncer, live_peers
from tests.dht_helpers import RUN, start_node, stop_node
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(geomesh_p2p.__file__).parent
_MAJ, _MIN, _ = (int(x) for x in geomesh_p2p.__version__.split("."))
#: a newer patch of this series, and the next minor
PATCH, MINOR = f"{_MAJ}.{_MIN}.99", f"{_MAJ}.{_MIN + 1}.0"


def _copy(root: Path, version: str) -> Path:
    """This package copied under ``root`` as release ``version``, whose PeerRecord has one more field."""
    dst = root / "geomesh_p2p"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    init = dst / "__init__.py"
    text, n = re.subn(r'__version__ = "[^"]+"', f'__version__ = "{version}"', init.read_text())
    assert n == 1
    init.write_text(text)
    peer = dst / "schema" / "peer.py"
    anchor = '    @field_validator("tokens_per_s")\n'
    src = peer.read_text()
    assert src.count(anchor) == 1
    field = f'    region: str = Field(default="eu-west", description="added by release {version}")\n\n'
    peer.write_text(src.replace(anchor, field + anchor))
    return root


async def _spawn(root: Path, bootstrap: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    argv = ["--bootstrap", bootstrap, "--run-id", RUN, "--announce", "--watch", "--period", "0.5"]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geomesh_p2p.dht",  # the copy's tool
        *argv,
        cwd=root,  # not the repository: its geomesh_p2p would shadow the copy
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def _rows(proc: asyncio.subprocess.Process, out: list[str]):
    """The JSON rows the tool prints, as they come; every line kept in ``out``."""
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            return
        text = line.decode(errors="replace").rstrip()
        out.append(text)
        if text.startswith("{"):
            yield json.loads(text)


async def _first_row(proc, out) -> dict:
    async for row in _rows(proc, out):
        return row
    raise AssertionError("the tool exited before its first row:\n" + "\n".join(out))


async def test_a_newer_patch_and_this_version_see_each_other_another_minor_is_dropped(tmp_path, caplog):
    patch = _copy(tmp_path / "patch", PATCH)
    minor = _copy(tmp_path / "minor", MINOR)
    boot = await start_node()
    procs: list[asyncio.subprocess.Process] = []
    outs: list[list[str]] = [[], []]
    me = boot.transport.identity
    mine = peer_record(me, version=geomesh_p2p.__version__, run_config_hash="none", address=boot.address)
    announcer = PeerAnnouncer(boot, mine, period_s=0.5)
    try:
        announcer.start()
        procs = [await _spawn(patch, boot.address), await _spawn(minor, boot.address)]
        first = await asyncio.wait_for(asyncio.gather(*(_first_row(p, o) for p, o in zip(procs, outs))), 90)
        newer_id, minor_id = (r["peer_id"] for r in first)

        async def view() -> list:
            return await live_peers(boot, RUN, expected_version=geomesh_p2p.__version__, mine=mine)

        with caplog.at_level(logging.INFO, logger="geomesh_p2p.dht.announce"):
            for _ in range(200):
                seen = {r.peer_id: r.version for r in await view()}
                dropped = [r.getMessage() for r in caplog.records if minor_id[:10] in r.getMessage()]
                if newer_id in seen and dropped:
                    break
                await asyncio.sleep(0.1)
        # this version: its own peer and the newer patch's (unknown field ignored), not the other minor's
        assert seen == {str(me.peer_id): geomesh_p2p.__version__, newer_id: PATCH}
        assert len(dropped) == 1 and f"version {geomesh_p2p.__version__} vs {MINOR}" in dropped[0], dropped
        raw = (await boot.get(f"{RUN}/peers"))[newer_id].value
        assert json.loads(raw)["region"] == "eu-west"  # the newer field travelled, signed, as written

        # the newer patch's process lists this version's peer (and itself)
        async def lists_me() -> None:
            async for row in _rows(procs[0], outs[0]):
                if str(me.peer_id) in row["peers"] and newer_id in row["peers"]:
                    return

        await asyncio.wait_for(lists_me(), 30)
    finally:
        await announcer.stop()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 30)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        await stop_node(boot)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not any("Traceback" in line for o in outs for line in o), outs
