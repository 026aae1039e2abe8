"""Pure arithmetic of a weighted mix: how many samples each source gives an epoch, and in which order.

``apportion`` splits an epoch of ``N`` samples by weight (largest remainders, exact integers).
``DrawOrder`` orders them by Tijdeman's chairman assignment (each step, among the sources at
least ``1/(2S-2)`` behind their share, the one whose next sample is due first): every prefix of
the epoch holds each source's share to within ``1 - 1/(2S-2)`` < 1 sample for ``S`` sources, so
any window holds it to within two, and within one with two sources. Integer arithmetic
throughout: every process computes the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fractions import Fraction

from ..errors import ConfigError


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: floors, then the largest remainders (ties
    to the earlier source). The counts sum to ``total``; each is within one of its exact share."""
    if total < 0:
        raise ConfigError(f"samples_per_epoch={total!r} must not be negative")
    exact = [Fraction(w) for w in weights]
    whole = sum(exact)
    if not exact or whole <= 0 or any(w < 0 for w in exact):
        raise ConfigError(f"weights {list(weights)!r} must be non-negative numbers, not all zero")
    shares = [total * w / whole for w in exact]
    counts = [int(share) for share in shares]  # floors (shares are non-negative)
    left = total - sum(counts)
    by_remainder = sorted(range(len(shares)), key=lambda s: (-(shares[s] - counts[s]), s))
    for s in by_remainder[:left]:
        counts[s] += 1
    return counts


class DrawOrder:
    """The order of one epoch's samples over sources with ``counts[s]`` samples each: position
    ``q`` of the epoch is the ``k``-th sample of source ``s``."""

    def __init__(self, counts: Sequence[int]) -> None:
        if any(n < 0 for n in counts):
            raise ValueError(f"counts {list(counts)!r} must not be negative")
        self.counts = tuple(counts)
        self.total = sum(self.counts)

    def walk(self) -> Iterator[tuple[int, int]]:
        """``(source, k)`` of every position of the epoch, in order.

        Written by hand: no library offers the chairman assignment with exact integer shares
        and a fixed tie rule (lower source first); it is a few integer products per sample.
        """
        counts, total = self.counts, self.total
        active = [s for s, n in enumerate(counts) if n]
        spread = max(1, 2 * len(active) - 2)  # 1 / spread: how far behind a source must be
        taken = [0] * len(counts)
        for t in range(1, total + 1):
            best, due, weight = -1, 0, 1
            for s in active:
                n, c = counts[s], taken[s]
                if c >= n or (len(active) > 1 and spread * (n * t - total * c) < total):
                    continue  # done, or not yet far enough behind its share
                key = spread * (c + 1) - 1  # its next sample is due at key / (spread * n) * total
                if best < 0 or key * weight < due * n:
                    best, due, weight = s, key, n
            yield best, taken[best]
            taken[best] += 1

    def locate(self, positions: Sequence[int]) -> list[tuple[int, int]]:
        """``(source, k)`` for each of ``positions``, in their order; one walk up to the largest."""
        if not positions:
            return []
        if min(positions) < 0 or max(positions) >= self.total:
            raise IndexError(f"positions must lie in [0, {self.total}) (got {min(positions)}..{max(positions)})")
        wanted = sorted(set(positions))
        found: dict[int, tuple[int, int]] = {}
        at = iter(wanted)
        target = next(at)
        for position, pair in enumerate(self.walk()):
            if position == target:
                found[position] = pair
                target = next(at, -1)
                if target < 0:
                    break
        return [found[p] for p in positions]
