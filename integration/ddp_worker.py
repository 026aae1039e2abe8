"""Runs in each rank of the multi-process tests: DataLoaders over AsyncS3Dataset under gloo."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Reading, S3Config, Split


def keys_of_batch(batch: list[dict]) -> list[str]:
    """A module-level collate function: ranks started by mp.spawn start their workers by spawn too,
    which pickles it."""
    return [sample["__key__"] for sample in batch]


def run_rank(rank: int, world_size: int, port: int, cases: dict[str, dict], env: dict, out: dict) -> None:
    """One rank: init gloo on 127.0.0.1, then per case read one epoch with 2 workers and gather
    the keys on rank 0 as ``out[case] = {"keys": [per rank], "length": ..., "errors": [per rank]}``.

    A case that fails on a rank is reported in ``errors`` and the next case still runs (every rank
    still joins the gather, so none waits forever), so each test sees only its own case's failure.
    """
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        config = S3Config.from_env()
        for name, spec in cases.items():
            try:
                keys, length = read(spec, config)
                mine = {"keys": keys, "length": length, "error": None}
            except Exception:
                mine = {"keys": None, "length": None, "error": traceback.format_exc()}
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                out[name] = {"keys": [g["keys"] for g in gathered], "errors": [g["error"] for g in gathered],
                             "length": mine["length"]}
    finally:
        dist.destroy_process_group()


def read(spec: dict, config: S3Config) -> tuple[list[str], int]:
    """The keys this rank reads in one epoch of ``spec``, and ``len()`` of its dataset."""
    if spec["mode"] == "objects":
        dataset = AsyncS3Dataset.from_prefix(spec["uri"], shuffle=True, seed=5, config=config,
                                             split=Split(pad=spec.get("pad_policy", "pad")))
    else:
        dataset = AsyncS3Dataset.from_shards(spec["uri"], shuffle=True, seed=5, config=config,
                                             sample_counts=spec.get("counts"), reading=Reading(shuffle_buffer=50))
    dataset.set_epoch(1)  # dataset built and rank read after init_process_group, as users do
    loader = DataLoader(dataset, batch_size=16, num_workers=2, collate_fn=keys_of_batch, timeout=120)
    return [key for batch in loader for key in batch], len(dataset)
