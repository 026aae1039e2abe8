"""When and how long to retry a failed request.

Transient or permanent is decided once, by type (the backends translate errors into
``TransientStoreError`` or a permanent ``StoreError``). Backoff is exponential with full jitter,
which spreads a herd of DataLoader workers best; by default only the deadline ends the retries,
so a request rides out a short outage and says so in a warning; but an endpoint that has never
answered (``answered``) is given up within seconds, since a wrong endpoint is then likelier
than an outage. Pure except
``call_with_retries``, which sleeps through an injectable ``Clock``. Why: docs/design/retry.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

import anyio

from .errors import BadAnswerError, ConfigError, EndpointUnreachableError, TransientStoreError

T = TypeVar("T")

DEFAULT_MAX_ATTEMPTS: int | None = None  # no count: the deadline bounds the retries
DEFAULT_BASE_DELAY = 0.05
DEFAULT_MAX_DELAY = 5.0
DEFAULT_DEADLINE = 120.0
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 30.0
BAD_ANSWER_ATTEMPTS = 3  # a server that answered, but not what was asked: a few tries, not the deadline
PROGRESS_AFTER = 3.0  # a request failing for this long is reported in a warning line ...
PROGRESS_EVERY = 5.0  # ... and the process reports at most once per this many seconds

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Limits for retrying one request.

    ``deadline`` bounds all attempts of one request together (seconds from the first try);
    ``max_attempts`` (counting the first try) stops earlier, after that many; None: only the
    deadline. ``read_timeout`` is how long a response may send no bytes before it counts as
    stalled and is retried; ``connect_timeout`` bounds opening a connection.
    """

    max_attempts: int | None = DEFAULT_MAX_ATTEMPTS
    base_delay: float = DEFAULT_BASE_DELAY
    max_delay: float = DEFAULT_MAX_DELAY
    deadline: float = DEFAULT_DEADLINE
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1):
            raise ConfigError(f"RetryPolicy.max_attempts={attempts!r} must be at least 1 (or None: "
                              "only the deadline limits the retries)")
        for name in ("base_delay", "max_delay"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ConfigError(f"RetryPolicy.{name}={getattr(self, name)!r} must not be negative")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:  # also rejects NaN
                raise ConfigError(f"RetryPolicy.{name}={getattr(self, name)!r} must be positive")


# ------------------------------------------------------------------------------ first contact
# A request that cannot connect means one of two things: the endpoint is wrong (a typo in
# AWS_ENDPOINT_URL, a server never started), or a server that worked is down for a while (a
# restart, a failover). Only the first contact tells them apart: while nothing at an endpoint has
# ever answered (any HTTP answer, an error status included: the backends call ``answered``), the
# retries give up within FIRST_CONTACT_DEADLINE seconds with advice on the endpoint; once it has
# answered, an outage is ridden out up to RetryPolicy.deadline. Plain process state (a set under
# a lock: each engine runs in its own thread); a forked child inherits it, and a dataset pickled
# into a spawned worker carries its endpoint's (``StoreSpec``), so a worker does not take a
# running server for a typo.

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


# Where messages send a user who wants a longer deadline: ``RetryPolicy(deadline=...)``, or, while
# a command-line tool runs (``advising``), its option, since a shell user cannot set the former.
_deadline_option: str | None = None


@contextlib.contextmanager
def advising(option: str) -> Iterator[None]:
    """Within: messages that advise a longer deadline name ``option`` (a command line's, e.g.
    ``--retry-deadline``) rather than ``RetryPolicy(deadline=...)``."""
    global _deadline_option
    before, _deadline_option = _deadline_option, option
    try:
        yield
    finally:
        _deadline_option = before


def _raise_deadline() -> str:
    return f"raise it with {_deadline_option}" if _deadline_option else "raise RetryPolicy(deadline=...)"


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


def next_delay(policy: RetryPolicy, failures: int, elapsed: float, rng: random.Random) -> float | None:
    """Seconds to wait after the ``failures``-th failure in a row (1-based), ``elapsed`` seconds
    into the retries, before the next attempt; None when the policy gives up instead."""
    if policy.max_attempts is not None and failures >= policy.max_attempts:
        return None
    delay = backoff_delay(failures - 1, policy, rng)
    return None if elapsed + delay >= policy.deadline else delay


def gave_up(exc: TransientStoreError, policy: RetryPolicy, failures: int, elapsed: float,
            what: str = "") -> TransientStoreError:
    """The final error: ``exc``'s type, bucket and key, and a message that says retrying is over,
    after how many attempts and how long, and which limit of the policy ended it."""
    if isinstance(exc, BadAnswerError) and failures >= BAD_ANSWER_ATTEMPTS:
        limit = ("a server that answers, but not what was asked, is not waited out: the answer "
                 "came back wrong each time")
    elif policy.max_attempts is not None and failures >= policy.max_attempts:
        limit = f"RetryPolicy(max_attempts={policy.max_attempts}) allows no more"
    else:
        limit = (f"its deadline of {policy.deadline:g} s would pass before another attempt: "
                 f"{_raise_deadline()} to wait out longer outages")
    where = f" on {what}" if what else ""
    # the endpoint that answered so (with several endpoints, or a proxy in front, the bucket and
    # key alone do not say which); an unreachable one names it already
    answerer = "" if isinstance(exc, EndpointUnreachableError) or not exc.endpoint else f" at {exc.endpoint}"
    message = f"{exc}{answerer}; gave up{where} after {failures} attempt(s) over {elapsed:.1f}s ({limit})"
    return type(exc)(message, bucket=exc.bucket, key=exc.key, endpoint=exc.endpoint)


def first_contact(exc: TransientStoreError, policy: RetryPolicy, failures: int, elapsed: float,
                  delay: float | None) -> bool:
    """Whether ``exc`` is a first contact that failed long enough: no connection to an endpoint
    that has never answered, for ``FIRST_CONTACT_DEADLINE`` seconds (or the policy's
    own deadline or attempts, when shorter) if the next wait were taken."""
    if not unanswered(exc):
        return False
    return delay is None or elapsed + delay >= min(FIRST_CONTACT_DEADLINE, policy.deadline)


def unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to connect to an endpoint that has never answered."""
    return isinstance(exc, EndpointUnreachableError) and bool(exc.endpoint) and not has_answered(exc.endpoint)


def wrong_endpoint(exc: EndpointUnreachableError, failures: int, elapsed: float,
                   what: str = "") -> EndpointUnreachableError:
    """The final error of a first contact that could not connect: names the endpoint, what was
    tried, and the fix (a wrong endpoint is far likelier than an outage of a server never seen)."""
    endpoint = exc.endpoint
    where = f" on {what}" if what else ""
    return EndpointUnreachableError(
        f"{exc}; gave up{where} after {failures} attempt(s) over {elapsed:.1f}s: nothing at "
        f"{endpoint} has answered since this process started, so this is most likely a wrong "
        "endpoint, not an outage. Fix AWS_ENDPOINT_URL (or S3_ENDPOINT_URL, MINIO_ENDPOINT, "
        "S3Config(endpoint_url=...)): its scheme (http or https), host and port, or start the "
        f"server there. (Once an endpoint has answered, outages are retried for up to "
        f"{_deadline_option or 'RetryPolicy.deadline'}.)",
        bucket=exc.bucket, key=exc.key, endpoint=endpoint,
    )


class _Throttle:
    """At most one progress line per ``PROGRESS_EVERY`` seconds in this process, whichever of
    the many requests in flight it comes from (an outage fails them all at once)."""

    last = -float("inf")

    @classmethod
    def ready(cls, now: float) -> bool:
        if now - cls.last < PROGRESS_EVERY:
            return False
        cls.last = now
        return True


class Retrying:
    """The retry state of one operation: failures in a row, since when, and the rng it jitters with.

    ``failed(exc)`` is called with each transient failure and returns how long to wait before the
    next attempt, or raises the final error (``gave_up``). The clock starts at ``started`` (the
    first attempt's ``clock.monotonic()``), or with None at the first failure (a stream that ran
    for minutes before breaking is not out of time); ``failed(exc, progressed=True)`` starts
    attempts and clock over at that failure, for operations that resume where they stopped.
    ``what`` names the operation in messages when the error alone does not. Without ``rng``, a fresh
    ``random.Random()`` is made at the first failure only (seeding one costs more than a whole
    successful request's Python work, and almost every call succeeds first).
    """

    def __init__(self, policy: RetryPolicy, *, started: float | None, rng: random.Random | None = None,
                 what: str = "", clock: Clock = SYSTEM_CLOCK) -> None:
        self.policy = policy
        self.clock = clock
        self.started = started
        self.rng = rng
        self.what = what
        self.failures = 0

    def failed(self, exc: TransientStoreError, *, progressed: bool = False) -> float:
        now = self.clock.monotonic()
        if progressed:
            self.failures, self.started = 0, None
        if self.started is None:
            self.started = now
        if self.rng is None:
            self.rng = random.Random()
        self.failures += 1
        elapsed = now - self.started
        delay = next_delay(self.policy, self.failures, elapsed, self.rng)
        if isinstance(exc, BadAnswerError) and self.failures >= BAD_ANSWER_ATTEMPTS:
            delay = None
        asked = getattr(exc, "retry_after", None)  # a throttle's Retry-After, within the policy
        if delay is not None and asked is not None:
            delay = min(max(delay, asked), self.policy.max_delay)
            if elapsed + delay >= self.policy.deadline:
                delay = None
        if first_contact(exc, self.policy, self.failures, elapsed, delay):
            assert isinstance(exc, EndpointUnreachableError)  # first_contact checked it
            raise wrong_endpoint(exc, self.failures, elapsed, self.what) from exc
        if delay is None:
            raise gave_up(exc, self.policy, self.failures, elapsed, self.what) from exc
        if elapsed >= PROGRESS_AFTER and not unanswered(exc) \
                and _Throttle.ready(now):  # (a first contact ends within seconds: nothing to report)
            limit = (f"{self.policy.max_attempts} attempts or " if self.policy.max_attempts else "")
            log.warning("still retrying%s after %.0f s of failures (attempt %d; gives up after %s%g s, "
                        "see %s): %s", f" {self.what}" if self.what else "", elapsed,
                        self.failures, limit, self.policy.deadline, _deadline_option or "RetryPolicy", exc)
        return delay


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
    to its message, so a user sees that retrying happened and is over (``gave_up``).

    ``progressed``, when given, is asked after each failure whether that attempt got somewhere
    (a long listing received pages before its connection broke, and the next attempt resumes
    after them): then the attempt count and the deadline start again from now, so that only
    attempts that make no progress are limited, and a long operation is never cut for having
    taken longer than the deadline in total.

    Without ``rng``, each call jitters with its own ``random.Random()`` (seeded from
    ``os.urandom``, so every process, worker and call jitters independently), see ``Retrying``.
    ``clock`` reads the time for the deadline and does the backoff sleeps.
    """
    state: Retrying | None = None  # made at the first failure: almost every call succeeds first
    started = clock.monotonic()
    while True:
        try:
            return await attempt()
        except TransientStoreError as exc:
            if state is None:
                state = Retrying(policy, started=started, rng=rng, clock=clock)
            delay = state.failed(exc, progressed=progressed is not None and progressed())
            if on_retry is not None:
                on_retry(exc)
            await clock.sleep(delay)
