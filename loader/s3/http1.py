"""HTTP/1.1 on asyncio protocols: the pooled keep-alive connections that ``SignedGetter`` sends
its signed GETs over.

Hand-written because a per-object dataset makes one GET per sample, and aiohttp's client spent
about twice the CPU of this module per GET of a ~110 KB object on loopback (~180 against ~90 µs,
socket reads included): a ``ClientRequest``, multidicts, URL objects, a cookie jar, trace hooks
and a timer per request, none of which a signed S3 GET uses (bench/results/http1-2026-11-28.md).
What is here is what such a GET needs and no more: requests without a body, one endpoint, a
status line and headers, bodies framed by ``Content-Length``, by chunked transfer coding or by
the connection's end, keep-alive reuse, connect and read timeouts, TLS on memory BIOs
(``tls``: a closing pool's idle TLS connections wait for the next pool of the process, so an
epoch does not pay a handshake per connection again), and flow control for streamed bodies.
Errors are three kinds, which the store translates (``aioboto3_store.translate_error``):
``ConnectFailed`` (nothing reached), ``ResponseBroken`` (a connection that ended or sent garbage
mid-answer, a ``ConnectionError``) and ``TimeoutError`` (no byte for ``read_timeout`` seconds while one was awaited).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import socket
import ssl
from collections.abc import Callable

from .addressing import Proxy
from .answer_pace import MIN_RATE as _MIN_RATE  # the pace every transport holds answers to
from .tls import PARKED, TlsLayer

_MAX_HEAD = 64 << 10  # a status line and headers longer than this are not an S3 answer
_HIGH_WATER = 256 << 10  # a streamed body pauses the socket with this much received and unread
# (about one read of asyncio's; aiohttp paused at 128 KiB): buffers the engine does not count stay small
_NO_BODY = (204, 304)
_DRAIN_MOST = 512 << 10  # a called-off answer on a TLS connection with at most this much body left
# is read to its end and the connection kept: decrypting 512 KiB costs less than a handshake (~0.85 ms)
_DRAIN_SECONDS = 0.5  # ... if it ends within this: its place in the pool waits for it meanwhile
# The grammar h11 reads (RFC 9112), and tests/test_http1_differential.py holds this parser to it
STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([0-9]{3})(?: [^\x00\n\r\x0b\x0c]*)?\Z")
_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LENGTH = re.compile(r"[0-9]{1,19}\Z")  # at most 19 digits: below 2**63, past any object
CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;.*)?[ \t]*\Z")


class ConnectFailed(Exception):
    """No connection could be made (refused, unknown host, connect timeout); ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ResponseBroken(ConnectionError):
    """The connection ended, or sent what is not HTTP/1.1, before the whole answer arrived."""


class FramingBroken(ResponseBroken):
    """The server answered, but broke HTTP/1.1's grammar or framing (a bad status line, header,
    length or chunk size, bytes past the answer's end): its connection is closed, never reused,
    and the store raises ``BadAnswerError`` (a few tries, not the whole retry deadline)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses answers as bytes arrive and hands them to the one
    request in flight on it (no pipelining)."""

    def __init__(self, watchdog: _Watchdog) -> None:
        self._watchdog = watchdog  # the pool's: its read timeout, one timer for all connections
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # whether a request went out on it before (a stale one may be reset)
        self.adopted = False  # parked by an earlier pool (tls.PARKED) and taken by this one
        self._head = bytearray()  # the start of a head that arrived in pieces
        self._waiter: asyncio.Future[None] | None = None
        self._until = ""  # what the waiter waits for: "head", "some" (bytes of the body), "all"
        self._last_data = 0.0
        self._waited = 0.0  # seconds this answer was waited for (not the reader's own time)
        self._wait_start = 0.0
        self._bytes = 0  # bytes of this answer's body received
        self._head_waited = 0.0  # of _waited, the part spent waiting for the head
        self._whole = False  # the body is read whole (else piece by piece: paused past _HIGH_WATER)
        self._error: BaseException | None = None
        self._paused = False
        # the answer being read
        self.status = 0
        self.headers: dict[str, str] = {}
        self._in_head = False
        self._framing = ""  # "length", "chunked" or "close"
        self._left = 0  # body bytes still to come ("length"), or of the current chunk ("chunked")
        self._chunk_state = "size"  # chunked: "size", "data", "data-end", "trailer"
        self._pending = bytearray()  # chunked: bytes of a size line or trailer not yet complete
        self._body: collections.deque[bytes | memoryview] = collections.deque()
        self._buffered = 0
        self._keep_alive = False  # the answer's headers allow another request on this connection
        self._got_bytes = False  # whether any byte of the current answer came
        self.done = False  # the whole body has arrived

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last_data = self._loop.time()
        self._got_bytes = True
        try:
            body: bytes | memoryview | None = data
            if self._in_head:
                body = self._take_head(data)
                if body is None:
                    return
            elif self.done or not self.status:
                if data:  # bytes nobody asked for: the connection cannot be trusted for another
                    self._fail(FramingBroken(f"{len(data)} bytes arrived outside any answer"))
                return
            if body:
                self._bytes += len(body)
                self._take_body(body)
        except ResponseBroken as exc:
            self._fail(exc)
            return
        self._wake()

    def eof_received(self) -> bool | None:
        if self._framing == "close" and not self._in_head:
            self.done = True
        self._keep_alive = False
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done and self._error is None:
            if self._in_head and not self._head:
                reason = "the server closed the connection before answering"
            elif self._in_head:
                reason = "the connection ended inside the answer's headers"
            else:
                reason = "the connection ended before the whole body arrived"
            if exc is not None:
                reason += f" ({type(exc).__name__}: {exc})"
            self._error = ResponseBroken(reason)
        self._wake()

    # -- what a request does with it

    def send(self, head: bytes) -> None:
        """Send one request and start reading its answer."""
        assert self.transport is not None
        self.status, self.headers, self.done, self._keep_alive = 0, {}, False, False
        self._in_head, self._framing, self._error, self._got_bytes = True, "", None, False
        self._waited, self._bytes, self._wait_start = 0.0, 0, self._loop.time()
        self._body.clear()
        self._buffered, self._whole = 0, False
        self.used = True
        self.transport.write(head)

    @property
    def body_left(self) -> int | None:
        """Bytes of the answer's body still to come, where its framing says (None: chunked, or
        to the connection's end)."""
        if self.done:
            return 0
        return self._left if self._framing == "length" else None

    @property
    def answered_nothing(self) -> bool:
        """Whether the connection broke before a byte of the answer came (a stale keep-alive)."""
        return not self._got_bytes

    @property
    def reusable(self) -> bool:
        """Whether another request may go on this connection: its answer ended cleanly and both
        sides keep it alive."""
        return self._keep_alive and self.done and not self.closed

    async def wait_head(self) -> None:
        """Until the status line and headers are in (an interim 1xx answer is passed over)."""
        while self._in_head:
            await self._wait("head")
        if self._error is not None:
            raise self._error

    async def read_all(self) -> bytes:
        """The rest of the body, whole."""
        self._whole = True
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        while not self.done:
            await self._wait("all")
        parts, self._body = self._body, collections.deque()
        self._buffered = 0
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    async def read_some(self) -> bytes:
        """The next bytes of the body as they arrived, or ``b""`` at its end."""
        while not self._body and not self.done:
            await self._wait("some")
        if not self._body:
            return b""
        data = self._body.popleft()
        self._buffered -= len(data)
        if isinstance(data, memoryview):
            data = data.tobytes()
        if self._paused and self._buffered < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- parsing

    def _take_head(self, data: bytes) -> memoryview | None:
        """Parse the head once it is complete; what followed it (the body's start), or None while
        the head is incomplete. The body's bytes are not copied on the way: the usual answer
        arrives with its head and the first ~64 KB of body in one read."""
        if self._head:
            self._head += data
            data = bytes(self._head)
            self._head.clear()
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > _MAX_HEAD:
                    raise FramingBroken(f"no end of headers in the first {_MAX_HEAD} bytes")
                self._head += data
                return None
            if not self._parse_head(data[:end]):
                self._head_waited = self._waited + self._loop.time() - self._wait_start
                return memoryview(data)[end + 4:]
            data = data[end + 4:]  # after an interim (1xx) answer, rare: a copy will do

    def _parse_head(self, head: bytes) -> bool:
        """Read a status line and headers; whether it was an interim (1xx) answer, after which
        the real one follows. Sets the body's framing; anything outside RFC 9112's grammar (as
        h11 reads it), or a framing that is ambiguous, is ``FramingBroken``."""
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        if _bad_chars(text, len(lines) - 1):
            raise FramingBroken(f"a NUL, VT, FF or a lone CR or LF in the answer's head: {text[:80]!r}")
        status_line = STATUS_LINE.match(lines[0])
        if status_line is None:
            raise FramingBroken(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(status_line.group(2))
        if status < 100:
            raise FramingBroken(f"status {status} is not an HTTP status")
        headers = _read_fields(lines[1:])
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            return True
        self.status, self.headers, self._in_head = status, headers, False
        keep_alive = ("close" not in headers.get("connection", "").lower()
                      and status_line.group(1) == "1")
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.lower() != "chunked":  # another coding's bytes are not
            raise FramingBroken(f"Transfer-Encoding {coding[:60]!r}: only chunked is read")  # the object's
        length = headers.get("content-length")
        if length is not None:
            lengths = {value.strip() for value in length.split(",")}  # "5, 5": the same length, twice
            length = lengths.pop()
            if lengths or not _LENGTH.match(length):
                raise FramingBroken(f"Content-Length {headers['content-length'][:40]!r} is not a length")
        if status in _NO_BODY:
            self._framing, self.done = "length", True
        elif coding is not None:
            if length is not None:  # RFC 9112 6.3: a sign of smuggling, an error here
                raise FramingBroken("both Transfer-Encoding and Content-Length")
            self._framing, self._chunk_state, self._pending = "chunked", "size", bytearray()
        elif length is not None:
            self._framing, self._left = "length", int(length)
            self.done = self._left == 0
        else:
            self._framing, keep_alive = "close", False
        self._keep_alive = keep_alive
        return False

    def _take_body(self, data: bytes | memoryview) -> None:
        if self._framing == "length":
            if len(data) > self._left:
                raise FramingBroken(f"{len(data) - self._left} bytes past the Content-Length")
            self._left -= len(data)
            self._keep(data)
            if not self._left:
                self.done = True
        elif self._framing == "chunked":
            self._take_chunked(data)
        else:
            self._keep(data)

    def _take_chunked(self, data: bytes | memoryview) -> None:
        """Chunked transfer coding (RFC 9112 section 7.1), read incrementally; extensions and
        trailers are read past."""
        view = memoryview(data)
        while view:
            if self._chunk_state == "data":
                take = min(self._left, len(view))
                self._keep(bytes(view[:take]))
                view = view[take:]
                self._left -= take
                if not self._left:
                    self._chunk_state = "data-end"
                continue
            self._pending += view
            view = memoryview(b"")
            while True:
                end = self._pending.find(b"\r\n")
                if end < 0:
                    if len(self._pending) > _MAX_HEAD:
                        raise FramingBroken("a chunk's size line or trailer without its end")
                    return
                line = bytes(self._pending[:end])
                del self._pending[:end + 2]
                if self._chunk_state == "data-end":
                    if line:
                        raise FramingBroken("a chunk longer than its size")
                    self._chunk_state = "size"
                elif self._chunk_state == "size":
                    size = CHUNK_SIZE_LINE.match(line)
                    if size is None:
                        raise FramingBroken(f"chunk size line {line[:20]!r} is not hexadecimal")
                    self._left = int(size.group(1), 16)
                    self._chunk_state = "data" if self._left else "trailer"
                    if self._left:
                        view, self._pending = memoryview(bytes(self._pending)), bytearray()
                        break
                elif not line:  # the empty line that ends the trailer: the body is complete
                    if self._pending:
                        raise FramingBroken(f"{len(self._pending)} bytes arrived outside any answer")
                    self.done = True
                    return
                else:  # a trailer field: read past, but only if it is one
                    field = line.decode("latin-1")
                    if _bad_chars(field, 0):
                        raise FramingBroken(f"malformed trailer line: {field[:80]!r}")
                    _read_fields([field])

    def _keep(self, data: bytes | memoryview) -> None:
        if not data:
            return
        self._body.append(data)
        self._buffered += len(data)
        if (not self._whole and not self._paused and self._buffered > _HIGH_WATER
                and not self.done and self.transport is not None):
            self._paused = True
            self.transport.pause_reading()

    # -- waiting, with the read timeout

    async def _wait(self, until: str) -> None:
        """Until the answer has what ``until`` names, an error, or ``read_timeout`` seconds
        without a byte (which the pool's watchdog checks)."""
        if self._error is not None:
            raise self._error
        if self.closed and not self.done:
            raise ResponseBroken("the connection is closed")
        self._waiter, self._until = self._loop.create_future(), until
        self._last_data = self._wait_start = self._loop.time()
        watchdog = self._watchdog
        watchdog.watch(self)
        try:
            await self._waiter
        finally:
            self._waiter = None
            watchdog.waiting.discard(self)
            self._waited += self._loop.time() - self._wait_start
        if self._error is not None:
            raise self._error

    def check_timeout(self, now: float) -> None:
        """Fail the wait if no byte came for ``read_timeout`` seconds, if the head is not whole
        after twice that in all, or if the body, waited for ``read_timeout`` in all, came slower
        than ``_MIN_RATE`` (a server sending a byte now and then never trips the first rule)."""
        limit = self._watchdog.read_timeout
        if self._waiter is None:
            return
        if now - self._last_data >= limit:
            self._fail(TimeoutError(f"no byte received for {limit:g} s"))
            return
        waited = self._waited + now - self._wait_start
        if self._in_head:
            if waited >= 2 * limit:
                self._fail(TimeoutError(f"the answer's head was not whole after {waited:.1f} s"))
            return
        body_waited = waited - self._head_waited
        if body_waited >= limit and self._bytes < _MIN_RATE * body_waited:
            self._fail(TimeoutError(f"the body came at {self._bytes / body_waited:.0f} bytes/s for "
                                    f"{body_waited:.1f} s, under {_MIN_RATE} bytes/s"))

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        until = self._until
        if (self._error is not None or self.done or (until == "head" and not self._in_head)
                or (until == "some" and self._body)):
            waiter.set_result(None)


def _bad_chars(text: str, lines: int) -> bool:
    """Whether ``text`` (``lines`` + 1 lines joined by CRLF) holds a character no field may:
    NUL, VT, FF, or a CR or LF outside a CRLF (counts: C speed, a search each was slower)."""
    return (text.count("\r") != lines or text.count("\n") != lines or "\x00" in text
            or "\x0b" in text or "\x0c" in text)


def _read_fields(lines: list[str]) -> dict[str, str]:
    """Header fields (names in lower case; a repeated field's values joined with ", "): a name
    of token characters, a colon, a value without NUL, CR, LF, VT or FF (the caller looked for
    those in the whole head at once: ``_bad_chars``; cheaper than a match a line)."""
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name.strip(_TOKEN_CHARS):
            raise FramingBroken(f"malformed header line: {line[:80]!r}")
        name, value = name.lower(), value.strip(" \t")
        if name in headers:
            if name == "transfer-encoding":  # one framing, said once
                raise FramingBroken(f"{name} sent twice")
            value = f"{headers[name]}, {value}"
        headers[name] = value
    return headers


class _TunnelOpener(asyncio.Protocol):
    """Reads a proxy's answer to ``CONNECT``: ``answer`` is its status line once the head is in
    (a 2xx answer to CONNECT has no body; the tunnel's bytes follow)."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._head = bytearray()

    def data_received(self, data: bytes) -> None:
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end >= 0 and not self.answer.done():
            if end + 4 < len(self._head):
                self.answer.set_exception(ResponseBroken("the proxy sent bytes past its CONNECT answer"))
            else:
                self.answer.set_result(self._head[:end].split(b"\r\n", 1)[0].decode("latin-1"))
        elif len(self._head) > _MAX_HEAD and not self.answer.done():
            self.answer.set_exception(ResponseBroken("no end of the proxy's CONNECT answer"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(ResponseBroken("the proxy closed the connection before "
                                                     "answering CONNECT"))


class _Watchdog:
    """The read timeout of a pool's connections: one timer for all of them, ticking while any
    waits, instead of a timer made and cancelled for every wait (a tenth of a GET's CPU here).
    A stall is noticed within a quarter of ``read_timeout`` (at most a second) past it."""

    def __init__(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout
        self.period = min(1.0, read_timeout / 4)
        self.waiting: set[_Connection] = set()
        self._ticking = False

    def watch(self, connection: _Connection) -> None:
        self.waiting.add(connection)
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_later(self.period, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            now = loop.time()
            for connection in list(self.waiting):
                connection.check_timeout(now)
        finally:  # ticks on whatever happened: a watchdog that stopped would let a stall hang
            if self.waiting:
                loop.call_later(self.period, self._tick)
            else:
                self._ticking = False


class Response:
    """An answer's status and headers (names in lower case), and its body to read."""

    def __init__(self, connection: _Connection, release: Callable[[_Connection], None]) -> None:
        self._connection: _Connection | None = connection
        self._reader = connection
        self._release = release
        self.status = connection.status
        self.headers = connection.headers

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; with ``limit``, at most its first ``limit`` bytes (an error body)."""
        if limit is None:
            return await self._reader.read_all()
        parts, size = [], 0
        while size < limit and (part := await self._reader.read_some()):
            parts.append(part)
            size += len(part)
        return b"".join(parts)[:limit]

    async def read_some(self) -> bytes:
        """The next bytes of the body as they arrived (``b""`` at its end)."""
        return await self._reader.read_some()

    def close(self) -> None:
        """Give the connection back (kept alive only when its answer was read to the end)."""
        if self._connection is not None:
            connection, self._connection = self._connection, None
            self._release(connection)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class ConnectionPool:
    """At most ``limit`` keep-alive connections to one host, taken by one request at a time."""

    def __init__(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None, limit: int,
                 connect_timeout: float, read_timeout: float, proxy: Proxy | None = None) -> None:
        self._host, self._port = host, port
        self._proxy = proxy
        # through a proxy, plain http requests name their target whole (absolute-form)
        forward = proxy is not None and ssl_context is None
        self.target_prefix = f"http://{host}" + ("" if port == 80 else f":{port}") if forward else ""
        self.proxy_headers = proxy.headers() if forward and proxy is not None else ""
        self._ssl = ssl_context
        self._limit = max(1, limit)
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._watchdog = _Watchdog(read_timeout)
        self._open = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self._drains: set[asyncio.Task[None]] = set()
        # where this pool's idle TLS connections are parked for the next pool (``tls.PARKED``):
        # the same origin, proxy and TLS settings (the context, cached per process)
        self._parking = (host, port, proxy, ssl_context) if ssl_context is not None else None

    async def get(self, head: bytes) -> Response:
        """Send a request (its whole head, ending in an empty line) and return its answer once the
        headers are in. A kept-alive connection that the server had closed unseen is tried again
        on a new one, once (as aiohttp does: a GET that got no byte of answer is safe to send again)."""
        for attempt in (0, 1):
            connection = await self._take(parked=attempt == 0)
            reused = connection.used
            try:
                connection.send(head)
                await connection.wait_head()
            except ResponseBroken:
                self._drop(connection)
                if attempt == 0 and reused and connection.answered_nothing:
                    if connection.adopted and self._parking is not None:
                        PARKED.clear(self._parking)  # the others waited as long: closed too, likely
                    continue
                raise
            except asyncio.CancelledError:  # a hedge called off: its TLS connection may be kept
                self._release_unfinished(connection)
                raise
            except BaseException:  # a timeout
                self._drop(connection)
                raise
            return Response(connection, self._give_back)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close the idle connections; idle TLS ones are parked for the process's next pool to
        the same origin (``tls.PARKED``) instead."""
        self._closed = True
        drains = list(self._drains)
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        idle, self._idle = self._idle, []
        for connection in idle:
            layer = connection.transport
            if (isinstance(layer, TlsLayer) and self._parking is not None and layer.transport is not None
                    and connection.reusable
                    and PARKED.park(self._parking, layer.transport, layer, self._limit)):
                continue
            if layer is not None:
                layer.close()
        self._open -= len(idle)

    # -- connections

    async def _take(self, *, parked: bool = True) -> _Connection:
        """An idle connection, a parked one (``parked``), or a new one, within the limit."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
            self._open -= 1
        while self._open >= self._limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._signal()  # pass the wake-up on to the next waiter
                raise
            while self._idle:
                connection = self._idle.pop()
                if not connection.closed:
                    return connection
                self._open -= 1
        self._open += 1
        try:
            if parked and self._parking is not None:
                adopted = await self._adopt()
                if adopted is not None:
                    return adopted
            return await self._connect()
        except BaseException:
            self._open -= 1
            self._signal()
            raise

    async def _adopt(self) -> _Connection | None:
        """A connection a closed pool parked (``tls.PARKED``), taken into this loop, or None."""
        parked = PARKED.take(self._parking)
        if parked is None:
            return None
        connection = _Connection(self._watchdog)
        connection.used = connection.adopted = True  # a stale one gets the retry on a new one
        layer = TlsLayer(connection, parked.tls, parked.incoming, parked.outgoing, established=True)
        try:
            await asyncio.get_running_loop().create_connection(lambda: layer, sock=parked.sock)
        except OSError:
            parked.sock.close()
            return None
        return connection

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = self._host, self._port
        if self._proxy is not None:
            host, port = self._proxy.origin.host, self._proxy.origin.port
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._proxy is not None and self._ssl is not None:
                    return await self._tunnel()
                if self._ssl is not None:
                    connection = _Connection(self._watchdog)
                    transport, layer = await loop.create_connection(
                        lambda: self._tls_for(connection), host, port)
                    try:
                        await layer.handshake
                    except BaseException:
                        transport.abort()
                        raise
                    return connection
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._watchdog), host, port)
        except ssl.SSLError:
            raise  # the certificate or a plain-http server: worded by the store
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self._connect_timeout:g} s") from None
        except socket.gaierror as exc:
            raise ConnectFailed(f"host {host!r} not found: {exc.strerror}") from None
        except OSError as exc:  # asyncio's own text is "Connect call failed (address)"
            # its reason in the text, not as the cause: a DataLoader worker's message prints the
            # chain, and asyncio's frames of the refused connect would come before the advice
            reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            via = "" if self._proxy is None else " (the proxy)"
            raise ConnectFailed(f"{reason} at {host}:{port}{via}") from None
        return connection

    async def _tunnel(self) -> _Connection:
        """A TLS connection to the host through the proxy's ``CONNECT`` tunnel (as botocore's
        urllib3 makes one): a plain connection to the proxy, ``CONNECT host:port``, a 2xx answer,
        then the TLS handshake with the host inside it."""
        assert self._proxy is not None and self._ssl is not None
        loop = asyncio.get_running_loop()
        proxy = self._proxy.origin
        transport, opener = await loop.create_connection(_TunnelOpener, proxy.host, proxy.port)
        authority = f"{self._host}:{self._port}"
        try:
            transport.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                            f"{self._proxy.headers()}\r\n".encode("latin-1"))
            status_line = await opener.answer
            code = status_line.split(" ", 2)[1] if status_line.count(" ") >= 1 else ""
            if not code.startswith("2"):
                raise ConnectFailed(f"the proxy at {proxy.host}:{proxy.port} refused "
                                    f"CONNECT {authority}: {status_line[:80]!r}")
            connection = _Connection(self._watchdog)
            layer = self._tls_for(connection)
            transport.set_protocol(layer)
            layer.connection_made(transport)
            await layer.handshake
        except BaseException:
            transport.abort()
            raise
        return connection

    def _tls_for(self, connection: _Connection) -> TlsLayer:
        """TLS to the host (its name checked against the certificate) under ``connection``."""
        assert self._ssl is not None
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        return TlsLayer(connection, self._ssl.wrap_bio(incoming, outgoing, server_hostname=self._host),
                        incoming, outgoing)

    def _give_back(self, connection: _Connection) -> None:
        if connection.reusable and not self._closed:
            self._idle.append(connection)
            self._signal()
        elif not connection.done:  # an answer left unread (called off)
            self._release_unfinished(connection)
        else:
            self._drop(connection)

    def _release_unfinished(self, connection: _Connection) -> None:
        """A connection whose answer was called off before its end (a hedge that lost): a TLS one
        is read to the end in the background when what is left is small (``_DRAIN_MOST``) and
        comes within ``_DRAIN_SECONDS``, then kept, since a new one costs a handshake; any other
        is closed. It keeps its place in the pool's limit meanwhile: freeing it opened a new
        connection for the next request while the old one drained (21-24 handshakes a worker
        in an epoch with ~50 drains, none when the place is kept)."""
        left = connection.body_left if connection.status else 0
        if (self._parking is None or self._closed or connection.closed or left is None
                or left > _DRAIN_MOST):
            self._drop(connection)
            return
        task = asyncio.get_running_loop().create_task(self._drain(connection))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain(self, connection: _Connection) -> None:
        try:
            async with asyncio.timeout(_DRAIN_SECONDS):
                await connection.wait_head()
                left = connection.body_left
                if left is not None and left <= _DRAIN_MOST:
                    await connection.read_all()
        except BaseException:  # noqa: BLE001 - broken, stalled or the pool closing: not kept
            pass
        if connection.reusable and not self._closed:
            self._idle.append(connection)
            self._signal()
        else:
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        if not connection.closed:
            connection.abort()
        self._open -= 1
        self._signal()

    def _signal(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
