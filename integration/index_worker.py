"""Runs in each rank of the shard-index tests: reads one epoch per *cell*, writes what it got.

A rank is started by ``torch.multiprocessing.spawn`` (so its DataLoader workers are spawned, the
default there), joins a gloo group, and for each cell builds ``AsyncS3Dataset.from_shards`` with
the cell's URIs and options and reads one epoch with the cell's ``workers`` (default 1). It
writes ``{out}/{cell}/rank{r}.json``: the keys it read, ``len()`` (or why there is none), and the
error, when the cell raised.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, S3Config

from launching import save_result


def keys_of_batch(batch: list[dict]) -> list[str]:
    """Module level, so that spawned workers can unpickle it."""
    return [sample["__key__"] for sample in batch]


def spawned(rank: int, world_size: int, plan: dict[str, Any]) -> None:
    os.environ.update(plan["env"])
    dist.init_process_group("gloo", init_method=plan["init_method"], rank=rank, world_size=world_size)
    try:
        config = S3Config.from_env()
        for cell in plan["cells"]:
            result: dict[str, Any] = {"keys": [], "length": None, "error": None}
            started = time.monotonic()
            try:
                dataset = AsyncS3Dataset.from_shards(cell["shards"], config=config, shuffle=True, seed=7,
                                                     **cell.get("options", {}))
                dataset.set_epoch(2)
                try:
                    result["length"] = len(dataset)
                except TypeError as exc:
                    result["length"] = f"TypeError: {exc}"
                loader = DataLoader(dataset, batch_size=8, num_workers=cell.get("workers", 1), collate_fn=keys_of_batch,
                                    timeout=120)
                for batch in loader:
                    result["keys"].extend(batch)
            except Exception as exc:  # the test compares what each rank saw
                result["error"] = f"{type(exc).__name__}: {exc}"
                # A loader that failed can stay alive in a reference cycle through the
                # traceback until the collector runs: at exit its spawned workers were then
                # killed under it, which torch reports as the rank's own failure.
                del exc
                gc.collect()
            result["seconds"] = round(time.monotonic() - started, 2)
            save_result(plan["out"], cell["name"], rank, result)
            dist.barrier()
    finally:
        dist.destroy_process_group()
