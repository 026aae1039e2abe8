"""Shared fixtures for unit tests (helpers live in ``fakes.py``, importable by name)."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def no_leaked_threads():
    """Fail a test that leaves a thread of ours running after it returns."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in leaked:
        thread.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"
