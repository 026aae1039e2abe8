"""``ThrottledStore``: reads that take their turn under a rate limit, which SlowDown answers set.

Every engine's reads pass through one (below its ``HedgedStore``, so hedges take their turn too);
the state it consults, a ``ThrottleControl``, is one per endpoint and bucket in a process, shared
by all of that process's engines (each runs its own loop thread, hence the lock), because S3
throttles per prefix whoever sends. Retrying alone turns a throttle into a storm (measured: 54 %
of GETs answered SlowDown), so the control sends less, by what it measures, whatever the shape of
the limit (token bucket, sliding second, one limit shared by many processes, a limit that rises).
Each process sees only its own answers; a DataLoader's workers hand the limit they found on to its
next epoch's workers, which are new unless ``persistent_workers`` (``handoff``). ``ThrottleControl``
is a state machine driven by three events on an injected clock (a turn booked, an answer, a
SlowDown); tests/throttle_sim.py runs
the same class for a job of many processes against a simulated prefix. The rules:

* **Start small**: before any limit is known, a job of many processes sends ``JOB_START_WINDOW``
  requests at once between them, each process its share but at least ``START_WINDOW``
  (``start_window``), one more for each good answer (doubling every round trip, as TCP's slow
  start), so that many processes do not start with all of their requests at once, while a job of
  one or two readers starts as the engine asks (a window it must ramp up each epoch, as
  non-persistent DataLoader workers start anew, cost a clean read 5-15 %); a request held
  for its place counts as asked for (the first cut measures what the process asked to send),
  and the first cut books the held ones under the limit it sets. No hedge while the window is full.
* **Cut** when more than ``TARGET_SHARE`` of the last answers (at most ``RECENT``) to requests sent
  since the last cut are SlowDown: the limit becomes ``BACKOFF`` x what got through (the rate sent
  since the last cut, for the first cut what was sent in one ``RATE_WINDOW`` at most, times the
  share answered well over the last ``RATE_WINDOW``; the share is counted as if
  ``1 / TARGET_SHARE`` answers had been answered at ``TARGET_SHARE``, so a process with few
  answers is cut no deeper for having few). At most one cut per ``RATE_WINDOW`` once limited: a
  prefix counts a second, so what was sent before a cut still counts after it.
* **Wait out a full limit**: when most answers were SlowDown, a burst met a full limit (a sliding
  second refuses the rest of its second) or others took it (a DataLoader worker that starts late
  meets the bucket the first one emptied): the limit drops to what got through, and grows back
  fast (doubling every ``RECOVER_DOUBLING`` s) to ``known``: what was answered well over the last
  second, or the share of its limit its answers show taken (so a process answered nothing is
  not left at nothing), whichever is more, and no more than the limit last found. A process that
  got more than ``known``'s second through in the last ``RATE_WINDOW`` (a burst that filled a
  sliding second, which still counts it) sends nothing until that has left the window, then
  sends at ``known`` at once.
* **Probe** while the limit holds requests back (an unused limit would run away): it grows by
  ``GROWTH`` of itself per second (a limit that doubled is found within ``RISE_FOUND`` s), twice
  as fast for each ``RATE_WINDOW`` since the last cut and each ``RECENT`` good answers since the
  last SlowDown, whichever says less (a rise, or processes that left, is found in seconds; a
  process answered a few times a second probes no faster than its answers can show it wrong),
  up to twice what got through in the last ``RATE_WINDOW`` (a limit is tested by its answers: a
  loop that ran late grows no untested limit), plus ``CATCH_UP``
  requests/s per second, the part that is the same for every process and brings a job's
  processes to equal shares.
* The limit is paced (one request every ``1 / rate`` s, no burst); a cut or a grown limit
  re-times the turns booked ahead, in the order they were booked (a request's place in line is
  kept: delivery waits for the first sample of a batch), and a request waiting for its turn looks
  every ``RECHECK`` s whether its turn moved (its look grows the limit, as a booking does); a
  turn that came due goes unless a cut came since, however late a busy loop woke it.

Why and the numbers: docs/design/throttle.md.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, NamedTuple, TypeVar

import anyio

from .. import topology
from ..errors import ThrottledError
from .handoff import for_this_process
from .protocol import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, Pin

T = TypeVar("T")
C = TypeVar("C")

# Every value has its reason here; docs/design/throttle.md lists the test that fails when it
# changes enough to matter.
# cut above this share of SlowDowns: half the 10 % a throttled job may see, the other half being
# what a probe sends over the limit before its answers show it
TARGET_SHARE = 0.05
RECENT = math.ceil(2 / TARGET_SHARE)  # answers the share is judged over: TARGET_SHARE of them is 2 (derived)
# a cut leaves this share of what got through: the deeper, the more a process holding more than
# its share gives back to those with less (0.9 left a job of 64 processes' slowest at a third of the mean)
BACKOFF = 0.8
# seconds to find a limit that doubled: S3 raises a busy prefix's limit under sustained load
RISE_FOUND = 10.0
GROWTH = math.log(2 / BACKOFF) / RISE_FOUND  # per second: from a cut to twice the rate cut from (derived)
# requests/s added per second of probing, whatever the rate: the same for every process, it
# brings those with less than their share up (AIMD's additive increase)
CATCH_UP = 0.5
# seconds: S3 states its limits per second; what got through is measured over one
RATE_WINDOW = 1.0
# seconds in which a limit cut by a full limit's refusals doubles back up to what got through:
# a sliding second that refused a burst opens within RATE_WINDOW, and is found within a tenth of it
RECOVER_DOUBLING = RATE_WINDOW / 10
MIN_RATE = 1.0  # requests/s: the lowest limit (a process answered only SlowDown waits no longer)
RECHECK = 0.1  # seconds: a request waiting for its turn looks this often whether the limit was reset
# requests in flight before any limit is known, one more for each good answer (doubling every
# round trip, as TCP's slow start): a job of many processes starts at this many each, not at the
# engine's 64 each (8 processes x 64 went into a second that allowed 300); 64 in flight are
# reached in 3 round trips (60 ms at 20 ms an answer)
START_WINDOW = 16
# ... and a job's processes together: the 8 x START_WINDOW of the shape that measured it (2 ranks
# x 4 workers), shared by fewer processes where there are fewer (2 workers: the engine's 64 each)
JOB_START_WINDOW = 8 * START_WINDOW


def start_window(readers: int) -> int:
    """Requests one of a job's ``readers`` processes sends before any limit is known: its share
    of ``JOB_START_WINDOW``, at least ``START_WINDOW``."""
    return max(START_WINDOW, JOB_START_WINDOW // max(1, readers))


class ThrottleStats(NamedTuple):
    """One control's counters (approximately consistent: read without the lock)."""

    requests: int
    throttled: int
    rate_limit: float | None  # requests/s allowed now; None: no limit
    cuts: int  # how often SlowDowns cut the limit


class Turn:
    """A booked turn: when it comes ``due`` (the control's clock) and the ``generation`` (cuts so
    far) to report its answer with; a cut or a grown limit moves both. ``taken``: it went."""

    __slots__ = ("due", "generation", "taken", "wake", "since")

    def __init__(self, due: float, generation: int, taken: bool, since: float = 0.0) -> None:
        self.due = due  # inf: held for a place in the start window, given by an answer
        self.generation = generation
        self.taken = taken
        self.since = since  # when it was booked (a held turn waits at most RATE_WINDOW)
        self.wake: Callable[[], None] | None = None  # called (under the lock) when a held turn is given


class ThrottleControl:
    """The shared rate limit for one endpoint and bucket in this process (see the module
    docstring). A state machine driven by ``turn``, ``on_answer`` and ``on_throttled`` on
    ``clock`` (seconds, monotonic; a simulation passes its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: int = START_WINDOW,
                 limit: float | None = None) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        # None: no limit known yet (the start window holds); ``limit``: one handed over (``handoff``)
        self.rate: float | None = None if limit is None else max(MIN_RATE, limit)
        self.known = self.rate or 0.0  # requests/s known to get through: the limit grows back to it fast
        self.grown_at = clock()  # when the limit last grew
        self.paused_until = -math.inf  # no request goes before
        self.next_free = 0.0  # when the next request may go, under the limit
        self.booked_rate = self.known  # the rate the current schedule spaces turns at
        self.booked: deque[Turn] = deque()  # turns booked ahead, in their order (some taken)
        self.last_due = -math.inf  # the latest turn that came due
        self.generation = 0  # bumped by every cut: answers to requests sent before stop counting
        self.schedule = 0  # bumped by a cut or a grown limit: turns booked ahead moved
        self.recent: deque[bool] = deque()  # this generation's last answers: SlowDown?
        self.recent_slowdowns = 0
        self.second: deque[tuple[float, bool]] = deque()  # this generation's answers within RATE_WINDOW
        self.second_slowdowns = 0
        self.started: float | None = None  # when this generation began (the first turn, or the cut)
        self.sent = 0  # requests sent in this generation
        self.answered: deque[float] = deque()  # good answers' times within the last RATE_WINDOW
        self.last_throttled = -math.inf
        self.clean = 0  # good answers since the last SlowDown
        self.cut_at = -math.inf
        self.inflight = 0  # requests taken and not yet answered
        self.window = window  # before any limit: at most this many in flight (start_window)
        self.held: deque[Turn] = deque()  # turns waiting for a place in the window, in order
        self.requests = 0
        self.throttled = 0
        self.cuts = 0
        self.handoff: Any = None  # where a DataLoader worker hands its limit on (``handoff.Handoff``)

    # ---------------------------------------------------------------- the state machine

    def turn(self) -> Turn:
        """Book the next request's turn (taken at once when it is due now: ``take`` the others
        when they come due, or ``cancel`` them)."""
        with self.lock:
            now = self.clock()
            self.requests += 1
            if self.started is None:
                self.started = now
            rate = self.rate
            self.sent += 1  # (a held turn too: the first cut measures what the process asked to send)
            if rate is None:
                if self.inflight >= self.window or self.held:  # slow start: wait for an answer
                    turn = Turn(math.inf, self.generation, False, now)
                    self.held.append(turn)
                    return turn
                self.inflight += 1
                return Turn(now, self.generation, True)
            booked = self.booked
            while booked and booked[0].taken:
                booked.popleft()
            rate = self._grow(rate, now)
            start = max(now, self.next_free, self.paused_until)
            self.next_free = start + 1.0 / rate
            turn = Turn(start, self.generation, start <= now)
            if turn.taken:
                self.last_due = start
                self.inflight += 1
            else:
                booked.append(turn)
            return turn

    def _grow(self, rate: float, now: float) -> float:
        """The limit now: grown if it held requests back since it was last looked at (not in a
        pause), and the turns booked ahead re-timed when it grew enough. Under the lock. A turn
        booked and one looking whether it came due both look: while every request waits for its
        turn none books, and a limit cut to its floor had grown only as fast as its turns went."""
        if self.next_free >= now >= self.paused_until:
            answered = self.answered
            while answered and answered[0] < now - RATE_WINDOW:
                answered.popleft()
            # ... at most to twice what got through (a limit is tested by its answers)
            ceiling = max(rate, self.known, 2 * len(answered) / RATE_WINDOW)
            rate = self.rate = self._grown(rate, now, ceiling)
            if rate > self.booked_rate * (1 + TARGET_SHARE):  # turns booked ahead are too far apart
                self._reschedule(now, max(now, self.last_due + 1.0 / rate), cut=False)
        self.grown_at = max(now, self.paused_until)
        return rate

    def _grown(self, rate: float, now: float, ceiling: float) -> float:
        """The limit after holding requests back since ``grown_at``: fast back up to ``known``,
        then the probe, to no more than ``ceiling``. Under the lock."""
        elapsed = now - self.grown_at
        if rate < self.known:
            doublings = elapsed / RECOVER_DOUBLING
            if doublings <= math.log2(self.known / rate):
                return rate * 2.0 ** doublings
            elapsed -= RECOVER_DOUBLING * math.log2(self.known / rate)
            rate = self.known
        # quiet: seconds since the last cut, and RECENTs of good answers since the last SlowDown
        # (over RECENT answers a share of TARGET_SHARE shows), whichever says less
        quiet = min((now - self.cut_at) / RATE_WINDOW, self.clean / RECENT)
        if elapsed > 0 and ceiling > rate:
            # GROWTH * 2 ** quiet * elapsed, in logs and at most what reaches the ceiling: a
            # limit held a minute or more after its last cut had overflowed math.exp
            log_exponent = math.log(GROWTH * elapsed) + quiet * math.log(2)
            rate *= math.exp(math.exp(min(log_exponent, math.log(math.log(ceiling / rate)))))
        return min(ceiling, rate + CATCH_UP * max(elapsed, 0.0))

    def _reschedule(self, now: float, at: float, cut: bool) -> None:
        """Turns booked ahead and not taken go again from ``at`` at the limit's spacing, in their
        order; after a cut all of them, in its generation (they are sent after it); after a grown
        limit those not yet due (a due turn goes as it was booked). Under the lock."""
        rate = self.rate
        assert rate is not None
        self.schedule += 1
        self.booked_rate = rate
        kept: deque[Turn] = deque()
        for turn in self.booked:
            if turn.taken:
                continue
            if not cut and turn.due <= now:
                at = max(at, turn.due + 1.0 / rate)
                kept.append(turn)
                continue
            turn.due = at
            at += 1.0 / rate
            if cut:
                turn.generation = self.generation
                self.sent += 1
            kept.append(turn)
        self.booked.clear()  # in place: turn() holds it
        self.booked.extend(kept)
        self.next_free = at

    def on_answer(self, generation: int) -> None:
        """A good answer to a request booked in ``generation``."""
        with self.lock:
            now = self.clock()
            answered = self.answered
            answered.append(now)
            while answered[0] < now - RATE_WINDOW:
                answered.popleft()
            self.clean += 1
            self.inflight -= 1
            if self.rate is None:
                self.window += 1
            if generation == self.generation:
                self._note(now, False)
            self._give(now)

    def on_throttled(self, generation: int) -> None:
        """A SlowDown to a request booked in ``generation``: cut when they are a share of the answers."""
        with self.lock:
            now = self.clock()
            self.throttled += 1
            self.last_throttled = now
            self.clean = 0
            self.inflight -= 1
            if generation == self.generation:
                self._note(now, True)
                self._cut(now)
            self._give(now)

    def on_failed(self) -> None:
        """A request taken and ended otherwise (an error, cancelled: a hedge that lost): its place
        in the start window is free."""
        with self.lock:
            self.inflight -= 1
            self._give(self.clock())

    def _give(self, now: float) -> None:
        """Held turns get their place: in the start window while no limit is known, else a turn
        booked under the limit (the first cut came). Under the lock."""
        held = self.held
        while held and (self.rate is not None or self.inflight < self.window):
            turn = held.popleft()
            if turn.taken:
                continue  # cancelled
            if self.rate is None:
                turn.due, turn.taken = now, True
                self.inflight += 1
            else:  # booked under the first cut's limit, in its generation
                self.sent += 1
                turn.generation = self.generation
                start = turn.due = max(now, self.next_free, self.paused_until)
                self.next_free = start + 1.0 / self.rate
                self.booked.append(turn)
            if turn.wake is not None:
                turn.wake()

    def _cut(self, now: float) -> None:
        """Cut the limit when SlowDowns are more than a share of this generation's answers.
        Under the lock."""
        recent, slowdowns = self.recent, self.recent_slowdowns
        if slowdowns < 2 or slowdowns <= TARGET_SHARE * len(recent):
            return
        # most answered SlowDown (not at the first cut: a job's first requests all go at once)
        full = self.rate is not None and slowdowns > len(recent) / 2
        if self.cuts >= (1 if not full else 2) and now - self.cut_at < RATE_WINDOW:
            # the prefix counts a second: what was sent before the last cut still counts (the
            # first cut, made mid-burst, may be followed at once by one more)
            return
        assert self.started is not None
        span = now - self.started
        if self.rate is None:  # the first: what was sent in a second at most (a burst's rate says nothing)
            sent = self.sent / max(span, RATE_WINDOW)
        else:  # below the limit while requests back off
            sent = min(self.sent / span if span > 0 else math.inf, self.rate)
        # the share answered well, counted as if 1 / TARGET_SHARE more were answered at
        # TARGET_SHARE (a process with few answers is judged no worse for having few)
        prior = 1 / TARGET_SHARE
        n, k = len(recent), slowdowns
        judged = (n - k + prior - 1) / (n + prior)
        if full:
            taken = 1 - slowdowns / len(recent)
        else:  # over the last second
            n, k = len(self.second), self.second_slowdowns
            taken = (n - k + prior - 1) / (n + prior)
        before = self.rate
        self.rate = max(MIN_RATE, BACKOFF * taken * sent)
        if not full:
            self.known = self.rate
        else:  # back fast to what was answered well over the last second, once the limit opens
            answered = self.answered
            while answered and answered[0] < now - RATE_WINDOW:
                answered.popleft()
            # ... or the share of the limit it had that its answers show taken: a process
            # answered little may have met a limit that others took (a DataLoader worker that
            # starts late meets the bucket emptied), not one it overran
            assert before is not None  # a full limit is met only once limited
            got = max(len(answered) / RATE_WINDOW, judged * before)
            self.known = max(self.rate, min(self.known, got))
            # a limit that remembers a second (a sliding second) still counts what this process
            # got through in the last one: nothing goes until that has fallen below ``known``'s
            # second, and then at ``known`` (growing back from nearly nothing, the process sent
            # into the closed second all the while)
            over = len(answered) - int(self.known * RATE_WINDOW)
            if over >= 0:
                self.paused_until = answered[over] + RATE_WINDOW
                self.rate = self.known
        self.grown_at = self.started = self.cut_at = now
        self.sent = 0
        self.generation += 1
        self.cuts += 1
        recent.clear()
        self.recent_slowdowns = 0
        self.second.clear()
        self.second_slowdowns = 0
        self._reschedule(now, max(now + 1.0 / self.rate, self.paused_until), cut=True)

    def _note(self, now: float, slowdown: bool) -> None:
        """One answer of this generation into the share's windows. Under the lock."""
        recent = self.recent
        recent.append(slowdown)
        self.recent_slowdowns += slowdown
        if len(recent) > RECENT:
            self.recent_slowdowns -= recent.popleft()
        second = self.second
        second.append((now, slowdown))
        self.second_slowdowns += slowdown
        while second[0][0] < now - RATE_WINDOW:
            self.second_slowdowns -= second.popleft()[1]

    # ---------------------------------------------------------------- for the store wrapper

    def take(self, turn: Turn) -> bool:
        """Whether ``turn`` has come due (then it is taken: its request goes), however late a busy
        loop looked; a cut since it was booked moved it."""
        with self.lock:
            if turn.taken:
                return True
            now = self.clock()
            if turn.due > now and self.rate is not None:
                self._grow(self.rate, now)  # a grown limit may move it sooner
            if turn.due == math.inf and now - turn.since >= RATE_WINDOW:
                turn.due = now  # the window is for the first round trips: never hold a read longer
            if turn.due > now:
                return False
            turn.taken = True
            self.inflight += 1
            self.last_due = max(self.last_due, turn.due)
            return True

    def cancel(self, turn: Turn) -> None:
        """A booked turn its request no longer waits for (cancelled): no later turn waits for it
        (a turn given and not yet seen gives its place back)."""
        with self.lock:
            if turn.taken:
                self.inflight -= 1
                self._give(self.clock())
            elif turn.due != math.inf:  # booked (a held turn is skipped when its place comes)
                turn.taken = True
                self.requests -= 1
                if turn.generation == self.generation:
                    self.sent -= 1
            else:
                turn.taken = True
                self.requests -= 1
                if turn.generation == self.generation:
                    self.sent -= 1

    async def acquire(self) -> int:
        """Wait for this request's turn under the rate limit (at once when there is none); the
        generation to report its answer with."""
        turn = self.turn()
        try:
            while not self.take(turn):  # it looks every RECHECK whether its turn moved
                if turn.due == math.inf:
                    await self._held(turn)
                else:
                    await anyio.sleep(min(max(turn.due - self.clock(), 0.0), RECHECK))
        except BaseException:
            self.cancel(turn)
            raise
        return turn.generation

    async def _held(self, turn: Turn) -> None:
        """Wait until ``turn`` is given a place (an answer, maybe on another engine's loop thread,
        wakes it) or ``RECHECK`` passed."""
        loop = asyncio.get_running_loop()
        given = loop.create_future()

        def give() -> None:
            if not given.done():
                given.set_result(None)

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(give)
            except RuntimeError:  # that loop closed: nothing waits there any more
                pass

        with self.lock:
            if turn.due != math.inf:
                return
            turn.wake = wake
        with anyio.move_on_after(RECHECK):
            await given

    def congested(self, hedge: bool = False) -> bool:
        """Whether a second request for the same object would add to a throttle: limited, or
        answered SlowDown within the last ``RATE_WINDOW``; for a ``hedge``, also while the start
        window is full (it would wait behind the reads held there, and be cancelled unsent)."""
        return (self.rate is not None or self.clock() - self.last_throttled < RATE_WINDOW
                or (hedge and self.inflight >= self.window))

    def statistics(self) -> ThrottleStats:
        return ThrottleStats(self.requests, self.throttled, self.rate, self.cuts)


class SharedControls(Generic[C]):
    """A process's controls by (endpoint, bucket), made by ``factory(endpoint, bucket)``; a forked
    child starts with none."""

    def __init__(self, factory: Callable[[str, str], C]) -> None:
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
                control = self.by_key.get((endpoint, bucket))
                if control is None:
                    control = self.by_key[(endpoint, bucket)] = self.factory(endpoint, bucket)
        return control


def _job_control(endpoint: str, bucket: str) -> ThrottleControl:
    """A control whose start window is this process's share of its job's; in a DataLoader worker,
    one that starts at the limit the last epoch's workers found, if they found one (``handoff``)."""
    handoff = for_this_process(endpoint, bucket, every=RATE_WINDOW)
    control = ThrottleControl(window=start_window(topology.readers()),
                              limit=None if handoff is None else handoff.read())
    control.handoff = handoff
    return control


CONTROLS: SharedControls[ThrottleControl] = SharedControls(_job_control)


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


class ReadWrapper(Generic[C]):
    """A store wrapper whose whole-body reads (``get``, ``get_range``, ``get_if_changed``) pass
    through ``_read(bucket, call)``; everything else goes to ``inner`` as it is. The throttle and
    the hedging wrappers differ only in ``_read`` (and in how they stream), and in the process's
    ``shared`` controls each reads its bucket's ``control`` from."""

    inner: ObjectStore
    endpoint: str
    controls: dict[str, C]  # this wrapper's buckets' controls: a dict read, not the shared lock
    shared: SharedControls[Any]

    def control(self, bucket: str) -> C:
        """The control this process shares for ``bucket`` at this wrapper's endpoint."""
        control = self.controls.get(bucket)
        if control is None:
            control = self.controls[bucket] = self.shared.get(self.endpoint, bucket)
        return control

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


class ThrottledStore(ReadWrapper[ThrottleControl]):
    """An ``ObjectStore`` whose reads (``get``, ``get_range``, ``get_if_changed``, ``stream``) wait
    for their turn under the shared ``ThrottleControl`` of their bucket and report how they were
    answered; everything else passes through. Counts its own SlowDowns (``throttled``) for ``stats()``."""

    shared = CONTROLS

    def __init__(self, inner: ObjectStore, endpoint: str | None = None) -> None:
        self.inner = inner
        self.endpoint = endpoint or endpoint_of(inner)
        self.controls: dict[str, ThrottleControl] = {}
        self.throttled = 0

    def congested(self, bucket: str, hedge: bool = False) -> bool:
        """Whether a second request for ``bucket`` would add to a throttle (``HedgedStore`` asks)."""
        return self.control(bucket).congested(hedge)

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        control = self.control(bucket)
        generation = await control.acquire()
        chunks = self.inner.stream(bucket, key, start, chunk_size, pin=pin, end=end)
        first = True
        try:
            async for chunk in chunks:
                if first:
                    control.on_answer(generation)
                    first = False
                    _hand_on(control)
                yield chunk
        except ThrottledError:
            if first:
                first = False
                self.throttled += 1
                control.on_throttled(generation)
                _hand_on(control)
            raise
        finally:
            if first:  # ended before an answer (an error, cancelled, no body)
                control.on_failed()
            await chunks.aclose()

    def __repr__(self) -> str:
        return f"ThrottledStore({self.inner!r})"

    async def _read(self, bucket: str, call: Callable[[], Awaitable[T]]) -> T:
        control = self.control(bucket)
        generation = await control.acquire()
        try:
            result = await call()
        except ThrottledError:
            self.throttled += 1
            control.on_throttled(generation)
            _hand_on(control)
            raise
        except BaseException:
            control.on_failed()
            raise
        control.on_answer(generation)
        _hand_on(control)
        return result


def _hand_on(control: ThrottleControl) -> None:
    """Give the limit ``control`` holds to the next epoch's DataLoader workers (``handoff``): the
    rate it allows, or what it knows gets through while it grows back to that after a full limit
    (a moment in which the rate is near nothing must not start the next epoch there)."""
    handoff = control.handoff
    if handoff is not None:
        rate = control.rate
        handoff.note(None if rate is None else max(rate, control.known))
