"""Wait for a condition instead of sleeping and hoping: a test that checks an upper bound must
first see the situation it bounds (a full buffer, a paused engine), or it passes vacuously."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` until it is true; fail the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.005)


def wait_stable(read: Callable[[], T], what: str, quiet: float = 0.3, timeout: float = 20.0) -> T:
    """Poll ``read`` until its value has not changed for ``quiet`` seconds; return that value."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what} settles")
        time.sleep(0.005)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value
