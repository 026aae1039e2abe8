"""``ThrottleControl``'s rules on a simulated clock, one client at a time: each shape of limit is
met near its rate with few SlowDowns, SlowDowns at random cut little, and each constant of the
control has a test here or in test_throttle_sim.py that fails when it changes enough to matter
(docs/design/throttle.md lists which)."""

from __future__ import annotations

import math
import random

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from throttle_sim import Prefix, Server

from loader.s3 import throttle
from loader.s3.throttle import BACKOFF, MIN_RATE, RATE_WINDOW, RISE_FOUND, ThrottleControl

START = 1000.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def drive(control: ThrottleControl, clock: Clock, seconds: float, server: Server, *,
          demand: float = 1000.0, latency: float = 0.02) -> tuple[int, int]:
    """A client with ``demand`` requests/s ready, each waiting its turn under the control's limit
    and answered ``latency`` later by ``server`` (whose time is the clock's since ``START``).
    Returns (good answers, SlowDowns); every SlowDown is sent again like any request."""
    good = slow = 0
    end = clock.now + seconds
    pending: list[tuple[float, int, bool]] = []  # (answer due, generation, answered well)

    def answer() -> None:
        nonlocal good, slow
        due, generation, ok = pending.pop(0)
        clock.now = max(clock.now, due)
        if ok:
            good += 1
            control.on_answer(generation)
        else:
            slow += 1
            control.on_throttled(generation)

    while clock.now < end:
        turn = control.turn()
        while turn.due == math.inf:  # held for a place in the start window: an answer gives it
            answer()
        clock.now = max(turn.due, clock.now + 1.0 / demand)
        assert control.take(turn)
        pending.append((clock.now + latency, turn.generation, server.answers(clock.now - START)))
        while pending and pending[0][0] <= clock.now:
            answer()
    return good, slow


def sent_now(control: ThrottleControl) -> int:
    """Book a turn and send at once, whatever the limit says (a client that keeps its own pace);
    the generation to report the answer with."""
    turn = control.turn()
    turn.taken = True
    return turn.generation


@pytest.mark.parametrize("shape", ["bucket", "window"])
def test_each_shape_of_limit_is_met_near_its_rate_with_few_slowdowns(shape):
    clock = Clock()
    control = ThrottleControl(clock)
    good, slow = drive(control, clock, 30.0, Server(Prefix(rate=300.0, shape=shape)))
    assert control.rate is not None
    assert good / 30.0 >= 0.8 * 300, good / 30.0  # most of what the prefix allows ...
    assert slow <= 0.10 * (good + slow), (good, slow)  # ... with few SlowDowns
    assert control.congested()  # and no hedge while limited


def test_slowdowns_at_random_cost_little():
    """0.5 % of answers SlowDown whatever the rate (a server's hiccups): below TARGET_SHARE they
    never make a share that cuts (the control cannot tell a hiccup from a throttle otherwise)."""
    clock = Clock()
    control = ThrottleControl(clock)
    hiccups = random.Random(1)

    class Hiccups(Server):
        def answers(self, t: float) -> bool:
            return hiccups.random() >= 0.005

    good, slow = drive(control, clock, 30.0, Hiccups(Prefix()), demand=300.0)
    assert slow > 20 and good / 30.0 >= 0.95 * 300, (good, slow, control.rate)


def test_an_unused_limit_does_not_grow():
    clock = Clock()
    control = ThrottleControl(clock)
    drive(control, clock, 3.0, Server(Prefix(rate=100.0, shape="bucket")))
    limit = control.rate
    assert limit is not None
    clock.now += 5.0  # idle: nothing waits for a turn
    for _ in range(50):
        control.on_answer(control.generation)
    assert control.rate == limit


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.booleans()), max_size=300))
def test_the_limit_never_falls_below_its_floor(events):
    clock = Clock()
    control = ThrottleControl(clock)
    for gap, throttled in events:
        generation = sent_now(control)
        clock.now += gap
        control.on_throttled(generation) if throttled else control.on_answer(generation)
        assert control.rate is None or control.rate >= MIN_RATE


def test_a_jobs_first_burst_is_cut_within_two_slowdowns():
    """A job's first requests all go out at once and come back SlowDown: the limit comes after
    two, whatever the share rule's window (every request in flight would meet the throttle)."""
    clock = Clock()
    control = ThrottleControl(clock)
    generations = [sent_now(control) for _ in range(64)]
    clock.now += 0.05
    control.on_throttled(generations[0])
    assert control.rate is None
    control.on_throttled(generations[1])
    assert control.rate is not None and control.congested()
    assert control.generation == 1  # answers to the rest of the burst count towards no further cut
    for generation in generations[2:]:
        control.on_throttled(generation)
    assert control.cuts == 1


def test_a_cut_leaves_backoff_of_what_got_through():
    """Paced at 200/s, 20 % of answers SlowDown: the prefix took 160/s, the limit becomes
    BACKOFF x that (the share counted over the last second)."""
    clock = Clock()
    control = ThrottleControl(clock)
    control.rate = control.known = 200.0
    control.cut_at = clock.now - 10.0
    control.started = clock.now
    for i in range(200):  # one second at 200/s
        generation = sent_now(control)
        clock.now += 1 / 200
        control.on_throttled(generation) if i % 5 == 0 and i >= 150 else control.on_answer(generation)
        if control.cuts:
            break
    assert control.cuts == 1
    taken = 1 - 0.2 * 0.2 * 200 / (200 + 1 / throttle.TARGET_SHARE)  # about what the last second showed
    assert control.rate == pytest.approx(BACKOFF * 200 * taken, rel=0.15)


def test_cuts_come_at_most_once_per_rate_window():
    """A prefix counts a second: SlowDowns just after a cut answer what was sent before it
    (a share of them, not most), so the next cut waits RATE_WINDOW."""
    clock = Clock()
    control = ThrottleControl(clock)
    drive(control, clock, 5.0, Server(Prefix(rate=100.0, shape="bucket")))
    cuts = control.cuts
    cut_times = []
    for i in range(400):
        generation = sent_now(control)
        clock.now += 0.005
        control.on_throttled(generation) if i % 3 == 0 else control.on_answer(generation)
        if control.cuts > cuts:
            cut_times.append(clock.now)
            cuts = control.cuts
    assert len(cut_times) >= 2
    assert min(b - a for a, b in zip(cut_times, cut_times[1:])) >= RATE_WINDOW


def test_a_limit_that_doubles_is_found_within_rise_found():
    """Held at a token bucket of 200/s, which doubles after 20 s: within RISE_FOUND seconds of
    the rise the client gets 0.8x the new rate in a second."""
    clock = Clock()
    control = ThrottleControl(clock)
    server = Server(Prefix(rate=200.0, shape="bucket", rises_after=20.0))
    drive(control, clock, 20.0, server, demand=2000.0)
    seconds = []
    for _ in range(int(RISE_FOUND)):
        seconds.append(drive(control, clock, 1.0, server, demand=2000.0)[0])
        if seconds[-1] >= 0.8 * 400:
            break
    assert seconds[-1] >= 0.8 * 400, (seconds, control.rate)


def test_a_full_limit_is_waited_out_and_its_rate_found_again():
    """A sliding second that let a burst through refuses the rest of its second: the control
    sends little until it opens (not its limit's worth of SlowDowns), then is back near the
    rate that got through within a few tenths of a second (RECOVER_DOUBLING)."""
    clock = Clock()
    control = ThrottleControl(clock)
    server = Server(Prefix(rate=300.0, shape="window"))
    good, slow = drive(control, clock, 1.0, server, demand=5000.0)
    # ~100 SlowDowns are the burst's own (in flight when it met the limit), then few: a limit at the
    # rate that got through would have met the closed second ~280 times more
    assert good <= 300 and slow <= 200, (good, slow)
    good, slow = drive(control, clock, 2.0, server, demand=5000.0)
    # the next two seconds: 435 of 600 here (RECOVER_DOUBLING 0.4 s instead of 0.1: 95)
    assert good >= 0.6 * 600 and slow <= 0.1 * (good + slow), (good, slow)


def test_waiting_requests_go_sooner_in_their_order_when_the_limit_grows():
    """Requests booked far ahead at a low limit go sooner once it grows (they look every
    RECHECK), in the order they were booked: delivery in order waits for the first sample of a
    batch, and requests that booked again at their own looks went in the order of their looks."""
    control = ThrottleControl()
    control.rate = control.known = 2.0  # two a second: 20 requests would wait 10 s
    control.cut_at = control.clock() - 100.0
    order: list[int] = []

    async def one(i: int) -> None:
        await anyio.sleep(0.013 * i)  # booked in this order, each looking on its own phase
        await control.acquire()
        order.append(i)

    async def main() -> float:
        started = control.clock()
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
                await anyio.sleep(0.3)
                with control.lock:
                    control.rate = 20.0  # as a probe that found a rise would: 20 go in a second
                    control._reschedule(control.clock(), control.clock(), cut=False)
        return control.clock() - started

    assert anyio.run(main) < 3.0  # not the 10 s they were booked for
    # in order, but for what a look every RECHECK lets pass (20 a second: 2); booking again at
    # their own looks, the eighth went last
    assert all(order.index(i) <= i + 20 * throttle.RECHECK for i in range(20)), order
    assert control.requests == 20  # each counted once


@pytest.mark.parametrize("quiet", [60.0, 3600.0])
def test_a_limit_held_long_after_its_last_cut_grows_without_overflow(quiet):
    """A limit cut once, then holding requests back for a long quiet stretch: its growth (twice
    as fast for each quiet second) reaches its ceiling instead of overflowing ``math.exp`` (which
    raised OverflowError in a job's second minute after a cut)."""
    clock = Clock()
    control = ThrottleControl(clock)
    control.rate = control.known = 100.0
    control.cut_at = clock.now
    control.clean = 10**6
    clock.now += quiet
    for _ in range(200):  # demand beyond the limit: the limit holds turns back, so it grows
        generation = sent_now(control)
        clock.now += 0.002
        control.on_answer(generation)
    assert control.rate is not None and math.isfinite(control.rate) and control.rate > 100.0


def test_a_full_sliding_second_is_waited_out_before_sending_again():
    """A process that got 150 answers through in the last second meets a full limit (most
    answers SlowDown): a sliding second still counts those 150, so nothing goes until they have
    fallen below the limit it goes back to; then it sends at that limit, not from nothing."""
    clock = Clock()
    control = ThrottleControl(clock)
    control.rate = control.known = 120.0
    control.cut_at = control.started = clock.now - 10.0
    first_answer = clock.now
    for _ in range(150):  # 150 answered well within this second
        control.answered.append(clock.now)
        clock.now += 0.004
    generation = control.generation
    for _ in range(3):
        control.turn()
        control.on_throttled(generation)
    assert control.cuts == 1
    known = control.known
    assert control.rate == known  # straight back to what got through ...
    wait = control.turn().due - clock.now
    # ... once the oldest of the 150 have left the second: 150 - known of them
    assert wait >= first_answer + (150 - int(known)) * 0.004 + RATE_WINDOW - clock.now - 0.005, (wait, known)


def test_a_limit_others_took_costs_few_slowdowns():
    """A process that got its share for a second, then nothing (others took the whole limit):
    answered only SlowDown, it falls to MIN_RATE between its tries to grow back, so ten seconds
    of refusals cost 251 SlowDowns here (a floor of 5 GET/s: 342; 20: 456)."""
    clock = Clock()
    control = ThrottleControl(clock)

    class TakenAfterASecond(Server):
        def answers(self, t: float) -> bool:
            return t < 1.0

    server = TakenAfterASecond(Prefix(rate=300.0))
    drive(control, clock, 1.0, server, demand=300.0)
    good, slow = drive(control, clock, 10.0, server, demand=300.0)
    assert good == 0 and slow <= 300, (good, slow)


def test_a_limit_grows_while_every_request_waits():
    """Cut to its floor with 20 requests booked a second apart and none booking since (each
    waits for its turn): their looks grow the limit back towards what got through, and move
    their turns sooner. Grown only by new bookings, the last would have waited 19 s (one rank of
    2 x 4 DataLoader workers through the proxy waited 30-45 s so)."""
    clock = Clock()
    control = ThrottleControl(clock)
    control.rate, control.known = MIN_RATE, 100.0
    control.cut_at = control.grown_at = clock.now
    turns = [control.turn() for _ in range(20)]
    assert turns[-1].due - clock.now >= 18.0
    clock.now += 0.5
    assert not control.take(turns[-1])  # a look: not its turn yet ...
    assert turns[-1].due - clock.now < 1.0, (turns[-1].due - clock.now, control.rate)  # ... but soon
    assert [t.due for t in turns[1:]] == sorted(t.due for t in turns[1:])  # in the order booked


async def until(condition) -> None:
    """Yield to the other tasks until ``condition()`` holds (a hang guard, not a time bound)."""
    with anyio.fail_after(30):
        while not condition():
            await anyio.sleep(0.001)


@pytest.fixture
def rank_of_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is one rank of a job of 8 (as torchrun says it): 8 processes read."""
    import torch  # noqa: F401 - a process counts ranks only where torch runs (``topology.readers``)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")


@pytest.mark.parametrize(("world_size", "window"), [(None, 64), ("2", 64), ("4", 32), ("8", 16), ("64", 16)])
def test_a_jobs_processes_share_its_start_window(monkeypatch, world_size, window):
    """Before any limit is known, the reads a process sends at once are its share of
    ``JOB_START_WINDOW`` (at least ``START_WINDOW``): a process alone, or one of 2, sends the
    engine's 64 at once (nothing to ramp up each epoch on a clean server); one of 8 or more, 16."""
    import torch  # noqa: F401 - a process counts ranks only where torch runs (``topology.readers``)

    from loader.s3.throttle import ThrottledStore
    from loader.testing import MemoryStore

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world_size is not None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", world_size)
    gate = anyio.Event()
    store = MemoryStore.with_objects("b", {f"k{i}": b"x" for i in range(64)}, gate=gate)
    reads = ThrottledStore(store, endpoint=f"memory:share-{world_size}")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(reads.get, "b", f"k{i}")
            await until(lambda: store.requests == window)
            await anyio.sleep(0.05)
            assert store.requests == window  # the rest wait for answers
            gate.set()
        assert store.requests == 64

    anyio.run(main)


@given(readers=st.integers(min_value=1, max_value=100_000))
def test_the_start_window_is_a_share_of_the_jobs_with_a_floor(readers):
    from loader.s3.throttle import JOB_START_WINDOW, START_WINDOW, start_window

    window = start_window(readers)
    assert window >= START_WINDOW  # however many processes
    assert window * readers > JOB_START_WINDOW - readers  # the job's window, up to each share's rounding
    if readers <= JOB_START_WINDOW // START_WINDOW:
        assert window * readers <= JOB_START_WINDOW  # and no more, until the floor takes over
    assert start_window(readers + 1) <= window  # more processes: no more each


def test_before_any_limit_a_process_starts_with_start_window_in_flight(rank_of_eight):
    """64 reads at once (the engine's requests in flight) before any limit is known, in a rank
    of a job of 8: the store sees ``START_WINDOW`` of them before the first answer, then two
    more for each good answer (the window grows by one, and the answered place is free), and
    all 64 once they are answered."""
    from loader.s3.throttle import START_WINDOW, ThrottledStore
    from loader.testing import MemoryStore

    first, second = anyio.Event(), anyio.Event()
    store = MemoryStore.with_objects("b", {f"k{i}": b"x" for i in range(64)}, gate=first)
    reads = ThrottledStore(store, endpoint="memory:slow-start")
    control = reads.control("b")
    control.clock = lambda: 0.0  # a stalled test must not see a held read's longest wait pass
    got: list[bytes] = []

    async def read(i: int) -> None:
        got.append(await reads.get("b", f"k{i}"))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(read, i)
            await until(lambda: store.requests == START_WINDOW and len(control.held) == 64 - START_WINDOW)
            await anyio.sleep(0.05)
            assert store.requests == START_WINDOW  # the rest wait for answers
            store.gate = second
            first.set()  # the first window is answered
            await until(lambda: store.requests == 3 * START_WINDOW)
            await anyio.sleep(0.05)
            assert store.requests == 3 * START_WINDOW and control.window == 2 * START_WINDOW
            store.gate = None
            second.set()
        assert len(got) == 64 and store.requests == 64
        assert control.inflight == 0 and control.rate is None and control.throttled == 0

    anyio.run(main)


def test_a_read_held_by_the_start_window_goes_after_rate_window_whatever_holds_the_places():
    """The start window is for the first round trips: a read held a whole ``RATE_WINDOW`` goes,
    even while every place is held by reads never answered (a place lost to an accounting slip
    costs a second, never a hang)."""
    from loader.s3.throttle import RATE_WINDOW, START_WINDOW

    clock = Clock()
    control = ThrottleControl(clock)
    for _ in range(START_WINDOW):
        assert control.take(control.turn())
    held = control.turn()
    assert not control.take(held)
    clock.now += RATE_WINDOW / 2
    assert not control.take(held)
    clock.now += RATE_WINDOW / 2
    assert control.take(held) and control.inflight == START_WINDOW + 1


def test_a_read_cancelled_or_failed_gives_its_place_in_the_start_window_back(rank_of_eight):
    """Reads cancelled while they wait at the store (a hedge that lost) and reads that fail free
    their places: the next reads go, none waits for an answer that never comes."""
    from loader.errors import NoSuchKeyError
    from loader.s3.throttle import START_WINDOW, ThrottledStore
    from loader.testing import MemoryStore

    gate = anyio.Event()
    store = MemoryStore.with_objects("b", {f"k{i}": b"x" for i in range(64)}, gate=gate)
    reads = ThrottledStore(store, endpoint="memory:slow-start-cancel")
    control = reads.control("b")

    async def main() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(reads.get, "b", f"k{i}")
                await until(lambda: store.requests == START_WINDOW)
                scope.cancel()
        assert control.inflight == 0  # every place given back
        store.gate = None
        with pytest.raises(NoSuchKeyError):
            await reads.get("b", "missing")
        assert control.inflight == 0
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(reads.get, "b", f"k{i}")
        assert control.inflight == 0 and not [t for t in control.held if not t.taken]

    anyio.run(main)


def test_a_cut_before_any_limit_books_the_held_requests_under_it():
    """The first cut comes while requests wait for a place in the start window: they are booked
    under the new limit, in their order, paced at it (not let go at once, not lost)."""
    from loader.s3.throttle import START_WINDOW

    clock = Clock()
    control = ThrottleControl(clock)
    turns = [control.turn() for _ in range(64)]
    assert sum(t.taken for t in turns) == START_WINDOW
    held = turns[START_WINDOW:]
    assert all(t.due == math.inf for t in held)
    clock.now += 0.02
    for _ in range(3):
        control.on_throttled(0)
    assert control.rate is not None and control.cuts == 1
    dues = [t.due for t in held]
    assert all(math.isfinite(d) for d in dues) and dues == sorted(dues)
    assert dues[-1] - dues[0] >= (len(held) - 1) / control.rate - 1e-6  # paced under the limit
