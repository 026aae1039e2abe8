"""What one process has delivered in an epoch, kept small enough to snapshot every batch.

``StatefulDataLoader`` asks each worker for ``state_dict()`` after every batch, so the state must
not grow with the epoch. A ``Watermark`` stores a set of sample numbers as "everything below
``low``" plus the few delivered out of order (as-completed delivery, the shuffle buffer): its
size is bounded by how far out of order delivery gets, not by how far the epoch has gone.

Also here: which samples each DataLoader worker has handed over after the training loop saw a
number of batches, for resuming with a plain ``DataLoader`` (no per-worker state available).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Watermark:
    """A set of non-negative integers: all below ``low``, plus ``above``."""

    __slots__ = ("low", "above")

    def __init__(self, low: int = 0, above: Sequence[int] = ()) -> None:
        self.low = low
        self.above = set(above)

    def add(self, n: int) -> None:
        if n == self.low:
            self.low += 1
            while self.low in self.above:
                self.above.remove(self.low)
                self.low += 1
        elif n > self.low:
            self.above.add(n)

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and (n < self.low or n in self.above)

    def __len__(self) -> int:
        return self.low + len(self.above)

    def to_state(self) -> list[Any]:
        return [self.low, sorted(self.above)]

    @classmethod
    def from_state(cls, state: Sequence[Any]) -> Watermark:
        low, above = state
        return cls(int(low), [int(n) for n in above])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Watermark) and self.to_state() == other.to_state()

    def __repr__(self) -> str:
        return f"Watermark(low={self.low}, above={sorted(self.above)})"


def batches_per_worker(samples: Sequence[int], batch_size: int, drop_last: bool = False) -> list[int]:
    """How many batches each worker produces from its number of samples."""
    if drop_last:
        return [n // batch_size for n in samples]
    return [-(-n // batch_size) for n in samples]


def consumed_per_worker(
    samples: Sequence[int], batches_seen: int, batch_size: int, drop_last: bool = False
) -> list[int]:
    """Samples each worker had delivered when the loop had seen ``batches_seen`` batches.

    Mirrors the DataLoader's in-order round robin over workers, which skips a worker once it is
    exhausted. ``samples[w]`` is worker ``w``'s share for the epoch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be at least 1")
    remaining = batches_per_worker(samples, batch_size, drop_last)
    taken = [0] * len(samples)
    worker, left = 0, batches_seen
    while left > 0 and any(remaining):
        if remaining[worker]:
            remaining[worker] -= 1
            taken[worker] += 1
            left -= 1
        worker = (worker + 1) % len(samples)
    return [min(n, t * batch_size) for n, t in zip(samples, taken)]
