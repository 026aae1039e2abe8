"""Run a store call from synchronous code: a short-lived event loop in a helper thread.

That works from plain scripts, notebooks (which already run a loop in the main thread) and
DataLoader workers alike, and leaves no thread behind.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from anyio.from_thread import start_blocking_portal

from .protocol import ObjectStore

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")


def run_async(fn: Callable[[], Awaitable[T]], meanwhile: Callable[[], object] | None = None) -> T:
    """Run one coroutine function to completion on a fresh loop in a helper thread.

    ``meanwhile``: work for the calling thread while the loop runs ``fn`` (a listing's pages
    are mostly waits on the server); an error it raises cancels ``fn``.
    """
    try:
        with start_blocking_portal(name="loader-oneshot") as portal:
            if meanwhile is None:
                return portal.call(fn)
            running = portal.start_task_soon(fn)
            meanwhile()
            return running.result()
    except BaseException as exc:
        # The portal's frame that set the error on its future still holds that future, and is in
        # the error's traceback: a cycle, which kept every frame the error then passed through,
        # and their callers, until a garbage collection (a caller that catches it, as the shard
        # index lookup does a NoSuchKey, in a DataLoader's fork hook: the iterator that was
        # forking, whose finalizer torch then runs in that collection, 5 s a worker). The frames
        # below this one are done: their locals go, their lines stay in the traceback.
        traceback.clear_frames(exc.__traceback__)
        raise


async def with_store(
    factory: Callable[[], Awaitable[ObjectStore]], use: Callable[[ObjectStore], Awaitable[T]]
) -> T:
    """Open a store, run ``use(store)``, always close it. An error of a task group in ``use``
    is raised as itself (the first that is not a cancellation), never as the group: callers
    and users want our error, and a group does not survive the pickling into DataLoader workers."""
    store = await factory()
    try:
        return await use(store)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    finally:
        await store.aclose()


def first_error(group: BaseException) -> BaseException:
    """The error that made a task group fail: its first leaf that is not a cancellation (the
    others are mostly the cancellations it caused); its own traceback stays attached."""
    # a loop, not a recursive inner function: that would be a cycle (the function in its own
    # closure) holding the leaves, and through their tracebacks every frame they passed
    leaves: list[BaseException] = []
    pending = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(reversed(exc.exceptions))
        else:
            leaves.append(exc)
    cancelled = anyio.get_cancelled_exc_class()
    return next((leaf for leaf in leaves if not isinstance(leaf, cancelled)), leaves[0] if leaves else group)
