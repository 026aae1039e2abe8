"""``memory_budget``: one number that bounds what an iterating process holds (in-memory store).

What the budget derives (queue, bodies in flight, shards and parts in flight, part size, the
shuffle buffer in bytes), that explicit knobs win and a combination over the budget is refused,
and that the engine's byte reservations and the byte-bounded shuffle buffer keep to their shares.
RSS under a budget with a real server is measured in integration/test_resources.py.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from test_shards import BUCKET, assert_exactly, make_store, shards_ds

from loader import AsyncS3Dataset, AsyncS3MapDataset, ConfigError, Limits, Reading
from loader.datasets.object_samples import object_job
from loader.datasets.options import Options, budget_options, dataset_options, shard_read_bytes
from loader.datasets.shuffle import shuffled
from loader.engine import EngineLimits, FetchEngine

from fakes import FakeStore, reusable

MiB = 1 << 20


# ----------------------------------------------------------------------------- what it derives


def test_objects_mode_gives_half_to_the_queue_and_the_rest_to_bodies_in_flight():
    options, _ = dataset_options("objects", limits=Limits(memory=256 * MiB))
    assert options.queue_bytes == 128 * MiB
    assert options.object_limits("ordered").inflight_bytes == 128 * MiB
    assert Options().object_limits("ordered").inflight_bytes is None  # no budget: as before


def test_shard_mode_splits_queue_shuffle_and_reads():
    derived = budget_options({"memory_budget": 256 * MiB, "shuffle": True}, "shards")
    assert derived["queue_bytes"] == 64 * MiB and derived["shuffle_bytes"] == 64 * MiB
    reads = derived["shards_inflight"] * shard_read_bytes(derived["parts_inflight"], derived["part_size"])
    assert 96 * MiB <= reads <= 128 * MiB
    assert derived["chunk_size"] <= derived["part_size"]
    unshuffled = budget_options({"memory_budget": 256 * MiB}, "shards")
    assert unshuffled["shuffle_bytes"] is None  # no shuffle buffer: its share goes to reads
    assert (unshuffled["shards_inflight"]
            * shard_read_bytes(unshuffled["parts_inflight"], unshuffled["part_size"])) <= 192 * MiB


def test_a_large_budget_keeps_the_defaults():
    derived = budget_options({"memory_budget": 8 << 30}, "shards")
    assert (derived["shards_inflight"], derived["parts_inflight"], derived["part_size"]) == (4, 4, 16 * MiB)


def test_a_small_budget_shrinks_parts_then_parts_in_flight_then_shards():
    derived = budget_options({"memory_budget": 16 * MiB}, "shards")
    reads = 16 * MiB - derived["queue_bytes"]
    assert derived["shards_inflight"] * shard_read_bytes(derived["parts_inflight"], derived["part_size"]) <= reads
    assert derived["part_size"] >= 1 * MiB


def test_explicit_knobs_win_and_the_rest_is_derived():
    derived = budget_options({"memory_budget": 256 * MiB, "queue_bytes": 32 * MiB,
                              "shards_inflight": 2}, "shards")
    assert derived["queue_bytes"] == 32 * MiB and derived["shards_inflight"] == 2
    ds = AsyncS3Dataset.from_shards("s3://bucket/s-{0..3}.tar", limits=Limits(memory=256 * MiB, concurrency=8))
    assert ds.source.shard_options.shards_inflight == 2  # concurrency // 4 parts
    with pytest.deprecated_call(match="queue_bytes="):  # the queue's own size has no new spelling
        ds = AsyncS3Dataset.from_shards("s3://bucket/s-{0..3}.tar", limits=Limits(memory=256 * MiB),
                                        queue_bytes=32 * MiB)
    assert ds.options.queue_bytes == 32 * MiB


@pytest.mark.parametrize("options, match", [
    (lambda: dict(limits=Limits(memory=64 * MiB, concurrency=32), reading=Reading(part_size=16 * MiB)),
     r"more than Limits\(memory=67108864\).* 8 files read at once x \(2 x \d+ parts in flight \+ 1\) x "
     r"Reading\(part_size=16777216\)"),
    (lambda: dict(limits=Limits(memory=1000)), r"Limits.memory=1000 must be .* at least"),
])
def test_settings_over_the_budget_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        AsyncS3Dataset.from_shards("s3://bucket/s-{0..3}.tar", **options())


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_a_queue_over_the_budget_is_refused(mode):
    """The queue's own size is an old spelling only (the new one derives it from the budget)."""
    with pytest.raises(ConfigError, match="queue_bytes=.* leaves nothing of memory_budget"), \
            pytest.deprecated_call(match="queue_bytes="):
        if mode == "objects":
            AsyncS3Dataset.from_keys("bucket", ["a.jpg"], limits=Limits(memory=32 * MiB), queue_bytes=32 * MiB)
        else:
            AsyncS3Dataset.from_shards("s3://bucket/s-{0..3}.tar", limits=Limits(memory=64 * MiB),
                                       queue_bytes=64 * MiB)


def test_the_map_dataset_refuses_a_budget_it_cannot_use():
    with pytest.raises(ConfigError, match=r"memory=67108864.*AsyncS3MapDataset takes only Limits\(concurrency=\)"):
        AsyncS3MapDataset.from_keys("bucket", ["a.jpg"], limits=Limits(memory=64 * MiB))


# ----------------------------------------------------------------------------- the engine's share


def run_objects(fake: FakeStore, keys: list[str], limits: EngineLimits, pause: float = 0.0):
    engine = FetchEngine((object_job(BUCKET, key, i) for i, key in enumerate(keys)),
                         reusable(fake), limits=limits)
    got = []
    for item in engine:
        got.append(item)
        time.sleep(pause)
    return got, engine.statistics()


def test_bodies_in_flight_stay_within_their_share():
    size = 100_000
    keys = [f"train/{i:04d}.bin" for i in range(60)]
    fake = FakeStore.with_objects(BUCKET, {k: bytes([i % 251]) * size for i, k in enumerate(keys)},
                                  latency=0.01)
    limits = EngineLimits(max_inflight=64, queue_bytes=300_000, inflight_bytes=700_000)
    got, stats = run_objects(fake, keys, limits, pause=0.002)
    assert [position for position, _ in got] == list(range(60))
    # each request reserves 2 x 100 KB once a size is known: at most 3 in flight, not 64
    assert 2 <= fake.peak_inflight <= 3, fake.peak_inflight
    assert stats.peak_reserved_bytes <= 700_000
    assert stats.peak_buffered_bytes <= 300_000 + 2 * size


def test_without_a_byte_share_the_count_alone_limits_requests():
    keys = [f"train/{i:04d}.bin" for i in range(60)]
    fake = FakeStore.with_objects(BUCKET, {k: b"x" * 1000 for k in keys}, latency=0.02)
    _, stats = run_objects(fake, keys, EngineLimits(max_inflight=16))
    assert fake.peak_inflight > 3 and stats.peak_reserved_bytes == 0


def test_per_object_dataset_under_a_budget_is_exactly_once():
    keys = [f"train/{i:04d}.bin" for i in range(80)]
    objects = {k: random.Random(i).randbytes(50_000) for i, k in enumerate(keys)}
    fake = FakeStore.with_objects(BUCKET, objects, latency=0.005)
    ds = AsyncS3Dataset.from_keys(BUCKET, keys, store=reusable(fake), limits=Limits(memory=8 * MiB),
                                  shuffle=True, seed=1)
    got = list(ds)
    assert Counter(s["__url__"] for s in got) == Counter(f"s3://{BUCKET}/{k}" for k in keys)
    assert all(s["bin"] == objects[s["__url__"].split("/", 3)[3]] for s in got)
    assert ds.stats()["peak_reserved_bytes"] <= 4 * MiB


# ----------------------------------------------------------------------------- the shuffle buffer's share


def test_the_shuffle_buffer_keeps_to_its_bytes_and_loses_nothing():
    rng = random.Random(0)
    items = [(i, rng.randint(1, 5000)) for i in range(2000)]
    held, peak = [], 0

    def sized(stream):
        for item in stream:
            held.append(item)
            yield item

    out = []
    for item in shuffled(sized(items), 1000, random.Random(1), max_bytes=20_000,
                         nbytes=lambda item: item[1]):
        held.remove(item)
        peak = max(peak, sum(size for _, size in held) + item[1])
        out.append(item)
    assert sorted(out) == items and out != items
    assert peak <= 20_000 + 5000  # the limit plus the one item that arrived last


def test_the_byte_bounded_shuffle_repeats_for_a_seed():
    items = list(range(500))
    first = list(shuffled(items, 100, random.Random(5), max_bytes=50, nbytes=lambda _: 1))
    second = list(shuffled(items, 100, random.Random(5), max_bytes=50, nbytes=lambda _: 1))
    assert first == second and sorted(first) == items


def test_shard_dataset_under_a_budget_is_exactly_once():
    fake, expected = make_store(num_shards=6, per_shard=80)
    ds = shards_ds(fake, f"s3://{BUCKET}/shards/", limits=Limits(memory=8 * MiB), shuffle=True, seed=2)
    assert ds.source.shard_options.shuffle_bytes == 2 * MiB
    assert_exactly(list(ds), expected)
    assert ds.stats()["peak_buffered_bytes"] <= 2 * MiB + 2 * 10_000


def test_a_batch_in_the_consumers_hands_counts_against_the_queue():
    """The engine hands items over in batches; a consumer that stalls holds its batch, so the
    batch stays in the queue's byte count until the consumer comes back, and one batch takes at
    most a quarter of ``queue_bytes``: fetching then stops at the queue's size, the batch
    included, rather than refilling the whole queue behind it."""
    objects = {f"train/{i:03d}.bin": bytes([i]) * MiB for i in range(40)}
    fake = FakeStore.with_objects("bucket", objects)
    # the queue takes half the budget: 4 MiB; the other half bounds the one body in flight
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(fake),
                                  limits=Limits(concurrency=1, memory=8 * MiB))
    assert ds.options.queue_bytes == 4 * MiB
    items = iter(ds)
    next(items)
    time.sleep(0.3)  # the queue fills up
    next(items)  # a batch is taken: with the whole queue in it, the engine would fetch a queue more
    time.sleep(0.5)  # the consumer stalls: the engine fills what room there is, then waits
    fetched_ahead = fake.requests - 2
    # the queue (4 objects, the one in hand included) and the request in flight; handing the
    # whole queue over and refilling it behind the stalled consumer fetched 7 here
    assert fetched_ahead <= 4 + 1, fetched_ahead
    assert sum(1 for _ in items) == 38
    assert ds.stats()["peak_buffered_bytes"] <= 4 * MiB + 2 * MiB


@pytest.mark.parametrize("budget", [8 * MiB, 16 * MiB, 64 * MiB, 128 * MiB, 1 << 30])
@pytest.mark.parametrize("shuffle", [False, True])
def test_derived_shard_reads_fit_their_share(budget, shuffle):
    derived = budget_options({"memory_budget": budget, "shuffle": shuffle}, "shards")
    reads = derived["shards_inflight"] * shard_read_bytes(derived["parts_inflight"], derived["part_size"])
    share = budget - derived["queue_bytes"] - (derived["shuffle_bytes"] or 0)
    assert reads <= share or (derived["shards_inflight"], derived["parts_inflight"]) == (1, 1)
    assert derived["part_size"] >= 1 * MiB
