"""The loop-side half of an engine: jobs started under the limits (places, the memory bound),
the bounded buffer, and cancellation; the order items leave in is a delivery policy
(``delivery.py``), the start-up heuristics a ``Tuning`` (``tuning.py``). Runs only in the
engine's loop thread; ``fetch.FetchEngine`` is the thread-safe handle (docs/design/engine.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import traceback
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable
from typing import Any

import anyio

from ..retry import RetryPolicy
from ..s3 import ObjectStore
from ..s3.blocking import first_error
from ..s3.hedging import TailStore
from .delivery import DeliveryPolicy, Entry, Slot, delivery_for
from .limits import Counts, EngineLimits
from .tuning import TUNING, Tuning


class JobContext:
    """What a job sees: the store, ``emit`` for its results, and a retry counter."""

    __slots__ = ("store", "retry", "_core", "_slot")

    def __init__(self, core: EngineCore, slot: Slot, store: ObjectStore, retry: RetryPolicy):
        self.store = store
        self.retry = retry
        self._core = core
        self._slot = slot

    async def emit(self, item: Any, nbytes: int) -> None:
        """Hand one item to the consumer; waits while the buffer is full (backpressure)."""
        await self._core.emit(self._slot, item, nbytes)

    def retried(self, exc: BaseException) -> None:
        """Count one retry (passed as ``on_retry`` to ``call_with_retries``)."""
        self._core.counts.retries += 1


JobFn = Callable[[JobContext], Awaitable[None]]
"""A job's work: emits its items through the context, raises to fail."""


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One unit of the engine's work and what the engine must know of it before it starts.

    ``reserve``: the bytes it holds while it runs, when known (else the engine reserves twice
    the largest item seen); ``reads_ahead``: it fetches all it holds before its first item
    (within ``reserve``), so it may start while the buffer is full, and, under interleaved
    delivery, ahead of its lane (``Tuning.ahead_places``). A plain ``JobFn`` is a ``Job`` with
    neither."""

    run: JobFn
    reserve: int | None = None
    reads_ahead: bool = False

    @staticmethod
    def of(job: AnyJob) -> Job:
        return job if isinstance(job, Job) else Job(job)


AnyJob = Job | JobFn
Jobs = Iterable[AnyJob] | AsyncIterable[AnyJob]
"""What an engine runs: jobs, or jobs that come as they are known (awaited in the loop, e.g.
made from a listing's pages as they arrive), closed when the engine stops."""


async def _numbered(jobs: Jobs) -> AsyncGenerator[tuple[int, AnyJob], None]:
    """``enumerate`` over either kind of ``Jobs``; an async source is closed when this is."""
    if not isinstance(jobs, AsyncIterable):
        for numbered in enumerate(jobs):
            yield numbered
        return
    index, source = 0, aiter(jobs)
    try:
        async for job in source:
            yield index, job
            index += 1
    finally:
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


async def run_all(calls: Iterable[Callable[[], Awaitable[object]]], limit: int | None = None) -> None:
    """Run ``calls`` concurrently, at most ``limit`` at a time (None: all at once); the first to
    fail cancels the others and its error is raised as it is (a task group would wrap it in an
    exception group)."""
    errors: list[Exception] = []
    limiter = None if limit is None else anyio.CapacityLimiter(limit)
    async with anyio.create_task_group() as group:

        async def one(call: Callable[[], Awaitable[object]]) -> None:
            try:
                if limiter is None:
                    await call()
                else:
                    async with limiter:
                        await call()
            except Exception as exc:  # noqa: BLE001 - re-raised below, unwrapped
                errors.append(exc)
                group.cancel_scope.cancel()

        for call in calls:
            group.start_soon(one, call)
    if errors:
        raise errors[0]


class Budget:
    """The bytes running jobs hold (``EngineLimits.inflight_bytes``): each job reserves what it
    says it holds, else twice the largest item seen (its body arriving, then joined), or all of
    the budget before any size is known; one job may always run."""

    __slots__ = ("limit", "reserved", "largest_item")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.reserved = 0
        self.largest_item = 0

    def reservation(self, fixed: int | None) -> int:
        budget = self.limit or 0
        if fixed is not None:
            return min(fixed, budget)
        if not self.largest_item:
            return budget
        return min(2 * self.largest_item, budget)

    def fits(self, fixed: int | None, running: int) -> bool:
        if self.limit is None or not running:
            return True
        return self.reserved + self.reservation(fixed) <= self.limit

    def reserve(self, fixed: int | None) -> int:
        if self.limit is None:
            return 0
        amount = self.reservation(fixed)
        self.reserved += amount
        return amount


class EngineCore:
    """Jobs, places, the memory bound and cancellation; the delivery policy decides the order.

    Touched only from the engine thread, except for ``counts`` that ``statistics()`` reads.
    """

    def __init__(
        self,
        jobs: Jobs,
        store_factory: Callable[[], Awaitable[ObjectStore]],
        limits: EngineLimits,
        retry: RetryPolicy,
        schedule: Iterable[int] | None = None,
        tuning: Tuning = TUNING,
    ) -> None:
        self.jobs = jobs
        self.store_factory = store_factory
        self.limits = limits
        self.retry = retry
        self.tuning = tuning
        self.counts = Counts()
        self.budget = Budget(limits.inflight_bytes)
        self.slots: dict[int, Slot] = {}  # launched and not yet drained
        self.delivery: DeliveryPolicy = delivery_for(self, schedule)
        self.waiting = False  # whether the consumer is parked in take(), holding nothing
        self.pending: deque[tuple[Job, JobContext]] = deque()  # launched, no runner yet
        # parked runners, each woken by its future's result: an asyncio future, not an
        # anyio.Event, which looks up the running library on every creation (sniffio: a few
        # us, paid once per job when runners park between jobs); the engine runs on asyncio
        self.idle: list[asyncio.Future[None]] = []
        self.runners = 0
        self.launch_done = False
        self.failed = False  # a job raised: no more jobs start
        self.fatal: BaseException | None = None  # the engine itself failed (the store)
        self.changed: anyio.Event | None = None
        self.take_bytes = max(1, limits.queue_bytes // 4)  # most bytes one batch hands over
        self.taken = [0, 0]  # items and bytes handed over by the current take()
        self.tail: TailStore | None = None  # the store jobs read through (hedging, throttling)

    # ------------------------------------------------------------------ jobs and places

    async def main(self) -> None:
        store = None
        try:
            store = self.tail = TailStore(await self.store_factory(), max_requests=self.limits.max_inflight)
            async with anyio.create_task_group() as beside:
                beside.start_soon(store.watch)  # hedges straggling reads (s3/hedging.py)
                async with anyio.create_task_group() as tg:
                    await self.launch_all(tg, store)
                beside.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            # a streamed job source (a listing read as it arrives) fails inside the task group:
            # the user gets its error, not the group
            self.fatal = first_error(exc)
        finally:
            self.launch_done = True
            self.notify()
            if store is not None:
                with anyio.CancelScope(shield=True):
                    await store.aclose()

    async def launch_all(self, tg: anyio.abc.TaskGroup, store: ObjectStore) -> None:
        counts, delivery = self.counts, self.delivery
        async with contextlib.aclosing(_numbered(self.jobs)) as numbered:
            async for index, given in numbered:
                if index == 1:
                    await self.let_first_job_lead()
                job = Job.of(given)
                await self.wait_for_room(index, job)
                if self.failed:
                    break
                slot = Slot(index)
                slot.reserved = self.budget.reserve(job.reserve)
                counts.peak_reserved_bytes = max(counts.peak_reserved_bytes, self.budget.reserved)
                self.slots[index] = slot
                counts.launched += 1
                self.pending.append((job, JobContext(self, slot, store, self.retry)))
                if self.idle:
                    _wake(self.idle.pop())
                elif self.runners < delivery.places(job.reads_ahead) or delivery.must_start(index):
                    self.runners += 1  # a job the consumer already waits for gets a runner even past the limit
                    tg.start_soon(self.runner)
        self.launch_done = True
        self.notify()
        while self.idle:
            _wake(self.idle.pop())  # parked runners see launch_done and return

    async def wait_for_room(self, index: int, job: Job) -> None:
        """Wait until job ``index`` may start: a free place, the order's consent, and room in the
        memory budget.

        The places are a plain count, not an ``anyio.Semaphore``: only this one task takes
        them, and a semaphore's ``acquire`` yields to the loop on every call even when a place is
        free (one loop iteration per job, about a third of the engine's CPU per sample). Here
        the launcher starts jobs back to back until the limit, then sleeps until one finishes.
        """
        counts, delivery, ahead = self.counts, self.delivery, job.reads_ahead
        while not self.failed and not delivery.must_start(index) and not (
            counts.launched - counts.jobs_done < delivery.places(ahead)
            and delivery.may_start(index, ahead)
            and self.budget.fits(job.reserve, counts.launched - counts.jobs_done)
        ):
            await self.wait_change()

    async def let_first_job_lead(self) -> None:
        """Hold the other jobs back until the first one has an item, for ``first_job_lead_s`` at
        most, then hand that item over before they start (``Tuning`` says why and what it
        measured). A remote server's first byte takes longer than the lead, so the others lose
        the lead, once."""
        lead, counts = self.tuning.first_job_lead_s, self.counts
        if not (self.delivery.lead and lead > 0):
            return
        # The clock starts once the first job has gone as far as it can without waiting: a
        # backend's set-up on its first request (obstore builds its client) is not lead.
        await asyncio.sleep(0)
        with anyio.move_on_after(lead):
            while not (counts.buffered_items or counts.delivered_items or counts.jobs_done or self.failed):
                await self.wait_change()
        if (counts.buffered_items or counts.delivered_items) and self.tuning.handover_s > 0:
            # A few loop turns carry the take's result to the consumer's future; then the loop
            # idles (its thread in the selector, the GIL free) for the consumer's thread to run.
            for _ in range(3):
                await asyncio.sleep(0)
            await asyncio.sleep(self.tuning.handover_s)

    async def runner(self) -> None:
        """Run launched jobs one after another, parking when there is none; return at the end.

        Up to ``places()`` runners live as long as the engine. A task per job would be
        simpler, but spawning an anyio task (its cancel scope, event and wrapper) cost about as
        much as the rest of the engine's work per sample. Every launched job finds a runner: the
        launcher wakes a parked one or starts a new one, and when there are already
        ``places()`` runners and none is parked, fewer than ``places()`` jobs are held,
        so some runner has not yet started or woken up and will take it.
        """
        while True:
            while self.pending:
                job, ctx = self.pending.popleft()
                await self.run_job(job, ctx)
            if self.launch_done or self.runners > self.delivery.places(ahead=True):  # the most any job gets
                self.runners -= 1
                return
            wake = asyncio.get_running_loop().create_future()
            self.idle.append(wake)
            await wake

    async def run_job(self, job: Job, ctx: JobContext) -> None:
        slot, counts = ctx._slot, self.counts
        counts.inflight += 1
        counts.peak_inflight = max(counts.peak_inflight, counts.inflight)
        try:
            await job.run(ctx)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it in order
            slot.error = exc
            self.failed = True
            self.delivery.failed(slot, exc)
        except BaseException as exc:  # cancelled (the engine closing): anyio keeps a cancelled
            # task's error in a cycle with its traceback, whose frames (the item a job was
            # emitting, its buffers) would wait for a garbage collection; their locals go now
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            counts.inflight -= 1
            counts.jobs_done += 1
            self.budget.reserved -= slot.reserved
            slot.reserved = 0
            slot.done = True
            self.delivery.ended(slot)
            self.notify()  # a place is free: the launcher may be waiting for one

    # ------------------------------------------------------------------ the buffer

    def discard(self) -> None:
        """Once nothing runs this core any more (its loop stopped): drop the items never delivered
        and end the cycle with the delivery policy, so that neither waits for a garbage
        collection (the jobs cancelled mid-flight have let go of theirs, see ``run_job``)."""
        for slot in self.slots.values():  # a cancelled job's context holds its slot
            slot.items.clear()
        self.slots.clear()
        self.delivery.detach()

    def full(self) -> bool:
        counts = self.counts
        return counts.buffered_items >= self.limits.queue_items or counts.buffered_bytes >= self.limits.queue_bytes

    async def emit(self, slot: Slot, item: Any, nbytes: int) -> None:
        delivery, counts = self.delivery, self.counts
        while delivery.holds(slot) or (self.full() and not delivery.may_overfill(slot)):
            await self.wait_change()
        delivery.put(slot, (item, nbytes))
        if nbytes > self.budget.largest_item:
            self.budget.largest_item = nbytes
        counts.buffered_items += 1
        counts.buffered_bytes += nbytes
        counts.peak_buffered_bytes = max(counts.peak_buffered_bytes, counts.buffered_bytes)
        self.notify()

    async def take(self, max_items: int, released: tuple[int, int] = (0, 0)) -> tuple[list[Any], tuple[int, int]]:
        """Runs in the loop on behalf of the consumer: the next items (``[]`` at the end) and
        their count and bytes, which stay in the buffer's counts until the consumer hands them
        back as ``released`` with its next call (it holds them until then)."""
        self.release(*released)
        self.taken = [0, 0]
        delivery, waited = self.delivery, False
        while True:
            if self.fatal is not None:  # raised once: the consumer then closes the engine
                fatal, self.fatal = self.fatal, None  # kept, its traceback would keep the frames
                try:  # that hold this core, up to the consumer's iterator (see raise_error)
                    raise fatal
                finally:
                    del fatal
            if waited and self.counts.delivered_items and delivery.gathers:
                await self.gather(max_items)
            out = delivery.pop(max_items)
            if out:
                self.notify()
                return out, (self.taken[0], self.taken[1])
            if delivery.finished():
                return [], (0, 0)
            self.waiting = True
            if self.full() or delivery.must_start(self.counts.launched):
                self.notify()  # the wanted job may be parked in emit(); the launcher may hold it back
            try:
                await self.wait_change()
            finally:
                self.waiting = False
            waited = True

    async def gather(self, max_items: int) -> None:
        """The consumer waits on the fetch: let a few items gather before handing them over
        (``Tuning.gather_s``); one timer, not a wake-up per arriving item (which cost what the
        hop saved)."""
        tuning = self.tuning
        if (tuning.gather_s <= 0 or self.counts.buffered_items >= min(max_items, tuning.gather_items)
                or self.full() or not self.counts.inflight):
            return
        loop = asyncio.get_running_loop()
        gathered = loop.create_future()
        timer = loop.call_later(tuning.gather_s, _wake, gathered)
        try:
            await gathered
        finally:
            timer.cancel()

    def take_more(self, out: list[Any], max_items: int) -> bool:
        """Whether the batch being taken has room for another item."""
        return len(out) < max_items and self.taken[1] < self.take_bytes

    def account(self, entry: Entry) -> Any:
        """An item handed over: delivered now, still buffered until the consumer releases it."""
        item, nbytes = entry
        self.taken[0] += 1
        self.taken[1] += nbytes
        self.counts.delivered_items += 1
        self.counts.delivered_bytes += nbytes
        return item

    def release(self, items: int, nbytes: int) -> None:
        """The consumer is done with the last batch: its room is free again."""
        if items:
            self.counts.buffered_items -= items
            self.counts.buffered_bytes -= nbytes
            self.notify()

    # ------------------------------------------------------------------ one wake-up for all waits

    def notify(self) -> None:
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    async def wait_change(self) -> None:
        if self.changed is None:
            self.changed = anyio.Event()
        await self.changed.wait()


def _wake(parked: asyncio.Future[None]) -> None:
    """Wake the task parked on ``parked`` (a runner, a gathering take); one cancelled meanwhile
    has nothing to wake."""
    if not parked.done():
        parked.set_result(None)


