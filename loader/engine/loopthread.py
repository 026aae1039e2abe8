"""An anyio event loop in a daemon thread, reached through a ``BlockingPortal``.

``start_blocking_portal`` without its generator, whose ``finally`` waits for the loop thread when
garbage-collected: in a forked child that thread does not exist, so freeing an inherited portal
would hang. A plain portal and thread have no finalizer (docs/design/engine.md).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future

import anyio
from anyio.from_thread import BlockingPortal


class LoopThread:
    """A running event loop: ``portal`` to call into it, ``stop()`` to end it and join."""

    __slots__ = ("portal", "thread")

    def __init__(self, portal: BlockingPortal, thread: threading.Thread) -> None:
        self.portal = portal
        self.thread = thread

    @classmethod
    def start(cls, name: str) -> LoopThread:
        """Start the loop thread and wait until its portal answers."""
        ready: Future[BlockingPortal] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:  # noqa: BLE001 - surfaced to start() if the loop never came up
                if not ready.done():
                    ready.set_exception(exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return cls(ready.result(), thread)

    def stop(self) -> None:
        """Cancel whatever still runs in the loop, stop it and join the thread (idempotent)."""
        with contextlib.suppress(RuntimeError):  # already stopped
            self.portal.call(self.portal.stop, True)
        self.thread.join()
