"""A local disk cache across epochs: ``CachedStore`` wraps any ``ObjectStore``, ``DiskCache`` keeps the files.

The first epoch fills the cache; later epochs read from local disk and send no request to the
object store for anything cached. Nothing above the store changes: the wrapper implements the
``ObjectStore`` protocol, so the engine, per-object jobs and shard streaming use it unaware::

    cache = DiskCache("/nvme/cache", limit_bytes=200 << 30)
    store = CachedStore(await open_store(...), cache, endpoint_id="http://127.0.0.1:8333")

What is served from where:

* ``get``: a hit returns the cached object; a miss fetches it (one GET) and stores it.
* ``stream(start)``: a hit reads the cached file from ``start``; a miss streams from the store
  and writes each chunk at its offset into a temp file while yielding it.
* ``get_range``: a hit reads the cached file; a miss is one ranged GET whose bytes also go into
  the temp file at their offset (shards of known size are read as parallel ranged parts).
* A temp file is committed only once it holds every byte of the object, ``[0, size)``, with the
  size learnt from the store itself: a stream that ran to its end, or a ranged GET that came back
  short. Each ranged GET asks the store for one byte more than the caller wants, so the part that
  ends the object says so and no HEAD or listing is needed. So a stream from 0 commits; a stream
  cut by a fault and resumed with ``stream(start=offset)`` commits once the resume reaches the
  end (the pieces were written at their true offsets); a set of ranged parts commits when the
  last one lands. A stream the caller closes early, or a read that is cancelled, discards its
  temp file (nothing will complete it); one that failed with a store error keeps it for the
  caller's retry. Incomplete temp files are removed by ``aclose()``.
* ``list`` and ``get_if_changed`` pass through; ``put`` passes through and removes the cached entry.

Versions: an entry records the ETag of the version it was filled from (a temp file whose pieces
came with different ETags is never committed), and an entry answers a read only while it can be
trusted to be current, by the rule ``validate`` names (``cache_validate=`` of the datasets):

* ``"listing"`` (default): when the read carries the ETag its key list gave (``listed_etag``:
  ``from_prefix`` and shard prefixes are listed, and listings carry ETags), an entry of another
  version is stale and fetched again, then replaced. A read without one (``from_keys``,
  manifests, shard URLs named one by one) trusts the entry. No request is spent either way, so
  epoch 2 of an unchanged data set sends no GET.
* ``"always"``: an entry is revalidated with one conditional GET (``If-None-Match``, one byte
  asked) the first time this store serves it: 304 Not Modified costs a request but no body; any
  other answer refetches. The key list's ETag, when given, is compared as well.
* ``"never"``: entries are trusted (for data sets that are never overwritten).

A read pinned to a version (``pin`` holding an ETag: the later parts of a shard, a resumed
stream) is answered only by an entry of that very version; a read served from an entry pins
that entry's ETag, so a later request of the same read that goes to the store sends it as
``If-Match``. ``stale_refetches`` counts entries found out of date, ``revalidations`` the
conditional GETs sent.

Layout of ``directory``::

    .lock          flock(2) taken to commit, discard or evict; holds the shared byte count
    tmp/           temp files being written (unique names, O_EXCL); stale ones removed at startup
    ab/abcd...     one file per object: name = sha256(endpoint_id, bucket, key) in hex

File names never contain the key, so no key (``../../x``, absolute paths, 1,000 characters,
any unicode) can name a path outside the directory. The endpoint is part of the name, so two
services with a bucket of the same name do not share entries.

A cache file: a 32-byte header, the object's bytes, a table of one crc32 per block
(``DEFAULT_BLOCK_SIZE``, 1 MiB) of the object, then the ETag of the version it holds::

    magic "LDRCACH2" | length u64 | block size u32 | crc32 of table and ETag u32 | ETag length u16
    | crc32 of these 26 bytes u32 | 2 pad

(Files of the first format, without an ETag, fail the magic check and are fetched again.)

A read checks the header, that the file size is exactly header + length + table, the table's
checksum, and the crc32 of each block it returns, so a truncated or corrupted file is found,
deleted and fetched again (``corrupt_refetches``). Per-block checksums let a ranged read or a
resumed stream check only the blocks it reads. crc32 runs at several GB/s: cheap next to the
read itself. There is no fsync: a file lost or torn by a crash fails these checks and is
fetched again, which is all a cache needs.

Writes are atomic: a temp file in ``tmp/`` (same file system), complete with its header, then
``os.replace`` onto the final name; readers never see a partial file. Several DataLoader workers
and several processes may write the same key at once: each has its own temp file, the last
replace wins, and the contents are identical. A reader that has the file open keeps reading
the old inode when it is replaced or evicted.

Size bound: ``limit_bytes`` covers every entry's file size (header and table included) plus
the few bytes of ``.lock``; files being written in ``tmp/`` are not counted (at most the objects
in flight). All processes share one running total in ``.lock``, updated under the lock on each
commit and discard; when a commit would take it over the limit, the directory is scanned and
the least recently used entries (oldest mtime) are deleted, *before* the new file is renamed
into place, until the total with it is at most ``evict_to * limit`` (90%). Evicting to below the limit
makes the O(entries) scan happen once
per 10% of the limit written rather than on every commit; the scan also corrects the total if a
crash or a user's ``rm`` made it drift. A hit sets the file's mtime (at most every
``touch_after`` seconds), so all processes share one recency order. A file another process
deleted meanwhile is skipped. An object too large for the limit is not cached.

Blocking file work: opening an entry, its header and a read of at most ``INLINE_MAX`` bytes run
on the event loop: they are syscalls of a few microseconds on a local disk's page cache,
cheaper than the hop to a worker thread. Larger reads and writes, and every commit, discard
and eviction (they take a lock another process may hold while it scans), run in anyio's worker
threads. anyio stops those threads when the engine's event loop ends.

Errors of the cache itself (disk full, permission, I/O error) never fail a read: the read goes
to the store and a warning is logged once per ``CachedStore``.
"""

from __future__ import annotations

import array
import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import struct
import sys
import threading
import time
import warnings
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel

from ..errors import ConfigError, InvalidRangeError
from .base import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, Pin

try:
    import fcntl
except ImportError:  # not on Windows: one process at a time there (see _locked)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_LIMIT",
    "MIN_CACHE_LIMIT",
    "VALIDATE_RULES",
    "CacheStats",
    "CachedStore",
    "DiskCache",
    "check_cache_options",
    "check_validate",
    "endpoint_id_for",
    "open_cached_store",
]

DEFAULT_CACHE_LIMIT = 10 << 30
VALIDATE_RULES = ("listing", "always", "never")
DEFAULT_VALIDATE = "listing"
MIN_CACHE_LIMIT = 4096
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_EVICT_TO = 0.9
DEFAULT_TOUCH_AFTER = 10.0
DEFAULT_STALE_TEMP_AFTER = 15 * 60.0
STALE_TEMP_SCAN_MAX = 10_000  # temp files looked at per startup: bounded work
INLINE_MAX = 256 << 10  # reads and writes up to this size stay on the event loop (see above)
MAX_PENDING = 64  # incomplete temp files one CachedStore keeps at once
MAX_GAP_FILL = 1 << 20  # a resumed stream re-asks at most this much to close a gap in its file
LOCK_RESERVE = 64  # bytes of the limit set aside for .lock (it holds a decimal count)

MAGIC = b"LDRCACH2"
_HEAD = struct.Struct("<8sQIIH")  # magic, length, block size, crc32 of table + ETag, ETag length
HEADER_SIZE = 32  # _HEAD + crc32 of _HEAD + 2 bytes of padding
ETAG_MAX = 1024  # longer ETags are not recorded (no S3-compatible server sends such)
_NAME = re.compile(r"[0-9a-f]{64}")
_FILE_MODE = 0o600  # cached training data is as private as the credentials that fetched it
_DIR_MODE = 0o700
_local_lock = threading.Lock()  # stands in for flock where fcntl is missing
if array.array("I").itemsize != 4:  # the block table is little-endian u32
    raise ImportError("loader.stores.cache needs a platform where C unsigned int is 4 bytes")


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


class _Corrupt(Exception):
    """A cache file failed a check; the message says which."""

    identity: tuple[int, int] | None = None


# ----------------------------------------------------------------------------- options


def check_cache_options(
    cache_dir: Any, cache_limit: Any, cache_validate: Any = DEFAULT_VALIDATE
) -> tuple[str | None, int | None]:
    """Validate ``cache_dir=``/``cache_limit=``/``cache_validate=``; return the absolute
    directory and the limit.

    No I/O: the directory is created by the first ``DiskCache`` (in the process that iterates).
    """
    check_validate(cache_validate)
    if cache_dir is None:
        if cache_limit is not None:
            raise ConfigError(f"cache_limit={cache_limit!r} needs cache_dir= (the directory to cache in)")
        return None, None
    if not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir):
        raise ConfigError(f"cache_dir={cache_dir!r} must be a directory path (str or os.PathLike)")
    limit = DEFAULT_CACHE_LIMIT if cache_limit is None else cache_limit
    _check_limit(limit, "cache_limit")
    return os.path.abspath(os.path.expanduser(os.fspath(cache_dir))), limit


def check_validate(validate: Any, name: str = "cache_validate") -> None:
    """``validate`` must be one of ``VALIDATE_RULES`` (see the module docstring)."""
    if validate not in VALIDATE_RULES:
        raise ConfigError(
            f"{name}={validate!r} must be one of {VALIDATE_RULES}: 'listing' checks cache entries "
            "against the ETags a listing gave, 'always' asks the server with a conditional GET, "
            "'never' trusts them"
        )


def _check_limit(limit: Any, name: str) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < MIN_CACHE_LIMIT:
        raise ConfigError(
            f"{name}={limit!r} must be a number of bytes, at least {MIN_CACHE_LIMIT} "
            "(e.g. 200 << 30 for 200 GiB)"
        )


def endpoint_id_for(store: Any, config: Any) -> str:
    """What tells one service's objects from another's in cache file names.

    A backend by name: the endpoint URL (AWS S3 itself when there is none). A user's store
    factory: its qualified name, which is the same in every process and run.
    """
    if callable(store):
        while isinstance(store, functools.partial):  # never repr(): it may hold secrets, and addresses
            store = store.func
        kind = store if hasattr(store, "__qualname__") else type(store)
        return f"factory:{kind.__module__}.{kind.__qualname__}"
    endpoint = getattr(config, "endpoint_url", None)
    return endpoint.rstrip("/") if endpoint else "aws-s3"


# ----------------------------------------------------------------------------- the files


class DiskCache:
    """The on-disk part: entries named by hash, atomic commits, shared byte count, LRU eviction.

    Synchronous and safe to call from several threads and processes at once (see the module
    docstring). Creating one creates the directory and removes stale temp files (bounded work).
    ``touch_after``: a hit refreshes an entry's mtime when it is older than this many seconds.
    ``stale_temp_after``: temp files untouched this long are leftovers of killed processes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        limit_bytes: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        evict_to: float = DEFAULT_EVICT_TO,
        touch_after: float = DEFAULT_TOUCH_AFTER,
        stale_temp_after: float = DEFAULT_STALE_TEMP_AFTER,
    ) -> None:
        _check_limit(limit_bytes, "limit_bytes")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size < 1 << 32:
            raise ConfigError(f"block_size={block_size!r} must be a positive integer below 4 GiB")
        if not 0 < evict_to <= 1:
            raise ConfigError(f"evict_to={evict_to!r} must lie in (0, 1]: the fraction of the limit eviction leaves")
        if not touch_after >= 0 or not stale_temp_after > 0:
            raise ConfigError(
                f"touch_after={touch_after!r} must be >= 0 and stale_temp_after={stale_temp_after!r} > 0"
            )
        self.directory = Path(os.path.abspath(os.path.expanduser(os.fspath(directory))))
        self.limit_bytes = limit_bytes
        self.budget = limit_bytes - LOCK_RESERVE  # what the entries may use
        self.block_size = block_size
        self.evict_to = evict_to
        self.touch_after = touch_after
        self.stale_temp_after = stale_temp_after
        self._tmp = self.directory / "tmp"
        self._lock_path = self.directory / ".lock"
        os.makedirs(self._tmp, mode=_DIR_MODE, exist_ok=True)
        self.clean_stale_temps()

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r}, limit_bytes={self.limit_bytes})"

    # ----------------------------------------------------------------- names and sizes

    @staticmethod
    def name_for(endpoint_id: str, bucket: str, key: str) -> str:
        """sha256 of the three strings, each length-prefixed (so no two triples collide)."""
        digest = hashlib.sha256()
        for part in (endpoint_id, bucket, key):
            raw = part.encode("utf-8", "surrogatepass")
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
        return digest.hexdigest()

    def path_for(self, name: str) -> Path:
        if not _NAME.fullmatch(name):  # names come from name_for only; refuse anything else
            raise ValueError(f"{name!r} is not a cache entry name (64 hex digits)")
        return self.directory / name[:2] / name

    def entry_size(self, length: int, etag: str | None = None) -> int:
        """Bytes on disk of an entry holding ``length`` bytes of object (version ``etag``)."""
        return HEADER_SIZE + length + 4 * -(-length // self.block_size) + len((etag or "").encode())

    def fits(self, length: int) -> bool:
        return self.entry_size(length) <= self.budget

    # ----------------------------------------------------------------- reading

    def open(self, name: str) -> CacheEntry | None:
        """The entry, checked (header, size, table), or None when there is none.

        Raises ``_Corrupt`` for a file that fails a check. A hit refreshes the mtime (LRU).
        """
        try:
            fd = os.open(self.path_for(name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            try:
                entry = CacheEntry(fd, name)
            except _Corrupt as exc:
                st = os.fstat(fd)
                exc.identity = (st.st_dev, st.st_ino)  # discard this file, not a fresh copy
                raise
            if self.touch_after == 0 or time.time() - entry.stat.st_mtime > self.touch_after:
                with contextlib.suppress(OSError):  # read-only media: LRU order degrades, reads work
                    os.utime(fd if os.utime in os.supports_fd else self.path_for(name))
            return entry
        except BaseException:
            os.close(fd)
            raise

    # ----------------------------------------------------------------- writing

    def begin(self, name: str) -> TempFile:
        """A new temp file for ``name`` (a unique name created with O_EXCL)."""
        return TempFile(self, name)

    def put(self, name: str, data: bytes, etag: str | None = None) -> int | None:
        """Cache ``data`` (version ``etag``) as ``name``; the number of entries evicted, or None
        if it is too large."""
        if not self.fits(len(data)):
            return None
        temp = self.begin(name)
        try:
            temp.write(0, data)
        except BaseException:
            temp.abort()
            raise
        return temp.finish(len(data), _block_crcs(data, self.block_size), etag)

    def commit(self, temp_path: str, name: str, size: int) -> int:
        """Move a finished temp file onto ``name``, making room first; the evictions made.

        Eviction comes *before* the rename, so the directory is never over the limit, not even
        between a commit and its eviction.
        """
        final = self.path_for(name)
        os.makedirs(final.parent, mode=_DIR_MODE, exist_ok=True)
        with self._locked() as lock:
            used = self._usage(lock)
            try:
                growth = size - os.stat(final).st_size  # replacing an older copy of the same key
            except FileNotFoundError:
                growth = size
            evicted = 0
            if used + growth > self.budget:
                evicted, used = self._evict(growth, keep=str(final))
            self._set_usage(lock, used + growth)  # before the rename: a crash between over-counts (safe)
            os.replace(temp_path, final)
        return evicted

    def discard(self, name: str, identity: tuple[int, int] | None = None) -> bool:
        """Delete the entry (only if it is still the file ``identity`` = (st_dev, st_ino))."""
        path = self.path_for(name)
        with self._locked() as lock:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return False
            if identity is not None and (st.st_dev, st.st_ino) != identity:
                return False  # already replaced by a fresh copy
            used = self._usage(lock)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            self._set_usage(lock, max(0, used - st.st_size))
            return True

    def usage(self) -> int:
        """The shared running total of entry bytes (what eviction compares with the limit)."""
        with self._locked() as lock:
            return self._usage(lock)

    def clean_stale_temps(self) -> int:
        """Remove temp files nobody has written for ``stale_temp_after`` seconds (killed writers).

        Looks at no more than ``STALE_TEMP_SCAN_MAX`` files. A writer whose temp file was
        removed under it only loses that commit (``os.replace`` fails, the read still succeeds).
        """
        removed = 0
        deadline = time.time() - self.stale_temp_after
        with os.scandir(self._tmp) as found:
            for number, item in enumerate(found):
                if number >= STALE_TEMP_SCAN_MAX:
                    break
                try:
                    if item.stat(follow_symlinks=False).st_mtime < deadline:
                        os.unlink(item.path)
                        removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            log.info("removed %d stale temp file(s) from %s", removed, self._tmp)
        return removed

    def scan(self) -> list[tuple[int, int, str]]:
        """Every entry as ``(mtime_ns, size, path)``; entries deleted meanwhile are left out."""
        entries: list[tuple[int, int, str]] = []
        try:
            top = list(os.scandir(self.directory))
        except FileNotFoundError:
            return entries
        for sub in top:
            if len(sub.name) != 2 or not _is_hex(sub.name) or not sub.is_dir(follow_symlinks=False):
                continue
            try:
                with os.scandir(sub.path) as files:
                    for item in files:
                        if not _NAME.fullmatch(item.name):
                            continue
                        try:
                            st = item.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        entries.append((st.st_mtime_ns, st.st_size, item.path))
            except FileNotFoundError:
                continue
        return entries

    # ----------------------------------------------------------------- shared accounting

    @contextlib.contextmanager
    def _locked(self):
        """Exclusive across processes (flock) and threads: a fresh descriptor per acquisition, so
        two threads of one process exclude each other too, and nothing survives a fork."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield fd
            else:
                with _local_lock:
                    yield fd
        finally:
            os.close(fd)  # releases the flock

    def _usage(self, lock: int) -> int:
        raw = os.pread(lock, LOCK_RESERVE, 0).strip()
        if raw.isdigit():
            return int(raw)
        used = sum(size for _, size, _ in self.scan())  # first use of this directory, or damaged
        self._set_usage(lock, used)
        return used

    @staticmethod
    def _set_usage(lock: int, used: int) -> None:
        raw = b"%d\n" % used
        os.pwrite(lock, raw, 0)
        os.ftruncate(lock, len(raw))

    def _evict(self, growth: int, keep: str) -> tuple[int, int]:
        """Make room for ``growth`` more bytes (call with the lock held): scan, and if the
        entries would exceed the budget, delete the least recently used (never ``keep``) until
        they fit in ``evict_to`` of it. Returns (files deleted, bytes left)."""
        entries = self.scan()
        total = sum(size for _, size, _ in entries)
        evicted = 0
        if total + growth > self.budget:
            target = int(self.budget * self.evict_to)
            for _, size, path in sorted(entries):
                if total + growth <= target:
                    break
                if path == keep:
                    continue
                try:
                    os.unlink(path)
                    evicted += 1
                except FileNotFoundError:  # another process removed it first: gone all the same
                    pass
                total -= size
            log.debug("evicted %d cache file(s) from %s; %d bytes left", evicted, self.directory, total)
        return evicted, total


class CacheEntry:
    """One open, checked cache file; ``read`` verifies the blocks it returns."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.stat = os.fstat(fd)
        raw = os.pread(fd, HEADER_SIZE, 0)
        if len(raw) < HEADER_SIZE:
            raise _Corrupt(f"{len(raw)} bytes, shorter than the header")
        magic, length, block_size, table_crc, etag_size = _HEAD.unpack_from(raw)
        (header_crc,) = struct.unpack_from("<I", raw, _HEAD.size)
        if magic != MAGIC:
            raise _Corrupt("not a cache file of this version (bad magic)")
        if zlib.crc32(raw[: _HEAD.size]) != header_crc or block_size == 0:
            raise _Corrupt("header checksum mismatch")
        blocks = -(-length // block_size)
        expected = HEADER_SIZE + length + 4 * blocks + etag_size
        if self.stat.st_size != expected:
            raise _Corrupt(f"file has {self.stat.st_size} bytes, its header says {expected} (truncated?)")
        trailer = _pread_exact(fd, 4 * blocks + etag_size, HEADER_SIZE + length)
        if zlib.crc32(trailer) != table_crc:
            raise _Corrupt("block table checksum mismatch")
        try:
            self.etag: str | None = trailer[4 * blocks:].decode("utf-8") or None
        except UnicodeDecodeError:
            raise _Corrupt("its ETag is not UTF-8") from None
        crcs = array.array("I")
        crcs.frombytes(trailer[: 4 * blocks])
        if sys.byteorder == "big":
            crcs.byteswap()
        self.length = length
        self.block_size = block_size
        self.crcs = crcs

    @property
    def identity(self) -> tuple[int, int]:
        return self.stat.st_dev, self.stat.st_ino

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (within the object), every block they touch verified."""
        if end <= start:
            return b""
        size = self.block_size
        first, last = start // size, -(-end // size)
        lo, hi = first * size, min(self.length, last * size)
        raw = _pread_exact(self.fd, hi - lo, HEADER_SIZE + lo)
        view = memoryview(raw)
        for block in range(first, last):
            at = (block - first) * size
            if zlib.crc32(view[at : at + size]) != self.crcs[block]:
                raise _Corrupt(f"block {block} (bytes {block * size}-{min(self.length, (block + 1) * size)}) "
                               "checksum mismatch")
        if start == lo and end == hi:
            return raw
        return raw[start - lo : end - lo]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class TempFile:
    """A cache file being written: object bytes at their offsets, then table and header."""

    def __init__(self, cache: DiskCache, name: str) -> None:
        self.cache = cache
        self.name = name
        self.path = str(cache._tmp / f"{name[:16]}.{os.getpid()}.{secrets.token_hex(8)}.part")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(self.path, flags, _FILE_MODE)

    def write(self, offset: int, data: bytes) -> None:
        view, at = memoryview(data), HEADER_SIZE + offset
        while view:
            done = os.pwrite(self.fd, view, at)
            view, at = view[done:], at + done

    def finish(
        self, length: int, crcs: list[int] | array.array | None = None, etag: str | None = None
    ) -> int:
        """Write table, ETag and header, close, commit; evictions made. Removes itself on
        failure. ``etag``: the version the bytes are of (None: unknown, not recorded)."""
        try:
            size = self.cache.block_size
            if crcs is None:  # assembled from pieces: checksum what is on disk
                crcs = array.array("I", (zlib.crc32(_pread_exact(self.fd, min(size, length - at), HEADER_SIZE + at))
                                         for at in range(0, length, size)))
            table = array.array("I", crcs)
            if sys.byteorder == "big":
                table.byteswap()
            raw_etag = (etag or "").encode("utf-8")
            if len(raw_etag) > ETAG_MAX:
                raw_etag = b""
            table_bytes = table.tobytes() + raw_etag
            head = _HEAD.pack(MAGIC, length, size, zlib.crc32(table_bytes), len(raw_etag))
            header = head + struct.pack("<I2x", zlib.crc32(head))
            self.write(length, table_bytes)
            os.pwrite(self.fd, header, 0)
            os.ftruncate(self.fd, HEADER_SIZE + length + len(table_bytes))
            os.close(self.fd)
            self.fd = -1
            return self.cache.commit(self.path, self.name, HEADER_SIZE + length + len(table_bytes))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _block_crcs(data: bytes, size: int) -> list[int]:
    view = memoryview(data)
    return [zlib.crc32(view[at : at + size]) for at in range(0, len(data), size)]


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            raise _Corrupt(f"file ended {n - got} bytes early (truncated while open?)")
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


# ----------------------------------------------------------------------------- the wrapper


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

    Owns ``inner``: ``aclose()`` closes it. Counters are plain ints (see ``CacheStats``);
    ``on_close`` is called with the final ``statistics()`` when the store is closed. Use it
    in one event loop, like any store (see ``loader/stores/base.py``).
    """

    def __init__(
        self,
        inner: ObjectStore,
        cache: DiskCache,
        endpoint_id: str,
        *,
        validate: str = DEFAULT_VALIDATE,
        on_close: Callable[[CacheStats], None] | None = None,
    ) -> None:
        check_validate(validate, "validate")
        self.inner = inner
        self.cache = cache
        self.endpoint_id = endpoint_id
        self.validate = validate
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

    def statistics(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.bytes_read_from_cache, self.evictions,
                          self.corrupt_refetches, self.stale_refetches, self.revalidations)

    def __repr__(self) -> str:
        return f"CachedStore({self.inner!r}, {self.cache!r}, endpoint_id={self.endpoint_id!r})"

    # ----------------------------------------------------------------- the protocol

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(bucket, prefix)

    async def get(
        self, bucket: str, key: str, *, pin: Pin | None = None, listed_etag: str | None = None
    ) -> bytes:
        name = self._name(bucket, key)
        data = await self._cached(name, bucket, key, 0, None, pin, listed_etag)
        if data is not None:
            return data
        self.misses += 1
        puts = self._puts.get(name, 0)
        used = Pin() if pin is None else pin  # learns the version, to record it with the bytes
        data = await self.inner.get(bucket, key, pin=used, listed_etag=listed_etag)
        if self.cache.fits(len(data)) and self._puts.get(name, 0) == puts:
            try:
                evicted = await anyio.to_thread.run_sync(self.cache.put, name, data, used.etag)
                self.evictions += evicted or 0
            except OSError as exc:
                self._cache_failed(exc, bucket, key)
        return data

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *,
        pin: Pin | None = None, listed_etag: str | None = None,
    ) -> bytes:
        name = self._name(bucket, key)
        if end is not None and end <= start:  # nothing to read (the backends send no request either)
            return b""
        data = await self._cached(name, bucket, key, start, end, pin, listed_etag)
        if data is not None:
            return data
        self.misses += 1
        assembly = self._assembly(name, create=True)
        if assembly is None:
            return await self.inner.get_range(bucket, key, start, end, pin=pin, listed_etag=listed_etag)
        used = Pin() if pin is None else pin
        keep = False
        try:
            # One byte more than asked: a shorter answer says where the object ends.
            data = await self.inner.get_range(bucket, key, start, None if end is None else end + 1,
                                              pin=used, listed_etag=listed_etag)
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
            await self._ended(assembly, size)
        return data

    async def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, listed_etag: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be >= 1")
        name = self._name(bucket, key)
        position = start
        used = Pin() if pin is None else pin
        entry = await self._open(name, bucket, key)
        if entry is not None and not await self._usable(entry, name, bucket, key, used, listed_etag):
            entry.close()
            entry = None
        if entry is not None:
            fell_back = False
            try:
                _check_start(entry.length, start, bucket, key)
                block = entry.block_size
                span = max(block, -(-chunk_size // block) * block)  # whole blocks per read
                at = start - start % block
                while at < entry.length:
                    stop = min(entry.length, at + span)
                    try:
                        data = await self._read(entry, at, stop)
                    except _Corrupt as exc:  # the bytes so far were verified: the rest from the store
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
                self.inner.stream(bucket, key, start=offset, chunk_size=chunk_size, pin=used,
                                  listed_etag=listed_etag)
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
            if assembly is not None:
                await self._ended(assembly, offset)
            if offset < position:  # asked to start past the end: what the store would have said
                _check_start(offset, position, bucket, key)
        except InvalidRangeError:
            keep = True
            if assembly is not None and offset > 0 and assembly.covers(0, offset):
                await self._ended(assembly, offset)  # resumed exactly at the end of the object
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
        except _Corrupt as exc:
            await self._corrupt(name, exc.identity, exc, bucket, key)
        except OSError as exc:
            self._cache_failed(exc, bucket, key)
        return None

    async def _usable(
        self, entry: CacheEntry, name: str, bucket: str, key: str, pin: Pin | None,
        listed_etag: str | None,
    ) -> bool:
        """Whether ``entry`` may answer this read (the rule is in the module docstring); if it
        may, a read that ``pin`` is not pinned yet is pinned to the entry's version."""
        if pin is not None and pin.etag is not None:
            return entry.etag == pin.etag  # never mix versions within one read
        fresh = True
        if listed_etag is not None and self.validate != "never":
            fresh = entry.etag == listed_etag
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

    async def _unchanged(self, bucket: str, key: str, etag: str) -> bool:
        """One conditional GET of one byte: whether the object is still version ``etag``."""
        self.revalidations += 1
        try:
            return await self.inner.get_if_changed(bucket, key, etag, 0, 1) is None
        except InvalidRangeError:  # changed into an empty object
            return False

    async def _cached(
        self, name: str, bucket: str, key: str, start: int, end: int | None,
        pin: Pin | None = None, listed_etag: str | None = None,
    ) -> bytes | None:
        """Bytes ``[start, end)`` from a complete, intact, current cache file, or None (a miss;
        a corrupt file is removed on the way). A start past the object's end raises as S3 would."""
        entry = await self._open(name, bucket, key)
        if entry is None:
            return None
        try:
            if not await self._usable(entry, name, bucket, key, pin, listed_etag):
                return None
            _check_start(entry.length, start, bucket, key)
            data = await self._read(entry, start, entry.length if end is None else min(end, entry.length))
        except _Corrupt as exc:
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

    async def _corrupt(self, name: str, identity: tuple[int, int] | None, exc: _Corrupt, bucket: str,
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

    async def _ended(self, assembly: _Assembly, size: int) -> None:
        """A read reached the object's end at ``size``."""
        if assembly.size is not None and assembly.size != size:  # the object changed under us
            self._drop(assembly)
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
            except (OSError, _Corrupt) as exc:  # finish() removed its temp file
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
    *,
    validate: str = DEFAULT_VALIDATE,
    on_close: Callable[[CacheStats], None] | None = None,
    **cache_options: Any,
) -> CachedStore:
    """``factory()``'s store wrapped in a cache; await it inside the loop that will use it.

    The directory is checked first, so a bad ``cache_dir`` fails before any connection opens.
    """
    try:
        cache = await anyio.to_thread.run_sync(lambda: DiskCache(directory, limit_bytes, **cache_options))
    except OSError as exc:
        raise ConfigError(
            f"cache_dir={os.fspath(directory)!r} cannot be used: {type(exc).__name__}: {exc}"
        ) from exc
    return CachedStore(await factory(), cache, endpoint_id, validate=validate, on_close=on_close)
