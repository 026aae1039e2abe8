"""Runs in each rank of the multi-process tests: a DataLoader over AsyncS3Dataset under gloo."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, S3Config


def keys_of_batch(batch: list[dict]) -> list[str]:
    """A module-level collate function: ranks started by mp.spawn start their workers by spawn too,
    which pickles it."""
    return [sample["__key__"] for sample in batch]


def run_rank(rank: int, world_size: int, port: int, spec: dict, env: dict, out: dict) -> None:
    """One rank: init gloo on 127.0.0.1, read one epoch with 2 workers, gather keys on rank 0."""
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        config = S3Config.from_env()
        if spec["mode"] == "objects":
            dataset = AsyncS3Dataset.from_prefix(spec["uri"], shuffle=True, seed=5, config=config,
                                                 pad_policy=spec.get("pad_policy", "pad"))
        else:
            dataset = AsyncS3Dataset.from_shards(spec["uri"], shuffle=True, seed=5, config=config,
                                                 sample_counts=spec.get("counts"), shuffle_buffer=50)
        dataset.set_epoch(1)  # dataset built and rank read after init_process_group, as users do
        loader = DataLoader(dataset, batch_size=16, num_workers=2,
                            collate_fn=keys_of_batch,
                            timeout=120)
        keys = [key for batch in loader for key in batch]
        gathered = [None] * world_size
        dist.all_gather_object(gathered, keys)
        if rank == 0:
            out.update(keys=gathered, length=len(dataset))
    finally:
        dist.destroy_process_group()
