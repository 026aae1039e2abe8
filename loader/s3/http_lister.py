"""Listings over the standard library's HTTP client, for the process that builds a dataset.

That process forks DataLoader workers later and waits for the listing before the first sample:
``HttpLister`` imports neither aiohttp nor botocore (slow to import) and starts no runtime a fork
breaks. Pages are SigV4-signed ``http.client`` requests in worker threads, addressed as botocore addresses them
(``addressing``: AWS's regional endpoints, virtual-hosted or path-style, through the proxy that
``HTTPS_PROXY``/``HTTP_PROXY`` name unless ``NO_PROXY`` bypasses it), with the config's keys or
what botocore's chain finds; what it cannot serve (``usable``) is listed by aioboto3
(docs/design/listing.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import functools
import http.client
import io
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import AsyncGenerator
from typing import Any, NoReturn

import anyio
import anyio.to_thread

from ..config import S3Config
from ..errors import BadAnswerError, StoreError
from ..lifecycle import join_thread
from ..retry import RetryPolicy, answered
from .addressing import NotServed, Origin, Proxy, bucket_address, proxy_for, redirected, unserved
from .answer_checks import asked_for, check_codings, check_head, check_length
from .answer_pace import MIN_RATE as _MIN_RATE
from .credentials import resolve_credentials
from .error_answers import (
    answer_code,
    at_endpoint,
    broken_framing,
    certificate_rejected,
    error_for_answer,
    failed_mid_request,
    plain_http_server,
    unreachable,
)
from .http1 import CHUNK_SIZE_LINE, STATUS_LINE
from .list_xml import list_query, paged, parse_list_page
from .protocol import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ListPage,
    ObjectInfo,
    ObjectStore,
    Pin,
    objects_of,
)
from .signing import signed_get_request

_MAX_ERROR_BODY = 64 << 10  # an error body larger than this is not S3's XML: keep only its start


def _connect(address: tuple[str, int], *args: Any) -> socket.socket:
    """``socket.create_connection`` for ``http.client``, an ASCII host given as bytes: a ``str``
    host makes ``getaddrinfo`` encode it with the ``idna`` codec, whose import (with
    ``stringprep`` and ``unicodedata``) held up a first listing by 3-6 ms. An ASCII name or
    address encodes the same either way."""
    host, port = address
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    return socket.create_connection((name, port), *args)  # type: ignore[arg-type]


def _quiet(connection: http.client.HTTPConnection) -> bool:
    """Whether nothing more arrived on a connection whose answer was read whole: bytes past an
    answer's framing (or its end) mean the connection cannot be trusted with another request."""
    sock = connection.sock
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    poller = select.poll()  # (not select(): a process may hold descriptors past FD_SETSIZE)
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


class AnswerDeadline(TimeoutError):
    """The whole answer (head and body) did not arrive within its deadline."""


class _DeadlineSocket:
    """What ``http.client`` reads an answer from: the connection's socket, each read bounded by
    what is left of the answer's deadline (a socket timeout alone restarts at every byte, so a
    server sending one byte a second never times out)."""

    def __init__(self, sock: socket.socket, deadline: float, read_timeout: float) -> None:
        self.sock, self.deadline, self._read_timeout = sock, deadline, read_timeout

    def makefile(self, mode: str) -> io.BufferedReader:
        # the socket stays open while this reader is (as socket.makefile keeps it): a
        # connection closed right after a close-delimited answer's head still reads its body
        self.sock._io_refs += 1  # type: ignore[attr-defined]
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise AnswerDeadline("the whole answer did not arrive in time (the server sends, but "
                                 f"too slowly: under {_MIN_RATE} bytes/s past the read timeout)")
        self.sock.settimeout(min(left, self._read_timeout))
        try:
            return self.sock.recv_into(buffer, nbytes, flags)
        except TimeoutError:
            if time.monotonic() < self.deadline:
                raise  # a stall: no byte for read_timeout
            return self.recv_into(buffer, nbytes, flags)  # past the deadline: says so

    def fileno(self) -> int:
        return self.sock.fileno()

    def _decref_socketios(self) -> None:
        self.sock._decref_socketios()  # type: ignore[attr-defined]


class _CheckedResponse(http.client.HTTPResponse):
    """``http.client``'s answer, with its status line and chunk sizes held to the grammar
    ``http1`` reads (h11's): ``int()`` alone takes ``0x1f``, ``+1f``, ``1_000`` and Unicode
    digits, so the two transports would read one answer two ways. Read through a
    ``_DeadlineSocket`` when given one."""

    def __init__(self, sock: Any, debuglevel: int = 0, method: str | None = None,
                 url: str | None = None, *, read_timeout: float | None = None) -> None:
        self.deadline_socket = None
        if read_timeout is not None:  # the head within 2 read timeouts; the body: see _call
            sock = self.deadline_socket = _DeadlineSocket(
                sock, time.monotonic() + 2 * read_timeout, read_timeout)
        super().__init__(sock, debuglevel, method, url)

    def _read_status(self) -> tuple[str, int, str]:
        line = str(self.fp.readline(_MAX_LINE + 1), "iso-8859-1")
        if not line:
            raise http.client.RemoteDisconnected("the server closed the connection without answering")
        found = STATUS_LINE.match(line.removesuffix("\r\n"))
        if len(line) > _MAX_LINE or not line.endswith("\r\n") or found is None:
            raise http.client.BadStatusLine(line[:80])
        version, _, rest = line.partition(" ")
        return version, int(found.group(2)), rest[4:].strip()

    def _read_next_chunk_size(self) -> int:
        line = self.fp.readline(_MAX_LINE + 1)
        found = CHUNK_SIZE_LINE.match(line.removesuffix(b"\r\n"))
        if len(line) > _MAX_LINE or not line.endswith(b"\r\n") or found is None:
            self._close_conn()  # type: ignore[attr-defined]
            raise http.client.HTTPException(f"chunk size line {line[:20]!r} is not hexadecimal")
        return int(found.group(1), 16)


_MAX_LINE = 65536  # http.client's own limit on a line


async def open_lister(config: S3Config, *, max_connections: int, retry: RetryPolicy) -> ObjectStore:
    """The store to list with for ``config``: ``HttpLister`` where it serves (``usable``), else
    the aioboto3 backend (docs/design/listing.md)."""
    if usable(config):
        return HttpLister(config, max_connections=max_connections, retry=retry)
    from .aioboto3_store import Aioboto3Store

    return await Aioboto3Store.open(config, max_connections=max_connections, retry=retry)


def usable(config: S3Config) -> bool:
    """Whether ``HttpLister`` can list for ``config``: every endpoint, unless a setting asks for
    what only botocore serves (FIPS or dual-stack endpoints, an https proxy: ``addressing.unserved``)."""
    return unserved(config, "bucket") is None


class HttpLister:
    """``PagedLister`` over ``http.client`` (docs/design/listing.md); besides listing it
    reads whole objects and ranges (what a listing may need: a shard index)."""

    def __init__(self, config: S3Config, *, max_connections: int = 8,
                 retry: RetryPolicy | None = None) -> None:
        if not usable(config):
            raise ValueError(f"HttpLister cannot serve {unserved(config, 'bucket')}")
        retry = retry or RetryPolicy()
        self._endpoint = config.endpoint_url or "AWS S3"
        self._config = config
        self._timeout = max(retry.connect_timeout, retry.read_timeout)
        self._read_timeout = retry.read_timeout
        self._context: ssl.SSLContext | None = None
        self._credentials: Any = None  # the config's keys, or what botocore's chain found (on first use)
        self._idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self._max_connections, self._retry = max_connections, retry
        self._fallback: ObjectStore | None = None
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(max(1, max_connections))
        self._closed = False
        # a first page asked for before the listing's event loop ran (``send_first_page``)
        self._first: tuple[tuple[str, str, int], concurrent.futures.Future[ListPage]] | None = None
        self._first_fetch: tuple[threading.Thread, concurrent.futures.Future[ListPage]] | None = None

    def send_first_page(self, bucket: str, prefix: str, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        """Ask for the listing's first page now, from a thread of its own, where no event loop
        runs yet: its answer comes while the loop that lists starts (~10 ms, mostly the import of
        anyio's asyncio backend the first time). ``list_pages`` takes it for the same first page,
        or raises what it failed with, which the listing's retries treat as any page's error."""
        first: concurrent.futures.Future[ListPage] = concurrent.futures.Future()
        query = list_query(prefix, page_size)

        def fetch() -> None:
            try:
                first.set_result(self._page(bucket, prefix, query))
            except BaseException as exc:  # noqa: BLE001 - handed to list_pages, raised there
                first.set_exception(exc)

        self._first = ((bucket, prefix, page_size), first)
        thread = threading.Thread(target=fetch, name="loader-first-page", daemon=True)
        self._first_fetch = (thread, first)
        thread.start()

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
        """``ListObjectsV2`` pages, resumed at ``token`` or started after ``start_after``; what
        this client cannot serve (a region redirect, an S3 Express bucket) is listed by the
        aioboto3 backend from where it stopped, which names the reason once."""
        pages = self._own_pages(bucket, prefix, token=token, start_after=start_after,
                                delimiter=delimiter, page_size=page_size)
        try:
            async for page in pages:
                yield page
                token = page.token
            return
        except NotServed:
            pass
        finally:
            await pages.aclose()
        store = await self._aioboto3()
        async for page in store.list_pages(bucket, prefix, token=token, start_after=start_after,
                                           delimiter=delimiter, page_size=page_size):
            yield page

    async def _aioboto3(self) -> Any:
        """The aioboto3 backend, for what this client cannot serve (opened once, closed with it)."""
        if self._fallback is None:
            from .aioboto3_store import Aioboto3Store

            self._fallback = await Aioboto3Store.open(self._config, max_connections=self._max_connections,
                                                      retry=self._retry)
        return self._fallback

    def _own_pages(self, bucket: str, prefix: str, *, token: str | None, start_after: str | None,
                   delimiter: str | None, page_size: int) -> AsyncGenerator[ListPage, None]:
        first, self._first = self._first, None
        if not ((token, start_after, delimiter) == (None, None, None) and first is not None
                and first[0] == (bucket, prefix, page_size)):
            first = None  # sent for another listing: not this one's first page

        async def fetch(token: str | None) -> ListPage:
            nonlocal first
            if first is not None:
                sent, first = first[1], None
                return await asyncio.wrap_future(sent)  # no worker thread to wait in; cancellable
            query = list_query(prefix, page_size, token, start_after, delimiter)
            return await anyio.to_thread.run_sync(self._page, bucket, prefix, query, limiter=self._limiter)

        return paged(fetch, bucket=bucket, prefix=prefix, token=token)

    def _page(self, bucket: str, prefix: str, query: dict[str, str]) -> ListPage:
        """One page, in a worker thread."""
        return parse_list_page(self._call(bucket, prefix, "", query, None, listing=True),
                               bucket=bucket, prefix=prefix, token=query.get("continuation-token"))

    def _call(self, bucket: str, key: str, path: str, query: dict[str, str],
              byte_range: str | None, *, listing: bool = False) -> bytes:
        """One signed GET of ``/bucket`` + ``path`` (already escaped), in a worker thread: the
        body, or the error that the answer or the connection's failure means."""
        reason = unserved(self._config, bucket)
        if reason is not None:
            raise NotServed(reason)
        address = bucket_address(self._config, bucket)
        request_target, headers = self.request(bucket, path, query, byte_range,
                                               datetime.datetime.now(datetime.timezone.utc))
        connection, proxy = self._connection(address.origin)
        if proxy is not None and not address.origin.https:  # a forward proxy: absolute-form
            request_target = address.origin.url + request_target
            if proxy.authorization:
                headers["Proxy-Authorization"] = proxy.authorization
        asked = asked_for(byte_range)
        expected: int | None = None
        try:
            connection.request("GET", request_target, headers=headers)
            response = connection.getresponse()
            answered(self._endpoint)
            length = response.getheader("Content-Length")
            deadline = getattr(response, "deadline_socket", None)
            if deadline is not None and length is not None and length.isascii() \
                    and length.isdigit() and len(length) < 19:  # the body at the least rate
                deadline.deadline += int(length) / _MIN_RATE
            if response.status < 300:  # held to the request before its body is read
                expected = check_head(response.status, response.getheader, asked, bucket, key)
                body = response.read()
                check_length(len(body), expected, asked, bucket, key)
            else:
                check_codings(response.getheader("Transfer-Encoding"), asked, bucket, key)
                body = response.read(_MAX_ERROR_BODY)
        except BadAnswerError as exc:
            connection.close()  # its framing cannot be trusted for another answer
            at_endpoint(exc, self._endpoint)
            raise
        except (http.client.RemoteDisconnected, http.client.IncompleteRead) as exc:
            connection.close()  # the connection ended early: worth another try
            self._fail(exc, bucket, key, listing)
        except (http.client.HTTPException, ValueError, OverflowError) as exc:
            connection.close()  # not HTTP/1.1 (http.client raises all three for bad framing)
            raise at_endpoint(broken_framing(bucket, key, f"{type(exc).__name__}: {exc}", listing=listing,
                                             request=asked.describe()), self._endpoint) from exc
        except OSError as exc:
            connection.close()
            self._fail(exc, bucket, key, listing)
        with self._lock:
            if response.will_close or self._closed or response.status >= 300 \
                    or not _quiet(connection):
                connection.close()
            else:
                if connection.sock is not None:  # (the answer's deadline had shortened it)
                    connection.sock.settimeout(self._timeout)
                self._idle.setdefault(address.origin, []).append(connection)
        reason = redirected(response.status, {name.lower(): value for name, value in response.getheaders()},
                            bucket, self._config.region)
        if reason is not None:
            raise NotServed(reason)
        if response.status >= 300:
            raise error_for_answer(answer_code(body), response.status, bucket=bucket, key=key,
                                   endpoint=self._endpoint, listing=listing,
                                   headers=response.getheader, body=body)
        return body

    def request(self, bucket: str, path: str, query: dict[str, str], byte_range: str | None,
                when: datetime.datetime) -> tuple[str, dict[str, str]]:
        """The target and the headers of a GET of the bucket's ``path`` (already escaped: ``""``
        for the bucket itself, else ``/key``), every header signed: ``Range`` and the
        ``Accept-Encoding`` that ``http.client`` would add unsigned (tests/test_signing.py holds
        this to botocore's signature)."""
        address = bucket_address(self._config, bucket)
        return signed_get_request(address.host, (address.base + path) or "/", query, byte_range,
                          credentials=self._keys(), region=self._config.region, when=when,
                          headers={"accept-encoding": "identity"})

    def _keys(self) -> Any:
        """Frozen credentials to sign with: the config's keys, else what botocore's chain finds
        (resolved once, refreshed by botocore when temporary)."""
        credentials = self._credentials
        if credentials is None:
            with self._lock:
                if self._credentials is None:
                    self._credentials = resolve_credentials(self._config)
                credentials = self._credentials
        return credentials.get_frozen_credentials()

    def _connection(self, origin: Origin) -> tuple[http.client.HTTPConnection, Proxy | None]:
        """An idle connection to ``origin`` or a new one (through the proxy the environment
        names for it: a CONNECT tunnel for https, the proxy itself for http), and that proxy."""
        proxy = proxy_for(origin)
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                return idle.pop(), proxy
            if origin.https and self._context is None:
                verify = self._config.verify
                self._context = ssl.create_default_context(
                    cafile=verify if isinstance(verify, str) else None)
                if verify is False:  # asked for: no verification
                    self._context.check_hostname = False
                    self._context.verify_mode = ssl.CERT_NONE
        host, port = (origin.host, origin.port) if proxy is None else \
            (proxy.origin.host, proxy.origin.port)
        connection: http.client.HTTPConnection
        if not origin.https:
            connection = http.client.HTTPConnection(host, port, timeout=self._timeout)
        else:
            connection = http.client.HTTPSConnection(host, port, timeout=self._timeout,
                                                     context=self._context)
            if proxy is not None:
                tunnel = {"Proxy-Authorization": proxy.authorization} if proxy.authorization else None
                connection.set_tunnel(origin.host, origin.port, headers=tunnel)
        connection.response_class = functools.partial(  # type: ignore[assignment]
            _CheckedResponse, read_timeout=self._read_timeout)
        connection._create_connection = _connect  # type: ignore[attr-defined]
        return connection, proxy

    def _fail(self, exc: BaseException, bucket: str, key: str, listing: bool) -> NoReturn:
        """Raise ``exc`` as one of ours (wording: ``error_answers``)."""
        if isinstance(exc, ssl.SSLCertVerificationError):
            raise certificate_rejected(self._endpoint, bucket, key,
                                       exc.verify_message or str(exc), listing=listing) from exc
        if isinstance(exc, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(exc):
            raise plain_http_server(self._endpoint, bucket, key, listing=listing) from exc
        if isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
            raise unreachable(self._endpoint, bucket, key, listing=listing,
                              reason=exc.strerror or str(exc)) from exc
        # with what it said, as the other transports do; a stall says how long it was waited out
        if isinstance(exc, AnswerDeadline):
            said = str(exc)
        elif isinstance(exc, TimeoutError):
            said = f"no answer within {self._timeout:g} s"
        else:
            said = str(exc)
        detail = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
        raise at_endpoint(failed_mid_request(bucket, key, detail, listing=listing), self._endpoint) from exc

    async def aclose(self) -> None:
        self.close()
        fallback, self._fallback = self._fallback, None
        if fallback is not None:
            await fallback.aclose()

    def close(self) -> None:
        """``aclose`` without an event loop, but for the aioboto3 fallback (opened only by a
        listing): what closes a lister made for a first page that no listing took."""
        with self._lock:
            self._closed = True  # a first page still on its way closes its connection itself
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
        fetch, self._first_fetch = self._first_fetch, None
        if fetch is not None and fetch[1].done():
            # Its answer is in: the thread is ending (microseconds). Joined to its OS-level end,
            # it cannot still be tearing down when the DataLoader forks its workers right after
            # the listing (lifecycle.join_thread). One still waiting for its answer (the listing
            # failed first) closes its own connection.
            join_thread(fetch[0])

    # Reads: whole objects and ranges (a shard index found beside the shards); not streams or
    # conditional reads, which the data path makes through the backends.

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        return await self._get(bucket, key, None)

    async def get_range(self, bucket: str, key: str, start: int, end: int | None, *,
                        pin: Pin | None = None) -> bytes:
        if end is not None and end <= start:
            return b""
        return await self._get(bucket, key, f"bytes={start}-{'' if end is None else end - 1}")

    async def _get(self, bucket: str, key: str, byte_range: str | None) -> bytes:
        path = "/" + urllib.parse.quote(key, safe="/~")
        try:
            return await anyio.to_thread.run_sync(self._call, bucket, key, path, {}, byte_range,
                                                  limiter=self._limiter)
        except NotServed:
            store = await self._aioboto3()
            if byte_range is None:
                return await store.get(bucket, key)
            start, _, end = byte_range.removeprefix("bytes=").partition("-")
            return await store.get_range(bucket, key, int(start), int(end) + 1 if end else None)

    def _not_here(self, bucket: str, key: str) -> NoReturn:
        raise StoreError(f"HttpLister lists and reads small objects only (asked for a stream or "
                         f"a write of s3://{bucket}/{key})", bucket=bucket, key=key)

    async def stream(self, bucket: str, key: str, start: int = 0,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                     pin: Pin | None = None, end: int | None = None) -> AsyncGenerator[bytes, None]:
        self._not_here(bucket, key)
        yield b""  # pragma: no cover - makes this an async generator

    async def get_if_changed(self, bucket: str, key: str, etag: str, start: int = 0,
                             end: int | None = None, *, pin: Pin | None = None) -> bytes | None:
        self._not_here(bucket, key)

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        self._not_here(bucket, key)

    def __repr__(self) -> str:
        return f"HttpLister(endpoint={self._endpoint!r})"

