"""Shuffled reading of label-sorted data against the real server: tar shards written in class
order by webdataset's ``ShardWriter`` (indexed by ``loader index``) and a Parquet file written by
Hugging Face ``datasets`` (an ``Image`` and a ``ClassLabel``, rows sorted by label), read with
0 and 2 DataLoader workers, with ``batch_size=`` 8 and 32 and without it, give batches as mixed
as a permutation's (>= 0.9x its distinct labels, <= 1 % single-label batches: counts, not time);
stopped mid-epoch on 2 workers and resumed on 3 from what the main process saved with
``loader.checkpoint``, every sample comes once; unshuffled, the stored order; a mix of the two,
the same."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from bench.labelmix import label_mix
from loader import AsyncS3Dataset, Reading

from s3servers import S3_VARS

CLASSES, PER_CLASS, PER_SHARD = 10, 60, 20
BATCH = 8  # what the stopped and resumed runs read in
LABELS = [i // PER_CLASS for i in range(CLASSES * PER_CLASS)]

# Written in a process of its own: this folder's ``datasets`` module hides Hugging Face's here.
HF_WRITER = textwrap.dedent("""
    import io, sys
    import datasets
    from PIL import Image

    def png(i):
        out = io.BytesIO()
        Image.new("L", (2, 2), i % 256).save(out, "PNG")
        return out.getvalue()

    labels = [int(x) for x in sys.argv[2].split(",")]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[f"c{i}" for i in range(10)])})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": png(i), "path": f"{i}.png"} for i in range(len(labels))],
                                     "label": labels}, features=features)
    ds.to_parquet(sys.argv[1])
""")


@pytest.fixture(scope="module")
def sorted_set(s3_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sorted")
    bucket = s3_server.new_bucket("sorted")
    with wds.ShardWriter(str(tmp / "train-%05d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i, label in enumerate(LABELS):
            sink.write({"__key__": f"s{i:05d}", "cls": str(label), "bin": bytes([i % 256]) * 300})
    for path in sorted(tmp.glob("train-*.tar")):
        s3_server.minio.fput_object(bucket, f"tar/{path.name}", str(path))
    clean = {k: v for k, v in os.environ.items() if k not in S3_VARS and k != "PYTHONPATH"}
    index = subprocess.run([sys.executable, "-m", "loader", "index", f"s3://{bucket}/tar/", "--no-progress"],
                           env={**clean, **s3_server.env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                           capture_output=True, text=True, timeout=300)
    assert index.returncode == 0, index.stderr
    parquet = tmp / "train-00000-of-00001.parquet"
    written = subprocess.run([sys.executable, "-c", HF_WRITER, str(parquet), ",".join(map(str, LABELS))],
                             cwd=tmp, env=clean, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    s3_server.minio.fput_object(bucket, f"pq/{parquet.name}", str(parquet))
    return bucket


def dataset(s3_server, bucket: str, mode: str, **options):
    options = {"shuffle": True, "seed": 11, "config": s3_server.config, **options}
    if mode == "shards":
        return AsyncS3Dataset.from_shards(f"s3://{bucket}/tar/", **options)
    return AsyncS3Dataset.from_parquet(f"s3://{bucket}/pq/", columns=["image", "label"], **options)


def label_of(sample) -> int:
    return int(sample["cls"]) if "cls" in sample else int(sample["label"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_label_sorted_data_gives_mixed_batches(s3_server, sorted_set, mode, dealt, workers):
    for batch in (8, 32):
        ds = dataset(s3_server, sorted_set, mode, **({"batch_size": batch} if dealt else {}))
        ds.set_epoch(1)
        batches = list(DataLoader(ds, batch_size=batch, num_workers=workers,
                                  collate_fn=lambda samples: [label_of(s) for s in samples]))
        assert sorted(label for b in batches for label in b) == LABELS
        found = label_mix(batches, [PER_CLASS] * CLASSES)
        assert found.ratio >= 0.9 and found.single_fraction <= 0.01, (batch, found)


def through_a_checkpoint(s3_server, bucket: str, ds: AsyncS3Dataset, seen: int) -> dict:
    """What a training script saves with its model, taken in the main process (whose
    DataLoader's 2 workers did the reading), saved and loaded with ``loader.checkpoint``: the
    state must name the lanes of the run that started the epoch."""
    from loader import checkpoint

    uri = f"s3://{bucket}/ckpt/{ds.source.kind}.pt"
    checkpoint.save({"data": ds.state_dict(), "seen": seen}, uri, config=s3_server.config)
    state = checkpoint.load(uri, config=s3_server.config)
    assert state["data"]["lanes"] == 2, state["data"]
    return state


def stopped_and_resumed(s3_server, bucket: str, build: Callable[[], Any], stop_at: int) -> list[tuple[str, str]]:
    """Epoch 2 of ``build()`` (a dataset with ``batch_size=BATCH``) read by 2 workers, stopped
    after batch ``stop_at``, saved and loaded through a checkpoint, resumed on 3 workers: the
    samples before the stop are a slice of the epoch's order and, with the rest, the whole epoch
    once (a sample lost or read twice fails). Returns the epoch's ``(source, key)`` in order."""

    def keys(samples):
        return [(s.get("__source__", ""), s["__key__"]) for s in samples]

    whole_ds = build()
    whole_ds.resume(epoch=2, samples_seen=0, lanes=2)  # the order of the 2-worker run, read by one
    whole = [k for b in DataLoader(whole_ds, batch_size=BATCH, collate_fn=keys) for k in b]
    first = build()
    first.set_epoch(2)
    before: list[tuple[str, str]] = []
    for step, b in enumerate(DataLoader(first, batch_size=BATCH, num_workers=2, collate_fn=keys)):
        before += b
        if step == stop_at:
            break
    seen = first.samples_seen(stop_at + 1)
    state = through_a_checkpoint(s3_server, bucket, first, seen)
    second = build()
    second.resume(epoch=state["data"]["epoch"], samples_seen=state["seen"], lanes=state["data"]["lanes"])
    after = [k for b in DataLoader(second, batch_size=BATCH, num_workers=3, collate_fn=keys) for k in b]
    assert seen == len(before) == (stop_at + 1) * BATCH
    assert sorted(before) == sorted(whole[:seen])  # a resume skips a slice of the epoch's order
    assert sorted(before + after) == sorted(whole)
    return whole


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_stopped_on_two_workers_resumed_on_three_reads_the_rest_once(s3_server, sorted_set, mode):
    whole = stopped_and_resumed(s3_server, sorted_set,
                                lambda: dataset(s3_server, sorted_set, mode, batch_size=BATCH), stop_at=20)
    assert len(set(whole)) == len(whole) == len(LABELS)


@pytest.mark.parametrize("mode", ["shards", "parquet"])
def test_unshuffled_is_the_stored_order(s3_server, sorted_set, mode):
    for options in ({}, {"batch_size": 8}):
        ds = dataset(s3_server, sorted_set, mode, shuffle=False, **options)
        ds.set_epoch(0)
        assert [label_of(s) for s in ds] == LABELS
    ds = dataset(s3_server, sorted_set, mode, shuffle=False, batch_size=8)  # blocks dealt to 2 workers
    batches = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda samples: [label_of(s) for s in samples])
    assert [label for b in batches for label in b] == LABELS


def test_unshuffled_parquet_of_several_units_a_file_is_the_stored_order_file_by_file(s3_server):
    """Two files of 3 row groups of ~0.5 MB, read in units of at most 1 MiB (2 a file, read side
    by side): rows come file by file, each in its stored order, with and without blocks."""
    bucket = s3_server.new_bucket("units")
    row = 60_000
    for number in range(2):
        table = pa.table({"image": [{"bytes": os.urandom(row), "path": f"{i}.bin"} for i in range(24)],
                          "label": pa.array(range(number * 24, (number + 1) * 24), pa.int64())})
        out = io.BytesIO()
        pq.write_table(table, out, row_group_size=8, compression="none")
        s3_server.minio.put_object(bucket, f"pq/part-{number}.parquet", io.BytesIO(out.getvalue()),
                                   len(out.getvalue()))
    for options in ({}, {"batch_size": 8}):
        ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/pq/", columns=["image", "label"],
                                         shuffle=False, config=s3_server.config,
                                         reading=Reading(part_size=1 << 20), **options)
        assert ds.source.size() == 4, "two units a file"
        assert [int(s["label"]) for s in ds] == list(range(48)), options


def mixed(s3_server, bucket: str, **options):
    from loader import mix

    return mix({"tar": dataset(s3_server, bucket, "shards"), "pq": dataset(s3_server, bucket, "parquet")},
               seed=4, config=s3_server.config, **options)


@pytest.mark.parametrize("dealt", [True, False], ids=["batch_size", "no-batch_size"])
def test_a_mix_of_label_sorted_shards_and_parquet_gives_mixed_batches(s3_server, sorted_set, dealt):
    for batch in (8, 32):
        ds = mixed(s3_server, sorted_set, **({"batch_size": batch} if dealt else {}))
        ds.set_epoch(1)
        batches = list(DataLoader(ds, batch_size=batch, num_workers=2,
                                  collate_fn=lambda samples: [(s["__source__"], s["__key__"], label_of(s))
                                                              for s in samples]))
        got = [sample for b in batches for sample in b]
        assert len(got) == len(set(got)) == 2 * len(LABELS), "each sample of each source once"
        found = label_mix([[label for *_, label in b] for b in batches], [2 * PER_CLASS] * CLASSES)
        assert found.ratio >= 0.9 and found.single_fraction <= 0.01, (batch, found)


def test_a_mix_stopped_on_two_workers_resumed_on_three_reads_the_rest_once(s3_server, sorted_set):
    whole = stopped_and_resumed(s3_server, sorted_set,
                                lambda: mixed(s3_server, sorted_set, batch_size=BATCH), stop_at=30)
    assert len(set(whole)) == len(whole) == 2 * len(LABELS)
