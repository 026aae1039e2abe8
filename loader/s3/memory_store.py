"""``MemoryStore``: an in-memory ``ObjectStore`` with injectable latency and faults, and counters of
what it was asked, for tests of code that reads through the loader without a server. Users import
it from ``loader.testing`` (see docs/testing.md); the loader's own unit tests run on it.

``MemoryStore`` is its own async factory (``await store()`` reopens and returns it), so every
engine of a process reads the same objects and counts into the same counters. It pickles with the
dataset (its objects, faults and hooks must pickle too): DataLoader workers started by ``spawn``
read their own copies, forked ones copy-on-write ones; the parent's counters count its requests.
The loader's own unit tests run on it. It implements exactly the protocol in
``s3/protocol.py`` and behaves like a well-behaved backend (the loader's error tree, half-open
ranges, key-ordered paged listings, a ``TransientStoreError`` when a streamed body is cut short):

* ``requests`` / ``requests_by_key``: read requests (``get``, ``get_range``, ``stream``), counted
  when they start, failed ones included; ``list_requests`` (one per page) and ``puts`` apart;
  ``list_inflight`` / ``peak_list_inflight``: list pages being answered at once;
  ``order="directories"`` lists directory by directory as SeaweedFS does (see ``list_pages``);
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
  which holds requests in flight so a test can count how many were issued;
* ``on_read``: ``callable(key, n)`` run as the ``n``-th read request of ``key`` (from 1) starts,
  after it is counted and before it looks at the object: a hook to overwrite an object mid-read.

Versions, as S3 has them: every object's ETag is the md5 of its bytes (``etag_of``), listings
carry it, reads hand it to their ``Pin`` (``ObjectChangedError`` on a change) and a pinned read
whose ETag no longer matches fails as S3's 412 does; ``get_if_changed`` answers None for the
current ETag (a 304). ``etags=False`` plays a server that sends no ETags at all.
``conditional_requests`` counts the conditional GETs.

Multipart uploads (the ``MultipartStore`` protocol, for ``loader.checkpoint``): ``uploads`` holds
the open ones (``upload_id -> MultipartUpload``) until completed or aborted, so "nothing orphaned"
is ``list_multipart_uploads`` coming back empty. Parts may be as small as ``min_part_size`` (1 by
default, not S3's 5 MiB, so tests stay small); ``complete_multipart`` enforces it like S3 does
(``EntityTooSmall``) for every part but the last. Counters: ``multipart_created``,
``parts_uploaded`` (successful), ``parts_started``, ``parts_inflight`` / ``peak_parts_inflight``,
``completed``, ``aborted``. Faults: ``part_fail`` (``{part_number: fault}``, same single/list
rule as ``fail``), ``multipart_fail`` (``{"create" | "complete" | "abort" | "list": fault}``) and
``on_part``: ``callable(part_number)`` run when a part upload starts, after it is counted as in
flight; when it returns an awaitable, that is awaited (a hook to pace parts or to interrupt).

Nothing loop-bound is created in ``__init__`` and the counters are plain ints, so one instance
may be used by several event loops (engines) in turn, and read from the test's own thread.
"""


from __future__ import annotations

import bisect
import builtins
import copy
import hashlib
import inspect
import itertools
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from ..errors import (
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    StoreError,
    TransientStoreError,
)
from .error_answers import error_for_answer
from .list_xml import paged
from .protocol import DEFAULT_CHUNK_SIZE, ListPage, ObjectInfo, Pin, objects_of

__all__ = ["MemoryStore", "MultipartUpload"]

Latency = float | Callable[[str], float]
Fault = BaseException | list[BaseException]
DEFAULT_PAGE_SIZE = 1000
_upload_numbers = itertools.count(1)


@dataclass
class MultipartUpload:
    """One open multipart upload in a ``MemoryStore``: where it goes and the parts so far."""

    bucket: str
    key: str
    parts: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # number -> (etag, data)


class MemoryStore:
    """An in-memory object store that a dataset or a checkpoint takes as ``store=`` (see
    docs/testing.md; the module docstring has every counter and hook).

    Args:
        objects: ``{(bucket, key): bytes}``; ``with_objects(bucket, {key: bytes})`` is shorter.
        buckets: buckets that exist, empty ones included.
        latency: seconds, or ``callable(key) -> seconds``, before each answer.
        fail: ``{key: exc}`` on every request, ``{key: [exc, ...]}`` one per request, then none.
        list_fail: the same for listings, by prefix.
        truncate: ``{key: n}``: streams of ``key`` are cut after ``n`` bytes.
        page_size: keys per listing page.
        order: ``"bytes"`` (S3) or ``"directories"`` (SeaweedFS's listing order).
    """

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
        min_part_size: int = 1,
        part_fail: Mapping[int, Fault] | None = None,
        multipart_fail: Mapping[str, Fault] | None = None,
        on_part: Callable[[int], object] | None = None,
        on_read: Callable[[str, int], object] | None = None,
        etags: bool = True,
        order: str = "bytes",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be >= 1")
        if order not in ("bytes", "directories"):
            raise ValueError(f"order={order!r}: 'bytes' (S3) or 'directories' (SeaweedFS)")
        self.order = order
        self.objects: dict[tuple[str, str], bytes] = _Objects(objects or {})
        self._listing: tuple[tuple, list[str], list] = ((), [], [])  # sorted keys, see _keys_after
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
        self.list_inflight = self.peak_list_inflight = 0
        self.puts = 0
        self.inflight = 0
        self.peak_inflight = 0
        self.gets_started: list[tuple[float, str]] = []
        self.min_part_size = min_part_size
        self.part_fail: dict[int, Fault] = _copy_faults(part_fail)
        self.multipart_fail: dict[str, Fault] = _copy_faults(multipart_fail)
        self.on_part = on_part
        self.on_read = on_read
        self.etags = etags
        self.conditional_requests = 0
        self.uploads: dict[str, MultipartUpload] = {}
        self.multipart_created = self.parts_started = self.parts_uploaded = 0
        self.completed = self.aborted = 0
        self.parts_inflight = self.peak_parts_inflight = 0

    @classmethod
    def with_objects(cls, bucket: str, objects: Mapping[str, bytes], **options) -> MemoryStore:
        """A store holding ``objects`` (key -> bytes) in one ``bucket``."""
        return cls({(bucket, key): data for key, data in objects.items()}, buckets=[bucket], **options)

    def reset_counters(self) -> None:
        """Zero the counters (``inflight`` stays: those requests are still running)."""
        self.requests = self.list_requests = self.puts = self.conditional_requests = 0
        self.peak_inflight = self.inflight
        self.multipart_created = self.parts_started = self.parts_uploaded = 0
        self.completed = self.aborted = 0
        self.peak_parts_inflight = self.parts_inflight
        self.requests_by_key.clear()
        self.gets_started.clear()

    # ------------------------------------------------------------------------- the protocol

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return objects_of(self.list_pages(bucket, prefix, page_size=self.page_size))

    def list_pages(
        self,
        bucket: str,
        prefix: str = "",
        *,
        token: str | None = None,
        start_after: str | None = None,
        delimiter: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncGenerator[ListPage, None]:
        """``PagedLister``: pages of at most ``min(page_size, self.page_size)`` entries; the
        token is the last key the page covered, so a resumed listing starts after it.
        ``start_after`` is S3's ``StartAfter`` (used without a token); with
        ``order="directories"`` it skips the keys under ``start_after + "/"``, as SeaweedFS does."""
        async def fetch(token: str | None) -> ListPage:
            after = (token, False) if token is not None else None if start_after is None else (start_after, True)
            self._check_open()
            self.list_requests += 1
            self.list_inflight += 1
            self.peak_list_inflight = max(self.peak_list_inflight, self.list_inflight)
            try:
                await self._respond(prefix, self.list_fail)
                self._check_bucket(bucket)
                return self._delimited_page(bucket, prefix, after, delimiter, min(page_size, self.page_size))
            finally:
                self.list_inflight -= 1

        return paged(fetch, bucket=bucket, prefix=prefix, token=token)

    def etag_of(self, bucket: str, key: str) -> str | None:
        """The object's current ETag (the md5 of its bytes, unquoted), None without ETags."""
        data = self.objects.get((bucket, key))
        if data is None or not self.etags:
            return None
        return hashlib.md5(data).hexdigest()

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        async with self._read(key):
            return self._lookup(bucket, key, pin)

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        async with self._read(key):
            data = self._lookup(bucket, key, pin)
            _check_range(bucket, key, start, end, len(data))
            return data[start:end]

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        async with self._read(key):
            self.conditional_requests += 1
            data = self._lookup(bucket, key, None)
            if self.etag_of(bucket, key) == etag:
                return None
            if pin is not None:
                pin.observe(self.etag_of(bucket, key), bucket, key)
            _check_range(bucket, key, start, end, len(data))
            return data[start:end]

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncIterator[bytes]:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be >= 1")
        async with self._read(key):
            data = self._lookup(bucket, key, pin)  # the version this response carries
            _check_range(bucket, key, start, end, len(data))
            last = len(data) if end is None else min(len(data), end)
            cut = self._take(self.truncate, key)
            stop = last if cut is None else min(last, start + cut)
            for offset in range(start, stop, chunk_size):
                await anyio.lowlevel.checkpoint()
                yield data[offset : min(offset + chunk_size, stop)]
            if stop < last:
                raise TransientStoreError(
                    f"body of {key!r} in bucket {bucket!r} ended after {stop - start} of "
                    f"{last - start} bytes (from offset {start})",
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

    async def __call__(self) -> MemoryStore:
        """The store as its own factory (``store=`` of a dataset or a checkpoint): reopened
        and returned, so one instance serves every engine in turn."""
        self.closed = False
        return self

    # ------------------------------------------------------------------------- MultipartStore

    async def create_multipart(self, bucket: str, key: str) -> str:
        self._check_open()
        await self._respond("create", self.multipart_fail)
        self._check_bucket(bucket)
        upload_id = f"upload-{next(_upload_numbers)}"
        self.uploads[upload_id] = MultipartUpload(bucket, key)
        self.multipart_created += 1
        return upload_id

    async def upload_part(
        self, bucket: str, key: str, upload_id: str, part_number: int, data: bytes | bytearray
    ) -> str:
        self._check_open()
        self.parts_started += 1
        self.parts_inflight += 1
        self.peak_parts_inflight = max(self.peak_parts_inflight, self.parts_inflight)
        try:
            if self.on_part is not None:
                result = self.on_part(part_number)
                if inspect.isawaitable(result):
                    await result
            await self._respond(key, self.fail)
            fault = self._take(self.part_fail, part_number)
            if fault is not None:
                raise _fresh(fault)
            upload = self._upload(bucket, key, upload_id)
            if not 1 <= part_number <= 10_000:
                raise StoreError(f"part number {part_number} is not in 1..10000", bucket=bucket, key=key)
            payload = bytes(data)
            etag = '"' + hashlib.md5(payload).hexdigest() + '"'
            upload.parts[part_number] = (etag, payload)
            self.parts_uploaded += 1
            return etag
        finally:
            self.parts_inflight -= 1

    async def complete_multipart(
        self, bucket: str, key: str, upload_id: str, parts: builtins.list[tuple[int, str]]
    ) -> None:
        self._check_open()
        await self._respond("complete", self.multipart_fail)
        upload = self._upload(bucket, key, upload_id)
        numbers = [number for number, _ in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError(f"parts {numbers} are not unique and ascending (InvalidPartOrder)",
                             bucket=bucket, key=key)
        chunks = []
        for position, (number, etag) in enumerate(parts):
            stored = upload.parts.get(number)
            if stored is None or stored[0] != etag:
                raise StoreError(f"part {number} with ETag {etag!r} was not uploaded (InvalidPart)",
                                 bucket=bucket, key=key)
            if position < len(parts) - 1 and len(stored[1]) < self.min_part_size:
                raise StoreError(
                    f"part {number} holds {len(stored[1])} bytes, less than {self.min_part_size} "
                    "(EntityTooSmall)", bucket=bucket, key=key)
            chunks.append(stored[1])
        self.objects[bucket, key] = b"".join(chunks)
        del self.uploads[upload_id]
        self.completed += 1

    async def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._check_open()
        await self._respond("abort", self.multipart_fail)
        if self.uploads.pop(upload_id, None) is not None:
            self.aborted += 1

    async def list_multipart_uploads(self, bucket: str, prefix: str = "") -> builtins.list[tuple[str, str]]:
        self._check_open()
        await self._respond("list", self.multipart_fail)
        self._check_bucket(bucket)
        return sorted(
            (upload.key, upload_id)
            for upload_id, upload in self.uploads.items()
            if upload.bucket == bucket and upload.key.startswith(prefix)
        )

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
            if self.on_read is not None:
                result = self.on_read(key, self.requests_by_key[key])
                if inspect.isawaitable(result):
                    await result
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
    def _take(table: dict, name: str | int):
        """The fault for ``name``: a single one stays, a list is consumed one per attempt."""
        entry = table.get(name)
        if not isinstance(entry, list):
            return entry
        if not entry:
            return None
        return entry.pop(0)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("MemoryStore is closed; a request came after aclose()")

    def _check_bucket(self, bucket: str) -> None:
        if bucket not in self.buckets:
            raise NoSuchBucketError(f"no bucket {bucket!r}", bucket=bucket)

    def _upload(self, bucket: str, key: str, upload_id: str) -> MultipartUpload:
        upload = self.uploads.get(upload_id)
        if upload is None or (upload.bucket, upload.key) != (bucket, key):
            raise StoreError(f"no multipart upload {upload_id!r} for {key!r} in bucket {bucket!r} "
                             "(NoSuchUpload)", bucket=bucket, key=key)
        return upload

    def _lookup(self, bucket: str, key: str, pin: Pin | None) -> bytes:
        """The object's bytes; with a pin, S3's If-Match (a 412) and the response's ETag."""
        self._check_bucket(bucket)
        try:
            data = self.objects[bucket, key]
        except KeyError:
            message = f"no object {key!r} in bucket {bucket!r}"
            raise NoSuchKeyError(message, bucket=bucket, key=key) from None
        if pin is not None:
            etag = self.etag_of(bucket, key)
            if pin.etag is not None and etag is not None and pin.etag != etag:
                raise error_for_answer("PreconditionFailed", 412, bucket=bucket, key=key,
                                       endpoint="MemoryStore")
            pin.observe(etag, bucket, key)
        return data

    def _delimited_page(
        self, bucket: str, prefix: str, after: tuple[str, bool] | None, delimiter: str | None,
        size: int,
    ) -> ListPage:
        """One page after ``after`` = (key, is a StartAfter), in this store's ``order``."""
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        last = None
        for key in self._keys_after(bucket, prefix, after):
            rest = key[len(prefix):]
            folder = None
            if delimiter and delimiter in rest:
                folder = prefix + rest.split(delimiter, 1)[0] + delimiter
            if not (folder and prefixes and prefixes[-1] == folder):  # a new entry
                if len(objects) + len(prefixes) == size:
                    return ListPage(objects, prefixes, last)
                if folder:
                    prefixes.append(folder)
                else:
                    objects.append(ObjectInfo(key, len(self.objects[bucket, key]), self.etag_of(bucket, key)))
            last = key
        return ListPage(objects, prefixes, None)

    def _keys_after(self, bucket: str, prefix: str, after: tuple[str, bool] | None) -> Iterator[str]:
        """The keys of ``bucket`` under ``prefix`` after ``after``, in this store's ``order``:
        ``directories`` sorts by path segments ('/' below every character) and a StartAfter
        skips the keys under ``after + "/"``, as SeaweedFS does. The sorted keys are kept
        until the objects change."""
        def order(key: str) -> Any:
            return key if self.order == "bytes" else key.split("/")

        stamp = (id(self.objects), getattr(self.objects, "version", None), bucket, self.order)
        if self._listing[0] != stamp or stamp[1] is None:
            keys = sorted((key for b, key in self.objects if b == bucket), key=order)
            self._listing = (stamp, keys, [order(key) for key in keys])
        _, keys, marks = self._listing
        start = bisect.bisect_left(marks, order(prefix))
        if after is not None:
            start = max(start, bisect.bisect_right(marks, order(after[0])))
        below = after[0] + "/" if after is not None and after[1] and self.order != "bytes" else None
        entered = False
        for key in keys[start:]:
            if not key.startswith(prefix):
                if entered:
                    return  # the keys under a prefix are adjacent in either order
                continue
            entered = True
            if below is None or not key.startswith(below):
                yield key


class _Objects(dict):
    """The store's objects; ``version`` counts changes, so that listings can keep keys sorted."""

    version = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> Any:
        self.version += 1
        return super().popitem()

    def clear(self) -> None:
        self.version += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self.version += 1
        return super().setdefault(*args)


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
    except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt from its args
        return fault


def _copy_faults(table: Mapping | None) -> dict:
    """Own copies of the lists, so consuming faults never edits the caller's dict."""
    return {name: list(v) if isinstance(v, list) else v for name, v in (table or {}).items()}
