"""``FaultProxy``: a thread that owns an event loop and a listening socket, one ``Connection``
task per client, the plan swapped live, and counts of what happened.

Safety: it listens on 127.0.0.1 only and forwards only to a 127.0.0.1 upstream (anything else is a
``ValueError``); it stops by itself after ``max_lifetime`` seconds, and stopping aborts every
connection it holds and ends its thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import ssl
import threading
import time
from urllib.parse import urlsplit

from .connection import LOOPBACK, Connection
from .http11 import BUFFER
from .plan import Decision, FaultDecider, FaultPlan, is_real

log = logging.getLogger("faults")

DEFAULT_MAX_LIFETIME = 600.0
DEFAULT_HISTORY = 100_000
_START_TIMEOUT = 10.0


class FaultProxy:
    """A fault-injecting reverse proxy on ``127.0.0.1`` in front of ``upstream`` (also on 127.0.0.1).

    Use it as a context manager (``with FaultProxy(url, plan) as proxy:``) or call ``start()`` and
    ``stop()``. Nothing happens in ``__init__`` beyond validation: ``start()`` binds a free port
    (or ``port``), starts the event loop thread and returns once the proxy accepts connections.
    The proxy stops by itself ``max_lifetime`` seconds after it started.

    ``counts`` is a snapshot ``Counter``: ``"requests"`` (every request head received),
    ``"latency"`` (requests delayed), one key per fault kind injected, ``"straggle"`` (answered
    late), ``"throttled"`` (the ``slowdown`` answers the plan's ``get_rate`` made), and
    ``"upstream_errors"`` when the upstream could not be reached or broke mid-answer;
    ``accepted`` counts the connections accepted (with ``tls``, a TLS handshake each). ``decisions`` lists
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
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.upstream = upstream
        self._upstream_port = _check_upstream(upstream)
        if plan is None:
            plan = FaultPlan()
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan={plan!r} is not a FaultPlan")
        if not is_real(max_lifetime) or not max_lifetime > 0 or not math.isfinite(max_lifetime):
            raise ValueError(f"max_lifetime={max_lifetime!r} must be a finite number of seconds > 0")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be 0 (any free port) or a port number")
        self.max_lifetime = float(max_lifetime)
        self._requested_port = port
        self._tls = tls  # a server context: clients speak https to the proxy, which speaks http on
        self._lock = threading.Lock()
        self._decider = FaultDecider(plan)
        self._counts: collections.Counter[str] = collections.Counter()
        self._accepted = 0
        self._decisions: collections.deque[tuple[str, str, str | None]] = collections.deque(maxlen=history)
        self._heads: collections.deque[dict[str, list[str]]] = collections.deque(maxlen=history)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._port: int | None = None
        self._connections: set[Connection] = set()
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
    def accepted(self) -> int:
        """Connections accepted so far (over ``tls``: a TLS handshake each)."""
        with self._lock:
            return self._accepted

    @property
    def decisions(self) -> list[tuple[str, str, str | None]]:
        """``(method, target, fault kind or None)`` per request, in arrival order (a snapshot)."""
        with self._lock:
            return list(self._decisions)

    @property
    def headers(self) -> list[dict[str, list[str]]]:
        """The headers of each request as it reached the proxy (lower-case names), in the order
        of ``decisions`` (a snapshot): what a server behind it received."""
        with self._lock:
            return list(self._heads)

    def throttle_timeline(self) -> tuple[float | None, list[int]]:
        """The throttle's requests let through in each second since its first, and when (seconds
        after its first) a rising limit doubled (None: it has not), under the current plan."""
        with self._lock:
            decider = self._decider
            seconds = max(decider.passed_per_second, default=-1) + 1
            return decider.rose_after, [decider.passed_per_second[i] for i in range(seconds)]

    def reset_counts(self) -> None:
        """Forget counts and decisions (not the random sequence; use ``set_plan`` for that)."""
        with self._lock:
            self._counts.clear()
            self._decisions.clear()
            self._heads.clear()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy is not started; use `with FaultProxy(...)` or call start()")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>`` (``https`` with ``tls``): give this to the client instead of
        the upstream's URL."""
        return f"{'https' if self._tls else 'http'}://{LOOPBACK}:{self.port}"

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
            self._accept, LOOPBACK, self._requested_port, limit=BUFFER, backlog=1024, ssl=self._tls
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
        connection = Connection(self, reader, writer)
        self._connections.add(connection)
        with self._lock:
            self._accepted += 1
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

    def _decide(self, method: str, target: str,
                headers: dict[str, list[str]] | None = None) -> tuple[FaultPlan, Decision]:
        with self._lock:
            decider = self._decider
            decision = decider.decide(method, target, time.monotonic())
            self._counts["requests"] += 1
            if decision.straggle:
                self._counts["straggle"] += 1
            if decision.throttled:
                self._counts["throttled"] += 1
            if decider.plan.latency > 0:
                self._counts["latency"] += 1
            if decision.kind is not None:
                self._counts[decision.kind] += 1
            self._decisions.append((method, target, decision.kind))
            self._heads.append(dict(headers or {}))
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
