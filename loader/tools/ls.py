"""``loader ls``: what is under a prefix (count, total size, size histogram), how to read it
(objects, tar shards, Parquet files with their row counts) and whether to shard it.

The listing is I/O (one paged LIST through the project's store, ``inputs.list_prefix``); the
summary and the text histogram are pure functions of the sizes, tested without a server.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import IO, NamedTuple

from ..config import S3Config
from ..datasets.object_samples import sample_notes
from ..errors import EmptyDatasetError, ParquetFormatError
from ..formats.compression import is_shard_name
from ..formats.grouping import split_key
from ..formats.packing import PROGRESS_NAME
from ..formats.parquet import PARQUET_SUFFIX
from ..listing.inputs import list_prefix, snapshot_notes
from ..listing.snapshots import save_snapshot, snapshot_option
from ..retry import RetryPolicy
from ..s3 import ObjectInfo, StoreSpec
from ..shard_index.format import INDEX_NAME
from ..uri import parse_s3_uri
from .arguments import retry_policy
from .sizes import format_size

SMALL_OBJECT = 1 << 20  # below this median, per-object loading is request-bound: suggest shards
BAR_WIDTH = 40


def among(keys: Iterable[str], is_kind: Callable[[str], bool]) -> tuple[int, int]:
    """``(objects of a kind, other objects)`` of a listing, e.g. ``is_shard_name`` (tar shards,
    plain or compressed) or ``is_parquet``; the index files ``loader shard`` writes beside its
    shards count as neither."""
    kind = others = 0
    for key in keys:
        if is_kind(key):
            kind += 1
        elif key.rpartition("/")[2] not in (INDEX_NAME, PROGRESS_NAME):
            others += 1
    return kind, others


def mostly(keys: Iterable[str], is_kind: Callable[[str], bool]) -> bool:
    """Whether a listing is to be read as that kind (tar shards with ``from_shards``, Parquet
    files with ``from_parquet``) rather than one object per sample: at least half of its
    objects are. What ``ls`` and ``bench`` both go by."""
    kind, others = among(keys, is_kind)
    return kind > 0 and kind >= others


def is_parquet(key: str) -> bool:
    return key.endswith(PARQUET_SUFFIX)


class ParquetRows(NamedTuple):
    """What the footers of a listing's Parquet files say: rows and row groups in all, and the
    files whose footer did not read (corrupt or truncated), by URL with the reason."""

    rows: int
    row_groups: int
    unreadable: tuple[str, ...] = ()


def shard_destination(uri: str) -> str:
    """Where ``ls`` suggests ``loader shard`` put the shards of ``uri``: a folder beside it
    (``s3://b/train/`` -> ``s3://b/train-shards/``), or ``s3://b/shards/`` for a whole bucket."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")  # a URI the caller checked
    folder = key.rstrip("/")
    return f"s3://{bucket}/{folder}-shards/" if folder else f"s3://{bucket}/shards/"


class Bucket(NamedTuple):
    """Objects with ``low <= size < high`` (``low`` 0 and ``high`` 1 for empty objects)."""

    low: int
    high: int
    objects: int


def log2_histogram(sizes: Sequence[int]) -> list[Bucket]:
    """Counts per power-of-two size range, from the smallest to the largest occupied one."""
    counts = Counter(0 if size <= 0 else size.bit_length() for size in sizes)
    if not counts:
        return []
    lo, hi = min(counts), max(counts)
    return [Bucket(0 if b == 0 else 1 << (b - 1), 1 if b == 0 else 1 << b, counts.get(b, 0))
            for b in range(lo, hi + 1)]


def render_histogram(buckets: Sequence[Bucket], width: int = BAR_WIDTH) -> list[str]:
    """One text line per bucket: range, a bar scaled to the fullest bucket, the count; a run of
    three or more empty buckets is one ``...`` line."""
    most = max((b.objects for b in buckets), default=0)
    lines = []
    empty_run = 0
    for position, b in enumerate(buckets):
        if not b.objects:
            empty_run += 1
            next_full = position + 1 < len(buckets) and buckets[position + 1].objects
            if next_full and empty_run >= 3:
                lines.append(f"  {'...':>21}  {'':<{width}}  0")
            elif next_full:
                lines.extend(_row(e, "", width) for e in buckets[position - empty_run + 1 : position + 1])
            continue
        empty_run = 0
        bar = "█" * (round(width * b.objects / most) if most else 0)
        if b.objects and not bar:
            bar = "▏"
        lines.append(_row(b, bar, width))
    return lines


def _row(b: Bucket, bar: str, width: int) -> str:
    label = "0 B (empty)" if b.high == 1 else f"{format_size(b.low)} – {format_size(b.high)}"
    return f"  {label:>21}  {bar:<{width}}  {b.objects:,}"


def summarize_listing(uri: str, objects: Sequence[ObjectInfo], *, top_extensions: int = 6,
                      parquet: ParquetRows | None = None) -> list[str]:
    """The report ``loader ls`` prints for a listing (not empty); ``parquet``: what the footers
    of its Parquet files say, when it looks like Parquet (``parquet_rows`` reads them)."""
    sizes = [info.size for info in objects]
    total = sum(sizes)
    median = statistics.median(sizes)
    lines = [
        f"{uri}: {len(objects):,} objects, {format_size(total)} ({total:,} bytes)",
        f"object size: median {format_size(median)}, mean {format_size(total / len(sizes))}, "
        f"smallest {format_size(min(sizes))}, largest {format_size(max(sizes))}",
    ]
    extensions = Counter(split_key(info.key)[1] or "(none)" for info in objects)
    shown = ", ".join(f"{ext} {n:,}" for ext, n in extensions.most_common(top_extensions))
    more = len(extensions) - top_extensions
    lines.append(f"extensions: {shown}" + (f", and {more} more" if more > 0 else ""))
    lines.append("size histogram (log2 buckets):")
    lines.extend(render_histogram(log2_histogram(sizes)))
    shards, _ = among((info.key for info in objects), is_shard_name)
    if mostly((info.key for info in objects), is_parquet):
        files, _ = among((info.key for info in objects), is_parquet)
        counted = "" if parquet is None else f", {parquet.rows:,} rows in {parquet.row_groups:,} row groups"
        lines.append(f"these are Parquet files ({files:,} of {len(objects):,} objects{counted}): read them "
                     f"with AsyncS3Dataset.from_parquet({uri!r}); `loader bench {uri}` measures them")
        for problem in () if parquet is None else parquet.unreadable:
            lines.append(f"  unreadable: {problem}")
    elif mostly((info.key for info in objects), is_shard_name):
        lines.append(f"these look like tar shards ({shards:,} of {len(objects):,} objects): read them with "
                     f"AsyncS3Dataset.from_shards({uri!r}); `loader bench {uri}` measures them")
    elif median < SMALL_OBJECT:
        dst = shard_destination(uri)
        lines.append(
            f"hint: the median object is {format_size(median)}; per-object loading pays one request "
            "per sample and tops out near Limits(concurrency=) / latency samples/s. Pack them into tar "
            "shards and read those with from_shards():"
        )
        lines.append(f"  loader shard {uri} {dst} --target-size 256MB")
    return lines


def empty_listing(uri: str) -> str:
    """What ``loader ls`` says about a prefix with nothing under it."""
    bucket, prefix = parse_s3_uri(uri)
    if not prefix:
        return (f"{uri}: 0 objects, the bucket is empty; upload objects into it "
                f"(e.g. `aws s3 cp --recursive DIR s3://{bucket}/`), then list it again")
    return (f"{uri}: 0 objects under this prefix; check it (it is case-sensitive and matches from "
            f"the start of the key, see `loader ls s3://{bucket}/`) and that the upload finished")


def run_ls(args: argparse.Namespace, out: IO[str]) -> int:
    """``loader ls [--save PATH] URI``: the summary; ``--save``: the listing snapshot too."""
    save = getattr(args, "save", None)
    retry = retry_policy(args)
    try:
        objects = list_uri(args.uri, save=save, retry=retry)
    except EmptyDatasetError:
        if save:  # a snapshot of nothing would only fail later, in from_manifest
            raise
        # an empty listing is an answer, not a failure: a new bucket is empty until the first upload
        print(empty_listing(args.uri), file=out)
        return 0
    rows = parquet_rows(args.uri, objects, retry=retry) if mostly((info.key for info in objects), is_parquet) else None
    for line in summarize_listing(args.uri, objects, parquet=rows):
        print(line, file=out)
    if save:
        print(f"saved the listing to {save}: AsyncS3Dataset.from_manifest({save!r}) reads it "
              "back without listing", file=out)
    return 0


def parquet_rows(uri: str, objects: Sequence[ObjectInfo], *, config: S3Config | None = None,
                 store: str | None = None, retry: RetryPolicy | None = None) -> ParquetRows:
    """Rows and row groups from the footers of the listing's ``.parquet`` files (one ranged GET
    of each file's tail, as ``from_parquet`` reads them); a file whose footer does not read is
    named, not fatal: ``ls`` describes what is there."""
    from ..datasets.parquet_source import read_footers_or_errors
    from ..formats.parquet import ParquetRef, parse_footer

    retry = retry or RetryPolicy()
    factory = StoreSpec.of(store, config).opener(max_connections=4, retry=retry)
    bucket = parse_s3_uri(uri).bucket
    refs = [ParquetRef(bucket, info.key, info.size, info.etag) for info in objects
            if info.key.endswith(PARQUET_SUFFIX)]
    rows = groups = 0
    unreadable: list[str] = []
    for ref, footer in zip(refs, read_footers_or_errors(refs, factory, retry)):
        if isinstance(footer, ParquetFormatError):
            unreadable.append(str(footer))
            continue
        meta = parse_footer(ref, footer)
        rows += meta.num_rows
        groups += meta.num_row_groups
    return ParquetRows(rows, groups, tuple(unreadable))


def list_uri(uri: str, *, config: S3Config | None = None, store: str | None = None,
             save: str | None = None, retry: RetryPolicy | None = None) -> list[ObjectInfo]:
    """Every object under ``uri`` (sorted; an empty prefix is an ``EmptyDatasetError``);
    ``save``: also write it as a listing snapshot to that path (``listing.snapshots``)."""
    retry = retry or RetryPolicy()
    factory = StoreSpec.of(store, config).opener(max_connections=4, retry=retry)
    snapshot = snapshot_option(save, "--save ")  # checked before listing: a bad path fails now
    found = list_prefix(uri, factory=factory, retry=retry)
    if snapshot is not None:
        bucket, prefix = parse_s3_uri(uri)
        # kept beside the keys for from_manifest: hidden keys counted, samples grouped
        found = save_snapshot(found, snapshot.path, f"s3://{bucket}/{prefix}", snapshot_notes(sample_notes))
    return list(found.infos())
