"""Wrap a store to count its requests, bytes, errors and latency (the numbers behind ``stats()``).

``RequestRecorder`` wraps the store an engine uses and counts requests, failed requests, bytes
and request latency (whole response for ``get``/``get_range``, time to first chunk for
``stream``) into a ``LatencyHistogram`` (log-spaced buckets: fixed size, mergeable), and the
time spent in requests (``seconds``: a stream's awaits for its chunks, not the time its reader
holds them).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

from .protocol import ObjectInfo, ObjectStore, Pin

T = TypeVar("T", bytes, bytes | None)

# Latency bucket upper bounds: 50 us x 2**(i/4), 96 buckets, up to ~850 s; ~19 % resolution.
BOUNDS = tuple(50e-6 * 2 ** (i / 4) for i in range(96))


class LatencyHistogram:
    """Counts of request latencies in log-spaced buckets; percentiles from the buckets."""

    __slots__ = ("counts",)

    def __init__(self, counts: Sequence[float] | None = None) -> None:
        self.counts: list[float] = list(counts) if counts is not None else [0] * (len(BOUNDS) + 1)

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS, seconds)] += 1

    def merge(self, other: LatencyHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    def percentile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q``-quantile (None when empty)."""
        total = self.total
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0.0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return BOUNDS[index] if index < len(BOUNDS) else math.inf
        return math.inf

    def summary(self) -> dict[str, float | None]:
        return {f"latency_p{int(q * 100)}_s": self.percentile(q) for q in (0.5, 0.9, 0.99)}


class RequestRecorder:
    """Counters one iterating process fills while its engine runs (touched by one thread)."""

    def __init__(self) -> None:
        self.requests = 0
        self.request_errors = 0
        self.bytes = 0
        self.seconds = 0.0  # summed over requests, which overlap: it can exceed the wall time
        self.latency = LatencyHistogram()

    def wrap(self, factory: Callable[[], Awaitable[ObjectStore]]) -> Callable[[], Awaitable[ObjectStore]]:
        """A store factory whose stores report to this recorder."""

        async def open_recorded() -> ObjectStore:
            return _RecordedStore(await factory(), self)

        return open_recorded


class _RecordedStore:
    """An ``ObjectStore`` that times and counts the reads it passes to ``inner``."""

    def __init__(self, inner: ObjectStore, recorder: RequestRecorder) -> None:
        self.inner = inner
        self.recorder = recorder
        # whether the engine may hedge these reads is the wrapped store's to say (the cache's is no)
        self.hedged_by_engine = bool(getattr(inner, "hedged_by_engine", True))

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(bucket, prefix)

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        return await self._timed(self.inner.get(bucket, key, pin=pin))

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        return await self._timed(self.inner.get_range(bucket, key, start, end, pin=pin))

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        return await self._timed(self.inner.get_if_changed(bucket, key, etag, start, end, pin=pin))

    async def _timed(self, request: Awaitable[T]) -> T:
        recorder = self.recorder
        recorder.requests += 1
        started = time.perf_counter()
        try:
            data = await request
        except Exception:
            recorder.request_errors += 1
            recorder.seconds += time.perf_counter() - started
            raise
        elapsed = time.perf_counter() - started
        recorder.seconds += elapsed
        recorder.latency.add(elapsed)
        recorder.bytes += 0 if data is None else len(data)
        return data

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = 1 << 20, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        recorder = self.recorder
        recorder.requests += 1
        clock = time.perf_counter
        asked = clock()
        first = True
        chunks = self.inner.stream(bucket, key, start, chunk_size, pin=pin, end=end)
        try:
            async for chunk in chunks:
                got = clock()
                recorder.seconds += got - asked
                if first:
                    recorder.latency.add(got - asked)
                    first = False
                recorder.bytes += len(chunk)
                yield chunk
                asked = clock()
        except Exception:
            recorder.request_errors += 1
            raise
        finally:
            await chunks.aclose()

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        await self.inner.put(bucket, key, data)

    async def aclose(self) -> None:
        await self.inner.aclose()
