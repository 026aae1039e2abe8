"""What an engine is told (``EngineLimits``: concurrency, buffer bounds, delivery order) and
what it reports (``EngineStats``, from the live ``Counts``); plain values, checked on construction."""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

from ..checks import check_int
from ..errors import ConfigError

DEFAULT_MAX_INFLIGHT = 64
DEFAULT_QUEUE_BYTES = 256 << 20
DEFAULT_QUEUE_ITEMS = 1024
TAKE_BATCH = 256  # items handed across the thread boundary per call: amortises the portal hop
Delivery = Literal["ordered", "interleave", "completed", "scheduled"]
DELIVERIES = ("ordered", "interleave", "completed", "scheduled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """How much the engine may fetch ahead, and in which order it delivers.

    ``delivery``: ``"ordered"`` gives every item of job 0, then of job 1, ...;
    ``"interleave"`` takes one item at a time from ``max_inflight`` jobs in turn (round robin
    over lanes; a finished job's lane takes the next job), deterministic like ``"ordered"``
    but mixing streams; ``"completed"`` gives items as they arrive (fastest, not repeatable);
    ``"scheduled"`` follows a schedule given to the engine: the job index of every item, in
    delivery order (jobs numbered in the order of their first entry), for exact interleaves.
    """

    max_inflight: int = DEFAULT_MAX_INFLIGHT
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_items: int = DEFAULT_QUEUE_ITEMS
    delivery: Delivery = "ordered"
    inflight_bytes: int | None = None  # bytes reserved by running jobs (docs/design/engine.md)

    def __post_init__(self) -> None:
        if self.delivery not in DELIVERIES:
            raise ConfigError(f"delivery={self.delivery!r} is not one of {DELIVERIES}")
        for name in ("max_inflight", "queue_bytes", "queue_items"):
            check_int(name, getattr(self, name), minimum=1, must="a positive integer")
        check_int("inflight_bytes", self.inflight_bytes, minimum=1, optional=True,
                  must="a positive integer or None")


class EngineStats(NamedTuple):
    """A snapshot of the engine's counters (read without locking, so approximately consistent)."""

    jobs_started: int
    jobs_done: int
    inflight: int
    peak_inflight: int
    buffered_items: int
    buffered_bytes: int
    peak_buffered_bytes: int
    delivered_items: int
    delivered_bytes: int
    retries: int
    consumer_wait_s: float
    peak_reserved_bytes: int = 0  # most of ``inflight_bytes`` reserved at once (0 without it)
    throttled: int = 0  # requests answered SlowDown/503/429 (s3/throttle.py)
    hedged: int = 0  # straggling requests sent a second time
    hedges_won: int = 0  # ... of which the second answered first


@dataclasses.dataclass(slots=True)
class Counts:
    """The core's counters; ``FetchEngine.statistics()`` reads them from another thread
    (plain ints: approximately consistent, which is all statistics need)."""

    launched: int = 0
    jobs_done: int = 0
    inflight: int = 0
    peak_inflight: int = 0
    buffered_items: int = 0
    buffered_bytes: int = 0
    peak_buffered_bytes: int = 0
    delivered_items: int = 0
    delivered_bytes: int = 0
    retries: int = 0
    peak_reserved_bytes: int = 0
