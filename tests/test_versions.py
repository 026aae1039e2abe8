"""One version per read, and a cache that cannot go stale silently, against the in-memory store.

``FakeStore`` behaves like S3 here: ETags are md5s of the bytes, listings carry them, a pinned
request whose ETag no longer holds fails as a 412 would. Objects are overwritten *between two
requests of one read* through its ``on_read`` hook, with bytes of the same size and layout, which
is what made splicing invisible before: every test then checks, field by field, that what was
delivered came from one version only, or that the read failed naming the object.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import tarfile
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loader import AsyncS3Dataset, AsyncS3MapDataset, Cache, ConfigError, Limits, Reading, Store, checkpoint
from loader.cache.files import MAGIC, DiskCache
from loader.cache.store import CachedStore
from loader.errors import ObjectChangedError
from loader.retry import RetryPolicy
from loader.s3.error_answers import error_for_answer
from loader.s3.protocol import Pin, normalize_etag

from fakes import FakeStore, reusable

BUCKET = "bucket"
FAST_RETRY = RetryPolicy(base_delay=0.001, max_delay=0.01)
DEADLINE = 20


def tar_of(version: int, n: int = 40, size: int = 2000) -> bytes:
    """A shard of ``n`` samples whose payloads say which version wrote them (same sizes)."""
    rng = random.Random(version)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("bin", bytes([version]) + rng.randbytes(size - 1)), ("cls", b"7")):
                info = tarfile.TarInfo(f"s/{i:05d}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def overwrite_on(fake: FakeStore, key: str, nth: int, data: bytes):
    """An ``on_read`` hook: replace ``key`` with ``data`` as its ``nth`` read request starts."""

    def hook(read_key: str, n: int) -> None:
        if read_key == key and n == nth:
            fake.objects[BUCKET, key] = data

    return hook


def versions_of(samples) -> set[int]:
    return {sample["bin"][0] for sample in samples}


# --------------------------------------------------------------------------- the pin itself


def test_pin_keeps_the_first_etag_and_refuses_another():
    pin = Pin()
    assert pin.if_match() is None
    pin.observe('"abc"', BUCKET, "k")
    assert pin.etag == "abc" and pin.if_match() == '"abc"'
    pin.observe("W/\"abc\"", BUCKET, "k")  # the same version, however quoted
    pin.observe(None, BUCKET, "k")  # a response without an ETag: nothing to compare
    with pytest.raises(ObjectChangedError, match=r"s3://bucket/k changed during the read.*abc"):
        pin.observe('"def"', BUCKET, "k")


def test_normalize_etag():
    assert normalize_etag('"x-2"') == "x-2" == normalize_etag("x-2") == normalize_etag('W/"x-2"')
    assert normalize_etag("") is None and normalize_etag(None) is None


def test_a_412_is_object_changed_and_names_the_object():
    error = error_for_answer("PreconditionFailed", 412, bucket="b", key="k/x", endpoint="e")
    assert isinstance(error, ObjectChangedError)
    assert error.bucket == "b" and error.key == "k/x"
    assert "s3://b/k/x changed during the read" in str(error) and "412" in str(error)


def test_fake_store_answers_if_match_like_s3():
    fake = FakeStore.with_objects(BUCKET, {"k": b"old"})

    async def main() -> None:
        pin = Pin()
        assert await fake.get_range(BUCKET, "k", 0, 2, pin=pin) == b"ol"
        fake.objects[BUCKET, "k"] = b"new"
        with pytest.raises(ObjectChangedError):
            await fake.get_range(BUCKET, "k", 2, 3, pin=pin)
        assert await fake.get_if_changed(BUCKET, "k", fake.etag_of(BUCKET, "k")) is None
        assert await fake.get_if_changed(BUCKET, "k", pin.etag) == b"new"

    anyio.run(main)


# --------------------------------------------------------------------------- shards


def shard_dataset(fake: FakeStore, spec: str, *, part_size: int | None = None, parts_inflight: int | None = None,
                  cache: Path | None = None) -> AsyncS3Dataset:
    """``parts_inflight``: ranged parts per shard, which only the old spelling sets (warned about)."""
    store = Store(backend=reusable(fake), retry=FAST_RETRY, cache=None if cache is None else Cache(cache))
    reading = Reading(shuffle_buffer=0, part_size=part_size)
    if parts_inflight is None:
        return AsyncS3Dataset.from_shards(spec, store=store, reading=reading)
    with pytest.deprecated_call(match="parts_inflight="):
        return AsyncS3Dataset.from_shards(spec, store=store, reading=reading, parts_inflight=parts_inflight)


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_ranged_parts_of_a_shard_overwritten_mid_read_are_never_spliced():
    """The original report: parts of a listed shard, overwritten after a few parts."""
    old, new = tar_of(1), tar_of(2)
    assert len(old) == len(new)
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": old})
    fake.on_read = overwrite_on(fake, "shards/a.tar", 4, new)
    ds = shard_dataset(fake, f"s3://{BUCKET}/shards/", part_size=4096, parts_inflight=2)
    delivered = []
    with pytest.raises(ObjectChangedError, match=r"s3://bucket/shards/a\.tar changed during the read"):
        for sample in ds:
            delivered.append(sample)
    assert delivered and versions_of(delivered) == {1}
    assert fake.requests_by_key["shards/a.tar"] >= 4


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_parts_all_ask_for_the_listed_version():
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": tar_of(1)})
    seen: list[str | None] = []
    get_range = fake.get_range

    async def spy(bucket, key, start, end, *, pin=None):
        seen.append(pin.etag if pin is not None else "no pin")
        return await get_range(bucket, key, start, end, pin=pin)

    fake.get_range = spy
    samples = list(shard_dataset(fake, f"s3://{BUCKET}/shards/", part_size=4096, parts_inflight=3))
    assert len(samples) == 40
    assert len(seen) > 3 and set(seen) == {fake.etag_of(BUCKET, "shards/a.tar")}


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_a_shard_replaced_after_listing_is_read_whole_in_its_new_version():
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": tar_of(1)})
    ds = shard_dataset(fake, f"s3://{BUCKET}/shards/", part_size=4096, parts_inflight=2)
    ds.shards()  # listed: size and ETag of version 1
    fake.objects[BUCKET, "shards/a.tar"] = tar_of(3, n=50)  # another size too
    samples = list(ds)
    assert len(samples) == 50 and versions_of(samples) == {3}


@pytest.mark.parametrize("name", ["a.tar", "a.tar.gz"])
def test_resumed_stream_of_an_overwritten_shard_fails_instead_of_splicing(name):
    """A connection cut mid-shard, the shard overwritten before the resume: a plain tar resumes
    at a member's offset, a .tar.gz restarts from byte 0 and skips what it parsed; either is
    only sound on the same bytes, so the resume asks for the first version."""
    import gzip

    key = f"shards/{name}"
    pack = (lambda data: gzip.compress(data, mtime=0)) if name.endswith(".gz") else bytes
    old, new = pack(tar_of(1)), pack(tar_of(2))
    fake = FakeStore.with_objects(BUCKET, {key: old}, truncate={key: [len(old) // 2, None]})
    fake.on_read = overwrite_on(fake, key, 2, new)
    delivered = []
    with pytest.raises(ObjectChangedError, match=re.escape(f"s3://bucket/{key}")):
        for sample in shard_dataset(fake, f"s3://{BUCKET}/{key}"):
            delivered.append(sample)
    assert 0 < len(delivered) < 40 and versions_of(delivered) == {1}


def test_resumed_stream_of_an_unchanged_shard_still_completes():
    old = tar_of(1)
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": old},
                                  truncate={"shards/a.tar": [len(old) // 3, len(old) // 3, None]})
    samples = list(shard_dataset(fake, f"s3://{BUCKET}/shards/a.tar"))
    assert len(samples) == 40 and versions_of(samples) == {1}
    assert fake.requests_by_key["shards/a.tar"] == 3


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_a_server_without_etags_reads_as_before():
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": tar_of(1)}, etags=False)
    samples = list(shard_dataset(fake, f"s3://{BUCKET}/shards/", part_size=4096))
    assert len(samples) == 40


# --------------------------------------------------------------------------- checkpoints


def saved(seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    buffer = io.BytesIO()
    torch.save({f"w{i}": torch.randn(3000, generator=generator) for i in range(4)}, buffer)
    return buffer.getvalue()


def test_checkpoint_overwritten_during_a_load_fails_naming_it():
    old, new = saved(1), saved(2)
    assert len(old) == len(new)
    fake = FakeStore.with_objects(BUCKET, {"ckpt/step.pt": old})
    fake.on_read = overwrite_on(fake, "ckpt/step.pt", 3, new)
    with pytest.raises(ObjectChangedError, match=r"s3://bucket/ckpt/step\.pt changed during the read"):
        checkpoint.load(f"s3://{BUCKET}/ckpt/step.pt", store=reusable(fake), part_size=4096,
                        limits=Limits(concurrency=2))


def test_checkpoint_overwritten_after_its_listing_fails_before_reading_anything():
    fake = FakeStore.with_objects(BUCKET, {"ckpt/step.pt": saved(1)})
    fake.on_read = overwrite_on(fake, "ckpt/step.pt", 1, saved(2))
    with pytest.raises(ObjectChangedError):
        checkpoint.load(f"s3://{BUCKET}/ckpt/step.pt", store=reusable(fake), part_size=4096)


def test_checkpoint_loads_pinned_to_the_listed_version():
    data = saved(1)
    fake = FakeStore.with_objects(BUCKET, {"ckpt/step.pt": data})
    out = checkpoint.load(f"s3://{BUCKET}/ckpt/step.pt", store=reusable(fake), part_size=4096)
    assert torch.equal(out["w0"], torch.load(io.BytesIO(data))["w0"])


# --------------------------------------------------------------------------- the cache


def payloads(n: int, version: int, size: int = 300) -> dict[str, bytes]:
    return {f"train/{i:04d}.bin": bytes([version]) + random.Random(i * 7 + version).randbytes(size)
            for i in range(n)}


def by_key(samples) -> dict[str, bytes]:
    return {sample["__key__"]: sample["bin"] for sample in samples}


def test_listing_etags_refetch_overwritten_entries_and_nothing_else(tmp_path):
    fake = FakeStore.with_objects(BUCKET, payloads(40, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path))}
    assert len(list(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options))) == 40
    changed = payloads(40, 2)
    for key in list(changed)[:10]:
        fake.objects[BUCKET, key] = changed[key]
    fake.reset_counters()
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options)  # a new listing
    got = by_key(ds)
    assert sum(value[0] == 2 for value in got.values()) == 10
    assert all(got[key.removesuffix(".bin")] == data for (_, key), data in fake.objects.items())
    assert fake.requests == 10
    assert ds.stats()["cache_stale_refetches"] == 10
    fake.reset_counters()
    assert len(list(ds)) == 40 and fake.requests == 0  # epoch 2: every entry current, no GET


def test_without_etags_in_the_key_list_listing_rule_trusts_entries(tmp_path):
    """The documented rule: cache_validate='listing' with from_keys has nothing to compare."""
    fake = FakeStore.with_objects(BUCKET, payloads(5, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path))}
    keys = sorted(key for _, key in fake.objects)
    list(AsyncS3Dataset.from_keys(BUCKET, keys, **options))
    fake.objects.update({(BUCKET, k): v for k, v in payloads(5, 2).items()})
    fake.reset_counters()
    assert versions_of(AsyncS3Dataset.from_keys(BUCKET, keys, **options)) == {1}
    assert fake.requests == 0


def test_always_revalidates_with_conditional_gets_that_cost_no_body(tmp_path):
    fake = FakeStore.with_objects(BUCKET, payloads(8, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path, validate="always"))}
    keys = sorted(key for _, key in fake.objects)
    list(AsyncS3Dataset.from_keys(BUCKET, keys, **options))
    fake.objects[BUCKET, keys[3]] = payloads(8, 2)[keys[3]]
    fake.reset_counters()
    got = by_key(AsyncS3Dataset.from_keys(BUCKET, keys, **options))
    assert got[keys[3].removesuffix(".bin")][0] == 2
    assert {value[0] for key, value in got.items() if key != keys[3].removesuffix(".bin")} == {1}
    assert fake.conditional_requests == 8  # one per entry
    assert fake.requests == 8 + 1  # and one full GET, for the changed object


def test_never_trusts_entries(tmp_path):
    fake = FakeStore.with_objects(BUCKET, payloads(4, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path, validate="never"))}
    list(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options))
    fake.objects.update({(BUCKET, k): v for k, v in payloads(4, 2).items()})
    fake.reset_counters()
    assert versions_of(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options)) == {1}
    assert fake.requests == 0


def test_cache_validate_is_checked_up_front():
    """Each spelling's error names the spelling the user wrote."""
    with pytest.raises(ConfigError, match=r"^Cache\.validate='sometimes' must be one of"):
        AsyncS3Dataset.from_keys(BUCKET, ["k"], store=Store(cache=Cache("cache", validate="sometimes")))
    with pytest.raises(ConfigError, match=r"^Cache\.limit=100 must be a number of bytes, at least 4096"):
        Cache("cache", limit=100)
    with pytest.raises(ConfigError, match=r"^Cache\.dir='' must be a directory path"):
        Cache("")
    with pytest.deprecated_call(), pytest.raises(ConfigError, match=r"^cache_validate='sometimes' must be one of"):
        AsyncS3Dataset.from_keys(BUCKET, ["k"], cache_dir="cache", cache_validate="sometimes")


def test_map_dataset_refetches_overwritten_entries(tmp_path):
    fake = FakeStore.with_objects(BUCKET, payloads(6, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path))}
    with AsyncS3MapDataset.from_prefix(f"s3://{BUCKET}/train/", **options) as ds:
        assert versions_of(ds.__getitems__(list(range(6)))) == {1}
    fake.objects.update({(BUCKET, k): v for k, v in payloads(6, 2).items()})
    fake.reset_counters()
    with AsyncS3MapDataset.from_prefix(f"s3://{BUCKET}/train/", **options) as ds:
        assert versions_of(ds.__getitems__(list(range(6)))) == {2}
    assert fake.requests == 6


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_shards_from_a_cache_are_refetched_when_the_listing_says_so(tmp_path):
    fake = FakeStore.with_objects(BUCKET, {"shards/a.tar": tar_of(1)})
    options = {"cache": tmp_path, "part_size": 4096, "parts_inflight": 2}
    assert versions_of(shard_dataset(fake, f"s3://{BUCKET}/shards/", **options)) == {1}
    fake.objects[BUCKET, "shards/a.tar"] = tar_of(2)
    fake.reset_counters()
    ds = shard_dataset(fake, f"s3://{BUCKET}/shards/", **options)
    assert versions_of(ds) == {2}
    fake.reset_counters()
    assert versions_of(ds) == {2} and fake.requests == 0  # the new version is cached now


async def cached(fake: FakeStore, tmp_path, **options) -> CachedStore:
    fake.closed = False
    return CachedStore(fake, DiskCache(tmp_path / "cache", 1 << 20, block_size=256), "fake",
                       **options)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_pieces_of_two_versions_are_never_committed(tmp_path, anyio_backend):
    fake = FakeStore.with_objects(BUCKET, {"k": b"a" * 1000})
    with anyio.fail_after(DEADLINE):
        store = await cached(fake, tmp_path)
        try:
            assert await store.get_range(BUCKET, "k", 0, 600) == b"a" * 600
            fake.objects[BUCKET, "k"] = b"b" * 1000
            assert await store.get_range(BUCKET, "k", 600, 1000) == b"b" * 400  # unpinned: as asked
        finally:
            await store.aclose()
        fake.reset_counters()
        store = await cached(fake, tmp_path)
        try:
            assert await store.get(BUCKET, "k") == b"b" * 1000
            assert fake.requests == 1  # nothing was committed from the mixed pieces
        finally:
            await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_pinned_read_never_takes_an_entry_of_another_version(tmp_path, anyio_backend):
    fake = FakeStore.with_objects(BUCKET, {"k": b"a" * 1000})
    with anyio.fail_after(DEADLINE):
        store = await cached(fake, tmp_path)
        try:
            old_etag = fake.etag_of(BUCKET, "k")
            await store.get(BUCKET, "k")  # cached: version a
            fake.objects[BUCKET, "k"] = b"b" * 1000
            pin = Pin()
            assert await store.get_range(BUCKET, "k", 0, 10, pin=pin) == b"a" * 10  # from disk
            assert pin.etag == old_etag
            fresh = Pin(fake.etag_of(BUCKET, "k"))
            assert await store.get_range(BUCKET, "k", 0, 10, pin=fresh) == b"b" * 10  # not disk
            # pinned to a: the disk has all of a, so the read stays whole without the store
            fake.reset_counters()
            assert await store.get_range(BUCKET, "k", 10, 20, pin=Pin(old_etag)) == b"a" * 10
            assert fake.requests == 0
        finally:
            await store.aclose()


def test_cache_files_of_the_first_format_are_fetched_again(tmp_path):
    fake = FakeStore.with_objects(BUCKET, payloads(3, 1))
    options = {"store": Store(backend=reusable(fake), retry=FAST_RETRY, cache=Cache(tmp_path))}
    list(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options))
    files = [path for path in tmp_path.rglob("*") if path.is_file() and len(path.name) == 64]
    assert len(files) == 3
    for path in files:
        raw = bytearray(path.read_bytes())
        assert raw[:8] == MAGIC
        raw[:8] = b"LDRCACH1"
        path.write_bytes(bytes(raw))
    fake.reset_counters()
    assert len(list(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options))) == 3
    assert fake.requests == 3


def test_cache_entry_records_the_etag(tmp_path):
    data = b"x" * 5000
    cache = DiskCache(tmp_path, 1 << 20, block_size=1024)
    name = cache.name_for("e", BUCKET, "k")
    cache.put(name, data, hashlib.md5(data).hexdigest())
    entry = cache.open(name)
    try:
        assert entry.etag == hashlib.md5(data).hexdigest() and entry.read(0, 5000) == data
    finally:
        entry.close()
    cache.put(name, data)  # no version known
    entry = cache.open(name)
    try:
        assert entry.etag is None and entry.read(100, 200) == data[100:200]
    finally:
        entry.close()


def test_key_lists_keep_listed_etags_compactly_through_merges_slices_and_pickles():
    import pickle

    from loader.listing.keylist import KeyList, _Runs
    from loader.s3.protocol import ObjectInfo

    md5 = hashlib.md5(b"x").hexdigest()
    infos = [ObjectInfo("b/2", 2, md5), ObjectInfo("a/1", 1, "abc-3"), ObjectInfo("c/3", 3, None)]
    runs = _Runs("")
    runs.add(infos[:1])
    runs.add(infos[1:])  # out of order: merged, not concatenated
    merged = runs.merged()
    assert list(merged) == ["a/1", "b/2", "c/3"]
    assert merged.etags() == ["abc-3", md5, None]
    assert list(merged.infos())[1] == ObjectInfo("b/2", 2, md5)
    assert merged[1:].etags() == [md5, None]
    assert pickle.loads(pickle.dumps(merged)).etags() == merged.etags()
    plain = KeyList.from_infos([ObjectInfo("k", 1)])
    assert plain.etags() is None
    assert KeyList.from_infos([ObjectInfo("k", 1, md5)])._etags.nbytes < 24  # 17 bytes + offset


# --------------------------------------------------------------------------- the key list's versions


keys_and_tags = st.lists(st.tuples(st.text(min_size=1, max_size=8), st.one_of(st.none(), st.sampled_from(
    ["0cc175b9c0f1b6a831c399e269772661", "abc-3", "x"]))), unique_by=lambda pair: pair[0], max_size=30)


@given(keys_and_tags, st.text(max_size=8), st.booleans())
def test_a_key_lists_versions_answer_as_a_dict_would_sorted_or_not(pairs, probe, in_order):
    from loader.listing.keylist import KeyList
    from loader.listing.versions import listed_versions
    from loader.s3.protocol import ObjectInfo

    if in_order:
        pairs = sorted(pairs)
    keys = KeyList.from_infos(ObjectInfo(key, 1, tag) for key, tag in pairs)
    versions = listed_versions(BUCKET, keys)
    expected = dict(pairs)
    if all(tag is None for tag in expected.values()):
        assert versions is None  # a listing without ETags: nothing to compare with
        return
    assert versions is not None
    for key in [*expected, probe]:
        assert versions(BUCKET, key) == expected.get(key)
        assert versions("other-bucket", key) is None


def test_keys_from_the_user_and_shards_without_etags_give_no_versions():
    from loader.formats.shards import ShardRef
    from loader.listing.versions import listed_versions, versions_of

    assert listed_versions(BUCKET, ("a", "b")) is None
    assert versions_of([ShardRef(BUCKET, "s/a.tar", 10)]) is None
    versions = versions_of([ShardRef(BUCKET, "s/a.tar", 10, "e1"), ShardRef("b2", "s/a.tar", 10, "e2")])
    assert versions is not None
    assert (versions(BUCKET, "s/a.tar"), versions("b2", "s/a.tar"), versions(BUCKET, "s/b.tar")) == (
        "e1", "e2", None)


def test_a_mix_asks_its_sources_key_lists_in_turn():
    from loader.listing.versions import first_known

    def listing(table):
        return lambda bucket, key: table.get((bucket, key))

    a, b = listing({("x", "k"): "1"}), listing({("x", "k"): "2", ("y", "k"): "3"})
    assert first_known([None, None]) is None and first_known([None, a]) is a
    both = first_known([a, None, b])
    assert both is not None
    assert (both("x", "k"), both("y", "k"), both("z", "k")) == ("1", "3", None)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
@pytest.mark.parametrize("validate", ["listing", "always", "never"])
async def test_the_cache_checks_entries_against_the_versions_it_was_given(tmp_path, anyio_backend, validate):
    """The store is told the key list's versions once; reads carry none."""
    fake = FakeStore.with_objects(BUCKET, {"k": b"a" * 100})
    old = fake.etag_of(BUCKET, "k")
    with anyio.fail_after(DEADLINE):
        store = await cached(fake, tmp_path, validate=validate)
        try:
            await store.get(BUCKET, "k")  # cached: version a
        finally:
            await store.aclose()
        fake.objects[BUCKET, "k"] = b"b" * 100
        listed = {"k": fake.etag_of(BUCKET, "k")}  # a new listing saw version b
        store = await cached(fake, tmp_path, validate=validate,
                             versions=lambda bucket, key: listed.get(key))
        try:
            assert await store.get(BUCKET, "k") == (b"a" if validate == "never" else b"b") * 100
            assert store.stale_refetches == (0 if validate == "never" else 1)
            assert store.revalidations == 0  # the listing said it: no conditional GET needed
        finally:
            await store.aclose()
        fake.reset_counters()
        store = await cached(fake, tmp_path, validate=validate,
                             versions=lambda bucket, key: None if key == "k" else old)
        try:  # not in the key list: trusted, or asked about under "always"
            await store.get(BUCKET, "k")
            assert fake.conditional_requests == (1 if validate == "always" else 0)
        finally:
            await store.aclose()
