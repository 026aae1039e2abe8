"""Pure arithmetic of a weighted mix: how many samples each source gives an epoch, and in which order.

``apportion`` splits an epoch of ``N`` samples by weight (largest remainders, exact integers).
``DrawOrder`` orders them by Tijdeman's chairman assignment (each step, among the sources at
least ``1/(2S-2)`` behind their share, the one whose next sample is due first): every prefix of
the epoch holds each source's share to within ``1 - 1/(2S-2)`` < 1 sample for ``S`` sources, so
any window holds it to within two, and within one with two sources. Integer arithmetic
throughout: every process computes the same order.
"""

from __future__ import annotations

import array
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


class Tallied:
    """An epoch's draw order as the source of each position (1 byte a position, under 256
    sources), with each source's running count every ``EVERY`` positions: how many draws of a
    source fall in a stretch of the order, or in one lane's positions of it, is a few counts of
    bytes (C speed), so a worker finds its lanes' sizes and its own draws without a walk."""

    EVERY = 256

    def __init__(self, counts: Sequence[int]) -> None:
        self.width = len(counts)
        self.sources = array.array("B" if self.width < 256 else "H", (s for s, _ in DrawOrder(counts).walk()))
        self.total = len(self.sources)
        self.tallies = array.array("q")  # row i: each source's draws in sources[:i * EVERY]
        running = [0] * self.width
        for start in range(0, self.total + 1, self.EVERY):
            self.tallies.extend(running)
            block = self.sources[start:start + self.EVERY]
            running = [n + block.count(s) for s, n in enumerate(running)]

    def before(self, source: int, q: int) -> int:
        """Draws of ``source`` at positions ``[0, q)``."""
        row = q // self.EVERY
        return self.tallies[row * self.width + source] + self.sources[row * self.EVERY:q].count(source)

    def position(self, source: int, k: int) -> int:
        """The position of ``source``'s ``k``-th draw (from 0)."""
        low, high = 0, len(self.tallies) // self.width - 1  # the last row with at most k draws before it
        while low < high:
            middle = (low + high + 1) // 2
            if self.tallies[middle * self.width + source] <= k:
                low = middle
            else:
                high = middle - 1
        q = low * self.EVERY - 1
        for _ in range(k - self.tallies[low * self.width + source] + 1):
            q = self.sources.index(source, q + 1)
        return q

    def in_lane(self, source: int, lane: int, start: int, stop: int, step: int, table: Sequence[int]) -> int:
        """Draws of ``source`` at positions ``[start, stop)`` that lane ``lane`` holds, where
        position ``q`` is lane ``table[(q // step) % len(table)]``'s."""
        period, out = len(table), 0
        if stop <= start:
            return 0
        for residue, owner in enumerate(table):
            if owner != lane:
                continue
            if step == 1:
                out += self.sources[start + (residue - start) % period:stop:period].count(source)
                continue
            block = start // step
            block += (residue - block) % period
            while block * step < stop:
                out += self.sources[max(start, block * step):min(stop, (block + 1) * step)].count(source)
                block += period
        return out
