"""A fault-injecting HTTP/1.1 reverse proxy that sits in front of a real S3 server on 127.0.0.1.

Tests and benchmarks point a client at ``FaultProxy.endpoint_url`` instead of the server; the proxy
forwards every request byte for byte (the ``Host`` header included, so signed requests still verify
upstream) and, with seeded probabilities per request, injects what a real object store does to a
client on a bad day::

    latency    every request waits ``latency`` seconds before it is forwarded (time to first byte)
    reset      the client connection is torn down with a TCP RST (SO_LINGER 0) before any answer
    slowdown   ``503 SlowDown`` with S3's XML error body, without asking the upstream
    truncate   the real status and headers (true Content-Length), then part of the body, then close
    stall      the real headers and part of the body, then silence for ``stall_seconds``, then close

Usage from a test (the proxy runs its own event loop in a thread)::

    with DevServer(buckets=["train"]) as server, FaultProxy(server.config.endpoint_url,
                                                            FaultPlan(slowdown=0.3, seed=1)) as proxy:
        config = dataclasses.replace(server.config, endpoint_url=proxy.endpoint_url)
        ...
        assert proxy.counts["slowdown"] > 0
        proxy.set_plan(FaultPlan())          # live: from now on everything passes

Faults other than latency hit only GETs of objects by default (``only_methods=("GET",)``,
``objects_only=True``), so uploads, listings and bucket requests stay reliable; both are settings.
A reset or slowdown request never reaches the upstream.

or from a shell, in a process of its own so it does not share the client's GIL::

    python integration/faults.py --upstream http://127.0.0.1:8333 --latency 0.02

Design, in short:

* One task per client connection, HTTP/1.1 keep-alive, and one upstream connection per client
  connection (opened lazily, reused while both sides keep the connection alive, reopened once if the
  upstream had silently closed an idle one). Bodies stream through in pieces of at most ``_PIECE``
  bytes with write-side backpressure, so memory is bounded per connection whatever the object size.
* Request bodies: ``Content-Length`` or chunked, relayed by a task of their own while the proxy
  waits for the upstream's answer, so ``Expect: 100-continue`` works untouched: the header goes
  upstream, the upstream's ``100 Continue`` comes back, the client sends the body, the proxy relays
  it. Response bodies: ``Content-Length``, chunked (relayed raw, trailers included) or delimited by
  the upstream closing.
* Decisions come from one ``random.Random(plan.seed)`` in the order requests arrive: exactly two
  draws per request (which fault, and where in the body to cut) whatever its method, so the same
  seed and the same sequence of requests give the same sequence of decisions. ``set_plan`` starts a
  fresh sequence from the new plan's seed.
* Safety: the proxy listens on 127.0.0.1 only and forwards only to a 127.0.0.1 upstream; anything
  else is a ``ValueError``. It stops by itself after ``max_lifetime`` seconds, and stopping aborts
  every connection it holds and ends its thread.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import email.utils
import itertools
import logging
import math
import random
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterable
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

__all__ = [
    "DEFAULT_MAX_LIFETIME",
    "DEFAULT_STALL_SECONDS",
    "FAULT_KINDS",
    "LOOPBACK",
    "Decision",
    "FaultDecider",
    "FaultPlan",
    "FaultProxy",
]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
FAULT_KINDS = ("reset", "slowdown", "truncate", "stall")
DEFAULT_MAX_LIFETIME = 600.0
DEFAULT_STALL_SECONDS = 30.0
DEFAULT_ONLY_METHODS = ("GET",)
DEFAULT_HISTORY = 100_000

_PIECE = 1 << 18  # most bytes moved per read when relaying a body
_BUFFER = 1 << 18  # StreamReader limit: buffered bytes before reading pauses; also the longest head
_WRITE_HIGH = 1 << 18  # write buffer above which relaying waits for the peer to read
_CONNECT_TIMEOUT = 10.0
_CLOSE_TIMEOUT = 5.0
_START_TIMEOUT = 10.0
_NO_BODY_STATUSES = frozenset({204, 304})
_SLOWDOWN_MESSAGE = "Please reduce your request rate."


# ---------------------------------------------------------------------------------------------
# The plan and the seeded decisions: pure, no I/O.


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """What to do to requests: probabilities per request, and the seed that makes them repeat.

    ``latency`` is not a probability: every request waits that many seconds before it is forwarded.
    ``reset``, ``slowdown``, ``truncate`` and ``stall`` are probabilities in [0, 1] that together
    may not exceed 1; each request gets at most one of them. They apply only to requests whose
    method is in ``only_methods`` (``GET`` by default, so uploads stay reliable; ``None`` means
    every method) and, with ``objects_only`` (the default), only to requests for an object
    (``/bucket/key``, path-style addressing), so listings and other bucket requests stay reliable
    too. ``stall_seconds`` is how long a stalled response stays
    silent before the proxy closes it: make it longer than the client's read timeout.
    """

    latency: float = 0.0
    reset: float = 0.0
    slowdown: float = 0.0
    truncate: float = 0.0
    stall: float = 0.0
    stall_seconds: float = DEFAULT_STALL_SECONDS
    seed: int = 0
    only_methods: tuple[str, ...] | None = DEFAULT_ONLY_METHODS
    objects_only: bool = True

    def __post_init__(self) -> None:
        for name in ("latency", "stall_seconds"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"FaultPlan {name}={value!r} must be a finite number of seconds >= 0")
        for name in FAULT_KINDS:
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultPlan {name}={value!r} must be a probability between 0 and 1")
        total = self.fault_probability
        if total > 1.0 + 1e-9:
            raise ValueError(
                f"FaultPlan fault probabilities add up to {total!r} "
                f"(reset+slowdown+truncate+stall); they may not exceed 1"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"FaultPlan seed={self.seed!r} must be an int")
        if not isinstance(self.objects_only, bool):
            raise ValueError(f"FaultPlan objects_only={self.objects_only!r} must be True or False")
        object.__setattr__(self, "only_methods", _methods(self.only_methods))

    @property
    def fault_probability(self) -> float:
        """Chance that an eligible request gets some fault (latency aside)."""
        return sum(getattr(self, name) for name in FAULT_KINDS)

    def applies_to(self, method: str, target: str = "/bucket/key") -> bool:
        """Whether faults other than latency may hit a request with this method and request-target."""
        if self.only_methods is not None and method.upper() not in self.only_methods:
            return False
        return not self.objects_only or _names_object(target)


def _names_object(target: str) -> bool:
    """Whether a path-style request-target names an object: ``/bucket/key``, not ``/bucket?list``."""
    if not target.startswith("/"):
        target = "/" + target.split("://", 1)[-1].partition("/")[2]  # absolute-form
    path = target.split("?", 1)[0]
    bucket, slash, key = path[1:].partition("/")
    return bool(bucket and slash and key)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _methods(value: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):  # only_methods="PUT" means ("PUT",), not ("P", "U", "T")
        value = (value,)
    methods = tuple(value)
    for method in methods:
        if not isinstance(method, str) or not method or not method.isalpha():
            raise ValueError(f"FaultPlan only_methods has {method!r}; give HTTP method names like 'GET'")
    return tuple(method.upper() for method in methods)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The fate of one request: ``kind`` is one of ``FAULT_KINDS`` or ``None`` (forward intact);
    ``fraction`` in [0, 1) says where in the body a ``truncate`` or ``stall`` cuts."""

    kind: str | None
    fraction: float


class FaultDecider:
    """The seeded sequence of decisions for one plan: exactly two draws per request, any method.

    Not thread-safe on its own; ``FaultProxy`` calls it from its event loop only.
    """

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)

    def decide(self, method: str, target: str) -> Decision:
        draw = self._rng.random()
        fraction = self._rng.random()
        if not self.plan.applies_to(method, target):
            return Decision(None, fraction)
        edge = 0.0
        for kind in FAULT_KINDS:
            probability = getattr(self.plan, kind)
            if probability and draw < edge + probability:
                return Decision(kind, fraction)
            edge += probability
        return Decision(None, fraction)


# ---------------------------------------------------------------------------------------------
# The proxy: a thread that owns an event loop and a listening socket.


class FaultProxy:
    """A fault-injecting reverse proxy on ``127.0.0.1`` in front of ``upstream`` (also on 127.0.0.1).

    Use it as a context manager (``with FaultProxy(url, plan) as proxy:``) or call ``start()`` and
    ``stop()``. Nothing happens in ``__init__`` beyond validation: ``start()`` binds a free port
    (or ``port``), starts the event loop thread and returns once the proxy accepts connections.
    The proxy stops by itself ``max_lifetime`` seconds after it started.

    ``counts`` is a snapshot ``Counter``: ``"requests"`` (every request head received),
    ``"latency"`` (requests delayed), one key per fault kind injected, and ``"upstream_errors"``
    when the upstream could not be reached or broke mid-answer. ``decisions`` lists
    ``(method, target, kind)`` for the last ``history`` requests in arrival order.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        max_lifetime: float = DEFAULT_MAX_LIFETIME,
        port: int = 0,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        self.upstream = upstream
        self._upstream_port = _check_upstream(upstream)
        if plan is None:
            plan = FaultPlan()
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan={plan!r} is not a FaultPlan")
        if not _is_real(max_lifetime) or not max_lifetime > 0 or not math.isfinite(max_lifetime):
            raise ValueError(f"max_lifetime={max_lifetime!r} must be a finite number of seconds > 0")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be 0 (any free port) or a port number")
        self.max_lifetime = float(max_lifetime)
        self._requested_port = port
        self._lock = threading.Lock()
        self._decider = FaultDecider(plan)
        self._counts: collections.Counter[str] = collections.Counter()
        self._decisions: collections.deque[tuple[str, str, str | None]] = collections.deque(maxlen=history)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._port: int | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._stop_requested = False

    # -- public surface ------------------------------------------------------------------------

    @property
    def plan(self) -> FaultPlan:
        return self._decider.plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Change behaviour from now on; decisions restart from ``plan.seed``. Thread-safe."""
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan={plan!r} is not a FaultPlan")
        with self._lock:
            self._decider = FaultDecider(plan)

    @property
    def counts(self) -> collections.Counter[str]:
        """A snapshot of what happened so far (see the class docstring for the keys)."""
        with self._lock:
            return collections.Counter(self._counts)

    @property
    def decisions(self) -> list[tuple[str, str, str | None]]:
        """``(method, target, fault kind or None)`` per request, in arrival order (a snapshot)."""
        with self._lock:
            return list(self._decisions)

    def reset_counts(self) -> None:
        """Forget counts and decisions (not the random sequence; use ``set_plan`` for that)."""
        with self._lock:
            self._counts.clear()
            self._decisions.clear()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy is not started; use `with FaultProxy(...)` or call start()")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``: give this to the client instead of the upstream's URL."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("FaultProxy was already started; make a new one")
        self._thread = threading.Thread(
            target=self._run_thread, name=f"FaultProxy->{self._upstream_port}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            self.stop()
            raise RuntimeError(f"FaultProxy did not start within {_START_TIMEOUT} s")
        if self._startup_error is not None:
            self._thread.join(_START_TIMEOUT)
            raise RuntimeError(f"FaultProxy could not start: {self._startup_error}") from self._startup_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection, stop listening and end the thread. Idempotent, thread-safe."""
        self._stop_requested = True
        thread, loop, event = self._thread, self._loop, self._stop_event
        if thread is None:
            return
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(event.set)
        if thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError(f"FaultProxy thread did not end within {timeout} s")

    close = stop

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the proxy has stopped (e.g. after ``max_lifetime``); True if it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self._thread else "not started")
        where = f" at {self.endpoint_url}" if self._port is not None else ""
        return f"<FaultProxy {state}{where} -> {self.upstream} {self.plan!r}>"

    # -- the event loop thread -----------------------------------------------------------------

    def _run_thread(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                log.exception("FaultProxy stopped on an error")
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                loop.run_until_complete(_cancel_all(loop))
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._stop_event = asyncio.Event()
        server = await asyncio.start_server(
            self._accept, LOOPBACK, self._requested_port, limit=_BUFFER, backlog=1024
        )
        try:
            self._port = server.sockets[0].getsockname()[1]
            self._ready.set()
            if self._stop_requested:  # stop() raced with start()
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), self.max_lifetime)
        finally:
            server.close()
            for connection in list(self._connections):
                connection.abort()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        connection = _Connection(self, reader, writer)
        self._connections.add(connection)
        try:
            await connection.serve()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.debug("FaultProxy connection failed", exc_info=True)
        finally:
            connection.abort()
            self._connections.discard(connection)
            self._tasks.discard(task)

    def _decide(self, method: str, target: str) -> tuple[FaultPlan, Decision]:
        with self._lock:
            decider = self._decider
            decision = decider.decide(method, target)
            self._counts["requests"] += 1
            if decider.plan.latency > 0:
                self._counts["latency"] += 1
            if decision.kind is not None:
                self._counts[decision.kind] += 1
            self._decisions.append((method, target, decision.kind))
            return decider.plan, decision

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1


async def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left (connections accepted while stopping), so no task outlives the loop."""
    for _ in range(3):
        tasks = [task for task in asyncio.all_tasks(loop) if task is not asyncio.current_task()]
        if not tasks:
            return
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _check_upstream(upstream: str) -> int:
    """The upstream's port; a ``ValueError`` for anything but ``http://127.0.0.1:<port>``."""
    if not isinstance(upstream, str):
        raise ValueError(f"upstream={upstream!r} must be a URL string like 'http://127.0.0.1:8333'")
    parts = urlsplit(upstream)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"upstream={upstream!r} has an invalid port") from exc
    if parts.scheme != "http" or parts.hostname != LOOPBACK or parts.username or parts.password:
        raise ValueError(
            f"upstream={upstream!r} is not allowed: FaultProxy forwards only to http://{LOOPBACK}:<port>"
        )
    if port is None or port == 0:
        raise ValueError(f"upstream={upstream!r} must name its port, like 'http://{LOOPBACK}:8333'")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"upstream={upstream!r} must be just scheme, host and port (no path)")
    return port


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 framing: just enough to find where messages end, never to rewrite them.


class _BadMessage(Exception):
    """The peer sent something that is not HTTP/1.1 we can relay."""


@dataclasses.dataclass
class _Head:
    raw: bytes  # exactly as received, relayed unchanged
    start: list[str]  # request line or status line, split in three
    headers: dict[str, list[str]]  # lower-case name -> values

    def get(self, name: str) -> str | None:
        values = self.headers.get(name)
        return values[-1] if values else None

    def tokens(self, name: str) -> set[str]:
        return {token.strip().lower() for value in self.headers.get(name, ()) for token in value.split(",")}

    @property
    def version(self) -> str:
        return self.start[0] if self.start[0].startswith("HTTP/") else self.start[2]

    def keep_alive(self) -> bool:
        connection = self.tokens("connection")
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    def body_framing(self) -> tuple[str, int]:
        """("chunked", 0), ("length", n) or ("none", 0) for a request; responses decide more."""
        if "transfer-encoding" in self.headers:
            codings = [t for t in self.tokens("transfer-encoding") if t]
            if "content-length" in self.headers or not codings or "chunked" not in codings:
                raise _BadMessage("unsupported Transfer-Encoding / Content-Length combination")
            return "chunked", 0
        lengths = set(self.headers.get("content-length", ()))
        if not lengths:
            return "none", 0
        if len(lengths) != 1:
            raise _BadMessage("conflicting Content-Length headers")
        value = lengths.pop().strip()
        if not value.isdigit():
            raise _BadMessage(f"bad Content-Length {value!r}")
        return "length", int(value)


def _parse_head(raw: bytes, *, request: bool) -> _Head:
    try:
        text = raw[:-4].decode("latin-1")
    except UnicodeDecodeError as exc:  # latin-1 decodes anything; kept for clarity
        raise _BadMessage("undecodable head") from exc
    lines = text.split("\r\n")
    start = lines[0].split(" ", 2)
    if len(start) != 3:
        raise _BadMessage(f"bad start line {lines[0][:100]!r}")
    if request and not (start[0].isalpha() and start[2] in ("HTTP/1.1", "HTTP/1.0")):
        raise _BadMessage(f"bad request line {lines[0][:100]!r}")
    if not request and not (start[0].startswith("HTTP/1.") and start[1].isdigit() and len(start[1]) == 3):
        raise _BadMessage(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise _BadMessage(f"bad header line {line[:100]!r}")
        headers.setdefault(name.lower(), []).append(value.strip())
    return _Head(raw, start, headers)


async def _read_head(reader: asyncio.StreamReader, *, request: bool) -> _Head:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise _BadMessage("head too long") from exc
    return _parse_head(raw, request=request)


async def _copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> None:
    """Relay exactly ``size`` bytes; ``IncompleteReadError`` if the reader ends first."""
    while size > 0:
        data = await reader.read(min(size, _PIECE))
        if not data:
            raise asyncio.IncompleteReadError(b"", size)
        writer.write(data)
        size -= len(data)
        await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relay a chunked body raw: size lines, data, the last chunk and any trailers."""
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size = _chunk_size(line)
        if size == 0:
            break
        await _copy_exact(reader, writer, size + 2)  # data and its CRLF
    while True:  # trailers, then the empty line that ends the message
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        if line == b"\r\n":
            break
    await writer.drain()


async def _copy_to_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(_PIECE):
        writer.write(data)
        await writer.drain()


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip()
    try:
        size = int(text, 16)
    except ValueError:
        raise _BadMessage(f"bad chunk size line {line[:40]!r}") from None
    if size < 0:
        raise _BadMessage(f"bad chunk size line {line[:40]!r}")
    return size


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _tune(writer: asyncio.StreamWriter) -> None:
    writer.transport.set_write_buffer_limits(high=_WRITE_HIGH)


_request_ids = itertools.count(1)


def _slowdown_response(target: str, *, head_only: bool, close: bool) -> bytes:
    request_id = f"FAULTPROXY{next(_request_ids):012d}"
    resource = target.split("?", 1)[0]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>SlowDown</Code><Message>{_SLOWDOWN_MESSAGE}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    head = (
        "HTTP/1.1 503 Slow Down\r\n"
        f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
        "Server: FaultProxy\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    ).encode()
    return head if head_only else head + body


def _simple_response(status: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status}\r\nServer: FaultProxy\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class _UpstreamFailed(Exception):
    """The upstream could not be reached or broke off before its answer was complete."""


class _Connection:
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
                request = await _read_head(self.reader, request=True)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client closed between requests
            except _BadMessage as exc:
                self.writer.write(_simple_response("400 Bad Request", f"FaultProxy: {exc}\n"))
                await self._close_client()
                return
            if not await self._exchange(request):
                await self._close_client()
                return

    async def _exchange(self, request: _Head) -> bool:
        """Answer one request; True when the client connection stays open for the next one."""
        method, target = request.start[0], request.start[1]
        plan, decision = self.proxy._decide(method, target)
        try:
            framing = request.body_framing()
        except _BadMessage as exc:
            self.writer.write(_simple_response("400 Bad Request", f"FaultProxy: {exc}\n"))
            return False
        if plan.latency > 0:
            await asyncio.sleep(plan.latency)
        if decision.kind == "reset":
            _set_linger_zero(self.writer)
            self.abort()
            return False
        if decision.kind == "slowdown":
            return await self._slowdown(request, framing)
        self.responded = False
        try:
            return await self._forward(request, framing, plan, decision)
        except (_UpstreamFailed, _BadMessage, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._drop_upstream()
            if self.writer.transport.is_closing():
                return False  # the client went away; nothing to report
            self.proxy._count("upstream_errors")
            log.debug("FaultProxy: upstream failed for %s %s: %s", method, target, exc)
            if self.responded:  # part of the answer is out: the client must see it break off
                self.writer.transport.abort()
            else:
                self.writer.write(_simple_response("502 Bad Gateway", f"FaultProxy: upstream failed: {exc}\n"))
            return False

    async def _slowdown(self, request: _Head, framing: tuple[str, int]) -> bool:
        has_body = framing[0] == "chunked" or framing[1] > 0
        close = not request.keep_alive()
        if has_body and "100-continue" in request.tokens("expect"):
            close = True  # the client may or may not send the body now: end the connection
        elif framing[0] == "length":
            await self._discard(framing[1])
        elif framing[0] == "chunked":
            await _copy_chunked(self.reader, _Sink())
        self.writer.write(_slowdown_response(request.start[1], head_only=request.start[0] == "HEAD", close=close))
        await self.writer.drain()
        return not close

    async def _discard(self, size: int) -> None:
        while size > 0:
            data = await self.reader.read(min(size, _PIECE))
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
                asyncio.open_connection(LOOPBACK, self.proxy._upstream_port, limit=_BUFFER), _CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise _UpstreamFailed(f"cannot connect to {self.proxy.upstream}: {exc}") from exc
        _tune(self.up_writer)
        return False

    async def _forward(self, request: _Head, framing: tuple[str, int], plan: FaultPlan, decision: Decision) -> bool:
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
                response = await _read_head(self.up_reader, request=False)
                break
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                partial = getattr(exc, "partial", b"")
                self._drop_upstream()
                if not (reused and attempt == 0 and not partial):
                    raise
        try:
            if response is None:
                response = await _read_head(self.up_reader, request=False)
            while response.start[1].startswith("1") and response.start[1] != "101":
                self.responded = True
                self.writer.write(response.raw)  # 100 Continue and friends go straight through
                await self.writer.drain()
                response = await _read_head(self.up_reader, request=False)
            if response.start[1] == "101":
                raise _BadMessage("protocol upgrades are not relayed")
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
                await _copy_exact(self.reader, up_writer, framing[1])
            else:
                await _copy_chunked(self.reader, up_writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The client went away mid-upload: make the upstream side fail too, so that the
            # response wait in _forward ends instead of hanging.
            self.abort()
            raise

    async def _relay_response(self, request: _Head, response: _Head, plan: FaultPlan, decision: Decision) -> bool:
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
            await _copy_exact(self.up_reader, self.writer, framing[1])
        elif framing[0] == "chunked":
            await _copy_chunked(self.up_reader, self.writer)
        elif framing[0] == "eof":
            await _copy_to_eof(self.up_reader, self.writer)
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
            await _copy_exact(self.up_reader, self.writer, int(size * fraction))
        elif kind == "chunked":
            line = await self.up_reader.readuntil(b"\r\n")
            size = _chunk_size(line)
            if size:
                self.writer.write(line)
                await _copy_exact(self.up_reader, self.writer, int(size * fraction))
        elif kind == "eof":
            data = await self.up_reader.read(_PIECE)
            self.writer.write(data[: int(len(data) * fraction)])


class _Sink:
    """A writer that forgets what it is given (to discard a chunked request body)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Command line: run the proxy in a process of its own (benchmarks).


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help=f"http://{LOOPBACK}:<port> of the S3 server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added before forwarding")
    for kind in FAULT_KINDS:
        parser.add_argument(f"--{kind}", type=float, default=0.0, help=f"probability of {kind} per request")
    parser.add_argument("--stall-seconds", type=float, default=DEFAULT_STALL_SECONDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-methods", default=",".join(DEFAULT_ONLY_METHODS),
                        help="comma-separated methods faults apply to, or '*' for all")
    parser.add_argument("--all-paths", action="store_true",
                        help="let faults hit bucket requests (listings) too, not only objects")
    parser.add_argument("--max-lifetime", type=float, default=DEFAULT_MAX_LIFETIME)
    args = parser.parse_args(argv)
    methods = None if args.only_methods == "*" else tuple(m for m in args.only_methods.split(",") if m)
    try:
        plan = FaultPlan(latency=args.latency, reset=args.reset, slowdown=args.slowdown, truncate=args.truncate,
                         stall=args.stall, stall_seconds=args.stall_seconds, seed=args.seed, only_methods=methods,
                         objects_only=not args.all_paths)
        proxy = FaultProxy(args.upstream, plan, max_lifetime=args.max_lifetime, port=args.port)
    except ValueError as exc:
        parser.error(str(exc))
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    with proxy:
        print(proxy.endpoint_url, flush=True)
        while proxy.running and not done.wait(0.2):
            pass
        counts = proxy.counts
    print(dict(counts), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
