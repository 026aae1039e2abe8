"""``loader shard``: pack the objects under a prefix into WebDataset tar shards, resumably.

The I/O half of packing (the plan is ``formats/packing.py``): members fetched in order, shards
streamed up as multipart uploads ``concurrency`` at a time, memory about ``concurrency *
(part_size + readahead)`` whatever the shard size. ``_progress.json`` records the plan's
fingerprint and the finished shards, so a rerun writes only the rest (docs/design/packing.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ..checks import check_int
from ..config import S3Config
from ..engine.fetch import first_error
from ..errors import ConfigError, LoaderError, StoreError
from ..formats.compression import Compression, Encoder, open_encoder
from ..formats.packing import (
    PROGRESS_NAME,
    Member,
    ShardPlan,
    Skipped,
    check_name_format,
    default_name_format,
    encode_member,
    end_of_archive,
    group_samples,
    parse_progress,
    part_size_for,
    plan_fingerprint,
    plan_shards,
    progress_document,
    shuffle_samples,
)
from ..listing.inputs import list_objects
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectStore, StoreFactory, StoreSpec
from ..s3.blocking import run_async
from ..s3.protocol import S3_MIN_PART_SIZE, MultipartStore
from ..shard_index.format import INDEX_NAME, add_versions, build_index
from ..uri import parse_s3_uri
from .sizes import format_size

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

DEFAULT_TARGET_SIZE = 256 * 10**6
DEFAULT_CONCURRENCY = 8
DEFAULT_MAX_INFLIGHT = 64
DEFAULT_PART_SIZE = 16 << 20
DEFAULT_READAHEAD = 16 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackOptions:
    """How to pack; the first five decide the shards' bytes (and so the plan's fingerprint).

    ``target_size``: tar bytes per shard (a sample is never split, so one larger sample makes
    one larger shard). ``name_format``: shard names under DST, formatted with the shard number
    (default ``shard-{:05d}.tar``, ``.tar.gz``/``.tar.zst`` when compressed). ``compress``:
    ``"gzip"`` or ``"zstd"`` to compress each shard as it streams up (None: plain tar).
    ``shuffle``/``seed``: pack samples in a seeded random order instead of key order.
    ``skip_invalid``: leave out objects that cannot be WebDataset members instead of failing.
    ``concurrency``: shards built and uploaded at once. ``max_inflight``: source GETs in flight
    in all. ``part_size``: multipart part size (at least 5 MiB on S3). ``readahead``: bytes of
    members fetched ahead of the tar writer per shard. ``overwrite``: ignore an earlier run's
    progress and existing shards and repack everything. ``stop_after``: stop after this many
    shards were written (for tests of resuming).
    """

    target_size: int = DEFAULT_TARGET_SIZE
    name_format: str | None = None
    compress: Compression | None = None
    shuffle: bool = False
    seed: int = 0
    skip_invalid: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    part_size: int = DEFAULT_PART_SIZE
    readahead: int = DEFAULT_READAHEAD
    overwrite: bool = False
    stop_after: int | None = None

    def __post_init__(self) -> None:
        for name in ("target_size", "concurrency", "max_inflight", "part_size", "readahead"):
            check_int(name, getattr(self, name), minimum=1, must="a positive integer")
        check_int("stop_after", self.stop_after, minimum=1, optional=True, must="a positive integer")
        if self.compress not in (None, "gzip", "zstd"):
            raise ConfigError(f"compress={self.compress!r} must be 'gzip', 'zstd' or None")
        if self.compress is not None:
            open_encoder(self.compress)  # a missing zstd library fails here, before any I/O
        name_format = self.name_format or default_name_format(self.compress)
        object.__setattr__(self, "name_format", name_format)
        check_name_format(name_format, self.compress)

    def plan_options(self) -> dict[str, Any]:
        """The options that decide what the shards hold (part of the fingerprint)."""
        return {"target_size": self.target_size, "name_format": self.name_format,
                **({"compress": self.compress} if self.compress else {}),
                "shuffle": self.shuffle, "seed": self.seed if self.shuffle else None,
                "skip_invalid": self.skip_invalid}


@dataclasses.dataclass
class PackReport:
    """What a ``pack`` run did. ``complete`` is False when it stopped early (``stop_after``)."""

    source: str
    destination: str
    index_url: str
    shards: int = 0
    written: int = 0
    resumed: int = 0
    samples: int = 0
    objects: int = 0
    source_bytes: int = 0
    shard_bytes: int = 0
    seconds: float = 0.0
    complete: bool = False
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    stray: list[str] = dataclasses.field(default_factory=list)
    first_shard: str = ""
    last_shard: str = ""


ProgressHook = Callable[[int, int], None]  # (source bytes, objects) packed since the last call


def pack(
    src: str,
    dst: str,
    options: PackOptions | None = None,
    *,
    config: S3Config | None = None,
    store: str | StoreFactory | None = None,
    retry: RetryPolicy | None = None,
    progress: Callable[[PackReport, int, int], ProgressHook] | None = None,
) -> PackReport:
    """Pack every object under ``src`` into tar shards under ``dst``; see docs/design/packing.md.

    ``store`` is a backend name (default: ``$LOADER_STORE`` or aioboto3) or an async factory
    returning an ``ObjectStore``. ``progress(report, total_bytes, total_objects)``, when given,
    is called once the plan is known and returns a hook called with each packed object's bytes.
    """
    options = options or PackOptions()
    retry = retry or RetryPolicy()
    src_bucket, src_prefix = parse_s3_uri(src)
    dst_bucket, dst_prefix = parse_s3_uri(dst)
    if dst_prefix and not dst_prefix.endswith("/"):
        dst_prefix += "/"
    if src_bucket == dst_bucket and dst_prefix in (src_prefix, src_prefix + "/"):
        raise ConfigError(
            f"DST_PREFIX s3://{dst_bucket}/{dst_prefix} is the folder of SRC_PREFIX s3://{src_bucket}/"
            f"{src_prefix}, so the shards would mix with the objects they hold; choose another folder "
            "(one inside the source is fine: what lies under DST_PREFIX is left out of the source)"
        )
    factory = StoreSpec.of(store, config).opener(
        max_connections=options.max_inflight + options.concurrency, retry=retry)
    packer = _Packer(src_bucket, src_prefix, dst_bucket, dst_prefix, options, retry, progress)
    return run_async(functools.partial(packer.run, factory))


class _Packer:
    """One run of ``pack`` inside its event loop."""

    def __init__(self, src_bucket: str, src_prefix: str, dst_bucket: str, dst_prefix: str,
                 options: PackOptions, retry: RetryPolicy,
                 progress: Callable[[PackReport, int, int], ProgressHook] | None) -> None:
        self.src_bucket, self.src_prefix = src_bucket, src_prefix
        self.bucket, self.prefix = dst_bucket, dst_prefix
        self.dst_in_src = src_bucket == dst_bucket and dst_prefix.startswith(src_prefix)  # left out of SRC
        self.options = options
        self.retry = retry
        self.make_progress = progress
        self.hook: ProgressHook = lambda nbytes, objects: None
        self.report = PackReport(source=f"s3://{src_bucket}/{src_prefix}",
                                 destination=f"s3://{dst_bucket}/{dst_prefix}",
                                 index_url=f"s3://{dst_bucket}/{dst_prefix}{INDEX_NAME}")
        self.done: set[int] = set()
        self.written_progress: set[int] = set()
        self.progress_lock = anyio.Lock()
        self.store: ObjectStore  # opened by run()
        self.gets = anyio.CapacityLimiter(options.max_inflight)
        self.stored: dict[int, int] = {}  # shard number -> object size (compressed shards)

    async def run(self, factory: StoreFactory) -> PackReport:
        started = time.perf_counter()
        self.store = await factory()
        try:
            await self._run()
        except BaseExceptionGroup as group:  # task groups wrap; callers want our error itself
            raise first_error(group) from None
        finally:
            await self.store.aclose()
            self.report.seconds = time.perf_counter() - started
        return self.report

    async def _run(self) -> None:
        options, report = self.options, self.report
        # DST first: a missing bucket or permission fails before a long listing of SRC
        existing = await self._list(self.bucket, self.prefix)
        listing = await list_objects(self.store, self.src_bucket, self.src_prefix, self.retry)
        objects = [(info.key, info.size) for info in listing.infos()
                   if not (self.dst_in_src and info.key.startswith(self.prefix))]
        samples, skipped = group_samples(objects, self.src_prefix)
        report.skipped = skipped
        if skipped and not options.skip_invalid:
            first = skipped[0]
            raise ConfigError(
                f"{len(skipped)} object(s) under {report.source} cannot be WebDataset members, e.g. "
                f"s3://{self.src_bucket}/{first.key}: {first.reason}; rename or remove them, or pass "
                "--skip-invalid to leave them out"
            )
        if not samples:
            raise ConfigError(f"none of the {len(objects)} object(s) under {report.source} can be a "
                              "WebDataset member (each needs a name like key.ext)")
        if options.shuffle:
            samples = shuffle_samples(samples, options.seed)
        plans = plan_shards(samples, options.target_size)
        name_format = options.name_format
        assert name_format is not None  # PackOptions gave the default
        self.names = [self.prefix + name_format.format(p.number) for p in plans]
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"name format {options.name_format!r} gives two of the "
                              f"{len(plans)} shards the same name; use more digits")
        self.plans = plans
        self.fingerprint = plan_fingerprint(report.source, objects, options.plan_options())
        report.shards = len(plans)
        report.first_shard, report.last_shard = self.names[0], self.names[-1]
        report.samples = len(samples)
        report.objects = sum(p.objects for p in plans)
        report.source_bytes = sum(p.source_bytes for p in plans)
        report.shard_bytes = sum(p.bytes for p in plans)

        self.done = await self._resume_state(existing)
        report.resumed = len(self.done)
        todo = [p for p in plans if p.number not in self.done]
        await self._abort_stale_uploads({self.names[p.number] for p in todo})
        await self._write_progress(force=True)
        if self.make_progress is not None:
            self.hook = self.make_progress(report, report.source_bytes, report.objects)
            self.hook(sum(p.source_bytes for p in plans if p.number in self.done),
                      sum(p.objects for p in plans if p.number in self.done))

        stopped = await self._write_shards(todo)
        if stopped:
            return
        index = build_index(report.source, self.bucket, self.names, plans,
                            fingerprint=self.fingerprint, target_size=options.target_size,
                            skipped=len(skipped), compression=options.compress,
                            stored_bytes=[self.stored.get(p.number, p.bytes) for p in plans])
        # each shard's size and ETag as a listing shows them: from_shards counts only that version
        listed = await list_objects(self.store, self.bucket, self.prefix, self.retry)
        add_versions(index, {info.key: (info.size, info.etag) for info in listed.infos()})
        await self._put(self.prefix + INDEX_NAME, json.dumps(index, separators=(",", ":")).encode())
        report.complete = True

    # ------------------------------------------------------------------ resume

    async def _resume_state(self, existing: dict[str, int]) -> set[int]:
        """Shard numbers already finished by an earlier run of this same plan, judged from
        ``existing`` (key -> size of every object under DST) and ``_progress.json``."""
        planned = {name: plan for name, plan in zip(self.names, self.plans)}
        self.report.stray = sorted(key for key in existing
                                   if key.endswith(".tar") and key not in planned)
        progress_key = self.prefix + PROGRESS_NAME
        where = f"s3://{self.bucket}/{progress_key}"
        if self.options.overwrite:
            return set()
        if progress_key not in existing:
            clash = [key for key in (*planned, self.prefix + INDEX_NAME) if key in existing]
            if clash:
                raise ConfigError(
                    f"s3://{self.bucket}/{clash[0]} already exists (and {len(clash) - 1} more shard "
                    f"or index objects) but there is no {PROGRESS_NAME} of a loader shard run there; "
                    "pass --overwrite to replace them, or choose another DST_PREFIX"
                )
            return set()
        raw = await call_with_retries(lambda: self.store.get(self.bucket, progress_key), self.retry)
        try:
            document = json.loads(raw)
        except ValueError:
            document = None
        recorded = parse_progress(document, self.fingerprint, where)
        if self.options.compress is not None:
            # a compressed shard's size is known only once written: trust the record, and that
            # the object is there (an upload becomes visible only when it completes)
            done = {plan.number for name, plan in planned.items()
                    if plan.number in recorded and name in existing}
            self.stored.update({planned[name].number: existing[name] for name in planned
                                if name in existing})
        else:
            done = {plan.number for name, plan in planned.items() if existing.get(name) == plan.bytes}
        redo = sorted(recorded - done)
        if redo:
            log.warning("%d shard(s) recorded as written in %s are missing or have another size "
                        "(e.g. %s); writing them again", len(redo), where, self.names[redo[0]])
        return done

    async def _abort_stale_uploads(self, names: set[str]) -> None:
        """Abort multipart uploads a killed run left open for shards about to be written."""
        store = self.store
        if not names or not isinstance(store, MultipartStore):
            return
        try:
            uploads = await store.list_multipart_uploads(self.bucket, self.prefix)
            for key, upload_id in uploads:
                if key in names:
                    await store.abort_multipart(self.bucket, key, upload_id)
        except StoreError as exc:  # cleanup only: the shards are still written correctly
            log.warning("could not clean up unfinished uploads under s3://%s/%s: %s",
                        self.bucket, self.prefix, exc)

    # ------------------------------------------------------------------ shards

    async def _write_shards(self, todo: list[ShardPlan]) -> bool:
        """Write ``todo``, ``concurrency`` at a time; True when ``stop_after`` stopped it."""
        slots = anyio.Semaphore(self.options.concurrency)
        finished = 0
        stopped = False

        async with anyio.create_task_group() as tg:

            async def one(plan: ShardPlan) -> None:
                nonlocal finished, stopped
                try:
                    await self._write_shard(plan)
                    await self._record(plan.number)
                finally:
                    slots.release()
                finished += 1
                self.report.written += 1
                if self.options.stop_after is not None and finished >= self.options.stop_after:
                    stopped = True
                    tg.cancel_scope.cancel()

            for plan in todo:
                await slots.acquire()
                if stopped:
                    slots.release()
                    break
                tg.start_soon(one, plan, name=f"shard {plan.number}")
        return stopped

    async def _write_shard(self, plan: ShardPlan) -> None:
        key = self.names[plan.number]
        multipart = isinstance(self.store, MultipartStore)
        part_size = part_size_for(plan.bytes, max(self.options.part_size, _min_part_size(self.store)))
        encoder = open_encoder(self.options.compress) if self.options.compress else None
        upload = _ShardUpload(self.store, self.bucket, key, part_size if multipart else None, self.retry,
                              encoder)
        try:
            await self._fetch_in_order(plan.members, upload.write)
            await upload.write([end_of_archive()])
            await upload.finish()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await upload.abort()
            raise
        if upload.tar_bytes != plan.bytes:  # cannot happen unless the layout code is wrong
            raise LoaderError(f"s3://{self.bucket}/{key}: wrote {upload.tar_bytes} tar bytes, "
                              f"planned {plan.bytes}; this is a bug in loader shard")
        self.stored[plan.number] = upload.written

    async def _fetch_in_order(self, members: list[Member],
                              consume: Callable[[list[bytes]], Awaitable[None]]) -> None:
        """GET ``members`` concurrently, hand them to ``consume`` in order, with bounded read-ahead."""
        budget = _Budget(self.options.readahead, self.options.max_inflight)
        results: dict[int, bytes] = {}
        arrived = [anyio.Event() for _ in members]
        store, bucket, retry = self.store, self.src_bucket, self.retry

        async with anyio.create_task_group() as tg:

            async def fetch(index: int, member: Member) -> None:
                async with self.gets:
                    data = await call_with_retries(lambda: store.get(bucket, member.key), retry)
                results[index] = data
                arrived[index].set()

            async def produce() -> None:
                for index, member in enumerate(members):
                    await budget.acquire(member.size)
                    tg.start_soon(fetch, index, member)

            tg.start_soon(produce)
            for index, member in enumerate(members):
                await arrived[index].wait()
                data = results.pop(index)
                budget.release(member.size)
                if len(data) != member.size:
                    raise LoaderError(
                        f"s3://{bucket}/{member.key} is {len(data)} bytes now but was {member.size} "
                        "when listed: the source changed while packing; rerun with --overwrite "
                        "once it is stable"
                    )
                await consume(encode_member(member.name, data))
                self.hook(len(data), 1)

    # ------------------------------------------------------------------ small objects

    async def _record(self, number: int) -> None:
        """Mark a shard done and rewrite ``_progress.json`` (writes coalesce under a lock)."""
        self.done.add(number)
        await self._write_progress()

    async def _write_progress(self, force: bool = False) -> None:
        async with self.progress_lock:
            if not force and self.done <= self.written_progress:
                return  # a write that started after ours finished already covered it
            snapshot = set(self.done)
            document = progress_document(self.fingerprint, self.report.source,
                                         self.report.destination, len(self.plans), snapshot,
                                         self.options.plan_options())
            with anyio.CancelScope(shield=True):  # a finished shard must reach the record
                await self._put(self.prefix + PROGRESS_NAME, json.dumps(document).encode())
            self.written_progress = snapshot

    async def _put(self, key: str, data: bytes) -> None:
        await call_with_retries(lambda: self.store.put(self.bucket, key, data), self.retry)

    async def _list(self, bucket: str, prefix: str) -> dict[str, int]:
        async def attempt() -> dict[str, int]:
            return {info.key: info.size async for info in self.store.list(bucket, prefix)}

        return await call_with_retries(attempt, self.retry)


class _ShardUpload:
    """One shard's bytes on their way up: a multipart upload in parts of at least ``part_size``,
    or a single PUT when the shard fits in one part (or the store has no multipart uploads,
    ``part_size=None``), compressed on the way when there is an ``encoder``. Whoever creates it
    calls ``abort()`` on every failure path."""

    def __init__(self, store: Any, bucket: str, key: str, part_size: int | None,
                 retry: RetryPolicy, encoder: Encoder | None = None) -> None:
        self.store, self.bucket, self.key = store, bucket, key
        self.part_size = part_size
        self.retry = retry
        self.encoder = encoder
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.written = 0  # bytes uploaded (compressed, when compressing)
        self.tar_bytes = 0  # tar bytes written into it
        self.upload_id: str | None = None
        self.parts: list[tuple[int, str]] = []

    async def write(self, pieces: list[bytes]) -> None:
        self.tar_bytes += sum(map(len, pieces))
        if self.encoder is not None:
            data = self.encoder.compress(b"".join(pieces))
            pieces = [data] if data else []
        self.pieces.extend(pieces)
        self.buffered += sum(map(len, pieces))
        if self.part_size is not None and self.buffered >= self.part_size:
            await self._part(self._take())

    def _take(self) -> bytes:
        data = b"".join(self.pieces)
        self.pieces, self.buffered = [], 0
        return data

    async def _part(self, data: bytes) -> None:
        store, retry = self.store, self.retry
        if self.upload_id is None:
            self.upload_id = await call_with_retries(
                lambda: store.create_multipart(self.bucket, self.key), retry)
        number = len(self.parts) + 1
        etag = await call_with_retries(
            lambda: store.upload_part(self.bucket, self.key, self.upload_id, number, data), retry)
        self.parts.append((number, etag))
        self.written += len(data)

    async def finish(self) -> None:
        if self.encoder is not None:
            self.pieces.append(self.encoder.flush())
        data = self._take()
        if self.upload_id is None:
            await call_with_retries(lambda: self.store.put(self.bucket, self.key, data), self.retry)
            self.written += len(data)
            return
        if data:
            await self._part(data)
        await call_with_retries(lambda: self.store.complete_multipart(
            self.bucket, self.key, self.upload_id, self.parts), self.retry)
        self.upload_id = None

    async def abort(self) -> None:
        if self.upload_id is None:
            return
        upload_id, self.upload_id = self.upload_id, None
        try:
            await self.store.abort_multipart(self.bucket, self.key, upload_id)
        except StoreError as exc:  # the original error matters more; say what is left behind
            log.warning("could not abort the multipart upload of s3://%s/%s (%s); the next run "
                        "aborts it, or a bucket lifecycle rule", self.bucket, self.key, exc)


class _Budget:
    """Read-ahead limit of one shard: at most ``max_bytes`` (or one object, if larger) and
    ``max_items`` fetched or in flight ahead of the writer. One task acquires, one releases."""

    def __init__(self, max_bytes: int, max_items: int) -> None:
        self.max_bytes, self.max_items = max_bytes, max_items
        self.bytes = self.items = 0
        self._changed = anyio.Event()

    async def acquire(self, nbytes: int) -> None:
        while self.items and (self.bytes + nbytes > self.max_bytes or self.items >= self.max_items):
            await self._changed.wait()
        self.bytes += nbytes
        self.items += 1

    def release(self, nbytes: int) -> None:
        self.bytes -= nbytes
        self.items -= 1
        self._changed.set()
        self._changed = anyio.Event()


def _min_part_size(store: Any) -> int:
    """S3's smallest part, unless the store says it takes smaller ones (a test fake)."""
    return int(getattr(store, "min_part_size", S3_MIN_PART_SIZE))


def summary_lines(report: PackReport) -> list[str]:
    """The human summary ``loader shard`` prints when a run ends."""
    rate = report.source_bytes / report.seconds if report.seconds else 0.0
    lines = [
        f"packed {report.objects:,} objects ({report.samples:,} samples, "
        f"{format_size(report.source_bytes)}) into {report.shards:,} shards under "
        f"{report.destination} in {report.seconds:.1f} s ({format_size(rate)}/s)"
        + (f"; {report.resumed} shard(s) were already there" if report.resumed else ""),
        f"index: {report.index_url}",
    ]
    if report.skipped:
        lines.append(f"left out {len(report.skipped)} object(s) that cannot be WebDataset members "
                     f"(e.g. {report.skipped[0].key}: {report.skipped[0].reason})")
    if report.stray:
        lines.append(f"note: {len(report.stray)} other .tar object(s) under {report.destination} are "
                     f"not from this run (e.g. {report.stray[0]}); a prefix read would include them, "
                     "the index does not")
    return lines
