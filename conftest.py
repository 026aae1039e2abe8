"""Fixtures shared by ``tests/`` and ``integration/``."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the test.

    A process started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python then installs no handler of its own: a test that sends itself SIGINT would see
    nothing happen. This puts Python's default handler in place and restores what was there.
    """
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread of ours running after it returns."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in leaked:
        thread.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"
