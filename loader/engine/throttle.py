"""``ThrottledStore``: reads that take their turn under a rate limit, which SlowDown answers set.

Every engine's reads pass through one (below its ``HedgedStore``, so hedges take their turn too);
the state it consults, a ``ThrottleControl``, is one per endpoint and bucket in a process, shared
by all of that process's engines (each runs its own loop thread, hence the lock), because S3
throttles per prefix whoever sends.

Throttling (``ThrottledError``: SlowDown, 503, 429): retrying alone turns a throttle into a storm
(measured: 54 % of GETs answered SlowDown). A throttle shows as a share of SlowDowns that grows
with the rate sent; a server's hiccups show as a few SlowDowns at any rate, which sending less
would not spare. So the first cut needs ``CUT_COUNT`` SlowDowns making ``CUT_SHARE`` of the last
answers (at most ``CUT_WINDOW``, within ``RATE_WINDOW``), or ``STORM_COUNT`` before any good answer
(a job's first requests, all sent at once, meeting a throttle). Once limited, another cut needs
``CUT_AGAIN_COUNT`` and ``CUT_AGAIN_SHARE`` of the answers since the previous cut, which must be
``CUT_AGAIN_AFTER`` old. A cut sets a client-side rate limit at ``THROTTLE_CUT`` times the rate sent
over the last ``RATE_WINDOW`` (the first) or the rate of good answers (the next). Every good answer
grows the limit by ``GROWTH`` requests/s while the limit is in use; after ``UNLIMIT_AFTER`` seconds
without a cut the limit goes away. Requests waiting for their turn when a cut comes wait again at
the new rate. Why and the numbers: docs/design/retry.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, NamedTuple, TypeVar

import anyio

from ..errors import ThrottledError
from ..s3 import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, Pin

T = TypeVar("T")
C = TypeVar("C")

THROTTLE_CUT = 0.7  # a cut sets the limit to this share of the good answers' rate
CUT_COUNT = 8  # SlowDowns, at least, for the first cut ...
CUT_SHARE = 0.2  # ... making at least this share of the answers since ...
STORM_COUNT = 4  # ... or this many before any good answer (a job's first requests meeting a throttle) ...
CUT_AGAIN_COUNT = 5  # ... and for another cut, once limited (a throttle once met is watched closer) ...
CUT_AGAIN_SHARE = 0.1  # ... at least this share
CUT_WINDOW = 100  # ... (the last this many at most, within RATE_WINDOW)
CUT_AGAIN_AFTER = 0.1  # seconds: cuts at most this often (answers to requests sent before the cut come after it)
GROWTH = 0.3  # requests/s added to the limit per good answer (about 30 % a second at any rate)
MIN_RATE = 1.0  # requests/s: the limit never goes below this
UNLIMIT_AFTER = 30.0  # seconds without a cut before the limit is lifted
RATE_WINDOW = 1.0  # seconds over which the rate of good answers and the share of SlowDowns are measured


class ThrottleStats(NamedTuple):
    """One control's counters (approximately consistent: read without the lock)."""

    requests: int
    throttled: int
    rate_limit: float | None  # requests/s allowed now; None: no limit


class ThrottleControl:
    """The shared rate limit for one endpoint and bucket in this process (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.rate: float | None = None
        self.next_free = 0.0  # when the next request may go, under a limit
        self.generation = 0  # bumped by every cut: waiters take a new turn
        self.last_cut = -float("inf")
        self.unsettled_until = -float("inf")  # SlowDowns were a share of the answers: a throttle may be forming
        self.seen_good = False
        # since the last cut, within RATE_WINDOW: (when, whether a SlowDown)
        self.outcomes: deque[tuple[float, bool]] = deque(maxlen=CUT_WINDOW)
        self.answered: deque[float] = deque()  # good answers' times within the last RATE_WINDOW
        self.sent: deque[float] = deque()  # send times within the last RATE_WINDOW, until the first cut
        self.requests = 0
        self.throttled = 0

    def turn(self) -> tuple[float, int]:
        """Book the next request: seconds to wait before sending it, and the generation booked in."""
        with self.lock:
            now = self.clock()
            self.requests += 1
            if self.rate is None:
                sent = self.sent
                sent.append(now)
                if sent[0] < now - RATE_WINDOW:
                    sent.popleft()  # one in, (at most) one out: trimmed fully where it is read
                return 0.0, self.generation
            if now - self.last_cut > UNLIMIT_AFTER:
                self.rate = None
                return 0.0, self.generation
            start = max(now, self.next_free)
            self.next_free = start + 1.0 / self.rate
            return start - now, self.generation

    async def acquire(self) -> None:
        """Wait for this request's turn under the rate limit (at once when there is none)."""
        while True:
            wait, generation = self.turn()
            if wait <= 0:
                return
            await anyio.sleep(wait)
            if generation == self.generation:
                return
            with self.lock:  # a cut came while waiting: book again at the new rate
                self.requests -= 1

    def congested(self) -> bool:
        """Whether a second request for the same object would add to a throttle: limited, or
        SlowDowns made a share of the recent answers."""
        return self.rate is not None or self.clock() < self.unsettled_until

    def on_throttled(self) -> None:
        """A SlowDown: cut the rate when SlowDowns are a share of the recent answers."""
        with self.lock:
            self.throttled += 1
            now = self.clock()
            outcomes = self.outcomes
            outcomes.append((now, True))
            if now - self.last_cut < CUT_AGAIN_AFTER:
                return
            while outcomes[0][0] < now - RATE_WINDOW:
                outcomes.popleft()
            slowdowns = sum(throttled for _, throttled in outcomes)
            if slowdowns >= CUT_AGAIN_SHARE * len(outcomes):  # a throttle may be forming
                self.unsettled_until = now + RATE_WINDOW
            if self.rate is None:
                storm = not self.seen_good and slowdowns >= STORM_COUNT  # no good answer yet
                if not storm and (slowdowns < CUT_COUNT or slowdowns < CUT_SHARE * len(outcomes)):
                    return
            elif slowdowns < CUT_AGAIN_COUNT or slowdowns < CUT_AGAIN_SHARE * len(outcomes):
                return
            accepted = _rate_within(self.answered, now)
            if self.rate is None:
                base = _rate_within(self.sent, now)
                self.sent.clear()
            else:
                base = min(self.rate, accepted)
            self.rate = max(MIN_RATE, THROTTLE_CUT * base)
            self.next_free = now + 1.0 / self.rate
            self.last_cut = now
            outcomes.clear()
            self.generation += 1

    def on_answer(self) -> None:
        """A good answer: grow the limit while it holds requests back."""
        with self.lock:
            now = self.clock()
            self.seen_good = True
            self.outcomes.append((now, False))
            answered = self.answered
            answered.append(now)
            if answered[0] < now - RATE_WINDOW:
                answered.popleft()  # one in, (at most) one out: the window stays trimmed cheaply
            if self.rate is not None and self.next_free >= now:
                self.rate += GROWTH  # only while the limit holds requests back: unused, it would run away

    def statistics(self) -> ThrottleStats:
        return ThrottleStats(self.requests, self.throttled, self.rate)


def _rate_within(times: deque[float], now: float) -> float:
    """Events per second over the last ``RATE_WINDOW``, from their times (older ones dropped)."""
    while times and times[0] < now - RATE_WINDOW:
        times.popleft()
    return len(times) / RATE_WINDOW


class SharedControls(Generic[C]):
    """A process's controls by (endpoint, bucket), made by ``factory``; a forked child starts with none."""

    def __init__(self, factory: Callable[[], C]) -> None:
        self.factory = factory
        self.pid = os.getpid()
        self.by_key: dict[tuple[str, str], C] = {}
        self.lock = threading.Lock()

    def get(self, endpoint: str, bucket: str) -> C:
        if self.pid != os.getpid():  # forked: the parent's locks and counts are not ours
            self.pid, self.by_key, self.lock = os.getpid(), {}, threading.Lock()
        control = self.by_key.get((endpoint, bucket))
        if control is None:
            with self.lock:
                control = self.by_key.setdefault((endpoint, bucket), self.factory())
        return control


CONTROLS: SharedControls[ThrottleControl] = SharedControls(ThrottleControl)


def control_for(endpoint: str, bucket: str) -> ThrottleControl:
    """The rate limit this process shares for ``bucket`` at ``endpoint``."""
    return CONTROLS.get(endpoint, bucket)


def endpoint_of(store: Any) -> str:
    """The endpoint a store (or the store a wrapper holds) talks to, or its type's name."""
    seen = 0
    while store is not None and seen < 8:
        endpoint = getattr(store, "_endpoint", None)
        if isinstance(endpoint, str):
            return endpoint
        store = getattr(store, "inner", None) or getattr(store, "_inner", None)
        seen += 1
    return f"store:{type(store).__name__}"


class ReadWrapper:
    """A store wrapper whose whole-body reads (``get``, ``get_range``, ``get_if_changed``) pass
    through ``_read(bucket, call)``; everything else goes to ``inner`` as it is. The throttle and
    the hedging wrappers differ only in ``_read`` (and in how they stream)."""

    inner: ObjectStore

    def __getattr__(self, name: str) -> Any:  # list_pages, multipart, hedged_by_engine, ...: the inner store's
        return getattr(self.inner, name)

    async def _read(self, bucket: str, call: Callable[[], Awaitable[T]]) -> T:
        raise NotImplementedError

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(bucket, prefix)

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        return await self._read(bucket, lambda: self.inner.get(bucket, key, pin=pin))

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        return await self._read(bucket, lambda: self.inner.get_range(bucket, key, start, end, pin=pin))

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        return await self._read(
            bucket, lambda: self.inner.get_if_changed(bucket, key, etag, start, end, pin=pin))

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        await self.inner.put(bucket, key, data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ThrottledStore(ReadWrapper):
    """An ``ObjectStore`` whose reads (``get``, ``get_range``, ``get_if_changed``, ``stream``) wait
    for their turn under the shared ``ThrottleControl`` of their bucket and report how they were
    answered; everything else passes through. Counts its own SlowDowns (``throttled``) for ``stats()``."""

    def __init__(self, inner: ObjectStore, endpoint: str | None = None) -> None:
        self.inner = inner
        self.endpoint = endpoint or endpoint_of(inner)
        self.controls: dict[str, ThrottleControl] = {}
        self.throttled = 0

    def control(self, bucket: str) -> ThrottleControl:
        control = self.controls.get(bucket)
        if control is None:
            control = self.controls[bucket] = control_for(self.endpoint, bucket)
        return control

    def congested(self, bucket: str) -> bool:
        """Whether a hedge for ``bucket`` would add to a throttle (``HedgedStore`` asks)."""
        return self.control(bucket).congested()

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None,
    ) -> AsyncGenerator[bytes, None]:
        control = self.control(bucket)
        await control.acquire()
        chunks = self.inner.stream(bucket, key, start, chunk_size, pin=pin)
        first = True
        try:
            async for chunk in chunks:
                if first:
                    control.on_answer()
                    first = False
                yield chunk
        except ThrottledError:
            self.throttled += 1
            control.on_throttled()
            raise
        finally:
            await chunks.aclose()

    def __repr__(self) -> str:
        return f"ThrottledStore({self.inner!r})"

    async def _read(self, bucket: str, call: Callable[[], Awaitable[T]]) -> T:
        control = self.control(bucket)
        await control.acquire()
        try:
            result = await call()
        except ThrottledError:
            self.throttled += 1
            control.on_throttled()
            raise
        control.on_answer()
        return result
