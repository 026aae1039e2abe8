"""One version per read, and a cache that cannot go stale silently, on a real S3 server.

The server is the judge here: it answers ``If-Match`` with 412 PreconditionFailed once an object
was overwritten (S3, MinIO and SeaweedFS all do). Objects are overwritten *between two requests
of one read*, through the same server, by a thin store wrapper (``Overwriting``) that PUTs the
new version as the n-th read request of the key starts, so the timing is exact, not raced.
New versions have the same member names and sizes and differ only in their bytes, whose first
byte names the version: a spliced read is then invisible to a tar parser, and only the checks
here (every delivered sample of one version, or an error naming the object) can tell.

Each read path runs on every backend and GET path: aioboto3's direct signed GETs (the default
for path-style endpoints), aioboto3 through botocore, and obstore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import random
import tarfile

import anyio
import pytest
import torch

from loader import AsyncS3Dataset, Cache, Limits, ObjectChangedError, Reading, RetryPolicy, Store, checkpoint
from loader.s3 import open_store
from loader.s3.aioboto3_store import Aioboto3Store

from faults import FaultPlan, FaultProxy

BACKENDS = ["aioboto3", "aioboto3-botocore", "obstore"]
FAST_RETRY = RetryPolicy(base_delay=0.01, max_delay=0.1)


def tar_of(version: int, members: int, size: int) -> bytes:
    """``members`` samples of ``size`` bytes whose first byte is ``version`` (same layout for
    every version)."""
    rng = random.Random(version)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(members):
            data = bytes([version]) + rng.randbytes(size - 1)
            info = tarfile.TarInfo(f"s/{i:05d}.bin")
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def versions_of(samples) -> set[int]:
    return {sample["bin"][0] for sample in samples}


async def open_backend(backend: str, config, retry: RetryPolicy = FAST_RETRY):
    if backend == "aioboto3-botocore":
        return await Aioboto3Store.open(config, max_connections=8, retry=retry, direct_gets=False)
    return await open_store(backend, config, max_connections=8, retry=retry)


class Overwriting:
    """A store that passes every request on; as read request number ``nth`` of ``key`` starts,
    it first runs ``before()`` (if given) and overwrites ``key`` with ``data`` (a PUT)."""

    def __init__(self, inner, key: str, nth: int, data: bytes | None, before=None) -> None:
        self.inner = inner
        self.key, self.nth, self.data, self.before = key, nth, data, before
        self.reads = 0

    async def _read_starts(self, bucket: str, key: str) -> None:
        if key != self.key:
            return
        self.reads += 1
        if self.reads == self.nth:
            if self.before is not None:
                self.before()
            if self.data is not None:
                # another writer, which no cancellation of ours stops: the read that triggers it
                # may be a hedge, cancelled when the request it doubles answers first
                with anyio.CancelScope(shield=True):
                    await self.inner.put(bucket, key, self.data)

    def list(self, bucket, prefix=""):
        return self.inner.list(bucket, prefix)

    async def get(self, bucket, key, **versions):
        await self._read_starts(bucket, key)
        return await self.inner.get(bucket, key, **versions)

    async def get_range(self, bucket, key, start, end, **versions):
        await self._read_starts(bucket, key)
        return await self.inner.get_range(bucket, key, start, end, **versions)

    async def get_if_changed(self, bucket, key, etag, start=0, end=None, **versions):
        await self._read_starts(bucket, key)
        return await self.inner.get_if_changed(bucket, key, etag, start, end, **versions)

    async def stream(self, bucket, key, start=0, chunk_size=1 << 20, **versions):
        await self._read_starts(bucket, key)
        async with contextlib.aclosing(
            self.inner.stream(bucket, key, start=start, chunk_size=chunk_size, **versions)
        ) as chunks:
            async for chunk in chunks:
                yield chunk

    async def put(self, bucket, key, data):
        await self.inner.put(bucket, key, data)

    async def aclose(self):
        await self.inner.aclose()


def overwriting(backend: str, config, key: str, nth: int, data: bytes | None, before=None):
    """``store=`` for a dataset or a checkpoint load: a backend wrapped in ``Overwriting``."""

    async def factory():
        return Overwriting(await open_backend(backend, config), key, nth, data, before)

    return factory


def upload(s3_server, bucket: str, key: str, data: bytes) -> None:
    s3_server.minio.put_object(bucket, key, io.BytesIO(data), len(data))


@pytest.fixture(scope="module")
def big_shards():
    """The shard of the original report: 40 members of ~1 MiB (~40 MiB), and its rewrite."""
    old, new = tar_of(1, 40, (1 << 20) - 512), tar_of(2, 40, (1 << 20) - 512)
    assert len(old) == len(new) and len(old) > 40 << 20
    return old, new


# --------------------------------------------------------------------------- ranged parts


@pytest.mark.server_sensitive
@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_overwritten_during_ranged_parts_is_never_spliced(s3_server, big_shards, backend):
    """The original reproduction: part_size=2 MiB, parts_inflight=2, overwritten mid-read."""
    old, new = big_shards
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, "big/train-0000.tar", old)
    store = overwriting(backend, s3_server.config, "big/train-0000.tar", 6, new)
    with pytest.deprecated_call(match="parts_inflight="):  # parts per shard: the old spelling only
        dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/big/", parts_inflight=2,
                                             reading=Reading(part_size=2 << 20, shuffle_buffer=0),
                                             store=Store(backend=store, retry=FAST_RETRY))
    assert dataset.shards()[0].etag is not None, "the listing carries the ETag"
    delivered = []
    with pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/big/train-0000\.tar changed "
                                                 "during the read"):
        for sample in dataset:
            delivered.append(sample)
    assert 0 < len(delivered) < 40 and versions_of(delivered) == {1}
    # the next epoch reads the new version whole
    with pytest.deprecated_call(match="parts_inflight="):
        again = AsyncS3Dataset.from_shards(f"s3://{bucket}/big/", reading=Reading(part_size=2 << 20), parts_inflight=2,
                                           config=s3_server.config, store=backend.split("-")[0])
    again = list(again)
    assert len(again) == 40 and versions_of(again) == {2}


@pytest.mark.server_sensitive
@pytest.mark.parametrize("backend", ["aioboto3", "obstore"])
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_shard_replaced_between_listing_and_reading_is_read_in_its_new_version(s3_server, backend):
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, "s/a.tar", tar_of(1, 20, 100_000))
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/s/", reading=Reading(part_size=256 << 10),
                                         config=s3_server.config, store=backend)
    dataset.shards()
    upload(s3_server, bucket, "s/a.tar", tar_of(2, 30, 100_000))
    samples = list(dataset)
    assert len(samples) == 30 and versions_of(samples) == {2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_object_replaced_at_another_size_after_the_listing_is_read_in_its_new_version(s3_server, backend):
    """A whole read is held to the size its listing gave only for the version listed: the
    server's ETag on the answer tells that a shorter or longer body is a version written since."""
    bucket = s3_server.new_bucket()
    for name in ("a", "b", "c"):
        upload(s3_server, bucket, f"p/{name}.bin", bytes([1]) * 1000)
    dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/p/", shuffle=False,
                                         store=functools.partial(open_backend, backend, s3_server.config))
    assert len(dataset) == 3  # listed: 1,000 bytes each
    upload(s3_server, bucket, "p/b.bin", bytes([2]) * 990)
    upload(s3_server, bucket, "p/c.bin", bytes([3]) * 1500)
    assert [sample["bin"] for sample in dataset] == [bytes([1]) * 1000, bytes([2]) * 990, bytes([3]) * 1500]


# --------------------------------------------------------------------------- resumed streams


def proxied(s3_server, plan: FaultPlan) -> FaultProxy:
    try:
        return FaultProxy(s3_server.config.endpoint_url, plan)
    except ValueError as exc:
        pytest.skip(f"the fault proxy needs a loopback http server: {exc}")


@pytest.mark.server_sensitive
@pytest.mark.parametrize("overwrite", [True, False], ids=["overwritten", "unchanged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_cut_by_the_proxy_resumes_only_on_the_same_version(s3_server, backend, overwrite):
    """The proxy cuts the shard's first GET mid-body; before the resume, the shard is
    overwritten (or not). The resume asks for the first version: 412, an error naming the shard;
    unchanged, the shard completes exactly once."""
    old, new = tar_of(1, 40, 100_000), tar_of(2, 40, 100_000)
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, "s/a.tar", old)
    with proxied(s3_server, FaultPlan()) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        store = overwriting(backend, config, "s/a.tar", 2, new if overwrite else None,
                            before=lambda: proxy.set_plan(FaultPlan()))
        dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/s/a.tar", reading=Reading(shuffle_buffer=0),
                                             store=Store(backend=store, retry=FAST_RETRY))
        dataset.resolve()  # the look for an index (there is none) before the proxy cuts GETs
        proxy.set_plan(FaultPlan(truncate=1.0, seed=3))
        delivered = []
        with contextlib.ExitStack() as stack:
            if overwrite:
                stack.enter_context(pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/s/a\.tar"))
            for sample in dataset:
                delivered.append(sample)
        assert proxy.counts["truncate"] == 1
    assert versions_of(delivered) <= {1}
    if overwrite:
        assert len(delivered) < 40
    else:
        assert [s["__key__"] for s in delivered] == [f"s/{i:05d}" for i in range(40)]


# --------------------------------------------------------------------------- checkpoints


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(1 << 18, generator=generator) for i in range(8)}  # 8 MiB


@pytest.mark.server_sensitive
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_overwritten_during_a_parallel_load_fails_naming_it(s3_server, backend):
    bucket = s3_server.new_bucket()
    uri = f"s3://{bucket}/ckpt/latest.pt"
    checkpoint.save(state(1), uri, config=s3_server.config)
    replacement = io.BytesIO()
    torch.save(state(2), replacement)
    store = overwriting(backend, s3_server.config, "ckpt/latest.pt", 4, replacement.getvalue())
    with pytest.raises(ObjectChangedError, match=rf"{uri} changed during the read"):
        checkpoint.load(uri, store=store, part_size=1 << 20, limits=Limits(concurrency=4))
    loaded = checkpoint.load(uri, store=functools.partial(open_backend, backend, s3_server.config))
    assert torch.equal(loaded["layer3"], state(2)["layer3"])


# --------------------------------------------------------------------------- the cache


def objects(n: int, version: int) -> dict[str, bytes]:
    return {f"train/{i:04d}.bin": bytes([version]) + random.Random(i * 31 + version).randbytes(2000)
            for i in range(n)}


@pytest.mark.server_sensitive
@pytest.mark.parametrize("backend", ["aioboto3", "obstore"])
def test_cache_gives_fresh_bytes_after_an_overwrite_between_epochs(s3_server, tmp_path, backend):
    bucket = s3_server.new_bucket()
    for key, data in objects(40, 1).items():
        upload(s3_server, bucket, key, data)
    options = {"config": s3_server.config, "store": Store(backend=backend, cache=Cache(tmp_path))}
    first = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", **options)
    assert versions_of(first) == {1}
    assert versions_of(first) == {1} and first.stats()["requests"] == 0  # epoch 2: no GET
    changed = dict(list(objects(40, 2).items())[:10])
    for key, data in changed.items():
        upload(s3_server, bucket, key, data)
    second = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", **options)  # a new listing
    got = {sample["__key__"] + ".bin": sample["bin"] for sample in second}
    assert all(got[key] == data for key, data in changed.items())
    assert sum(data[0] == 1 for data in got.values()) == 30
    assert second.stats()["requests"] == 10 and second.stats()["cache_stale_refetches"] == 10
    assert versions_of(second) == {1, 2} and second.stats()["requests"] == 0


@pytest.mark.server_sensitive
@pytest.mark.parametrize("backend", ["aioboto3", "obstore"])
def test_cache_validate_always_asks_the_server_with_conditional_gets(s3_server, tmp_path, backend):
    bucket = s3_server.new_bucket()
    for key, data in objects(8, 1).items():
        upload(s3_server, bucket, key, data)
    keys = sorted(objects(8, 1))
    options = {"config": s3_server.config, "store": Store(backend=backend, cache=Cache(tmp_path, validate="always"))}
    assert versions_of(AsyncS3Dataset.from_keys(bucket, keys, **options)) == {1}
    upload(s3_server, bucket, keys[5], objects(8, 2)[keys[5]])
    again = AsyncS3Dataset.from_keys(bucket, keys, **options)
    got = {sample["__key__"] + ".bin": sample["bin"][0] for sample in again}
    assert got == {key: 2 if key == keys[5] else 1 for key in keys}
    assert again.stats()["requests"] == 8 + 1  # 8 answered 304 (no body), one refetch


@pytest.mark.server_sensitive
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_shards_from_the_cache_are_refetched_when_overwritten(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, "s/a.tar", tar_of(1, 20, 100_000))
    options = {"config": s3_server.config, "store": Store(cache=Cache(tmp_path)),
               "reading": Reading(part_size=256 << 10)}
    assert versions_of(AsyncS3Dataset.from_shards(f"s3://{bucket}/s/", **options)) == {1}
    upload(s3_server, bucket, "s/a.tar", tar_of(2, 20, 100_000))
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/s/", **options)
    assert versions_of(dataset) == {2}
    assert versions_of(dataset) == {2} and dataset.stats()["requests"] == 0
