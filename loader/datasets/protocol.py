"""The seam between a dataset and what it reads: the ``Source`` protocol.

``AsyncS3Dataset`` owns the epoch, the split into blocks, resume and the engine; a source owns
what is read (keys, shards, a mix of sources) and turns one slot's share of an epoch into engine
jobs. Each source lives in its own module (``object_source``, ``shard_source``), so a new way of
reading is a new module, not a branch in the dataset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from ..engine.core import Jobs
from ..engine.fetch import AnyJob, EngineLimits
from ..listing.versions import Versions
from .partition import PadPolicy

Tagged = tuple[Any, Any]
"""``(tag, item)``: the tag says which part of the slot's plan the item is (for resume)."""

class Run(Protocol):
    """Runs jobs in the dataset's engine and yields what they emit, in the order the limits ask
    (``schedule``: the job of every item, for ``delivery="scheduled"``)."""

    def __call__(self, jobs: Jobs, limits: EngineLimits,
                 schedule: Iterable[int] | None = None) -> Generator[Any, None, None]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot:
    """One (rank, DataLoader worker) reading one epoch: what a source needs to pick its share.

    ``positions``: with ``batch_size=``, the positions of the epoch's sample order this slot
    reads, in reading order (the dataset deals them in blocks); None lets the source split the
    epoch itself (``partition``: strided samples, or shards dealt to slots).
    ``seen``: samples of the epoch a ``resume()`` skipped (per rank for a source of fixed rank
    length, see ``Source.fixed_rank_length``; ``positions`` already start after them).
    ``lanes``: with ``batch_size=``, the rank x worker slots of the run that started the epoch,
    whose lanes a shuffled order of shards or row groups comes from (None: this run's).
    """

    rank: int
    world_size: int
    worker: int
    num_workers: int
    seed: int
    epoch: int
    shuffle: bool
    policy: PadPolicy
    positions: Sequence[int] | None = None
    seen: int = 0
    lanes: int | None = None

    def where(self) -> dict[str, Any]:
        """The keywords ``partition``'s functions take."""
        return dict(seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, rank=self.rank,
                    world_size=self.world_size, worker=self.worker, num_workers=self.num_workers)


def _always(tag: Any) -> bool:
    return True


class Read(NamedTuple):
    """One job of a source's share, for a mix: it emits ``(tag, sample)`` for the next ``size``
    positions of the slot, in order (fewer when a fault ends it early); items whose tag
    ``is_sample`` refuses are bookkeeping (an end-of-shard marker) and carry no position.
    ``reserve``: the bytes the job holds while it runs, when known (the engine's budget)."""

    job: AnyJob
    size: int
    is_sample: Callable[[Any], bool] = _always
    reserve: int | None = None


class Progress(Protocol):
    """What one process delivered of its slot this epoch; small enough to save every batch."""

    def add(self, tag: Any) -> None:
        """Mark the item tagged ``tag`` as delivered."""
        ...

    def to_state(self) -> dict[str, Any]:
        """The part of ``state_dict`` that lets the same slot skip what it delivered."""
        ...

    def counters(self) -> dict[str, int]:
        """Counters for ``stats()`` (shards skipped, ...)."""
        ...


class Source(Protocol):
    """What a dataset reads. Picklable, and opens no connection until asked to list."""

    kind: str
    """What a saved state is for (``"objects"``, ``"shards"``): a state loads only into its kind."""

    def resolve(self) -> None:
        """List now (once): DataLoader workers then inherit the result instead of listing."""
        ...

    def size(self) -> int:
        """How many units (samples, shards) the source has: a saved state must match it."""
        ...

    def count(self) -> int | None:
        """Samples in one epoch's order, or None while unknown (tar shards not yet counted)."""
        ...

    def missing_count(self) -> str:
        """Why ``count()`` is None and how to make it known (advice for an error message)."""
        ...

    def fixed_rank_length(self) -> int | None:
        """Samples every rank yields per epoch when the source fixes that number itself
        (``samples_per_epoch``), whatever the data holds; None when the epoch is the data
        (``count()`` samples dealt across ranks). ``resume(samples_seen=)`` then counts per rank,
        and no blocks are dealt (``Slot.positions`` stays None)."""
        ...

    def deals_lanes(self) -> bool:
        """Whether a shuffled epoch is dealt to lanes, one per rank x DataLoader worker of the
        run that starts it (``lanes``: tar shards, Parquet row groups, mixes of them): its order
        then depends on that number, which ``resume(samples_seen=)`` must be told."""
        ...

    def skipped(self, url: str, key: str | None) -> str:
        """How a warning names a sample that ``on_error`` skipped, and what reading does next."""
        ...

    def progress(self, state: Mapping[str, Any]) -> Progress:
        """A fresh progress, or the one a saved state describes (empty mapping: fresh)."""
        ...

    def stream(self, slot: Slot, progress: Progress, run: Run) -> Generator[Tagged, None, None]:
        """This slot's share of the epoch, less what ``progress`` says was delivered."""
        ...

    def describe(self) -> str:
        """A short phrase for reprs and errors (``"4000 keys"``, ``"12 shards"``)."""
        ...

    def versions(self) -> Versions | None:
        """What the source's listing says each object's version is, which a disk cache checks
        its entries against (``loader.listing.versions``); None when no listing gave ETags."""
        ...

    def transform(self, sample: dict[str, Any]) -> Any:
        """The sample as users asked for it (``transform=``); runs in the consumer's thread."""
        ...


class Mixable(Source, Protocol):
    """A source that a mix can draw from: jobs for exactly the given positions."""

    def reads(self, slot: Slot) -> list[Read]:
        """Jobs that emit ``slot.positions`` (positions of the epoch's order, required here),
        in order; the ``size`` of consecutive reads adds up to ``len(slot.positions)``."""
        ...


class LaneMixable(Mixable, Protocol):
    """A mixable source whose shuffled share of an epoch a mix reads in lanes (``deals_lanes``)."""

    def unit_counts(self) -> list[int] | None:
        """Samples per unit read (tar shard, Parquet unit of row groups)."""
        ...

    def lane_reads(self, segments: list[Any], sizes: list[int], wanted: list[tuple[int, int]],
                   *, seed: int, epoch: int) -> list[tuple[Read, list[int]]]:
        """Reads of ``segments`` cut into pieces dealt to lanes of ``sizes``; see ``ShardSource``."""
        ...
