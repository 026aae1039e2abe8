"""How ``checkpoint.save`` streams: the caller's thread fills parts as ``torch.save`` writes, and
one task in the portal's loop uploads them, a bounded number at a time, then completes or aborts.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ..errors import LoaderError, StoreError
from ..retry import RetryPolicy, call_with_retries
from ..s3.protocol import S3_MAX_PART_SIZE, S3_MAX_PARTS, MultipartStore

T = TypeVar("T")
log = logging.getLogger("loader.checkpoint")

PARTS_PER_SIZE_STEP = 1000  # the part size doubles after every this many parts


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
        """Upload every part handed over, then complete; on any failure abort, then raise. Once
        complete, abort the unfinished uploads of the same key that were open when this began."""
        single = False
        earlier = await self._open_uploads()
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
            await self._abort_earlier(earlier)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abort()
            raise

    async def _open_uploads(self) -> list[str]:
        """Upload ids of unfinished multipart uploads of this very key: what a save killed
        outright (SIGKILL, the OOM killer, preemption) left behind, parts stored and billed out of
        sight. Ctrl-C and errors abort their own; nothing can abort on SIGKILL but the next save."""
        if not isinstance(self.store, MultipartStore):
            return []
        try:
            uploads = await self._retried(self.store.list_multipart_uploads, self.bucket, self.key)
        except StoreError as exc:  # cleanup only: the save goes on
            log.warning("could not look for unfinished uploads of s3://%s/%s: %s", self.bucket, self.key, exc)
            return []
        return [upload_id for key, upload_id in uploads if key == self.key]

    async def _abort_earlier(self, upload_ids: list[str]) -> None:
        """Abort ``upload_ids`` (open before this save began, so not this save's) and say so."""
        if not upload_ids:
            return
        aborted = 0
        for upload_id in upload_ids:
            try:
                await self._retried(self.store.abort_multipart, self.bucket, self.key, upload_id)
                aborted += 1
            except StoreError as exc:  # cleanup only: the checkpoint is saved
                log.warning("could not abort an unfinished upload of s3://%s/%s: %s", self.bucket, self.key, exc)
        log.warning(
            "aborted %d unfinished multipart upload(s) of s3://%s/%s left by an earlier save that was "
            "killed before it could abort (their parts were stored and billed out of sight); a bucket "
            "lifecycle rule AbortIncompleteMultipartUpload cleans up those of keys never saved again "
            "(docs/design/checkpoint.md)", aborted, self.bucket, self.key)

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
