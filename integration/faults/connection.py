"""One client connection and the upstream connection that serves it: each request is forwarded
byte for byte, or answered with the fault its decision names.

HTTP/1.1 keep-alive; the upstream connection is opened lazily, reused while both sides keep the
connection alive, and reopened once if the upstream had silently closed an idle one. Bodies stream
through in pieces of at most ``PIECE`` bytes with write-side backpressure, so memory is bounded per
connection whatever the object size. A request body is relayed by a task of its own while the
answer is awaited, so ``Expect: 100-continue`` works untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import TYPE_CHECKING

from .answers import simple_response, slowdown_response
from .http11 import (
    BUFFER,
    PIECE,
    BadMessage,
    Head,
    Sink,
    chunk_size,
    copy_chunked,
    copy_exact,
    copy_to_eof,
    read_head,
)
from .plan import Decision, FaultPlan

if TYPE_CHECKING:
    from .proxy import FaultProxy

log = logging.getLogger("faults")

LOOPBACK = "127.0.0.1"  # the only address the proxy listens on and connects to
_WRITE_HIGH = 1 << 18  # write buffer above which relaying waits for the peer to read
_CONNECT_TIMEOUT = 10.0
_CLOSE_TIMEOUT = 5.0
_NO_BODY_STATUSES = frozenset({204, 304})


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _tune(writer: asyncio.StreamWriter) -> None:
    writer.transport.set_write_buffer_limits(high=_WRITE_HIGH)



class _UpstreamFailed(Exception):
    """The upstream could not be reached or broke off before its answer was complete."""


class Connection:
    """One client connection and the upstream connection that serves it."""

    def __init__(self, proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.reader = reader
        self.writer = writer
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.responded = False  # whether any of the current answer went to the client
        _tune(writer)

    def abort(self) -> None:
        """Drop both connections now (stop, or an unrecoverable error)."""
        self.writer.transport.abort()
        self._drop_upstream()

    def _drop_upstream(self) -> None:
        if self.up_writer is not None:
            self.up_writer.transport.abort()
        self.up_reader = self.up_writer = None

    async def _close_client(self) -> None:
        """Close gracefully: what was written still reaches the client, then FIN."""
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), _CLOSE_TIMEOUT)
        except (asyncio.TimeoutError, OSError):
            self.writer.transport.abort()

    async def serve(self) -> None:
        while True:
            try:
                request = await read_head(self.reader, request=True)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client closed between requests
            except BadMessage as exc:
                self.writer.write(simple_response("400 Bad Request", f"FaultProxy: {exc}\n"))
                await self._close_client()
                return
            if not await self._exchange(request):
                await self._close_client()
                return

    async def _exchange(self, request: Head) -> bool:
        """Answer one request; True when the client connection stays open for the next one."""
        method, target = request.start[0], request.start[1]
        plan, decision = self.proxy._decide(method, target, request.headers)
        try:
            framing = request.body_framing()
        except BadMessage as exc:
            self.writer.write(simple_response("400 Bad Request", f"FaultProxy: {exc}\n"))
            return False
        if plan.latency > 0:
            await asyncio.sleep(plan.latency)
        if decision.straggle:
            await asyncio.sleep(plan.straggle_seconds)
        if decision.kind == "reset":
            _set_linger_zero(self.writer)
            self.abort()
            return False
        if decision.kind == "slowdown":
            return await self._slowdown(request, framing, plan)
        self.responded = False
        try:
            return await self._forward(request, framing, plan, decision)
        except (_UpstreamFailed, BadMessage, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._drop_upstream()
            if self.writer.transport.is_closing():
                return False  # the client went away; nothing to report
            self.proxy._count("upstream_errors")
            log.debug("FaultProxy: upstream failed for %s %s: %s", method, target, exc)
            if self.responded:  # part of the answer is out: the client must see it break off
                self.writer.transport.abort()
            else:
                self.writer.write(simple_response("502 Bad Gateway", f"FaultProxy: upstream failed: {exc}\n"))
            return False

    async def _slowdown(self, request: Head, framing: tuple[str, int], plan: FaultPlan) -> bool:
        has_body = framing[0] == "chunked" or framing[1] > 0
        close = plan.slowdown_close or not request.keep_alive()
        if has_body and "100-continue" in request.tokens("expect"):
            close = True  # the client may or may not send the body now: end the connection
        elif framing[0] == "length":
            await self._discard(framing[1])
        elif framing[0] == "chunked":
            await copy_chunked(self.reader, Sink())
        self.writer.write(slowdown_response(request.start[1], head_only=request.start[0] == "HEAD", close=close))
        await self.writer.drain()
        return not close

    async def _discard(self, size: int) -> None:
        while size > 0:
            data = await self.reader.read(min(size, PIECE))
            if not data:
                raise asyncio.IncompleteReadError(b"", size)
            size -= len(data)

    async def _open_upstream(self) -> bool:
        """Connect if needed; True when an existing (possibly stale) connection is reused."""
        if self.up_writer is not None and not self.up_reader.at_eof() and not self.up_writer.is_closing():
            return True
        self._drop_upstream()
        try:
            self.up_reader, self.up_writer = await asyncio.wait_for(
                asyncio.open_connection(LOOPBACK, self.proxy._upstream_port, limit=BUFFER), _CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise _UpstreamFailed(f"cannot connect to {self.proxy.upstream}: {exc}") from exc
        _tune(self.up_writer)
        return False

    async def _forward(self, request: Head, framing: tuple[str, int], plan: FaultPlan, decision: Decision) -> bool:
        has_body = framing[0] == "chunked" or framing[1] > 0
        response = None
        body_task: asyncio.Task | None = None
        for attempt in (0, 1):
            reused = await self._open_upstream()
            self.up_writer.write(request.raw)
            if has_body:
                body_task = asyncio.get_running_loop().create_task(self._relay_request_body(framing))
                self.proxy._tasks.add(body_task)
                body_task.add_done_callback(self.proxy._tasks.discard)
                break
            try:
                await self.up_writer.drain()
                response = await read_head(self.up_reader, request=False)
                break
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                partial = getattr(exc, "partial", b"")
                self._drop_upstream()
                if not (reused and attempt == 0 and not partial):
                    raise
        try:
            if response is None:
                response = await read_head(self.up_reader, request=False)
            while response.start[1].startswith("1") and response.start[1] != "101":
                self.responded = True
                self.writer.write(response.raw)  # 100 Continue and friends go straight through
                await self.writer.drain()
                response = await read_head(self.up_reader, request=False)
            if response.start[1] == "101":
                raise BadMessage("protocol upgrades are not relayed")
            keep = await self._relay_response(request, response, plan, decision)
            if body_task is not None:
                if not body_task.done():  # the upstream answered before the whole body was sent
                    keep = False
                    self._drop_upstream()
                elif body_task.cancelled() or body_task.exception() is not None:
                    keep = False
            return keep
        finally:
            if body_task is not None:
                if not body_task.done():
                    body_task.cancel()
                    await asyncio.wait([body_task])  # lets our own cancellation through
                if not body_task.cancelled():
                    body_task.exception()  # retrieved: its failure has already ended both sides

    async def _relay_request_body(self, framing: tuple[str, int]) -> None:
        up_writer = self.up_writer
        try:
            if framing[0] == "length":
                await copy_exact(self.reader, up_writer, framing[1])
            else:
                await copy_chunked(self.reader, up_writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The client went away mid-upload: make the upstream side fail too, so that the
            # response wait in _forward ends instead of hanging.
            self.abort()
            raise

    async def _relay_response(self, request: Head, response: Head, plan: FaultPlan, decision: Decision) -> bool:
        status = int(response.start[1])
        if request.start[0] == "HEAD" or status in _NO_BODY_STATUSES:
            framing = ("none", 0)
        else:
            framing = response.body_framing()
            if framing[0] == "none":
                framing = ("eof", 0)  # no length: the body ends when the upstream closes
        self.responded = True
        if decision.kind in ("truncate", "stall"):
            self.writer.write(response.raw)
            await self._relay_part(framing, decision.fraction)
            await self.writer.drain()
            self._drop_upstream()  # its answer is unfinished: the connection cannot be reused
            if decision.kind == "stall":
                await asyncio.sleep(plan.stall_seconds)
            return False
        self.writer.write(response.raw)
        if framing[0] == "length":
            await copy_exact(self.up_reader, self.writer, framing[1], plan.bandwidth)
        elif framing[0] == "chunked":
            await copy_chunked(self.up_reader, self.writer)
        elif framing[0] == "eof":
            await copy_to_eof(self.up_reader, self.writer)
        await self.writer.drain()
        upstream_keep = framing[0] != "eof" and response.keep_alive()
        if not upstream_keep:
            self._drop_upstream()
        return upstream_keep and request.keep_alive()

    async def _relay_part(self, framing: tuple[str, int], fraction: float) -> None:
        """Relay the start of a body: ``fraction`` of it for Content-Length, ``fraction`` of the
        first data chunk for chunked bodies, ``fraction`` of the first piece read otherwise."""
        kind, size = framing
        if kind == "length":
            await copy_exact(self.up_reader, self.writer, int(size * fraction))
        elif kind == "chunked":
            line = await self.up_reader.readuntil(b"\r\n")
            size = chunk_size(line)
            if size:
                self.writer.write(line)
                await copy_exact(self.up_reader, self.writer, int(size * fraction))
        elif kind == "eof":
            data = await self.up_reader.read(PIECE)
            self.writer.write(data[: int(len(data) * fraction)])
