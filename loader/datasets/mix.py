"""Mixing data sets by weight: ``mix({"web": a, "curated": b}, weights={...})``.

A ``MixSource`` is a source over sources. Each epoch it gives every source its share of the
epoch (``mix_order.apportion``) and orders the shares by the chairman assignment
(``mix_order.DrawOrder``); the result is one sequence that ``AsyncS3Dataset`` deals, resumes
and counts like any other, the same on any number of ranks and workers. A source is read as an
endless stream of passes, each in a fresh order from ``(seed, source name, pass)``; an epoch
takes the next stretch of it (``"continue"``: every sample is seen before any repeats, across
epochs) or a stretch starting at a fresh pass (``"epoch"``). All sources share one engine.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from ..checks import check_int
from ..config import S3Config
from ..decode import apply_transform
from ..engine.fetch import AnyJob, Job, JobContext
from ..errors import ConfigError, EmptyDatasetError
from ..listing.versions import Versions, first_known
from ..retry import RetryPolicy
from ..s3 import ObjectStore, StoreFactory
from . import lanes, partition
from .groups import Limits, Split, Store
from .mix_order import DrawOrder, Tallied, apportion
from .object_samples import OnError
from .object_source import ObjectProgress
from .options import Options, Transform, check_mix_part, dataset_options
from .progress import Watermark
from .protocol import LaneMixable, Mixable, Progress, Read, Run, Slot, Tagged

if TYPE_CHECKING:
    from .iterable import AsyncS3Dataset

Sampling = Literal["continue", "epoch"]
SAMPLINGS = ("continue", "epoch")
SOURCE_FIELD = "__source__"
DEFAULT_MIX_BUDGET = 1 << 30  # a mix bounds its reads in bytes even when no memory_budget is given


@dataclasses.dataclass(frozen=True)
class Part:
    """One source of a mix: its name, what it reads, its weight (None: its size) and how it is
    sampled."""

    name: str
    source: Mixable
    weight: float | None
    shuffle: bool
    sampling: Sampling
    seed: int  # of this source's passes, from the mix's seed and the name


class MixSource:
    """Sources mixed by weight into one epoch (see the module docstring)."""

    kind = "mix"

    def __init__(self, parts: list[Part], options: Options, samples_per_epoch: int | None) -> None:
        self.parts = parts
        self.options = options
        options.preload_backend()  # the backend the mix's engine reads with
        self.samples_per_epoch = samples_per_epoch
        self._counts: list[int] | None = None
        self._by_name = {part.name: part for part in parts}
        self._tallied: Tallied | None = None  # the draw order, counted (tallied())

    # ------------------------------------------------------------------ sizes

    def sizes(self) -> list[int]:
        """Samples in one pass over each source (tar shards need their counts: ``loader index``)."""
        out = []
        for part in self.parts:
            count = part.source.count()
            if count is None:
                raise ConfigError(f"mix source {part.name!r}: {part.source.missing_count()}")
            if count == 0:
                raise EmptyDatasetError(f"mix source {part.name!r} holds no samples")
            out.append(count)
        return out

    def shares(self) -> list[int]:
        """Samples each source gives every epoch."""
        if self._counts is None:
            sizes = self.sizes()
            weights = [size if part.weight is None else part.weight for part, size in zip(self.parts, sizes)]
            total = self.samples_per_epoch
            if total is None:  # the longest epoch in which no source repeats a sample
                whole = sum(weights)
                total = min(int(size * whole / w) for size, w in zip(sizes, weights) if w > 0)
            self._counts = apportion(total, weights)
        return self._counts

    # ------------------------------------------------------------------ the Source protocol

    def resolve(self) -> None:
        for part in self.parts:
            part.source.resolve()
        self.shares()
        if self.deals_lanes():
            self.tallied()  # here, once: DataLoader workers started later inherit it

    def tallied(self) -> Tallied:
        """The epoch's draw order (the same every epoch) as ``Tallied`` counts, made once per
        process (1 byte a position): a worker's share of sources read in lanes needs its lanes'
        sizes, which depend on every position; with these, counting them costs no walk."""
        if self._tallied is None:
            self._tallied = Tallied(self.shares())
        return self._tallied

    def size(self) -> int:
        return sum(self.shares())

    def count(self) -> int:
        return sum(self.shares())

    def missing_count(self) -> str:
        return ""

    def fixed_rank_length(self) -> None:
        return None  # the mix's epoch (samples_per_epoch= or the default) is an order dealt to ranks

    def deals_lanes(self) -> bool:
        return any(part.shuffle and part.source.deals_lanes() for part in self.parts)

    def skipped(self, url: str, key: str | None) -> str:
        return url if key is None else f"sample {key!r} from {url}"

    def progress(self, state: Mapping[str, Any]) -> ObjectProgress:
        return ObjectProgress(Watermark.from_state(state["delivered"]) if state else None)

    def stream(self, slot: Slot, progress: Progress, run: Run) -> Generator[Tagged, None, None]:
        assert isinstance(progress, ObjectProgress)
        shares, sizes = self.shares(), self.sizes()
        total = sum(shares)
        positions = slot.positions
        if positions is None:  # the draw order is the order: deal it as is, strided like samples
            positions = partition.partition(total, seed=slot.seed, epoch=slot.epoch, shuffle=False,
                                            rank=slot.rank, world_size=slot.world_size, worker=slot.worker,
                                            num_workers=slot.num_workers, policy=slot.policy)
        todo = [(tag, q) for tag, q in enumerate(positions) if tag not in progress.delivered]
        laned = {s for s, part in enumerate(self.parts) if part.source.deals_lanes()}
        walked = self._walk(slot, [q for _, q in todo], laned)
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (source, pass) -> [(tag, position)]
        in_lanes: dict[int, list[tuple[int, int]]] = {}  # source -> [(tag, mix position)]
        for tag, q in todo:
            s, k = walked.located[q]
            part = self.parts[s]
            if s in laned:
                in_lanes.setdefault(s, []).append((tag, q))
                continue
            first = slot.epoch * shares[s] if part.sampling == "continue" else 0
            stream_pass, at = divmod(first + k, sizes[s])
            if part.sampling == "epoch":
                stream_pass += slot.epoch * (-(-shares[s] // sizes[s]))  # fresh passes each epoch
            groups.setdefault((s, stream_pass), []).append((tag, at))
        jobs: list[tuple[int, AnyJob]] = []  # (first tag, job)
        owner: dict[int, int] = {}  # tag -> index into jobs (before sorting)
        for (s, stream_pass), entries in groups.items():
            part = self.parts[s]
            reads = part.source.reads(dataclasses.replace(
                slot, seed=part.seed, epoch=stream_pass, shuffle=part.shuffle,
                positions=[at for _, at in entries]))
            at = 0
            for read in reads:
                tags = [tag for tag, _ in entries[at:at + read.size]]
                at += read.size
                if not tags:
                    continue
                for tag in tags:
                    owner[tag] = len(jobs)
                jobs.append((tags[0], _labelled(read, tags, part)))
        for s, entries, read, members in self._lane_reads(slot, in_lanes, walked):
            tags = [entries[m][0] for m in members]
            for tag in tags:
                owner[tag] = len(jobs)
            jobs.append((tags[0], _labelled(read, tags, self.parts[s])))
        launch = sorted(range(len(jobs)), key=lambda j: jobs[j][0])
        number = {j: n for n, j in enumerate(launch)}
        schedule = [number[owner[tag]] for tag, _ in todo]
        budget = self.options.limits.memory or DEFAULT_MIX_BUDGET
        limits = self.options.engine_limits("scheduled", inflight_bytes=max(1, budget - self.options.queue_bytes))
        yield from run((jobs[j][1] for j in launch), limits, schedule)

    # ------------------------------------------------------------------ sources read in lanes

    def _walk(self, slot: Slot, wanted: list[int], laned: set[int]) -> _Walked:
        """``(source, k)`` of each of ``wanted`` (positions of the epoch's draw order), and, for
        the sources ``laned`` (read in lanes), how many samples of each chunk (pass) each lane
        holds and ``(chunk, lane, draw)`` of each wanted position of theirs. With such sources
        everything comes from ``tallied()`` (counts of bytes, per wanted position or lane);
        without, the order is walked up to the last position wanted."""
        total = sum(self.shares())
        walked = _Walked({}, {}, {}, {})
        if not wanted:
            return walked
        if min(wanted) < 0 or max(wanted) >= total:
            raise IndexError(f"positions must lie in [0, {total}) (got {min(wanted)}..{max(wanted)})")
        located, draws = walked.located, walked.draws
        if not laned:
            want, last = set(wanted), max(wanted)
            for q, (s, k) in enumerate(DrawOrder(self.shares()).walk()):
                if q in want:
                    located[q] = (s, k)
                if q == last:
                    break
            return walked
        tallied = self.tallied()
        for q in set(wanted):
            s = tallied.sources[q]
            located[q] = (s, tallied.before(s, q))
        count, step, table = self._lane_dealing(slot)
        spans: dict[int, list[tuple[int, int]]] = {}  # laned source -> per chunk, its positions [start, stop)
        for s in laned:
            chunks = walked.chunks[s] = self._share_chunks(s, slot.epoch)
            ends = [first for first, _ in chunks[1:]] + [self.shares()[s]]
            spans[s] = [(tallied.position(s, first), tallied.position(s, end - 1) + 1)
                        for (first, _), end in zip(chunks, ends)]
            walked.sizes[s] = [[tallied.in_lane(s, lane, start, stop, step, table) for lane in range(count)]
                               for start, stop in spans[s]]
        groups: dict[tuple[int, int, int], list[int]] = {}  # (source, chunk, lane) -> wanted positions
        for q, (s, k) in located.items():
            if s in laned:
                chunk = bisect.bisect_right(walked.chunks[s], k, key=lambda c: c[0]) - 1
                groups.setdefault((s, chunk, table[(q // step) % len(table)]), []).append(q)
        for (s, chunk, lane), positions in groups.items():
            at, drawn = spans[s][chunk][0], 0  # the lane's draws of this chunk before ``at``
            for q in sorted(positions):
                drawn += tallied.in_lane(s, lane, at, q, step, table)
                draws[q] = (chunk, lane, drawn)
                at = q
        return walked

    def _lane_reads(self, slot: Slot, in_lanes: dict[int, list[tuple[int, int]]], walked: _Walked,
                    ) -> Generator[tuple[int, list[tuple[int, int]], Read, list[int]], None, None]:
        """The reads of this slot's samples of shuffled shard and Parquet sources, which deal
        their share of each epoch to lanes as they do alone (docs/design/shuffle.md): the
        share's samples of each pass (a stretch of the source's passes) are cut into pieces
        dealt to one lane per rank x worker slot of the run that started the epoch, and lane
        ``l``'s ``j``-th draw is the ``j``-th of the pass's positions that slot ``l`` reads (a
        pass's samples all come before the next pass's). Yields ``(source, entries, read,
        indices into entries)``."""
        chunks, sizes, draws = walked.chunks, walked.sizes, walked.draws
        for s, entries in in_lanes.items():
            part = self.parts[s]
            source = cast(LaneMixable, part.source)
            for chunk, (_, segments) in enumerate(chunks[s]):
                mine = [at for at, (_, q) in enumerate(entries) if draws[q][0] == chunk]
                if not mine:
                    continue
                for read, members in source.lane_reads(
                        segments, sizes[s][chunk], [draws[entries[at][1]][1:] for at in mine],
                        seed=part.seed + chunk, epoch=slot.epoch):
                    yield s, entries, read, [mine[m] for m in members]

    def _lane_dealing(self, slot: Slot) -> tuple[int, int, list[int]]:
        """How many lanes, and the lane of each mix position ``q``: ``table[(q // step) %
        len(table)]``; with ``batch_size=`` the blocks' (``Slot.lanes``), else the strided
        slot's of this run (periodic in ``world_size * workers``)."""
        workers = max(1, slot.num_workers)
        if slot.positions is not None:
            count, batch = slot.lanes or slot.world_size * workers, self.options.batch_size
            assert batch is not None  # positions are dealt in blocks of it
            return count, batch, list(range(count))  # lanes.block_lane's
        count = slot.world_size * workers
        return count, 1, [lanes.strided_lane(q, slot.world_size, workers) for q in range(count)]

    def _share_chunks(self, s: int, epoch: int) -> list[tuple[int, list[lanes.Segment]]]:
        """The samples source ``s`` gives ``epoch`` (a stretch of its passes, as unshuffled
        reads take them), one chunk per pass: ``(its first sample's index in the share, its
        segments of units in stored order)``."""
        part, share, size = self.parts[s], self.shares()[s], self.sizes()[s]
        counts = cast(LaneMixable, part.source).unit_counts()
        assert counts is not None
        first = epoch * share if part.sampling == "continue" else 0
        later = epoch * (-(-share // size)) if part.sampling == "epoch" else 0  # fresh passes
        chunks: list[tuple[int, list[lanes.Segment]]] = []
        at, end = first, first + share
        while at < end:
            stream_pass, offset = divmod(at, size)
            stop = min(size, offset + end - at)
            order = partition.epoch_order(len(counts), seed=part.seed, epoch=stream_pass + later, shuffle=True)
            chunks.append((at - first, sorted(lanes.stretch(counts, order, offset, stop))))
            at += stop - offset
        return chunks

    def transform(self, sample: dict[str, Any]) -> Any:
        name = sample[SOURCE_FIELD]
        out = self._by_name[name].source.transform(sample)
        if self.options.transform is not None:
            out = apply_transform(self.options.transform, out) if isinstance(out, dict) else self.options.transform(out)
        if isinstance(out, dict):
            out.setdefault(SOURCE_FIELD, name)
        return out

    def versions(self) -> Versions | None:
        return first_known([part.source.versions() for part in self.parts])

    def describe(self) -> str:
        return "a mix of " + ", ".join(f"{part.name} ({part.source.describe()})" for part in self.parts)


class _Walked(NamedTuple):
    """What one walk of a mix's draw order found (``MixSource._walk``)."""

    located: dict[int, tuple[int, int]]  # wanted position -> (source, k)
    draws: dict[int, tuple[int, int, int]]  # wanted position of a laned source -> (chunk, lane, draw)
    sizes: dict[int, list[list[int]]]  # laned source -> per chunk, samples per lane
    chunks: dict[int, list[tuple[int, list[lanes.Segment]]]]  # laned source -> _share_chunks


class _Context:
    """What a source's job sees inside a mix: its items renumbered by position in the mix,
    each sample marked with its source's name."""

    __slots__ = ("store", "retry", "_ctx", "_tags", "_next", "_read", "_name")

    def __init__(self, ctx: JobContext, tags: list[int], read: Read, name: str) -> None:
        self.store: ObjectStore = ctx.store
        self.retry: RetryPolicy = ctx.retry
        self._ctx, self._tags, self._read, self._name, self._next = ctx, tags, read, name, 0

    async def emit(self, item: Any, nbytes: int) -> None:
        tag, value = item
        if not self._read.is_sample(tag):
            return  # bookkeeping of the source (an end-of-shard marker): no position in the mix
        if isinstance(value, dict):
            value[SOURCE_FIELD] = self._name
        position, self._next = self._tags[self._next], self._next + 1
        await self._ctx.emit((position, value), nbytes)

    def retried(self, exc: BaseException) -> None:
        self._ctx.retried(exc)


def _labelled(read: Read, tags: list[int], part: Part) -> Job:
    inner = Job.of(read.job)

    async def job(ctx: JobContext) -> None:
        await inner.run(_Context(ctx, tags, read, part.name))  # type: ignore[arg-type]

    return Job(job, reserve=read.reserve)  # what the engine's budget counts


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's passes: stable across processes and Python versions."""
    digest = hashlib.blake2b(f"loader.mix:{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def mix(datasets: Mapping[str, AsyncS3Dataset], weights: Mapping[str, float] | None = None, *,
        samples_per_epoch: int | None = None,
        sampling: Sampling | Mapping[str, Sampling] = "continue", shuffle: bool = False,
        seed: int | None = None, transform: Transform | None = None, batch_size: int | None = None,
        on_error: OnError = "raise", limits: Limits | None = None, split: Split | None = None,
        store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
        **deprecated: Any) -> AsyncS3Dataset:
    """One iterable dataset drawing from several ``AsyncS3Dataset``s by weight.

    ``weights``: relative, per name (default: each dataset's size, so an epoch reads each once).
    ``samples_per_epoch``: the epoch's length (default: the longest in which no source repeats a
    sample, ``min(size / weight)`` over the sources). ``sampling`` (one value or per name):
    ``"continue"`` reads each source as one stream of shuffled passes across epochs, so every
    sample comes before any repeats, though an epoch that spans the end of one pass and the start
    of the next can hold a sample of that source twice; ``"epoch"`` starts each epoch on a fresh
    pass. A weight of 0 gives no samples, but the source is still listed: it must exist and hold
    samples (leave it out of ``datasets`` instead). Every sample carries ``"__source__"``. Each
    source keeps its ``transform``, ``shuffle``, ``on_error`` and shard options; how to load
    (``limits``, ``batch_size``, ``split``, ``store`` and ``config``) is the mix's, given here as
    keywords; ``seed`` seeds every source's passes.
    """
    from .iterable import AsyncS3Dataset

    if not isinstance(datasets, Mapping) or not datasets:
        raise ConfigError("mix() takes a non-empty mapping of name -> AsyncS3Dataset")
    if weights is not None and set(weights) != set(datasets):
        raise ConfigError(f"weights name {sorted(weights)}, the datasets {sorted(datasets)}; give one "
                          "weight per dataset")
    check_int("samples_per_epoch", samples_per_epoch, minimum=1, optional=True, must="a positive integer")
    loader_options, _ = dataset_options(  # a memory limit gives the mix's queue half, as for objects
        "mix", shuffle=shuffle, seed=seed, transform=transform, batch_size=batch_size,
        on_error=on_error, limits=limits, split=split, store=store, config=config, old=deprecated)
    parts = []
    for name, dataset in datasets.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"mix() names must be non-empty strings, not {name!r}")
        if not isinstance(dataset, AsyncS3Dataset) or not hasattr(dataset.source, "reads"):
            raise ConfigError(f"mix source {name!r} must be an AsyncS3Dataset over objects or shards, "
                              f"not {type(dataset).__name__}")
        check_mix_part(name, dataset.options, loader_options)
        weight = None if weights is None else weights[name]
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0 <= weight < math.inf):
            raise ConfigError(f"weights[{name!r}]={weight!r} must be a finite, non-negative number "
                              "(weights are relative: e.g. 0.7 and 0.3, or 7 and 3)")
        how = sampling if isinstance(sampling, str) else sampling.get(name, "continue")
        if how not in SAMPLINGS:
            raise ConfigError(f"sampling={how!r} for {name!r} must be one of {SAMPLINGS}")
        parts.append(Part(name, cast(Mixable, dataset.source), weight, dataset.options.shuffle, how,
                          source_seed(loader_options.effective_seed, name)))
    if weights is not None and not any(weights.values()):
        raise ConfigError("at least one weight must be above zero")
    return AsyncS3Dataset(MixSource(parts, loader_options, samples_per_epoch), options=loader_options)
