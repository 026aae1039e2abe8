"""When and how long to retry a failed request.

Which faults are transient is decided once, by type: the store backends translate their
library's errors into ``TransientStoreError`` (5xx, SlowDown, RequestTimeout, resets, timeouts,
bodies shorter than their Content-Length) or a permanent ``StoreError`` (403, 404, bad range).
Everything here is pure except ``call_with_retries``, which only sleeps.

Backoff is exponential with *full jitter* (a uniform draw in ``[0, min(cap, base * 2**n))``),
which spreads a thundering herd of DataLoader workers best; see the AWS architecture blog post
"Exponential Backoff And Jitter".
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio

from .errors import ConfigError, TransientStoreError

T = TypeVar("T")

DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_BASE_DELAY = 0.05
DEFAULT_MAX_DELAY = 5.0
DEFAULT_DEADLINE = 120.0
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Limits for retrying one request.

    ``max_attempts`` counts the first try; ``deadline`` bounds all attempts of one request
    together (seconds from the first try); ``read_timeout`` is how long a response may send no
    bytes before it counts as stalled and is retried; ``connect_timeout`` bounds opening a
    connection.
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    base_delay: float = DEFAULT_BASE_DELAY
    max_delay: float = DEFAULT_MAX_DELAY
    deadline: float = DEFAULT_DEADLINE
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts={self.max_attempts!r} must be at least 1")
        for name in ("base_delay", "max_delay"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ConfigError(f"RetryPolicy.{name}={getattr(self, name)!r} must not be negative")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:  # also rejects NaN
                raise ConfigError(f"RetryPolicy.{name}={getattr(self, name)!r} must be positive")


class Clock(Protocol):
    """Where retrying reads the time and waits: the system clock, or a test's that moves when told."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """``time.monotonic`` and ``anyio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


def backoff_delay(attempt: int, policy: RetryPolicy, rng: random.Random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (0-based), full jitter."""
    cap = min(policy.max_delay, policy.base_delay * (2 ** min(attempt, 62)))
    return rng.uniform(0.0, cap)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another attempt."""
    return isinstance(exc, TransientStoreError)


async def call_with_retries(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
    rng: random.Random | None = None,
    progressed: Callable[[], bool] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> T:
    """Run ``attempt()`` until it succeeds, a permanent error occurs, or the limits are spent.

    The last transient error is re-raised with the number of attempts and seconds spent added
    to its message, so a user sees that retrying happened and gave up.

    ``progressed``, when given, is asked after each failure whether that attempt got somewhere
    (a long listing received pages before its connection broke, and the next attempt resumes
    after them): then the attempt count and the deadline start again from now, so that only
    attempts that make no progress are limited, and a long operation is never cut for having
    taken longer than the deadline in total.

    Without ``rng``, a fresh ``random.Random()`` (seeded from ``os.urandom``, so every process,
    worker and call jitters independently) is made at the first retry only: seeding it costs
    more than a whole successful request's Python work, and almost every call succeeds first.
    ``clock`` reads the time for the deadline and does the backoff sleeps.
    """
    started = clock.monotonic()
    n = 0  # failed attempts since the start or the last progress
    while True:
        try:
            return await attempt()
        except TransientStoreError as exc:
            if progressed is not None and progressed():
                started, n = clock.monotonic(), 0
            if rng is None:
                rng = random.Random()
            elapsed = clock.monotonic() - started
            delay = backoff_delay(n, policy, rng)
            if n + 1 >= policy.max_attempts or elapsed + delay >= policy.deadline:
                raise type(exc)(
                    f"{exc} (gave up after {n + 1} attempt(s) over {elapsed:.1f}s; "
                    "see RetryPolicy to allow more)",
                    bucket=exc.bucket,
                    key=exc.key,
                ) from exc
            if on_retry is not None:
                on_retry(exc)
            n += 1
            await clock.sleep(delay)
