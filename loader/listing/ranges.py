"""Listing one prefix as key ranges in parallel, splitting the largest range as others finish.

After two pages an idle lister splits the largest unfinished range at a guessed key; ranges at
once double while that lists faster, up to ``parallel``. Each range is retried page by page and
drops the keys past its bound (the next range lists them). Details: docs/design/listing.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import anyio
import anyio.abc

from ..retry import RetryPolicy, call_with_retries
from ..s3.listing_order import SERVERS, ListingOrder
from ..s3.protocol import ListPage, ObjectInfo, PagedLister
from .keyspace import KeySpace

RAMP_PAGES = 2  # pages listed one after the other before any range is split
MIN_SPLIT_PAGES = 3  # a range estimated to hold fewer pages than this is left whole
MAX_MISSES = 0.2  # empty ranges split off, per page received, beyond which splitting pauses
LEVEL_PAGES = 3  # pages per range allowed at once that measure a level of parallelism
GAIN = 1.1  # how much faster a doubling must list for the next one to be tried


@dataclasses.dataclass(eq=False)
class KeyRange:
    """One range of the listing: from ``StartAfter=start_after`` until a key past ``hi``."""

    start_after: str | None
    hi: str | None  # None: to the end of the prefix
    token: str | None = None  # resumes after the last page received
    first: str | None = None
    last: str | None = None
    keys: int = 0
    pages: int = 0
    done: bool = False
    splittable: bool = True  # not wrapped back over another range (``ListingOrder.wrapped``)


class RangeLister:
    """Lists ``s3://bucket/prefix`` with up to ``parallel`` ranges at once; ``run()`` returns
    when every range is done, or raises the first range's failure. ``order``: how servers
    list, the one place their quirk is known (``s3.listing_order``)."""

    def __init__(self, store: PagedLister, bucket: str, prefix: str, retry: RetryPolicy,
                 page_size: int, parallel: int, sink: Callable[[list[ObjectInfo]], None],
                 order: ListingOrder = SERVERS) -> None:
        self.store, self.bucket, self.prefix, self.order = store, bucket, prefix, order
        self.retry, self.page_size, self.parallel, self.sink = retry, page_size, parallel, sink
        self.pending: list[KeyRange] = [KeyRange(None, None)]
        self.active: list[KeyRange] = []
        self.ranges = 0  # started, for statistics and tests
        self.pages = 0
        self._keys = 0
        self.misses = 0  # ranges split off that held nothing: the guesses that went wrong
        self.limit = 1  # ranges allowed at once, doubled while that lists faster (_measure)
        self._level: tuple[float, int, int] | None = None  # (time, pages, keys) as it began
        self._level_rate = 0.0  # keys per second at the level below
        self._settled = False
        self._chars: set[str] = set()  # the alphabet of the keys seen
        self._folder_ends: set[int] = set()  # lengths at which keys seen have a "/"
        self._space: KeySpace | None = None
        self._finished_ranges: list[KeyRange] = []
        self._covered = [0, 0]  # keys and positions of the finished ranges (for the density)
        self._changed = anyio.Event()
        self._failed: list[Exception] = []

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            for _ in range(self.parallel):
                group.start_soon(self._worker, group)
        if self._failed:
            raise self._failed[0]

    async def _worker(self, group: anyio.abc.TaskGroup) -> None:
        try:
            while True:
                found = self.pending.pop(0) if self.pending else self._steal()
                if found is None:
                    if not self.active:
                        return
                    await self._changed.wait()
                    continue
                self.active.append(found)
                self.ranges += 1
                if self._level is None and len(self.active) >= self.limit and self.pages >= RAMP_PAGES:
                    self._level = (time.monotonic(), self.pages, self._keys)  # the level is in use
                try:
                    await self._list(found)
                finally:
                    self.active.remove(found)
                    self._finished(found)
        except Exception as exc:  # noqa: BLE001 - the first failure is the listing's, re-raised in run()
            self._failed.append(exc)
            group.cancel_scope.cancel()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _list(self, part: KeyRange) -> None:
        received = checked = 0

        async def attempt() -> None:
            nonlocal received
            pages = self.store.list_pages(
                self.bucket, self.prefix, token=part.token, page_size=self.page_size,
                start_after=part.start_after if part.pages == 0 else None)
            async with contextlib.aclosing(pages):
                async for page in pages:
                    self._take(part, page)
                    received += 1
                    if part.done:
                        break

        def progressed() -> bool:
            nonlocal checked
            moved, checked = received != checked, received
            return moved

        await call_with_retries(attempt, self.retry, progressed=progressed)

    def _take(self, part: KeyRange, page: ListPage) -> None:
        objects = page.objects
        if objects and part.last is None and part.splittable:
            part.splittable = not self.order.wrapped(part.start_after, objects[0].key)
        if objects:
            if part.first is None:
                part.first = objects[0].key
            part.last = objects[-1].key
            part.keys += len(objects)
            self._learn(info.key for info in objects) if self.pages == 0 else self._learn(
                (objects[0].key, objects[-1].key))
            hi = part.hi
            if hi is not None and max(info.key for info in objects) > hi:
                kept = [info for info in objects if not self.order.past(info.key, hi)]
                if len(kept) < len(objects):
                    objects, part.done = kept, True
        if part.pages == 0 and part.done and not objects:
            self.misses += 1
        part.pages += 1
        part.token = page.token
        if page.token is None:
            part.done = True
        self.pages += 1
        self._keys += len(objects)
        self.sink(objects)
        self._measure()
        self._notify()

    def _measure(self) -> None:
        """Double ``limit`` while each doubling lists faster, by ``GAIN`` at least; settle
        otherwise. Against a remote S3, pages wait on round trips and more ranges list more keys
        per second; on a server that is short of CPU (a local one sharing the client's cores)
        more ranges only add requests, and the listing stays nearly page after page."""
        if self._settled or self.pages < RAMP_PAGES:
            return
        now = time.monotonic()
        if self._level is None:
            if self.limit == 1:
                self._level = (now, self.pages, self._keys)
            return  # measured from when as many ranges run as allowed
        began, pages, keys = self._level
        if self.pages - pages < LEVEL_PAGES * self.limit or now <= began:
            return
        rate = (self._keys - keys) / (now - began)
        if self.limit > 1 and rate < self._level_rate * GAIN:
            self._settled = True
            if rate < self._level_rate:
                self.limit //= 2  # the last doubling made it slower: step back
            return
        if self.limit >= self.parallel:
            self._settled = True
            return
        self._level_rate, self.limit = rate, min(self.parallel, self.limit * 2)
        self._level = None

    # ------------------------------------------------------------------ splitting

    def _learn(self, keys: Iterable[str]) -> None:
        """Grow the alphabet and the folder ends with ``keys`` (every key of the first page,
        the first and last of later ones)."""
        skip = len(self.prefix)
        for key in keys:
            rest = key[skip:]
            self._chars.update(rest)
            self._folder_ends.update(skip + i for i, char in enumerate(rest) if char == "/")

    def _current_space(self) -> KeySpace:
        """The key space of what has been seen; when the alphabet grew, the finished ranges'
        widths are measured again in the new one."""
        space = self._space
        folders = self._folder_ends if self.order.avoids_folder_names() else set()  # only grows
        if space is None or len(space.chars) != len(self._chars) or len(space.folder_ends) != len(folders):
            space = self._space = KeySpace(self.prefix, "".join(self._chars), frozenset(folders))
            self._covered = [sum(part.keys for part in self._finished_ranges),
                             sum(self._width(space, part) for part in self._finished_ranges)]
        return space

    def _width(self, space: KeySpace, part: KeyRange) -> int:
        start = part.first if part.start_after is None else part.start_after
        return max(0, space.position(part.last) - space.position(start))

    def _finished(self, part: KeyRange) -> None:
        if part.keys and part.last is not None:
            space = self._current_space()
            self._finished_ranges.append(part)
            self._covered[0] += part.keys
            self._covered[1] += self._width(space, part)
        self._notify()

    def _steal(self) -> KeyRange | None:
        """A new range split off the largest splittable active one, or None for now."""
        if self.pages < RAMP_PAGES or len(self.active) >= min(self.pages, self.limit):
            return None
        if self.misses > self.pages * MAX_MISSES:
            return None  # guesses keep landing in empty key space: wait for more pages
        candidates = [part for part in self.active
                      if part.pages and not part.done and part.last is not None and part.splittable]
        if not candidates:
            return None
        space = self._current_space()
        keys = self._covered[0] + sum(part.keys for part in self.active)
        width = self._covered[1] + sum(self._width(space, part) for part in self.active)
        density = keys / width if width else math.inf

        def remaining(part: KeyRange) -> float:
            if part.hi is None:
                return math.inf
            own = self._width(space, part)
            local = part.keys / own if own else density
            return local * (space.position(part.hi) - space.position(part.last))

        for part in sorted(candidates, key=remaining, reverse=True):
            if remaining(part) < MIN_SPLIT_PAGES * self.page_size:
                return None
            assert part.last is not None
            ahead = None if part.hi is not None else max(width, 1)
            bound = space.between(part.last, part.hi, 0.5, ahead)
            if bound is None:
                continue
            piece = KeyRange(bound, part.hi)
            part.hi = bound
            return piece
        return None

