"""``HedgedStore``: a straggling read of a store is sent again, the first answer wins; a read
through the disk cache (a store saying ``hedged_by_engine = False``) is not, since a hedged miss
would fetch and fill one entry twice; nothing is hedged while the store below is congested."""

from __future__ import annotations

import itertools

import anyio
import pytest

from loader.s3.hedging import HEDGE_AT_FIRST, HEDGE_BURST, HEDGE_SHARE, HEDGES_PER_READ, HedgedStore

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


@pytest.mark.parametrize("hedged_by_engine, reads", [(True, 1 + HEDGES_PER_READ), (False, 1)])
def test_a_straggling_read_is_hedged_unless_its_store_says_no(hedged_by_engine, reads):
    inner = Straggling(hedged_by_engine)
    store = HedgedStore(inner, f"http://tail-test-{next(_endpoints)}", max_requests=4)

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


class OneStuck:
    """A store whose first ``stuck`` reads of the key ``stuck`` never answer (until cancelled);
    others answer soon."""

    def __init__(self, stuck: int = 1) -> None:
        self.stuck = stuck
        self.reads: dict[str, int] = {}
        self.inflight = self.peak_inflight = 0  # reads at the store at once, as a server counts them

    async def get(self, bucket: str, key: str, *, pin=None) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            if key == "stuck" and self.reads[key] <= self.stuck:
                await anyio.sleep_forever()
            await anyio.sleep(0.002)
            return key.encode()
        finally:
            self.inflight -= 1


def test_a_hedge_gets_a_place_while_other_reads_keep_every_place_busy():
    # As in the engine while its buffer has room: each read that ends is followed at once by
    # another, so a place among max_requests is never left free. The hedge must get one anyway
    # (reads give way to it), or the straggler waits for the epoch's end.
    inner = OneStuck()
    store = HedgedStore(inner, f"http://tail-test-{next(_endpoints)}", max_requests=4)
    done = anyio.Event()

    async def feed() -> None:
        while not done.is_set():
            assert await store.get("bucket", "fast") == b"fast"

    async def main() -> bytes:
        with anyio.fail_after(30):  # without the priority: no answer until the feeders stop
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.watch)
                while not store.watching:
                    await anyio.sleep(0)
                for _ in range(3):  # with the stuck read: all four places
                    tg.start_soon(feed)
                body = await store.get("bucket", "stuck")
                done.set()
                tg.cancel_scope.cancel()
        return body

    assert anyio.run(main) == b"stuck"
    assert inner.reads["stuck"] == 2
    assert store.hedges_won == 1
    assert store.inflight == 0 and store.hedges_waiting == 0 and store.hedges_out == 0
    # the hedge took a place that freed up; the feeders' next reads waited for another, so the
    # store never saw more than max_requests at once
    assert inner.peak_inflight == 4


def test_reads_wait_for_a_place_while_a_hedge_holds_one():
    # A hedge holds one of the two places, a read holds the other: the next read must wait until
    # one of them ends (without the wait, three requests would be in flight under a limit of 2).
    store = HedgedStore(OneStuck(), f"http://tail-test-{next(_endpoints)}", max_requests=2)

    async def main() -> None:
        with anyio.fail_after(5):
            await store.enter()  # a read's place
            entered = anyio.Event()

            async def read() -> None:
                await store.enter()
                entered.set()

            await store.enter(hedge=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.05)
                assert not entered.is_set() and store.inflight == 2 and store.hedges_out == 1
                store.leave(hedge=True)  # the hedge ends: its place goes to the read
                await entered.wait()
        assert store.inflight == 2 and store.hedges_out == 0

    anyio.run(main)


def test_a_read_that_gave_way_to_a_hedge_goes_when_the_hedge_is_called_off():
    # The hedge waits for a place, a read gives way to it; the original answers and the hedge is
    # cancelled before it got one: the read must go at once, not wait for some other read to end.
    store = HedgedStore(OneStuck(), f"http://tail-test-{next(_endpoints)}", max_requests=1)

    async def main() -> None:
        with anyio.fail_after(5):
            await store.enter()  # the one place, held throughout
            hedge = anyio.CancelScope()
            entered = anyio.Event()

            async def read() -> None:
                await store.enter()
                entered.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(_enter_within, store, hedge)
                while not store.hedges_waiting:
                    await anyio.sleep(0)
                tg.start_soon(read)
                await anyio.sleep(0.05)
                assert not entered.is_set()  # gave way to the waiting hedge
                hedge.cancel()
                await entered.wait()
        assert store.hedges_waiting == 0

    anyio.run(main)


async def _enter_within(store: HedgedStore, scope: anyio.CancelScope) -> None:
    with scope:
        await store.enter(hedge=True)


def test_a_hedge_that_straggles_too_is_sent_again_and_the_first_answer_wins():
    inner = OneStuck(stuck=HEDGES_PER_READ)  # the original and the first hedge never answer
    store = HedgedStore(inner, f"http://tail-test-{next(_endpoints)}", max_requests=4)

    async def main() -> bytes:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.watch)
                while not store.watching:
                    await anyio.sleep(0)
                body = await store.get("bucket", "stuck")
                tg.cancel_scope.cancel()
        return body

    assert anyio.run(main) == b"stuck"
    assert inner.reads["stuck"] == 1 + HEDGES_PER_READ
    assert store.hedged == HEDGES_PER_READ and store.hedges_won == 1
    assert store.inflight == 0  # the losers were cancelled and left


def test_hedges_waiting_for_a_place_count_against_the_budget():
    # Every place is held by a read that never answers, so no hedge can be sent: the watcher
    # must still stop deciding hedges at the budget, or they would all go out at once later.
    inner = OneStuck(stuck=10**9)
    store = HedgedStore(inner, f"http://tail-test-{next(_endpoints)}", max_requests=40)
    control = store.control("bucket")

    async def main() -> tuple[int, int, int]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.watch)
            while not store.watching:
                await anyio.sleep(0)
            for _ in range(40):
                tg.start_soon(store.get, "bucket", "stuck")
            await anyio.sleep(HEDGE_AT_FIRST * (HEDGES_PER_READ + 0.5))  # every hedge is due
            seen = (control.hedged, control.hedges_queued, control.requests)
            tg.cancel_scope.cancel()
        return seen

    hedged, queued, requests = anyio.run(main)
    assert hedged == 0 and requests == 40  # no place freed up: nothing was sent
    assert 1 <= queued <= HEDGE_SHARE * requests + HEDGE_BURST
    assert control.hedges_queued == 0  # cancelled before they were sent: their places given back
