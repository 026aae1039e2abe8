"""An in-memory ``ObjectStore`` for unit tests: no server, injectable latency and faults, counters.

``FakeStore`` implements exactly the protocol in ``loader/stores/base.py`` and behaves like a
well-behaved backend (our error tree, half-open ranges, key-ordered paged listings, a
``TransientStoreError`` when a streamed body is cut short), so tests of the engine, retries and
datasets can assert on what the store *saw*:

* ``requests`` / ``requests_by_key``: read requests (``get``, ``get_range``, ``stream``), counted
  when they start, failed ones included; ``list_requests`` (one per page) and ``puts`` apart;
* ``inflight`` / ``peak_inflight``: read requests in progress, a stream until it is exhausted or
  closed, kept with ``try/finally`` so cancellation and early ``aclose()`` count right;
* ``gets_started``: ``(time.monotonic(), key)`` for each read request, in start order.

Faults and pacing:

* ``latency``: seconds (or ``callable(key) -> seconds``) slept before each response, the time to
  first byte; list pages call it with the prefix;
* ``fail``: ``{key: exception}`` raises a copy of it on *every* request for ``key`` (a permanent
  fault, e.g. 403); ``{key: [exc1, exc2]}`` raises them on successive requests, one per attempt,
  then lets requests through (a transient fault); ``list_fail`` does the same by prefix for ``list``;
* ``truncate``: ``{key: n}`` cuts every ``stream`` of ``key`` after ``n`` bytes *of that stream*
  and raises ``TransientStoreError``, so a retry resuming at its offset makes progress; a list
  applies per attempt (``None`` for an attempt that is not cut);
* ``gate``: set it to an unset ``anyio.Event`` and every request waits on it after being counted,
  which holds requests in flight so a test can count how many were issued.

Nothing loop-bound is created in ``__init__`` and the counters are plain ints, so one instance
may be used by several event loops (engines) in turn, and read from the test's own thread.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel

from loader.errors import InvalidRangeError, NoSuchBucketError, NoSuchKeyError, TransientStoreError
from loader.stores.base import DEFAULT_CHUNK_SIZE, ObjectInfo

Latency = float | Callable[[str], float]
Fault = BaseException | list[BaseException]
DEFAULT_PAGE_SIZE = 1000


class FakeStore:
    """In-memory ``ObjectStore``; see the module docstring for latency, faults and counters."""

    def __init__(
        self,
        objects: Mapping[tuple[str, str], bytes] | None = None,
        *,
        buckets: Iterable[str] = (),
        latency: Latency = 0.0,
        fail: Mapping[str, Fault] | None = None,
        list_fail: Mapping[str, Fault] | None = None,
        truncate: Mapping[str, int | list[int | None]] | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        gate: anyio.Event | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be >= 1")
        self.objects: dict[tuple[str, str], bytes] = dict(objects or {})
        self.buckets: set[str] = set(buckets) | {bucket for bucket, _ in self.objects}
        self.latency = latency
        self.fail: dict[str, Fault] = _copy_faults(fail)
        self.list_fail: dict[str, Fault] = _copy_faults(list_fail)
        self.truncate: dict[str, int | list[int | None]] = _copy_faults(truncate)
        self.page_size = page_size
        self.gate = gate
        self.closed = False
        self.requests = 0
        self.requests_by_key: Counter[str] = Counter()
        self.list_requests = 0
        self.puts = 0
        self.inflight = 0
        self.peak_inflight = 0
        self.gets_started: list[tuple[float, str]] = []

    @classmethod
    def with_objects(cls, bucket: str, objects: Mapping[str, bytes], **options) -> FakeStore:
        """A store holding ``objects`` (key -> bytes) in one ``bucket``."""
        return cls({(bucket, key): data for key, data in objects.items()}, buckets=[bucket], **options)

    def reset_counters(self) -> None:
        """Zero the counters (``inflight`` stays: those requests are still running)."""
        self.requests = self.list_requests = self.puts = 0
        self.peak_inflight = self.inflight
        self.requests_by_key.clear()
        self.gets_started.clear()

    # ------------------------------------------------------------------------- the protocol

    async def list(self, bucket: str, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        after: str | None = None
        while True:
            self._check_open()
            self.list_requests += 1
            await self._respond(prefix, self.list_fail)
            self._check_bucket(bucket)
            page, truncated = self._page(bucket, prefix, after)
            for info in page:
                yield info
            if not truncated:
                return
            after = page[-1].key

    async def get(self, bucket: str, key: str) -> bytes:
        async with self._read(key):
            return self._lookup(bucket, key)

    async def get_range(self, bucket: str, key: str, start: int, end: int | None) -> bytes:
        async with self._read(key):
            data = self._lookup(bucket, key)
            _check_range(bucket, key, start, end, len(data))
            return data[start:end]

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be >= 1")
        async with self._read(key):
            data = self._lookup(bucket, key)
            _check_range(bucket, key, start, None, len(data))
            cut = self._take(self.truncate, key)
            stop = len(data) if cut is None else min(len(data), start + cut)
            for offset in range(start, stop, chunk_size):
                await anyio.lowlevel.checkpoint()
                yield data[offset : min(offset + chunk_size, stop)]
            if stop < len(data):
                raise TransientStoreError(
                    f"body of {key!r} in bucket {bucket!r} ended after {stop - start} of "
                    f"{len(data) - start} bytes (from offset {start})",
                    bucket=bucket,
                    key=key,
                )

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        self._check_open()
        self.puts += 1
        await self._respond(key, self.fail)
        self._check_bucket(bucket)
        self.objects[bucket, key] = bytes(data)

    async def aclose(self) -> None:
        self.closed = True

    # ------------------------------------------------------------------------- helpers

    @asynccontextmanager
    async def _read(self, key: str):
        """Count one read request and hold it in flight until the body is done."""
        self._check_open()
        self.requests += 1
        self.requests_by_key[key] += 1
        self.gets_started.append((time.monotonic(), key))
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            await self._respond(key, self.fail)
            yield
        finally:
            self.inflight -= 1

    async def _respond(self, name: str, faults: dict[str, Fault]) -> None:
        """The round trip: wait on the gate, sleep the latency, raise an injected fault."""
        if self.gate is not None:
            await self.gate.wait()
        delay = self.latency(name) if callable(self.latency) else self.latency
        if delay > 0:
            await anyio.sleep(delay)
        else:
            await anyio.lowlevel.checkpoint()
        fault = self._take(faults, name)
        if fault is not None:
            raise _fresh(fault)

    @staticmethod
    def _take(table: dict, name: str):
        """The fault for ``name``: a single one stays, a list is consumed one per attempt."""
        entry = table.get(name)
        if not isinstance(entry, list):
            return entry
        if not entry:
            return None
        return entry.pop(0)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("FakeStore is closed; a request came after aclose()")

    def _check_bucket(self, bucket: str) -> None:
        if bucket not in self.buckets:
            raise NoSuchBucketError(f"no bucket {bucket!r}", bucket=bucket)

    def _lookup(self, bucket: str, key: str) -> bytes:
        self._check_bucket(bucket)
        try:
            return self.objects[bucket, key]
        except KeyError:
            message = f"no object {key!r} in bucket {bucket!r}"
            raise NoSuchKeyError(message, bucket=bucket, key=key) from None

    def _page(self, bucket: str, prefix: str, after: str | None) -> tuple[list[ObjectInfo], bool]:
        """One page of keys after ``after`` (like a continuation token), and whether more follow."""
        keys = sorted(
            key
            for b, key in self.objects
            if b == bucket and key.startswith(prefix) and (after is None or key > after)
        )
        page = [ObjectInfo(key, len(self.objects[bucket, key])) for key in keys[: self.page_size]]
        return page, len(keys) > self.page_size


def _check_range(bucket: str, key: str, start: int, end: int | None, size: int) -> None:
    if start < 0 or start > size or (end is not None and end < start):
        raise InvalidRangeError(
            f"range [{start}, {end}) is not within {key!r} in bucket {bucket!r} ({size} bytes)",
            bucket=bucket,
            key=key,
        )


def _fresh(fault: BaseException) -> BaseException:
    """A copy to raise, so repeated raises do not pile tracebacks onto one instance."""
    try:
        return copy.copy(fault)
    except Exception:  # an exception type that cannot be rebuilt from its args
        return fault


def _copy_faults(table: Mapping | None) -> dict:
    """Own copies of the lists, so consuming faults never edits the caller's dict."""
    return {name: list(v) if isinstance(v, list) else v for name, v in (table or {}).items()}


# ----------------------------------------------------------------------------- test helpers

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
