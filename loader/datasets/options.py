"""``LoaderOptions``: how to load (concurrency, memory, shuffling, store, cache), shared by both
datasets and validated when a dataset is built, not later in a worker."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .. import topology
from ..cache.options import DEFAULT_VALIDATE, check_cache_options
from ..checks import check_int
from ..config import S3Config
from ..engine import DEFAULT_MAX_INFLIGHT, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_ITEMS, Delivery, EngineLimits
from ..errors import ConfigError
from ..listing.keylist import ListOptions
from ..listing.versions import Versions
from ..retry import RetryPolicy
from ..s3 import StoreFactory, StoreSpec, preload_backend
from ..s3.recording import RequestRecorder
from . import partition
from .groups import MIN_MEMORY
from .object_samples import ON_ERROR, OnError

if TYPE_CHECKING:
    from ..cache.store import CacheStats
    from ..formats.shards import ShardOptions  # imported by shard mode only: a per-object start needs none

Transform = Callable[[dict[str, Any]], Any]
Mode = Literal["objects", "shards"]
MIN_MEMORY_BUDGET = MIN_MEMORY


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Everything about *how* to load, shared by both modes, as one flat record; validated at
    construction. Internal: the constructors build it from their keywords and groups
    (``Limits``, ``Split``, ``Store``: see ``groups``), and a dataset keeps it as ``options``.

    - ``shuffle``, ``seed``: a new order per epoch from ``(seed, epoch)``, the same on every rank
      (no seed: the fixed default 0, so ranks still agree).
    - ``max_inflight`` (64): requests in flight per iterating process (per-object mode; shards
      have ``shards_inflight``).
    - ``memory_budget``: bytes per iterating process for everything the loader holds; derives the
      queue, bodies in flight, shard parts and shuffle buffer (the two below included).
    - ``queue_bytes`` (256 MiB), ``queue_items`` (1024): fetched samples not yet consumed; a
      slow consumer pauses fetching.
    - ``ordered`` (True): deliver in the planned order; False: as completed.
    - ``transform``: ``dict -> anything``; its errors name the object and keep the cause.
    - ``on_error`` (``"raise"``): a bad sample raises, ``"skip"`` drops it, ``"warn"`` drops it
      with a warning.
    - ``batch_size``: the DataLoader's batch size, given to the dataset too: whole batches per
      worker in turn, and an exact resume on any number of ranks.
    - ``rank``, ``world_size``: the distributed position (default: the process group, else
      ``RANK``/``WORLD_SIZE``); ``pad_policy`` (``"pad"``): equal ranks by repeating a few
      samples, or ``"drop"`` them.
    - ``config``: an ``S3Config`` (default: from the environment); ``store``: ``"aioboto3"``
      (default, or ``$LOADER_STORE``), ``"obstore"``, or an async store factory; ``retry``: a
      ``RetryPolicy``; ``listing``: a ``ListOptions``.
    - ``cache_dir``, ``cache_limit``, ``cache_validate`` (``"listing"``): the disk cache, its
      size in bytes, and when an entry may still answer (``"listing"``, ``"always"``,
      ``"never"``).
    - ``log_stats``: log one line of statistics per worker at the end of each pass.
    """

    shuffle: bool = False
    seed: int | None = None
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_items: int = DEFAULT_QUEUE_ITEMS
    ordered: bool = True
    transform: Transform | None = None
    config: S3Config | None = None
    store: str | StoreFactory | None = None
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    rank: int | None = None
    world_size: int | None = None
    pad_policy: partition.PadPolicy = "pad"
    batch_size: int | None = None
    log_stats: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None
    on_error: OnError = "raise"
    memory_budget: int | None = None
    listing: ListOptions = dataclasses.field(default_factory=ListOptions)
    cache_validate: str = DEFAULT_VALIDATE

    def __post_init__(self) -> None:
        if self.on_error == "skip_shard":  # the shard-only name it had before objects could skip
            object.__setattr__(self, "on_error", "skip")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r} must be one of 'raise', 'skip', 'warn'")
        self.limits("ordered")  # validates the engine settings now, not in a worker later
        budget = self.memory_budget
        if budget is not None:
            check_int("memory_budget", budget, minimum=MIN_MEMORY_BUDGET,
                      must=f"a number of bytes, at least {MIN_MEMORY_BUDGET} (8 MiB), e.g. 512 << 20 "
                           "for 512 MiB")
            if self.queue_bytes >= budget:
                raise ConfigError(
                    f"queue_bytes={self.queue_bytes} leaves nothing of memory_budget={budget} for "
                    "requests in flight; give a smaller queue_bytes (the budget alone gives the "
                    "queue half in per-object mode, a quarter in shard mode), or a larger budget"
                )
        check_int("seed", self.seed, optional=True, must="an integer or None")
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(f"transform={self.transform!r} is not callable")
        if not isinstance(self.listing, ListOptions):
            raise ConfigError(f"listing={self.listing!r} must be a loader.ListOptions(...)")
        if self.pad_policy not in ("pad", "drop"):
            raise ConfigError(f"pad_policy={self.pad_policy!r} must be 'pad' or 'drop'")
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, minimum=1,
                      must="a positive integer (the DataLoader's batch size on each rank)")
            if not self.ordered:
                raise ConfigError("batch_size= deals the epoch's order in blocks, which as-completed "
                                  "delivery would mix across batches; drop ordered=False")
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError("give rank and world_size together, or neither (then torch.distributed decides)")
        if (self.rank is not None and self.world_size is not None
                and not 0 <= self.rank < self.world_size):
            raise ConfigError(f"rank={self.rank!r} must lie in [0, world_size={self.world_size!r})")
        spec = StoreSpec.of(self.store, self.config)
        object.__setattr__(self, "store", spec.store)  # a backend's name is resolved now, and
        object.__setattr__(self, "config", spec.config)  # its config, for workers to inherit
        cache_dir, cache_limit = check_cache_options(self.cache_dir, self.cache_limit,
                                                     self.cache_validate)
        object.__setattr__(self, "cache_dir", cache_dir)  # absolute: workers may chdir
        object.__setattr__(self, "cache_limit", cache_limit)  # DEFAULT_CACHE_LIMIT when not given

    def limits(self, delivery: Delivery, max_inflight: int | None = None,
               inflight_bytes: int | None = None) -> EngineLimits:
        return EngineLimits(max_inflight=max_inflight or self.max_inflight,
                            queue_bytes=self.queue_bytes, queue_items=self.queue_items,
                            delivery=delivery, inflight_bytes=inflight_bytes)

    def object_limits(self, delivery: Delivery) -> EngineLimits:
        """Per-object mode: under a ``memory_budget``, what the queue leaves of it bounds the
        bodies in flight (the engine reserves twice the largest object seen per request)."""
        budget = self.memory_budget
        return self.limits(delivery, inflight_bytes=None if budget is None else budget - self.queue_bytes)

    @property
    def effective_seed(self) -> int:
        """No seed given: a fixed default, so that every rank still agrees without talking."""
        return partition.DEFAULT_SEED if self.seed is None else self.seed

    def world(self) -> tuple[int, int]:
        """Read in ``__iter__``, never at construction (the process group may not exist yet)."""
        if self.rank is not None and self.world_size is not None:
            return self.rank, self.world_size
        return topology.world()

    def listing_factory(self) -> StoreFactory:
        """The store that lists keys and shards in the process that builds the dataset.

        obstore's native runtime does not survive ``fork()``: a process that used it forks
        DataLoader workers that hang. Listing is a one-off, so it never goes through obstore:
        ``open_listing_store`` lists with the standard library's HTTP client where it can (no
        aiohttp or botocore to import before the first sample), else through aioboto3.
        """
        spec = self._spec()
        if spec.factory is not None:
            return self.store_factory(cached=False)
        return spec.lister(max_connections=self.listing.concurrency, retry=self.retry)

    def store_factory(self, *, cached: bool = True,
                      on_cache_close: Callable[[CacheStats], None] | None = None,
                      recorder: RequestRecorder | None = None,
                      versions: Versions | None = None) -> StoreFactory:
        """How the engine opens its store: a backend by name, or a user-given async factory
        (``store=`` may be one: for custom backends and for tests with an in-memory store),
        wrapped in the disk cache when ``cache_dir`` is set and ``cached`` (listings are not).
        A ``recorder`` counts the requests that reach the backend (cache hits are not).
        ``versions``: the ETags the dataset's key list gave, which the cache checks its entries
        against (``cache_validate="listing"``)."""
        spec = self._spec()
        factory = spec.opener(max_connections=self.max_inflight, retry=self.retry)
        if recorder is not None:
            factory = recorder.wrap(factory)
        if self.cache_dir is None or not cached:
            return factory
        assert self.cache_limit is not None  # __post_init__ gave the default
        from ..cache.store import open_cached_store  # only where a cache is asked for

        return functools.partial(open_cached_store, factory, self.cache_dir, self.cache_limit,
                                 spec.identity, validate=self.cache_validate,
                                 on_close=on_cache_close, versions=versions)

    def preload_backend(self) -> None:
        """Import the backend that will read, in the process that builds the dataset, before
        any DataLoader worker forks (``loader.s3.preload_backend``). Sources call it: at once,
        or, one that lists, while its listing's pages arrive (the import then costs the first
        sample nothing)."""
        spec = self._spec()
        if spec.backend is not None:
            preload_backend(spec.backend, spec.config)

    def _spec(self) -> StoreSpec:
        """``store=`` and ``config=`` as ``__post_init__`` resolved them."""
        return StoreSpec.of(self.store, self.config)


def warn_direct_construction(name: str, sources: str, *, shards: bool) -> None:
    """The one way to build a dataset is a constructor (``from_prefix``, ...); the keywords of
    ``__init__`` that described a source still work for one release, with this warning."""
    constructors = "from_keys(bucket, keys), from_prefix('s3://bucket/prefix/'), from_manifest(path)"
    if shards:
        constructors += ", from_shards(pattern) or from_parquet(files)"
    warnings.warn(
        f"{name}(bucket=, {sources}, options=LoaderOptions(...)) is deprecated and will be removed "
        f"in the next release: build it with {name}.{constructors}, whose keywords and option groups "
        "(Limits, Split, Store, Reading) replace LoaderOptions", DeprecationWarning, stacklevel=3)


# ------------------------------------------------------------------------ one memory budget
#
# ``memory_budget`` is bytes per iterating process (each DataLoader worker has its own). It is
# split the way Mountpoint's memory target splits, into fixed shares whose sum is the budget:
#
#   per-object mode   queue_bytes = budget / 2; bodies in flight = the rest, reserved per request
#                     by the engine (twice the largest object seen), so max_inflight adapts to
#                     the object size
#   shard mode        queue_bytes = budget / 4; the shuffle buffer (with shuffle=True) = budget / 4,
#                     in bytes as well as in samples; shards in flight x shard_read_bytes = the
#                     rest (each part fetched ahead held twice while it arrives, plus the one
#                     being parsed; a streamed shard holds at most that in chunks and the member
#                     it assembles)
#
# Knobs given explicitly win and the others are derived from what is left; a combination of
# explicit knobs that exceeds the budget is a ConfigError that names them (clamping silently
# would hide that the knobs the user chose are not the ones in force).

_SHARD_KNOBS = ("shards_inflight", "parts_inflight", "part_size", "chunk_size")


def shard_read_bytes(parts_inflight: int, part_size: int) -> int:
    """What one shard being read may hold: ``parts_inflight`` parts fetched ahead, each twice
    for a moment as it arrives (the HTTP client's pieces, then the joined body; measured: RSS
    went 15-30 MiB past a 128 MiB budget when parts counted once), and the part being parsed."""
    return (2 * parts_inflight + 1) * part_size


def budget_options(options: Mapping[str, Any], mode: Mode) -> dict[str, Any]:
    """``options`` (constructor keywords) plus the knobs ``memory_budget`` derives, for those
    not given. Without a budget, ``options`` unchanged."""
    out = dict(options)
    budget = out.get("memory_budget")
    if budget is None or not isinstance(budget, int) or budget < MIN_MEMORY_BUDGET:
        return out  # validated (with a message) by LoaderOptions
    if mode == "objects":
        out.setdefault("queue_bytes", budget // 2)
        return out
    from ..formats.shards import (
        DEFAULT_CHUNK_SIZE,
        DEFAULT_PART_SIZE,
        DEFAULT_PARTS_INFLIGHT,
        DEFAULT_SHARDS_INFLIGHT,
        MIN_PART_SIZE,
    )

    queue = out.setdefault("queue_bytes", budget // 4)
    shuffle_bytes = out.setdefault("shuffle_bytes", budget // 4 if out.get("shuffle") else None) or 0
    reads = budget - queue - shuffle_bytes
    shards = out.get("shards_inflight", DEFAULT_SHARDS_INFLIGHT)
    parts = out.get("parts_inflight", DEFAULT_PARTS_INFLIGHT)
    part = out.get("part_size", DEFAULT_PART_SIZE)
    if not all(isinstance(v, int) and v > 0 for v in (shards, parts, part, reads)):
        return out  # a bad knob: ShardOptions / the check below say which
    # shrink what was not given, the part size first (it costs least), then parts, then shards
    if shards * shard_read_bytes(parts, part) > reads and "part_size" not in options:
        part = max(MIN_PART_SIZE, reads // (shards * shard_read_bytes(parts, 1)))
    if shards * shard_read_bytes(parts, part) > reads and "parts_inflight" not in options:
        parts = max(1, (reads // (shards * part) - 1) // 2)
    if shards * shard_read_bytes(parts, part) > reads and "shards_inflight" not in options:
        shards = max(1, reads // shard_read_bytes(parts, part))
    out.update(shards_inflight=shards, parts_inflight=parts, part_size=part)
    out["chunk_size"] = min(out.get("chunk_size", DEFAULT_CHUNK_SIZE), part)
    return out


def check_budget(options: LoaderOptions, shard_options: ShardOptions | None) -> None:
    """Raise ConfigError when the knobs in force exceed ``memory_budget`` (shard mode; per-object
    mode is checked by ``LoaderOptions``), naming each share."""
    budget = options.memory_budget
    if budget is None or shard_options is None:
        return
    s = shard_options
    shuffle = (s.shuffle_bytes or 0) if options.shuffle else 0
    reads = s.shards_inflight * shard_read_bytes(s.parts_inflight, s.part_size)
    total = options.queue_bytes + shuffle + reads
    if total > budget:
        raise ConfigError(
            f"these settings hold up to {total} bytes, more than Limits(memory={budget}): the queue's "
            f"{options.queue_bytes} + the shuffle buffer's {shuffle} + {s.shards_inflight} files read at "
            f"once x (2 x {s.parts_inflight} parts in flight + 1) x Reading(part_size={s.part_size}) "
            "(a part is held twice while it arrives). Lower what you set (Limits(concurrency=), "
            "Reading(part_size=), or drop them and let the budget decide), or raise Limits(memory=)"
        )
