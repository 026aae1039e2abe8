"""``AsyncS3Dataset``: an ``IterableDataset`` that streams samples from S3 through a ``FetchEngine``.

The dataset object is a picklable description (bucket, keys or prefix, options). It opens no
connection and starts no thread until ``__iter__`` runs, in whichever process iterates: the main
process with ``num_workers=0``, else each DataLoader worker. There it works out its share of the
epoch (``partition.py``: rank, then worker, from ``(seed, epoch)``), builds an engine, and yields
samples, transformed if asked. When the iteration ends for any reason the engine is closed and
only a statistics snapshot is kept: nothing that points at an event loop survives it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from . import partition, topology
from .config import S3Config, resolve_config
from .engine import DEFAULT_MAX_INFLIGHT, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_ITEMS, EngineLimits, EngineStats, FetchEngine
from .errors import ConfigError, SampleError
from .jobs import object_job
from .retry import RetryPolicy
from .sources import check_keys, list_prefix, read_manifest
from .stores import StoreFactory, open_store, resolve_backend
from .uri import parse_s3_uri

log = logging.getLogger(__name__)

Transform = Callable[[dict[str, Any]], Any]
STATE_VERSION = 1


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

    def __post_init__(self) -> None:
        EngineLimits(max_inflight=self.max_inflight, queue_bytes=self.queue_bytes,
                     queue_items=self.queue_items, ordered=self.ordered)
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
            object.__setattr__(self, "config", resolve_config(self.config))

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(max_inflight=self.max_inflight, queue_bytes=self.queue_bytes,
                            queue_items=self.queue_items, ordered=self.ordered)

    @property
    def effective_seed(self) -> int:
        """No seed given: a fixed default, so that every rank still agrees without talking."""
        return partition.DEFAULT_SEED if self.seed is None else self.seed

    def world(self) -> tuple[int, int]:
        """Read in ``__iter__``, never at construction (the process group may not exist yet)."""
        if self.world_size is not None:
            return self.rank, self.world_size
        return topology.world()

    def store_factory(self) -> StoreFactory:
        """How the engine opens its store: a backend by name, or a user-given async factory
        (``store=`` may be one: for custom backends and for tests with an in-memory store)."""
        if callable(self.store):
            return self.store
        return functools.partial(open_store, self.store, self.config,
                                 max_connections=self.max_inflight, retry=self.retry)


class AsyncS3Dataset(IterableDataset):
    """Stream samples from S3 with many concurrent GETs; build with ``from_prefix``/``from_keys``.

    Samples are dicts in the WebDataset convention (``__key__``, ``__url__``, extension → bytes),
    passed through ``transform`` when given. Call ``set_epoch(e)`` before each epoch for a new
    deterministic order (with ``shuffle=True``). ``len()`` is the number of samples this rank
    yields per epoch.
    """

    def __init__(
        self,
        bucket: str,
        *,
        keys: Iterable[str] | None = None,
        prefix: str | None = None,
        options: LoaderOptions | None = None,
    ) -> None:
        super().__init__()
        if (keys is None) == (prefix is None):
            raise ConfigError("give exactly one of keys=... or prefix=...")
        self.bucket = bucket
        self.prefix = prefix
        self.options = options or LoaderOptions()
        self._keys: tuple[str, ...] | None = None if keys is None else check_keys(bucket, keys)
        self.epoch = 0
        self._resume: dict[str, Any] | None = None
        self._delivered: list[int] = []
        self._last_stats: EngineStats | None = None

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_prefix(cls, uri: str, **options: Any) -> AsyncS3Dataset:
        """Every object under ``s3://bucket/prefix/``, listed once when first needed."""
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix=prefix, options=LoaderOptions(**options))

    @classmethod
    def from_keys(cls, bucket: str, keys: Iterable[str], **options: Any) -> AsyncS3Dataset:
        """Exactly these keys of ``bucket`` (no listing, no HEAD: one GET per sample)."""
        if bucket.startswith("s3://"):
            bucket = parse_s3_uri(bucket).bucket
        return cls(bucket, keys=keys, options=LoaderOptions(**options))

    @classmethod
    def from_manifest(cls, path: str, bucket: str | None = None, **options: Any) -> AsyncS3Dataset:
        """Keys from a text file, one per line (plain keys with ``bucket=``, or ``s3://`` URIs)."""
        bucket, keys = read_manifest(path, bucket)
        return cls(bucket, keys=keys, options=LoaderOptions(**options))

    # ----------------------------------------------------------------------- epoch control

    def keys(self) -> tuple[str, ...]:
        """The full key list, listing the prefix now if that has not happened yet."""
        if self._keys is None:
            found = list_prefix(
                f"s3://{self.bucket}/{self.prefix}", factory=self.options.store_factory(),
                retry=self.options.retry,
            )
            self._keys = tuple(info.key for info in found)
            log.info("listed %d objects under s3://%s/%s", len(self._keys), self.bucket, self.prefix)
        return self._keys

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (also lists, if needed, so
        that DataLoader workers inherit the key list instead of each listing again)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        self.keys()
        if epoch != self.epoch:
            self._resume = None
        self.epoch = epoch

    def __len__(self) -> int:
        _, world_size = self.options.world()
        return partition.rank_length(len(self.keys()), world_size, self.options.pad_policy)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawned workers: list here, once, rather than in every worker.
        self.keys()
        return self.__dict__.copy()

    # ----------------------------------------------------------------------- iteration

    def plan(self) -> list[int]:
        """Positions (into ``keys()``) that this rank and worker read this epoch, in order."""
        rank, world_size = self.options.world()
        worker, num_workers = topology.worker()
        return partition.partition(
            len(self.keys()), seed=self.options.effective_seed, epoch=self.epoch,
            shuffle=self.options.shuffle, rank=rank, world_size=world_size,
            worker=worker, num_workers=num_workers, policy=self.options.pad_policy,
        )

    def __iter__(self) -> Iterator[Any]:
        keys = self.keys()
        slots = list(enumerate(self.plan()))  # (slot in this worker's plan, position in keys)
        done = self._resumed_slots(len(slots))
        self._delivered = sorted(done)
        todo = [(slot, pos) for slot, pos in slots if slot not in done]
        jobs = (object_job(self.bucket, keys[pos], slot) for slot, pos in todo)
        engine = FetchEngine(jobs, self.options.store_factory(), limits=self.options.limits,
                             retry=self.options.retry, name="loader-engine")
        try:
            for slot, sample in engine:
                self._delivered.append(slot)
                yield self._transform(sample)
        finally:
            engine.close()
            self._last_stats = engine.statistics()
            self._resume = None

    def _transform(self, sample: dict[str, Any]) -> Any:
        transform = self.options.transform
        if transform is None:
            return sample
        try:
            return transform(sample)
        except Exception as exc:
            raise SampleError(
                f"transform {getattr(transform, '__name__', transform)!r} failed on "
                f"{sample.get('__url__')}: {type(exc).__name__}: {exc}",
                url=sample.get("__url__", ""),
            ) from exc

    # ----------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Where this process is in the epoch: enough to skip what it already delivered."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.options.effective_seed,
            "num_keys": len(self.keys()),
            "delivered": list(self._delivered),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips the samples already delivered."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["num_keys"] != len(self.keys()) or state["seed"] != self.options.effective_seed:
            raise ConfigError(
                "this state was saved for a different data set or seed "
                f"({state['num_keys']} keys, seed {state['seed']}); resume with the same ones"
            )
        self.epoch = state["epoch"]
        self._resume = state

    def _resumed_slots(self, plan_length: int) -> set[int]:
        if self._resume is None or self._resume["epoch"] != self.epoch:
            return set()
        return {slot for slot in self._resume["delivered"] if 0 <= slot < plan_length}

    def stats(self) -> EngineStats | None:
        """Counters of the last finished iteration in this process (None before the first)."""
        return self._last_stats

    def __repr__(self) -> str:
        what = f"{len(self._keys)} keys" if self._keys is not None else f"prefix {self.prefix!r}"
        return (f"AsyncS3Dataset(s3://{self.bucket}, {what}, shuffle={self.options.shuffle}, "
                f"max_inflight={self.options.max_inflight}, store={self.options.store!r})")
