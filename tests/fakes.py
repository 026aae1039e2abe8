"""The unit tests' in-memory store: ``loader.testing.MemoryStore`` (latency, faults, counters: see
``loader/s3/memory_store.py``), under the name the tests know it by, and two helpers."""

from __future__ import annotations

import hashlib

from loader.testing import MemoryStore as FakeStore
from loader.testing import MultipartUpload

__all__ = ["FakeStore", "MultipartUpload", "payloads", "reusable"]


class SharedFake:
    """A picklable async store factory (``reusable`` is a closure): hands out its ``FakeStore``.

    After pickling into a spawned worker it hands out that worker's copy of the store.
    """

    def __init__(self, fake: FakeStore) -> None:
        self.fake = fake

    async def __call__(self) -> FakeStore:
        self.fake.closed = False
        return self.fake


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
