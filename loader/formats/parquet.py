"""Parquet files as a source of samples: footers, row-group plans, and rows decoded by pyarrow.

A Parquet file carries its own index: its footer (the file's last bytes) gives the row count of
every row group and where each column chunk lies. So a data set of Parquet files needs no index
of ours: one ranged GET of each file's tail gives its footer (``read_footer``), the footers give
exact row counts for an exact split, and a row group is read by fetching only the selected
columns' chunks (``row_group_job``: ranged GETs in parallel, each pinned to the listed ETag).

Nothing here parses Parquet: pyarrow decodes the footer and the pages. It reads them from a
``SparseFile``, a file of the object's size that holds only the byte ranges fetched (the
selected column chunks); pyarrow is asked not to coalesce reads across the gaps.

Memory: a row group being read holds the compressed bytes of its selected column chunks (all
of them: pyarrow decodes a row group's columns side by side), plus one decoded batch of rows
(``BATCH_ROWS``); ``RowGroupPlan.need`` is that number, which the engine's budget reserves. A
row group that does not fit in the budget that way is read streamed (``StreamedFile``: each
column chunk fetched in pieces as pyarrow reads it forward, ``RowGroupPlan.streamed_need``).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import warnings
from collections.abc import Awaitable, Callable, Container, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from ..engine.core import run_all
from ..engine.fetch import Job, JobContext
from ..errors import ConfigError, ObjectChangedError, ParquetFormatError, say_skipped
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectStore
from ..s3.protocol import Pin
from ..s3.request_gate import gated
from ..uri import object_url
from .shards import END, ShardAssignment, ShardEnd

if TYPE_CHECKING:
    import pyarrow.parquet as pq

log = logging.getLogger(__name__)

PARQUET_SUFFIX = ".parquet"
DEFAULT_TAIL = 64 << 10  # bytes of a file's tail read at once: its footer, unless the footer is larger
MAGIC = b"PAR1"
BATCH_ROWS = 64  # rows decoded at a time: bounds the decoded bytes a row group holds
# One ranged GET reads at most this many bytes of a unit, ``parts_inflight`` of them at once: S3
# serves one connection at about 85-90 MB/s, so a unit read as one GET of 32 MiB takes 0.4 s,
# and AWS advises ranges of 8-16 MB (measured: bench/results/parquet-s3like-2026-11-27.md).
RANGE_BYTES = 8 << 20
# Arrow reads up to 100 bytes past a column chunk's end for files of old parquet-mr writers
# (its ``kMaxDictHeaderSize`` padding); fetching them too keeps such files readable.
CHUNK_SLACK = 100
# A row group larger than its share of the memory budget is read streamed: each column chunk in
# pieces as pyarrow decodes it, this many pieces fetched ahead of the one it reads.
STREAM_AHEAD = 1


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or a ConfigError saying how to install it (the ``parquet`` extra)."""
    try:
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError("reading Parquet needs pyarrow: pip install 's3stream-loader[parquet]'") from exc
    return pyarrow.parquet


class ParquetRef(NamedTuple):
    """One Parquet file: where it is, its size and the ETag its listing gave (reads pin it)."""

    bucket: str
    key: str
    size: int
    etag: str | None = None

    @property
    def url(self) -> str:
        return object_url(self.bucket, self.key)

    @property
    def stem(self) -> str:
        """The key less its ``.parquet`` suffix: the first part of every row's ``__key__``."""
        return self.key[: -len(PARQUET_SUFFIX)] if self.key.endswith(PARQUET_SUFFIX) else self.key


class Footer(NamedTuple):
    """A file's footer as fetched: where it starts in the file, and its bytes (the Thrift
    metadata, its 4-byte length and the closing magic)."""

    start: int
    data: bytes


class RowGroupPlan(NamedTuple):
    """Row groups to read as one unit: file ``file`` (an index into the source's files), its
    consecutive row groups ``groups``, ``rows`` rows in all, the first of which is row ``first`` of
    the file; ``ranges``: the merged byte ranges of the selected columns' chunks; ``decoded``:
    those columns' bytes once decompressed (the footer says), for the memory a batch needs."""

    file: int
    groups: tuple[int, ...]
    rows: int
    first: int
    ranges: tuple[tuple[int, int], ...]
    decoded: int
    chunks: tuple[tuple[int, int], ...] = ()  # each selected column chunk's bytes (a streamed read's)

    @property
    def name(self) -> str:
        """``row group 3`` or ``row groups 3-5``, for messages."""
        first, last = self.groups[0], self.groups[-1]
        return f"row group {first}" if first == last else f"row groups {first}-{last}"

    @property
    def fetched(self) -> int:
        """Bytes fetched for this row group (its selected column chunks)."""
        return sum(end - start for start, end in self.ranges)

    @property
    def batch(self) -> int:
        """Bytes of one decoded batch of rows (``BATCH_ROWS``), by the footer's sizes."""
        return 0 if self.rows == 0 else -(-self.decoded * min(self.rows, BATCH_ROWS) // self.rows)

    @property
    def need(self) -> int:
        """Bytes held while this row group is read: its fetched column chunks, and one decoded
        batch twice over (the Arrow arrays and the Python rows made of them)."""
        return self.fetched + 2 * self.batch

    def streamed_need(self, piece: int) -> int:
        """Bytes held while this row group is read streamed in pieces of ``piece`` bytes
        (``StreamedFile``): per column chunk, the piece pyarrow reads from, the next one
        fetched ahead and pyarrow's own buffer of one piece; plus the decoded batch twice over.
        A page larger than a piece is read whole (the footer does not say page sizes)."""
        held = sum(min(end - start, (STREAM_AHEAD + 2) * piece) for start, end in self.chunks)
        return held + 2 * self.batch


# ----------------------------------------------------------------------------- footers


async def read_footer(store: ObjectStore, ref: ParquetRef, retry: RetryPolicy,
                      tail: int = DEFAULT_TAIL) -> Footer:
    """The footer of ``ref``: one ranged GET of its last ``tail`` bytes, and a second one only
    when the footer is longer. Both pinned to the listed ETag. The last 8 bytes are the
    footer's length and the magic ``PAR1`` (the one thing read here by hand: where the
    footer starts; pyarrow parses it)."""
    if ref.size < 12:
        raise ParquetFormatError(f"{ref.url} is {ref.size} bytes, too short for a Parquet file "
                                 "(not Parquet, or truncated)", url=ref.url)
    pin = Pin(ref.etag)

    async def get(start: int, end: int) -> bytes:
        return await call_with_retries(lambda: store.get_range(ref.bucket, ref.key, start, end, pin=pin),
                                       retry)

    begin = max(0, ref.size - tail)
    data = await get(begin, ref.size)
    if len(data) != ref.size - begin or data[-4:] != MAGIC:
        raise ParquetFormatError(f"{ref.url} does not end in the Parquet magic {MAGIC!r}: not a Parquet "
                                 "file, or a truncated one (its footer is missing)", url=ref.url)
    length = int.from_bytes(data[-8:-4], "little")
    start = ref.size - 8 - length
    if start < 4:
        raise ParquetFormatError(f"{ref.url}: its footer claims {length} bytes, more than the file holds "
                                 f"({ref.size} bytes): the footer is corrupt or the file truncated",
                                 url=ref.url)
    if start < begin:
        data = await get(start, begin) + data
        begin = start
    return Footer(start, data[start - begin:])


def parse_footer(ref: ParquetRef, footer: Footer) -> pq.FileMetaData:
    """pyarrow's ``FileMetaData`` of a fetched footer; a ParquetFormatError naming the file when
    it does not decode."""
    parquet = pyarrow_parquet()
    import pyarrow as pa

    try:
        # The footer alone behind the leading magic: a file pyarrow parses the metadata of
        # (offsets in it stay those of the real file).
        return parquet.ParquetFile(pa.BufferReader(MAGIC + footer.data)).metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ParquetFormatError(f"{ref.url}: its Parquet footer does not decode ({exc}); the file is "
                                 "corrupt or truncated", url=ref.url) from exc


def class_label_names(metadata: Mapping[bytes, bytes] | None, columns: Sequence[str] | None) -> list[str] | None:
    """The class names of a Hugging Face ``ClassLabel`` column, from the ``huggingface`` entry of
    a file's key-value metadata (``{"info": {"features": {column: {"_type": "ClassLabel",
    "names": [...]}}}}``, as ``datasets`` writes it): the one such column among ``columns`` (None:
    all), or the one named ``label`` when there are several; None when there is none."""
    raw = (metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    try:
        features = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return None  # metadata of another shape: no classes, nothing to fail on
    if not isinstance(features, dict):
        return None
    labels = {name: feature["names"] for name, feature in features.items()
              if isinstance(feature, dict) and feature.get("_type") == "ClassLabel"
              and isinstance(feature.get("names"), list) and (columns is None or name in columns)}
    if len(labels) > 1:
        labels = {name: names for name, names in labels.items() if name == "label"}
    if len(labels) != 1:
        return None
    return [str(name) for name in next(iter(labels.values()))]


def top_level_names(meta: pq.FileMetaData) -> list[str]:
    """The columns a user selects: the schema's top-level fields."""
    return list(meta.schema.to_arrow_schema().names)


def plan_row_groups(ref: ParquetRef, file: int, meta: pq.FileMetaData, footer: Footer,
                    columns: Sequence[str] | None) -> list[RowGroupPlan]:
    """Every row group of one file, with the byte ranges of the ``columns`` selected (None: all).

    A column that the file does not have is a ConfigError naming the file and the column."""
    names = top_level_names(meta)
    if columns is not None:
        missing = [name for name in columns if name not in names]
        if missing:
            raise ConfigError(f"{ref.url} has no column {missing[0]!r} (columns=... asked for "
                              f"{list(columns)!r}; the file's columns are {names!r})")
    wanted = set(names if columns is None else columns)
    plans: list[RowGroupPlan] = []
    first = 0
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        spans: list[tuple[int, int]] = []
        decoded = 0
        for number in range(row_group.num_columns):
            chunk = row_group.column(number)
            if chunk.path_in_schema.split(".", 1)[0] not in wanted:
                continue
            start = chunk.data_page_offset
            dictionary = chunk.dictionary_page_offset
            if chunk.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
                start = dictionary
            end = min(start + chunk.total_compressed_size + CHUNK_SLACK, footer.start)
            if not 0 <= start < end:
                raise ParquetFormatError(f"{ref.url}: row group {group} column {chunk.path_in_schema!r} "
                                         f"lies at bytes {start}..{end}, outside the file: its footer "
                                         "is corrupt", url=ref.url)
            spans.append((start, end))
            decoded += chunk.total_uncompressed_size
        plans.append(RowGroupPlan(file, (group,), row_group.num_rows, first, merge_ranges(spans), decoded,
                                  tuple(sorted(spans))))
        first += row_group.num_rows
    return plans


def coalesce(plans: Sequence[RowGroupPlan], limit: int, max_need: int | None = None,
             max_rows: int | None = None) -> list[RowGroupPlan]:
    """Consecutive row groups of one file joined into units of at most ``limit`` fetched bytes
    (and ``max_rows`` rows) that need at most ``max_need`` bytes to read (a row group larger than
    that stays alone): one ranged GET reads several small row groups.

    Why: a server's cost is mostly per request (SeaweedFS spends ~20 ms of CPU on a ranged GET of
    a 96 MiB object whatever its length, measured), and the Hub writes image data sets in row
    groups of 100 rows (~5 MB). Units of several row groups shuffle coarser; the split stays exact."""
    out: list[RowGroupPlan] = []
    for plan in plans:
        last = out[-1] if out else None
        if (last is not None and last.file == plan.file and last.groups[-1] + 1 == plan.groups[0]
                and last.first + last.rows == plan.first and last.fetched + plan.fetched <= limit
                and (max_rows is None or last.rows + plan.rows <= max_rows)):
            joined = RowGroupPlan(plan.file, last.groups + plan.groups, last.rows + plan.rows, last.first,
                                  merge_ranges(last.ranges + plan.ranges), last.decoded + plan.decoded,
                                  last.chunks + plan.chunks)
            if max_need is None or joined.need <= max_need:
                out[-1] = joined
                continue
            out.append(plan)
        else:
            out.append(plan)
    return out


def merge_ranges(spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Half-open byte ranges, sorted, with overlapping or touching ones joined."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return tuple((start, end) for start, end in out)


def split_ranges(ranges: Sequence[tuple[int, int]], part_size: int) -> list[tuple[int, int]]:
    """Each range cut into parts of at most ``part_size`` bytes: one ranged GET each."""
    return [(at, min(at + part_size, end)) for start, end in ranges for at in range(start, end, part_size)]


# ----------------------------------------------------------------------------- decoding


class _RangesFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes of which only some ranges can be read:
    what pyarrow reads a row group from (``read`` is the subclass's)."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self._size = size
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


class SparseFile(_RangesFile):
    """A read-only file of ``size`` bytes of which only ``pieces`` (``(offset, bytes)``, not
    overlapping) are present: what pyarrow reads a row group or a footer from. A read may span
    pieces that follow each other (the ranged GETs of one byte range, kept apart rather than
    joined: only the bytes of such a read are copied). Reading a byte that was not fetched is an
    OSError naming the file (a planning mistake, never silent)."""

    def __init__(self, url: str, size: int, pieces: Sequence[tuple[int, bytes]]) -> None:
        super().__init__(url, size)
        self._pieces = sorted(pieces, key=lambda piece: piece[0])
        self._starts = [offset for offset, _ in self._pieces]

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._at + size)
        if end <= self._at:
            return b""
        import bisect

        at, views = self._at, []
        place = bisect.bisect_right(self._starts, at) - 1
        while at < end:  # within one piece, or across pieces that follow each other (the parts of a range)
            offset, data = self._pieces[place] if 0 <= place < len(self._pieces) else (at, b"")
            if not offset <= at < offset + len(data):
                raise OSError(f"{self.url}: bytes {self._at}..{end} were not fetched")
            stop = min(end, offset + len(data))
            views.append(memoryview(data)[at - offset: stop - offset])  # pyarrow takes one without a copy
            at, place = stop, place + 1
        self._at = at
        return views[0] if len(views) == 1 else b"".join(views)  # type: ignore[return-value]



class StreamedFile(_RangesFile):
    """A read-only file of ``size`` bytes whose column chunks (``chunks``, byte ranges) are
    fetched in pieces of ``piece`` bytes as pyarrow reads them, ``STREAM_AHEAD`` pieces ahead of
    the one read, and dropped once the reading has moved past them: what a row group larger
    than its share of the memory budget is decoded from. pyarrow reads each column chunk
    forward (its buffered stream, ``buffer_size=piece``), so each chunk holds a few pieces.

    pyarrow calls ``read`` from the thread that decodes; ``fetch(start, end)`` runs in the
    engine's loop (``token``), started there by ``start`` (a task group's ``start_soon``)."""

    def __init__(self, url: str, size: int, chunks: Sequence[tuple[int, int]], piece: int,
                 fetch: Callable[[int, int], Awaitable[bytes]], start: Callable[..., Any], token: Any) -> None:
        super().__init__(url, size)
        # Back to back: a chunk read up to CHUNK_SLACK past its end reads the next one's first
        # bytes from that one's pieces, so each byte belongs to one chunk.
        ordered = sorted(set(chunks))
        self._chunks = [(start, min(end, ordered[i + 1][0]) if i + 1 < len(ordered) else end)
                        for i, (start, end) in enumerate(ordered) if i + 1 == len(ordered) or start < ordered[i + 1][0]]
        self._piece = piece
        self._fetch = fetch
        self._start = start
        self._token = token
        # (chunk start, piece start) -> (fetched, [bytes | error])
        self._pieces: dict[tuple[int, int], tuple[anyio.Event, list[Any]]] = {}
        self.held = self.peak = 0  # bytes of pieces fetched and not yet dropped (measured)
        self.failed: Exception | None = None  # a fetch's error, as it was
        self.warned = False  # whether a page larger than a piece was reported

    def _chunk(self, at: int) -> tuple[int, int]:
        import bisect

        place = bisect.bisect_right(self._chunks, (at, self._size + 1)) - 1
        if place < 0 or not self._chunks[place][0] <= at < self._chunks[place][1]:
            raise OSError(f"{self.url}: byte {at} is in no column chunk read")
        return self._chunks[place]

    def _ask(self, begin: int, end: int, at: int) -> None:
        """Start fetching the piece of chunk ``begin..end`` at ``at`` (in the loop), once."""
        if at >= end or (begin, at) in self._pieces:
            return
        anyio.from_thread.run_sync(self._begin, begin, at, min(at + self._piece, end), token=self._token)

    def _begin(self, begin: int, at: int, stop: int) -> None:
        """In the loop: register the piece at ``at`` of the chunk at ``begin`` and start its
        fetch. Whatever ends the fetch (an answer, an error, the read called off) wakes the reader."""
        fetched, box = anyio.Event(), list[Any]()
        self._pieces[begin, at] = (fetched, box)

        async def get() -> None:
            try:
                box.append(await self._fetch(at, stop))
            except Exception as exc:  # noqa: BLE001 - raised in the reading thread
                box.append(exc)
            finally:
                if not box:
                    box.append(OSError(f"{self.url}: the read of bytes {at}..{stop} was called off"))
                fetched.set()

        self._start(get)

    def _piece_at(self, begin: int, end: int, at: int) -> tuple[int, bytes]:
        """The piece holding byte ``at`` of chunk ``begin..end`` (waited for), the next ones
        asked for, and this chunk's other pieces dropped: at most ``STREAM_AHEAD + 1`` each."""
        first = begin + (at - begin) // self._piece * self._piece
        for ahead in range(STREAM_AHEAD + 1):
            self._ask(begin, end, first + ahead * self._piece)
        fetched, box = self._pieces[begin, first]
        anyio.from_thread.run(fetched.wait, token=self._token)
        if isinstance(box[0], Exception):
            self.failed = box[0]  # raised through pyarrow, which may wrap it: decode_rows raises this
            raise box[0]
        last = first + STREAM_AHEAD * self._piece
        for key in [key for key in self._pieces if key[0] == begin and not first <= key[1] <= last]:
            del self._pieces[key]  # read past (pyarrow reads a chunk forward), or ahead of a read gone back
        self.held = sum(len(got[0]) for _, got in self._pieces.values() if got and isinstance(got[0], bytes))
        self.peak = max(self.peak, self.held)
        return first, box[0]

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._at + size)
        if end - self._at > self._piece and not self.warned:
            # pyarrow reads one piece at a time, unless a page is larger: it is read whole, and the
            # row group holds more than its reservation says (the footer does not give page sizes)
            self.warned = True
            message = (f"{self.url}: a page of {end - self._at} bytes, larger than the pieces of {self._piece} "
                       "bytes it is streamed in, is held whole (with its copy), past what the memory "
                       "budget reserved; write smaller pages (pyarrow: data_page_size= and a smaller "
                       "write_batch_size=) for streamed reads to stay within it")
            warnings.warn(message, RuntimeWarning, stacklevel=2)  # once: not logged as well
        out = []
        while self._at < end:
            begin, stop = self._chunk(self._at)
            first, data = self._piece_at(begin, stop, self._at)
            take = min(end, first + len(data)) - self._at
            if take <= 0:
                raise OSError(f"{self.url}: bytes {self._at}..{end} were not fetched")
            out.append(memoryview(data)[self._at - first:self._at - first + take])
            self._at += take
        return out[0] if len(out) == 1 else b"".join(out)  # type: ignore[return-value]


def decode_rows(ref: ParquetRef, meta: pq.FileMetaData, plan: RowGroupPlan,
                pieces: Sequence[tuple[int, bytes]] | StreamedFile, columns: Sequence[str] | None,
                batch_rows: int = BATCH_ROWS) -> Generator[list[dict[str, Any]], None, None]:
    """The rows of one row group as dicts (pyarrow's ``to_pylist``: binary as bytes, structs as
    dicts, lists as lists), ``batch_rows`` at a time, decoded from the fetched ``pieces`` (or
    from a ``StreamedFile``, which fetches them as they are read)."""
    parquet = pyarrow_parquet()
    import pyarrow as pa

    if isinstance(pieces, StreamedFile):
        source: io.RawIOBase = pieces
        options: dict[str, Any] = {"buffer_size": pieces._piece}  # read each chunk forward, piece by piece
    else:
        source, options = SparseFile(ref.url, ref.size, pieces), {}
    reader = parquet.ParquetFile(source, metadata=meta, pre_buffer=False, **options)
    try:
        for batch in reader.iter_batches(batch_size=batch_rows, row_groups=list(plan.groups),
                                         columns=None if columns is None else list(columns),
                                         use_threads=False):
            yield batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        if isinstance(source, StreamedFile) and source.failed is not None:
            raise source.failed from None  # a fetch failed (after its retries), not the decoding
        raise ParquetFormatError(f"{ref.url}: {plan.name} does not decode ({exc}); the file "
                                 "is corrupt", url=ref.url) from exc
    finally:
        reader.close()


def decode_table(ref: ParquetRef, meta: pq.FileMetaData, plan: RowGroupPlan,
                 pieces: Sequence[tuple[int, bytes]], columns: Sequence[str] | None) -> Any:
    """The rows of one unit of row groups as one Arrow table, decoded from the fetched ``pieces``
    (for a read that gives them in another order than stored)."""
    parquet = pyarrow_parquet()
    import pyarrow as pa

    reader = parquet.ParquetFile(SparseFile(ref.url, ref.size, pieces), metadata=meta, pre_buffer=False)
    try:
        return reader.read_row_groups(list(plan.groups), columns=None if columns is None else list(columns),
                                      use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ParquetFormatError(f"{ref.url}: {plan.name} does not decode ({exc}); the file "
                                 "is corrupt", url=ref.url) from exc
    finally:
        reader.close()


def row_nbytes(row: dict[str, Any]) -> int:
    """Bytes a row holds in its binary values (top level and one level down: an image column's
    ``{"bytes": ..., "path": ...}``), what the engine's byte budget counts."""
    total = 0
    for value in row.values():
        if isinstance(value, (bytes, bytearray, str)):
            total += len(value)
        elif isinstance(value, dict):
            for inner in value.values():  # a loop, not sum() over a generator: this runs per row
                if isinstance(inner, (bytes, bytearray, str)):
                    total += len(inner)
    return total


class RowGroupRead(NamedTuple):
    """What a row-group job needs besides the plan: the file, its parsed footer, the columns,
    how many ranged GETs of at most ``part_size`` bytes it keeps in flight, and whether it is
    read streamed (``StreamedFile``: pieces of ``part_size`` as pyarrow reads them)."""

    ref: ParquetRef
    meta: Any  # pq.FileMetaData
    columns: tuple[str, ...] | None
    part_size: int
    parts_inflight: int
    streamed: bool = False
    gets_inflight: int = 0  # ranged GETs at once through the store, all units together (0: no bound)


def row_group_job(read: RowGroupRead, plan: RowGroupPlan, position: int, assignment: ShardAssignment,
                  skip: Container[int] = frozenset(), on_error: str = "raise",
                  order: Sequence[int] | None = None) -> Job:
    """Read one unit of row groups: fetch its selected column chunks (ranged GETs of at most
    ``part_size`` bytes, ``parts_inflight`` at a time, every one pinned to the listed ETag), decode
    them in a worker thread, and emit ``((position, row), sample)`` for each row (numbered in the
    unit) the assignment keeps and ``skip`` does not hold, then ``((position, END),
    ShardEnd(rows))``: a unit is read as a shard is.

    ``order``: the rows to emit, in this order (a shuffled read; not for a streamed unit): the
    unit is decoded whole and converted at once (one ``to_pylist``: taking rows in another order
    first copied them twice).

    A sample: ``__key__`` (the file's key less ``.parquet``, a slash, the row's number in the
    file), ``__url__`` (the file's URL) and the selected columns' values."""
    ref = read.ref
    if order is not None and read.streamed:
        raise ValueError("a streamed row group is read in stored order")

    def changed(exc: ObjectChangedError) -> ObjectChangedError:
        # Not the store's own advice ("read it again, the next epoch"): this dataset's later epochs
        # read with the footers it read when it listed, so only a new dataset reads the new version.
        return ObjectChangedError(
            f"{ref.url} was overwritten after its footer was read (the version read, ETag "
            f"{ref.etag}, is gone): its row groups no longer lie where that footer said, and "
            "this dataset's later epochs read with the same footers, so they fail the same way. "
            "Build the dataset again (AsyncS3Dataset.from_parquet(...)) to read the new version, "
            "and avoid overwriting files that a running job reads", bucket=ref.bucket, key=ref.key)

    async def job(ctx: JobContext) -> None:
        pin = Pin(ref.etag)
        in_parts = getattr(ctx.store, "cache_in_parts", None)  # a disk cache: keep each range read
        if in_parts is not None:
            in_parts(ref.bucket, ref.key)

        async def get(start: int, end: int) -> bytes:
            return await call_with_retries(
                lambda: gated(ctx.store, read.gets_inflight,
                              lambda: ctx.store.get_range(ref.bucket, ref.key, start, end, pin=pin)),
                ctx.retry, on_retry=ctx.retried)

        if read.streamed:
            failed: Exception | None = None
            async with anyio.create_task_group() as fetching:  # the pieces asked for while decoding
                source = StreamedFile(ref.url, ref.size, plan.chunks, read.part_size, get,
                                      fetching.start_soon, anyio.lowlevel.current_token())
                try:
                    await emit_rows(ctx, source)
                except Exception as exc:  # noqa: BLE001 - raised below, outside the task group (unwrapped)
                    failed = exc
                finally:
                    fetching.cancel_scope.cancel()  # pieces fetched ahead of an ending read
            if isinstance(failed, ObjectChangedError):
                raise changed(failed) from failed
            if failed is not None:
                raise failed
            return
        fetched: dict[int, bytes] = {}

        async def fetch(start: int, end: int) -> None:
            fetched[start] = await get(start, end)

        parts = split_ranges(plan.ranges, read.part_size)
        try:
            await run_all([functools.partial(fetch, start, end) for start, end in parts], read.parts_inflight)
        except ObjectChangedError as exc:
            raise changed(exc) from exc
        pieces = sorted(fetched.items())  # each part its own piece: no copy joins them
        fetched.clear()
        if order is not None:
            await emit_in_order(ctx, pieces, order)
            return
        await emit_rows(ctx, pieces)

    async def emit_in_order(ctx: JobContext, pieces: list[tuple[int, bytes]], order: Sequence[int]) -> None:
        stem, url, first = ref.stem + "/", ref.url, plan.first
        try:
            table = await anyio.to_thread.run_sync(decode_table, ref, read.meta, plan, pieces, read.columns)
        except ParquetFormatError as exc:
            if on_error == "raise":
                raise
            say_skipped(f"skipping {plan.name} of {ref.url} (on_error={on_error!r}): {exc}", on_error, log)
            await ctx.emit(((position, END), ShardEnd(0, skipped=True)), 0)
            return
        pieces.clear()  # the table holds the rows now
        if table.num_rows != plan.rows:
            raise ParquetFormatError(f"{ref.url}: {plan.name} decoded {table.num_rows} rows, its footer "
                                     f"says {plan.rows}", url=ref.url)
        rows = await anyio.to_thread.run_sync(table.to_pylist)  # one conversion; the table then goes
        del table
        for index in order:
            if index not in skip:
                row = rows[index]
                rows[index] = None  # delivered: its bytes go with the consumer
                sample = {"__key__": f"{stem}{first + index}", "__url__": url, **row}
                await ctx.emit(((position, index), sample), row_nbytes(row))
        await ctx.emit(((position, END), ShardEnd(plan.rows, skipped=False)), 0)

    async def emit_rows(ctx: JobContext, pieces: Sequence[tuple[int, bytes]] | StreamedFile) -> None:
        rows = decode_rows(ref, read.meta, plan, pieces, read.columns)
        index = 0
        stem, url, first = ref.stem + "/", ref.url, plan.first  # once, not per row
        try:
            while True:
                batch = await anyio.to_thread.run_sync(next, rows, None)
                if batch is None:
                    break
                for row in batch:
                    if assignment.keeps(index) and index not in skip:
                        sample = {"__key__": f"{stem}{first + index}", "__url__": url, **row}
                        await ctx.emit(((position, index), sample), row_nbytes(row))
                    index += 1
        except ParquetFormatError as exc:
            if on_error == "raise":
                raise
            say_skipped(f"skipping the rest of {plan.name} of {ref.url} (on_error={on_error!r}): {exc}",
                        on_error, log)
            await ctx.emit(((position, END), ShardEnd(index, skipped=True)), 0)
            return
        finally:
            rows.close()
        if index != plan.rows:
            raise ParquetFormatError(f"{ref.url}: {plan.name} decoded {index} rows, its footer "
                                     f"says {plan.rows}", url=ref.url)
        await ctx.emit(((position, END), ShardEnd(index, skipped=False)), 0)

    # what the engine's budget counts; a job that fetches all before it emits may start while
    # the buffer is full, and ahead of its lane (engine/core.py); a streamed one fetches as it emits
    return Job(job, reserve=plan.streamed_need(read.part_size) if read.streamed else plan.need,
               reads_ahead=not read.streamed)
