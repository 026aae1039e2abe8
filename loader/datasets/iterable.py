"""``AsyncS3Dataset``: an ``IterableDataset`` that streams a source's samples through a ``FetchEngine``.

The dataset is a picklable description: a source (``object_source``, ``shard_source``) and
options. It opens no connection and starts no thread until ``__iter__`` runs in the process that
iterates; there it works out its slot's share of the epoch, builds an engine, and yields samples.
When the iteration ends the engine is closed and only a statistics snapshot is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from multiprocessing.context import get_spawning_popen
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

from .. import topology
from ..config import S3Config
from ..engine.core import Jobs
from ..engine.fetch import EngineLimits, FetchEngine
from ..errors import ConfigError, SampleError, say_skipped
from ..lifecycle import LiveObjects
from ..listing.inputs import read_manifest
from ..listing.snapshots import is_snapshot, saved_snapshot, snapshot_option, snapshot_uri
from ..s3 import StoreFactory
from ..s3.recording import RequestRecorder
from ..uri import parse_s3_uri
from . import partition
from .groups import Limits, Reading, Split, Store
from .object_samples import LabelFrom, OnError, SampleIndex, Skipped, skippable
from .object_source import ObjectSource
from .options import Options, Transform, dataset_options, warn_direct_construction
from .protocol import Progress, Slot, Source
from .stats import MAX_WORKERS, StatsBoard, StepWaits, report, summarize, timed

if TYPE_CHECKING:  # the disk cache and the shard modules are imported where they are used, so
    from ..cache.store import CacheStats  # a per-object dataset starts without either
    from ..formats.shards import ShardOptions, ShardRef

log = logging.getLogger(__name__)
stats_log = logging.getLogger("loader.stats")
"""One line per worker and pass, at INFO, when this logger's level is set."""

STATE_VERSION = 3
"""2: shuffled orders of more than ``partition.SMALL_ORDER`` items are a keyed permutation
computed per index; version 1 states are accepted only where their order is unchanged.
3: shuffled shards and row groups are read in lanes (``lanes``); version 2 states are accepted
only where their order is unchanged (objects, or not shuffled)."""


class AsyncS3Dataset(IterableDataset):
    """Stream samples from S3 with many requests in flight. Build it with a constructor:

    * ``from_prefix("s3://b/train/")``, ``from_keys(bucket, keys)``, ``from_manifest(path)``:
      objects sharing a stem (``a/1.jpg``, ``a/1.cls``) form one sample, ``Limits(concurrency=)``
      samples fetched at a time; ``label_from="parent"`` adds the class index as ``"cls"``;
    * ``from_shards("s3://b/train-{0000..0127}.tar")``: WebDataset tar shards streamed and
      parsed on the fly, ``Limits(concurrency=) // 4`` at a time, mixed by a shuffle buffer;
    * ``from_parquet("s3://b/data/", columns=[...])``: rows of Parquet files, row group by row
      group, only the selected columns fetched.

    Samples are dicts in the WebDataset convention (``__key__``, ``__url__``, extension → bytes),
    passed through ``transform``. Call ``set_epoch(e)`` before each epoch: with ``shuffle=True``
    the order follows ``(seed, epoch)``, the same on every rank.

    Every constructor takes the same keywords besides its source's own: ``shuffle``, ``seed``,
    ``transform``, ``batch_size``, ``on_error`` (``"raise"``; ``"skip"`` or ``"warn"`` drop a
    sample whose object is gone or whose transform raised), ``config`` (an ``S3Config``;
    default: from the environment), and three groups: ``limits=Limits(concurrency=,
    memory=, ordered=)``, ``split=Split(rank=, world_size=, pad=, ...)`` and
    ``store=Store(backend=, retry=, listing=, cache=)`` (or a backend's name: ``"obstore"``).

    ``batch_size=B`` (the DataLoader's batch size per rank) deals the epoch's order in blocks:
    at step ``s`` rank ``r`` reads block ``s * W + r``, so ``s`` steps consume exactly the first
    ``s * B * W`` samples whatever the number of ranks and workers, and ``resume(epoch=,
    samples_seen=)`` continues on any topology. It is given here, not learned from the
    DataLoader: the main process needs it (``len()``, ``samples_seen()``, ``resume()``) before
    any batch, and a DataLoader never tells its dataset its batch size, so it is not checked:
    give the DataLoader the same one, or ``samples_seen()`` counts the wrong samples.
    """

    def __init__(
        self,
        source: Source | None = None,
        *,
        options: Options | None = None,
        bucket: str | None = None,
        keys: Iterable[str] | None = None,
        prefix: str | None = None,
        shards: str | Iterable[str] | None = None,
        shard_options: ShardOptions | None = None,
        group: bool = True,
        label_from: LabelFrom | None = None,
        labels: Iterable[int | str | None] | None = None,
    ) -> None:
        super().__init__()
        self.options = options or Options()
        if source is None:
            warn_direct_construction("AsyncS3Dataset", "keys=|prefix=|shards=", shards=True)
            source = source_from_keywords(self.options, bucket=bucket, keys=keys, prefix=prefix,
                                          shards=shards, shard_options=shard_options, group=group,
                                          label_from=label_from, labels=labels)
        self.source: Source = source
        self._epoch = topology.SharedEpoch(0)  # workers follow it, however they were started
        self._launch: topology.Launch | None = None  # the world of the process that pickled it
        self._unpickled_in: int | None = None  # the process that unpickled this copy
        self._resume: dict[str, Any] | None = None  # a load_state_dict() state for its epoch
        self._elastic: tuple[int, int] | None = None  # (epoch, samples_seen) from resume()
        self._lanes: tuple[int, int] | None = None  # (epoch, lanes) from resume() or a state
        # The lanes of the last iteration's order (see Slot.lanes), in shared memory as the epoch:
        # DataLoader workers write it, so the main process's state_dict() names them too.
        self._read_lanes = topology.SharedEpoch(0)
        self._progress: Progress = self.source.progress({})
        self._samples_skipped = 0  # by on_error in this pass: an object gone, a transform that raised
        self._last_stats: dict[str, Any] | None = None
        self._recorder = RequestRecorder()
        self._board = StatsBoard()  # shared memory, no thread or connection
        self._steps: StepWaits | None = None  # the training loop's waits, when it uses timed()
        self._split = [0.0, 0.0]  # this pass: seconds in transform, seconds outside between samples
        self._startup = [0.0, 0.0]  # this pass: seconds to the first item, the engine's wait in them

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_prefix(cls, uri: str, *, group: bool = True, label_from: LabelFrom | None = None,
                    snapshot: str | os.PathLike[str] | None = None, shuffle: bool = False,
                    seed: int | None = None, transform: Transform | None = None,
                    batch_size: int | None = None, on_error: OnError = "raise",
                    limits: Limits | None = None, split: Split | None = None,
                    store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                    **deprecated: Any) -> AsyncS3Dataset:
        """Every object under ``s3://bucket/prefix``, listed once when first needed.

        Objects sharing a stem form one sample (``group=False``: one object per sample);
        ``label_from="parent"`` labels each with its class folder, as ``ImageFolder`` does.
        Hidden objects (basename starting with a dot) are left out; a prefix without a trailing
        slash that also matches sibling names is warned about. ``snapshot=PATH``: read the
        listing from that file, or list and save it there (``snapshots``). The other keywords:
        see the class docstring.
        """
        bucket, prefix = parse_s3_uri(uri)
        loader_options, _ = dataset_options(
            "objects", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
            on_error=on_error, limits=limits, split=split, store=store, config=config, old=deprecated)
        return cls(ObjectSource(bucket, loader_options, prefix=prefix, group=group, label_from=label_from,
                                snapshot=snapshot_option(snapshot)),
                   options=loader_options)

    @classmethod
    def from_keys(cls, bucket: str, keys: Iterable[str], *, group: bool = True,
                  label_from: LabelFrom | None = None, shuffle: bool = False, seed: int | None = None,
                  transform: Transform | None = None, batch_size: int | None = None,
                  on_error: OnError = "raise", limits: Limits | None = None, split: Split | None = None,
                  store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                  **deprecated: Any) -> AsyncS3Dataset:
        """Exactly these keys of ``bucket`` (no listing, no HEAD), grouped by stem as in
        ``from_prefix``; samples come in the order their stems first appear."""
        if bucket.startswith("s3://"):
            bucket = parse_s3_uri(bucket).bucket
        loader_options, _ = dataset_options(
            "objects", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
            on_error=on_error, limits=limits, split=split, store=store, config=config, old=deprecated)
        return cls(ObjectSource(bucket, loader_options, keys=keys, group=group, label_from=label_from),
                   options=loader_options)

    @classmethod
    def from_manifest(cls, path: str, bucket: str | None = None, *, group: bool = True,
                      label_from: LabelFrom | None = None, shuffle: bool = False, seed: int | None = None,
                      transform: Transform | None = None, batch_size: int | None = None,
                      on_error: OnError = "raise", limits: Limits | None = None, split: Split | None = None,
                      store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                      **deprecated: Any) -> AsyncS3Dataset:
        """Keys from a file: plain text (a key or ``s3://`` URI per line), or CSV / JSON lines
        with a ``key`` column and optionally a ``label`` column (see ``inputs.read_manifest``);
        or a listing snapshot (``loader ls --save``), read without any LIST."""
        loader_options, _ = dataset_options(
            "objects", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
            on_error=on_error, limits=limits, split=split, store=store, config=config, old=deprecated)
        if is_snapshot(path):
            bucket, prefix = parse_s3_uri(snapshot_uri(path, bucket))
            return cls(ObjectSource(bucket, loader_options, prefix=prefix, group=group,
                                    label_from=label_from, snapshot=saved_snapshot(path)),
                       options=loader_options)
        manifest = read_manifest(path, bucket)
        return cls(ObjectSource(manifest.bucket, loader_options, keys=manifest.keys, group=group,
                                label_from=label_from, labels=manifest.labels),
                   options=loader_options)

    @classmethod
    def from_shards(cls, shards: str | Iterable[str], *, shuffle: bool = False, seed: int | None = None,
                    transform: Transform | None = None, batch_size: int | None = None,
                    on_error: OnError = "raise", limits: Limits | None = None, split: Split | None = None,
                    store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                    reading: Reading | None = None, sample_counts: Mapping[str, int] | None = None,
                    **deprecated: Any) -> AsyncS3Dataset:
        """Tar shards: a brace pattern, a list of URIs/patterns, or a prefix (every ``.tar``,
        ``.tar.gz``/``.tgz``, ``.tar.zst``/``.tzst`` under it; compressed ones are decompressed
        as they stream), their samples interleaved and mixed by a shuffle buffer. Besides the
        keywords of the class docstring:

        - ``limits=Limits(concurrency=16)``: requests in flight, ``concurrency // 4`` shards
          streamed at once with up to 4 ranged parts each.
        - ``reading=Reading(...)``: ``shuffle_buffer`` (1000 with ``shuffle=True``; 0 = off),
          ``part_size`` (16 MiB: a shard of known size above two parts is read as ranged GETs),
          ``chunk_size`` (1 MiB: the piece a streamed shard is read in), ``index`` (the shard
          index's URI when it is not the ``index.json`` beside the shards, found by itself).
        - ``sample_counts={url: n}``: the shards' sample counts, when there is no index.
        - ``split=Split(samples_per_epoch=N)``: exactly N samples per rank and epoch, cycling
          through the shards (no counts needed); ``Split(uneven_ranks=True)``: accept ranks of
          unequal length when the counts are unknown.
        """
        loader_options, knobs = dataset_options(
            "shards", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
            on_error=on_error, limits=limits, split=split, store=store, config=config,
            reading=reading, old=deprecated)
        from ..formats.shards import ShardOptions

        shard_options = ShardOptions(**knobs)
        from .shard_source import ShardSource

        return cls(ShardSource(shards, loader_options, shard_options=shard_options,
                               sample_counts=sample_counts),
                   options=loader_options)

    @classmethod
    def from_parquet(cls, files: str | Iterable[str], columns: Sequence[str] | None = None, *,
                     shuffle: bool = False, seed: int | None = None, transform: Transform | None = None,
                     batch_size: int | None = None, on_error: OnError = "raise",
                     limits: Limits | None = None, split: Split | None = None,
                     store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                     reading: Reading | None = None, **deprecated: Any) -> AsyncS3Dataset:
        """Rows of Parquet files: a brace pattern, a list of URIs/patterns, or a prefix (every
        ``.parquet`` under it). Each row is a sample: ``__key__`` (the file's key less
        ``.parquet``, ``/``, the row's number in the file), ``__url__`` and the ``columns``
        selected (None: all), as pyarrow gives them (binary as bytes, structs as dicts).

        The footers are read once, before workers start; their row counts split every epoch
        exactly, by row group (dealt, shuffled and resumed as shards are: ``limits=Limits(
        concurrency=)`` reads ``concurrency // 4`` row groups at once, ``reading=Reading(
        shuffle_buffer=, part_size=)``, ``split=Split(samples_per_epoch=)``). Only the
        selected columns' chunks are fetched. Needs the ``parquet`` extra (pyarrow).
        """
        from .parquet_source import ParquetSource

        loader_options, knobs = dataset_options(
            "parquet", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
            on_error=on_error, limits=limits, split=split, store=store, config=config,
            reading=reading, old=deprecated)
        from ..formats.shards import ShardOptions

        shard_options = ShardOptions(**knobs)
        # row groups at once: a number given (Limits(concurrency=) or an old spelling) applies to
        # every process; the default is per rank, shared among its workers (ParquetSource.inflight)
        given = "shards_inflight" in knobs
        return cls(ParquetSource(files, loader_options, columns=columns, shard_options=shard_options,
                                 inflight_per_rank=not given),
                   options=loader_options)

    # ----------------------------------------------------------------------- what is read

    def keys(self) -> Sequence[str]:
        """Per-object datasets: every object key (the prefix is listed now if not yet)."""
        return self._ask("keys")()

    def samples(self) -> SampleIndex:
        """Per-object datasets: which objects form each sample, and their labels."""
        return self._ask("samples")()

    def shards(self) -> list[ShardRef]:
        """Shard datasets: the shard list (prefixes are listed now if not yet)."""
        return self._ask("shards")()

    def shard_counts(self) -> list[int] | None:
        """Shard datasets: samples per shard in ``shards()`` order, when known."""
        return self._ask("shard_counts")()

    @property
    def classes(self) -> list[str] | None:
        """Class names by index when labels come from names (as ``ImageFolder``); else None."""
        return getattr(self.source, "classes", None)

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """``{class name: index}``, the inverse of ``classes`` (None without named classes)."""
        return getattr(self.source, "class_to_idx", None)

    def _ask(self, name: str) -> Any:
        """The source's method ``name``; a clear TypeError when this source has none."""
        method = getattr(self.source, name, None)
        if method is None:
            raise TypeError(f"{name}() is not available here: this dataset reads {self.source.describe()}")
        return method

    def resolve(self) -> None:
        """List now (keys or shards), so that DataLoader workers inherit the result."""
        self.source.resolve()

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (and list, if needed).

        The epoch lives in shared memory made with the dataset, so DataLoader workers follow
        the last value set here, however and whenever they were started.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        self.resolve()
        if epoch != self.epoch:
            self._resume = None
        if self._elastic is not None and self._elastic[0] != epoch:
            self._elastic = None
        if self._lanes is not None and self._lanes[0] != epoch:
            self._lanes = None
        self.epoch = epoch

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.value = value

    def __len__(self) -> int:
        """Samples this rank yields per epoch (after ``resume()``, what is left of it)."""
        fixed = self.source.fixed_rank_length()
        if fixed is not None:
            return fixed - self._seen()
        _, world_size = self._world()
        if self.options.batch_size is not None:
            _, rest = self._rest()
            full, last = partition.block_shape(rest, self.options.batch_size, world_size,
                                               self.options.split.pad)
            return full * self.options.batch_size + last
        count = self.source.count()
        if count is None:
            raise TypeError(self.source.missing_count())
        return partition.rank_length(count, world_size, self.options.split.pad)

    def __getstate__(self) -> dict[str, Any]:
        starting = get_spawning_popen() is not None
        if starting:  # pickled to start a process (a spawned DataLoader worker, most often):
            self.resolve()  # list here, once, rather than in every worker; other pickling lists nothing
        state = self.__dict__.copy()
        if starting and self.options.split.world_size is None:
            # Starting a process (a spawn or forkserver DataLoader worker, most often): it will
            # not inherit this process's group, so tell it the rank (see topology.world).
            state["_launch"] = topology.observe()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unpickled_in = os.getpid()

    def _world(self) -> tuple[int, int]:
        """``(rank, world_size)``: explicit options, else as ``topology.world`` finds it."""
        if self.options.split.world_size is not None:
            return self.options.world()
        return topology.world(launch=self._launch, unpickled_here=self._unpickled_in == os.getpid())

    def _slot(self) -> Slot:
        """This process's slot of the current epoch (with ``batch_size=``, its blocks)."""
        rank, world_size = self._world()
        worker, num_workers = topology.worker()
        positions = None
        if self.options.batch_size is not None and self.source.fixed_rank_length() is None:
            seen, rest = self._rest()
            positions = [seen + p for p in partition.block_positions(
                rest, batch_size=self.options.batch_size, rank=rank, world_size=world_size,
                worker=worker, num_workers=num_workers, policy=self.options.split.pad)]
        lanes = world_size * max(1, num_workers)
        if self._lanes is not None and self._lanes[0] == self.epoch:
            lanes = self._lanes[1]
        self._read_lanes.value = lanes
        return Slot(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers,
                    seed=self.options.effective_seed, epoch=self.epoch, shuffle=self.options.shuffle,
                    policy=self.options.split.pad, positions=positions, seen=self._seen(),
                    lanes=lanes if positions is not None else None)

    # ----------------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        iteration = self._iterate()
        _open_iterations.add(iteration)  # closed at exit if still open (see below)
        return iteration

    def _iterate(self) -> Generator[Any, None, None]:
        worker, num_workers = topology.worker()
        self._board.clear(range(worker, worker + 1))
        if worker == 0:
            self._board.clear(range(max(1, num_workers), MAX_WORKERS))  # rows of a bigger past run
        progress = self._progress = self.source.progress(self._resumed())
        self._samples_skipped = 0
        self._recorder = RequestRecorder()
        clock = time.perf_counter
        started, samples = clock(), 0
        transforming = handing = 0.0  # seconds in transform, and outside between samples (stats.py)
        startup: float | None = None  # seconds to the first item: start-up, reported apart
        self._startup = [0.0, 0.0]
        tagged = self.source.stream(self._slot(), progress, self._run)
        try:
            with contextlib.closing(tagged):  # stops the engine now, not when a traceback dies
                for tag, item in tagged:
                    if startup is None:
                        startup = self._startup[0] = clock() - started
                    progress.add(tag)
                    if isinstance(item, Skipped):
                        self._skip(item.url, None, item.reason)
                        continue
                    began = clock()
                    try:
                        sample = self.source.transform(item)
                    except SampleError as exc:
                        if self.options.on_error == "raise" or not skippable(exc):
                            raise
                        self._skip(exc.url, item.get("__key__"), str(exc))
                        continue
                    finally:
                        done = clock()
                        transforming += done - began
                    samples += 1
                    yield sample
                    handing += clock() - done
        finally:
            self._split = [transforming, handing]
            self._publish(worker, samples, time.perf_counter() - started)

    def _skip(self, url: str, key: str | None, reason: str) -> None:
        """Count a sample that ``on_error`` skips, and say so as it asks."""
        self._samples_skipped += 1
        say_skipped(f"skipping {self.source.skipped(url, key)} (on_error={self.options.on_error!r}): {reason}",
                    self.options.on_error, log, level=logging.INFO, stacklevel=3)

    def _run(self, jobs: Jobs, limits: EngineLimits,
             schedule: Iterable[int] | None = None) -> Generator[Any, None, None]:
        """Run a source's jobs in one engine, closed when the iteration ends."""
        cache_stats: list[CacheStats] = []  # appended in the engine's thread when its store closes
        factory = self.options.store_factory(on_cache_close=cache_stats.append, recorder=self._recorder,
                                             versions=self.source.versions())
        engine = FetchEngine(jobs, factory, limits=limits, retry=self.options.store.retry, name="loader-engine",
                             schedule=schedule)
        try:
            items = iter(engine)
            for first in items:  # the engine's wait up to its first item is start-up (stats.py)
                if not self._startup[1]:
                    self._startup[1] = engine.statistics().consumer_wait_s
                yield first
                break
            yield from items
        finally:
            engine.close()
            stats = engine.statistics()._asdict()
            ends = self._progress.counters().get("shard_ends", 0)  # end-of-shard markers are not samples
            stats["delivered_items"] = max(0, stats["delivered_items"] - ends)
            self._last_stats = stats
            if cache_stats:  # this process's cache counters (hits, misses, ...) for the epoch
                self._last_stats["cache"] = cache_stats[-1]._asdict()
            self._resume = None

    def _publish(self, worker: int, samples: int, seconds: float) -> None:
        """Put this pass's counters on the shared board (and in the log, if asked)."""
        engine = self._last_stats or {}
        cache = engine.get("cache", {})
        recorder = self._recorder
        counters = {
            "samples": samples, "bytes": recorder.bytes, "requests": recorder.requests,
            "request_errors": recorder.request_errors, "retries": engine.get("retries", 0),
            "samples_skipped": self._samples_skipped, "shards_skipped": 0, "tar_links_skipped": 0,
            **{k: v for k, v in self._progress.counters().items() if k != "shard_ends"},
            "cache_hits": cache.get("hits", 0), "cache_misses": cache.get("misses", 0),
            "cache_stale_refetches": cache.get("stale_refetches", 0),
            "consumer_wait_s": max(0.0, engine.get("consumer_wait_s", 0.0) - self._startup[1]),
            "startup_s": self._startup[0], "seconds": seconds,
            "get_s": recorder.seconds, "transform_s": self._split[0], "handoff_s": self._split[1],
            "peak_inflight": engine.get("peak_inflight", 0),
            "throttled": engine.get("throttled", 0), "hedged": engine.get("hedged", 0),
            "hedges_won": engine.get("hedges_won", 0),
        }
        self._board.write(worker, counters, recorder.latency)
        self._last_stats = {**engine, **summarize([(counters, recorder.latency)])}
        if self.options.log_stats or stats_log.level and stats_log.isEnabledFor(logging.INFO):
            s = self._last_stats
            stats_log.info("worker %d: %d samples in %.1fs (%.0f/s), %d requests, %d retries, "
                     "p50 %s p99 %s", worker, samples, seconds, samples / max(seconds, 1e-9),
                     s["requests"], s["retries"], s["latency_p50_s"], s["latency_p99_s"])

    # ----------------------------------------------------------------------- state and resume

    def state_dict(self) -> dict[str, Any]:
        """Where this process is in the epoch: enough to skip exactly what it delivered.

        Small and bounded (see ``progress.Watermark``), so ``StatefulDataLoader`` can take it
        after every batch; it collects and restores one per DataLoader worker.
        """
        return {
            "version": STATE_VERSION,
            "mode": self.source.kind,
            "epoch": self.epoch,
            "seed": self.options.effective_seed,
            "size": self.source.size(),
            "batch_size": self.options.batch_size,
            "samples_seen": self._seen(),
            "lanes": self._read_lanes.value or None,
            **self._progress.to_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips the samples already delivered."""
        kind = self.source.kind
        if state.get("version") == 1 and state.get("mode") == kind:
            _check_old_order(state, shuffled=self.options.shuffle)
        elif state.get("version") == 2 and state.get("mode") == kind:
            _check_unlaned(state, shuffled=self.options.shuffle)
        elif state.get("version") != STATE_VERSION or state.get("mode") != kind:
            raise ConfigError(
                f"this state (version {state.get('version')!r}, mode {state.get('mode')!r}) is not "
                f"for a {kind} dataset of version {STATE_VERSION}")
        if state["size"] != self.source.size() or state["seed"] != self.options.effective_seed:
            raise ConfigError(
                f"this state was saved for a different data set or seed (size {state['size']}, "
                f"seed {state['seed']}); resume with the same ones")
        if state.get("batch_size") != self.options.batch_size:
            raise ConfigError(
                f"this state was saved with batch_size={state.get('batch_size')!r}, this dataset "
                f"has batch_size={self.options.batch_size!r}; resume with the same one (or use "
                "resume(epoch=, samples_seen=) to change the batch size or the number of ranks)")
        self.epoch = state["epoch"]
        self._resume = dict(state)
        seen = state.get("samples_seen", 0)
        self._elastic = (state["epoch"], seen) if seen else None
        lanes = state.get("lanes")
        self._lanes = (state["epoch"], lanes) if lanes else None

    def resume(self, *, epoch: int, samples_seen: int, lanes: int | None = None) -> None:
        """Continue ``epoch`` after the first ``samples_seen`` samples of its order, on any
        number of ranks and DataLoader workers (needs ``batch_size=``).

        ``samples_seen`` is what ``samples_seen(steps)`` said at the checkpoint. The rest of the
        epoch is dealt in blocks over the new ranks and workers (its end padded or dropped as
        ``Split(pad=)`` says); ``batch_size`` may change too. Call it before the DataLoader
        starts its workers: persistent workers keep the plan they were started with. A source
        that fixes each rank's epoch length (shards with ``samples_per_epoch=N``) counts
        ``samples_seen`` per rank: every rank then yields the ``N - samples_seen`` left.

        ``lanes``: a shuffled epoch of shards or row groups is dealt to one lane per rank x
        DataLoader worker of the run that started it (docs/design/shuffle.md); resuming on
        another number of them, give that run's ``world_size * max(1, num_workers)`` (None:
        this run's). The rest of the epoch is then read in smaller runs, slower, never wrong.
        """
        fixed = self.source.fixed_rank_length()
        if self.options.batch_size is None and fixed is None:
            raise ConfigError(
                "resume(samples_seen=) counts samples of the epoch's order as batch_size= deals "
                "it; build the dataset with batch_size=<the DataLoader's batch size per rank>")
        for name, value in (("epoch", epoch), ("samples_seen", samples_seen)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer")
        self.resolve()
        total = self._total() if fixed is None else fixed
        if samples_seen > total:
            per = "" if fixed is None else " per rank"
            raise ConfigError(f"samples_seen={samples_seen!r} is more than the {total} samples{per} "
                              "of an epoch of this data set; is it the same data set?")
        if lanes is not None and (not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1):
            raise ConfigError(f"lanes={lanes!r} must be a positive integer: the ranks x DataLoader "
                              "workers (at least 1) of the run that saved samples_seen")
        # shards and row groups (the sources cut into pieces) deal a shuffled epoch to lanes: the
        # order depends on how many, which this run cannot know; a guess would repeat and skip
        if lanes is None and self._lanes is not None and self._lanes[0] == epoch:
            lanes = self._lanes[1]  # the epoch's lanes, as an earlier resume or state gave them
        if lanes is None and samples_seen and fixed is None and self.source.deals_lanes():
            raise ConfigError(
                "resume(samples_seen=) of a shuffled epoch of shards or row groups needs lanes=: "
                "the order was dealt to one lane per rank x DataLoader worker of the run that "
                "saved samples_seen; pass lanes=<its world_size * max(1, num_workers)> (its "
                "state_dict()['lanes'] records it), or resume with load_state_dict()")
        self.epoch = epoch
        self._resume = None
        self._elastic = (epoch, samples_seen)
        self._lanes = None if lanes is None else (epoch, lanes)

    def resume_from_batches(self, epoch: int, batches_seen: int, batch_size: int) -> None:
        """Deprecated: ``ds.set_epoch(epoch); ds.resume(epoch=epoch,
        samples_seen=ds.samples_seen(batches_seen))``, which it now is (``batch_size`` must be
        the dataset's)."""
        warnings.warn("resume_from_batches() is deprecated and will be removed in the next release: "
                      "save ds.samples_seen(steps) at the checkpoint and call "
                      "resume(epoch=, samples_seen=ds.samples_seen(...)) (or use state_dict() / "
                      "load_state_dict())", DeprecationWarning, stacklevel=2)
        if self.options.batch_size is None:
            raise ConfigError(
                f"resume_from_batches counts the epoch's order in blocks of the batch size: build "
                f"the dataset with batch_size={batch_size!r} (the DataLoader's batch size per rank, "
                "which also makes the resume work on any number of ranks and workers)")
        if batch_size != self.options.batch_size:
            raise ConfigError(f"batch_size={batch_size!r} differs from the dataset's "
                              f"batch_size={self.options.batch_size!r}; give the same one")
        self.set_epoch(epoch)
        self.resume(epoch=epoch, samples_seen=self.samples_seen(batches_seen))

    def samples_seen(self, steps: int) -> int:
        """Samples of this epoch's order consumed after ``steps`` steps of the current iteration
        on every rank (plus those a ``resume`` skipped): what to save for ``resume``."""
        if self.options.batch_size is None:
            raise ConfigError("samples_seen() needs batch_size= (the DataLoader's batch size per rank)")
        fixed = self.source.fixed_rank_length()
        if fixed is not None:  # an epoch of ``fixed`` samples per rank: counted per rank
            return min(fixed, self._seen() + steps * self.options.batch_size)
        _, world_size = self._world()
        seen, rest = self._rest()
        return seen + partition.samples_consumed(rest, steps, batch_size=self.options.batch_size,
                                                 world_size=world_size, policy=self.options.split.pad)

    def _total(self) -> int:
        """Samples in an epoch's order; a ConfigError says how to make an unknown count known."""
        count = self.source.count()
        if count is None:
            raise ConfigError(f"batch_size= deals samples, so it needs their number: {self.source.missing_count()}")
        return count

    def _rest(self) -> tuple[int, int]:
        """``(samples skipped by resume(), samples left)`` of the current epoch's order."""
        if self.options.batch_size is None:
            return 0, 0
        seen = self._seen()
        return seen, self._total() - seen

    def _seen(self) -> int:
        """Samples of the current epoch's order that a ``resume()`` skips."""
        elastic = self._elastic
        return elastic[1] if elastic is not None and elastic[0] == self.epoch else 0

    def _resumed(self) -> Mapping[str, Any]:
        if self._resume is None or self._resume["epoch"] != self.epoch:
            return {}
        return self._resume

    # ----------------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any] | None:
        """Counters of the last epoch: samples, bytes, requests, retries, errors skipped,
        cache hits, request latency p50/p90/p99, throughput, and where the loader's time went
        after the first sample (``consumer_wait_s`` waiting for fetches, ``transform_s``,
        ``handoff_s``, ``get_s``; the start-up before it apart, ``startup_s``). After a loop over
        ``timed(...)``: how long training waited for data per step in the steady state
        (``step_wait_p50_s``/``p95``/``p99``, ``data_wait_s``, ``data_wait_fraction``), the
        start-up apart (``first_batch_s``, ``startup_wait_s``: each worker's first batch) and
        the end (``end_wait_s``).

        In the main process after a DataLoader epoch this sums every worker's row of the
        shared board (``"workers"`` says how many): one rank's numbers. None before any
        iteration.
        """
        rows = self._board.read()
        out = self._last_stats if not rows else {**(self._last_stats or {}), **summarize(rows)}
        if self._steps is not None:
            out = {**(out or {}), **self._steps.summary()}
        return out

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``batches`` (a DataLoader over this dataset), timing how long each step
        waits for its batch: ``for batch in ds.timed(loader): ...``. Only the process that
        runs the training loop can see those waits (DataLoader workers cannot), so they are
        measured here, per rank; ``stats()`` and ``report()`` then include them."""
        # a DataLoader's workers each start on their own first batch: start-up, kept apart
        self._steps = StepWaits(startup_steps=getattr(batches, "num_workers", 0) or 1)
        return timed(batches, self._steps)

    def report(self) -> str:
        """``stats()`` in a few lines for people: where this rank's last epoch spent its time
        (waiting for data per step, fetching, transform, hand-off) and what to change first."""
        stats = self.stats()
        if stats is None:
            return "no epoch yet: iterate first (for batch in ds.timed(loader): ...)"
        limit = getattr(getattr(self.source, "shard_options", None), "shards_inflight", None)
        return report(stats, inflight_limit=limit or self.options.concurrency)

    def __repr__(self) -> str:
        return (f"AsyncS3Dataset({self.source.describe()}, shuffle={self.options.shuffle}, "
                f"concurrency={self.options.concurrency}, store={self.options.store.backend!r})")


def _close_iteration(iteration: Generator[Any, None, None]) -> None:
    iteration.close()


# Iterations a script left open (``next(iter(loader))``, then exit) are closed at exit, while the
# modules their ``finally`` needs still exist: left to the interpreter's teardown, they ran it
# after module globals were cleared and printed a TypeError. A forked child forgets its parent's.
_open_iterations: LiveObjects[Generator[Any, None, None]] = LiveObjects(
    in_child=lambda iteration: None, at_exit=_close_iteration)


def source_from_keywords(options: Options, *, bucket: str | None = None,
                         keys: Iterable[str] | None = None, prefix: str | None = None,
                         shards: str | Iterable[str] | None = None,
                         shard_options: ShardOptions | None = None, group: bool = True,
                         label_from: LabelFrom | None = None,
                         labels: Iterable[int | str | None] | None = None,
                         objects_only: bool = False) -> Source:
    """The source that the deprecated ``AsyncS3Dataset(keys=|prefix=|shards=, ...)`` (or, with
    ``objects_only``, ``AsyncS3MapDataset(keys=|prefix=, ...)``) describes."""
    given = [name for name, value in (("keys", keys), ("prefix", prefix), ("shards", shards))
             if value is not None]
    if len(given) != 1 or (objects_only and shards is not None):
        names = "keys= or prefix=" if objects_only else "keys=, prefix= or shards="
        raise ConfigError(f"give exactly one of {names} (got {given or 'none'})")
    if shards is not None:
        from .shard_source import ShardSource

        return ShardSource(shards, options, shard_options=shard_options)
    if bucket is None:
        raise ConfigError(f"{given[0]}= needs bucket= (or use from_prefix('s3://bucket/...'), "
                          "from_keys(bucket, keys) or from_manifest(path))")
    return ObjectSource(bucket, options, keys=keys, prefix=prefix, group=group, label_from=label_from,
                        labels=labels)


def _check_unlaned(state: Mapping[str, Any], *, shuffled: bool) -> None:
    """A state of version 2 (shuffled shards and row groups read unit after unit) resumes only
    where this release reads in the same order: objects, or unshuffled."""
    if state.get("mode") not in ("shards", "parquet") or not shuffled:
        return
    epoch = state.get("epoch")
    raise ConfigError(
        f"this state was saved by an earlier release (state version 2) in the middle of epoch "
        f"{epoch!r}; this release reads shuffled {state.get('mode')} in another order (mixed across "
        f"runs of samples), so the samples it delivered cannot be told apart. Start that epoch "
        f"again (ds.set_epoch({epoch!r}) instead of load_state_dict), or finish it with the release "
        "that saved the state and upgrade at an epoch boundary")


def _check_old_order(state: Mapping[str, Any], *, shuffled: bool) -> None:
    """A state of version 1 (releases whose every shuffled order was a list shuffled whole) may
    be resumed only where that order is still this release's: unshuffled, or objects or shards
    (whose order is over the shards) of at most ``partition.SMALL_ORDER`` items. Elsewhere the position it
    saved would point into another order, and the epoch would repeat and skip samples."""
    size, epoch = state.get("size"), state.get("epoch")
    if state.get("mode") in ("objects", "shards") and (
            not shuffled or (isinstance(size, int) and size <= partition.SMALL_ORDER)):
        return
    raise ConfigError(
        f"this state was saved by an earlier release (state version 1) in the middle of epoch "
        f"{epoch!r}; this release shuffles {state.get('mode')} of more than {partition.SMALL_ORDER} "
        f"items in another order, so the samples it delivered cannot be told apart. Start that "
        f"epoch again (ds.set_epoch({epoch!r}) instead of load_state_dict), or finish it with the "
        "release that saved the state and upgrade at an epoch boundary")
