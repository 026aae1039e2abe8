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
import warnings
from collections.abc import Container, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..checks import check_int
from ..decode import apply_transform
from ..engine.fetch import AnyJob, Delivery, EngineLimits, JobContext, JobFn
from ..errors import ConfigError, EmptyDatasetError
from ..formats.shards import (
    END,
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
from . import cycling, lanes, partition
from .options import Options, check_budget, shard_read_bytes
from .progress import Watermark
from .protocol import Progress, Read, Run, Slot, Tagged
from .shuffle import shuffled

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

    def __init__(self, shards: str | Iterable[str], options: Options, *,
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
                                          retry=self.options.store.retry, options=self.options.store.listing,
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
                                                       self.options.store.retry)
            if document is None and given:
                raise ConfigError(f"index={given!r}: {self._no_index}; write one with "
                                  f"`{self._command()} --out {uri}`")
            if document is not None and uri is not None:
                blocks = ((self.options.batch_size is not None or self.options.shuffle)
                          and self.shard_options.samples_per_epoch is None)  # offsets: blocks, lanes
                self._counts = match_index(shards, document, uri, offsets=blocks,
                                           fix=f"run `{self._command()}` again (it reads only the "
                                               "shards that changed)")
                changed = probe_unlisted(shards, self._counts, self.options.listing_factory(),
                                         self.options.store.retry)
                if self._counts.missing:
                    raise missing_shards(self._given, shards, self._counts.missing)
                if changed:
                    raise overwritten_shards(self._counts, changed)
                self._shards = with_versions(shards, self._counts)
        self._counts_tried = True
        if self._counts is None:
            self._warn_no_lanes(shards)
        return self._counts

    def _warn_no_lanes(self, shards: list[ShardRef]) -> None:
        """Say (once, where the counts were looked for) that a shuffled epoch of shards without
        sample counts is mixed by the shuffle buffer alone, and how to get lanes instead."""
        if not self.options.shuffle or self.shard_options.samples_per_epoch is not None:
            return
        named = ", ".join(shard.url for shard in shards[:3])
        named += f" and {len(shards) - 3} more" if len(shards) > 3 else ""
        warnings.warn(
            f"shuffle=True over {len(shards)} tar shard(s) without sample counts ({named}; "
            f"{self._no_index}): each shard is read whole, in turn with a few others, and mixed by a "
            f"shuffle buffer of {self.shard_options.buffer_size} samples only, so shards packed in "
            "label order give batches of few labels. Write their index once: "
            f"`{self._command()}`; shuffled epochs are then cut into runs spread over the data set",
            RuntimeWarning, stacklevel=2)

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

    def deals_lanes(self) -> bool:
        return (self.options.shuffle and self.shard_options.samples_per_epoch is None
                and self.unit_counts() is not None)

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
        if self.in_lanes(slot):
            yield from self._lane_stream(slot, progress, run)
            return
        options = self.shard_options
        jobs = [
            self.job(a, position, skip=progress.shard(position))
            for position, a in enumerate(self.assignments(slot))
            if not shard_complete(a, progress.shard_samples.get(position), progress.shard(position))
        ]
        blocks = slot.positions is not None
        if blocks:
            delivery: Delivery = "ordered"  # blocks in order: shards read ahead, delivered in turn
        elif not self.options.limits.ordered:
            delivery = "completed"
        else:  # unshuffled: the stored order, shard after shard (read ahead); shuffled: mixed
            delivery = "interleave" if self.options.shuffle else "ordered"
        limits = self.limits(delivery)
        size = options.buffer_size if self.options.shuffle and not blocks else 0  # keeps blocks whole
        with contextlib.closing(progress.count_ends(run(jobs, limits))) as stream:
            yield from shuffled(stream, size, slot_rng(slot), max_bytes=options.shuffle_bytes,
                                nbytes=tagged_nbytes)

    # ------------------------------------------------------------------ shuffled: lanes

    def in_lanes(self, slot: Slot) -> bool:
        """Whether ``slot`` reads its share in lanes (see ``lanes``): a shuffled epoch whose
        sample counts are known; without them, shards are dealt whole and a buffer mixes."""
        return (slot.shuffle and self.shard_options.samples_per_epoch is None
                and self.unit_counts() is not None)

    def open_count(self) -> int:
        """Pieces a lane reads at once: ``lanes.OPEN_PIECES``, fewer where the memory budget
        cannot hold that many pieces being read (``lane_reserve`` each: pieces are streamed)."""
        budget = self.options.limits.memory
        if budget is None:
            return lanes.OPEN_PIECES
        need = self.lane_reserve(0)
        return max(2, min(lanes.OPEN_PIECES, (budget - self.options.queue_bytes) // need))

    def piece_sizes(self, counts: list[int], lanes_count: int, lane_samples: int) -> list[int]:
        """Samples of each unit one piece holds at most: about ``PIECE_BYTES`` where the index's
        offsets let a piece be read alone (one ranged GET), fewer where a lane would otherwise
        hold fewer than ``lanes.LANE_PIECES``; the whole shard where there are no offsets."""
        known, shards = self.counts(), self.shards()
        spread = -(-lane_samples // lanes.LANE_PIECES)
        out = []
        for shard, samples in zip(shards, counts):
            offsets = None if known is None or shard.compression is not None else known.offsets.get(shard.url)
            if not offsets or not samples:
                out.append(samples)
                continue
            size = shard.size or offsets[-1] * samples // max(1, samples - 1)
            by_bytes = PIECE_BYTES * samples // max(1, size)
            most = max(MIN_PIECE_SAMPLES, min(by_bytes, spread))
            out.append(-(-samples // -(-samples // most)))  # equal pieces, no short one at the end
        return out

    def permuted(self, unit: int) -> bool:
        """Whether a piece of ``unit`` gives its samples permuted (tar: stored order)."""
        return False

    def lane_plan(self, slot: Slot) -> tuple[list[tuple[int, int, int]], dict[int, lanes.LaneOrder]]:
        """This slot's samples in reading order as ``(lane, piece, index in its unit)``, and the
        order of each lane it reads from."""
        counts = self.unit_counts()
        assert counts is not None
        total = sum(counts)
        workers = max(1, slot.num_workers)
        if slot.positions is None:  # each slot its own lane: rank lengths split over workers
            per_rank = partition.rank_length(total, slot.world_size, slot.policy)
            sizes = [size for _ in range(slot.world_size) for size in lanes.split_sizes(per_rank, workers)]
            mine = slot.rank * workers + slot.worker
            wanted: list[int] = [mine]
        else:  # blocks of batch_size= from the lanes of the run that started the epoch
            batch = self.options.batch_size
            assert batch is not None
            count = slot.lanes or slot.world_size * workers
            sizes = lanes.block_lane_sizes(total, batch, count)
            located = [lanes.block_lane(position, batch, count) for position in slot.positions]
            wanted = sorted({lane for lane, _ in located})
        most = self.piece_sizes(counts, len(sizes), -(-sum(sizes) // max(1, len(sizes))))
        dealing = random.Random(partition.epoch_seed(slot.seed, slot.epoch))
        pieces = lanes.cut(counts, range(len(counts)), sizes, most.__getitem__, dealing)
        permutations: dict[int, list[int] | None] = {}

        def rows(unit: int) -> list[int] | None:
            if unit not in permutations:
                permutations[unit] = (lanes.unit_rows(counts[unit], seed=slot.seed, epoch=slot.epoch, unit=unit)
                                      if self.permuted(unit) else None)
            return permutations[unit]

        orders = {lane: lanes.lane_order(pieces[lane], open_count=self.open_count(), rows=rows,
                                         seed=lanes.lane_seed(slot.seed, slot.epoch, lane))
                  for lane in wanted}
        if slot.positions is None:
            lane_order = orders[mine]
            _warn_unmixed(self, lane_order)
            return [(mine, piece, index) for piece, index in zip(lane_order.piece, lane_order.at)], orders
        return [(lane, orders[lane].piece[draw], orders[lane].at[draw]) for lane, draw in located], orders

    def lane_job(self, unit: int, position: int, indices: list[int], skip: Container[int]) -> AnyJob:
        """The job that reads ``indices`` of ``unit`` (ascending here) as plan position ``position``."""
        ranges = lanes.ranges_of(indices)
        assignment = ShardAssignment(unit, 1, 0, ranges[0][0], ranges[-1][1], ranges)
        shard, counts = self.shards()[unit], self.counts()
        assert counts is not None  # lanes need the counts
        return shard_job(shard, position, assignment, self.shard_options, skip=skip,
                         on_error=self.options.on_error, offsets=counts.offsets.get(shard.url),
                         expect=counts.expect(shard), buffer_up_to=BUFFERED_PIECE)

    def _lane_stream(self, slot: Slot, progress: ShardProgress, run: Run) -> Generator[Tagged, None, None]:
        """A shuffled slot read in lanes: one job per piece (plan positions in the order of
        their first sample), delivered in the lanes' order, less what ``progress`` holds."""
        plan, orders = self.lane_plan(slot)
        keys: dict[tuple[int, int, int], int] = {}  # (lane, piece, repeat) -> plan position
        repeats: dict[tuple[int, int], dict[int, int]] = {}
        members: list[list[int]] = []  # per plan position, its indices in reading order
        units: list[int] = []
        entries: list[tuple[int, int]] = []  # (plan position, index) per sample, in order
        for lane, piece, index in plan:
            seen = repeats.setdefault((lane, piece), {})
            repeat = seen.get(index, 0)  # padding may deal a sample twice to one slot
            seen[index] = repeat + 1
            position = keys.setdefault((lane, piece, repeat), len(members))
            if position == len(members):
                members.append([])
                units.append(orders[lane].pieces[piece].unit)
            members[position].append(index)
            entries.append((position, index))
        marks = progress.shards
        todo = [(position, index) for position, index in entries
                if position not in marks or index not in marks[position]]
        last = {position: at for at, (position, _) in enumerate(todo)}
        number: dict[int, int] = {}
        jobs: list[AnyJob] = []
        schedule: list[int] = []
        for at, (position, _) in enumerate(todo):
            if position not in number:
                number[position] = len(jobs)
                done = marks.get(position)
                jobs.append(self.lane_job(units[position], position, members[position],
                                          Watermark() if done is None else Watermark.from_state(done.to_state())))
            schedule.append(number[position])
            if last[position] == at:
                schedule.append(number[position])  # its end-of-shard marker
        stream = progress.count_ends(run(jobs, self.lane_limits(), schedule))
        buffer = self.shard_options.shuffle_buffer if slot.positions is None else None
        with contextlib.closing(stream):  # a buffer asked for mixes on top (not with blocks)
            yield from shuffled(stream, buffer or 0, slot_rng(slot), max_bytes=self.shard_options.shuffle_bytes,
                                nbytes=tagged_nbytes)

    def lane_reads(self, segments: list[lanes.Segment], sizes: list[int], wanted: list[tuple[int, int]],
                   *, seed: int, epoch: int) -> list[tuple[Read, list[int]]]:
        """A mix's share of this source in one epoch, read in lanes: ``segments`` (the share's
        samples, in stored order) cut into pieces and dealt to lanes of ``sizes`` samples, each
        lane read as ``lane_order`` says. ``wanted``: ``(lane, draw)`` of each sample the slot
        reads, in its order. Returns one read per piece, each with the indices into ``wanted``
        it emits, in the order it emits them."""
        counts = self.unit_counts()
        assert counts is not None  # a mix reads shards in lanes only when counted
        most = self.piece_sizes(counts, len(sizes), -(-sum(sizes) // max(1, len(sizes))))
        pieces = lanes.cut([segment.stop - segment.start for segment in segments], range(len(segments)), sizes,
                           lambda number: most[segments[number].unit],
                           random.Random(partition.epoch_seed(seed, epoch)))

        def rows(number: int) -> Sequence[int]:
            unit, start, stop = segments[number]
            if not self.permuted(unit):
                return range(start, stop)
            return [start + row for row in lanes.unit_rows(stop - start, seed=seed, epoch=epoch, unit=number)]

        orders = {lane: lanes.lane_order(pieces[lane], open_count=self.open_count(), rows=rows,
                                         seed=lanes.lane_seed(seed, epoch, lane))
                  for lane in sorted({lane for lane, _ in wanted})}
        groups: dict[tuple[int, int, int], list[int]] = {}  # (lane, piece, repeat) -> indices into wanted
        repeats: dict[tuple[int, int], int] = {}  # a padded order may want one draw twice
        for number, (lane, draw) in enumerate(wanted):
            repeat = repeats.get((lane, draw), 0)
            repeats[lane, draw] = repeat + 1
            groups.setdefault((lane, orders[lane].piece[draw], repeat), []).append(number)
        out: list[tuple[Read, list[int]]] = []
        for (lane, piece, _), members in groups.items():
            order = orders[lane]
            unit = segments[order.pieces[piece].unit].unit
            indices = [order.at[wanted[number][1]] for number in members]
            out.append((Read(self.lane_job(unit, len(out), indices, frozenset()), len(indices), _is_sample,
                             self.lane_reserve(unit)), members))
        return out

    def lane_reserve(self, unit: int) -> int:
        """Bytes a piece being read in a lane holds: a buffered piece, or a streamed one's chunk."""
        return BUFFERED_PIECE + self.shard_options.chunk_size

    def lane_limits(self) -> EngineLimits:
        """The engine's limits for reading in lanes: the open pieces and two more ahead."""
        budget = self.options.limits.memory
        return self.options.engine_limits("scheduled", max_inflight=self.open_count() + 2,
                                   inflight_bytes=None if budget is None else budget - self.options.queue_bytes)

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
        assignments = self.assignments(slot)  # raises without counts
        counts = self.unit_counts()
        assert counts is not None
        return [Read(self.job(a, position), a.wanted(counts[a.shard]), _is_sample, self.reserve(a))
                for position, a in enumerate(assignments)]

    # ------------------------------------------------------------------ how one shard is read
    # (a source of other units dealt like shards, such as Parquet row groups, overrides these)

    def job(self, assignment: ShardAssignment, position: int, *, skip: Container[int] = frozenset(),
            offsets: bool = True) -> AnyJob:
        """The engine job that reads ``assignment``'s samples as plan position ``position``,
        less ``skip``; ``offsets``: ranged reads from the index's offsets where they apply."""
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
        return self.options.engine_limits(delivery, max_inflight=self.shard_options.shards_inflight)

    def transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)

    def versions(self) -> Versions | None:
        return versions_of(self.shards())

    def describe(self) -> str:
        if self._shards is not None:
            return f"{len(self._shards)} shards"
        return f"shards {self._specs[:2]}"


def _check_combinations(options: Options, shard_options: ShardOptions,
                        sample_counts: Mapping[str, int] | None) -> None:
    """Options that cannot go together, refused at construction rather than ignored."""
    if sample_counts is not None and shard_options.index is not None:
        raise ConfigError("give sample_counts= or index=, not both")
    if shard_options.samples_per_epoch is not None and not options.limits.ordered:
        raise ConfigError("samples_per_epoch= reads its passes over the shards in order (the "
                          "shuffle buffer mixes each pass), so ordered=False cannot apply; drop it")
    buffer = shard_options.shuffle_buffer
    if (options.batch_size is not None and buffer and shard_options.samples_per_epoch is None):
        raise ConfigError(
            f"shuffle_buffer={buffer!r} cannot be used with batch_size=: blocks of the epoch's order "
            "are read in order (a per-worker buffer would tie the order to the number of workers "
            "and break resuming on another topology), so no buffer mixes them. Drop "
            "shuffle_buffer=; the shard order is still shuffled every epoch, and samples can be "
            "mixed once when packing (loader shard --shuffle)")


def index_at(uri: str) -> str:
    """``index=``: a URI ending in ``/`` means the ``index.json`` in that folder."""
    return uri + INDEX_NAME if uri.endswith("/") else uri


def slot_rng(slot: Slot) -> random.Random:
    """The shuffle buffer's generator for one slot and epoch."""
    number, _ = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
    return random.Random(partition.epoch_seed(slot.seed, slot.epoch) ^ (number << 20) ^ (slot.seen << 40))


PIECE_BYTES = 32 << 20
"""Bytes of one piece of a shard read in lanes at most (one ranged GET from the index's offsets,
streamed): requests cost more than bytes (through the embedded server, pieces of 4 MiB made a
shard epoch 0.6x as fast as whole-shard streams, 8 MiB 0.7x), and a streamed piece holds a chunk
whatever its length. Pieces are smaller where a lane would hold fewer than ``lanes.LANE_PIECES``."""
BUFFERED_PIECE = 1 << 20
"""A piece of at most this many bytes is one GET read whole; a longer one is streamed from its
first byte and parsed as it arrives, so its first samples come before its last bytes and an
open piece holds a chunk, not its body. Buffered 8 MiB pieces made a lane wait for whole bodies
before its first draws: streamed, a shard epoch without ``batch_size=`` ran ~1.5x as fast."""
MIN_PIECE_SAMPLES = 8
"""A piece of a shard holds at least this many samples: a GET per few samples costs more in
requests than it gives in mixing."""


def _warn_unmixed(source: ShardSource, order: lanes.LaneOrder) -> None:
    """Say once (per dataset and process) when a lane reads too few pieces, none permuted, to
    mix a data set stored sorted."""
    pieces = order.pieces
    if getattr(source, "_said_unmixed", False) or not pieces or len(pieces) >= lanes.MIN_MIXING:
        return
    if any(source.permuted(piece.unit) for piece in pieces):
        return
    source._said_unmixed = True  # type: ignore[attr-defined]
    warnings.warn(
        f"shuffle=True: this DataLoader worker reads only {len(pieces)} run(s) of samples "
        f"({source.describe()} for its rank x worker slots), so a batch mixes at most that many "
        "runs: data stored sorted by label gives batches of few labels. Write the shards' index "
        "(`loader index`), whose offsets let shards be split into smaller runs, use more (smaller) "
        "shards or fewer workers, or mix samples when packing (loader shard --shuffle)",
        RuntimeWarning, stacklevel=4)


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
