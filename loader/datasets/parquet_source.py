"""``ParquetSource``: rows of Parquet files, read row group by row group straight from S3.

The files come from brace patterns, URI lists or prefixes (every ``.parquet`` under them).
They are listed and their footers read (one ranged GET of each file's tail) once per job, as a
key list is: in a ``torch.distributed`` job rank 0 lists and reads the footers, and the files
with their footers travel to the other ranks packed as one shared list (``sharing.once_per_job``:
once per machine through the job's store, one mapped file per machine); a plain process reads
them itself. Either happens before any DataLoader worker starts, and the result travels with
the dataset into the workers. The footers' row counts make every row group a unit whose sample
count is known, so a row group is dealt, shuffled, cycled, resumed and mixed exactly as a tar
shard with a known count is: this source is a ``ShardSource`` whose units are row groups and
whose reads are ``formats.parquet.row_group_job``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import posixpath
import struct
import warnings
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ..engine.fetch import Delivery, EngineLimits, Job
from ..errors import ConfigError, EmptyDatasetError, NoSuchKeyError, ParquetFormatError
from ..formats.parquet import (
    PARQUET_SUFFIX,
    RANGE_BYTES,
    STREAM_AHEAD,
    Footer,
    ParquetRef,
    RowGroupPlan,
    RowGroupRead,
    class_label_names,
    coalesce,
    parse_footer,
    plan_row_groups,
    pyarrow_parquet,
    read_footer,
    row_group_job,
    run_all,
)
from ..formats.shards import ShardAssignment, ShardOptions, ShardRef
from ..listing.inputs import list_prefix
from ..listing.keylist import KeyList, ListOptions
from ..listing.sharing import once_per_job, raise_if_failed_before_fork, ticket, track
from ..listing.versions import Versions, versions_of
from ..retry import RetryPolicy
from ..s3 import ObjectStore, StoreFactory
from ..s3.blocking import run_async, with_store
from ..uri import expand_braces, parse_s3_uri
from . import lanes
from .options import Options
from .shard_source import ShardSource

FOOTERS_INFLIGHT = 16  # footers fetched at once while resolving
SHUFFLED_UNIT_BYTES = 8 << 20
SHUFFLED_UNITS = 256
"""Shuffled, units of row groups hold at most ``SHUFFLED_UNIT_BYTES`` and a ``SHUFFLED_UNITS``-th
of the rows (a row group is never cut): a lane mixes its open units, so more, smaller units mix a
sorted file better (the Hub's 100-row image groups stay one each)."""

log = logging.getLogger(__name__)


def parquet_specs(spec: str | Iterable[str]) -> list[str]:
    """Brace patterns expanded: URIs of files (ending in ``.parquet``) or of prefixes."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise EmptyDatasetError("the Parquet file list is empty")
    out: list[str] = []
    for item in specs:
        if not isinstance(item, str):
            raise ConfigError(f"Parquet file {item!r} is not an s3:// URI string")
        out.extend(expand_braces(item))
    for uri in out:
        parse_s3_uri(uri)  # fail now, with the URI named
    return out


def resolve_files(specs: Sequence[str], *, factory: StoreFactory, retry: RetryPolicy,
                  options: ListOptions, ticket: int) -> list[ParquetRef]:
    """The files ``specs`` name, each with its size and ETag from a listing: a prefix is listed
    for its ``.parquet`` objects; a file's folder is listed once for all files named in it."""
    files: list[ParquetRef] = []
    folders: dict[tuple[str, str], dict[str, tuple[int, str | None]]] = {}
    for uri in specs:
        bucket, key = parse_s3_uri(uri)
        if key.endswith(PARQUET_SUFFIX):
            folder = posixpath.dirname(key)
            folder = folder + "/" if folder else ""
            if (bucket, folder) not in folders:
                found = list_prefix(f"s3://{bucket}/{folder}", factory=factory, retry=retry,
                                    suffix=PARQUET_SUFFIX, options=options, ticket=ticket)
                folders[(bucket, folder)] = {info.key: (info.size, info.etag) for info in found.infos()}
            listed = folders[(bucket, folder)].get(key)
            if listed is None:
                raise NoSuchKeyError(f"s3://{bucket}/{key} does not exist (the listing of "
                                     f"s3://{bucket}/{folder} has no such key)", bucket=bucket, key=key)
            files.append(ParquetRef(bucket, key, *listed))
        else:
            found = list_prefix(uri, factory=factory, retry=retry, suffix=PARQUET_SUFFIX,
                                options=options, ticket=ticket)
            files.extend(ParquetRef(bucket, info.key, info.size, info.etag) for info in found.infos())
    return files


def read_footers_or_errors(files: Sequence[ParquetRef], factory: StoreFactory,
                           retry: RetryPolicy) -> list[Footer | ParquetFormatError]:
    """Every file's footer, or the ``ParquetFormatError`` that says why it does not read (a
    truncated or corrupt file; one whose footer does not parse too), in the files' order."""

    async def use(store: ObjectStore) -> list[Footer | ParquetFormatError]:
        out: list[Footer | ParquetFormatError | None] = [None] * len(files)

        async def one(number: int) -> None:
            try:
                footer = await read_footer(store, files[number], retry)
                parse_footer(files[number], footer)  # a footer that does not decode fails here, named
                out[number] = footer
            except ParquetFormatError as exc:
                out[number] = exc

        await run_all([functools.partial(one, number) for number in range(len(files))], FOOTERS_INFLIGHT)
        return [footer for footer in out if footer is not None]

    return run_async(functools.partial(with_store, factory, use))


def without_unreadable(files: Sequence[ParquetRef], footers: Sequence[Footer | ParquetFormatError],
                       on_error: str) -> tuple[list[ParquetRef], list[Footer]]:
    """``on_error="skip"``/``"warn"``: the files whose footers read, the others left out, each
    said once (a warning for ``"warn"``, a log line for ``"skip"``); ``"raise"``: the first
    error."""
    kept: list[ParquetRef] = []
    read: list[Footer] = []
    for ref, footer in zip(files, footers, strict=True):
        if isinstance(footer, Footer):
            kept.append(ref)
            read.append(footer)
            continue
        if on_error == "raise":
            raise footer
        message = f"skipping {ref.url} (on_error={on_error!r}): {footer}"
        if on_error == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        else:
            log.warning(message)
    return kept, read


# One file's entry in the shared list: footer start, then the lengths of bucket, key and ETag
# (NO_ETAG: none listed), then those and the footer's bytes; the file's size is the entry's size.
# Framed by hand: the list is a keyfile mapped by every process of a machine, so it holds plain
# bytes (no pickle from a shared directory), and these are the only fields a file needs.
_RECORD = struct.Struct("<qIII")
NO_ETAG = 0xFFFFFFFF


def pack_footers(files: Sequence[ParquetRef], footers: Sequence[Footer]) -> KeyList:
    """The files and their footers as one ``KeyList`` of records, what a job shares."""
    records = []
    for ref, footer in zip(files, footers, strict=True):
        bucket, key = ref.bucket.encode(), ref.key.encode("utf-8", "surrogatepass")
        etag = b"" if ref.etag is None else ref.etag.encode("utf-8", "surrogatepass")
        head = _RECORD.pack(footer.start, len(bucket), len(key), NO_ETAG if ref.etag is None else len(etag))
        records.append(b"".join((head, bucket, key, etag, footer.data)))
    return KeyList.from_records(records, [ref.size for ref in files])


def unpack_footers(packed: KeyList) -> tuple[list[ParquetRef], list[Footer]]:
    """``pack_footers`` undone: the files and their footers, in order."""
    files, footers = [], []
    for number in range(len(packed)):
        record = packed.record(number)
        start, buckets, keys, etags = _RECORD.unpack_from(record)
        at = _RECORD.size
        bucket = record[at:at + buckets].decode()
        at += buckets
        key = record[at:at + keys].decode("utf-8", "surrogatepass")
        at += keys
        etag = None
        if etags != NO_ETAG:
            etag = record[at:at + etags].decode("utf-8", "surrogatepass")
            at += etags
        files.append(ParquetRef(bucket, key, packed.size(number), etag))
        footers.append(Footer(start, record[at:]))
    return files, footers


class ParquetSource(ShardSource):
    """Rows of Parquet files, ``columns`` selected (None: all), dealt by row group."""

    kind = "parquet"
    unit_name = "row groups"

    def __init__(self, files: str | Iterable[str], options: Options, *,
                 columns: Sequence[str] | None = None,
                 shard_options: ShardOptions | None = None, inflight_per_rank: bool = False) -> None:
        # Not ShardSource.__init__: no tar index or sample counts; what its methods use is set here.
        pyarrow_parquet()  # a missing extra fails here, not in a worker
        self.options = options
        self.shard_options = shard_options or ShardOptions()
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) and c for c in columns):
                raise ConfigError(f"columns={columns!r} must be a list of column names")
            columns = tuple(columns)
            if not columns:
                raise ConfigError("columns=[] selects nothing; give column names, or None for all")
        self.columns: tuple[str, ...] | None = columns
        self._inflight_per_rank = inflight_per_rank
        self._given: str | list[str] = files if isinstance(files, str) else list(files)
        self._specs = parquet_specs(self._given)
        self._listing_ticket = ticket(repr(("parquet", self._specs)))
        self._shared: KeyList | None = None  # the files and footers as the job shares them
        self._files: list[ParquetRef] | None = None  # unpacked from ``_shared``, per process
        self._footers: list[Footer] | None = None
        self._plans: list[RowGroupPlan] | None = None
        self._metas: dict[int, Any] = {}  # parsed footers, per process (not pickled)
        if options.batch_size is not None and self.shard_options.shuffle_buffer:
            raise ConfigError(f"shuffle_buffer={self.shard_options.shuffle_buffer!r} cannot be used with "
                              "batch_size=: blocks of the epoch's order are read in order; drop "
                              "shuffle_buffer= (the row-group order is still shuffled every epoch)")
        if self.shard_options.samples_per_epoch is not None and not options.limits.ordered:
            raise ConfigError("samples_per_epoch= reads its passes in order, so ordered=False cannot "
                              "apply; drop it")
        options.preload_backend()
        track(self)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_metas"] = {}  # pyarrow's metadata objects are parsed again from the footer bytes
        if state["_shared"] is not None:  # travels as the shared list (into a spawned worker: its file)
            state["_files"] = state["_footers"] = None
        return state

    # ------------------------------------------------------------------ what is read

    def files(self) -> list[ParquetRef]:
        """The Parquet files, listed now if not yet."""
        self.plans()
        return self._unpacked()[0]

    def _unpacked(self) -> tuple[list[ParquetRef], list[Footer]]:
        if self._files is None or self._footers is None:
            assert self._shared is not None
            self._files, self._footers = unpack_footers(self._shared)
        return self._files, self._footers

    def plans(self) -> list[RowGroupPlan]:
        """Every row group holding rows, in file order: list, read the footers, plan (once)."""
        if self._plans is None:
            raise_if_failed_before_fork(self)
            shared = self._files_and_footers()
            files, footers = unpack_footers(shared)
            groups: list[RowGroupPlan] = []
            for number, (ref, footer) in enumerate(zip(files, footers)):
                meta = self._metas[number] = parse_footer(ref, footer)
                groups.extend(plan for plan in plan_row_groups(ref, number, meta, footer, self.columns) if plan.rows)
            # Shuffled, units hold at most 1/SHUFFLED_UNITS of the rows (row groups allowing):
            # enough units for every lane to mix many, whatever the number of workers.
            most_rows = max(1, sum(g.rows for g in groups) // SHUFFLED_UNITS) if self.options.shuffle else None
            plans = coalesce(groups, self._unit_bytes(), self._unit_need(), max_rows=most_rows)
            if not plans:
                raise EmptyDatasetError(f"{len(files)} Parquet file(s) under {self._specs[:2]} hold no rows")
            self._check_budget(files, plans)
            self._shared, self._files, self._footers, self._plans = shared, files, footers, plans
        return self._plans

    def _files_and_footers(self) -> KeyList:
        """List the files and read their footers, once per job (``sharing.once_per_job``): the
        other ranks receive both, so a job makes one listing's LIST requests and one footer GET
        per file, however many ranks it has."""
        listing = self.options.store.listing

        def produce() -> KeyList:
            alone = dataclasses.replace(listing, once_per_job=False)  # shared below, with the footers
            files = resolve_files(self._specs, factory=self.options.listing_factory(), retry=self.options.store.retry,
                                  options=alone, ticket=self._listing_ticket)
            footers = read_footers_or_errors(files, self.options.listing_factory(), self.options.store.retry)
            return pack_footers(*without_unreadable(files, footers, self.options.on_error))

        if not listing.once_per_job:
            return produce()
        return once_per_job(f"parquet-footers|{self._specs!r}", produce, self._listing_ticket)

    def _check_budget(self, files: Sequence[ParquetRef], plans: Sequence[RowGroupPlan]) -> None:
        """A row group that needs more than the budget leaves for reads cannot be read within it:
        say which, what it needs, and what would help."""
        reads = self.read_bytes()
        if reads is None:
            return
        piece = self._piece()
        largest = max(plans, key=self._need)
        if self._need(largest) > reads:  # only a streamed one can: one that fits whole is not streamed
            raise ConfigError(
                f"{largest.name} of {files[largest.file].url} needs {largest.need} bytes to read whole "
                f"({largest.fetched} bytes of column chunks for columns {self.columns or 'all'}, plus a "
                f"decoded batch), and {largest.streamed_need(piece)} read streamed (each of its "
                f"{len(largest.chunks)} column chunks in pieces of {piece} bytes, "
                f"{STREAM_AHEAD + 2} held at once), more than Limits(memory={self.options.limits.memory}) "
                f"leaves for reads ({reads} bytes); raise the memory limit, select fewer columns, give "
                "Reading(part_size=) smaller pieces, or write smaller row groups")

    def _unit_bytes(self) -> int:
        """Fetched bytes a unit of row groups holds at most: ``part_size``, and when shuffling
        ``SHUFFLED_UNIT_BYTES`` (smaller units, more of them to mix in each lane)."""
        part = self.shard_options.part_size
        return min(part, SHUFFLED_UNIT_BYTES) if self.options.shuffle else part

    def _piece(self) -> int:
        """Bytes of one ranged GET of a unit (and of a piece of a streamed row group)."""
        return min(self.shard_options.part_size, RANGE_BYTES)

    def _need(self, plan: RowGroupPlan) -> int:
        """What ``plan`` holds while it is read, whole or streamed (the engine's reservation)."""
        return plan.streamed_need(self._piece()) if self._streams(plan) else plan.need

    def _streams(self, plan: RowGroupPlan) -> bool:
        """Whether ``plan`` is read streamed: only a row group that does not fit whole in what the
        memory budget leaves for reads is (streaming fetches in smaller, later pieces: slower)."""
        reads = self.read_bytes()
        return reads is not None and plan.need > reads

    def _unit_need(self) -> int | None:
        """What a unit of several row groups may need: its share of ``read_bytes()``, so that
        ``row_groups_inflight`` units fit in the budget at once (None: no budget)."""
        reads = self.read_bytes()
        return None if reads is None else reads // self.shard_options.shards_inflight

    def read_bytes(self) -> int | None:
        """What ``memory_budget`` leaves for row groups being read (None: no budget)."""
        budget = self.options.limits.memory
        if budget is None:
            return None
        shuffle = (self.shard_options.shuffle_bytes or 0) if self.options.shuffle else 0
        return budget - self.options.queue_bytes - shuffle

    def meta(self, number: int) -> Any:
        """File ``number``'s parsed footer (parsed once per process)."""
        meta = self._metas.get(number)
        if meta is None:
            files, footers = self._unpacked()
            meta = self._metas[number] = parse_footer(files[number], footers[number])
        return meta

    @property
    def classes(self) -> list[str] | None:
        """Class names by index from a Hugging Face ``ClassLabel`` column (the first file's
        ``huggingface`` metadata); None without one. Lists and reads the footers if not yet."""
        self.plans()
        return class_label_names(self.meta(0).metadata, self.columns)

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        names = self.classes
        return None if names is None else {name: i for i, name in enumerate(names)}

    def shards(self) -> list[ShardRef]:
        """The Parquet files (as ``ShardRef``s: bucket, key, size, ETag)."""
        return [ShardRef(*ref) for ref in self.files()]

    def shard_counts(self) -> list[int]:
        """Rows per file, in ``shards()`` order."""
        rows = [0] * len(self.files())
        for plan in self.plans():
            rows[plan.file] += plan.rows
        return rows

    def unit_counts(self) -> list[int]:
        return [plan.rows for plan in self.plans()]

    def counts(self) -> None:
        return None  # no tar index: the footers give the counts

    # ------------------------------------------------------------------ the Source protocol

    def resolve(self) -> None:
        self.plans()

    def size(self) -> int:
        return len(self.plans())

    def count(self) -> int:
        return sum(self.unit_counts())

    def missing_count(self) -> str:
        return ""

    def skipped(self, url: str, key: str | None) -> str:
        return f"row {key!r} of {url}, going on with the rest of the row group"

    def job(self, assignment: ShardAssignment, position: int, *, skip: Container[int] = frozenset(),
            offsets: bool = True, order: Sequence[int] | None = None) -> Job:
        plan = self.plans()[assignment.shard]
        # shuffled, many units are open at once: their GETs no more at once than a rank's unshuffled
        # units' (each one a new connection otherwise: s3/request_gate.py), in each worker (its own
        # pool: a share per worker cost 0.8x the rate at w=2 over https, bench/results/aws-2026-11-28-f.md)
        options = self.shard_options
        gets = options.shards_inflight * options.parts_inflight if self.options.shuffle else 0
        read = RowGroupRead(self.files()[plan.file], self.meta(plan.file), self.columns,
                            self._piece(), self.shard_options.parts_inflight, self._streams(plan), gets)
        return row_group_job(read, plan, position, assignment, skip=skip, on_error=self.options.on_error,
                             order=order)

    def reserve(self, assignment: ShardAssignment) -> int:
        return self._need(self.plans()[assignment.shard])

    # ------------------------------------------------------------------ shuffled: lanes of units

    def piece_sizes(self, counts: list[int], lanes_count: int, lane_samples: int) -> list[int]:
        """A unit is cut only where a lane's length needs it (each piece of it fetches the same
        column chunks again), or where there are too few units for every lane to mix
        ``lanes.MIN_MIXING`` of them (a small data set): then every lane gets a piece of each
        (a random share of its rows), and each unit is fetched once per lane."""
        if len(counts) >= lanes.MIN_MIXING * lanes_count:
            return list(counts)
        return [max(1, -(-count // lanes_count)) for count in counts]

    def permuted(self, unit: int) -> bool:
        """A unit decoded whole gives its rows permuted; a streamed one (too large for the budget
        to hold whole) in stored order."""
        return not self._streams(self.plans()[unit])

    def open_count(self) -> int:
        """Units a lane reads at once: ``lanes.OPEN_PIECES``, fewer where what the memory budget
        leaves for reads cannot hold that many of the largest (each is held until its last row
        is delivered)."""
        reads = self.read_bytes()
        if reads is None:
            return lanes.OPEN_PIECES
        largest = max(self._need(plan) for plan in self.plans())
        return max(2, min(lanes.OPEN_PIECES, reads // max(1, largest)))

    def lane_job(self, unit: int, position: int, indices: list[int], skip: Container[int]) -> Job:
        first, stop = min(indices), max(indices) + 1
        assignment = ShardAssignment(unit, 1, 0, first, stop, lanes.ranges_of(indices))
        return self.job(assignment, position, skip=skip, order=indices if self.permuted(unit) else None)

    def lane_reserve(self, unit: int) -> int:
        return self._need(self.plans()[unit])  # held decoded until its last row is delivered

    def lane_limits(self) -> EngineLimits:
        return self.options.engine_limits("scheduled", max_inflight=self.open_count() + 2,
                                   inflight_bytes=self.read_bytes())

    def inflight(self) -> int:
        """Units this process delivers side by side: ``row_groups_inflight`` (the engine reads as
        many again ahead, engine/core.py); when it was not given, its default is per rank, shared
        among the rank's DataLoader workers (at least one each).

        Why: units are large (up to 32 MiB), so a few per rank keep the server busy; four in every
        worker made two workers on two shared cores spend ~1.5x the client CPU per row (the
        bytes of eight units churning through memory at once) and reach the first sample later
        (bench/results/parquet-workers-2026-11-27.md)."""
        count = self.shard_options.shards_inflight
        if self._inflight_per_rank:
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            if info is not None:
                count = max(1, count // info.num_workers)
        return count

    def limits(self, delivery: Delivery) -> EngineLimits:
        return self.options.engine_limits(delivery, max_inflight=self.inflight(), inflight_bytes=self.read_bytes())

    def versions(self) -> Versions | None:
        return versions_of(self.shards())

    def describe(self) -> str:
        if self._plans is not None and self._shared is not None:
            return f"{len(self._plans)} row groups in {len(self._shared)} Parquet files"
        return f"Parquet files {self._specs[:2]}"
