"""The delivery orders: which job may start, where its items wait, which item goes next.

One class per ``EngineLimits.delivery`` mode, each readable alone; ``DeliveryPolicy`` holds what they
share and the defaults. A policy sees the core (``core.EngineCore``) through ``Core``: the slots,
the counters, the buffer's fullness, the consumer's wait, ``account`` for an item handed over
and ``take_more`` for the batch's bounds. Runs only in the engine's loop thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple, NoReturn, Protocol

from .limits import Counts, EngineLimits
from .tuning import Tuning

Entry = tuple[Any, int]
"""An item and its bytes."""


class Slot:
    """One job's place in the delivery order: its pending items and how it ended."""

    __slots__ = ("index", "items", "done", "error", "reserved")

    def __init__(self, index: int) -> None:
        self.index = index
        self.items: deque[Entry] = deque()
        self.done = False
        self.error: BaseException | None = None
        self.reserved = 0  # bytes of ``inflight_bytes`` this job holds while it runs


def raise_error(slot: Slot) -> NoReturn:
    """Raise the job's error, which the slot no longer holds from then on: the error's traceback
    holds every frame that held the slot (the job's, the consumer's up to its DataLoader
    iterator), so a slot keeping it would keep them all until a garbage collection."""
    error, slot.error = slot.error, None
    assert error is not None
    try:
        raise error
    finally:
        del error  # nor this frame, which the traceback holds too


class Core(Protocol):
    """What a delivery policy sees of the core."""

    limits: EngineLimits
    tuning: Tuning
    counts: Counts
    slots: dict[int, Slot]  # launched and not yet drained
    launch_done: bool  # no job will start any more
    waiting: bool  # the consumer is parked in take(), holding nothing

    def full(self) -> bool: ...
    def notify(self) -> None: ...
    def take_more(self, out: list[Any], max_items: int) -> bool: ...
    def account(self, entry: Entry) -> Any: ...


class DeliveryPolicy:
    """What every order shares: items wait in their job's slot, a job starts while the buffer has
    room (one that fetches all it holds first, ``ahead``, at any time), and the job the consumer
    is parked on may put one item over a full buffer (waiting would deadlock: the room is held
    by other jobs' items; the consumer frees it with its next take, so one over is the most)."""

    lead = True  # the first job's item is the first delivered: it may run alone a moment
    gathers = True  # a waiting consumer may let a few items gather (``Tuning.gather_s``)

    def __init__(self, core: Core) -> None:
        self.core = core  # which holds this policy: ``detach`` ends the cycle once the engine closes
        self.wanted = 0  # the job whose next item the consumer is waiting for

    def places(self, ahead: bool = False) -> int:
        """Jobs that may run at once (``ahead``: jobs that fetch all they hold first)."""
        return self.core.limits.max_inflight

    def may_start(self, index: int, ahead: bool) -> bool:
        """Whether job ``index`` may start now, as far as the order goes (jobs start in order)."""
        return ahead or not self.core.full()

    def must_start(self, index: int) -> bool:
        """Whether job ``index`` starts whatever the limits say (the consumer waits for it)."""
        return False

    def holds(self, slot: Slot) -> bool:
        """Whether ``slot``'s job must wait before putting an item, room or not."""
        return False

    def may_overfill(self, slot: Slot) -> bool:
        """Whether ``slot``'s job may put one item over a full buffer."""
        return self.core.waiting and slot.index == self.wanted and not slot.items

    def put(self, slot: Slot, entry: Entry) -> None:
        slot.items.append(entry)

    def failed(self, slot: Slot, exc: BaseException) -> None:
        """``slot``'s job raised ``exc`` (already recorded on the slot)."""

    def ended(self, slot: Slot) -> None:
        """``slot``'s job returned or raised."""

    def pop(self, max_items: int) -> list[Any]:
        """The next items for the consumer, at most ``max_items``; raises a job's error in turn."""
        raise NotImplementedError

    def finished(self) -> bool:
        core = self.core
        return core.launch_done and core.counts.jobs_done == core.counts.launched and not core.slots

    def detach(self) -> None:
        """The engine is closed: let go of the core (a weak reference here would cost every item
        its indirection) and of any item never delivered."""
        del self.core


class Ordered(DeliveryPolicy):
    """Every item of job 0, then of job 1, ...; jobs start at most ``queue_items`` ahead of the
    one being delivered (the reorder window)."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.head = 0  # the job being delivered

    def may_start(self, index: int, ahead: bool) -> bool:
        if index >= self.head + self.core.limits.queue_items:
            return False
        return super().may_start(index, ahead)

    def pop(self, max_items: int) -> list[Any]:
        core = self.core
        out: list[Any] = []
        while core.take_more(out, max_items):
            self.wanted = self.head
            slot = core.slots.get(self.head)
            if slot is None:
                break
            if slot.items:
                out.append(core.account(slot.items.popleft()))
                continue
            if not slot.done:
                break
            if slot.error is not None and out:
                break  # deliver what came before the error first
            del core.slots[self.head]
            self.head += 1
            if slot.error is not None:
                raise_error(slot)
        return out


class Interleaved(DeliveryPolicy):
    """One item at a time from ``max_inflight`` jobs in turn: a round robin over lanes, a lane
    that finishes its job taking the next one. Every job a lane holds must run, or the round
    robin could wait on one that never starts; memory stays bounded because ``emit`` waits while
    the buffer is full. A lane's next job may start before the lane takes it
    (``Tuning.lane_lookahead``, ``Tuning.ahead_places``), its items held until then."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.lanes = list(range(core.limits.max_inflight))  # the job of each lane
        self.cursor = 0  # the lane whose turn it is
        self.next_index = core.limits.max_inflight  # the job the next free lane takes

    def places(self, ahead: bool = False) -> int:
        limit = self.core.limits.max_inflight
        return self.core.tuning.ahead_places * limit if ahead else limit

    def may_start(self, index: int, ahead: bool) -> bool:
        # From the first item delivered on (before, it would share the connections with the
        # reads the first sample waits for), a lane's next job may send its request while the
        # lane's last items are delivered. Jobs running stay within places().
        core = self.core
        lookahead = core.limits.max_inflight if core.tuning.lane_lookahead and core.counts.delivered_items else 0
        return index < self.next_index + lookahead

    def holds(self, slot: Slot) -> bool:
        return slot.index >= self.next_index  # read ahead of its lane: its items would take the room

    def pop(self, max_items: int) -> list[Any]:
        core = self.core
        out: list[Any] = []
        while core.take_more(out, max_items) and self.lanes:
            self.cursor %= len(self.lanes)
            index = self.wanted = self.lanes[self.cursor]
            slot = core.slots.get(index)
            if slot is None:
                if core.launch_done and index >= core.counts.launched:
                    del self.lanes[self.cursor]  # no such job: the lane retires
                    continue
                break  # not started yet
            if slot.items:
                out.append(core.account(slot.items.popleft()))
                self.cursor += 1
                continue
            if not slot.done or (slot.error is not None and out):
                break
            del core.slots[index]
            if slot.error is not None:
                raise_error(slot)
            self.lanes[self.cursor] = self.next_index  # the lane takes the next job
            self.next_index += 1
            core.notify()  # the launcher may be waiting for that
        return out


class Completed(DeliveryPolicy):
    """Items as they arrive, from any job (fastest, not repeatable); a job's error takes its
    place among them."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.ready: deque[Entry] = deque()

    def may_overfill(self, slot: Slot) -> bool:
        return False  # the consumer takes whatever is ready: it never waits on one job

    def put(self, slot: Slot, entry: Entry) -> None:
        self.ready.append(entry)

    def failed(self, slot: Slot, exc: BaseException) -> None:
        self.ready.append((_Failure(slot), 0))

    def ended(self, slot: Slot) -> None:
        del self.core.slots[slot.index]

    def pop(self, max_items: int) -> list[Any]:
        core = self.core
        out: list[Any] = []
        while self.ready and core.take_more(out, max_items):
            item, _ = self.ready[0]
            if isinstance(item, _Failure):
                if out:
                    break
                self.ready.popleft()
                raise_error(item.slot)
            out.append(core.account(self.ready.popleft()))
        return out

    def finished(self) -> bool:
        return super().finished() and not self.ready

    def detach(self) -> None:
        self.ready.clear()
        super().detach()


class Scheduled(DeliveryPolicy):
    """Follows a schedule: the job index of every item, in delivery order (jobs numbered in the
    order of their first entry). The job the consumer waits for starts whatever the limits say:
    the buffer may be full of items of jobs that started earlier but are due later (a long shard
    beside many small objects). No lead (the first item may come from another job than the
    first) and no gathering."""

    lead = False
    gathers = False

    def __init__(self, core: Core, schedule: Iterable[int]) -> None:
        super().__init__(core)
        self.schedule = iter(schedule)
        self.entry: int | None = None  # the schedule's current entry
        self.done = False

    def must_start(self, index: int) -> bool:
        return index <= self.wanted

    def pop(self, max_items: int) -> list[Any]:
        core = self.core
        out: list[Any] = []
        while core.take_more(out, max_items):
            if self.entry is None:
                self.entry = next(self.schedule, None)
                if self.entry is None:
                    self.end()
                    break
            index = self.wanted = self.entry
            slot = core.slots.get(index)
            if slot is None:
                if index < core.counts.launched or core.launch_done:
                    self.entry = None  # a job that gave fewer items than scheduled, or none at all
                    continue
                break  # not started yet
            if slot.items:
                out.append(core.account(slot.items.popleft()))
                self.entry = None
                continue
            if not slot.done or (slot.error is not None and out):
                break
            del core.slots[index]
            self.entry = None
            if slot.error is not None:
                raise_error(slot)
        return out

    def end(self) -> None:
        """The schedule is exhausted: every job must have delivered all it emitted."""
        self.done = True
        left = [index for index, slot in self.core.slots.items() if slot.items]
        if left:
            raise RuntimeError(f"jobs {left[:5]} emitted more items than the schedule gave them")

    def finished(self) -> bool:
        core = self.core
        return self.done and core.launch_done and core.counts.jobs_done == core.counts.launched


def delivery_for(core: Core, schedule: Iterable[int] | None) -> DeliveryPolicy:
    """The policy of ``EngineLimits.delivery``."""
    mode = core.limits.delivery
    if mode == "scheduled":
        assert schedule is not None  # FetchEngine checks it
        return Scheduled(core, schedule)
    return {"ordered": Ordered, "interleave": Interleaved, "completed": Completed}[mode](core)


class _Failure(NamedTuple):
    """A job's error queued in completion order (on its slot)."""

    slot: Slot
