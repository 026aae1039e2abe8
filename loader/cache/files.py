"""The disk cache's files: one per object, checksummed per block, written atomically, shared by
processes through a lock that keeps the byte count, evicted least recently used first.

Synchronous; the layout, the file format and the locking are described in docs/design/cache.md.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import os
import re
import secrets
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

from ..checks import check_int
from ..errors import ConfigError
from .options import check_limit

try:
    import fcntl
except ImportError:  # not on Windows: one process at a time there (see _locked)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_EVICT_TO = 0.9
DEFAULT_TOUCH_AFTER = 10.0
DEFAULT_STALE_TEMP_AFTER = 15 * 60.0
STALE_TEMP_SCAN_MAX = 10_000  # temp files looked at per startup: bounded work
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
    raise ImportError("loader.cache.files needs a platform where C unsigned int is 4 bytes")


class CorruptEntry(Exception):
    """A cache file failed a check; the message says which. ``identity``: the file's
    ``(st_dev, st_ino)``, so that only that file is discarded, never a fresh copy."""

    identity: tuple[int, int] | None = None


class DiskCache:
    """The on-disk part: entries named by hash, atomic commits, shared byte count, LRU eviction.

    Synchronous and safe to call from several threads and processes at once (docs/design/cache.md).
    Creating one creates the directory and removes stale temp files (bounded work).
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
        check_limit(limit_bytes, "limit_bytes")
        check_int("block_size", block_size, minimum=1, maximum=(1 << 32) - 1,
                  must="a positive integer below 4 GiB")
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

        Raises ``CorruptEntry`` for a file that fails a check. A hit refreshes the mtime (LRU).
        """
        try:
            fd = os.open(self.path_for(name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            try:
                entry = CacheEntry(fd, name)
            except CorruptEntry as exc:
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
            raise CorruptEntry(f"{len(raw)} bytes, shorter than the header")
        magic, length, block_size, table_crc, etag_size = _HEAD.unpack_from(raw)
        (header_crc,) = struct.unpack_from("<I", raw, _HEAD.size)
        if magic != MAGIC:
            raise CorruptEntry("not a cache file of this version (bad magic)")
        if zlib.crc32(raw[: _HEAD.size]) != header_crc or block_size == 0:
            raise CorruptEntry("header checksum mismatch")
        blocks = -(-length // block_size)
        expected = HEADER_SIZE + length + 4 * blocks + etag_size
        if self.stat.st_size != expected:
            raise CorruptEntry(f"file has {self.stat.st_size} bytes, its header says {expected} (truncated?)")
        trailer = _pread_exact(fd, 4 * blocks + etag_size, HEADER_SIZE + length)
        if zlib.crc32(trailer) != table_crc:
            raise CorruptEntry("block table checksum mismatch")
        try:
            self.etag: str | None = trailer[4 * blocks:].decode("utf-8") or None
        except UnicodeDecodeError:
            raise CorruptEntry("its ETag is not UTF-8") from None
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
                raise CorruptEntry(f"block {block} (bytes {block * size}-{min(self.length, (block + 1) * size)}) "
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
            raise CorruptEntry(f"file ended {n - got} bytes early (truncated while open?)")
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)

