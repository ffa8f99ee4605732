"""``geomesh-bootstrap``: run a DHT node that does not train, the entry point newcomers dial.

  geomesh-bootstrap --run-id my-run --host 0.0.0.0 --port 31337 --advertise-host PUBLIC_IP
  geomesh-peer join --run-id my-run --bootstrap PUBLIC_IP:31337 --host 0.0.0.0 --advertise-host VOLUNTEER_IP  # each

Prints the address to dial and the node's PeerID, logs the number of live peers of the run every
--status-interval seconds, and exits with status 0 on Ctrl+C (SIGINT) or SIGTERM. Several bootstraps
may serve one swarm: start each with --bootstrap pointing at the others, and give peers all of them
(--bootstrap is repeatable). Peers keep finding each other when every bootstrap is gone.

With --http-port PORT it also serves a read-only status page (http://HOST:PORT/: peers, round, leader,
plan, digests, plots of loss / perplexity / tokens/s / idle) and its JSON (/api/swarm, /api/rounds),
built from the run's signed DHT records; --http-host says where it listens (default 127.0.0.1).

Every option can also come from --config FILE (YAML or JSON; keys are the long option names);
flags on the command line win.
"""

from __future__ import annotations

import argparse
import errno
import asyncio
import logging
import os
from pathlib import Path
import shlex
import signal
import socket
import sys
import time
from typing import NoReturn, Optional

from geomesh_p2p.util.exit_gc import arm_startup_freeze, freeze_startup_heap, skip_exit_collections
from geomesh_p2p import __version__
from geomesh_p2p.config.flags import (
    ConfigFileError,
    StrictParser,
    add_flags,
    add_log_level,
    flag_specs,
    load_config_defaults,
    unknown_home,
)
from geomesh_p2p.config.models import DEFAULT_BOOTSTRAP_IDENTITY as DEFAULT_IDENTITY  # noqa: F401  (re-exported)
from geomesh_p2p.config.models import DEFAULT_BOOTSTRAP_PORT as DEFAULT_PORT  # noqa: F401
from geomesh_p2p.config.models import DEFAULT_RUN_ID, BootstrapConfig, run_named  # noqa: F401
from geomesh_p2p.config.models import DEFAULT_POW_BITS, MAX_POW_BITS
from geomesh_p2p.net.addr import (
    AddressError,
    format_address,
    is_wildcard_host,
    first_listen_problem,
    normalize_host,
    parse_address,
)
from geomesh_p2p.schema.shards import check_shards
from geomesh_p2p.telemetry.logonce import LogOnChange
from geomesh_p2p.util.fds import raise_fd_limit
from geomesh_p2p.util.aio import unless_set, wait_event

PROG = "geomesh-bootstrap"
#: bound (seconds) on the last read of the swarm's round when the bootstrap stops (its state file keeps it)
FINAL_PROGRESS_READ_S = 3.0
#: bound (seconds) on one write of the --state-file (a hung file system must not hold the status loop)
STATE_SAVE_TIMEOUT_S = 30.0

log = logging.getLogger("geomesh.bootstrap")


class _Parser(StrictParser):
    """An ArgumentParser whose errors are one line (no usage dump): ``geomesh-bootstrap: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self.suggest(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n", 1)[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # Every option but --config/--log-level comes from BootstrapConfig's fields (defaults and help once).
    add_flags(ap, flag_specs(BootstrapConfig))
    ap.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML/JSON file of option values (flags on the command line win) (default: none)",
    )
    add_log_level(ap)
    return ap


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def _outward_host() -> str:
    """This machine's address on its default route (no packet is sent); 127.0.0.1 when there is none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def _fmt(host: str, port: int) -> str:
    """``host:port`` for a message (IPv6 in brackets; as given when it does not format)."""
    try:
        return format_address(host, port)
    except AddressError:
        return f"{host}:{port}"


def state_path(ns: argparse.Namespace) -> Optional[str]:
    """The --state-file to use: the flag, else next to --identity; None when '' (off)."""
    if ns.state_file is not None:
        return ns.state_file or None
    return os.path.splitext(os.path.expanduser(ns.identity))[0] + ".state.json"


def check_state_file(ns: argparse.Namespace) -> Optional[str]:
    """A one-line complaint about the --state-file (the flag's or the default next to --identity), or None. A
    file that exists must be a state file this program wrote (of any run or version: one of another run is
    replaced, as before): a binary or other file there was logged as "ignoring" and then overwritten, the
    user's file lost to a typo (red team, session 28). An absent file is fine (it is created)."""
    from geomesh_p2p.dht.progress import BootstrapState, StateFileError

    path = state_path(ns)
    if not path:
        return None
    if not ns.state_file:  # the default, next to --identity: a problem of its folder is --identity's (fresh user 50)
        key = Path(os.path.expanduser(ns.identity))
        there = next((a for a in key.parents if a.exists()), None)
        if there is not None and not there.is_dir():
            return (
                f"--identity {ns.identity}: its folder {key.parent} exists and is not a folder"
                if there == key.parent
                else f"--identity {ns.identity}: its folder {key.parent} cannot be made: {there} exists and is not a folder"
            )
    else:  # the default's folder is --identity's, made with the key; a typed one's must be there
        parent = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
        # a typo must not make folders (fresh user 49: --state-file /nonexist/dir/b3.json made /nonexist/dir)
        if not os.path.isdir(parent):
            return f"--state-file {path}: folder {parent} does not exist (the file is created, its folder is not)"
        if not os.path.exists(path) and not os.access(parent, os.W_OK):
            return f"--state-file {path}: folder {parent} is not writable"
    try:
        BootstrapState.read(path)
    except StateFileError as e:
        return f"--state-file {path}: {e}; give another path, or move the file away"
    return None


def writes_line(ns: argparse.Namespace) -> str:
    """The start-up line naming where this bootstrap writes (its key, and its state file unless off), e.g.
    ``writes under /home/u/.geomesh: identity key bootstrap.key (--identity), state bootstrap.state.json
    (--state-file; '' = none)``."""
    key = os.path.abspath(os.path.expanduser(ns.identity))
    state = state_path(ns)
    state = os.path.abspath(os.path.expanduser(state)) if state else None
    dirs = list(dict.fromkeys(os.path.dirname(p) for p in (key, state) if p))
    one = len(dirs) == 1

    def name(path: str) -> str:
        return os.path.basename(path) if one else path

    where = f"state {name(state)} (--state-file; '' = none)" if state else "no state file (--state-file '')"
    return f"writes under {', '.join(dirs)}: identity key {name(key)} (--identity), {where}"


def _check(ns: argparse.Namespace) -> Optional[str]:
    """A one-line complaint about the option values, or None."""
    if not 0 <= ns.port <= 65535:
        return f"--port {ns.port}: must be between 0 and 65535"
    for b in ns.bootstrap:
        try:
            parse_address(str(b))
        except AddressError as e:
            return f"--bootstrap {e}"
    for flag, host in (("--host", ns.host), ("--advertise-host", ns.advertise_host), ("--http-host", ns.http_host)):
        if host is not None and host != "":
            try:
                normalize_host(host)
            except AddressError as e:
                return f"{flag}: {e}"
    if ns.http_port is not None and not 0 <= ns.http_port <= 65535:
        return f"--http-port {ns.http_port}: must be between 0 and 65535"
    if not ns.http_poll > 0:
        return f"--http-poll {ns.http_poll}: must be > 0"
    if ns.status_interval <= 0:
        return f"--status-interval {ns.status_interval}: must be > 0"
    for flag, v in (("--k", ns.k), ("--alpha", ns.alpha)):  # the one at fault, not both (fresh user 46's kind)
        if v < 1:
            return f"{flag} {v}: must be >= 1"
    if ns.rpc_timeout <= 0:
        return f"--rpc-timeout {ns.rpc_timeout}: must be > 0"
    if not ns.run_id:
        return "--run-id: must not be empty"
    if ns.pow_bits is not None and not 0 <= ns.pow_bits <= MAX_POW_BITS:
        return f"--pow-bits {ns.pow_bits}: must be between 0 and {MAX_POW_BITS}"
    try:
        check_shards(ns.record_shards)
    except ValueError as e:
        return f"--record-shards {ns.record_shards}: {str(e).removeprefix('record_shards ')}"
    return None


def pow_floor(ns: argparse.Namespace) -> int:
    """The least proof of work (bits) a record must carry to count here: --pow-bits, else the peers' default
    in an open run and 0 in a private one (--allow-peers admits by list)."""
    if ns.pow_bits is not None:
        return int(ns.pow_bits)
    return 0 if ns.allow_peers else DEFAULT_POW_BITS


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` with --config values as defaults. Raises SystemExit(2) with a one-line message."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.config:
        try:
            parser.set_defaults(**load_config_defaults(parser, ns.config))
        except ConfigFileError as e:
            parser.exit(2, f"{PROG}: {e}\n")
        ns = parser.parse_args(argv)
        if isinstance(ns.bootstrap, str):
            ns.bootstrap = [ns.bootstrap]
    problem = _check(ns) or unknown_home(parser, ns)  # ~NAME of nobody: a traceback from pathlib (red team 43)
    if problem:
        parser.exit(2, f"{PROG}: {problem}\n")
    return ns


async def serve(ns: argparse.Namespace, identity, allow_peers: Optional[list[str]] = None, tls=None) -> int:
    """Run the bootstrap node until SIGINT/SIGTERM. Returns the exit status. ``allow_peers``: the
    entries of --allow-peers (private run), None for an open run. ``tls``: the checked
    ``transport.TlsConfig`` of --tls-cert/--tls-key/--tls-ca, None for plaintext.

    SIGINT/SIGTERM are caught from the first line (imports and the join take seconds): a stop during the
    start ends it at the next step and shuts the node down in order, instead of a KeyboardInterrupt
    that left gRPC's server running into a closed event loop ("Event loop is closed", issue 14 #10)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await _serve(ns, identity, allow_peers, tls, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve(ns: argparse.Namespace, identity, allow_peers, tls, stop: asyncio.Event) -> int:
    """:func:`serve` with its stop event (set by SIGINT/SIGTERM)."""
    # the DHT's imports (hivemind, which loads torch) take seconds, a minute on a loaded machine: said first (a
    # fresh-user trial saw ~50 s of silence at load 12 before the "serving on" line). On stdout, with the banner:
    # stderr's lines are the log and a failed start's one line
    print(f"{PROG} {__version__}: starting run {run_named(ns.run_id)}: loading the DHT's libraries (seconds; longer on a "
          "loaded machine)", flush=True)  # fmt: skip
    from geomesh_p2p.dht import DHTJoinError, DHTNode, live_peers
    from geomesh_p2p.net.identity import allow_list
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.trust.admission import load_or_solve_pow, pow_cache_path, run_record_store_check

    advertise = ns.advertise_host
    if advertise is None and is_wildcard_host(ns.host):
        advertise = _outward_host()
    allow = allow_list(allow_peers, also=[identity.peer_id]) if allow_peers is not None else None
    transport = Transport(
        identity, ns.run_id, TransportConfig(host=ns.host, port=ns.port, advertise_host=advertise, tls=tls), allow=allow
    )
    node = DHTNode(
        transport,
        k=ns.k,
        alpha=ns.alpha,
        rpc_timeout_s=ns.rpc_timeout,
        refresh_period_s=ns.refresh_period,
        republish_period_s=ns.republish_period,
        # junk under the run's keys is refused, not stored (each slot costs an identity's work)
        store_check=run_record_store_check(ns.run_id, pow_floor(ns)),
    )
    from geomesh_p2p.net.links import LinkProbeService

    LinkProbeService(transport)  # joining peers measure their link against the bootstrap
    try:
        address = await transport.start()
    except (OSError, RuntimeError) as e:
        await transport.stop(grace=0)
        reason = str(e).splitlines()[0].split(";")[0] if str(e) else type(e).__name__
        if not reason.startswith("cannot listen"):
            reason = f"cannot listen on {_fmt(ns.host, ns.port)}: {reason}"
        return _fail(reason)
    # its own proof of work at the floor it asks, once it listens (0.10.0: the run's nodes store its progress record
    # under a run key only with it); cached beside --identity, as a peer's is; a second or so for the default 22 bits
    if pow_floor(ns) > 0:
        cache = pow_cache_path(ns.identity) if ns.identity else None
        node.pow_nonce, _took, _cached = await asyncio.to_thread(
            load_or_solve_pow, identity, ns.run_id, pow_floor(ns), cache, stop.is_set
        )
        if node.pow_nonce is None:  # stopped while computing it
            await transport.stop(grace=0)
            return 0

    status = None
    if ns.http_port is not None:
        from geomesh_p2p.status.http import StatusServer
        from geomesh_p2p.status.swarm import SwarmWatcher

        watcher = SwarmWatcher(
            node, ns.run_id, poll_s=ns.http_poll, allow=allow, pow_floor=pow_floor(ns), shards=ns.record_shards
        )
        status = StatusServer(watcher, ns.http_host, ns.http_port)
        try:
            url = await status.start()
        except OSError as e:
            await transport.stop(grace=0)
            why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            return _fail(
                f"cannot serve the status page on {_fmt(ns.http_host, ns.http_port)}: {why} "
                "(another --http-port, or --http-port 0 for a free one)"
            )

    print(f"{PROG} {__version__}: run {run_named(ns.run_id)}, DHT node serving on {address}", flush=True)
    print(f"PeerID: {identity.peer_id}", flush=True)
    # stdout, after the address line: a start that fails stays one line on stderr, and the first line the address
    print(writes_line(ns), flush=True)
    print(f"peers join with: --bootstrap {address} --run-id {shlex.quote(ns.run_id)}", flush=True)
    if allow is not None:
        print(f"private run: {len(allow_peers)} allowed peer(s) from --allow-peers {ns.allow_peers}", flush=True)
    if status is not None:
        print(f"status page on {url} (JSON: {url}api/swarm, {url}api/rounds)", flush=True)
    new_key = identity.keep_created()  # said once it serves, last: a start that fails stays one line
    if new_key:
        print(new_key, flush=True)
    from geomesh_p2p.dht.progress import BootstrapState, SwarmProgress, disowned_rise, progress_of, publish_progress

    from geomesh_p2p.trust.admission import Admission

    counted = Admission(ns.run_id, pow_floor(ns), allow)
    state_file = state_path(ns)
    saved = await asyncio.to_thread(BootstrapState.load, state_file, ns.run_id) if state_file else None
    me = identity.peer_id.to_string()
    progress: Optional[SwarmProgress] = saved.swarm_progress(by=me) if saved is not None else None
    rose_from: Optional[SwarmProgress] = None  # the progress before live records last raised it (disowned_rise)

    async def refresh_progress() -> int:
        """The swarm's round and run-config hash, published and kept for the state file; returns the number
        of live, not leaving, peers. From the live records and those of leaving peers that held a state (each
        is the last round its peer finished), :func:`progress_of` takes the config most of them announce and
        its newest round. That is the truth when a live peer of that config is among them; with only leaving
        ones it may only raise the remembered round: their records expire one by one, and a peer that stopped
        while waiting for the swarm announces round 0 as it leaves; neither may make the bootstrap forget."""
        nonlocal progress, rose_from
        # Only records that carry the run's proof of work count: free identities announcing another config or
        # round 10^9 would otherwise outvote the run's peers in progress_of (and tell newcomers a false round).
        everyone = await live_peers(node, ns.run_id, include_leaving=True, shards=ns.record_shards)
        recs = counted.filter(everyone)
        if len(recs) < len(everyone):
            below.failed(
                "pow",
                "%d peer record(s) carry less proof of work than this bootstrap's --pow-bits %d and are not counted "
                "(a run with a lower --pow-bits passes the same value here)",
                len(everyone) - len(recs),
                pow_floor(ns),
            )
        else:
            below.recovered("every peer record carries this bootstrap's --pow-bits of work again")
        # live records, and the records of leaving peers that held a state (the last round each finished)
        held = [r for r in recs if not r.leaving or r.weights_digest]
        if progress is not None and progress.config_hash:
            # While a live peer of the config remembered is there, records of other configs cannot replace it
            # (red team, session 13: three cheap identities of another config outnumbered two real peers)
            same = [r for r in held if (r.run_config_hash or "") == progress.config_hash]
            if any(not r.leaving for r in same):
                held = same
        now = progress_of(held, me, time.time())  # the config most records announce, and its round
        live = now is not None and any(not r.leaving and (r.run_config_hash or "") == now.config_hash for r in held)
        if now is not None and (live or progress is None or now.round > progress.round):
            # A round two or more live peers reached is the swarm's, no lone peer's fork: nothing up to it is given
            # back. rose_from was the progress before the first rise ever seen (round 0 of a run watched from its
            # start), and after a crash one digest-less leaving record (a rogue's, or a survivor's that ended "NOT
            # known to be the swarm's last") gave back every round of the run (red team 48b).
            several = {
                r.peer_id
                for r in held
                if not r.leaving and r.round >= now.round and (r.run_config_hash or "") == now.config_hash
            }
            if len(several) >= 2:
                rose_from = None
            elif live and progress is not None and now.round > progress.round and rose_from is None:
                rose_from = progress
            progress = now
            await publish_progress(node, progress, identity)
        elif rose_from is not None:
            # no peer live: the rounds live records added stand, unless their peers left disowning them (a lone
            # peer's fork, "NOT the swarm's": fresh user 48); then the round remembered before them comes back
            disowned = disowned_rise(rose_from, recs)
            if disowned:
                log.info(
                    "run %r: the peers past round %d left saying their state is not the swarm's: the run's round "
                    "remembered is %d again",
                    ns.run_id,
                    rose_from.round,
                    rose_from.round,
                )
                progress = rose_from
                await publish_progress(node, progress, identity)
            rose_from = None
        return sum(1 for r in recs if not r.leaving)

    # A full disk, a read-only --state-file, a DHT that does not answer: one WARNING per change of state and
    # one INFO line when it works again, not the same line every --status-interval (issue 29 #7).
    save_failures, count_failures, below = LogOnChange(log), LogOnChange(log), LogOnChange(log)

    saving: list[asyncio.Future] = []  # the last write (a stuck one is not joined by another)
    # Its imports (hivemind loads torch), servers and saved state are built: the run's full collections skip them
    # from now on, as the peer's do (geomesh_p2p/util/exit_gc.py); only when main() runs as this process.
    freeze_startup_heap()

    async def save_state() -> None:
        if not state_file:
            return
        if saving and not saving[-1].done():
            save_failures.failed("hung", "the bootstrap state is not saved: the last write to %s is stuck", state_file)
            return
        write = asyncio.ensure_future(asyncio.to_thread(BootstrapState.capture(node, progress).save, state_file))
        write.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned one's outcome is read
        saving[:] = [write]
        try:
            await asyncio.wait_for(asyncio.shield(write), STATE_SAVE_TIMEOUT_S)
        except asyncio.TimeoutError:  # a file system that does not answer: the bootstrap serves on
            save_failures.failed(
                "hung", "saving the bootstrap state to %s took over %.0f s; abandoned", state_file, STATE_SAVE_TIMEOUT_S
            )
        except OSError as e:  # the bootstrap keeps serving; the next interval tries again
            save_failures.failed(
                (type(e).__name__, e.errno),
                "could not save the bootstrap state to %s: %s (retried every --status-interval; "
                "logged again when it changes)",
                state_file,
                e.strerror or e,
            )
        else:
            save_failures.recovered("bootstrap state saved to %s again", state_file)

    try:
        try:
            await unless_set(node.join(ns.bootstrap), stop)  # its retries take up to ~30 s
        except DHTJoinError as e:  # the others may come later: keep serving, re-dial them on refresh
            log.warning("%s; serving alone for now", e)
        if saved is not None and not stop.is_set():
            # Re-dial the swarm it knew before the restart: its peers re-enter the table now, not when
            # they happen to call (they may never: their tables are not empty).
            known = saved.contact_list()
            n = await node.rejoin(known)
            log.info(
                "restored state of %s: re-dialled %d saved contact(s), %d answered%s",
                state_file,
                len(known),
                n,
                f"; the run was at round {progress.round}" if progress is not None else "",
            )
        if progress is not None and not stop.is_set():
            await publish_progress(node, progress, identity)
        if status is not None:
            status.watcher.start()
        while not stop.is_set():
            if await wait_event(stop, ns.status_interval):
                break
            try:
                n_live = await refresh_progress()
                log.info(
                    "live peers: %d (routing table: %d nodes; %d keys held)",
                    n_live,
                    len(node.contacts()),
                    len(node.storage),
                )
            except Exception as e:  # a status line must never stop the node
                count_failures.failed(type(e).__name__, "could not count live peers: %r", e)
            else:
                count_failures.recovered("counting live peers works again")
            await save_state()
    finally:
        if state_file:
            # The periodic read is up to --status-interval old: read the swarm's round once more (bounded) so
            # the state file does not remember a round the swarm left behind minutes ago.
            try:
                await asyncio.wait_for(refresh_progress(), FINAL_PROGRESS_READ_S)
            except Exception as e:  # stopping must never fail over it; the last known round is saved
                log.debug("final read of the swarm's round failed: %r", e)
        await save_state()
        if status is not None:
            await status.stop()
            await status.watcher.stop()
        await node.shutdown()
        await transport.stop(grace=1.0)
    print(f"{PROG}: stopped", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``geomesh-bootstrap``. Returns 0 on a clean stop (SIGINT/SIGTERM), 2 on bad options."""
    skip_exit_collections()  # as the peer's: no full GC passes over the imported packages at exit (docs/exit-lag.md)
    if argv is None:  # this process's own command line (not main([...]) in a test): freeze the start-up heap
        arm_startup_freeze()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl+C before serve() catches it (imports take seconds): no traceback
        print(f"{PROG}: stopped during start-up", file=sys.stderr, flush=True)
        return 0


def _main(argv: Optional[list[str]] = None) -> int:
    """:func:`main` (a Ctrl+C before the event loop runs raises KeyboardInterrupt here)."""
    try:
        ns = parse(argv)
    except SystemExit as e:  # --help/--version (0) or a one-line error (2)
        return int(e.code or 0)
    # gRPC's C core (its own lines on a busy port, a failed TLS handshake) is silenced when the package is
    # imported, before grpc loads (geomesh_p2p.util.grpc_env); here it would be too late.
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    from geomesh_p2p.net.identity import Identity, IdentityError

    raise_fd_limit()  # gRPC's and the status page's shares of it (geomesh_p2p/util/fds.py) grow with it
    problem = check_state_file(ns) or check_ports(ns)  # before the key is created: a refused start leaves nothing
    if problem:
        return _fail(problem)
    try:
        identity = Identity.load_or_create(ns.identity)
    except IdentityError as e:
        return _fail(f"--identity: {e}")
    from geomesh_p2p.trust.admission import discard_new_identity

    try:
        return _start(ns, identity)
    finally:
        # a key file this start created goes with a failed start (kept once it served: _serve)
        discard_new_identity(identity)


def check_ports(ns: argparse.Namespace) -> Optional[str]:
    """``--port`` and ``--http-port`` checked by binding them at start (:func:`~geomesh_p2p.net.addr.listen_problem`):
    a busy status port was found only after the node listened and made its proof of work. A one-line complaint
    naming the flag, or None."""
    return first_listen_problem(
        [(ns.host, ns.port, "--port", "--host"), (ns.http_host, ns.http_port, "--http-port", "--http-host")]
    )


def _start(ns: argparse.Namespace, identity) -> int:
    """The rest of :func:`_main` once ``identity`` is loaded or created: the allow-list and TLS files, then
    :func:`serve`. Returns the exit status."""
    allow_peers = None
    if ns.allow_peers:
        from geomesh_p2p.trust.admission import read_allow_file

        try:
            allow_peers = read_allow_file(ns.allow_peers)
        except UnicodeDecodeError as e:  # a binary file: named, not the codec's message (review M3)
            return _fail(f"--allow-peers: {ns.allow_peers} is not UTF-8 text (byte {e.start})")
        except ValueError as e:
            return _fail(f"--allow-peers: {e}")
    from geomesh_p2p.net.tls import TlsError, tls_from_flags

    try:
        tls = tls_from_flags(getattr(ns, "tls_cert", None), getattr(ns, "tls_key", None), getattr(ns, "tls_ca", None))
    except TlsError as e:  # one line naming the flag and the file, before anything listens
        return _fail(str(e))
    try:
        return asyncio.run(serve(ns, identity, allow_peers, tls))
    except KeyboardInterrupt:  # a second Ctrl+C during shutdown
        return 0


if __name__ == "__main__":
    sys.exit(main())
