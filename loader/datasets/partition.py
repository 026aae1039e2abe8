"""Which items each (rank, worker) reads in an epoch: pure functions, no I/O, no torch.

Every process computes its own share from the same inputs (count, seed, epoch, rank, world size,
worker) and agrees with every other process without communicating, so nothing here may depend
on ``hash()``, global random state or installed libraries. Items are shuffled per epoch, then
split across ranks (equal lengths: ``"pad"`` or ``"drop"``, or DDP hangs) and workers; shards are
dealt to (rank, worker) slots, split by sample index when there are fewer shards than slots, or
laid end to end into equal runs when their counts are known. The rules: docs/design/partition.md.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar, overload

from ..checks import check_int

if TYPE_CHECKING:  # shard mode's: imported by its functions, so a per-object start needs no shard module
    from ..formats.shards import ShardAssignment

PadPolicy = Literal["pad", "drop"]
T = TypeVar("T")

DEFAULT_SEED = 0
"""The seed of a dataset never given one: every rank still derives the same order."""

_POLICIES = ("pad", "drop")
_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- validation


def _check_index(name: str, value: object, count: int, count_name: str) -> int:
    index = check_int(name, value)
    if not 0 <= index < count:
        raise ValueError(f"{name}={index!r} is outside [0, {count_name}={count!r})")
    return index


def _check_policy(policy: object) -> None:
    if policy not in _POLICIES:
        raise ValueError(f"policy={policy!r} is not one of 'pad', 'drop'")


def _effective_workers(num_workers: int) -> int:
    """``num_workers=0`` (loading in the main process) reads like one worker."""
    return max(1, check_int("num_workers", num_workers, minimum=0))


# ----------------------------------------------------------------------------- epoch order


def epoch_seed(seed: int, epoch: int) -> int:
    """One 64-bit seed from ``(seed, epoch)``, the same in every process and Python version."""
    check_int("seed", seed)
    check_int("epoch", epoch, minimum=0)
    digest = hashlib.blake2b(f"loader.partition:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK64


SMALL_ORDER = 1024
"""Orders of up to this many items are a Fisher-Yates shuffle held as a list (the same orders
as releases before the keyed permutation); longer ones are computed per index."""

_ROUNDS = 6
_MIX1 = 0x9E3779B97F4A7C15
_MIX2 = 0xD6E8FEB86659FD93


class _Computed(Sequence[int]):
    """A sequence of ints computed when read; equal to any list, tuple or such sequence with the
    same items, like a list would be."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Computed | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = repr(list(self)) if len(self) <= 20 else f"<{len(self)} items>"
        return f"{type(self).__name__}({shown})"


class EpochOrder(_Computed):
    """A permutation of ``range(n)``, the identity without ``shuffle``, else seeded by epoch.

    Shuffled orders of more than ``SMALL_ORDER`` items are a keyed bijection computed per index
    in O(1) memory: an unbalanced Feistel network over the smallest power of two >= ``n``, walked
    until it lands inside ``[0, n)`` (cycle-walking, as format-preserving encryption does; fewer
    than two steps on average). Each worker so computes only the items of its own share, at
    ~3 µs each, instead of building the whole list. Hand-written: no maintained library offers
    a seeded bijection over an arbitrary ``[0, n)`` in pure Python.
    """

    __slots__ = ("_n", "_small", "_rounds", "_bits")

    def __init__(self, n: int, *, seed: int, epoch: int, shuffle: bool) -> None:
        check_int("n", n, minimum=0)
        seeded = epoch_seed(seed, epoch)  # validates seed and epoch even when not shuffling
        self._n = n
        self._small: list[int] | None = None
        self._rounds: tuple[tuple[int, int, int], ...] = ()
        self._bits = 0
        if not shuffle:
            return
        if n <= SMALL_ORDER:
            order = list(range(n))
            random.Random(seeded).shuffle(order)
            self._small = order
            return
        bits = (n - 1).bit_length()
        digest = hashlib.blake2b(f"loader.partition.feistel:{seeded}".encode(),
                                 digest_size=8 * _ROUNDS).digest()
        rounds = []
        high = bits // 2  # the halves swap sizes every round: any bit count works
        for r in range(_ROUNDS):
            key = int.from_bytes(digest[8 * r:8 * r + 8], "little")
            rounds.append((high, (1 << high) - 1, key))
            high = bits - high
        self._rounds = tuple(rounds)
        self._bits = bits

    def __len__(self) -> int:
        return self._n

    def _at(self, index: int) -> int:
        if self._small is not None:
            return self._small[index]
        if not self._rounds:
            return index
        n, bits, x = self._n, self._bits, index
        while True:  # cycle-walking: the network permutes [0, 2**bits); stay inside [0, n)
            for high, mask, key in self._rounds:
                low = x & ((1 << (bits - high)) - 1)
                y = ((low ^ key) * _MIX1) & _MASK64
                y ^= y >> 32
                y = (y * _MIX2) & _MASK64
                y ^= y >> 29
                x = (low << high) | ((x >> (bits - high)) ^ (y & mask))
            if x < n:
                return x

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Taken: ...

    def __getitem__(self, index: int | slice) -> int | Taken:
        if isinstance(index, slice):
            return Taken(self, range(self._n)[index])
        n = self._n
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} is outside an order of {n} items")
        return self._at(index)

    def __iter__(self) -> Iterator[int]:
        if self._small is not None:
            return iter(self._small)
        if not self._rounds:
            return iter(range(self._n))
        return map(self._at, range(self._n))


class Taken(_Computed):
    """The items of ``order`` at ``positions`` (taken modulo ``len(order)``: padding wraps to the
    order's start), computed when read: a rank's or worker's share without a list of it."""

    __slots__ = ("_order", "_positions")

    def __init__(self, order: Sequence[int], positions: range) -> None:
        if len(positions) and not len(order):
            raise ValueError("positions in an empty order")
        self._order = order
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Taken: ...

    def __getitem__(self, index: int | slice) -> int | Taken:
        if isinstance(index, slice):
            return Taken(self._order, self._positions[index])
        return self._order[self._positions[index] % len(self._order)]

    def __iter__(self) -> Iterator[int]:
        order, n = self._order, len(self._order)
        at = order._at if isinstance(order, EpochOrder) else order.__getitem__  # no bounds checks
        return (at(p % n) for p in self._positions)


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> EpochOrder:
    """A permutation of ``range(n)``: the identity without ``shuffle``, else seeded by epoch
    (see ``EpochOrder``: computed per index, in O(1) memory, past ``SMALL_ORDER`` items)."""
    return EpochOrder(n, seed=seed, epoch=epoch, shuffle=shuffle)


# ----------------------------------------------------------------------------- item mode


def rank_length(n: int, world_size: int, policy: PadPolicy = "pad") -> int:
    """Items per rank: ``ceil(n / W)`` with ``"pad"``, ``floor(n / W)`` with ``"drop"``."""
    check_int("n", n, minimum=0)
    check_int("world_size", world_size, minimum=1)
    _check_policy(policy)
    return -(-n // world_size) if policy == "pad" else n // world_size


def rank_share(
    order: Sequence[int], rank: int, world_size: int, policy: PadPolicy = "pad"
) -> Taken:
    """This rank's items: ``order`` padded or trimmed to a multiple of ``world_size``, strided.

    Padding repeats ``order`` from its start, cycling when ``n < world_size - 1``. The share is
    computed as it is read (``Taken``), never built as a list.
    """
    check_int("world_size", world_size, minimum=1)
    _check_index("rank", rank, world_size, "world_size")
    total = rank_length(len(order), world_size, policy) * world_size
    return Taken(order, range(rank, total, world_size))


def worker_share(items: Sequence[T], worker: int, num_workers: int) -> Sequence[T]:
    """This worker's part of a rank's items, ``items[worker::num_workers]`` (0 workers means 1);
    a ``Taken`` share stays computed-when-read."""
    workers = _effective_workers(num_workers)
    _check_index("worker", worker, workers, "max(1, num_workers)")
    if isinstance(items, _Computed):
        return items[worker::workers]  # type: ignore[return-value]
    return list(items[worker::workers])


def partition(
    n: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    policy: PadPolicy = "pad",
) -> Sequence[int]:
    """The item indices that ``(rank, worker)`` reads in ``epoch``, in reading order: computed
    as they are read, so a worker's start costs O(1) time and memory at any ``n``."""
    _check_policy(policy)
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    return worker_share(rank_share(order, rank, world_size, policy), worker, num_workers)


# ----------------------------------------------------------------------------- shard mode


def slot_of(rank: int, world_size: int, worker: int, num_workers: int) -> tuple[int, int]:
    """``(slot id, number of slots)`` for one (rank, worker): ``rank * workers + worker``."""
    workers = _effective_workers(num_workers)
    check_int("world_size", world_size, minimum=1)
    _check_index("rank", rank, world_size, "world_size")
    _check_index("worker", worker, workers, "max(1, num_workers)")
    return rank * workers + worker, world_size * workers


def needs_sample_split(num_shards: int, slots: int) -> bool:
    """Whether shards must be split by sample index (fewer shards than slots, but some)."""
    check_int("num_shards", num_shards, minimum=0)
    check_int("slots", slots, minimum=1)
    return 0 < num_shards < slots


def shard_assignments(
    num_shards: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
) -> list[ShardAssignment]:
    """What one (rank, worker) slot reads in shard mode; see docs/design/partition.md.

    With at least as many shards as slots, slot ``s`` reads shards ``order[s::slots]`` whole.
    With fewer, it reads the one shard ``order[s % num_shards]`` with a sample-index stride.
    Zero shards give every slot nothing.
    """
    from ..formats.shards import ShardAssignment

    check_int("num_shards", num_shards, minimum=0)
    slot, slots = slot_of(rank, world_size, worker, num_workers)
    order = epoch_order(num_shards, seed=seed, epoch=epoch, shuffle=shuffle)
    if not needs_sample_split(num_shards, slots):
        return [ShardAssignment(shard, 1, 0) for shard in order[slot::slots]]
    position = slot % num_shards
    stride = len(range(position, slots, num_shards))  # slots that read this shard
    return [ShardAssignment(order[position], stride, slot // num_shards)]


def balanced_shard_ranges(
    counts: Sequence[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    policy: PadPolicy = "pad",
) -> list[ShardAssignment]:
    """Equal-length shard splitting when every shard's sample count is known.

    The shards, in epoch order, form one sequence of ``sum(counts)`` samples. Rank ``r`` reads
    positions ``[r * L, (r + 1) * L)`` with ``L = rank_length(total, world_size, policy)``
    (``"pad"`` wraps around to the start, repeating at most ``world_size - 1`` samples); its
    workers split that run into contiguous parts differing by at most one sample. The result
    lists, in reading order, the sample range of each shard this slot reads.
    """
    from ..formats.shards import ShardAssignment

    for position, count in enumerate(counts):
        check_int(f"counts[{position}]", count, minimum=0)
    workers = _effective_workers(num_workers)
    slot_of(rank, world_size, worker, num_workers)  # validates rank and worker
    total = sum(counts)
    length = rank_length(total, world_size, policy)
    if total == 0 or length == 0:
        return []
    lo = rank * length + (worker * length) // workers
    hi = rank * length + ((worker + 1) * length) // workers
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    starts = []  # where each shard (in epoch order) begins in the sample sequence
    at = 0
    for shard in order:
        starts.append(at)
        at += counts[shard]
    out: list[ShardAssignment] = []
    position = lo
    while position < hi:
        wrapped = position % total  # the sequence repeats (pad) past ``total``
        for place, shard in enumerate(order):
            begin, end = starts[place], starts[place] + counts[shard]
            if begin <= wrapped < end:
                stop = min(end, wrapped + (hi - position))
                out.append(ShardAssignment(shard, 1, 0, wrapped - begin, stop - begin))
                position += stop - wrapped
                break
    return out


# ----------------------------------------------------------------------------- blocks (batch_size=)
#
# With ``batch_size=B`` the epoch's order is dealt in blocks: at step ``s`` rank ``r`` reads block
# ``s * W + r``, so the W ranks together consume the order front to back, B * W samples a step,
# whatever W and the number of DataLoader workers. A rank's worker ``w`` reads the blocks of the
# steps ``s`` with ``s % max(1, num_workers) == w``: the DataLoader takes whole batches from its
# workers in turn (worker 0's first batch, worker 1's first, ...), and an ``IterableDataset``
# worker's batch is the next B samples it yields, so the rank's batch at step ``s`` is block
# ``s * W + r`` exactly. The end of the order: the R < B * W samples left after the full steps
# make one last, shorter step of ``ceil(R / W)`` samples per rank (``"pad"``: the order is
# extended by repeating its start, at most W - 1 samples) or ``floor(R / W)`` (``"drop"``: at most
# W - 1 samples are left out), the same per-rank lengths as ``rank_length``. Every worker's
# batches line up with its blocks because only the very last step is short.


def block_shape(m: int, batch_size: int, world_size: int, policy: PadPolicy = "pad") -> tuple[int, int]:
    """``(full, last)``: ``m`` samples dealt in blocks of ``batch_size`` to ``world_size`` ranks
    give each rank ``full`` blocks of ``batch_size``, then one of ``last`` samples (0: none)."""
    check_int("m", m, minimum=0)
    check_int("batch_size", batch_size, minimum=1)
    check_int("world_size", world_size, minimum=1)
    _check_policy(policy)
    full, rest = divmod(m, batch_size * world_size)
    last = -(-rest // world_size) if policy == "pad" else rest // world_size
    return full, last


def steps_per_rank(m: int, batch_size: int, world_size: int, policy: PadPolicy = "pad") -> int:
    """Batches every rank reads when ``m`` samples are dealt in blocks (the last may be short)."""
    full, last = block_shape(m, batch_size, world_size, policy)
    return full + (last > 0)


def block_positions(
    m: int,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    policy: PadPolicy = "pad",
) -> list[int]:
    """Positions in a sequence of ``m`` samples that ``(rank, worker)`` reads, in reading order.

    The blocks of the steps this worker serves, one after another; with ``"pad"`` the last
    step's positions past ``m - 1`` wrap to the start of the sequence.
    """
    workers = _effective_workers(num_workers)
    slot_of(rank, world_size, worker, num_workers)  # validates rank and worker
    full, last = block_shape(m, batch_size, world_size, policy)
    out: list[int] = []
    for step in range(worker, full + (last > 0), workers):
        if step < full:
            lo, size = (step * world_size + rank) * batch_size, batch_size
        else:
            lo, size = full * batch_size * world_size + rank * last, last
        out.extend(p % m for p in range(lo, lo + size))
    return out


def samples_consumed(m: int, steps: int, *, batch_size: int, world_size: int,
                     policy: PadPolicy = "pad") -> int:
    """How many of the sequence's ``m`` samples are consumed after ``steps`` steps on every rank:
    always a prefix of the sequence (pad repeats are not counted twice)."""
    check_int("steps", steps, minimum=0)
    full, last = block_shape(m, batch_size, world_size, policy)
    if steps <= full:
        return steps * batch_size * world_size
    return min(m, full * batch_size * world_size + last * world_size)


def sequence_ranges(counts: Sequence[int], order: Sequence[int],
                    positions: Sequence[int]) -> list[ShardAssignment]:
    """Map positions in the sample sequence that the shards make laid end to end in ``order``
    (``counts[shard]`` samples each) to shard reads, in the positions' order.

    Consecutive positions in one shard become one sample range; successive ranges in the same
    shard, ascending, share one ``ShardAssignment`` (``ranges``), so that its shard is read once.
    """
    from ..formats.shards import ShardAssignment

    starts: list[int] = []
    at = 0
    for shard in order:
        starts.append(at)
        at += counts[shard]
    runs: list[list[int]] = []  # [place, start, stop]
    for position in positions:
        if not 0 <= position < at:
            raise ValueError(f"position {position} is outside the {at} samples of these shards")
        place = bisect.bisect_right(starts, position) - 1
        index = position - starts[place]
        if runs and runs[-1][0] == place and runs[-1][2] == index:
            runs[-1][2] += 1
        else:
            runs.append([place, index, index + 1])
    out: list[ShardAssignment] = []
    ranges: list[tuple[int, int]] = []
    for i, (place, start, stop) in enumerate(runs):
        ranges.append((start, stop))
        following = runs[i + 1] if i + 1 < len(runs) else None
        if following is None or following[0] != place or following[1] < stop:
            shard = order[place]
            out.append(ShardAssignment(shard, 1, 0, ranges[0][0], ranges[-1][1], tuple(ranges)))
            ranges = []
    return out
