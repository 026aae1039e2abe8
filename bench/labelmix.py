"""How mixed batches are: distinct labels per batch against a uniform permutation (pure).

Used by ``bench/shuffle.py`` and by the tests that read label-sorted data: counts, not time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from math import comb
from typing import NamedTuple


class Mix(NamedTuple):
    batches: int
    distinct: float  # mean distinct labels per batch
    uniform: float  # what a uniform random permutation gives (expected)
    single: int  # batches holding one label only

    @property
    def ratio(self) -> float:
        return self.distinct / self.uniform if self.uniform else 1.0

    @property
    def single_fraction(self) -> float:
        return self.single / self.batches if self.batches else 0.0


def uniform_distinct(counts: Sequence[int], batch: int) -> float:
    """Expected distinct labels in ``batch`` samples drawn without replacement from a set with
    ``counts[label]`` samples of each label: what a batch of a uniform permutation holds."""
    total = sum(counts)
    if batch > total:
        batch = total
    whole = comb(total, batch)
    return sum(1 - comb(total - c, batch) / whole for c in counts if c)


def label_mix(batches: Iterable[Sequence[object]], counts: Sequence[int] | None = None) -> Mix:
    """``batches`` of labels (full ones only: a short last batch is left out) against a uniform
    permutation of the same labels (``counts``: of the whole set; default: those seen)."""
    kept = [list(b) for b in batches]
    size = max((len(b) for b in kept), default=0)
    kept = [b for b in kept if len(b) == size]
    if counts is None:
        counts = list(Counter(label for b in kept for label in b).values())
    distinct = sum(len(set(b)) for b in kept) / max(1, len(kept))
    single = sum(1 for b in kept if len(set(b)) == 1)
    return Mix(len(kept), distinct, uniform_distinct(counts, size) if size else 0.0, single)
