"""A sample shuffle buffer: mixes a stream whose order comes in runs (shards) without holding it.

Pure and seeded: the same input, size and seed give the same output, so shard-mode epochs
repeat exactly for a given ``(seed, epoch, rank, worker)``. Hand-written rather than taken from
webdataset because it is a dozen lines and must be seeded per epoch and slot.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def shuffled(items: Iterable[T], size: int, rng: random.Random, *, max_bytes: int | None = None,
             nbytes: Callable[[T], int] | None = None) -> Iterator[T]:
    """Yield ``items`` in an order mixed within a window of ``size`` (0 or 1: unchanged).

    Each incoming item replaces a uniformly chosen one in a full buffer, which is yielded; at
    the end the rest is shuffled and drained. Memory: ``size`` items, and with ``max_bytes``
    also at most that many bytes (``nbytes(item)`` each) plus one item.
    """
    if size <= 1:
        yield from items
        return
    if max_bytes is not None and nbytes is not None:
        yield from _shuffled_bytes(items, size, rng, max_bytes, nbytes)
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


def _shuffled_bytes(items: Iterable[T], size: int, rng: random.Random, max_bytes: int,
                    nbytes: Callable[[T], int]) -> Iterator[T]:
    """``shuffled`` with a byte limit too: while the buffer is over either limit, a uniformly
    chosen item leaves it."""
    buffer: list[T] = []
    held = 0
    for item in items:
        buffer.append(item)
        held += nbytes(item)
        while len(buffer) > 1 and (len(buffer) > size or held > max_bytes):
            index = rng.randrange(len(buffer))
            buffer[index], buffer[-1] = buffer[-1], buffer[index]
            out = buffer.pop()
            held -= nbytes(out)
            yield out
    rng.shuffle(buffer)
    yield from buffer
