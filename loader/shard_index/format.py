"""The shard index's entries: what each shard held when it was indexed, and whether it still does.

``index.json`` (version 1, written by ``loader shard`` and ``loader index``) lists one entry per
shard: ``samples``, and the object's ``size`` and ``etag`` that say which version that count
belongs to (plus tar ``bytes`` and sample ``offsets``). Pure: no I/O. Format: docs/design/shard-index.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import ConfigError
from ..formats.compression import Compression, compression_of
from ..formats.packing import ShardPlan
from ..s3.protocol import normalize_etag

__all__ = ["INDEX_NAME", "INDEX_VERSION", "IndexEntry", "add_versions", "build_index", "entry_document",
           "index_counts", "index_document", "parse_index", "stale_reason"]

INDEX_NAME = "index.json"
INDEX_VERSION = 1


class IndexEntry(NamedTuple):
    """One shard as the index recorded it. ``offsets`` is None when absent or unusable."""

    url: str
    samples: int
    size: int | None = None
    etag: str | None = None
    offsets: Sequence[int] | None = None


def parse_index(document: Any, where: str) -> dict[str, IndexEntry]:
    """``{shard url: entry}`` of a parsed index; a ConfigError names what is malformed."""
    if not isinstance(document, dict) or document.get("version") != INDEX_VERSION:
        raise ConfigError(f"{where} is not a shard index of version {INDEX_VERSION} (as loader index "
                          "and loader shard write); run `python -m loader index` to write one")
    shards = document.get("shards")
    if not isinstance(shards, list):
        raise ConfigError(f"{where} has no list of shards")
    entries: dict[str, IndexEntry] = {}
    for position, shard in enumerate(shards):
        entry = _entry(shard, f"{where}: shards[{position}]")
        entries[entry.url] = entry
    return entries


def _entry(shard: Any, where: str) -> IndexEntry:
    if not isinstance(shard, dict):
        raise ConfigError(f"{where} is not an object")
    url, samples = shard.get("url"), shard.get("samples")
    if not isinstance(url, str) or not isinstance(samples, int) or not _count(samples):
        raise ConfigError(f"{where} lacks a url or a sample count")
    size = shard.get("size", shard.get("stored_bytes"))
    if size is None and compression_of(url) is None:
        size = shard.get("bytes")  # uncompressed: the tar bytes are the object
    if size is not None and not _count(size):
        raise ConfigError(f"{where} ({url}): size {size!r} is not a number of bytes")
    etag = shard.get("etag")
    if etag is not None and not isinstance(etag, str):
        raise ConfigError(f"{where} ({url}): etag {etag!r} is not a string")
    offsets = shard.get("offsets")
    usable = (isinstance(offsets, list) and len(offsets) == samples
              and all(_count(o) for o in offsets)
              and all(a < b for a, b in zip(offsets, offsets[1:])))
    return IndexEntry(url, samples, size, normalize_etag(etag), offsets if usable else None)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def stale_reason(entry: IndexEntry, size: int | None, etag: str | None) -> str | None:
    """Why a shard listed with ``size`` and ``etag`` is no longer the version ``entry`` counted,
    or None when nothing says so (the ETags agree, or without ETags the sizes do)."""
    etag = normalize_etag(etag)
    if entry.etag is not None and etag is not None:
        if entry.etag != etag:
            return f"its ETag is {etag} now, the index recorded {entry.etag}"
        return None
    if entry.size is not None and size is not None and entry.size != size:
        return f"it is {size} bytes now, the index recorded {entry.size}"
    return None


def entry_document(url: str, key: str, *, samples: int, size: int, etag: str | None,
                   tar_bytes: int, offsets: Sequence[int] | None) -> dict[str, Any]:
    """One shard's entry as ``loader index`` writes it (offsets only for uncompressed shards)."""
    document: dict[str, Any] = {"key": key, "url": url, "samples": samples, "size": size,
                                "etag": normalize_etag(etag), "bytes": tar_bytes}
    if offsets is not None:
        document["offsets"] = list(offsets)
    kind = compression_of(key)
    if kind is not None:
        document["compression"] = kind
    return document


def index_document(entries: Iterable[Mapping[str, Any]],
                   base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The index holding ``entries`` (sorted by URL), keeping ``base``'s other top-level fields
    (an index ``loader shard`` wrote keeps its source and fingerprint)."""
    shards = sorted((dict(entry) for entry in entries), key=lambda entry: entry["url"])
    document = {key: value for key, value in (base or {}).items()
                if key not in ("version", "shards", "samples", "bytes")}
    document.setdefault("created_by", "loader index")
    document.update(version=INDEX_VERSION, samples=sum(s["samples"] for s in shards),
                    bytes=sum(s.get("bytes", 0) for s in shards), shards=shards)
    return document


def add_versions(document: dict[str, Any], listed: Mapping[str, tuple[int, str | None]]) -> dict[str, Any]:
    """``document`` with each shard's ``size`` and ``etag`` from ``listed`` (key -> the size and
    ETag a listing gave), as ``loader shard`` records them once its shards are written."""
    for shard in document.get("shards", ()):
        version = listed.get(shard.get("key"))
        if version is not None:
            shard["size"], shard["etag"] = version[0], normalize_etag(version[1])
    return document


# ------------------------------------------------------------------------ the index loader shard writes


def build_index(source: str, bucket: str, names: Sequence[str], plans: Sequence[ShardPlan], *,
                fingerprint: str, target_size: int, skipped: int = 0,
                compression: Compression | None = None,
                stored_bytes: Sequence[int] | None = None) -> dict[str, Any]:
    """``index.json``: every shard's key, URL, samples, objects, bytes and sample offsets.

    ``bytes`` and ``offsets`` are of the tar stream; compressed shards add ``compression`` and
    each shard's ``stored_bytes`` (the object's size).
    """
    shards = [
        {"key": name, "url": f"s3://{bucket}/{name}", "samples": len(plan.samples),
         "objects": plan.objects, "bytes": plan.bytes, "offsets": list(plan.offsets)}
        for name, plan in zip(names, plans, strict=True)
    ]
    if compression is not None:
        for shard, stored in zip(shards, stored_bytes or itertools.repeat(None, len(shards)),
                                 strict=True):
            shard["stored_bytes"] = stored
    return {
        "version": INDEX_VERSION,
        "created_by": "loader shard",
        "source": source,
        "fingerprint": fingerprint,
        "target_size": target_size,
        **({"compression": compression} if compression else {}),
        "samples": sum(s["samples"] for s in shards),
        "objects": sum(s["objects"] for s in shards),
        "skipped_objects": skipped,
        "bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
    }


def index_counts(index: Any, where: str = "the index") -> dict[str, int]:
    """``{shard url: samples}`` from a parsed index, checked (for ``sample_counts=``)."""
    if not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
        raise ConfigError(f"{where} is not an index written by loader shard (version {INDEX_VERSION})")
    counts: dict[str, int] = {}
    for position, shard in enumerate(index.get("shards", ())):
        url = shard.get("url") if isinstance(shard, dict) else None
        samples = shard.get("samples") if isinstance(shard, dict) else None
        if not isinstance(url, str) or not isinstance(samples, int) or samples < 0:
            raise ConfigError(f"{where}: shards[{position}] lacks a url or a sample count")
        counts[url] = samples
    return counts
