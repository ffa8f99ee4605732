"""Small asyncio helpers shared by the node's services."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Collection, Dict, Generic, Optional, Set, Tuple, TypeVar

__all__ = [
    "SharedRead",
    "TaskScope",
    "cancel_and_wait",
    "create_unscoped_task",
    "finish_or_cancel",
    "prestart_default_executor",
    "runs",
    "unless_set",
    "wait_event",
]


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True when it is set.

    Unlike ``asyncio.wait_for(event.wait(), timeout)`` this creates no inner task on Python >= 3.11
    (``asyncio.timeout``), so a handler cancelled while waiting (a client that hung up on a long poll)
    leaves no pending task behind to be garbage-collected with "Task was destroyed but it is pending!".
    """
    if event.is_set():
        return True
    if timeout <= 0:
        return False
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout):
                await event.wait()
        else:  # pragma: no cover - 3.10
            await asyncio.wait_for(event.wait(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        pass
    return event.is_set()


#: Seconds the worker threads of :func:`prestart_default_executor` wait for each other to have started.
PRESTART_TIMEOUT_S = 10.0


def prestart_default_executor(
    loop: asyncio.AbstractEventLoop, workers: Optional[int] = None
) -> concurrent.futures.ThreadPoolExecutor:
    """Give ``loop`` a default executor (``asyncio.to_thread``, ``run_in_executor(None, ...)``) whose ``workers``
    threads (default asyncio's own, ``min(32, cpu_count + 4)``) are all started now; returns it. ``asyncio.run``
    shuts it down with the loop, as it does the executor it would make itself.

    Why (issue 27, session 46): ``ThreadPoolExecutor`` starts a thread inside ``submit`` while it has no idle one, and
    ``Thread.start`` waits until the new thread runs: on a loaded 2-core host the event loop waited 51 ms for that in
    a ``gpt2-124m`` round (located with ``GEOMESH_LOOPLAG_TRACE_MS=50``). Started here, before the loop is busy, no
    later ``submit`` starts one. Call it from the loop's thread before the first ``to_thread``; blocks until every
    worker runs (a few ms), at most :data:`PRESTART_TIMEOUT_S` s.

    Raises:
        ValueError: ``workers`` < 1.
    """
    n = min(32, (os.cpu_count() or 1) + 4) if workers is None else int(workers)
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="asyncio")
    # each task holds its thread until all n have started, so submit starts n threads, not 1 reused n times
    barrier = threading.Barrier(n, timeout=PRESTART_TIMEOUT_S)
    try:
        for f in [pool.submit(barrier.wait) for _ in range(n)]:
            f.result()
    except threading.BrokenBarrierError:  # a host too loaded to run n threads in 10 s: the lazy threads as before
        pass
    loop.set_default_executor(pool)
    return pool


async def cancel_and_wait(tasks: Collection[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until each has finished; their results and errors are dropped. Why: a
    task only cancelled (not awaited) is still pending when its loop closes, and is then reported as
    "Task was destroyed but it is pending!"."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def finish_or_cancel(tasks: Collection[asyncio.Future]) -> None:
    """Wait for ``tasks`` to finish (results and errors dropped); if this waiter is cancelled, cancel
    them and wait for them before re-raising. Spawned on an owner (e.g. ``TaskOwner.spawn``), it makes
    that owner's shutdown end tasks it did not start itself."""
    try:
        if tasks:
            await asyncio.wait(tasks)
    finally:
        await cancel_and_wait([t for t in tasks if not t.done()])


async def unless_set(aw: Awaitable[Any], event: asyncio.Event) -> Tuple[bool, Any]:
    """Run ``aw`` until it finishes or ``event`` is set, whichever comes first: (True, its result), or
    (False, None) once it was cancelled and awaited (a Ctrl+C during a join's retries ends it at once,
    leaving no task behind). Raises what ``aw`` raised."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([stopped] + ([task] if not task.done() else []))
    if task.cancelled():
        return False, None
    return True, task.result()


# The innermost TaskScope of the running code. A task copies its creator's context, so the tasks that
# a scope's tasks create see the same scope (and are recorded by it) without any cooperation.
_current_scope: contextvars.ContextVar[Optional["TaskScope"]] = contextvars.ContextVar(
    "geomesh_task_scope", default=None
)


def _default_factory(loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
    # What the loop does when no factory is installed. kwargs: ``context`` (3.11+) and ``name`` (3.13+).
    return asyncio.Task(coro, loop=loop, **kwargs)


class _RecordingFactory:
    """The loop's task factory while TaskScopes are open on it: creates each task with the factory it
    replaced (``previous``; none: ``asyncio.Task``), then, when the creator's context (or the
    ``context`` given) is inside an open TaskScope, records the task there. ``open_scopes``: how many
    scopes use it; the last one to close puts ``previous`` back."""

    def __init__(self, previous: Optional[Callable[..., asyncio.Future]]) -> None:
        self.previous = previous
        self.delegate = previous if previous is not None else _default_factory
        self.open_scopes = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Future:
        context = kwargs.get("context")
        scope = _current_scope.get() if context is None else context.get(_current_scope)
        task = self.delegate(loop, coro, **kwargs)
        # Once a scope is closed only the tasks it handed to ``adopt`` still run in its context: what
        # they create is theirs (their owner's), not an outer scope's to cancel.
        if scope is not None and not scope._closed:
            scope._record(task, asyncio.current_task(loop))
        return task


def _acquire_factory(loop: asyncio.AbstractEventLoop) -> _RecordingFactory:
    # Installed when the first scope on this loop opens; a factory set since then by someone else is
    # wrapped in turn (delegated to).
    current = loop.get_task_factory()
    if not isinstance(current, _RecordingFactory):
        current = _RecordingFactory(current)
        loop.set_task_factory(current)
    current.open_scopes += 1
    return current


def _release_factory(loop: asyncio.AbstractEventLoop, factory: _RecordingFactory) -> None:
    # The last scope out puts the previous factory back, so code outside scopes pays nothing. Left in
    # place (inert) when someone installed a factory over it meanwhile: theirs may delegate to it.
    factory.open_scopes -= 1
    if factory.open_scopes == 0 and loop.get_task_factory() is factory:
        loop.set_task_factory(factory.previous)


def create_unscoped_task(coro, name: Optional[str] = None) -> asyncio.Task:
    """``loop.create_task(coro, name=name)`` on the running loop, recorded by no TaskScope, nor are the
    tasks it creates: for a task with an owner of its own (``TaskOwner.spawn``: a routing-table ping or a
    channel close started during a DHT lookup belongs to the node, not to the lookup's scope). Its context
    is a copy of the creator's without the scope. Raises RuntimeError outside a running loop."""
    context = contextvars.copy_context()
    context.run(_current_scope.set, None)
    # Created inside ``context`` (not with create_task's context=, absent on 3.10): the task copies it.
    return context.run(asyncio.get_running_loop().create_task, coro, name=name)


def runs(fn: Callable[..., Awaitable[Any]]) -> Callable[[asyncio.Future], bool]:
    """A predicate for :class:`TaskScope`'s ``keep``: True for a task running a coroutine of the async
    function ``fn`` (any closure of it; started or not). False for other futures."""
    code = getattr(fn, "__code__", None)

    def predicate(task: asyncio.Future) -> bool:
        get_coro = getattr(task, "get_coro", None)
        return code is not None and get_coro is not None and getattr(get_coro(), "cr_code", None) is code

    return predicate


class TaskScope:
    """Owns every task created while it is active, including the tasks those tasks create, so code that
    starts tasks and may leave them behind (e.g. hivemind's ``traverse_dht``, which leaves its workers
    and their helpers pending when it returns or is cancelled: "Task was destroyed but it is pending!")
    can be called without leaks and without changing it.

    ``async with TaskScope(adopt=..., keep=...) as scope: await code_that_starts_tasks()``.
    Recording: a ContextVar names the scope, and a loop task factory, installed on the running loop while
    any scope is open there (once for all of them; the factory found before is put back when the last
    one closes), records each task whose creator's context names an open scope; it delegates creation to
    the factory installed before it (default: ``asyncio.Task(coro, loop=loop, **kwargs)``). Tasks built by calling ``asyncio.Task``
    directly, bypassing the loop's factory, are not seen; tasks with an owner of their own are created
    with :func:`create_unscoped_task` so that no scope takes them.

    On exit, the tasks still running are handled, then the scope closes (it records nothing more):

    * normal exit, with ``adopt``: tasks for which ``keep(task)`` is True (default: none), and tasks
      created by them, are passed to ``adopt(tasks)`` (a set; not called when empty); the caller owns
      them from then on (e.g. cancels and awaits them at its shutdown);
    * all the others, and every task on an exit by exception or cancellation, are cancelled and awaited
      before ``__aexit__`` returns; a task they create while ending is handled the same way. If the
      exiting task is cancelled again meanwhile, the cleanup still completes, then CancelledError is
      raised. Results and errors of cancelled tasks are dropped (the exception leaving the body, if
      any, propagates unchanged). A task that swallows its cancellation keeps the exit waiting.

    ``scope.tasks``: the tasks recorded so far while open (a set, done ones included; empty once
    closed). Nested scopes: a task is recorded by the innermost open one; once a scope is closed, what
    its adopted tasks create is recorded by none. Raises RuntimeError when entered twice or outside a
    running loop.
    """

    def __init__(
        self,
        adopt: Optional[Callable[[Set[asyncio.Future]], None]] = None,
        keep: Optional[Callable[[asyncio.Future], bool]] = None,
    ) -> None:
        self._adopt = adopt
        self._keep = keep
        self._creator: Dict[asyncio.Future, Optional[asyncio.Future]] = {}  # task -> task that created it
        self._token: Optional[contextvars.Token] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._factory: Optional[_RecordingFactory] = None
        self._entered = False
        self._closed = False

    @property
    def tasks(self) -> Set[asyncio.Future]:
        """The tasks recorded while open, done ones included (a new set; empty once closed)."""
        return set(self._creator)

    def _record(self, task: asyncio.Future, creator: Optional[asyncio.Future]) -> None:
        self._creator[task] = creator

    def _kept(self, task: asyncio.Future, kept: Dict[asyncio.Future, bool]) -> bool:
        # True when the task, or a recorded task that created it (transitively), is one to keep.
        chain = []
        t: Optional[asyncio.Future] = task
        verdict = False
        while t is not None and t in self._creator:
            if t in kept:
                verdict = kept[t]
                break
            chain.append(t)
            if self._keep is not None and self._keep(t):
                verdict = True
                break
            t = self._creator[t]
        for c in chain:
            kept[c] = verdict
        return verdict

    async def __aenter__(self) -> "TaskScope":
        if self._entered:
            raise RuntimeError("a TaskScope can be entered once")
        self._entered = True
        self._loop = asyncio.get_running_loop()
        self._factory = _acquire_factory(self._loop)
        self._token = _current_scope.set(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        token, loop, factory = self._token, self._loop, self._factory
        if token is None or loop is None or factory is None:  # all set by __aenter__
            raise RuntimeError("a TaskScope is exited without having been entered")
        _current_scope.reset(token)  # the body's own context: the exiting code is outside now
        adopt = self._adopt if exc_type is None else None
        kept: Dict[asyncio.Future, bool] = {}
        handled: Set[asyncio.Future] = set()
        interrupted = False
        try:
            while True:  # rounds: tasks may create tasks while being cancelled
                fresh = [t for t in self._creator if t not in handled and not t.done()]
                if not fresh:
                    break
                handled.update(fresh)
                to_adopt = {t for t in fresh if adopt is not None and self._kept(t, kept)}
                if to_adopt and adopt is not None:  # (to_adopt is empty without adopt)
                    adopt(to_adopt)
                to_end = [t for t in fresh if t not in to_adopt]
                for t in to_end:
                    t.cancel()
                pending = set(to_end)
                while pending:
                    try:
                        _, pending = await asyncio.wait(pending)
                    except asyncio.CancelledError:  # cancelled again: let them finish ending first
                        interrupted = True
                for t in to_end:  # retrieve errors so none is logged as "never retrieved"
                    if not t.cancelled():
                        t.exception()
        finally:
            self._closed = True
            _release_factory(loop, factory)
            self._creator.clear()  # adopted tasks keep this scope in their context: drop the references
        if interrupted:
            raise asyncio.CancelledError


T = TypeVar("T")


class SharedRead(Generic[T]):
    """A read that concurrent and closely following callers share (single flight, then reuse).

    ``await shared.get()``: the result of a read (``read()``, an async function) that finished less than
    ``max_age_s`` seconds ago (monotonic ``clock``), else of the read in flight (joined), else of a new one.
    Why: a peer's round asks for the run's membership from several phases and polling loops, and each
    full read of the peer records costs O(N) DHT traffic; callers that ask within ``max_age_s`` of each
    other (or while a read runs) cost one read. ``max_age_s`` = 0: no reuse, concurrent callers still share.

    Errors: an exception of the shared read is raised to every caller waiting on it, and is not kept:
    the next call reads again. The read runs as a task of its own (outside any :class:`TaskScope`, so a
    caller's scope ending does not cancel it under the other callers); a caller cancelled while waiting
    is cancelled alone, and the read with it once no caller waits (a new call then starts a fresh read).
    ``reads``: how many reads were started (for tests and measurements).
    """

    def __init__(
        self, read: Callable[[], Awaitable[T]], max_age_s: float = 0.5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_age_s < 0:
            raise ValueError("max_age_s must be >= 0")
        self._read, self.max_age_s, self._clock = read, max_age_s, clock
        self._value: Optional[Tuple[float, T]] = None  # (clock when the read finished, its result)
        self._inflight: Optional[asyncio.Task] = None
        self._waiters: Dict[asyncio.Future, int] = {}  # read task -> callers waiting on it
        self.reads = 0

    def invalidate(self) -> None:
        """Forget the last result: the next call reads (or joins a read already in flight)."""
        self._value = None

    async def _run(self) -> T:
        try:
            value = await self._read()
            self._value = (self._clock(), value)
            return value
        finally:
            if self._inflight is asyncio.current_task():
                self._inflight = None

    async def get(self) -> T:
        """The shared result (see the class); raises what the shared read raised."""
        got = self._value
        if got is not None and self._clock() - got[0] < self.max_age_s:
            return got[1]
        task = self._inflight
        if task is None:
            self.reads += 1
            task = self._inflight = create_unscoped_task(self._run(), name="shared-read")
        self._waiters[task] = self._waiters.get(task, 0) + 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters[task] == 1 and not task.done():  # the last one waiting: nobody needs the read
                task.cancel()
                if self._inflight is task:
                    self._inflight = None
            raise
        finally:
            left = self._waiters.pop(task) - 1
            if left:
                self._waiters[task] = left
