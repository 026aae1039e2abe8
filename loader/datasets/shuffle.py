"""A sample shuffle buffer: mixes a stream whose order comes in runs (shards) without holding it.

Pure and seeded: the same input, size and seed give the same output, so shard-mode epochs
repeat exactly for a given ``(seed, epoch, rank, worker)``. Hand-written rather than taken from
webdataset because it is a dozen lines and must be seeded per epoch and slot.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def shuffled(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """Yield ``items`` in an order mixed within a window of ``size`` (0 or 1: unchanged).

    Each incoming item replaces a uniformly chosen one in a full buffer, which is yielded; at
    the end the rest is shuffled and drained. Memory: ``size`` items.
    """
    if size <= 1:
        yield from items
        return
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        index = rng.randrange(size)
        buffer[index], item = item, buffer[index]
        yield item
    rng.shuffle(buffer)
    yield from buffer
