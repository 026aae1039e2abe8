"""What a dataset's key list says each object's version is: ``versions(bucket, key)`` -> ETag.

The disk cache checks its entries against it (``cache_validate="listing"``), so reads carry no
such hint. A listed ``KeyList`` is sorted: it is searched by bisection, no dict at a million keys.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .keylist import KeyList

Versions = Callable[[str, str], "str | None"]
"""``versions(bucket, key)``: the ETag the key list gave for the object, or None (none given)."""


class Listed(Protocol):
    """Anything that names one listed object and its ETag (a shard reference)."""

    @property
    def bucket(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def etag(self) -> str | None: ...


def listed_versions(bucket: str, keys: Sequence[str]) -> Versions | None:
    """The versions of a per-object key list: a ``KeyList`` made by a listing, with ETags; None
    for keys from the user or a manifest (nothing to compare with)."""
    if isinstance(keys, KeyList) and keys.has_etags:
        return _SortedKeys(bucket, keys)
    return None


def versions_of(objects: Iterable[Listed]) -> Versions | None:
    """The versions of a few listed objects (a shard list), by ``(bucket, key)``; None when
    none carries an ETag."""
    table = {(item.bucket, item.key): item.etag for item in objects if item.etag is not None}
    if not table:
        return None

    def versions(bucket: str, key: str) -> str | None:
        return table.get((bucket, key))

    return versions


def first_known(lookups: Iterable[Versions | None]) -> Versions | None:
    """One lookup over several key lists (the sources of a mix): the first that has an ETag for
    the object answers; None when none of them has versions."""
    found = [lookup for lookup in lookups if lookup is not None]
    if len(found) <= 1:
        return found[0] if found else None

    def versions(bucket: str, key: str) -> str | None:
        for lookup in found:
            etag = lookup(bucket, key)
            if etag is not None:
                return etag
        return None

    return versions


class _SortedKeys:
    """A ``KeyList``'s ETags found by bisection. A listing's key list is sorted; one that is not
    (packed in another order) is indexed by a dict the first time a search misses, so a key of
    the list is always found."""

    __slots__ = ("_ascending", "_positions", "bucket", "keys")

    def __init__(self, bucket: str, keys: KeyList) -> None:
        self.bucket = bucket
        self.keys = keys
        self._ascending: bool | None = None  # checked on the first miss, once
        self._positions: dict[str, int] | None = None

    def __call__(self, bucket: str, key: str) -> str | None:
        if bucket != self.bucket:
            return None
        keys = self.keys
        if self._positions is None:
            at = keys.find(key)
            if at is not None:
                return keys.etag(at)
            if self._ascending is None:
                self._ascending = all(a < b for a, b in itertools.pairwise(keys))
            if self._ascending:
                return None
            self._positions = {name: at for at, name in enumerate(keys)}
        found = self._positions.get(key)
        return None if found is None else keys.etag(found)
