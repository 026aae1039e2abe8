"""FetchEngine's scheduled delivery: items in exactly the order a schedule gives, without
deadlock when long jobs that started first are due after short ones, under any limits."""

from __future__ import annotations

import random

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.engine.fetch import EngineLimits, FetchEngine
from loader.errors import ConfigError

from fakes import FakeStore, reusable


def counting_job(name, n, delay=0.0, fail_at=None):
    """Emits ``(name, i)`` for ``i`` in ``range(n)``, 100 bytes each."""

    async def job(ctx):
        for i in range(n):
            if fail_at == i:
                raise ValueError(f"{name} broke at {i}")
            if delay:
                await anyio.sleep(delay)
            await ctx.emit((name, i), 100)

    return job


def schedule_of(sizes, rng):
    """A random interleave of jobs with ``sizes[j]`` items each, jobs numbered by first entry."""
    entries = [j for j, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(entries)
    first = {}
    for j in entries:
        first.setdefault(j, len(first))
    return [first[j] for j in entries], sorted(first, key=first.get)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=12), seed=st.integers(0, 10**6),
       inflight=st.integers(1, 4), queue_items=st.integers(1, 8))
def test_items_come_in_the_schedules_order_under_any_limits(sizes, seed, inflight, queue_items):
    rng = random.Random(seed)
    schedule, by_first_entry = schedule_of(sizes, rng)
    jobs = [counting_job(j, sizes[j]) for j in by_first_entry]
    limits = EngineLimits(max_inflight=inflight, queue_items=queue_items, delivery="scheduled")
    got = list(FetchEngine(jobs, reusable(FakeStore()), limits=limits, schedule=schedule))
    seen = {j: 0 for j in range(len(sizes))}
    expected = []
    for entry in schedule:
        j = by_first_entry[entry]
        expected.append((j, seen[j]))
        seen[j] += 1
    assert got == expected


def test_a_long_job_due_later_does_not_starve_the_short_ones():
    """One long job starts first and fills the buffer; the short jobs due in between still run."""
    long_one = counting_job("long", 200)
    shorts = [counting_job(f"s{i}", 1, delay=0.001) for i in range(100)]
    schedule = []
    for i in range(100):
        schedule += [0, 0, i + 1]
    limits = EngineLimits(max_inflight=2, queue_items=4, delivery="scheduled")
    got = list(FetchEngine([long_one, *shorts], reusable(FakeStore()), limits=limits, schedule=schedule))
    assert [name for name, _ in got[:6]] == ["long", "long", "s0", "long", "long", "s1"]
    assert len(got) == 300


def test_a_job_that_gives_fewer_items_than_scheduled_is_passed_over():
    jobs = [counting_job("a", 2), counting_job("b", 3)]
    schedule = [0, 1, 0, 0, 0, 1, 1]  # "a" is given four entries, emits two
    limits = EngineLimits(max_inflight=2, delivery="scheduled")
    got = list(FetchEngine(jobs, reusable(FakeStore()), limits=limits, schedule=schedule))
    assert got == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2)]


def test_a_job_error_arrives_after_the_items_scheduled_before_it():
    jobs = [counting_job("a", 5, fail_at=2), counting_job("b", 5)]
    schedule = [0, 1, 1, 0, 1, 0, 0, 0, 1, 1]
    limits = EngineLimits(max_inflight=2, delivery="scheduled")
    got = []
    with pytest.raises(ValueError, match="a broke at 2"):
        for item in FetchEngine(jobs, reusable(FakeStore()), limits=limits, schedule=schedule):
            got.append(item)
    assert got[:4] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]


def test_more_items_than_scheduled_is_an_error_not_a_hang():
    jobs = [counting_job("a", 3)]
    limits = EngineLimits(max_inflight=1, delivery="scheduled")
    with pytest.raises(RuntimeError, match="more items than the schedule"):
        list(FetchEngine(jobs, reusable(FakeStore()), limits=limits, schedule=[0, 0]))


def test_a_schedule_only_with_scheduled_delivery():
    with pytest.raises(ConfigError, match="schedule"):
        FetchEngine([], reusable(FakeStore()), limits=EngineLimits(delivery="scheduled"))
    with pytest.raises(ConfigError, match="schedule"):
        FetchEngine([], reusable(FakeStore()), schedule=[0])
