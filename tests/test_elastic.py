"""Elastic resume: the epoch's order dealt in blocks of ``batch_size``, and resuming it on another
number of ranks and DataLoader workers.

The pure part is property-tested against a model of the DataLoader's round robin over workers
(checked once against the real DataLoader below); the dataset part runs on an in-memory store.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader.datasets.partition import (
    block_positions,
    block_shape,
    samples_consumed,
    sequence_ranges,
    steps_per_rank,
)

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
