"""How long one answer may take as a whole: the same rule for every transport.

A read timeout restarts at every byte, so a server that sends one byte a second never trips it.
Every answer is therefore also held to a pace: its head whole within ``head_deadline`` (twice
the read timeout, after connecting), its body, once waited for ``read_timeout`` in all, come at
``MIN_RATE`` bytes/s or faster. ``http1`` and the standard-library lister check it as bytes arrive;
botocore's and obstore's readers are not ours, so their paths put ``within`` around their awaits:
one for the head, one for a body of known length (``body_deadline``), one per piece (``Pace``)
where the body is streamed or its length unknown. Pure but for ``within``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

MIN_RATE = 16 << 10  # bytes/s: a body waited for read_timeout in all must have come this fast
LISTED_BYTES = 2 << 10  # a listing page's bytes per key at most (a key is at most 1 KiB, plus its XML)


class AnswerTooSlow(TimeoutError):
    """An answer that did not keep the pace; its message says which part, and its limit."""


def head_deadline(read_timeout: float, connect_timeout: float = 0.0) -> float:
    """Seconds an answer's status line and headers may take, together; with ``connect_timeout``
    where the awaited request opens its connection too (botocore's, obstore's)."""
    return connect_timeout + 2 * read_timeout


def body_deadline(read_timeout: float, length: int) -> float:
    """Seconds a body of ``length`` bytes may be waited for, in all."""
    return max(read_timeout, length / MIN_RATE)


def too_slow_head(seconds: float) -> AnswerTooSlow:
    return AnswerTooSlow(f"the answer's head was not whole after {seconds:g} s (RetryPolicy's "
                         "connect_timeout, then twice its read_timeout)")


def too_slow_body(read_timeout: float, received: int, waited: float) -> AnswerTooSlow:
    return AnswerTooSlow(f"the body came at {received / max(waited, 1e-9):.0f} bytes/s for "
                         f"{waited:.1f} s, under {MIN_RATE} bytes/s past RetryPolicy.read_timeout "
                         f"({read_timeout:g} s)")


def too_slow_whole(read_timeout: float, length: int) -> AnswerTooSlow:
    return AnswerTooSlow(f"the body of {length:,} bytes was not whole after "
                         f"{body_deadline(read_timeout, length):g} s (RetryPolicy.read_timeout, or "
                         f"{MIN_RATE} bytes/s for a longer body)")


class Pace:
    """A body read piece by piece: seconds spent waiting for it (not the reader's own time, so
    a consumer that pauses a stream is not counted) and bytes received."""

    __slots__ = ("read_timeout", "received", "waited")

    def __init__(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout
        self.waited = 0.0
        self.received = 0

    def next_wait(self) -> float:
        """Seconds the next piece may be waited for before the body is behind its pace."""
        return body_deadline(self.read_timeout, self.received + 1) - self.waited

    def too_slow(self) -> AnswerTooSlow:
        return too_slow_body(self.read_timeout, self.received, self.waited)


async def within(seconds: float, awaitable: Awaitable[T], too_slow: Callable[[], AnswerTooSlow]) -> T:
    """``await awaitable``, cancelled after ``seconds`` and ``too_slow()`` raised instead (a
    timeout from inside, such as a client's own read timeout, passes as it is)."""
    if sys.version_info < (3, 11):  # pragma: no cover - no asyncio.timeout: a task of its own
        try:
            return await asyncio.wait_for(awaitable, max(seconds, 0.0))
        except asyncio.TimeoutError as exc:
            raise too_slow() from exc
    deadline = asyncio.timeout(max(seconds, 0.0))
    try:
        async with deadline:
            return await awaitable
    except TimeoutError as exc:
        if deadline.expired():
            raise too_slow() from exc
        raise


async def paced(pace: Pace, awaitable: Awaitable[T]) -> T:
    """One piece of a body read at ``pace``: ``await awaitable`` within what the pace allows,
    counting the wait; the caller adds the piece's length to ``Pace.received``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        return await within(pace.next_wait(), awaitable, pace.too_slow)
    finally:
        pace.waited += loop.time() - started
