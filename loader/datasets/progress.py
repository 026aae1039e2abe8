"""What one process has delivered in an epoch, kept small enough to snapshot every batch.

``StatefulDataLoader`` asks each worker for ``state_dict()`` after every batch, so the state must
not grow with the epoch. A ``Watermark`` stores a set of sample numbers as "everything below
``low``" plus the few delivered out of order (as-completed delivery, the shuffle buffer): its
size is bounded by how far out of order delivery gets, not by how far the epoch has gone.
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
