"""``samples_per_epoch=N``: the pure plan (``datasets.cycling``) and the dataset reading it.

Property tests check the plan's promises: a rank's worker quotas add up to N and line up with
the DataLoader's batches; every pass deals each shard to exactly one slot (or splits it by
sample); a pass order is fresh with shuffling and the same on every call. Then the dataset, on
the in-memory store: N per rank whatever the shards hold, set_epoch, state_dict and resume().
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_shard_index import PATTERN, SIZES, store_with_index
from test_shards import FAST_RETRY
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import AsyncS3Dataset, ConfigError, Limits, Reading, Split, Store
from loader.datasets import cycling, partition
from loader.errors import EmptyDatasetError

from fakes import reusable

# --------------------------------------------------------------------------- the plan (pure)


@given(n=st.integers(0, 500), workers=st.integers(0, 6), batch=st.none() | st.integers(1, 40))
def test_worker_quotas_add_up_to_the_rank_length(n, workers, batch):
    quotas = [cycling.worker_quota(n, worker=w, num_workers=workers, batch_size=batch)
              for w in range(max(1, workers))]
    assert sum(quotas) == n
    if batch is None:
        assert max(quotas) - min(quotas) <= 1


@given(n=st.integers(0, 500), workers=st.integers(0, 6), batch=st.integers(1, 40))
def test_worker_quotas_follow_the_dataloaders_batches(n, workers, batch):
    # The DataLoader takes batch i from worker i % workers: the quotas are those blocks' sizes.
    for w in range(max(1, workers)):
        blocks = partition.block_positions(n, batch_size=batch, rank=0, world_size=1, worker=w,
                                           num_workers=workers)
        assert cycling.worker_quota(n, worker=w, num_workers=workers, batch_size=batch) == len(blocks)


@given(shards=st.integers(1, 30), world=st.integers(1, 4), workers=st.integers(0, 3),
       seed=st.integers(0, 2**32), shuffle=st.booleans(), passes=st.integers(1, 3))
def test_every_pass_deals_each_shard_once_over_the_slots(shards, world, workers, seed, shuffle, passes):
    read = Counter()
    for rank, worker in itertools.product(range(world), range(max(1, workers))):
        plan = cycling.cycle(shards, seed=seed, shuffle=shuffle, rank=rank, world_size=world,
                             worker=worker, num_workers=workers)
        for number, a in itertools.takewhile(lambda p: p[0] < passes, plan):
            read[number, a.shard, a.stride, a.phase] += 1
    for number in range(passes):
        this = {k: v for k, v in read.items() if k[0] == number}
        assert all(v == 1 for v in this.values())
        readers = Counter(shard for _, shard, _, _ in this)
        assert set(readers) == set(range(shards))  # every shard, every pass
        for _, shard, stride, _ in this:
            assert readers[shard] == stride  # split by sample among exactly ``stride`` slots


@given(shards=st.integers(2, 30), seed=st.integers(0, 2**32), epoch=st.integers(0, 50),
       resumed=st.integers(0, 10**6))
def test_passes_are_deterministic_and_fresh_when_shuffling(shards, seed, epoch, resumed):
    def first_passes(shuffle, resumed=resumed):
        plan = cycling.cycle(shards, seed=cycling.pass_seed(seed, epoch, resumed), shuffle=shuffle,
                             rank=0, world_size=1, worker=0, num_workers=0)
        return [a.shard for _, a in itertools.islice(plan, 4 * shards)]

    assert first_passes(True) == first_passes(True)
    assert first_passes(False) == list(range(shards)) * 4
    orders = [tuple(first_passes(True)[p * shards:(p + 1) * shards]) for p in range(4)]
    assert all(sorted(order) == list(range(shards)) for order in orders)
    if shards >= 5:
        assert len(set(orders)) > 1, "a new order per pass"
    assert cycling.pass_seed(seed, epoch, resumed) != cycling.pass_seed(seed, epoch, resumed + 1)


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="num_shards=0"):
        next(cycling.cycle(0, seed=1, shuffle=True, rank=0, world_size=1, worker=0, num_workers=0))
    with pytest.raises(ValueError, match="n=-1"):
        cycling.worker_quota(-1, worker=0, num_workers=1)
    with pytest.raises(ValueError, match="batch_size=0"):
        cycling.worker_quota(5, worker=0, num_workers=1, batch_size=0)
    with pytest.raises(ValueError, match="worker=2"):
        cycling.worker_quota(5, worker=2, num_workers=2)
    with pytest.raises(ValueError, match="epoch=-1"):
        cycling.pass_seed(1, -1)


# --------------------------------------------------------------------------- the dataset


def ds_of(fake, **options):
    retry = options.pop("retry", FAST_RETRY)
    return AsyncS3Dataset.from_shards(PATTERN, store=Store(backend=reusable(fake), retry=retry), **options)


def keys(samples):
    return [s["__key__"] for s in samples]


@pytest.mark.parametrize("n", [7, 90, 250])  # less than, exactly and more than the 90 samples
def test_every_rank_yields_exactly_n_without_any_counts(n):
    fake, expected = store_with_index(index=False)
    got = []
    for rank in range(3):
        ds = ds_of(fake, split=Split(rank=rank, world_size=3, samples_per_epoch=n), shuffle=True, seed=1)
        assert len(ds) == n
        samples = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert len(samples) == n
        got.append(keys(samples))
    assert set().union(*got) <= set(expected)
    if n >= 90:  # enough to go round: each rank's slots cycle through their own shards
        assert sum(len(set(g)) for g in got) >= 90


def test_each_pass_reads_every_sample_of_the_slot_once():
    fake, expected = store_with_index(index=False)
    samples = keys(ds_of(fake, split=Split(samples_per_epoch=180), limits=Limits(concurrency=4), shuffle=False))
    assert samples[:90] == samples[90:] and sorted(samples[:90]) == sorted(expected)
    shuffled = keys(ds_of(fake, split=Split(samples_per_epoch=180), reading=Reading(shuffle_buffer=0),
                          limits=Limits(concurrency=4), shuffle=True, seed=3))
    first, second = shuffled[:90], shuffled[90:]
    assert sorted(first) == sorted(second) == sorted(expected) and first != second


def test_epochs_differ_and_repeat():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(samples_per_epoch=40), shuffle=True, seed=5)
    ds.set_epoch(1)
    one = keys(ds)
    ds.set_epoch(2)
    two = keys(ds)
    ds.set_epoch(1)
    assert keys(ds) == one != two


def test_state_dict_resume_yields_the_rest_of_the_quota_without_repeats():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(samples_per_epoch=70), shuffle=True, seed=2, batch_size=5)
    loader = StatefulDataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork")
    first, state = [], None
    for step, batch in enumerate(loader):
        first += batch["__key__"]
        if step == 5:
            state = loader.state_dict()
            break
    again = ds_of(fake, split=Split(samples_per_epoch=70), shuffle=True, seed=2, batch_size=5)
    resumed = StatefulDataLoader(again, batch_size=5, num_workers=2, multiprocessing_context="fork")
    resumed.load_state_dict(state)
    rest = [key for batch in resumed for key in batch["__key__"]]
    assert len(first) == 30 and len(rest) == 40
    assert not set(first) & set(rest), "70 < 90 samples: nothing repeats within the epoch"


def test_a_dataloader_dropped_mid_epoch_is_freed_at_once_where_no_shard_index_was_found():
    """Shards without an index: the fork hook's look for ``index.json`` ended in NoSuchKey. That
    error's traceback went through anyio's portal, whose frame holds the future the error was
    set on (a cycle), and every frame of it held its callers: the DataLoader iterator that was
    forking. Dropped mid-epoch, the iterator waited for a garbage collection, where torch's
    finalizer waits 5 s for each worker (10 s in this test's teardown). Now it is freed, and
    its workers ended, when the last reference goes."""
    import gc
    import multiprocessing
    import weakref

    fake, _ = store_with_index(index=False)
    gc.disable()  # no collection may end the iterator early, as one would now and then
    try:
        ds = ds_of(fake, split=Split(samples_per_epoch=70), shuffle=True, seed=2, batch_size=5)
        loader = StatefulDataLoader(ds, batch_size=5, num_workers=2)  # started the platform's way
        before = set(multiprocessing.active_children())
        iterator = iter(loader)
        next(iterator)
        dropped = weakref.ref(iterator)
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2
        del iterator, loader
        assert dropped() is None, "the iterator outlived its last reference"
    finally:
        gc.enable()
    for worker in workers:  # signalled already: the bound only keeps a broken run from hanging
        worker.join(timeout=60)
    assert not [w for w in workers if w.is_alive()]


def test_resume_counts_samples_seen_per_rank_on_any_topology():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(samples_per_epoch=50, rank=0, world_size=2), batch_size=4, shuffle=True)
    assert ds.samples_seen(3) == 12 and ds.samples_seen(100) == 50
    for world in (1, 3):  # saved on 2 ranks after 3 steps, resumed on 1 or 3
        lengths = []
        for rank in range(world):
            ds = ds_of(fake, split=Split(samples_per_epoch=50, rank=rank, world_size=world), batch_size=4, shuffle=True)
            ds.resume(epoch=4, samples_seen=12)
            ds.set_epoch(4)
            assert len(ds) == 38 and ds.samples_seen(2) == 20
            lengths.append(len(list(DataLoader(ds, batch_size=4))))
        assert lengths == [10] * world  # 9 batches of 4 and one of 2: 38 samples
    with pytest.raises(ConfigError, match="samples_seen=51 is more than the 50 samples per rank"):
        ds.resume(epoch=4, samples_seen=51)


def test_resume_without_batch_size_works_per_rank():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(samples_per_epoch=30))
    ds.resume(epoch=0, samples_seen=10)
    assert len(ds) == 20 and len(list(ds)) == 20


def test_a_slot_without_samples_fails_instead_of_spinning():
    fake, _ = store_with_index([2], index=False)
    ds = AsyncS3Dataset.from_shards("s3://bucket/shards/train-0000.tar", store=reusable(fake),
                                    split=Split(samples_per_epoch=5, rank=2, world_size=3))
    with pytest.raises(EmptyDatasetError, match="rank 2 worker 0 read a whole pass over its shards "
                                                "without finding a sample"):
        list(ds)


def test_shuffle_buffer_with_batch_size_works_with_samples_per_epoch():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(samples_per_epoch=20), reading=Reading(shuffle_buffer=50), batch_size=4, shuffle=True)
    assert len(list(DataLoader(ds, batch_size=4))) == 5


def test_samples_per_epoch_must_be_positive():
    fake, _ = store_with_index(index=False)
    with pytest.raises(ConfigError, match="samples_per_epoch=0 must be a positive integer"):
        ds_of(fake, split=Split(samples_per_epoch=0))
    assert sum(SIZES) == 90
