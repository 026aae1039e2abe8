"""One listing per job, counted: LIST requests through the proxy for every launch x start method.

Every cell of ``list_once_worker.py`` reads a prefix of its own, so the proxy's log says how
many LIST requests each cell cost the whole job: exactly one listing must have started there,
with fewer requests than two listings need (the parallel range listing may split one listing
into more requests than its pages); one plain process listing such a prefix is held to the same.
Spawned processes import torch again (seconds each on a small machine), so two
launches carry all the cells: ``torchrun`` (workers fork by default) and
``torch.multiprocessing.spawn`` with an explicit rank (workers spawn by default), each with
datasets built before and after ``init_process_group``, workers started every way,
``num_workers=0``, persistent workers, several epochs, shard prefixes, Parquet prefixes and the
map dataset. A Parquet cell's footers are read once per job too (one ranged GET of each file's
tail, counted by its ``Range``), and its ranks still read equal shares.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.parse
from pathlib import Path

import list_once_worker
import pytest
import torch.multiprocessing as mp

from loader import AsyncS3Dataset, ListOptions, Store
from loader.listing.nodeshare import SHARE_DIR_ENV

from datasets import upload_objects
from faults import FaultProxy
from s3servers import free_port

WORLD = 3
HERE = Path(__file__).resolve().parent
FOLDERS, PER_FOLDER = 2, 6  # objects: a folder page, then 2 pages of PAGE keys per folder
SHARDS, PER_SHARD = 3, 4
PARQUET_FILES, FILE_ROWS, GROUP_ROWS = 3, 6, 2  # 9 row groups of 2 rows: 6 rows per rank


def cell(name: str, mode: str, start: str, **extra: object) -> dict:
    return {"name": name, "mode": mode, "start": start, **extra}


# launch -> (what "default" starts workers with there, its cells). Spawned and forkserver workers
# import torch again: one each; forked ones are cheap: two.
LAUNCHES = {
    "torchrun": ("fork", [
        cell("t-objects-fork", "objects", "default", epochs=2),          # the scenario
        cell("t-objects-early", "objects", "default", early=True),
        cell("t-objects-persistent", "objects", "fork", persistent=True, epochs=2),
        cell("t-objects-forkserver", "objects", "forkserver", workers=1),
        cell("t-objects-w0", "objects", "none", workers=0),
        cell("t-shards-fork", "shards", "default"),
        cell("t-parquet-fork", "parquet", "default", epochs=2),
        cell("t-map-fork", "map", "default", early=True),
    ]),
    "mp.spawn": ("spawn", [
        cell("s-objects-spawn", "objects", "default", workers=1),
        cell("s-objects-fork-early", "objects", "fork", early=True, epochs=2),
        cell("s-objects-spawn-persistent", "objects", "spawn", workers=1, persistent=True,
             epochs=2, early=True),
        cell("s-shards-forkserver", "shards", "forkserver", workers=1),
        cell("s-parquet-spawn", "parquet", "default", workers=1, early=True),
        cell("s-map-spawn", "map", "default", workers=1),
    ]),
}


def tar_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def parquet_of(rows: int) -> bytes:
    """A Parquet file of ``rows`` rows in row groups of ``GROUP_ROWS``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"n": list(range(rows)), "blob": [bytes([i]) * 9 for i in range(rows)]}),
                   buffer, row_group_size=GROUP_ROWS)
    return buffer.getvalue()


def cell_objects(name: str, mode: str) -> tuple[dict[str, bytes], set[str]]:
    """What a cell's prefix holds, and the sample keys it must yield."""
    if mode == "parquet":
        items = {f"{name}/part-{f}.parquet": parquet_of(FILE_ROWS) for f in range(PARQUET_FILES)}
        return items, {f"{name}/part-{f}/{i}" for f in range(PARQUET_FILES) for i in range(FILE_ROWS)}
    if mode == "shards":
        items, samples = {}, set()
        for shard in range(SHARDS):
            stems = [f"{name}-{shard}-{i}" for i in range(PER_SHARD)]
            samples.update(stems)
            items[f"{name}/train-{shard:04d}.tar"] = tar_of({f"{stem}.bin": stem.encode() for stem in stems})
        return items, samples
    items = {f"{name}/f{f}/{i:03d}.bin": b"x" for f in range(FOLDERS) for i in range(PER_FOLDER)}
    return items, {key.rsplit(".", 1)[0] for key in items}


def list_requests(proxy: FaultProxy, bucket: str, prefix: str) -> tuple[int, int]:
    """``(LIST requests, listings started)`` under ``prefix``. A listing starts with one request
    that has neither a continuation token nor a ``start-after`` bound; every other request
    (next pages, key ranges split off in parallel) continues a listing already started."""
    quoted = prefix.replace("/", "%2F")
    targets = [target for method, target, _ in proxy.decisions
               if method == "GET" and target.startswith(f"/{bucket}?") and "list-type=2" in target
               and f"prefix={quoted}" in target]
    started = sum(1 for t in targets if "continuation-token=" not in t and "start-after=" not in t)
    return len(targets), started


def one_listing(requests: int, started: int, keys: int) -> bool:
    """Whether LIST requests are one listing's worth of ``keys``: exactly one listing started,
    and fewer requests than two listings need (each needs every key once, PAGE per request),
    however the parallel range listing split it."""
    pages = -(-keys // list_once_worker.PAGE)
    return started == 1 and pages <= requests < 2 * pages


@pytest.fixture(scope="module")
def matrix(s3_server, tmp_path_factory):
    """Run both launches once through one counting proxy; what every cell saw, and the counts."""
    bucket = s3_server.new_bucket("once")
    expected = {}
    for _, cells in LAUNCHES.values():
        for spec in cells:
            items, expected[spec["name"]] = cell_objects(spec["name"], spec["mode"])
            upload_objects(s3_server.minio, bucket, items)
    sizes = {}  # Parquet files' sizes: a GET that ends at a file's last byte reads its footer
    for _, cells in LAUNCHES.values():
        for spec in cells:
            if spec["mode"] == "parquet":
                sizes.update({key: len(data) for key, data in cell_objects(spec["name"], "parquet")[0].items()})
    for mode in ("objects", "shards", "parquet"):  # the yardstick prefixes
        items = cell_objects(f"plain-{mode}", mode)[0]
        sizes.update({key: len(data) for key, data in items.items() if mode == "parquet"})
        upload_objects(s3_server.minio, bucket, items)
    out = tmp_path_factory.mktemp("once")
    share = tmp_path_factory.mktemp("share")  # the job's own: other tests share files meanwhile
    seconds = {}
    with FaultProxy(s3_server.config.endpoint_url, max_lifetime=1800) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        listing = ListOptions(page_size=list_once_worker.PAGE)
        AsyncS3Dataset.from_prefix(f"s3://{bucket}/plain-objects/", config=config, store=Store(listing=listing)).keys()
        AsyncS3Dataset.from_shards(f"s3://{bucket}/plain-shards/", config=config, store=Store(listing=listing)).shards()
        AsyncS3Dataset.from_parquet(f"s3://{bucket}/plain-parquet/", config=config,
                                    store=Store(listing=listing)).resolve()
        env = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint_url, SHARE_DIR_ENV: str(share)}
        for style, (_, cells) in LAUNCHES.items():
            plan = {"cells": cells, "bucket": bucket, "env": env, "out": str(out / style),
                    "init_method": f"tcp://127.0.0.1:{free_port()}"}
            started = time.monotonic()
            launch(style, plan, out)
            seconds[style] = round(time.monotonic() - started, 1)
        counts = {name: list_requests(proxy, bucket, f"{name}/")
                  for cells in LAUNCHES.values() for name in (c["name"] for c in cells[1])}
        plain = {mode: list_requests(proxy, bucket, f"plain-{mode}/") for mode in ("objects", "shards", "parquet")}
        footers = footer_gets(proxy, bucket, sizes)
    print(f"launch seconds: {seconds}; (LIST requests, listings started) per cell: {counts}; "
          f"one process alone: {plain}; footer GETs per prefix: {footers}")
    objects = {mode: len(cell_objects("plain", mode)[0]) for mode in ("objects", "shards", "parquet")}
    return {"out": out, "counts": counts, "plain": plain, "expected": expected, "objects": objects,
            "footers": footers, "share": share.name, "left": {path.name for path in share.iterdir()}}


def footer_gets(proxy: FaultProxy, bucket: str, sizes: dict[str, int]) -> collections.Counter[str]:
    """Ranged GETs of a Parquet file's tail (its footer) per prefix: the GETs of ``sizes``' keys
    whose range ends at the file's last byte (a row group's range ends before the footer)."""
    found: collections.Counter[str] = collections.Counter()
    for (method, target, _), headers in zip(proxy.decisions, proxy.headers):
        path = urllib.parse.unquote(target.split("?", 1)[0])
        key = path[len(bucket) + 2:] if path.startswith(f"/{bucket}/") else None
        if method != "GET" or key not in sizes:
            continue
        ranges = headers.get("range") or [""]
        if ranges[0].endswith(f"-{sizes[key] - 1}"):
            found[key.split("/", 1)[0]] += 1
    return found


def launch(style: str, plan: dict, out: Path) -> None:
    if style == "mp.spawn":
        mp.spawn(list_once_worker.spawned, args=(WORLD, plan), nprocs=WORLD, join=True)
        return
    plan_file = out / f"{style}.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={WORLD}", "--max-restarts=0",
               str(HERE / "list_once_worker.py"), str(plan_file)]
    subprocess.run(command, env=env, check=True, timeout=600)


@pytest.mark.parametrize("style", list(LAUNCHES))
def test_a_job_lists_each_prefix_once_and_every_process_reads_that_listing(matrix, style):
    default, cells = LAUNCHES[style]
    problems = []
    for spec in cells:
        name = spec["name"]
        ranks = [json.loads((matrix["out"] / style / name / f"rank{r}.json").read_text())
                 for r in range(WORLD)]
        kind = spec["mode"] if spec["mode"] in ("shards", "parquet") else "objects"
        alone, (requests, started) = matrix["plain"][kind], matrix["counts"][name]
        assert one_listing(*alone, matrix["objects"][kind]), f"one process alone: {alone}"
        if not one_listing(requests, started, matrix["objects"][kind]):
            problems.append(f"{name}: {requests} LIST requests in {started} listing(s); one "
                            f"process alone made {alone[0]} in one")
        if kind == "parquet":  # one footer GET per file for the whole job, as for one process
            alone_footers, job_footers = matrix["footers"]["plain-parquet"], matrix["footers"][name]
            assert alone_footers == PARQUET_FILES, f"one process alone read {alone_footers} footers"
            if job_footers != PARQUET_FILES:
                problems.append(f"{name}: {job_footers} footer GETs for {PARQUET_FILES} files")
            for epoch in range(spec.get("epochs", 1)):
                shares = [len(rank["epochs"][epoch]) for rank in ranks]
                if shares != [PARQUET_FILES * FILE_ROWS // WORLD] * WORLD:
                    problems.append(f"{name} epoch {epoch}: ranks read {shares} rows, not equal shares")
        snapshots = {snapshot for rank in ranks for snapshot in rank["snapshots"]}
        if len(snapshots) != 1:
            problems.append(f"{name}: processes read different listings {sorted(snapshots)}")
        elif spec["mode"] != "shards" and not next(iter(snapshots)).startswith(f"file:{matrix['share']}:"):
            problems.append(f"{name}: the key list was not the node's shared file: {snapshots}")
        for epoch in range(spec.get("epochs", 1)):
            read = [key for rank in ranks for key in rank["epochs"][epoch]]
            if sorted(read) != sorted(matrix["expected"][name]):
                problems.append(f"{name} epoch {epoch}: {len(read)} samples read, "
                                f"{len(set(read))} distinct, want each of {len(matrix['expected'][name])} once")
        started = {how for rank in ranks for how in rank["started"]}
        expected_start = {"none" if spec.get("workers") == 0 else
                          default if spec["start"] == "default" else spec["start"]}
        if started != expected_start:
            problems.append(f"{name}: workers were {sorted(started)}, not {expected_start}")
    assert not problems, f"{style}: " + "; ".join(problems)


def test_no_shared_file_outlives_the_job(matrix):
    """Every rank and worker has exited: nothing they shared is left in the share directory."""
    assert matrix["left"] == set()


@pytest.mark.server_sensitive
def test_a_single_process_and_its_forked_workers_list_once(s3_server):
    """No group at all: the workers list once between them, later epochs' workers and the
    process itself (``set_epoch``, ``len``) map their file."""
    from torch.utils.data import DataLoader

    bucket = s3_server.new_bucket("once1")
    items, expected = cell_objects("single", "objects")
    upload_objects(s3_server.minio, bucket, items)
    with FaultProxy(s3_server.config.endpoint_url) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        listing = ListOptions(page_size=list_once_worker.PAGE)
        uri = f"s3://{bucket}/single/"
        AsyncS3Dataset.from_prefix(uri, config=config, store=Store(listing=listing)).keys()  # the yardstick
        one, _ = list_requests(proxy, bucket, "single/")
        proxy.reset_counts()
        dataset = AsyncS3Dataset.from_prefix(uri, config=config, store=Store(listing=listing))
        loader = DataLoader(dataset, batch_size=None, num_workers=2, timeout=120)
        epochs = [sorted(sample["__key__"] for sample in loader) for _ in range(2)]
        dataset.set_epoch(2)
        assert len(dataset) == len(expected) and epochs == [sorted(expected)] * 2
        requests, started = list_requests(proxy, bucket, "single/")
        assert one_listing(requests, started, len(items)) and one > 1, "one listing for everyone"


def test_a_dataset_never_read_does_not_hold_up_another_datasets_forked_workers(s3_server, caplog):
    """Datasets over a dead endpoint (a closed port) and over one answering every request with
    an error, built and never read, are not listed when a DataLoader over another dataset
    forks its workers: no request reaches the failing one, no warning names either. The
    dataset read is listed once for its workers, as one process alone lists it."""
    import logging

    from torch.utils.data import DataLoader

    from faults import FaultPlan

    bucket = s3_server.new_bucket("once2")
    items, expected = cell_objects("read", "objects")
    upload_objects(s3_server.minio, bucket, items)
    listing = ListOptions(page_size=list_once_worker.PAGE)
    closed = f"http://127.0.0.1:{free_port()}"  # bound, released: connections are refused
    refusing = FaultPlan(slowdown=1.0, only_methods=None, objects_only=False)
    with FaultProxy(s3_server.config.endpoint_url) as live, \
            FaultProxy(s3_server.config.endpoint_url, refusing) as failing:
        def dataset_at(endpoint: str) -> AsyncS3Dataset:
            config = dataclasses.replace(s3_server.config, endpoint_url=endpoint)
            return AsyncS3Dataset.from_prefix(f"s3://{bucket}/read/", config=config, store=Store(listing=listing))

        unread = [dataset_at(closed), dataset_at(failing.endpoint_url)]
        read = dataset_at(live.endpoint_url)
        with caplog.at_level(logging.WARNING, logger="loader"):
            keys = sorted(sample["__key__"] for sample in
                          DataLoader(read, batch_size=None, num_workers=2, timeout=120))
        assert keys == sorted(expected)
        assert one_listing(*list_requests(live, bucket, "read/"), len(items)), "one listing for the workers"
        assert failing.counts["requests"] == 0, "the failing endpoint was never asked"
        assert all(dataset.source._keys is None for dataset in unread)
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
