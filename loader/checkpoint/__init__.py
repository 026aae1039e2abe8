"""Checkpoints straight to and from S3: ``torch.save`` into a multipart upload, ``torch.load``
from parallel ranged GETs, with neither a local file nor a whole copy of the bytes in memory.

    from loader import checkpoint
    checkpoint.save(model.state_dict(), "s3://bucket/ckpt/step-1000.pt")
    state = checkpoint.load("s3://bucket/ckpt/step-1000.pt", map_location="cpu")

Memory is bounded by ``part_size`` x ``parts_inflight``; a failed save aborts its upload, and a
load reads one version (``If-Match``) or fails. How and why: docs/design/checkpoint.md.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Awaitable, Callable
from typing import IO, Any, cast

import torch
from anyio.from_thread import start_blocking_portal

from ..checks import check_int
from ..config import S3Config
from ..datasets.groups import Limits, Store
from ..errors import ConfigError
from ..retry import RetryPolicy
from ..s3 import ObjectStore, Pin, StoreSpec
from ..s3.protocol import S3_MAX_PART_SIZE, S3_MIN_PART_SIZE, MultipartStore
from ..uri import parse_s3_uri
from .failures import _cause, _named, _naming
from .reader import _listed, _RangeReader
from .upload import _abandon, _PartWriter, _Upload

__all__ = ["DEFAULT_LOAD_PART_SIZE", "DEFAULT_PART_SIZE", "DEFAULT_PARTS_INFLIGHT", "load", "save"]

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_LOAD_PART_SIZE = 8 << 20  # a response in flight costs twice its size (docs/design/checkpoint.md)
DEFAULT_PARTS_INFLIGHT = 4
_PORTAL_NAME = "loader-checkpoint"

StoreArg = Store | str | Callable[[], Awaitable[ObjectStore]] | None
_NOT_GIVEN: Any = object()  # a deprecated keyword left out


def save(
    obj: Any,
    uri: str,
    *,
    config: S3Config | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    limits: Limits | None = None,
    store: StoreArg = None,
    parts_inflight: int = _NOT_GIVEN,
    retry: RetryPolicy | None = _NOT_GIVEN,
) -> None:
    """``torch.save(obj)`` into the object at ``uri`` (``s3://bucket/key``), streamed in parts.

    ``part_size`` bytes per part (S3 needs at least 5 MiB for every part but the last), up to
    ``limits=Limits(concurrency=)`` uploading at once (default 4); memory beyond ``obj`` stays
    within ``(concurrency + 1) * part_size`` (``Limits(memory=)`` lowers the concurrency to fit).
    The object appears atomically when the upload completes; on any failure,
    ``KeyboardInterrupt`` included, the upload is aborted and the error names ``uri``.
    ``store=Store(backend=, retry=)`` as for the datasets (a backend's name or an async store
    factory alone is the short form); ``"obstore"`` has no multipart upload and saves through
    aioboto3 (docs/design/checkpoint.md). ``parts_inflight=`` and ``retry=`` are the deprecated
    spellings of ``limits=Limits(concurrency=)`` and ``store=Store(retry=)``.
    """
    bucket, key, parts_inflight, policy, backend, factory = _prepare(
        uri, config, limits, store, parts_inflight, retry, part_size, per_part=1, spare=1)
    outer = sys.exc_info()[1]  # e.g. the KeyboardInterrupt a caller saves on: not ours
    with start_blocking_portal(name=_PORTAL_NAME) as portal:
        with _naming(uri, "saving checkpoint to"):
            opened = portal.call(factory)
        try:
            _check_multipart(opened, part_size, backend)
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
    limits: Limits | None = None,
    part_size: int = DEFAULT_LOAD_PART_SIZE,
    parts_inflight: int = _NOT_GIVEN,
    retry: RetryPolicy | None = _NOT_GIVEN,
) -> Any:
    """``torch.load`` the object at ``uri``, read with up to ``limits=Limits(concurrency=)``
    ranged GETs at once (default 4).

    ``map_location`` and ``weights_only`` go to ``torch.load``. Tensor bytes go straight from the
    responses into the tensors, ``part_size`` bytes per GET: peak memory is the result plus about
    ``3 * concurrency * part_size`` (docs/design/checkpoint.md; ``Limits(memory=)`` lowers the
    concurrency to fit); no temporary file is written. A missing object raises
    ``NoSuchKeyError``, a missing bucket ``NoSuchBucketError``, both naming ``uri``.
    ``store=Store(backend=, retry=)`` as in ``save``; ``"obstore"`` reads through aioboto3
    (docs/design/checkpoint.md). ``parts_inflight=`` and ``retry=`` are deprecated as in ``save``.
    """
    bucket, key, parts_inflight, policy, _, factory = _prepare(
        uri, config, limits, store, parts_inflight, retry, part_size, per_part=3, spare=0)
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



def _prepare(
    uri: str, config: S3Config | None, limits: Limits | None, store: StoreArg, parts_inflight: int,
    retry: RetryPolicy | None, part_size: int, *, per_part: int, spare: int,
) -> tuple[str, str, int, RetryPolicy, StoreArg, Callable[[], Awaitable[Any]]]:
    """Everything a ``save`` or ``load`` settles before any I/O: the object, the parts in
    flight, the retry policy, the backend asked for and the factory that opens it. Parts and
    retries come from the option groups the datasets take (``Limits``, ``Store``) or the
    deprecated flat keywords (which warn and still win); memory is about ``(per_part * parts +
    spare) * part_size``. Every backend opens as aioboto3 (obstore has no multipart upload)."""
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        raise ConfigError(
            f"{uri!r} names no object; a checkpoint URI ends in a key, "
            "e.g. 's3://bucket/ckpt/step-1000.pt'"
        )
    if limits is not None and not isinstance(limits, Limits):
        raise ConfigError(f"limits={limits!r} must be a loader.Limits(concurrency=..., memory=...)")
    group = store if isinstance(store, Store) else Store(backend=store)
    if group.cache is not None:
        raise ConfigError(f"store=Store(cache={group.cache!r}): checkpoints are not cached; leave cache out")
    check_int("part_size", part_size, minimum=1, maximum=S3_MAX_PART_SIZE,
              must=f"an integer number of bytes from 1 to {S3_MAX_PART_SIZE} (5 GiB); S3 needs at "
                   f"least 5 MiB (default {DEFAULT_PART_SIZE})")
    parts = DEFAULT_PARTS_INFLIGHT
    if limits is not None and limits.concurrency is not None:
        parts = limits.concurrency
    if limits is not None and limits.memory is not None:
        fit = (limits.memory // part_size - spare) // per_part
        if fit < 1:
            raise ConfigError(
                f"Limits(memory={limits.memory!r}) holds no part of part_size={part_size!r} in flight "
                f"(it needs about {(per_part + spare) * part_size} bytes); give more memory or a smaller part_size")
        parts = min(parts, fit)
    if parts_inflight is not _NOT_GIVEN:
        warnings.warn("parts_inflight= is deprecated and will be removed in the next release: write "
                      "limits=Limits(concurrency=...)", DeprecationWarning, stacklevel=3)
        parts = parts_inflight
    policy = group.retry
    if retry is not _NOT_GIVEN:
        warnings.warn("retry= is deprecated and will be removed in the next release: write "
                      "store=Store(retry=...)", DeprecationWarning, stacklevel=3)
        policy = retry or RetryPolicy()
    check_int("parts_inflight", parts, minimum=1,
              must=f"a positive integer (default {DEFAULT_PARTS_INFLIGHT})")
    factory = StoreSpec.of(group.backend, config).opener(max_connections=parts + 1, retry=policy,
                                                          backend="aioboto3")
    return bucket, key, parts, policy, group.backend, factory


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
