"""``loader.s3.tls`` under ``http1``: answers read exactly over TLS on memory BIOs, and the idle
TLS connections a closing pool parks for the process's next pool (each epoch's engine runs its own
event loop): counted in TLS handshakes at a scripted server on 127.0.0.1 running in a thread of
its own, so that it outlives the client's loops."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import ssl
import threading
from collections.abc import Iterator

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.s3 import tls
from loader.s3.http1 import ConnectionPool

HOST = "tls.lab.test"  # the certificate's name; connections go to 127.0.0.1 with it as SNI


class TlsServer:
    """HTTP/1.1 over TLS on 127.0.0.1 in a thread: answers ``body <n>`` to its n-th request and
    counts ``handshakes`` (connections whose TLS came up); ``end_idle()`` closes every connection
    (a server that ends idle keep-alive connections)."""

    def __init__(self, context: ssl.SSLContext, *, delay: float = 0.0, repeat: int = 2000) -> None:
        self.handshakes = 0
        self.requests = 0
        self.delay, self.repeat = delay, repeat  # seconds before each answer; its body's size
        self._writers: set[asyncio.StreamWriter] = set()
        self._context = context
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = f"body {self.requests}".encode() * self.repeat  # ~14 KB: records in several reads
                self.requests += 1
                await asyncio.sleep(self.delay)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        finally:
            self._writers.discard(writer)
            writer.close()

    def end_idle(self) -> None:
        """Close every connection, and wait until the last is closed."""
        assert self._loop is not None
        done = threading.Event()

        def close_all() -> None:
            for writer in list(self._writers):
                writer.close()
            self._loop.call_later(0.2, done.set)  # type: ignore[union-attr]

        self._loop.call_soon_threadsafe(close_all)
        assert done.wait(10)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._context)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    def __enter__(self) -> TlsServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def pki() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for ``HOST``, and a client context that trusts it."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(HOST).configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


@pytest.fixture(autouse=True)
def nothing_parked() -> Iterator[None]:
    tls.PARKED.clear()
    yield
    tls.PARKED.clear()


def _pool(port: int, context: ssl.SSLContext) -> ConnectionPool:
    return ConnectionPool("127.0.0.1", port, ssl_context=context, limit=3, connect_timeout=5.0,
                          read_timeout=5.0)


def epoch(port: int, context: ssl.SSLContext, requests: int = 6) -> list[bytes]:
    """What one engine does: a pool in a loop of its own, requests three at a time, then closed."""
    async def one(pool: ConnectionPool) -> bytes:
        head = f"GET /b/k HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        async with await pool.get(head) as response:
            assert response.status == 200
            return await response.read()

    async def run() -> list[bytes]:
        pool = ConnectionPool(HOST, port, ssl_context=context, limit=3, connect_timeout=5.0, read_timeout=5.0)
        try:
            return await asyncio.gather(*(one(pool) for _ in range(requests)))
        finally:
            await pool.aclose()

    return asyncio.run(run())


@pytest.fixture
def lab_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HOST`` resolves to 127.0.0.1 in this process (and its forks)."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real("127.0.0.1" if host == HOST else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def bodies(first: int, count: int) -> set[bytes]:
    return {f"body {n}".encode() * 2000 for n in range(first, first + count)}


def test_a_second_epoch_reads_exactly_on_the_first_epochs_tls_connections(pki, lab_name):
    server_context, client = pki
    with TlsServer(server_context) as server:
        assert set(epoch(server.port, client)) == bodies(0, 6)
        first = server.handshakes
        assert 1 <= first <= 3 and tls.PARKED.count() == first
        assert set(epoch(server.port, client)) == bodies(6, 6)
        assert server.handshakes == first, "the second epoch's loop shook hands again"


def test_connections_the_server_closed_while_parked_are_not_used(pki, lab_name):
    server_context, client = pki
    with TlsServer(server_context) as server:
        assert set(epoch(server.port, client)) == bodies(0, 6)
        first = server.handshakes
        assert tls.PARKED.count() == first
        server.end_idle()
        assert set(epoch(server.port, client)) == bodies(6, 6)
        assert server.handshakes > first


def test_a_parked_connection_waits_at_most_park_seconds(pki, lab_name, monkeypatch):
    server_context, client = pki
    with TlsServer(server_context) as server:
        epoch(server.port, client)
        first = server.handshakes
        monkeypatch.setattr(tls, "PARK_SECONDS", 0.0)
        epoch(server.port, client)
        assert server.handshakes >= first + 1
        assert tls.PARKED.count() == 0, "parked after the second epoch, then expired as it came"


def test_other_tls_settings_do_not_take_parked_connections(pki, lab_name):
    """A connection made without a certificate check is never handed to a pool that checks."""
    server_context, client = pki
    unchecked = ssl.create_default_context()
    unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
    with TlsServer(server_context) as server:
        epoch(server.port, unchecked)
        first = server.handshakes
        epoch(server.port, client)
        assert server.handshakes > first


def test_a_certificate_for_another_name_is_refused_before_any_request(pki):
    server_context, client = pki
    with TlsServer(server_context) as server:
        async def run() -> None:
            pool = _pool(server.port, client)  # "127.0.0.1" is not the certificate's name
            try:
                with pytest.raises(ssl.SSLCertVerificationError, match="127.0.0.1"):
                    await pool.get(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            finally:
                await pool.aclose()

        asyncio.run(run())
        assert server.requests == 0


def _child_epoch(port: int, context: ssl.SSLContext, out: multiprocessing.Queue) -> None:
    out.put((sorted(epoch(port, context, 3)), tls.PARKED.count()))


def test_a_forked_child_makes_its_own_connections_and_leaves_the_parents_alive(pki, lab_name):
    server_context, client = pki
    with TlsServer(server_context) as server:
        epoch(server.port, client)
        parent = server.handshakes
        fork = multiprocessing.get_context("fork")
        out = fork.Queue()
        child = fork.Process(target=_child_epoch, args=(server.port, client, out))
        child.start()
        read, parked_in_child = out.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert len(read) == 3 and server.handshakes > parent, "the child used the parent's connections"
        assert parked_in_child >= 1
        before = server.handshakes
        assert len(epoch(server.port, client)) == 6
        assert server.handshakes == before, "the child's exit closed the parent's parked connections"


@pytest.mark.parametrize(("repeat", "delay", "handshakes"), [(2000, 0.1, 1), (1_000_000, 0.1, 2), (2000, 1.5, 2)])
def test_a_called_off_request_leaves_a_small_answers_connection_to_the_next(pki, lab_name, repeat, delay,
                                                                             handshakes):
    """A hedge that lost is cancelled while its answer is on the way: with little left to read
    (~14 KB), the connection is read to the end in the background and a later request takes it
    (one handshake); with ~7 MB left, or an answer later than ``_DRAIN_SECONDS``, it is closed and
    the next request shakes hands again."""
    server_context, client = pki
    with TlsServer(server_context, delay=delay, repeat=repeat) as server:
        async def run() -> bytes:
            pool = ConnectionPool(HOST, server.port, ssl_context=client, limit=1, connect_timeout=5.0,
                                  read_timeout=5.0)
            head = f"GET /b/k HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()

            async def one() -> bytes:
                async with await pool.get(head) as response:
                    return await response.read()

            try:
                called_off = asyncio.create_task(one())
                while not server.requests:  # the request is out; its answer is on the way
                    await asyncio.sleep(0.01)
                called_off.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await called_off
                await asyncio.gather(*pool._drains)  # the called-off answer read to its end (or not)
                return await one()
            finally:
                await pool.aclose()

        assert asyncio.run(run()) == b"body 1" * repeat
        assert server.handshakes == handshakes



class _Wire:
    """A transport that takes what is written and goes nowhere."""

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass

    close = abort


def test_a_handshake_cut_off_with_no_one_waiting_is_not_logged(pki, caplog):
    """A connect called off mid-handshake (a hedge cancelled inside ``create_connection``) ends
    the connection with nobody awaiting the handshake: its failure is not logged as a future's
    exception that was never retrieved."""
    import gc

    from loader.s3.http1 import _Connection, _Watchdog

    _, client = pki

    async def run() -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        layer = tls.TlsLayer(_Connection(_Watchdog(5)), client.wrap_bio(incoming, outgoing, server_hostname=HOST),
                             incoming, outgoing)
        layer.connection_made(_Wire())  # type: ignore[arg-type]
        assert outgoing.pending == 0  # the ClientHello went to the wire
        layer.connection_lost(None)
        assert layer.handshake.done()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(run())
        gc.collect()
    assert "never retrieved" not in caplog.text


class _Pipe:
    """A transport that keeps what is written (the client's side of an in-memory TLS pair)."""

    def __init__(self) -> None:
        self.sent = bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data

    def abort(self) -> None:
        pass

    close = abort


class _App:
    """What ``TlsLayer`` feeds: the plain text it hands up, and whether the server's end came."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.calls = 0
        self.ended = False

    def connection_made(self, transport: object) -> None:
        pass

    def data_received(self, data: bytes | bytearray) -> None:
        assert data  # never called with nothing
        self.received += data
        self.calls += 1

    def eof_received(self) -> bool | None:
        self.ended = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        pass


def _tls_pair(pki: tuple[ssl.SSLContext, ssl.SSLContext]) -> tuple[tls.TlsLayer, _App, _Pipe, ssl.SSLObject,
                                                                     ssl.MemoryBIO, ssl.MemoryBIO]:
    """A client ``TlsLayer`` with its handshake done against a server ``SSLObject`` in memory."""
    server_context, client_context = pki
    app, pipe = _App(), _Pipe()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    layer = tls.TlsLayer(app, client_context.wrap_bio(incoming, outgoing, server_hostname=HOST), incoming, outgoing)
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_context.wrap_bio(s_in, s_out, server_side=True)
    layer.connection_made(pipe)  # type: ignore[arg-type]
    for _ in range(10):
        s_in.write(bytes(pipe.sent))
        pipe.sent.clear()
        try:
            server.do_handshake()
        except ssl.SSLWantReadError:
            pass
        if s_out.pending:
            layer.data_received(s_out.read())
        if layer.handshake.done() and not pipe.sent:
            break
    assert layer.handshake.done() and layer.handshake.exception() is None
    return layer, app, pipe, server, s_in, s_out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 70_000), min_size=1, max_size=4),
       cuts=st.lists(st.integers(1, 200_000), max_size=12), close=st.booleans())
def test_records_decrypt_exactly_however_the_stream_is_cut(pki, sizes, cuts, close):
    """What the server encrypts (several records a write, up to 16 KiB each) reaches the app
    byte for byte and in order, whatever pieces the socket hands the layer (a record cut across
    reads, many records in one read), and the server's close_notify ends the stream after it."""
    async def run() -> None:
        layer, app, _, server, _, s_out = _tls_pair(pki)
        plain = b"".join(bytes([n % 251]) * size for n, size in enumerate(sizes))
        server.write(plain)
        if close:
            with contextlib.suppress(ssl.SSLWantReadError):
                server.unwrap()
        wire = s_out.read()
        at = 0
        for cut in sorted(set(cuts)) + [len(wire)]:
            if cut > at:
                layer.data_received(wire[at:cut])
                at = cut
        assert bytes(app.received) == plain
        assert app.ended is close
        assert app.calls <= len([c for c in set(cuts) if 0 < c < len(wire)]) + 1  # at most one a read

    asyncio.run(run())
