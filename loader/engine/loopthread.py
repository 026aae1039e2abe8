"""An anyio event loop in a daemon thread, reached through a ``BlockingPortal``.

``start_blocking_portal`` without its generator, whose ``finally`` waits for the loop thread when
garbage-collected: in a forked child that thread does not exist, so freeing an inherited portal
would hang. A plain portal and thread have no finalizer (docs/design/engine.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ..lifecycle import join_thread

T = TypeVar("T")


class LoopThread:
    """A running event loop: ``portal`` to call into it, ``stop()`` to end it and join."""

    __slots__ = ("loop", "portal", "thread")

    def __init__(self, portal: BlockingPortal, thread: threading.Thread, loop: asyncio.AbstractEventLoop) -> None:
        self.portal = portal
        self.thread = thread
        self.loop = loop

    @classmethod
    def start(cls, name: str) -> LoopThread:
        """Start the loop thread and wait until its portal answers."""
        ready: Future[tuple[BlockingPortal, asyncio.AbstractEventLoop]] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result((portal, asyncio.get_running_loop()))
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:  # noqa: BLE001 - surfaced to start() if the loop never came up
                if not ready.done():
                    ready.set_exception(exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        portal, loop = ready.result()
        return cls(portal, thread, loop)

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Await ``fn(*args)`` in the loop and return its result, from another thread.

        One hop each way (``asyncio.run_coroutine_threadsafe``): ``BlockingPortal.call`` makes
        the caller wait twice, first until the loop has started an anyio task for the call, then
        for its result (a wake-up of each thread more, and a task with its cancel scope). For
        the engine's hot hand-over; a call still pending when the loop stops is cancelled with
        the loop's other tasks (``concurrent.futures.CancelledError`` here), as the portal's are.
        """
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result()

    def stop(self) -> None:
        """Cancel whatever still runs in the loop, stop it and join the thread (idempotent)."""
        with contextlib.suppress(RuntimeError):  # already stopped
            self.portal.call(self.portal.stop, True)
        join_thread(self.thread)  # until the OS has it gone: a fork may come next
