"""At most ``limit`` requests of one kind in flight at once through one store (one engine's run).

Why: a shuffled Parquet epoch opens many units together (``lanes.OPEN_PIECES``) and each started
its ranged GETs at once, so the pool never had a connection idle to give: nearly every GET opened
a new one (a TCP, and over https a TLS, handshake each; ~1 connection per request against 1 per
~6 for pyarrow, bench/results/aws-2026-11-28-f.md). Held only while a request runs (never over a
retry's wait), so a waiting GET takes the next kept-alive connection instead of a new one.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# per store: the loop its semaphore belongs to (a store outliving its loop gets a new one) and it
_GATES: weakref.WeakKeyDictionary[Any, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary())


def _gate(store: Any, limit: int) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    held = _GATES.get(store)
    if held is None or held[0] is not loop:
        held = _GATES[store] = (loop, asyncio.Semaphore(limit))
    return held[1]


async def gated(store: Any, limit: int, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()`` once fewer than ``limit`` gated calls through ``store`` run (``limit`` 0:
    at once). The first call of a store and loop sets the limit."""
    if limit <= 0:
        return await call()
    async with _gate(store, limit):
        return await call()
