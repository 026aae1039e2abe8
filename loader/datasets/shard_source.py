"""``ShardSource``: WebDataset tar shards, streamed and parsed on the fly.

Shards come from brace patterns, URI lists or prefixes (listed once, on demand). How a slot's
share becomes shard reads depends on what is known: blocks of the epoch's order (``batch_size=``),
equal runs per rank (sample counts known), or whole shards dealt to slots (counts unknown).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import random
import sys
from collections.abc import Container, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import anyio

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

from ..checks import check_int
from ..decode import apply_transform
from ..engine.fetch import AnyJob, Delivery, EngineLimits, Job, JobContext, JobFn, first_error
from ..errors import ConfigError, EmptyDatasetError
from ..formats.shards import (
    END,
    SPAN_BYTES,
    ShardAssignment,
    ShardEnd,
    ShardOptions,
    ShardRef,
    Tag,
    sample_nbytes,
    shard_job,
)
from ..listing.inputs import resolve_shards, shard_specs
from ..listing.sharing import raise_if_failed_before_fork, ticket, track
from ..listing.versions import Versions, versions_of
from ..shard_index.counts import (
    Counts,
    fetch_index,
    given_counts,
    index_command,
    index_location,
    match_index,
    missing_shards,
    overwritten_shards,
    probe_unlisted,
    unknown_counts_advice,
    with_versions,
)
from ..shard_index.format import INDEX_NAME
from . import cycling, partition
from .options import LoaderOptions, check_budget, shard_read_bytes
from .progress import Watermark
from .protocol import Progress, Read, Run, Slot, Tagged
from .shuffle import shuffled
from .window_order import (
    SLOT_UNITS,
    WINDOW_UNITS,
    Segment,
    UnitRead,
    WindowOrder,
    contiguous_positions,
    index_ranges,
    plan_reads,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShardProgress:
    """Per shard of this worker's plan: the sample indices delivered, and how many samples the
    shard held once it was read to its end. Tags are ``(plan position, sample index)``."""

    shards: dict[int, Watermark] = dataclasses.field(default_factory=dict)
    shard_samples: dict[int, int] = dataclasses.field(default_factory=dict)
    shards_skipped: int = 0
    tar_links_skipped: int = 0  # hard and symbolic links in shards (no data, so no field)
    shard_ends: int = 0  # end-of-shard markers seen in this iteration

    def add(self, tag: Any) -> None:
        self.shard(tag[0]).add(tag[1])

    def shard(self, position: int) -> Watermark:
        return self.shards.setdefault(position, Watermark())

    def to_state(self) -> dict[str, Any]:
        return {
            "shards": [[position, *mark.to_state()] for position, mark in sorted(self.shards.items())],
            "shard_samples": sorted(self.shard_samples.items()),
        }

    def counters(self) -> dict[str, int]:
        return {"shards_skipped": self.shards_skipped, "tar_links_skipped": self.tar_links_skipped,
                "shard_ends": self.shard_ends}

    def delivered(self) -> int:
        """Samples delivered in all (the state's worth, a resume included)."""
        return sum(len(mark) for mark in self.shards.values())

    def count_ends(self, items: Iterable[tuple[Tag, Any]]) -> Generator[tuple[Tag, Any], None, None]:
        """``items`` less the end-of-shard markers, which update this progress instead."""
        for tag, item in items:
            if tag[1] == END:
                self.ended(tag[0], item)
            else:
                yield tag, item

    def ended(self, position: int, end: ShardEnd) -> None:
        """The shard at ``position`` was read to its end (or skipped)."""
        self.shard_samples[position] = end.samples
        self.shards_skipped += end.skipped
        self.tar_links_skipped += end.links
        self.shard_ends += 1

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ShardProgress:
        if not state:
            return cls()
        return cls(shards={int(p): Watermark(int(low), above) for p, low, above in state["shards"]},
                   shard_samples={int(p): int(n) for p, n in state["shard_samples"]})


class ShardSource:
    """Tar shards (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``/``.tzst``) of one or more buckets."""

    kind = "shards"
    unit_name = "shards"  # what ``size()`` counts, in messages

    def __init__(self, shards: str | Iterable[str], options: LoaderOptions, *,
                 shard_options: ShardOptions | None = None,
                 sample_counts: Mapping[str, int] | None = None) -> None:
        self.options = options
        self.shard_options = shard_options or ShardOptions()
        check_budget(options, self.shard_options)
        self._given: str | list[str] = shards if isinstance(shards, str) else list(shards)
        self._specs = shard_specs(self._given)
        self._listing_ticket = ticket(repr(("shards", self._specs)))  # see ``sharing``
        self._shards: list[ShardRef] | None = None
        self._sample_counts = None if sample_counts is None else check_counts(sample_counts)
        self._counts: Counts | None = None
        self._counts_tried = False
        self._no_index = ""  # why no index gives the counts, when none does
        _check_combinations(options, self.shard_options, sample_counts)
        track(self)  # listed before workers fork; the backend is imported meanwhile (``_listed``)

    # ------------------------------------------------------------------ what is read

    def shards(self) -> list[ShardRef]:
        """The shard list, listing prefixes now if not done yet (and reading the index, whose
        versions pin the reads of shards that no listing described)."""
        self.counts()
        assert self._shards is not None
        return self._shards

    def _listed(self) -> list[ShardRef]:
        if self._shards is None:
            raise_if_failed_before_fork(self)
            self._shards = resolve_shards(self._specs, factory=self.options.listing_factory(),
                                          retry=self.options.retry, options=self.options.listing,
                                          ticket=self._listing_ticket,
                                          meanwhile=self.options.preload_backend)
            self.options.preload_backend()  # where nothing was listed here (shards named, another rank)
        return self._shards

    def counts(self) -> Counts | None:
        """What is known of each shard's sample count: ``sample_counts=``, else the index (one
        GET, once); None when there is neither."""
        if self._counts_tried:
            return self._counts
        shards = self._listed()
        if self._sample_counts is not None:
            self._counts = given_counts(shards, self._sample_counts)
        else:
            given = self.shard_options.index
            uri = index_at(given) if given else index_location(shards)
            document, self._no_index = None, "the shards lie in several buckets (index= can say where their index is)"
            if uri is not None:
                document, self._no_index = fetch_index(uri, self.options.listing_factory(),
                                                       self.options.retry)
            if document is None and given:
                raise ConfigError(f"index={given!r}: {self._no_index}; write one with "
                                  f"`{self._command()} --out {uri}`")
            if document is not None and uri is not None:
                blocks = self.options.batch_size is not None and self.shard_options.samples_per_epoch is None
                self._counts = match_index(shards, document, uri, offsets=blocks,
                                           fix=f"run `{self._command()}` again (it reads only the "
                                               "shards that changed)")
                changed = probe_unlisted(shards, self._counts, self.options.listing_factory(),
                                         self.options.retry)
                if self._counts.missing:
                    raise missing_shards(self._given, shards, self._counts.missing)
                if changed:
                    raise overwritten_shards(self._counts, changed)
                self._shards = with_versions(shards, self._counts)
        self._counts_tried = True
        return self._counts

    def shard_counts(self) -> list[int] | None:
        """Samples per shard in ``shards()`` order, when every shard's count is known."""
        counts = self.counts()
        return None if counts is None else counts.complete(self.shards())

    def unit_counts(self) -> list[int] | None:
        """Samples per unit read (a shard here), in the order ``size()`` counts them."""
        return self.shard_counts()

    def _command(self) -> str:
        return index_command(self._given, self._listed())

    # ------------------------------------------------------------------ the Source protocol

    def resolve(self) -> None:
        self.shards()

    def size(self) -> int:
        return len(self.shards())

    def count(self) -> int | None:
        counts = self.unit_counts()
        return None if counts is None else sum(counts)

    def fixed_rank_length(self) -> int | None:
        return self.shard_options.samples_per_epoch

    def missing_count(self) -> str:
        counts = self.counts()
        problems = self._no_index if counts is None else counts.problems()
        return unknown_counts_advice(self._command(), problems)

    def skipped(self, url: str, key: str | None) -> str:
        return f"sample {key!r} of shard {url}, going on with the rest of the shard"

    def progress(self, state: Mapping[str, Any]) -> ShardProgress:
        return ShardProgress.from_state(state)

    def assignments(self, slot: Slot) -> list[ShardAssignment]:
        """Which shards ``slot`` reads, and which samples of each, in reading order."""
        counts = self.unit_counts()
        if slot.positions is not None:  # blocks of the epoch's order (see partition)
            if counts is None:
                raise ConfigError(f"batch_size= in shard mode deals samples: {self.missing_count()}")
            order = partition.epoch_order(len(counts), seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle)
            return partition.sequence_ranges(counts, order, slot.positions)
        if counts is not None:  # equal length per rank, exactly once (up to the pad policy)
            return partition.balanced_shard_ranges(counts, policy=slot.policy, **slot.where())
        if slot.world_size > 1 and not self.shard_options.uneven_ranks:
            raise ConfigError(f"{slot.world_size} ranks read {len(self.shards())} tar shards, but "
                              + self.missing_count())
        shards = self.size()
        _, slots = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
        if partition.needs_sample_split(shards, slots):
            _warn_sample_split(shards, slots)
        return partition.shard_assignments(shards, **slot.where())

    def stream(self, slot: Slot, progress: Progress, run: Run) -> Generator[Tagged, None, None]:
        assert isinstance(progress, ShardProgress)
        if self.shard_options.samples_per_epoch is not None:
            yield from self._cycle(slot, progress, run, self.shard_options.samples_per_epoch)
            return
        if self.unit_counts() is not None:  # the epoch's order is known sample by sample
            yield from self._planned(slot, progress, run)
            return
        options = self.shard_options
        jobs = [
            self.job(a, position, skip=progress.shard(position))
            for position, a in enumerate(self.assignments(slot))
            if not shard_complete(a, progress.shard_samples.get(position), progress.shard(position))
        ]
        # counts unknown: whole shards dealt to slots, their samples interleaved and mixed by the
        # shuffle buffer; unshuffled, each shard is delivered whole, in turn (the stored order)
        delivery: Delivery = "ordered" if not self.options.shuffle else (
            "interleave" if self.options.ordered else "completed")
        limits = self.limits(delivery)
        size = options.buffer_size if self.options.shuffle else 0
        with contextlib.closing(progress.count_ends(run(jobs, limits))) as stream:
            yield from shuffled(stream, size, slot_rng(slot), max_bytes=options.shuffle_bytes,
                                nbytes=tagged_nbytes)

    def unit_order(self, slot: Slot) -> WindowOrder:
        """The epoch's sample order (``window_order``): units shuffled, merged by windows."""
        counts = self.unit_counts()
        assert counts is not None
        return WindowOrder(counts, seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle,
                           **self.window_options())

    def window_options(self) -> dict[str, Any]:
        """How units are merged (``WindowOrder``'s keywords, indexed by unit).

        A tar shard streams, so it keeps its stored order inside its window. A window holds up
        to ``WINDOW_UNITS`` shards whose reads fit together in what ``shards_inflight`` shards
        read whole may hold (half each, as two windows are read at once): a read from the
        index's offsets holds a GET's span and the next, and a shard of at most two parts
        streams in chunks, so 64 fit; a larger shard without offsets is read in ranged parts,
        so only ``shards_inflight // 2`` do."""
        options, counts = self.shard_options, self.counts()
        whole = shard_read_bytes(options.parts_inflight, options.part_size)
        # a span and the next fetched ahead (or a streamed chunk), the member being parsed, and
        # the samples parsed ahead of their turn (READ_QUEUE_ITEMS, of the shard's mean size)
        small = 2 * min(options.part_size, SPAN_BYTES) + options.chunk_size
        samples = self.unit_counts() or []

        def weight(number: int, shard: ShardRef) -> int:
            queued = 0 if shard.size is None or number >= len(samples) else (
                READ_QUEUE_ITEMS * shard.size // max(1, samples[number]))
            if shard.compression is None and counts is not None and counts.offsets.get(shard.url):
                return small + queued
            if shard.size is not None and shard.size <= 2 * options.part_size:
                return small + queued
            return whole + queued

        weights = [weight(number, shard) for number, shard in enumerate(self.shards())]
        # two windows are read at once (the next while this one delivers): each gets half
        return {"window": WINDOW_UNITS, "weights": weights,
                "cap": options.shards_inflight * whole // PLAN_JOBS_INFLIGHT}

    def _planned(self, slot: Slot, progress: ShardProgress, run: Run) -> Generator[Tagged, None, None]:
        """Read the slot's share of the epoch in a windowed order (``window_order``): one read
        per unit a window's stretch touches, run side by side in one job per stretch that emits
        their samples in the order's sequence (``segment_job``).

        With ``batch_size=`` the slot reads its blocks of the epoch's order, the same on every
        topology (so a resume is a slice of it). Without, the slot reads its run of the shuffled
        units (``partition.balanced_shard_ranges``: each unit once, as before) merged in an order
        of its own, and the shuffle buffer mixes on top: nothing resumes such a pass on another
        topology, so its order need not be shared. Where units are too few for every slot to
        mix its own (``SLOT_UNITS``), slots read runs of the shared order instead: each reads
        its part of every unit of a window (a Parquet unit is then fetched by each)."""
        counts = self.unit_counts()
        assert counts is not None
        _, slots = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
        pieces: list[tuple[int, int]] | None = None  # None: the order's units are the units
        if slot.positions is not None:
            order = self.unit_order(slot)
            positions: Iterable[int] = slot.positions
        elif len(counts) < SLOT_UNITS * slots:  # too few units to give every slot its own: the
            order = self.unit_order(slot)  # slots share the order's windows, a run of it each
            total = len(order)
            positions = (p % total for p in contiguous_positions(
                total, rank=slot.rank, world_size=slot.world_size, worker=slot.worker,
                num_workers=slot.num_workers, policy=slot.policy)) if total else ()
        else:
            assignments = partition.balanced_shard_ranges(counts, policy=slot.policy, **slot.where())
            pieces = [(a.shard, a.start) for a in assignments]
            options = self.window_options()
            at = [a.shard for a in assignments]
            for name in ("weights", "permuted"):
                if options.get(name) is not None:
                    options[name] = [options[name][unit] for unit in at]
            number, _ = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
            order = WindowOrder([(a.stop or 0) - a.start for a in assignments],
                                seed=partition.epoch_seed(slot.seed, number), epoch=slot.epoch,
                                shuffle=slot.shuffle, **options)
            positions = range(len(order))
        # The engine's thread makes the jobs: give it a copy of what a resumed state says was
        # delivered, not the progress this thread updates.
        delivered = {p: Watermark.from_state(mark.to_state()) for p, mark in progress.shards.items()}
        plan = plan_reads(order, positions)
        if pieces is not None:
            plan = (Segment([read._replace(unit=pieces[read.unit][0],
                                           indices=tuple(pieces[read.unit][1] + i for i in read.indices))
                             for read in segment.reads], segment.schedule) for segment in plan)
        jobs = (self.segment_job(segment, delivered) for segment in plan)
        size = self.shard_options.buffer_size if slot.shuffle and slot.positions is None else 0
        stream = run(jobs, self.plan_limits())
        with contextlib.closing(stream):
            yield from shuffled(stream, size, slot_rng(slot), max_bytes=self.shard_options.shuffle_bytes,
                                nbytes=tagged_nbytes)

    def plan_limits(self) -> EngineLimits:
        """The engine's limits for a plan's jobs (one per window stretch): the next window's
        reads start while this one's samples are delivered."""
        return self.options.limits("ordered", max_inflight=PLAN_JOBS_INFLIGHT)

    def segment_job(self, segment: Segment, delivered: Mapping[int, Watermark]) -> Job:
        """One engine job for a stretch of a window: its reads run side by side as tasks, each
        into a queue of ``READ_QUEUE_ITEMS``, and the job emits their samples in the order's
        sequence (what a resume delivered left out). One job, not one per read: the engine then
        wakes one waiter per sample, not every read parked with a sample to hand over."""
        nothing = Watermark()
        reads = [(read, self.read_job(read, delivered.get(read.number, nothing))) for read in segment.reads]
        left = {read.number: iter(read.indices) for read in segment.reads}
        schedule = [number for number in segment.schedule
                    if next(left[number]) not in delivered.get(number, nothing)]

        async def job(ctx: JobContext) -> None:
            try:
                await merge(ctx)
            except BaseExceptionGroup as group:  # the task group wraps; callers want the error itself
                raise first_error(group) from None

        async def merge(ctx: JobContext) -> None:
            queues: dict[int, Any] = {}
            async with anyio.create_task_group() as reading:
                for read, read_job in reads:
                    send, receive = anyio.create_memory_object_stream[tuple[Any, int]](READ_QUEUE_ITEMS)
                    queues[read.number] = receive
                    reading.start_soon(_into_queue, read_job, ctx, send)
                for number in schedule:
                    queue = queues[number]
                    try:  # without a trip through the loop when the sample is there (anyio's
                        item, nbytes = queue.receive_nowait()  # receive() always yields)
                    except anyio.WouldBlock:
                        try:
                            item, nbytes = await queue.receive()
                        except anyio.EndOfStream:  # a read that ended early (on_error skipped the rest)
                            continue
                    except anyio.EndOfStream:
                        continue
                    await ctx.emit(item, nbytes)
                for receive in queues.values():
                    receive.close()

        return Job(job, reserve=sum(read_job.reserve or 0 for _, read_job in reads))

    def read_job(self, read: UnitRead, skip: Container[int]) -> Job:
        """The job of one read of a plan: its unit's samples ``read.indices``, emitted in that
        order as ``((read.number, index), sample)`` (no end-of-shard marker). Unshuffled, a run
        is read as before (from the shard's start, in ranged parts); shuffled, many reads run
        side by side, each from the index's offsets where known (one GET's span held each)."""
        ranges = index_ranges(read.indices)
        if len(ranges) == 1 and not self.options.shuffle:
            assignment = ShardAssignment(read.unit, 1, 0, ranges[0][0], ranges[0][1])
        else:
            assignment = ShardAssignment(read.unit, 1, 0, ranges[0][0], ranges[-1][1], ranges)
        job = self.job(assignment, read.number, skip=skip, order=read.indices)
        return samples_only(job, self.reserve(assignment))

    def _cycle(self, slot: Slot, progress: ShardProgress, run: Run, per_rank: int,
               ) -> Generator[Tagged, None, None]:
        """``samples_per_epoch``: this slot's quota of the rank's samples, from passes over the
        shards without end (see ``cycling``), less what ``progress`` says was delivered.

        Shards are delivered in plan order, a marker after each pass; the shuffle buffer mixes
        one pass at a time and is emptied at its end, so a pass's samples all come before any
        of them repeats."""
        left = cycling.worker_quota(per_rank - slot.seen, worker=slot.worker, num_workers=slot.num_workers,
                                    batch_size=self.options.batch_size) - progress.delivered()
        if left <= 0:
            return
        options = self.shard_options
        plan = cycling.cycle(self.size(), seed=cycling.pass_seed(slot.seed, slot.epoch, slot.seen),
                             shuffle=slot.shuffle, rank=slot.rank, world_size=slot.world_size,
                             worker=slot.worker, num_workers=slot.num_workers)
        # The jobs are made in the engine's thread as it needs them: give them a copy of what a
        # resumed state says was delivered, not the progress this thread updates.
        delivered = {p: Watermark.from_state(mark.to_state()) for p, mark in progress.shards.items()}
        ended = dict(progress.shard_samples)

        def jobs() -> Generator[AnyJob, None, None]:
            earlier, this_pass = False, 0  # whether a resumed state delivered samples of this pass
            for position, (number, a) in enumerate(plan):
                if number != this_pass:
                    yield _pass_marker(earlier)
                    earlier, this_pass = False, number
                done = delivered.get(position, Watermark())
                earlier = earlier or len(done) > 0
                if not shard_complete(a, ended.get(position), done):
                    yield self.job(a, position, skip=done, offsets=False)

        limits = self.limits("ordered")

        def samples() -> Generator[tuple[Tag, Any] | None, None, None]:
            found = 0  # samples of this pass
            for tag, item in run(jobs(), limits):
                if tag[1] == END:
                    progress.ended(tag[0], item)
                elif tag[1] == _PASS_END:
                    if not found and not item:
                        _, slots = partition.slot_of(slot.rank, slot.world_size, slot.worker,
                                                     slot.num_workers)
                        raise EmptyDatasetError(
                            f"rank {slot.rank} worker {slot.worker} read a whole pass over its shards "
                            f"without finding a sample ({self.size()} {self.unit_name} for {slots} rank x worker "
                            "slots): samples_per_epoch needs samples in every slot's share; use more "
                            "shards or fewer workers")
                    found = 0
                    yield None
                else:
                    found += 1
                    yield tag, item

        def one_pass(stream: Iterator[tuple[Tag, Any] | None]) -> Generator[tuple[Tag, Any], None, None]:
            for tagged in stream:
                if tagged is None:
                    return
                yield tagged

        def mixed(stream: Iterator[tuple[Tag, Any] | None]) -> Generator[tuple[Tag, Any], None, None]:
            size, rng = (options.buffer_size if self.options.shuffle else 0), slot_rng(slot)
            while True:
                yield from shuffled(one_pass(stream), size, rng, max_bytes=options.shuffle_bytes,
                                    nbytes=tagged_nbytes)

        with contextlib.closing(samples()) as stream:
            yield from itertools.islice(mixed(stream), left)

    def reads(self, slot: Slot) -> list[Read]:
        if slot.positions is None:
            raise ValueError("reads() needs the slot's positions")
        if self.unit_counts() is None:
            raise ConfigError(f"batch_size= in shard mode deals samples: {self.missing_count()}")
        order = self.unit_order(slot)
        return [Read(self.read_job(read, frozenset()), len(read.indices), _is_sample,
                     self.reserve(ShardAssignment(read.unit, 1, 0)), read.tags)
                for segment in plan_reads(order, slot.positions) for read in segment.reads]

    # ------------------------------------------------------------------ how one shard is read
    # (a source of other units dealt like shards, such as Parquet row groups, overrides these)

    def job(self, assignment: ShardAssignment, position: int, *, skip: Container[int] = frozenset(),
            offsets: bool = True, order: Sequence[int] | None = None) -> AnyJob:
        """The engine job that reads ``assignment``'s samples as plan position ``position``,
        less ``skip``; ``offsets``: ranged reads from the index's offsets where they apply.
        ``order``: the order to emit them in (a tar shard streams: only its stored order)."""
        shard, counts = self.shards()[assignment.shard], self.counts()
        return shard_job(shard, position, assignment, self.shard_options, skip=skip,
                         on_error=self.options.on_error,
                         offsets=counts.offsets.get(shard.url) if offsets and counts is not None else None,
                         expect=None if counts is None else counts.expect(shard))

    def reserve(self, assignment: ShardAssignment) -> int:
        """Bytes one read holds while it runs (a mix's budget counts them)."""
        options = self.shard_options
        return shard_read_bytes(options.parts_inflight, options.part_size)  # parts, or chunks and a member

    def limits(self, delivery: Delivery) -> EngineLimits:
        """The engine's limits for this source's reads."""
        return self.options.limits(delivery, max_inflight=self.shard_options.shards_inflight)

    def transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)

    def versions(self) -> Versions | None:
        return versions_of(self.shards())

    def describe(self) -> str:
        if self._shards is not None:
            return f"{len(self._shards)} shards"
        return f"shards {self._specs[:2]}"


def _check_combinations(options: LoaderOptions, shard_options: ShardOptions,
                        sample_counts: Mapping[str, int] | None) -> None:
    """Options that cannot go together, refused at construction rather than ignored."""
    if sample_counts is not None and shard_options.index is not None:
        raise ConfigError("give sample_counts= or index=, not both")
    if shard_options.samples_per_epoch is not None and not options.ordered:
        raise ConfigError("samples_per_epoch= reads its passes over the shards in order (the "
                          "shuffle buffer mixes each pass), so ordered=False cannot apply; drop it")
    buffer = shard_options.shuffle_buffer
    if (options.batch_size is not None and buffer and shard_options.samples_per_epoch is None):
        raise ConfigError(
            f"shuffle_buffer={buffer!r} cannot be used with batch_size=: blocks of the epoch's order "
            "are read in order (a per-worker buffer would tie the order to the number of workers "
            "and break resuming on another topology), so no buffer mixes them. Drop "
            "shuffle_buffer=: with shuffle=True the epoch's order already mixes the samples of up "
            "to 64 shards at a time")


def index_at(uri: str) -> str:
    """``index=``: a URI ending in ``/`` means the ``index.json`` in that folder."""
    return uri + INDEX_NAME if uri.endswith("/") else uri


def slot_rng(slot: Slot) -> random.Random:
    """The shuffle buffer's generator for one slot and epoch."""
    number, _ = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
    return random.Random(partition.epoch_seed(slot.seed, slot.epoch) ^ (number << 20) ^ (slot.seen << 40))


_PASS_END = -2  # the sample index that tags the end of a pass (``samples_per_epoch``)


def _pass_marker(earlier: bool) -> JobFn:
    """A job that marks the end of a pass (``earlier``: a resumed state delivered some of it)."""

    async def job(ctx: JobContext) -> None:
        await ctx.emit(((-1, _PASS_END), earlier), 0)

    return job


def check_counts(counts: Any) -> dict[str, int]:
    """``sample_counts``: a mapping of shard URL (or key) to its number of samples."""
    if not isinstance(counts, Mapping):
        raise ConfigError(f"sample_counts must map shard URL -> sample count, not {type(counts).__name__}")
    for url, count in counts.items():
        check_int(f"sample_counts[{url!r}]", count, minimum=0, must="a non-negative integer")
    return dict(counts)


PLAN_JOBS_INFLIGHT = 2
"""Window stretches a plan reads at once: the one being delivered and the next."""
READ_QUEUE_ITEMS = 16
"""Samples one read of a window may hold parsed ahead of their turn (besides the span it reads)."""


class _Queued:
    """What a read of a window's stretch sees: its samples go into its queue (the end-of-shard
    marker is left out: the plan knows each unit's count)."""

    __slots__ = ("store", "retry", "_ctx", "_send")

    def __init__(self, ctx: JobContext, send: Any) -> None:
        self.store, self.retry, self._ctx, self._send = ctx.store, ctx.retry, ctx, send

    async def emit(self, item: Any, nbytes: int) -> None:
        if item[0][1] != END:
            try:
                self._send.send_nowait((item, nbytes))  # no trip through the loop while there is room
            except anyio.WouldBlock:
                await self._send.send((item, nbytes))

    def retried(self, exc: BaseException) -> None:
        self._ctx.retried(exc)


async def _into_queue(job: Job, ctx: JobContext, send: Any) -> None:
    async with send:
        try:
            await job.run(_Queued(ctx, send))  # type: ignore[arg-type]
        except anyio.BrokenResourceError:
            pass  # the stretch stopped taking samples (it ended early)


class _SamplesOnly:
    """What a plan's job sees: its context, less the end-of-shard marker (a scheduled delivery
    has no place for it, and a plan knows every unit's count)."""

    __slots__ = ("store", "retry", "_ctx")

    def __init__(self, ctx: JobContext) -> None:
        self.store, self.retry, self._ctx = ctx.store, ctx.retry, ctx

    async def emit(self, item: Any, nbytes: int) -> None:
        if item[0][1] != END:
            await self._ctx.emit(item, nbytes)

    def retried(self, exc: BaseException) -> None:
        self._ctx.retried(exc)


def samples_only(job: AnyJob, reserve: int | None) -> Job:
    """``job`` without its end-of-shard marker, saying what it holds (the engine's budget)."""
    inner = Job.of(job)

    async def wrapped(ctx: JobContext) -> None:
        await inner.run(_SamplesOnly(ctx))  # type: ignore[arg-type]

    return Job(wrapped, reserve=reserve if inner.reserve is None else inner.reserve,
               reads_ahead=inner.reads_ahead)


def _is_sample(tag: Tag) -> bool:
    return tag[1] != END


def tagged_nbytes(tagged: tuple[Tag, dict[str, Any]]) -> int:
    return sample_nbytes(tagged[1])


def shard_complete(assignment: ShardAssignment, samples: int | None, delivered: Watermark) -> bool:
    """Whether a resumed shard has nothing left for this slot (so it is not read again)."""
    return samples is not None and len(delivered) >= assignment.wanted(samples)


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
