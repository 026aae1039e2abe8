"""``FetchEngine``: many requests in flight, a bounded buffer, and a plain iterator on top.

The only place with concurrency: an anyio loop in one background thread runs *jobs* (async
functions that ``emit`` items) and hands the items to the synchronous caller through a buffer
bounded by items and bytes, in job order when ``ordered``. A job starts only while the limits
hold, so a slow consumer stops new requests and memory stays bounded by configuration. Every
way an iteration ends stops the loop and joins the thread. This is the thread-safe handle; the
loop side is ``core.EngineCore``. The bound and why: docs/design/engine.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from ..errors import ConfigError
from ..lifecycle import LiveObjects
from ..retry import RetryPolicy
from ..s3 import ObjectStore
from ..s3.blocking import first_error
from .core import AnyJob, EngineCore, Job, JobContext, JobFn, Jobs
from .limits import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_ITEMS,
    DELIVERIES,
    TAKE_BATCH,
    Delivery,
    EngineLimits,
    EngineStats,
)
from .loopthread import LoopThread
from .tuning import TUNING, Tuning

__all__ = [
    "DEFAULT_MAX_INFLIGHT", "DEFAULT_QUEUE_BYTES", "DEFAULT_QUEUE_ITEMS", "DELIVERIES", "Delivery",
    "AnyJob", "EngineLimits", "EngineStats", "FetchEngine", "Job", "JobContext", "JobFn", "Tuning",
    "first_error", "live_engines",
]


class FetchEngine:
    """Runs ``jobs`` with bounded concurrency in a background event loop; iterate for the items.

    ``store_factory`` is awaited inside the loop to create the one store all jobs share; the
    engine closes it. ``tuning``: the start-up heuristics (``tuning.Tuning``; tests pass their
    own). Errors raised by a job reach the consumer (in order, after the items
    emitted before them when ``ordered``); the engine then stops starting new jobs.

    The loop thread holds only the ``EngineCore`` (buffer, counters, tasks), never this handle, so
    dropping the last reference to an engine garbage-collects it and ``__del__`` shuts it down.
    """

    def __init__(
        self,
        jobs: Jobs,
        store_factory: Callable[[], Awaitable[ObjectStore]],
        *,
        limits: EngineLimits | None = None,
        retry: RetryPolicy | None = None,
        name: str = "loader-engine",
        schedule: Iterable[int] | None = None,
        tuning: Tuning = TUNING,
    ) -> None:
        self._loop: LoopThread | None = None
        self._closed = False
        self.limits = limits or EngineLimits()
        self.retry = retry or RetryPolicy()
        if (schedule is None) == (self.limits.delivery == "scheduled"):
            raise ConfigError("a schedule= goes with delivery='scheduled', and only with it")
        self._core = EngineCore(jobs, store_factory, self.limits, self.retry, schedule, tuning)
        self._name = name
        self._pid = os.getpid()
        self._consumer_wait = 0.0

    def __iter__(self) -> Iterator[Any]:
        """Yield items until every job is done; re-raises the first job error in order."""
        self.start()
        assert self._loop is not None  # start() made it
        call, take = self._loop.call, self._core.take
        batch_items = max(1, min(TAKE_BATCH, self.limits.queue_items // 4))  # leave room to fetch into
        held = (0, 0)  # items and bytes of the last batch, released when the next is taken
        try:
            while True:
                started = time.perf_counter()
                batch, held = call(take, batch_items, held)
                self._consumer_wait += time.perf_counter() - started
                if not batch:
                    return
                yield from batch
        finally:
            self.close()

    def start(self) -> None:
        """Start the event-loop thread and the jobs (idempotent)."""
        if self._closed:
            raise RuntimeError("this FetchEngine is closed; build a new one for another pass")
        if self._loop is not None:
            return
        _live.add(self)
        self._loop = LoopThread.start(self._name)
        self._loop.portal.start_task_soon(self._core.main)

    def close(self) -> None:
        """Cancel all jobs, close the store, stop the loop, join the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None and os.getpid() == self._pid:  # else never started, or inherited
            # through fork: that thread is not ours (nor is it running in this process)
            if threading.current_thread() is loop.thread:
                raise RuntimeError("FetchEngine.close() called from its own event-loop thread")
            loop.stop()
        self._core.discard()  # nothing runs it now: the buffer goes with the iterator

    def __enter__(self) -> FetchEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed and self._loop is not None and os.getpid() == self._pid:
            warnings.warn(
                f"unclosed {self!r}; close() it or exhaust the iterator", ResourceWarning, stacklevel=2
            )
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._loop else "not started")
        return f"<FetchEngine {self._name} {state} {self.limits}>"

    def statistics(self) -> EngineStats:
        """Counters for ``dataset.stats()`` and for tests that measure the bounds."""
        counts, tail = self._core.counts, self._core.tail
        return EngineStats(
            jobs_started=counts.launched,
            jobs_done=counts.jobs_done,
            inflight=counts.inflight,
            peak_inflight=counts.peak_inflight,
            buffered_items=counts.buffered_items,
            buffered_bytes=counts.buffered_bytes,
            peak_buffered_bytes=counts.peak_buffered_bytes,
            delivered_items=counts.delivered_items,
            delivered_bytes=counts.delivered_bytes,
            retries=counts.retries,
            consumer_wait_s=self._consumer_wait,
            peak_reserved_bytes=counts.peak_reserved_bytes,
            throttled=tail.throttled if tail else 0,
            hedged=tail.hedged if tail else 0,
            hedges_won=tail.hedges_won if tail else 0,
        )


# --------------------------------------------------------------------- process-wide hygiene


def _disown(engine: FetchEngine) -> None:
    """In a forked child: disown an engine whose loop thread stayed behind in the parent.

    Its portal must never be *called* here (the thread that would answer does not exist in
    this process); dropping it is safe because ``LoopThread`` has no finalizer.
    """
    engine._loop = None
    engine._closed = True


def _close(engine: FetchEngine) -> None:
    engine.close()


_live: LiveObjects[FetchEngine] = LiveObjects(in_child=_disown, at_exit=_close)


def live_engines() -> int:
    """How many engines of this process are still running (for tests and leak checks)."""
    return sum(1 for engine in _live if not engine._closed)
