"""Listing a prefix at scale: key ranges in parallel, pages retried where they failed, keys compact.

``list_all`` lists a prefix as key ranges in parallel (``ranges``), retries a failed page
from the last token received (never from page 1), and packs pages into a ``KeyList`` (keys in
one buffer, ~length + 12 bytes each) merged into one sorted list. Why and how: docs/design/listing.md.
"""

from __future__ import annotations

import array
import dataclasses
import heapq
import itertools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

from ..checks import check_int
from ..errors import ConfigError
from ..retry import RetryPolicy, call_with_retries
from ..s3.protocol import DEFAULT_PAGE_SIZE, ObjectInfo, ObjectStore, PagedLister
from .ranges import RangeLister

DEFAULT_LIST_PARALLEL = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListOptions:
    """How prefixes are listed.

    ``page_size``: keys per LIST request (S3's ``max-keys``; 1000 is the most S3 returns).
    ``concurrency``: key ranges listed at once (1: one page after another); ``parallel``, its
    name in earlier releases, still sets it, with a DeprecationWarning.
    ``once_per_job``: in a ``torch.distributed`` job, rank 0 lists and hands the key list to the
    other ranks, so a job makes the LIST requests of one listing, not one per rank. Every rank
    must then build its datasets in the same order (as DDP requires anyway).
    """

    page_size: int = DEFAULT_PAGE_SIZE
    concurrency: int = DEFAULT_LIST_PARALLEL
    once_per_job: bool = True
    parallel: dataclasses.InitVar[int | None] = None

    def __post_init__(self, parallel: int | None) -> None:
        if parallel is not None:
            warnings.warn("ListOptions(parallel=) is deprecated and will be removed in the next release: "
                          "write ListOptions(concurrency=...)", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "concurrency", parallel)
        for name in ("page_size", "concurrency"):
            check_int(f"ListOptions.{name}", getattr(self, name), minimum=1, must="a positive integer")
        if self.page_size > DEFAULT_PAGE_SIZE:
            raise ConfigError(f"ListOptions.page_size={self.page_size!r}: S3 returns at most "
                              f"{DEFAULT_PAGE_SIZE} keys per page")


SPAWN_REDUCER: Callable[[KeyList], tuple[Any, ...] | None] | None = None
"""Set by ``nodeshare``: how a ``KeyList`` pickles into a process being started (a reference to
its shared file), or None for its buffers. A hook, so that this module imports nothing above it."""


def _owned(values: Any) -> array.array:
    """A typed map (or an ``array``) as an ``array`` of its own: pickles without the file."""
    if isinstance(values, array.array):
        return values
    out = array.array(values.format)
    out.frombytes(values.cast("B"))
    return out


class KeyList(Sequence[str]):
    """An immutable sequence of keys (and optionally their sizes and ETags) packed into a few
    buffers.

    ``keys[i]`` decodes one key; iteration, ``len``, slicing and pickling work like a tuple of
    ``str``, at a fraction of its memory (``nbytes``). It pickles as its buffers, so handing it
    to DataLoader workers or other ranks copies a few large blocks, not millions of objects.
    The buffers may also be read-only maps of a file (``keyfile``, ``nodeshare``): such a list
    is shared by every process that maps it, and pickles into a process being started as a
    reference to its file.
    """

    __slots__ = ("_blob", "_ends", "_etags", "_origin", "_sizes")

    def __init__(self, blob: bytes, ends: array.array, sizes: array.array | None = None,
                 etags: KeyList | None = None) -> None:
        if sizes is not None and len(sizes) != len(ends):
            raise ValueError(f"{len(sizes)} sizes for {len(ends)} keys")
        if etags is not None and len(etags) != len(ends):
            raise ValueError(f"{len(etags)} ETags for {len(ends)} keys")
        self._blob = blob
        self._ends = ends
        self._sizes = sizes
        self._etags = etags  # packed by _pack_etag: 17 bytes for an md5 ETag, not ~80
        self._origin: Any = None  # the file it is mapped from (keyfile.KeyFile), if any

    @classmethod
    def from_keys(cls, keys: Iterable[str], sizes: Iterable[int] | None = None) -> KeyList:
        """Pack ``keys`` in the order given (and ``sizes``, one per key, if given)."""
        encoded = [key.encode("utf-8", "surrogatepass") for key in keys]
        return cls._pack(encoded, None if sizes is None else array.array("q", sizes))

    @classmethod
    def from_infos(cls, infos: Iterable[ObjectInfo]) -> KeyList:
        """Pack listed objects (keys, sizes and ETags, if the listing gave any) in order."""
        infos = list(infos)
        etags = None
        if any(info.etag is not None for info in infos):
            etags = cls._pack([_pack_etag(info.etag) for info in infos], None)
        return cls._pack([info.key.encode("utf-8", "surrogatepass") for info in infos],
                         array.array("q", (info.size for info in infos)), etags)

    @classmethod
    def _pack(cls, encoded: list[bytes], sizes: array.array | None,
              etags: KeyList | None = None) -> KeyList:
        blob = b"".join(encoded)
        ends = array.array(_offset_type(len(blob)), itertools.accumulate(map(len, encoded)))
        return cls(blob, ends, sizes, etags)

    @classmethod
    def from_records(cls, records: Iterable[bytes], sizes: Iterable[int] | None = None) -> KeyList:
        """Pack opaque byte strings (read back with ``record``) as a list of keys is packed: what
        a source shares once per job besides keys (``sharing.once_per_job``) travels and maps
        the same way."""
        return cls._pack(list(records), None if sizes is None else array.array("q", sizes))

    def record(self, index: int) -> bytes:
        """Entry ``index`` as the bytes packed (``from_records``), not decoded."""
        raw = self._raw(index)
        return raw if isinstance(raw, bytes) else bytes(raw)

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> KeyList: ...

    def __getitem__(self, index: int | slice) -> str | KeyList:
        if isinstance(index, slice):
            positions = range(len(self))[index]
            sizes = None if self._sizes is None else [self._sizes[i] for i in positions]
            part = KeyList.from_keys((self[i] for i in positions), sizes)
            if self._etags is not None:
                part._etags = KeyList._pack([self._etags._raw(i) for i in positions], None)
            return part
        return self._raw(index).decode("utf-8", "surrogatepass")

    def _raw(self, index: int) -> bytes:
        count = len(self._ends)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"key index {index} out of range for {count} keys")
        start = self._ends[index - 1] if index else 0
        return self._blob[start:self._ends[index]]

    def __iter__(self) -> Iterator[str]:
        blob, start = self._blob, 0
        for end in self._ends:
            yield blob[start:end].decode("utf-8", "surrogatepass")
            start = end

    @property
    def has_sizes(self) -> bool:
        """Whether the list carries each key's size (made from a listing)."""
        return self._sizes is not None

    def size(self, index: int) -> int:
        """The listed size of key ``index`` (only for lists made from a listing)."""
        if self._sizes is None:
            raise TypeError("this key list carries no sizes (it was not made from a listing)")
        return self._sizes[index]

    @property
    def has_etags(self) -> bool:
        """Whether the listing gave ETags (``etag`` then answers for every key)."""
        return self._etags is not None

    def etag(self, index: int) -> str | None:
        """The listed ETag of key ``index`` (None when the listing gave none)."""
        return None if self._etags is None else _unpack_etag(self._etags._raw(index))

    def find(self, key: str) -> int | None:
        """The position of ``key`` in a list in key order (a listing's), by bisection over the
        packed bytes (UTF-8 sorts like the keys); None when it is not there."""
        raw = key.encode("utf-8", "surrogatepass")
        blob, ends = self._blob, self._ends
        lo, hi = 0, len(ends)
        while lo < hi:  # bisect.bisect_left, without decoding a str at every step
            mid = (lo + hi) // 2
            if blob[ends[mid - 1] if mid else 0:ends[mid]] < raw:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(ends) and blob[ends[lo - 1] if lo else 0:ends[lo]] == raw:
            return lo
        return None

    def infos(self) -> Iterator[ObjectInfo]:
        """``ObjectInfo(key, size, etag)`` for every key, in order (sizes needed)."""
        if self._sizes is None:
            raise TypeError("this key list carries no sizes (it was not made from a listing)")
        if self._etags is None:
            return map(ObjectInfo, self, self._sizes)
        return map(ObjectInfo, self, self._sizes, self.etags() or ())

    def etags(self) -> list[str | None] | None:
        """The listed ETag of every key, in order; None when the listing gave none."""
        if self._etags is None:
            return None
        return [_unpack_etag(raw) for raw in _raw_keys(self._etags)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (the whole cost of the list, bar a small header)."""
        return (len(self._blob) + self._ends.itemsize * len(self._ends)
                + (0 if self._sizes is None else self._sizes.itemsize * len(self._sizes))
                + (0 if self._etags is None else self._etags.nbytes))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyList):  # memoryview: the buffers may be maps of a file
            return (memoryview(self._blob) == memoryview(other._blob)
                    and memoryview(self._ends) == memoryview(other._ends))
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        if SPAWN_REDUCER is not None:  # into a process being started: maybe a file reference
            reduced = SPAWN_REDUCER(self)
            if reduced is not None:
                return reduced
        blob = self._blob if isinstance(self._blob, bytes) else bytes(self._blob)
        return (KeyList, (blob, _owned(self._ends), None if self._sizes is None else _owned(self._sizes),
                          self._etags))

    def __copy__(self) -> KeyList:
        return self  # immutable: a copy would only cost memory

    def __deepcopy__(self, memo: dict[int, Any]) -> KeyList:
        return self

    def __repr__(self) -> str:
        first = ", ".join(repr(key) for key in itertools.islice(self, 3))
        more = ", ..." if len(self) > 3 else ""
        return f"KeyList([{first}{more}], {len(self)} keys, {self.nbytes} bytes)"


_HEX = re.compile(r"[0-9a-f]+")


def _pack_etag(etag: str | None) -> bytes:
    """An ETag in few bytes: a lowercase hex one (an md5) as its 16 bytes after a 1, any other
    after a 2, none as nothing."""
    if not etag:
        return b""
    if len(etag) % 2 == 0 and _HEX.fullmatch(etag):
        return b"\x01" + bytes.fromhex(etag)
    return b"\x02" + etag.encode("utf-8", "surrogatepass")


def _unpack_etag(raw: bytes) -> str | None:
    if not raw:
        return None
    return raw[1:].hex() if raw[0] == 1 else raw[1:].decode("utf-8", "surrogatepass")


def _offset_type(total: int) -> str:
    """The narrowest unsigned array type that holds offsets up to ``total``."""
    return "I" if total < (1 << 32) else "Q"


class _Runs:
    """Pages packed as they arrive (each sorted on its own), merged once at the end."""

    def __init__(self, suffix: str | tuple[str, ...]) -> None:
        self.suffix = suffix
        self.runs: list[KeyList] = []

    def add(self, objects: list[ObjectInfo]) -> None:
        # directory markers ("a/") are not data; the suffix filter is the caller's
        kept = [info for info in objects
                if not info.key.endswith("/") and info.key.endswith(self.suffix)]
        if any(a.key >= b.key for a, b in itertools.pairwise(kept)):  # S3's pages are in order
            kept.sort()
            kept = [info for info, after in zip(kept, kept[1:] + [None])
                    if after is None or after.key != info.key]
        if kept:
            self.runs.append(KeyList.from_infos(kept))

    def merged(self) -> KeyList:
        """One sorted list without repeats (a concatenation when the runs already are in order)."""
        runs = sorted(self.runs, key=lambda run: run._raw(0))  # ranges finish in any order
        if all(a._raw(len(a) - 1) < b._raw(0) for a, b in itertools.pairwise(runs)):
            return _concat(runs)
        # built in place: a list of bytes objects would cost ~35 bytes per key more at the peak
        blob = bytearray()
        ends = array.array(_offset_type(sum(len(run._blob) for run in runs)))
        sizes = array.array("q")
        tags: list[bytes] = []
        last = None
        for raw, size, tag in heapq.merge(*(zip(_raw_keys(run), _listed_sizes(run), _raw_etags(run))
                                            for run in runs)):
            if raw != last:
                blob += raw
                ends.append(len(blob))
                sizes.append(size)
                tags.append(tag)
                last = raw
        etags = KeyList._pack(tags, None) if any(tags) else None
        return KeyList(bytes(blob), ends, sizes, etags)


def _raw_keys(keys: KeyList) -> Iterator[bytes]:
    """The UTF-8 bytes of each key: they sort like the keys (code point order)."""
    blob, start = keys._blob, 0
    for end in keys._ends:
        yield blob[start:end]
        start = end


def _raw_etags(keys: KeyList) -> Iterator[bytes]:
    """Each key's packed ETag (``b""`` for none)."""
    if keys._etags is None:
        return itertools.repeat(b"", len(keys))
    return _raw_keys(keys._etags)


def _listed_sizes(run: KeyList) -> array.array:
    """A run's sizes: runs are built from listings, which always carry them."""
    assert run._sizes is not None
    return run._sizes


def _concat(runs: list[KeyList]) -> KeyList:
    blob = b"".join(run._blob for run in runs)
    ends = array.array(_offset_type(len(blob)))
    sizes = array.array("q")
    base = 0
    for run in runs:
        ends.extend(end + base for end in run._ends)
        sizes.extend(_listed_sizes(run))
        base += len(run._blob)
    etags = None
    if any(run._etags is not None for run in runs):
        etags = KeyList._pack([tag for run in runs for tag in _raw_etags(run)], None)
    return KeyList(blob, ends, sizes, etags)


async def list_all(
    store: ObjectStore,
    bucket: str,
    prefix: str,
    retry: RetryPolicy,
    *,
    suffix: str | tuple[str, ...] = "",
    options: ListOptions | None = None,
) -> KeyList:
    """Every object under ``s3://bucket/prefix`` ending in ``suffix`` (or one of several),
    sorted, with sizes (directory markers skipped). See docs/design/listing.md for retries,
    key ranges and memory."""
    options = options or ListOptions()
    runs = _Runs(suffix)
    if isinstance(store, PagedLister):
        await RangeLister(store, bucket, prefix, retry, options.page_size, options.concurrency,
                          runs.add).run()
    else:
        await _list_whole(store, bucket, prefix, retry, runs)
    return runs.merged()


async def _list_whole(
    store: ObjectStore, bucket: str, prefix: str, retry: RetryPolicy, runs: _Runs
) -> None:
    """A store without pages: the whole listing is one attempt, retried from the start."""

    async def attempt() -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        async for info in store.list(bucket, prefix):
            found.append(info)
        return found

    runs.add(await call_with_retries(attempt, retry))


