"""Loader statistics: what each process fetched, how fast, where its time went, and how long
the training loop waited for data.

Each process splits its time into waiting for the engine, ``transform`` and the hand-off outside
the loader; ``StatsBoard`` (one shared-memory row per DataLoader worker, hand-written because no
library offers it) lets the main process sum the whole epoch of its rank (docs/design/stats.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from multiprocessing import RawArray
from multiprocessing.context import get_spawning_popen
from typing import Any, TypeVar

from ..s3.recording import BOUNDS, LatencyHistogram

COUNTERS = (
    "samples", "bytes", "requests", "request_errors", "retries", "samples_skipped", "shards_skipped",
    "tar_links_skipped",
    "cache_hits", "cache_misses", "cache_stale_refetches", "consumer_wait_s", "seconds",
    "get_s", "transform_s", "handoff_s", "peak_inflight", "startup_s", "throttled", "hedged",
    "hedges_won",
)
# summed over workers, except these: the largest worker's value
_MAXED = ("seconds", "peak_inflight", "startup_s")
T = TypeVar("T")
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
    for name in _MAXED:  # workers run side by side: the epoch took the longest of them
        total[name] = max((counters[name] for counters, _ in rows), default=0.0)
    out: dict[str, Any] = {name: (total[name] if name.endswith("_s") or name == "seconds" else int(total[name]))
                           for name in COUNTERS}
    out["workers"] = len(rows)
    out.update(latency.summary())
    seconds = out["seconds"]
    out["samples_per_s"] = out["samples"] / seconds if seconds else None
    out["mb_per_s"] = out["bytes"] / 1e6 / seconds if seconds else None
    return out


# ----------------------------------------------------------------------------- the training loop's side


class StepWaits:
    """How long a training loop waited for each of its batches, timed where it asks for them.

    Only the process that runs the loop can see this (DataLoader workers only see their own
    queue), so ``timed`` measures it there. Start-up is kept apart from the steady state: the
    first batch (``first_batch_s``: starting the iteration, and the workers unless they are
    persistent) and the first batch of each other DataLoader worker, which the loader takes in
    turn (``startup_wait_s`` sums the waits of those ``startup_steps``), and the wait at the
    end (``end_wait_s``: the last workers finishing and shutting down). The percentiles,
    ``data_wait_s`` and ``data_wait_fraction`` cover the steps in between, so that a short
    epoch's start-up does not read as slow loading.
    """

    __slots__ = ("waits", "steps", "wait_s", "busy_s", "first_s", "startup_steps", "startup_s", "end_s")

    def __init__(self, startup_steps: int = 1) -> None:
        self.waits = LatencyHistogram()
        self.steps = 0
        self.startup_steps = max(1, startup_steps)
        self.wait_s = 0.0  # the steady state's waits
        self.busy_s = 0.0  # time the loop spent on its batches (between receiving one and asking)
        self.first_s: float | None = None
        self.startup_s = 0.0
        self.end_s = 0.0

    def summary(self) -> dict[str, Any]:
        waits = self.waits
        total = self.wait_s + self.busy_s
        steady = self.steps - min(self.steps, self.startup_steps)
        return {
            "steps": self.steps, "steady_steps": steady, "data_wait_s": self.wait_s, "step_s": self.busy_s,
            "first_batch_s": self.first_s, "startup_wait_s": self.startup_s, "end_wait_s": self.end_s,
            "data_wait_fraction": self.wait_s / total if total and steady else None,
            **{f"step_wait_p{int(q * 100)}_s": waits.percentile(q) for q in (0.5, 0.95, 0.99)},
        }


def timed(batches: Iterable[T], waits: StepWaits) -> Iterator[T]:
    """Yield ``batches`` while recording in ``waits`` how long each ``next()`` took (the
    training loop's wait for data) and how long the loop kept each batch (its step)."""
    clock = time.perf_counter
    started = clock()
    iterator = iter(batches)
    while True:
        asked = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            waits.end_s += clock() - asked  # the last workers finishing
            return
        got = clock()
        if waits.first_s is None:
            waits.first_s = got - started
            waits.startup_s += got - started
        elif waits.steps < waits.startup_steps:  # another worker's first batch
            waits.startup_s += got - asked
        else:
            waits.waits.add(got - asked)
            waits.wait_s += got - asked
        waits.steps += 1
        yield batch
        waits.busy_s += clock() - got


# ----------------------------------------------------------------------------- advice


def report(stats: dict[str, Any], *, inflight_limit: int | None = None) -> str:
    """A few lines for people: where one rank's time went in its last epoch, and what to try."""
    lines = []
    samples, seconds, workers = stats.get("samples", 0), stats.get("seconds") or 0.0, stats.get("workers", 1)
    rate = f" ({samples / seconds:,.0f}/s)" if seconds else ""
    lines.append(f"{samples:,} samples in {seconds:.1f} s{rate}, {workers} loader process(es)")
    steps = stats.get("steps")
    if steps:
        share = stats["data_wait_fraction"] or 0.0
        steady = stats.get("steady_steps", steps - 1)
        lines.append(f"start-up, apart from the rest: first batch after {_ms(stats['first_batch_s'])}"
                     + (f", the first {steps - steady} (one per worker) after "
                        f"{_ms(stats.get('startup_wait_s'))} in all" if steps - steady > 1 else ""))
        if steady:
            lines.append(
                f"then training waited for data {stats['data_wait_s']:.2f} s ({share:.0%} of its time) "
                f"over {steady} steps: per step p50 {_ms(stats['step_wait_p50_s'])}, p95 "
                f"{_ms(stats['step_wait_p95_s'])}, p99 {_ms(stats['step_wait_p99_s'])}; "
                f"{_ms(stats.get('end_wait_s'))} at the end")
    parts = {"waiting for fetches": stats.get("consumer_wait_s", 0.0),
             "in transform": stats.get("transform_s", 0.0),
             "handing samples over": stats.get("handoff_s", 0.0)}
    busy = sum(parts.values())
    if busy:
        shares = ", ".join(f"{name} {value:.2f} s ({value / busy:.0%})" for name, value in parts.items())
        startup = stats.get("startup_s")
        first = f" (start-up to the first sample {startup:.2f} s, apart)" if startup else ""
        lines.append(f"loader processes, summed, after their first sample{first}: {shares}")
    requests = stats.get("requests", 0)
    if requests:
        lines.append(f"{requests:,} requests, {stats.get('get_s', 0.0):.2f} s in them (summed, they overlap), "
                     f"latency p50 {_ms(stats.get('latency_p50_s'))}, p99 {_ms(stats.get('latency_p99_s'))}"
                     + (f", at most {stats['peak_inflight']} in flight" if stats.get("peak_inflight") else ""))
    throttled, hedged = stats.get("throttled", 0), stats.get("hedged", 0)
    if requests and throttled:
        lines.append(f"S3 throttled this job: {throttled / requests:.0%} of requests ({throttled:,}) were "
                     "answered SlowDown and the loader held its request rate under the prefix's limit; "
                     "on S3 a prefix answers ~5,500 GET/s: spread keys over more prefixes, keep fewer "
                     "requests in flight (Limits(concurrency=)), or read shards instead of objects "
                     "(from_shards: one GET for thousands of samples)")
    if requests and hedged:
        lines.append(f"{hedged:,} straggling requests ({hedged / requests:.1%}) were sent again; "
                     f"the second answer came first {stats.get('hedges_won', 0):,} times")
    lines.append("advice: " + _advice(stats, parts, inflight_limit))
    return "\n".join(lines)


WAIT_WORTH_FIXING = 0.05  # below this share of its time waiting, data loading keeps up


def _advice(stats: dict[str, Any], parts: dict[str, float], inflight_limit: int | None) -> str:
    share = stats.get("data_wait_fraction")
    if share is None:
        if stats.get("steps"):
            return ("these steps were all start-up (a first batch from each worker): time an epoch "
                    "of more steps to see whether loading keeps up")
        return ("iterate `for batch in ds.timed(loader):` to measure how long training waits for "
                "data; until then, the split above says where the loader's own time goes")
    if share < WAIT_WORTH_FIXING:
        return f"data loading keeps up: training waits for it only {share:.0%} of its time"
    worst = max(parts, key=lambda name: parts[name])
    if worst == "in transform":
        return ("the transform is the limit: add DataLoader workers (each runs its own), or make it "
                "cheaper (decode_image(size=) decodes at a reduced scale)")
    if worst == "handing samples over":
        return ("handing samples to the main process is the limit: hand over less (raw bytes "
                "instead of large tensors, decode on the GPU with decode_images), or fewer, larger "
                "pieces per batch")
    peak = stats.get("peak_inflight") or 0
    if inflight_limit is not None and peak >= inflight_limit:
        return (f"fetching is the limit with all {inflight_limit} requests in flight: raise "
                "Limits(concurrency=), or pack small objects into shards (`loader shard`)")
    return ("fetching is the limit though requests are free to fly: the client's CPU per request is "
            "(add DataLoader workers, use store='obstore', or pack small objects into shards)")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"
