"""The one place with concurrency: an event loop in a background thread keeps many GETs in flight.

``fetch.FetchEngine`` runs jobs under a concurrency limit and hands results over through a buffer
bounded by bytes and items; ``loopthread.LoopThread`` owns the loop thread and survives ``fork``.
"""

from .fetch import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_ITEMS,
    Delivery,
    EngineLimits,
    EngineStats,
    FetchEngine,
    Job,
    JobContext,
    JobFn,
    Tuning,
)

__all__ = [
    "DEFAULT_MAX_INFLIGHT", "DEFAULT_QUEUE_BYTES", "DEFAULT_QUEUE_ITEMS", "Delivery", "EngineLimits",
    "EngineStats", "FetchEngine", "Job", "JobContext", "JobFn", "Tuning",
]
