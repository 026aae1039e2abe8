"""The epoch's order over units (window_order) and how mixed its batches are on sorted data.

Properties of the pure order (exactly once, deterministic per seed and epoch, a resume is a
slice of it on any topology, the stored order unshuffled), then the shuffle metric on
label-sorted data in every mode: mean distinct labels per batch at least 0.9x what a uniform
permutation gives, single-label batches at most 1 %; counts, not time.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from bench.labelmix import label_mix, uniform_distinct
from loader import AsyncS3Dataset, Reading, mix
from loader.datasets import partition
from loader.datasets.window_order import (
    WindowOrder,
    index_ranges,
    plan_reads,
    window_groups,
)
from loader.formats.shards import coalesced_spans

from fakes import FakeStore, reusable

counts_st = st.lists(st.integers(0, 40), min_size=0, max_size=12)


def orders(counts, seed, epoch, window, permuted=None):
    return WindowOrder(counts, seed=seed, epoch=epoch, shuffle=True, window=window, permuted=permuted)


@settings(deadline=None, max_examples=60)
@given(counts_st, st.integers(0, 3), st.integers(0, 5), st.integers(1, 6), st.data())
def test_every_sample_once_and_the_same_for_the_same_seed_and_epoch(counts, seed, epoch, window, data):
    permuted = data.draw(st.lists(st.booleans(), min_size=len(counts), max_size=len(counts)))
    order = list(orders(counts, seed, epoch, window, permuted))
    assert sorted(order) == [(u, i) for u in range(len(counts)) for i in range(counts[u])]
    assert order == list(orders(counts, seed, epoch, window, permuted))


@settings(deadline=None, max_examples=60)
@given(counts_st, st.integers(0, 3), st.integers(1, 6))
def test_a_streamed_unit_keeps_its_stored_order_inside_its_window(counts, seed, window):
    order = orders(counts, seed, 1, window)
    last: dict[int, int] = {}
    for unit, index in order:  # each unit lies in one window: its samples come ascending
        assert index == last.get(unit, -1) + 1
        last[unit] = index
    for group in order.groups:
        assert len(group) <= window


def test_unshuffled_is_the_stored_order_unit_after_unit():
    order = WindowOrder([3, 0, 2], seed=1, epoch=4, shuffle=False, window=8)
    assert list(order) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]


def test_the_order_changes_with_the_epoch_and_mixes_units():
    counts = [10] * 12
    first, second = list(orders(counts, 0, 0, 4)), list(orders(counts, 0, 1, 4))
    assert first != second
    runs = sum(1 for a, b in zip(first, first[1:]) if a[0] == b[0])
    assert runs < 0.5 * len(first)  # consecutive positions mostly from different units


def test_windows_hold_at_most_their_units_and_their_cap():
    assert window_groups([4, 2, 0, 1, 3], window=2) == [(4,), (2, 0), (1, 3)]  # balanced
    weights = [5, 5, 20, 5, 5]
    assert window_groups([0, 1, 2, 3, 4], window=4, weights=weights, cap=12) == [(0, 1), (2,), (3, 4)]


@settings(deadline=None, max_examples=60)
@given(counts_st, st.integers(0, 3), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 6), st.data())
def test_a_resume_on_another_topology_reads_the_rest_once(counts, seed, window, world, workers, batch, data):
    """Stop after some steps on one topology, resume the rest on another: a slice of the order."""
    order = orders(counts, seed, 2, window)
    n = len(order)
    steps = data.draw(st.integers(0, partition.steps_per_rank(n, batch, world, "drop")))
    seen = partition.samples_consumed(n, steps, batch_size=batch, world_size=world, policy="drop")
    new_world, new_workers = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))
    got = []
    for rank in range(world):
        for worker in range(workers):
            mine = partition.block_positions(n, batch_size=batch, rank=rank, world_size=world, worker=worker,
                                             num_workers=workers, policy="drop")
            per_step = [mine[i:i + batch] for i in range(0, len(mine), batch)]
            # this worker served steps worker, worker + workers, ...: those before ``steps``
            got += [p for i, block in enumerate(per_step) if worker + i * workers < steps for p in block]
    assert sorted(got) == list(range(seen))
    rest = n - seen
    for rank in range(new_world):
        for worker in range(max(1, new_workers)):
            got += [seen + p for p in partition.block_positions(
                rest, batch_size=batch, rank=rank, world_size=new_world, worker=worker,
                num_workers=new_workers, policy="drop")]
    full, last = partition.block_shape(rest, batch, new_world, "drop")  # "drop": < new_world left out
    assert len(got) == len(set(got)) == seen + (full * batch + last) * new_world
    assert set(got) == set(range(len(got)))  # a prefix of the order: nothing skipped, nothing twice
    samples = [order[p] for p in got]
    assert len(set(samples)) == len(samples)


@settings(deadline=None, max_examples=60)
@given(counts_st, st.integers(0, 3), st.integers(1, 5), st.data())
def test_a_plan_reads_each_position_once_in_its_order(counts, seed, window, data):
    order = orders(counts, seed, 0, window, [True, False] * 6 + [True])
    n = len(order)
    positions = data.draw(st.lists(st.integers(0, max(0, n - 1)), max_size=60)) if n else []
    found: dict[int, tuple[int, int]] = {}
    tag = 0
    for segment in plan_reads(order, positions):
        numbers = {read.number: read for read in segment.reads}
        cursor = Counter()
        for number in segment.schedule:
            read = numbers[number]
            found[tag] = (read.unit, read.indices[cursor[number]])
            assert read.tags[cursor[number]] == tag
            cursor[number] += 1
            tag += 1
    assert [found[t] for t in range(len(positions))] == [order[p] for p in positions]


@settings(deadline=None, max_examples=80)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.data(), st.integers(100, 20000),
       st.booleans())
def test_spans_cover_every_wanted_sample_within_their_size(sizes, data, max_bytes, sized):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    end = sum(sizes) if sized else None
    wanted = sorted(data.draw(st.sets(st.integers(0, len(sizes) - 1), min_size=1)))
    spans = coalesced_spans(index_ranges(wanted), offsets, max_bytes, end)
    assert all(a[1] <= b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))
    covered = {i for a, b in spans for i in range(a, b)}
    assert set(wanted) <= covered
    for a, b in spans:
        assert a in wanted and b - 1 in wanted  # a span starts and ends with wanted samples
        stop = offsets[b] if b < len(offsets) else end
        assert b - a == 1 or (stop is not None and stop - offsets[a] <= max_bytes)


def test_uniform_distinct_is_the_expectation_of_a_permutation():
    assert uniform_distinct([5, 5], 1) == pytest.approx(1.0)
    assert uniform_distinct([1] * 10, 8) == pytest.approx(8.0)
    assert uniform_distinct([100] * 10, 8) == pytest.approx(5.72, abs=0.02)


# ----------------------------------------------------------------------------- sorted data

CLASSES, PER_CLASS = 10, 100
LABELS = [i // PER_CLASS for i in range(CLASSES * PER_CLASS)]  # sorted by label


def sorted_store() -> FakeStore:
    """Label-sorted data three ways: keys in class order, tar shards packed in class order
    (with their index), Hub-style Parquet files (row groups of 100 rows, sorted by label)."""
    fake = FakeStore(buckets=["bucket"])
    for i, label in enumerate(LABELS):
        fake.objects["bucket", f"obj/c{label}/{i:05d}.bin"] = bytes([i % 256]) * 64
    per_shard, entries = 25, []
    for number, start in enumerate(range(0, len(LABELS), per_shard)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(start, start + per_shard):
                for ext, body in (("cls", str(LABELS[i]).encode()), ("bin", bytes([i % 256]) * 64)):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        body = out.getvalue()
        key = f"tar/{number:03d}.tar"
        fake.objects["bucket", key] = body
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            offsets = [m.offset for m in tar.getmembers()][::2]
        entries.append({"url": f"s3://bucket/{key}", "samples": per_shard, "offsets": offsets,
                        "etag": fake.etag_of("bucket", key), "size": len(body)})
    fake.objects["bucket", "tar/index.json"] = json.dumps({"version": 1, "shards": entries}).encode()
    half = len(LABELS) // 2
    for folder, size in (("pq", 64), ("pqbig", 12_000)):
        for number in range(2):
            rows = range(number * half, (number + 1) * half)
            table = pa.table({"image": [bytes([i % 256]) * size for i in rows],
                              "label": pa.array([LABELS[i] for i in rows], pa.int64())})
            out = io.BytesIO()
            pq.write_table(table, out, row_group_size=100, compression="none")
            fake.objects["bucket", f"{folder}/train-{number:05d}-of-00002.parquet"] = out.getvalue()
    return fake


SORTED = sorted_store()
STORE = reusable(SORTED)


def sorted_dataset(mode: str, **options):
    options = {"shuffle": True, "seed": 3, "store": STORE, **options}
    if mode == "objects":
        return AsyncS3Dataset.from_prefix("s3://bucket/obj/", label_from="parent", **options)
    if mode == "shards":
        return AsyncS3Dataset.from_shards("s3://bucket/tar/", **options)
    if mode == "shards-counts":  # counts given, no index: no offsets, shards read from their start
        counts = {f"s3://bucket/tar/{n:03d}.tar": 25 for n in range(len(LABELS) // 25)}
        return AsyncS3Dataset.from_shards("s3://bucket/tar/", sample_counts=counts, **options)
    if mode == "parquet":
        return AsyncS3Dataset.from_parquet("s3://bucket/pq/", **options)
    if mode == "parquet-row-groups":  # units of one row group (1.2 MB): mixed across units only
        return AsyncS3Dataset.from_parquet("s3://bucket/pqbig/", reading=Reading(part_size=1 << 20), **options)
    parts = {"tar": sorted_dataset("shards"), "pq": sorted_dataset("parquet")}
    return mix(parts, **options)


def label_of(sample) -> int:
    if "cls" in sample:
        return int(sample["cls"])
    return int(sample["label"])


def epoch_batches(ds, batch: int, workers: int = 0, epoch: int = 1) -> list[list[int]]:
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=batch, num_workers=workers,
                        collate_fn=lambda samples: [label_of(s) for s in samples])
    return list(loader)


MODES = ["objects", "shards", "shards-counts", "parquet", "parquet-row-groups", "mix"]


@pytest.mark.parametrize("dealt", [False, True], ids=["no-batch_size", "batch_size"])
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("mode", MODES)
def test_sorted_data_makes_mixed_batches(mode, batch, dealt):
    ds = sorted_dataset(mode, **({"batch_size": batch} if dealt else {}))
    batches = epoch_batches(ds, batch)
    assert sorted(label for b in batches for label in b) == LABELS if mode != "mix" else True
    found = label_mix(batches, [PER_CLASS] * CLASSES)
    assert found.ratio >= 0.9, found
    assert found.single_fraction <= 0.01, found


@pytest.mark.parametrize("dealt", [{"batch_size": 8}, {}], ids=["batch_size", "no-batch_size"])
@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_sorted_data_mixes_with_workers_and_repeats_per_epoch(mode, dealt):
    # two Parquet files of 500 rows are two units: too few for each worker to mix its own
    first = epoch_batches(sorted_dataset(mode, **dealt), 8, workers=2)
    again = epoch_batches(sorted_dataset(mode, **dealt), 8, workers=2)
    other = epoch_batches(sorted_dataset(mode, **dealt), 8, workers=2, epoch=2)
    assert first == again and first != other
    found = label_mix(first, [PER_CLASS] * CLASSES)
    assert found.ratio >= 0.9 and found.single_fraction <= 0.01, found


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_unshuffled_is_the_stored_order_file_by_file(mode):
    ds = sorted_dataset(mode, shuffle=False)
    ds.set_epoch(0)
    assert [label_of(s) for s in ds] == LABELS


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_a_resume_on_another_worker_count_reads_the_rest_once(mode):
    batch = 8
    ds = sorted_dataset(mode, batch_size=batch)
    ds.set_epoch(1)
    loader = DataLoader(ds, batch_size=batch, num_workers=2, collate_fn=lambda b: [s["__key__"] for s in b])
    before = []
    for step, keys in enumerate(loader):
        before += keys
        if step == 10:
            break
    seen = ds.samples_seen(11)
    again = sorted_dataset(mode, batch_size=batch)
    again.resume(epoch=1, samples_seen=seen)
    after = [k for keys in DataLoader(again, batch_size=batch, num_workers=3,
                                      collate_fn=lambda b: [s["__key__"] for s in b]) for k in keys]
    assert len(before) == seen
    assert len(before) + len(after) == len(LABELS) == len(set(before + after))
    whole = [k for keys in DataLoader(sorted_dataset(mode, batch_size=batch), batch_size=batch,
                                      collate_fn=lambda b: [s["__key__"] for s in b]) for k in keys]
    assert before + after == whole or sorted(before + after) == sorted(whole)


def test_a_state_saved_before_windowed_orders_resumes_only_where_the_order_is_unchanged():
    from loader import ConfigError

    shuffled = sorted_dataset("shards", batch_size=8)
    shuffled.set_epoch(1)
    with pytest.raises(ConfigError, match=r"state version 2\) in the middle of epoch 1.*mixes shuffled "
                                          r"shards.*ds\.set_epoch\(1\) instead of load_state_dict"):
        shuffled.load_state_dict({**shuffled.state_dict(), "version": 2})
    unshuffled = sorted_dataset("parquet", shuffle=False)
    unshuffled.load_state_dict({**unshuffled.state_dict(), "version": 2, "epoch": 1})
    assert unshuffled.epoch == 1
    objects = sorted_dataset("objects")
    objects.load_state_dict({**objects.state_dict(), "version": 2, "epoch": 1})
    assert objects.epoch == 1
