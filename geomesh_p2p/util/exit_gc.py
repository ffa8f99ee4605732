"""Spare a process the cyclic garbage collector's passes over its imported modules: at exit, and during the run.

Why: a peer's interpreter holds ~415,000 GC-tracked objects once torch, transformers, hivemind and grpc are
imported (functions, tuples, dicts, cells of those packages; the node's own state is a small share), and
``Py_FinalizeEx`` runs full collections over all of them after the ``atexit`` handlers (when it clears
``sys.modules`` and again when it clears the interpreter). Each pass costs ~0.3-0.5 CPU-s; on a loaded machine
(the e2e tier: 2 cores, 17-45 runnable processes) the process exited 6-88 s after its node had shut down, and
py-spy saw only ``gc_collect_main`` in that time (docs/exit-lag.md). ``gc.freeze()`` moves every object alive
at that point into the permanent generation, which those passes skip; refcounting still frees what module
teardown releases, and objects created afterwards are still collected.

What it gives up: an object that is garbage only through a reference cycle at exit is not finalized (its
``__del__`` does not run) - which Python does not promise at exit anyway. Nothing of the node's relies on it:
its files, threads, channels and servers are closed by its shutdown, logging's handlers by ``logging.shutdown``
(an ``atexit`` handler that runs before this one), and ``sys.stdout``/``sys.stderr`` are flushed by the
interpreter after the collections.
"""

from __future__ import annotations

import atexit
import gc

_installed = False
_armed = False


def freeze_heap() -> None:
    """Move every GC-tracked object into the permanent generation (``gc.freeze``). For the end of a process."""
    gc.freeze()


def skip_exit_collections() -> None:
    """Register :func:`freeze_heap` with ``atexit``, once per process (later calls do nothing). Call it early
    (a command's ``main``): ``atexit`` runs handlers last-registered-first, so this one runs after those
    registered later (the node's); those registered at import (logging's flush) run after it, and what they
    allocate is still collected. Harmless in a process that calls ``main`` in-process (tests): it acts only
    when that process exits."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(freeze_heap)


def arm_startup_freeze() -> None:
    """Let :func:`freeze_startup_heap` act in this process: for a command's ``main`` run as the process itself (its
    arguments from the command line), never for ``main([...])`` called in a test process, whose objects would never
    be collected again."""
    global _armed
    _armed = True


def freeze_startup_heap() -> bool:
    """Once the node's model and training are built (:meth:`PeerNode.start`; a follower rank's, ``run_follower``; the
    bootstrap's imports and servers, ``geomesh-bootstrap``'s ``_serve``): collect, then move every object alive into the permanent generation (``gc.freeze``),
    so that the run's full collections skip the ~418,000 objects of the imports and the model (234 ms each on this
    machine, holding the GIL: an event-loop stall whenever one ran; issue 27). Objects made later are collected as
    before; what the start made and drops later through a reference cycle is not (refcounting still frees the
    rest). Acts only after :func:`arm_startup_freeze`, once. Returns whether it froze."""
    global _armed
    if not _armed:
        return False
    _armed = False
    gc.collect()  # garbage of the start first: frozen, it would never go
    gc.freeze()
    return True
