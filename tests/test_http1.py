"""``loader.s3.http1``: answers parsed however their bytes are split, keep-alive reuse, the
pool's limit, and every way a connection can fail (against scripted servers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.s3.http1 import ConnectFailed, ConnectionPool, ResponseBroken, _Connection, _Watchdog

GET = b"GET /bkt/key HTTP/1.1\r\nhost: h\r\n\r\n"


class _Transport:
    """Enough of a transport for feeding a connection bytes by hand."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def _chunked(body: bytes, sizes: list[int], extension: bool, trailer: bool) -> bytes:
    parts, at = [], 0
    for size in sizes:
        piece = body[at:at + size]
        if not piece:
            break
        at += len(piece)
        parts.append(f"{len(piece):x}{';ext=1' if extension else ''}\r\n".encode() + piece + b"\r\n")
    if at < len(body):
        parts.append(f"{len(body) - at:X}\r\n".encode() + body[at:] + b"\r\n")
    parts.append(b"0\r\n" + (b"x-checksum: abc\r\n" if trailer else b"") + b"\r\n")
    return b"".join(parts)


def _split(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(wire)) for cut in cuts} | {0, len(wire)})
    return [wire[a:b] for a, b in zip(points, points[1:])]


async def _feed(framing: str, body: bytes, sizes: list[int], extension: bool, trailer: bool,
                cuts: list[int]) -> tuple[bytes, _Connection]:
    connection = _Connection(_Watchdog(5))
    connection.connection_made(_Transport())  # type: ignore[arg-type]
    connection.send(GET)
    if framing == "chunked":
        wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nETag: \"e\"\r\n\r\n"
        wire += _chunked(body, sizes, extension, trailer)
    else:
        wire = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nETag: \"e\"\r\n\r\n".encode() + body
    for piece in _split(wire, cuts):
        connection.data_received(piece)
    await connection.wait_head()
    return await connection.read_all(), connection


@settings(max_examples=300, deadline=None)
@given(framing=st.sampled_from(["length", "chunked"]), body=st.binary(max_size=300),
       sizes=st.lists(st.integers(1, 64), max_size=10), extension=st.booleans(),
       trailer=st.booleans(), cuts=st.lists(st.integers(0, 600), max_size=12))
def test_a_body_is_read_whole_however_its_bytes_arrive(framing, body, sizes, extension, trailer, cuts):
    got, connection = asyncio.run(_feed(framing, body, sizes, extension, trailer, cuts))
    assert got == body
    assert connection.status == 200 and connection.headers["etag"] == '"e"'
    assert connection.done and connection.reusable, "a complete answer leaves the connection reusable"


def test_bytes_past_the_answer_make_the_connection_unusable():
    async def run() -> None:
        connection = _Connection(_Watchdog(5))
        transport = _Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.send(GET)
        connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabc")
        with pytest.raises(ResponseBroken, match="past the Content-Length"):
            await connection.wait_head()
        assert transport.aborted and not connection.reusable

    asyncio.run(run())


@pytest.mark.parametrize("head", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"])
def test_what_is_not_http_is_refused_with_what_it_was(head):
    async def run() -> None:
        connection = _Connection(_Watchdog(5))
        connection.connection_made(_Transport())  # type: ignore[arg-type]
        connection.send(GET)
        connection.data_received(head)
        with pytest.raises(ResponseBroken):
            await connection.wait_head()

    asyncio.run(run())


# ---------------------------------------------------------------- against a scripted server

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """A server on 127.0.0.1 that runs ``handler`` per request; yields its port and the
    connection number of each request it got (0, 1, ... in the order connections opened)."""
    seen: list[int] = []
    opened = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        number, opened = opened, opened + 1
        try:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                seen.append(number)
                await handler(reader, writer, len(seen) - 1)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()


def _pool(port: int, **options: float) -> ConnectionPool:
    settings = {"limit": 4, "connect_timeout": 5.0, "read_timeout": 5.0, **options}
    return ConnectionPool("127.0.0.1", port, ssl_context=None, **settings)  # type: ignore[arg-type]


async def _ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    body = f"body {n}".encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()


async def _get(pool: ConnectionPool) -> bytes:
    async with await pool.get(GET) as response:
        return await response.read()


def test_answers_read_to_the_end_keep_their_connection_alive():
    async def run() -> None:
        async with _server(_ok) as (port, seen):
            pool = _pool(port)
            assert [await _get(pool) for _ in range(3)] == [b"body 0", b"body 1", b"body 2"]
            assert seen == [0, 0, 0], "one connection for requests one after another"
            await pool.aclose()

    asyncio.run(run())


def test_a_kept_alive_connection_the_server_closed_is_replaced_unseen():
    async def close_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await _ok(reader, writer, n)
        writer.close()  # keep-alive announced (HTTP/1.1), then closed while idle

    async def run() -> None:
        async with _server(close_after) as (port, seen):
            pool = _pool(port)
            assert await _get(pool) == b"body 0"
            await asyncio.sleep(0.05)
            assert await _get(pool) == b"body 1"
            assert seen == [0, 1]
            await pool.aclose()

    asyncio.run(run())


def test_a_body_cut_short_raises_and_its_connection_is_not_reused():
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
            await writer.drain()
            writer.close()
        else:
            await _ok(reader, writer, n)

    async def run() -> None:
        async with _server(cut) as (port, seen):
            pool = _pool(port)
            with pytest.raises(ResponseBroken, match="before the whole body"):
                await _get(pool)
            assert await _get(pool) == b"body 1"
            assert seen == [0, 1]
            await pool.aclose()

    asyncio.run(run())


def test_an_answer_that_stalls_times_out_after_read_timeout():
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nsome")
        await writer.drain()
        await asyncio.sleep(3)

    async def run() -> None:
        async with _server(stall) as (port, _):
            pool = _pool(port, read_timeout=0.3)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError, match="no byte received for 0.3 s"):
                await _get(pool)
            assert asyncio.get_running_loop().time() - started >= 0.25  # not sooner; the 3 s close would say "broken"
            await pool.aclose()

    asyncio.run(run())


def test_a_slow_answer_that_keeps_sending_does_not_time_out():
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 524288\r\n\r\n")
        for _ in range(8):  # 64 KiB every 0.1 s: slow, but well above the least rate
            await asyncio.sleep(0.1)
            writer.write(b"x" * 65536)
            await writer.drain()

    async def run() -> None:
        async with _server(trickle) as (port, _):
            pool = _pool(port, read_timeout=0.25)  # the whole answer takes 0.8 s
            assert await _get(pool) == b"x" * 524288
            await pool.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_slowloris_answer_fails_though_a_byte_comes_in_every_read_timeout(part):
    sent = []

    async def slowloris(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        wire = b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n" + b"x" * 200
        if part == "body":
            writer.write(wire[:40])
            wire = wire[40:]
        for byte in wire:
            await asyncio.sleep(0.02)
            writer.write(bytes([byte]))
            sent.append(byte)
            await writer.drain()

    async def run() -> None:
        async with _server(slowloris) as (port, _):
            pool = _pool(port, read_timeout=0.3)
            with pytest.raises(TimeoutError, match="head was not whole" if part == "head" else "bytes/s"):
                await _get(pool)
            await pool.aclose()

    asyncio.run(run())
    assert len(sent) < 200, "failed before the trickle ended, not at its end"


def test_nothing_listening_is_a_connect_failure_that_says_so():
    async def run() -> None:
        async with _server(_ok) as (port, _):
            pass  # closed: nothing listens on the port now
        pool = _pool(port)
        with pytest.raises(ConnectFailed) as caught:
            await _get(pool)
        assert "refused" in caught.value.reason.lower()
        assert pool._open == 0

    asyncio.run(run())


def test_the_pool_opens_at_most_its_limit_and_every_request_is_answered():
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.02)
        await _ok(reader, writer, n)

    async def run() -> None:
        async with _server(slow) as (port, seen):
            pool = _pool(port, limit=3)
            bodies = await asyncio.gather(*(_get(pool) for _ in range(20)))
            assert sorted(bodies) == sorted(f"body {n}".encode() for n in range(20))
            assert set(seen) == {0, 1, 2}, "three connections, each used again"
            await pool.aclose()

    asyncio.run(run())


def test_a_request_called_off_mid_body_gives_its_place_back():
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\npartial")
            await writer.drain()
            await asyncio.sleep(3)
        else:
            await _ok(reader, writer, n)

    async def run() -> None:
        async with _server(endless) as (port, seen):
            pool = _pool(port, limit=1)
            task = asyncio.create_task(_get(pool))
            await asyncio.sleep(0.1)
            task.cancel()  # as a hedge that lost
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool._open == 0, "the half-read connection is closed, not pooled"
            assert await asyncio.wait_for(_get(pool), 2) == b"body 1", "the one place is free"
            assert seen == [0, 1]
            await pool.aclose()

    asyncio.run(run())


def test_a_streamed_body_pauses_the_socket_while_unread():
    size = 24 << 20

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size >> 20):
            writer.write(b"x" * (1 << 20))
            await writer.drain()

    async def run() -> None:
        async with _server(big) as (port, _):
            pool = _pool(port)
            received = most = 0
            async with await pool.get(GET) as response:
                await asyncio.sleep(0.3)  # a slow consumer
                connection = response._reader
                while data := await response.read_some():
                    most = max(most, connection._buffered + len(data))
                    received += len(data)
            assert received == size
            assert most < 1 << 20, f"{most} bytes held unread: the socket was not paused"
            await pool.aclose()

    asyncio.run(run())


def test_304_and_close_delimited_answers():
    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            writer.write(b'HTTP/1.1 304 Not Modified\r\nETag: "e"\r\n\r\n')
        else:  # no length, no chunks: the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            writer.close()
        await writer.drain()

    async def run() -> None:
        async with _server(answers) as (port, seen):
            pool = _pool(port)
            async with await pool.get(GET) as response:
                assert response.status == 304 and await response.read() == b""
            assert await _get(pool) == b"until the end"
            assert seen == [0, 0], "the 304 left its connection alive"
            assert pool._open == 0 and not pool._idle
            await pool.aclose()

    asyncio.run(run())
