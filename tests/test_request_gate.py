"""``request_gate.gated``: at most ``limit`` calls through one store at once, per store and per
event loop (a store whose loop ended gets a new gate), and no bound at ``limit`` 0."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.s3.request_gate import gated


class _Store:
    """Stands for a store: the gate only keys on it."""


async def _most_at_once(stores: list[_Store], limit: int, calls: int) -> dict[int, int]:
    running: dict[int, int] = {}
    most: dict[int, int] = {}

    async def call(store: _Store) -> int:
        key = id(store)
        running[key] = running.get(key, 0) + 1
        most[key] = max(most.get(key, 0), running[key])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        running[key] -= 1
        return key

    got = await asyncio.gather(*(gated(store, limit, lambda s=store: call(s))
                                 for _ in range(calls) for store in stores))
    assert sorted(got) == sorted(id(store) for _ in range(calls) for store in stores)
    return most


@settings(deadline=None, max_examples=40)
@given(limit=st.integers(1, 6), calls=st.integers(1, 20), stores=st.integers(1, 3))
def test_no_more_than_limit_at_once_per_store(limit, calls, stores):
    made = [_Store() for _ in range(stores)]
    most = asyncio.run(_most_at_once(made, limit, calls))
    assert all(most[id(store)] == min(limit, calls) for store in made), most


def test_zero_is_no_bound():
    store = _Store()
    assert asyncio.run(_most_at_once([store], 0, 9)) == {id(store): 9}


def test_a_store_outliving_its_loop_works_in_the_next():
    store = _Store()
    for _ in range(2):  # a semaphore of the first loop would not serve the second
        assert asyncio.run(_most_at_once([store], 2, 5)) == {id(store): 2}


def test_an_error_frees_its_place():
    store = _Store()

    async def fail() -> None:
        raise ValueError("no")

    async def run() -> int:
        for _ in range(3):
            with pytest.raises(ValueError):
                await gated(store, 1, fail)
        return await gated(store, 1, lambda: asyncio.sleep(0, result=7))

    assert asyncio.run(run()) == 7
