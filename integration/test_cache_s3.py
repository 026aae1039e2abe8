"""The disk cache on a real S3 server: later epochs send no GET, the size bound holds, damage is repaired.

The cache is built around the real backend as ``cache_dir=`` will build it: ``open_store("aioboto3",
...)`` wrapped in ``CachedStore``, handed to the dataset as an async ``store=`` factory. Between
the two sits ``Counting``, a proxy that appends one line per read request (``get``, ``get_range``,
``stream``) to a file, so requests are counted across DataLoader worker processes too. Content is
compared by sha256 with what was uploaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import threading
from collections import Counter
from pathlib import Path

import anyio
import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Limits, Reading, StoreError
from loader.cache.files import HEADER_SIZE, DiskCache
from loader.cache.store import CachedStore, CacheStats
from loader.retry import RetryPolicy
from loader.s3 import StoreSpec, open_store
from loader.s3.protocol import DEFAULT_CHUNK_SIZE

from datasets import jpeg_dataset, sha256
from shardsets import upload_shards

N = 1000


class Counting:
    """An ``ObjectStore`` proxy that logs each read request's key to ``log_path`` (one line each)."""

    def __init__(self, inner, log_path: Path, alias: dict[str, str] | None = None) -> None:
        self.inner = inner
        self.log_path = log_path
        self.alias = alias or {}  # key as asked -> key on the server

    def _count(self, key: str) -> str:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, key.encode("unicode_escape") + b"\n")  # one write: atomic with O_APPEND
        finally:
            os.close(fd)
        return self.alias.get(key, key)

    def list(self, bucket, prefix=""):
        return self.inner.list(bucket, prefix)

    async def get(self, bucket, key, **versions):
        return await self.inner.get(bucket, self._count(key), **versions)

    async def get_range(self, bucket, key, start, end, **versions):
        return await self.inner.get_range(bucket, self._count(key), start, end, **versions)

    def stream(self, bucket, key, start=0, chunk_size=DEFAULT_CHUNK_SIZE, **versions):
        return self.inner.stream(bucket, self._count(key), start=start, chunk_size=chunk_size,
                                 **versions)

    async def get_if_changed(self, bucket, key, etag, start=0, end=None, **versions):
        return await self.inner.get_if_changed(bucket, self._count(key), etag, start, end, **versions)

    async def put(self, bucket, key, data):
        await self.inner.put(bucket, key, data)

    async def aclose(self):
        await self.inner.aclose()


class Setup:
    """A cache directory, a request log, and the store factory that ties them to the server."""

    def __init__(self, server, tmp_path: Path, limit: int, alias: dict[str, str] | None = None) -> None:
        self.server = server
        self.directory = tmp_path / "cache"
        self.log_path = tmp_path / "requests.log"
        self.limit = limit
        self.alias = alias
        self.stats: list[CacheStats] = []

    async def factory(self) -> CachedStore:
        inner = await open_store("aioboto3", self.server.config, max_connections=16, retry=RetryPolicy())
        cache = await anyio.to_thread.run_sync(DiskCache, self.directory, self.limit)
        return CachedStore(Counting(inner, self.log_path, self.alias), cache,
                           StoreSpec.of("aioboto3", self.server.config).identity, on_close=self.stats.append)

    def requests(self) -> Counter:
        """Read requests since the last call, by key."""
        if not self.log_path.exists():
            return Counter()
        lines = [line.decode("unicode_escape") for line in self.log_path.read_bytes().splitlines()]
        self.log_path.unlink()
        return Counter(lines)

    def entries(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("??/*") if p.is_file())

    def path_of(self, bucket: str, key: str) -> Path:
        cache = DiskCache(self.directory, self.limit)
        return cache.path_for(cache.name_for(StoreSpec.of("aioboto3", self.server.config).identity, bucket, key))


def disk_bytes(directory: Path, include_tmp: bool = False) -> int:
    total = 0
    for path in directory.rglob("*"):
        if not include_tmp and path.parent.name == "tmp":
            continue
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:  # evicted while we looked
            pass
    return total


def object_digests(dataset, **loader_options) -> dict[str, str]:
    """``{key: sha256 of the jpg}`` of one epoch; fails on a repeated sample."""
    loader = DataLoader(dataset, batch_size=None, timeout=120 if loader_options.get("num_workers") else 0,
                        **loader_options)
    got = {}
    for sample in loader:
        key = sample["__url__"].split("/", 3)[3]
        assert key not in got, f"{key} delivered twice"
        got[key] = sha256(sample["jpg"])
    return got


@pytest.fixture(scope="module")
def jpegs(s3_server):
    """1,000 small JPEGs under train/ in a fresh bucket: (bucket, {key: sha256})."""
    bucket = s3_server.new_bucket()
    return bucket, jpeg_dataset(s3_server.minio, bucket, "train/", N, seed=7)


@pytest.mark.server_sensitive
def test_per_object_epochs_after_the_first_send_no_get(s3_server, jpegs, tmp_path):
    bucket, expected = jpegs
    setup = Setup(s3_server, tmp_path, 64 << 20)
    dataset = AsyncS3Dataset.from_keys(bucket, sorted(expected), shuffle=True, seed=1, limits=Limits(concurrency=32),
                                       store=setup.factory)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        assert object_digests(dataset) == expected
        requests = setup.requests()
        if epoch == 0:
            assert requests == Counter({key: 1 for key in expected}), "one GET per object"
        else:
            assert requests == Counter(), f"epoch {epoch} sent {sum(requests.values())} GETs"
    assert [(s.hits, s.misses) for s in setup.stats] == [(0, N), (N, 0), (N, 0)]
    assert len(setup.entries()) == N
    assert not list((setup.directory / "tmp").iterdir())


def test_dataloader_workers_fill_and_share_one_cache(s3_server, jpegs, tmp_path):
    """Two forked workers per epoch, each with its own store: they fill one directory, then
    the next epoch's workers (new processes) read everything from it."""
    bucket, expected = jpegs
    setup = Setup(s3_server, tmp_path, 64 << 20)
    dataset = AsyncS3Dataset.from_keys(bucket, sorted(expected), shuffle=True, seed=2, limits=Limits(concurrency=16),
                                       store=setup.factory)
    for epoch in range(2):
        dataset.set_epoch(epoch)
        assert object_digests(dataset, num_workers=2, multiprocessing_context="fork") == expected
        assert sum(setup.requests().values()) == (N if epoch == 0 else 0)
    assert len(setup.entries()) == N


@pytest.mark.parametrize("how", ["stream", "ranged_parts"])
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_shard_epochs_after_the_first_send_no_get(s3_server, tmp_path, how):
    bucket = s3_server.new_bucket()
    expected, _ = upload_shards(s3_server.minio, bucket, "shards/train-", [60] * 6, payload=3000, seed=3)
    setup = Setup(s3_server, tmp_path, 64 << 20)
    # A brace pattern gives no sizes: one streamed GET per shard. A prefix is listed, sizes are
    # known, and shards above two parts are read as parallel ranged GETs of part_size.
    uri = f"s3://{bucket}/shards/" if how == "ranged_parts" else f"s3://{bucket}/shards/train-{{0000..0005}}.tar"
    part_size = 32 << 10
    dataset = AsyncS3Dataset.from_shards(uri, shuffle=True, seed=4, reading=Reading(part_size=part_size),
                                         store=setup.factory)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        got = {}
        for sample in DataLoader(dataset, batch_size=None):
            assert sample["__key__"] not in got
            got[sample["__key__"]] = sha256(sample["bin"])
        assert got == expected
        requests = setup.requests()
        if epoch == 0:
            assert requests.pop("shards/index.json") == 1  # the one look for an index (none here)
            sizes = {o.object_name: o.size for o in s3_server.minio.list_objects(bucket, "shards/")}
            assert min(sizes.values()) > 2 * part_size  # so a listed shard is read as parts
            parts = {key: 1 if how == "stream" else -(-size // part_size) for key, size in sizes.items()}
            assert requests == Counter(parts), "one GET per shard or per part, and no more"
        else:
            assert requests == Counter(), f"epoch {epoch} sent {sum(requests.values())} GETs"
    assert len(setup.entries()) == 6


def test_eviction_keeps_the_directory_under_the_limit_while_reading_more(s3_server, jpegs, tmp_path):
    bucket, expected = jpegs
    total = sum(len(s3_server.minio.get_object(bucket, key).read()) for key in list(expected)[:50]) * N // 50
    limit = total // 4
    setup = Setup(s3_server, tmp_path, limit)
    dataset = AsyncS3Dataset.from_keys(bucket, sorted(expected), shuffle=True, seed=5, limits=Limits(concurrency=32),
                                       store=setup.factory)
    peak, stop = [0], threading.Event()

    def watch():
        """The size on disk, sampled while the epoch runs (files being written excluded). Each
        sample holds the cache's lock, as commits and evictions do: a walk of the directory that
        raced them could count a file already evicted next to the one that replaced it."""
        while not stop.is_set():
            if (setup.directory / ".lock").exists():
                fd = os.open(setup.directory / ".lock", os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    peak[0] = max(peak[0], disk_bytes(setup.directory))
                finally:
                    os.close(fd)
            stop.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            assert object_digests(dataset) == expected
            setup.requests()
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= limit, (peak[0], limit)
    assert disk_bytes(setup.directory, include_tmp=True) <= limit
    assert sum(s.evictions for s in setup.stats) > 0
    assert all(s.hits + s.misses == N for s in setup.stats)


def test_truncated_and_corrupted_cache_files_are_fetched_again(s3_server, jpegs, tmp_path):
    bucket, expected = jpegs
    keys = sorted(expected)[:40]
    setup = Setup(s3_server, tmp_path, 64 << 20)
    dataset = AsyncS3Dataset.from_keys(bucket, keys, store=setup.factory)
    assert object_digests(dataset) == {key: expected[key] for key in keys}
    setup.requests()
    truncated, flipped = setup.path_of(bucket, keys[3]), setup.path_of(bucket, keys[17])
    os.truncate(truncated, truncated.stat().st_size // 2)
    with open(flipped, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 1]))
    assert object_digests(dataset) == {key: expected[key] for key in keys}
    assert setup.requests() == Counter({keys[3]: 1, keys[17]: 1})
    assert setup.stats[-1].corrupt_refetches == 2
    assert object_digests(dataset) == {key: expected[key] for key in keys}  # repaired on disk
    assert setup.requests() == Counter()


def test_dot_dot_keys_never_leave_the_cache_directory(s3_server, tmp_path):
    """S3 servers refuse to store ``..`` segments, so such a key is read through an alias to a
    real object: its bytes come from the server, its cache file name from the hash."""
    bucket = s3_server.new_bucket()
    real = {"safe/a.bin": b"A" * 5000, "sp ace/ünï/b.bin": b"B" * 3000, "x/..%2f..%2fc.bin": b"C" * 100}
    for key, data in real.items():
        s3_server.minio.put_object(bucket, key, io.BytesIO(data), len(data))
    hostile = {"../../escape.bin": "safe/a.bin", "../../../../../../tmp/escape.bin": "safe/a.bin",
               "/etc/passwd": "sp ace/ünï/b.bin", "a/" * 300 + "deep.bin": "x/..%2f..%2fc.bin"}
    setup = Setup(s3_server, tmp_path / "inner", 64 << 20, alias=hostile)
    before = set(tmp_path.parent.rglob("*"))
    passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    keys = [*hostile, *real]
    content = {key: real[hostile.get(key, key)] for key in keys}

    async def read_all():
        async with await setup.factory() as store:
            got = {key: await store.get(bucket, key) for key in keys}
            streamed = {}
            for key in keys:
                streamed[key] = b"".join([chunk async for chunk in store.stream(bucket, key, start=1)])
            with pytest.raises(StoreError):  # the server itself refuses such a key
                await store.get(bucket, "../../not-aliased.bin")
            return got, streamed

    (tmp_path / "inner").mkdir()
    for _ in range(2):
        got, streamed = anyio.run(read_all)
        assert got == content
        assert streamed == {key: data[1:] for key, data in content.items()}
    requests = setup.requests()
    assert requests == Counter({**{key: 1 for key in keys}, "../../not-aliased.bin": 2})
    created = set(tmp_path.parent.rglob("*")) - before
    inside = os.path.realpath(tmp_path)
    assert all(os.path.realpath(p).startswith(inside + os.sep) for p in created), sorted(created)
    assert {p.name for p in setup.entries()} == {
        DiskCache.name_for(StoreSpec.of("aioboto3", s3_server.config).identity, bucket, key) for key in keys}
    assert not any("escape" in p.name or "passwd" in p.name for p in tmp_path.rglob("*"))
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd, "a key wrote outside"
