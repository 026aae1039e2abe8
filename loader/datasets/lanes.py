"""The shuffled order of units read in runs (tar shards, Parquet row groups): pure functions.

A shuffled epoch lays its units end to end in stored order and cuts them into *pieces*, runs of
consecutive samples of one unit, dealt round robin (each round in a random order) to *lanes*,
one lane per (rank, DataLoader worker) slot: every lane holds a stratified share of the data.
A lane is read with its pieces permuted, ``open_count`` of them open at once: each next
sample comes from a uniformly drawn open piece, and a finished piece makes room for the lane's
next one; a piece's own samples come in stored order, or, for a unit decoded whole (Parquet),
the pieces are cut from a permutation of the unit's rows. So a slot fetches each piece with
one read and never a sample of another slot's lane, while a batch draws on up to
``open_count`` runs spread over the data set.

Everything here is a function of the counts, the seed, the epoch and the lane count, so a
resumed slot computes the same order and skips what it delivered (docs/design/shuffle.md).
With ``batch_size=`` the lanes are the slots of the run that started the epoch: position ``p``
of the epoch's order is in block ``p // B``, which is lane ``block % lanes``'s next block.
"""

from __future__ import annotations

import array
import hashlib
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..checks import check_int
from .partition import epoch_seed

OPEN_PIECES = 32
"""Pieces a lane reads at once by default: with label-pure pieces of 10 classes, 32 open give
batches of 32 ~0.97x a permutation's distinct labels (16: ~0.82x); a memory budget may lower it."""

LANE_PIECES = 16
"""Pieces a lane is cut into at least, where the units allow: dealt in stored order, 16 pieces
hold a stratified share of 10 labels, and all of them are open at once."""

MIN_MIXING = 8
"""Fewer pieces than this in a lane, none of them permuted, cannot mix a sorted data set: said."""


class Piece(NamedTuple):
    """Samples ``[start, stop)`` of unit ``unit``, read by one lane with one read."""

    unit: int
    start: int
    stop: int


def cut(counts: Sequence[int], order: Sequence[int], sizes: Sequence[int],
        piece_size: Callable[[int], int], rng: random.Random | None = None) -> list[list[Piece]]:
    """Units laid end to end in ``order`` (from the start again where the lanes want more
    samples than there are: padding), cut into pieces of at most ``piece_size(unit)`` samples
    dealt round robin to lanes of ``sizes`` samples each (a lane that is full is passed over);
    with ``rng``, each round deals to the lanes in an order of its own.

    Dealt in stored order, neighbouring pieces go to different lanes: every lane holds a
    stratified share of the data set (of each label, where it is stored sorted by label)."""
    lanes: list[list[Piece]] = [[] for _ in sizes]
    units = [unit for unit in order if counts[unit] > 0]
    left = [check_int(f"sizes[{lane}]", size, minimum=0) for lane, size in enumerate(sizes)]
    if not units:
        if any(left):
            raise ValueError("lanes of samples from units that hold none")
        return lanes
    place, at = 0, 0  # the unit being cut (index into ``units``, wrapping) and where in it
    active = [lane for lane, size in enumerate(left) if size]
    while active:
        still = []
        if rng is not None:
            rng.shuffle(active)
        for lane in active:
            unit = units[place % len(units)]
            take = min(max(1, piece_size(unit)), counts[unit] - at, left[lane])
            lanes[lane].append(Piece(unit, at, at + take))
            left[lane] -= take
            at += take
            if at == counts[unit]:
                place, at = place + 1, 0
            if left[lane]:
                still.append(lane)
        active = sorted(still)
    return lanes


class LaneOrder(NamedTuple):
    """One lane's samples in reading order: the piece (index into ``pieces``) and the sample's
    index in its unit, per draw."""

    pieces: list[Piece]
    piece: array.array[int]
    at: array.array[int]

    def __len__(self) -> int:
        return len(self.piece)


def lane_seed(seed: int, epoch: int, lane: int) -> int:
    """One lane's generator seed, the same in every process and Python version."""
    digest = hashlib.blake2b(f"loader.lanes:{epoch_seed(seed, epoch)}:{lane}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def unit_rows(count: int, *, seed: int, epoch: int, unit: int) -> list[int]:
    """A permutation of a unit's ``count`` samples for one epoch: a unit decoded whole (Parquet)
    is cut into pieces of this order, so each piece is a random sample of the whole unit."""
    digest = hashlib.blake2b(f"loader.lanes.unit:{epoch_seed(seed, epoch)}:{unit}".encode(), digest_size=8).digest()
    rows = list(range(count))
    random.Random(int.from_bytes(digest, "little")).shuffle(rows)
    return rows


def lane_order(pieces: Sequence[Piece], *, open_count: int, seed: int,
               rows: Callable[[int], Sequence[int] | None] = lambda unit: None) -> LaneOrder:
    """The reading order of a lane of ``pieces``: the pieces permuted, ``open_count`` open at
    once, each draw from a uniformly chosen open one. A piece ``[start, stop)`` gives samples
    ``start`` to ``stop - 1`` of its unit in stored order, or where ``rows(unit)`` is a
    permutation of the unit, the samples ``rows(unit)[start:stop]``."""
    check_int("open_count", open_count, minimum=1)
    rng = random.Random(seed)
    pieces = list(pieces)
    rng.shuffle(pieces)
    within: list[Sequence[int]] = []
    for piece in pieces:
        permutation = rows(piece.unit)
        within.append(range(piece.start, piece.stop) if permutation is None
                      else permutation[piece.start:piece.stop])
    out_piece, out_at = array.array("q"), array.array("q")
    opened: list[list[int]] = []  # [piece, samples drawn]
    following = 0
    while True:
        while len(opened) < open_count and following < len(pieces):
            opened.append([following, 0])
            following += 1
        if not opened:
            break
        slot = rng.randrange(len(opened))
        entry = opened[slot]
        number, drawn = entry
        out_piece.append(number)
        out_at.append(within[number][drawn])
        entry[1] = drawn + 1
        if drawn + 1 == len(within[number]):
            opened[slot] = opened[-1]
            opened.pop()
    return LaneOrder(pieces, out_piece, out_at)


def block_lane(position: int, batch_size: int, lanes: int) -> tuple[int, int]:
    """``(lane, draw)``: where position ``position`` of a dealt epoch's order comes from when
    blocks of ``batch_size`` go to ``lanes`` lanes in turn."""
    block, offset = divmod(position, batch_size)
    turn, lane = divmod(block, lanes)
    return lane, turn * batch_size + offset


def block_lane_sizes(m: int, batch_size: int, lanes: int) -> list[int]:
    """How many of ``m`` positions each lane serves under ``block_lane``."""
    check_int("m", m, minimum=0)
    check_int("batch_size", batch_size, minimum=1)
    check_int("lanes", lanes, minimum=1)
    blocks, tail = divmod(m, batch_size)
    turns, extra = divmod(blocks, lanes)
    sizes = [batch_size * (turns + (lane < extra)) for lane in range(lanes)]
    if tail:
        sizes[extra] += tail  # the short last block is the next lane's
    return sizes


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` samples in ``parts`` parts differing by at most one."""
    return [(part + 1) * total // parts - part * total // parts for part in range(parts)]


def ranges_of(indices: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Ascending, disjoint ``[start, stop)`` ranges covering ``indices``."""
    out: list[tuple[int, int]] = []
    for index in sorted(indices):
        if out and out[-1][1] == index:
            out[-1] = (out[-1][0], index + 1)
        elif not out or out[-1][1] < index:
            out.append((index, index + 1))
    return tuple(out)


class Segment(NamedTuple):
    """Samples ``[start, stop)`` of unit ``unit`` (stored order), taken by a stretch of an order."""

    unit: int
    start: int
    stop: int


def stretch(counts: Sequence[int], order: Sequence[int], start: int, stop: int) -> list[Segment]:
    """Samples ``[start, stop)`` of the units laid end to end in ``order``, as segments of units
    (a mix's share of one pass over a source: which samples, before lanes order them)."""
    out: list[Segment] = []
    at = 0
    for unit in order:
        count = counts[unit]
        low, high = max(start, at), min(stop, at + count)
        if low < high:
            out.append(Segment(unit, low - at, high - at))
        at += count
        if at >= stop:
            break
    return out


def strided_lane(position: int, world_size: int, num_workers: int) -> int:
    """The slot (``rank * workers + worker``) that reads ``position`` of an order dealt strided
    (``partition.partition``: ranks take every ``world_size``-th, workers every
    ``num_workers``-th of those), for positions short of the padding."""
    workers = max(1, num_workers)
    return (position % world_size) * workers + (position // world_size) % workers
