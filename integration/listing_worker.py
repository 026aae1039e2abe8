"""Runs in each rank of the list-once test: build datasets over two prefixes under gloo."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from loader import AsyncS3Dataset, ListOptions, S3Config, Store


def list_on_rank(rank: int, world_size: int, port: int, spec: dict, out: dict) -> None:
    """List ``spec["shared"]`` once per job (the default), then ``spec["alone"]`` with
    ``once_per_job=False``; report each listing's length and digest per rank."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        config = S3Config(**spec["config"])
        found = {}
        for name, options in (("shared", ListOptions(page_size=100)),
                              ("alone", ListOptions(page_size=100, once_per_job=False))):
            dataset = AsyncS3Dataset.from_prefix(spec[name], config=config, store=Store(listing=options))
            keys = dataset.keys()
            found[name] = (len(keys), hashlib.sha256("\n".join(keys).encode()).hexdigest())
            dist.barrier()
        out[rank] = found
    finally:
        dist.destroy_process_group()
