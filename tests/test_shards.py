"""Shard mode (``AsyncS3Dataset.from_shards``) against the in-memory store: no server.

Shards are WebDataset tars built here with ``tarfile``: sample ``i`` of shard ``s`` is the pair
``s{s:03d}/{i:06d}.jpg`` (random bytes) and ``s{s:03d}/{i:06d}.cls`` (``b"7"``). Every test checks
what was *delivered* against what was *written*, field by field (sha256), so a lost, repeated or
corrupted sample fails whichever way it happened.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import random
import tarfile
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, get_worker_info

import loader.datasets.shard_source
from loader import AsyncS3Dataset, ConfigError, Limits, Reading, SampleError, Split, Store
from loader.datasets.options import MIN_MEMORY_BUDGET, budget_options
from loader.errors import NoSuchKeyError, ShardFormatError, TransientStoreError
from loader.formats.shards import MIN_PART_SIZE, ShardOptions
from loader.retry import RetryPolicy

from fakes import FakeStore, reusable
from waiting import wait_stable

BUCKET = "bucket"
PATTERN8 = f"s3://{BUCKET}/shards/train-{{0000..0007}}.tar"
FAST_RETRY = RetryPolicy(base_delay=0.001, max_delay=0.01)


# --------------------------------------------------------------------------- building shards


def shard_key(s: int) -> str:
    return f"shards/train-{s:04d}.tar"


def shard_url(s: int) -> str:
    return f"s3://{BUCKET}/{shard_key(s)}"


@functools.cache
def build_shard(s: int, n: int, min_size: int = 200, max_size: int = 3000) -> tuple[bytes, tuple]:
    """A tar of ``n`` samples and, per sample, ``(key, {ext: bytes}, first byte, end byte)``.

    The byte range covers the sample's members from the first header to the end of the last
    member's data (padding excluded), so a test can cut the object at a known place.
    """
    rng = random.Random(f"shard-{s}-{n}-{min_size}-{max_size}")
    buf = io.BytesIO()
    samples = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            key = f"s{s:03d}/{i:06d}"
            fields = {"jpg": rng.randbytes(rng.randint(min_size, max_size)), "cls": b"7"}
            first = buf.tell()
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
                end = buf.tell() - (-len(data) % 512)
            samples.append((key, fields, first, end))
    return buf.getvalue(), tuple(samples)


def make_store(num_shards: int = 8, per_shard: int = 260, **fake_options) -> tuple[FakeStore, dict]:
    """A FakeStore holding ``num_shards`` shards; returns it and ``{key: {ext: sha256}}``."""
    objects, expected = {}, {}
    for s in range(num_shards):
        data, samples = build_shard(s, per_shard)
        objects[shard_key(s)] = data
        for key, fields, _, _ in samples:
            expected[key] = fingerprint_fields(fields)
    return FakeStore.with_objects(BUCKET, objects, **fake_options), expected


def fingerprint_fields(fields: dict) -> dict[str, str]:
    return {ext: hashlib.sha256(data).hexdigest() for ext, data in fields.items()}


def fingerprint(sample: dict) -> tuple[str, dict[str, str]]:
    fields = {k: v for k, v in sample.items() if not k.startswith("__")}
    return sample["__key__"], fingerprint_fields(fields)


def assert_exactly(samples, expected: dict) -> None:
    """Every expected sample once, with exactly the written bytes, and nothing else."""
    keys = [sample["__key__"] for sample in samples]
    repeated = [key for key, n in Counter(keys).items() if n > 1]
    assert not repeated, f"delivered more than once: {repeated[:5]}"
    missing = sorted(set(expected) - set(keys))
    assert not missing, f"{len(missing)} sample(s) never delivered, e.g. {missing[:5]}"
    extra = sorted(set(keys) - set(expected))
    assert not extra, f"unexpected samples: {extra[:5]}"
    for sample in samples:
        key, fields = fingerprint(sample)
        assert fields == expected[key], f"sample {key} differs from what was written"


def shards_ds(fake: FakeStore, spec=PATTERN8, **options) -> AsyncS3Dataset:
    """``parts_inflight=`` (ranged parts per shard) and ``queue_bytes=`` (the queue's own size): what
    only the old spellings set, warned about."""
    retry = options.pop("retry", FAST_RETRY)
    old = {"parts_inflight", "queue_bytes"} & options.keys()
    with pytest.deprecated_call(match="|".join(sorted(old))) if old else contextlib.nullcontext():
        return AsyncS3Dataset.from_shards(spec, store=Store(backend=reusable(fake), retry=retry), **options)


def keys_of(samples) -> list[str]:
    return [sample["__key__"] for sample in samples]


def shard_of(sample: dict) -> str:
    return sample["__key__"].split("/")[0]


def tag_worker(sample: dict) -> dict:
    """A transform recording which DataLoader worker produced the sample."""
    info = get_worker_info()
    sample["__worker__"] = -1 if info is None else info.id
    return sample


def loader_of(ds, num_workers: int) -> DataLoader:
    return DataLoader(ds, batch_size=None, num_workers=num_workers, multiprocessing_context="fork")


# --------------------------------------------------------------------------- exactly once


def test_exactly_once_in_the_main_process():
    fake, expected = make_store()
    assert len(expected) >= 2000
    ds = shards_ds(fake)
    samples = list(ds)
    assert_exactly(samples, expected)
    assert samples[0]["__url__"] == shard_url(0)
    assert set(samples[0]) == {"__key__", "__url__", "jpg", "cls"}
    assert fake.requests_by_key["shards/index.json"] == 1, "one look for an index (there is none)"
    assert fake.requests == 9, "and one streamed GET per shard when nothing fails"
    stats = ds.stats()
    # Engine items: the samples plus one end-of-shard marker per shard.
    assert stats["delivered_items"] >= len(expected) and stats["shards_skipped"] == 0


@pytest.mark.parametrize("num_workers", [2, 4])
def test_exactly_once_with_dataloader_workers(num_workers):
    fake, expected = make_store()
    ds = shards_ds(fake, shuffle=True, seed=3, transform=tag_worker)
    samples = list(loader_of(ds, num_workers))
    assert_exactly(samples, expected)
    per_worker = Counter(sample["__worker__"] for sample in samples)
    assert set(per_worker) == set(range(num_workers))
    # 8 shards dealt over the workers: each worker reads 8 / num_workers whole shards.
    by_worker: dict[int, set[str]] = {}
    for sample in samples:
        by_worker.setdefault(sample["__worker__"], set()).add(shard_of(sample))
    assert all(len(shards) == 8 // num_workers for shards in by_worker.values())


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_prefix_form_uses_parallel_ranged_gets_and_keeps_bytes_exact():
    fake, expected = make_store(num_shards=3, per_shard=60)
    sizes = {key: len(data) for (_, key), data in fake.objects.items()}
    assert all(size > 2 * 4096 for size in sizes.values())
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", reading=Reading(part_size=4096), parts_inflight=3)
    assert [ref.size for ref in ds.shards()] == [sizes[shard_key(s)] for s in range(3)]
    fake.reset_counters()
    assert_exactly(list(ds), expected)
    for s in range(3):
        parts = -(-sizes[shard_key(s)] // 4096)
        assert fake.requests_by_key[shard_key(s)] == parts, "one ranged GET per part, no more"
    assert fake.peak_inflight >= 3


def test_prefix_form_skips_non_tar_objects():
    fake, expected = make_store(num_shards=2, per_shard=20)
    fake.objects[BUCKET, "shards/README.txt"] = b"not a shard"
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/")
    assert [ref.key for ref in ds.shards()] == [shard_key(0), shard_key(1)]
    assert_exactly(list(ds), expected)


# --------------------------------------------------------------------------- fewer shards than slots


def test_two_shards_over_four_workers(caplog):
    fake, expected = make_store(num_shards=2, per_shard=101)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar", transform=tag_worker)
    samples = list(loader_of(ds, 4))
    assert_exactly(samples, expected)
    per_worker = Counter(sample["__worker__"] for sample in samples)
    assert set(per_worker) == {0, 1, 2, 3}, per_worker
    assert max(per_worker.values()) - min(per_worker.values()) <= 2


def test_three_shards_over_two_ranks_of_two_workers():
    fake, expected = make_store(num_shards=3, per_shard=50)
    spec = f"s3://{BUCKET}/shards/train-{{0000..0002}}.tar"
    samples, slots = [], Counter()
    for rank in range(2):
        ds = shards_ds(fake, spec, split=Split(rank=rank, world_size=2, uneven_ranks=True), shuffle=True, seed=5,
                       transform=tag_worker)
        got = list(loader_of(ds, 2))
        slots.update((rank, sample["__worker__"]) for sample in got)
        samples.extend(got)
    assert_exactly(samples, expected)
    assert set(slots) == {(0, 0), (0, 1), (1, 0), (1, 1)}, slots


def test_sample_split_warns_once_about_the_cost(caplog, monkeypatch):
    monkeypatch.setattr(loader.datasets.shard_source, "_warned_split", False)
    fake, expected = make_store(num_shards=2, per_shard=30)
    spec = f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar"
    samples = []
    with caplog.at_level(logging.WARNING, logger="loader"):
        for rank in range(3):
            samples.extend(shards_ds(fake, spec, split=Split(rank=rank, world_size=3, uneven_ranks=True)))
    assert_exactly(samples, expected)
    warned = [r for r in caplog.records if "downloaded up to" in r.getMessage()]
    assert len(warned) == 1, "logged once per process, not once per iteration"
    message = warned[0].getMessage()
    assert "2 shard(s) for 3" in message and "at least 3 shards" in message


# --------------------------------------------------------------------------- order


def test_shuffled_order_depends_on_epoch_and_repeats_for_the_same_epoch():
    fake, expected = make_store(num_shards=8, per_shard=40)
    ds = shards_ds(fake, shuffle=True, seed=11, reading=Reading(shuffle_buffer=50))
    ds.set_epoch(0)
    first = keys_of(ds)
    assert keys_of(ds) == first, "same (seed, epoch), same order"
    ds.set_epoch(1)
    second = keys_of(ds)
    assert second != first and sorted(second) == sorted(first) == sorted(expected)
    fresh = shards_ds(fake, shuffle=True, seed=11, reading=Reading(shuffle_buffer=50))
    fresh.set_epoch(1)
    assert keys_of(fresh) == second, "a fresh dataset with the same (seed, epoch) agrees"
    other = shards_ds(fake, shuffle=True, seed=12, reading=Reading(shuffle_buffer=50))
    other.set_epoch(1)
    assert keys_of(other) != second


def test_shuffled_order_repeats_with_workers():
    fake, expected = make_store(num_shards=8, per_shard=40)
    ds = shards_ds(fake, shuffle=True, seed=11, reading=Reading(shuffle_buffer=50))
    runs = []
    for epoch in (0, 0, 1):
        ds.set_epoch(epoch)
        runs.append(keys_of(loader_of(ds, 2)))
    assert runs[0] == runs[1]
    assert runs[2] != runs[0]
    for run in runs:
        assert sorted(run) == sorted(expected)


def test_shuffle_buffer_mixes_samples_across_shards():
    fake, expected = make_store(num_shards=8, per_shard=40)
    ds = shards_ds(fake, shuffle=True, seed=2, reading=Reading(shuffle_buffer=100), limits=Limits(concurrency=4))
    samples = list(ds)
    assert_exactly(samples, expected)
    head = [shard_of(sample) for sample in samples[:40]]
    assert len(set(head)) > 1, "with one shard in flight only the buffer can mix shards"
    indices = [int(sample["__key__"].split("/")[1]) for sample in samples if shard_of(sample) == head[0]]
    assert indices != sorted(indices), "the buffer reorders within a shard too"


@pytest.mark.parametrize("shuffle_buffer", [0, 1, 64, 5000])
def test_exactly_once_whatever_the_shuffle_buffer(shuffle_buffer):
    fake, expected = make_store(num_shards=8, per_shard=40)
    ds = shards_ds(fake, shuffle=True, seed=4, reading=Reading(shuffle_buffer=shuffle_buffer))
    samples = list(ds)
    assert_exactly(samples, expected)
    if shuffle_buffer <= 1:
        # No sample shuffle: shards are read in a shuffled order, each one in its own order.
        for shard in {shard_of(s) for s in samples}:
            indices = [s["__key__"] for s in samples if shard_of(s) == shard]
            assert indices == sorted(indices)


def test_unshuffled_one_shard_at_a_time_is_shard_order_then_member_order():
    fake, expected = make_store(num_shards=8, per_shard=40)
    ds = shards_ds(fake, limits=Limits(concurrency=4))
    assert keys_of(ds) == sorted(expected)


def test_unshuffled_ordered_delivery_is_deterministic():
    fake, expected = make_store(num_shards=8, per_shard=40, latency=lambda key: random.random() / 100)
    ds = shards_ds(fake, limits=Limits(concurrency=16), reading=Reading(chunk_size=1000))
    first = keys_of(ds)
    assert sorted(first) == sorted(expected)
    assert keys_of(ds) == first, "ordered delivery does not depend on timing"
    for shard in {key.split("/")[0] for key in first}:
        in_shard = [key for key in first if key.startswith(shard + "/")]
        assert in_shard == sorted(in_shard)


def test_unordered_delivery_is_still_exactly_once():
    fake, expected = make_store(num_shards=8, per_shard=40)
    assert_exactly(list(shards_ds(fake, limits=Limits(ordered=False), shuffle=True, seed=1)), expected)


def test_unshuffled_is_the_stored_order_with_several_shards_in_flight():
    fake, expected = make_store(num_shards=8, per_shard=40)
    keys = keys_of(shards_ds(fake, limits=Limits(concurrency=12)))
    assert keys == sorted(expected)  # shard after shard, each in member order


def test_interleave_takes_round_robin_over_shards_in_flight():
    fake, expected = make_store(num_shards=8, per_shard=40)  # shuffled, counts unknown: no lanes
    keys = keys_of(shards_ds(fake, limits=Limits(concurrency=12), reading=Reading(shuffle_buffer=0), shuffle=True))
    assert sorted(keys) == sorted(expected)
    shards = [key.split("/")[0] for key in keys[:6]]
    assert shards[:3] == shards[3:] and len(set(shards[:3])) == 3
    assert all(key.endswith("/000000") for key in keys[:3])


# --------------------------------------------------------------------------- memory


class CountingStore(FakeStore):
    """A fake that counts the body bytes it has streamed so far."""

    streamed = 0

    async def stream(self, *args, **kwargs):
        async for chunk in super().stream(*args, **kwargs):
            self.streamed += len(chunk)
            yield chunk


def test_slow_consumer_keeps_the_buffer_within_queue_bytes():
    queue_bytes = 256 << 10
    objects, expected, largest = {}, {}, 0
    for s in range(2):
        data, samples = build_shard(s, 500, 3000, 5000)  # ~2 MB each
        objects[shard_key(s)] = data
        for key, fields, _, _ in samples:
            expected[key] = fingerprint_fields(fields)
            largest = max(largest, sum(len(v) for v in fields.values()))
    assert all(len(data) > 8 * queue_bytes for data in objects.values())
    fake = CountingStore.with_objects(BUCKET, objects)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar",
                   queue_bytes=queue_bytes, reading=Reading(shuffle_buffer=0, chunk_size=64 << 10))
    samples = []
    it = iter(ds)
    for _ in range(5):
        samples.append(next(it))
    # The engine fills the buffer, then must stop reading: see it stop, and well short of the data.
    streamed = wait_stable(lambda: fake.streamed, "the bytes streamed")
    assert queue_bytes <= streamed < sum(map(len, objects.values())) // 2
    samples.extend(it)
    assert_exactly(samples, expected)
    stats = ds.stats()
    # The engine admits an item while the buffer is under budget, and the job at the head of the
    # round robin may add one more when it has nothing buffered (else delivery could deadlock):
    # at most two samples over queue_bytes, however large the shards.
    assert stats["peak_buffered_bytes"] <= queue_bytes + 2 * largest, stats
    assert stats["delivered_items"] >= len(expected)


# --------------------------------------------------------------------------- corrupt shards


def truncated_store(cut_sample: int = 17):
    """8 shards; shard 3 cut in the middle of sample ``cut_sample``'s jpg data."""
    fake, expected = make_store(num_shards=8, per_shard=40)
    data, samples = build_shard(3, 40)
    _, _, first, _ = samples[cut_sample]
    cut = first + 512 + 100  # header, then 100 bytes into the jpg data
    fake.objects[BUCKET, shard_key(3)] = data[:cut]
    before = {key: expected[key] for key, _, _, end in samples if end <= cut}
    assert len(before) == cut_sample
    others = {key: value for key, value in expected.items() if not key.startswith("s003/")}
    return fake, others, before, cut


def test_truncated_shard_raises_naming_url_and_offset():
    fake, _, _, cut = truncated_store()
    with pytest.raises(ShardFormatError) as info:
        list(shards_ds(fake))
    err = info.value
    assert err.url == shard_url(3)
    assert shard_url(3) in str(err)
    assert err.offset == cut and f"byte {cut}" in str(err)
    assert "truncated" in str(err)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_truncated_shard_skipped(num_workers, caplog):
    fake, others, before, _ = truncated_store()
    ds = shards_ds(fake, on_error="skip_shard")
    with caplog.at_level(logging.WARNING, logger="loader"):
        samples = list(ds) if num_workers == 0 else list(loader_of(ds, num_workers))
    assert_exactly(samples, {**others, **before})
    if num_workers == 0:
        assert ds.stats()["shards_skipped"] == 1
        assert any(shard_url(3) in r.getMessage() for r in caplog.records)


def test_truncated_shard_warns():
    fake, others, before, _ = truncated_store()
    ds = shards_ds(fake, on_error="warn")
    with pytest.warns(RuntimeWarning, match=r"skipping the rest of shard s3://bucket/shards/train-0003\.tar"):
        samples = list(ds)
    assert_exactly(samples, {**others, **before})
    assert ds.stats()["shards_skipped"] == 1


def test_cut_inside_a_samples_second_member_drops_only_that_sample():
    fake, expected = make_store(num_shards=1, per_shard=30)
    data, samples = build_shard(0, 30)
    _, fields, first, _ = samples[12]
    cut = first + 512 + len(fields["jpg"]) + (-len(fields["jpg"]) % 512) + 200  # in .cls's header
    fake.objects[BUCKET, shard_key(0)] = data[:cut]
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar", on_error="skip_shard")
    got = list(ds)
    assert_exactly(got, {key: expected[key] for key, *_ in samples[:12]})
    assert ds.stats()["shards_skipped"] == 1


def test_cut_between_samples_keeps_every_complete_sample():
    """A shard that just stops at a member boundary (no end blocks) is a valid, shorter shard."""
    fake, expected = make_store(num_shards=1, per_shard=30)
    data, samples = build_shard(0, 30)
    end = samples[19][3]
    end += -end % 512
    fake.objects[BUCKET, shard_key(0)] = data[:end]
    got = list(shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar"))
    assert_exactly(got, {key: expected[key] for key, *_ in samples[:20]})


def test_garbage_object_is_not_a_tar():
    fake, _ = make_store(num_shards=8, per_shard=10)
    fake.objects[BUCKET, shard_key(5)] = random.Random(1).randbytes(5000)
    with pytest.raises(ShardFormatError, match=r"train-0005\.tar.*not a tar") as info:
        list(shards_ds(fake))
    assert info.value.offset == 0


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_garbage_object_on_the_ranged_path_is_not_a_tar():
    fake, _ = make_store(num_shards=2, per_shard=10)
    fake.objects[BUCKET, shard_key(1)] = random.Random(1).randbytes(50_000)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", reading=Reading(part_size=4096), parts_inflight=3)
    with pytest.raises(ShardFormatError, match=r"train-0001\.tar.*not a tar"):
        list(ds)


def test_garbage_object_skipped():
    fake, expected = make_store(num_shards=8, per_shard=10)
    fake.objects[BUCKET, shard_key(5)] = random.Random(1).randbytes(5000)
    ds = shards_ds(fake, on_error="skip_shard")
    samples = list(ds)
    assert_exactly(samples, {k: v for k, v in expected.items() if not k.startswith("s005/")})
    assert ds.stats()["shards_skipped"] == 1


def test_empty_object_is_an_empty_shard():
    fake, expected = make_store(num_shards=8, per_shard=10)
    fake.objects[BUCKET, shard_key(2)] = b""
    ds = shards_ds(fake)
    assert_exactly(list(ds), {k: v for k, v in expected.items() if not k.startswith("s002/")})
    assert ds.stats()["shards_skipped"] == 0


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_empty_object_found_by_listing_is_an_empty_shard():
    fake, expected = make_store(num_shards=3, per_shard=10)
    fake.objects[BUCKET, shard_key(1)] = b""
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", reading=Reading(part_size=1024))
    assert_exactly(list(ds), {k: v for k, v in expected.items() if not k.startswith("s001/")})


def test_missing_shard_names_the_key():
    fake, _ = make_store(num_shards=8, per_shard=10)
    del fake.objects[BUCKET, shard_key(6)]
    with pytest.raises(FileNotFoundError, match=r"shards/train-0006\.tar") as info:
        list(shards_ds(fake))
    assert isinstance(info.value, NoSuchKeyError)
    assert info.value.key == shard_key(6)


def test_missing_shard_is_not_skipped_by_on_error():
    """on_error covers corrupt shards; a 404 is a configuration mistake and still fails fast."""
    fake, _ = make_store(num_shards=8, per_shard=10)
    del fake.objects[BUCKET, shard_key(6)]
    with pytest.raises(NoSuchKeyError):
        list(shards_ds(fake, on_error="skip_shard"))
    assert fake.requests_by_key[shard_key(6)] == 1, "a 404 is not retried"


# --------------------------------------------------------------------------- transient faults


def test_cut_stream_resumes_with_a_ranged_get():
    fake, expected = make_store(num_shards=8, per_shard=40)
    fake.truncate = {shard_key(2): [20_000, 5_555, None], shard_key(6): [777]}
    ds = shards_ds(fake, reading=Reading(chunk_size=3000))
    samples = list(ds)
    assert_exactly(samples, expected)
    assert ds.stats()["retries"] >= 3
    assert fake.requests_by_key[shard_key(2)] == 3
    assert fake.requests_by_key[shard_key(6)] == 2


def test_cut_stream_resumes_in_every_worker():
    fake, expected = make_store(num_shards=8, per_shard=40)
    fake.truncate = {shard_key(s): [3000 + 1000 * s, None] for s in range(8)}
    assert_exactly(list(loader_of(shards_ds(fake, shuffle=True, seed=9), 2)), expected)


def test_many_cuts_that_each_make_progress_still_finish():
    fake, expected = make_store(num_shards=1, per_shard=40)
    size = len(fake.objects[BUCKET, shard_key(0)])
    fake.truncate = {shard_key(0): [4000] * (size // 4000 + 2)}  # every stream cut at 4000 bytes
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar",
                   retry=RetryPolicy(max_attempts=2, base_delay=0.001))
    assert_exactly(list(ds), expected)


def test_cuts_without_progress_give_up():
    """A stream always cut before the member it resumes at completes makes no progress: the
    attempts are counted, and the retry policy's limit ends it (rather than looping for ever)."""
    fake, _ = make_store(num_shards=1, per_shard=5)
    fake.truncate = {shard_key(0): [300] * 50}  # less than one header block each time
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar",
                   retry=RetryPolicy(max_attempts=3, base_delay=0.001))
    with pytest.raises(TransientStoreError, match=r"train-0000\.tar at byte 0"):
        list(ds)
    assert fake.requests_by_key[shard_key(0)] == 3


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_transient_faults_on_ranged_parts_are_retried():
    fake, expected = make_store(num_shards=3, per_shard=60)
    fake.fail = {
        shard_key(0): [TransientStoreError("503 SlowDown", bucket=BUCKET, key=shard_key(0))] * 3,
        shard_key(2): [TransientStoreError("reset", bucket=BUCKET, key=shard_key(2))],
    }
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", reading=Reading(part_size=4096), parts_inflight=3)
    ds.shards()
    fake.reset_counters()
    assert_exactly(list(ds), expected)
    assert ds.stats()["retries"] == 4
    parts = -(-len(fake.objects[BUCKET, shard_key(0)]) // 4096)
    assert fake.requests_by_key[shard_key(0)] == parts + 3


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_persistent_fault_on_a_part_gives_up():
    fake, _ = make_store(num_shards=2, per_shard=60)
    fake.fail = {shard_key(1): [TransientStoreError("503", bucket=BUCKET, key=shard_key(1))] * 10}
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", reading=Reading(part_size=4096), parts_inflight=3,
                   retry=RetryPolicy(max_attempts=2, base_delay=0.001))
    with pytest.raises(TransientStoreError, match="gave up"):
        list(ds)


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_sample_ranges_that_end_inside_a_ranged_shard_stop_cleanly():
    """With known counts, a rank's run may end inside a shard read by ranged parts: the job stops
    reading there (and must not surface as an exception group from the part fetchers)."""
    fake, expected = make_store(num_shards=3, per_shard=60)
    counts = {shard_url(s): 60 for s in range(3)}
    samples = []
    for rank in range(2):
        ds = shards_ds(fake, f"s3://{BUCKET}/shards/", split=Split(rank=rank, world_size=2),
                       reading=Reading(part_size=4096), parts_inflight=3, sample_counts=counts)
        got = list(ds)
        assert len(got) == len(ds) == 90
        samples.extend(got)
    assert_exactly(samples, expected)


def test_fork_after_epochs_in_the_main_process():
    """Three num_workers=0 epochs, then forked workers: nothing of ours may hang the children."""
    fake, expected = make_store(num_shards=4, per_shard=20)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0003}}.tar", shuffle=True, seed=1)
    for epoch in range(3):
        ds.set_epoch(epoch)
        assert_exactly(list(ds), expected)
    ds.set_epoch(3)
    assert_exactly(list(loader_of(ds, 2)), expected)


# --------------------------------------------------------------------------- resume


def read_part(ds, fraction: float, total: int):
    it = iter(ds)
    taken = [next(it) for _ in range(int(total * fraction))]
    state = ds.state_dict()
    it.close()
    return taken, state


@pytest.mark.parametrize("fraction", [0.0, 0.37, 0.99])
def test_resume_mid_epoch_with_shuffle(fraction):
    fake, expected = make_store(num_shards=8, per_shard=40)
    options = dict(shuffle=True, seed=21, reading=Reading(shuffle_buffer=100))
    ds = shards_ds(fake, **options)
    ds.set_epoch(3)
    first, state = read_part(ds, fraction, len(expected))
    fresh = shards_ds(fake, **options)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert_exactly(first + rest, expected)
    # The resumed state covers the whole epoch: resuming from it reads nothing more.
    final = fresh.state_dict()
    done = shards_ds(fake, **options)
    done.load_state_dict(final)
    fake.reset_counters()
    assert list(done) == []
    assert fake.requests == 0


def test_resume_does_not_reread_completed_shards():
    fake, expected = make_store(num_shards=8, per_shard=40)
    options = dict(shuffle=True, seed=8, reading=Reading(shuffle_buffer=8), limits=Limits(concurrency=8))
    ds = shards_ds(fake, **options)
    first, state = read_part(ds, 0.37, len(expected))
    per_shard = Counter(shard_of(sample) for sample in first)
    complete = {shard for shard, n in per_shard.items() if n == 40}
    partial = {shard for shard, n in per_shard.items() if n < 40}
    assert complete, f"the test needs a shard finished before the checkpoint: {per_shard}"
    fake.reset_counters()
    fresh = shards_ds(fake, **options)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert_exactly(first + rest, expected)
    for shard in complete:
        s = int(shard[1:])
        assert fake.requests_by_key[shard_key(s)] == 0, f"{shard} was complete, yet read again"
    for shard in partial:
        assert fake.requests_by_key[shard_key(int(shard[1:]))] == 1


def test_resume_state_is_for_its_epoch_only():
    fake, expected = make_store(num_shards=8, per_shard=20)
    ds = shards_ds(fake, shuffle=True, seed=1)
    ds.set_epoch(2)
    _, state = read_part(ds, 0.5, len(expected))
    fresh = shards_ds(fake, shuffle=True, seed=1)
    fresh.load_state_dict(state)
    assert fresh.epoch == 2
    fresh.set_epoch(3)  # a new epoch starts from scratch
    assert_exactly(list(fresh), expected)


def test_resume_rejects_another_seed_or_shard_count():
    fake, expected = make_store(num_shards=8, per_shard=10)
    _, state = read_part(shards_ds(fake, shuffle=True, seed=1), 0.5, len(expected))
    with pytest.raises(ConfigError, match="different data set or seed"):
        shards_ds(fake, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="different data set or seed"):
        shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0006}}.tar", shuffle=True,
                  seed=1).load_state_dict(state)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (lambda: {"limits": Limits(concurrency=0)}, r"Limits\.concurrency=0"),
        (lambda: {"reading": Reading(shuffle_buffer=-1)}, r"shuffle_buffer=-1"),
        (lambda: {"reading": Reading(shuffle_buffer=2.5)}, r"shuffle_buffer=2\.5"),
        (lambda: {"on_error": "ignore"}, r"on_error='ignore'"),
        (lambda: {"reading": Reading(part_size=0)}, r"part_size=0"),
        (lambda: {"reading": Reading(part_size=1)},
         r"^part_size=1 is below the floor of 1048576 bytes: each part is one ranged GET"),
        (lambda: {"reading": Reading(part_size=(1 << 20) - 1)},
         r"part_size=1048575 is below the floor.*give part_size=1048576 \(1 MiB\)"),
        (lambda: {"parts_inflight": 0}, r"parts_inflight=0"),
        (lambda: {"reading": Reading(chunk_size=-5)}, r"chunk_size=-5"),
        (lambda: {"limits": Limits(concurrency=True)}, r"Limits\.concurrency=True"),
    ],
)
def test_invalid_shard_options_are_rejected_at_construction(options, match):
    fake, _ = make_store(num_shards=1, per_shard=1)
    with pytest.raises(ConfigError, match=match):
        shards_ds(fake, **options())
    assert fake.requests == fake.list_requests == 0


@pytest.mark.parametrize(
    "pattern",
    [
        f"s3://{BUCKET}/shards/train-{{0000..0007.tar",
        f"s3://{BUCKET}/shards/train-{{0007..0000}}.tar",
        f"s3://{BUCKET}/shards/train-{{0000...0007}}.tar",
        f"s3://{BUCKET}/shards/train-0000..0007}}.tar",
        "bucket/shards/train-{0000..0007}.tar",
    ],
)
def test_bad_shard_patterns_are_rejected_at_construction(pattern):
    fake, _ = make_store(num_shards=1, per_shard=1)
    with pytest.raises(ConfigError, match=r"train-"):
        shards_ds(fake, pattern)


def test_shard_dataset_has_no_length():
    fake, _ = make_store(num_shards=1, per_shard=1)
    with pytest.raises(TypeError, match="unknown"):
        len(shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar"))


def _fails_on_every_tenth(sample):
    if int(sample["__key__"].rsplit("/", 1)[1]) % 10 == 0:
        raise ValueError("undecodable")
    return sample["__key__"]


def test_transform_errors_in_shard_mode_follow_on_error():
    fake, expected = make_store(num_shards=2, per_shard=30)
    with pytest.raises(SampleError, match="undecodable"):
        list(shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar",
                       transform=_fails_on_every_tenth))
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar", on_error="skip",
                   transform=_fails_on_every_tenth)
    got = list(ds)
    assert len(got) == 54 and ds.stats()["samples_skipped"] == 6 == len(expected) - len(got)


@given(part_size=st.integers(1, 64 << 20))
def test_part_size_has_a_floor_of_one_mib_and_no_budget_goes_below_it(part_size):
    """``part_size=1`` made one GET per byte of a shard: below 1 MiB is refused, naming the
    setting and the floor; at or above it, accepted. A budget never derives less either."""
    if part_size < MIN_PART_SIZE:
        with pytest.raises(ConfigError, match=rf"^part_size={part_size} is below the floor of {MIN_PART_SIZE} bytes"):
            ShardOptions(part_size=part_size)
    else:
        assert ShardOptions(part_size=part_size).part_size == part_size
    derived = budget_options({"memory_budget": max(MIN_MEMORY_BUDGET, part_size)}, "shards")
    assert derived["part_size"] >= MIN_PART_SIZE


def test_a_skipped_sample_is_named_and_its_shard_goes_on(caplog):
    fake, _ = make_store(num_shards=1, per_shard=12)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/train-0000.tar", on_error="warn",
                   transform=_fails_on_every_tenth)
    with pytest.warns(RuntimeWarning) as warned:
        got = list(ds)
    assert len(got) == 10  # samples 0 and 10 skipped, the rest of the shard read
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2
    assert messages[0].startswith(f"skipping sample 's000/000000' of shard {shard_url(0)}, going on "
                                  "with the rest of the shard (on_error='warn'): transform")
    assert "s000/000010" in messages[1] and "skipping s3://" not in " ".join(messages)


def test_shuffle_buffer_with_batch_size_is_refused_not_ignored():
    fake, _ = make_store(num_shards=2, per_shard=10)
    with pytest.raises(ConfigError, match=r"shuffle_buffer=200 cannot be used with batch_size=: blocks "
                                          r".*Drop shuffle_buffer=.*loader shard --shuffle"):
        shards_ds(fake, shuffle=True, batch_size=8, reading=Reading(shuffle_buffer=200))
    shards_ds(fake, shuffle=True, batch_size=8, reading=Reading(shuffle_buffer=0))  # saying "no buffer" is fine
    shards_ds(fake, shuffle=True, batch_size=8)  # and so is the default, which does not apply
