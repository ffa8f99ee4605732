"""A key file created by this process (fresh-user trial, session 32): a mistyped ``--identity`` made a new identity
silently, and a start that failed left the key behind for the next try to use. Now its creation is said in one
line once the program serves (never before: a failed start prints one line, its error), and a failed start removes
the key file it created, never one it loaded."""

from __future__ import annotations

import json
import logging
import os

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.trust.admission import discard_new_identity, pow_cache_path

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ Identity.created
def test_a_created_key_is_said_once_and_a_loaded_one_never(tmp_path):
    path = tmp_path / "id.key"
    new = Identity.load_or_create(path)
    assert new.created is not None and new.created.path == path and not new.created.kept
    line = new.keep_created()
    assert line == (
        f"created a new identity at {path} (peer id {new.peer_id.short()}…); pass the same --identity to keep it"
    )
    assert "\n" not in line
    assert new.keep_created() is None  # said once
    assert new.discard_created() is None and path.read_bytes()  # kept: never removed afterwards
    loaded = Identity.load_or_create(path)
    assert loaded.peer_id == new.peer_id and loaded.created is None
    assert loaded.keep_created() is None and loaded.discard_created() is None
    assert Identity.generate().created is None  # never stored: nothing to say or remove


def test_a_failed_start_removes_the_key_and_the_folders_it_created(tmp_path):
    path = tmp_path / "typo" / "deeper" / "id.key"
    new = Identity.load_or_create(path)
    assert path.is_file()
    assert new.discard_created() == path
    assert not path.exists() and not (tmp_path / "typo").exists()  # the folders made for it went too
    assert sorted(os.listdir(tmp_path)) == []  # tmp_path itself existed before: left
    assert new.discard_created() is None  # once
    again = Identity.load_or_create(path)  # the next try creates (and says) a new one, it does not load a leftover
    assert again.created is not None and again.peer_id != new.peer_id


def test_a_folder_that_holds_something_else_by_then_stays(tmp_path):
    path = tmp_path / "a" / "b" / "id.key"
    new = Identity.load_or_create(path)
    (tmp_path / "a" / "notes.txt").write_text("written meanwhile")
    assert new.discard_created() == path
    assert not (tmp_path / "a" / "b").exists()  # empty: removed
    assert (tmp_path / "a" / "notes.txt").read_text() == "written meanwhile"


def test_an_existing_key_is_never_removed(tmp_path):
    path = tmp_path / "id.key"
    first = Identity.load_or_create(path)
    first.keep_created()
    raw = path.read_bytes()
    loaded = Identity.load_or_create(path)
    assert discard_new_identity(loaded) is None and loaded.discard_created() is None
    assert path.read_bytes() == raw


def test_a_file_that_replaced_the_created_key_stays(tmp_path):
    """Only the very file this process created goes (same device and inode): not one moved to its path since."""
    path = tmp_path / "id.key"
    new = Identity.load_or_create(path)
    other = tmp_path / "other.key"
    Identity.load_or_create(other)
    os.replace(other, path)
    raw = path.read_bytes()
    assert new.discard_created() is None
    assert path.read_bytes() == raw


def test_discard_new_identity_takes_the_proof_of_work_cached_for_it_only(tmp_path):
    path = tmp_path / "id.key"
    new = Identity.load_or_create(path)
    cache = pow_cache_path(path)
    cache.write_text(json.dumps({"peer_id": str(new.peer_id), "runs": {"r": 7}}))
    assert discard_new_identity(new) == path
    assert not path.exists() and not cache.exists()
    # a cache left by an earlier key at that path names another identity: not this process's, it stays
    path2 = tmp_path / "id2.key"
    old = json.dumps({"peer_id": str(Identity.generate().peer_id), "runs": {"r": 7}})
    pow_cache_path(path2).write_text(old)
    new2 = Identity.load_or_create(path2)
    assert discard_new_identity(new2) == path2
    assert not path2.exists() and pow_cache_path(path2).read_text() == old


# ------------------------------------------------------------------ geomesh-peer join
class _FakeNode:
    """Stands in for PeerNode in cmd_join: its run fails (``fail``) or serves (keeps the key, as PeerNode.run)."""

    fail: BaseException | None = None
    made: list = []

    def __init__(self, run, cfg, identity):
        self.identity = identity
        _FakeNode.made.append(self)

    def request_stop(self) -> None:
        pass

    async def run(self) -> int:
        if _FakeNode.fail is not None:
            raise _FakeNode.fail
        assert self.identity.keep_created() is not None
        return 0


@pytest.fixture
def fake_join(monkeypatch):
    """cmd_join with its node replaced by :class:`_FakeNode`, and no change to this process's threads."""
    import geomesh_p2p.model.memory
    import geomesh_p2p.node.host
    import geomesh_p2p.node.peer

    import peer.node_cli

    monkeypatch.setattr(geomesh_p2p.node.peer, "PeerNode", _FakeNode)
    # --port is checked by binding it (tests/integration/test_startup_checks.py): no socket in a unit test
    monkeypatch.setattr(peer.node_cli, "check_ports", lambda ns: None)
    monkeypatch.setattr(geomesh_p2p.node.host, "set_threads", lambda n: None)
    monkeypatch.setattr(geomesh_p2p.model.memory, "limit_malloc_arenas", lambda: None)
    monkeypatch.setattr(_FakeNode, "fail", None)
    monkeypatch.setattr(_FakeNode, "made", [])
    return _FakeNode


def test_join_that_fails_to_start_removes_the_key_it_created(tmp_path, capsys, fake_join):
    from peer.cli import main

    key = tmp_path / "idenity.key"  # the typo
    fake_join.fail = OSError("cannot listen on 127.0.0.1:1: the port is in use or the address is not local")
    assert main(["join", "--identity", str(key), "--port", "1"]) == 2
    assert len(fake_join.made) == 1 and fake_join.made[0].identity.created is None  # it had created one
    assert not key.exists()  # the next try does not take that identity silently
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("geomesh-peer")]
    assert err == ["geomesh-peer join: cannot listen on 127.0.0.1:1: the port is in use or the address is not local"]


def test_join_that_fails_to_start_keeps_an_existing_key(tmp_path, fake_join):
    from peer.cli import main

    key = tmp_path / "id.key"
    Identity.load_or_create(key)
    raw = key.read_bytes()
    fake_join.fail = OSError("cannot listen on 127.0.0.1:1: the port is in use or the address is not local")
    assert main(["join", "--identity", str(key), "--port", "1"]) == 2
    assert key.read_bytes() == raw


def test_join_that_served_keeps_the_key_it_created(tmp_path, fake_join):
    from peer.cli import main

    key = tmp_path / "id.key"
    assert main(["join", "--identity", str(key)]) == 0
    assert fake_join.made[0].identity.created.kept and len(key.read_bytes()) == 32


async def test_peer_node_says_a_created_key_once_it_serves_not_before(tmp_path, monkeypatch, caplog):
    """PeerNode.run: the line after start() (DHT joined, swarm checked, training built); none when start fails."""
    from geomesh_p2p.node import joining
    from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig

    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "created a new identity" in r.getMessage()]

    async def nothing() -> None:
        pass

    async def fails() -> None:
        raise OSError("cannot listen on 127.0.0.1:1")

    seen_at_initial_state: list = []

    async def initial_state(node) -> None:
        seen_at_initial_state.append(said())
        node.request_stop()  # ends run() before the first round

    monkeypatch.setattr(joining, "initial_state", initial_state)
    key = tmp_path / "id.key"
    node = PeerNode(RunConfig(), NodeConfig(), identity=Identity.load_or_create(key))
    monkeypatch.setattr(node, "start", fails)
    monkeypatch.setattr(node, "shutdown", nothing)
    with pytest.raises(OSError):
        await node.run()
    assert said() == [] and not node.identity.created.kept  # cmd_join removes it
    monkeypatch.setattr(node, "start", nothing)
    assert await node.run() == 0
    assert said() == [
        f"created a new identity at {key} (peer id {node.identity.peer_id.short()}…); "
        "pass the same --identity to keep it"
    ]
    assert seen_at_initial_state == [said()]  # said right after start(), before the initial state
    assert await node.run() == 0 and len(said()) == 1  # once


# ------------------------------------------------------------------ geomesh-bootstrap
def test_bootstrap_that_fails_to_start_removes_the_key_it_created(tmp_path, capsys):
    import bootstrap.cli as b

    key = tmp_path / "new" / "boot.key"
    bad = tmp_path / "allow.txt"
    bad.write_text("not-a-peer-id\n")
    argv = ["--identity", str(key), "--state-file", "", "--allow-peers", str(bad), "--port", "0"]  # no bind test
    assert b._main(argv) == 2
    assert not key.exists() and not key.parent.exists()
    assert capsys.readouterr().err.count("\n") == 1
    Identity.load_or_create(key)  # an existing key: a failed start leaves it
    raw = key.read_bytes()
    assert b._main(argv) == 2
    assert key.read_bytes() == raw


def test_join_arms_the_start_up_freeze_only_as_its_own_process(tmp_path, fake_join, monkeypatch):
    """``main()`` from the command line arms the freeze the node does once its model is built (the run's full
    collections skip the start's ~350,000 objects); ``main([...])`` in a test process never does (its objects would
    never be collected); an armed freeze acts once."""
    import gc

    from geomesh_p2p.util import exit_gc
    from peer.cli import main

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    monkeypatch.setattr(exit_gc, "_armed", False)
    assert main(["join", "--identity", str(tmp_path / "id.key"), "--port", "0"]) == 0
    assert exit_gc.freeze_startup_heap() is False and frozen == []
    monkeypatch.setattr("sys.argv", ["geomesh-peer", "join", "--identity", str(tmp_path / "id2.key"), "--port", "0"])
    assert main() == 0 and exit_gc._armed is True
    assert exit_gc.freeze_startup_heap() is True and frozen == [1]
    assert exit_gc.freeze_startup_heap() is False and frozen == [1]  # once
