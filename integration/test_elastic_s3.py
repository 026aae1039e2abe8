"""Elastic resume on the real server: an epoch stopped on 3 ranks x 2 DataLoader workers after 5
steps continues on 2 ranks x 3 workers, or on 1 rank in the main process, and the two parts are
the data set exactly once (up to the pad repeats at the epoch's end, at most ranks - 1).

Ranks are simulated with explicit ``rank=``/``world_size=`` in this process (one DataLoader per
rank, workers started as the platform starts them); shard mode reads the ``index.json`` that
``loader shard`` wrote, with no ``sample_counts=`` given.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Split
from loader.tools.shard import PackOptions, pack

from datasets import jpeg_dataset

BATCH = 8
SAMPLES = 251  # 5 steps x 8 x 3 ranks = 120 seen; the 131 left end with a short, padded step
SEED, EPOCH = 13, 4


@pytest.fixture(scope="module")
def data(s3_server):
    bucket = s3_server.new_bucket("elastic")
    objects = jpeg_dataset(s3_server.minio, bucket, "train/", SAMPLES, seed=8, with_cls=True)
    pack(f"s3://{bucket}/train/", f"s3://{bucket}/shards/", PackOptions(target_size=60_000),
         config=s3_server.config)
    return bucket, {key.rsplit(".", 1)[0] for key in objects}


def make(s3_server, bucket, mode, **topology):
    options = {"shuffle": True, "seed": SEED, "batch_size": BATCH, "config": s3_server.config,
               "transform": lambda sample: sample["__key__"], **topology}
    if mode == "objects":
        return AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", **options)
    return AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/", **options)


def run(s3_server, bucket, mode, world_size, num_workers, *, steps=None, seen=None, lanes=None):
    """Every rank's batches (keys), the samples_seen a checkpoint after ``steps`` would save, and
    the bytes all ranks fetched (``lanes``: the rank x worker slots whose lanes deal the epoch)."""
    out, saved, fetched = [], None, 0
    for rank in range(world_size):
        ds = make(s3_server, bucket, mode, split=Split(rank=rank, world_size=world_size))
        if seen is not None or lanes is not None:
            ds.resume(epoch=EPOCH, samples_seen=seen or 0, lanes=lanes)
        ds.set_epoch(EPOCH)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=list,
                            timeout=120 if num_workers else 0)
        out.append(list(itertools.islice(loader, steps)))
        fetched += ds.stats()["bytes"]
        if steps is not None:
            saved = ds.samples_seen(steps)
    return out, saved, fetched


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_stop_on_3x2_resume_on_2x3_and_on_1x0_reads_each_sample_once(s3_server, data, mode):
    bucket, everything = data
    if mode == "shards":  # loader shard names samples relative to the source prefix
        everything = {key.removeprefix("train/") for key in everything}
    # one rank, in order: the epoch's order, as the 3 x 2 run below deals it (shuffled shards: lanes)
    (order,), _, epoch_bytes = run(s3_server, bucket, mode, 1, 0, lanes=3 * 2)
    order = [key for batch in order for key in batch]
    assert sorted(order) == sorted(everything)

    head, seen, _ = run(s3_server, bucket, mode, 3, 2, steps=5)
    assert seen == 5 * BATCH * 3
    for step, rank in itertools.product(range(5), range(3)):  # block s * W + r of the order
        block = (step * 3 + rank) * BATCH
        assert head[rank][step] == order[block:block + BATCH], (step, rank)
    first = [key for batches in head for batch in batches for key in batch]

    for world_size, num_workers in ((2, 3), (1, 0)):
        tail, _, tail_bytes = run(s3_server, bucket, mode, world_size, num_workers, seen=seen, lanes=3 * 2)
        # 131 of 251 samples left: ranged GETs from the index's offsets fetch about their share
        # (streaming each shard a rank touches from its start fetched 1.5x the epoch here).
        assert tail_bytes < 0.75 * epoch_bytes, (world_size, tail_bytes, epoch_bytes)
        assert len({len(batches) for batches in tail}) == 1, "every rank takes the same steps"
        for rank, batches in enumerate(tail):
            for step, batch in enumerate(batches[:-1]):
                block = seen + (step * world_size + rank) * BATCH
                assert batch == order[block:block + BATCH], (world_size, step, rank)
        both = Counter(first + [key for batches in tail for batch in batches for key in batch])
        assert set(both) == everything, "a sample was lost across the resume"
        repeats = sum(both.values()) - len(everything)
        assert repeats <= world_size - 1, f"{repeats} repeats on {world_size} rank(s)"
        if world_size == 2:
            assert repeats == 1  # 131 left on 2 ranks: 8 full steps of 16, then 2 + 1 padded
