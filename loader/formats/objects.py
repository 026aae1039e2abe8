"""The units of engine work: fetch one object into a sample (shard streaming lives in ``shards.py``).

A job is ``async def job(ctx: JobContext)``: it fetches through ``ctx.store`` (with retries),
builds a WebDataset-style sample and ``emit``s it tagged with its position in the epoch plan, so
the dataset knows exactly which samples were delivered (for resume) whatever the order.
"""

from __future__ import annotations

from typing import Any

from ..engine.fetch import Job, JobContext
from ..retry import call_with_retries
from .tar import split_key
from ..uri import object_url

NO_EXTENSION_FIELD = "data"


def object_sample(bucket: str, key: str, data: bytes) -> dict[str, Any]:
    """``{"__key__": "train/000123", "__url__": "s3://b/train/000123.jpg", "jpg": b"..."}``.

    The field is the key's extension after the first dot of its basename (WebDataset's rule),
    or ``"data"`` for a key with no extension.
    """
    stem, ext = split_key(key)
    return {"__key__": stem, "__url__": object_url(bucket, key), ext or NO_EXTENSION_FIELD: data}


def object_job(bucket: str, key: str, position: int) -> Job:
    """Fetch ``s3://bucket/key`` with one GET (retried) and emit ``(position, sample)``."""

    async def job(ctx: JobContext) -> None:
        data = await call_with_retries(
            lambda: ctx.store.get(bucket, key), ctx.retry, on_retry=ctx.retried
        )
        await ctx.emit((position, object_sample(bucket, key, data)), len(data))

    return job
