"""``HedgedStore``: a read that straggles is sent again, and the first answer wins.

AWS advises retrying a request that is slower than its usual latency rather than waiting. A GET
with no answer after ``hedge_after()`` (``HEDGE_MARGIN`` times the 95th percentile of the last
answers for the bucket, at least ``HEDGE_FLOOR``; ``HEDGE_AT_FIRST`` until enough are known) is
sent again, and once more a threshold later if neither has answered (a hedge straggles as often as
any request: with one hedge, one epoch in ten of the benchmark waited out a straggler); the first
answer wins and the others are cancelled (their bytes were never handed over, so they are counted
once). A hedge takes the next place among the engine's requests in flight: reads give way to it.
At most ``HEDGE_SHARE`` of requests (plus ``HEDGE_BURST``) are hedged, and none while the store
below says its bucket is congested (``ThrottledStore.congested``: a second request would add to a
throttle, or wait behind the reads its start window holds). One watcher task per engine
(``HedgedStore.watch``) sends the hedges. The latencies and the budget are shared per endpoint
and bucket in a process (``HedgeControl``).

Hand-written: no asyncio library offers hedged requests. Why and the numbers: docs/design/retry.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import anyio

from .protocol import DEFAULT_CHUNK_SIZE, ObjectStore, Pin
from .throttle import ReadWrapper, SharedControls, ThrottledStore, endpoint_of

T = TypeVar("T")

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


class HedgeStats(NamedTuple):
    """One control's counters (approximately consistent: read without the lock)."""

    requests: int  # reads sent, hedges included
    hedged: int
    hedges_won: int
    hedge_after_s: float | None  # the current hedging threshold; None: not hedging yet


class HedgeControl:
    """Latencies and the hedging budget for one endpoint and bucket in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.threshold: float | None = None
        self.since_recompute = 0
        self.requests = 0
        self.hedged = 0
        self.hedges_queued = 0  # hedges decided, not yet sent (they count against the budget)
        self.hedges_won = 0

    def on_answer(self, seconds: float) -> None:
        """A good answer after ``seconds``: learn the latency."""
        with self.lock:
            self.latencies.append(seconds)
            self.since_recompute += 1
            if self.since_recompute >= RECOMPUTE_EVERY or (
                self.threshold is None and len(self.latencies) >= HEDGE_MIN_SAMPLES
            ):
                self.since_recompute = 0
                ordered = sorted(self.latencies)
                quantile = ordered[int(HEDGE_QUANTILE * (len(ordered) - 1))]
                self.threshold = max(HEDGE_FLOOR, HEDGE_MARGIN * quantile)

    def hedge_after(self) -> float:
        """Seconds after which a request still unanswered is hedged."""
        return HEDGE_AT_FIRST if self.threshold is None else self.threshold

    def reserve_hedge(self) -> bool:
        """Take a place for one more hedge in the budget, if one is left: hedges waiting to be
        sent count as well as those sent (``hedged`` counts a hedge once it is sent; the watcher
        may decide many at once while the engine's places are all taken)."""
        with self.lock:
            if self.hedged + self.hedges_queued + 1 > HEDGE_SHARE * self.requests + HEDGE_BURST:
                return False
            self.hedges_queued += 1
            return True

    def statistics(self) -> HedgeStats:
        return HedgeStats(self.requests, self.hedged, self.hedges_won, self.threshold)


CONTROLS: SharedControls[HedgeControl] = SharedControls(lambda endpoint, bucket: HedgeControl())


def control_for(endpoint: str, bucket: str) -> HedgeControl:
    """The hedging state this process shares for ``bucket`` at ``endpoint``."""
    return CONTROLS.get(endpoint, bucket)


class _Pending:
    """One read in flight that may be hedged: when it began, how to send it again, and the
    cancel scope that a winning hedge cancels it through."""

    __slots__ = ("bucket", "started", "after", "call", "scope", "control", "hedges", "result")

    def __init__(self, bucket: str, started: float, after: float, call: Callable[[], Awaitable[Any]],
                 scope: anyio.CancelScope, control: HedgeControl) -> None:
        self.bucket = bucket
        self.started = started
        self.after = after
        self.call = call
        self.scope = scope
        self.control = control
        self.hedges: list[anyio.CancelScope] = []  # the hedges' scopes, as they are sent
        self.result: tuple[Any] | None = None  # the hedge's answer, if it won


class HedgedStore(ReadWrapper[HedgeControl]):
    """An ``ObjectStore`` whose whole-body reads (``get``, ``get_range``, ``get_if_changed``) are
    hedged when they straggle; everything else passes through (streams are not hedged).

    A hedge is sent only when fewer than ``max_requests`` of this store's reads are in flight
    (the engine's ``max_inflight``), taking the next place that frees up ahead of the engine's
    next read; while a hedge waits or is out, reads wait for a place too, so hedging never takes
    the reads in flight past ``max_requests`` (a user's concurrency is a bound on requests). No
    hedge goes while the ``ThrottledStore.congested(bucket)`` below says so.
    Counts its own engine's share (``hedged``, ``hedges_won``) for ``stats()``."""

    shared = CONTROLS

    def __init__(self, inner: ObjectStore, endpoint: str | None = None, *,
                 max_requests: int | None = None) -> None:
        self.inner = inner
        self.max_requests = max_requests
        self.inflight = 0
        self.hedges_waiting = 0  # hedges waiting for a place: reads give way to them
        self.hedges_out = 0  # hedges holding a place: reads wait for one below max_requests
        self.freed: anyio.Event | None = None  # set when a place frees up, for those waiting
        self.pending: set[_Pending] = set()  # reads that may be hedged, while in flight
        self.watching = False  # whether ``watch`` runs (else nothing is hedged)
        # a store may say its reads are not to be hedged (the disk cache: a hedged miss would
        # fill one entry twice); throttling still applies to them
        self.hedges = bool(getattr(inner, "hedged_by_engine", True))
        self.endpoint = endpoint or endpoint_of(inner)
        self.controls: dict[str, HedgeControl] = {}
        self.hedged = 0
        self.hedges_won = 0

    def congested(self, bucket: str, hedge: bool = False) -> bool:
        """Whether a hedge now would add to a throttle (the store below says so)."""
        congested = getattr(self.inner, "congested", None)
        return bool(congested(bucket, hedge)) if congested is not None else False

    def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        return self.inner.stream(bucket, key, start, chunk_size, pin=pin, end=end)

    def __repr__(self) -> str:
        return f"HedgedStore({self.inner!r})"

    # ------------------------------------------------------------------------------------------

    async def enter(self, hedge: bool = False) -> None:
        """Count a read in flight. A hedge first waits for a place among ``max_requests``; the
        reads jobs ask for are already bounded by the engine (whose jobs may send several at
        once: the objects of one sample), but give way to a waiting hedge: the engine keeps
        ``max_requests`` in flight while its buffer has room, so a hedge that only took a
        place left free would wait for the epoch's end, and the straggler with it. While hedges
        are out, reads wait for a place as hedges do: a hedge takes a place, never one more."""
        limit = self.max_requests
        if limit is not None and hedge:
            self.hedges_waiting += 1
            try:
                while self.inflight >= limit:
                    await self._wait_freed()
            finally:
                self.hedges_waiting -= 1
                self._wake()  # reads that gave way to it may go (it may have been cancelled)
        elif limit is not None:
            while (self.hedges_waiting or self.hedges_out) and self.inflight + self.hedges_waiting >= limit:
                await self._wait_freed()
        self.inflight += 1
        self.hedges_out += hedge

    async def _wait_freed(self) -> None:
        if self.freed is None:
            self.freed = anyio.Event()
        await self.freed.wait()

    def leave(self, hedge: bool = False) -> None:
        """A read (or, ``hedge``, a hedge) in flight ended: its place frees up."""
        self.inflight -= 1
        self.hedges_out -= hedge
        self._wake()

    def _wake(self) -> None:
        """Let those waiting for a place look again."""
        if self.freed is not None:
            self.freed.set()
            self.freed = None

    async def _read(self, bucket: str, call: Callable[[], Awaitable[T]]) -> T:
        control = self.control(bucket)
        with control.lock:
            control.requests += 1
        quiet = not self.congested(bucket)
        after = control.hedge_after() if quiet and self.watching and self.hedges else None
        started = time.monotonic()
        await self.enter()
        try:
            if after is None:
                result = await call()
            else:
                result = await self._hedgeable(bucket, control, call, started, after)
        finally:
            self.leave()
        if quiet:  # a latency waited out under a rate limit says nothing of stragglers
            control.on_answer(time.monotonic() - started)
        return result

    async def _hedgeable(self, bucket: str, control: HedgeControl,
                         call: Callable[[], Awaitable[T]], started: float,
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
            pending = _Pending(bucket, started, after, call, scope, control)
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
                        elif not self.congested(pending.bucket, hedge=True) and pending.control.reserve_hedge():
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
                    if self.congested(pending.bucket, hedge=True):
                        return  # throttled since it was decided: a second request would add to the storm
                    with control.lock:
                        control.hedges_queued -= 1
                        control.hedged += 1
                        control.requests += 1
                        queued = False
                    self.hedged += 1
                    data = await pending.call()
                except Exception:  # noqa: BLE001 - the original request goes on and decides
                    return
                finally:
                    self.leave(hedge=True)
                if pending in self.pending and pending.result is None:  # the first answer: it wins
                    pending.result = (data,)
                    pending.scope.cancel()
        finally:
            if queued:  # cancelled before it was sent: the original answered meanwhile
                with control.lock:
                    control.hedges_queued -= 1


class TailStore(HedgedStore):
    """What an engine reads through: a ``HedgedStore`` over a ``ThrottledStore``, so that a hedge
    takes its turn under the rate limit and its SlowDown counts like any other."""

    def __init__(self, inner: ObjectStore, endpoint: str | None = None, *,
                 max_requests: int | None = None) -> None:
        super().__init__(ThrottledStore(inner, endpoint), endpoint, max_requests=max_requests)
