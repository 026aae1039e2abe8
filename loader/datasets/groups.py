"""The options users group by concern (httpx's ``Timeout``/``Limits`` pattern), and the one table
that maps the flat keywords of earlier releases onto them.

An entry point takes the few keywords every user touches flat (``shuffle``, ``seed``,
``transform``, ``batch_size``, ``on_error``, ``config`` and the source's own) and the rest in
small frozen objects:

- ``limits=Limits(concurrency=, memory=, ordered=)``: how many requests and how much memory;
- ``split=Split(rank=, world_size=, pad=, samples_per_epoch=, uneven_ranks=)``: how an epoch is
  split across ranks;
- ``store=Store(backend=, retry=, listing=, cache=Cache(dir=, limit=, validate=))``: which
  client reaches S3, how it retries and lists, and the disk cache in front of it (a backend's
  name alone, ``store="obstore"``, is the short form);
- ``reading=Reading(shuffle_buffer=, part_size=, chunk_size=, index=)``: how shards and Parquet
  files are read.

A dataset keeps them as one record (``options.Options``), the groups as given; shards and
Parquet read their files through ``ShardOptions``. ``DEPRECATED`` is the only list of the old
flat spellings, ``LANDS`` where each one's value goes: each still works, with a
``DeprecationWarning`` that names its new spelling.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from ..cache.options import check_dir, check_limit, check_validate
from ..checks import check_int
from ..errors import ConfigError
from ..listing.keylist import ListOptions
from ..retry import RetryPolicy
from ..s3 import StoreFactory
from . import partition

MIN_MEMORY = 8 << 20
Mode = Literal["objects", "shards", "parquet", "map", "mix"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """How many requests and how much memory, per iterating process (each DataLoader worker).

    ``concurrency``: requests in flight (default 64 per-object; for shards 16, and for
    Parquet 16 per rank shared among its DataLoader workers: ``concurrency // 4`` files or row
    groups read at once, 4 ranged parts each; a number given applies to every process). ``memory``: bytes for
    everything the loader holds (the queue of fetched samples, bodies and parts in flight, the
    shuffle buffer), split into fixed shares; None: the queue's defaults (256 MiB, 1024 items).
    ``ordered``: deliver in the planned order (True); False: as fetched, so one slow request
    does not hold back the rest (not with ``batch_size=``).
    """

    concurrency: int | None = None
    memory: int | None = None
    ordered: bool = True

    def __post_init__(self) -> None:
        check_int("Limits.concurrency", self.concurrency, minimum=1, optional=True,
                  must="a positive integer (requests in flight per process)")
        check_int("Limits.memory", self.memory, minimum=MIN_MEMORY, optional=True,
                  must=f"a number of bytes, at least {MIN_MEMORY} (8 MiB), e.g. 512 << 20 for 512 MiB")
        if not isinstance(self.ordered, bool):
            raise ConfigError(f"Limits.ordered={self.ordered!r} must be True or False")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """How an epoch is split across ranks.

    ``rank``, ``world_size``: this process's place (default: the process group, else
    ``RANK``/``WORLD_SIZE``; give both or neither). ``pad`` (``"pad"``): equal ranks by repeating
    a few samples, or ``"drop"`` them. Shards and Parquet also take ``samples_per_epoch``
    (exactly this many samples per rank and epoch, cycling through the files; no counts
    needed) and ``uneven_ranks`` (shards: accept ranks of unequal length when counts are
    unknown).
    """

    rank: int | None = None
    world_size: int | None = None
    pad: partition.PadPolicy = "pad"
    samples_per_epoch: int | None = None
    uneven_ranks: bool = False

    def __post_init__(self) -> None:
        if self.pad not in ("pad", "drop"):
            raise ConfigError(f"Split.pad={self.pad!r} must be 'pad' or 'drop'")
        check_int("Split.samples_per_epoch", self.samples_per_epoch, minimum=1, optional=True,
                  must="a positive integer (samples per rank and epoch) or None")


@dataclasses.dataclass(frozen=True)
class Cache:
    """The disk cache: ``dir`` (a local folder), its size ``limit`` in bytes (None: 10 GiB; least
    recently used entries are evicted first), and when an entry may still answer (``validate``:
    ``"listing"`` when the listing's ETag matches, ``"always"`` after a conditional GET,
    ``"never"`` without asking)."""

    dir: str | os.PathLike[str]
    limit: int | None = None  # None: DEFAULT_CACHE_LIMIT, 10 GiB
    validate: str = "listing"  # DEFAULT_VALIDATE

    def __post_init__(self) -> None:
        check_dir(self.dir, "Cache.dir")
        if self.limit is not None:
            check_limit(self.limit, "Cache.limit")
        check_validate(self.validate, "Cache.validate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Store:
    """How objects are fetched: ``backend`` (``"aioboto3"``, the default or ``$LOADER_STORE``;
    ``"obstore"``; or an async store factory), its ``retry`` policy, how prefixes are listed
    (``listing``), and the disk ``cache`` in front of it (a ``Cache``, or a folder for its
    defaults). ``store="obstore"`` is short for ``store=Store(backend="obstore")``."""

    backend: str | StoreFactory | None = None
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    listing: ListOptions = dataclasses.field(default_factory=ListOptions)
    cache: Cache | str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cache, (str, os.PathLike)):
            object.__setattr__(self, "cache", Cache(self.cache))
        if self.cache is not None and not isinstance(self.cache, Cache):
            raise ConfigError(f"Store.cache={self.cache!r} must be a loader.Cache(dir=...) or a folder")
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"Store.retry={self.retry!r} must be a loader.RetryPolicy(...)")
        if not isinstance(self.listing, ListOptions):
            raise ConfigError(f"Store.listing={self.listing!r} must be a loader.ListOptions(...)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reading:
    """How shards and Parquet files are read: ``shuffle_buffer`` (samples mixed after reading;
    1000 with ``shuffle=True``, 0 = off; ``Limits.memory`` bounds it in bytes too),
    ``part_size`` (a file of known size is read as ranged GETs of this many bytes: 16 MiB for
    shards, 32 MiB for Parquet), ``chunk_size`` (shards: the piece a streamed shard is read in,
    1 MiB) and ``index`` (shards: the URI of their index, when not beside them)."""

    shuffle_buffer: int | None = None
    part_size: int | None = None
    chunk_size: int | None = None
    index: str | None = None


# old flat keyword -> its new spelling (the value still lands on the field of the old name)
_LOADING = {
    "max_inflight": "limits=Limits(concurrency=...)",
    "memory_budget": "limits=Limits(memory=...)",
    "queue_bytes": "limits=Limits(memory=...), of which the queue takes its share",
    "queue_items": "limits=Limits(memory=...), of which the queue takes its share",
    "ordered": "limits=Limits(ordered=...)",
    "rank": "split=Split(rank=..., world_size=...)",
    "world_size": "split=Split(rank=..., world_size=...)",
    "pad_policy": "split=Split(pad=...)",
    "retry": "store=Store(retry=...)",
    "listing": "store=Store(listing=...)",
    "cache_dir": "store=Store(cache=Cache(dir=...))",
    "cache_limit": "store=Store(cache=Cache(dir=..., limit=...))",
    "cache_validate": "store=Store(cache=Cache(dir=..., validate=...))",
    "log_stats": "logging.getLogger('loader.stats').setLevel(logging.INFO)",
}
_READING = {
    "shards_inflight": "limits=Limits(concurrency=...) (files read at once: concurrency // 4)",
    "parts_inflight": "limits=Limits(concurrency=...) (ranged parts in flight per file: 4)",
    "shuffle_buffer": "reading=Reading(shuffle_buffer=...)",
    "shuffle_bytes": "limits=Limits(memory=...), of which the shuffle buffer takes a quarter",
    "part_size": "reading=Reading(part_size=...)",
    "samples_per_epoch": "split=Split(samples_per_epoch=...)",
}
DEPRECATED: dict[Mode, dict[str, str]] = {
    "objects": _LOADING,
    "mix": _LOADING,
    "shards": {**_LOADING, **_READING,
               "chunk_size": "reading=Reading(chunk_size=...)",
               "index": "reading=Reading(index=...)",
               "uneven_ranks": "split=Split(uneven_ranks=...)"},
    "parquet": {**_LOADING, **_READING,
                "row_groups_inflight": "limits=Limits(concurrency=...) (row groups read at once: "
                                       "concurrency // 4)"},
    "map": {name: _LOADING[name] for name in ("max_inflight", "retry", "listing", "cache_dir",
                                             "cache_limit", "cache_validate", "log_stats")},
}
"""Per entry point: the flat keywords of earlier releases, kept for one release, and what to
write instead."""

LANDS: dict[str, tuple[str, str]] = {
    "max_inflight": ("limits", "concurrency"), "memory_budget": ("limits", "memory"),
    "ordered": ("limits", "ordered"), "rank": ("split", "rank"), "world_size": ("split", "world_size"),
    "pad_policy": ("split", "pad"), "retry": ("store", "retry"), "listing": ("store", "listing"),
    "cache_dir": ("cache", "dir"), "cache_limit": ("cache", "limit"), "cache_validate": ("cache", "validate"),
    "queue_bytes": ("options", "queue_bytes"), "queue_items": ("options", "queue_items"),
    "log_stats": ("options", "log_stats"), "row_groups_inflight": ("reading", "shards_inflight"),
    **{name: ("reading", name) for name in ("shards_inflight", "parts_inflight", "shuffle_buffer",
                                            "shuffle_bytes", "part_size", "chunk_size", "index",
                                            "samples_per_epoch", "uneven_ranks")},
}
"""Where an old spelling's value goes: a group's field (``cache``: the ``Store``'s ``Cache``), a
field of ``Options`` itself, or (``reading``) a ``ShardOptions`` field of shards and Parquet."""
