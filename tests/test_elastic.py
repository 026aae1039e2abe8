"""Elastic resume: the epoch's order dealt in blocks of ``batch_size``, and resuming it on another
number of ranks and DataLoader workers.

The pure part is property-tested against a model of the DataLoader's round robin over workers
(checked once against the real DataLoader below); the dataset part runs on an in-memory store.
"""

from __future__ import annotations

import io
import itertools
import json
import tarfile
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader import AsyncS3Dataset, AsyncS3MapDataset, ConfigError, Limits, Reading, Split
from loader.datasets.partition import (
    block_positions,
    block_shape,
    epoch_order,
    samples_consumed,
    sequence_ranges,
    steps_per_rank,
)

from fakes import FakeStore, payloads, reusable

sizes = st.integers(0, 400)
batch_sizes = st.integers(1, 9)
world_sizes = st.integers(1, 6)
worker_counts = st.integers(0, 4)
policies = st.sampled_from(["pad", "drop"])


def rank_batches(m, batch_size, rank, world_size, num_workers, policy):
    """A model of what one rank's DataLoader yields: each worker's positions cut into batches of
    ``batch_size`` (its last one short), taken from the workers in turn, skipping finished ones."""
    per_worker = []
    for worker in range(max(1, num_workers)):
        mine = block_positions(m, batch_size=batch_size, rank=rank, world_size=world_size,
                               worker=worker, num_workers=num_workers, policy=policy)
        per_worker.append([mine[i:i + batch_size] for i in range(0, len(mine), batch_size)])
    out = []
    for round_ in itertools.zip_longest(*per_worker):
        out.extend(batch for batch in round_ if batch is not None)
    return out


def expected_block(m, step, rank, batch_size, world_size, policy):
    full, last = block_shape(m, batch_size, world_size, policy)
    if step < full:
        lo, size = (step * world_size + rank) * batch_size, batch_size
    else:
        lo, size = full * batch_size * world_size + rank * last, last
    return [p % m for p in range(lo, lo + size)]


@settings(max_examples=300)
@given(m=sizes, batch_size=batch_sizes, world_size=world_sizes, num_workers=worker_counts,
       policy=policies)
def test_step_s_of_rank_r_is_block_s_times_w_plus_r(m, batch_size, world_size, num_workers, policy):
    steps = steps_per_rank(m, batch_size, world_size, policy)
    batches = {r: rank_batches(m, batch_size, r, world_size, num_workers, policy)
               for r in range(world_size)}
    for rank, mine in batches.items():
        assert len(mine) == steps, "every rank takes the same number of steps (DDP needs it)"
        for step, batch in enumerate(mine):
            assert batch == expected_block(m, step, rank, batch_size, world_size, policy)
    # The prefix property: after s steps on every rank, exactly the first samples_consumed(s).
    for s in range(steps + 1):
        seen = Counter(p for mine in batches.values() for batch in mine[:s] for p in batch)
        consumed = samples_consumed(m, s, batch_size=batch_size, world_size=world_size, policy=policy)
        assert set(seen) == set(range(consumed))
        repeats = sum(seen.values()) - len(seen)
        assert repeats == 0 or (policy == "pad" and s == steps and repeats <= world_size - 1)
    if policy == "drop":
        assert m - samples_consumed(m, steps, batch_size=batch_size, world_size=world_size,
                                    policy=policy) <= world_size - 1


@settings(max_examples=300)
@given(m=sizes, first=st.tuples(batch_sizes, world_sizes, worker_counts),
       second=st.tuples(batch_sizes, world_sizes, worker_counts), policy=policies, data=st.data())
def test_a_resume_on_any_topology_reads_the_rest_exactly_once(m, first, second, policy, data):
    (b1, w1, n1), (b2, w2, n2) = first, second
    stop = data.draw(st.integers(0, steps_per_rank(m, b1, w1, policy)))
    head = Counter(p for r in range(w1) for batch in rank_batches(m, b1, r, w1, n1, policy)[:stop]
                   for p in batch)
    seen = samples_consumed(m, stop, batch_size=b1, world_size=w1, policy=policy)
    rest = m - seen
    tail = Counter(seen + p for r in range(w2) for batch in rank_batches(rest, b2, r, w2, n2, policy)
                   for p in batch)
    both = head + tail
    if policy == "pad":
        assert set(both) == set(range(m))
        assert sum(both.values()) - m <= max(w1, w2) - 1  # the pad repeats, from one part only
    else:
        assert all(count == 1 for count in both.values())
        assert set(both) <= set(range(m)) and m - len(both) <= max(w1, w2) - 1


class Blocks(IterableDataset):
    def __init__(self, m, batch_size, policy):
        self.m, self.batch_size, self.policy = m, batch_size, policy

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 0) if info is None else (info.id, info.num_workers)
        return iter(block_positions(self.m, batch_size=self.batch_size, rank=1, world_size=2,
                                    worker=worker, num_workers=workers, policy=self.policy))


@pytest.mark.parametrize("num_workers", [0, 3])
@pytest.mark.parametrize("m,policy", [(47, "pad"), (47, "drop"), (40, "pad")])
def test_the_model_is_what_the_real_dataloader_does(m, policy, num_workers):
    loader = DataLoader(Blocks(m, 4, policy), batch_size=4, num_workers=num_workers)
    assert [batch.tolist() for batch in loader] == rank_batches(m, 4, 1, 2, num_workers, policy)


@given(counts=st.lists(st.integers(0, 12), max_size=8), data=st.data())
def test_sequence_ranges_follow_the_positions(counts, data):
    order = data.draw(st.permutations(range(len(counts))))
    total = sum(counts)
    positions = data.draw(st.lists(st.integers(0, max(0, total - 1)), max_size=40)) if total else []
    where = [(shard, i) for shard in order for i in range(counts[shard])]
    got = []
    for a in sequence_ranges(counts, order, positions):
        assert list(a.ranges) == sorted(a.ranges) and (a.start, a.stop) == (a.ranges[0][0], a.ranges[-1][1])
        for start, stop in a.ranges:
            assert start < stop
            got.extend((a.shard, i) for i in range(start, stop))
            assert all(a.keeps(i) for i in range(start, stop))
        assert a.wanted(counts[a.shard]) == sum(stop - start for start, stop in a.ranges)
    assert got == [where[p] for p in positions]


def test_small_example():
    # 10 samples, 2 per batch, 3 ranks: one full step, then a last step of 2 with 2 pad repeats.
    assert block_shape(10, 2, 3) == (1, 2) and block_shape(10, 2, 3, "drop") == (1, 1)
    assert [block_positions(10, batch_size=2, rank=r, world_size=3, worker=0, num_workers=0)
            for r in range(3)] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 0, 1]]
    assert samples_consumed(10, 1, batch_size=2, world_size=3) == 6
    assert samples_consumed(10, 2, batch_size=2, world_size=3) == 10
    assert samples_consumed(10, 2, batch_size=2, world_size=3, policy="drop") == 9


# ----------------------------------------------------------------------------- the dataset

BATCH = 4


def shard_store(objects, per_shard=23, index=False):
    """The objects packed into tar shards (last one short); returns (store, counts)."""
    fake = FakeStore.with_objects("bucket", objects)
    keys, counts, offsets = sorted(objects), {}, {}
    for number, start in enumerate(range(0, len(keys), per_shard)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for key in keys[start:start + per_shard]:
                info = tarfile.TarInfo(key)
                info.size = len(objects[key])
                tar.addfile(info, io.BytesIO(objects[key]))
        url = f"s3://bucket/shards/{number}.tar"
        fake.objects["bucket", f"shards/{number}.tar"] = out.getvalue()
        counts[url] = len(keys[start:start + per_shard])
        with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
            offsets[url] = [member.offset for member in tar.getmembers()]
    if index:
        key = {u: u.removeprefix("s3://bucket/") for u in counts}  # the index records each version
        document = {"version": 1, "shards": [{"url": u, "samples": n, "offsets": offsets[u],
                                              "etag": fake.etag_of("bucket", key[u]),
                                              "size": len(fake.objects["bucket", key[u]])}
                                             for u, n in counts.items()]}
        fake.objects["bucket", "shards/index.json"] = json.dumps(document).encode()
    return fake, counts


def make_dataset(mode, fake, counts=None, **options):
    options = {"shuffle": True, "seed": 5, "batch_size": BATCH, "store": reusable(fake), **options}
    if mode == "objects":
        keys = sorted(k for (_, k) in fake.objects if k.startswith("train/"))
        return AsyncS3Dataset.from_keys("bucket", keys, **options)
    return AsyncS3Dataset.from_shards("s3://bucket/shards/", sample_counts=counts, **options)


def rank_run(make, rank, world_size, num_workers, steps=None, resume=None, lanes=None):
    ds = make(split=Split(rank=rank, world_size=world_size))
    if resume is not None:
        ds.resume(epoch=2, samples_seen=resume, lanes=lanes)
    ds.set_epoch(2)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=num_workers,
                        collate_fn=lambda batch: [s["__key__"] for s in batch])
    return list(itertools.islice(loader, steps)), ds


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_stop_on_three_ranks_resume_on_two_then_one(mode):
    objects = payloads(101, size=16)
    fake, counts = (FakeStore.with_objects("bucket", objects), None) if mode == "objects" else shard_store(objects)

    def make(**topology):
        return make_dataset(mode, fake, counts, **topology)

    head, probe = [], None
    for rank in range(3):
        batches, probe = rank_run(make, rank, 3, num_workers=2, steps=5)
        assert len(batches) == 5 and all(len(b) == BATCH for b in batches)
        head.append(batches)
    seen = probe.samples_seen(5)
    assert seen == 5 * BATCH * 3
    # The first part is exactly the first `seen` samples of the epoch's global order, step by step.
    if mode == "objects":
        order = [sorted(objects)[i].rsplit(".", 1)[0] for i in epoch_order(101, seed=5, epoch=2, shuffle=True)]
        for step in range(5):
            for rank in range(3):
                block = (step * 3 + rank) * BATCH
                assert head[rank][step] == order[block:block + BATCH]
    first = [k for batches in head for b in batches for k in b]
    everything = {k.rsplit(".", 1)[0] for k in objects}
    for world_size, num_workers in ((2, 3), (1, 0)):
        tail = []
        for rank in range(world_size):
            # the epoch was dealt to the lanes of 3 ranks x 2 workers (shuffled shards: lanes.py)
            batches, ds = rank_run(make, rank, world_size, num_workers, resume=seen, lanes=3 * 2)
            assert len(ds) == sum(len(b) for b in batches)
            tail.append(batches)
        assert len({len(batches) for batches in tail}) == 1, "equal steps on every rank"
        rest = [k for batches in tail for b in batches for k in b]
        both = Counter(first + rest)
        assert set(both) == everything
        repeats = sum(both.values()) - len(everything)
        assert 0 <= repeats <= world_size - 1  # the documented pad at the epoch's end


def test_shard_mode_reads_the_index_beside_the_shards():
    objects = payloads(60, size=16)
    fake, _ = shard_store(objects, index=True)
    ds = make_dataset("shards", fake, split=Split(rank=0, world_size=1))
    keys = [s["__key__"] for s in ds]
    assert sorted(keys) == sorted(k.rsplit(".", 1)[0] for k in objects) and len(ds) == 60


def test_with_the_index_offsets_each_rank_fetches_only_its_blocks():
    objects = payloads(150, size=400)
    fake, counts = shard_store(objects, per_shard=50, index=True)

    def epoch(counts=None):
        batches, read = [], 0
        for rank in range(3):
            # unshuffled: blocks of the shards' stored order (shuffled ones are read in lanes)
            ds = make_dataset("shards", fake, counts, split=Split(rank=rank, world_size=3),
                              reading=Reading(chunk_size=256), shuffle=False)
            ds.set_epoch(1)
            loader = DataLoader(ds, batch_size=BATCH, collate_fn=lambda b: [s["__key__"] for s in b])
            batches.append(list(loader))
            read += ds.stats()["bytes"]
        return batches, read

    ranged, ranged_bytes = epoch()  # offsets from index.json
    whole, whole_bytes = epoch(counts)  # counts alone: shards read from their start
    assert ranged == whole
    data = sum(len(body) for (_, key), body in fake.objects.items() if key.endswith(".tar"))
    assert ranged_bytes < 1.5 * data < whole_bytes


def test_shard_mode_without_counts_says_what_is_missing():
    fake, _ = shard_store(payloads(30, size=16))
    ds = make_dataset("shards", fake, split=Split(rank=0, world_size=1))
    with pytest.raises(ConfigError, match=r"sample count of each shard is unknown \(no index.json at "
                                          r"s3://bucket/shards/index.json\).*python -m loader index "
                                          r".*sample_counts=.*samples_per_epoch="):
        ds.resume(epoch=0, samples_seen=8)
    with pytest.raises(ConfigError, match="sample_counts"):
        list(ds)


def test_set_epoch_keeps_a_resume_of_the_same_epoch_and_drops_it_for_another():
    objects = payloads(40, size=16)
    ds = make_dataset("objects", FakeStore.with_objects("bucket", objects), split=Split(rank=0, world_size=1))
    ds.resume(epoch=3, samples_seen=12)
    ds.set_epoch(3)
    assert len(ds) == 28 and len(list(ds)) == 28 and ds.samples_seen(0) == 12
    ds.set_epoch(4)
    assert len(ds) == 40 and len(list(ds)) == 40


def test_state_dict_carries_the_resume_point():
    objects = payloads(40, size=16)
    fake = FakeStore.with_objects("bucket", objects)
    ds = make_dataset("objects", fake, split=Split(rank=0, world_size=1))
    ds.resume(epoch=1, samples_seen=16)
    it = iter(ds)
    got = [next(it)["__key__"] for _ in range(5)]
    state = ds.state_dict()
    it.close()
    again = make_dataset("objects", fake, split=Split(rank=0, world_size=1))
    again.load_state_dict(state)
    rest = [s["__key__"] for s in again]
    assert len(got) + len(rest) == 24 and not set(got) & set(rest)
    other = make_dataset("objects", fake, split=Split(rank=0, world_size=1), batch_size=None)
    with pytest.raises(ConfigError, match="batch_size=4"):
        other.load_state_dict(state)


@pytest.mark.parametrize("call, match", [
    (lambda fake: make_dataset("objects", fake, batch_size=0), "batch_size=0 must be a positive"),
    (lambda fake: make_dataset("objects", fake, limits=Limits(ordered=False)), "ordered=False"),
    (lambda fake: make_dataset("objects", fake, batch_size=None).resume(epoch=0, samples_seen=1),
     "build the dataset with batch_size="),
    (lambda fake: make_dataset("objects", fake).resume(epoch=0, samples_seen=-1), "samples_seen=-1"),
    (lambda fake: make_dataset("objects", fake).resume(epoch=0, samples_seen=11), "more than the 10"),
    (lambda fake: AsyncS3MapDataset.from_keys("bucket", ["train/a.bin"], batch_size=4), "batch_size=4"),
])
def test_bad_settings_are_named(call, match):
    with pytest.raises(ConfigError, match=match):
        call(FakeStore.with_objects("bucket", payloads(10, size=8)))


@pytest.mark.parametrize("how", ["stateful", "batches"])
@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_same_topology_resumes_still_work_with_batch_size(mode, how):
    from torchdata.stateful_dataloader import StatefulDataLoader

    objects = payloads(90, size=16)
    fake, counts = (FakeStore.with_objects("bucket", objects), None) if mode == "objects" else shard_store(objects)

    def loader(ds):
        cls = StatefulDataLoader if how == "stateful" else DataLoader
        return cls(ds, batch_size=BATCH, num_workers=2, collate_fn=lambda b: [s["__key__"] for s in b])

    def dataset():
        ds = make_dataset(mode, fake, counts, split=Split(rank=1, world_size=2))
        # itself resumed elastically (from a run of 2 ranks x 2 workers), then stopped again
        ds.resume(epoch=2, samples_seen=16, lanes=4)
        ds.set_epoch(2)
        return ds

    whole = list(loader(dataset()))
    first = loader(dataset())
    head = list(itertools.islice(first, 3))
    second = loader(dataset())
    if how == "stateful":
        second.load_state_dict(first.state_dict())
    else:
        with pytest.deprecated_call(match="resume_from_batches"):
            second.dataset.resume_from_batches(epoch=2, batches_seen=3, batch_size=BATCH)
    assert head + list(second) == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_batch_size_other_than_the_datasets_still_reads_each_sample_once(workers):
    """The two batch sizes are not compared (a DataLoader tells its dataset none): a different
    one still reads the epoch exactly once; only samples_seen(), counted in the dataset's
    blocks, is then wrong, as the docs say."""
    objects = payloads(40, size=16)
    fake = FakeStore.with_objects("bucket", objects)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), batch_size=8, store=reusable(fake))
    loader = DataLoader(ds, batch_size=16, num_workers=workers, collate_fn=keys_of_batch)
    batches = list(loader)
    assert sorted(key for batch in batches for key in batch) == sorted(key.rsplit(".", 1)[0] for key in objects)
    assert [len(batch) for batch in batches][:2] == [16, 16]
    assert ds.samples_seen(2) == 16, "counted in the dataset's blocks of 8, not the DataLoader's 16"


def keys_of_batch(batch):
    return [sample["__key__"] for sample in batch]



def test_resuming_shuffled_shards_by_samples_seen_asks_for_the_lanes_of_the_run_that_saved_it():
    """A shuffled epoch of shards is dealt to one lane per rank x worker of the run that started
    it; without that number a resume would repeat and skip samples: it is asked for, by name."""
    fake, counts = shard_store(payloads(90, size=16))
    ds = make_dataset("shards", fake, counts, split=Split(rank=0, world_size=1))
    with pytest.raises(ConfigError, match=r"needs lanes=.*world_size \* max\(1, num_workers\)"):
        ds.resume(epoch=1, samples_seen=16)
    ds.resume(epoch=1, samples_seen=16, lanes=3)  # given: accepted
