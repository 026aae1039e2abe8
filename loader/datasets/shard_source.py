"""``ShardSource``: WebDataset tar shards, streamed and parsed on the fly.

Shards come from brace patterns, URI lists or prefixes (listed once, on demand). How a slot's
share becomes shard reads depends on what is known: blocks of the epoch's order (``batch_size=``),
equal runs per rank (sample counts known), or whole shards dealt to slots (counts unknown).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import logging
import random
from collections.abc import Generator, Iterable, Mapping
from typing import Any

from ..checks import check_int
from ..decode import apply_transform
from ..engine.fetch import Delivery
from ..errors import ConfigError, NoSuchKeyError
from ..formats.packing import INDEX_NAME, index_counts
from ..formats.shards import END, ShardAssignment, ShardOptions, ShardRef, Tag, sample_nbytes, shard_job
from ..stores.versions import Versions, versions_of
from . import partition
from .options import LoaderOptions, check_budget
from .progress import Watermark
from .shard_index import read_index
from .shuffle import shuffled
from .source import Progress, Read, Run, Slot, Tagged
from .sources import resolve_shards, shard_specs

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

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ShardProgress:
        if not state:
            return cls()
        return cls(shards={int(p): Watermark(int(low), above) for p, low, above in state["shards"]},
                   shard_samples={int(p): int(n) for p, n in state["shard_samples"]})


class ShardSource:
    """Tar shards (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``/``.tzst``) of one or more buckets."""

    kind = "shards"

    def __init__(self, shards: str | Iterable[str], options: LoaderOptions, *,
                 shard_options: ShardOptions | None = None,
                 sample_counts: Mapping[str, int] | None = None) -> None:
        self.options = options
        self.shard_options = shard_options or ShardOptions()
        check_budget(options, self.shard_options)
        self._specs = shard_specs(shards)
        self._shards: list[ShardRef] | None = None
        self._sample_counts = None if sample_counts is None else check_counts(sample_counts)
        self._index_tried = False
        self._sample_offsets: dict[str, array.array[int]] | None = None  # from index.json

    # ------------------------------------------------------------------ what is read

    def shards(self) -> list[ShardRef]:
        """The shard list, listing prefixes now if not done yet."""
        if self._shards is None:
            self._shards = resolve_shards(self._specs, factory=self.options.listing_factory(),
                                          retry=self.options.retry, options=self.options.listing)
        return self._shards

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

    def find_index(self) -> None:
        """Without ``sample_counts=``, read the ``index.json`` that ``loader shard`` wrote
        beside the shards (when they share one folder): counts and each sample's offset."""
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

    # ------------------------------------------------------------------ the Source protocol

    def resolve(self) -> None:
        self.shards()
        if self.options.batch_size is not None:
            self.find_index()

    def size(self) -> int:
        return len(self.shards())

    def count(self) -> int | None:
        if self.options.batch_size is not None:
            self.find_index()
        counts = self.shard_counts()
        return None if counts is None else sum(counts)

    def missing_count(self) -> str:
        shards = self.shards()
        folder = shards[0].url.rpartition("/")[0] + "/" if shards else "the shards' folder"
        return (f"the number of samples in these tar shards is unknown until they are read: no "
                f"sample_counts= was given and there is no {INDEX_NAME} in {folder} (python -m "
                "loader shard writes one). Pass from_shards(..., sample_counts=read_index_counts("
                "'s3://.../index.json')) or {shard url: samples}")

    def progress(self, state: Mapping[str, Any]) -> ShardProgress:
        return ShardProgress.from_state(state)

    def assignments(self, slot: Slot) -> list[ShardAssignment]:
        """Which shards ``slot`` reads, and which samples of each, in reading order."""
        if slot.positions is not None:  # blocks of the epoch's order (see partition)
            self.find_index()
            counts = self.shard_counts()
            if counts is None:
                raise ConfigError(f"batch_size= in shard mode deals samples: {self.missing_count()}")
            order = partition.epoch_order(len(counts), seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle)
            return partition.sequence_ranges(counts, order, slot.positions)
        counts = self.shard_counts()
        if counts is not None:  # equal length per rank, exactly once (up to the pad policy)
            return partition.balanced_shard_ranges(counts, policy=slot.policy, **slot.where())
        shards = len(self.shards())
        _, slots = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
        if partition.needs_sample_split(shards, slots):
            _warn_sample_split(shards, slots)
        return partition.shard_assignments(shards, **slot.where())

    def stream(self, slot: Slot, progress: Progress, run: Run) -> Generator[Tagged, None, None]:
        assert isinstance(progress, ShardProgress)
        shards, options = self.shards(), self.shard_options
        offsets = self._sample_offsets or {}
        jobs = [
            shard_job(shards[a.shard], position, a, options, skip=progress.shard(position),
                      on_error=self.options.on_error, offsets=offsets.get(shards[a.shard].url))
            for position, a in enumerate(self.assignments(slot))
            if not _shard_complete(a, progress.shard_samples.get(position), progress.shard(position))
        ]
        blocks = slot.positions is not None
        if blocks:
            delivery: Delivery = "ordered"  # blocks in order: shards read ahead, delivered in turn
        else:
            delivery = "interleave" if self.options.ordered else "completed"
        limits = self.options.limits(delivery, max_inflight=options.shards_inflight)

        def samples() -> Generator[tuple[Tag, dict[str, Any]], None, None]:
            for tag, item in run(jobs, limits):
                if tag[1] == END:
                    progress.shard_samples[tag[0]] = item.samples
                    progress.shards_skipped += item.skipped
                    progress.tar_links_skipped += item.links
                    progress.shard_ends += 1
                else:
                    yield tag, item

        size = options.shuffle_buffer if self.options.shuffle and not blocks else 0  # keeps blocks whole
        number, _ = partition.slot_of(slot.rank, slot.world_size, slot.worker, slot.num_workers)
        rng = random.Random(partition.epoch_seed(slot.seed, slot.epoch) ^ (number << 20))
        with contextlib.closing(samples()) as stream:
            yield from shuffled(stream, size, rng, max_bytes=options.shuffle_bytes, nbytes=_tagged_nbytes)

    def reads(self, slot: Slot) -> list[Read]:
        if slot.positions is None:
            raise ValueError("reads() needs the slot's positions")
        shards, counts = self.shards(), self.shard_counts()
        assert counts is not None  # assignments() raised without them
        options = self.shard_options
        reserve = (options.parts_inflight + 1) * options.part_size  # parts, or chunks and a member
        return [Read(shard_job(shards[a.shard], position, a, options,
                               on_error=self.options.on_error,
                               offsets=(self._sample_offsets or {}).get(shards[a.shard].url)),
                     a.wanted(counts[a.shard]), _is_sample, reserve)
                for position, a in enumerate(self.assignments(slot))]

    def transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)

    def versions(self) -> Versions | None:
        return versions_of(self.shards())

    def describe(self) -> str:
        if self._shards is not None:
            return f"{len(self._shards)} shards"
        return f"shards {self._specs[:2]}"


def check_counts(counts: Any) -> dict[str, int]:
    """``sample_counts``: a mapping of shard URL (or key) to its number of samples."""
    if not isinstance(counts, Mapping):
        raise ConfigError(f"sample_counts must map shard URL -> sample count, not {type(counts).__name__}")
    for url, count in counts.items():
        check_int(f"sample_counts[{url!r}]", count, minimum=0, must="a non-negative integer")
    return dict(counts)


def _is_sample(tag: Tag) -> bool:
    return tag[1] != END


def _tagged_nbytes(tagged: tuple[Tag, dict[str, Any]]) -> int:
    return sample_nbytes(tagged[1])


def _shard_complete(assignment: ShardAssignment, samples: int | None, delivered: Watermark) -> bool:
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
