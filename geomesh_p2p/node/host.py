"""Several peers on one host (issue 27): torch's default of one intra-op thread per core in every peer
oversubscribes a machine that runs several, so a peer started without ``--threads`` takes its share of the
cores among the peer processes live on this host.

The processes are counted through a per-user directory of PID files (:func:`host_dir`): each peer writes its
own at start, and every count drops the files of PIDs no longer alive, so a peer killed with SIGKILL costs
nothing after it is gone. A peer started earlier keeps the threads it took; the count is a start-up default,
not a scheduler.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["host_dir", "live_host_peers", "usable_cores", "set_threads"]

log = logging.getLogger("geomesh_p2p.node.peer")


def host_dir() -> Path:
    """Where this user's peer processes register: ``$XDG_RUNTIME_DIR/geomesh_p2p/peers`` when set, else
    ``<tmp>/geomesh_p2p-<uid>/peers``."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(run) / "geomesh_p2p" if run else Path(tempfile.gettempdir()) / f"geomesh_p2p-{os.getuid()}"
    return base / "peers"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that PID: alive
        return True
    return True


def live_host_peers(register: bool = True, directory: Optional[Path] = None) -> int:
    """Peer processes live on this host, this one included when ``register`` (its PID file is written
    first). Files of dead PIDs are removed. An unwritable directory counts this process alone (1).

    Raises nothing: any OSError is logged at DEBUG and gives 1."""
    d = directory or host_dir()
    me = os.getpid()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if register:
            (d / str(me)).write_text("")
        n = 0
        for f in d.iterdir():
            try:
                pid = int(f.name)
            except ValueError:
                continue
            if pid == me or _alive(pid):
                n += 1
            else:
                f.unlink(missing_ok=True)
        return max(1, n)
    except OSError as e:
        log.debug("cannot count the peers on this host in %s: %s", d, e)
        return 1


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_threads(threads: Optional[int], directory: Optional[Path] = None) -> int:
    """Set torch's intra-op threads: ``threads`` when given (``--threads``), else the usable cores divided by
    the peer processes live on this host (:func:`live_host_peers`), at least 1; one INFO line when the
    default is shared. Returns the thread count set."""
    if threads:
        torch.set_num_threads(threads)
        return threads
    cores, peers = usable_cores(), live_host_peers(directory=directory)
    n = max(1, cores // peers)
    torch.set_num_threads(n)
    if peers > 1:
        log.info(
            "torch threads: %d (%d cores shared by %d peer processes on this host; --threads sets it)", n, cores, peers
        )
    return n
