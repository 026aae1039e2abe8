"""Loader statistics: what each process fetched, how fast, and what the main process can see.

The requests themselves are counted by ``stores.recording.RequestRecorder``.
``StatsBoard`` is a small shared-memory table with one row per DataLoader worker. Each worker
writes its row when its pass over the epoch ends; the main process sums the rows, so
``dataset.stats()`` there covers the whole epoch of that rank, not just the main process.
Written by hand on ``multiprocessing.RawArray`` because no library does "one row per
worker, readable by the parent" and a DataLoader gives no channel for it.
"""

from __future__ import annotations

from multiprocessing import RawArray
from multiprocessing.context import get_spawning_popen
from typing import Any

from ..stores.recording import BOUNDS, LatencyHistogram

COUNTERS = (
    "samples", "bytes", "requests", "request_errors", "retries", "samples_skipped", "shards_skipped",
    "tar_links_skipped",
    "cache_hits", "cache_misses", "cache_stale_refetches", "consumer_wait_s", "seconds",
)
MAX_WORKERS = 128  # rows on the board; workers beyond it keep their stats to themselves
_ROW = 1 + len(COUNTERS) + len(BOUNDS) + 1  # used flag, counters, buckets, overflow bucket


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
