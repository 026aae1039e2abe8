"""``LoaderOptions``: how to load (concurrency, memory, shuffling, store, cache), shared by both
datasets and validated when a dataset is built, not later in a worker."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import TypedDict

from ..config import S3Config, resolve_config
from ..engine import DEFAULT_MAX_INFLIGHT, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_ITEMS, Delivery, EngineLimits
from ..errors import ConfigError
from ..formats.objects import ON_ERROR, OnError
from ..retry import RetryPolicy
from ..stores import StoreFactory, open_store, preload_backend, resolve_backend
from ..stores.cache import CacheStats, check_cache_options, endpoint_id_for, open_cached_store
from ..stores.recording import RequestRecorder
from . import partition, topology

Transform = Callable[[dict[str, Any]], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Everything about *how* to load, shared by both modes; validated at construction."""

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
    log_stats: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None
    on_error: OnError = "raise"

    def __post_init__(self) -> None:
        if self.on_error == "skip_shard":  # the shard-only name it had before objects could skip
            object.__setattr__(self, "on_error", "skip")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r} must be one of 'raise', 'skip', 'warn'")
        self.limits("ordered")  # validates the engine settings now, not in a worker later
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"seed={self.seed!r} must be an integer or None")
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(f"transform={self.transform!r} is not callable")
        if self.pad_policy not in ("pad", "drop"):
            raise ConfigError(f"pad_policy={self.pad_policy!r} must be 'pad' or 'drop'")
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError("give rank and world_size together, or neither (then torch.distributed decides)")
        if self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank!r} must lie in [0, world_size={self.world_size!r})")
        if not callable(self.store):
            object.__setattr__(self, "store", resolve_backend(self.store))
            preload_backend(self.store)
            object.__setattr__(self, "config", resolve_config(self.config))
        cache_dir, cache_limit = check_cache_options(self.cache_dir, self.cache_limit)
        object.__setattr__(self, "cache_dir", cache_dir)  # absolute: workers may chdir
        object.__setattr__(self, "cache_limit", cache_limit)  # DEFAULT_CACHE_LIMIT when not given

    def limits(self, delivery: Delivery, max_inflight: int | None = None) -> EngineLimits:
        return EngineLimits(max_inflight=max_inflight or self.max_inflight,
                            queue_bytes=self.queue_bytes, queue_items=self.queue_items,
                            delivery=delivery)

    @property
    def effective_seed(self) -> int:
        """No seed given: a fixed default, so that every rank still agrees without talking."""
        return partition.DEFAULT_SEED if self.seed is None else self.seed

    def world(self) -> tuple[int, int]:
        """Read in ``__iter__``, never at construction (the process group may not exist yet)."""
        if self.world_size is not None:
            return self.rank, self.world_size
        return topology.world()

    def listing_factory(self) -> StoreFactory:
        """The store that lists keys and shards in the process that builds the dataset.

        obstore's native runtime does not survive ``fork()``: a process that used it forks
        DataLoader workers that hang. Listing is a one-off, so it always goes through aioboto3,
        which leaves nothing behind, and ``store="obstore"`` then works with forked workers.
        """
        if self.store == "obstore":
            return functools.partial(open_store, "aioboto3", self.config, max_connections=4,
                                     retry=self.retry)
        return self.store_factory(cached=False)

    def store_factory(self, *, cached: bool = True,
                      on_cache_close: Callable[[CacheStats], None] | None = None,
                      recorder: RequestRecorder | None = None) -> StoreFactory:
        """How the engine opens its store: a backend by name, or a user-given async factory
        (``store=`` may be one: for custom backends and for tests with an in-memory store),
        wrapped in the disk cache when ``cache_dir`` is set and ``cached`` (listings are not).
        A ``recorder`` counts the requests that reach the backend (cache hits are not)."""
        if callable(self.store):
            factory = self.store
        else:
            factory = functools.partial(open_store, self.store, self.config,
                                        max_connections=self.max_inflight, retry=self.retry)
        if recorder is not None:
            factory = recorder.wrap(factory)
        if self.cache_dir is None or not cached:
            return factory
        return functools.partial(open_cached_store, factory, self.cache_dir, self.cache_limit,
                                 endpoint_id_for(self.store, self.config), on_close=on_cache_close)


class LoaderKwargs(TypedDict, total=False):
    """The keyword arguments every constructor accepts: ``LoaderOptions``' fields, typed for
    editors and type checkers (``**options: Unpack[LoaderKwargs]``); validation stays in
    ``LoaderOptions``. A test keeps the two in step."""

    shuffle: bool
    seed: int | None
    max_inflight: int
    queue_bytes: int
    queue_items: int
    ordered: bool
    transform: Transform | None
    config: S3Config | None
    store: str | StoreFactory | None
    retry: RetryPolicy
    rank: int | None
    world_size: int | None
    pad_policy: partition.PadPolicy
    log_stats: bool
    cache_dir: str | os.PathLike[str] | None
    cache_limit: int | None
    on_error: OnError


class MapKwargs(TypedDict, total=False):
    """What ``AsyncS3MapDataset`` takes: ``LoaderKwargs`` less what its sampler decides (order,
    split across ranks) and the queue it does not have."""

    max_inflight: int
    transform: Transform | None
    config: S3Config | None
    store: str | StoreFactory | None
    retry: RetryPolicy
    log_stats: bool
    cache_dir: str | os.PathLike[str] | None
    cache_limit: int | None
    on_error: OnError


class ShardKwargs(LoaderKwargs, total=False):
    """``from_shards`` also takes how shards are read (``formats.shards.ShardOptions``) and the
    sample counts per shard."""

    shards_inflight: int
    shuffle_buffer: int
    part_size: int
    parts_inflight: int
    chunk_size: int
    sample_counts: Mapping[str, int] | None
