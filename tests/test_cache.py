"""The disk cache (``loader/cache/store.py``) against the in-memory store: no server.

Each test asserts on two things: the bytes a reader got (always those the store holds), and what
the inner store *saw* (``FakeStore.requests_by_key``), so "served from disk" means zero requests,
and a refetch is exactly one. Sizes on disk are measured with ``os.stat``, never taken from the
cache's own bookkeeping. Every async test runs under ``anyio.fail_after``.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import io
import logging
import os
import random
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import anyio
import pytest

from loader import AsyncS3Dataset, ConfigError, Limits, Reading, Store
from loader.cache.files import HEADER_SIZE, DiskCache
from loader.cache.options import check_cache_options
from loader.cache.store import CachedStore, CacheStats, open_cached_store
from loader.config import S3Config
from loader.errors import InvalidRangeError, TransientStoreError
from loader.retry import RetryPolicy
from loader.s3 import StoreSpec
from loader.s3.protocol import ObjectStore, Pin

from fakes import FakeStore

pytestmark = pytest.mark.anyio
DEADLINE = 20
BUCKET = "bucket"
BLOCK = 256  # small blocks, so that objects of a few KiB span many of them
FAST_RETRY = RetryPolicy(base_delay=0.001, max_delay=0.01)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def blob(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def objects(n: int, size: int = 1000, prefix: str = "train/") -> dict[str, bytes]:
    return {f"{prefix}{i:05d}.bin": blob(i, size) for i in range(n)}


def new_cache(tmp_path: Path, limit: int = 1 << 20, **options) -> DiskCache:
    options.setdefault("block_size", BLOCK)
    return DiskCache(tmp_path / "cache", limit, **options)


@asynccontextmanager
async def session(fake: FakeStore, cache: DiskCache, endpoint: str = "fake"):
    """One ``CachedStore`` over ``fake`` (re-opened, as an engine would), closed at the end."""
    fake.closed = False
    store = CachedStore(fake, cache, endpoint)
    try:
        yield store
    finally:
        await store.aclose()


async def read_stream(store, key, start=0, chunk_size=1 << 20) -> bytes:
    async with aclosing(store.stream(BUCKET, key, start=start, chunk_size=chunk_size)) as chunks:
        parts = [chunk async for chunk in chunks]
    assert all(0 < len(part) <= chunk_size for part in parts)
    return b"".join(parts)


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if p.is_file())


def temp_files(root: Path) -> list[Path]:
    return sorted((root / "tmp").iterdir())


def disk_bytes(root: Path) -> int:
    """Every regular file under the cache directory, as the file system reports it."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def path_of(cache: DiskCache, key: str, endpoint: str = "fake", bucket: str = BUCKET) -> Path:
    return cache.path_for(cache.name_for(endpoint, bucket, key))


# --------------------------------------------------------------------------- basics


def test_is_an_object_store(tmp_path):
    assert isinstance(CachedStore(FakeStore(), new_cache(tmp_path), "x"), ObjectStore)
    gc.collect()


async def test_get_second_pass_makes_no_request(tmp_path):
    data = objects(20)
    fake = FakeStore.with_objects(BUCKET, data)
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            assert {k: await store.get(BUCKET, k) for k in data} == data
            assert store.statistics() == CacheStats(hits=0, misses=20, bytes_read_from_cache=0,
                                                    evictions=0, corrupt_refetches=0)
        assert fake.requests == 20
        fake.reset_counters()
        # A new process would build a new DiskCache and store: nothing in memory carries over.
        async with session(fake, new_cache(tmp_path)) as store:
            assert {k: await store.get(BUCKET, k) for k in data} == data
            assert (store.hits, store.misses, store.bytes_read_from_cache) == (20, 0, 20 * 1000)
        assert fake.requests == 0
    assert len(entry_files(tmp_path / "cache")) == 20 and temp_files(tmp_path / "cache") == []


async def test_stream_from_any_start_and_chunk_size_after_one_full_stream(tmp_path):
    data = blob(1, 5000)
    fake = FakeStore.with_objects(BUCKET, {"k": data, "empty": b""})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            assert await read_stream(store, "k", chunk_size=700) == data
            assert await read_stream(store, "empty") == b""
            assert fake.requests == 2 and store.misses == 2
            for start in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 4999):
                for chunk_size in (1, 7, BLOCK, 1000, 1 << 20):
                    assert await read_stream(store, "k", start, chunk_size) == data[start:], (start, chunk_size)
            assert await read_stream(store, "empty") == b""
            # Past the end: what S3 answers (416), from the cache too.
            with pytest.raises(InvalidRangeError, match=r"byte 5000 .*s3://bucket/k \(5000 bytes\)"):
                await read_stream(store, "k", 5000)
            assert fake.requests == 2
            assert store.hits == 6 * 5 + 2
            assert store.bytes_read_from_cache == sum(5 * (5000 - s) for s in (0, 1, 255, 256, 257, 4999))


async def test_get_range_from_the_cached_file(tmp_path):
    data = blob(2, 3000)
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            await store.get(BUCKET, "k")
            for start, end in [(0, 1), (0, 3000), (5, 260), (255, 257), (2999, None), (100, 10_000), (7, 7)]:
                assert await store.get_range(BUCKET, "k", start, end) == data[start:end]
            with pytest.raises(InvalidRangeError):
                await store.get_range(BUCKET, "k", 3000, None)
            assert fake.requests == 1 and store.hits == 6  # an empty range reads nothing


async def test_get_fills_the_cache_for_stream_and_stream_for_get(tmp_path):
    data = objects(2, 2000)
    a, b = data
    fake = FakeStore.with_objects(BUCKET, data)
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            assert await store.get(BUCKET, a) == data[a]
            assert await read_stream(store, b, chunk_size=300) == data[b]
            fake.reset_counters()
            assert await read_stream(store, a, 10) == data[a][10:]
            assert await store.get(BUCKET, b) == data[b]
            assert await store.get_range(BUCKET, b, 100, 200) == data[b][100:200]
            assert fake.requests == 0


async def test_ranged_parts_in_any_order_assemble_one_entry(tmp_path):
    """Shards of known size are read as parallel ranged GETs: together they fill the cache,
    with no request beyond the parts (each asks one byte more, to see where the object ends)."""
    data = blob(3, 10_000)
    fake = FakeStore.with_objects(BUCKET, {"shard.tar": data})
    cache = new_cache(tmp_path)
    parts = [(i * 3000, min(10_000, (i + 1) * 3000)) for i in range(4)]
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            got = {}

            async def part(start, end, delay):
                await anyio.sleep(delay)
                got[start] = await store.get_range(BUCKET, "shard.tar", start, end)

            async with anyio.create_task_group() as tg:
                for (start, end), delay in zip(parts, [0.03, 0.0, 0.02, 0.01]):
                    tg.start_soon(part, start, end, delay)
            assert b"".join(got[s] for s, _ in parts) == data
            assert fake.requests == 4 and store.misses == 4
            assert len(entry_files(tmp_path / "cache")) == 1
            fake.reset_counters()
            assert await store.get(BUCKET, "shard.tar") == data
            assert await read_stream(store, "shard.tar", 4321) == data[4321:]
            assert fake.requests == 0
    assert temp_files(tmp_path / "cache") == []


async def test_parts_that_miss_a_piece_commit_nothing(tmp_path):
    data = blob(4, 10_000)
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            assert await store.get_range(BUCKET, "k", 0, 3000) == data[:3000]
            assert await store.get_range(BUCKET, "k", 6000, 10_000) == data[6000:]  # the end, not the middle
            assert entry_files(tmp_path / "cache") == []
            assert await store.get_range(BUCKET, "k", 3000, 6000) == data[3000:6000]
            assert len(entry_files(tmp_path / "cache")) == 1  # now complete
            fake.reset_counters()
            assert await store.get(BUCKET, "k") == data and fake.requests == 0


# --------------------------------------------------------------------------- partial and resumed reads


async def test_stream_closed_after_two_chunks_commits_nothing(tmp_path):
    data = blob(5, 5000)
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            async with aclosing(store.stream(BUCKET, "k", chunk_size=1000)) as chunks:
                assert [await chunks.__anext__() for _ in range(2)] == [data[:1000], data[1000:2000]]
            assert entry_files(tmp_path / "cache") == []
            assert temp_files(tmp_path / "cache") == []  # dropped when the stream closed
            # A stream started past 0 cannot complete a file on its own: nothing either.
            assert await read_stream(store, "k", 100) == data[100:]
            assert entry_files(tmp_path / "cache") == []
            assert await read_stream(store, "k") == data
            assert fake.requests == 3
    assert len(entry_files(tmp_path / "cache")) == 1


async def test_bounded_streams_end_to_end_fill_the_cache_and_are_served_from_it(tmp_path):
    """A stream asked to stop at ``end`` (a shard read in pieces) keeps what it read: pieces that
    cover the object complete its entry, and a bounded stream is then served from it."""
    data = blob(7, 5000)
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            async with aclosing(store.stream(BUCKET, "k", chunk_size=1000, end=1500)) as chunks:
                assert b"".join([chunk async for chunk in chunks]) == data[:1500]
            assert entry_files(tmp_path / "cache") == []  # the object's end not met yet
            assert await read_stream(store, "k", 1500) == data[1500:]
            assert len(entry_files(tmp_path / "cache")) == 1 and fake.requests == 2
            async with aclosing(store.stream(BUCKET, "k", start=700, chunk_size=600, end=2100)) as chunks:
                parts = [chunk async for chunk in chunks]
            assert b"".join(parts) == data[700:2100] and all(len(part) <= 600 for part in parts)
            assert fake.requests == 2 and store.hits == 1


async def test_cancelled_stream_commits_nothing(tmp_path):
    data = blob(6, 5000)
    gate = anyio.Event()
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            async def consume():
                async with aclosing(store.stream(BUCKET, "k", chunk_size=1000)) as chunks:
                    async for _ in chunks:
                        gate.set()
                        await anyio.sleep_forever()

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await gate.wait()
                tg.cancel_scope.cancel()
            assert entry_files(tmp_path / "cache") == [] and temp_files(tmp_path / "cache") == []


async def test_cut_and_resumed_stream_is_assembled_correctly(tmp_path):
    """The shard reader resumes at the start of the member being parsed, *before* the cut:
    the overlap and the rest land at their true offsets, so the committed file is exact."""
    data = blob(7, 9000)
    fake = FakeStore.with_objects(BUCKET, {"k": data}, truncate={"k": [2500, 3000, None]})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            got = bytearray()
            start = 0
            for resume_back in (700, 10, None):
                try:
                    async with aclosing(store.stream(BUCKET, "k", start=start, chunk_size=600)) as chunks:
                        async for chunk in chunks:
                            got[start:] = b""  # what a resuming reader does: drop past the offset
                            got += chunk
                            start += len(chunk)
                except TransientStoreError:
                    start -= resume_back
                    del got[start:]
                    continue
                break
            assert bytes(got) == data
            assert fake.requests == 3
            assert len(entry_files(tmp_path / "cache")) == 1
        fake.reset_counters()
        async with session(fake, new_cache(tmp_path)) as store:
            assert await store.get(BUCKET, "k") == data
            assert fake.requests == 0


async def test_a_resume_past_the_bytes_received_still_completes_the_file(tmp_path):
    """A tar parser resumes at the next member's header, skipping padding it never received:
    the cache asks the store from the end of its file instead (one request all the same) and
    hands the caller only what it asked for."""
    data = blob(13, 9000)
    fake = FakeStore.with_objects(BUCKET, {"k": data}, truncate={"k": [2500, None]})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            with pytest.raises(TransientStoreError):
                await read_stream(store, "k", chunk_size=1000)
            assert await read_stream(store, "k", 2900, chunk_size=1000) == data[2900:]
            assert fake.requests == 2 and len(entry_files(tmp_path / "cache")) == 1
            fake.reset_counters()
            assert await store.get(BUCKET, "k") == data and fake.requests == 0


async def test_cut_stream_never_resumed_leaves_no_temp_file(tmp_path):
    fake = FakeStore.with_objects(BUCKET, {"k": blob(8, 5000)}, truncate={"k": 1000})
    with anyio.fail_after(DEADLINE):
        async with session(fake, new_cache(tmp_path)) as store:
            with pytest.raises(TransientStoreError):
                await read_stream(store, "k", chunk_size=400)
            assert len(temp_files(tmp_path / "cache")) == 1  # kept for a resume...
        assert temp_files(tmp_path / "cache") == []  # ...until the store is closed
        assert entry_files(tmp_path / "cache") == []


# --------------------------------------------------------------------------- size bound


async def test_eviction_keeps_the_directory_under_the_limit(tmp_path):
    limit = 20_000
    data = objects(100, 1000)
    fake = FakeStore.with_objects(BUCKET, data)
    cache = new_cache(tmp_path, limit)
    root = tmp_path / "cache"
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            for key in data:
                assert await store.get(BUCKET, key) == data[key]
                assert disk_bytes(root) <= limit
            assert store.evictions > 0
            # The shared count agrees with the file system.
            assert cache.usage() == sum(p.stat().st_size for p in entry_files(root))
            # What is left is the most recent keys: a second pass over them needs no request.
            fake.reset_counters()
            kept = list(data)[-len(entry_files(root)):]
            for key in kept:
                assert await store.get(BUCKET, key) == data[key]
            assert fake.requests == 0


async def test_least_recently_used_goes_first_and_hits_count_as_use(tmp_path):
    size = 1000
    entry = HEADER_SIZE + size + 4 * -(-size // BLOCK) + 32  # 32: the ETag, an md5 in hex
    limit = 64 + 5 * entry  # room for exactly five
    data = objects(8, size)
    keys = list(data)
    fake = FakeStore.with_objects(BUCKET, data)
    cache = new_cache(tmp_path, limit, touch_after=0, evict_to=1.0)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            for key in keys[:5]:
                await store.get(BUCKET, key)
            now = time.time()
            for age, key in enumerate(reversed(keys[:5])):  # keys[0] is the oldest
                os.utime(path_of(cache, key), (now - 100 - age, now - 100 - age))
            await store.get(BUCKET, keys[0])  # a hit: now the most recent
            await store.get(BUCKET, keys[5])  # over the limit: evicts keys[1]
            assert not path_of(cache, keys[1]).exists()
            assert path_of(cache, keys[0]).exists() and path_of(cache, keys[2]).exists()
            await store.get(BUCKET, keys[6])  # then keys[2]
            assert not path_of(cache, keys[2]).exists() and path_of(cache, keys[0]).exists()
            assert store.evictions == 2 and disk_bytes(tmp_path / "cache") <= limit


async def test_an_object_larger_than_the_limit_is_not_cached(tmp_path):
    big, small = blob(9, 10_000), blob(10, 100)
    fake = FakeStore.with_objects(BUCKET, {"big": big, "small": small})
    cache = new_cache(tmp_path, 8192)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            for _ in range(2):
                assert await store.get(BUCKET, "big") == big
                assert await read_stream(store, "big", chunk_size=1500) == big
                assert await store.get_range(BUCKET, "big", 0, 9000) == big[:9000]
                assert await store.get(BUCKET, "small") == small
                assert temp_files(tmp_path / "cache") == []
            assert fake.requests_by_key == {"big": 6, "small": 1}
    assert [p.name for p in entry_files(tmp_path / "cache")] == [cache.name_for("fake", BUCKET, "small")]
    assert disk_bytes(tmp_path / "cache") <= 8192


# --------------------------------------------------------------------------- integrity


async def test_truncated_and_corrupted_files_are_refetched_once(tmp_path):
    data = objects(5, 2000)
    keys = list(data)
    fake = FakeStore.with_objects(BUCKET, data)
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            for key in keys:
                await store.get(BUCKET, key)
        paths = [path_of(cache, key) for key in keys]
        os.truncate(paths[0], paths[0].stat().st_size - 10)  # truncated
        flip_byte(paths[1], HEADER_SIZE + 1500)  # one bit in the data
        flip_byte(paths[2], 9)  # the length field of the header
        flip_byte(paths[3], paths[3].stat().st_size - 2)  # the block table
        fake.reset_counters()
        async with session(fake, new_cache(tmp_path)) as store:
            assert {key: await store.get(BUCKET, key) for key in keys} == data
            assert fake.requests_by_key == {key: 1 for key in keys[:4]}
            assert store.corrupt_refetches == 4 and store.hits == 1 and store.misses == 4
        fake.reset_counters()
        async with session(fake, new_cache(tmp_path)) as store:  # repaired on disk
            assert {key: await store.get(BUCKET, key) for key in keys} == data
            assert fake.requests == 0 and store.corrupt_refetches == 0


async def test_corruption_found_mid_stream_continues_from_the_store(tmp_path):
    data = blob(11, 5000)
    fake = FakeStore.with_objects(BUCKET, {"k": data})
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            assert await read_stream(store, "k") == data
            flip_byte(path_of(cache, "k"), HEADER_SIZE + 3000)
            fake.reset_counters()
            assert await read_stream(store, "k", chunk_size=BLOCK) == data  # bad block: rest refetched
            assert fake.requests == 1 and store.corrupt_refetches == 1
            assert await store.get_range(BUCKET, "k", 2900, 3100) == data[2900:3100]  # entry gone: a miss
            assert await store.get(BUCKET, "k") == data  # refills
            fake.reset_counters()
            flip_byte(path_of(cache, "k"), HEADER_SIZE + 10)
            assert await store.get_range(BUCKET, "k", 0, 100) == data[:100]
            assert fake.requests == 1 and store.corrupt_refetches == 2


# --------------------------------------------------------------------------- names


async def test_hostile_keys_stay_inside_the_cache_directory(tmp_path):
    keys = [
        "../../etc/passwd",
        "../../../../../../tmp/escape",
        "/etc/shadow",
        "//double//slash",
        "a/" * 400 + "deep",
        "x" * 1000,
        "ünïcødé/日本語/🙂.jpg",
        "..",
        ".",
        "tmp",
        ".lock",
        "con\\..\\..\\windows",
        " spaces and\ttabs\nnewline",
    ]
    data = {key: blob(i, 300) for i, key in enumerate(keys)}
    fake = FakeStore.with_objects(BUCKET, data)
    fake.objects[("../..", "../../x")] = b"bucket too"
    fake.buckets.add("../..")
    root = tmp_path / "cache"
    base = tmp_path.parent
    before = {p for p in base.rglob("*")}
    cache = DiskCache(root, 1 << 20)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            for key in keys:
                assert await store.get(BUCKET, key) == data[key]
                assert await read_stream(store, key, 1) == data[key][1:]
            assert await store.get("../..", "../../x") == b"bucket too"
            fake.reset_counters()
            for key in keys:
                assert await store.get(BUCKET, key) == data[key]
            assert fake.requests == 0
    created = {p for p in base.rglob("*")} - before
    real_root = os.path.realpath(root)
    assert created, "nothing was cached"
    for path in created:
        assert os.path.realpath(path) == real_root or os.path.realpath(path).startswith(real_root + os.sep), path
        assert path.name in {"cache", "tmp", ".lock"} or len(path.name) in (2, 64), path
    assert len(entry_files(root)) == len(keys) + 1


def test_names_depend_on_endpoint_bucket_and_key_and_nothing_collides():
    name = DiskCache.name_for
    assert name("e", "b", "k") == name("e", "b", "k")
    assert len({name("e", "b", "k"), name("e2", "b", "k"), name("e", "b2", "k"), name("e", "b", "k2"),
                name("e", "bk", ""), name("eb", "", "k"), name("e", "", "bk")}) == 7
    with pytest.raises(ValueError, match="not a cache entry name"):
        DiskCache.path_for(DiskCache.__new__(DiskCache), "../" + "a" * 61)


# --------------------------------------------------------------------------- concurrency


def test_threads_writing_one_key_leave_one_valid_file_and_readers_never_see_a_partial_one(tmp_path):
    cache = new_cache(tmp_path, 1 << 20)
    name = cache.name_for("fake", BUCKET, "k")
    data = blob(12, 50_000)
    errors: list[BaseException] = []
    stop = threading.Event()
    seen = {"whole": 0, "none": 0}

    def writer():
        try:
            for _ in range(40):
                cache.put(name, data)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader():
        try:
            while not stop.is_set():
                entry = cache.open(name)
                if entry is None:
                    seen["none"] += 1
                    continue
                try:
                    assert entry.read(0, entry.length) == data
                    seen["whole"] += 1
                finally:
                    entry.close()
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer) for _ in range(6)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join(timeout=60)
    stop.set()
    for thread in readers:
        thread.join(timeout=60)
    assert not errors, errors
    assert seen["whole"] > 0
    assert [p.name for p in entry_files(tmp_path / "cache")] == [name]
    assert temp_files(tmp_path / "cache") == []
    assert cache.usage() == disk_bytes(tmp_path / "cache") - (tmp_path / "cache" / ".lock").stat().st_size


WRITER = textwrap.dedent("""
    import os, random, sys, time
    from loader.cache.files import DiskCache
    directory, limit, name_count, rounds, seed, barrier, processes = sys.argv[1:]
    limit, name_count, rounds, seed, processes = map(int, (limit, name_count, rounds, seed, processes))
    cache = DiskCache(directory, limit, block_size=256)
    rng = random.Random(seed)
    open(os.path.join(barrier, str(seed)), "w").close()
    while len(os.listdir(barrier)) < processes:  # start writing together, imports done
        time.sleep(0.001)
    for _ in range(rounds):
        i = rng.randrange(name_count)
        data = random.Random(i).randbytes(3000 + i)
        cache.put(DiskCache.name_for("fake", "bucket", f"k{i}"), data)
""")


def run_writers(directory: Path, limit: int, names: int, rounds: int, processes: int) -> None:
    barrier = directory.parent / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(limit), str(names), str(rounds),
                               str(seed), str(barrier), str(processes)], stderr=subprocess.PIPE, text=True)
             for seed in range(processes)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err


def test_processes_writing_one_key_leave_one_valid_file(tmp_path):
    root = tmp_path / "cache"
    run_writers(root, 1 << 20, names=1, rounds=300, processes=4)
    cache = DiskCache(root, 1 << 20)
    name = cache.name_for("fake", BUCKET, "k0")
    assert [p.name for p in entry_files(root)] == [name]
    entry = cache.open(name)
    assert entry.read(0, entry.length) == random.Random(0).randbytes(3000)
    entry.close()
    assert temp_files(root) == []


def test_processes_share_one_size_bound(tmp_path):
    """Four processes each writing far more than the limit: the total on disk stays under it,
    because they share one count (under flock) instead of each believing it has the room."""
    root, limit = tmp_path / "cache", 40_000
    run_writers(root, limit, names=60, rounds=150, processes=4)
    assert disk_bytes(root) <= limit
    assert temp_files(root) == []
    cache = DiskCache(root, limit)
    assert cache.usage() == sum(p.stat().st_size for p in entry_files(root))
    for path in entry_files(root):  # every survivor is whole
        entry = cache.open(path.name)
        entry.read(0, entry.length)
        entry.close()


# --------------------------------------------------------------------------- put, startup, failures


async def test_put_invalidates_the_cached_entry(tmp_path):
    fake = FakeStore.with_objects(BUCKET, {"k": b"old" * 100})
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            assert await store.get(BUCKET, "k") == b"old" * 100
            await store.put(BUCKET, "k", b"new" * 100)
            assert not path_of(cache, "k").exists()
            assert await store.get(BUCKET, "k") == b"new" * 100
            assert await read_stream(store, "k") == b"new" * 100
            assert fake.puts == 1 and fake.requests == 2 and store.hits == 1
            async for info in store.list(BUCKET):  # listing passes through
                assert info.key == "k"
            assert fake.list_requests == 1


async def test_a_read_racing_a_put_does_not_cache_the_old_bytes(tmp_path):
    gate = anyio.Event()
    fake = FakeStore.with_objects(BUCKET, {"k": b"old"}, gate=gate)
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.get, BUCKET, "k")
                await anyio.wait_all_tasks_blocked()  # the GET is in flight (held at the gate)
                fake.objects[BUCKET, "k"] = b"new"
                tg.start_soon(store.put, BUCKET, "k", b"new")
                await anyio.wait_all_tasks_blocked()
                gate.set()
            assert not path_of(cache, "k").exists()
            assert await store.get(BUCKET, "k") == b"new"


def test_startup_removes_stale_temp_files_only(tmp_path):
    root = tmp_path / "cache"
    DiskCache(root, 1 << 20)
    stale, fresh = root / "tmp" / "aaaa.1.dead.part", root / "tmp" / "bbbb.2.live.part"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    cache = DiskCache(root, 1 << 20)
    assert temp_files(root) == [fresh]
    assert cache.clean_stale_temps() == 0


def test_a_damaged_or_missing_shared_count_is_rebuilt_from_the_directory(tmp_path):
    cache = new_cache(tmp_path)
    for i in range(5):
        cache.put(cache.name_for("fake", BUCKET, f"k{i}"), blob(i, 700))
    truth = sum(p.stat().st_size for p in entry_files(tmp_path / "cache"))
    assert cache.usage() == truth
    (tmp_path / "cache" / ".lock").write_bytes(b"12x\n")  # torn write of a killed process
    assert cache.usage() == truth
    (tmp_path / "cache" / ".lock").unlink()
    assert new_cache(tmp_path).usage() == truth


async def test_cache_failures_fall_back_to_the_store(tmp_path, monkeypatch, caplog):
    data = objects(3, 500)
    fake = FakeStore.with_objects(BUCKET, data)
    cache = new_cache(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache, "put", disk_full)
    monkeypatch.setattr(cache, "begin", disk_full)
    with anyio.fail_after(DEADLINE), caplog.at_level(logging.WARNING, logger="loader.cache.store"):
        async with session(fake, cache) as store:
            for key in data:
                assert await store.get(BUCKET, key) == data[key]
                assert await read_stream(store, key) == data[key]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "No space left" in warned[0].getMessage()
    assert entry_files(tmp_path / "cache") == []


def test_an_unclosed_store_warns(tmp_path):
    store = CachedStore(FakeStore(), new_cache(tmp_path), "fake")
    with pytest.warns(ResourceWarning, match="never closed"):
        del store
        gc.collect()


@pytest.mark.parametrize(
    "cache_dir,cache_limit,match",
    [
        (None, 1 << 30, r"cache_limit=1073741824 needs cache_dir="),
        (123, None, r"cache_dir=123 must be a directory path"),
        ("", None, r"cache_dir='' must be a directory path"),
        ("/x", 0, r"cache_limit=0 must be a number of bytes, at least 4096"),
        ("/x", 1.5e9, r"cache_limit=1500000000.0 must be a number of bytes"),
        ("/x", True, r"cache_limit=True must be a number of bytes"),
    ],
)
def test_options_are_checked_with_clear_messages(cache_dir, cache_limit, match):
    with pytest.raises(ConfigError, match=match):
        check_cache_options(cache_dir, cache_limit)


def test_options_resolve_the_directory_and_default_the_limit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_cache_options("c", None) == (str(tmp_path / "c"), 10 << 30)
    assert check_cache_options(None, None) == (None, None)
    assert StoreSpec.of("aioboto3", S3Config(endpoint_url="http://h:9000/")).identity == "http://h:9000"
    assert StoreSpec.of("aioboto3", S3Config()).identity == "aws-s3"
    assert StoreSpec.of(open_cached_store).identity == "factory:loader.cache.store.open_cached_store"
    secret = functools.partial(open_cached_store, "secret-token")  # stable, and no arguments shown
    assert StoreSpec.of(secret).identity == "factory:loader.cache.store.open_cached_store"


async def test_an_unusable_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")

    async def factory():
        raise AssertionError("the store is not opened when the cache cannot be")

    with anyio.fail_after(DEADLINE), pytest.raises(ConfigError, match=r"cache_dir=.*file/sub.* cannot be used"):
        await open_cached_store(factory, tmp_path / "file" / "sub", 1 << 20, "x")


# --------------------------------------------------------------------------- through the dataset


def cached_factory(fake: FakeStore, directory: Path, limit: int, stats: list):
    async def open_store():
        fake.closed = False
        return CachedStore(fake, DiskCache(directory, limit), "fake", on_close=stats.append)

    return open_store


def digest(sample: dict) -> tuple[str, str]:
    return sample["__key__"], hashlib.sha256(b"".join(
        v for k, v in sorted(sample.items()) if isinstance(v, bytes))).hexdigest()


def test_per_object_epochs_after_the_first_make_no_request(tmp_path):
    data = objects(300, 2000)
    fake = FakeStore.with_objects(BUCKET, data)
    stats: list[CacheStats] = []
    dataset = AsyncS3Dataset.from_keys(BUCKET, list(data), shuffle=True, seed=1, limits=Limits(concurrency=16),
                                       store=cached_factory(fake, tmp_path / "cache", 8 << 20, stats))
    epochs = []
    for epoch in range(3):
        fake.reset_counters()
        dataset.set_epoch(epoch)
        epochs.append(sorted(digest(s) for s in dataset))
        assert fake.requests == (300 if epoch == 0 else 0)
    assert epochs[0] == epochs[1] == epochs[2]
    assert len(epochs[0]) == 300
    assert [(s.hits, s.misses) for s in stats] == [(0, 300), (300, 0), (300, 0)]


def tar_shard(s: int, n: int) -> bytes:
    rng = random.Random(s)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, payload in (("jpg", rng.randbytes(rng.randint(200, 3000))), ("cls", b"7")):
                info = tarfile.TarInfo(f"s{s:03d}/{i:06d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


@pytest.mark.parametrize("how", ["stream", "parts", "stream_with_cuts"])
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_shard_epochs_after_the_first_make_no_request(tmp_path, how):
    shards = {f"shards/train-{s:04d}.tar": tar_shard(s, 40) for s in range(6)}
    truncate = {key: [9000, None] for key in shards} if how == "stream_with_cuts" else None
    fake = FakeStore.with_objects(BUCKET, shards, truncate=truncate)
    stats: list[CacheStats] = []
    uri = f"s3://{BUCKET}/shards/" if how == "parts" else f"s3://{BUCKET}/shards/train-{{0000..0005}}.tar"
    dataset = AsyncS3Dataset.from_shards(uri, shuffle=True, seed=2, reading=Reading(part_size=8192),
                                         store=Store(backend=cached_factory(fake, tmp_path / "cache", 8 << 20, stats),
                                                     retry=FAST_RETRY))
    epochs = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        fake.reset_counters()
        epochs.append(sorted(digest(s) for s in dataset))
        if epoch == 0:
            if how == "parts":  # ranged GETs of part_size, and not one more
                assert fake.requests_by_key == {key: -(-len(data) // 8192) for key, data in shards.items()}
            else:  # one GET per shard, and one resume per cut
                assert fake.requests_by_key == {key: 2 if truncate else 1 for key in shards}
        else:
            assert fake.requests == 0, fake.requests_by_key
    assert epochs[0] == epochs[1] == epochs[2] and len(epochs[0]) == 240
    assert len(entry_files(tmp_path / "cache")) == 6 and temp_files(tmp_path / "cache") == []
    reads = sum(-(-len(data) // 8192) for data in shards.values()) if how == "parts" else 6
    assert stats[-1] == CacheStats(hits=reads, misses=0, bytes_read_from_cache=sum(map(len, shards.values())),
                                   evictions=0, corrupt_refetches=0)


def test_forked_workers_after_cached_in_process_epochs_do_not_hang(tmp_path, no_leaked_threads):
    """The fork hazard of DESIGN.md with the cache on: three num_workers=0 epochs (which use
    worker threads for commits), then forked DataLoader workers reading from the same cache."""
    from torch.utils.data import DataLoader

    data = objects(200, 300_000 // 100)
    fake = FakeStore.with_objects(BUCKET, data)
    stats: list[CacheStats] = []
    dataset = AsyncS3Dataset.from_keys(BUCKET, list(data), limits=Limits(concurrency=8),
                                       store=cached_factory(fake, tmp_path / "cache", 8 << 20, stats))
    for epoch in range(3):
        dataset.set_epoch(epoch)
        assert len(list(dataset)) == 200
    assert fake.requests == 200
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
    assert sorted(s["bin"] for s in loader) == sorted(data.values())


async def test_an_object_read_in_parts_caches_each_range_by_version(tmp_path):
    """A reader that never covers an object whole (a Parquet file's column chunks) hints the
    cache (``cache_in_parts``): each range is an entry of its own, read back with no request
    while its version is the one pinned; a new version is fetched again, never mixed."""
    data = blob(4, 5000)
    fake = FakeStore.with_objects(BUCKET, {"rows.parquet": data})
    ranges = [(100, 900), (2000, 2600), (4990, 5000)]
    cache = new_cache(tmp_path)
    with anyio.fail_after(DEADLINE):
        async with session(fake, cache) as store:
            store.cache_in_parts(BUCKET, "rows.parquet")
            pin = Pin(fake.etag_of(BUCKET, "rows.parquet"))
            for start, end in ranges:
                assert await store.get_range(BUCKET, "rows.parquet", start, end, pin=pin) == data[start:end]
            assert fake.requests == 3
        fake.reset_counters()
        async with session(fake, cache) as store:  # the next epoch: a new store, the same cache
            store.cache_in_parts(BUCKET, "rows.parquet")
            for start, end in ranges:
                assert await store.get_range(BUCKET, "rows.parquet", start, end, pin=pin) == data[start:end]
            assert fake.requests == 0 and store.hits == 3
            assert await store.get_range(BUCKET, "rows.parquet", 0, 50) == data[:50]  # another range: asked
            assert fake.requests == 1
        changed = blob(5, 5000)
        fake.objects[(BUCKET, "rows.parquet")] = changed
        fake.reset_counters()
        async with session(fake, cache) as store:
            store.cache_in_parts(BUCKET, "rows.parquet")
            new_pin = Pin(fake.etag_of(BUCKET, "rows.parquet"))
            assert await store.get_range(BUCKET, "rows.parquet", 100, 900, pin=new_pin) == changed[100:900]
            assert fake.requests == 1 and store.stale_refetches == 0 and store.misses == 1
