"""``AsyncS3Dataset``: an ``IterableDataset`` that streams samples from S3 through a ``FetchEngine``.

The dataset object is a picklable description (bucket, keys or prefix, options). It opens no
connection and starts no thread until ``__iter__`` runs, in whichever process iterates: the main
process with ``num_workers=0``, else each DataLoader worker. There it works out its share of the
epoch (``partition.py``: rank, then worker, from ``(seed, epoch)``), builds an engine, and yields
samples, transformed if asked. When the iteration ends for any reason the engine is closed and
only a statistics snapshot is kept: nothing that points at an event loop survives it.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import logging
import os
import random
import time
import warnings
from collections.abc import Generator, Iterable, Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

from torch.utils.data import IterableDataset
from typing_extensions import Unpack

from ..decode import apply_transform
from ..engine.fetch import (
    Delivery,
    EngineLimits,
    FetchEngine,
)
from ..errors import ConfigError, NoSuchKeyError, SampleError
from ..formats.objects import LabelFrom, SampleIndex, Skipped, sample_job, skippable
from ..formats.packing import INDEX_NAME, index_counts
from ..formats.shards import END, ShardOptions, ShardRef, Tag, sample_nbytes, shard_job
from ..stores.cache import CacheStats
from ..stores.recording import RequestRecorder
from ..stores.versions import Versions, listed_versions, versions_of
from ..uri import parse_s3_uri
from . import partition, topology
from .options import LoaderKwargs, LoaderOptions, ShardKwargs, budget_options, check_budget
from .progress import Watermark, consumed_per_worker
from .shard_index import read_index
from .shuffle import shuffled
from .sources import ObjectSamples, check_keys, read_manifest, resolve_shards, shard_specs
from .stats import MAX_WORKERS, StatsBoard, summarize

log = logging.getLogger(__name__)

STATE_VERSION = 1


class AsyncS3Dataset(ObjectSamples, IterableDataset):
    """Stream samples from S3 with many requests in flight. Build it with a constructor:

    * ``from_prefix("s3://b/train/")``, ``from_keys(bucket, keys)``, ``from_manifest(path)``:
      objects that share a stem (``a/1.jpg``, ``a/1.cls``) form one sample, their GETs run
      concurrently, ``max_inflight`` samples at a time; ``label_from="parent"`` adds the class
      folder's index as ``"cls"`` (see ``classes``);
    * ``from_shards("s3://b/train-{0000..0127}.tar")``: WebDataset tar shards streamed and
      parsed on the fly, ``shards_inflight`` at a time, samples mixed by a shuffle buffer.

    Samples are dicts in the WebDataset convention (``__key__``, ``__url__``, extension → bytes),
    passed through ``transform`` when given. Call ``set_epoch(e)`` before each epoch: with
    ``shuffle=True`` it picks that epoch's order from ``(seed, epoch)``, the same on every rank.

    ``batch_size=B`` (the DataLoader's batch size on each rank) deals the epoch's order in blocks
    of B: at step ``s`` rank ``r`` gets block ``s * W + r``, so after ``s`` steps the job has
    consumed exactly the first ``s * B * W`` samples of that order, whatever the number of ranks
    ``W`` and of DataLoader workers. ``resume(epoch=, samples_seen=)`` then continues the epoch
    on any number of ranks and workers (see there). Shard mode reads samples in shard order then
    (shards shuffled per epoch), without the per-worker shuffle buffer.
    """

    def __init__(
        self,
        *,
        bucket: str | None = None,
        keys: Iterable[str] | None = None,
        prefix: str | None = None,
        shards: str | Iterable[str] | None = None,
        options: LoaderOptions | None = None,
        shard_options: ShardOptions | None = None,
        group: bool = True,
        label_from: LabelFrom | None = None,
        labels: Iterable[int | str | None] | None = None,
    ) -> None:
        super().__init__()
        given = [name for name, value in (("keys", keys), ("prefix", prefix), ("shards", shards))
                 if value is not None]
        if len(given) != 1:
            raise ConfigError(f"give exactly one of keys=, prefix= or shards= (got {given or 'none'})")
        if shards is None and bucket is None:
            raise ConfigError(f"{given[0]}= needs bucket= (or use from_prefix('s3://bucket/...'), "
                              "from_keys(bucket, keys) or from_manifest(path))")
        self.mode = "shards" if shards is not None else "objects"
        self.bucket = bucket
        self.prefix = prefix
        self.options = options or LoaderOptions()
        self.shard_options = shard_options or ShardOptions()
        check_budget(self.options, self.shard_options if self.mode == "shards" else None)
        self._keys = None if keys is None or bucket is None else check_keys(bucket, keys)
        self._group = group
        self._label_from = label_from
        self._labels = None if labels is None else tuple(labels)
        self._index: SampleIndex | None = None
        if self._keys is not None:
            self._index = self._build_index()  # a bad key list fails here, not in a worker
        self._shard_specs = None if shards is None else shard_specs(shards)
        self._shards: list[ShardRef] | None = None
        self._sample_counts: dict[str, int] | None = None
        self._epoch = topology.SharedEpoch(0)  # workers follow it, however they were started
        self._launch: topology.Launch | None = None  # the world of the process that pickled it
        self._unpickled_in: int | None = None  # the process that unpickled this copy
        self._resume: dict[str, Any] | None = None
        self._elastic: tuple[int, int] | None = None  # (epoch, samples_seen) from resume()
        self._index_tried = False  # batch_size= in shard mode: looked for index.json
        self._sample_offsets: dict[str, array.array[int]] | None = None  # from index.json
        self._progress = _Progress()
        self._fast_forward: tuple[int, int, int, bool] | None = None
        self._last_stats: dict[str, Any] | None = None
        self._recorder = RequestRecorder()
        self._board = StatsBoard()  # shared memory, no thread or connection

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_prefix(cls, uri: str, *, group: bool = True, label_from: LabelFrom | None = None,
                    **options: Unpack[LoaderKwargs]) -> AsyncS3Dataset:
        """Every object under ``s3://bucket/prefix``, listed once when first needed.

        Objects sharing a stem form one sample (``group=False``: one object per sample).
        ``label_from="parent"``: the class folder of each object becomes its label (field
        ``"cls"``, an ``int``; ``classes`` and ``class_to_idx`` name them, as in ``ImageFolder``).
        Hidden objects (basename starting with a dot) are left out. A prefix without a trailing
        slash matches siblings too (``imgs`` matches ``imgs-shards/``): that is warned about.
        """
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket=bucket, prefix=prefix, group=group,
                   options=LoaderOptions(**budget_options(options, "objects")),
                   label_from=label_from)

    @classmethod
    def from_keys(cls, bucket: str, keys: Iterable[str], *, group: bool = True,
                  label_from: LabelFrom | None = None, **options: Unpack[LoaderKwargs]) -> AsyncS3Dataset:
        """Exactly these keys of ``bucket`` (no listing, no HEAD), grouped by stem as in
        ``from_prefix``; samples come in the order their stems first appear."""
        if bucket.startswith("s3://"):
            bucket = parse_s3_uri(bucket).bucket
        return cls(bucket=bucket, keys=keys, group=group,
                   options=LoaderOptions(**budget_options(options, "objects")),
                   label_from=label_from)

    @classmethod
    def from_manifest(cls, path: str, bucket: str | None = None, *, group: bool = True,
                      label_from: LabelFrom | None = None, **options: Unpack[LoaderKwargs]) -> AsyncS3Dataset:
        """Keys from a file: plain text (one key or ``s3://`` URI per line), or CSV / JSON lines
        with a ``key`` (or ``url``) column and optionally a ``label`` column (class names or
        integers), see ``sources.read_manifest``. Grouped by stem as in ``from_prefix``."""
        manifest = read_manifest(path, bucket)
        return cls(bucket=manifest.bucket, keys=manifest.keys,
                   options=LoaderOptions(**budget_options(options, "objects")),
                   group=group, label_from=label_from, labels=manifest.labels)

    @classmethod
    def from_shards(cls, shards: str | Iterable[str], **options: Unpack[ShardKwargs]) -> AsyncS3Dataset:
        """Tar shards: a brace pattern, a list of URIs/patterns, or a prefix (every shard under it:
        ``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``/``.tzst``; compressed ones are decompressed
        as they stream).

        Shard options (see ``ShardOptions``): ``shards_inflight``, ``shuffle_buffer``,
        ``part_size``, ``parts_inflight``, ``chunk_size``; the rest as usual (``on_error``: a
        corrupt shard raises, or the rest of it is skipped, quietly or with a warning).
        """
        rest: dict[str, Any] = budget_options(options, "shards")
        names = {field.name for field in dataclasses.fields(ShardOptions)}
        shard_options = ShardOptions(**{k: rest.pop(k) for k in list(rest) if k in names})
        counts = rest.pop("sample_counts", None)
        dataset = cls(shards=shards, options=LoaderOptions(**rest), shard_options=shard_options)
        dataset._sample_counts = None if counts is None else _check_counts(counts)
        return dataset

    # ----------------------------------------------------------------------- what to read

    @property
    def _per_object(self) -> bool:
        return self.mode == "objects"

    def shards(self) -> list[ShardRef]:
        """Shard mode: the shard list, listing prefixes now if not done yet."""
        if self.mode != "shards":
            raise TypeError("shards() is for shard datasets; this one reads objects (see keys())")
        if self._shards is None:
            assert self._shard_specs is not None  # the constructor set it in shard mode
            self._shards = resolve_shards(self._shard_specs, factory=self.options.listing_factory(),
                                          retry=self.options.retry, options=self.options.listing)
        return self._shards

    def resolve(self) -> None:
        """List now (keys or shards), so that DataLoader workers inherit the result."""
        self.samples() if self.mode == "objects" else self.shards()
        if self.mode == "shards" and self.options.batch_size is not None:
            self._find_index()

    def _find_index(self) -> None:
        """``batch_size=`` in shard mode needs every shard's sample count: without
        ``sample_counts=``, read the ``index.json`` that ``loader shard`` wrote beside them."""
        if self._sample_counts is not None or self._index_tried:
            return
        self._index_tried = True
        places = {(shard.bucket, shard.key.rpartition("/")[0]) for shard in self.shards()}
        if len(places) != 1:
            return
        (bucket, folder), = places
        uri = f"s3://{bucket}/{folder + '/' if folder else ''}{INDEX_NAME}"
        try:
            document = read_index(uri, store=self.options.listing_factory(), retry=self.options.retry)
        except NoSuchKeyError:
            return
        self._sample_counts = index_counts(document, uri)
        # Each sample's byte offset lets a worker fetch just its blocks (ranged GETs) rather
        # than every shard a step touches from its first byte. array: 8 bytes a sample.
        self._sample_offsets = {
            shard["url"]: array.array("q", shard["offsets"]) for shard in document["shards"]
            if isinstance(shard.get("offsets"), list) and len(shard["offsets"]) == shard["samples"]
        }

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (and list, if needed).

        The epoch lives in a shared-memory cell made with the dataset, so DataLoader workers
        follow the last value set here, however and whenever they were started (persistent
        ones included).
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        self.resolve()
        if epoch != self.epoch:
            self._resume = None
        if self._elastic is not None and self._elastic[0] != epoch:
            self._elastic = None
        self.epoch = epoch

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.value = value

    def __len__(self) -> int:
        """Samples this rank yields per epoch (shards: only when ``sample_counts`` was given);
        after ``resume()``, what is left of the epoch."""
        _, world_size = self._world()
        if self.options.batch_size is not None:
            _, rest = self._rest()
            full, last = partition.block_shape(rest, self.options.batch_size, world_size,
                                               self.options.pad_policy)
            return full * self.options.batch_size + last
        if self.mode == "shards":
            counts = self.shard_counts()
            if counts is None:
                raise TypeError("the number of samples in these tar shards is unknown until they "
                                "are read; pass from_shards(..., sample_counts={url: n})")
            return partition.rank_length(sum(counts), world_size, self.options.pad_policy)
        return partition.rank_length(len(self.samples()), world_size, self.options.pad_policy)

    def shard_counts(self) -> list[int] | None:
        """Samples per shard in ``shards()`` order, when given; every shard must be covered."""
        if self._sample_counts is None:
            return None
        counts = []
        for shard in self.shards():
            count = self._sample_counts.get(shard.url, self._sample_counts.get(shard.key))
            if count is None:
                raise ConfigError(f"sample_counts has no entry for shard {shard.url}")
            counts.append(count)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawned workers: list here, once, rather than in every worker.
        self.resolve()
        state = self.__dict__.copy()
        if get_spawning_popen() is not None and self.options.world_size is None:
            # Starting a process (a spawn or forkserver DataLoader worker, most often): it will
            # not inherit this process's group, so tell it the rank (see topology.world).
            state["_launch"] = topology.observe()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unpickled_in = os.getpid()

    def _world(self) -> tuple[int, int]:
        """``(rank, world_size)``: explicit options, else as ``topology.world`` finds it."""
        if self.options.world_size is not None:
            return self.options.world()
        return topology.world(launch=self._launch, unpickled_here=self._unpickled_in == os.getpid())

    # ----------------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        worker, num_workers = topology.worker()
        self._board.clear(range(worker, worker + 1))
        if worker == 0:
            self._board.clear(range(max(1, num_workers), MAX_WORKERS))  # rows of a bigger past run
        self._progress = _Progress.from_state(self._resumed())
        self._recorder = RequestRecorder()
        started, samples = time.perf_counter(), 0
        skip = self._fast_forward_count()
        tagged = self._iter_objects(skip) if self.mode == "objects" else self._iter_shards()
        if self.mode == "shards" and skip:
            tagged = _drop(tagged, skip, self._progress)
        try:
            with contextlib.closing(tagged):  # stops the engine now, not when a traceback dies
                for tag, item in tagged:
                    self._progress.add(tag)
                    if isinstance(item, Skipped):
                        self._skip(item.url, item.reason)
                        continue
                    try:
                        sample = self._transform(item)
                    except SampleError as exc:
                        if self.options.on_error == "raise" or not skippable(exc):
                            raise
                        self._skip(exc.url, str(exc))
                        continue
                    samples += 1
                    yield sample
        finally:
            self._publish(worker, samples, time.perf_counter() - started)

    def _skip(self, url: str, reason: str) -> None:
        """Count a sample that ``on_error`` skips, and say so as it asks."""
        self._progress.samples_skipped += 1
        message = f"skipping {url} (on_error={self.options.on_error!r}): {reason}"
        if self.options.on_error == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)
        else:
            log.info(message)

    def _publish(self, worker: int, samples: int, seconds: float) -> None:
        """Put this pass's counters on the shared board (and in the log, if asked)."""
        engine = self._last_stats or {}
        cache = engine.get("cache", {})
        recorder = self._recorder
        counters = {
            "samples": samples, "bytes": recorder.bytes, "requests": recorder.requests,
            "request_errors": recorder.request_errors, "retries": engine.get("retries", 0),
            "samples_skipped": self._progress.samples_skipped,
            "shards_skipped": self._progress.shards_skipped,
            "tar_links_skipped": self._progress.tar_links_skipped, "cache_hits": cache.get("hits", 0),
            "cache_misses": cache.get("misses", 0),
            "cache_stale_refetches": cache.get("stale_refetches", 0),
            "consumer_wait_s": engine.get("consumer_wait_s", 0.0), "seconds": seconds,
        }
        self._board.write(worker, counters, recorder.latency)
        self._last_stats = {**engine, **summarize([(counters, recorder.latency)])}
        if self.options.log_stats:
            s = self._last_stats
            log.info("worker %d: %d samples in %.1fs (%.0f/s), %d requests, %d retries, "
                     "p50 %s p99 %s", worker, samples, seconds, samples / max(seconds, 1e-9),
                     s["requests"], s["retries"], s["latency_p50_s"], s["latency_p99_s"])

    def plan(self) -> list[int]:
        """Per-object mode: positions in ``samples()`` this rank and worker read this epoch."""
        rank, world_size = self._world()
        worker, num_workers = topology.worker()
        if self.options.batch_size is not None:
            order = partition.epoch_order(len(self.samples()), seed=self.options.effective_seed,
                                          epoch=self.epoch, shuffle=self.options.shuffle)
            return [order[g] for g in self._block_plan(rank, world_size, worker, num_workers)]
        return partition.partition(
            len(self.samples()), seed=self.options.effective_seed, epoch=self.epoch,
            shuffle=self.options.shuffle, rank=rank, world_size=world_size,
            worker=worker, num_workers=num_workers, policy=self.options.pad_policy,
        )

    def _iter_objects(self, skip: int = 0) -> Generator[tuple[Any, dict[str, Any]], None, None]:
        index = self.samples()
        done = self._progress.objects
        for slot in range(skip):  # plain-DataLoader resume: the first ``skip`` were delivered
            done.add(slot)
        todo = [(slot, pos) for slot, pos in enumerate(self.plan()) if slot not in done]
        on_error, bucket = self.options.on_error, self.bucket
        assert bucket is not None  # the constructor requires it in per-object mode
        jobs = (sample_job(index, bucket, pos, slot, on_error) for slot, pos in todo)
        delivery: Delivery = "ordered" if self.options.ordered else "completed"
        yield from self._run(jobs, self.options.object_limits(delivery),
                             listed_versions(bucket, self.keys()))

    def _iter_shards(self) -> Generator[tuple[Any, dict[str, Any]], None, None]:
        shards = self.shards()
        rank, world_size = self._world()
        worker, num_workers = topology.worker()
        seed = self.options.effective_seed
        where: dict[str, Any] = dict(seed=seed, epoch=self.epoch, shuffle=self.options.shuffle, rank=rank,
                     world_size=world_size, worker=worker, num_workers=num_workers)
        slot, slots = partition.slot_of(rank, world_size, worker, num_workers)
        counts = self.shard_counts()
        if self.options.batch_size is not None:  # blocks of the global order (see partition)
            known = self._block_counts()
            order = partition.epoch_order(len(known), seed=seed, epoch=self.epoch,
                                          shuffle=self.options.shuffle)
            positions = self._block_plan(rank, world_size, worker, num_workers)
            assignments = partition.sequence_ranges(known, order, positions)
        elif counts is not None:  # equal length per rank, exactly once (up to the pad policy)
            assignments = partition.balanced_shard_ranges(counts, policy=self.options.pad_policy, **where)
        else:
            assignments = partition.shard_assignments(len(shards), **where)
            if partition.needs_sample_split(len(shards), slots):
                _warn_sample_split(len(shards), slots)
        progress = self._progress
        offsets = self._sample_offsets or {}
        jobs = [
            shard_job(shards[a.shard], position, a, self.shard_options,
                      skip=progress.shard(position), on_error=self.options.on_error,
                      offsets=offsets.get(shards[a.shard].url))
            for position, a in enumerate(assignments)
            if not _shard_complete(a, progress.shard_samples.get(position), progress.shard(position))
        ]
        if self.options.batch_size is not None:
            delivery: Delivery = "ordered"  # blocks in order: shards read ahead, delivered in turn
        else:
            delivery = "interleave" if self.options.ordered else "completed"
        limits = self.options.limits(delivery, max_inflight=self.shard_options.shards_inflight)

        def samples() -> Generator[tuple[Tag, dict[str, Any]], None, None]:
            for tag, item in self._run(jobs, limits, versions_of(shards)):
                if tag[1] == END:
                    progress.shard_samples[tag[0]] = item.samples
                    progress.shards_skipped += item.skipped
                    progress.tar_links_skipped += item.links
                    progress.shard_ends += 1
                else:
                    yield tag, item

        blocks = self.options.batch_size is not None  # a shuffle buffer would break the blocks
        size = self.shard_options.shuffle_buffer if self.options.shuffle and not blocks else 0
        rng = random.Random(partition.epoch_seed(seed, self.epoch) ^ (slot << 20))
        with contextlib.closing(samples()) as stream:
            yield from shuffled(stream, size, rng, max_bytes=self.shard_options.shuffle_bytes,
                                nbytes=_tagged_nbytes)

    def _run(self, jobs: Iterable[Any], limits: EngineLimits,
             versions: Versions | None = None) -> Generator[Any, None, None]:
        cache_stats: list[CacheStats] = []  # appended in the engine's thread when its store closes
        factory = self.options.store_factory(on_cache_close=cache_stats.append,
                                             recorder=self._recorder, versions=versions)
        engine = FetchEngine(jobs, factory, limits=limits, retry=self.options.retry,
                             name="loader-engine")
        try:
            yield from engine
        finally:
            engine.close()
            stats = engine.statistics()._asdict()
            ends = self._progress.shard_ends  # end-of-shard markers are not samples
            stats["delivered_items"] = max(0, stats["delivered_items"] - ends)
            self._last_stats = {**stats, "shards_skipped": self._progress.shards_skipped,
                                "tar_links_skipped": self._progress.tar_links_skipped}
            if cache_stats:  # this process's cache counters (hits, misses, ...) for the epoch
                self._last_stats["cache"] = cache_stats[-1]._asdict()
            self._resume = None

    def _transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)

    # ----------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Where this process is in the epoch: enough to skip exactly what it delivered.

        Small and bounded (see ``progress.Watermark``), so ``StatefulDataLoader`` can take it
        after every batch. In DataLoader workers each worker has its own; torchdata's
        ``StatefulDataLoader`` collects and restores them per worker.
        """
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "epoch": self.epoch,
            "seed": self.options.effective_seed,
            "size": self._size(),
            "batch_size": self.options.batch_size,
            "samples_seen": self._seen(),
            **self._progress.to_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips the samples already delivered."""
        if state.get("version") != STATE_VERSION or state.get("mode") != self.mode:
            raise ConfigError(
                f"this state (version {state.get('version')!r}, mode {state.get('mode')!r}) is not "
                f"for a {self.mode} dataset of version {STATE_VERSION}"
            )
        if state["size"] != self._size() or state["seed"] != self.options.effective_seed:
            raise ConfigError(
                f"this state was saved for a different data set or seed (size {state['size']}, "
                f"seed {state['seed']}); resume with the same ones"
            )
        if state.get("batch_size") != self.options.batch_size:
            raise ConfigError(
                f"this state was saved with batch_size={state.get('batch_size')!r}, this dataset "
                f"has batch_size={self.options.batch_size!r}; resume with the same one (or use "
                "resume(epoch=, samples_seen=) to change the batch size or the number of ranks)")
        self.epoch = state["epoch"]
        self._resume = state
        self._fast_forward = None
        seen = state.get("samples_seen", 0)
        self._elastic = (state["epoch"], seen) if seen else None

    def resume_from_batches(self, epoch: int, batches_seen: int, batch_size: int,
                            drop_last: bool = False) -> None:
        """Resume with a plain ``DataLoader``: skip what its first ``batches_seen`` batches held.

        Each worker works out, from the DataLoader's round robin over workers, how many samples
        it had handed over, and skips exactly those (per-object mode: without fetching them;
        shard mode: by reading and dropping them). Needs ``ordered=True`` (the default), the same
        seed, data set, ``batch_size``, ``drop_last``, ``num_workers`` and world size as before.

        With the dataset's ``batch_size=`` this is ``resume(epoch, samples_seen(batches_seen))``:
        a new DataLoader starts its round robin at worker 0, so skipping per worker would take
        the steps out of order; the blocks left are dealt afresh instead, on any topology.
        """
        if not self.options.ordered:
            raise ConfigError("resume_from_batches needs ordered=True (as-completed order is not "
                              "repeatable); use torchdata's StatefulDataLoader instead")
        for name, value in (("epoch", epoch), ("batches_seen", batches_seen)):
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
        if self.options.batch_size is not None:
            if batch_size != self.options.batch_size:
                raise ConfigError(f"batch_size={batch_size!r} differs from the dataset's "
                                  f"batch_size={self.options.batch_size!r}; give the same one")
            self.resolve()
            self.epoch = epoch
            self.resume(epoch=epoch, samples_seen=self.samples_seen(batches_seen))
            return
        self.resolve()
        self.epoch = epoch
        self._resume = None
        self._fast_forward = (epoch, batches_seen, batch_size, drop_last)

    def resume(self, *, epoch: int, samples_seen: int) -> None:
        """Continue ``epoch`` after the first ``samples_seen`` samples of its order, on any
        number of ranks and DataLoader workers (needs ``batch_size=``).

        ``samples_seen`` is what ``samples_seen(steps)`` said when the checkpoint was taken
        (``steps * batch_size * world_size`` before the epoch's last step). The rest of the
        epoch is dealt in blocks over the new ranks and workers, with its own end (padded or
        dropped as ``pad_policy`` says, at most ``world_size - 1`` samples); ``batch_size`` may
        change too. It applies to the iterations of ``epoch`` until ``set_epoch`` picks another
        epoch (``set_epoch(epoch)`` itself keeps it). Call it before the DataLoader starts its
        workers: persistent workers keep the plan they were started with.
        """
        if self.options.batch_size is None:
            raise ConfigError(
                "resume(samples_seen=) counts samples of the epoch's order as batch_size= deals "
                "it; build the dataset with batch_size=<the DataLoader's batch size per rank>")
        for name, value in (("epoch", epoch), ("samples_seen", samples_seen)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer")
        self.resolve()
        total = self._total()
        if samples_seen > total:
            raise ConfigError(f"samples_seen={samples_seen!r} is more than the {total} samples "
                              "of an epoch of this data set; is it the same data set?")
        self.epoch = epoch
        self._resume = None
        self._fast_forward = None
        self._elastic = (epoch, samples_seen)

    def samples_seen(self, steps: int) -> int:
        """Samples of this epoch's order consumed after ``steps`` steps of the current iteration
        on every rank (plus those a ``resume`` skipped): what to save for ``resume``."""
        if self.options.batch_size is None:
            raise ConfigError("samples_seen() needs batch_size= (the DataLoader's batch size per rank)")
        _, world_size = self._world()
        seen, rest = self._rest()
        return seen + partition.samples_consumed(rest, steps, batch_size=self.options.batch_size,
                                                 world_size=world_size, policy=self.options.pad_policy)

    def _total(self) -> int:
        """Samples in an epoch's order (shard mode: needs every shard's count)."""
        if self.mode == "objects":
            return len(self.samples())
        return sum(self._block_counts())

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

    def _block_plan(self, rank: int, world_size: int, worker: int, num_workers: int) -> list[int]:
        """Positions in this epoch's order that (rank, worker) reads, in reading order."""
        seen, rest = self._rest()
        batch_size = self.options.batch_size
        if batch_size is None:
            raise ConfigError("block dealing needs batch_size=")
        positions = partition.block_positions(rest, batch_size=batch_size, rank=rank,
                                              world_size=world_size, worker=worker,
                                              num_workers=num_workers, policy=self.options.pad_policy)
        return [seen + p for p in positions]

    def _block_counts(self) -> list[int]:
        """Samples per shard, which ``batch_size=`` needs in shard mode; says what is missing."""
        self._find_index()
        counts = self.shard_counts()
        if counts is None:
            shards = self.shards()
            folder = shards[0].url.rpartition("/")[0] + "/" if shards else "the shards' folder"
            raise ConfigError(
                "batch_size= in shard mode deals samples, so it needs the number of samples in "
                f"every shard: no sample_counts= was given and there is no {INDEX_NAME} in "
                f"{folder} (python -m loader shard writes one). Pass from_shards(..., "
                "sample_counts=read_index_counts('s3://.../index.json')) or {shard url: samples}")
        return counts

    def _fast_forward_count(self) -> int:
        """How many of this worker's samples a ``resume_from_batches`` says were delivered."""
        plan, self._fast_forward = self._fast_forward, None
        if plan is None or plan[0] != self.epoch:
            return 0
        _, batches_seen, batch_size, drop_last = plan
        worker, num_workers = topology.worker()
        shares = self._worker_shares(num_workers)
        return consumed_per_worker(shares, batches_seen, batch_size, drop_last)[worker]

    def _worker_shares(self, num_workers: int) -> list[int]:
        """Samples each worker of this rank yields this epoch (shards without counts: assumed
        equal, which holds until the first worker runs dry)."""
        rank, world_size = self._world()
        where: dict[str, Any] = dict(seed=self.options.effective_seed, epoch=self.epoch,
                     shuffle=self.options.shuffle, rank=rank, world_size=world_size,
                     num_workers=num_workers)
        workers = range(max(1, num_workers))
        if self.mode == "objects":
            return [len(partition.partition(len(self.samples()), worker=w,
                                            policy=self.options.pad_policy, **where)) for w in workers]
        counts = self.shard_counts()
        if counts is None:
            return [1 << 62 for _ in workers]
        return [sum((counts[a.shard] if a.stop is None else a.stop) - a.start
                    for a in partition.balanced_shard_ranges(
                        counts, worker=w, policy=self.options.pad_policy, **where))
                for w in workers]

    def _size(self) -> int:
        return len(self.samples()) if self.mode == "objects" else len(self.shards())

    def _resumed(self) -> dict[str, Any]:
        if self._resume is None or self._resume["epoch"] != self.epoch:
            return {}
        return self._resume

    def stats(self) -> dict[str, Any] | None:
        """Counters of the last epoch: samples, bytes, requests, retries, errors skipped,
        cache hits, request latency p50/p90/p99, time the consumer waited, throughput.

        In the main process after a DataLoader epoch this sums every worker's row of the
        shared board (``"workers"`` says how many); engine details such as
        ``peak_buffered_bytes`` are this process's own. None before any iteration.
        """
        rows = self._board.read()
        if not rows:
            return self._last_stats
        return {**(self._last_stats or {}), **summarize(rows)}

    def __repr__(self) -> str:
        if self.mode == "shards":
            what = (f"{len(self._shards)} shards" if self._shards is not None
                    else f"shards {(self._shard_specs or [])[:2]}")
        else:
            what = f"{len(self._keys)} keys" if self._keys is not None else f"prefix {self.prefix!r}"
        return (f"AsyncS3Dataset({what}, bucket={self.bucket!r}, shuffle={self.options.shuffle}, "
                f"max_inflight={self.options.max_inflight}, store={self.options.store!r})")


@dataclasses.dataclass
class _Progress:
    """What this process delivered in the current epoch (the basis of ``state_dict``).

    Per-object mode tags samples with their slot in this worker's plan; shard mode with
    ``(shard position in the plan, sample index in the shard)``.
    """

    objects: Watermark = dataclasses.field(default_factory=Watermark)
    shards: dict[int, Watermark] = dataclasses.field(default_factory=dict)
    shard_samples: dict[int, int] = dataclasses.field(default_factory=dict)
    shards_skipped: int = 0
    samples_skipped: int = 0  # by on_error: an object gone, a transform that raised
    tar_links_skipped: int = 0  # hard and symbolic links in shards (no data, so no field)
    shard_ends: int = 0  # end-of-shard markers seen in this iteration

    def add(self, tag: Any) -> None:
        if isinstance(tag, tuple):
            self.shard(tag[0]).add(tag[1])
        else:
            self.objects.add(tag)

    def shard(self, position: int) -> Watermark:
        return self.shards.setdefault(position, Watermark())

    def to_state(self) -> dict[str, Any]:
        return {
            "delivered": self.objects.to_state(),
            "shards": [[position, *mark.to_state()] for position, mark in sorted(self.shards.items())],
            "shard_samples": sorted(self.shard_samples.items()),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Progress:
        if not state:
            return cls()
        return cls(
            objects=Watermark.from_state(state["delivered"]),
            shards={int(p): Watermark(int(low), above) for p, low, above in state["shards"]},
            shard_samples={int(p): int(n) for p, n in state["shard_samples"]},
        )


def _drop(tagged: Generator[Any, None, None], count: int,
          progress: _Progress) -> Generator[Any, None, None]:
    """Skip the first ``count`` samples (read, not transformed), recording them as delivered."""
    with contextlib.closing(tagged):
        for number, (tag, sample) in enumerate(tagged):
            if number < count:
                progress.add(tag)
                continue
            yield tag, sample


def _tagged_nbytes(tagged: tuple[Tag, dict[str, Any]]) -> int:
    return sample_nbytes(tagged[1])


def _shard_complete(assignment: partition.ShardAssignment, samples: int | None,
                    delivered: Watermark) -> bool:
    """Whether a resumed shard has nothing left for this slot (so it is not read again)."""
    if samples is None:
        return False
    return len(delivered) >= assignment.wanted(samples)


def _check_counts(counts: Any) -> dict[str, int]:
    """``sample_counts``: a mapping of shard URL (or key) to its number of samples."""
    if not isinstance(counts, dict):
        raise ConfigError(f"sample_counts must map shard URL -> sample count, not {type(counts).__name__}")
    for url, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"sample_counts[{url!r}]={count!r} must be a non-negative integer")
    return dict(counts)


_warned_split = False


def _warn_sample_split(num_shards: int, slots: int) -> None:
    global _warned_split
    if not _warned_split:
        _warned_split = True
        log.warning(
            "%d shard(s) for %d rank x worker slots: each slot reads a whole shard and keeps every "
            "n-th sample, so each shard is downloaded up to %d times; use at least %d shards "
            "to read each once", num_shards, slots, -(-slots // num_shards), slots,
        )
