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
"""``versions(bucket, key)``: the ETag the key list gave for the object, or None (none given).
The lookups made here also answer ``.size(bucket, key)`` (``listed_size``)."""


def listed_size(versions: Versions | None, bucket: str, key: str) -> int | None:
    """The size the key list gave the object, where ``versions`` knows sizes (None otherwise):
    the disk cache keeps no body of the listed version at another size."""
    size = getattr(versions, "size", None)
    return None if size is None else size(bucket, key)


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
    table: dict[tuple[str, str], tuple[str | None, int | None]] = {
        (item.bucket, item.key): (item.etag, getattr(item, "size", None))
        for item in objects if item.etag is not None}
    return _Table(table) if table else None


class _Table:
    """A few listed objects' ETags and sizes, by ``(bucket, key)``."""

    __slots__ = ("table",)

    def __init__(self, table: dict[tuple[str, str], tuple[str | None, int | None]]) -> None:
        self.table = table

    def __call__(self, bucket: str, key: str) -> str | None:
        return self.table.get((bucket, key), (None, None))[0]

    def size(self, bucket: str, key: str) -> int | None:
        return self.table.get((bucket, key), (None, None))[1]


def first_known(lookups: Iterable[Versions | None]) -> Versions | None:
    """One lookup over several key lists (the sources of a mix): the first that has an ETag for
    the object answers; None when none of them has versions."""
    found = [lookup for lookup in lookups if lookup is not None]
    if len(found) <= 1:
        return found[0] if found else None
    return _First(found)


class _First:
    """The first of several lookups that has an ETag for the object answers (its size too)."""

    __slots__ = ("found",)

    def __init__(self, found: list[Versions]) -> None:
        self.found = found

    def __call__(self, bucket: str, key: str) -> str | None:
        for lookup in self.found:
            etag = lookup(bucket, key)
            if etag is not None:
                return etag
        return None

    def size(self, bucket: str, key: str) -> int | None:
        for lookup in self.found:
            if lookup(bucket, key) is not None:
                return listed_size(lookup, bucket, key)
        return None


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
        at = self._index(bucket, key)
        return None if at is None else self.keys.etag(at)

    def size(self, bucket: str, key: str) -> int | None:
        at = self._index(bucket, key)
        return None if at is None or not self.keys.has_sizes else self.keys.size(at)

    def _index(self, bucket: str, key: str) -> int | None:
        if bucket != self.bucket:
            return None
        keys = self.keys
        if self._positions is None:
            at = keys.find(key)
            if at is not None:
                return at
            if self._ascending is None:
                self._ascending = all(a < b for a, b in itertools.pairwise(keys))
            if self._ascending:
                return None
            self._positions = {name: at for at, name in enumerate(keys)}
        return self._positions.get(key)
