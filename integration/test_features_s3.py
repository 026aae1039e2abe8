"""End to end on the real server, one test per feature the docs show that no other test drives
through a DataLoader: shard lists, ``LOADER_STORE``, ``resume_from_batches``, ``ordered=False``,
``pad_policy="drop"`` across ranks, ``log_stats``, ``cache_dir=`` and ``loader shard --shuffle``."""

from __future__ import annotations

import collections
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Cache, Limits, Split, Store

from datasets import jpeg_dataset, sha256
from shardsets import upload_shards

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # DataLoader's own timeout: a hung worker fails the test instead of hanging it


def key_batch(batch: list[dict]) -> list[str]:
    """A collate function that keeps only the keys (module-level: spawned workers pickle it)."""
    return [sample["__key__"] for sample in batch]


def keys_of(dataset, num_workers: int = 2, batch_size: int = 8) -> list[str]:
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        timeout=TIMEOUT if num_workers else 0,
                        collate_fn=key_batch)
    return [key for batch in loader for key in batch]


@pytest.fixture(scope="module")
def objects(s3_server):
    bucket = s3_server.new_bucket("feat")
    expected = jpeg_dataset(s3_server.minio, bucket, "train/", 120, seed=11)
    return bucket, sorted(key.rsplit(".", 1)[0] for key in expected)


@pytest.fixture(scope="module")
def shards(s3_server):
    bucket = s3_server.new_bucket("feat-shards")
    expected, counts = upload_shards(s3_server.minio, bucket, "shards/train-", [40, 25, 35, 20], payload=500)
    return bucket, expected, counts


def test_a_list_of_shard_uris_reads_exactly_those_shards(s3_server, shards):
    bucket, expected, counts = shards
    chosen = sorted(counts)[1:3]  # two of the four, given as a plain list of URIs
    ds = AsyncS3Dataset.from_shards(chosen, config=s3_server.config, shuffle=True, seed=1)
    got = keys_of(ds)
    wanted = {key for key in expected if key.startswith(("s0001/", "s0002/"))}
    assert len(got) == len(wanted) == sum(counts[uri] for uri in chosen)
    assert set(got) == wanted


def test_loader_store_picks_the_backend(s3_server, s3_env, objects, monkeypatch):
    bucket, stems = objects
    monkeypatch.setenv("LOADER_STORE", "obstore")
    ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/")
    assert ds.options.store.backend == "obstore"
    # obstore's runtime does not survive fork: spawned workers, as the docs advise
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn", timeout=TIMEOUT,
                        collate_fn=key_batch)
    got = [key for batch in loader for key in batch]
    assert sorted(got) == stems
    monkeypatch.setenv("LOADER_STORE", "no-such-backend")
    with pytest.raises(Exception, match="LOADER_STORE|no-such-backend"):
        AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/")


def test_resume_from_batches_reads_the_rest_of_the_epoch(s3_server, objects):
    bucket, stems = objects
    make = lambda: AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config,  # noqa: E731
                                              shuffle=True, seed=4, batch_size=8)
    ds = make()
    ds.set_epoch(2)
    first = []
    loader = DataLoader(ds, batch_size=8, num_workers=2, timeout=TIMEOUT,
                        collate_fn=key_batch)
    for step, batch in enumerate(loader):
        first.extend(batch)
        if step == 4:  # five batches seen, then the job "dies"
            break
    del loader
    resumed = make()
    with pytest.deprecated_call(match="resume_from_batches"):  # the deprecated form this test keeps working
        resumed.resume_from_batches(epoch=2, batches_seen=5, batch_size=8)
    rest = keys_of(resumed)
    assert len(first) == 40
    assert len(first) + len(rest) == len(stems), "no sample twice"
    assert sorted(first + rest) == stems, "the two parts are the epoch exactly once"


def test_ordered_false_still_delivers_each_sample_once(s3_server, objects):
    bucket, stems = objects
    ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config,
                                    limits=Limits(ordered=False, concurrency=16))
    got = keys_of(ds)
    assert sorted(got) == stems


def test_pad_policy_drop_gives_equal_ranks_without_repeats(s3_server, objects):
    bucket, stems = objects  # 120 samples over 7 ranks: 17 each, 1 dropped
    world = 7
    per_rank = []
    for rank in range(world):
        ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config, shuffle=True,
                                        seed=3, split=Split(rank=rank, world_size=world, pad="drop"))
        per_rank.append(keys_of(ds, num_workers=2))
        assert len(ds) == len(per_rank[-1])
    flat = [key for keys in per_rank for key in keys]
    assert {len(keys) for keys in per_rank} == {len(stems) // world}
    assert len(flat) == len(set(flat)) == len(stems) - len(stems) % world
    assert set(flat) <= set(stems)


def test_log_stats_logs_one_line_per_worker_pass(s3_server, objects, caplog):
    bucket, stems = objects
    ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config)
    with caplog.at_level(logging.INFO, logger="loader.stats"):  # the documented switch
        got = keys_of(ds, num_workers=0)
    assert sorted(got) == stems
    lines = [r.getMessage() for r in caplog.records if "samples in" in r.getMessage()]
    assert len(lines) == 1 and f"{len(stems)} samples" in lines[0], lines
    assert "requests" in lines[0] and "p50" in lines[0]


def test_cache_dir_serves_the_second_epoch_from_disk(s3_server, objects, tmp_path):
    bucket, stems = objects
    ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config,
                                    store=Store(cache=Cache(tmp_path / "cache", limit=1 << 30)))
    assert sorted(keys_of(ds, num_workers=0)) == stems
    first = ds.stats()
    assert first["cache_misses"] == len(stems) and first["requests"] == len(stems)
    ds.set_epoch(1)
    assert sorted(keys_of(ds, num_workers=0)) == stems
    second = ds.stats()
    assert second["cache_hits"] == len(stems) and second["requests"] == 0, second


def test_loader_shard_shuffle_mixes_samples_across_shards(s3_server, s3_env):
    bucket = s3_server.new_bucket("feat-pack")
    expected = jpeg_dataset(s3_server.minio, bucket, "src/", 60, seed=8, with_cls=True)

    def pack(dst: str, *extra: str) -> list[list[str]]:
        done = subprocess.run([sys.executable, "-m", "loader", "shard", f"s3://{bucket}/src/",
                               f"s3://{bucket}/{dst}/", "--target-size", "40k", *extra],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr
        ds = AsyncS3Dataset.from_shards(f"s3://{bucket}/{dst}/", shuffle=False)
        by_shard = collections.defaultdict(list)
        for sample in ds:
            assert sha256(sample["jpg"]) == expected[f"src/{sample['__key__']}.jpg"]
            by_shard[sample["__url__"]].append(sample["__key__"])
        return [by_shard[url] for url in sorted(by_shard)]

    plain = pack("plain")
    mixed = pack("mixed", "--shuffle", "--seed", "3")
    again = pack("again", "--shuffle", "--seed", "3")
    flat = [key for shard in mixed for key in shard]
    assert sorted(flat) == sorted(key for shard in plain for key in shard), "the same samples"
    assert [key for shard in plain for key in shard] == sorted(flat), "unshuffled: key order"
    assert flat != sorted(flat), "--shuffle changes the order"
    assert mixed == again, "the same seed packs the same shards"
