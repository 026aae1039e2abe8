"""The engine's ``TailStore``: which reads it hedges. A straggling read of a store is sent again;
a read through the disk cache (a store saying ``hedged_by_engine = False``) is not, since a
hedged miss would fetch and fill one entry twice."""

from __future__ import annotations

import itertools

import anyio
import pytest

from loader.engine.tail import HEDGE_AT_FIRST, TailStore

_endpoints = itertools.count()
STRAGGLE = HEDGE_AT_FIRST + 1.0  # seconds: well past the threshold used before any answer is known


class Straggling:
    """A store whose every read answers ``STRAGGLE`` seconds late, counting the reads."""

    def __init__(self, hedged_by_engine: bool) -> None:
        self.hedged_by_engine = hedged_by_engine
        self.reads = 0

    async def get(self, bucket: str, key: str, *, pin=None) -> bytes:
        self.reads += 1
        await anyio.sleep(STRAGGLE)
        return b"body"


@pytest.mark.parametrize("hedged_by_engine, reads", [(True, 2), (False, 1)])
def test_a_straggling_read_is_hedged_unless_its_store_says_no(hedged_by_engine, reads):
    inner = Straggling(hedged_by_engine)
    store = TailStore(inner, f"http://tail-test-{next(_endpoints)}", max_requests=4)

    async def main() -> bytes:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.watch)
            while not store.watching:  # as in the engine: the watcher runs before reads start
                await anyio.sleep(0)
            body = await store.get("bucket", "key")
            tg.cancel_scope.cancel()
        return body

    assert anyio.run(main) == b"body"
    assert inner.reads == reads
    assert store.hedged == reads - 1
