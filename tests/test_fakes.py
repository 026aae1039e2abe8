"""The fake store behaves like a well-behaved backend, so tests built on it mean something.

Every async test runs under ``anyio.fail_after`` so a bug shows up as a failure, not a hang.
"""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from loader.errors import (
    AccessDeniedError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    TransientStoreError,
)
from loader.s3.protocol import ObjectInfo, ObjectStore

from fakes import FakeStore

pytestmark = pytest.mark.anyio
DEADLINE = 30  # a hang guard: far past what a test takes on a loaded machine


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def store():
    return FakeStore.with_objects("b", {"k": b"0123456789", "empty": b""})


async def collect(iterator):
    async with aclosing(iterator) as it:
        return [item async for item in it]


def test_is_an_object_store():
    assert isinstance(FakeStore(), ObjectStore)


async def test_get_and_ranges_are_half_open(store):
    with anyio.fail_after(DEADLINE):
        assert await store.get("b", "k") == b"0123456789"
        assert await store.get_range("b", "k", 2, 5) == b"234"
        assert await store.get_range("b", "k", 7, None) == b"789"
        assert await store.get_range("b", "k", 7, 100) == b"789"  # clamped, like S3
        assert await store.get_range("b", "k", 10, None) == b""
        assert await store.get_range("b", "empty", 0, None) == b""
        for start, end in [(11, None), (-1, 3), (5, 4)]:
            with pytest.raises(InvalidRangeError, match=r"range .* 'k' in bucket 'b' \(10 bytes\)"):
                await store.get_range("b", "k", start, end)
        assert store.requests == 9 and store.requests_by_key == {"k": 8, "empty": 1}


async def test_stream_chunks_from_an_offset(store):
    with anyio.fail_after(DEADLINE):
        assert await collect(store.stream("b", "k", chunk_size=4)) == [b"0123", b"4567", b"89"]
        assert await collect(store.stream("b", "k", start=3, chunk_size=5)) == [b"34567", b"89"]
        assert await collect(store.stream("b", "k", start=10)) == []
        assert await collect(store.stream("b", "k", start=3, chunk_size=2, end=8)) == [b"34", b"56", b"7"]
        assert await collect(store.stream("b", "k", start=8, end=20)) == [b"89"]  # as a range: to the end
        with pytest.raises(InvalidRangeError):
            await collect(store.stream("b", "k", start=11))
        assert store.inflight == 0


async def test_missing_bucket_and_key(store):
    with anyio.fail_after(DEADLINE):
        with pytest.raises(NoSuchKeyError, match=r"no object 'nope' in bucket 'b'") as info:
            await store.get("b", "nope")
        assert (info.value.bucket, info.value.key) == ("b", "nope")
        with pytest.raises(NoSuchBucketError, match=r"'other'"):
            await store.get("other", "k")
        with pytest.raises(NoSuchBucketError):
            await collect(store.list("other"))
        with pytest.raises(NoSuchKeyError):
            await collect(store.stream("b", "nope"))
        assert isinstance(info.value, FileNotFoundError)


async def test_list_pages_in_key_order_with_sizes():
    objects = {f"train/{i:03d}": b"x" * i for i in reversed(range(10))}
    objects["val/000"] = b"v"
    fake = FakeStore.with_objects("b", objects, page_size=3)
    with anyio.fail_after(DEADLINE):
        listed = await collect(fake.list("b", "train/"))
        assert listed == [ObjectInfo(f"train/{i:03d}", i, fake.etag_of("b", f"train/{i:03d}"))
                          for i in range(10)]
        assert fake.list_requests == 4  # 3 + 3 + 3 + 1
        fake.reset_counters()
        assert len(await collect(fake.list("b"))) == 11 and fake.list_requests == 4
        fake.reset_counters()
        assert await collect(fake.list("b", "val/")) == [ObjectInfo("val/000", 1, fake.etag_of("b", "val/000"))]
        assert fake.list_requests == 1
        assert await collect(fake.list("b", "nothing/")) == []
        assert fake.requests == 0  # listing is not a read request


async def test_list_of_exactly_one_page_takes_one_request():
    fake = FakeStore.with_objects("b", {f"{i}": b"" for i in range(3)}, page_size=3)
    with anyio.fail_after(DEADLINE):
        assert len(await collect(fake.list("b"))) == 3
        assert fake.list_requests == 1


async def test_faults_listed_are_consumed_one_per_attempt(store):
    faults = [TransientStoreError("slow down"), TransientStoreError("503")]
    fake = FakeStore.with_objects("b", {"k": b"data"}, fail={"k": faults})
    with anyio.fail_after(DEADLINE):
        for message in ("slow down", "503"):
            with pytest.raises(TransientStoreError, match=message):
                await fake.get("b", "k")
        assert await fake.get("b", "k") == b"data"
        assert fake.requests_by_key["k"] == 3
        assert len(faults) == 2  # the caller's list is left alone


async def test_a_single_fault_is_permanent():
    denied = AccessDeniedError("403", bucket="b", key="k")
    fake = FakeStore.with_objects("b", {"k": b"data"}, fail={"k": denied})
    with anyio.fail_after(DEADLINE):
        raised = []
        for _ in range(3):
            with pytest.raises(AccessDeniedError) as info:
                await fake.get_range("b", "k", 0, 2)
            raised.append(info.value)
        assert raised[0] is not raised[1] and raised[0].key == "k"  # fresh copies
        assert fake.requests == 3 and fake.inflight == 0


async def test_list_faults_by_prefix():
    fake = FakeStore.with_objects("b", {"p/1": b""}, list_fail={"p/": [TransientStoreError("x")]})
    with anyio.fail_after(DEADLINE):
        with pytest.raises(TransientStoreError):
            await collect(fake.list("b", "p/"))
        assert await collect(fake.list("b", "p/")) == [ObjectInfo("p/1", 0, fake.etag_of("b", "p/1"))]


async def test_truncated_stream_raises_transient_and_resumes():
    fake = FakeStore.with_objects("b", {"k": b"0123456789"}, truncate={"k": [4, None]})
    with anyio.fail_after(DEADLINE):
        got = []
        with pytest.raises(TransientStoreError, match=r"ended after 4 of 10 bytes") as info:
            async with aclosing(fake.stream("b", "k", chunk_size=3)) as chunks:
                async for chunk in chunks:
                    got.append(chunk)
        assert got == [b"012", b"3"] and info.value.key == "k"
        assert await collect(fake.stream("b", "k", start=4)) == [b"456789"]
        assert fake.inflight == 0


async def test_peak_inflight_counts_concurrent_requests():
    fake = FakeStore.with_objects("b", {f"{i}": b"x" for i in range(10)}, latency=0.02)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(fake.get, "b", f"{i}")
        assert fake.peak_inflight == 10 and fake.inflight == 0
        assert sorted(key for _, key in fake.gets_started) == sorted(f"{i}" for i in range(10))


async def test_gate_holds_requests_in_flight():
    fake = FakeStore.with_objects("b", {"a": b"1", "c": b"2"})
    fake.gate = anyio.Event()
    results = []

    async def fetch(key):
        results.append(await fake.get("b", key))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, "a")
            tg.start_soon(fetch, "c")
            await wait_all_tasks_blocked()
            assert (fake.requests, fake.inflight, results) == (2, 2, [])
            fake.gate.set()
        assert sorted(results) == [b"1", b"2"] and fake.inflight == 0


async def test_cancelled_and_abandoned_requests_leave_inflight():
    """Cancellation mid-request and an early ``aclose()`` of a stream both give the slot back."""
    fake = FakeStore.with_objects("b", {"k": b"x" * 100})
    with anyio.fail_after(DEADLINE):
        fake.gate = anyio.Event()
        with anyio.move_on_after(0.05):
            await fake.get("b", "k")
        assert fake.inflight == 0
        fake.gate = None
        async with aclosing(fake.stream("b", "k", chunk_size=10)) as chunks:
            async for _ in chunks:
                assert fake.inflight == 1
                break
        await checkpoint()
        assert fake.inflight == 0 and fake.peak_inflight == 1


async def test_latency_per_key():
    seen = []

    def latency(name):
        seen.append(name)
        return 0.0

    fake = FakeStore.with_objects("b", {"k": b""}, latency=latency)
    with anyio.fail_after(DEADLINE):
        await fake.get("b", "k")
        await collect(fake.list("b", "pre"))
    assert seen == ["k", "pre"]


async def test_put_then_get_and_close(store):
    with anyio.fail_after(DEADLINE):
        await store.put("b", "new", bytearray(b"abc"))
        assert await store.get("b", "new") == b"abc" and store.puts == 1
        with pytest.raises(NoSuchBucketError):
            await store.put("nope", "x", b"")
        await store.aclose()
        await store.aclose()  # idempotent
        assert store.closed
        with pytest.raises(RuntimeError, match="closed"):
            await store.get("b", "k")
        with pytest.raises(RuntimeError, match="closed"):
            await collect(store.list("b"))


def test_one_instance_across_event_loops():
    """Not an anyio test: it runs two event loops itself, one after the other."""
    fake = FakeStore.with_objects("b", {"k": b"v"}, latency=0.001)
    for _ in range(2):
        assert anyio.run(fake.get, "b", "k") == b"v"
    assert fake.requests == 2 and fake.peak_inflight == 1
