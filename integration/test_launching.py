"""Every launch style x every worker start method x every mode, on the real server.

Each launch starts 2 ranks that read one epoch per *cell* (a mode and a worker start method,
see ``launching.py``); the test checks, per cell, that the ranks' union is the data set exactly
once and that every rank read as many samples as ``len()`` promised. Shard cells read shards
indexed by ``loader index`` with no counts given; the cells marked ``resume`` stop after two
steps and resume, and the union must still be the epoch exactly once. Spawned processes import
torch again (seconds each on a small machine), so the matrix is cut to cover every value of
every axis, every launch style with every mode, and the combinations that broke: ranks started
by ``mp.spawn`` whose workers are spawned by default, and ``torchrun`` ranks with forkserver
workers. A cell also checks that its workers really were started the way it says.

Resume runs where what it depends on differs, not in every cell (each resumed spawn or
forkserver cell starts its workers twice): each launch style resumes at least once; each
resume mechanism (``resume(samples_seen=)`` for the pattern, ``StatefulDataLoader`` state for
the prefix) with workers that inherit the resumed dataset by fork and with workers it is pickled
to (spawn, forkserver), the pickled ones under a rank from the process group (``mp.spawn``) and
from the environment alone (``torchrun``, before its group); early-built datasets in both
mechanisms; two workers per rank (lanes = ranks x workers) once. How the ranks met (tcp, file,
env, SLURM's variables) and which start method of the two that pickle do not touch resume.

And the epoch: with persistent workers, whatever was (not) called before the workers started,
each epoch follows the last ``set_epoch``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset
from loader.shard_index.write import index_shards

import launching
from datasets import jpeg_dataset
from shardsets import upload_shards

WORLD = 2
OBJECTS = 40
SHARD_SIZES = [13, 7, 11, 9]
HERE = Path(__file__).resolve().parent


def cell(mode: str, start: str, **extra: object) -> dict:
    # One worker where workers import torch again (seconds each); two where they fork.
    workers = 2 if start == "fork" else 1
    return {"name": f"{mode}-{start}", "mode": mode, "start": start, "workers": workers, **extra}


# launch style -> (the start method "default" means in its ranks, its cells). "early" cells build
# their dataset before the process group is initialized; under torchrun the group starts at the
# first cell that asks for it (DistributedSampler needs one), so the cells before read RANK alone.
# Shard cells read indexed shards (found beside them, no counts given) by pattern ("shards") and
# by prefix ("shards-prefix"), each with every start method; those marked resume=True stop
# halfway and resume (launching.read; which ones and why: the module's docstring).
LAUNCHES = {
    "mp.spawn+tcp": ("spawn", [cell("objects", "default"), cell("shards", "default"),
                               cell("shards-prefix", "default"),
                               cell("map", "default"), cell("objects", "fork", early=True),
                               cell("shards", "spawn", early=True, resume=True),
                               cell("map", "fork", early=True)]),
    "mp.spawn+file": ("spawn", [cell("objects", "fork"), cell("shards", "forkserver"),
                                cell("shards-prefix", "fork", early=True, resume=True),
                                cell("map", "forkserver")]),
    "torchrun": ("fork", [cell("objects", "forkserver"), cell("shards", "spawn"),
                          cell("shards-prefix", "forkserver", resume=True),
                          cell("shards", "fork", resume=True),
                          cell("map", "default", group=True, workers=2),
                          cell("objects", "default", workers=2)]),
    "slurm env": ("fork", [cell("objects", "spawn"), cell("shards", "default", workers=2, resume=True),
                           cell("shards-prefix", "spawn"), cell("map", "fork")]),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def data(s3_server):
    bucket = s3_server.new_bucket("launch")
    objects = jpeg_dataset(s3_server.minio, bucket, "train/", OBJECTS, seed=11)
    samples, _ = upload_shards(s3_server.minio, bucket, "shards/train-", SHARD_SIZES, payload=100)
    index_shards(f"s3://{bucket}/shards/", config=s3_server.config)  # as `loader index` does
    return {
        "spec": {"objects": f"s3://{bucket}/train/",
                 "shards": f"s3://{bucket}/shards/train-{{0000..{len(SHARD_SIZES) - 1:04d}}}.tar",
                 "shards-prefix": f"s3://{bucket}/shards/"},
        "expected": {"objects": {key.rsplit(".", 1)[0] for key in objects}, "shards": set(samples)},
        "env": s3_server.env,
    }


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any rank in it, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def launch(style: str, plan: dict, tmp_path: Path) -> None:
    if style.startswith("mp.spawn"):
        mp.spawn(launching.spawned, args=(WORLD, plan), nprocs=WORLD, join=True)
        return
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    script = [str(HERE / "launching.py"), str(plan_file)]
    if style == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={WORLD}", "--max-restarts=0", *script]
        subprocess.run(command, env=child_env({}), check=True, timeout=400)
        return
    port = str(free_port())  # SLURM-style: srun starts every task; they meet at MASTER_ADDR
    tasks = [subprocess.Popen([sys.executable, *script], env=child_env({
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(WORLD),
        "SLURM_NNODES": "1", "SLURM_JOB_ID": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
    })) for rank in range(WORLD)]
    try:
        codes = [task.wait(timeout=400) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert codes == [0] * WORLD, f"SLURM-style tasks exited with {codes}"


@pytest.mark.parametrize("style", list(LAUNCHES))
def test_each_rank_reads_its_own_share(style, data, tmp_path):
    default, cells = LAUNCHES[style]
    if style == "mp.spawn+file":
        init, init_method = "start", (tmp_path / "rendezvous").as_uri()
    elif style == "torchrun":
        init, init_method = "cells", None  # env only, until a cell asks for the group
    else:
        init, init_method = "start", f"tcp://127.0.0.1:{free_port()}"
    plan = {"style": style, "init": init,
            "init_method": init_method, "cells": cells, "data": data["spec"], "env": data["env"],
            "out": str(tmp_path / "out")}
    started = time.monotonic()
    launch(style, plan, tmp_path)
    print(f"{style}: {time.monotonic() - started:.1f} s")

    problems = []
    for spec in cells:
        name = spec["name"]
        ranks = [json.loads((tmp_path / "out" / name / f"rank{r}.json").read_text())
                 for r in range(WORLD)]
        expected = data["expected"]["shards" if spec["mode"].startswith("shards") else "objects"]
        print(f"  {name}: {[r['seconds'] for r in ranks]} s")
        counts = [len(rank["keys"]) for rank in ranks]
        union = Counter(key for rank in ranks for key in rank["keys"])
        started = {how for rank in ranks for how in rank["started"]}
        want = default if spec["start"] == "default" else spec["start"]
        if counts != [len(expected) // WORLD] * WORLD or [r["length"] for r in ranks] != counts:
            problems.append(f"{name}: ranks read {counts} samples, len() said "
                            f"{[r['length'] for r in ranks]}, want {len(expected) // WORLD} each")
        if set(union) != expected or max(union.values()) != 1:
            twice = sum(1 for n in union.values() if n > 1)
            problems.append(f"{name}: {twice} samples read more than once, "
                            f"{len(expected - set(union))} missing")
        if spec.get("resume") and [r["stopped"] for r in ranks] != [launching.RESUME_AFTER * launching.BATCH] * WORLD:
            problems.append(f"{name}: stopped after {[r['stopped'] for r in ranks]} samples, not "
                            f"{launching.RESUME_AFTER} batches, before resuming")
        if started != {want}:
            problems.append(f"{name}: workers were {sorted(started)}, not {want}")
    assert not problems, f"{style}: " + "; ".join(problems)


# ----------------------------------------------------------------------------- epochs


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_persistent_workers_follow_set_epoch_even_without_one_before_epoch_0(s3_server, context):
    bucket = s3_server.new_bucket("epoch")
    jpeg_dataset(s3_server.minio, bucket, "train/", 24, seed=12)
    ds = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", shuffle=True, seed=3,
                                    config=s3_server.config)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context, timeout=120)
    orders = [[sample["__key__"] for sample in loader]]  # epoch 0: set_epoch never called
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        orders.append([sample["__key__"] for sample in loader])
    expected = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        fresh = DataLoader(ds, batch_size=None, num_workers=2, timeout=120)
        expected.append([sample["__key__"] for sample in fresh])
    assert orders[0] != orders[1] and orders[1] != orders[2], "set_epoch did not reach the workers"
    assert orders == expected, "each epoch's order must be the one fresh workers give"
    assert sorted(orders[1]) == sorted(orders[0]) and len(set(orders[0])) == 24
