"""Runs in each rank of the list-once matrix: every cell lists its own prefix, reads it, reports.

A *cell* is a mode (``objects``: ``AsyncS3Dataset.from_prefix``, ``shards``: ``from_shards`` of a
prefix, ``parquet``: ``from_parquet`` of a prefix, ``map``: ``AsyncS3MapDataset`` with a
``DistributedSampler``), a way workers start
(``default``: no ``multiprocessing_context``, as most users leave it; ``fork``, ``spawn``,
``forkserver`` named; ``none``: ``num_workers=0``), whether they persist, and how many epochs.
Cells marked ``early`` build their dataset before ``init_process_group``. Nothing lists before
the DataLoader starts: no ``set_epoch``, no ``keys()``, exactly the issue's scenario.

Each cell writes ``{out}/{cell}/rank{r}.json``: the keys read per epoch, the snapshot every
process used (the id of the shared key list file it mapped, or a digest for a list in memory),
and how the workers were started. The test counts the LIST requests per cell's prefix (and a
Parquet cell's footer GETs).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

from loader import AsyncS3Dataset, AsyncS3MapDataset, ListOptions, Reading, Split, Store

from launching import save_result

PAGE = 4  # keys per LIST page: a cell's listing takes several requests


def spawned(rank: int, world_size: int, plan: dict[str, Any]) -> None:
    """A ``torch.multiprocessing.spawn`` rank: the rank goes to ``init_process_group`` only."""
    os.environ.update(plan["env"])
    run(rank, plan, lambda: dist.init_process_group(
        "gloo", init_method=plan["init_method"], rank=rank, world_size=world_size))


def script() -> None:
    """A rank started by ``torchrun``: ``RANK``/``WORLD_SIZE`` come from the environment."""
    plan = json.loads(Path(sys.argv[1]).read_text())
    os.environ.update(plan["env"])
    run(int(os.environ["RANK"]), plan, lambda: dist.init_process_group("gloo"))


def run(rank: int, plan: dict[str, Any], init: Any) -> None:
    cells = plan["cells"]
    try:
        datasets = {c["name"]: build(c, plan["bucket"]) for c in cells if c.get("early")}
        init()
        for cell in cells:
            if cell["name"] not in datasets:
                datasets[cell["name"]] = build(cell, plan["bucket"])
        for cell in cells:
            result = read(cell, datasets[cell["name"]])
            save_result(plan["out"], cell["name"], rank, result)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def build(cell: dict[str, Any], bucket: str) -> Any:
    uri = f"s3://{bucket}/{cell['name']}/"
    listing = ListOptions(page_size=PAGE)
    if cell["mode"] == "map":
        return AsyncS3MapDataset.from_prefix(uri, store=Store(listing=listing))
    if cell["mode"] == "parquet":
        return AsyncS3Dataset.from_parquet(uri, store=Store(listing=listing), shuffle=True, seed=2)
    if cell["mode"] == "shards":
        return AsyncS3Dataset.from_shards(uri, store=Store(listing=listing), reading=Reading(shuffle_buffer=0),
                                          split=Split(uneven_ranks=True))
    return AsyncS3Dataset.from_prefix(uri, store=Store(listing=listing))


def read(cell: dict[str, Any], dataset: Any) -> dict[str, Any]:
    workers = cell.get("workers", 2)
    options: dict[str, Any] = {"batch_size": 2, "num_workers": workers, "collate_fn": collate}
    if workers:
        options["timeout"] = 120
        options["multiprocessing_context"] = None if cell["start"] == "default" else cell["start"]
        options["persistent_workers"] = cell.get("persistent", False)
    sampler = None
    if cell["mode"] == "map":
        sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, sampler=sampler, **options)
    epochs, snapshots, started = [], set(), set()
    for _ in range(cell.get("epochs", 1)):
        keys: list[str] = []
        for batch_keys, snapshot, how in loader:
            keys.extend(batch_keys)
            snapshots.add(snapshot)
            started.add(how)
        epochs.append(keys)
    if not workers:
        snapshots = {snapshot_of(dataset)}
    return {"epochs": epochs, "snapshots": sorted(snapshots), "started": sorted(started)}


_KINDS = {"ForkProcess": "fork", "SpawnProcess": "spawn", "ForkServerProcess": "forkserver"}


def collate(batch: list[dict[str, Any]]) -> tuple[list[str], str | None, str]:
    """In the worker: the batch's keys, the snapshot this worker's dataset holds, how it started."""
    info = get_worker_info()
    kind = _KINDS.get(type(multiprocessing.current_process()).__name__)
    how = "none" if info is None else kind or multiprocessing.get_start_method()
    snapshot = None if info is None else snapshot_of(info.dataset)
    return [sample["__key__"] for sample in batch], snapshot, how


def snapshot_of(dataset: Any) -> str:
    """``file:<directory name>:<id>`` of the shared key list file a dataset maps, else a digest
    of its keys."""
    source = dataset.source
    keys = getattr(source, "_keys", getattr(source, "_shared", None))
    origin = getattr(keys, "_origin", None)
    if origin is not None:
        return f"file:{Path(origin.path).parent.name}:{origin.id}"
    if getattr(source, "_shared", None) is not None:  # Parquet: files and footers, packed records
        names = [keys.record(i).hex() for i in range(len(keys))]
    else:
        names = list(keys) if keys is not None else [shard.url for shard in getattr(source, "_shards", None) or ()]
    return "memory:" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


if __name__ == "__main__":
    import list_once_worker  # by module name, so spawned workers find its functions

    list_once_worker.script()
