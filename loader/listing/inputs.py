"""What to fetch: object keys from a prefix listing or a manifest, and shard URLs from patterns.

Listing is I/O, so it happens once, on demand, through a short-lived event loop in a helper
thread (``run_async``): that works from plain scripts, notebooks (which already run a loop in
the main thread) and DataLoader workers alike, and leaves no thread behind.
"""

from __future__ import annotations

import array
import csv
import functools
import io
import json
import logging
import os
import re
import warnings
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ConfigError, EmptyDatasetError
from ..retry import RetryPolicy
from ..s3 import ObjectStore
from ..s3.blocking import run_async, with_store
from ..uri import expand_braces, parse_s3_uri, sibling_matches
from .keyfile import Annotations, origin
from .keylist import KeyList, ListOptions, list_all
from .sharing import once_per_job
from .snapshots import Snapshot, load_snapshot, save_snapshot

if TYPE_CHECKING:  # the shard modules come with the shard functions: a per-object start needs none
    from ..formats.shards import ShardRef

log = logging.getLogger(__name__)


async def list_objects(
    store: ObjectStore,
    bucket: str,
    prefix: str,
    retry: RetryPolicy,
    *,
    suffix: str | tuple[str, ...] = "",
    options: ListOptions | None = None,
) -> KeyList:
    """Every object under ``s3://bucket/prefix`` (optionally ending in ``suffix``, or in one of
    several), key order, with sizes (``loader.listing.keylist``: retried page by page, folders
    in parallel, packed into a ``KeyList``).

    Sorted because servers disagree (SeaweedFS lists directory by directory) and positions in
    this list decide every rank's share. Directory markers (keys ending in ``/``) are skipped.
    An empty result is an error, because a training run over nothing is always a mistake
    (usually a typo in the prefix).
    """
    return check_listed(await list_all(store, bucket, prefix, retry, suffix=suffix, options=options),
                        bucket, prefix, suffix)


def check_listed(found: KeyList, bucket: str, prefix: str, suffix: str | tuple[str, ...] = "") -> KeyList:
    """``found``, unless it is empty: an ``EmptyDatasetError`` naming the prefix (``list_objects``)."""
    if not found:
        endings = " or ".join(map(repr, (suffix,) if isinstance(suffix, str) else suffix))
        what = f"no objects{f' ending in {endings}' if suffix else ''}"
        raise EmptyDatasetError(
            f"{what} under s3://{bucket}/{prefix}; check the prefix (it is case-sensitive and "
            "matches from the start of the key) and that the upload finished"
        )
    return found


def list_prefix(
    uri: str,
    *,
    factory: Callable[[], Awaitable[ObjectStore]],
    retry: RetryPolicy,
    suffix: str | tuple[str, ...] = "",
    options: ListOptions | None = None,
    ticket: int = 0,
    keep: Callable[[KeyList], KeyList] | None = None,
    snapshot: Snapshot | None = None,
    annotate: Callable[[KeyList], Annotations] | None = None,
    meanwhile: Callable[[], object] | None = None,
) -> KeyList:
    """Synchronous ``list_objects`` for an ``s3://bucket/prefix`` URI, then ``keep`` (a filter);
    in a job, listed once and shared (``sharing.once_per_job``, by ``ticket``). ``snapshot``:
    read the key list from that file instead, or list and save it there (``snapshots``), with
    what ``annotate`` derives from the keys. ``meanwhile``: work for this thread while the
    pages arrive (``run_async``); not called where nothing is listed here. A ``factory`` that
    offers ``send_first_page`` (``s3.ListingOpener``) is asked for the first page before the
    listing's event loop starts, which its answer then overlaps."""
    bucket, prefix = parse_s3_uri(uri)
    uri = f"s3://{bucket}/{prefix}"
    options = options or ListOptions()

    async def use(store: ObjectStore) -> KeyList:
        return await list_objects(store, bucket, prefix, retry, suffix=suffix, options=options)

    def produce() -> KeyList:
        if snapshot is not None and (not snapshot.create or os.path.exists(snapshot.path)):
            found = load_snapshot(snapshot.path, uri)
        else:
            send_first_page = getattr(factory, "send_first_page", None)
            if send_first_page is not None:
                send_first_page(bucket, prefix, options.page_size)
            try:
                found = run_async(functools.partial(with_store, factory, use), meanwhile)
            finally:  # a first page's lister that the listing never opened (it failed first)
                discard = getattr(factory, "discard", None)
                if discard is not None:
                    discard()
            if snapshot is not None:
                found = save_snapshot(found, snapshot.path, uri, annotate)
        return found if keep is None else keep(found)

    if options.once_per_job:
        what = "objects" if keep is not None else "all"
        return once_per_job(f"{uri}*{suffix}|{what}", produce, ticket)
    return produce()


class Manifest(NamedTuple):
    """What a manifest lists: one bucket, its keys, and a label per key when it has a column."""

    bucket: str
    keys: list[str]
    labels: list[int | str | None] | None = None


KEY_COLUMNS = ("key", "url", "uri")
LABEL_COLUMNS = ("label", "cls", "class")
_INTEGER = re.compile(r"-?[0-9]+")


def read_manifest(path: str | Path, bucket: str | None = None) -> Manifest:
    """Keys (and labels) from a manifest file; the format follows the file's suffix.

    * plain text (any other suffix): one key or ``s3://`` URI per line; blank lines and lines
      starting with ``#`` are skipped;
    * ``.csv``: a header row naming a key column (``key``, ``url`` or ``uri``) and optionally a
      label column (``label``, ``cls`` or ``class``); a label column of integers gives class
      indices as they are, any other values are class names (numbered in sorted order);
    * ``.jsonl`` / ``.ndjson``: one JSON object per line with the same names, e.g.
      ``{"key": "train/cat/1.jpg", "label": "cat"}``.

    Keys are plain (``bucket`` given) or ``s3://`` URIs, all naming one bucket. A row may leave
    its label empty when another row of the same sample (same stem) gives it.
    """
    manifest = Path(path)
    name = str(manifest)
    try:
        text = manifest.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {name!r}: {exc.strerror}") from exc
    suffix = manifest.suffix.lower()
    if suffix == ".csv":
        rows, labeled = _csv_rows(text, name)
    elif suffix in (".jsonl", ".ndjson"):
        rows, labeled = _json_rows(text, name)
    else:
        rows = [(number, line.strip(), None) for number, line in enumerate(text.splitlines(), 1)
                if line.strip() and not line.strip().startswith("#")]
        labeled = False
    keys: list[str] = []
    for number, key, _ in rows:
        if key.startswith("s3://"):
            uri = parse_s3_uri(key)
            if bucket is not None and uri.bucket != bucket:
                raise ConfigError(
                    f"{name!r} line {number}: bucket {uri.bucket!r} differs from "
                    f"{bucket!r}; one manifest serves one bucket"
                )
            bucket = uri.bucket
            key = uri.key
        keys.append(key)
    if bucket is None:
        raise ConfigError(f"manifest {name!r} holds plain keys; pass bucket=... or write s3:// URIs")
    if not keys:
        raise EmptyDatasetError(f"manifest {name!r} lists no keys")
    labels = [label for _, _, label in rows] if labeled else None
    if labels is not None and all(label is None or isinstance(label, str) and _INTEGER.fullmatch(label)
                                  for label in labels) and suffix == ".csv":
        labels = [None if label is None else int(label) for label in labels]
    return Manifest(bucket, keys, labels)


Row = tuple[int, str, "int | str | None"]


def _column(names: Iterable[str], wanted: tuple[str, ...]) -> str | None:
    lowered = {name.strip().lower(): name for name in names if name}
    return next((lowered[w] for w in wanted if w in lowered), None)


def _csv_rows(text: str, name: str) -> tuple[list[Row], bool]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    key_column = _column(header, KEY_COLUMNS)
    if key_column is None:
        raise ConfigError(f"manifest {name!r}: the first row must name the columns, one of them "
                          f"{' / '.join(KEY_COLUMNS)} (found {header!r})")
    label_column = _column(header, LABEL_COLUMNS)
    rows: list[Row] = []
    for row in reader:
        key = (row.get(key_column) or "").strip()
        if not key:
            continue
        label = (row.get(label_column) or "").strip() if label_column else ""
        rows.append((reader.line_num, key, label or None))
    return rows, label_column is not None


def _json_rows(text: str, name: str) -> tuple[list[Row], bool]:
    rows: list[Row] = []
    labeled = False
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"manifest {name!r} line {number}: not JSON ({exc.msg})") from exc
        key_column = _column(row, KEY_COLUMNS) if isinstance(row, dict) else None
        if key_column is None or not isinstance(row[key_column], str):
            raise ConfigError(f"manifest {name!r} line {number}: expected an object with a "
                              f"string {' / '.join(KEY_COLUMNS)} field, got {line.strip()[:80]!r}")
        label_column = _column(row, LABEL_COLUMNS)
        label = None if label_column is None else row[label_column]
        if isinstance(label, bool) or not (label is None or isinstance(label, (int, str))):
            raise ConfigError(f"manifest {name!r} line {number}: label {label!r} must be a class "
                              "name or an integer")
        labeled = labeled or label_column is not None
        rows.append((number, row[key_column], label))
    return rows, labeled


def check_keys(bucket: str, keys: Iterable[str]) -> tuple[str, ...]:
    """Validate a user-given key list once, up front, with messages naming the bad entry."""
    out = tuple(keys)
    if not out:
        raise EmptyDatasetError(f"the key list for bucket {bucket!r} is empty")
    for position, key in enumerate(out):
        if not isinstance(key, str) or not key:
            raise ConfigError(f"keys[{position}]={key!r} is not a non-empty string")
    return out


def shard_specs(spec: str | Iterable[str]) -> list[str]:
    """Expand a shard spec into URIs or prefixes: brace patterns, lists of them, or a prefix.

    A string ending in a shard suffix (after brace expansion: ``.tar``, ``.tar.gz``, ``.tgz``,
    ``.tar.zst``, ``.tzst``) names a shard; anything else is a prefix whose objects with those
    suffixes are the shards (``resolve_shards`` lists it). zstd shards need a zstd library, which
    is checked here, before any worker starts.
    """
    from ..formats.compression import require_codec

    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise EmptyDatasetError("the shard list is empty")
    out: list[str] = []
    for item in specs:
        if not isinstance(item, str):
            raise ConfigError(f"shard {item!r} is not an s3:// URI string")
        out.extend(expand_braces(item))
    for uri in out:
        parse_s3_uri(uri)  # fail now, with the URI named, not in a worker later
        require_codec(uri)
    return out


def resolve_shards(
    specs: list[str],
    *,
    factory: Callable[[], Awaitable[ObjectStore]],
    retry: RetryPolicy,
    options: ListOptions | None = None,
    ticket: int = 0,
    meanwhile: Callable[[], object] | None = None,
) -> list[ShardRef]:
    """Turn shard URIs and prefixes into ``ShardRef``s; prefixes are listed (sizes known), once
    per job (``ticket``: the dataset's, see ``sharing``). ``meanwhile``: as in ``list_prefix``,
    during the first listing."""
    from ..formats.compression import SHARD_SUFFIXES, is_shard_name, require_codec
    from ..formats.shards import ShardRef

    shards: list[ShardRef] = []
    for uri in specs:
        bucket, key = parse_s3_uri(uri)
        if is_shard_name(key):
            shards.append(ShardRef(bucket, key))
        else:
            found = list_prefix(uri, factory=factory, retry=retry, suffix=SHARD_SUFFIXES,
                                options=options, ticket=ticket, meanwhile=meanwhile)
            meanwhile = None
            warn_siblings(bucket, key, found)
            for info in found.infos():
                require_codec(f"s3://{bucket}/{info.key}")
                shards.append(ShardRef(bucket, info.key, info.size, info.etag))
    return shards


HIDDEN_NOTE = "hidden"  # a snapshot's count of hidden keys (``list_keys``)


def count_hidden(found: KeyList) -> int:
    """How many keys are hidden objects (a basename starting with a dot); a snapshot that
    counted them says, without going over the keys."""
    file = origin(found)
    if file is not None and HIDDEN_NOTE in file.notes:
        return int(file.notes[HIDDEN_NOTE][0])
    return sum(1 for key in found if key.startswith(".", key.rfind("/") + 1))


def snapshot_notes(annotate: Callable[[KeyList], Annotations] | None) -> Callable[[KeyList], Annotations]:
    """What a snapshot of a per-object listing keeps beside its keys: how many are hidden, and,
    when none is (the keys read are then the keys saved), what ``annotate`` derives from them."""

    def notes(found: KeyList) -> Annotations:
        count = count_hidden(found)
        return {HIDDEN_NOTE: array.array("q", [count]),
                **(annotate(found) if annotate is not None and not count else {})}

    return notes


def list_keys(
    bucket: str,
    prefix: str,
    *,
    factory: Callable[[], Awaitable[ObjectStore]],
    retry: RetryPolicy,
    options: ListOptions | None = None,
    ticket: int = 0,
    snapshot: Snapshot | None = None,
    annotate: Callable[[KeyList], Annotations] | None = None,
    meanwhile: Callable[[], object] | None = None,
) -> KeyList:
    """The keys a per-object dataset reads under ``s3://bucket/prefix``: hidden objects (a
    basename starting with a dot: ``.DS_Store``, ``._x.jpg``) are left out, and a prefix that
    also matched sibling folders is warned about (``warn_siblings``). A snapshot saved keeps
    the count of hidden keys and what ``annotate`` derives from the keys (``keyfile``), so that
    reading it back goes over no key one by one. ``meanwhile``: as in ``list_prefix``."""
    where = f"s3://{bucket}/{prefix}"
    keys = list_prefix(where, factory=factory, retry=retry, options=options, ticket=ticket,
                       keep=functools.partial(visible_keys, where=where), snapshot=snapshot,
                       annotate=snapshot_notes(annotate), meanwhile=meanwhile)
    warn_siblings(bucket, prefix, keys)
    log.info("listed %d objects under %s (%d bytes)", len(keys), where, keys.nbytes)
    return keys


def visible_keys(found: KeyList, where: str) -> KeyList:
    """``found`` without its hidden objects (``list_keys``); an error if nothing else is left."""
    keys = found
    if count_hidden(found):
        keys = KeyList.from_infos(info for info in found.infos()
                                  if not info.key.startswith(".", info.key.rfind("/") + 1))
        log.info("left out %d hidden objects under %s", len(found) - len(keys), where)
    if not keys:
        raise EmptyDatasetError(f"only hidden objects (names starting with a dot) under {where}")
    return keys


def warn_siblings(bucket: str, prefix: str, keys: Iterable[str]) -> None:
    """Warn, once per listing, when a prefix without its trailing slash matched more than the
    folder it names (``s3://b/imgs`` also matches ``imgs-shards/`` and ``imgs.txt``)."""
    others = sibling_matches(prefix, keys)
    if others:
        shown = ", ".join(repr(name) for name in others[:5]) + (" ..." if len(others) > 5 else "")
        warnings.warn(
            f"s3://{bucket}/{prefix} has no trailing slash, so it also matched {len(others)} "
            f"sibling name(s) next to the folder {prefix + '/'!r}: {shown}; write "
            f"s3://{bucket}/{prefix}/ to read only that folder", UserWarning, stacklevel=4)
