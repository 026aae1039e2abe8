"""Which endpoints have answered this process (or the process that built its dataset).

A request that cannot connect means one of two things: the endpoint is wrong (a typo in
``AWS_ENDPOINT_URL``, a server never started), or a server that worked is down for a while (a
restart, a failover). Only the first contact tells them apart: while nothing at an endpoint has
ever answered, ``loader.retry`` gives up within ``FIRST_CONTACT_DEADLINE`` seconds with advice on
the endpoint; once it has answered (any HTTP answer, an error status included), an outage is
ridden out up to ``RetryPolicy.deadline``. Why: docs/retry.md.

Plain module state (a set guarded by a lock: the engines of a process run in their own threads);
a forked child inherits it, and a dataset pickled into a spawned worker carries what its
endpoint's state was (``StoreSpec``), so a worker does not take a running server for a typo.
"""

from __future__ import annotations

import threading

FIRST_CONTACT_DEADLINE = 5.0  # seconds of failed connects before a never-answered endpoint is called wrong

_answered: set[str] = set()
_lock = threading.Lock()


def answered(endpoint: str | None) -> None:
    """Record that ``endpoint`` answered a request (cheap when already known: a set lookup)."""
    if endpoint and endpoint not in _answered:
        with _lock:
            _answered.add(endpoint)


def has_answered(endpoint: str | None) -> bool:
    """Whether ``endpoint`` ever answered in this process (or its dataset's parent)."""
    return bool(endpoint) and endpoint in _answered


def forget() -> None:
    """Forget every endpoint (for tests that play a fresh process)."""
    with _lock:
        _answered.clear()
