"""How ``checkpoint.load`` reads: a seekable file over one object version for ``torch.load``,
served by parallel ranged GETs and a small block cache, and the listing that finds that version.
"""

from __future__ import annotations

import functools
import io
from collections import OrderedDict
from typing import Any

from anyio.from_thread import BlockingPortal

from ..engine.core import run_all
from ..errors import NoSuchKeyError, StoreError
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectInfo, ObjectStore, Pin
from ..uri import object_url


class _RangeReader(io.RawIOBase):
    """A seekable, read-only file over one object, for ``torch.load`` (docs/design/checkpoint.md).

    Reads of at least ``block_size`` bytes are fetched straight into the caller's buffer, in
    ``block_size`` spans, ``parallel`` at once (parts already cached are copied, then dropped);
    smaller reads are served from cached ``block_size``-aligned blocks. A miss fetches just the
    blocks it needs, or, when it is the block after the previous miss (records after records),
    ``parallel`` blocks from there at once. The cache keeps at most ``parallel`` blocks, least
    recently used out first, making room before it fetches.
    """

    def __init__(
        self,
        portal: BlockingPortal,
        store: ObjectStore,
        bucket: str,
        key: str,
        size: int,
        pin: Pin,
        *,
        block_size: int,
        parallel: int,
        retry: RetryPolicy,
    ) -> None:
        super().__init__()
        self._pin = pin  # the version listed with ``size``: every ranged GET asks for it
        self._portal = portal
        self._store = store
        self._bucket = bucket
        self._key = key
        self._size = size
        self._block = block_size
        self._parallel = parallel
        self._retry = retry
        self._pos = 0
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._last_miss: int | None = None  # the last block of the last cache miss
        self.error: BaseException | None = None
        self.requests = 0
        self.bytes_fetched = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"whence={whence!r} is not SEEK_SET, SEEK_CUR or SEEK_END")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        start = self._pos
        count = min(len(view), self._size - start)
        if count <= 0:
            return 0
        try:
            if count >= self._block:
                self._read_direct(start, view[:count])
            else:
                self._read_cached(start, view[:count])
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        self._pos = start + count
        return count

    def close(self) -> None:
        self._cache.clear()
        super().close()

    def _read_cached(self, start: int, view: memoryview) -> None:
        first, last = start // self._block, (start + len(view) - 1) // self._block
        needed = range(first, last + 1)
        capacity = max(self._parallel, len(needed))
        if any(index not in self._cache for index in needed):
            # read ahead only when misses run front to back (records after records); a lone
            # miss (the zip's magic number, its directory at the end) fetches just its blocks
            sequential = self._last_miss is not None and first - 1 <= self._last_miss <= first
            self._last_miss = last
            ahead = range(first, min(self._blocks(), first + capacity) if sequential else last + 1)
            wanted = [index for index in ahead if index not in self._cache]
            for index in list(self._cache):  # make room first: never more than capacity blocks
                if len(self._cache) + len(wanted) <= capacity:
                    break
                if index not in needed:
                    del self._cache[index]
            for index, data in self._fetch({i: self._block_span(i) for i in wanted}).items():
                self._cache[index] = data
        for index in needed:  # most recently used last, so read-ahead is evicted before these
            self._cache.move_to_end(index)
        done = 0
        for index in needed:
            data = self._cache[index]
            lo = start + done - index * self._block
            take = min(len(view) - done, len(data) - lo)
            view[done : done + take] = data[lo : lo + take]
            done += take

    def _read_direct(self, start: int, view: memoryview) -> None:
        end = start + len(view)
        spans: dict[int, tuple[int, int]] = {}
        for index in range(start // self._block, (end - 1) // self._block + 1):
            lo, hi = max(start, index * self._block), min(end, (index + 1) * self._block)
            cached = self._cache.get(index)
            if cached is not None:
                offset = index * self._block
                view[lo - start : hi - start] = cached[lo - offset : hi - offset]
                if lo == index * self._block and hi == (index + 1) * self._block:
                    del self._cache[index]  # wholly inside this record: never read again
            else:
                spans[index] = (lo, hi)
        if spans:
            self._fetch(spans, into=view, base=start)

    def _fetch(
        self, spans: dict[int, tuple[int, int]], *, into: memoryview | None = None, base: int = 0
    ) -> dict[int, bytes]:
        """GET every span, ``parallel`` at once; copy into ``into`` or return them by index."""
        self.requests += len(spans)
        return self._portal.call(self._fetch_async, spans, into, base)

    async def _fetch_async(
        self, spans: dict[int, tuple[int, int]], into: memoryview | None, base: int
    ) -> dict[int, bytes]:
        out: dict[int, bytes] = {}

        async def one(index: int, lo: int, hi: int) -> None:
            data = await call_with_retries(
                functools.partial(self._store.get_range, self._bucket, self._key, lo, hi, pin=self._pin),
                self._retry,
            )
            if len(data) != hi - lo:
                raise StoreError(
                    f"{object_url(self._bucket, self._key)}: bytes [{lo}, {hi}) came back as "
                    f"{len(data)} bytes; was the object replaced while it was being read?",
                    bucket=self._bucket, key=self._key,
                )
            self.bytes_fetched += len(data)
            if into is None:
                out[index] = data
            else:  # the caller's thread is blocked in portal.call until we return
                into[lo - base : hi - base] = data

        await run_all((functools.partial(one, index, lo, hi) for index, (lo, hi) in spans.items()),
                      self._parallel)
        return out

    def _blocks(self) -> int:
        return -(-self._size // self._block)

    def _block_span(self, index: int) -> tuple[int, int]:
        return index * self._block, min(self._size, (index + 1) * self._block)


async def _listed(store: ObjectStore, bucket: str, key: str, retry: RetryPolicy) -> ObjectInfo:
    """The object's size and ETag, from a listing of its own key (no HEAD in ``ObjectStore``)."""

    async def attempt() -> ObjectInfo | None:
        listing = store.list(bucket, key)
        try:
            async for info in listing:
                if info.key == key:
                    return info
        finally:
            aclose = getattr(listing, "aclose", None)
            if aclose is not None:
                await aclose()
        return None

    info = await call_with_retries(attempt, retry)
    if info is None:
        raise NoSuchKeyError(
            f"no checkpoint at {object_url(bucket, key)}: the bucket has no object {key!r}; "
            "check the step number and prefix, and that the save finished",
            bucket=bucket, key=key,
        )
    return info
