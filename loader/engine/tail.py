"""The tail of real S3, met in the engine: stragglers hedged, throttling answered with fewer requests.

Every engine wraps its store in a ``TailStore``; the state it consults, a ``TailControl``, is
one per endpoint and bucket in a process, shared by all of that process's engines (each runs its
own loop thread, hence the lock), because S3 throttles per prefix whoever sends.

* **Throttling** (``ThrottledError``: SlowDown, 503, 429). Retrying alone turns a throttle into a
  storm (measured: 54 % of GETs answered SlowDown). A throttle shows as a share of SlowDowns that
  grows with the rate sent; a server's hiccups show as a few SlowDowns at any rate, which sending
  less would not spare. So the first cut needs ``CUT_COUNT`` SlowDowns making ``CUT_SHARE`` of
  the last answers (at most ``CUT_WINDOW``, within ``RATE_WINDOW``), or ``STORM_COUNT`` before any
  good answer (a job's first requests, all sent at once, meeting a throttle): a stalled moment's
  few answers, mostly retries, never make either, and 5 % of SlowDowns at random seldom do.
  Once limited, a throttle is watched closer: another cut needs ``CUT_AGAIN_COUNT`` and
  ``CUT_AGAIN_SHARE`` of the answers since the previous cut, which must be ``CUT_AGAIN_AFTER``
  old. A cut sets a client-side rate limit at ``THROTTLE_CUT`` times the rate sent over the last
  ``RATE_WINDOW`` (the first) or the rate of good answers, what the server took (the next).
  Every good answer grows the limit by ``GROWTH`` requests/s while the limit is in use (a request
  booked within ``1/limit`` seconds): multiplicative decrease, additive increase, as the AWS SDKs'
  adaptive retry mode does with a token bucket. After ``UNLIMIT_AFTER`` seconds without a cut the
  limit goes away. Requests waiting for their turn when a cut comes wait again at the new rate.
* **Stragglers.** AWS advises retrying a request that is slower than its usual latency rather than
  waiting. A GET with no answer after ``hedge_after()`` (``HEDGE_MARGIN`` times the 95th percentile
  of this control's last answers, at least ``HEDGE_FLOOR``; ``HEDGE_AT_FIRST`` until enough are known) is sent
  again, and once more a threshold later if neither has answered (a hedge straggles as often as
  any request: with one hedge, one epoch in ten of the benchmark waited out a straggler); the first
  answer wins and the others are cancelled (their bytes were never handed over, so they are
  counted once). A hedge takes the next place among the engine's requests in flight: reads give
  way to it. At most ``HEDGE_SHARE`` of requests (plus a small burst) are hedged,
  and none while throttled or for ``RATE_WINDOW`` after SlowDowns made ``CUT_AGAIN_SHARE`` of the
  last answers (a throttle's first moments, before its cut). One watcher task per engine
  (``TailStore.watch``) sends the hedges.

Hand-written: no asyncio library offers hedged requests or an adaptive rate limiter shared across
event loops. Why and the numbers: docs/design/retry.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import anyio

from ..errors import ThrottledError
from ..s3 import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, Pin

T = TypeVar("T")

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
HEDGE_FLOOR = 0.05  # seconds: never hedge sooner than this
HEDGE_AT_FIRST = 0.3  # seconds: the threshold until HEDGE_MIN_SAMPLES answers have been seen
HEDGE_QUANTILE = 0.95
HEDGE_MARGIN = 1.0  # hedge after this many times the quantile (2.0 hedged stragglers later: bench/results)
HEDGE_SHARE = 0.05  # at most this share of requests is hedged ...
HEDGE_BURST = 8  # ... plus this many
HEDGES_PER_READ = 2  # a hedge may straggle too (as often as any request): then another is sent
HEDGE_MIN_SAMPLES = 32  # answers seen before any request is hedged
LATENCY_WINDOW = 512  # answers the threshold is computed from
RECOMPUTE_EVERY = 64  # answers between two computations of the threshold


class TailStats(NamedTuple):
    """One control's counters (approximately consistent: read without the lock)."""

    requests: int
    throttled: int
    hedged: int
    hedges_won: int
    rate_limit: float | None  # requests/s allowed now; None: no limit
    hedge_after_s: float | None  # the current hedging threshold; None: not hedging yet


class TailControl:
    """The shared state for one endpoint and bucket in this process (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.rate: float | None = None
        self.next_free = 0.0  # when the next request may go, under a limit
        self.generation = 0  # bumped by every cut: waiters take a new turn
        self.last_cut = -float("inf")
        self.hedge_pause_until = -float("inf")  # SlowDowns were a share of the answers: no hedge till then
        # since the last cut, within RATE_WINDOW: (when, whether a SlowDown)
        self.outcomes: deque[tuple[float, bool]] = deque(maxlen=CUT_WINDOW)
        self.answered: deque[float] = deque()  # good answers' times within the last RATE_WINDOW
        self.sent: deque[float] = deque()  # send times within the last RATE_WINDOW, until the first cut
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.threshold: float | None = None
        self.since_recompute = 0
        self.requests = 0
        self.throttled = 0
        self.hedged = 0
        self.hedges_queued = 0  # hedges decided, not yet sent (they count against the budget)
        self.hedges_won = 0

    # -------------------------------------------------------------------- rate

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

    def on_throttled(self) -> None:
        """A SlowDown: cut the rate when SlowDowns are a share of the recent answers (see the
        module docstring): a throttle is met within a few answers, while SlowDowns sprinkled at
        any rate (a server's hiccups) leave the rate alone instead of cutting it to nothing."""
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
                self.hedge_pause_until = now + RATE_WINDOW
            if self.rate is None:
                storm = not self.latencies and slowdowns >= STORM_COUNT  # no good answer yet
                if not storm and (slowdowns < CUT_COUNT or slowdowns < CUT_SHARE * len(outcomes)):
                    return
            elif slowdowns < CUT_AGAIN_COUNT or slowdowns < CUT_AGAIN_SHARE * len(outcomes):
                return
            accepted = self._accepted_rate(now)
            if self.rate is None:
                base = self._sent_rate(now)
                self.sent.clear()
            else:
                base = min(self.rate, accepted)
            self.rate = max(MIN_RATE, THROTTLE_CUT * base)
            self.next_free = now + 1.0 / self.rate
            self.last_cut = now
            outcomes.clear()
            self.generation += 1

    def _accepted_rate(self, now: float) -> float:
        """Good answers per second over the last ``RATE_WINDOW`` (called under the lock)."""
        return _rate_within(self.answered, now)

    def _sent_rate(self, now: float) -> float:
        """Requests sent per second over the last ``RATE_WINDOW``, for the first cut: a job's first
        moments count less than a second's worth (on the safe side), and a throttle met at once
        is met by the requests of those moments, where good answers' count would be the burst a
        server lets through at first (S3 does; the fault proxy's throttle too)."""
        return _rate_within(self.sent, now)

    def on_answer(self, seconds: float) -> None:
        """A good answer after ``seconds``: grow the limit, learn the latency."""
        with self.lock:
            now = self.clock()
            self.outcomes.append((now, False))
            answered = self.answered
            answered.append(now)
            if answered[0] < now - RATE_WINDOW:
                answered.popleft()  # one in, (at most) one out: the window stays trimmed cheaply
            if self.rate is not None and self.next_free >= now:
                self.rate += GROWTH  # only while the limit holds requests back: unused, it would run away
            self.latencies.append(seconds)
            self.since_recompute += 1
            if self.since_recompute >= RECOMPUTE_EVERY or (
                self.threshold is None and len(self.latencies) >= HEDGE_MIN_SAMPLES
            ):
                self.since_recompute = 0
                ordered = sorted(self.latencies)
                quantile = ordered[int(HEDGE_QUANTILE * (len(ordered) - 1))]
                self.threshold = max(HEDGE_FLOOR, HEDGE_MARGIN * quantile)

    # -------------------------------------------------------------------- hedging

    def hedging_paused(self) -> bool:
        """Whether no hedge may go now: throttled, or maybe about to be (a second request
        would add to the storm)."""
        return self.rate is not None or self.clock() < self.hedge_pause_until

    def hedge_after(self) -> float | None:
        """Seconds after which a request still unanswered is hedged; None: do not hedge it."""
        if self.hedging_paused():
            return None
        return HEDGE_AT_FIRST if self.threshold is None else self.threshold

    def reserve_hedge(self) -> bool:
        """Take a place for one more hedge in the budget, if one is left: hedges waiting to be
        sent count as well as those sent (``hedged`` counts a hedge once it is sent; the watcher
        may decide many at once while the engine's places are all taken)."""
        with self.lock:
            if (self.hedging_paused()
                    or self.hedged + self.hedges_queued + 1 > HEDGE_SHARE * self.requests + HEDGE_BURST):
                return False
            self.hedges_queued += 1
            return True

    def statistics(self) -> TailStats:
        return TailStats(self.requests, self.throttled, self.hedged, self.hedges_won, self.rate,
                         self.threshold)


def _rate_within(times: deque[float], now: float) -> float:
    """Events per second over the last ``RATE_WINDOW``, from their times (older ones dropped)."""
    while times and times[0] < now - RATE_WINDOW:
        times.popleft()
    return len(times) / RATE_WINDOW


class _Controls:
    """The process's controls by (endpoint, bucket); a forked child starts with none."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.by_key: dict[tuple[str, str], TailControl] = {}
        self.lock = threading.Lock()

    def get(self, endpoint: str, bucket: str) -> TailControl:
        if self.pid != os.getpid():  # forked: the parent's locks and counts are not ours
            self.__init__()  # type: ignore[misc]
        control = self.by_key.get((endpoint, bucket))
        if control is None:
            with self.lock:
                control = self.by_key.setdefault((endpoint, bucket), TailControl())
        return control


CONTROLS = _Controls()


def control_for(endpoint: str, bucket: str) -> TailControl:
    """The control this process shares for ``bucket`` at ``endpoint``."""
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


class _Pending:
    """One read in flight that may be hedged: when it began, how to send it again, and the
    cancel scope that a winning hedge cancels it through."""

    __slots__ = ("started", "after", "call", "scope", "control", "hedges", "result")

    def __init__(self, started: float, after: float, call: Callable[[], Awaitable[Any]],
                 scope: anyio.CancelScope, control: TailControl) -> None:
        self.started = started
        self.after = after
        self.call = call
        self.scope = scope
        self.control = control
        self.hedges: list[anyio.CancelScope] = []  # the hedges' scopes, as they are sent
        self.result: tuple[Any] | None = None  # the hedge's answer, if it won


class TailStore:
    """An ``ObjectStore`` that reads through the shared ``TailControl`` of each bucket: whole-body
    reads (``get``, ``get_range``, ``get_if_changed``) wait for their turn under a rate limit and
    are hedged when they straggle; streams wait for their turn; everything else passes through.

    A hedge is sent only when fewer than ``max_requests`` of this store's reads are in flight
    (the engine's ``max_inflight``), taking the next place that frees up ahead of the engine's
    next read; the reads of jobs already started are not held back, so while hedges are out the
    count may pass ``max_requests`` by at most their number (the hedging budget bounds it).
    Counts its own engine's share (``throttled``, ``hedged``, ``hedges_won``) for ``stats()``."""

    def __init__(self, inner: ObjectStore, endpoint: str | None = None, *,
                 max_requests: int | None = None) -> None:
        self.inner = inner
        self.max_requests = max_requests
        self.inflight = 0
        self.hedges_waiting = 0  # hedges waiting for a place: reads give way to them
        self.freed: anyio.Event | None = None  # set when a place frees up, for those waiting
        self.pending: set[_Pending] = set()  # reads that may be hedged, while in flight
        self.watching = False  # whether ``watch`` runs (else nothing is hedged)
        # a store may say its reads are not to be hedged (the disk cache: a hedged miss would
        # fill one entry twice); throttling still applies to them
        self.hedges = bool(getattr(inner, "hedged_by_engine", True))
        self.endpoint = endpoint or endpoint_of(inner)
        self.controls: dict[str, TailControl] = {}
        self.throttled = 0
        self.hedged = 0
        self.hedges_won = 0

    def __getattr__(self, name: str) -> Any:  # list_pages, multipart, ...: the inner store's
        return getattr(self.inner, name)

    def control(self, bucket: str) -> TailControl:
        control = self.controls.get(bucket)
        if control is None:
            control = self.controls[bucket] = control_for(self.endpoint, bucket)
        return control

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

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None,
    ) -> AsyncGenerator[bytes, None]:
        control = self.control(bucket)
        await control.acquire()
        chunks = self.inner.stream(bucket, key, start, chunk_size, pin=pin)
        try:
            async for chunk in chunks:
                yield chunk
        except ThrottledError:
            self._throttled(control)
            raise
        finally:
            await chunks.aclose()

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        await self.inner.put(bucket, key, data)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __repr__(self) -> str:
        return f"TailStore({self.inner!r})"

    # ------------------------------------------------------------------------------------------

    async def enter(self, hedge: bool = False) -> None:
        """Count a read in flight. A hedge first waits for a place among ``max_requests``; the
        reads jobs ask for are already bounded by the engine (whose jobs may send several at
        once: the objects of one sample), but give way to a waiting hedge: the engine keeps
        ``max_requests`` in flight while its buffer has room, so a hedge that only took a
        place left free would wait for the epoch's end, and the straggler with it."""
        limit = self.max_requests
        if limit is None:
            self.inflight += 1
            return
        if hedge:
            self.hedges_waiting += 1
            try:
                while self.inflight >= limit:
                    await self._wait_freed()
            finally:
                self.hedges_waiting -= 1
                self._wake()  # reads that gave way to it may go (it may have been cancelled)
        else:
            while self.hedges_waiting and self.inflight + self.hedges_waiting >= limit:
                await self._wait_freed()
        self.inflight += 1

    async def _wait_freed(self) -> None:
        if self.freed is None:
            self.freed = anyio.Event()
        await self.freed.wait()

    def leave(self) -> None:
        self.inflight -= 1
        self._wake()

    def _wake(self) -> None:
        """Let those waiting for a place look again."""
        if self.freed is not None:
            self.freed.set()
            self.freed = None

    def _throttled(self, control: TailControl) -> None:
        self.throttled += 1
        control.on_throttled()

    async def _read(self, bucket: str, call: Callable[[], Awaitable[T]]) -> T:
        control = self.control(bucket)
        await control.acquire()
        after = control.hedge_after() if self.watching and self.hedges else None
        started = time.monotonic()
        await self.enter()
        try:
            if after is None:
                result = await call()
            else:
                result = await self._hedgeable(control, call, started, after)
        except ThrottledError:
            self._throttled(control)
            raise
        finally:
            self.leave()
        control.on_answer(time.monotonic() - started)
        return result

    async def _hedgeable(self, control: TailControl, call: Callable[[], Awaitable[T]], started: float,
                         after: float) -> T:
        """``call()`` in this task, where ``watch`` can see it: if it has no answer after
        ``after`` seconds, the watcher sends it again; a hedge that answers first cancels this
        request and its answer is returned; an answer here first cancels the hedge.

        A task per request to race the two would be simpler, but spawning one costs more than
        the rest of a request's Python work (measured: ~70-170 us against ~5 us); the watcher is
        one task per engine. The cancel scope stays, though it costs a few us per read: a hedge
        cancelling this task directly (``task.cancel()``) would break through the anyio shields
        of the stores below (a disk cache's write, a test's overwriting PUT), which a scope's
        cancellation respects."""
        with anyio.CancelScope() as scope:
            pending = _Pending(started, after, call, scope, control)
            self.pending.add(pending)
            try:
                return await call()
            finally:
                self.pending.discard(pending)
                for hedge in pending.hedges:  # answered (here or by a hedge) or failed: the rest are not needed
                    hedge.cancel()
        assert pending.result is not None  # only a winning hedge cancels the scope
        self.hedges_won += 1
        with control.lock:
            control.hedges_won += 1
        return pending.result[0]

    async def watch(self) -> None:
        """Hedge the reads that straggle, until cancelled: run it beside the jobs that read
        (``FetchEngine`` does); without it, nothing is hedged."""
        self.watching = True
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    now = time.monotonic()
                    wake = HEDGE_AT_FIRST
                    for pending in list(self.pending):
                        if len(pending.hedges) >= HEDGES_PER_READ:
                            continue
                        # the first hedge after the threshold, another one a threshold later
                        due = pending.started + pending.after * (len(pending.hedges) + 1)
                        if due > now:
                            wake = min(wake, due - now)
                        elif pending.control.reserve_hedge():
                            hedge = anyio.CancelScope()
                            pending.hedges.append(hedge)
                            tg.start_soon(self._hedge, pending, hedge)
                    await anyio.sleep(max(wake, HEDGE_FLOOR / 2))
        finally:
            self.watching = False

    async def _hedge(self, pending: _Pending, scope: anyio.CancelScope) -> None:
        """Send ``pending`` again (its place in the hedging budget reserved by the watcher); if
        this answers first, hand the answer over and cancel the original."""
        control = pending.control
        queued = True
        try:
            with scope:
                await self.enter(hedge=True)
                try:
                    if control.hedging_paused():
                        return  # throttled since it was decided: a second request would add to the storm
                    await control.acquire()  # counted as a request (no wait: only unthrottled hedges)
                    with control.lock:
                        control.hedges_queued -= 1
                        control.hedged += 1
                        queued = False
                    self.hedged += 1
                    data = await pending.call()
                except ThrottledError:  # counted like any SlowDown: it is one
                    self._throttled(control)
                    return
                except Exception:  # noqa: BLE001 - the original request goes on and decides
                    return
                finally:
                    self.leave()
                if pending in self.pending and pending.result is None:  # the first answer: it wins
                    pending.result = (data,)
                    pending.scope.cancel()
        finally:
            if queued:  # cancelled before it was sent: the original answered meanwhile
                with control.lock:
                    control.hedges_queued -= 1
