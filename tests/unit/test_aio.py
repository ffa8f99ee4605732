"""geomesh_p2p.util.aio.TaskScope: every task created inside a scope (and by those tasks) is recorded, and on
exit handed to ``adopt`` or cancelled and awaited; the loop's task factory it installs delegates to the
one already there and records nothing outside scopes."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from geomesh_p2p.util.aio import TaskScope, cancel_and_wait, create_unscoped_task, runs
from geomesh_p2p.net.transport import TaskOwner

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def restore_factory():
    """Put back the loop's task factory a test replaced (the loop may outlive the test)."""
    loop = asyncio.get_running_loop()
    before = loop.get_task_factory()
    yield loop
    loop.set_task_factory(before)


async def _forever(started: asyncio.Event | None = None) -> None:
    if started is not None:
        started.set()
    await asyncio.Event().wait()


async def test_tasks_created_by_scope_tasks_are_recorded_and_cancelled_on_exit():
    made: list = []
    ready = asyncio.Event()

    async def grandchild():
        ready.set()
        await asyncio.Event().wait()

    async def child():
        made.append(asyncio.create_task(grandchild()))
        await asyncio.Event().wait()

    before = asyncio.all_tasks()
    async with TaskScope() as scope:
        made.append(asyncio.ensure_future(child()))
        await ready.wait()
        assert scope.tasks == set(made) and len(made) == 2
    assert all(t.cancelled() for t in made)
    assert asyncio.all_tasks() - before == set()
    assert scope.tasks == set()  # closed: nothing kept referenced


async def test_tasks_outside_the_scope_are_not_recorded():
    started = asyncio.Event()
    outside: list = []
    gate = asyncio.Event()

    async def elsewhere():  # another task, created before the scope: its context has no scope
        await gate.wait()
        outside.append(asyncio.create_task(asyncio.sleep(0)))

    other = asyncio.create_task(elsewhere())
    async with TaskScope() as scope:
        inside = asyncio.create_task(_forever(started))
        await started.wait()
        gate.set()
        await other
        assert scope.tasks == {inside}
    after = asyncio.create_task(asyncio.sleep(0))  # the body's context again: no scope
    await asyncio.gather(after, *outside)
    assert inside.cancelled() and scope.tasks == set()


async def test_normal_exit_adopts_kept_tasks_and_their_children_and_ends_the_rest():
    adopted: list = []
    release = asyncio.Event()
    waiting = asyncio.Event()

    async def call():  # a "kept" kind (an RPC call in flight)
        inner = asyncio.create_task(release.wait())  # created by a kept task: adopted with it
        await inner
        return "reply"

    async def waiter():
        waiting.set()
        await asyncio.Event().wait()

    before = asyncio.all_tasks()
    async with TaskScope(adopt=adopted.append, keep=runs(call)):
        c = asyncio.create_task(call())
        w = asyncio.create_task(waiter())
        await waiting.wait()
    assert len(adopted) == 1
    (handed,) = adopted
    assert c in handed and len(handed) == 2 and not any(t.done() for t in handed)
    assert w.cancelled()
    assert asyncio.all_tasks() - before == handed
    release.set()
    assert await c == "reply"
    await asyncio.gather(*handed)


async def test_exit_by_exception_cancels_kept_tasks_too_and_propagates():
    adopted: list = []
    started = asyncio.Event()
    with pytest.raises(ValueError, match="boom"):
        async with TaskScope(adopt=adopted.append, keep=runs(_forever)):
            t = asyncio.create_task(_forever(started))
            await started.wait()
            raise ValueError("boom")
    assert adopted == [] and t.cancelled()


async def test_exit_on_cancel_awaits_the_tasks_ending():
    started = asyncio.Event()
    entered_cleanup = asyncio.Event()
    may_finish = asyncio.Event()
    ended: list = []

    async def slow_to_end():
        try:
            started.set()
            await asyncio.Event().wait()
        finally:  # cleanup that itself awaits (closing a call)
            entered_cleanup.set()
            await may_finish.wait()
            ended.append(True)

    children: list = []

    async def body():
        async with TaskScope():
            children.append(asyncio.create_task(slow_to_end()))
            await asyncio.Event().wait()

    outer = asyncio.create_task(body())
    await started.wait()
    outer.cancel()
    await entered_cleanup.wait()
    assert not outer.done()  # the scope waits for its task to end
    outer.cancel()  # cancelled again meanwhile: the cleanup still completes
    await asyncio.sleep(0)
    assert not outer.done()
    may_finish.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended == [True] and children[0].cancelled()


async def test_tasks_made_while_ending_are_ended_too():
    made: list = []
    started = asyncio.Event()

    async def spawns_on_cancel():
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            made.append(asyncio.create_task(_forever()))

    before = asyncio.all_tasks()
    async with TaskScope():
        spawner = asyncio.create_task(spawns_on_cancel())
        await started.wait()
    assert spawner.cancelled() and len(made) == 1 and made[0].cancelled()
    assert asyncio.all_tasks() - before == set()


async def test_the_factory_already_installed_is_delegated_to_and_put_back(restore_factory):
    loop = restore_factory
    seen: list = []

    def theirs(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        seen.append(task)
        return task

    loop.set_task_factory(theirs)
    async with TaskScope() as scope:
        t = asyncio.create_task(_forever(), name="in-scope")
        await asyncio.sleep(0)
        assert scope.tasks == {t}
    assert seen == [t] and t.get_name() == "in-scope" and t.cancelled()
    assert loop.get_task_factory() is theirs
    outside = asyncio.create_task(asyncio.sleep(0), name="outside")
    await outside
    assert seen == [t, outside] and outside.get_name() == "outside"

    # A factory set over ours while a scope is open: ours stays under it (inert), the next scope wraps it.
    async with TaskScope():
        loop.set_task_factory(theirs)
    assert loop.get_task_factory() is theirs
    async with TaskScope() as scope2:
        t2 = asyncio.create_task(_forever())
        assert scope2.tasks == {t2}
    assert seen[-1] is t2 and t2.cancelled()


async def test_the_factory_is_installed_while_scopes_are_open_and_removed_after():
    loop = asyncio.get_running_loop()
    before = loop.get_task_factory()
    inner_open = asyncio.Event()
    outer_may_close = asyncio.Event()

    async def other_scope():  # a concurrent lookup in another task
        async with TaskScope():
            inner_open.set()
            await outer_may_close.wait()

    other = asyncio.create_task(other_scope())
    await inner_open.wait()
    factory = loop.get_task_factory()
    assert factory is not before
    async with TaskScope():
        async with TaskScope():
            assert loop.get_task_factory() is factory  # once for all open scopes
    assert loop.get_task_factory() is factory  # the other task's scope is still open
    outer_may_close.set()
    await other
    assert loop.get_task_factory() is before  # the last one out put it back: nothing to pay outside
    # Outside scopes a task is the loop's own, in the creator's context, named as asked.
    var = contextvars.ContextVar("probe")
    var.set("here")

    async def read():
        return var.get()

    t = asyncio.create_task(read(), name="plain")
    assert type(t) is asyncio.Task and t.get_name() == "plain"
    assert await t == "here"


async def test_a_task_created_with_a_context_of_the_scope_is_recorded():
    captured: list = []
    go = asyncio.Event()
    made: list = []

    async def helper():  # runs outside the scope, creates a task in the scope's context
        await go.wait()
        made.append(asyncio.get_running_loop().create_task(_forever(), context=captured[0]))

    h = asyncio.create_task(helper())
    async with TaskScope() as scope:
        captured.append(contextvars.copy_context())
        go.set()
        await h
        assert scope.tasks == set(made) and len(made) == 1
    assert made[0].cancelled()


async def test_nested_scopes_record_in_the_innermost():
    async with TaskScope() as outer:
        a = asyncio.create_task(_forever())
        async with TaskScope() as inner:
            b = asyncio.create_task(_forever())
            assert inner.tasks == {b}
        assert b.cancelled() and not a.done()
        c = asyncio.create_task(_forever())
        assert outer.tasks == {a, c}
    assert a.cancelled() and c.cancelled()


async def test_a_scope_is_entered_once():
    scope = TaskScope()
    async with scope:
        pass
    with pytest.raises(RuntimeError):
        async with scope:
            pass


async def test_runs_matches_tasks_of_that_function_only():
    async def f():
        await asyncio.sleep(0)

    async def g():
        await asyncio.sleep(0)

    tf, tg = asyncio.create_task(f()), asyncio.create_task(g())
    pred = runs(f)
    assert pred(tf) and not pred(tg) and not pred(asyncio.get_running_loop().create_future())
    await asyncio.gather(tf, tg)


async def test_tasks_with_an_owner_of_their_own_are_left_to_it():
    owner = TaskOwner("test")
    made: list = []
    started = asyncio.Event()

    async def owned():  # e.g. a routing-table ping spawned on the node during a lookup
        made.append(asyncio.create_task(_forever()))  # its children are not the scope's either
        started.set()
        await asyncio.Event().wait()

    try:
        with pytest.raises(asyncio.CancelledError):
            async with TaskScope() as scope:
                a = owner.spawn(owned(), name="owned")
                b = create_unscoped_task(_forever(), name="unscoped")
                await started.wait()
                assert scope.tasks == set() and b.get_name() == "unscoped"
                raise asyncio.CancelledError  # even a cancelled scope leaves them running
        assert not a.done() and not b.done() and not made[0].done()
    finally:
        await owner.close()
        await cancel_and_wait([b, *made])
    assert a.cancelled()
