"""The default ``ObjectStore``: aioboto3 (botocore over aiohttp), with a direct transport.

One client per engine, made inside its loop (on first use), pool sized to its concurrency. GETs
and listings skip botocore's request pipeline (``signed_get``) for every endpoint; what that path
cannot serve (a region redirect, an S3 Express directory bucket) is named once and left to botocore;
botocore's retries, checksums and parameter validation are off (``loader.retry`` retries, the
rest costs CPU for nothing on reads). Errors are translated in ``_translate``, worded by
``error_answers`` (docs/design/stores.md).
"""

from __future__ import annotations

import asyncio
import builtins  # list() below is a method: annotations after it name the type this way
import contextlib
import io
import os
import re
import ssl
import sys
import threading
import warnings
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from ..config import S3Config
from ..errors import StoreError, TransientStoreError
from ..lifecycle import LiveObjects
from ..retry import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, RetryPolicy, answered
from ..uri import object_url
from .addressing import NotServed
from .answer_checks import Asked, asked_for, check_head, check_length
from .answer_pace import (
    LISTED_BYTES,
    AnswerTooSlow,
    Pace,
    body_deadline,
    head_deadline,
    paced,
    too_slow_head,
    too_slow_whole,
    within,
)
from .credentials import GivenKeys, credentials_error, no_credentials_found
from .error_answers import (
    at_endpoint,
    broken_framing,
    certificate_rejected,
    error_for_answer,
    failed_mid_request,
    no_credentials,
    plain_http_server,
    target,
    unreachable,
)
from .http1 import ConnectFailed, FramingBroken
from .list_xml import not_a_listing, paged
from .protocol import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ListPage,
    ObjectInfo,
    Pin,
    normalize_etag,
    objects_of,
)
from .signed_get import SignedGetter

# _OURS_AS_THEY_ARE: where a try block runs our own checks (the direct path, a body's length),
# their StoreError is raised as it is (a transient one marked with the endpoint, as
# ``translate_error`` would), never through ``raise self._translate(exc) from exc``: the
# translation returns it unchanged, and an error that is its own cause is a reference cycle
# through its traceback, keeping every frame it passed (up to the user's DataLoader iterator)
# until a garbage collection.
_STREAM_ERRORS = (asyncio.TimeoutError, ConnectionError)  # http1's ResponseBroken too; botocore's: _botocore


class _NeverRaised(Exception):
    """A class no error is an instance of."""


class _NotImported:
    """``botocore.exceptions`` before botocore is imported: no error is one of its classes yet."""

    def __getattr__(self, name: str) -> type[Exception]:
        return _NeverRaised


def _botocore() -> Any:
    """``botocore.exceptions``, looked up where an error is translated, not imported: a store that
    GETs and lists only through ``SignedGetter`` never imports botocore (~700 objects and a few ms
    before the first sample), and then no error can be one of its classes."""
    return sys.modules.get("botocore.exceptions") or _NotImported()

_SAID: set[tuple[str, str, str]] = set()  # fallbacks already named in this process


class FallbackWarning(RuntimeWarning):
    """Requests for a bucket go through botocore's pipeline, not the signed path; says why."""


_CONDITION_PARAMS = {"If-Match": "IfMatch", "If-None-Match": "IfNoneMatch"}  # botocore's names
_NOT_MODIFIED = ("304", "NotModified")  # the code botocore gives a 304 answer (it has no body)


class _SessionCache:
    """aioboto3 sessions by credentials and region, lent to one store opening at a time.

    A new session loads botocore's service data again, tens of milliseconds of CPU that every
    engine (each DataLoader worker, each epoch) would pay; a client from a warm session is
    an order of magnitude cheaper. botocore sessions are not thread-safe, so a session is lent to one
    opening at a time; one that finds it lent out (another engine thread, or another store
    opening in the same event loop, where waiting on a lock would block the loop) takes a
    fresh session instead: never a wait. A forked child starts with an empty cache and a fresh
    lock, rather than trust a session or a lock that a parent thread held at the fork.
    """

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str | None, ...], Any] = {}

    @contextlib.contextmanager
    def borrow(self, config: S3Config) -> Iterator[Any]:
        _session_caches.add(self)  # on use, not at import; again in a forked child
        if not self._lock.acquire(blocking=False):
            yield _new_session(config)
            return
        try:
            key = _session_key(config)
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = _new_session(config)
            yield session
        finally:
            self._lock.release()


_session_caches: LiveObjects[_SessionCache] = LiveObjects(in_child=_SessionCache._forget)


def _session_key(config: S3Config) -> tuple[str | None, ...]:
    """What a session's credentials depend on: the config's keys and profile, and, when the
    chain is to find them, the AWS_* variables it reads (tests and tools change them)."""
    key = (config.access_key_id, config.secret_access_key, config.session_token, config.region,
           config.profile)
    if config.has_credentials:
        return key
    return key + tuple(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("AWS_"))


def _new_session(config: S3Config) -> Any:
    import aioboto3  # imported here: it is slow to import and only the engine thread needs it

    # Keys left as None make aiobotocore run botocore's chain (environment, profile files,
    # credential_process, SSO, web identity, container, instance metadata) on first use.
    return aioboto3.Session(
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        aws_session_token=config.session_token,
        region_name=config.region,
        profile_name=config.profile,
    )


_SESSIONS = _SessionCache()


class Aioboto3Store:
    """``ObjectStore`` over one aiobotocore S3 client; build it with ``await Aioboto3Store.open()``."""

    def __init__(
        self,
        client: Any,
        stack: contextlib.AsyncExitStack,
        endpoint: str,
        getter: SignedGetter | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        self._read_timeout = read_timeout  # and the pace every answer keeps (answer_pace)
        self._head = head_deadline(read_timeout, connect_timeout)  # connecting included
        self._made_client = client  # or an async factory of it: made on first use
        self._client_lock = asyncio.Lock()
        self._stack = stack
        self._endpoint = endpoint
        self._getter = getter  # GETs without botocore's per-request pipeline, where it applies
        self._to_botocore: set[str] = set()  # buckets the getter cannot serve (named once)

    async def _botocore(self) -> Any:
        """The aiobotocore client, made on first use: a store that only GETs and lists through
        ``SignedGetter`` never imports aiobotocore nor builds a client (a cost paid before the first sample)."""
        if callable(self._made_client):
            async with self._client_lock:
                if callable(self._made_client):
                    self._made_client = await self._made_client()
        return self._made_client

    @classmethod
    async def open(
        cls,
        config: S3Config,
        *,
        max_connections: int = 64,
        retry: RetryPolicy | None = None,
        direct_gets: bool = True,
    ) -> Aioboto3Store:
        """Create the store inside the running event loop (the botocore client when first needed).

        ``direct_gets`` sends GETs and listings through ``SignedGetter`` (a third of botocore's
        CPU per request); ``False`` keeps every request on botocore.
        """
        retry = retry or RetryPolicy()
        # Plain-http endpoints have nothing to verify: say so, and aiobotocore then builds no
        # SSL context at all (it otherwise does, per engine, even for http). Besides the CPU,
        # that keeps OpenSSL out of forked DataLoader workers, where a lock inherited from a
        # parent thread can hang SSL_CTX_new (seen in the benchmark with forked workers).
        plain_http = (config.endpoint_url or "").startswith("http://")
        stack = contextlib.AsyncExitStack()

        async def make_client() -> Any:
            from aiobotocore.config import AioConfig  # slow to import: only when needed

            boto_config = AioConfig(
                max_pool_connections=max(1, max_connections),
                connect_timeout=retry.connect_timeout,
                read_timeout=retry.read_timeout,
                # total_max_attempts counts the first try; botocore reads a bare "max_attempts" as
                # *retries* (+1), which silently retried 503/5xx/resets once below loader.retry
                retries={"total_max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path" if config.path_style else config.addressing_style},
                parameter_validation=False,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                tcp_keepalive=True,
            )
            with _SESSIONS.borrow(config) as session:
                await _credentials(session, config)
                return await stack.enter_async_context(
                    session.client(
                        "s3", endpoint_url=config.endpoint_url, config=boto_config,
                        verify=False if plain_http else config.verify,
                    )
                )

        try:
            if not direct_gets:
                return cls(await make_client(), stack, config.endpoint_url or "AWS S3",
                           read_timeout=retry.read_timeout, connect_timeout=retry.connect_timeout)
            frozen = _given_credentials(config) or _found_credentials(config)
            if frozen is None:
                with _SESSIONS.borrow(config) as session:
                    credentials = await _credentials(session, config)
                frozen = _keep_if_static(config, credentials)
            if frozen is None:

                async def frozen() -> Any:
                    return await credentials.get_frozen_credentials()  # refreshes temporary ones

            getter = SignedGetter(config, frozen, max_connections=max_connections, retry=retry)
            stack.push_async_callback(getter.aclose)
        except BaseException:
            await stack.aclose()
            raise
        return cls(make_client, stack, config.endpoint_url or "AWS S3", getter,
                   read_timeout=retry.read_timeout, connect_timeout=retry.connect_timeout)

    def _direct(self, bucket: str) -> SignedGetter | None:
        """The signed path for ``bucket``'s requests, or None where botocore's serves them."""
        getter = self._getter
        if getter is None or bucket in self._to_botocore:
            return None
        reason = getter.serves(bucket)
        if reason is None:
            return getter
        self._leave_to_botocore(bucket, reason)
        return None

    def _leave_to_botocore(self, bucket: str, reason: str) -> None:
        """Send ``bucket``'s requests through botocore from now on, and say why, once a process."""
        self._to_botocore.add(bucket)
        said = (self._endpoint, bucket, reason)
        if said not in _SAID:
            _SAID.add(said)
            warnings.warn(f"s3://{bucket} at {self._endpoint}: requests go through botocore's "
                          f"request pipeline, not the signed http1 path, because of {reason}; "
                          "expect about twice the CPU per request", FallbackWarning, stacklevel=2)

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return objects_of(self.list_pages(bucket, prefix))

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
        """``ListObjectsV2`` pages, resumed at ``token`` (S3's continuation token) or started
        after ``start_after``."""
        async def fetch(token: str | None) -> ListPage:
            after = None if token else start_after
            try:
                getter = self._direct(bucket)
                if getter is not None:
                    try:
                        return await getter.list_page(bucket, prefix, token, delimiter, page_size, after)
                    except NotServed as exc:
                        self._leave_to_botocore(bucket, exc.reason)
                return await self._botocore_page(bucket, prefix, token, delimiter, page_size, after)
            except StoreError as exc:  # ours already (see _OURS_AS_THEY_ARE)
                at_endpoint(exc, self._endpoint)
                raise
            except Exception as exc:
                raise self._translate(exc, bucket, prefix, listing=True) from exc

        return paged(fetch, bucket=bucket, prefix=prefix, token=token)

    async def _botocore_page(
        self, bucket: str, prefix: str, token: str | None, delimiter: str | None, page_size: int,
        start_after: str | None = None,
    ) -> ListPage:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": page_size}
        if token:
            kwargs["ContinuationToken"] = token
        elif start_after:
            kwargs["StartAfter"] = start_after
        if delimiter:
            kwargs["Delimiter"] = delimiter
        # botocore reads a page whole: one deadline, for a page of page_size keys at most
        allowed = self._head + body_deadline(self._read_timeout,
                                                                    page_size * LISTED_BYTES)
        page = await within(allowed, (await self._botocore()).list_objects_v2(**kwargs),
                            lambda: AnswerTooSlow(f"the listing page was not whole after {allowed:g} s"))
        answered(self._endpoint)
        objects = [ObjectInfo(item["Key"], int(item["Size"]), normalize_etag(item.get("ETag")))
                   for item in page.get("Contents", ())]
        prefixes = [item["Prefix"] for item in page.get("CommonPrefixes", ())]
        next_token = page.get("NextContinuationToken")
        if "IsTruncated" not in page:  # botocore read a 200 whose body is no ListBucketResult
            raise not_a_listing(bucket, prefix, token, "no IsTruncated in it")
        if page["IsTruncated"] and (not next_token or not (objects or prefixes)):
            raise not_a_listing(bucket, prefix, token, "IsTruncated is true with no "
                                + ("NextContinuationToken" if not next_token else "keys on the page"))
        return ListPage(objects, prefixes, next_token if page["IsTruncated"] else None)

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        return _sent(await self._read(bucket, key, None, pin))

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        if end is not None and end <= start:
            return b""
        return _sent(await self._read(bucket, key, _range_header(start, end), pin))

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        byte_range = None if start == 0 and end is None else _range_header(start, end)
        return await self._read(bucket, key, byte_range, pin, {"If-None-Match": f'"{etag}"'})

    async def _read(
        self, bucket: str, key: str, byte_range: str | None, pin: Pin | None,
        conditions: dict[str, str] | None = None,
    ) -> bytes | None:
        """The bytes, or None where ``If-None-Match`` was answered 304 Not Modified."""
        if pin is not None and pin.etag is not None:
            conditions = {**(conditions or {}), "If-Match": f'"{pin.etag}"'}
        getter = self._direct(bucket)
        if getter is not None:
            try:
                data, etag = await getter.get(bucket, key, byte_range, conditions)
            except NotServed as exc:
                self._leave_to_botocore(bucket, exc.reason)
            except StoreError as exc:  # ours already (see _OURS_AS_THEY_ARE)
                at_endpoint(exc, self._endpoint)
                raise
            except Exception as exc:
                raise self._translate(exc, bucket, key) from exc
            else:
                if pin is not None and data is not None:
                    pin.observe(etag, bucket, key)
                return data
        kwargs = {"Bucket": bucket, "Key": key}
        if byte_range:
            kwargs["Range"] = byte_range
        for header, name in _CONDITION_PARAMS.items():
            if conditions and header in conditions:
                kwargs[name] = conditions[header]
        try:
            client, read_timeout = await self._botocore(), self._read_timeout
            response = await within(self._head, client.get_object(**kwargs),
                                    lambda: too_slow_head(self._head))
            answered(self._endpoint)
            body = response["Body"]
            async with body:  # releases the connection even on error (its __aenter__ returns
                # the raw aiohttp response, so keep the StreamingBody, which checks the length)
                asked = asked_for(byte_range, conditions)
                expected = _checked_head(response, asked, bucket, key)
                data = await _paced_body(body, expected, read_timeout)  # short bodies raise
                check_length(len(data), expected, asked, bucket, key)
        except StoreError as exc:  # ours already (see _OURS_AS_THEY_ARE)
            at_endpoint(exc, self._endpoint)
            raise
        except Exception as exc:
            if conditions and "If-None-Match" in conditions and _error_code(exc) in _NOT_MODIFIED:
                return None
            raise self._translate(exc, bucket, key) from exc
        if pin is not None:
            pin.observe(response.get("ETag"), bucket, key)
        return data

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        if end is not None and end <= start:
            return  # nothing to read (as get_range: no request)
        if_match = None if pin is None else pin.if_match()
        byte_range = _range_header(start, end) if start or end is not None else None
        pieces = self._pieces(bucket, key, byte_range, chunk_size, if_match)
        expected, received, first = -1, 0, True
        try:
            async for chunk, expected, etag in pieces:  # noqa: B007 (expected is read after the loop)
                if first and pin is not None:
                    pin.observe(etag, bucket, key)  # before the first byte reaches the caller
                first = False
                received += len(chunk)
                yield chunk
        finally:  # a consumer that stops early releases the connection now, not at GC
            await pieces.aclose()
        if expected >= 0 and received < expected:
            raise at_endpoint(TransientStoreError(
                f"{object_url(bucket, key)}: body ended after {start + received} bytes, "
                f"{expected - received} short of its Content-Length",
                bucket=bucket,
                key=key,
            ), self._endpoint)

    async def _pieces(
        self, bucket: str, key: str, byte_range: str | None, chunk_size: int, if_match: str | None
    ) -> AsyncGenerator[tuple[bytes, int, str | None], None]:
        """The body's pieces through the signed path, else botocore's (a redirect comes before
        any piece, so a fallback repeats nothing)."""
        getter = self._direct(bucket)
        if getter is not None:
            pieces = self._direct_stream(getter, bucket, key, byte_range, chunk_size, if_match)
            try:
                async for piece in pieces:
                    yield piece
                return
            except NotServed as exc:
                self._leave_to_botocore(bucket, exc.reason)
            finally:
                await pieces.aclose()
        fallback = self._botocore_stream(bucket, key, byte_range, chunk_size, if_match)
        try:
            async for piece in fallback:
                yield piece
        finally:
            await fallback.aclose()

    async def _direct_stream(
        self, getter: SignedGetter, bucket: str, key: str, byte_range: str | None, chunk_size: int,
        if_match: str | None,
    ) -> AsyncGenerator[tuple[bytes, int, str | None], None]:
        conditions = None if if_match is None else {"If-Match": if_match}
        pieces = getter.stream(bucket, key, byte_range, chunk_size, conditions)
        try:
            async for chunk, length, etag in pieces:
                yield chunk, -1 if length is None else length, etag
        except NotServed:
            raise
        except StoreError as exc:  # ours already (see _OURS_AS_THEY_ARE)
            at_endpoint(exc, self._endpoint)
            raise
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc
        finally:
            await pieces.aclose()

    async def _botocore_stream(
        self, bucket: str, key: str, byte_range: str | None, chunk_size: int, if_match: str | None
    ) -> AsyncGenerator[tuple[bytes, int, str | None], None]:
        kwargs = {"Bucket": bucket, "Key": key}
        if byte_range:
            kwargs["Range"] = byte_range
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        read_timeout = self._read_timeout
        try:
            response = await within(self._head,
                                    (await self._botocore()).get_object(**kwargs),
                                    lambda: too_slow_head(self._head))
            answered(self._endpoint)
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc
        etag = response.get("ETag")
        body = response["Body"]
        async with body:
            asked = asked_for(kwargs.get("Range"), None if if_match is None else {"If-Match": if_match})
            try:
                due = _checked_head(response, asked, bucket, key)
            except StoreError as exc:  # ours (see _OURS_AS_THEY_ARE)
                at_endpoint(exc, self._endpoint)
                raise
            expected = -1 if due is None else due
            pace = Pace(read_timeout)  # the consumer's own time between pieces is not counted
            while True:
                try:
                    chunk = await paced(pace, body.read(chunk_size))
                    pace.received += len(chunk)
                except Exception as exc:
                    raise self._translate(exc, bucket, key) from exc
                if not chunk:
                    break
                yield chunk, expected, etag

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        try:
            await (await self._botocore()).put_object(Bucket=bucket, Key=key, Body=data)
            answered(self._endpoint)
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc

    # ------------------------------------------------------------- MultipartStore (protocol.py)

    async def create_multipart(self, bucket: str, key: str) -> str:
        try:
            response = await (await self._botocore()).create_multipart_upload(Bucket=bucket, Key=key)
            answered(self._endpoint)
        except Exception as exc:
            raise self._translate_multipart(exc, bucket, key, None) from exc
        return str(response["UploadId"])

    async def upload_part(
        self, bucket: str, key: str, upload_id: str, part_number: int, data: bytes | bytearray
    ) -> str:
        body = _PartBody(data if isinstance(data, bytes) else bytes(data))
        try:
            response = await (await self._botocore()).upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=part_number, Body=body
            )
        except Exception as exc:
            raise self._translate_multipart(exc, bucket, key, upload_id) from exc
        return str(response["ETag"])

    async def complete_multipart(
        self, bucket: str, key: str, upload_id: str, parts: builtins.list[tuple[int, str]]
    ) -> None:
        listed = [{"PartNumber": number, "ETag": etag} for number, etag in parts]
        try:  # botocore turns a "200 OK with an error in the body" into a ClientError here
            await (await self._botocore()).complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": listed}
            )
        except Exception as exc:
            raise self._translate_multipart(exc, bucket, key, upload_id) from exc

    async def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            await (await self._botocore()).abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            if _error_code(exc) == "NoSuchUpload":
                return  # already aborted or completed: nothing is left to clean up
            raise self._translate_multipart(exc, bucket, key, upload_id) from exc

    async def list_multipart_uploads(
        self, bucket: str, prefix: str = ""
    ) -> builtins.list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            try:
                page = await (await self._botocore()).list_multipart_uploads(
                    Bucket=bucket, Prefix=prefix, **markers
                )
            except Exception as exc:
                raise self._translate(exc, bucket, prefix, listing=True) from exc
            found.extend((str(u["Key"]), str(u["UploadId"])) for u in page.get("Uploads", ()))
            key_marker = page.get("NextKeyMarker")
            if not page.get("IsTruncated") or not key_marker:
                return found
            markers = {"KeyMarker": key_marker}
            if page.get("NextUploadIdMarker"):
                markers["UploadIdMarker"] = page["NextUploadIdMarker"]

    def _translate_multipart(
        self, exc: BaseException, bucket: str, key: str, upload_id: str | None
    ) -> BaseException:
        """``translate_error``, except that a vanished upload is not a missing key."""
        if _error_code(exc) == "NoSuchUpload":
            return StoreError(
                f"s3://{bucket}/{key}: multipart upload {upload_id!r} no longer exists at "
                f"{self._endpoint} (aborted, completed, or expired by a lifecycle rule); "
                "start the upload again",
                bucket=bucket, key=key,
            )
        return self._translate(exc, bucket, key)

    async def aclose(self) -> None:
        await self._stack.aclose()

    def _translate(
        self, exc: BaseException, bucket: str, key: str, *, listing: bool = False
    ) -> BaseException:
        """Map a botocore/aiohttp error to ``loader.errors`` with a message that gives advice."""
        return translate_error(exc, bucket=bucket, key=key, endpoint=self._endpoint, listing=listing)


def _aiohttp_errors() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """aiohttp's TLS, connect, mid-request and unparsable-answer error classes, where botocore's
    path imported it; empty where nothing did.

    The direct transport needs no aiohttp, and importing it costs ~90 ms before a first sample
    (its connector builds SSL contexts at import), so this module does not import it: an
    aiohttp error can only come from a store that did."""
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is None:
        return (), (), (), ()
    return ((aiohttp.ClientSSLError,), (aiohttp.ClientConnectorError,),
            (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError),
            (aiohttp.ClientResponseError,))  # what its parser refused (botocore never raises for status)


def translate_error(
    exc: BaseException, *, bucket: str, key: str, endpoint: str, listing: bool = False
) -> BaseException:
    """The one place where aiobotocore's and aiohttp's errors become ours (wording: ``error_answers``);
    a transient one names ``endpoint`` once retrying it gives up."""
    return at_endpoint(_translated(exc, bucket=bucket, key=key, endpoint=endpoint, listing=listing), endpoint)


def _translated(
    exc: BaseException, *, bucket: str, key: str, endpoint: str, listing: bool = False
) -> BaseException:
    if isinstance(exc, (StoreError, asyncio.CancelledError)):
        return exc
    bce = _botocore()
    if isinstance(exc, bce.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        meta = exc.response.get("ResponseMetadata", {})
        status = int(meta.get("HTTPStatusCode", 0) or 0)
        return error_for_answer(code, status, bucket=bucket, key=key, endpoint=endpoint,
                                listing=listing, headers=meta.get("HTTPHeaders", {}).get)
    aiohttp_tls, aiohttp_connect, aiohttp_stream, aiohttp_unparsable = _aiohttp_errors()
    inner: Any = exc.kwargs.get("error") if isinstance(exc, bce.HTTPClientError) else None
    if isinstance(inner, aiohttp_unparsable):  # an answer that broke HTTP/1.1 (a status line,
        # a length, a chunk size): aiohttp closes such a connection
        return broken_framing(bucket, key, " ".join(str(getattr(inner, "message", inner)).split()),
                              listing=listing)
    if isinstance(exc, (bce.SSLError, ssl.SSLError, *aiohttp_tls)):
        return _tls_error(exc, bucket=bucket, key=key, endpoint=endpoint, listing=listing)
    if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError)):
        return unreachable(endpoint, bucket, key, listing=listing)
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return no_credentials()
    if isinstance(exc, aiohttp_connect):
        os_error: Any = getattr(exc, "os_error", None)  # aiohttp's ClientConnectorError has one
        return unreachable(endpoint, bucket, key, listing=listing,
                           reason=(os_error and os_error.strerror) or str(exc))
    if isinstance(exc, ConnectFailed):
        return unreachable(endpoint, bucket, key, listing=listing, reason=exc.reason)
    if isinstance(exc, FramingBroken):
        return broken_framing(bucket, key, str(exc), listing=listing)
    if isinstance(exc, (*_STREAM_ERRORS, bce.ResponseStreamingError, bce.IncompleteReadError,
                        bce.ReadTimeoutError, bce.ConnectionClosedError, *aiohttp_stream)):
        # with what it said, where it said anything ("no byte received for 30 s")
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return failed_mid_request(bucket, key, detail, listing=listing)
    return StoreError(f"{target(bucket, key, listing=listing)}: unexpected "
                      f"{type(exc).__name__}: {exc}", bucket=bucket, key=key)


def _given_credentials(config: S3Config) -> Any:
    """For keys given in the config: an async function that returns them, with no boto3
    session (whose import and setup cost time at start); None when they are to be looked up."""
    if not config.has_credentials:
        return None
    return _returning(GivenKeys(config.access_key_id or "", config.secret_access_key or "",
                                config.session_token))


def _returning(keys: GivenKeys) -> Any:
    """An async function that returns ``keys``: what ``SignedGetter`` awaits for its credentials."""

    async def fixed() -> Any:
        return keys

    return fixed


# Keys the credential chain found that never expire (a profile's, the environment's), by what the
# chain read (``_session_key``). Kept through a fork, unlike the sessions: a DataLoader worker then
# signs with the keys its parent found rather than run the chain again, whose container provider
# builds an SSLContext, and OpenSSL can hang in a forked child doing so (seen under load: a worker
# stuck in SSLContext.__new__ for good). Temporary credentials are not kept: each process
# refreshes its own.
_FOUND_KEYS: dict[tuple[str | None, ...], GivenKeys] = {}


def _found_credentials(config: S3Config) -> Any:
    """Static keys the chain found for ``config`` earlier in this process or its parent, as an
    async function that returns them; None when there are none."""
    keys = _FOUND_KEYS.get(_session_key(config))
    return None if keys is None else _returning(keys)


def _keep_if_static(config: S3Config, credentials: Any) -> Any:
    """Keep ``credentials`` for later openings when they never expire (botocore's refreshable
    credentials have ``refresh_needed``) and return them as ``_found_credentials`` does."""
    if hasattr(credentials, "refresh_needed"):
        return None
    keys = _FOUND_KEYS[_session_key(config)] = GivenKeys(credentials.access_key, credentials.secret_key,
                                                         credentials.token)
    return _returning(keys)


async def _credentials(session: Any, config: S3Config) -> Any:
    """The session's credentials (resolved once per session, refreshed by aiobotocore), or an
    error that names what was tried or which source failed."""
    try:
        credentials = await session.get_credentials()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise credentials_error(config, exc) from exc
    if credentials is None:
        raise no_credentials_found(config)
    return credentials


# OpenSSL's words for a TLS handshake answered in plain HTTP (versions differ)
_PLAIN_HTTP = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure",
               "packet length too long", "HTTP_REQUEST")
_VERIFY_REASON = re.compile(r"certificate verify failed: ([^(\]]+)")


def _tls_error(
    exc: BaseException, *, bucket: str, key: str, endpoint: str, listing: bool
) -> BaseException:
    """A failed TLS handshake, by OpenSSL's message: a plain-http server, or a certificate
    that did not verify (botocore wraps it in its ``SSLError``, aiohttp in its own)."""
    text = str(exc)
    if any(marker in text for marker in _PLAIN_HTTP):
        return plain_http_server(endpoint, bucket, key, listing=listing)
    reason = _VERIFY_REASON.search(text)
    if reason is not None or "CERTIFICATE_VERIFY_FAILED" in text:
        return certificate_rejected(endpoint, bucket, key,
                                    reason.group(1).strip() if reason else "verify failed",
                                    listing=listing)
    return failed_mid_request(bucket, key, f"TLS error: {text[:200]}", listing=listing)


class _PartBody(io.BytesIO):
    """A part's body that reaches the socket without a whole copy.

    A plain ``bytes`` body is copied whole on its way out (aiohttp joins it with the headers on
    Python < 3.12.9, and asyncio buffers whatever the socket did not take at once); a
    ``BytesIO`` is sent in small chunks, but aiohttp sizes it with ``getbuffer()``, which copies
    a buffer shared with ``bytes``. This one answers ``getbuffer()`` with a read-only view of
    the bytes it shares: one part in flight then costs the part, not two or three of it.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._data = data

    def getbuffer(self) -> memoryview:
        return memoryview(self._data)


def _checked_head(response: dict[str, Any], asked: Asked, bucket: str, key: str) -> int | None:
    """botocore's answer held to the request (``answer_checks``, as every transport's is): the
    body's length it must have."""
    meta = response.get("ResponseMetadata", {})
    headers = meta.get("HTTPHeaders", {})  # botocore's names are in lower case
    return check_head(int(meta.get("HTTPStatusCode", 200)), headers.get, asked, bucket, key)


async def _paced_body(body: Any, length: int | None, read_timeout: float) -> bytes:
    """botocore's body, read whole at the pace every answer keeps (``answer_pace``): one
    deadline where its length is known, else one per piece."""
    if length is not None:
        return bytes(await within(body_deadline(read_timeout, length), body.read(),
                                  lambda: too_slow_whole(read_timeout, length)))
    pace, pieces = Pace(read_timeout), []
    while piece := await paced(pace, body.read(DEFAULT_CHUNK_SIZE)):
        pace.received += len(piece)
        pieces.append(piece)
    return b"".join(pieces)


def _error_code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore ``ClientError`` ('' for anything else)."""
    if isinstance(exc, _botocore().ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _sent(data: bytes | None) -> bytes:
    """A read's bytes: only a read with ``If-None-Match`` can come back without any."""
    if data is None:
        raise StoreError("a 304 Not Modified answer to a read that sent no If-None-Match")
    return data


def _range_header(start: int, end: int | None) -> str:
    if start < 0:
        raise ValueError(f"range start {start!r} must not be negative")
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
