"""The shard index ``loader shard`` writes beside its shards, and reading it back.

``DST/index.json`` lists every shard with its URL, sample count, size and the byte offset of
each sample's first header; ``read_index_counts(uri)`` turns it into the ``sample_counts=`` of
``AsyncS3Dataset.from_shards``.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import S3Config, resolve_config
from ..errors import ConfigError
from ..retry import RetryPolicy, call_with_retries
from ..stores import open_store, resolve_backend
from ..stores.blocking import run_async, with_store
from ..uri import parse_s3_uri
from .compression import Compression

if TYPE_CHECKING:
    from .packing import ShardPlan

INDEX_NAME = "index.json"
INDEX_VERSION = 1


def build_index(source: str, bucket: str, names: Sequence[str], plans: Sequence[ShardPlan], *,
                fingerprint: str, target_size: int, skipped: int = 0,
                compression: Compression | None = None,
                stored_bytes: Sequence[int] | None = None) -> dict[str, Any]:
    """``index.json``: every shard's key, URL, samples, objects, bytes and sample offsets.

    ``bytes`` and ``offsets`` are of the tar stream; compressed shards add ``compression`` and
    each shard's ``stored_bytes`` (the object's size).
    """
    shards = [
        {"key": name, "url": f"s3://{bucket}/{name}", "samples": len(plan.samples),
         "objects": plan.objects, "bytes": plan.bytes, "offsets": list(plan.offsets)}
        for name, plan in zip(names, plans, strict=True)
    ]
    if compression is not None:
        for shard, stored in zip(shards, stored_bytes or itertools.repeat(None, len(shards)),
                                 strict=True):
            shard["stored_bytes"] = stored
    return {
        "version": INDEX_VERSION,
        "created_by": "loader shard",
        "source": source,
        "fingerprint": fingerprint,
        "target_size": target_size,
        **({"compression": compression} if compression else {}),
        "samples": sum(s["samples"] for s in shards),
        "objects": sum(s["objects"] for s in shards),
        "skipped_objects": skipped,
        "bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
    }


def index_counts(index: Any, where: str = "the index") -> dict[str, int]:
    """``{shard url: samples}`` from a parsed index, checked (for ``sample_counts=``)."""
    if not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
        raise ConfigError(f"{where} is not an index written by loader shard (version {INDEX_VERSION})")
    counts: dict[str, int] = {}
    for position, shard in enumerate(index.get("shards", ())):
        url = shard.get("url") if isinstance(shard, dict) else None
        samples = shard.get("samples") if isinstance(shard, dict) else None
        if not isinstance(url, str) or not isinstance(samples, int) or samples < 0:
            raise ConfigError(f"{where}: shards[{position}] lacks a url or a sample count")
        counts[url] = samples
    return counts


def read_index(
    uri: str, *, config: S3Config | None = None, store: str | Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Fetch and parse ``s3://bucket/.../index.json`` written by ``loader shard``.

    Configuration comes from the environment unless ``config`` (an ``S3Config``) is given;
    ``store`` is a backend name or an async store factory, as for the datasets.
    """
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        key += INDEX_NAME
    retry = RetryPolicy()
    if callable(store):
        factory = store
    else:
        factory = functools.partial(open_store, resolve_backend(store), resolve_config(config),
                                    max_connections=2, retry=retry)

    async def use(s: Any) -> bytes:
        return await call_with_retries(lambda: s.get(bucket, key), retry)

    where = f"s3://{bucket}/{key}"
    raw = run_async(functools.partial(with_store, factory, use))
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{where} is not JSON ({exc}); give the index.json that loader shard wrote") from None
    index_counts(document, where)  # validates
    return document


def read_index_counts(
    uri: str, *, config: S3Config | None = None, store: str | Callable[[], Any] | None = None
) -> dict[str, int]:
    """``{shard url: samples}`` from a ``loader shard`` index, for ``from_shards(sample_counts=)``::

        counts = read_index_counts("s3://bucket/shards/index.json")
        ds = AsyncS3Dataset.from_shards("s3://bucket/shards/", sample_counts=counts)

    A prefix (``s3://bucket/shards/``) means its ``index.json``.
    """
    document = read_index(uri, config=config, store=store)
    return index_counts(document, uri)
