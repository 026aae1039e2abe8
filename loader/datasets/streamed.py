"""Samples of a prefix as its listing's pages arrive, where the reading order is the listing's.

Unshuffled, on one rank without DataLoader workers, sample ``i`` of an epoch is sample ``i`` of
the listing, so the first GETs need not wait for the last page. A page settles the keys at or
below ``ListingOrder.settled`` (no later page lists one of them, in byte order or directory by
directory), and the settled keys are cut where no stem goes on (a stem's keys lie in one stretch
of the sorted list): each piece's ``build_index`` is then exactly the next samples of the whole
listing's, in the same order. The rule and its proof: docs/design/objects.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio

from ..errors import StoreError
from ..listing.keylist import KeyList, ListOptions, _list_whole, _Runs
from ..listing.ranges import RangeLister
from ..retry import RetryPolicy
from ..s3.listing_order import SERVERS, ListingOrder
from ..s3.protocol import ObjectInfo, ObjectStore, PagedLister
from .object_samples import SampleIndex, build_index, is_hidden


class SettledSamples:
    """Pages in (``add``, in the server's order), pieces of whole samples out (``take``, in key
    order): pure, no I/O. ``group``: samples are keys sharing a stem (else one key each)."""

    def __init__(self, prefix: str, *, group: bool = True, order: ListingOrder = SERVERS) -> None:
        self.prefix, self.group, self.order = prefix, group, order
        self.finished = False
        self._unsettled: list[ObjectInfo] = []  # listed, not yet known to be in final order
        self._ready: list[ObjectInfo] = []  # settled, in key order, not yet taken
        self._last: str | None = None  # the last key settled
        self._bound = ""  # every key listed later is past it (``ListingOrder.settled``)
        self._stems: list[str] = []  # the open stems at the end of ``_ready``, each a prefix of the next
        self._scanned = 0  # keys of ``_ready`` the stems have seen
        self._cut = 0  # keys of ``_ready`` before the last point no stem spans

    def add(self, objects: list[ObjectInfo]) -> None:
        """One page of the listing, as the server sent it."""
        if not objects:
            return
        bound = self.order.settled(objects[-1].key, self.prefix)
        self._unsettled.extend(info for info in objects
                               if not info.key.endswith("/") and not is_hidden(info.key))
        self._settle(bound)

    def finish(self) -> None:
        """The listing ended: every key is settled and every stem closed."""
        self._settle(None)
        self.finished = True

    def take(self) -> list[ObjectInfo]:
        """The settled keys whose samples are whole, in key order (empty: none yet)."""
        ready = self._ready
        if self.finished or not self.group:
            cut = len(ready)
        else:
            stems, cut = self._stems, self._cut
            for at in range(self._scanned, len(ready)):
                key = ready[at].key
                while stems and not key.startswith(stems[-1]):
                    stems.pop()
                if not stems:
                    cut = at  # no stem before ``at`` continues at or after it
                dot = key.find(".", key.rfind("/") + 1)
                stem = key if dot < 0 else key[:dot]
                if not stems or stems[-1] != stem:
                    stems.append(stem)
            self._scanned = len(ready)
            # every key still to come is past the bound: a stem it does not start is closed
            while stems and not self._bound.startswith(stems[-1]):
                stems.pop()
            if not stems:
                cut = len(ready)
        self._ready, out = ready[cut:], ready[:cut]
        self._scanned -= cut
        self._cut = 0
        return out

    def _settle(self, bound: str | None) -> None:
        if bound is None:
            now, self._unsettled = self._unsettled, []
        else:
            self._bound = bound
            now = [info for info in self._unsettled if info.key <= bound]
            self._unsettled = [info for info in self._unsettled if info.key > bound]
        now.sort()
        for info in now:
            if self._last is not None and info.key <= self._last:
                if info.key == self._last:
                    continue  # a page answered again
                raise StoreError(
                    f"the server listed {info.key!r} after {self._last!r} had been settled: it lists "
                    "in neither byte order nor directory by directory; read this prefix shuffled, or "
                    "with DataLoader workers, which list it whole first", key=info.key)
            self._ready.append(info)
            self._last = info.key


async def streamed_samples(
    factory: Callable[[], Awaitable[ObjectStore]],
    bucket: str,
    prefix: str,
    retry: RetryPolicy,
    options: ListOptions,
    *,
    group: bool,
    listed: Callable[[KeyList], KeyList],
) -> AsyncGenerator[SampleIndex, None]:
    """List ``s3://bucket/prefix`` page after page and yield its samples as they are settled, in
    pieces (each a ``SampleIndex`` over its own keys). At the end ``listed`` gets the whole key
    list (``list_all``'s) and returns the keys read: they must be the keys yielded."""
    settled, runs, changed = SettledSamples(prefix, group=group), _Runs(""), asyncio.Event()

    def sink(objects: list[ObjectInfo]) -> None:
        runs.add(objects)
        settled.add(objects)
        changed.set()

    where = f"s3://{bucket}/{prefix}"
    store = await factory()
    task: asyncio.Future[None] | None = None
    try:
        if isinstance(store, PagedLister):  # one range: pages come in the server's order
            listing = RangeLister(store, bucket, prefix, retry, options.page_size, 1, sink).run()
        else:
            listing = _list_whole(store, bucket, prefix, retry, _Sink(sink))
        task = asyncio.ensure_future(listing)
        task.add_done_callback(lambda _: changed.set())
        count = 0
        while not settled.finished:
            if task.done():
                task.result()  # the listing's failure, if any
                settled.finish()
            piece = settled.take()
            if piece:
                count += len(piece)
                yield build_index(KeyList.from_infos(piece), group=group, where=where, prefix=prefix)
            elif not settled.finished:
                changed.clear()
                await changed.wait()
    finally:
        with anyio.CancelScope(shield=True):  # closed when the engine stops, cancelled or not
            if task is not None:
                task.cancel()  # nothing, once it is done
                await asyncio.gather(task, return_exceptions=True)
            await store.aclose()
    keys = listed(runs.merged())
    if len(keys) != count:  # never: each settled key went into one piece
        raise RuntimeError(f"{where}: {count} keys read as they were listed, {len(keys)} listed")


class _Sink(_Runs):
    """``_list_whole``'s ``runs``, for a store without pages: its one page goes to ``sink``."""

    def __init__(self, sink: Callable[[list[ObjectInfo]], None]) -> None:
        super().__init__("")
        self._sink = sink

    def add(self, objects: list[ObjectInfo]) -> None:
        self._sink(objects)
