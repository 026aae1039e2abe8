"""Shuffled reading of label-sorted data against the real server: tar shards packed in class
order (with their index) and Hub-style Parquet files sorted by label, read by 2 DataLoader
workers with batch_size= 8 and 32 and without it, give batches as mixed as a permutation's
(>= 0.9x its distinct labels, <= 1 % single-label batches); stopped mid-epoch and resumed on
another number of workers, every sample comes once; unshuffled, the stored order."""

from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from bench.labelmix import label_mix
from loader import AsyncS3Dataset

CLASSES, PER_CLASS, PER_SHARD = 10, 120, 20
LABELS = [i // PER_CLASS for i in range(CLASSES * PER_CLASS)]


def put(minio, bucket: str, key: str, body: bytes) -> str:
    return minio.put_object(bucket, key, io.BytesIO(body), len(body)).etag


@pytest.fixture(scope="module")
def sorted_set(s3_server):
    minio, bucket = s3_server.minio, s3_server.new_bucket("sorted")
    entries = []
    for number, start in enumerate(range(0, len(LABELS), PER_SHARD)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(start, start + PER_SHARD):
                for ext, body in (("cls", str(LABELS[i]).encode()), ("bin", bytes([i % 256]) * 300)):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        body = out.getvalue()
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            offsets = [member.offset for member in tar.getmembers()][::2]
        key = f"tar/{number:04d}.tar"
        etag = put(minio, bucket, key, body)
        entries.append({"url": f"s3://{bucket}/{key}", "samples": PER_SHARD, "offsets": offsets,
                        "etag": etag, "size": len(body)})
    put(minio, bucket, "tar/index.json", json.dumps({"version": 1, "shards": entries}).encode())
    half = len(LABELS) // 2
    for number in range(2):  # as a Hub push writes them: row groups of 100 rows, sorted by label
        rows = range(number * half, (number + 1) * half)
        table = pa.table({"image": [{"bytes": bytes([i % 256]) * 300, "path": f"{i}.jpg"} for i in rows],
                          "label": pa.array([LABELS[i] for i in rows], pa.int64())})
        out = io.BytesIO()
        pq.write_table(table, out, row_group_size=100)
        put(minio, bucket, f"pq/train-{number:05d}-of-00002.parquet", out.getvalue())
    return bucket


def dataset(s3_server, bucket: str, mode: str, **options):
    options = {"shuffle": True, "seed": 11, "config": s3_server.config, **options}
    if mode == "shards":
        return AsyncS3Dataset.from_shards(f"s3://{bucket}/tar/", **options)
    return AsyncS3Dataset.from_parquet(f"s3://{bucket}/pq/", **options)


def label_of(sample) -> int:
    return int(sample["cls"]) if "cls" in sample else int(sample["label"])


@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_label_sorted_data_gives_mixed_batches(s3_server, sorted_set, mode, dealt):
    for batch in (8, 32):
        ds = dataset(s3_server, sorted_set, mode, **({"batch_size": batch} if dealt else {}))
        ds.set_epoch(1)
        batches = list(DataLoader(ds, batch_size=batch, num_workers=2,
                                  collate_fn=lambda samples: [label_of(s) for s in samples]))
        assert sorted(label for b in batches for label in b) == LABELS
        found = label_mix(batches, [PER_CLASS] * CLASSES)
        assert found.ratio >= 0.9 and found.single_fraction <= 0.01, (batch, found)


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_stopped_on_two_workers_resumed_on_three_reads_the_rest_once(s3_server, sorted_set, mode):
    batch = 8

    def keys(samples):
        return [s["__key__"] for s in samples]

    whole_ds = dataset(s3_server, sorted_set, mode, batch_size=batch)
    whole_ds.set_epoch(2)
    whole = [k for b in DataLoader(whole_ds, batch_size=batch, collate_fn=keys) for k in b]
    first = dataset(s3_server, sorted_set, mode, batch_size=batch)
    first.set_epoch(2)
    before: list[str] = []
    for step, b in enumerate(DataLoader(first, batch_size=batch, num_workers=2, collate_fn=keys)):
        before += b
        if step == 20:
            break
    seen = first.samples_seen(21)
    second = dataset(s3_server, sorted_set, mode, batch_size=batch)
    second.resume(epoch=2, samples_seen=seen)
    after = [k for b in DataLoader(second, batch_size=batch, num_workers=3, collate_fn=keys) for k in b]
    assert seen == len(before) == 21 * batch
    assert sorted(before) == sorted(whole[:seen])  # a resume skips a slice of the epoch's order
    assert sorted(before + after) == sorted(whole) and len(set(whole)) == len(LABELS)


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_unshuffled_is_the_stored_order(s3_server, sorted_set, mode):
    ds = dataset(s3_server, sorted_set, mode, shuffle=False)
    ds.set_epoch(0)
    assert [label_of(s) for s in ds] == LABELS
