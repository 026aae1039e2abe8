"""Which items each (rank, worker) reads in an epoch: pure functions, no I/O, no torch.

Every process of a job computes its own share from the same inputs (item count, seed, epoch,
rank, world size, worker, worker count) and gets an answer that agrees with every other
process's, with no communication at all. That is why nothing here may depend on ``hash()``
(salted per process), on global random state, or on which libraries happen to be installed:

1. :func:`epoch_order` shuffles ``range(n)`` with ``random.Random(epoch_seed(seed, epoch))``;
   ``epoch_seed`` mixes the two with BLAKE2b, and both are stable across processes and
   Python versions. Shuffling is O(n) in pure Python: about 0.4 s per million items.
2. :func:`rank_share` splits that order across ranks by striding, ``order[rank::world_size]``,
   after padding (``"pad"``, like ``DistributedSampler(drop_last=False)``: the order is extended
   by repeating its start, so every rank gets ``ceil(n / W)`` items) or trimming (``"drop"``:
   the tail is dropped, every rank gets ``floor(n / W)``). Equal length per rank matters
   because DDP hangs when one rank runs out of batches before the others.
3. :func:`worker_share` splits a rank's share across its DataLoader workers, again by striding;
   worker shares differ by at most one item (the DataLoader interleaves them anyway).

Shard mode (``from_shards``) reads whole tar shards, so the unit of splitting is the shard, and
there may be fewer shards than reading slots. A *slot* is one (rank, worker) pair::

    slots   = world_size * max(1, num_workers)
    slot id = rank * max(1, num_workers) + worker

:func:`shard_assignments` deals shards (in epoch order) round-robin over slots when there are
at least as many shards as slots. Otherwise it uses **sample-index splitting**: slot ``s``
reads shard ``order[s % num_shards]`` and keeps only the samples whose index within the shard
``% stride == phase``, where ``stride`` is the number of slots reading that shard and ``phase``
is this slot's place among them. Every sample still goes to exactly one slot and no slot sits
idle, at a price: each such shard is downloaded ``stride`` times (once per slot reading it).
Round-robin dealing does not give equal sample counts per rank (shards hold different numbers
of samples, and slots may hold one shard more than others). When the sample count of every shard
is known (``from_shards(..., sample_counts=...)``), :func:`balanced_shard_ranges` does better:
it lays the epoch's shards end to end and gives each rank a contiguous run of exactly
``rank_length(total, W, policy)`` samples, and each worker a contiguous part of its rank's run.
A shard on the border of two runs is read by both slots, each keeping its own sample range
(the first stops reading at its range's end), so the overhead is at most one shard per slot.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Literal, TypeVar

from ..formats.shards import ShardAssignment

PadPolicy = Literal["pad", "drop"]
T = TypeVar("T")

DEFAULT_SEED = 0
"""The seed of a dataset never given one: every rank still derives the same order."""

_POLICIES = ("pad", "drop")
_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return value


def _check_index(name: str, value: object, count: int, count_name: str) -> int:
    index = _check_int(name, value)
    if not 0 <= index < count:
        raise ValueError(f"{name}={index!r} is outside [0, {count_name}={count!r})")
    return index


def _check_policy(policy: object) -> None:
    if policy not in _POLICIES:
        raise ValueError(f"policy={policy!r} is not one of 'pad', 'drop'")


def _effective_workers(num_workers: int) -> int:
    """``num_workers=0`` (loading in the main process) reads like one worker."""
    return max(1, _check_int("num_workers", num_workers, minimum=0))


# ----------------------------------------------------------------------------- epoch order


def epoch_seed(seed: int, epoch: int) -> int:
    """One 64-bit seed from ``(seed, epoch)``, the same in every process and Python version."""
    _check_int("seed", seed)
    _check_int("epoch", epoch, minimum=0)
    digest = hashlib.blake2b(f"loader.partition:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK64


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """A permutation of ``range(n)``: the identity without ``shuffle``, else seeded by epoch."""
    _check_int("n", n, minimum=0)
    order = list(range(n))
    seeded = epoch_seed(seed, epoch)  # validates seed and epoch even when not shuffling
    if shuffle:
        random.Random(seeded).shuffle(order)
    return order


# ----------------------------------------------------------------------------- item mode


def rank_length(n: int, world_size: int, policy: PadPolicy = "pad") -> int:
    """Items per rank: ``ceil(n / W)`` with ``"pad"``, ``floor(n / W)`` with ``"drop"``."""
    _check_int("n", n, minimum=0)
    _check_int("world_size", world_size, minimum=1)
    _check_policy(policy)
    return -(-n // world_size) if policy == "pad" else n // world_size


def rank_share(
    order: Sequence[int], rank: int, world_size: int, policy: PadPolicy = "pad"
) -> list[int]:
    """This rank's items: ``order`` padded or trimmed to a multiple of ``world_size``, strided.

    Padding repeats ``order`` from its start, cycling when ``n < world_size - 1``.
    """
    _check_int("world_size", world_size, minimum=1)
    _check_index("rank", rank, world_size, "world_size")
    n = len(order)
    total = rank_length(n, world_size, policy) * world_size
    if total <= n:
        return list(order[rank:total:world_size])
    return [order[i % n] for i in range(rank, total, world_size)]


def worker_share(items: Sequence[T], worker: int, num_workers: int) -> list[T]:
    """This worker's part of a rank's items, ``items[worker::num_workers]`` (0 workers means 1)."""
    workers = _effective_workers(num_workers)
    _check_index("worker", worker, workers, "max(1, num_workers)")
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
) -> list[int]:
    """The item indices that ``(rank, worker)`` reads in ``epoch``, in reading order."""
    _check_policy(policy)
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    return worker_share(rank_share(order, rank, world_size, policy), worker, num_workers)


# ----------------------------------------------------------------------------- shard mode


def slot_of(rank: int, world_size: int, worker: int, num_workers: int) -> tuple[int, int]:
    """``(slot id, number of slots)`` for one (rank, worker): ``rank * workers + worker``."""
    workers = _effective_workers(num_workers)
    _check_int("world_size", world_size, minimum=1)
    _check_index("rank", rank, world_size, "world_size")
    _check_index("worker", worker, workers, "max(1, num_workers)")
    return rank * workers + worker, world_size * workers


def needs_sample_split(num_shards: int, slots: int) -> bool:
    """Whether shards must be split by sample index (fewer shards than slots, but some)."""
    _check_int("num_shards", num_shards, minimum=0)
    _check_int("slots", slots, minimum=1)
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
    """What one (rank, worker) slot reads in shard mode; see the module docstring.

    With at least as many shards as slots, slot ``s`` reads shards ``order[s::slots]`` whole.
    With fewer, it reads the one shard ``order[s % num_shards]`` with a sample-index stride.
    Zero shards give every slot nothing.
    """
    _check_int("num_shards", num_shards, minimum=0)
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
    for position, count in enumerate(counts):
        _check_int(f"counts[{position}]", count, minimum=0)
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
        wrapped = position % total
        cycle_end = position - wrapped + total  # the sequence repeats (pad) past ``total``
        for place, shard in enumerate(order):
            begin, end = starts[place], starts[place] + counts[shard]
            if begin <= wrapped < end:
                stop = min(end, wrapped + (hi - position), cycle_end)
                out.append(ShardAssignment(shard, 1, 0, wrapped - begin, stop - begin))
                position += stop - wrapped
                break
    return out
