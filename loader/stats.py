"""Loader statistics: what each process fetched, how fast, and what the main process can see.

* ``RequestRecorder`` wraps the store an engine uses and counts requests, failed requests,
  bytes and request latency (whole response for ``get``/``get_range``, time to first chunk
  for ``stream``) into a ``LatencyHistogram`` (log-spaced buckets: fixed size, mergeable).
* ``StatsBoard`` is a small shared-memory table with one row per DataLoader worker. Each worker
  writes its row when its pass over the epoch ends; the main process sums the rows, so
  ``dataset.stats()`` there covers the whole epoch of that rank, not just the main process.
  Written by hand on ``multiprocessing.RawArray`` because no library does "one row per
  worker, readable by the parent" and a DataLoader gives no channel for it.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from multiprocessing import RawArray
from multiprocessing.context import get_spawning_popen
from typing import Any

from .stores import ObjectInfo, ObjectStore

# Latency bucket upper bounds: 50 us x 2**(i/4), 96 buckets, up to ~850 s; ~19 % resolution.
BOUNDS = tuple(50e-6 * 2 ** (i / 4) for i in range(96))
COUNTERS = (
    "samples", "bytes", "requests", "request_errors", "retries", "shards_skipped",
    "cache_hits", "cache_misses", "consumer_wait_s", "seconds",
)
MAX_WORKERS = 128  # rows on the board; workers beyond it keep their stats to themselves
_ROW = 1 + len(COUNTERS) + len(BOUNDS) + 1  # used flag, counters, buckets, overflow bucket


class LatencyHistogram:
    """Counts of request latencies in log-spaced buckets; percentiles from the buckets."""

    __slots__ = ("counts",)

    def __init__(self, counts: Sequence[float] | None = None) -> None:
        self.counts = list(counts) if counts is not None else [0] * (len(BOUNDS) + 1)

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
        seen = 0
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

    def list(self, bucket: str, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        return self.inner.list(bucket, prefix)

    async def get(self, bucket: str, key: str) -> bytes:
        return await self._timed(self.inner.get(bucket, key))

    async def get_range(self, bucket: str, key: str, start: int, end: int | None) -> bytes:
        return await self._timed(self.inner.get_range(bucket, key, start, end))

    async def _timed(self, request: Awaitable[bytes]) -> bytes:
        recorder = self.recorder
        recorder.requests += 1
        started = time.perf_counter()
        try:
            data = await request
        except Exception:
            recorder.request_errors += 1
            raise
        recorder.latency.add(time.perf_counter() - started)
        recorder.bytes += len(data)
        return data

    async def stream(self, bucket: str, key: str, start: int = 0, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        recorder = self.recorder
        recorder.requests += 1
        started = time.perf_counter()
        first = True
        chunks = self.inner.stream(bucket, key, start, chunk_size)
        try:
            async for chunk in chunks:
                if first:
                    recorder.latency.add(time.perf_counter() - started)
                    first = False
                recorder.bytes += len(chunk)
                yield chunk
        except Exception:
            recorder.request_errors += 1
            raise
        finally:
            await chunks.aclose()

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        await self.inner.put(bucket, key, data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class StatsBoard:
    """One shared-memory row per DataLoader worker; the parent sums them.

    Created in the process that builds the dataset, so forked and spawned workers share it.
    Pickled any other way (``copy.deepcopy``, ``torch.save``) it becomes a private board.
    """

    def __init__(self) -> None:
        self._cells = RawArray("d", MAX_WORKERS * _ROW)

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is None:  # not a process start: shared memory cannot travel
            return {"_cells": None}
        return {"_cells": self._cells}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._cells = state["_cells"] if state["_cells"] is not None else RawArray("d", MAX_WORKERS * _ROW)

    def clear(self, rows: range) -> None:
        for row in rows:
            if 0 <= row < MAX_WORKERS:
                base = row * _ROW
                self._cells[base:base + _ROW] = [0.0] * _ROW

    def write(self, row: int, counters: dict[str, float], latency: LatencyHistogram) -> None:
        if not 0 <= row < MAX_WORKERS:
            return
        base = row * _ROW
        values = [1.0] + [float(counters.get(name, 0)) for name in COUNTERS] + [float(c) for c in latency.counts]
        self._cells[base:base + _ROW] = values

    def read(self) -> list[tuple[dict[str, float], LatencyHistogram]]:
        """The rows written since they were last cleared."""
        rows = []
        for row in range(MAX_WORKERS):
            base = row * _ROW
            if self._cells[base] != 1.0:
                continue
            values = self._cells[base + 1:base + _ROW]
            counters = dict(zip(COUNTERS, values[:len(COUNTERS)]))
            rows.append((counters, LatencyHistogram(values[len(COUNTERS):])))
        return rows


def summarize(rows: list[tuple[dict[str, float], LatencyHistogram]]) -> dict[str, Any]:
    """Sum worker rows into one dict with latency percentiles and throughput."""
    total = {name: 0.0 for name in COUNTERS}
    latency = LatencyHistogram()
    for counters, histogram in rows:
        for name in COUNTERS:
            total[name] += counters[name]
        latency.merge(histogram)
    out: dict[str, Any] = {name: (total[name] if name.endswith("_s") or name == "seconds" else int(total[name]))
                           for name in COUNTERS}
    out["workers"] = len(rows)
    out.update(latency.summary())
    seconds = max((counters["seconds"] for counters, _ in rows), default=0.0)
    out["seconds"] = seconds  # workers run side by side: the epoch took the longest of them
    out["samples_per_s"] = out["samples"] / seconds if seconds else None
    out["mb_per_s"] = out["bytes"] / 1e6 / seconds if seconds else None
    return out
