"""``CachedStore``: an ``ObjectStore`` that answers reads from a ``DiskCache`` and fills it.

The first epoch fills the cache; later epochs read from local disk and send no request for what
is cached. Whole objects, streams and ranged parts all fill it; an entry is served only while it
is current by the rule ``validate`` names, and never mixes versions (docs/design/cache.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel

from ..checks import check_int
from ..errors import BadAnswerError, ConfigError, InvalidRangeError
from ..listing.versions import Versions, listed_size
from ..s3.answer_checks import check_listed
from ..s3.protocol import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, Pin
from .files import CacheEntry, CorruptEntry, DiskCache, TempFile
from .options import DEFAULT_VALIDATE, check_validate

log = logging.getLogger(__name__)

INLINE_MAX = 256 << 10  # reads and writes up to this size stay on the event loop (docs/design/cache.md)
MAX_PENDING = 64  # incomplete temp files one CachedStore keeps at once
MAX_GAP_FILL = 1 << 20  # a resumed stream re-asks at most this much to close a gap in its file


class CacheStats(NamedTuple):
    """Counters of one ``CachedStore``: ``hits + misses`` is the number of reads.

    ``hits``: reads answered from disk with no request; ``misses``: reads that went to the
    store (refetches of corrupt entries included); ``corrupt_refetches``: cache files found
    truncated or corrupt (deleted, then fetched again); ``evictions``: files this store's commits
    evicted; ``stale_refetches``: entries of an older version, fetched again; ``revalidations``:
    conditional GETs sent (``validate="always"``).
    """

    hits: int
    misses: int
    bytes_read_from_cache: int
    evictions: int
    corrupt_refetches: int
    stale_refetches: int = 0
    revalidations: int = 0



class _Assembly:
    """An object being gathered into a temp file from streamed chunks and ranged parts.

    Lives on the event loop thread only. ``covered`` holds merged ``[start, end)`` intervals of
    bytes on disk; ``size`` is set once a read reached the object's end; ``etag`` is the version
    the pieces came from (a piece of another version kills the assembly). ``busy`` counts writes
    in worker threads: the descriptor is closed only when none is running.
    """

    __slots__ = ("busy", "committing", "covered", "dead", "etag", "name", "size", "temp")

    def __init__(self, name: str, temp: TempFile) -> None:
        self.name = name
        self.temp = temp
        self.etag: str | None = None  # the version of the pieces written so far
        self.covered: list[list[int]] = []
        self.size: int | None = None
        self.busy = 0
        self.dead = False
        self.committing = False

    def covers(self, start: int, end: int) -> bool:
        return any(lo <= start and end <= hi for lo, hi in self.covered)

    def add(self, start: int, end: int) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted([*self.covered, [start, end]]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.covered = merged

    def prefix_end(self) -> int:
        """How far the bytes from offset 0 on are all on disk."""
        return self.covered[0][1] if self.covered and self.covered[0][0] == 0 else 0

    def complete(self) -> bool:
        if self.size is None:
            return False
        return self.size == 0 or self.covered == [[0, self.size]]


class CachedStore:
    """An ``ObjectStore`` that answers from a ``DiskCache`` and fills it from ``inner``.

    Owns ``inner``: ``aclose()`` closes it. ``versions``: the ETags the key list gave
    (``versions.py``), which ``validate="listing"`` compares entries with. Counters are plain
    ints (see ``CacheStats``); ``on_close`` is called with the final ``statistics()`` when the
    store is closed. Use it in one event loop, like any store (see ``loader/s3/protocol.py``).
    """

    # The engine does not hedge reads through the cache (s3/hedging.py): a hedged miss would
    # fetch and fill the same entry twice, and a hit is a local file read, never a straggler.
    hedged_by_engine = False

    def __init__(
        self,
        inner: ObjectStore,
        cache: DiskCache,
        endpoint_id: str,
        *,
        validate: str = DEFAULT_VALIDATE,
        on_close: Callable[[CacheStats], None] | None = None,
        versions: Versions | None = None,
    ) -> None:
        check_validate(validate, "validate")
        self.inner = inner
        self.cache = cache
        self.endpoint_id = endpoint_id
        self.validate = validate
        self.versions = versions
        self.on_close = on_close
        self.stale_refetches = 0
        self.revalidations = 0
        self._validated: set[str] = set()  # entries revalidated by this store (validate="always")
        self.hits = 0
        self.misses = 0
        self.bytes_read_from_cache = 0
        self.evictions = 0
        self.corrupt_refetches = 0
        self._pending: dict[str, _Assembly] = {}
        self._too_big: set[str] = set()
        self._puts: dict[str, int] = {}  # name -> puts seen, so a read racing a put caches nothing
        self._closed = False
        self._warned = False
        self._in_parts: set[str] = set()  # objects whose ranges are cached as entries of their own

    def statistics(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.bytes_read_from_cache, self.evictions,
                          self.corrupt_refetches, self.stale_refetches, self.revalidations)

    def __repr__(self) -> str:
        return f"CachedStore({self.inner!r}, {self.cache!r}, endpoint_id={self.endpoint_id!r})"

    # ----------------------------------------------------------------- the protocol

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(bucket, prefix)

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        name = self._name(bucket, key)
        data = await self._cached(name, bucket, key, 0, None, pin)
        if data is not None:
            return data
        self.misses += 1
        puts = self._puts.get(name, 0)
        used = Pin() if pin is None else pin  # learns the version, to record it with the bytes
        data = await self.inner.get(bucket, key, pin=used)
        if self.cache.fits(len(data)) and self._puts.get(name, 0) == puts \
                and not self._unlike_listing(bucket, key, len(data), used.etag):
            try:
                evicted = await anyio.to_thread.run_sync(self.cache.put, name, data, used.etag)
                self.evictions += evicted or 0
            except OSError as exc:
                self._cache_failed(exc, bucket, key)
        return data

    def cache_in_parts(self, bucket: str, key: str) -> None:
        """A hint from a reader that reads ``bucket/key`` by ranges that never cover it whole (a
        Parquet file's selected column chunks): each range it asks for becomes a cache entry of
        its own, kept and validated like a whole object, and read back when the same range is
        asked again (the next epoch asks the same ones). The hint reaches this store through
        the wrappers that forward attributes; without a cache nobody answers it."""
        self._in_parts.add(self._name(bucket, key))

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        name = self._name(bucket, key)
        if end is not None and end <= start:  # nothing to read (the backends send no request either)
            return b""
        data = await self._cached(name, bucket, key, start, end, pin)
        if data is not None:
            return data
        if name in self._in_parts:
            return await self._get_part(bucket, key, start, end, pin)
        self.misses += 1
        assembly = self._assembly(name, create=True)
        if assembly is None:
            return await self.inner.get_range(bucket, key, start, end, pin=pin)
        used = Pin() if pin is None else pin
        keep = False
        try:
            # One byte more than asked: a shorter answer says where the object ends.
            data = await self.inner.get_range(bucket, key, start, None if end is None else end + 1,
                                              pin=used)
            keep = True
        except Exception:
            keep = True  # a failed request: the caller's retry may still complete the file
            raise
        finally:
            if not keep:  # cancelled: nothing may come back for this file
                self._drop(assembly)
        if end is None or len(data) <= end - start:
            size = start + len(data)
        else:
            data, size = data[: end - start], None
        await self._tee(assembly, start, data, used.etag)
        if size is not None:
            await self._ended(assembly, size, bucket, key)
        return data

    async def _get_part(self, bucket: str, key: str, start: int, end: int | None, pin: Pin | None) -> bytes:
        """Bytes ``[start, end)`` of an object read in parts: its own entry for that range, or
        one ranged GET that fills it (with the version it came from, as every entry)."""
        part = self.cache.name_for(self.endpoint_id, bucket, f"{key}\0bytes={start}-{'' if end is None else end}")
        data = await self._cached(part, bucket, key, 0, None, pin)
        if data is not None:
            return data
        self.misses += 1
        puts = self._puts.get(self._name(bucket, key), 0)
        used = Pin() if pin is None else pin
        data = await self.inner.get_range(bucket, key, start, end, pin=used)
        if self.cache.fits(len(data)) and self._puts.get(self._name(bucket, key), 0) == puts:
            try:
                evicted = await anyio.to_thread.run_sync(self.cache.put, part, data, used.etag)
                self.evictions += evicted or 0
            except OSError as exc:
                self._cache_failed(exc, bucket, key)
        return data

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        check_int("chunk_size", chunk_size, minimum=1)
        if end is not None and end <= start:
            return  # nothing to read (as get_range)
        name = self._name(bucket, key)
        position = start
        used = Pin() if pin is None else pin
        entry = await self._open(name, bucket, key)
        if entry is not None and not await self._usable(entry, name, bucket, key, used):
            entry.close()
            entry = None
        if entry is not None:
            fell_back = False
            try:
                _check_start(entry.length, start, bucket, key)
                last = entry.length if end is None else min(entry.length, end)
                block = entry.block_size
                span = max(block, -(-chunk_size // block) * block)  # whole blocks per read
                at = start - start % block
                while at < last:
                    stop = min(last, at + span)
                    try:
                        data = await self._read(entry, at, stop)
                    except CorruptEntry as exc:  # the bytes so far were verified: the rest from the store
                        await self._corrupt(name, entry.identity, exc, bucket, key)
                        fell_back = True
                        break
                    if position == at and len(data) <= chunk_size:  # the usual case: no copy
                        position += len(data)
                        self.bytes_read_from_cache += len(data)
                        yield data
                        at = stop
                        continue
                    view = memoryview(data)[position - at :]
                    for piece in range(0, len(view), chunk_size):
                        chunk = bytes(view[piece : piece + chunk_size])
                        position += len(chunk)
                        self.bytes_read_from_cache += len(chunk)
                        yield chunk
                    at = stop
            finally:
                entry.close()
                if not fell_back:
                    self.hits += 1
            if not fell_back:
                return
        self.misses += 1
        assembly = self._assembly(name, create=position == 0)
        offset = position  # where the store's bytes start; ``position``: what the caller has had
        if assembly is not None and 0 < assembly.prefix_end() < position <= assembly.prefix_end() + MAX_GAP_FILL:
            # A resumed reader may skip bytes it never received (a tar parser skips member
            # padding): ask from the end of what the file holds, so that it can still complete.
            offset = assembly.prefix_end()
        keep = False
        try:
            async with contextlib.aclosing(
                self.inner.stream(bucket, key, start=offset, chunk_size=chunk_size, pin=used, end=end)
            ) as chunks:
                async for chunk in chunks:
                    if assembly is not None:
                        await self._tee(assembly, offset, chunk, used.etag)
                    offset += len(chunk)
                    if offset > position:
                        if offset - len(chunk) < position:
                            chunk = chunk[len(chunk) - (offset - position):]
                        position = offset
                        yield chunk
            keep = True
            if assembly is not None and (end is None or offset < end):  # the object's end was met
                await self._ended(assembly, offset, bucket, key)
            if offset < position:  # asked to start past the end: what the store would have said
                _check_start(offset, position, bucket, key)
        except InvalidRangeError:
            keep = True
            if assembly is not None and offset > 0 and assembly.covers(0, offset):
                await self._ended(assembly, offset, bucket, key)  # resumed exactly at the end
            raise
        except Exception:
            keep = True  # a store error: the caller may resume with stream(start=...) into this file
            raise
        finally:
            if assembly is not None and not keep:  # closed early or cancelled: never completes
                self._drop(assembly)

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        return await self.inner.get_if_changed(bucket, key, etag, start, end, pin=pin)

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        name = self._name(bucket, key)
        self._puts[name] = self._puts.get(name, 0) + 1
        self._validated.discard(name)
        try:
            await self.inner.put(bucket, key, data)
        finally:
            assembly = self._pending.get(name)
            if assembly is not None:
                self._drop(assembly)
            self._too_big.discard(name)
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self.cache.discard, name)
                except OSError as exc:
                    self._cache_failed(exc, bucket, key)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for assembly in list(self._pending.values()):
            self._drop(assembly)
        try:
            await self.inner.aclose()
        finally:
            if self.on_close is not None:
                self.on_close(self.statistics())

    async def __aenter__(self) -> CachedStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"{self!r} was never closed; call aclose()", ResourceWarning, stacklevel=1)
            for assembly in list(self._pending.values()):
                self._drop(assembly)

    # ----------------------------------------------------------------- helpers

    def _name(self, bucket: str, key: str) -> str:
        return self.cache.name_for(self.endpoint_id, bucket, key)

    async def _open(self, name: str, bucket: str, key: str) -> CacheEntry | None:
        await anyio.lowlevel.checkpoint()  # a hit never waits otherwise: let other tasks run
        try:
            return self.cache.open(name)
        except CorruptEntry as exc:
            await self._corrupt(name, exc.identity, exc, bucket, key)
        except OSError as exc:
            self._cache_failed(exc, bucket, key)
        return None

    async def _usable(
        self, entry: CacheEntry, name: str, bucket: str, key: str, pin: Pin | None
    ) -> bool:
        """Whether ``entry`` may answer this read (the rule: docs/design/cache.md); if it
        may, a read that ``pin`` is not pinned yet is pinned to the entry's version."""
        if pin is not None and pin.etag is not None:
            return entry.etag == pin.etag  # never mix versions within one read
        fresh = True
        listed = None if self.versions is None or self.validate == "never" else self.versions(bucket, key)
        if listed is not None:
            fresh = entry.etag == listed
        if fresh and self._unlike_listing(bucket, key, entry.length, entry.etag):
            fresh = False  # (a body cached before its listing's check: never served)
        if fresh and self.validate == "always" and name not in self._validated:
            fresh = entry.etag is not None and await self._unchanged(bucket, key, entry.etag)
        if not fresh:
            self.stale_refetches += 1
            return False
        if self.validate == "always":
            self._validated.add(name)
        if pin is not None:
            pin.observe(entry.etag, bucket, key)
        return True

    def _unlike_listing(self, bucket: str, key: str, length: int, etag: str | None) -> bool:
        """Whether ``length`` bytes of version ``etag`` cannot be the object the key list gave
        (``answer_checks.check_listed``: its listed version at another size, or no ETag to tell):
        such bytes are never cached, and a cached entry like them is never served."""
        size = listed_size(self.versions, bucket, key)
        if size is None or length == size:
            return False
        try:
            check_listed(length, etag, size, self.versions(bucket, key) if self.versions else None,
                         bucket, key)
        except BadAnswerError:
            return True
        return False

    async def _unchanged(self, bucket: str, key: str, etag: str) -> bool:
        """One conditional GET of one byte: whether the object is still version ``etag``."""
        self.revalidations += 1
        try:
            return await self.inner.get_if_changed(bucket, key, etag, 0, 1) is None
        except InvalidRangeError:  # changed into an empty object
            return False

    async def _cached(
        self, name: str, bucket: str, key: str, start: int, end: int | None, pin: Pin | None = None
    ) -> bytes | None:
        """Bytes ``[start, end)`` from a complete, intact, current cache file, or None (a miss;
        a corrupt file is removed on the way). A start past the object's end raises as S3 would."""
        entry = await self._open(name, bucket, key)
        if entry is None:
            return None
        try:
            if not await self._usable(entry, name, bucket, key, pin):
                return None
            _check_start(entry.length, start, bucket, key)
            data = await self._read(entry, start, entry.length if end is None else min(end, entry.length))
        except CorruptEntry as exc:
            await self._corrupt(name, entry.identity, exc, bucket, key)
            return None
        finally:
            entry.close()
        self.hits += 1
        self.bytes_read_from_cache += len(data)
        return data

    async def _read(self, entry: CacheEntry, start: int, end: int) -> bytes:
        block = entry.block_size
        if min(entry.length, -(-end // block) * block) - start // block * block <= INLINE_MAX:  # whole blocks
            return entry.read(start, end)
        return await anyio.to_thread.run_sync(entry.read, start, end)

    async def _corrupt(self, name: str, identity: tuple[int, int] | None, exc: CorruptEntry, bucket: str,
                       key: str) -> None:
        self.corrupt_refetches += 1
        log.warning("cache file %s for s3://%s/%s is damaged (%s); deleting it and fetching again",
                    self.cache.path_for(name), bucket, key, exc)
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(self.cache.discard, name, identity)
            except OSError as err:
                self._cache_failed(err, bucket, key)

    def _cache_failed(self, exc: Exception, bucket: str, key: str) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "disk cache %s failed for s3://%s/%s (%s: %s); reading from the store instead",
                self.cache.directory, bucket, key, type(exc).__name__, exc)

    def _assembly(self, name: str, *, create: bool) -> _Assembly | None:
        assembly = self._pending.get(name)
        if assembly is not None or not create or self._closed or name in self._too_big:
            return assembly
        if len(self._pending) >= MAX_PENDING:
            return None
        try:
            assembly = _Assembly(name, self.cache.begin(name))
        except OSError as exc:
            self._cache_failed(exc, "?", name)
            return None
        self._pending[name] = assembly
        return assembly

    async def _tee(self, assembly: _Assembly, offset: int, data: bytes, etag: str | None) -> None:
        """Write ``data`` (of version ``etag``) at ``offset`` into the assembly's temp file;
        commit when complete."""
        end = offset + len(data)
        if assembly.dead or assembly.committing or not data:
            return
        if etag != assembly.etag:
            if assembly.covered:  # pieces of two versions: this file can never be committed
                self._drop(assembly)
                return
            assembly.etag = etag
        if assembly.covers(offset, end):
            return
        if not self.cache.fits(end):
            self._too_big.add(assembly.name)
            self._drop(assembly)
            return
        assembly.busy += 1
        try:
            if len(data) <= INLINE_MAX:
                assembly.temp.write(offset, data)
            else:
                await anyio.to_thread.run_sync(assembly.temp.write, offset, data)
        except OSError as exc:
            self._cache_failed(exc, "?", assembly.name)
            assembly.dead = True
        finally:
            assembly.busy -= 1
        if assembly.dead:
            self._drop(assembly)
            return
        assembly.add(offset, end)
        await self._finish(assembly)

    async def _ended(self, assembly: _Assembly, size: int, bucket: str, key: str) -> None:
        """A read reached the object's end at ``size``."""
        if (assembly.size is not None and assembly.size != size) \
                or self._unlike_listing(bucket, key, size, assembly.etag):
            self._drop(assembly)  # the object changed under us, or the answers are wrong
            return
        assembly.size = size
        await self._finish(assembly)

    async def _finish(self, assembly: _Assembly) -> None:
        if assembly.dead or assembly.committing or assembly.busy or not assembly.complete():
            return
        assembly.committing = True
        if self._pending.get(assembly.name) is assembly:
            del self._pending[assembly.name]
        with anyio.CancelScope(shield=True):
            try:
                size = assembly.size
                assert size is not None  # complete() checked it
                evicted = await anyio.to_thread.run_sync(
                    functools.partial(assembly.temp.finish, size, etag=assembly.etag)
                )
                self.evictions += evicted
            except (OSError, CorruptEntry) as exc:  # finish() removed its temp file
                self._cache_failed(exc, "?", assembly.name)

    def _drop(self, assembly: _Assembly) -> None:
        assembly.dead = True
        if self._pending.get(assembly.name) is assembly:
            del self._pending[assembly.name]
        if assembly.busy == 0 and not assembly.committing:
            assembly.temp.abort()


def _check_start(length: int, start: int, bucket: str, key: str) -> None:
    """S3's rule for a range starting at ``start`` (a start of 0 sends no range at all)."""
    if start < 0 or (start > 0 and start >= length):
        raise InvalidRangeError(
            f"range starting at byte {start} is not within s3://{bucket}/{key} ({length} bytes)",
            bucket=bucket,
            key=key,
        )


async def open_cached_store(
    factory: Callable[[], Awaitable[ObjectStore]],
    directory: str | os.PathLike[str],
    limit_bytes: int,
    endpoint_id: str,
    **options: Any,
) -> CachedStore:
    """``factory()``'s store wrapped in a cache; await it inside the loop that will use it.
    ``options``: ``CachedStore``'s keywords (``validate``, ``on_close``, ``versions``).

    The directory is checked first, so a bad ``cache_dir`` fails before any connection opens.
    """
    try:
        cache = await anyio.to_thread.run_sync(DiskCache, directory, limit_bytes)
    except OSError as exc:
        raise ConfigError(
            f"cache_dir={os.fspath(directory)!r} cannot be used: {type(exc).__name__}: {exc}"
        ) from exc
    return CachedStore(await factory(), cache, endpoint_id, **options)
