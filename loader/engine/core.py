"""The loop-side half of an engine: job launching under the limits, the bounded buffer, and
the delivery orders (ordered, interleave, completed, scheduled). Runs only in the engine's
loop thread; ``fetch.FetchEngine`` is the thread-safe handle around it (docs/design/engine.md)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import anyio

from ..retry import RetryPolicy
from ..s3 import ObjectStore
from .hedging import TailStore
from .limits import FIRST_ITEM_HANDOVER_SECONDS, FIRST_JOB_LEAD_SECONDS, GATHER_ITEMS, GATHER_SECONDS, EngineLimits


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
        self._core.retries += 1


Job = Callable[[JobContext], Awaitable[None]]


class Slot:
    """One job's place in the delivery order: its pending items and how it ended."""

    __slots__ = ("index", "items", "done", "error", "reserved")

    def __init__(self, index: int) -> None:
        self.index = index
        self.items: deque[tuple[Any, int]] = deque()
        self.done = False
        self.error: BaseException | None = None
        self.reserved = 0  # bytes of ``inflight_bytes`` this job holds while it runs


class EngineCore:
    """The loop-side half of an engine: job launching, the buffer and its counters.

    Touched only from the engine thread, except for the plain-int counters that
    ``statistics()`` reads (approximately consistent, which is all statistics need).
    """

    def __init__(
        self,
        jobs: Iterable[Job],
        store_factory: Callable[[], Awaitable[ObjectStore]],
        limits: EngineLimits,
        retry: RetryPolicy,
        schedule: Iterable[int] | None = None,
    ) -> None:
        self.jobs = jobs
        self.schedule = iter(schedule or ())  # "scheduled": the job of each item to deliver
        self.entry: int | None = None  # "scheduled": the schedule's current entry
        self.schedule_done = False
        self.store_factory = store_factory
        self.limits = limits
        self.retry = retry
        self.delivery = limits.delivery
        self.slots: dict[int, Slot] = {}  # launched and not yet drained
        self.ready: deque[tuple[Any, int]] = deque()  # "completed" delivery
        self.head = 0  # "ordered": the job being delivered
        self.wanted = 0  # the job whose next item the consumer is waiting for
        self.waiting = False  # whether the consumer is parked in take(), holding nothing
        self.lanes = list(range(limits.max_inflight))  # "interleave": job index per lane
        self.cursor = 0  # "interleave": the lane whose turn it is
        self.next_index = limits.max_inflight  # "interleave": the job the next free lane takes
        self.pending: deque[tuple[Job, JobContext]] = deque()  # launched, no runner yet
        # parked runners, each woken by its future's result: an asyncio future, not an
        # anyio.Event, which looks up the running library on every creation (sniffio: a few
        # us, paid once per job when runners park between jobs); the engine runs on asyncio
        self.idle: list[asyncio.Future[None]] = []
        self.runners = 0
        self.launch_done = False
        self.failed = False
        self.fatal: BaseException | None = None
        self.changed: anyio.Event | None = None
        self.launched = 0
        self.jobs_done = 0
        self.inflight = 0
        self.peak_inflight = 0
        self.buffered_items = 0
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        self.delivered_items = 0
        self.delivered_bytes = 0
        self.retries = 0
        self.take_bytes = max(1, limits.queue_bytes // 4)  # most bytes one batch hands over
        self.reserved_bytes = 0  # sum of the running jobs' reservations
        self.peak_reserved_bytes = 0
        self.largest_item = 0
        self.taken = [0, 0]  # items and bytes handed over by the current take()
        self.tail: TailStore | None = None  # the store jobs read through (hedging, throttling)

    async def main(self) -> None:
        store = None
        try:
            store = self.tail = TailStore(await self.store_factory(), max_requests=self.limits.max_inflight)
            async with anyio.create_task_group() as beside:
                beside.start_soon(store.watch)  # hedges straggling reads (engine/tail.py)
                async with anyio.create_task_group() as tg:
                    await self.launch_all(tg, store)
                beside.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.fatal = exc
        finally:
            self.launch_done = True
            self.notify()
            if store is not None:
                with anyio.CancelScope(shield=True):
                    await store.aclose()

    async def launch_all(self, tg: anyio.abc.TaskGroup, store: ObjectStore) -> None:
        for index, job in enumerate(self.jobs):
            if index == 1:
                await self.let_first_job_lead()
            fixed = getattr(job, "reserve", None)  # a job may say what it holds (a shard read)
            ahead = getattr(job, "reads_ahead", False)  # it fetches all it holds before its first item
            await self.wait_for_room(index, fixed, ahead)
            if self.failed:
                break
            slot = Slot(index)
            if self.limits.inflight_bytes is not None:
                slot.reserved = self.reservation(fixed)
                self.reserved_bytes += slot.reserved
                self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            self.slots[index] = slot
            self.launched += 1
            self.pending.append((job, JobContext(self, slot, store, self.retry)))
            if self.idle:
                _wake(self.idle.pop())
            elif self.runners < self.places(ahead) or self.overdue(index):
                self.runners += 1  # a job the consumer already waits for gets a runner even past the limit
                tg.start_soon(self.runner)
        self.launch_done = True
        self.notify()
        while self.idle:
            _wake(self.idle.pop())  # parked runners see launch_done and return

    async def let_first_job_lead(self) -> None:
        """Hold the other jobs back until the first one has an item, for ``FIRST_JOB_LEAD_SECONDS``
        at most: started together, the first GET shared the server and the loop with 63 others
        and its sample came ~20 ms later on loopback (the first sample's time, twice over).
        A remote server's first byte takes longer than the lead, so the others lose the lead,
        once (docs/design/engine.md, "The first item"). Not under a schedule, whose first item
        may come from another job."""
        if self.delivery == "scheduled":
            return
        # The clock starts once the first job has gone as far as it can without waiting: a
        # backend's set-up on its first request (obstore builds its client, ~5 ms, before the
        # GET goes out) ate the whole lead, and the GET then shared the loop with 63 others.
        await asyncio.sleep(0)
        with anyio.move_on_after(FIRST_JOB_LEAD_SECONDS):
            while not (self.buffered_items or self.delivered_items or self.jobs_done or self.failed):
                await self.wait_change()
        if self.buffered_items or self.delivered_items:
            # Let the consumer's take hand the item over before starting the others, and then let
            # the consumer's thread have the GIL: starting 63 jobs holds it for ~10 ms, and the
            # consumer, woken meanwhile, waited out the switch interval (5 ms) for its first
            # sample. A few loop turns carry the take's result to the consumer's future; a short
            # sleep releases the GIL for long enough that the consumer, woken by that future,
            # takes it (a zero sleep gave it back before the consumer's thread asked, often).
            for _ in range(3):
                await asyncio.sleep(0)
            time.sleep(FIRST_ITEM_HANDOVER_SECONDS)

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
            if self.launch_done or self.runners > self.places(ahead=True):  # the most any job gets
                self.runners -= 1
                return
            wake = asyncio.get_running_loop().create_future()
            self.idle.append(wake)
            await wake

    async def run_job(self, job: Job, ctx: JobContext) -> None:
        slot = ctx._slot
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            await job(ctx)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it in order
            slot.error = exc
            self.failed = True
            if self.delivery == "completed":
                self.ready.append((_Failure(exc), 0))
        finally:
            self.inflight -= 1
            self.jobs_done += 1
            self.reserved_bytes -= slot.reserved
            slot.reserved = 0
            slot.done = True
            if self.delivery == "completed":
                del self.slots[slot.index]
            self.notify()  # a job slot is free: the launcher may be waiting for one

    def full(self) -> bool:
        return (
            self.buffered_items >= self.limits.queue_items
            or self.buffered_bytes >= self.limits.queue_bytes
        )

    def places(self, ahead: bool = False) -> int:
        """Jobs that may run at once: ``max_inflight``, twice that for jobs that read ahead
        (``ahead``) under interleaved delivery: each lane's next job fetches while the lane's
        job is delivered, else a lane waits out its next job's fetch whenever it moves on."""
        if ahead and self.delivery == "interleave":
            return 2 * self.limits.max_inflight
        return self.limits.max_inflight

    def room_for(self, index: int, ahead: bool = False) -> bool:
        """Whether job ``index`` may start now (always in job order); ``ahead``: it fetches all
        it holds before its first item (within its reservation), so it may start while the
        buffer is full, and twice as many such jobs may run under interleaved delivery."""
        if self.delivery == "interleave":
            # Every job a lane holds must run, or the round robin could wait on one that never
            # starts; memory stays bounded because emit() waits while the buffer is full.
            # A job may start before its lane takes it, its first item held in emit() until then:
            # when a lane's job has fetched all it reads, the next one sends its request while the
            # lane's last items are delivered, instead of the lane waiting out the server's first
            # byte (every shard). Jobs running stay within places(). This starts with the first
            # item delivered: before, it would share the connections with the reads the first
            # sample waits for.
            lookahead = self.limits.max_inflight if self.delivered_items else 0
            return index < self.next_index + lookahead
        if self.delivery == "ordered" and index >= self.head + self.limits.queue_items:
            return False  # the reorder window
        return ahead or not self.full()

    async def wait_for_room(self, index: int, fixed: int | None = None, ahead: bool = False) -> None:
        """Wait until job ``index`` may start: a free job slot and room in the buffer.

        The job slots are a plain count, not an ``anyio.Semaphore``: only this one task takes
        them, and a semaphore's ``acquire`` yields to the loop on every call even when a slot is
        free (one loop iteration per job, about a third of the engine's CPU per sample). Here
        the launcher starts jobs back to back until the limit, then sleeps until one finishes.
        """
        while not self.failed and not self.overdue(index) and not (
            self.launched - self.jobs_done < self.places(ahead)
            and self.room_for(index, ahead)
            and self.bytes_room(fixed)
        ):
            await self.wait_change()

    def overdue(self, index: int) -> bool:
        """Whether job ``index`` must start whatever the limits say: with a schedule, the
        consumer may wait for it while the buffer is full of items of jobs that started
        earlier but are due later (a long shard beside many small objects)."""
        return self.delivery == "scheduled" and index <= self.wanted

    def reservation(self, fixed: int | None = None) -> int:
        """What a job about to start reserves of ``inflight_bytes``: what it says it holds
        (``fixed``), else twice the largest item seen (its body arriving, then joined), or all
        of it before any size is known."""
        budget = self.limits.inflight_bytes or 0
        if fixed is not None:
            return min(fixed, budget)
        if not self.largest_item:
            return budget
        return min(2 * self.largest_item, budget)

    def bytes_room(self, fixed: int | None = None) -> bool:
        """Whether another job's reservation fits (one job may always run)."""
        if self.limits.inflight_bytes is None or self.launched == self.jobs_done:
            return True
        return self.reserved_bytes + self.reservation(fixed) <= self.limits.inflight_bytes

    async def emit(self, slot: Slot, item: Any, nbytes: int) -> None:
        # The job the consumer is parked on may deliver one item over a full buffer: making it
        # wait would deadlock (the room is held by other jobs' items). Only while the consumer
        # is parked: items it holds are freed by its next take(), so one over is the most.
        # A job that read ahead of its lane waits for the lane (its items would take the room).
        while (self.delivery == "interleave" and slot.index >= self.next_index) or (self.full() and not (
            self.waiting and self.delivery != "completed" and slot.index == self.wanted
            and not slot.items
        )):
            await self.wait_change()
        (self.ready if self.delivery == "completed" else slot.items).append((item, nbytes))
        if nbytes > self.largest_item:
            self.largest_item = nbytes
        self.buffered_items += 1
        self.buffered_bytes += nbytes
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
        self.notify()

    async def take(self, max_items: int, released: tuple[int, int] = (0, 0)) -> tuple[list[Any], tuple[int, int]]:
        """Runs in the loop on behalf of the consumer: the next items (``[]`` at the end) and
        their count and bytes, which stay in the buffer's counts until the consumer hands them
        back as ``released`` with its next call (it holds them until then)."""
        self.release(*released)
        self.taken = [0, 0]
        waited = False
        while True:
            if self.fatal is not None:
                raise self.fatal
            if waited and self.delivered_items and self.delivery != "scheduled":
                await self.gather(max_items)
            out = self.pop[self.delivery](self, max_items)
            if out:
                self.notify()
                return out, (self.taken[0], self.taken[1])
            if self.finished():
                return [], (0, 0)
            self.waiting = True
            if self.delivery == "scheduled" or self.full():
                self.notify()  # the wanted job may be parked in emit(); the launcher may hold it back
            try:
                await self.wait_change()
            finally:
                self.waiting = False
            waited = True

    async def gather(self, max_items: int) -> None:
        """The consumer waits on the fetch: let a few items gather before handing them over.

        Each hand-over is a hop between threads (~90 us of CPU across both); when the consumer
        outpaces the fetch, the first item to arrive would otherwise go alone, and a batch of 32
        take a dozen hops. Waiting ``GATHER_SECONDS`` unless ``GATHER_ITEMS`` are already in
        costs the consumer nothing it could use (a batch needs all its samples); it never
        applies to the first item of an iteration, to a full buffer, nor while no job runs
        (nothing more would come)."""
        if self.buffered_items >= min(max_items, GATHER_ITEMS) or self.full() or not self.inflight:
            return
        # one timer, not a wake-up per arriving item (which cost what the hop saved)
        loop = asyncio.get_running_loop()
        gathered = loop.create_future()
        timer = loop.call_later(GATHER_SECONDS, _wake, gathered)
        try:
            await gathered
        finally:
            timer.cancel()

    def pop_ordered(self, max_items: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < max_items and self.taken[1] < self.take_bytes:
            self.wanted = self.head
            slot = self.slots.get(self.head)
            if slot is None:
                break
            if slot.items:
                out.append(self.account(slot.items.popleft()))
                continue
            if not slot.done:
                break
            if slot.error is not None and out:
                break  # deliver what came before the error first
            del self.slots[self.head]
            self.head += 1
            if slot.error is not None:
                raise slot.error
        return out

    def pop_interleave(self, max_items: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < max_items and self.taken[1] < self.take_bytes and self.lanes:
            self.cursor %= len(self.lanes)
            index = self.wanted = self.lanes[self.cursor]
            slot = self.slots.get(index)
            if slot is None:
                if self.launch_done and index >= self.launched:
                    del self.lanes[self.cursor]  # no such job: the lane retires
                    continue
                break  # not started yet
            if slot.items:
                out.append(self.account(slot.items.popleft()))
                self.cursor += 1
                continue
            if not slot.done or (slot.error is not None and out):
                break
            del self.slots[index]
            if slot.error is not None:
                raise slot.error
            self.lanes[self.cursor] = self.next_index  # the lane takes the next job
            self.next_index += 1
            self.notify()  # the launcher may be waiting for that
        return out

    def pop_scheduled(self, max_items: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < max_items and self.taken[1] < self.take_bytes:
            if self.entry is None:
                self.entry = next(self.schedule, None)
                if self.entry is None:
                    self.end_schedule()
                    break
            index = self.wanted = self.entry
            slot = self.slots.get(index)
            if slot is None:
                if index < self.launched or self.launch_done:
                    self.entry = None  # a job that gave fewer items than scheduled, or none at all
                    continue
                break  # not started yet
            if slot.items:
                out.append(self.account(slot.items.popleft()))
                self.entry = None
                continue
            if not slot.done or (slot.error is not None and out):
                break
            del self.slots[index]
            self.entry = None
            if slot.error is not None:
                raise slot.error
        return out

    def end_schedule(self) -> None:
        """The schedule is exhausted: every job must have delivered all it emitted."""
        self.schedule_done = True
        left = [index for index, slot in self.slots.items() if slot.items]
        if left:
            raise RuntimeError(f"jobs {left[:5]} emitted more items than the schedule gave them")

    def pop_completed(self, max_items: int) -> list[Any]:
        out: list[Any] = []
        while self.ready and len(out) < max_items and self.taken[1] < self.take_bytes:
            item, _ = self.ready[0]
            if isinstance(item, _Failure):
                if out:
                    break
                self.ready.popleft()
                raise item.error
            out.append(self.account(self.ready.popleft()))
        return out

    def account(self, entry: tuple[Any, int]) -> Any:
        """An item handed over: delivered now, still buffered until the consumer releases it."""
        item, nbytes = entry
        self.taken[0] += 1
        self.taken[1] += nbytes
        self.delivered_items += 1
        self.delivered_bytes += nbytes
        return item

    def release(self, items: int, nbytes: int) -> None:
        """The consumer is done with the last batch: its room is free again."""
        if items:
            self.buffered_items -= items
            self.buffered_bytes -= nbytes
            self.notify()

    pop = {"ordered": pop_ordered, "interleave": pop_interleave, "completed": pop_completed,
           "scheduled": pop_scheduled}

    def finished(self) -> bool:
        if self.delivery == "scheduled":
            return self.schedule_done and self.launch_done and self.jobs_done == self.launched
        return (
            self.launch_done
            and self.jobs_done == self.launched
            and not self.ready
            and not self.slots
        )

    def notify(self) -> None:
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    async def wait_change(self) -> None:
        if self.changed is None:
            self.changed = anyio.Event()
        await self.changed.wait()


class _Failure(NamedTuple):
    """A job error queued in completion order (``ordered=False``)."""

    error: BaseException


def _wake(parked: asyncio.Future[None]) -> None:
    """Wake the task parked on ``parked`` (a runner, a gathering take); one cancelled meanwhile
    has nothing to wake."""
    if not parked.done():
        parked.set_result(None)
