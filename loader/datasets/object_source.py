"""``ObjectSource``: one sample per object (or per group of objects sharing a stem).

Keys come from a prefix listing (once, on demand), a key list or a manifest; ``SampleIndex``
groups them into samples and labels them. Both datasets read through it: the iterable one by
``stream`` (a job per sample), the map-style one by ``sample`` and ``fetch``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Generator, Iterable, Mapping, Sequence
from typing import Any

from ..decode import apply_transform
from ..engine.core import Jobs
from ..engine.fetch import Delivery, JobFn
from ..listing.inputs import check_keys, check_listed, list_keys, visible_keys, warn_siblings
from ..listing.keylist import KeyList
from ..listing.sharing import raise_if_failed_before_fork, ticket, track
from ..listing.snapshots import Snapshot
from ..listing.versions import Versions, listed_versions
from ..s3 import StoreFactory
from ..topology import in_worker
from . import partition
from .object_samples import LabelFrom, SampleIndex, build_index, sample_job, sample_notes
from .options import Options
from .progress import Watermark
from .protocol import Progress, Read, Run, Slot, Tagged
from .streamed import streamed_samples

log = logging.getLogger(__name__)


class ObjectProgress:
    """The slots of this worker's plan already delivered (tags are plan slots)."""

    def __init__(self, delivered: Watermark | None = None) -> None:
        self.delivered = delivered or Watermark()

    def add(self, tag: Any) -> None:
        self.delivered.add(tag)

    def to_state(self) -> dict[str, Any]:
        return {"delivered": self.delivered.to_state()}

    def counters(self) -> dict[str, int]:
        return {}


class ObjectSource:
    """Objects of one bucket: a prefix listed when first needed, or a given key list."""

    kind = "objects"
    _listing_ticket = 0  # which dataset over its prefix this is (``sharing.ticket``)
    _streaming = False  # a pass reads the prefix as it is listed (``_streamed_listing``)

    def __init__(self, bucket: str, options: Options, *, keys: Iterable[str] | None = None,
                 prefix: str | None = None, group: bool = True, label_from: LabelFrom | None = None,
                 labels: Iterable[int | str | None] | None = None,
                 snapshot: Snapshot | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.options = options
        self._snapshot = snapshot  # a listing snapshot to read the keys from (or to write)
        self._keys: Sequence[str] | None = None if keys is None else check_keys(bucket, keys)
        self._group = group
        self._label_from = label_from
        self._labels = None if labels is None else tuple(labels)
        self._index: SampleIndex | None = None
        if self._keys is not None:
            self._index = self._build_index()  # a bad key list fails here, not in a worker
            options.preload_backend()
        else:  # listed once per job, before DataLoader workers fork (``sharing``); the
            # backend is imported while the pages arrive (``keys``)
            self._listing_ticket = ticket(repr(("objects", bucket, prefix)))
            track(self)

    # ------------------------------------------------------------------ what is read

    def keys(self) -> Sequence[str]:
        """Every object key, listing the prefix now if not done yet (once)."""
        if self._keys is None:
            assert self.prefix is not None  # the constructor takes keys or a prefix
            raise_if_failed_before_fork(self)
            self._keys = list_keys(self.bucket, self.prefix, factory=self.options.listing_factory(),
                                   retry=self.options.store.retry, options=self.options.store.listing,
                                   ticket=self._listing_ticket, snapshot=self._snapshot,
                                   annotate=sample_notes if self._group else None,
                                   meanwhile=self.options.preload_backend)
            self.options.preload_backend()  # where nothing was listed here (a snapshot, another rank)
        return self._keys

    def samples(self) -> SampleIndex:
        """Which objects form each sample (the unit of an epoch), and their labels."""
        if self._index is None:
            self._index = self._build_index()
        return self._index

    @property
    def classes(self) -> list[str] | None:
        """Class names by index when labels come from names, sorted as ``ImageFolder`` does."""
        classes = self.samples().classes
        return None if classes is None else list(classes)

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        return self.samples().class_to_idx

    def _build_index(self) -> SampleIndex:
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix is not None else "the key list"
        keys = self.keys()
        return build_index(keys, group=self._group, label_from=self._label_from,
                           labels=self._labels, where=where, prefix=self.prefix,
                           pinned=self._snapshot is not None)

    # ------------------------------------------------------------------ the Source protocol

    def resolve(self) -> None:
        self.samples()

    def size(self) -> int:
        return len(self.samples())

    def count(self) -> int:
        return len(self.samples())

    def missing_count(self) -> str:
        return ""  # a listed or given key list always has a count

    def fixed_rank_length(self) -> None:
        return None  # an epoch is the key list

    def deals_lanes(self) -> bool:
        return False  # a permutation of the keys, the same on any topology

    def skipped(self, url: str, key: str | None) -> str:
        return url  # the object is the sample

    def progress(self, state: Mapping[str, Any]) -> ObjectProgress:
        if not state:
            return ObjectProgress()
        return ObjectProgress(Watermark.from_state(state["delivered"]))

    def plan(self, slot: Slot) -> Sequence[int]:
        """Positions in ``samples()`` that ``slot`` reads this epoch, in reading order."""
        n = len(self.samples())
        if slot.positions is not None:
            order = partition.epoch_order(n, seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle)
            return [order[p] for p in slot.positions]
        return partition.partition(n, policy=slot.policy, **slot.where())

    def stream(self, slot: Slot, progress: Progress, run: Run) -> Generator[Tagged, None, None]:
        assert isinstance(progress, ObjectProgress)
        # what a resume skips, copied: the engine's thread reads it while this one adds to the original
        done = Watermark.from_state(progress.delivered.to_state())
        delivery: Delivery = "ordered" if self.options.limits.ordered else "completed"
        jobs: Jobs
        factory = self._streamed_listing(slot)
        if factory is not None:
            jobs = self._streamed_jobs(factory, done)
        else:
            index, bucket, on_error = self.samples(), self.bucket, self.options.on_error
            # One job at a time, as the engine asks: the plan is computed as it is read (partition)
            jobs = (sample_job(index, bucket, pos, tag, on_error)
                    for tag, pos in enumerate(self.plan(slot)) if tag not in done)
        try:
            yield from run(jobs, self.options.object_limits(delivery))
        finally:
            self._streaming = False
            discard = getattr(factory, "discard", None)  # ``s3.ListingOpener``
            if discard is not None:  # its first page's lister, where the listing never opened it
                discard()

    def _streamed_listing(self, slot: Slot) -> StoreFactory | None:
        """The store factory that lists the prefix when this pass reads it as its pages arrive
        (``streamed``), else None: not listed yet, read in the listing's order (unshuffled, one
        rank, no DataLoader workers, no batch blocks), no snapshot, labels or cache that need
        every key first. The first page's request then goes out now, before the engine's thread
        starts."""
        if not (self._keys is None and self.prefix is not None and self._snapshot is None
                and self._label_from is None and self._labels is None and self.options.store.cache is None
                and not slot.shuffle and slot.positions is None and slot.world_size == 1
                and slot.num_workers <= 1 and not in_worker()):
            return None
        raise_if_failed_before_fork(self)
        factory = self.options.listing_factory()
        send_first_page = getattr(factory, "send_first_page", None)
        if send_first_page is not None:
            send_first_page(self.bucket, self.prefix, self.options.store.listing.page_size)
        self._streaming = True
        return factory

    async def _streamed_jobs(self, factory: StoreFactory, done: Watermark) -> AsyncGenerator[JobFn, None]:
        """The jobs of an unshuffled pass in the listing's order, made as its pages arrive; the
        keys are kept at the end, as ``keys()`` would have listed them."""
        assert self.prefix is not None
        bucket, prefix, on_error = self.bucket, self.prefix, self.options.on_error
        where = f"s3://{bucket}/{prefix}"

        def listed(found: KeyList) -> KeyList:
            keys = visible_keys(check_listed(found, bucket, prefix), where)
            warn_siblings(bucket, prefix, keys)
            log.info("listed %d objects under %s (%d bytes), read as they came", len(keys), where, keys.nbytes)
            self._keys = keys
            return keys

        tag = 0
        pieces = streamed_samples(factory, bucket, prefix, self.options.store.retry,
                                  self.options.store.listing, group=self._group, listed=listed)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                for sample in range(len(piece)):
                    if tag not in done:
                        yield sample_job(piece, bucket, sample, tag, on_error)
                    tag += 1

    def reads(self, slot: Slot) -> list[Read]:
        if slot.positions is None:
            raise ValueError("reads() needs the slot's positions")
        index, bucket, on_error = self.samples(), self.bucket, self.options.on_error
        order = partition.epoch_order(len(index), seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle)
        return [Read(sample_job(index, bucket, order[p], tag, on_error), 1, reserve=self._reserve(order[p]))
                for tag, p in enumerate(slot.positions)]

    def _reserve(self, sample: int) -> int | None:
        """Twice the listed bytes of a sample's objects (arriving, then joined), when the key list
        came from a listing; None leaves it to the engine."""
        keys = self.keys()
        if not isinstance(keys, KeyList) or not keys.has_sizes:
            return None
        total = 0
        for key in self.samples().objects(sample):
            at = keys.find(key)
            if at is None:
                return None
            total += keys.size(at)
        return 2 * max(total, 1)

    def transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)

    def versions(self) -> Versions | None:
        if self._streaming and self._keys is None:
            return None  # only a cache asks, and a streamed pass has none
        return listed_versions(self.bucket, self.keys())

    def describe(self) -> str:
        if self.prefix is not None and self._keys is None:
            return f"prefix s3://{self.bucket}/{self.prefix}"
        return f"{len(self.keys())} keys of bucket {self.bucket!r}"
