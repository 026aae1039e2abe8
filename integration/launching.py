"""Runs in each rank of the launch-matrix tests: reads one epoch per cell, writes what it got.

One rank process runs several *cells* in turn, each a DataLoader over one mode
(``objects``: ``AsyncS3Dataset.from_prefix``, ``map``: ``AsyncS3MapDataset`` with a
``DistributedSampler``, ``shards``: ``from_shards`` over a brace pattern, ``shards-prefix``: over
the shards' prefix; both shard modes find the shards' index by themselves) with workers started
one way (``default`` passes no ``multiprocessing_context``; ``fork``, ``spawn``, ``forkserver``
name it, as a user would). Shard cells marked ``"resume"`` stop after two steps and resume: the
pattern with ``batch_size=`` and ``ds.resume(samples_seen=)``, the prefix with
``StatefulDataLoader``'s state; the other shard cells read their epoch straight through.
Each cell writes ``{out}/{cell}/rank{r}.json``: the keys this rank read, in order, the kind of
process each batch came from, ``len(dataset)``, and how many samples a resumed cell read before
it stopped. The test compares the ranks.

Launched three ways, the way users launch:

* ``spawned(rank, world_size, plan)``: the target of ``torch.multiprocessing.spawn``; the rank
  is only ever given to ``init_process_group`` (``tcp://`` or ``file://``), never put in the
  environment. Cells marked ``"early"`` build their dataset (and call ``set_epoch``) before the
  group is initialized, the others after.
* as a script under ``torchrun``: ``RANK``/``WORLD_SIZE`` come from the environment. Cells run
  with no process group until one marked ``"group": true``, which initializes it (``env://``).
* as a script under a SLURM-style launcher: ``SLURM_PROCID``/``SLURM_NTASKS`` set, no ``RANK``;
  the script passes them to ``init_process_group`` itself, as SLURM users do.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, Reading, S3Config

SEED = 5
EPOCH = 1
BATCH = 4
RESUME_AFTER = 2  # steps read before a shard cell stops and resumes


def spawned(rank: int, world_size: int, plan: dict[str, Any]) -> None:
    """One ``torch.multiprocessing.spawn`` rank."""
    os.environ.update(plan["env"])
    run(rank, world_size, plan, lambda: dist.init_process_group(
        "gloo", init_method=plan["init_method"], rank=rank, world_size=world_size))


def script() -> None:
    """A rank started as a script (``torchrun``, or SLURM-style with ``SLURM_*`` variables)."""
    plan = json.loads(Path(sys.argv[1]).read_text())
    os.environ.update(plan["env"])
    if plan["style"] == "torchrun":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run(rank, world_size, plan, lambda: dist.init_process_group("gloo"))  # env://
    else:
        rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        run(rank, world_size, plan, lambda: dist.init_process_group(
            "gloo", init_method=address, rank=rank, world_size=world_size))


def run(rank: int, world_size: int, plan: dict[str, Any], init: Any) -> None:
    config = S3Config.from_env()
    cells = plan["cells"]
    try:
        # Datasets built (and set_epoch called) before the process group exists, then the rest.
        datasets = {c["name"]: build(c["mode"], plan["data"], config) for c in cells if c.get("early")}
        if plan["init"] == "start":
            init()
        for cell in cells:
            if cell["name"] not in datasets:
                datasets[cell["name"]] = build(cell["mode"], plan["data"], config)
        for cell in cells:
            if cell.get("group") and not dist.is_initialized():
                init()
            started = time.monotonic()
            result = read(cell, datasets[cell["name"]], world_size)
            result["seconds"] = round(time.monotonic() - started, 2)
            save_result(plan["out"], cell["name"], rank, result)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def save_result(out: str, cell: str, rank: int, result: dict[str, Any]) -> None:
    """What one rank saw in one cell, as ``out/cell/rank{rank}.json`` for the test to compare."""
    where = Path(out) / cell
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank{rank}.json").write_text(json.dumps(result))


def build(mode: str, data: dict[str, Any], config: S3Config) -> Any:
    if mode == "map":
        return AsyncS3MapDataset.from_prefix(data["objects"], config=config)
    if mode == "objects":
        dataset = AsyncS3Dataset.from_prefix(data["objects"], shuffle=True, seed=SEED, config=config)
    elif mode == "shards":  # blocks of the epoch's order: resumed with resume(samples_seen=)
        dataset = AsyncS3Dataset.from_shards(data["shards"], shuffle=True, seed=SEED, config=config,
                                             batch_size=BATCH)
    else:
        dataset = AsyncS3Dataset.from_shards(data["shards-prefix"], shuffle=True, seed=SEED, config=config,
                                             reading=Reading(shuffle_buffer=10))
    dataset.set_epoch(EPOCH)
    return dataset


def read(cell: dict[str, Any], dataset: Any, world_size: int) -> dict[str, Any]:
    context = None if cell["start"] == "default" else cell["start"]
    options: dict[str, Any] = {"batch_size": BATCH, "num_workers": cell.get("workers", 2),
                               "multiprocessing_context": context, "collate_fn": keys_and_started,
                               "timeout": 120}
    resume = bool(cell.get("resume"))  # shard cells only: stop after RESUME_AFTER steps, resume
    keys: list[str] = []
    started: set[str] = set()
    stopped = None  # samples read before the stop, in a resumed cell

    def take(loader: Any, steps: int | None = None) -> None:
        for step, (batch_keys, how) in enumerate(loader):
            keys.extend(batch_keys)
            started.add(how)
            if step + 1 == steps:
                return

    if cell["mode"] == "map":
        sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
        sampler.set_epoch(EPOCH)
        take(DataLoader(dataset, sampler=sampler, **options))
        length = len(sampler)
    elif cell["mode"] == "shards":  # resumed: two steps, then the rest after resume(samples_seen=)
        length = len(dataset)
        take(DataLoader(dataset, **options), RESUME_AFTER if resume else None)
        if resume:
            stopped = len(keys)
            # the lanes of the run that saved samples_seen: its ranks x workers (this run's here)
            lanes = world_size * max(1, options["num_workers"])
            dataset.resume(epoch=EPOCH, samples_seen=dataset.samples_seen(RESUME_AFTER), lanes=lanes)
            take(DataLoader(dataset, **options))
    elif cell["mode"] == "shards-prefix":  # resumed: two steps, then the rest from the loader's state
        length = len(dataset)
        first = StatefulDataLoader(dataset, **options)
        take(first, RESUME_AFTER if resume else None)
        if resume:
            stopped = len(keys)
            state = first.state_dict()
            del first
            again = StatefulDataLoader(dataset, **options)
            again.load_state_dict(state)
            take(again)
    else:
        take(DataLoader(dataset, **options))
        length = len(dataset)
    return {"keys": keys, "started": sorted(started), "length": length, "stopped": stopped}


_KINDS = {"ForkProcess": "fork", "SpawnProcess": "spawn", "ForkServerProcess": "forkserver"}


def keys_and_started(batch: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Collate in the worker: the batch's keys, and how this worker was started (a worker of
    the default context is a plain ``Process``; then the start method its parent set says)."""
    kind = _KINDS.get(type(multiprocessing.current_process()).__name__)
    return [sample["__key__"] for sample in batch], kind or multiprocessing.get_start_method()


if __name__ == "__main__":
    import launching  # run from the module by name, so spawned workers find its functions

    launching.script()
