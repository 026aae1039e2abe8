"""TLS for ``http1``'s connections over a pair of ``ssl.MemoryBIO`` (OpenSSL does the protocol,
this module only moves bytes), and the TLS connections a closing pool keeps for the process's
next event loop (``PARKED``).

Why not asyncio's TLS transport: a connection it makes belongs to its event loop, and the engine
runs one loop per epoch, so every epoch paid a TLS handshake per connection: ~0.85 ms of client
CPU each here (OpenSSL 3.0; resuming a session saves only the certificate check, a quarter of
it), 64 connections an engine, two engines with two DataLoader workers: ~0.1 ms a sample of a
1,000-object epoch (bench/results/aws-2026-11-28-c.md). An ``ssl.SSLObject`` belongs to no
loop: a pool that closes parks its idle connections (the socket and the TLS state), and the
next pool for the same origin and TLS settings in the same process adopts them into its own
loop. A parked connection waits at most ``PARK_SECONDS``, is never used by another process (a
forked child forgets them without touching OpenSSL) and is checked for a server's close before
it is taken. Plain ``http`` connections are not parked: a TCP connect costs ~0.06 ms.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

PARK_SECONDS = 10.0  # a parked connection older than this is closed, not adopted (httpx keeps
# idle ones 5 s, S3 closes them after ~20 s): long enough for the gap between two epochs
_READ = 256 << 10  # one read of the decrypted stream (OpenSSL hands back a record at a time;
# reading records into one preallocated buffer instead measured no faster: the zero-filled buffer
# costs what the record objects and their join did, ~50 µs a ~110 KB answer either way)


class App(Protocol):
    """What ``TlsLayer`` feeds: ``http1._Connection`` (an ``asyncio.Protocol``)."""

    def connection_made(self, transport: Any) -> None: ...
    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...


class TlsLayer(asyncio.Protocol):
    """TLS between a plain asyncio transport (below) and ``app`` (above), to which it is the
    transport: ``write``, ``pause_reading``, ``resume_reading``, ``close``, ``abort``.
    ``handshake`` completes when TLS is up (at once for an adopted connection) or holds the
    ``ssl.SSLError`` that stopped it (a certificate refused, a plain-http server)."""

    def __init__(self, app: App, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 *, established: bool = False) -> None:
        self.app = app
        self.tls, self.incoming, self.outgoing = tls, incoming, outgoing
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # a connect called off mid-handshake (a hedge cancelled) leaves no one to read its outcome
        self.handshake.add_done_callback(_outcome_read)
        if established:
            self.handshake.set_result(None)

    # -- below: the plain transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.app.connection_made(self)
        if not self.handshake.done():
            self._shake()

    def data_received(self, data: bytes) -> None:
        self.incoming.write(data)
        if not self.handshake.done():
            self._shake()
            if not self.handshake.done() or self.handshake.exception() is not None:
                return
        chunks: list[bytes] = []
        ended = False
        try:
            while chunk := self.tls.read(_READ):
                chunks.append(chunk)
            ended = True  # a read of nothing: the server's close_notify (``_ssl`` does not raise
            # SSLZeroReturnError for it once the shutdown is received), the end of its stream
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            ended = True
        except ssl.SSLError as exc:  # a record that does not decrypt: nothing more can be trusted
            self._deliver(chunks)
            self.abort()
            self.app.connection_lost(ConnectionError(f"TLS: {exc}"))
            return
        self._flush()  # what reading wrote (a key update's answer)
        self._deliver(chunks)
        if ended:
            self.app.eof_received()
            self.close()

    def eof_received(self) -> bool | None:
        if not self.handshake.done():
            self.handshake.set_exception(ConnectionResetError("the server closed the connection during "
                                                              "the TLS handshake"))
            return None
        return self.app.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(exc or ConnectionResetError(
                "the connection ended during the TLS handshake"))
        self.app.connection_lost(exc)

    # -- above: what the app calls

    def write(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self.tls
        return default if self.transport is None else self.transport.get_extra_info(name, default)

    # -- inside

    def _shake(self) -> None:
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except ssl.SSLError as exc:  # the store words it (a certificate, a plain-http server)
            self._flush()
            self.handshake.set_exception(exc)
            self.abort()
            return
        self._flush()
        self.handshake.set_result(None)

    def _flush(self) -> None:
        if self.outgoing.pending and self.transport is not None:
            self.transport.write(self.outgoing.read())

    def _deliver(self, chunks: list[bytes]) -> None:
        if len(chunks) == 1:
            self.app.data_received(chunks[0])
        elif chunks:
            self.app.data_received(b"".join(chunks))


def _outcome_read(future: asyncio.Future[None]) -> None:
    """Mark a handshake's failure as seen (asyncio logs a future's unread exception)."""
    if not future.cancelled():
        future.exception()


class Parked(NamedTuple):
    """An idle TLS connection that no event loop owns: its socket and its TLS state."""

    sock: socket.socket
    tls: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO
    since: float


class ParkingLot:
    """Idle TLS connections by origin, kept between one pool's close and the next pool's start
    in the same process (any thread: engines run in loop threads of their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[Hashable, list[Parked]] = {}
        self._pid = os.getpid()
        self._orphans: list[Parked] = []  # a parent's TLS state in a forked child: never freed there
        self._closes_at_exit = False

    def park(self, key: Hashable, transport: asyncio.Transport, layer: TlsLayer, most: int) -> bool:
        """Keep ``layer``'s connection for ``key`` (at most ``most`` of them) and let ``transport``
        go without closing the connection; whether it was kept (else the caller closes it)."""
        trsock = transport.get_extra_info("socket")
        if trsock is None or layer.incoming.pending:  # bytes not yet read: not an idle connection
            return False
        with self._lock:
            self._forget_if_forked()
            kept = self._by_key.setdefault(key, [])
            self._expire(kept, time.monotonic())
            if len(kept) >= most:
                return False
            sock = trsock.dup()  # the connection lives on in the copy; the transport closes its own
            if not self._closes_at_exit:  # registered on first use, not at import
                self._closes_at_exit = True
                atexit.register(self.clear)
            kept.append(Parked(sock, layer.tls, layer.incoming, layer.outgoing, time.monotonic()))
        transport.abort()
        return True

    def take(self, key: Hashable) -> Parked | None:
        """A parked connection for ``key`` that the server has not closed, or None."""
        with self._lock:
            self._forget_if_forked()
            kept = self._by_key.get(key)
            if not kept:
                return None
            self._expire(kept, time.monotonic())
            while kept:
                parked = kept.pop()
                if _quiet(parked.sock):
                    return parked
                parked.sock.close()  # the server closed it (or said something) while it waited
        return None

    def clear(self, key: Hashable | None = None) -> None:
        """Close the parked connections of ``key`` (all, without one)."""
        with self._lock:
            self._forget_if_forked()
            keys = list(self._by_key) if key is None else [key]
            for each in keys:
                for parked in self._by_key.pop(each, []):
                    parked.sock.close()

    def count(self) -> int:
        """How many connections are parked (those past ``PARK_SECONDS`` closed first)."""
        with self._lock:
            self._forget_if_forked()
            now = time.monotonic()
            for kept in self._by_key.values():
                self._expire(kept, now)
            return sum(len(kept) for kept in self._by_key.values())

    def _expire(self, kept: list[Parked], now: float) -> None:
        fresh = [parked for parked in kept if now - parked.since < PARK_SECONDS]
        for parked in kept:
            if now - parked.since >= PARK_SECONDS:
                parked.sock.close()
        kept[:] = fresh

    def _forget_if_forked(self) -> None:
        """In a forked child, the parent's connections are the parent's: close this process's
        copies of their descriptors (the parent's stay open) and keep their TLS state referenced
        for good, so that OpenSSL is not entered to free it in the child."""
        if self._pid == os.getpid():
            return
        for kept in self._by_key.values():
            for parked in kept:
                parked.sock.close()
                self._orphans.append(parked)
        self._by_key.clear()
        self._pid = os.getpid()


def _quiet(sock: socket.socket) -> bool:
    """Whether nothing is waiting to be read on an idle connection: a server that closed it (or
    sent anything unasked) makes it readable (urllib3 checks a pooled connection the same way)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


PARKED = ParkingLot()
