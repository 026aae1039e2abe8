"""Reading back the ``index.json`` that ``loader shard`` writes beside its shards: sample counts
(``sample_counts=`` of ``from_shards``) and sample offsets, fetched with the caller's retries."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from ..config import S3Config
from ..errors import ConfigError
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectStore, StoreSpec
from ..s3.blocking import run_async, with_store
from ..uri import parse_s3_uri
from .format import INDEX_NAME, index_counts


def read_index(
    uri: str, *, config: S3Config | None = None, store: str | Callable[[], Any] | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """Fetch and parse ``s3://bucket/.../index.json`` written by ``loader shard``.

    Configuration comes from the environment unless ``config`` (an ``S3Config``) is given;
    ``store`` is a backend name or an async store factory, and ``retry`` the retry policy, as for
    the datasets. A prefix (ending in ``/``) means its ``index.json``.
    """
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        key += INDEX_NAME
    policy = retry or RetryPolicy()
    factory = StoreSpec.of(store, config).opener(max_connections=2, retry=policy)

    async def use(s: ObjectStore) -> bytes:
        return await call_with_retries(lambda: s.get(bucket, key), policy)

    where = f"s3://{bucket}/{key}"
    raw = run_async(functools.partial(with_store, factory, use))
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{where} is not JSON ({exc}); give the index.json that loader shard wrote") from None
    index_counts(document, where)  # validates
    return document


def read_index_counts(
    uri: str, *, config: S3Config | None = None, store: str | Callable[[], Any] | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, int]:
    """``{shard url: samples}`` from a ``loader shard`` index, for ``from_shards(sample_counts=)``::

        counts = read_index_counts("s3://bucket/shards/index.json")
        ds = AsyncS3Dataset.from_shards("s3://bucket/shards/", sample_counts=counts)

    A prefix (``s3://bucket/shards/``) means its ``index.json``.
    """
    document = read_index(uri, config=config, store=store, retry=retry)
    return index_counts(document, uri)
