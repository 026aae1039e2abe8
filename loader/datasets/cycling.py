"""Fixed-length epochs over shards of unknown size (``samples_per_epoch=N``): pure planning.

Every rank yields exactly N samples an epoch without counts: a rank's N are split among its
workers (``worker_quota``, following the DataLoader's batches with ``batch_size=``), and each
slot reads endless seeded passes over the shards until its quota is met (docs/design/partition.md).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator

from ..formats.shards import ShardAssignment
from . import partition

_MASK64 = (1 << 64) - 1


def worker_quota(n: int, *, worker: int, num_workers: int, batch_size: int | None = None) -> int:
    """Samples worker ``worker`` of a rank yields so that the rank yields ``n`` in all."""
    partition.slot_of(0, 1, worker, num_workers)  # validates worker and num_workers
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative integer")
    workers = max(1, num_workers)
    if batch_size is None:
        return n // workers + (worker < n % workers)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    full, last = divmod(n, batch_size)  # steps of a whole batch, then one of ``last`` samples
    mine = len(range(worker, full, workers))
    return mine * batch_size + (last if last and full % workers == worker else 0)


def pass_seed(seed: int, epoch: int, resumed: int = 0) -> int:
    """The seed of an epoch's passes; ``resumed`` (samples per rank a resume skipped) makes a
    resumed epoch continue from a fresh point of the cycle rather than from its start."""
    for name, value, low in (("seed", seed, None), ("epoch", epoch, 0), ("resumed", resumed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
            raise ValueError(f"{name}={value!r} must be an integer" + (" >= 0" if low is not None else ""))
    digest = hashlib.blake2b(f"loader.cycling:{seed}:{epoch}:{resumed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK64


def cycle(num_shards: int, *, seed: int, shuffle: bool, rank: int, world_size: int, worker: int,
          num_workers: int) -> Iterator[tuple[int, ShardAssignment]]:
    """``(pass, assignment)`` for one slot, pass after pass, without end (``seed``: a
    :func:`pass_seed`). Each pass gives every slot a share (sample-split shards when there are
    fewer shards than slots), so no slot is ever left without shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r}: samples_per_epoch needs at least one shard")
    for number in itertools.count():
        for assignment in partition.shard_assignments(
                num_shards, seed=seed, epoch=number, shuffle=shuffle, rank=rank,
                world_size=world_size, worker=worker, num_workers=num_workers):
            yield number, assignment
