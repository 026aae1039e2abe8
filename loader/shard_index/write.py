"""``loader index``: count the samples of tar shards other tools wrote, and write the index that
``from_shards`` finds beside them (so every rank reads the same number of samples).

Each shard is streamed once and grouped exactly as shard mode does; the index is rewritten as
shards finish, so an interrupted run resumes with the shards it lacks, and an entry is reused only
for the shard version it was made from. Where, format and resume: docs/design/shard-index.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import S3Config, resolve_config
from ..engine.fetch import EngineLimits, FetchEngine, JobContext, JobFn
from ..errors import ConfigError, NoSuchKeyError
from ..formats.compression import SHARD_SUFFIXES, is_shard_name
from ..formats.grouping import SampleGrouper
from ..formats.shards import DEFAULT_PART_SIZE, ShardOptions, ShardRef, read_members
from ..formats.tar import TarMember, TarStreamParser
from ..listing.inputs import list_prefix, resolve_shards, shard_specs
from ..listing.keylist import ListOptions
from ..retry import RetryPolicy, call_with_retries
from ..s3 import StoreFactory, open_store, resolve_backend
from ..s3.blocking import run_async, with_store
from ..s3.protocol import Pin
from ..uri import parse_s3_uri
from .counts import fetch_index, index_location
from .format import INDEX_NAME, IndexEntry, entry_document, index_document, parse_index

DEFAULT_CONCURRENCY = 8
DEFAULT_FLUSH_S = 10.0
PROGRESS_STEP = 8 << 20  # tar bytes between progress reports from a shard being read
ALONE = ListOptions(once_per_job=False)  # a command, not a rank of a job: no process group to ask (nor torch)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexOptions:
    """``out``: the index's URI (default: ``index.json`` in the shards' common folder).
    ``concurrency``: shards read at once, each as one stream (memory: about ``concurrency`` x
    (a 1 MiB chunk + the largest sample)). ``parts_inflight``: above 1, an uncompressed shard over
    two ``part_size`` is read as that many ranged GETs at once instead (for a few very large
    shards on a distant store; holds ``parts_inflight`` x ``part_size`` per shard).
    ``flush_s``: the index is rewritten at most this often while shards finish. ``force``: read
    every shard again, even those indexed. ``stop_after``: stop after this many shards (tests)."""

    out: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    parts_inflight: int = 1
    part_size: int = DEFAULT_PART_SIZE
    flush_s: float = DEFAULT_FLUSH_S
    force: bool = False
    stop_after: int | None = None

    def __post_init__(self) -> None:
        for name in ("concurrency", "parts_inflight", "part_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.out is not None:
            bucket, key = parse_s3_uri(self.out)
            if not key or key.endswith("/"):
                object.__setattr__(self, "out", f"s3://{bucket}/{key}{INDEX_NAME}")


@dataclasses.dataclass
class IndexReport:
    """What a run did; ``complete`` is False when it stopped before every shard was indexed."""

    index_url: str = ""
    shards: int = 0
    already: int = 0  # indexed by an earlier run and unchanged
    indexed: int = 0  # read by this run
    samples: int = 0  # in the shards of this run
    bytes_read: int = 0
    seconds: float = 0.0
    complete: bool = False


Progress = Callable[[IndexReport, int], Callable[[int, int], None]]
"""``progress(report, total_bytes)`` once the work is known; returns ``hook(nbytes, shards)``."""


def index_shards(
    shards: str | Sequence[str],
    options: IndexOptions | None = None,
    *,
    config: S3Config | None = None,
    store: str | StoreFactory | None = None,
    retry: RetryPolicy | None = None,
    progress: Progress | None = None,
) -> IndexReport:
    """Index ``shards`` (a brace pattern, a list of URIs/patterns, or a prefix)."""
    options = options or IndexOptions()
    retry = retry or RetryPolicy()
    started = time.perf_counter()
    if callable(store):
        factory: StoreFactory = store
    else:
        factory = functools.partial(open_store, resolve_backend(store), resolve_config(config),
                                    max_connections=4 * options.concurrency, retry=retry)
    refs = listed_shards(shard_specs(shards), factory, retry)
    uri = options.out or index_location(refs)
    if uri is None:
        raise ConfigError("these shards lie in several buckets: give --out s3://BUCKET/.../index.json "
                          "(and index= to from_shards)")
    report = IndexReport(index_url=uri, shards=len(refs))
    document, entries = _existing(uri, factory, retry)
    todo = [ref for ref in refs if options.force or not _current(entries.get(ref.url), ref)]
    report.already = len(refs) - len(todo)
    kept = {url: shard for url, shard in _raw_entries(document).items()
            if url not in {ref.url for ref in todo}}
    hook = progress(report, sum(ref.size or 0 for ref in todo)) if progress else (lambda n, s: None)
    writer = _Writer(uri, factory, retry, document, kept, options.flush_s)
    if not todo:
        report.complete = True
        return report
    engine = FetchEngine(
        [_index_job(ref, ShardOptions(part_size=options.part_size, parts_inflight=options.parts_inflight))
         for ref in todo], factory,
        limits=EngineLimits(max_inflight=options.concurrency, queue_items=4 * options.concurrency,
                            delivery="completed"),
        retry=retry, name="loader-index")
    try:
        for kind, value in engine:
            if kind == "bytes":
                report.bytes_read += value
                hook(value, 0)
                continue
            ref, entry, unreported = value
            writer.add(ref.url, entry)
            report.bytes_read += unreported
            report.indexed += 1
            report.samples += entry["samples"]
            hook(unreported, 1)
            if options.stop_after is not None and report.indexed >= options.stop_after:
                break
        report.complete = report.indexed == len(todo)
    finally:
        engine.close()
        if writer.dirty:
            writer.write()  # what was indexed stays indexed, whatever stopped the run
        report.seconds = time.perf_counter() - started
    return report


def listed_shards(specs: list[str], factory: StoreFactory, retry: RetryPolicy) -> list[ShardRef]:
    """``specs`` as shards with their size and ETag: prefixes are listed, and named shards are
    found in one listing of what their keys have in common (a missing one is an error)."""
    named: dict[str, list[str]] = {}
    prefixes: list[str] = []
    for uri in specs:
        bucket, key = parse_s3_uri(uri)
        if is_shard_name(key):
            named.setdefault(bucket, []).append(key)
        else:
            prefixes.append(uri)
    found: dict[str, ShardRef] = {}
    for bucket, keys in named.items():
        common = _common_prefix(keys)
        listing = list_prefix(f"s3://{bucket}/{common}", factory=factory, retry=retry, suffix=SHARD_SUFFIXES,
                              options=ALONE)
        infos = {info.key: info for info in listing.infos()}
        for key in keys:
            info = infos.get(key)
            if info is None:
                raise NoSuchKeyError(f"shard s3://{bucket}/{key} does not exist (it is not in the "
                                     f"listing of s3://{bucket}/{common})", bucket=bucket, key=key)
            found[f"s3://{bucket}/{key}"] = ShardRef(bucket, key, info.size, info.etag)
    listed = resolve_shards(prefixes, factory=factory, retry=retry, options=ALONE) if prefixes else []
    out: dict[str, ShardRef] = {}  # each shard once, named ones first
    for ref in [*found.values(), *listed]:
        out.setdefault(ref.url, ref)
    return list(out.values())


def _common_prefix(keys: list[str]) -> str:
    first, last = min(keys), max(keys)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _existing(uri: str, factory: StoreFactory, retry: RetryPolicy) -> tuple[dict[str, Any] | None,
                                                                         dict[str, IndexEntry]]:
    """The index already at ``uri`` (None) and its entries; refuses to replace another file."""
    document, why = fetch_index(uri, factory, retry)
    if document is None and not why.startswith("no "):
        raise ConfigError(f"{why}; it is left alone: give --out another place for the index")
    return document, ({} if document is None else parse_index(document, uri))


def _raw_entries(document: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {shard["url"]: shard for shard in (document or {}).get("shards", ())}


def _current(entry: IndexEntry | None, ref: ShardRef) -> bool:
    """Whether ``entry`` was made from the version of the shard listed as ``ref``."""
    if entry is None:
        return False
    if ref.etag is not None:
        return entry.etag == ref.etag  # an entry without an ETag is read again to record one
    return entry.size is not None and entry.size == ref.size


def _index_job(shard: ShardRef, options: ShardOptions) -> JobFn:
    """Read one shard to its end: emit ``("bytes", n)`` as it goes, then ``("done", (shard,
    entry, bytes not yet reported))``. The read is pinned to the listed version."""

    async def job(ctx: JobContext) -> None:
        grouper = SampleGrouper(shard.url)
        parser = TarStreamParser(shard.url)
        offsets: list[int] = []
        reported = 0

        async def on_member(member: TarMember) -> None:
            nonlocal reported
            before = grouper.pending_offset
            grouper.add(member)
            if grouper.pending_offset is not None and grouper.pending_offset != before:
                offsets.append(grouper.pending_offset)  # a new sample starts with this member
            if shard.compression is None and parser.offset - reported >= PROGRESS_STEP:
                await ctx.emit(("bytes", parser.offset - reported), 0)
                reported = parser.offset

        pin = Pin(shard.etag)
        await read_members(ctx, shard, options, on_member, parser, pin=pin)
        size = shard.size if shard.size is not None else parser.offset
        entry = entry_document(shard.url, shard.key, samples=len(offsets), size=size, etag=pin.etag,
                               tar_bytes=parser.offset,
                               offsets=offsets if shard.compression is None else None)
        await ctx.emit(("done", (shard, entry, size - reported)), 8 * len(offsets))

    return job


class _Writer:
    """The index as it grows: written every ``flush_s`` seconds as shards finish, and at the end."""

    def __init__(self, uri: str, factory: StoreFactory, retry: RetryPolicy,
                 base: dict[str, Any] | None, entries: dict[str, dict[str, Any]], flush_s: float) -> None:
        self.bucket, self.key = parse_s3_uri(uri)
        self.factory, self.retry = factory, retry
        self.base, self.entries = base, dict(entries)
        self.flush_s = flush_s
        self.written = time.monotonic()
        self.dirty = False

    def add(self, url: str, entry: dict[str, Any]) -> None:
        self.entries[url] = entry
        self.dirty = True
        if time.monotonic() - self.written >= self.flush_s:
            self.write()

    def write(self) -> None:
        data = json.dumps(index_document(self.entries.values(), self.base), separators=(",", ":")).encode()

        async def put(store: Any) -> None:
            await call_with_retries(lambda: store.put(self.bucket, self.key, data), self.retry)

        run_async(functools.partial(with_store, self.factory, put))
        self.written, self.dirty = time.monotonic(), False
