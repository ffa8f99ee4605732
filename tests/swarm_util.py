"""Start peer processes on 127.0.0.1 for tests, read their per-round JSON lines, stop them by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from geomesh_p2p.telemetry import events
from geomesh_p2p.util.procs import ProcGroup, address_in_log, bootstrap_argv, read_json_rows
from tests import zygote

# Small and fast: tests are about the protocol, not the model.
FAST = [
    "--threads",
    "1",
    "--seq-len",
    "32",
    "--window-s",
    "1.5",  # 2.5 until session 10: a second less per round of every e2e swarm (~200 rounds in the suite)
    # A device at half speed: each inner step is followed by a sleep as long as it computed (the profile says
    # so too, and the plans follow). The e2e tier is CPU-bound on 2 cores (3-4 training peers per test, three
    # tests at once), and its peers fill their windows with steps: this halves that CPU. A test that needs the
    # steps (the attacks' perplexity bound) passes "--speed-factor", "1" after it (the last value counts).
    "--speed-factor",
    os.environ.get("GEOMESH_TEST_SPEED", "0.5"),
    "--profile-batches",
    "4,8",
    "--target-batch",
    "4",
    "--run-id",
    "test-swarm",
    "--pow-bits",
    "8",
    # Every row evaluated: tests read eval_ppl per round (auto would follow this loaded machine's timings), on
    # 2 batches, not 8: the evaluation was ~70 % of a FAST peer's training CPU (py-spy, session 40). Tests that
    # bound a perplexity (test_attacks) pass the default 8 after these flags.
    "--eval-every",
    "1",
    "--eval-batches",
    "2",
]
RUN_ID = FAST[FAST.index("--run-id") + 1]  # the run FAST peers join; a bootstrap for them must serve it


START_TIMEOUT = 120  # seconds for a cold interpreter (torch, grpc) to print its "serving on" line


@contextlib.contextmanager
def dead_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` where nobody listens while the ``with`` block runs: the port is bound by a socket
    that never listens (connections to it are refused) and no other process can bind it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


class ProcSwarm(ProcGroup):
    """Owns the processes it starts (``procs``: name -> Popen); :meth:`stop_all` ends each of them
    (SIGINT, then SIGKILL), by PID. Logs: ``<dir>/<name>.log`` (appended to), ``<dir>/<name>.jsonl``."""

    def __init__(self, workdir: Path):
        super().__init__()
        self.dir = workdir
        self._log_start: dict[str, int] = {}  # name -> size of its .log when it was last started

    def peer(
        self, name: str, *args: str, bootstrap: str | None = None, port: int = 0, extra: Sequence[str] = ()
    ) -> subprocess.Popen:
        """Start ``peer.cli join`` as ``name`` (key ``<dir>/<name>.key``, rows ``<dir>/<name>.jsonl``) with
        :data:`FAST`, then ``args`` and ``extra``; port 0 (the default): read its address with :meth:`address`."""
        return self.join(name, ["peer.cli", "join"], *args, *extra, bootstrap=bootstrap, port=port)

    def join(
        self, name: str, command: Sequence[str], *args: str, bootstrap: str | None = None, port: int = 0
    ) -> subprocess.Popen:
        """Start ``python -m <command>`` (a ``join`` command: the peer's or an attacker's) as ``name`` with
        its key, ``--port``, its JSON rows and :data:`FAST`, then ``args``, and ``--bootstrap`` when given."""
        argv = [
            sys.executable,
            "-m",
            *command,
            "--identity",
            str(self.dir / f"{name}.key"),
            "--port",
            str(port),
            "--log-json",
            str(self.log_path(name)),
            *FAST,
            *args,
        ]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        return self._spawn(name, argv)

    def start_peers(
        self, names: Sequence[str], *args: str, each: Optional[Callable[[int, str], Sequence[str]]] = None
    ) -> str:
        """Start ``names[0]`` on port 0, read its address back (:meth:`address`), then the others with it
        as ``--bootstrap``; every peer gets ``args`` and ``each(i, name)``. Returns that address (HOST:PORT)
        for later joiners. Raises AssertionError when the first peer does not serve."""
        entry: Optional[str] = None
        for i, n in enumerate(names):
            self.peer(n, *args, *(each(i, n) if each else ()), bootstrap=entry)
            if entry is None:
                entry = self.address(n)
        assert entry is not None, "no peer to start"
        return entry

    def bootstrap(
        self, name: str, *extra: str, port: int = 0, run_id: str = RUN_ID, host: str = "127.0.0.1"
    ) -> subprocess.Popen:
        """Start a bootstrap as ``name`` (key ``<dir>/<name>.key``; see :func:`geomesh_p2p.util.procs.bootstrap_argv`); with port 0
        (the default) read the address it bound with :meth:`address`."""
        key = self.dir / f"{name}.key"
        # the peers' proof of work (FAST): a bootstrap counts only records that carry at least its --pow-bits
        pow_bits = ("--pow-bits", FAST[FAST.index("--pow-bits") + 1])
        return self._spawn(name, bootstrap_argv(run_id, key, *pow_bits, *extra, host=host, port=port))

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self._log_start[name] = log.stat().st_size if log.exists() else 0
        # forked from this worker's pre-imported interpreter when it can be (tests/zygote.py: ~4 CPU-s less each)
        child = zygote.spawn(argv, log, append=True)
        if child is None:
            return self.spawn(name, argv, log, append=True)
        self.procs[name] = child
        return child

    def address(self, name: str, timeout: float = START_TIMEOUT) -> str:
        """HOST:PORT that ``name`` (a peer or bootstrap started with port 0) bound, from the "serving on"
        line of its latest start. Raises AssertionError (with the logs' tails) when it, or another
        process of the swarm, exits first, or after ``timeout`` seconds."""
        found: list[str] = []

        def serving() -> bool:
            a = address_in_log(self.dir / f"{name}.log", self._log_start.get(name, 0))
            if a is None and self.procs[name].poll() is not None:
                raise AssertionError(
                    f"{name} exited with {self.procs[name].returncode} before serving:\n" + self.text(name)[-3000:]
                )
            found[:] = [a] if a else []
            return a is not None

        self.wait_for(serving, timeout, f"{name} to serve")
        return found[0]

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.jsonl"

    def rows(self, name: str) -> list[dict]:
        return read_json_rows(self.log_path(name))

    def digests_by_round(self, names) -> dict[int, set]:
        """round -> the set of digests the peers ``names`` wrote for it (one lineage: one digest a round)."""
        out: dict[int, set] = {}
        for n in names:
            for x in self.rows(n):
                out.setdefault(x["round"], set()).add(x["digest"])
        return out

    def planned_out(self, name: str) -> set[int]:
        """The rounds peer ``name`` was left out of by their leader (event ``planned_out``, reason ``not_in_plan``:
        e.g. the no-part penalty of a push that came after its part closed, which a loaded machine gives an honest
        peer; geomesh_p2p/round/rules/penalties.py). Such a peer writes no row for the round and re-syncs after it."""
        return {e["round"] for e in self.events(name, "planned_out") if e.get("reason") == "not_in_plan"}

    def plan_problems(self, names: Sequence[str], rounds: Sequence[int]) -> list[tuple]:
        """What does not add up in rounds ``rounds`` of the peers ``names`` (all of the swarm's trainers): ``[]`` when
        each peer wrote a row of each round or was planned out of it (:meth:`planned_out`), never both, and every row
        of a round counts its plan as the peers that wrote one (``peers`` == their number: nobody else planned, and
        nobody of them planned but missing). A plan-out a loaded machine gives an honest peer passes; a peer that
        skipped or forked a round, or a round planned with an outsider or trained apart, is listed:
        ``(round, peer, why)``."""
        out: list[tuple] = []
        rows = {n: {x["round"]: x for x in self.rows(n)} for n in names}
        out_of = {n: self.planned_out(n) for n in names}
        for r in rounds:
            wrote = [n for n in names if r in rows[n]]
            for n in names:
                if (r in rows[n]) == (r in out_of[n]):
                    out.append(
                        (r, n, "both a row and planned out" if r in rows[n] else "neither a row nor planned out")
                    )
            out += [(r, n, f"peers {rows[n][r]['peers']}, {len(wrote)} rows") for n in wrote
                    if rows[n][r]["peers"] != len(wrote)]  # fmt: skip
        return out

    def text(self, name: str) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text() if p.exists() else ""

    def events(self, name: str, kind: Optional[str] = None) -> list[dict]:
        """The structured events peer ``name`` wrote (``--log-json``: :func:`geomesh_p2p.telemetry.events.events_path`),
        every start of it, oldest first; only those of ``kind`` when given. ``[]`` before it wrote any."""
        return events.read(events.events_path(self.log_path(name)), kind)

    def wait_for(self, cond, timeout: float, what: str) -> None:
        """Poll ``cond()`` until true; fail with the peers' log tails after ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -9):
                    raise AssertionError(
                        f"{name} exited with {p.returncode} while waiting for {what}:\n" + self.text(name)[-3000:]
                    )
            time.sleep(0.25)
        tails = "\n".join(f"--- {n}\n{self.text(n)[-1500:]}" for n in self.procs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")

    def wait_exit(self, names, timeout: float) -> dict[str, int]:
        self.wait_for(lambda: all(self.procs[n].poll() is not None for n in names), timeout, f"{names} to exit")
        return {n: self.procs[n].returncode for n in names}

    def interrupt(self, name: str) -> None:
        """Ctrl+C: SIGINT to the peer (it finishes its exchange, announces it leaves, exits)."""
        self.procs[name].send_signal(signal.SIGINT)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self, grace_s: float = 40.0) -> None:
        """SIGINT to each running process (a peer finishes its exchange and leaves), SIGKILL to whatever
        still runs ``grace_s`` seconds later; each by its PID."""
        super().stop_all(grace_s)
