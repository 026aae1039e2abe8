"""The epoch's sample order over units (tar shards, Parquet row-group units): pure, no I/O.

Why this shape. A unit is read front to back (a tar shard streams; a Parquet unit is fetched and
decoded whole), and data sets are often sorted (by label, by source) inside and across units.
Shuffling only the order of the units leaves every batch drawn from one unit: one label at a
time. A permutation of all samples would mix perfectly but makes every sample its own request.
So the order mixes where reading is cheap, within what is held anyway (as MosaicML's block
shuffles and LitData's chunk shuffles do):

1. the units are shuffled (``partition.epoch_order``);
2. consecutive units of that order form **windows** of at most ``window`` units (and, with a
   byte cap, of units whose reads fit in it together): the units read side by side;
3. inside a window the samples of its units are **merged**: a uniformly random interleaving of
   the units' sequences, so any run of positions draws from every unit of the window in
   proportion to its size, exactly as a permutation of the window would;
4. a unit held whole while it is read (a Parquet unit) has its own sequence **permuted**; a
   streamed unit (a tar shard) keeps its stored order, which the merge preserves, so each read
   still streams its unit front to back.

The order is a function of ``(seed, epoch, counts, window, cap, weights, permuted)`` alone, never
of ranks or workers: any slice of it is what a resume on any topology skips. Without
``shuffle`` it is the stored order, unit after unit.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from ..checks import check_int
from .partition import epoch_order, epoch_seed, rank_length, slot_of

WINDOW_UNITS = 64
"""Units merged in one window. On data sorted by label (10 labels) into single-label units, a
batch drawn from ``k`` random units has, of what a uniform permutation gives, ~0.87x the
distinct labels at ``k=16`` and batch 8 (0.80x at batch 32), ~0.94x (0.93x) at ``k=32`` and
~0.97x (0.97x) at ``k=64``: 64 keeps above 0.9x where windows come out smaller than the most
(the data's last units, a memory cap). Each read held open costs a tar shard one GET's span
(``formats.shards.SPAN_BYTES``); Parquet units are capped by the memory limit instead."""


SLOT_UNITS = WINDOW_UNITS // 2
"""Without ``batch_size=``, a slot reads units of its own (each unit read once in all) when every
slot gets at least this many: its own windows then mix about as well as shared ones (~0.93x a
permutation's distinct labels on single-label units). With fewer, slots share the order's
windows instead, each reading its part of every unit."""


def window_groups(units: Sequence[int], *, window: int, weights: Sequence[int] | None = None,
                  cap: int | None = None) -> list[tuple[int, ...]]:
    """``units`` (in epoch order) cut into consecutive windows of at most ``window`` units whose
    ``weights`` (indexed by unit) sum to at most ``cap`` (a unit over the cap alone is a window);
    without a cap, as few windows as that allows, of sizes differing by one at most."""
    check_int("window", window, minimum=1)
    if cap is None:  # windows of near-equal sizes: a short last window would mix its few units alone
        count = -(-len(units) // window)
        return [tuple(units[len(units) * w // count:len(units) * (w + 1) // count]) for w in range(count)]
    out: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0
    for unit in units:
        weight = 0 if weights is None else weights[unit]
        if current and (len(current) >= window or (cap is not None and held + weight > cap)):
            out.append(tuple(current))
            current, held = [], 0
        current.append(unit)
        held += weight
    if current:
        out.append(tuple(current))
    return out


def _seed(name: str, seeded: int, number: int) -> int:
    digest = hashlib.blake2b(f"loader.window_order.{name}:{seeded}:{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _Window(NamedTuple):
    units: tuple[int, ...]
    labels: array  # the window's unit (by place in ``units``) at each position of the window
    ranks: array  # how many earlier positions of the window hold the same unit


class WindowOrder(Sequence[tuple[int, int]]):
    """Position ``p`` of the epoch's order is sample ``index`` of unit ``unit``: ``order[p] ==
    (unit, index)`` (see the module docstring). A window is computed when first read (O(its
    samples) time and memory, the last one kept), so a slot reading its share touches only the
    windows it reads."""

    def __init__(self, counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool,
                 window: int = WINDOW_UNITS, weights: Sequence[int] | None = None, cap: int | None = None,
                 permuted: Sequence[bool] | None = None) -> None:
        for at, count in enumerate(counts):
            check_int(f"counts[{at}]", count, minimum=0)
        self.counts = list(counts)
        self.shuffle = shuffle
        self._seeded = epoch_seed(seed, epoch)
        units = list(epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle))
        if shuffle:
            self.groups = window_groups(units, window=window, weights=weights, cap=cap)
        else:
            self.groups = [(unit,) for unit in units]  # the stored order, unit after unit
        self._permuted = [False] * len(counts) if permuted is None or not shuffle else list(permuted)
        self.starts: list[int] = []
        at = 0
        for group in self.groups:
            self.starts.append(at)
            at += sum(self.counts[unit] for unit in group)
        self._n = at
        self._cached: tuple[int, _Window] | None = None
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self._n

    def window_of(self, position: int) -> int:
        """The window holding ``position``."""
        return bisect.bisect_right(self.starts, position) - 1

    def _window(self, number: int) -> _Window:
        if self._cached is not None and self._cached[0] == number:
            return self._cached[1]
        units = self.groups[number]
        labels = array("I")
        for place, unit in enumerate(units):
            labels.extend(array("I", [place]) * self.counts[unit])
        if len(units) > 1:
            mixed = list(labels)
            random.Random(_seed("merge", self._seeded, number)).shuffle(mixed)
            labels = array("I", mixed)
        seen = [0] * len(units)
        ranks = array("I", bytes(4 * len(labels)))
        for q, place in enumerate(labels):
            ranks[q] = seen[place]
            seen[place] += 1
        built = _Window(units, labels, ranks)
        self._cached = (number, built)
        self._perms = {unit: perm for unit, perm in self._perms.items() if unit in units}
        return built

    def _within(self, unit: int, rank: int) -> int:
        if not self._permuted[unit]:
            return rank
        perm = self._perms.get(unit)
        if perm is None:
            perm = list(range(self.counts[unit]))
            random.Random(_seed("unit", self._seeded, unit)).shuffle(perm)
            self._perms[unit] = perm
        return perm[rank]

    def __getitem__(self, position: int) -> tuple[int, int]:  # type: ignore[override]
        if not isinstance(position, int):
            raise TypeError("a WindowOrder is indexed by position (an int)")
        if position < 0:
            position += self._n
        if not 0 <= position < self._n:
            raise IndexError(f"position {position} is outside an order of {self._n} samples")
        number = self.window_of(position)
        win = self._window(number)
        q = position - self.starts[number]
        unit = win.units[win.labels[q]]
        return unit, self._within(unit, win.ranks[q])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return (self[p] for p in range(self._n))


class UnitRead(NamedTuple):
    """One job of a slot's plan: read ``indices`` of ``unit``, emitted in that order, which are
    the slot's items ``tags`` (places in its reading order); ``number``: the read's place in the
    plan (its progress key)."""

    number: int
    unit: int
    indices: tuple[int, ...]
    tags: tuple[int, ...]


class Segment(NamedTuple):
    """A stretch of a slot's reading order inside one window: its reads, and for each of its
    items in reading order the number of the read that emits it."""

    reads: list[UnitRead]
    schedule: list[int]


def plan_reads(order: WindowOrder, positions: Iterable[int]) -> Iterator[Segment]:
    """A slot's positions (in reading order) as unit reads, one stretch at a time.

    A stretch is a run of ascending positions inside one window (a pad that wraps to the
    order's start begins a new one); it becomes one read per unit it touches, each emitting its
    samples in the order the positions ask for them (ascending in the unit where the unit keeps
    its stored order). Lazy: the engine asks for reads and the schedule as it goes, so a worker
    starts after computing its first window only."""
    number = 0
    current: list[tuple[int, int, int]] = []  # (tag, unit, index)
    window = last = -1

    def flush() -> Segment:
        nonlocal number
        by_unit: dict[int, list[tuple[int, int]]] = {}
        owner: list[int] = []
        firsts: dict[int, int] = {}
        for t, unit, index in current:
            if unit not in firsts:
                firsts[unit] = number + len(firsts)
                by_unit[unit] = []
            by_unit[unit].append((t, index))
            owner.append(firsts[unit])
        reads = [UnitRead(firsts[unit], unit, tuple(i for _, i in items), tuple(t for t, _ in items))
                 for unit, items in by_unit.items()]
        number += len(reads)
        return Segment(reads, owner)

    for tag, position in enumerate(positions):
        w = order.window_of(position)
        if current and (w != window or position <= last):
            yield flush()
            current = []
        window, last = w, position
        unit, index = order[position]
        current.append((tag, unit, index))
    if current:
        yield flush()


def index_ranges(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted indices as ascending ``(start, stop)`` runs of consecutive ones."""
    out: list[list[int]] = []
    for index in sorted(indices):
        if out and out[-1][1] == index:
            out[-1][1] += 1
        else:
            out.append([index, index + 1])
    return tuple((start, stop) for start, stop in out)


def contiguous_positions(total: int, *, rank: int, world_size: int, worker: int, num_workers: int,
                         policy: str = "pad") -> range:
    """Without ``batch_size=``: the run of ``[0, total)`` that ``(rank, worker)`` reads (rank
    ``r`` the ``r``-th of equal runs, its workers contiguous parts of it), as
    ``partition.balanced_shard_ranges`` deals them; positions past ``total`` (``"pad"``) are
    for the caller to wrap."""

    workers = max(1, num_workers)
    slot_of(rank, world_size, worker, num_workers)  # validates rank and worker
    length = rank_length(total, world_size, policy)  # type: ignore[arg-type]
    lo = rank * length + (worker * length) // workers
    hi = rank * length + ((worker + 1) * length) // workers
    return range(lo, hi)
