"""The engine's loop thread: calls into it from another thread, and its end."""

from __future__ import annotations

import concurrent.futures
import threading

import anyio
import pytest
from os_threads import HAS_TASKS, WHY_NOT, alive, linger_at_exit

from loader.engine.loopthread import LoopThread


def test_a_call_returns_the_result_or_raises_the_error_in_the_calling_thread():
    loop = LoopThread.start("test-loop")
    try:
        async def where(x: int) -> tuple[int, str]:
            await anyio.sleep(0)
            return x + 1, threading.current_thread().name

        assert loop.call(where, 1) == (2, "test-loop")

        async def fails() -> None:
            raise KeyError("no such key")

        with pytest.raises(KeyError, match="no such key"):
            loop.call(fails)
    finally:
        loop.stop()
    assert not loop.thread.is_alive()


def test_a_call_still_waiting_when_the_loop_stops_is_cancelled_not_left_hanging():
    loop = LoopThread.start("test-loop")
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await anyio.sleep(3600)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(loop.call, forever)
        assert started.wait(10)
        loop.stop()
        with pytest.raises(concurrent.futures.CancelledError):
            pending.result(timeout=10)
    assert not loop.thread.is_alive()


@pytest.mark.skipif(not HAS_TASKS, reason=WHY_NOT)
def test_stop_returns_once_the_os_has_the_loop_thread_gone():
    """The engine stops its loop at the end of an epoch, and a DataLoader may fork its workers
    right after: a loop thread still in its C-level exit then (OpenSSL's handlers, after TLS
    reads) left a forked worker's first TLS handshake waiting for good."""
    loop = LoopThread.start("test-loop")

    async def lingers() -> int:
        linger_at_exit(0.3)
        return threading.get_native_id()

    native_id = loop.call(lingers)
    loop.stop()
    assert not alive(native_id)
