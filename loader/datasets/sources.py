"""What to fetch: object keys from a prefix listing or a manifest, and shard URLs from patterns.

Listing is I/O, so it happens once, on demand, through a short-lived event loop in a helper
thread (``run_async``): that works from plain scripts, notebooks (which already run a loop in
the main thread) and DataLoader workers alike, and leaves no thread behind.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar


from ..errors import ConfigError, EmptyDatasetError
from ..retry import RetryPolicy, call_with_retries
from ..stores import ObjectInfo, ObjectStore
from ..stores.blocking import run_async, with_store
from ..formats.shards import ShardRef
from ..uri import expand_braces, parse_s3_uri

T = TypeVar("T")


async def list_objects(
    store: ObjectStore, bucket: str, prefix: str, retry: RetryPolicy, *, suffix: str = ""
) -> list[ObjectInfo]:
    """Every object under ``s3://bucket/prefix`` (optionally ending in ``suffix``), key order.

    Directory markers (keys ending in ``/``) are skipped. An empty result is an error, because a
    training run over nothing is always a mistake (usually a typo in the prefix).
    """

    async def attempt() -> list[ObjectInfo]:
        return [
            info
            async for info in store.list(bucket, prefix)
            if not info.key.endswith("/") and info.key.endswith(suffix)
        ]

    # Sorted here because servers disagree (SeaweedFS lists directory by directory) and
    # positions in this list decide every rank's share.
    found = sorted(await call_with_retries(attempt, retry))
    if not found:
        what = f"no objects{f' ending in {suffix!r}' if suffix else ''}"
        raise EmptyDatasetError(
            f"{what} under s3://{bucket}/{prefix}; check the prefix (it is case-sensitive and "
            "matches from the start of the key) and that the upload finished"
        )
    return found


def list_prefix(
    uri: str,
    *,
    factory: Callable[[], Awaitable[ObjectStore]],
    retry: RetryPolicy,
    suffix: str = "",
) -> list[ObjectInfo]:
    """Synchronous ``list_objects`` for an ``s3://bucket/prefix`` URI."""
    bucket, prefix = parse_s3_uri(uri)

    async def use(store: ObjectStore) -> list[ObjectInfo]:
        return await list_objects(store, bucket, prefix, retry, suffix=suffix)

    return run_async(functools.partial(with_store, factory, use))


def read_manifest(path: str | Path, bucket: str | None = None) -> tuple[str, list[str]]:
    """Keys from a text file, one per line: plain keys (``bucket`` given) or ``s3://`` URIs.

    Blank lines and lines starting with ``#`` are skipped. All URIs must name one bucket.
    """
    manifest = Path(path)
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {str(manifest)!r}: {exc.strerror}") from exc
    keys: list[str] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("s3://"):
            uri = parse_s3_uri(line)
            if bucket is not None and uri.bucket != bucket:
                raise ConfigError(
                    f"{str(manifest)!r} line {number}: bucket {uri.bucket!r} differs from "
                    f"{bucket!r}; one manifest serves one bucket"
                )
            bucket = uri.bucket
            line = uri.key
        keys.append(line)
    if bucket is None:
        raise ConfigError(
            f"manifest {str(manifest)!r} holds plain keys; pass bucket=... or write s3:// URIs"
        )
    if not keys:
        raise EmptyDatasetError(f"manifest {str(manifest)!r} lists no keys")
    return bucket, keys


def check_keys(bucket: str, keys: Iterable[str]) -> tuple[str, ...]:
    """Validate a user-given key list once, up front, with messages naming the bad entry."""
    out = tuple(keys)
    if not out:
        raise EmptyDatasetError(f"the key list for bucket {bucket!r} is empty")
    for position, key in enumerate(out):
        if not isinstance(key, str) or not key:
            raise ConfigError(f"keys[{position}]={key!r} is not a non-empty string")
    return out


def shard_specs(spec: str | Iterable[str]) -> list[str]:
    """Expand a shard spec into URIs or prefixes: brace patterns, lists of them, or a prefix.

    A string ending in ``.tar`` (after brace expansion) names shards; anything else is a prefix
    whose ``.tar`` objects are the shards (``resolve_shards`` lists it).
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise EmptyDatasetError("the shard list is empty")
    out: list[str] = []
    for item in specs:
        if not isinstance(item, str):
            raise ConfigError(f"shard {item!r} is not an s3:// URI string")
        out.extend(expand_braces(item))
    for uri in out:
        parse_s3_uri(uri)  # fail now, with the URI named, not in a worker later
    return out


def resolve_shards(
    specs: list[str], *, factory: Callable[[], Awaitable[ObjectStore]], retry: RetryPolicy
) -> list[ShardRef]:
    """Turn shard URIs and prefixes into ``ShardRef``s; prefixes are listed (sizes known)."""
    shards: list[ShardRef] = []
    for uri in specs:
        bucket, key = parse_s3_uri(uri)
        if key.endswith(".tar"):
            shards.append(ShardRef(bucket, key))
        else:
            found = list_prefix(uri, factory=factory, retry=retry, suffix=".tar")
            shards.extend(ShardRef(bucket, info.key, info.size) for info in found)
    return shards
