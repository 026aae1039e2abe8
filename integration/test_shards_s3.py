"""Shard mode end to end on a real S3 server: exactly once, order, splitting, memory, bad shards."""

from __future__ import annotations

import io
import time

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, Limits, NoSuchKeyError, Reading, ShardFormatError

from datasets import import_probes, sha256
from shardsets import pack, upload_shards

SIZES = [260, 250, 270, 240, 255, 265, 245, 275]  # 2,060 samples in 8 shards


@pytest.fixture(scope="module")
def shards(s3_server):
    bucket = s3_server.new_bucket()
    expected, counts = upload_shards(s3_server.minio, bucket, "train/shard-", SIZES, payload=1500, seed=4)
    return bucket, expected, counts


def digests(dataset, **options):
    loader = DataLoader(dataset, batch_size=None, timeout=120 if options.get("num_workers") else 0, **options)
    return [(sample["__key__"], sha256(sample["bin"])) for sample in loader]


def assert_exactly_once(got, expected):
    keys = [key for key, _ in got]
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} duplicates"
    assert dict(got) == expected


@pytest.mark.server_sensitive
@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_every_sample_exactly_once(s3_server, shards, num_workers):
    bucket, expected, _ = shards
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/train/shard-{{0000..0007}}.tar", shuffle=True,
                                         seed=1, config=s3_server.config)
    options = {"num_workers": num_workers}
    if num_workers:
        options["multiprocessing_context"] = "fork"
    assert_exactly_once(digests(dataset, **options), expected)


@pytest.mark.server_sensitive
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_prefix_form_reads_large_shards_as_ranged_parts(s3_server, shards):
    bucket, expected, _ = shards
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/train/", reading=Reading(part_size=64 << 10),
                                         config=s3_server.config)
    assert all(shard.size for shard in dataset.shards()), "the listing gives sizes"
    assert_exactly_once(digests(dataset), expected)


def test_part_size_below_the_floor_is_refused_and_the_floor_reads_in_parts(s3_server):
    """``part_size=1`` once made one GET per byte of a shard; it is refused before any request,
    naming the setting and the floor. A 2.6 MB shard read with ``part_size`` at the floor takes
    three ranged GETs."""
    bucket = s3_server.new_bucket("parts")
    expected, _ = upload_shards(s3_server.minio, bucket, "big/shard-", [130], payload=20_000, seed=8)
    uri = f"s3://{bucket}/big/"
    for part_size in (1, 256 << 10, (1 << 20) - 1):
        with pytest.raises(ConfigError, match=rf"^part_size={part_size} is below the floor of 1048576 bytes: "
                                              r"each part is one ranged GET.*give part_size=1048576 \(1 MiB\)"):
            AsyncS3Dataset.from_shards(uri, reading=Reading(part_size=part_size), config=s3_server.config)
    dataset = AsyncS3Dataset.from_shards(uri, reading=Reading(part_size=1 << 20), config=s3_server.config)
    (shard,) = dataset.shards()
    assert 2 << 20 < shard.size <= 3 << 20
    assert_exactly_once(digests(dataset), expected)
    stats = dataset.stats()
    assert stats["requests"] - stats["hedged"] == 3  # a part slow under load may be sent twice


def test_fewer_shards_than_workers(s3_server, shards):
    bucket, expected, _ = shards
    two = f"s3://{bucket}/train/shard-{{0000..0001}}.tar"
    wanted = {key: digest for key, digest in expected.items() if key.startswith(("s0000/", "s0001/"))}
    dataset = AsyncS3Dataset.from_shards(two, shuffle=True, config=s3_server.config)
    got = digests(dataset, num_workers=4, multiprocessing_context="fork")
    assert_exactly_once(got, wanted)


def test_epochs_differ_and_seeds_repeat(s3_server, shards):
    bucket, expected, _ = shards
    uri = f"s3://{bucket}/train/shard-{{0000..0007}}.tar"

    def order(epoch, seed=7):
        dataset = AsyncS3Dataset.from_shards(uri, shuffle=True, seed=seed, config=s3_server.config)
        dataset.set_epoch(epoch)
        return [key for key, _ in digests(dataset, num_workers=2, multiprocessing_context="fork")]

    first = order(0)
    assert first == order(0), "same seed and epoch, same order"
    assert first != order(1) and sorted(first) == sorted(order(1)) == sorted(expected)
    assert first != order(0, seed=8)


def test_slow_consumer_keeps_buffered_bytes_within_the_budget(s3_server):
    bucket = s3_server.new_bucket()
    # 3 shards of ~3 MB each against a 256 KiB budget: the shards are 12x the budget.
    expected, _ = upload_shards(s3_server.minio, bucket, "big/", [100, 100, 100], payload=30_000)
    budget = 256 << 10
    with pytest.deprecated_call(match="queue_bytes="):  # the queue's own size has no new spelling
        dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/big/", queue_bytes=budget,
                                             reading=Reading(shuffle_buffer=0), config=s3_server.config)
    seen = []
    for number, sample in enumerate(dataset):
        seen.append(sample["__key__"])
        if number < 5:
            time.sleep(0.2)  # a consumer far slower than the server
    stats = dataset.stats()
    largest = 30_000 + 97 + 8
    assert stats["peak_buffered_bytes"] >= budget - largest, "the buffer never filled: nothing was bounded"
    assert stats["peak_buffered_bytes"] <= budget + 2 * largest, stats
    assert sorted(seen) == sorted(expected)


@pytest.mark.server_sensitive
def test_truncated_garbage_and_empty_shards(s3_server):
    bucket = s3_server.new_bucket()
    good = pack({f"ok/{i:04d}": {"bin": bytes([i]) * 500} for i in range(20)})
    broken = pack({f"cut/{i:04d}": {"bin": bytes([i]) * 500} for i in range(20)})
    objects = {
        "mix/0-good.tar": good,
        "mix/1-truncated.tar": broken[: len(broken) // 2 + 100],
        "mix/2-garbage.tar": b"\xff\xd8\xff\xe0 this is a JPEG, not a tar" * 40,
        "mix/3-empty.tar": b"",
    }
    for key, body in objects.items():
        s3_server.minio.put_object(bucket, key, io.BytesIO(body), len(body))
    url = f"s3://{bucket}/mix/"

    def read(pattern, **options):
        return [s["__key__"] for s in AsyncS3Dataset.from_shards(pattern, config=s3_server.config,
                                                                 limits=Limits(concurrency=4), **options)]

    with pytest.raises(ShardFormatError, match=rf"s3://{bucket}/mix/1-truncated.tar.*byte \d+") as info:
        read(url)
    assert info.value.url.endswith("1-truncated.tar") and info.value.offset is not None
    with pytest.raises(ShardFormatError, match=rf"{bucket}/mix/2-garbage.tar.*not a tar"):
        read(f"s3://{bucket}/mix/2-garbage.tar")
    assert read(f"s3://{bucket}/mix/3-empty.tar") == [], "an empty object is an empty shard"

    dataset = AsyncS3Dataset.from_shards(url, config=s3_server.config, on_error="skip_shard")
    keys = [s["__key__"] for s in dataset]
    assert {k for k in keys if k.startswith("ok/")} == {f"ok/{i:04d}" for i in range(20)}
    assert 0 < sum(k.startswith("cut/") for k in keys) < 20, "samples before the cut are kept"
    assert dataset.stats()["shards_skipped"] == 2  # the truncated and the garbage shard
    with pytest.warns(RuntimeWarning, match="skipping the rest of shard"):
        read(url, on_error="warn")


@pytest.mark.server_sensitive
def test_missing_shard_names_the_key(s3_server, shards):
    bucket, _, _ = shards
    with pytest.raises(NoSuchKeyError, match=r"no object .train/shard-009[89]\.tar. in bucket"):
        list(AsyncS3Dataset.from_shards(f"s3://{bucket}/train/shard-{{0098..0099}}.tar",
                                        config=s3_server.config))


@pytest.fixture(scope="module")
def listed_imports(forked_probes, s3_server, shards):
    return import_probes(forked_probes, s3_server, "from_shards", f"s3://{shards[0]}/train/")


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_shards_listed_from_a_prefix_import_the_backend_while_listing_and_workers_read_them_all(
        shards, listed_imports, store):
    """As per-object mode: the import waits for the listing, which the workers start after."""
    _, expected, _ = shards
    assert listed_imports[store] == (False, True, len(expected))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_left_early_frees_its_dataloader_and_workers_at_once(s3_server, shards, num_workers):
    """Shards without an index, an epoch left after a few batches (a validation pass of N
    batches, a test loop's ``break``): the iterator and its workers go with the last reference.
    The index lookup's NoSuchKey, caught, had kept the frames it passed through, back to the
    DataLoader that was forking, until a garbage collection; there torch's finalizer waited 5 s
    for each worker, a 10 s stall at whatever step of training the collection came."""
    import gc
    import multiprocessing
    import weakref

    bucket, _, _ = shards
    gc.collect()
    gc.disable()  # a collection now and then would free it anyway: none may hide the cycle
    try:
        dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/train/", config=s3_server.config)
        before = set(multiprocessing.active_children())
        iterator = iter(DataLoader(dataset, batch_size=8, num_workers=num_workers, timeout=120 if num_workers else 0))
        next(iterator)
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == num_workers
        left = weakref.ref(iterator), weakref.ref(dataset)
        del iterator, dataset
        assert [ref() for ref in left] == [None, None], "the iterator or its dataset outlived its last reference"
    finally:
        gc.enable()
    for worker in workers:  # signalled already: the bound only keeps a broken run from hanging
        worker.join(timeout=60)
    assert not [worker for worker in workers if worker.is_alive()]
