"""FetchEngine against the in-memory store: bounds measured by the store, order, errors, cleanup."""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import logging
import os
import random
import signal
import threading
import time

import anyio
import anyio.lowlevel
import pytest

from loader.engine.core import run_all
from loader.engine.fetch import EngineLimits, FetchEngine, Job, Tuning, live_engines
from loader.errors import AccessDeniedError, ConfigError, NoSuchKeyError, say_skipped

from fakes import FakeStore, payloads, reusable
from waiting import wait_stable, wait_until

BUCKET = "b"


def fetch_jobs(keys):
    """Jobs that GET each key and emit ``(position, bytes)``."""

    def job_for(position, key):
        async def job(ctx):
            data = await ctx.store.get(BUCKET, key)
            await ctx.emit((position, data), len(data))

        return job

    return (job_for(position, key) for position, key in enumerate(keys))


def make(n=200, size=100, **store_options):
    objects = payloads(n, size)
    return objects, FakeStore.with_objects(BUCKET, objects, **store_options)


def test_ordered_delivery_returns_every_item_in_job_order(no_leaked_threads):
    objects, fake = make(300, latency=lambda key: random.uniform(0, 0.005))
    keys = sorted(objects)
    with FetchEngine(fetch_jobs(keys), reusable(fake), limits=EngineLimits(max_inflight=16)) as engine:
        got = list(engine)
    assert [position for position, _ in got] == list(range(len(keys)))
    assert [data for _, data in got] == [objects[key] for key in keys]
    assert fake.closed, "the engine must close the store it opened"


def test_as_completed_delivery_returns_every_item_once(no_leaked_threads):
    objects, fake = make(300, latency=lambda key: random.uniform(0, 0.005))
    keys = sorted(objects)
    limits = EngineLimits(max_inflight=16, delivery="completed")
    got = list(FetchEngine(fetch_jobs(keys), reusable(fake), limits=limits))
    assert sorted(position for position, _ in got) == list(range(len(keys)))
    assert fake.requests == len(keys)


@pytest.mark.parametrize("max_inflight", [1, 4, 32])
def test_inflight_requests_never_exceed_max_inflight(max_inflight, no_leaked_threads):
    objects, fake = make(200, latency=0.002)
    limits = EngineLimits(max_inflight=max_inflight)
    assert len(list(FetchEngine(fetch_jobs(sorted(objects)), reusable(fake), limits=limits))) == 200
    assert fake.peak_inflight <= max_inflight
    assert fake.peak_inflight == max_inflight, "with enough work the limit should be reached"


def test_slow_consumer_pauses_fetching_and_bounds_buffered_bytes(no_leaked_threads):
    size, budget, inflight = 10_000, 50_000, 4
    objects, fake = make(500, size=size)
    limits = EngineLimits(max_inflight=inflight, queue_bytes=budget, queue_items=1000)
    engine = FetchEngine(fetch_jobs(sorted(objects)), reusable(fake), limits=limits)
    iterator = iter(engine)
    next(iterator)  # consumer takes one item, then stops reading
    # First see the situation under test: the buffer at its budget, fetching paused.
    wait_until(lambda: engine.statistics().buffered_bytes >= budget - size, "the buffer fills")
    # settled for 1 s, not 0.3: a starved engine thread can go 0.3 s between its last requests
    requests_when_paused = wait_stable(lambda: fake.requests, "the request count", quiet=1.0)
    time.sleep(0.3)
    assert fake.requests == requests_when_paused, "the store kept receiving requests"
    assert requests_when_paused >= budget // size, "the buffer was filled by real requests"
    # The documented bound: budget + in-flight requests (+ one batch handed to the consumer).
    assert requests_when_paused <= budget // size + inflight + 1 + 256
    stats = engine.statistics()
    assert stats.buffered_bytes <= budget + inflight * size
    assert stats.peak_buffered_bytes <= budget + inflight * size
    rest = list(iterator)  # resuming the consumer resumes fetching, nothing lost
    assert len(rest) == 499
    assert engine.statistics().peak_buffered_bytes <= budget + inflight * size


def test_item_count_bound_pauses_fetching(no_leaked_threads):
    objects, fake = make(500, size=10)
    limits = EngineLimits(max_inflight=4, queue_items=20)
    engine = FetchEngine(fetch_jobs(sorted(objects)), reusable(fake), limits=limits)
    iterator = iter(engine)
    next(iterator)
    wait_until(lambda: engine.statistics().buffered_items >= 20 - 1, "the buffer holds its item limit")
    requests = wait_stable(lambda: fake.requests, "the request count")
    assert engine.statistics().peak_buffered_bytes <= (20 + 4) * 10
    assert 20 <= requests <= 20 + 4 + 256 + 1
    engine.close()


def test_break_after_ten_items_leaves_no_thread_task_or_engine(no_leaked_threads):
    objects, fake = make(1000, latency=0.001)
    limits = EngineLimits(max_inflight=8, queue_items=50)  # so that fetching must wait for us
    engine = FetchEngine(fetch_jobs(sorted(objects)), reusable(fake), limits=limits)
    for count, _ in enumerate(engine, start=1):
        if count == 10:
            break
    del _
    gc.collect()
    assert live_engines() == 0
    assert fake.closed
    assert fake.inflight == 0, "cancelled requests must finish their cleanup"
    assert fake.requests < 1000, "breaking early must stop fetching"


def test_dropping_the_iterator_closes_the_engine(no_leaked_threads):
    objects, fake = make(1000, latency=0.001)
    iterator = iter(FetchEngine(fetch_jobs(sorted(objects)), reusable(fake)))
    next(iterator)
    del iterator
    gc.collect()
    assert live_engines() == 0
    assert fake.closed


def test_a_started_engine_that_is_never_closed_warns():
    objects, fake = make(10)
    engine = FetchEngine(fetch_jobs(sorted(objects)), reusable(fake))
    engine.start()
    with pytest.warns(ResourceWarning, match="unclosed"):
        del engine
        gc.collect()
    assert live_engines() == 0


def test_a_fetch_error_names_the_key_after_earlier_items_are_delivered(no_leaked_threads):
    denied = AccessDeniedError("denied: train/000020.bin", bucket=BUCKET, key="train/000020.bin")
    objects, fake = make(50, fail={"train/000020.bin": denied})
    got = []
    with pytest.raises(AccessDeniedError, match="000020") as info:
        for item in FetchEngine(fetch_jobs(sorted(objects)), reusable(fake), limits=EngineLimits(max_inflight=8)):
            got.append(item[0])
    assert got == list(range(20)), "everything before the failing key must be delivered first"
    assert info.value.key == "train/000020.bin"


def test_a_missing_key_fails_fast_in_as_completed_mode(no_leaked_threads):
    objects, fake = make(50)
    keys = sorted(objects) + ["train/missing.bin"]
    with pytest.raises(NoSuchKeyError, match="missing.bin"):
        list(FetchEngine(fetch_jobs(keys), reusable(fake), limits=EngineLimits(delivery="completed")))


@pytest.mark.parametrize("delivery", ["ordered", "interleave", "completed", "scheduled", "store fails"])
def test_an_error_the_consumer_caught_keeps_no_engine_alive(delivery, no_leaked_threads):
    """The engine kept a job's error on its slot (a store's, on the engine's core): the error's
    traceback holds every frame that held them, up to the consumer's iterator, a cycle that
    kept the engine, its buffer and the user's DataLoader iterator until a garbage collection.
    Raised once, it is let go: caught and dropped, nothing of the engine outlives its last
    reference."""
    import weakref

    objects, fake = make(20, fail={"train/000012.bin": NoSuchKeyError("gone", bucket=BUCKET, key="train/000012.bin")})
    keys = sorted(objects)
    limits = EngineLimits(max_inflight=4, delivery="ordered" if delivery == "store fails" else delivery)
    schedule = range(len(keys)) if delivery == "scheduled" else None

    async def broken():
        raise ConfigError("no credentials")

    gc.collect()
    gc.disable()  # only references may free it
    try:
        engine = FetchEngine(fetch_jobs(keys), broken if delivery == "store fails" else reusable(fake),
                             limits=limits, schedule=schedule)
        core = weakref.ref(engine._core)
        try:  # not pytest.raises: its ExceptionInfo would keep the error, and so the engine
            for _ in engine:
                pass
        except (NoSuchKeyError, ConfigError) as exc:
            error = type(exc)
        else:
            raise AssertionError("the error was not raised")
        assert error is (ConfigError if delivery == "store fails" else NoSuchKeyError)
        freed = weakref.ref(engine)
        del engine
        assert freed() is None and core() is None, "the caught error kept the engine"
    finally:
        gc.enable()


@pytest.mark.parametrize("delivery", ["ordered", "interleave", "completed"])
def test_an_iteration_left_early_frees_the_items_it_never_delivered(delivery, no_leaked_threads):
    """A consumer that leaves mid-epoch (a ``break``, a validation pass of N batches) drops the
    buffer with its iterator: the items fetched and never delivered (up to ``queue_bytes``), and
    those the jobs cancelled mid-flight were emitting, do not wait for a garbage collection
    (anyio keeps a cancelled task's error in a cycle with its traceback, and so its frames)."""
    import weakref

    class Item:
        pass

    made: list[weakref.ref] = []

    def jobs():
        for _ in range(40):
            async def job(ctx):
                for _ in range(5):
                    item = Item()
                    made.append(weakref.ref(item))
                    await ctx.emit(item, 1000)
            yield job

    gc.collect()
    gc.disable()  # only references may free them
    try:
        iterator = iter(FetchEngine(jobs(), reusable(FakeStore()),
                                    limits=EngineLimits(max_inflight=8, queue_items=64, delivery=delivery)))
        first = next(iterator)
        wait_until(lambda: len(made) >= 40, "the buffer to fill behind the consumer", timeout=30)
        del iterator
        alive = sum(ref() is not None for ref in made)
        assert alive == 1, f"{alive - 1} items never delivered outlived the iterator"
        del first
    finally:
        gc.enable()


def test_a_store_that_cannot_open_reports_why(no_leaked_threads):
    async def broken():
        raise ConfigError("no credentials for endpoint 'http://127.0.0.1:1'")

    with pytest.raises(ConfigError, match="no credentials"):
        list(FetchEngine(fetch_jobs(["k"]), broken))


def test_no_jobs_means_an_empty_iteration(no_leaked_threads):
    _, fake = make(0)
    assert list(FetchEngine(iter(()), reusable(fake))) == []


@pytest.mark.parametrize("name,value", [("max_inflight", 0), ("max_inflight", -3), ("queue_bytes", 0),
                                        ("queue_items", 1.5)])
def test_invalid_limits_are_rejected_at_construction(name, value):
    with pytest.raises(ConfigError, match=name):
        EngineLimits(**{name: value})


def test_a_closed_engine_cannot_be_iterated_again():
    objects, fake = make(5)
    engine = FetchEngine(fetch_jobs(sorted(objects)), reusable(fake))
    assert len(list(engine)) == 5
    with pytest.raises(RuntimeError, match="closed"):
        list(engine)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_fork_after_three_engine_runs_does_not_hang(no_leaked_threads):
    """The hazard from FIELD_NOTES: engines run in the parent, then a forked child runs one."""
    objects, fake = make(100, latency=0.0005)
    for _ in range(3):
        assert len(list(FetchEngine(fetch_jobs(sorted(objects)), reusable(fake)))) == 100
    # Also an engine still running at fork time: the child must forget it, not touch it.
    running = iter(FetchEngine(fetch_jobs(sorted(objects)), reusable(fake)))
    next(running)
    pid = os.fork()
    if pid == 0:  # child: run a fresh engine; exit code says whether it worked
        code = 1
        try:
            signal.alarm(20)
            code = 0 if len(list(FetchEngine(fetch_jobs(sorted(objects)), reusable(fake)))) == 100 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("forked child hung")
    del running
    gc.collect()
    assert os.waitstatus_to_exitcode(status) == 0
    assert threading.active_count() >= 1


def stream_jobs(lengths, latency=0.0):
    """Jobs that emit ``(job, i)`` for i in range(length), sleeping a random bit between items."""
    import anyio

    def job_for(position, length):
        async def job(ctx):
            rng = random.Random(position)
            for i in range(length):
                if latency:
                    await anyio.sleep(rng.uniform(0, latency))
                await ctx.emit((position, i), 10)

        return job

    return [job_for(position, length) for position, length in enumerate(lengths)]


def test_interleave_is_round_robin_over_lanes_and_repeatable(no_leaked_threads):
    lengths = [5, 1, 3, 0, 7, 2, 4]
    runs = []
    for _ in range(3):
        limits = EngineLimits(max_inflight=3, delivery="interleave", queue_items=4)
        runs.append(list(FetchEngine(stream_jobs(lengths, latency=0.002), reusable(FakeStore()), limits=limits)))
    assert runs[0] == runs[1] == runs[2], "interleaving must not depend on timing"
    got = runs[0]
    assert sorted(got) == sorted((j, i) for j, n in enumerate(lengths) for i in range(n))
    assert got[:3] == [(0, 0), (1, 0), (2, 0)], "one item from each of the first three jobs in turn"
    for job in range(len(lengths)):
        assert [i for j, i in got if j == job] == list(range(lengths[job])), "each job stays in order"


def test_interleave_bounds_the_buffer_with_a_slow_consumer(no_leaked_threads):
    limits = EngineLimits(max_inflight=4, delivery="interleave", queue_items=10_000, queue_bytes=200)
    engine = FetchEngine(stream_jobs([1000] * 8), reusable(FakeStore()), limits=limits)
    iterator = iter(engine)
    next(iterator)
    wait_until(lambda: engine.statistics().buffered_bytes >= 200 - 10, "the buffer reaches its budget")
    wait_stable(lambda: engine.statistics().delivered_items + engine.statistics().buffered_items,
                "the items produced")
    assert engine.statistics().peak_buffered_bytes <= 200 + 10, "at most one item over the budget"
    assert len(list(iterator)) == 7999


def test_a_slow_job_goes_over_the_budget_only_while_the_consumer_waits_for_it(no_leaked_threads):
    """The job the consumer waits on may add one item to a full buffer (or it would deadlock),
    but not while the consumer still holds the items of its last take: those come back first.
    The items divide the budget, so the buffer fills to it exactly and one item is the most over."""

    def job_for(position, delay, count):
        async def job(ctx):
            import anyio

            for i in range(count):
                if delay:
                    await anyio.sleep(delay)
                await ctx.emit((position, i), 10)

        return job

    for delivery in ("ordered", "interleave"):
        limits = EngineLimits(max_inflight=3, delivery=delivery, queue_items=10_000, queue_bytes=100)
        jobs = [job_for(0, 0.003, 30), job_for(1, 0, 60), job_for(2, 0, 60)]
        engine = FetchEngine(iter(jobs), reusable(FakeStore()), limits=limits)
        got = []
        for item in engine:
            got.append(item)
            time.sleep(0.005)  # holds each item while the slow job, which the others wait behind, adds one
        assert sorted(got) == sorted([(0, i) for i in range(30)] + [(j, i) for j in (1, 2) for i in range(60)])
        peak = engine.statistics().peak_buffered_bytes
        assert peak <= 100 + 10, f"{delivery}: the wanted job went {peak - 100} bytes over a full buffer"


def test_jobs_that_fail_in_interleave_mode_raise_after_earlier_items(no_leaked_threads):
    async def boom(ctx):
        await ctx.emit(("boom", 0), 1)
        raise NoSuchKeyError("no object 'shard-3.tar'", bucket=BUCKET, key="shard-3.tar")

    jobs = stream_jobs([2, 2, 2]) + [boom]
    limits = EngineLimits(max_inflight=2, delivery="interleave")
    got = []
    with pytest.raises(NoSuchKeyError, match="shard-3.tar"):
        for item in FetchEngine(jobs, reusable(FakeStore()), limits=limits):
            got.append(item)
    assert ("boom", 0) in got


def reading_ahead_jobs(lengths, log, fetch=0.02):
    """Jobs that fetch for ``fetch`` seconds, then emit ``(job, i)`` for each of their items;
    ``log`` records ``("start", job)`` and ``("end", job)`` and the jobs running at once."""
    import anyio

    running = set()

    def job_for(position, length):
        async def job(ctx):
            running.add(position)
            log.append(("start", position, len(running)))
            await anyio.sleep(fetch)
            for i in range(length):
                await ctx.emit((position, i), 1)
            running.discard(position)

        return Job(job, reads_ahead=True)

    return [job_for(position, length) for position, length in enumerate(lengths)]


def test_jobs_that_read_ahead_fetch_while_their_lanes_are_delivered(no_leaked_threads):
    """Interleaved delivery: a job that fetches before its first item starts while the job its
    lane holds is still delivered (else the lane waits out every fetch), at most one such job
    per lane, and the order delivered is the one the lanes give without reading ahead."""
    lengths = [6, 6, 4, 4, 3, 5]
    limits = EngineLimits(max_inflight=2, delivery="interleave", queue_items=4)
    log: list = []
    engine = FetchEngine(reading_ahead_jobs(lengths, log), reusable(FakeStore()), limits=limits)
    iterator = iter(engine)
    got = [next(iterator)]
    wait_until(lambda: {("start", 2), ("start", 3)} <= {entry[:2] for entry in log},
               "jobs 2 and 3 start while jobs 0 and 1 hold the lanes")
    assert engine.statistics().buffered_items <= 4 + 1, "jobs reading ahead hold their items back"
    got += list(iterator)
    plain = list(FetchEngine(stream_jobs(lengths), reusable(FakeStore()), limits=limits))
    assert got == plain, "reading ahead must not change the interleave"
    assert max(count for _, _, count in log) <= 2 * 2, "at most max_inflight jobs read ahead"


def test_reading_ahead_waits_for_the_first_item(no_leaked_threads):
    """Before the first item, jobs reading ahead would share the connections with those the
    first item waits for: only the lanes' jobs start."""
    import anyio

    gate = threading.Event()
    log: list = []
    jobs = reading_ahead_jobs([3, 3, 3, 3], log)
    first = jobs[0]

    async def held(ctx):
        await anyio.to_thread.run_sync(gate.wait)
        await first.run(ctx)

    jobs[0] = Job(held, reads_ahead=True)
    limits = EngineLimits(max_inflight=2, delivery="interleave")
    engine = FetchEngine(jobs, reusable(FakeStore()), limits=limits)
    iterator = iter(engine)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(next, iterator)
        try:
            wait_until(lambda: ("start", 1) in {entry[:2] for entry in log}, "job 1 starts")
            time.sleep(0.1)
            started = {entry[:2] for entry in log}
        finally:
            gate.set()
        assert pending.result(timeout=10) == (0, 0)
    assert len(list(iterator)) == 11
    assert ("start", 2) not in started, "no job reads ahead before the first item"


def test_a_waiting_consumer_gets_items_gathered_but_its_first_item_at_once(no_leaked_threads, monkeypatch):
    """Items that arrive one by one, 1 ms apart, to a consumer that waits for each: after the
    first (handed over alone, at once, though more come within the gathering time), they cross
    to the consumer a few at a time, in order."""
    from loader.engine import core

    sizes: list[int] = []
    take = core.EngineCore.take

    async def counted(self, *args, **kwargs):
        out = await take(self, *args, **kwargs)
        sizes.append(len(out[0]))
        return out

    monkeypatch.setattr(core.EngineCore, "take", counted)

    def paced(n):
        def job_for(position):
            async def job(ctx):
                await anyio.sleep(0.1 + 0.001 * position if position else 0)
                await ctx.emit(position, 1)

            return job

        return (job_for(position) for position in range(n))

    with FetchEngine(paced(200), reusable(FakeStore()), limits=EngineLimits(max_inflight=256),
                     tuning=Tuning(gather_s=0.3)) as engine:
        assert list(engine) == list(range(200))
    assert sizes[0] == 1, "the first item is handed over alone: nothing delays the first sample"
    assert sizes[-1] == 0, "the end"
    assert len(sizes) < 200 / 2, f"{len(sizes)} hops for 200 items: nothing was gathered"


def gated_jobs(n, gate, log):
    """Job 0 waits for ``gate`` before its item; every job logs its start and emits its position."""

    def job_for(position):
        async def job(ctx):
            log.append(position)
            if position == 0:
                await anyio.to_thread.run_sync(gate.wait)
            await ctx.emit(position, 1)

        return job

    return [job_for(position) for position in range(n)]


@pytest.mark.parametrize("delivery", ["ordered", "interleave", "completed"])
def test_the_first_job_runs_alone_until_its_first_item(no_leaked_threads, monkeypatch, delivery):
    """Started together, the first read shared the server and the loop with 63 others and the
    first sample came ~20 ms later: the others wait for its item (here the lead is long)."""
    lead = Tuning(first_job_lead_s=30.0)
    gate, log = threading.Event(), []
    with FetchEngine(gated_jobs(8, gate, log), reusable(FakeStore()),
                     limits=EngineLimits(max_inflight=4, delivery=delivery), tuning=lead) as engine:
        iterator = iter(engine)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(next, iterator)
            try:
                wait_until(lambda: 0 in log, "job 0 starts")
                time.sleep(0.2)
                assert log == [0], "no other job starts before the first one's item"
            finally:
                gate.set()
            assert first.result(timeout=10) == 0
        assert sorted([0, *iterator]) == list(range(8))
    assert sorted(log) == list(range(8))


def test_a_lanes_next_job_sends_its_request_while_the_lanes_last_items_wait(no_leaked_threads):
    """Interleaved delivery (shard mode): once a lane's job has fetched all it reads, the next
    job starts (its request, the server's first byte) while the lane's items are still being
    delivered, instead of after; its items wait for the lane, and the order is unchanged."""
    log = []

    def job_for(position):
        async def job(ctx):
            log.append(position)
            for i in range(5):
                await ctx.emit((position, i), 1)

        return job

    with FetchEngine([job_for(position) for position in range(6)], reusable(FakeStore()),
                     limits=EngineLimits(max_inflight=2, queue_items=16, delivery="interleave")) as engine:
        iterator = iter(engine)
        out = [next(iterator)]  # one batch taken (at most 4 items): lanes 0 and 1 hold 5 each
        wait_until(lambda: 2 in log and 3 in log, "the lanes' next jobs start before the lanes are drained")
        out += iterator
    lanes = [[(0, i) for i in range(5)] + [(2, i) for i in range(5)] + [(4, i) for i in range(5)],
             [(1, i) for i in range(5)] + [(3, i) for i in range(5)] + [(5, i) for i in range(5)]]
    assert out == [item for pair in zip(*lanes) for item in pair], "round robin over the two lanes"


def test_the_first_jobs_lead_counts_from_its_first_wait(no_leaked_threads, monkeypatch):
    """A backend's set-up before its first request goes out (obstore builds its client, ~5 ms,
    holding the loop) does not use up the lead: the others still wait for the first item."""
    lead = Tuning(first_job_lead_s=0.5)
    log, seen_at_first_item = [], []

    def job_for(position):
        async def job(ctx):
            log.append(position)
            if position == 0:
                time.sleep(0.7)  # synchronous set-up, longer than the lead
                await anyio.sleep(0.01)  # the request itself
                seen_at_first_item.extend(log)
            await ctx.emit(position, 1)

        return job

    with FetchEngine([job_for(position) for position in range(8)], reusable(FakeStore()),
                     limits=EngineLimits(max_inflight=4), tuning=lead) as engine:
        assert list(engine) == list(range(8))
    assert seen_at_first_item == [0], "the others started while the first job's request was out"


def test_the_first_jobs_lead_ends_after_its_time_without_an_item(no_leaked_threads, monkeypatch):
    """A first read that stalls holds the others back for the lead only."""
    lead = Tuning(first_job_lead_s=0.05)
    gate, log = threading.Event(), []
    with FetchEngine(gated_jobs(8, gate, log), reusable(FakeStore()),
                     limits=EngineLimits(max_inflight=4), tuning=lead) as engine:
        iterator = iter(engine)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(next, iterator)
            try:
                wait_until(lambda: len(log) >= 4, "other jobs start while job 0 still waits")
            finally:
                gate.set()
            assert first.result(timeout=10) == 0
        assert list(iterator) == list(range(1, 8))


def test_the_first_items_hand_over_leaves_the_loop_running(no_leaked_threads):
    """After the lead, the loop idles a moment for the consumer's thread before the other jobs
    start; it is an asyncio sleep, not a blocking one: the first job's own callbacks (its next
    read, here a timer) still run meanwhile, before any other job starts."""
    log = []

    def job_for(position):
        async def job(ctx):
            log.append(("start", position))
            await ctx.emit((position, 0), 1)
            if position == 0:
                await anyio.sleep(0.01)  # due long before the hand-over ends
                log.append(("read", 0))
                await ctx.emit((0, 1), 1)

        return job

    tuning = Tuning(first_job_lead_s=5.0, handover_s=1.0)
    with FetchEngine([job_for(position) for position in range(4)], reusable(FakeStore()),
                     limits=EngineLimits(max_inflight=4), tuning=tuning) as engine:
        assert list(engine) == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0)]
    assert log.index(("read", 0)) < log.index(("start", 1)), "the loop was blocked during the hand-over"


# ---------------------------------------------------------------- run_all: the one gather


def test_run_all_holds_its_limit_and_runs_everything():
    """At most ``limit`` calls run at once (None: all of them); every call runs once."""

    async def main(limit: int | None) -> tuple[int, list[int]]:
        inflight = peak = 0
        done: list[int] = []

        async def call(n: int) -> None:
            nonlocal inflight, peak
            inflight += 1
            peak = max(peak, inflight)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            inflight -= 1
            done.append(n)

        with anyio.fail_after(10):
            await run_all([functools.partial(call, n) for n in range(10)], limit)
        return peak, sorted(done)

    assert anyio.run(main, 3) == (3, list(range(10)))
    assert anyio.run(main, None) == (10, list(range(10)))


def test_run_all_raises_the_first_failure_unwrapped_and_cancels_the_rest():
    """The failing call's own error comes out (no ExceptionGroup), and calls still waiting are
    cancelled rather than waited for."""
    cancelled: list[int] = []

    async def main() -> None:
        never = anyio.Event()

        async def wait(n: int) -> None:
            try:
                await never.wait()
            except anyio.get_cancelled_exc_class():
                cancelled.append(n)
                raise

        async def fail() -> None:
            await anyio.lowlevel.checkpoint()
            raise NoSuchKeyError("gone", bucket="b", key="k")

        with anyio.fail_after(10):
            await run_all([functools.partial(wait, 0), fail, functools.partial(wait, 1)])

    with pytest.raises(NoSuchKeyError, match="gone"):
        anyio.run(main)
    assert sorted(cancelled) == [0, 1]


def test_say_skipped_warns_or_logs_once(caplog):
    """``on_error="warn"``: a RuntimeWarning and no log line; otherwise a log line at the level."""
    log = logging.getLogger("loader.test_say_skipped")
    with pytest.warns(RuntimeWarning, match="dropped a"), caplog.at_level(logging.DEBUG, log.name):
        say_skipped("dropped a", "warn", log)
    assert not [r for r in caplog.records if r.name == log.name]
    with caplog.at_level(logging.DEBUG, log.name):
        say_skipped("dropped b", "skip", log, level=logging.INFO)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == log.name] == [(logging.INFO, "dropped b")]
