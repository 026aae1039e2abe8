"""Shuffled reading in lanes (``loader.datasets.lanes``): the pure order, property-tested (every
sample once per epoch, deterministic per seed and epoch, another order another epoch, a resume
reads exactly the rest), and on the fake store label-sorted shards and Parquet files give batches
as mixed as a permutation's, with 0 and 2 DataLoader workers (counts, not time)."""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from bench.labelmix import label_mix
from loader import AsyncS3Dataset, Split
from loader.datasets import lanes
from loader.datasets.partition import epoch_order

from fakes import FakeStore, reusable

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)


def everything(counts):
    return Counter((unit, index) for unit, n in enumerate(counts) for index in range(n))


def lane_samples(order: lanes.LaneOrder):
    return [(order.pieces[p].unit, at) for p, at in zip(order.piece, order.at)]


@settings(deadline=None, max_examples=150)
@given(counts=counts_st, slots=st.integers(1, 7), piece=st.integers(1, 9), open_count=st.integers(1, 6),
       seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_lanes_read_every_sample_once(counts, slots, piece, open_count, seed, epoch):
    total = sum(counts)
    sizes = lanes.split_sizes(total, slots)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=True)
    cut = lanes.cut(counts, order, sizes, lambda unit: piece)
    assert [sum(p.stop - p.start for p in lane) for lane in cut] == sizes
    assert all(0 < p.stop - p.start <= piece for lane in cut for p in lane)
    permutations = {unit: lanes.unit_rows(n, seed=seed, epoch=epoch, unit=unit)
                    for unit, n in enumerate(counts) if unit % 2 == 0}
    read = Counter()
    for lane, pieces in enumerate(cut):
        drawn = lanes.lane_order(pieces, open_count=open_count, seed=lanes.lane_seed(seed, epoch, lane),
                                 rows=permutations.get)
        samples = lane_samples(drawn)
        assert len(samples) == sizes[lane]
        for number, p in enumerate(drawn.pieces):  # a piece in stored order, or a slice of the permutation
            mine = [at for q, at in zip(drawn.piece, drawn.at) if q == number]
            if p.unit % 2:
                assert mine == list(range(p.start, p.stop))
            else:
                assert mine == permutations[p.unit][p.start:p.stop]
        read.update(samples)
    assert read == everything(counts)


@settings(deadline=None, max_examples=100)
@given(counts=counts_st, batch=st.integers(1, 9), slots=st.integers(1, 5), seed=st.integers(0, 3))
def test_blocks_of_the_lanes_cover_the_epoch_once(counts, batch, slots, seed):
    total = sum(counts)
    sizes = lanes.block_lane_sizes(total, batch, slots)
    assert sum(sizes) == total
    order = epoch_order(len(counts), seed=seed, epoch=1, shuffle=True)
    cut = lanes.cut(counts, order, sizes, lambda unit: 3)
    drawn = [lane_samples(lanes.lane_order(p, open_count=4, seed=lanes.lane_seed(seed, 1, n)))
             for n, p in enumerate(cut)]
    located = [lanes.block_lane(position, batch, slots) for position in range(total)]
    assert Counter(located) == Counter((lane, d) for lane in range(slots) for d in range(sizes[lane]))
    assert Counter(drawn[lane][d] for lane, d in located) == everything(counts)


def test_the_order_is_the_seed_s_and_the_epoch_s():
    counts = [50] * 12
    sizes = lanes.split_sizes(600, 2)

    def read(seed, epoch):
        order = epoch_order(12, seed=seed, epoch=epoch, shuffle=True)
        cut = lanes.cut(counts, order, sizes, lambda unit: 10)
        return [lane_samples(lanes.lane_order(p, open_count=8, seed=lanes.lane_seed(seed, epoch, n)))
                for n, p in enumerate(cut)]

    assert read(1, 0) == read(1, 0)
    assert read(1, 0) != read(1, 1) and read(1, 0) != read(2, 0)


def test_pieces_of_a_unit_go_to_different_lanes():
    cut = lanes.cut([30, 30], [0, 1], [30, 30], lambda unit: 10)
    assert cut == [[lanes.Piece(0, 0, 10), lanes.Piece(0, 20, 30), lanes.Piece(1, 10, 20)],
                   [lanes.Piece(0, 10, 20), lanes.Piece(1, 0, 10), lanes.Piece(1, 20, 30)]]


def test_ranges_of():
    assert lanes.ranges_of([5, 1, 2, 3, 9, 8]) == ((1, 4), (5, 6), (8, 10))
    assert lanes.ranges_of([]) == ()


# ----------------------------------------------------------------------------- on the fake store

CLASSES, PER_CLASS, PER_SHARD = 10, 48, 16
LABELS = [i // PER_CLASS for i in range(CLASSES * PER_CLASS)]  # sorted by label


def sorted_store() -> FakeStore:
    """Tar shards packed in class order with their index, and two Parquet files sorted by
    label in row groups of 16 rows (as a Hub push writes them, smaller)."""
    fake = FakeStore.with_objects("bucket", {})
    entries = []
    for number, start in enumerate(range(0, len(LABELS), PER_SHARD)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(start, start + PER_SHARD):
                for ext, body in (("cls", str(LABELS[i]).encode()), ("bin", bytes([i % 256]) * 64)):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        body = out.getvalue()
        key = f"tar/{number:04d}.tar"
        fake.objects["bucket", key] = body
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            offsets = [member.offset for member in tar.getmembers()][::2]
        entries.append({"url": f"s3://bucket/{key}", "samples": PER_SHARD, "offsets": offsets,
                        "etag": fake.etag_of("bucket", key), "size": len(body)})
    fake.objects["bucket", "tar/index.json"] = json.dumps({"version": 1, "shards": entries}).encode()
    half = len(LABELS) // 2
    for number in range(2):
        rows = range(number * half, (number + 1) * half)
        table = pa.table({"image": [{"bytes": bytes([i % 256]) * 64, "path": f"{i}.jpg"} for i in rows],
                          "label": pa.array([LABELS[i] for i in rows], pa.int64())})
        out = io.BytesIO()
        pq.write_table(table, out, row_group_size=16)
        fake.objects["bucket", f"pq/train-{number:05d}-of-00002.parquet"] = out.getvalue()
    return fake


FAKE = sorted_store()


def dataset(mode, **options):
    options = {"shuffle": True, "seed": 3, "store": reusable(FAKE), **options}
    if mode == "shards":
        return AsyncS3Dataset.from_shards("s3://bucket/tar/", **options)
    return AsyncS3Dataset.from_parquet("s3://bucket/pq/", columns=["image", "label"], **options)


def label_of(sample) -> int:
    return int(sample["cls"]) if "cls" in sample else int(sample["label"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_label_sorted_data_gives_mixed_batches(mode, dealt, workers):
    for batch in (8, 32):
        ds = dataset(mode, **({"batch_size": batch} if dealt else {}))
        ds.set_epoch(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "cannot mix" warning here
            batches = list(DataLoader(ds, batch_size=batch, num_workers=workers,
                                      collate_fn=lambda samples: [label_of(s) for s in samples]))
        assert sorted(label for b in batches for label in b) == LABELS
        found = label_mix(batches, [PER_CLASS] * CLASSES)
        assert found.ratio >= 0.9 and found.single_fraction <= 0.01, (batch, found)


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_unshuffled_is_the_stored_order(mode):
    ds = dataset(mode, shuffle=False)
    assert [label_of(s) for s in ds] == LABELS
    ds = dataset(mode, shuffle=False, batch_size=8)
    assert [label_of(s) for s in ds] == LABELS


@settings(deadline=None, max_examples=12)
@given(mode=st.sampled_from(["shards", "parquet"]), dealt=st.booleans(), stop=st.integers(0, len(LABELS)))
def test_a_saved_state_resumes_with_exactly_the_rest_in_order(mode, dealt, stop):
    options = {"batch_size": 8} if dealt else {}
    whole_ds = dataset(mode, **options)
    whole_ds.set_epoch(2)
    whole = [s["__key__"] for s in whole_ds]
    first = dataset(mode, **options)
    first.set_epoch(2)
    taken, state = [], first.state_dict()
    if stop:
        for sample in first:
            taken.append(sample["__key__"])
            if len(taken) == stop:
                state = first.state_dict()
                break
    second = dataset(mode, **options)
    second.load_state_dict(state)
    rest = [s["__key__"] for s in second]
    assert taken + rest == whole
    assert sorted(whole) == sorted(set(whole)) and len(whole) == len(LABELS)


def test_a_worker_with_too_few_runs_to_mix_says_so():
    # No index, so shards cannot be split: 30 shards over 2 workers... but here one shard of a
    # lane is the whole lane. Counts given without offsets: each piece is a whole shard.
    counts = {f"s3://bucket/tar/{n:04d}.tar": PER_SHARD for n in range(len(LABELS) // PER_SHARD)}
    ds = AsyncS3Dataset.from_shards([f"s3://bucket/tar/{n:04d}.tar" for n in range(4)], shuffle=True,
                                    store=reusable(FAKE),
                                    sample_counts={u: n for u, n in counts.items() if int(u[-8:-4]) < 4})
    with pytest.warns(RuntimeWarning, match="reads only 4 run"):
        assert len(list(ds)) == 4 * PER_SHARD


@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
@pytest.mark.parametrize("mode", ["shards", "parquet", "mix"])
def test_a_stateful_dataloader_of_two_workers_resumes_with_exactly_the_rest(mode, dealt):
    from torchdata.stateful_dataloader import StatefulDataLoader

    options = {"batch_size": 8} if dealt else {}

    def loader():
        ds = mixed(options.get("batch_size")) if mode == "mix" else dataset(mode, **options)
        ds.set_epoch(4)
        return StatefulDataLoader(ds, batch_size=8, num_workers=2,
                                  collate_fn=lambda samples: [(s.get("__source__"), s["__key__"]) for s in samples])

    whole = [key for batch in loader() for key in batch]
    first, taken = loader(), []
    for step, batch in enumerate(first):
        taken += batch
        if step == 6:
            state = first.state_dict()
            break
    again = loader()
    again.load_state_dict(state)
    rest = [key for batch in again for key in batch]
    assert taken + rest == whole and len(set(whole)) == (2 if mode == "mix" else 1) * len(LABELS)


@pytest.mark.parametrize("mode", ["shards", "mix"])
def test_the_main_process_s_state_names_the_lanes_its_workers_read(mode):
    """The state a training script takes from the dataset in its main process (its DataLoader's
    workers did the reading) names their lanes, which a resume of the epoch's order needs."""
    ds = mixed(8) if mode == "mix" else dataset(mode, batch_size=8)
    ds.set_epoch(1)
    assert ds.state_dict()["lanes"] is None  # nothing read yet
    for step, _ in enumerate(DataLoader(ds, batch_size=8, num_workers=3, collate_fn=len)):
        if step == 4:
            break
    state, seen = ds.state_dict(), ds.samples_seen(5)
    assert state["lanes"] == 3
    whole_ds = mixed(8) if mode == "mix" else dataset(mode, batch_size=8)
    whole_ds.resume(epoch=1, samples_seen=0, lanes=state["lanes"])
    whole = [(s.get("__source__"), s["__key__"]) for s in whole_ds]
    again = mixed(8) if mode == "mix" else dataset(mode, batch_size=8)
    again.resume(epoch=state["epoch"], samples_seen=seen, lanes=state["lanes"])
    assert [(s.get("__source__"), s["__key__"]) for s in again] == whole[seen:]


# ----------------------------------------------------------------------------- reading pieces


def test_pieces_above_the_buffered_size_are_streamed_and_below_it_read_whole(monkeypatch):
    """A lane's piece longer than ``BUFFERED_PIECE`` is streamed from its first sample (parsed as
    it arrives) and asks for no byte past its last sample, a shorter one is one bounded GET;
    either way every sample comes once, and every byte of the shards is asked for once."""
    from loader.datasets import shard_source

    calls = Counter()
    asked: list[int] = []  # bytes each stream asked for
    fake = FakeStore.with_objects("bucket", {})
    fake.objects.update(FAKE.objects)
    for name in ("get_range", "stream"):
        method = getattr(fake, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            if args[1].endswith(".tar"):
                calls[_name] += 1
                if _name == "stream":
                    end, start = kwargs.get("end"), kwargs.get("start", args[2] if len(args) > 2 else 0)
                    asked.append((len(fake.objects["bucket", args[1]]) if end is None else end) - start)
            return _method(*args, **kwargs)

        monkeypatch.setattr(fake, name, counted)
    monkeypatch.setattr(shard_source, "MIN_PIECE_SAMPLES", 4)
    monkeypatch.setattr(lanes, "LANE_PIECES", len(LABELS) // 4)  # pieces of 4: 4 a shard
    shards = len(LABELS) // PER_SHARD
    # the last piece of a shard reads on to its end (the count check): streamed either way
    for limit, gets, streams in ((1 << 20, 3 * shards, shards), (0, 0, 4 * shards)):
        monkeypatch.setattr(shard_source, "BUFFERED_PIECE", limit)
        calls.clear()
        asked.clear()
        ds = AsyncS3Dataset.from_shards("s3://bucket/tar/", shuffle=True, seed=3, store=reusable(fake))
        ds.set_epoch(1)
        assert sorted(label_of(s) for s in ds) == LABELS
        assert calls == {"get_range": gets, "stream": streams} if gets else {"stream": streams}, (limit, calls)
    tar_bytes = sum(len(body) for (_, key), body in fake.objects.items() if key.endswith(".tar"))
    assert sum(asked) == tar_bytes, "each streamed piece ends where the next one starts"


# ----------------------------------------------------------------------------- mixes


def mixed(dealt=None, **options):
    from loader import mix

    store = reusable(FAKE)
    datasets = {"tar": dataset("shards", store=store), "pq": dataset("parquet", store=store)}
    return mix(datasets, store=store, seed=5, shuffle=True,
               **({"batch_size": dealt} if dealt else {}), **options)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
def test_a_mix_of_label_sorted_shards_and_parquet_gives_mixed_batches_each_sample_once(dealt, workers):
    for batch in (8, 32):
        ds = mixed(batch if dealt else None)
        ds.set_epoch(1)
        batches = list(DataLoader(ds, batch_size=batch, num_workers=workers,
                                  collate_fn=lambda samples: [(s["__source__"], s["__key__"], label_of(s))
                                                              for s in samples]))
        got = [sample for b in batches for sample in b]
        assert len(got) == 2 * len(LABELS) and len(set(got)) == len(got), "each sample once an epoch"
        assert Counter(source for source, _, _ in got) == {"tar": len(LABELS), "pq": len(LABELS)}
        found = label_mix([[label for _, _, label in b] for b in batches], [2 * PER_CLASS] * CLASSES)
        assert found.ratio >= 0.9 and found.single_fraction <= 0.01, (batch, found)


def test_a_mix_in_lanes_walks_its_draw_order_once_before_its_workers_start():
    from loader.datasets.mix_order import DrawOrder

    ds = mixed()
    ds.set_epoch(1)  # in the main process: forked DataLoader workers inherit the walk
    assert ds.source._tallied is not None
    assert list(ds.source._tallied.sources) == [s for s, _ in DrawOrder(ds.source.shares()).walk()]


def test_a_mix_in_lanes_shuffles_every_epoch_anew():
    orders = []
    for epoch in (1, 2):
        ds = mixed()
        ds.set_epoch(epoch)
        orders.append([(s["__source__"], s["__key__"]) for s in ds])
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


@settings(deadline=None, max_examples=8)
@given(dealt=st.booleans(), stop=st.integers(1, 2 * len(LABELS) - 1))
def test_a_mix_in_lanes_resumes_from_a_saved_state_with_exactly_the_rest(dealt, stop):
    whole_ds = mixed(8 if dealt else None)
    whole_ds.set_epoch(3)
    whole = [(s["__source__"], s["__key__"]) for s in whole_ds]
    first = mixed(8 if dealt else None)
    first.set_epoch(3)
    taken = []
    for sample in first:
        taken.append((sample["__source__"], sample["__key__"]))
        if len(taken) == stop:
            state = first.state_dict()
            break
    second = mixed(8 if dealt else None)
    second.load_state_dict(state)
    assert taken + [(s["__source__"], s["__key__"]) for s in second] == whole


# ----------------------------------------------------------------------------- which sources deal lanes


def test_sources_say_whether_they_deal_lanes():
    from loader import mix

    assert dataset("shards").source.deals_lanes() and dataset("parquet").source.deals_lanes()
    assert not dataset("shards", shuffle=False).source.deals_lanes()
    objects = AsyncS3Dataset.from_prefix("s3://bucket/tar/", shuffle=True, store=reusable(FAKE))
    assert not objects.source.deals_lanes()
    assert mixed().source.deals_lanes()
    assert not mix({"objects": objects}, store=objects.options.store).source.deals_lanes()


def test_shards_without_counts_warn_once_naming_them_and_the_index_command():
    bare = FakeStore.with_objects("bucket", {})  # the shards without their index
    bare.objects.update({("bucket", key.replace("tar/", "raw/")): body for (_, key), body in FAKE.objects.items()
                         if key.endswith(".tar")})
    ds = AsyncS3Dataset.from_shards("s3://bucket/raw/", shuffle=True, store=reusable(bare),
                                    split=Split(uneven_ranks=True))
    with pytest.warns(RuntimeWarning, match="without sample counts") as said:
        ds.set_epoch(0)
        ds.set_epoch(1)
    texts = [str(w.message) for w in said if "sample counts" in str(w.message)]
    assert len(texts) == 1
    assert "s3://bucket/raw/0000.tar" in texts[0] and "and 27 more" in texts[0]
    assert "python -m loader index 's3://bucket/raw/'" in texts[0]
    assert sorted(label_of(s) for s in ds) == LABELS  # read whole, mixed by the buffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = AsyncS3Dataset.from_shards("s3://bucket/tar/", shuffle=True, store=reusable(FAKE))
        quiet.set_epoch(0)  # an index: lanes, nothing to say
        unshuffled = AsyncS3Dataset.from_shards("s3://bucket/raw/", store=reusable(bare),
                                                split=Split(uneven_ranks=True))
        unshuffled.set_epoch(0)


def test_a_memory_budget_opens_as_many_streamed_pieces_as_their_chunks_fit():
    """Streamed pieces hold a chunk each, not their length: 64 MiB leaves room for 24 open (8 MiB
    bodies read whole allowed 6), and batches of label-sorted shards still mix under it."""
    from loader import Limits

    ds = dataset("shards", limits=Limits(memory=64 << 20))
    assert ds.source.open_count() == 24
    assert dataset("shards", limits=Limits(memory=16 << 20)).source.open_count() >= 2
    ds.set_epoch(1)
    batches = list(DataLoader(ds, batch_size=32, collate_fn=lambda samples: [label_of(s) for s in samples]))
    assert sorted(label for b in batches for label in b) == LABELS
    found = label_mix(batches, [PER_CLASS] * CLASSES)
    assert found.ratio >= 0.9 and found.single_fraction <= 0.01, found
