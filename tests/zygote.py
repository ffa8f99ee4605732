"""A pre-imported interpreter that forks the e2e tests' ``python -m peer.cli`` / ``python -m bootstrap.cli`` processes.

Why: every peer process of the e2e tier spent ~4-6 of its ~9 CPU-seconds importing torch, transformers (whose
import scans its ~3,000 model files), torch.distributed and hivemind before its first line of its own, and the
tier starts ~200 of them on 2 shared cores. A *zygote* (Android's name for the same trick) imports those
third-party packages once per pytest worker and forks a child per process asked for; the child runs the module
exactly as ``python -m`` would (``runpy._run_module_as_main``: ``__name__ == "__main__"``, ``sys.argv``,
``sys.path[0]`` the working directory), with its own stdout/stderr log, environment, working directory and
signal dispositions. The library's modules a peer's start imports (:data:`PRELOAD_PROJECT`, none of which starts a
thread, opens a gRPC channel or reads anything per process but one clock, re-read in the child) are imported once
before the fork too (~0.4 CPU-s a child less), from the files a cold child would import (else the child drops them),
and so are the ``peer`` CLI's modules but ``peer.cli`` (:data:`PRELOAD_CLI`; ``peer.cli`` runs as ``__main__``, whose
``main`` reads the process's argv). The ``bootstrap`` package is not (its import reads the process's argv): each
child imports it itself, as a fresh interpreter does. One more difference: the zygote's imports are already frozen (``gc.freeze``), as a peer's or bootstrap's own start-up freeze
(``geomesh_p2p.util.exit_gc.freeze_startup_heap``) would leave them; ``ZygoteChild.frozen_at_fork`` says how many.

What a child is not: a child of the test process. :class:`ZygoteChild` stands in for ``subprocess.Popen`` (``pid``,
``poll``, ``wait``, ``returncode``, ``send_signal``, ``kill``, ``terminate``); the zygote reaps each child and sends
its exit status (negative: the signal that ended it, as ``Popen.returncode``) over the child's own Unix socket.

Used by :class:`tests.swarm_util.ProcSwarm` only for a ``python -m MODULE`` command line whose environment is the
zygote's own (plus ``PYTHONUNBUFFERED``), also behind ``ip netns exec NAME`` (the child joins that network namespace
itself): anything else (``LD_PRELOAD``/faketime, a test's own variables) starts as a plain ``subprocess.Popen``. ``GEOMESH_TEST_ZYGOTE=0`` turns it off (every
process a cold interpreter, as before). The zygote refuses to fork (and the caller falls back) if importing left
a thread running: forking a threaded process can deadlock the child.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence, TextIO

#: what the zygote imports before it forks: the third-party packages of a peer's start-up (not the project's)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "hivemind.dht.routing",
    "hivemind.dht.storage",
    "hivemind.dht.node",
    "hivemind.dht.traverse",
    "grpc",
    "grpc.aio",
    "pydantic",
    # what the project's pydantic models load on first use (pydantic's package imports them lazily): ~25 ms a child
    "pydantic.main",
    "pydantic.fields",
    "pydantic.types",
    "pydantic.type_adapter",
    "pydantic.functional_validators",
    "pydantic.json_schema",
    "pydantic.plugin._schema_validator",
    "annotated_types",
    "google.protobuf",
    "cryptography",
    # the standard library's servers (the status page, the bootstrap's); pure modules
    "http.server",
    "wsgiref.simple_server",
)
#: the library's modules a peer's or bootstrap's start imports (these pull in the ~200 of them, ~0.4 CPU-s a child):
#: after the third-party ones, each in the zygote once. Not the ``bootstrap`` package: importing it sets
#: ``GRPC_VERBOSITY`` from the process's own argv (geomesh_p2p.util.grpc_env.quiet_grpc_core), which the child does
#: itself (``peer``'s CLI does that in ``peer.cli.main``, run by the child: :data:`PRELOAD_CLI`). Checked (tests/e2e/test_zygote.py): importing these starts no thread (neither Python's nor the
#: OS's), creates no gRPC channel or server, reads no environment variable a child could see changed (a child's
#: environment is the zygote's), and reads one clock (net.swarm_time's step watch, marked again in each child).
PRELOAD_PROJECT = (
    "geomesh_p2p.config.flags",
    "geomesh_p2p.config.models",
    "geomesh_p2p.util.exit_gc",
    "geomesh_p2p.util.fds",
    "geomesh_p2p.util.malloc",
    "geomesh_p2p.util.aio",
    "geomesh_p2p.util.errors",
    "geomesh_p2p.util.procs",
    "geomesh_p2p.model.presets",
    "geomesh_p2p.model.ckpt_files",
    "geomesh_p2p.dht.preflight",
    "geomesh_p2p.node.host",
    "geomesh_p2p.node.peer",
    "geomesh_p2p.node.ranks",
)
#: the ``geomesh-peer`` CLI's modules a ``python -m peer.cli`` child imports (~0.02 CPU-s a child): not ``peer.cli``
#: itself, which the child runs as ``__main__`` (runpy warns when the module is already imported). Importing them reads
#: nothing of the process (the package's import runs nothing; ``peer.cli.main`` quiets gRPC: the child's own argv).
PRELOAD_CLI = ("peer.node_cli", "peer.tools_cli", "peer.demo")
#: the top-level package of :data:`PRELOAD_PROJECT`: a child whose ``sys.path`` finds it elsewhere (another
#: checkout first on its path) drops the preloaded modules and imports its own, as a cold interpreter would
PROJECT_PACKAGE = "geomesh_p2p"
#: the top-level package of :data:`PRELOAD_CLI` (built on :data:`PROJECT_PACKAGE`'s modules: dropped with them)
CLI_PACKAGE = "peer"
ENABLED = os.environ.get("GEOMESH_TEST_ZYGOTE", "1") != "0"
START_TIMEOUT_S = 180.0  # the zygote's imports on a loaded 2-core machine (a cold peer's take up to ~70 s at load 15)


# ------------------------------------------------------------------------------ the zygote process
def _child(req: dict, fds: Sequence[int], keep: Sequence[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` as ``req`` says (env, cwd, session, signals), its
    stdout and stderr ``fds`` (received from the test process), its stdin /dev/null."""
    for fd in keep:
        if fd > 2:  # 0-2 are replaced below (closed here, the log would open as fd 0)
            os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # as a cold interpreter: SIGINT ignored when its spawner ignores it (a job started with `&` by a script)
    signal.signal(signal.SIGINT, signal.SIG_IGN if req.get("sigint_ignored") else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if req.get("new_session"):
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {null, *fds} - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    sys.argv = ["-m", *req["args"][1:]]  # runpy replaces argv[0] with the module's file, as `python -m` does
    if (
        "numpy" in sys.modules
    ):  # a fresh interpreter seeds numpy's global generator from the OS (random re-seeds itself)
        sys.modules["numpy"].random.seed()
    _same_project_files()
    if req.get("netns"):  # last: a failure is the child's (its traceback in its log, exit status 1)
        _enter_netns(req["netns"])


def _same_project_files() -> None:
    """In a forked child (``sys.path`` as the child's): keep the preloaded :data:`PROJECT_PACKAGE` and
    :data:`CLI_PACKAGE` modules only if a cold interpreter would import the same files (each package found at the
    same place on the child's path); else drop that package's (the CLI's too when the library's go: they hold the
    zygote's library modules), and the child imports its own. Then restart what the preload read of the clock (the
    step watch of geomesh_p2p.net.swarm_time counts wall-clock steps from its import: a cold child's from its start)."""
    import importlib.machinery

    def drop(package: str) -> None:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]

    def elsewhere(package: str) -> bool:
        spec = importlib.machinery.PathFinder.find_spec(package, sys.path)
        return spec is None or spec.origin != sys.modules[package].__file__

    if CLI_PACKAGE in sys.modules and elsewhere(CLI_PACKAGE):
        drop(CLI_PACKAGE)
    if PROJECT_PACKAGE not in sys.modules:
        return
    if elsewhere(PROJECT_PACKAGE):
        drop(PROJECT_PACKAGE)
        drop(CLI_PACKAGE)
        return
    swarm_time = sys.modules.get("geomesh_p2p.net.swarm_time")
    if swarm_time is not None:
        swarm_time._steps.mark()


def os_threads() -> int:
    """This process's threads as the OS counts them (``/proc/self/task``): Python's and native ones (gRPC's
    pollers, a BLAS or OpenMP pool), which ``threading.enumerate`` does not see. 1 where /proc is not there."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


#: ``ip netns exec NAME`` in front of a ``python -m`` command line (tests/e2e/test_slow_link.py's joiner behind a
#: slow veth): forked too, the child joining that network namespace itself
NETNS_EXEC = ("ip", "netns", "exec")
CLONE_NEWNET = 0x40000000  # <sched.h>


def _enter_netns(name: str) -> None:
    """In a forked child: join the network namespace ``name`` (``/run/netns/NAME``, ``setns(2)``), what ``ip netns
    exec NAME`` does for the sockets of the process it execs (the rest of what it does, a private /sys and
    ``/etc/netns/NAME`` bind mounts, no process here reads). Raises OSError (the child exits 1 with it, as ``ip``
    does when it cannot)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _split_netns(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """``(NAME, the rest)`` for ``ip netns exec NAME ...``; ``(None, argv)`` otherwise."""
    if len(argv) > 4 and tuple(argv[:3]) == NETNS_EXEC:
        return argv[3], list(argv[4:])
    return None, list(argv)


def serve() -> Optional[dict]:
    """The zygote's loop (``python -c 'import tests.zygote as z; z.main()'``): import :data:`PRELOAD`, print the
    socket's path, then fork a child for each request. Returns the request in a forked child (the caller runs the
    module); in the zygote it returns None when its stdin closes (the test process ended)."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass  # an optional package: the child imports what it needs itself
    native = os_threads()  # the third-party imports' own pools (OpenBLAS's: ~2 idle workers, fork-safe)
    for name in PRELOAD_PROJECT + PRELOAD_CLI:
        __import__(name)  # the project's own: a failure is the zygote's (the caller starts every process cold)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if not threads and os_threads() != native:  # e.g. a gRPC channel's poller: not forked with
        threads = [f"{os_threads() - native} native thread(s) started by the project's imports"]
    # The imports' ~400,000 GC-tracked objects into the permanent generation, as a peer's own start does
    # (geomesh_p2p/util/exit_gc.freeze_startup_heap: collect, then freeze), here once before the forks: a child's own
    # start-up collection then scans only what it made (~0.2 CPU-s less), and no collection in a child writes to the
    # shared pages' object headers (copy-on-write: ~22,000 page faults, ~85 MiB copied, per child before).
    gc.collect()
    gc.freeze()
    path = os.path.join(tempfile.mkdtemp(prefix="geomesh-zygote-"), "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that set_wakeup_fd writes on SIGCHLD
    signal.set_wakeup_fd(wake_w)
    project = sorted(m for m in sys.modules if m.split(".")[0] in (PROJECT_PACKAGE, "peer", "bootstrap"))
    print(
        json.dumps({"socket": path, "threads": threads, "frozen": gc.get_freeze_count(), "project": project}),
        flush=True,
    )
    children: dict[int, socket.socket] = {}
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([listener, stdin, wake_r], [], [], 1.0)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while children:  # reap: each child's status to its own socket
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test process no longer listens
                conn.close()
        if stdin in ready and not os.read(stdin, 4096):
            return None  # the test process is gone: its children are stopped by PID there
        if listener in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            req = json.loads(data if data.endswith(b"\n") else data + _read_line(conn).encode())
            if threads or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"refused threads {threads}\n".encode())
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                keep = [listener.fileno(), conn.fileno(), wake_r, wake_w, *(c.fileno() for c in children.values())]
                _child(req, fds, keep)
                return req
            for fd in fds:  # the child's now
                os.close(fd)
            children[pid] = conn
            conn.sendall(f"pid {pid}\n".encode())


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the zygote's peer closed the connection")
        buf += chunk
    return buf.decode()


def main() -> None:
    """The zygote's entry point; in a forked child, runs the requested module as ``__main__``."""
    req = serve()
    if req is None:
        return
    import runpy

    runpy._run_module_as_main(req["args"][0])  # type: ignore[attr-defined]  # what `python -m` calls


# ------------------------------------------------------------------------------ the test process's side
class ZygoteChild:
    """A forked child seen like a ``subprocess.Popen``: ``pid``, ``returncode`` (None while it runs), ``poll()``,
    ``wait(timeout)`` (raises ``subprocess.TimeoutExpired``), ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, frozen_at_fork: int = 0):
        self.args, self.pid, self._conn = args, pid, conn
        #: the objects the zygote had frozen (``gc.get_freeze_count()``) when it forked this child: the child's own
        #: count starts there (a cold interpreter's at 0)
        self.frozen_at_fork = frozen_at_fork
        self.returncode: Optional[int] = None
        self._buf = b""
        self.stdout: Optional[TextIO] = None  # text streams when started by spawn_piped
        self.stderr: Optional[TextIO] = None

    def _read_exit(self, timeout: Optional[float]) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                chunk = self._conn.recv(64)
                if not chunk:  # the zygote died: the child is an orphan; ask the kernel whether it runs
                    if _alive(self.pid):
                        raise socket.timeout
                    self.returncode = -signal.SIGKILL  # unknown status; it is gone
                    return
                self._buf += chunk
        except (socket.timeout, BlockingIOError):
            return
        line = self._buf.split(b"\n", 1)[0].decode()
        self.returncode = int(line.split()[1])
        self._conn.close()

    def poll(self) -> Optional[int]:
        self._read_exit(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _same_env(env: dict) -> dict:
    """``env`` less what pytest changes per test (``PYTEST_CURRENT_TEST``): the variables a fork must match."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


class Zygote:
    """The test process's handle on its zygote (one per pytest worker, started on first use, stopped by PID at exit)."""

    def __init__(self) -> None:
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = Path(tempfile.mkdtemp(prefix="geomesh-zygote-log-")) / "zygote.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import tests.zygote as z; z.main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
                cwd=Path(__file__).resolve().parents[1],
            )
        atexit.register(self.stop)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().decode() if ready else ""
        hello = json.loads(line) if line else {"socket": "", "threads": ["(did not start)"]}
        self.socket: str = hello["socket"]
        self.threads: list = hello["threads"]
        self.usable = not self.threads  # else every process starts cold (spawn returns None)
        self.frozen: int = hello.get("frozen", 0)
        #: the project's modules imported in the zygote before any fork (:data:`PRELOAD_PROJECT`, :data:`PRELOAD_CLI`
        #: and theirs)
        self.project: list = hello.get("project", [])
        if not line:
            self.stop()

    def stop(self) -> None:
        """Stop the zygote by PID (its children are the tests' to stop) and remove its socket's and log's folders."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for folder in (Path(self.socket).parent if getattr(self, "socket", "") else None, self.log.parent):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def spawn(
        self,
        args: list[str],
        argv: list[str],
        fds: tuple[int, int],
        env: dict,
        cwd,
        new_session: bool,
        netns: Optional[str] = None,
    ):
        """Fork ``python -m ARGS`` (``argv`` the full command line, for messages) with stdout and stderr ``fds``
        (sent to the zygote; the caller closes its own); returns a :class:`ZygoteChild`, or None when the zygote
        refuses (a thread ran in it)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        req = {
            "args": args,
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "new_session": new_session,
            "netns": netns,
            "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
        }
        socket.send_fds(conn, [(json.dumps(req) + "\n").encode()], list(fds))
        conn.settimeout(60)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise RuntimeError(f"the test zygote closed while forking {argv}: {self.log.read_text()[-2000:]}")
            line += chunk
        word, rest = line.decode().split(" ", 1)
        if word != "pid":
            conn.close()
            global last_refusal
            last_refusal = f"the zygote refused: {line.decode().strip()}"
            return None
        return ZygoteChild(argv, int(rest), conn, self.frozen)


_zygote: Optional[Zygote] = None


#: Why the last :func:`spawn` or :func:`spawn_piped` started nothing ("" after one that forked): for test messages.
last_refusal = ""


def _zygote_for(argv: Sequence[str]) -> Optional[Zygote]:
    """This worker's zygote (started on first use) when it may fork ``argv``: ``[sys.executable, "-m", ...]``
    under this process's environment, the zygote on and usable; else None (the reason in :data:`last_refusal`)."""
    global _zygote, last_refusal
    if not ENABLED or len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        last_refusal = "off, or not a python -m command line"
        return None
    if any(k == "LD_PRELOAD" or k.startswith("FAKETIME") for k in os.environ):
        last_refusal = "env: LD_PRELOAD/FAKETIME set"
        return None  # libfaketime & co. act from the process's start: never forked, nor a zygote started under them
    if _zygote is None:
        _zygote = Zygote()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not _zygote.usable:
        last_refusal = f"unusable: threads after its imports {_zygote.threads}"
        return None
    if _same_env(env) != _same_env(_zygote.env):
        mine, its = _same_env(env), _same_env(_zygote.env)
        diff = sorted(k for k in set(mine) | set(its) if mine.get(k) != its.get(k))
        last_refusal = f"env: differs from the zygote's in {diff[:5]}"
        return None
    last_refusal = ""
    return _zygote


def spawn(argv: Sequence[str], log: Path, *, append: bool, cwd=None, new_session: bool = False):
    """Start ``argv`` (``[sys.executable, "-m", MODULE, ...]``, or that behind ``ip netns exec NAME``) with stdout and stderr to ``log``, like
    :meth:`geomesh_p2p.util.procs.ProcGroup.spawn`, forked from this worker's zygote; None when it cannot be forked
    (not such a command line, a different environment, the zygote off or refusing): the caller starts it itself."""
    netns, cmd = _split_netns(argv)
    z = _zygote_for(cmd)
    if z is None:
        return None
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return z.spawn(list(cmd[2:]), list(argv), (fd, fd), env, cwd, new_session, netns)
    finally:
        os.close(fd)


def spawn_piped(argv: Sequence[str], *, cwd=None):
    """Like ``subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, cwd=cwd)`` with ``PYTHONUNBUFFERED``,
    forked from this worker's zygote: a :class:`ZygoteChild` whose ``stdout`` and ``stderr`` are text streams to
    read; None when it cannot be forked (see :func:`spawn`)."""
    z = _zygote_for(argv)
    if z is None:
        return None
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        child = z.spawn(list(argv[2:]), list(argv), (out_w, err_w), dict(os.environ, PYTHONUNBUFFERED="1"), cwd, False)
    finally:
        os.close(out_w)
        os.close(err_w)
    if child is None:
        os.close(out_r)
        os.close(err_r)
        return None
    child.stdout, child.stderr = open(out_r, encoding="utf-8"), open(err_r, encoding="utf-8")
    return child


def run(argv: Sequence[str], *, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)`` with
    ``PYTHONUNBUFFERED``, forked from this worker's zygote when it can be (:func:`spawn_piped`; a cold interpreter
    otherwise): a CLI invocation that fails at start costs ~1 CPU-s instead of ~5 (torch's import). On a timeout the
    child is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    child = spawn_piped(argv, cwd=cwd)
    if child is None:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    got: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda k=k, s=s: got.__setitem__(k, s.read()), daemon=True)
        for k, s in (("out", child.stdout), ("err", child.stderr))
    ]
    for t in readers:
        t.start()
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    for t in readers:
        t.join(30)  # EOF once the child exited (unless a grandchild it left holds the pipes)
    child.stdout.close()
    child.stderr.close()
    return subprocess.CompletedProcess(list(argv), code, got.get("out", ""), got.get("err", ""))
