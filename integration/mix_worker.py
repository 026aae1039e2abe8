"""One rank of the mix tests, started by ``torch.multiprocessing.spawn``: reads a mix of three
sources for some steps (or to the end), resumed or not, and writes its batches and
``samples_seen`` to ``{out}/rank{r}.json``. DataLoader workers start the default way (spawn
under ``mp.spawn``); the rank reaches them through the process group, as users' do."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, S3Config, mix

BATCH = 4
EPOCH = 2
WEIGHTS = {"web": 0.5, "plain": 0.3, "gz": 0.2}


def build(spec: dict[str, Any], config: S3Config) -> AsyncS3Dataset:
    sources = {
        "web": AsyncS3Dataset.from_prefix(spec["web"], shuffle=True, config=config),
        "plain": AsyncS3Dataset.from_shards(spec["plain"], shuffle=True, config=config,
                                            sample_counts=spec["counts"]),
        "gz": AsyncS3Dataset.from_shards(spec["gz"], shuffle=True, config=config, sample_counts=spec["counts"]),
    }
    return mix(sources, WEIGHTS, samples_per_epoch=spec["samples"], seed=11, batch_size=BATCH, config=config)


def source_and_key(batch: list[dict[str, Any]]) -> list[list[str]]:
    return [[sample["__source__"], sample["__key__"]] for sample in batch]


def spawned(rank: int, world_size: int, plan: dict[str, Any]) -> None:
    os.environ.update(plan["env"])
    dist.init_process_group("gloo", init_method=plan["init_method"], rank=rank, world_size=world_size)
    try:
        dataset = build(plan["spec"], S3Config.from_env())
        if plan.get("resume") is not None:
            dataset.resume(epoch=EPOCH, samples_seen=plan["resume"], lanes=plan["spec"].get("lanes"))
        dataset.set_epoch(EPOCH)
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=plan["workers"],
                            collate_fn=source_and_key, timeout=120)
        batches = list(itertools.islice(loader, plan.get("steps")))
        seen = dataset.samples_seen(len(batches)) if plan.get("steps") else None
        out = Path(plan["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"batches": batches, "seen": seen,
                                                          "length": len(dataset)}))
    finally:
        dist.barrier()
        dist.destroy_process_group()
