"""Parquet data sets against the real server: row groups split exactly across 3 ranks x 1
spawned DataLoader worker and resumed on 2 ranks x 2; Parquet mixed with objects and shards;
a file written by DuckDB read as the same file written by pyarrow; images decoded from a Hub-style
image column; and the bad inputs (a missing column, a corrupt or truncated footer, a file with
zero rows, a file overwritten after its footer was read)."""

from __future__ import annotations

import collections
import dataclasses
import io
from pathlib import Path

import duckdb
import parquet_worker
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_mix_s3 import global_order
from test_mix_s3 import launch as mix_launch

from loader import (
    AsyncS3Dataset,
    Cache,
    ConfigError,
    EmptyDatasetError,
    Limits,
    ObjectChangedError,
    ParquetFormatError,
    Reading,
    Store,
    decode_sample,
)

from datasets import jpeg_dataset
from shardsets import upload_shards

ROWS = (40, 0, 33, 19)  # rows of the pyarrow-written files; the second holds none


def jpeg(number: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (12 + number % 5, 10), (number * 7 % 256, 40, 90)).save(out, format="JPEG")
    return out.getvalue()


def table(rows: int, file: int) -> pa.Table:
    return pa.table({
        "image": [{"bytes": jpeg(file * 100 + i), "path": f"{file}-{i}.jpg"} for i in range(rows)],
        "label": pa.array([(file + i) % 7 for i in range(rows)], pa.int64()),
        "tag": pa.array([f"t{i % 3}" for i in range(rows)]).dictionary_encode(),
        "tokens": [list(range(i % 4)) for i in range(rows)],
    })


def put(minio, bucket: str, key: str, body: bytes) -> None:
    minio.put_object(bucket, key, io.BytesIO(body), len(body))


def arrow_bytes(data: pa.Table, **options) -> bytes:
    out = io.BytesIO()
    pq.write_table(data, out, **options)
    return out.getvalue()


def duckdb_bytes(data: pa.Table, path: Path) -> bytes:
    connection = duckdb.connect()
    connection.register("rows", data)
    connection.execute(f"COPY (SELECT * FROM rows) TO '{path}' (FORMAT parquet, ROW_GROUP_SIZE 2048)")
    connection.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def spec(s3_server, tmp_path_factory):
    minio = s3_server.minio
    bucket = s3_server.new_bucket("parquet")
    for number, rows in enumerate(ROWS):
        put(minio, bucket, f"pq/part-{number}.parquet", arrow_bytes(table(rows, number), row_group_size=6))
    many = table(5000, 9)
    put(minio, bucket, "arrow/rows.parquet", arrow_bytes(many, row_group_size=2048))
    put(minio, bucket, "duck/rows.parquet", duckdb_bytes(many, tmp_path_factory.mktemp("duck") / "rows.parquet"))
    jpeg_dataset(minio, bucket, "web/", 30, seed=3)
    _, counts = upload_shards(minio, bucket, "shards/s-", [7, 7, 7], payload=100)
    return {"bucket": bucket, "parquet": f"s3://{bucket}/pq/", "web": f"s3://{bucket}/web/",
            "shards": f"s3://{bucket}/shards/", "counts": counts, "samples": 48, "mix": False}


def launch(spec, env, out: Path, world: int, workers: int, steps=None, resume=None) -> list[dict]:
    return mix_launch(spec, env, out, world, workers, steps=steps, resume=resume, worker=parquet_worker)


def single_process_order(spec, config) -> list[tuple[str, str]]:
    whole = parquet_worker.build(spec, config)
    whole.set_epoch(parquet_worker.EPOCH)
    if spec.get("lanes"):  # the order of a run of that many rank x worker slots, read by one
        whole.resume(epoch=parquet_worker.EPOCH, samples_seen=0, lanes=spec["lanes"])
    return [(s.get("__source__", "rows"), s["__key__"]) for s in whole]


def test_rows_split_on_three_ranks_then_resumed_on_two(spec, s3_server, s3_env, tmp_path):
    spec = dict(spec, lanes=3)  # a shuffled epoch is dealt to the lanes of the 3 x 1 run that starts it
    expected = single_process_order(spec, s3_server.config)
    assert sorted(key for _, key in expected) == sorted(f"pq/part-{f}/{i}" for f, n in enumerate(ROWS)
                                                        for i in range(n))
    # 3 ranks x 1 worker, resumed on 2 ranks x 2: the topology changes in both counts, with 12
    # processes to start (each spawned one imports torch again) where 3 x 2 then 2 x 3 took 17
    head = launch(spec, s3_server.env, tmp_path / "head", world=3, workers=1, steps=2)
    assert [len(r["batches"]) for r in head] == [2, 2, 2]
    seen = head[0]["seen"]
    assert seen == 2 * 3 * parquet_worker.BATCH
    tail = launch(spec, s3_server.env, tmp_path / "tail", world=2, workers=2, resume=seen)
    lengths = [sum(len(b) for b in r["batches"]) for r in tail]
    assert lengths == [r["length"] for r in tail] and len(set(lengths)) == 1, "equal ranks"
    got = global_order(head) + global_order(tail)
    assert got[:len(expected)] == expected, "the resumed job reads the rest of the single-process order"
    assert len(got) - len(expected) < 2, "at most one padded sample"


def test_parquet_mixed_with_objects_and_shards(spec, s3_server):
    mixed = dict(spec, mix=True)
    got = single_process_order(mixed, s3_server.config)
    assert len(got) == spec["samples"]
    assert collections.Counter(name for name, _ in got) == {"rows": 24, "web": 14, "shards": 10}
    assert len(set(got)) == len(got)
    again = parquet_worker.build(mixed, s3_server.config)
    again.set_epoch(parquet_worker.EPOCH)
    # shuffled Parquet and shards are dealt to lanes: two workers read the one-process run's one
    again.resume(epoch=parquet_worker.EPOCH, samples_seen=0, lanes=1)
    from torch.utils.data import DataLoader

    loader = DataLoader(again, batch_size=parquet_worker.BATCH, num_workers=2, collate_fn=parquet_worker.keys)
    assert [tuple(s) for batch in loader for s in batch] == got


def test_a_duckdb_file_reads_as_the_same_pyarrow_file(spec, s3_server):
    def rows(prefix: str) -> dict[str, dict]:
        ds = AsyncS3Dataset.from_parquet(f"s3://{spec['bucket']}/{prefix}/rows.parquet", config=s3_server.config)
        return {s["__key__"].rsplit("/", 1)[1]: {k: v for k, v in s.items() if not k.startswith("__")} for s in ds}

    arrow, duck = rows("arrow"), rows("duck")
    assert len(arrow) == 5000 and arrow == duck
    assert arrow["7"]["tokens"] == [0, 1, 2] and arrow["7"]["tag"] == "t1"


def test_a_hub_image_column_feeds_decode_sample(spec, s3_server):
    ds = AsyncS3Dataset.from_parquet(spec["parquet"] + "part-{2..3}.parquet", columns=["image", "label"],
                                     config=s3_server.config, transform=decode_sample)
    samples = list(ds)
    assert len(samples) == ROWS[2] + ROWS[3]
    assert all(s["image"].shape[0] == 3 and s["image"].shape[1] == 10 for s in samples)


def test_bad_inputs_name_the_file(spec, s3_server):
    bucket, config, minio = spec["bucket"], s3_server.config, s3_server.minio
    with pytest.raises(ConfigError, match=rf"s3://{bucket}/pq/part-0.parquet has no column 'caption'"):
        AsyncS3Dataset.from_parquet(spec["parquet"], columns=["image", "caption"], config=config).resolve()
    good = arrow_bytes(table(10, 1))
    put(minio, bucket, "bad/corrupt.parquet", good[:-24] + b"\x07" * 20 + good[-4:])
    with pytest.raises(ParquetFormatError, match=rf"s3://{bucket}/bad/corrupt.parquet"):
        AsyncS3Dataset.from_parquet(f"s3://{bucket}/bad/", config=config).resolve()
    put(minio, bucket, "bad/corrupt.parquet", good[: len(good) // 2])
    with pytest.raises(ParquetFormatError, match=rf"s3://{bucket}/bad/corrupt.parquet .*magic"):
        AsyncS3Dataset.from_parquet(f"s3://{bucket}/bad/", config=config).resolve()
    # on_error="skip": the truncated file is left out, the good one beside it read whole
    put(minio, bucket, "bad/good.parquet", good)
    rows = list(AsyncS3Dataset.from_parquet(f"s3://{bucket}/bad/", config=config, on_error="skip"))
    assert [row["__key__"] for row in rows] == [f"bad/good/{i}" for i in range(10)]
    put(minio, bucket, "empty/none.parquet", arrow_bytes(table(0, 0)))
    with pytest.raises(EmptyDatasetError, match="hold no rows"):
        AsyncS3Dataset.from_parquet(f"s3://{bucket}/empty/", config=config).resolve()


@pytest.mark.server_sensitive
def test_a_file_overwritten_after_its_footer_was_read(s3_server):
    """Footers by ranged GET of the tail, row groups by ranged GETs pinned with If-Match: the
    reads and the 412 of an overwritten file, on every server."""
    bucket, minio = s3_server.new_bucket("pqchange"), s3_server.minio
    put(minio, bucket, "changing/rows.parquet", arrow_bytes(table(12, 4), row_group_size=6))
    ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/changing/", config=s3_server.config)
    assert [s["label"] for s in ds] == [(4 + i) % 7 for i in range(12)]
    ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/changing/", config=s3_server.config)
    ds.resolve()
    put(minio, bucket, "changing/rows.parquet", arrow_bytes(table(12, 5), row_group_size=6))
    with pytest.raises(ObjectChangedError, match="changing/rows.parquet was overwritten after its footer was read"):
        list(ds)
    # The advice works as written: this dataset's next epoch fails the same way; a new one reads the new rows.
    ds.set_epoch(1)
    with pytest.raises(ObjectChangedError, match=r"Build the dataset again \(AsyncS3Dataset.from_parquet") as info:
        list(ds)
    assert "next epoch" not in str(info.value)
    again = AsyncS3Dataset.from_parquet(f"s3://{bucket}/changing/", config=s3_server.config)
    assert [s["label"] for s in again] == [(5 + i) % 7 for i in range(12)]


@pytest.mark.server_sensitive
@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_a_row_group_larger_than_the_budget_is_read_streamed(s3_server, store):
    """A 12 MB row group (pages of ~0.5 MB) under a budget that leaves 18 MiB for reads: read
    whole it would need ~20 MB, so its column chunk comes in ranged GETs of part_size (1 MiB)
    as pyarrow decodes it, on every server and both backends; every row as written."""
    bucket, minio = s3_server.new_bucket("pqstream"), s3_server.minio
    blobs = [bytes([i % 256]) * 60_000 for i in range(200)]
    put(minio, bucket, "big/a.parquet", arrow_bytes(pa.table({"blob": blobs, "n": list(range(200))}),
                                                     row_group_size=200, compression="none", use_dictionary=False,
                                                     write_batch_size=8, data_page_size=256 << 10))
    ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/big/", config=s3_server.config, store=store,
                                     limits=Limits(memory=24 << 20), reading=Reading(part_size=1 << 20))
    (plan,) = ds.source.plans()
    assert plan.need > ds.source.read_bytes(), "read whole, it would not fit"
    got = list(ds)
    assert [row["blob"] for row in got] == blobs and [row["n"] for row in got] == list(range(200))
    assert ds.stats()["requests"] >= 12, ds.stats()


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
@pytest.mark.parametrize("read", ["whole", "streamed"])
def test_rows_are_exact_through_injected_faults(s3_server, store, read):
    """Ranged GETs of row groups (read whole, or streamed piece by piece) answered with resets,
    SlowDowns, truncated bodies and stalls: each retried, every row comes once and whole."""
    from loader import RetryPolicy, Store

    from faults import FaultPlan, FaultProxy

    bucket, minio = s3_server.new_bucket("pqfaults"), s3_server.minio
    blobs = [bytes([i % 256]) * 60_000 for i in range(200)]
    put(minio, bucket, "f/a.parquet", arrow_bytes(pa.table({"blob": blobs, "n": list(range(200))}),
                                                   row_group_size=200 if read == "streamed" else 20,
                                                   compression="none", use_dictionary=False,
                                                   write_batch_size=8, data_page_size=256 << 10))
    retry = RetryPolicy(read_timeout=2, connect_timeout=2, base_delay=0.01, max_delay=0.2, max_attempts=12)
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan()) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        options = {"limits": Limits(memory=24 << 20)} if read == "streamed" else {}
        ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/f/", config=config, store=Store(backend=store, retry=retry),
                                         reading=Reading(part_size=1 << 20), **options)
        ds.resolve()  # the footer read before the faults
        proxy.set_plan(FaultPlan(reset=0.1, slowdown=0.1, truncate=0.1, stall=0.03, stall_seconds=3.0, seed=5))
        got = list(ds)
        counts = proxy.counts
    assert sorted(row["n"] for row in got) == list(range(200)), "each row once"
    assert all(row["blob"] == blobs[row["n"]] for row in got), "each row whole"
    assert sum(counts.get(kind, 0) for kind in ("reset", "slowdown", "truncate", "stall")) > 0, counts


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_later_epochs_read_parquet_from_the_disk_cache(s3_server, store, tmp_path):
    """``Store(cache=Cache(...))`` keeps the column chunks a Parquet epoch reads, each range an
    entry validated by the listed ETag: the second epoch sends no GET, and its rows are the
    first's. Counted below the cache (``stats()["requests"]``: requests that reached the server)."""
    bucket, minio = s3_server.new_bucket("pqcache"), s3_server.minio
    for number in range(3):
        put(minio, bucket, f"c/part-{number}.parquet", arrow_bytes(table(20, number), row_group_size=6))
    ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/c/", columns=["label", "tokens"], config=s3_server.config,
                                     store=Store(backend=store, cache=Cache(tmp_path / "cache")))
    first = sorted((s["__key__"], s["label"]) for s in ds)
    assert len(first) == 60 and ds.stats()["requests"] >= 3, ds.stats()
    assert any((tmp_path / "cache").rglob("*")), "the first epoch filled the cache"
    ds.set_epoch(1)
    second = sorted((s["__key__"], s["label"]) for s in ds)
    assert second == first
    assert ds.stats()["requests"] == 0, ds.stats()
    # shuffled (lanes: units cut into a piece per lane, each fetching the unit's chunks): the
    # ranges are the unit's whatever the epoch's order, so a later epoch is served from disk too
    shuffled = AsyncS3Dataset.from_parquet(f"s3://{bucket}/c/", columns=["label", "tokens"], shuffle=True,
                                           config=s3_server.config,
                                           store=Store(backend=store, cache=Cache(tmp_path / "shuffled")))
    orders = []
    for epoch in (0, 1):
        shuffled.set_epoch(epoch)
        orders.append([s["__key__"] for s in shuffled])
    assert sorted(orders[1]) == sorted(orders[0]) == sorted(key for key, _ in first) and orders[0] != orders[1]
    assert shuffled.stats()["requests"] == 0, shuffled.stats()
    if store == "obstore":  # its runtime does not survive fork() after the epochs above: spawn, or this
        return
    # DataLoader workers read what another process cached: the entries are files, shared
    from torch.utils.data import DataLoader

    ds.set_epoch(2)
    third = sorted((s["__key__"], s["label"]) for s in DataLoader(ds, batch_size=None, num_workers=2))
    assert third == first and ds.stats()["workers"] == 2 and ds.stats()["requests"] == 0, ds.stats()


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_parquet_epoch_reuses_its_connections(s3_server, shuffle, store):
    """A Parquet epoch's ranged GETs (the column chunks of 20 row groups in two files, 40 GETs)
    go over kept-alive connections: the proxy in front of the server accepts no more connections
    than the GETs the reader keeps in flight (units in flight x parts each), not one per GET, as
    a shuffled epoch did when it started the GETs of all its open units at once."""
    from loader.formats.shards import DEFAULT_PARTS_INFLIGHT, DEFAULT_SHARDS_INFLIGHT

    from faults import FaultPlan, FaultProxy

    bucket, minio = s3_server.new_bucket("pqconns"), s3_server.minio
    for number in range(2):
        blobs = [bytes([(number + i) % 256]) * 60_000 for i in range(200)]
        put(minio, bucket, f"k/part-{number}.parquet",
            arrow_bytes(pa.table({"blob": blobs, "n": list(range(200))}), row_group_size=20,
                        compression="none", use_dictionary=False))
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan()) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        ds = AsyncS3Dataset.from_parquet(f"s3://{bucket}/k/", config=config, store=Store(backend=store),
                                         reading=Reading(part_size=1 << 20), shuffle=shuffle)
        ds.resolve()
        proxy.reset_counts()
        before = proxy.accepted
        rows = sorted(row["n"] for row in ds)
        requests, connections = proxy.counts["requests"], proxy.accepted - before
        stats = ds.stats()
    assert rows == sorted(list(range(200)) * 2)
    assert requests >= 40, requests
    # a spare few: a client may connect for a GET while another GET's connection is coming back
    # (obstore's pool did, once in a while); one connection per GET made 40. A hedge or a retry
    # runs beside the GETs in flight and may need a connection of its own: on a loaded machine
    # answers are slow enough to be hedged (26 connections for 50 GETs once, 10 of them extra)
    extra = stats["hedged"] + stats["retries"]
    assert connections <= DEFAULT_SHARDS_INFLIGHT * DEFAULT_PARTS_INFLIGHT + 4 + extra, (connections, requests, stats)
