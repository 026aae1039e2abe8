"""The native ``ObjectStore``: obstore (Rust ``object_store`` over reqwest/hyper, signing in Rust).

Why: botocore builds, signs and parses every request in Python; obstore does it natively and
hands Python one buffer per response, for a fraction of the client CPU per GET. Choose it with
``store="obstore"`` (extra ``obstore``). ``S3Config`` is its only source of settings (never the
``AWS_*`` environment obstore would read), its own retries are off (``loader.retry`` retries),
and it does not survive ``fork``: ``open()`` refuses in a child forked after a request.
Listings go through this package's own lister, which checks every page (object_store shows none).
How each part is wired, and why: docs/design/obstore.md.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import timedelta
from typing import Any, NamedTuple

import obstore
from obstore import exceptions as obe
from obstore.store import S3Store

from ..checks import check_int
from ..config import S3Config
from ..errors import (
    ConfigError,
    InvalidRangeError,
    StoreError,
    TransientStoreError,
)
from ..retry import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, RetryPolicy, answered
from ..uri import object_url
from .answer_checks import Asked, asked_for, bad_answer, check_length, check_span
from .answer_pace import (
    AnswerTooSlow,
    Pace,
    body_deadline,
    head_deadline,
    paced,
    too_slow_head,
    too_slow_whole,
    within,
)
from .credentials import BotocoreCredentialProvider, resolve_credentials
from .error_answers import (
    DENIED_CODES,
    at_endpoint,
    certificate_rejected,
    error_for_answer,
    failed_mid_request,
    no_credentials,
    plain_http_server,
    target,
    unreachable,
)
from .protocol import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ListPage,
    ObjectInfo,
    Pin,
    normalize_etag,
    objects_of,
)

__all__ = ["ObstoreStore", "forked_after_use", "translate_error"]


# S3 error codes that say what happened even when object_store's text carries no status
_ANSWERED_WITHOUT_STATUS = {"NoSuchBucket", "NoSuchKey", "NotFound", "InvalidRange"} | DENIED_CODES
_CERT_REASONS = {
    "UnknownIssuer": "signed by a CA that is not trusted",
    "NotValidForName": "not issued for this host name",
    "Expired": "expired",
    "NotValidYet": "not valid yet",
    "Revoked": "revoked",
    "BadSignature": "bad signature",
    "CaUsedAsEndEntity": "a CA certificate used as the server's own certificate",
}
_TO_THE_END = 1 << 62  # a range end past any object: S3 clips it to the object's size

# pid of the process whose tokio runtime our requests started (None: no request made yet)
_runtime_pid: int | None = None


def forked_after_use() -> bool:
    """Whether this process was forked from one in which this backend already made requests.

    obstore's tokio runtime is process-global and its worker threads do not survive ``fork()``:
    every request in such a child would wait forever. ``ObstoreStore.open()`` refuses then; a
    caller that wants a fallback (e.g. to aioboto3 in forked DataLoader workers) can ask first.
    """
    return _runtime_pid is not None and _runtime_pid != os.getpid()


class ObstoreStore:
    """``ObjectStore`` over obstore's ``S3Store``s; build it with ``await ObstoreStore.open()``."""

    def __init__(self, options: dict[str, Any], *, endpoint: str, custom_endpoint: str | None,
                 virtual_host: bool, max_connections: int,
                 read_timeout: float = DEFAULT_READ_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 listing: Callable[[], Awaitable[Any]] | None = None) -> None:
        self._options = options
        self._open_lister = listing  # opens the store that lists (``list_pages``)
        self._lister: Any = None
        self._read_timeout = read_timeout  # and the pace every answer keeps (answer_pace)
        self._head = head_deadline(read_timeout, connect_timeout)  # connecting included
        self._endpoint = endpoint
        self._custom_endpoint = custom_endpoint
        self._virtual_host = virtual_host
        self._max_connections = max_connections
        self._stores: dict[str, S3Store] = {}
        self._closed = False
        self._whole_by_range = True  # False once the server has not honoured a whole-object range

    @classmethod
    async def open(
        cls, config: S3Config, *, max_connections: int = 64, retry: RetryPolicy | None = None
    ) -> ObstoreStore:
        """Check the settings and prepare the per-bucket stores (no connection is made here)."""
        if forked_after_use():
            raise ConfigError(
                "store='obstore' cannot run in a process forked after obstore was used in its "
                "parent: obstore's Rust runtime does not survive fork() and every request would "
                "hang. Start DataLoader workers with multiprocessing_context='spawn' (or "
                "'forkserver'), or use store='aioboto3' when the main process also iterates"
            )
        retry = retry or RetryPolicy()
        max_connections = max(1, int(max_connections))
        client_options: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=retry.connect_timeout),
            "read_timeout": timedelta(seconds=retry.read_timeout),
            "timeout": timedelta(seconds=retry.deadline),
            "pool_max_idle_per_host": str(max_connections),
        }
        endpoint = config.endpoint_url
        if endpoint is not None and endpoint.startswith("http://"):
            client_options["allow_http"] = True
        if config.verify is False:
            client_options["allow_invalid_certificates"] = True
        elif isinstance(config.verify, str):
            client_options["root_certificate"] = _read_ca_bundle(config.verify)
        options: dict[str, Any] = {
            "region": config.region,
            "skip_signature": False,
            "virtual_hosted_style_request": not config.path_style,
            "client_options": client_options,
            "retry_config": {"max_retries": 0, "retry_timeout": timedelta(seconds=retry.deadline)},
        }
        # Blocking, once per store: files, maybe a credential_process or a metadata request
        # (bounded by botocore's timeouts); obstore calls the provider from its own threads.
        options["credential_provider"] = BotocoreCredentialProvider(resolve_credentials(config))
        from .http_lister import open_lister  # (here: not with this module)

        listing = functools.partial(open_lister, config, max_connections=max_connections, retry=retry)
        return cls(options, endpoint=endpoint or "AWS S3", custom_endpoint=endpoint,
                   virtual_host=not config.path_style, max_connections=max_connections,
                   read_timeout=retry.read_timeout, connect_timeout=retry.connect_timeout,
                   listing=listing)

    def __repr__(self) -> str:
        return (f"ObstoreStore(endpoint={self._endpoint!r}, buckets={sorted(self._stores)!r}, "
                f"max_connections={self._max_connections}, closed={self._closed})")

    # ------------------------------------------------------------------------- the protocol

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return objects_of(self.list_pages(bucket, prefix))

    async def list_pages(
        self,
        bucket: str,
        prefix: str = "",
        *,
        token: str | None = None,
        start_after: str | None = None,
        delimiter: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncGenerator[ListPage, None]:
        """``ListObjectsV2`` pages through this package's own lister, not object_store's: that
        one follows continuation tokens unseen and reads an HTML page, an ``<Error>`` answered
        200 or a truncated page without a token as the listing's end; ours reads each page
        (``list_xml``: a ``ListBucketResult`` or an error, no token answered twice). Same
        settings: the config's endpoint, addressing, credentials, CA bundle and proxy."""
        lister = await self._listing()
        pages = lister.list_pages(bucket, prefix, token=token, start_after=start_after,
                                  delimiter=delimiter, page_size=page_size)
        try:
            async for page in pages:
                yield page
        finally:
            await pages.aclose()

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        _check_key(bucket, key)
        if pin is not None:  # the response's ETag is needed: get_range_async does not give it
            return await self._get_plain(bucket, key, pin=pin)
        if self._whole_by_range:
            store = self._store(bucket)
            try:
                data = bytes(await self._one_await(obstore.get_range_async(store, key, start=0, end=_TO_THE_END)))
                answered(self._endpoint)
                return data
            except AnswerTooSlow:
                pass  # slow, or only long: the paced reading below tells which
            except Exception as exc:
                facts = read_error_text(str(exc))
                status = facts.status
                if status is None and facts.range_ignored:
                    self._whole_by_range = False
                elif status != 416:  # a 416 to a range from byte 0: the object is empty
                    raise self._translate(exc, bucket, key) from exc
                return await self._get_plain(bucket, key, by_range=False)
            finally:
                del store  # see _get_plain()
        return await self._get_plain(bucket, key)

    async def _get_plain(
        self, bucket: str, key: str, options: Any = None,
        pin: Pin | None = None, *, by_range: bool = True,
    ) -> bytes:
        """The object (or ``options["range"]`` of it) with ``get_async``: two awaits, its length
        checked, its ETag handed to ``pin`` (which adds ``If-Match`` once it holds one).
        ``by_range`` False: a whole object by a plain GET (a range from 0 was just refused)."""
        if by_range and self._whole_by_range and "range" not in (options or {}):
            # the whole object asked as the range from byte 0: object_store holds a 206's
            # Content-Range to it, where it takes any 206 to a plain GET for the whole object
            try:
                return await self._get_plain(bucket, key, {**(options or {}), "range": {"offset": 0}}, pin)
            except StoreError as exc:
                if not self._plain_instead(exc.__cause__):
                    raise
            return await self._get_plain(bucket, key, options, pin, by_range=False)
        if pin is not None and pin.etag is not None:
            options = {**(options or {}), "if_match": pin.if_match()}
        store = self._store(bucket)
        result = None
        read_timeout = self._read_timeout
        try:
            result = await within(self._head,
                                  obstore.get_async(store, key, options=options),
                                  lambda: too_slow_head(self._head))
            if pin is not None:
                pin.observe(result.meta.get("e_tag"), bucket, key)
            length = result.range[1] - result.range[0]
            data = await within(body_deadline(read_timeout, length), result.bytes_async(),
                                lambda: too_slow_whole(read_timeout, length))
            answered(self._endpoint)
            start, stop = result.range
            check_span(_asked(options), start, stop, _size(result.meta), result.meta.get("e_tag"),
                       bucket, key)
        except StoreError as exc:  # a check of the answer (``check_span``)
            at_endpoint(exc, self._endpoint)
            raise
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc
        finally:
            # The frame of a cancelled request lives on in its traceback, which the engine's
            # cancellation leaves in reference cycles: without this, the response (a pooled
            # connection) and the bucket's store (its pool, every idle connection) stayed open
            # after a `break` until the garbage collector happened to run.
            del store, result
        return _checked(data, stop - start, bucket, key, start, self._endpoint)

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        _check_range_args(bucket, key, start, end)
        if end is not None and end == start:
            return b""
        if start == 0 and end is None:
            return await self.get(bucket, key, pin=pin)
        if pin is not None:
            return await self._get_pinned_range(bucket, key, start, end, pin)
        store = self._store(bucket)
        try:
            if end is None:
                data = await self._one_await(obstore.get_range_async(store, key, start=start,
                                                                     end=_TO_THE_END))
            else:
                read_timeout, length = self._read_timeout, end - start
                data = await within(
                    self._head + body_deadline(read_timeout, length),
                    obstore.get_range_async(store, key, start=start, end=end),
                    lambda: too_slow_whole(read_timeout, length))
        except AnswerTooSlow as exc:
            if end is not None:
                raise self._translate(exc, bucket, key) from exc
            # slow, or only long: the paced reading tells which
            return await self._get_pinned_range(bucket, key, start, end, None)
        except Exception as exc:
            if _status_of(exc) == 416:
                await self._past_the_end(bucket, key, start, end)
                return b""
            raise self._translate(exc, bucket, key) from exc
        finally:
            del store  # see _get_plain()
        answered(self._endpoint)
        if end is not None and len(data) > end - start:  # never more than asked (object_store
            # checks the Content-Range's start; a shorter span than a range to the end is taken
            # as the object's end: only a listed size, checked by the caller, catches that)
            check_length(len(data), end - start, asked_for(f"bytes={start}-{end - 1}"), bucket, key)
        return bytes(data)

    async def _get_pinned_range(
        self, bucket: str, key: str, start: int, end: int | None, pin: Pin | None
    ) -> bytes:
        """``get_range`` through ``get_async``, which reports the ETag (one await more)."""
        byte_range: Any = {"offset": start} if end is None else (start, end)
        try:
            return await self._get_plain(bucket, key, {"range": byte_range}, pin)
        except StoreError as exc:
            if _status_of(exc.__cause__) == 416:
                await self._past_the_end(bucket, key, start, end)
                return b""
            raise

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        _check_range_args(bucket, key, start, end)
        options: dict[str, Any] = {"if_none_match": f'"{etag}"'}
        if start or end is not None:
            options["range"] = {"offset": start} if end is None else (start, end)
        try:
            return await self._get_plain(bucket, key, options, pin)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, obe.NotModifiedError) or _status_of(cause) == 304:
                return None
            raise

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        check_int("chunk_size", chunk_size, minimum=1)
        _check_range_args(bucket, key, start, end)
        if end is not None and end == start:
            return  # nothing to read (as get_range: no request)
        store = self._store(bucket)
        options: Any = {"range": {"offset": start}} if start or self._whole_by_range else {}
        if end is not None:
            options["range"] = (start, end)
        if pin is not None and pin.etag is not None:
            options["if_match"] = pin.if_match()
        read_timeout = self._read_timeout
        try:
            while True:
                try:
                    result = await within(self._head,
                                          obstore.get_async(store, key, options=options),
                                          lambda: too_slow_head(self._head))
                    break
                except Exception as exc:
                    if start or end is not None or "range" not in options or not self._plain_instead(exc):
                        raise
                    del options["range"]  # the whole object, by a plain GET
            first, stop = result.range
            check_span(_asked(options), first, stop, _size(result.meta), result.meta.get("e_tag"),
                       bucket, key)
            if pin is not None:
                pin.observe(result.meta.get("e_tag"), bucket, key)
        except StoreError as exc:  # a check of the answer (``check_span``)
            at_endpoint(exc, self._endpoint)
            raise
        except Exception as exc:
            if start and _status_of(exc) == 416:
                await self._past_the_end(bucket, key, start, end)
                return  # resumed exactly at the end: nothing left to read
            raise self._translate(exc, bucket, key) from exc
        finally:
            del store  # see _get_plain(); the response is released below
        expected = stop - first
        received = 0
        # obstore's min_chunk_size is a minimum: a chunk may exceed it by one network read
        # (up to ~400 KiB here). Asking for half keeps chunks of 1 MiB within bounds; anything
        # longer is split below, which copies, so it should stay rare.
        chunks = result.stream(min_chunk_size=max(1, chunk_size // 2))
        pace = Pace(read_timeout)  # the consumer's own time between chunks is not counted
        try:
            while True:
                try:
                    chunk = await paced(pace, chunks.__anext__())
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    raise self._translate(exc, bucket, key) from exc
                pace.received += len(chunk)
                received += len(chunk)
                if len(chunk) <= chunk_size:
                    yield chunk
                else:
                    view = memoryview(chunk)
                    for offset in range(0, len(chunk), chunk_size):
                        yield bytes(view[offset:offset + chunk_size])
        finally:
            del chunks, result  # drops the Rust body, releasing its connection
        if received != expected:
            raise at_endpoint(TransientStoreError(
                f"{object_url(bucket, key)}: body ended after {start + received} bytes, "
                f"{expected - received} short of its Content-Length",
                bucket=bucket,
                key=key,
            ), self._endpoint)

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        _check_key(bucket, key)
        store = self._store(bucket)
        try:
            await obstore.put_async(store, key, data, use_multipart=False)
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc

    async def aclose(self) -> None:
        """Drop every bucket's store (and with it its connection pool), and close the lister."""
        self._closed = True
        self._stores.clear()
        lister, self._lister = self._lister, None
        if lister is not None:
            await lister.aclose()

    # ------------------------------------------------------------------------- helpers

    async def _listing(self) -> Any:
        """The store every listing goes through, opened on first use: ``HttpLister`` (the
        standard library's HTTP client, which checks every page) where it serves the config,
        else the aioboto3 backend (``http_lister.open_lister``)."""
        if self._closed:
            raise RuntimeError("ObstoreStore is closed; a listing came after aclose()")
        if self._lister is None:
            if self._open_lister is None:
                raise RuntimeError("ObstoreStore made without open() has no lister")
            self._lister = await self._open_lister()
        return self._lister

    def _store(self, bucket: str) -> S3Store:
        """The bucket's ``S3Store``, created on first use."""
        store = self._stores.get(bucket)
        if store is not None:
            return store
        if self._closed:
            raise RuntimeError("ObstoreStore is closed; a request came after aclose()")
        options = dict(self._options)
        endpoint = self._custom_endpoint
        if endpoint is not None:
            if self._virtual_host:  # object_store wants the bucket already in the host name
                scheme, _, host = endpoint.partition("://")
                endpoint = f"{scheme}://{bucket}.{host}"
            # both keys: AWS_ENDPOINT_URL_S3 in the environment would win over "endpoint" alone
            options["endpoint"] = endpoint
            options["aws_endpoint_url_s3"] = endpoint
        try:
            store = S3Store(bucket, **options)
        except Exception as exc:
            raise ConfigError(
                f"store='obstore' rejected the settings for bucket {bucket!r} at {self._endpoint}: "
                f"{_summary(exc)}"
            ) from exc
        global _runtime_pid
        _runtime_pid = os.getpid()  # requests are about to start obstore's runtime
        self._stores[bucket] = store
        return store

    async def _past_the_end(self, bucket: str, key: str, start: int, end: int | None) -> None:
        """After a 416: return if ``start`` is exactly the object's size (an empty range, as
        with a slice), else raise ``InvalidRangeError``. Costs a HEAD, on this path only."""
        store = self._store(bucket)  # its ConfigError as it is (a translation would be its own cause)
        try:
            meta = await obstore.head_async(store, key)
        except Exception as exc:
            raise self._translate(exc, bucket, key) from exc
        size = int(meta["size"])
        if start == size:
            return
        asked = f"from byte {start}" if end is None else f"[{start}, {end})"
        raise InvalidRangeError(
            f"s3://{bucket}/{key}: the requested byte range ({asked}) is past the end of the "
            f"object ({size} bytes)",
            bucket=bucket, key=key,
        )

    def _plain_instead(self, exc: BaseException | None) -> bool:
        """Whether a whole read asked as the range from byte 0 failed with ``exc`` only for
        being a range, and is asked again as a plain GET: a 416 (an empty object), or a 200 (a
        server that ignores Range, asked by plain GETs from then on)."""
        facts = read_error_text(str(exc))
        if facts.status is None and facts.range_ignored:
            self._whole_by_range = False
            return True
        return facts.status == 416

    def _one_await(self, request: Any) -> Any:
        """``request`` (head and body in one await, of a length not known before) within the
        time the pace allows an object of up to ``read_timeout`` x ``MIN_RATE`` bytes; one that
        takes longer is read again by ``_get_plain``, whose two awaits keep the pace for any length
        (a body that long and slow is rare; the one await saves a third of the CPU per GET)."""
        read_timeout = self._read_timeout
        return within(self._head + body_deadline(read_timeout, 0), request,
                      lambda: AnswerTooSlow("not whole in one await"))

    def _translate(
        self, exc: BaseException, bucket: str, key: str, *, listing: bool = False
    ) -> BaseException:
        return translate_error(exc, bucket=bucket, key=key, endpoint=self._endpoint, listing=listing)


def translate_error(
    exc: BaseException, *, bucket: str, key: str, endpoint: str, listing: bool = False
) -> BaseException:
    """``_translated``, and a transient error names ``endpoint`` once retrying it gives up."""
    return at_endpoint(_translated(exc, bucket=bucket, key=key, endpoint=endpoint, listing=listing), endpoint)


def _translated(
    exc: BaseException, *, bucket: str, key: str, endpoint: str, listing: bool = False
) -> BaseException:
    """The one place where obstore's errors become ours (same wording as the aioboto3 backend).

    By class first: ``FileNotFoundError``/``NotFoundError`` (404), ``PermissionDeniedError``
    (403), ``UnauthenticatedError`` (401, or no credentials), ``InvalidPathError`` and
    ``ValueError`` (a key ``object_store`` cannot express as a path); ``GenericError`` is
    everything else (5xx, 416, refused connections, timeouts, bodies cut short), and for it, as
    for an S3 error code the classes do not carry, only the text says more: ``read_error_text``.
    """
    if isinstance(exc, (StoreError, ConfigError, asyncio.CancelledError)):
        return exc
    if isinstance(exc, AnswerTooSlow):  # ours (answer_pace): its message says which limit
        return failed_mid_request(bucket, key, f"{type(exc).__name__}: {exc}", listing=listing)
    facts = read_error_text(str(exc))
    status, code = facts.status, facts.code
    if status is None and _REDIRECT_MARKER in str(exc):  # S3's 301 (no Location): a wrong region
        status, code = 301, code or "PermanentRedirect"
    if status is None and code != "NoSuchBucket":  # the exception's class is all there is
        if isinstance(exc, (FileNotFoundError, obe.NotFoundError)):
            status = 404
        elif isinstance(exc, obe.PermissionDeniedError):
            status = 403
        elif isinstance(exc, obe.UnauthenticatedError) and not code:
            return no_credentials()
    if status is not None or code in _ANSWERED_WITHOUT_STATUS:
        return error_for_answer(code, status or 0, bucket=bucket, key=key, endpoint=endpoint,
                                listing=listing)
    if facts.certificate is not None:
        return certificate_rejected(endpoint, bucket, key, _CERT_REASONS.get(facts.certificate, facts.certificate),
                                    listing=listing)
    if facts.plain_http:  # a TLS handshake answered with plain HTTP
        return plain_http_server(endpoint, bucket, key, listing=listing)
    if facts.kind == "Connect":
        return unreachable(endpoint, bucket, key, listing=listing, reason=facts.os_message)
    if facts.refused_answer is not None:  # a server that answered, but not what was asked
        refused = facts.refused_answer
        if refused.startswith("Content-Length Header missing"):
            refused += (" (object_store reads only bodies of a stated length: store='aioboto3' "
                        "reads chunked ones too)")
        return bad_answer(Asked(), bucket, key, f"{refused} (object_store's check)", listing=listing)
    if facts.failure is not None:
        return failed_mid_request(bucket, key, facts.failure, listing=listing)
    what = target(bucket, key, listing=listing)
    if isinstance(exc, (ValueError, obe.InvalidPathError)) and facts.unaddressable:
        return StoreError(
            f"{what}: store='obstore' cannot address this key ({_summary(exc)}); object_store "
            "rejects keys with empty segments ('//'), '.' or '..' segments, or control "
            "characters; use store='aioboto3' for such keys",
            bucket=bucket, key=key,
        )
    return StoreError(f"{what}: unexpected {type(exc).__name__}: {_summary(exc)}",
                      bucket=bucket, key=key)


# ------------------------------------------------------------- what obstore's text says

OBSTORE_TEXT_VERSION = "0.12.1"
"""The obstore release whose error texts ``read_error_text`` was checked against, message by
message (tests/test_obstore_text.py, which fails on another release until it is checked again)."""

_STATUS_RE = re.compile(r"non-2xx status code: (\d{3})|\bstatus: (\d{3})\b")
_CODE_RE = re.compile(r"<Code>([^<]{1,100})</Code>")
_KIND_RE = re.compile(r"HttpError \{\s*kind: (\w+)")
_OS_MESSAGE_RE = re.compile(r'message: "([^"]{1,200})"')
# rustls's verdict on the server's certificate, e.g. InvalidCertificate(UnknownIssuer) or
# InvalidCertificate(Other(OtherError(CaUsedAsEndEntity)))
_CERT_RE = re.compile(r"InvalidCertificate\(\s*(\w+)(?:\(\s*(?:\w+\(\s*)?(\w+))?")
# object_store's complaint about a 200 (the whole object) where it asked for a range: a server
# that ignores Range (a 206 of another range is a wrong answer, ``_REFUSED_RE``)
_RANGE_IGNORED_RE = re.compile(r"non-partial response", re.I)
# object_store's words for a 3xx it could not follow (S3's 301 for another region has no Location)
_REDIRECT_MARKER = "Received redirect without LOCATION"
_PATH_ERROR_MARKERS = ("Could not parse path", "Error parsing Path", "empty path segment")
# an answer object_store refused: a range or framing not asked for, a listing page it cannot read
_REFUSED_RE = re.compile(r"(Received non-partial response when range requested|Requested \d+\.\.\d+, "
                         r"got \d+\.\.\d+|Content-Length Header missing from response|Content-Range "
                         r"header (?:not present|contained)[^\n]{0,60}|Failed to parse value for "
                         r"CONTENT_RANGE header[^\n]{0,60}|Got invalid list response: [^\n]{0,160})")
_HYPER_PARSE_RE = re.compile(r"hyper::Error\(\s*Parse\(\s*(\w+)(?:\(\s*(\w+))?")


class ErrorText(NamedTuple):
    """What an obstore error's text says beyond its class."""

    status: int | None  # the HTTP status of an answer
    code: str  # the S3 error code in the answer's XML ("" when none)
    kind: str  # reqwest's error kind (Connect, Timeout, Request, Decode, Body, ...; "" when none)
    os_message: str | None  # the OS's words for a failed connection
    certificate: str | None  # rustls's verdict on the server's certificate (UnknownIssuer, ...)
    plain_http: bool  # a TLS handshake answered with plain HTTP
    failure: str | None  # how a request failed mid-way, in a few words (None: it did not)
    range_ignored: bool  # a 200 (the whole object) where a range was asked for
    unaddressable: bool  # a key object_store cannot express as a path
    refused_answer: str | None  # object_store's or hyper's words for an answer it refused (None: none)


def read_error_text(text: str) -> ErrorText:
    """The facts in an obstore error's text: obstore (0.12) raises classes but exposes no
    status, S3 code or cause on them, so the Rust debug print is all there is. The one place
    that reads it, checked message by message against ``OBSTORE_TEXT_VERSION``."""
    status = _STATUS_RE.search(text)
    code = _CODE_RE.search(text)
    kind_match = _KIND_RE.search(text)
    kind = kind_match.group(1) if kind_match else ""
    os_message = _OS_MESSAGE_RE.search(text)
    cert = _CERT_RE.search(text)
    certificate = None
    if cert is not None:
        name = cert.group(2) if cert.group(1) == "Other" and cert.group(2) else cert.group(1)
        certificate = name.removesuffix("Context")  # rustls 0.23: NotValidForNameContext { .. }
    failure = None
    if "IncompleteBody" in text:
        failure = "the body ended before its Content-Length"
    elif kind in ("Timeout", "Interrupted", "Request", "Decode"):
        if "TimedOut" in text or kind == "Timeout":
            failure = "timed out"
        elif "ConnectionReset" in text:
            failure = "connection reset"
        elif "IncompleteMessage" in text:
            failure = "connection closed before a response"
        else:
            failure = kind
    return ErrorText(
        status=int(status.group(1) or status.group(2)) if status else None,
        code=code.group(1) if code else "",
        kind=kind,
        os_message=os_message.group(1) if os_message else None,
        certificate=certificate,
        plain_http="InvalidContentType" in text,
        failure=failure,
        range_ignored=_RANGE_IGNORED_RE.search(text) is not None,
        unaddressable=any(marker in text for marker in _PATH_ERROR_MARKERS),
        refused_answer=_refused(text),
    )


def _refused(text: str) -> str | None:
    """What object_store (or hyper under it) refused in an answer, in its words."""
    found = _REFUSED_RE.search(text)
    if found is not None:
        return found.group(1)
    parse = _HYPER_PARSE_RE.search(text)
    if parse is not None:
        return "hyper could not parse the answer: " + " ".join(part for part in parse.groups() if part)
    return None


def _status_of(exc: BaseException | None) -> int | None:
    """The HTTP status an obstore error's text carries, if any."""
    return read_error_text(str(exc)).status


# ----------------------------------------------------------------------------- pure helpers


def _summary(exc: BaseException, limit: int = 300) -> str:
    """obstore's message without its debug dump (which repeats the whole response)."""
    text = str(exc).split("\n\nDebug source", 1)[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _check_key(bucket: str, key: str) -> None:
    """Refuse keys that object_store would silently rewrite (it drops a leading or trailing '/',
    so ``/a`` would read the object ``a``). Keys it cannot parse at all fail in the request."""
    if key.startswith("/") or key.endswith("/"):
        raise StoreError(
            f"s3://{bucket}/{key}: store='obstore' cannot address this key (object_store drops a "
            "leading or trailing '/', which would name another object); use store='aioboto3' for "
            "such keys",
            bucket=bucket, key=key,
        )


def _asked(options: Any) -> Asked:
    """What a ``get_async`` with ``options`` asked for (``answer_checks``)."""
    options = options or {}
    byte_range = options.get("range")
    if_match = options.get("if_match")
    asked = Asked(if_match=None if if_match is None else normalize_etag(if_match),
                  if_none_match="if_none_match" in options)
    if isinstance(byte_range, dict):
        return asked._replace(ranged=True, start=int(byte_range["offset"]))
    if byte_range is not None:
        return asked._replace(ranged=True, start=int(byte_range[0]), end=int(byte_range[1]))
    return asked


def _size(meta: Any) -> int | None:
    size = meta.get("size")
    return None if size is None else int(size)


def _check_range_args(bucket: str, key: str, start: int, end: int | None) -> None:
    _check_key(bucket, key)
    if start < 0 or (end is not None and end < start):
        raise InvalidRangeError(
            f"s3://{bucket}/{key}: byte range [{start}, {end}) is not a valid half-open range",
            bucket=bucket, key=key,
        )


def _checked(data: Any, expected: int, bucket: str, key: str, start: int, endpoint: str) -> bytes:
    """``data`` as ``bytes`` (one copy), if it is as long as the response said."""
    if len(data) != expected:
        raise at_endpoint(TransientStoreError(
            f"{object_url(bucket, key)}: body ended after {start + len(data)} bytes, "
            f"{expected - len(data)} short of its Content-Length",
            bucket=bucket, key=key,
        ), endpoint)
    return bytes(data)


def _read_ca_bundle(path: str) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"AWS_CA_BUNDLE / S3Config(verify={path!r}) cannot be read as a PEM file: {exc}"
        ) from exc
