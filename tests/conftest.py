"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from geomesh_p2p.util import exit_gc

from tests.collective_util import Swarm
from tests.proc_util import Server
from tests.swarm_util import ProcSwarm


@pytest.fixture
async def swarms():
    """``await swarms(n_servers, n_clients=0, **kw)`` -> a started in-process collective :class:`Swarm`;
    every swarm made is stopped in teardown (also when the test fails)."""
    made: list[Swarm] = []

    async def make(n_servers, n_clients=0, **kw) -> Swarm:
        s = Swarm(n_servers, n_clients, **kw)
        made.append(s)
        return await s.start()

    try:
        yield make
    finally:
        for s in made:
            await s.stop()


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``),
    restored after: on a shared 2-core machine, spin-waiting OpenMP threads make CPU steps ~10-40x slower."""
    import torch  # here, so modules without torch do not load it

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def swarm(tmp_path):
    """A :class:`ProcSwarm` of peer processes in ``tmp_path``; every process it started is stopped in
    teardown (SIGINT, then SIGKILL), also when the test fails. Modules with their own ``swarm`` override it."""
    s = ProcSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture
def servers():
    """``servers(argv)`` -> a started :class:`~tests.proc_util.Server` (``python argv...``, address from
    its 'serving on' line); every server started is stopped by PID in teardown, also when the test fails."""
    started: list[Server] = []

    def spawn(argv):
        s = Server(argv)
        started.append(s)
        return s

    try:
        yield spawn
    finally:
        for s in started:
            s.stop()


# ------------------------------------------------------------------------------ tiers
# tests/unit: no sockets and no servers (the guard below refuses an INET socket's bind/connect);
# tests/integration: in-process gRPC on 127.0.0.1; tests/e2e: OS processes (peers, bootstraps, workers,
# console scripts, a browser, network namespaces). `make test-quick` runs the first two, `make test` all three.
# Every test under tests/e2e is also marked ``e2e`` so that `-m "not e2e"` keeps working.
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Mark the tests under ``tests/e2e`` ``e2e``; pytest's own hook, no return."""
    for item in items:
        if (TESTS / "e2e") in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


# ------------------------------------------------------------------------------ parallel runs (pytest-xdist)
# `make test` runs the suite with ``-n N --dist loadfile``: each file's tests run in one worker, one after another
# (a module's shared fixtures stay in one process), except that the files of a group in SERIAL_GROUPS count as
# one file: their assertions hold under load, but each of them keeps the cores busy for minutes (processes that
# train), and two of them at once on a 2-core machine only slow each other down. (Not ``--dist loadgroup`` with
# ``xdist_group`` markers: pytest-xdist 3.8 marks a group in ``item._nodeid``, which pytest 9.2 no longer reads.)
SERIAL_GROUPS = {
    # swarms of 3-4 training peer processes, several minutes each
    "e2e-swarms": ("tests/e2e/test_attacks.py", "tests/e2e/test_swarm.py"),
}
# Longest first (LPT scheduling): a worker that is free takes the longest file still waiting, so the minutes-long
# files start at once and the many short unit files fill the workers' last gaps; in collection order they came last
# and one worker ran the last long file alone for a minute or more. The order is a measurement (seconds per file in
# a 3-worker run on 2 cores, `pytest -n 3 --durations=0`, session 30: 968 s in all, load 1-14 from other jobs, e2e
# processes forked from tests/zygote.py): a file missing from it only loses its place, as does every other tests/e2e
# file (next) and then everything else (collection order).
LONGEST_FIRST = (
    "e2e-swarms",  # ~235 s (test_attacks ~120, test_swarm ~115)
    # CPU-bound verified-work screens in process (a unit file, so it used to start after every e2e file and end
    # the run alone on one worker)
    "tests/unit/test_screening.py",  # ~230
    "tests/e2e/test_join_errors.py",  # ~205
    "tests/e2e/test_stalled_peer_procs.py",  # ~150
    "tests/e2e/test_faults_net_procs.py",  # ~145 (~550 with cold processes)
    "tests/e2e/test_accountable_procs.py",  # ~115
    # mostly a fixed wait (a plan read 20 s past a 10 s --plan-ttl-floor-s; 130 s into a 170 s round until session
    # 30, then the longest single test at ~180 s): early, its wait overlaps the CPU of the others
    "tests/e2e/test_long_window_procs.py",  # ~60
    "tests/e2e/test_slow_link.py",  # ~95
    # 16 peer processes (~85 CPU-s, 57-84 s): not at the start, where they took the attack tests' honest peers below
    # their perplexity bound (session 26); here they start once test_attacks is about done (session 36)
    "tests/e2e/test_accountable_groups_procs.py",  # ~70
    "tests/e2e/test_rank_trainer.py",  # ~95
    "tests/e2e/test_status_page.py",  # ~95
    "tests/unit/test_verify.py",  # ~80
    "tests/e2e/test_faults_node_procs.py",  # ~80
)


def scope_rank(scope: str) -> int:
    """Where a file (or SERIAL_GROUPS group) of the suite goes in a parallel run: its index in LONGEST_FIRST,
    then any other tests/e2e file, then the rest. Lower runs first."""
    if scope in LONGEST_FIRST:
        return LONGEST_FIRST.index(scope)
    return len(LONGEST_FIRST) + (0 if scope.startswith("tests/e2e/") else 1)


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # a pytest-xdist hook: without xdist (plain pytest) never called
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile``: the scheduler that groups the tests by file, the files of a SERIAL_GROUPS
    group together, and hands a free worker the longest file still waiting (:func:`scope_rank`); ``None``
    (xdist's own) for every other mode."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # here: xdist is installed only when it runs this hook

    group_of = {f: g for g, files in SERIAL_GROUPS.items() for f in files}

    class FileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(path, path)

        def _assign_work_unit(self, node) -> None:
            # xdist takes the workqueue's first unit: move the best-ranked one there (min keeps queue order on ties)
            best = min(self.workqueue, key=scope_rank)
            self.workqueue.move_to_end(best, last=False)
            super()._assign_work_unit(node)

    return FileGroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _unit_tier_opens_no_socket(request, monkeypatch):
    """In ``tests/unit``, binding or connecting an IPv4/IPv6 socket fails the test: such a test belongs in
    ``tests/integration``. (Unix sockets and socketpairs, which asyncio uses for its own wake-ups, stay
    allowed. gRPC's C core opens its sockets outside Python: a gRPC server or channel is caught by the
    ``grpc.aio.server``/channel guards instead.)"""
    if (TESTS / "unit") not in Path(request.node.path).resolve().parents:
        yield
        return
    import socket

    import grpc

    def refuse(what):
        def f(*a, **k):
            raise AssertionError(f"a unit test opened {what}: move it to tests/integration")

        return f

    orig_bind, orig_connect = socket.socket.bind, socket.socket.connect

    def bind(self, addr, *a):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse("an INET socket")()
        return orig_bind(self, addr, *a)

    def connect(self, addr, *a):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse("an INET socket")()
        return orig_connect(self, addr, *a)

    monkeypatch.setattr(socket.socket, "bind", bind)
    monkeypatch.setattr(socket.socket, "connect", connect)
    for mod, name in (
        (grpc.aio, "server"),
        (grpc.aio, "insecure_channel"),
        (grpc.aio, "secure_channel"),
        (grpc, "server"),
        (grpc, "insecure_channel"),
        (grpc, "secure_channel"),
    ):
        monkeypatch.setattr(mod, name, refuse(f"a gRPC {name}"))
    yield


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Restore torch's intra-op thread count after each test: an in-process PeerNode sets it (``--threads``),
    and under ``make test``'s xdist workers a later file in the same worker (the codec's thread plan) must not
    see what an earlier one set."""
    import torch  # here: collecting the suite stays fast for files that never use torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_start_up_freeze_left():
    """A test that leaves this process armed for the start-up heap freeze (``exit_gc.arm_startup_freeze``: what a
    command's ``main`` or a follower rank's ``worker_main`` does as its own process) or frozen fails, and both are
    undone: an armed test process froze its whole heap at the next in-process node's start, so every object alive then
    (other tests' too) was never collected again (red team 44: the follower-rank entry test left it armed)."""
    yield
    armed, frozen = exit_gc._armed, gc.get_freeze_count()
    exit_gc._armed = False
    if frozen:
        gc.unfreeze()
    if armed or frozen:
        pytest.fail(f"the test left the start-up heap freeze armed ({armed}) or {frozen} object(s) frozen")
