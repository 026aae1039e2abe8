"""Run a store call from synchronous code: a short-lived event loop in a helper thread.

That works from plain scripts, notebooks (which already run a loop in the main thread) and
DataLoader workers alike, and leaves no thread behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from anyio.from_thread import start_blocking_portal

from .protocol import ObjectStore

T = TypeVar("T")


def run_async(fn: Callable[[], Awaitable[T]], meanwhile: Callable[[], object] | None = None) -> T:
    """Run one coroutine function to completion on a fresh loop in a helper thread.

    ``meanwhile``: work for the calling thread while the loop runs ``fn`` (a listing's pages
    are mostly waits on the server); an error it raises cancels ``fn``.
    """
    with start_blocking_portal(name="loader-oneshot") as portal:
        if meanwhile is None:
            return portal.call(fn)
        running = portal.start_task_soon(fn)
        meanwhile()
        return running.result()


async def with_store(
    factory: Callable[[], Awaitable[ObjectStore]], use: Callable[[ObjectStore], Awaitable[T]]
) -> T:
    """Open a store, run ``use(store)``, always close it."""
    store = await factory()
    try:
        return await use(store)
    finally:
        await store.aclose()

