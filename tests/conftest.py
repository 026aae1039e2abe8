"""Shared helpers for unit tests: an in-memory store wired into engines and datasets."""

from __future__ import annotations

import hashlib
import threading

import pytest

from fakes import FakeStore


def reusable(fake: FakeStore):
    """An async store factory that hands out ``fake`` to every engine (re-opened each time)."""

    async def open_store() -> FakeStore:
        fake.closed = False
        return fake

    return open_store


def payloads(n: int, size: int = 100, prefix: str = "train/") -> dict[str, bytes]:
    """``n`` objects ``prefix000000.bin`` ... with distinct contents of ``size`` bytes."""
    return {
        f"{prefix}{i:06d}.bin": (hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1))[:size]
        for i in range(n)
    }


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
