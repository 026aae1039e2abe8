"""Shards other tools wrote, indexed by ``loader index``, read by real ranks on the real server.

The shards come from GNU tar (the ``tar`` command, long names and directory entries included),
webdataset's ``ShardWriter`` and ``tar -czf`` (``.tgz``). ``python -m loader index`` indexes them
as a user runs it; then 3 ranks started by ``torch.multiprocessing.spawn`` (DataLoader workers
spawned, as there by default: 2 a rank where all nine shards are split among ranks and workers, 1
elsewhere) read them with nothing but the shards' URIs: every rank the same count, each sample once
(the pad policy repeats at most 2). Shards without an index fail in
such a job before the first sample, with the advice; ``samples_per_epoch`` gives N on every rank.
A shard rewritten after indexing is an error naming it, or read exactly where counts do not matter.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import index_worker
import pytest
import torch.multiprocessing as mp
import webdataset as wds

from loader import AsyncS3Dataset, ConfigError, Reading, Split
from loader.errors import ObjectChangedError
from loader.shard_index.write import IndexOptions, index_shards

from s3servers import S3_VARS
from shardsets import pack

WORLD = 3
GNU = [37, 23, 42]  # samples per shard written by GNU tar
TGZ = [29, 31]  # by tar -czf
WDS = 130  # by webdataset's ShardWriter, 40 a shard: 40, 40, 40, 10
HERE = Path(__file__).resolve().parent


def sample_files(folder: Path, first: int, count: int) -> list[str]:
    """``count`` samples as files (``.txt`` + ``.cls``; some with long names) under ``folder``."""
    keys = []
    for number in range(first, first + count):
        stem = f"s{number:05d}" + ("-" + "n" * 110 if number % 9 == 0 else "")  # > 100 bytes: GNU long name
        keys.append(stem)
        (folder / f"{stem}.txt").write_bytes(f"sample {number} ".encode() * (number % 13 + 1))
        (folder / f"{stem}.cls").write_text(str(number % 10))
    return keys


def gnu_tar(tmp: Path, name: str, first: int, count: int, *, gzip: bool = False) -> tuple[Path, list[str]]:
    folder = tmp / f"{name}-files"
    (folder / "part").mkdir(parents=True)
    keys = sample_files(folder / "part", first, count)
    out = tmp / name
    flags = "-czf" if gzip else "-cf"
    subprocess.run(["tar", "--format=gnu", "--sort=name", flags, str(out), "-C", str(folder), "."],
                   check=True)
    return out, [f"./part/{key}" for key in keys]


def webdataset_shards(tmp: Path, first: int, count: int) -> tuple[list[Path], list[str]]:
    keys = []
    with wds.ShardWriter(str(tmp / "wds-%06d.tar"), maxcount=40, verbose=0) as sink:
        for number in range(first, first + count):
            key = f"w{number:05d}"
            keys.append(key)
            sink.write({"__key__": key, "txt": f"sample {number}".encode(), "cls": str(number % 10)})
    return sorted(tmp.glob("wds-*.tar")), keys


@pytest.fixture(scope="module")
def foreign(s3_server, tmp_path_factory):
    """Nine foreign shards under ``foreign/``; returns the bucket and every sample key."""
    tmp = tmp_path_factory.mktemp("foreign")
    bucket = s3_server.new_bucket("foreign")
    files, expected, first = [], [], 0
    for i, count in enumerate(GNU):
        path, keys = gnu_tar(tmp, f"gnu-{i:03d}.tar", first, count)
        files.append(path)
        expected += keys
        first += count
    for i, count in enumerate(TGZ):
        path, keys = gnu_tar(tmp, f"tgz-{i}.tgz", first, count, gzip=True)
        files.append(path)
        expected += keys
        first += count
    paths, keys = webdataset_shards(tmp, first, WDS)
    files += paths
    expected += keys
    for path in files:
        s3_server.minio.fput_object(bucket, f"foreign/{path.name}", str(path))
    # the same webdataset shards again, in a folder no one indexes
    for path in paths:
        s3_server.minio.fput_object(bucket, f"raw/{path.name}", str(path))
    assert len(files) == 9 and len(expected) == sum(GNU) + sum(TGZ) + WDS == 292
    return bucket, expected, keys


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in S3_VARS}
    return subprocess.run([sys.executable, "-m", "loader", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(s3_server, cells, tmp_path) -> dict[str, list[dict]]:
    plan = {"env": s3_server.env, "init_method": f"tcp://127.0.0.1:{free_port()}", "cells": cells,
            "out": str(tmp_path / "out")}
    mp.spawn(index_worker.spawned, args=(WORLD, plan), nprocs=WORLD, join=True)
    return {cell["name"]: [json.loads((tmp_path / "out" / cell["name"] / f"rank{r}.json").read_text())
                           for r in range(WORLD)] for cell in cells}


def test_foreign_shards_indexed_then_read_by_three_spawned_ranks(s3_server, foreign, tmp_path):
    bucket, expected, wds_keys = foreign
    proc = cli("index", f"s3://{bucket}/foreign/", "--no-progress", env=s3_server.env)
    assert proc.returncode == 0, proc.stderr
    assert "indexed 9 shard(s) (292 samples" in proc.stdout and f"s3://{bucket}/foreign/index.json" in proc.stdout
    print(proc.stdout)
    index = json.loads(s3_server.minio.get_object(bucket, "foreign/index.json").read())
    by_name = {shard["key"].rsplit("/", 1)[1]: shard for shard in index["shards"]}
    assert [by_name[f"gnu-{i:03d}.tar"]["samples"] for i in range(3)] == GNU
    assert [by_name[f"tgz-{i}.tgz"]["samples"] for i in range(2)] == TGZ
    assert [by_name[f"wds-{i:06d}.tar"]["samples"] for i in range(4)] == [40, 40, 40, 10]
    assert all(shard["etag"] and shard["size"] for shard in index["shards"])
    assert "offsets" not in by_name["tgz-0.tgz"] and len(by_name["gnu-000.tar"]["offsets"]) == 37
    again = cli("index", f"s3://{bucket}/foreign/", "--no-progress", env=s3_server.env)
    assert "indexed 0 shard(s)" in again.stdout and "9 were indexed already" in again.stdout

    gnu_and_tgz = [f"s3://{bucket}/foreign/gnu-{i:03d}.tar" for i in range(3)] + \
                  [f"s3://{bucket}/foreign/tgz-{i}.tgz" for i in range(2)]
    # 2 DataLoader workers a rank where the split among workers is proven: every writer's shards
    # (long names, gzip) laid end to end into 6 equal runs; 1 elsewhere, where a cell proves how
    # its URIs are read (a worker per rank is still a spawned process reading its rank's share)
    cells = [
        {"name": "prefix", "shards": f"s3://{bucket}/foreign/", "workers": 2},
        {"name": "pattern", "shards": f"s3://{bucket}/foreign/wds-{{000000..000003}}.tar"},
        {"name": "list", "shards": gnu_and_tgz},
        {"name": "per-epoch", "shards": f"s3://{bucket}/raw/", "options": {"samples_per_epoch": 50}},
        # last: a DataLoader that fails while another spawned worker of it still starts leaves
        # that worker to die on the queues it was given, and torch blames the next loader for it
        {"name": "unindexed", "shards": f"s3://{bucket}/raw/"},
    ]
    results = spawn_ranks(s3_server, cells, tmp_path)
    wanted = {"prefix": expected, "pattern": wds_keys, "list": [k for k in expected if k.startswith("./")]}
    for name, keys in wanted.items():
        ranks = results[name]
        counts = [len(rank["keys"]) for rank in ranks]
        per_rank = -(-len(keys) // WORLD)
        print(f"{name}: {len(keys)} samples, ranks read {counts}, len() {[r['length'] for r in ranks]}")
        assert [r["error"] for r in ranks] == [None] * WORLD, name
        assert counts == [per_rank] * WORLD and [r["length"] for r in ranks] == counts, name
        read = Counter(key for rank in ranks for key in rank["keys"])
        assert set(read) == set(keys), name
        assert sum(read.values()) - len(keys) == per_rank * WORLD - len(keys) <= WORLD - 1, name
    for rank in results["unindexed"]:
        assert rank["keys"] == [] and "3 ranks read 4 tar shards" in rank["error"]
        assert f"python -m loader index 's3://{bucket}/raw/'" in rank["error"]
        assert "samples_per_epoch=" in rank["error"] and "uneven_ranks=True" in rank["error"]
        assert "loader index" in rank["length"]
    per_epoch = results["per-epoch"]
    print(f"per-epoch: ranks read {[len(r['keys']) for r in per_epoch]}")
    assert [r["error"] for r in per_epoch] == [None] * WORLD
    assert [len(r["keys"]) for r in per_epoch] == [50] * WORLD and [r["length"] for r in per_epoch] == [50] * WORLD
    assert set().union(*(r["keys"] for r in per_epoch)) <= set(wds_keys)


@pytest.mark.server_sensitive
def test_a_shard_rewritten_after_indexing_is_named_and_never_counted_stale(s3_server, tmp_path):
    bucket = s3_server.new_bucket("stale")
    shards = {f"s/x-{i}.tar": {f"s{i}/{n:03d}": {"bin": b"%d" % n * 30} for n in range(20 + i)}
              for i in range(3)}
    for key, samples in shards.items():
        body = pack(samples)
        s3_server.minio.put_object(bucket, key, io.BytesIO(body), len(body))
    report = index_shards(f"s3://{bucket}/s/", IndexOptions(), config=s3_server.config)
    assert report.samples == 63
    smaller = pack({key: value for key, value in list(shards["s/x-1.tar"].items())[:-1]})
    s3_server.minio.put_object(bucket, "s/x-1.tar", io.BytesIO(smaller), len(smaller))
    pattern = f"s3://{bucket}/s/x-{{0..2}}.tar"

    def read(spec, rank, world, **options):
        return list(AsyncS3Dataset.from_shards(spec, config=s3_server.config, split=Split(rank=rank, world_size=world),
                                               **options))

    # a pattern: no listing, the reads are pinned to the indexed ETag (the server answers 412)
    with pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/s/x-1.tar is not the version the index "
                                                 rf"s3://{bucket}/s/index.json counted"):
        for rank in range(3):
            read(pattern, rank, 3)
    # a prefix: the listing shows another ETag, so the entry is not used; 3 ranks fail at once
    with pytest.raises(ConfigError, match=rf"changed since the index .* counted them: s3://{bucket}/s/x-1"):
        read(f"s3://{bucket}/s/", 0, 3)
    # one rank needs no counts: it reads the new version exactly
    assert len(read(f"s3://{bucket}/s/", 0, 1)) == 62
    # indexing again reads that shard alone, and the ranks are equal again
    again = index_shards(f"s3://{bucket}/s/", IndexOptions(), config=s3_server.config)
    assert (again.indexed, again.already) == (1, 2)
    lengths = [len(read(pattern, rank, 3)) for rank in range(3)]
    assert lengths == [21, 21, 21]


def test_a_ctrl_c_leaves_a_resumable_index(s3_server, foreign):
    bucket, _, _ = foreign
    out = f"s3://{bucket}/meta/partial.json"
    stopped = cli("index", f"s3://{bucket}/foreign/", "--out", out, "--concurrency", "1", "--stop-after", "4",
                  "--no-progress", env=s3_server.env)
    assert stopped.returncode == 130 and "run the same command again" in stopped.stderr
    assert len(json.loads(s3_server.minio.get_object(bucket, "meta/partial.json").read())["shards"]) == 4
    done = cli("index", f"s3://{bucket}/foreign/", "--out", out, "--no-progress", env=s3_server.env)
    assert done.returncode == 0 and "indexed 5 shard(s)" in done.stdout and "4 were indexed already" in done.stdout
    assert f"index='{out}'" in done.stdout
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/foreign/", config=s3_server.config, reading=Reading(index=out))
    assert sum(dataset.shard_counts()) == 292
