"""What the proxy does to requests: the plan (probabilities and seed) and the decisions drawn
from it. Pure: no I/O.

Decisions come from one ``random.Random(plan.seed)`` in the order requests arrive: exactly two
draws per request (which fault, and where in the body to cut) whatever its method, so the same
seed and the same sequence of requests give the same sequence of decisions.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable

FAULT_KINDS = ("reset", "slowdown", "truncate", "stall")
DEFAULT_STALL_SECONDS = 30.0
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

    def __post_init__(self) -> None:
        for name in ("latency", "stall_seconds"):
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


class FaultDecider:
    """The seeded sequence of decisions for one plan: exactly two draws per request, any method.

    Not thread-safe on its own; ``FaultProxy`` calls it from its event loop only.
    """

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)

    def decide(self, method: str, target: str) -> Decision:
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
        return Decision(None, fraction)
