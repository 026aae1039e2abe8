"""AsyncS3MapDataset end to end on a real S3 server: samplers across ranks and workers, errors."""

from __future__ import annotations

import threading
import traceback

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from loader import Limits, NoSuchKeyError
from loader.datasets.mapped import THREAD_NAME, AsyncS3MapDataset

from datasets import jpeg_dataset, sha256

N = 301  # odd: DistributedSampler pads one rank's share with one repeat


@pytest.fixture(scope="module")
def jpegs(s3_server):
    """301 synthetic JPEGs under train/ in a fresh bucket: (bucket, {key: sha256})."""
    bucket = s3_server.new_bucket()
    return bucket, jpeg_dataset(s3_server.minio, bucket, "train/", N, seed=5)


def digest(sample):
    """Runs in the workers (module level, so spawn can pickle it): (key, sha256 of the bytes)."""
    return sample["__url__"].split("/", 3)[3], sha256(sample["jpg"])


_EARLIER: set[int | None] = set()


@pytest.fixture(autouse=True)
def _earlier_threads():
    """Client threads that other tests in this process left to the garbage collector (a
    dataset held by a saved traceback) are not this test's."""
    _EARLIER.clear()
    _EARLIER.update(t.ident for t in threading.enumerate() if t.name.startswith(THREAD_NAME))


def our_threads():
    """This test's client threads still running."""
    return [t for t in threading.enumerate()
            if t.name.startswith(THREAD_NAME) and t.ident not in _EARLIER]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_distributed_sampler_ranks_cover_the_data_set(s3_server, jpegs, context):
    bucket, expected = jpegs
    dataset = AsyncS3MapDataset.from_prefix(f"s3://{bucket}/train/", transform=digest,
                                            limits=Limits(concurrency=32), config=s3_server.config)
    assert len(dataset) == N  # listed here, once; the workers get the key list
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=7)
                for rank in (0, 1)]
    # Persistent workers: each keeps its client (loop thread, connection pool) across epochs.
    loaders = [DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2,
                          multiprocessing_context=context, persistent_workers=True,
                          collate_fn=list, timeout=120) for sampler in samplers]
    orders = []
    for epoch in (0, 1):
        shares = []
        for sampler, loader in zip(samplers, loaders):
            sampler.set_epoch(epoch)
            shares.append([item for batch in loader for item in batch])
        assert len(shares[0]) == len(shares[1]) == (N + 1) // 2, "equal counts per rank"
        got = shares[0] + shares[1]
        for key, value in got:
            assert value == expected[key], f"{key}: content differs from what was uploaded"
        assert {key for key, _ in got} == set(expected), "the union of both ranks is the data set"
        assert len(got) - len({key for key, _ in got}) == 1, "only the sampler's padding repeats"
        orders.append([key for key, _ in shares[0]])
    assert orders[0] != orders[1], "set_epoch reshuffles"
    del loaders  # shuts the persistent workers down
    assert not our_threads(), "the parent only listed; each worker opened and dropped its own client"


def test_in_process_batches_then_forked_workers(s3_server, jpegs):
    """num_workers=0 reads keep a client alive in the parent; forked workers must not touch it."""
    bucket, expected = jpegs
    keys = sorted(expected)
    dataset = AsyncS3MapDataset.from_keys(bucket, keys, transform=digest, config=s3_server.config)
    try:
        for start in range(0, 96, 32):
            batch = dataset.__getitems__(list(range(start, start + 32)))
            assert batch == [(key, expected[key]) for key in keys[start:start + 32]]
        assert len(our_threads()) == 1
        loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2,
                            multiprocessing_context="fork", collate_fn=list, timeout=120)
        got = [item for batch in loader for item in batch]
        assert sorted(got) == sorted(expected.items())
        assert dataset[7] == (keys[7], expected[keys[7]]), "the parent's client still works"
    finally:
        dataset.close()
    assert not our_threads()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_missing_key_is_named(s3_server, jpegs, num_workers):
    bucket, expected = jpegs
    keys = sorted(expected)[:40] + ["train/does-not-exist.jpg"]
    dataset = AsyncS3MapDataset.from_keys(bucket, keys, config=s3_server.config)
    try:
        if num_workers == 0:
            assert dataset[3]["__key__"] == "train/000003"
            with pytest.raises(NoSuchKeyError, match=r"does-not-exist\.jpg") as info:
                dataset.__getitems__(list(range(41)))
            assert info.value.key == "train/does-not-exist.jpg" and info.value.bucket == bucket
            assert len(dataset.__getitems__(list(range(40)))) == 40, "the dataset keeps working"
        else:
            loader = DataLoader(dataset, batch_size=32, num_workers=2, multiprocessing_context="fork",
                                collate_fn=list, timeout=120)
            with pytest.raises(NoSuchKeyError, match=r"does-not-exist\.jpg") as raised:
                list(loader)
            # the traceback holds the DataLoader's iterator in a reference cycle: left to the
            # garbage collector, its queues go first and torch waits 5 s for each worker
            traceback.clear_frames(raised.tb)
    finally:
        dataset.close()
    assert not our_threads()
