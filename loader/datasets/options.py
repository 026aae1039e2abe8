"""``Options``: how to load (the option groups and the keywords every entry point takes),
one record shared by both datasets and validated when a dataset is built, not later in a
worker; and how one memory budget is split among the queue, the shuffle buffer and the reads."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .. import topology
from ..cache.options import DEFAULT_VALIDATE, check_cache_options, check_validate
from ..checks import check_int
from ..config import S3Config
from ..engine import DEFAULT_MAX_INFLIGHT, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_ITEMS, Delivery, EngineLimits
from ..errors import ConfigError
from ..listing.versions import Versions
from ..s3 import StoreFactory, StoreSpec, preload_backend
from ..s3.recording import RequestRecorder
from . import partition
from .groups import DEPRECATED, LANDS, MIN_MEMORY, Cache, Limits, Mode, Reading, Split, Store
from .object_samples import ON_ERROR, OnError

if TYPE_CHECKING:
    from ..cache.store import CacheStats
    from ..formats.shards import ShardOptions  # imported by shard mode only: a per-object start needs none

Transform = Callable[[dict[str, Any]], Any]
MIN_MEMORY_BUDGET = MIN_MEMORY
DEFAULT_UNIT_BYTES = 32 << 20
"""Parquet's row groups are read in units of up to this many bytes (``Reading(part_size=)``):
ranged GETs as large as pyarrow's own read coalescing makes them (its ``range_size_limit``), see
``formats.parquet.coalesce``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """What a dataset was asked for, as one record: the keywords every entry point takes flat
    and the option groups (``Limits``, ``Split``, ``Store``), resolved once by ``dataset_options``
    (a backend's name and the config from the environment, the cache's folder made absolute).
    A dataset keeps it as ``options``; its sources read it.

    ``queue_bytes``, ``queue_items``: the queue of fetched samples not yet consumed, the share of
    ``Limits.memory`` the mode gives it (set alone only by the deprecated spellings).
    ``log_stats``: deprecated; the level of the logger named "loader.stats" says the same. For shards and
    Parquet, ``Limits.concurrency`` is read as files at once (``ShardOptions.shards_inflight``),
    and is None here.
    """

    shuffle: bool = False
    seed: int | None = None
    transform: Transform | None = None
    batch_size: int | None = None
    on_error: OnError = "raise"
    config: S3Config | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    split: Split = dataclasses.field(default_factory=Split)
    store: Store = dataclasses.field(default_factory=Store)
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_items: int = DEFAULT_QUEUE_ITEMS
    log_stats: bool = False

    def __post_init__(self) -> None:
        if self.on_error == "skip_shard":  # the shard-only name it had before objects could skip
            object.__setattr__(self, "on_error", "skip")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r} must be one of 'raise', 'skip', 'warn'")
        self.engine_limits("ordered")  # validates the engine settings now, not in a worker later
        budget = self.limits.memory
        if budget is not None and self.queue_bytes >= budget:
            raise ConfigError(
                f"queue_bytes={self.queue_bytes} leaves nothing of memory_budget={budget} for "
                "requests in flight; give a smaller queue_bytes (the budget alone gives the "
                "queue half in per-object mode, a quarter in shard mode), or a larger budget"
            )
        check_int("seed", self.seed, optional=True, must="an integer or None")
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(f"transform={self.transform!r} is not callable")
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, minimum=1,
                      must="a positive integer (the DataLoader's batch size on each rank)")
            if not self.limits.ordered:
                raise ConfigError("batch_size= deals the epoch's order in blocks, which as-completed "
                                  "delivery would mix across batches; drop Limits(ordered=False)")
        rank, world_size = self.split.rank, self.split.world_size
        if (rank is None) != (world_size is None):
            raise ConfigError("give rank and world_size together, or neither (then torch.distributed decides)")
        if rank is not None and world_size is not None and not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank!r} must lie in [0, world_size={world_size!r})")
        spec = StoreSpec.of(self.store.backend, self.config)  # a backend's name is resolved now,
        object.__setattr__(self, "config", spec.config)  # and its config, for workers to inherit
        cache = self.store.cache
        assert cache is None or isinstance(cache, Cache)  # Store.__post_init__ made it one
        folder, limit = check_cache_options(None if cache is None else cache.dir,
                                            None if cache is None else cache.limit,
                                            DEFAULT_VALIDATE if cache is None else cache.validate)
        object.__setattr__(self, "store", dataclasses.replace(
            self.store, backend=spec.store,  # the cache's folder absolute: workers may chdir
            cache=None if folder is None or cache is None else Cache(folder, limit, cache.validate)))

    def __getattr__(self, name: str) -> Any:
        """A flat field of ``LoaderOptions`` (``max_inflight``, ``cache_dir``... read from ``ds.options``)
        still reads for one release, with a warning naming where it lives now."""
        group, field = LANDS.get(name, ("", ""))
        if group not in ("limits", "split", "store", "cache"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        where = "store.cache" if group == "cache" else group
        warnings.warn(f"options.{name} is deprecated and will be removed in the next release: read "
                      f"options.{where}.{field}", DeprecationWarning, stacklevel=2)
        if name == "max_inflight":
            return self.concurrency  # its default was the engine's
        holder = self.store.cache if group == "cache" else getattr(self, group)
        return None if holder is None else getattr(holder, field)

    @property
    def concurrency(self) -> int:
        """Requests in flight per iterating process (per-object mode; shards count files)."""
        return self.limits.concurrency or DEFAULT_MAX_INFLIGHT

    def engine_limits(self, delivery: Delivery, max_inflight: int | None = None,
                      inflight_bytes: int | None = None) -> EngineLimits:
        return EngineLimits(max_inflight=max_inflight or self.concurrency,
                            queue_bytes=self.queue_bytes, queue_items=self.queue_items,
                            delivery=delivery, inflight_bytes=inflight_bytes)

    def object_limits(self, delivery: Delivery) -> EngineLimits:
        """Per-object mode: under ``Limits(memory=)``, what the queue leaves of it bounds the
        bodies in flight (the engine reserves twice the largest object seen per request)."""
        budget = self.limits.memory
        return self.engine_limits(delivery, inflight_bytes=None if budget is None else budget - self.queue_bytes)

    @property
    def effective_seed(self) -> int:
        """No seed given: a fixed default, so that every rank still agrees without talking."""
        return partition.DEFAULT_SEED if self.seed is None else self.seed

    def world(self) -> tuple[int, int]:
        """Read in ``__iter__``, never at construction (the process group may not exist yet)."""
        if self.split.rank is not None and self.split.world_size is not None:
            return self.split.rank, self.split.world_size
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
        return spec.lister(max_connections=self.store.listing.concurrency, retry=self.store.retry)

    def store_factory(self, *, cached: bool = True,
                      on_cache_close: Callable[[CacheStats], None] | None = None,
                      recorder: RequestRecorder | None = None,
                      versions: Versions | None = None) -> StoreFactory:
        """How the engine opens its store: a backend by name, or a user-given async factory
        (``Store(backend=)`` may be one: for custom backends and for tests with an in-memory
        store), wrapped in the disk cache when ``Store(cache=)`` is set and ``cached`` (listings
        are not). A ``recorder`` counts the requests that reach the backend (cache hits are not).
        ``versions``: the ETags the dataset's key list gave, which the cache checks its entries
        against (``Cache(validate="listing")``)."""
        spec = self._spec()
        factory = spec.opener(max_connections=self.concurrency, retry=self.store.retry)
        if recorder is not None:
            factory = recorder.wrap(factory)
        cache = self.store.cache
        if cache is None or not cached:
            return factory
        assert isinstance(cache, Cache) and cache.limit is not None  # __post_init__ resolved it
        from ..cache.store import open_cached_store  # only where a cache is asked for

        return functools.partial(open_cached_store, factory, os.fspath(cache.dir), cache.limit,
                                 spec.identity, validate=cache.validate,
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
        """``Store(backend=)`` and ``config=`` as ``__post_init__`` resolved them."""
        return StoreSpec.of(self.store.backend, self.config)


_COMMON = ("shuffle", "seed", "transform", "batch_size", "on_error", "config")


def dataset_options(mode: Mode, *, limits: Limits | None = None, split: Split | None = None,
                    store: str | StoreFactory | Store | None = None, reading: Reading | None = None,
                    old: Mapping[str, Any] | None = None, stacklevel: int = 3,
                    **common: Any) -> tuple[Options, dict[str, Any]]:
    """An entry point's keywords as the record its dataset keeps, and, for shards and Parquet,
    the reading knobs given (``ShardOptions``' fields: only those chosen, so what ``memory``
    derives still knows which were). ``common``: ``shuffle``, ``seed``... as given; ``old``: the
    flat spellings of earlier releases, each warned about and put where ``LANDS`` says. Unknown
    ``old`` names are a TypeError, as Python gives for any unexpected keyword. ``stacklevel``:
    the user's call, seen from here (3: the entry point called this)."""
    for name, value, kind in (("limits", limits, Limits), ("split", split, Split), ("reading", reading, Reading)):
        if value is not None and not isinstance(value, kind):
            raise ConfigError(f"{name}={value!r} must be a loader.{kind.__name__}(...)")
    if isinstance(store, Cache):
        raise ConfigError(f"store={store!r}: a Cache goes inside a Store; pass store=Store(cache=Cache(...))")
    groups: dict[str, Any] = {"limits": limits or Limits(), "split": split or Split(),
                              "store": store if isinstance(store, Store) else Store(backend=store)}
    reading = reading or Reading()
    check_groups(mode, groups["split"], reading)
    knobs: dict[str, Any] = {}  # ShardOptions' fields, as given
    if mode in ("shards", "parquet"):
        # imported here: a per-object start imports no shard module
        from ..formats.shards import DEFAULT_PARTS_INFLIGHT, MIN_PART_SIZE, ShardOptions, part_size_too_small

        concurrency = groups["limits"].concurrency
        if concurrency is not None:  # files at once, each with its parts in flight
            parts = (old or {}).get("parts_inflight", DEFAULT_PARTS_INFLIGHT)
            knobs["shards_inflight"] = max(1, concurrency // max(1, parts))
            groups["limits"] = dataclasses.replace(groups["limits"], concurrency=None)
        knobs.update((name, value) for name, value in (
            *vars(reading).items(), ("samples_per_epoch", groups["split"].samples_per_epoch),
            ("uneven_ranks", groups["split"].uneven_ranks or None)) if value is not None)
    own: dict[str, Any] = {}  # queue_bytes, queue_items, log_stats
    cache: dict[str, Any] = {}
    spellings = DEPRECATED[mode]
    for name, value in (old or {}).items():
        if name not in spellings:
            raise TypeError(f"unexpected keyword argument {name!r}")
        warnings.warn(f"{name}= is deprecated and will be removed in the next release: write "
                      f"{spellings[name]}", DeprecationWarning, stacklevel=stacklevel)
        group, field = LANDS[name]
        if group == "reading":
            given = field in knobs
            knobs[field] = value
        elif group == "options":
            given = False
            own[field] = value
        elif group == "cache":
            given = groups["store"].cache is not None
            cache[field] = value
        else:
            given = getattr(groups[group], field) != getattr(type(groups[group])(), field)
            try:
                groups[group] = dataclasses.replace(groups[group], **{field: value})
            except ConfigError as exc:
                raise ConfigError(f"{name}={value!r} must be what {spellings[name]} takes: {exc}") from None
        if given:
            raise ConfigError(f"{name}={value!r} and its new spelling {spellings[name]} are both given; "
                              "keep the new one")
    if cache:
        check_validate(cache.get("validate", DEFAULT_VALIDATE))
        if "dir" not in cache:
            name = next(iter(cache))
            raise ConfigError(f"cache_{name}={cache[name]!r} needs cache_dir= (the directory to cache in)")
        groups["store"] = dataclasses.replace(groups["store"], cache=Cache(**cache))
    memory = groups["limits"].memory
    if memory is not None:  # the queue's share of the budget
        own.setdefault("queue_bytes", memory // 2 if mode in ("objects", "mix", "map") else memory // 4)
    if mode == "shards":
        knobs = budget_options({**knobs, **own, "memory_budget": memory, "shuffle": common.get("shuffle")},
                               "shards")
        own["queue_bytes"] = knobs.get("queue_bytes", own.get("queue_bytes", DEFAULT_QUEUE_BYTES))
        fields = {field.name for field in dataclasses.fields(ShardOptions)}
        knobs = {name: value for name, value in knobs.items() if name in fields}
    elif mode == "parquet":  # row groups: the shuffle buffer a quarter of the budget, 32 MiB parts
        if memory is not None and common.get("shuffle"):
            knobs.setdefault("shuffle_bytes", memory // 4)
        part = knobs.setdefault("part_size", DEFAULT_UNIT_BYTES)
        if isinstance(part, int) and not isinstance(part, bool) and 0 < part < MIN_PART_SIZE:
            raise ConfigError(part_size_too_small(part, "32 MiB for Parquet"))
    common = {name: value for name, value in common.items() if value is not None}
    return Options(**common, **groups, **own), knobs


def check_groups(mode: Mode, split: Split, reading: Reading) -> None:
    """The groups' fields that only some entry points read, refused elsewhere."""
    if mode not in ("shards", "parquet") and split.samples_per_epoch is not None:
        raise ConfigError("Split(samples_per_epoch=) is for shards and Parquet; an epoch of "
                          f"{'a mix is mix(samples_per_epoch=)' if mode == 'mix' else 'objects is every sample'}")
    if mode != "shards" and split.uneven_ranks:
        raise ConfigError("Split(uneven_ranks=True) is for shards whose counts are unknown")
    if reading != Reading():
        if mode not in ("shards", "parquet"):
            raise ConfigError("reading=Reading(...) is for shards and Parquet files")
        if mode == "parquet" and (reading.chunk_size is not None or reading.index is not None):
            raise ConfigError("Reading(chunk_size=, index=) are for shards; Parquet reads row groups "
                              "in parts of Reading(part_size=)")


# what means nothing to AsyncS3MapDataset (by the flat names), and what decides instead
_SAMPLER_DECIDES = ("shuffle", "seed", "ordered", "rank", "world_size", "pad_policy", "batch_size")
_NO_QUEUE = ("queue_bytes", "queue_items", "memory_budget")


def map_options(transform: Transform | None, on_error: OnError, limits: Limits | None,
             store: str | StoreFactory | Store | None, config: S3Config | None,
             deprecated: Mapping[str, Any]) -> Options:
    """``AsyncS3MapDataset``'s keywords as ``Options``; of ``Limits`` only ``concurrency`` applies."""
    if limits is not None and (limits.memory is not None or not limits.ordered):
        raise ConfigError(
            f"limits={limits!r}: AsyncS3MapDataset takes only Limits(concurrency=); it has no queue "
            "(memory is one batch of objects, batch_size x object size) and the sampler decides order")
    _check_sampler_free(deprecated)  # their old flat spellings: say why, not "unexpected"
    options, _ = dataset_options("map", transform=transform, on_error=on_error, limits=limits, store=store,
                                 config=config, old=deprecated, stacklevel=4)
    return options


def _check_sampler_free(given: Mapping[str, Any]) -> None:
    """Refuse what a sampler decides, or a queue this dataset does not have."""
    for name in given:
        if name in _SAMPLER_DECIDES:
            raise ConfigError(
                f"{name}={given[name]!r} means nothing for AsyncS3MapDataset: in a map-style "
                "dataset the sampler decides order and the split across ranks (use "
                "DataLoader(shuffle=True), RandomSampler(generator=...) or "
                "DistributedSampler(shuffle=..., seed=...) and its set_epoch)"
            )
        if name in _NO_QUEUE:
            raise ConfigError(
                f"{name}={given[name]!r} means nothing for AsyncS3MapDataset: it has no queue; "
                "memory is one batch of objects (batch_size x object size)"
            )


def check_map_options(options: Options) -> None:
    """The same rule for ``Options`` passed to ``AsyncS3MapDataset.__init__`` directly."""
    split, limits = options.split, options.limits
    given = {"shuffle": options.shuffle, "seed": options.seed, "ordered": limits.ordered,
             "rank": split.rank, "world_size": split.world_size, "pad_policy": split.pad,
             "batch_size": options.batch_size, "queue_bytes": options.queue_bytes,
             "queue_items": options.queue_items, "memory_budget": limits.memory}
    unset = {"shuffle": False, "ordered": True, "pad_policy": Split().pad,
             "queue_bytes": DEFAULT_QUEUE_BYTES, "queue_items": DEFAULT_QUEUE_ITEMS}
    changed = {name: value for name, value in given.items() if value != unset.get(name)}
    if changed:
        _check_sampler_free(changed)


_MIX_DECIDES: dict[str, Callable[[Options], Any]] = {  # an old spelling (what the message names) -> where it lives now
    "batch_size": lambda o: o.batch_size, "rank": lambda o: o.split.rank,
    "world_size": lambda o: o.split.world_size, "pad_policy": lambda o: o.split.pad,
    "max_inflight": lambda o: o.limits.concurrency, "queue_bytes": lambda o: o.queue_bytes,
    "queue_items": lambda o: o.queue_items, "memory_budget": lambda o: o.limits.memory,
    "store": lambda o: o.store.backend, "config": lambda o: o.config, "cache_dir": lambda o: o.store.cache,
}


def check_mix_part(name: str, given: Options, mix_options: Options) -> None:
    """How to load is the mix's: a source that set it differently would be silently overruled."""
    defaults = Options()
    for field, read in _MIX_DECIDES.items():
        value = read(given)
        if field in ("store", "config"):
            if value != read(mix_options):
                raise ConfigError(
                    f"mix source {name!r} reads through another {field} than the mix; give {field}= "
                    "to mix(...) and use one endpoint and store for all sources")
            continue
        if value != read(defaults) and value != read(mix_options):
            new = DEPRECATED["mix"].get(field, f"{field}=...")
            raise ConfigError(f"mix source {name!r} sets {field}={value!r}: in a mix that is the "
                              f"mix's setting; give {new} to mix(...) instead")


def LoaderOptions(**flat: Any) -> Options:
    """The flat record of earlier releases (``loader.LoaderOptions``, deprecated there): its
    keywords, the old flat spellings, land on ``Options``' groups here, once."""
    common = {name: flat.pop(name) for name in _COMMON if name in flat}
    with warnings.catch_warnings():  # ``loader.LoaderOptions`` warned already, naming the groups
        warnings.simplefilter("ignore", DeprecationWarning)
        options, _ = dataset_options("objects", store=flat.pop("store", None), old=flat, **common)
    return options


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
# ``Limits(memory=)`` is bytes per iterating process (each DataLoader worker has its own). It is
# split the way Mountpoint's memory target splits, into fixed shares whose sum is the budget:
#
#   per-object mode   queue_bytes = budget / 2; bodies in flight = the rest, reserved per request
#                     by the engine (twice the largest object seen), so requests in flight adapt to
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


def check_budget(options: Options, shard_options: ShardOptions | None) -> None:
    """Raise ConfigError when the knobs in force exceed ``Limits(memory=)`` (shard mode; per-object
    mode is checked by ``Options``), naming each share."""
    budget = options.limits.memory
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
