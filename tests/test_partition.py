"""Property tests for ``loader.datasets.partition``: exactly-once, balance and determinism.

The model is s3torchconnector's hypothesis test: draw a job shape (items, ranks, workers, seed,
epoch), compute every (rank, worker) share, and check the union against the whole data set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.datasets.partition import (
    DEFAULT_SEED,
    SMALL_ORDER,
    balanced_shard_ranges,
    block_positions,
    block_shape,
    epoch_order,
    epoch_seed,
    needs_sample_split,
    partition,
    rank_length,
    rank_share,
    samples_consumed,
    sequence_ranges,
    shard_assignments,
    slot_of,
    steps_per_rank,
    worker_share,
)
from loader.formats.shards import ShardAssignment

sizes = st.integers(0, 5000)
world_sizes = st.integers(1, 16)
worker_counts = st.integers(0, 8)
seeds = st.integers(-(2**70), 2**70)
epochs = st.integers(0, 10_000)
policies = st.sampled_from(["pad", "drop"])

ROOT = Path(__file__).resolve().parent.parent


def all_shares(n, seed, epoch, shuffle, world_size, num_workers, policy):
    """``{(rank, worker): items}`` for a whole job, computing the epoch order once."""
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    shares = {}
    for rank in range(world_size):
        mine = rank_share(order, rank, world_size, policy)
        for worker in range(max(1, num_workers)):
            shares[rank, worker] = worker_share(mine, worker, num_workers)
    return order, shares


# ----------------------------------------------------------------------------- item mode


@settings(deadline=None)  # orders past SMALL_ORDER are computed per index: ~3 us an item
@given(n=sizes, seed=seeds, epoch=epochs, shuffle=st.booleans(), world_size=world_sizes,
       num_workers=worker_counts, policy=policies, data=st.data())
def test_union_balance_and_composition(n, seed, epoch, shuffle, world_size, num_workers, policy, data):
    order, shares = all_shares(n, seed, epoch, shuffle, world_size, num_workers, policy)
    union = Counter(item for items in shares.values() for item in items)
    per_rank = rank_length(n, world_size, policy)

    if policy == "pad":
        # Every item at least once; the only repeats are the padding, taken from the order's start.
        pad = per_rank * world_size - n
        expected = Counter(order) + Counter(order[i % n] for i in range(pad)) if n else Counter()
        assert union == expected
        assert sum(union.values()) == world_size * -(-n // world_size)
        assert set(union) == set(range(n))
    else:
        assert all(count == 1 for count in union.values())  # disjoint
        assert sum(union.values()) == world_size * (n // world_size)
        assert set(union) <= set(range(n))

    workers = max(1, num_workers)
    for rank in range(world_size):
        lengths = [len(shares[rank, w]) for w in range(workers)]
        assert sum(lengths) == per_rank  # equal length per rank
        assert max(lengths) - min(lengths) <= 1  # workers balanced within a rank

    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    worker = data.draw(st.integers(0, workers - 1), label="worker")
    kwargs = dict(seed=seed, epoch=epoch, shuffle=shuffle, rank=rank, world_size=world_size,
                  worker=worker, num_workers=num_workers, policy=policy)
    assert partition(n, **kwargs) == shares[rank, worker]
    assert partition(n, **kwargs) == partition(n, **kwargs)  # deterministic


@settings(deadline=None)
@given(n=sizes, seed=seeds, epoch=epochs)
def test_order_is_a_permutation_and_identity_without_shuffle(n, seed, epoch):
    shuffled = epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    assert sorted(shuffled) == list(range(n))
    assert shuffled == epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    assert epoch_order(n, seed=seed, epoch=epoch, shuffle=False) == list(range(n))


@given(n=sizes, world_size=world_sizes, policy=policies)
def test_unshuffled_ranks_stride_the_identity(n, world_size, policy):
    total = rank_length(n, world_size, policy) * world_size
    for rank in range(world_size):
        share = partition(n, seed=DEFAULT_SEED, epoch=0, shuffle=False, rank=rank,
                          world_size=world_size, worker=0, num_workers=0, policy=policy)
        assert share == [i % n for i in range(rank, total, world_size)]


@pytest.mark.parametrize("n", [10, 100, 5000])
@pytest.mark.parametrize("seed", [DEFAULT_SEED, 1, 42, -7])
def test_epochs_and_seeds_give_different_orders(n, seed):
    orders = [tuple(epoch_order(n, seed=seed, epoch=e, shuffle=True)) for e in range(6)]
    assert len(set(orders)) == len(orders)
    assert all(order != tuple(range(n)) for order in orders)
    other_seed = epoch_order(n, seed=seed + 1, epoch=0, shuffle=True)
    assert tuple(other_seed) != orders[0]


# The keyed permutation (orders longer than SMALL_ORDER): sizes on both sides of the switch,
# primes and powers of two, each checked whole.
special_sizes = [0, 1, 2, 3, 7, SMALL_ORDER, SMALL_ORDER + 1, 1031, 2048, 2049, 4096, 8191, 65537]


@pytest.mark.parametrize("n", special_sizes)
def test_orders_of_special_sizes_are_permutations(n):
    order = epoch_order(n, seed=11, epoch=3, shuffle=True)
    items = list(order)
    assert len(order) == n and sorted(items) == list(range(n))
    assert [order[i] for i in range(n)] == items  # per index, as a worker reads it
    if n:
        assert order[-1] == items[-1] and order[-n] == items[0]
        assert order[1::3] == items[1::3] and order[::-2] == items[::-2]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match=f"outside an order of {n} items"):
            order[bad]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(SMALL_ORDER + 1, 6000), seed=seeds, epoch=epochs)
def test_keyed_orders_are_permutations_and_differ_by_epoch(n, seed, epoch):
    order = list(epoch_order(n, seed=seed, epoch=epoch, shuffle=True))
    assert sorted(order) == list(range(n))
    assert order == list(epoch_order(n, seed=seed, epoch=epoch, shuffle=True))
    assert order != list(epoch_order(n, seed=seed, epoch=epoch + 1, shuffle=True))
    assert order != list(range(n))


def test_keyed_orders_are_well_mixed():
    """The keyed permutation mixes like a shuffle: neighbours in the order are not neighbours
    in the data, and every part of the order draws from every part of the data."""
    n, parts = 4096, 16
    for seed, epoch in [(0, 0), (1, 7), (-3, 2)]:
        order = list(epoch_order(n, seed=seed, epoch=epoch, shuffle=True))
        assert sum(abs(a - b) == 1 for a, b in zip(order, order[1:])) < 10  # ~2 expected
        for start in range(0, n, n // parts):  # a 16 x 16 table, 16 expected in each cell
            cells = Counter(item * parts // n for item in order[start:start + n // parts])
            assert len(cells) == parts and max(cells.values()) < 40


@pytest.mark.parametrize("n", [1_000_000, 100_000_000])
def test_a_workers_share_starts_in_constant_memory(n):
    """A worker's share of the epoch is computed as it is read: its start holds no list."""
    tracemalloc.start()
    try:
        share = partition(n, seed=1, epoch=4, shuffle=True, rank=3, world_size=8, worker=1,
                          num_workers=4)
        first = [item for _, item in zip(range(64), share)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(share) == n // 32 and len(set(first)) == 64 and all(0 <= i < n for i in first)
    assert peak < 64 * 1024
    order = epoch_order(n, seed=1, epoch=4, shuffle=True)
    assert first == [order[p] for p in range(3 + 8, 3 + 8 + 64 * 32, 32)]  # strided ranks, then workers


@settings(max_examples=30, deadline=None)
@given(n=st.integers(SMALL_ORDER + 1, 3000), seed=seeds, epoch=epochs, data=st.data())
def test_resume_on_another_topology_reads_the_rest_exactly_once(n, seed, epoch, data):
    """Blocks of the keyed order: what the first topology consumed, then the rest dealt over
    another number of ranks and workers, read every item exactly once ("drop" only leaves
    out the tail's remainder)."""
    batch = data.draw(st.integers(1, 64), label="batch_size")
    before = data.draw(st.integers(1, 8), label="world_size before")
    steps = data.draw(st.integers(0, n // (batch * before)), label="steps")
    seen = samples_consumed(n, steps, batch_size=batch, world_size=before, policy="drop")
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    world_size = data.draw(st.integers(1, 8), label="world_size after")
    workers = data.draw(st.integers(0, 4), label="num_workers after")
    read = [order[p] for p in range(seen)]
    for rank in range(world_size):
        for worker in range(max(1, workers)):
            read += [order[seen + p] for p in block_positions(
                n - seen, batch_size=batch, rank=rank, world_size=world_size, worker=worker,
                num_workers=workers, policy="drop")]
    assert len(read) == len(set(read))
    assert len(read) >= n - (world_size - 1)


def test_epoch_seed_is_pinned():
    """Golden values: a change here would make old and new processes disagree on the order."""
    assert epoch_seed(0, 0) == 7422961589448188785
    assert epoch_order(10, seed=0, epoch=0, shuffle=True) == [2, 9, 1, 3, 8, 5, 0, 4, 7, 6]
    assert epoch_order(2000, seed=0, epoch=0, shuffle=True)[:8] == [
        108, 411, 531, 798, 1002, 1994, 1027, 50]
    assert 0 <= epoch_seed(-(2**100), 10**9) < 2**64
    assert epoch_seed(0, 1) != epoch_seed(1, 0)


def test_order_agrees_across_processes_with_different_hash_seeds():
    """Fresh interpreters with different ``hash()`` salts compute the same order."""
    code = (
        "from loader.datasets.partition import epoch_order\n"
        "print(list(epoch_order(50, seed=3, epoch=2, shuffle=True)))\n"
        "print(list(epoch_order(5000, seed=3, epoch=2, shuffle=True)))\n"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, cwd=ROOT)
        outputs.add(result.stdout)
    expected = [list(epoch_order(n, seed=3, epoch=2, shuffle=True)) for n in (50, 5000)]
    assert outputs == {"".join(f"{order}\n" for order in expected)}


def test_small_examples():
    order = list(range(7))
    assert [rank_share(order, r, 3) for r in range(3)] == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert [rank_share(order, r, 3, "drop") for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [rank_share([5], r, 4) for r in range(4)] == [[5], [5], [5], [5]]
    assert [rank_share([], r, 4) for r in range(4)] == [[], [], [], []]
    assert worker_share("abcdefg", 1, 3) == ["b", "e"]
    assert worker_share([1, 2, 3], 0, 0) == [1, 2, 3]
    assert rank_length(10, 4, "pad") == 3 and rank_length(10, 4, "drop") == 2


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rank_share([1, 2], 2, 2), r"rank=2 is outside \[0, world_size=2\)"),
        (lambda: rank_share([1, 2], -1, 2), r"rank=-1 is outside"),
        (lambda: rank_share([1, 2], 0, 0), r"world_size=0 must be >= 1"),
        (lambda: rank_share([1], 0, 1, "keep"), r"policy='keep' is not one of"),
        (lambda: worker_share([1], 1, 0), r"worker=1 is outside \[0, max\(1, num_workers\)=1\)"),
        (lambda: worker_share([1], 0, -1), r"num_workers=-1 must be >= 0"),
        (lambda: epoch_order(-1, seed=0, epoch=0, shuffle=True), r"n=-1 must be >= 0"),
        (lambda: epoch_order(3, seed=0, epoch=-1, shuffle=False), r"epoch=-1 must be >= 0"),
        (lambda: epoch_order(3, seed="0", epoch=0, shuffle=True), r"seed='0' is not an int"),
        (lambda: epoch_order(3, seed=0, epoch=1.0, shuffle=True), r"epoch=1.0 is not an int"),
        (lambda: rank_length(3, True), r"world_size=True is not an int"),
        (lambda: shard_assignments(-1, seed=0, epoch=0, shuffle=False, rank=0, world_size=1,
                                   worker=0, num_workers=0), r"num_shards=-1 must be >= 0"),
        (lambda: needs_sample_split(-1, 2), r"num_shards=-1 must be >= 0"),
        (lambda: needs_sample_split(1, 0), r"slots=0 must be >= 1"),
        (lambda: needs_sample_split(1.0, 2), r"num_shards=1.0 is not an int"),
        (lambda: slot_of(0, 0, 0, 0), r"world_size=0 must be >= 1"),
        (lambda: slot_of(2, 2, 0, 0), r"rank=2 is outside \[0, world_size=2\)"),
        (lambda: slot_of(0, 1, 2, 2), r"worker=2 is outside \[0, max\(1, num_workers\)=2\)"),
        (lambda: balanced_shard_ranges([3, -1], seed=0, epoch=0, shuffle=False, rank=0,
                                       world_size=1, worker=0, num_workers=0),
         r"counts\[1\]=-1 must be >= 0"),
        (lambda: balanced_shard_ranges([3], seed=0, epoch=0, shuffle=False, rank=1,
                                       world_size=1, worker=0, num_workers=0), r"rank=1 is outside"),
        (lambda: balanced_shard_ranges([3], seed=0, epoch=0, shuffle=False, rank=0,
                                       world_size=1, worker=0, num_workers=0, policy="keep"),
         r"policy='keep' is not one of"),
        (lambda: rank_length(-1, 2), r"n=-1 must be >= 0"),
        (lambda: rank_length(3, 0), r"world_size=0 must be >= 1"),
        (lambda: slot_of("0", 1, 0, 0), r"rank='0' is not an int"),
        (lambda: block_shape(-1, 2, 1), r"m=-1 must be >= 0"),
        (lambda: block_shape(5, 0, 1), r"batch_size=0 must be >= 1"),
        (lambda: block_shape(5, 2, 0), r"world_size=0 must be >= 1"),
        (lambda: block_shape(5, 2, 1, "keep"), r"policy='keep' is not one of"),
        (lambda: samples_consumed(5, -1, batch_size=2, world_size=1), r"steps=-1 must be >= 0"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- shard mode


@settings(max_examples=200)
@given(num_shards=st.integers(1, 64), world_size=world_sizes, num_workers=worker_counts,
       seed=seeds, epoch=epochs, shuffle=st.booleans(), data=st.data())
def test_shard_samples_are_covered_exactly_once(num_shards, world_size, num_workers, seed, epoch,
                                                shuffle, data):
    counts = data.draw(st.lists(st.integers(0, 40), min_size=num_shards, max_size=num_shards),
                       label="samples per shard")
    workers = max(1, num_workers)
    slots = world_size * workers
    seen = Counter()
    per_slot = {}
    for rank in range(world_size):
        for worker in range(workers):
            got = shard_assignments(num_shards, seed=seed, epoch=epoch, shuffle=shuffle, rank=rank,
                                    world_size=world_size, worker=worker, num_workers=num_workers)
            per_slot[slot_of(rank, world_size, worker, num_workers)[0]] = got
            for a in got:
                assert isinstance(a, ShardAssignment) and 0 <= a.phase < a.stride
                seen.update((a.shard, i) for i in range(counts[a.shard]) if a.keeps(i))

    assert set(per_slot) == set(range(slots))
    everything = {(shard, i) for shard, count in enumerate(counts) for i in range(count)}
    assert set(seen) == everything
    assert all(c == 1 for c in seen.values())

    if needs_sample_split(num_shards, slots):
        assert num_shards < slots
        assert all(len(got) == 1 for got in per_slot.values())  # nobody idle, one shard each
        downloads = Counter(a.shard for got in per_slot.values() for a in got)
        assert all(downloads[a.shard] == a.stride for got in per_slot.values() for a in got)
        assert max(downloads.values()) - min(downloads.values()) <= 1
    else:
        assert all(a.stride == 1 and a.phase == 0 for got in per_slot.values() for a in got)
        lengths = [len(got) for got in per_slot.values()]
        assert max(lengths) - min(lengths) <= 1
        assert sorted(a.shard for got in per_slot.values() for a in got) == list(range(num_shards))


def test_shard_examples():
    def plan(num_shards, world_size, num_workers, **kw):
        return [
            [a[:3] for a in shard_assignments(num_shards, seed=0, epoch=0, shuffle=False, rank=r,
                                              world_size=world_size, worker=w,
                                              num_workers=num_workers, **kw)]
            for r in range(world_size) for w in range(max(1, num_workers))
        ]

    assert plan(5, 2, 1) == [[(0, 1, 0), (2, 1, 0), (4, 1, 0)], [(1, 1, 0), (3, 1, 0)]]
    # 3 shards over 2 ranks x 2 workers = 4 slots: shard 0 is read twice, sample-split.
    assert plan(3, 2, 2) == [[(0, 2, 0)], [(1, 1, 0)], [(2, 1, 0)], [(0, 2, 1)]]
    assert plan(0, 2, 2) == [[], [], [], []]
    assert slot_of(1, 2, 3, 4) == (7, 8)
    assert slot_of(1, 2, 0, 0) == (1, 2)
    assert not needs_sample_split(0, 4) and needs_sample_split(3, 4) and not needs_sample_split(4, 4)
    assert needs_sample_split(1, 2) and not needs_sample_split(1, 1)


def test_the_default_policy_is_pad():
    """Without ``policy=``, ranks get ``ceil(n / W)`` items: nothing is dropped."""
    where = dict(seed=0, epoch=0, shuffle=False, world_size=2, worker=0, num_workers=0)
    assert partition(5, rank=1, **where) == partition(5, rank=1, policy="pad", **where) == [1, 3, 0]
    assert partition(5, rank=1, policy="drop", **where) == [1, 3]
    assert rank_length(5, 2) == 3
    ranges = balanced_shard_ranges([3, 2], rank=1, **where)
    assert ranges == balanced_shard_ranges([3, 2], rank=1, policy="pad", **where)
    assert sum(a.stop - a.start for a in ranges) == 3  # wraps around to sample 0 of shard 0
    assert block_shape(5, 2, 2) == block_shape(5, 2, 2, "pad") == (1, 1) != block_shape(5, 2, 2, "drop")
    assert steps_per_rank(5, 2, 2) == 2 and steps_per_rank(5, 2, 2, "drop") == 1


def test_balanced_ranges_follow_the_epoch_order_and_keep_what_they_say():
    counts = [4, 3, 5, 2, 6]
    where = dict(seed=7, epoch=3, world_size=2, num_workers=2)
    for shuffle in (False, True):
        order = epoch_order(len(counts), seed=7, epoch=3, shuffle=shuffle)
        read = [a for rank in range(2) for worker in range(2)
                for a in balanced_shard_ranges(counts, rank=rank, worker=worker, shuffle=shuffle, **where)]
        assert list(dict.fromkeys(a.shard for a in read)) == order
        for a in read:  # the engine asks keeps()/wanted(), not start/stop
            assert [i for i in range(counts[a.shard]) if a.keeps(i)] == list(range(a.start, a.stop))
            assert a.wanted(counts[a.shard]) == a.stop - a.start
    assert epoch_order(len(counts), seed=7, epoch=3, shuffle=True) != list(range(len(counts)))


def test_sequence_ranges_merge_ascending_runs_of_one_shard():
    # shard 1 first, then shard 0; three ascending runs in shard 0 become one assignment
    out = sequence_ranges([10, 4], [1, 0], [0, 1, 4, 5, 8, 10, 11, 2])
    assert [(a.shard, a.ranges) for a in out] == [
        (1, ((0, 2),)), (0, ((0, 2), (4, 5), (6, 8))), (1, ((2, 3),))]
    assert [i for i in range(10) if out[1].keeps(i)] == [0, 1, 4, 6, 7]
    # every sample inside the ranges is kept: stride 1, phase 0, the span of the ranges
    assert out[1] == ShardAssignment(0, 1, 0, 0, 8, ((0, 2), (4, 5), (6, 8)))
    # the last two runs merge too
    assert sequence_ranges([10], [0], [0, 1, 5, 6]) == [ShardAssignment(0, 1, 0, 0, 7, ((0, 2), (5, 7)))]
    with pytest.raises(ValueError, match="position 14 is outside the 14 samples of these shards"):
        sequence_ranges([10, 4], [1, 0], [13, 14])


def test_shard_order_follows_the_epoch():
    def first(epoch):
        return [shard_assignments(100, seed=1, epoch=epoch, shuffle=True, rank=0, world_size=1,
                                  worker=0, num_workers=0)]

    assert first(0) != first(1)
    assert first(0) == first(0)


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 300), min_size=0, max_size=40),
    world_size=st.integers(1, 16),
    num_workers=st.integers(0, 8),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
    policy=st.sampled_from(["pad", "drop"]),
)
def test_balanced_shard_ranges_are_exactly_once_and_equal_per_rank(
    counts, world_size, num_workers, seed, epoch, policy
):
    from collections import Counter

    from loader.datasets.partition import balanced_shard_ranges, rank_length

    total = sum(counts)
    seen: Counter = Counter()
    for rank in range(world_size):
        per_rank = 0
        for worker in range(max(1, num_workers)):
            ranges = balanced_shard_ranges(counts, seed=seed, epoch=epoch, shuffle=True, rank=rank,
                                           world_size=world_size, worker=worker,
                                           num_workers=num_workers, policy=policy)
            again = balanced_shard_ranges(counts, seed=seed, epoch=epoch, shuffle=True, rank=rank,
                                          world_size=world_size, worker=worker,
                                          num_workers=num_workers, policy=policy)
            assert ranges == again, "deterministic"
            for a in ranges:
                assert 0 <= a.start < a.stop <= counts[a.shard]
                seen.update((a.shard, i) for i in range(a.start, a.stop))
                per_rank += a.stop - a.start
        assert per_rank == rank_length(total, world_size, policy), "equal length per rank"
    every = {(shard, i) for shard, n in enumerate(counts) for i in range(n)}
    if policy == "pad":
        assert set(seen) == every, "every sample at least once"
        assert sum(seen.values()) - total == (-total) % world_size if total else True
    else:
        assert set(seen) <= every and max(seen.values(), default=1) == 1, "no sample twice"
        assert len(seen) == world_size * (total // world_size)
