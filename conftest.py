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
