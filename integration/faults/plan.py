"""What the proxy does to requests: the plan (probabilities and seed) and the decisions drawn
from it. Pure: no I/O.

Decisions come from one ``random.Random(plan.seed)`` in the order requests arrive: exactly two
draws per request (which fault, and where in the body to cut) whatever its method, so the same
seed and the same sequence of requests give the same sequence of decisions. Stragglers draw from
a second generator (so adding them changes no other decision), and the throttle (``get_rate``)
reads the time each request arrives, given to ``decide``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Iterable

FAULT_KINDS = ("reset", "slowdown", "truncate", "stall")
DEFAULT_STALL_SECONDS = 30.0
DEFAULT_STRAGGLE_SECONDS = 2.0
THROTTLE_BURST = 0.5  # seconds of get_rate the throttle's bucket holds (S3 too lets a short burst through)
THROTTLE_SHAPES = ("bucket", "window")
RISE_IDLE = 1.0  # seconds without an eligible request that end "sustained load" (the rise's clock restarts)
DEFAULT_ONLY_METHODS = ("GET",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """What to do to requests: probabilities per request, and the seed that makes them repeat.

    ``latency`` is not a probability: every request waits that many seconds before it is forwarded.
    ``reset``, ``slowdown``, ``truncate`` and ``stall`` are probabilities in [0, 1] that together
    may not exceed 1; each request gets at most one of them. They apply only to requests whose
    method is in ``only_methods`` (``GET`` by default, so uploads stay reliable; ``None`` means
    every method) and, with ``objects_only`` (the default), only to requests for an object
    (``/bucket/key``, path-style addressing), so listings and other bucket requests stay reliable
    too. ``stall_seconds`` is how long a stalled response stays
    silent before the proxy closes it: make it longer than the client's read timeout.

    Two conditions of real S3 that are not faults of one request: ``straggle`` is the probability
    that an eligible request is answered ``straggle_seconds`` late (a straggler: the answer itself
    is intact); ``get_rate`` throttles like S3 does per prefix: eligible requests beyond that many
    per second (a token bucket holding ``THROTTLE_BURST`` seconds' worth) are answered
    ``503 SlowDown`` without asking the upstream. ``throttle`` is the limit's shape: ``"bucket"``
    (that token bucket) or ``"window"`` (at most ``get_rate`` answered in any one second: a burst
    leaves the rest of its second answered SlowDown). ``get_rate_rises_after`` (seconds): the limit
    doubles once eligible requests have come that long without a pause of ``RISE_IDLE`` (S3
    repartitions a prefix under sustained load). ``slowdown_close`` (default True, as S3 does):
    every ``503 SlowDown`` carries ``Connection: close`` and a chunked body, and the connection
    is closed after it, so each costs the client a new connection. ``bandwidth`` (bytes/s, every answer) paces each
    answer's body: S3 serves one connection at about 85-90 MB/s (AWS's performance guidelines:
    one concurrent request per 85-90 MB/s wanted), where loopback has no such bound, so it shows
    what parallel requests buy.
    """

    latency: float = 0.0
    reset: float = 0.0
    slowdown: float = 0.0
    truncate: float = 0.0
    stall: float = 0.0
    stall_seconds: float = DEFAULT_STALL_SECONDS
    seed: int = 0
    only_methods: tuple[str, ...] | None = DEFAULT_ONLY_METHODS
    objects_only: bool = True
    straggle: float = 0.0
    straggle_seconds: float = DEFAULT_STRAGGLE_SECONDS
    get_rate: float | None = None
    throttle: str = "bucket"
    get_rate_rises_after: float | None = None
    slowdown_close: bool = True
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not is_real(self.straggle) or not 0.0 <= self.straggle <= 1.0:
            raise ValueError(f"FaultPlan straggle={self.straggle!r} must be a probability between 0 and 1")
        if self.get_rate is not None and (not is_real(self.get_rate) or not self.get_rate > 0
                                          or not math.isfinite(self.get_rate)):
            raise ValueError(f"FaultPlan get_rate={self.get_rate!r} must be a positive number of requests/s")
        if self.throttle not in THROTTLE_SHAPES:
            raise ValueError(f"FaultPlan throttle={self.throttle!r} must be one of {THROTTLE_SHAPES}")
        if self.get_rate_rises_after is not None and (
                not is_real(self.get_rate_rises_after) or not self.get_rate_rises_after > 0
                or not math.isfinite(self.get_rate_rises_after)):
            raise ValueError(f"FaultPlan get_rate_rises_after={self.get_rate_rises_after!r} must be a "
                             "positive number of seconds")
        if not isinstance(self.slowdown_close, bool):
            raise ValueError(f"FaultPlan slowdown_close={self.slowdown_close!r} must be True or False")
        if self.bandwidth is not None and (not is_real(self.bandwidth) or not self.bandwidth > 0
                                           or not math.isfinite(self.bandwidth)):
            raise ValueError(f"FaultPlan bandwidth={self.bandwidth!r} must be a positive number of bytes/s")
        for name in ("latency", "stall_seconds", "straggle_seconds"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"FaultPlan {name}={value!r} must be a finite number of seconds >= 0")
        for name in FAULT_KINDS:
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultPlan {name}={value!r} must be a probability between 0 and 1")
        total = self.fault_probability
        if total > 1.0 + 1e-9:
            raise ValueError(
                f"FaultPlan fault probabilities add up to {total!r} "
                f"(reset+slowdown+truncate+stall); they may not exceed 1"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"FaultPlan seed={self.seed!r} must be an int")
        if not isinstance(self.objects_only, bool):
            raise ValueError(f"FaultPlan objects_only={self.objects_only!r} must be True or False")
        object.__setattr__(self, "only_methods", _methods(self.only_methods))

    @property
    def fault_probability(self) -> float:
        """Chance that an eligible request gets some fault (latency aside)."""
        return sum(getattr(self, name) for name in FAULT_KINDS)

    def applies_to(self, method: str, target: str = "/bucket/key") -> bool:
        """Whether faults other than latency may hit a request with this method and request-target."""
        if self.only_methods is not None and method.upper() not in self.only_methods:
            return False
        return not self.objects_only or _names_object(target)


def _names_object(target: str) -> bool:
    """Whether a path-style request-target names an object: ``/bucket/key``, not ``/bucket?list``."""
    if not target.startswith("/"):
        target = "/" + target.split("://", 1)[-1].partition("/")[2]  # absolute-form
    path = target.split("?", 1)[0]
    bucket, slash, key = path[1:].partition("/")
    return bool(bucket and slash and key)


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _methods(value: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):  # only_methods="PUT" means ("PUT",), not ("P", "U", "T")
        value = (value,)
    methods = tuple(value)
    for method in methods:
        if not isinstance(method, str) or not method or not method.isalpha():
            raise ValueError(f"FaultPlan only_methods has {method!r}; give HTTP method names like 'GET'")
    return tuple(method.upper() for method in methods)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The fate of one request: ``kind`` is one of ``FAULT_KINDS`` or ``None`` (forward intact);
    ``fraction`` in [0, 1) says where in the body a ``truncate`` or ``stall`` cuts."""

    kind: str | None
    fraction: float
    straggle: bool = False  # answer ``straggle_seconds`` late (with kind None: intact)
    throttled: bool = False  # a ``slowdown`` that the throttle (``get_rate``) decided


class FaultDecider:
    """The seeded sequence of decisions for one plan: exactly two draws per request, any method.

    Not thread-safe on its own; ``FaultProxy`` calls it from its event loop only.
    """

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._straggle_rng = random.Random(plan.seed + 1)
        self._tokens = 0.0 if plan.get_rate is None else plan.get_rate * THROTTLE_BURST
        self._refilled: float | None = None
        self._answered: collections.deque[float] = collections.deque()  # the window's answered requests
        self._load_since: float | None = None  # when the current stretch of sustained load began
        self._last_seen: float | None = None
        # for benchmarks: requests the throttle let through in each second since its first, and
        # when (seconds after its first) the limit doubled
        self.first_at: float | None = None
        self.rose_after: float | None = None
        self.passed_per_second: collections.Counter[int] = collections.Counter()

    def decide(self, method: str, target: str, now: float = 0.0) -> Decision:
        """The fate of the next request, which arrived at ``now`` (seconds, any clock; only
        the throttle reads it)."""
        draw = self._rng.random()
        fraction = self._rng.random()
        if not self.plan.applies_to(method, target):
            return Decision(None, fraction)
        edge = 0.0
        for kind in FAULT_KINDS:
            probability = getattr(self.plan, kind)
            if probability and draw < edge + probability:
                return Decision(kind, fraction)
            edge += probability
        if self.plan.get_rate is not None and not self._take_token(now):
            return Decision("slowdown", fraction, throttled=True)
        straggle = bool(self.plan.straggle) and self._straggle_rng.random() < self.plan.straggle
        return Decision(None, fraction, straggle=straggle)

    def rate_at(self, now: float) -> float | None:
        """The limit in force for a request arriving at ``now`` (doubled after sustained load)."""
        rate, rise = self.plan.get_rate, self.plan.get_rate_rises_after
        if rate is None or rise is None:
            return rate
        if self._last_seen is None or now - self._last_seen > RISE_IDLE:
            self._load_since = now
        self._last_seen = now
        assert self._load_since is not None
        if now - self._load_since < rise:
            return rate
        if self.rose_after is None and self.first_at is not None:
            self.rose_after = now - self.first_at
        return 2 * rate

    def _take_token(self, now: float) -> bool:
        if self.first_at is None:
            self.first_at = now
        if self._passes(now):
            self.passed_per_second[int(now - self.first_at)] += 1
            return True
        return False

    def _passes(self, now: float) -> bool:
        rate = self.rate_at(now)
        assert rate is not None
        if self.plan.throttle == "window":
            answered = self._answered
            while answered and answered[0] <= now - 1.0:
                answered.popleft()
            if len(answered) >= rate:
                return False
            answered.append(now)
            return True
        if self._refilled is not None:
            self._tokens = min(rate * THROTTLE_BURST, self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
