"""Shard mode: stream WebDataset tar shards from S3 and parse them on the fly.

One engine job per shard: one GET, or ranged parts for a large shard of known size, fed to the
tar parser and grouped into the samples its slot keeps, never whole in memory or on disk. A
dropped connection resumes at the member being parsed (a compressed shard is read again and
the bytes already parsed skipped), so no sample is lost or repeated (docs/design/tar.md).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any, NamedTuple

import anyio

from ..checks import check_int
from ..engine.fetch import JobContext, JobFn
from ..errors import (
    BadAnswerError,
    ConfigError,
    InvalidRangeError,
    ObjectChangedError,
    ShardFormatError,
    TransientStoreError,
    say_skipped,
)
from ..retry import Retrying, call_with_retries
from ..s3.answer_checks import asked_for, check_length, check_listed
from ..s3.protocol import Pin
from ..uri import object_url, parse_s3_uri
from .compression import Compression, compression_of, open_decoder
from .grouping import SampleGrouper
from .tar import TarMember, TarStreamParser

log = logging.getLogger(__name__)

DEFAULT_SHARDS_INFLIGHT = 4
DEFAULT_SHUFFLE_BUFFER = 1000
DEFAULT_PART_SIZE = 16 << 20
MIN_PART_SIZE = 1 << 20  # a ranged part smaller than this costs more in requests than it saves
DEFAULT_PARTS_INFLIGHT = 4
DEFAULT_CHUNK_SIZE = 1 << 20


class ShardAssignment(NamedTuple):
    """Read shard ``shard`` and keep the samples whose index ``% stride == phase``, within
    ``[start, stop)``; ``ranges``, when given, are the ascending, disjoint ``(start, stop)``
    sample ranges kept inside that span (blocks dealt by ``batch_size=``)."""

    shard: int
    stride: int
    phase: int
    start: int = 0
    stop: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()

    def keeps(self, sample_index: int) -> bool:
        """Whether the ``sample_index``-th sample of the shard belongs to this slot."""
        if sample_index < self.start or (self.stop is not None and sample_index >= self.stop):
            return False
        if self.ranges:
            at = bisect.bisect_right(self.ranges, (sample_index, 1 << 62)) - 1
            return at >= 0 and sample_index < self.ranges[at][1]
        return sample_index % self.stride == self.phase

    def wanted(self, samples: int) -> int:
        """How many of a shard's ``samples`` this assignment keeps."""
        if self.ranges:
            return sum(max(0, min(stop, samples) - start) for start, stop in self.ranges)
        stop = samples if self.stop is None else min(self.stop, samples)
        return sum(1 for i in range(self.start, stop) if i % self.stride == self.phase)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """How shards are read and dealt.

    ``shards_inflight``: shards streamed at once per worker (their samples interleave).
    ``shuffle_buffer``: samples mixed after reading (0 = off; None: 1000 where a buffer applies);
    costs that many samples of RAM.
    ``part_size``/``parts_inflight``: a shard of known size above two parts is fetched as
    ranged GETs of ``part_size`` bytes (``MIN_PART_SIZE`` at least), ``parts_inflight`` at a
    time, reassembled in order.
    ``shuffle_bytes``: the shuffle buffer's limit in bytes as well (None: samples only);
    ``memory_budget`` sets it.
    ``samples_per_epoch``: exactly this many samples per rank and epoch, cycling through the
    shards (no counts needed). ``uneven_ranks``: accept ranks of unequal length when counts are
    unknown. ``index``: the shard index's URI when it is not in the shards' folder.
    """

    shards_inflight: int = DEFAULT_SHARDS_INFLIGHT
    shuffle_buffer: int | None = None
    part_size: int = DEFAULT_PART_SIZE
    parts_inflight: int = DEFAULT_PARTS_INFLIGHT
    chunk_size: int = DEFAULT_CHUNK_SIZE
    shuffle_bytes: int | None = None
    samples_per_epoch: int | None = None
    uneven_ranks: bool = False
    index: str | None = None

    def __post_init__(self) -> None:
        for name in ("shards_inflight", "part_size", "parts_inflight", "chunk_size"):
            check_int(name, getattr(self, name), minimum=1, must="a positive integer")
        check_int("shuffle_buffer", self.shuffle_buffer, minimum=0, optional=True, must="0 (off) or more")
        check_int("shuffle_bytes", self.shuffle_bytes, minimum=1, optional=True,
                  must="a positive number of bytes or None")
        check_int("samples_per_epoch", self.samples_per_epoch, minimum=1, optional=True,
                  must="a positive integer (samples per rank and epoch) or None")
        if not isinstance(self.uneven_ranks, bool):
            raise ConfigError(f"uneven_ranks={self.uneven_ranks!r} must be True or False")
        if self.index is not None:
            if not isinstance(self.index, str):
                raise ConfigError(f"index={self.index!r} must be an s3:// URI of a shard index")
            parse_s3_uri(self.index)
        if self.part_size < MIN_PART_SIZE:
            raise ConfigError(
                part_size_too_small(self.part_size, "16 MiB for shards"))

    @property
    def buffer_size(self) -> int:
        """The shuffle buffer in force where one applies (``shuffle_buffer`` or its default)."""
        return DEFAULT_SHUFFLE_BUFFER if self.shuffle_buffer is None else self.shuffle_buffer


def part_size_too_small(part_size: int, default: str) -> str:
    """What to say of a ``part_size`` (``Reading(part_size=)``) under ``MIN_PART_SIZE``; ``default``: the mode's."""
    return (f"part_size={part_size!r} is below the floor of {MIN_PART_SIZE} bytes: each part is "
            "one ranged GET, and parts that small spend their time on requests, not bytes; give "
            f"part_size={MIN_PART_SIZE} (1 MiB) or more, or leave the default ({default})")


class ShardRef(NamedTuple):
    """One shard: where it is and, when a listing told us, its size and ETag."""

    bucket: str
    key: str
    size: int | None = None
    etag: str | None = None

    @property
    def url(self) -> str:
        return object_url(self.bucket, self.key)

    @property
    def compression(self) -> Compression | None:
        """``"gzip"``, ``"zstd"`` or None (plain tar), from the key's suffix."""
        return compression_of(self.key)


class ShardEnd(NamedTuple):
    """Emitted after a shard's last sample: how many samples it held, whether it was skipped,
    and how many tar links (hard or symbolic: no data, so no field) it skipped."""

    samples: int
    skipped: bool
    links: int = 0


class Expect(NamedTuple):
    """How many samples a shard must hold, who said so and how to fix it: a shard read to its
    end that holds another number is an error (ranks would silently read unequal counts)."""

    samples: int
    source: str  # "the index s3://b/index.json", "sample_counts="
    fix: str

    def mismatch(self, shard: ShardRef, what: str) -> ConfigError:
        """The error for a shard found to differ (``what``: "holds 86 samples")."""
        return ConfigError(
            f"{shard.url} {what}, but {self.source} says it holds {self.samples}: the shard "
            f"changed after it was counted, or the count is wrong, and ranks would read unequal "
            f"numbers of samples, so the read stops; {self.fix}")

    def changed(self, shard: ShardRef, exc: ObjectChangedError) -> ObjectChangedError:
        """A read pinned to the counted version found another one."""
        return ObjectChangedError(
            f"{shard.url} is not the version {self.source} counted (ETag {shard.etag}): it was "
            f"overwritten after it was counted (the server no longer holds that version; reading "
            f"again would meet the same count), so the read stops; {self.fix}",
            bucket=shard.bucket, key=shard.key)


class _RangeDone(Exception):
    """Raised inside a shard job once its sample range is read; ends the stream early."""


Tag = tuple[int, int]  # (shard position in this slot's plan, sample index in the shard)
END = -1  # the sample index that tags a ShardEnd


def sample_nbytes(sample: dict[str, Any]) -> int:
    """Bytes a sample holds (what the engine's byte budget counts)."""
    return sum(len(value) for value in sample.values() if isinstance(value, (bytes, bytearray)))


def shard_job(
    shard: ShardRef,
    position: int,
    assignment: ShardAssignment,
    options: ShardOptions,
    skip: Container[int] = frozenset(),
    on_error: str = "raise",
    offsets: Sequence[int] | None = None,
    expect: Expect | None = None,
    buffer_up_to: int | None = None,
) -> JobFn:
    """Stream one shard; emit ``((position, index), sample)`` for each sample the slot keeps
    (and has not delivered before a resume), then ``((position, END), ShardEnd)``.

    ``on_error``: a corrupt or truncated shard raises (``"raise"``), or the rest of it is
    skipped quietly (``"skip"``) or with a warning (``"warn"``); ``ShardEnd`` says it was.

    ``offsets`` (the byte offset of each sample's first header, from the shard index) let an
    assignment with ``ranges`` read each range from its first byte with a ranged GET, instead
    of the shard from its start (uncompressed shards only: a compressed one has no offsets).

    ``expect``: the shard's sample count as the dataset was told it. Every request is then
    pinned to ``ShardRef.etag`` (the counted version), and a slot that reads to the shard's end
    checks the count: another count is an error naming the shard, never a silent difference.

    ``buffer_up_to``: a range of at most this many bytes is one bounded GET read whole before
    it is parsed, a longer one is streamed (default: ``part_size``).
    """
    if offsets is not None and assignment.ranges and shard.compression is None:
        bounded = options.part_size if buffer_up_to is None else buffer_up_to
        return _ranged_job(shard, position, assignment, options, skip, on_error, offsets, expect, bounded)
    expected = None if expect is None else expect.samples
    # A slot whose range ends at the shard's counted end reads on to the end, to check the count.
    stop_early = assignment.stop is not None and (expected is None or assignment.stop < expected)

    async def job(ctx: JobContext) -> None:
        grouper = SampleGrouper(shard.url)
        count = 0
        fields: frozenset[str] | None = None  # the field names of the last complete sample

        async def deliver(sample: dict[str, Any] | None) -> None:
            nonlocal count, fields
            if sample is None:
                return
            index = sample.pop("__index__")
            count = index + 1
            if expect is not None and count > expect.samples:
                raise expect.mismatch(shard, f"holds more than {expect.samples} samples")
            fields = frozenset(sample)
            if assignment.keeps(index) and index not in skip:
                await ctx.emit(((position, index), sample), sample_nbytes(sample))
            if stop_early and assignment.stop is not None and count >= assignment.stop:
                raise _RangeDone  # the rest of the shard belongs to another slot: stop reading

        async def on_member(member: TarMember) -> None:
            await deliver(grouper.add(member))

        parser = TarStreamParser(shard.url)
        try:
            pin = None if expect is None else Pin(shard.etag)
            try:
                await read_members(ctx, shard, options, on_member, parser, pin=pin)
            except ObjectChangedError as exc:
                if expect is None or shard.etag is None:
                    raise
                raise expect.changed(shard, exc) from exc
            await deliver(grouper.flush())
            if expect is not None and count != expect.samples:
                raise expect.mismatch(shard, f"holds {count} samples")
        except _RangeDone:
            pass
        except ShardFormatError as exc:
            if on_error == "raise":
                raise
            # The sample being collected when the shard broke off is complete when the break came
            # in a later sample's member; the parser does not say whose, so keep it when it has
            # every field the sample before it had (members past the break may have been its own).
            pending = grouper.flush()
            if pending is not None and frozenset(pending) - {"__index__"} == fields:
                with contextlib.suppress(_RangeDone):
                    await deliver(pending)
            say_skipped(f"skipping the rest of shard {shard.url} (on_error={on_error!r}): {exc}", on_error, log)
            links = _warn_links(shard, parser)
            await ctx.emit(((position, END), ShardEnd(count, skipped=True, links=links)), 0)
            return
        links = _warn_links(shard, parser)
        await ctx.emit(((position, END), ShardEnd(count, skipped=False, links=links)), 0)

    return job


def _ranged_job(
    shard: ShardRef,
    position: int,
    assignment: ShardAssignment,
    options: ShardOptions,
    skip: Container[int],
    on_error: str,
    offsets: Sequence[int],
    expect: Expect | None,
    bounded: int,
) -> JobFn:
    """``shard_job`` for sample ranges whose byte offsets are known: one GET per range, from the
    range's first sample's first header to the next sample's (at most ``bounded`` bytes held;
    a longer range, or one that runs to the shard's end, is streamed and cut after its last
    sample). A range that ends at the shard's last sample reads on to the end (the count check)."""
    expected = len(offsets)
    if expect is None:
        expect = Expect(expected, "the shard index", "index the shards again")

    async def job(ctx: JobContext) -> None:
        links, skipped = 0, False
        pin = Pin(shard.etag)  # the offsets describe one version: every range reads that one
        for start, stop in assignment.ranges:
            if all(index in skip for index in range(start, stop)):
                continue  # delivered before a resume
            grouper = SampleGrouper(shard.url, start_index=start)
            parser = TarStreamParser(shard.url, start_offset=offsets[start])
            last = start - 1  # the last sample index seen in this range

            async def deliver(sample: dict[str, Any] | None, stop: int = stop) -> None:
                nonlocal last
                if sample is None:
                    return
                index = last = sample.pop("__index__")
                if index >= expected:
                    raise expect.mismatch(shard, f"holds more than {expected} samples")
                if index >= stop:
                    raise _RangeDone
                if index not in skip:
                    await ctx.emit(((position, index), sample), sample_nbytes(sample))
                if index + 1 >= stop and stop < expected:
                    raise _RangeDone

            async def feed(chunk: bytes, parser: TarStreamParser = parser,
                           grouper: SampleGrouper = grouper) -> None:
                for member in parser.feed(chunk):
                    await deliver(grouper.add(member))

            try:
                try:
                    if stop < expected and offsets[stop] - offsets[start] <= bounded:
                        # One bounded GET: the range ends where the next sample's first header starts.
                        get = functools.partial(ctx.store.get_range, shard.bucket, shard.key,
                                                offsets[start], offsets[stop], pin=pin)
                        data = await call_with_retries(get, ctx.retry, on_retry=ctx.retried)
                        await feed(data)
                    else:  # to the shard's end, or too big for one buffer: streamed, to ``stop``'s first byte
                        await _read_stream(ctx, shard, options, parser, feed, pin,
                                           end=offsets[stop] if stop < expected else None)
                        parser.close()
                    await deliver(grouper.flush())
                except ObjectChangedError as exc:
                    if shard.etag is None:
                        raise
                    raise expect.changed(shard, exc) from exc
                except ShardFormatError as exc:
                    if exc.offset == offsets[start]:  # no header where the index put a sample
                        message = (f"{shard.url}: no tar header at byte {offsets[start]}, where "
                                   f"{expect.source} places sample {start}: the shard changed after "
                                   f"it was indexed (or is damaged); {expect.fix}. The parser said: {exc}")
                    else:
                        message = (f"{exc}; this read began at byte {offsets[start]}, where {expect.source} "
                                   f"places sample {start}: if the shard itself is valid, it changed "
                                   f"after it was indexed; {expect.fix}")
                    raise ShardFormatError(message, url=shard.url, offset=exc.offset) from exc
                if last + 1 < stop:
                    raise expect.mismatch(
                        shard, f"has no sample {last + 1} at byte {offsets[last + 1]}")
            except _RangeDone:
                pass
            except ShardFormatError as exc:
                if on_error == "raise":
                    raise
                say_skipped(f"skipping the rest of shard {shard.url} (on_error={on_error!r}): {exc}",
                            on_error, log)
                skipped = True
                break
            finally:
                links += parser.hard_links + parser.symlinks
        await ctx.emit(((position, END), ShardEnd(expected, skipped=skipped, links=links)), 0)

    return job


def _warn_links(shard: ShardRef, parser: TarStreamParser) -> int:
    """Say once per shard that it held links (skipped: they carry no data); returns how many."""
    links = parser.hard_links + parser.symlinks
    if links:
        name, target = parser.first_link or ("?", "?")
        message = (
            f"shard {shard.url} holds {parser.hard_links} hard link(s) and {parser.symlinks} "
            f"symbolic link(s) (e.g. {name!r} -> {target!r}); links carry no data, so they were "
            "skipped and are not fields of any sample (webdataset skips them too). Pack the files "
            "themselves: GNU tar --hard-dereference / --dereference"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=1)  # once: not logged as well
    return links


async def read_members(
    ctx: JobContext,
    shard: ShardRef,
    options: ShardOptions,
    on_member: Callable[[TarMember], Awaitable[None]],
    parser: TarStreamParser | None = None,
    *,
    pin: Pin | None = None,
) -> None:
    """Parse the whole shard, handing each member to ``on_member`` as soon as it is complete.

    Every request of the read carries one ``Pin`` (see ``loader/s3/protocol.py``): the later
    requests ask for the version of the first with ``If-Match``, and a shard overwritten
    meanwhile fails with ``ObjectChangedError`` instead of being parsed from two versions.
    Ranged parts are cut by the listed size, so they are pinned to the listed ETag from the
    first part on; a shard replaced after the listing, before any of its bytes were read, is
    read in its new version as one stream instead (the listed size no longer holds). A ``pin``
    given by the caller (a version whose sample count is relied upon) is kept on every path:
    another version is then always ``ObjectChangedError``.
    """
    parser = parser or TarStreamParser(shard.url)
    fed = False

    async def feed(chunk: bytes) -> None:
        nonlocal fed
        fed = True
        for member in parser.feed(chunk):
            await on_member(member)

    if (shard.compression is None and shard.size is not None
            and shard.size > 2 * options.part_size and options.parts_inflight > 1):
        try:
            await _read_parts(ctx, shard, options, feed, pin or Pin(shard.etag))
            parser.close()
            return
        except ObjectChangedError:
            if fed or shard.etag is None or pin is not None:
                raise
            log.info("%s changed after it was listed; reading its new version as one stream",
                     shard.url)
    await _read_stream(ctx, shard, options, parser, feed, pin or Pin())
    parser.close()


async def _read_stream(
    ctx: JobContext,
    shard: ShardRef,
    options: ShardOptions,
    parser: TarStreamParser,
    feed: Callable[[bytes], Awaitable[None]],
    pin: Pin,
    end: int | None = None,
) -> None:
    """One GET (to byte ``end`` where given, uncompressed only); on a transient fault, a ranged
    GET from the parser's resume offset, asking for the first response's version (``pin``).

    A compressed shard is read again from its first byte instead, and the decompressed bytes
    before the resume offset are dropped unparsed.

    Each resumed request gets the full attempt budget again once the previous one made
    progress, so a long shard over a flaky link still finishes; an attempt that makes no
    progress counts toward ``RetryPolicy.max_attempts`` and its deadline (from the first
    failure: a stream that ran for minutes before breaking is not out of time).
    """
    retrying = Retrying(ctx.retry, started=None, what=shard.url)
    compression = shard.compression
    while True:
        resume = parser.resume_offset
        start = 0 if compression is not None else resume
        received = start  # where the stream's bytes end: the listed size, for the listed version
        failure: TransientStoreError | None
        try:
            async with contextlib.aclosing(
                ctx.store.stream(shard.bucket, shard.key, start=start, chunk_size=options.chunk_size,
                                 pin=pin, end=end)
            ) as chunks:
                if compression is None:
                    async for chunk in chunks:
                        received += len(chunk)
                        await feed(chunk)
                else:
                    decoder = open_decoder(compression, shard.url, options.chunk_size)
                    skip = resume  # tar bytes parsed by an earlier pass
                    async for chunk in chunks:
                        received += len(chunk)
                        for piece in decoder.decode(chunk):
                            if skip:
                                if len(piece) <= skip:
                                    skip -= len(piece)
                                    continue
                                piece, skip = piece[skip:], 0
                            await feed(piece)
                    decoder.finish()
                    if skip:
                        raise ShardFormatError(
                            f"{shard.url}: the shard is shorter than when it was first read "
                            f"({resume - skip} of {resume} tar bytes before the resume offset); it "
                            "changed during the read", url=shard.url, offset=resume - skip)
            failure = None if received == end else _unlike_listing(shard, received, pin)
            if failure is None:
                return
        except InvalidRangeError:
            if start == 0:
                raise
            failure = _unlike_listing(shard, start, pin)
            if failure is None:
                return  # resumed exactly at the end: nothing was left to read
        except TransientStoreError as exc:
            failure = exc
        assert failure is not None  # every way here failed
        retrying.what = f"{shard.url} at byte {parser.resume_offset}"
        # a member completed since the last failure (bytes alone are no progress)
        delay = retrying.failed(failure, progressed=parser.resume_offset > resume)
        ctx.retried(failure)
        await anyio.sleep(delay)
        parser.restart_at(parser.resume_offset)


def _unlike_listing(shard: ShardRef, end: int, pin: Pin) -> BadAnswerError | None:
    """A shard's stream that ended at byte ``end`` of an object whose listing or index gave its size:
    the listed version must end there (``check_listed``); a body cut short cleanly, or a
    Content-Length short of the listing, is an error, retried from where it stopped."""
    if shard.size is None or end == shard.size:
        return None
    try:
        check_listed(end, pin.etag, shard.size, shard.etag, shard.bucket, shard.key)
    except BadAnswerError as exc:
        return exc
    return None


async def _read_parts(
    ctx: JobContext,
    shard: ShardRef,
    options: ShardOptions,
    feed: Callable[[bytes], Awaitable[None]],
    pin: Pin,
) -> None:
    """Ranged GETs of ``part_size``, ``parts_inflight`` ahead, fed to the parser in order, all
    of one version (``pin``).

    Each part is retried whole on a transient fault. Memory: ``parts_inflight`` parts.
    """
    size, part = shard.size, options.part_size
    assert size is not None  # only shards of listed size are fetched in parts
    count = -(-size // part)
    results: dict[int, bytes | BaseException] = {}
    arrived: dict[int, anyio.Event] = {}

    async def fetch(i: int, done: anyio.Event) -> None:
        end = min(size, (i + 1) * part)
        async def get() -> bytes:  # a part of the listed size's object is that long, or wrong
            data = await ctx.store.get_range(shard.bucket, shard.key, i * part, end, pin=pin)
            check_length(len(data), end - i * part, asked_for(f"bytes={i * part}-{end - 1}"),
                         shard.bucket, shard.key)
            return data

        try:
            results[i] = await call_with_retries(get, ctx.retry, on_retry=ctx.retried)
        except Exception as exc:  # noqa: BLE001 - handed to the reader below, which raises it in order
            results[i] = exc
        done.set()  # not arrived[i]: the reader pops that entry as soon as it starts waiting

    failure: BaseException | None = None
    async with anyio.create_task_group() as tg:
        started = 0
        for i in range(count):
            while started < count and started < i + options.parts_inflight:
                arrived[started] = anyio.Event()
                tg.start_soon(fetch, started, arrived[started])
                started += 1
            await arrived.pop(i).wait()
            data = results.pop(i)
            if isinstance(data, BaseException):
                failure = data
                tg.cancel_scope.cancel()
                break
            try:
                await feed(data)
            except Exception as exc:  # noqa: BLE001 - raised below, bare: the task group would wrap it in a group
                failure = exc
                tg.cancel_scope.cancel()
                break
    if failure is not None:
        raise failure
