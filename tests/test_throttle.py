"""``ThrottleControl``'s rules on a simulated clock: a throttle is met near its rate, SlowDowns at
random or in a stalled moment cut nothing."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from loader.engine.throttle import MIN_RATE, ThrottleControl

# ------------------------------------------------------------------ the throttle rules, on a clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def simulate(control: ThrottleControl, clock: Clock, seconds: float, demand: float,
             server: Callable[[float], bool]) -> tuple[int, int]:
    """A client that would send ``demand`` requests/s, each waiting its turn under the control's
    limit; ``server(now)`` says whether a request sent at ``now`` is answered SlowDown. Returns
    (good answers, SlowDowns); every SlowDown is sent again like any request."""
    good = slow = 0
    end = clock.now + seconds
    step = 1.0 / demand
    while clock.now < end:
        wait, _ = control.turn()
        clock.now += max(wait, step)
        if server(clock.now):
            slow += 1
            control.on_throttled()
        else:
            good += 1
            control.on_answer()
    return good, slow


def throttle(rate: float, burst: float = 0.5) -> Callable[[float], bool]:
    """A server that answers ``rate`` requests/s (a token bucket holding ``burst`` seconds' worth)."""
    bucket = {"tokens": rate * burst, "at": None}

    def slow_down(now: float) -> bool:
        if bucket["at"] is not None:
            bucket["tokens"] = min(rate * burst, bucket["tokens"] + (now - bucket["at"]) * rate)
        bucket["at"] = now
        if bucket["tokens"] >= 1:
            bucket["tokens"] -= 1
            return False
        return True

    return slow_down


def test_a_throttle_is_met_near_its_rate_with_few_slowdowns():
    clock = Clock()
    control = ThrottleControl(clock)
    good, slow = simulate(control, clock, 30.0, demand=1000.0, server=throttle(300.0))
    assert control.rate is not None
    assert good / 30.0 >= 0.75 * 300, good / 30.0  # most of what the server allows ...
    assert slow <= 0.10 * (good + slow), (good, slow)  # ... with few SlowDowns
    assert control.congested()  # and no hedge while limited


def test_slowdowns_sprinkled_at_random_leave_the_rate_alone():
    """5 % of answers SlowDown whatever the rate (a server's hiccups): sending less would not spare
    them, so no limit is set and nothing slows down."""
    clock = Clock()
    control = ThrottleControl(clock)
    hiccups = random.Random(1)
    good, slow = simulate(control, clock, 60.0, demand=300.0, server=lambda _: hiccups.random() < 0.05)
    assert control.rate is None and slow > 500
    assert good / 60.0 >= 0.9 * 300 * 0.95


def test_a_stalled_moment_of_retries_does_not_cut_the_rate():
    """While everything waits on a stalled request, the few answers are mostly SlowDown retries:
    too few to be a throttle."""
    clock = Clock()
    control = ThrottleControl(clock)
    for _ in range(50):  # the job ran well ...
        control.turn()
        clock.now += 0.01
        control.on_answer()
    clock.now += 2.0  # ... until a request stalled
    for _ in range(6):
        control.turn()
        clock.now += 0.1
        control.on_throttled()
    assert control.rate is None


def test_an_unused_limit_does_not_grow():
    clock = Clock()
    control = ThrottleControl(clock)
    simulate(control, clock, 2.0, demand=1000.0, server=throttle(100.0))
    limit = control.rate
    assert limit is not None
    clock.now += 5.0  # idle
    for _ in range(50):  # answers to requests sent well below the limit
        control.on_answer()
    assert control.rate == limit


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.booleans()), max_size=300))
def test_the_limit_never_falls_below_its_floor(events):
    clock = Clock()
    control = ThrottleControl(clock)
    for gap, throttled in events:
        control.turn()
        clock.now += gap
        control.on_throttled() if throttled else control.on_answer()
        assert control.rate is None or control.rate >= MIN_RATE


def test_a_storm_at_the_start_is_met_within_a_few_slowdowns():
    """A job's first requests all go out at once and most come back SlowDown: the limit comes
    after a handful, not after the share rule's count (its in-flight requests would all meet it)."""
    clock = Clock()
    control = ThrottleControl(clock)
    for _ in range(64):
        control.turn()
    clock.now += 0.05
    for _ in range(4):
        control.on_throttled()
    assert control.rate is not None and control.rate <= 0.7 * 64 + 1e-9
    assert control.congested()
