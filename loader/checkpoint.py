"""Checkpoints straight to and from S3: ``torch.save`` into a multipart upload, ``torch.load``
from parallel ranged GETs, with neither a local file nor a whole copy of the bytes in memory.

    from loader import checkpoint
    checkpoint.save(model.state_dict(), "s3://bucket/ckpt/step-1000.pt")
    state = checkpoint.load("s3://bucket/ckpt/step-1000.pt", map_location="cpu")

Memory is bounded by ``part_size`` x ``parts_inflight``; a failed save aborts its upload, and a
load reads one version (``If-Match``) or fails. How and why: docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import CancelledError, Future
from typing import IO, Any, TypeVar, cast

import anyio
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .checks import check_int
from .config import S3Config
from .errors import ConfigError, LoaderError, NoSuchKeyError, StoreError
from .retry import RetryPolicy, call_with_retries
from .stores import ObjectInfo, ObjectStore, Pin, StoreSpec
from .stores.base import S3_MAX_PART_SIZE, S3_MAX_PARTS, S3_MIN_PART_SIZE, MultipartStore
from .uri import object_url, parse_s3_uri

__all__ = ["DEFAULT_LOAD_PART_SIZE", "DEFAULT_PART_SIZE", "DEFAULT_PARTS_INFLIGHT", "load", "save"]

T = TypeVar("T")

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_LOAD_PART_SIZE = 8 << 20  # a response in flight costs twice its size (docs/checkpoint.md)
DEFAULT_PARTS_INFLIGHT = 4
PARTS_PER_SIZE_STEP = 1000  # the part size doubles after every this many parts
_PORTAL_NAME = "loader-checkpoint"

StoreArg = str | Callable[[], Awaitable[ObjectStore]] | None


def save(
    obj: Any,
    uri: str,
    *,
    config: S3Config | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    parts_inflight: int = DEFAULT_PARTS_INFLIGHT,
    store: StoreArg = None,
    retry: RetryPolicy | None = None,
) -> None:
    """``torch.save(obj)`` into the object at ``uri`` (``s3://bucket/key``), streamed in parts.

    ``part_size`` bytes per part (S3 needs at least 5 MiB for every part but the last), up to
    ``parts_inflight`` uploading at once; memory beyond ``obj`` stays within
    ``(parts_inflight + 1) * part_size``. The object appears atomically when the upload
    completes; on any failure, ``KeyboardInterrupt`` included, the upload is aborted and the
    error names ``uri``. ``store``: a backend name or an async store factory; ``"obstore"`` has no
    multipart upload and saves through aioboto3 (docs/checkpoint.md). ``retry`` governs each
    request (default ``RetryPolicy()``).
    """
    bucket, key = _object_uri(uri)
    _check_sizes(part_size, parts_inflight)
    policy = retry or RetryPolicy()
    factory = _store_factory(store, config, parts_inflight + 1, policy)
    outer = sys.exc_info()[1]  # e.g. the KeyboardInterrupt a caller saves on: not ours
    with start_blocking_portal(name=_PORTAL_NAME) as portal:
        with _naming(uri, "saving checkpoint to"):
            opened = portal.call(factory)
        try:
            _check_multipart(opened, part_size, store)
            upload: _Upload = portal.call(
                lambda: _Upload(opened, bucket, key, policy, parts_inflight)
            )
            future = portal.start_task_soon(upload.run)
            writer = _PartWriter(portal, upload, future, part_size)
            try:
                torch.save(obj, cast(IO[bytes], writer))  # it needs write() and flush() only
                if writer.error is not None:  # raised inside torch, which may have hidden it
                    raise writer.error
                writer.finish()
                future.result()
            except BaseException as exc:  # noqa: BLE001 - reraised below as the named cause, after the upload is aborted
                cause = _cause(exc, writer.error, outer)
                _abandon(portal, upload, future)
                if upload.abort_error is not None:
                    cause.add_note(
                        f"could not abort multipart upload {upload.upload_id!r} of {uri}: "
                        f"{upload.abort_error}; abort it by hand, or let a bucket lifecycle rule "
                        "(AbortIncompleteMultipartUpload) remove it"
                    )
                raise _named(cause, uri, "saving checkpoint to", hide=exc)  # noqa: B904 (_named sets the cause)
        finally:
            portal.call(opened.aclose)


def load(
    uri: str,
    *,
    map_location: Any = None,
    config: S3Config | None = None,
    weights_only: bool = True,
    store: StoreArg = None,
    parts_inflight: int = DEFAULT_PARTS_INFLIGHT,
    part_size: int = DEFAULT_LOAD_PART_SIZE,
    retry: RetryPolicy | None = None,
) -> Any:
    """``torch.load`` the object at ``uri``, read with up to ``parts_inflight`` ranged GETs at once.

    ``map_location`` and ``weights_only`` go to ``torch.load``. Tensor bytes go straight from the
    responses into the tensors, ``part_size`` bytes per GET: peak memory is the result plus about
    ``3 * parts_inflight * part_size`` (docs/checkpoint.md); no temporary file is written.
    A missing object raises ``NoSuchKeyError``, a missing bucket ``NoSuchBucketError``, both
    naming ``uri``. ``store="obstore"`` reads through aioboto3 (docs/checkpoint.md).
    """
    bucket, key = _object_uri(uri)
    _check_sizes(part_size, parts_inflight)
    policy = retry or RetryPolicy()
    factory = _store_factory(store, config, parts_inflight + 1, policy)
    outer = sys.exc_info()[1]
    with start_blocking_portal(name=_PORTAL_NAME) as portal:
        with _naming(uri, "loading checkpoint from"):
            opened = portal.call(factory)
        try:
            with _naming(uri, "loading checkpoint from"):
                listed = portal.call(_listed, opened, bucket, key, policy)
            reader = _RangeReader(portal, opened, bucket, key, listed.size, Pin(listed.etag),
                                  block_size=part_size, parallel=parts_inflight, retry=policy)
            try:
                return torch.load(cast(IO[bytes], reader),  # a RawIOBase, which typeshed tells apart
                                  map_location=map_location, weights_only=weights_only)
            except BaseException as exc:  # noqa: BLE001 - reraised as the named cause
                cause = _cause(exc, reader.error, outer)
                raise _named(cause, uri, "loading checkpoint from", hide=exc)  # noqa: B904 (_named sets the cause)
            finally:
                reader.close()
        finally:
            portal.call(opened.aclose)


# ----------------------------------------------------------------------------- save machinery


class _Upload:
    """The loop side of one ``save``: receives parts, uploads them, completes or aborts.

    Built in the loop thread (``portal.call``); ``run`` is the one task that owns the upload.
    The writer hands parts over through an unbuffered stream, and ``run`` only receives when an
    upload slot is free: that rendezvous is the backpressure which bounds the buffered parts.
    """

    def __init__(
        self, store: Any, bucket: str, key: str, retry: RetryPolicy, parts_inflight: int
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.key = key
        self.retry = retry
        self.send, self._receive = anyio.create_memory_object_stream[tuple[int, bytes, bool]](0)
        self._slots = anyio.Semaphore(parts_inflight)
        self._scope = anyio.CancelScope()  # cancelled by ``abandon`` (the writer failed)
        self.upload_id: str | None = None
        self.parts: list[tuple[int, str]] = []
        self.error: BaseException | None = None
        self.abort_error: BaseException | None = None

    async def run(self) -> None:
        """Upload every part handed over, then complete; on any failure abort, then raise."""
        single = False
        try:
            with self._scope:
                async with self._receive, anyio.create_task_group() as tg:
                    while self.error is None:
                        await self._slots.acquire()
                        try:
                            number, data, last = await self._receive.receive()
                        except anyio.EndOfStream:
                            self._slots.release()
                            break
                        try:
                            if number == 1 and last:  # it all fit in one part: a plain PUT
                                await self._retried(
                                    self.store.put, self.bucket, self.key, data
                                )
                                self._slots.release()
                                single = True
                                break
                            if self.upload_id is None:
                                # shielded: an upload created on the server must be known, to
                                # abort it
                                with anyio.CancelScope(shield=True):
                                    self.upload_id = await self._retried(
                                        self.store.create_multipart, self.bucket, self.key
                                    )
                        except Exception as exc:  # noqa: BLE001 - not raised here: a task group would wrap it
                            self.error = exc
                            self._slots.release()
                            tg.cancel_scope.cancel()
                            break
                        tg.start_soon(self._part, number, data, tg.cancel_scope)
            if self.error is not None:
                raise self.error
            if self._scope.cancel_called:
                raise _Abandoned()
            if not single and self.upload_id is not None:
                parts = sorted(self.parts)
                await self._retried(
                    self.store.complete_multipart, self.bucket, self.key, self.upload_id, parts
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abort()
            raise

    def abandon(self) -> None:
        """Stop at once: the writer failed (called in the loop thread)."""
        self._scope.cancel()

    async def _part(self, number: int, data: bytes, scope: anyio.CancelScope) -> None:
        try:
            etag = await self._retried(
                self.store.upload_part, self.bucket, self.key, self.upload_id, number, data
            )
            self.parts.append((number, etag))
        except Exception as exc:  # noqa: BLE001 - first failure wins; the others are its cancellations
            if self.error is None:
                self.error = exc
            scope.cancel()
        finally:
            del data
            self._slots.release()

    async def _abort(self) -> None:
        if self.upload_id is None:
            return
        try:
            await self._retried(self.store.abort_multipart, self.bucket, self.key, self.upload_id)
        except Exception as exc:  # noqa: BLE001 - reported as a note on the error that caused the abort
            self.abort_error = exc

    async def _retried(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return await call_with_retries(functools.partial(fn, *args), self.retry)


class _Abandoned(LoaderError):
    """``_Upload.run`` was stopped because the writer failed (the writer's error is raised)."""


class _PartWriter:
    """The file ``torch.save`` writes to, in the caller's thread: fills parts, hands them over.

    A part grows in a ``BytesIO`` (large blocks grow in place, by ``mremap``) and is handed over
    as the ``bytes`` its ``getvalue()`` returns without a copy; a ``bytearray`` would cost one
    more copy of every part on its way to the socket.
    """

    def __init__(self, portal: BlockingPortal, upload: _Upload, future: Future, part_size: int) -> None:
        self._portal = portal
        self._upload = upload
        self._future = future
        self._part_size = part_size
        self._number = 1
        self._part: io.BytesIO | None = io.BytesIO()
        self._fill = 0
        self._written = 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        if self.error is not None:
            raise self.error
        try:
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            total = len(view)
            done = 0
            while done < total:
                if self._part is None:
                    raise ValueError("write to a finished checkpoint writer")
                take = min(total - done, self._size_of(self._number) - self._fill)
                self._part.write(view[done : done + take])
                self._fill += take
                done += take
                if self._fill == self._size_of(self._number):
                    self._hand_over(last=False)
            self._written += total
            return total
        except BaseException as exc:
            self.error = exc
            raise

    def finish(self) -> None:
        """Hand over the last (short) part, if any, and tell the uploader there are no more."""
        if self._part is not None and (self._fill or self._number == 1):
            self._hand_over(last=True)
        self._part = None
        self._portal.call(self._upload.send.aclose)

    def _hand_over(self, *, last: bool) -> None:
        if self._number > S3_MAX_PARTS:
            raise LoaderError(
                f"the checkpoint needs more than {S3_MAX_PARTS} parts; raise part_size"
            )
        part = self._part
        if part is None:
            raise ValueError("write to a finished checkpoint writer")
        item = (self._number, part.getvalue(), last)
        del part
        self._part = None  # the uploader owns the bytes now
        try:
            self._portal.call(self._upload.send.send, item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._uploader_failure() from None
        del item
        self._number += 1
        self._fill = 0
        self._part = None if last else io.BytesIO()

    def _uploader_failure(self) -> BaseException:
        """Why the uploader stopped taking parts (waits for its abort to finish)."""
        error = self._future.exception()  # not result(): re-raising grows its traceback
        if error is not None:
            return error
        return StoreError("the uploader stopped before the checkpoint was written",
                          bucket=self._upload.bucket, key=self._upload.key)

    def _size_of(self, number: int) -> int:
        step = (number - 1) // PARTS_PER_SIZE_STEP
        return min(S3_MAX_PART_SIZE, self._part_size << step)


def _abandon(portal: BlockingPortal, upload: _Upload, future: Future) -> None:
    """Stop the uploader (which aborts the upload) and wait until it has."""
    if not future.done():
        portal.call(upload.abandon)
    with contextlib.suppress(CancelledError):
        future.exception()  # waits; the error, if any, is already the caller's


def _check_multipart(store: Any, part_size: int, given: StoreArg) -> None:
    if not isinstance(store, MultipartStore):
        raise ConfigError(
            f"store={given!r} opened {type(store).__name__}, which has no multipart upload "
            "(the MultipartStore protocol); checkpoints need one"
        )
    minimum = getattr(store, "min_part_size", S3_MIN_PART_SIZE)
    if part_size < minimum:
        raise ConfigError(
            f"part_size={part_size!r} is below the smallest part the store accepts "
            f"({minimum} bytes; S3 needs 5 MiB = {S3_MIN_PART_SIZE})"
        )


# ----------------------------------------------------------------------------- load machinery


class _RangeReader(io.RawIOBase):
    """A seekable, read-only file over one object, for ``torch.load`` (docs/checkpoint.md).

    Reads of at least ``block_size`` bytes are fetched straight into the caller's buffer, in
    ``block_size`` spans, ``parallel`` at once (parts already cached are copied, then dropped);
    smaller reads are served from cached ``block_size``-aligned blocks. A miss fetches just the
    blocks it needs, or, when it is the block after the previous miss (records after records),
    ``parallel`` blocks from there at once. The cache keeps at most ``parallel`` blocks, least
    recently used out first, making room before it fetches.
    """

    def __init__(
        self,
        portal: BlockingPortal,
        store: ObjectStore,
        bucket: str,
        key: str,
        size: int,
        pin: Pin,
        *,
        block_size: int,
        parallel: int,
        retry: RetryPolicy,
    ) -> None:
        super().__init__()
        self._pin = pin  # the version listed with ``size``: every ranged GET asks for it
        self._portal = portal
        self._store = store
        self._bucket = bucket
        self._key = key
        self._size = size
        self._block = block_size
        self._parallel = parallel
        self._retry = retry
        self._pos = 0
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._last_miss: int | None = None  # the last block of the last cache miss
        self.error: BaseException | None = None
        self.requests = 0
        self.bytes_fetched = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"whence={whence!r} is not SEEK_SET, SEEK_CUR or SEEK_END")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        start = self._pos
        count = min(len(view), self._size - start)
        if count <= 0:
            return 0
        try:
            if count >= self._block:
                self._read_direct(start, view[:count])
            else:
                self._read_cached(start, view[:count])
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        self._pos = start + count
        return count

    def close(self) -> None:
        self._cache.clear()
        super().close()

    def _read_cached(self, start: int, view: memoryview) -> None:
        first, last = start // self._block, (start + len(view) - 1) // self._block
        needed = range(first, last + 1)
        capacity = max(self._parallel, len(needed))
        if any(index not in self._cache for index in needed):
            # read ahead only when misses run front to back (records after records); a lone
            # miss (the zip's magic number, its directory at the end) fetches just its blocks
            sequential = self._last_miss is not None and first - 1 <= self._last_miss <= first
            self._last_miss = last
            ahead = range(first, min(self._blocks(), first + capacity) if sequential else last + 1)
            wanted = [index for index in ahead if index not in self._cache]
            for index in list(self._cache):  # make room first: never more than capacity blocks
                if len(self._cache) + len(wanted) <= capacity:
                    break
                if index not in needed:
                    del self._cache[index]
            for index, data in self._fetch({i: self._block_span(i) for i in wanted}).items():
                self._cache[index] = data
        for index in needed:  # most recently used last, so read-ahead is evicted before these
            self._cache.move_to_end(index)
        done = 0
        for index in needed:
            data = self._cache[index]
            lo = start + done - index * self._block
            take = min(len(view) - done, len(data) - lo)
            view[done : done + take] = data[lo : lo + take]
            done += take

    def _read_direct(self, start: int, view: memoryview) -> None:
        end = start + len(view)
        spans: dict[int, tuple[int, int]] = {}
        for index in range(start // self._block, (end - 1) // self._block + 1):
            lo, hi = max(start, index * self._block), min(end, (index + 1) * self._block)
            cached = self._cache.get(index)
            if cached is not None:
                offset = index * self._block
                view[lo - start : hi - start] = cached[lo - offset : hi - offset]
                if lo == index * self._block and hi == (index + 1) * self._block:
                    del self._cache[index]  # wholly inside this record: never read again
            else:
                spans[index] = (lo, hi)
        if spans:
            self._fetch(spans, into=view, base=start)

    def _fetch(
        self, spans: dict[int, tuple[int, int]], *, into: memoryview | None = None, base: int = 0
    ) -> dict[int, bytes]:
        """GET every span, ``parallel`` at once; copy into ``into`` or return them by index."""
        self.requests += len(spans)
        return self._portal.call(self._fetch_async, spans, into, base)

    async def _fetch_async(
        self, spans: dict[int, tuple[int, int]], into: memoryview | None, base: int
    ) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        errors: list[BaseException] = []
        limiter = anyio.CapacityLimiter(self._parallel)

        async def one(index: int, lo: int, hi: int, scope: anyio.CancelScope) -> None:
            try:
                async with limiter:
                    data = await call_with_retries(
                        functools.partial(self._store.get_range, self._bucket, self._key, lo, hi,
                                          pin=self._pin),
                        self._retry,
                    )
                if len(data) != hi - lo:
                    raise StoreError(
                        f"{object_url(self._bucket, self._key)}: bytes [{lo}, {hi}) came back as "
                        f"{len(data)} bytes; was the object replaced while it was being read?",
                        bucket=self._bucket, key=self._key,
                    )
                self.bytes_fetched += len(data)
                if into is None:
                    out[index] = data
                else:  # the caller's thread is blocked in portal.call until we return
                    into[lo - base : hi - base] = data
            except Exception as exc:  # noqa: BLE001 - collected; the first one is raised once the scope ends
                errors.append(exc)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, (lo, hi) in spans.items():
                tg.start_soon(one, index, lo, hi, tg.cancel_scope)
        if errors:
            raise errors[0]
        return out

    def _blocks(self) -> int:
        return -(-self._size // self._block)

    def _block_span(self, index: int) -> tuple[int, int]:
        return index * self._block, min(self._size, (index + 1) * self._block)


async def _listed(store: ObjectStore, bucket: str, key: str, retry: RetryPolicy) -> ObjectInfo:
    """The object's size and ETag, from a listing of its own key (no HEAD in ``ObjectStore``)."""

    async def attempt() -> ObjectInfo | None:
        listing = store.list(bucket, key)
        try:
            async for info in listing:
                if info.key == key:
                    return info
        finally:
            aclose = getattr(listing, "aclose", None)
            if aclose is not None:
                await aclose()
        return None

    info = await call_with_retries(attempt, retry)
    if info is None:
        raise NoSuchKeyError(
            f"no checkpoint at {object_url(bucket, key)}: the bucket has no object {key!r}; "
            "check the step number and prefix, and that the save finished",
            bucket=bucket, key=key,
        )
    return info


# ----------------------------------------------------------------------------- shared helpers


def _object_uri(uri: str) -> tuple[str, str]:
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        raise ConfigError(
            f"{uri!r} names no object; a checkpoint URI ends in a key, "
            "e.g. 's3://bucket/ckpt/step-1000.pt'"
        )
    return bucket, key


def _check_sizes(part_size: int, parts_inflight: int) -> None:
    check_int("part_size", part_size, minimum=1, maximum=S3_MAX_PART_SIZE,
              must=f"an integer number of bytes from 1 to {S3_MAX_PART_SIZE} (5 GiB); S3 needs at "
                   f"least 5 MiB (default {DEFAULT_PART_SIZE})")
    check_int("parts_inflight", parts_inflight, minimum=1,
              must=f"a positive integer (default {DEFAULT_PARTS_INFLIGHT})")


def _store_factory(
    store: StoreArg, config: S3Config | None, connections: int, retry: RetryPolicy
) -> Callable[[], Awaitable[Any]]:
    """An async factory for the store: a user-given one, else aioboto3 (obstore included: the
    multipart uploads go through botocore)."""
    return StoreSpec.of(store, config).opener(max_connections=connections, retry=retry,
                                              backend="aioboto3")


def _cause(
    exc: BaseException, ours: BaseException | None, outer: BaseException | None
) -> BaseException:
    """What really went wrong when ``torch.save``/``torch.load`` raised ``exc``.

    torch reports a failed ``write`` as a RuntimeError of its own ("unexpected pos"), raised
    while closing the archive, with the real error as its ``__context__``. Our file objects
    record their own failures (``ours``); an interrupt that landed where they could not record
    it (on entry to ``write``, or in torch's Python code) is found in the context chain, down to
    ``outer``, the exception the caller was already handling, if any; any other error that
    escaped a ``write`` is the context of torch's echo.
    """
    if ours is not None:
        return ours
    seen: BaseException | None = exc
    while seen is not None and seen is not outer:
        if not isinstance(seen, Exception):  # KeyboardInterrupt, SystemExit
            return seen
        seen = seen.__context__
    context = exc.__context__
    if _is_torch_echo(exc) and context is not None and context is not outer:
        return context
    return exc


def _is_torch_echo(exc: BaseException) -> bool:
    """torch's complaint, on closing an archive, that an earlier write had failed."""
    return isinstance(exc, RuntimeError) and "unexpected pos" in str(exc)


@contextlib.contextmanager
def _naming(uri: str, action: str):
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - reraised as the named cause
        raise _named(exc, uri, action)  # noqa: B904 (_named sets the cause)


def _named(
    exc: BaseException, uri: str, action: str, *, hide: BaseException | None = None
) -> BaseException:
    """``exc``, made to name ``uri``: a store error gets it in its message, others a note.

    ``hide``: the exception being handled when ``exc`` is raised, if it is only torch's echo of
    ``exc`` (torch reports a failed write as a RuntimeError of its own), left out of the traceback.
    """
    if hide is not None and hide is not exc:
        exc.__suppress_context__ = True
    if uri in str(exc) or any(uri in note for note in getattr(exc, "__notes__", ())):
        return exc
    if isinstance(exc, StoreError):
        renamed = type(exc)(f"{action} {uri}: {exc}", bucket=exc.bucket, key=exc.key)
        renamed.__cause__ = exc
        renamed.__suppress_context__ = True
        for note in getattr(exc, "__notes__", ()):
            renamed.add_note(note)
        return renamed
    exc.add_note(f"while {action} {uri}")
    return exc
