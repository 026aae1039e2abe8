"""Where a shard dataset's sample counts come from, and what to say when they are unknown.

Counts come from ``sample_counts=`` or from the shard index: ``index.json`` in the shards'
common folder (where ``loader shard`` and ``loader index`` write it), or the URI given as
``index=``. The index is read with one GET, so every rank finds the same counts. An entry
counts only for the version of the shard it was made from: a shard whose listing shows another
ETag (or size) is treated as not indexed, and one known only from a pattern is read pinned to
the indexed ETag, and checked before anything is read (``probe_unlisted``), so a shard
rewritten since fails with an error naming it on every rank before the first sample instead of
being counted from a stale entry.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.core import run_all
from ..errors import ConfigError, InvalidRangeError, NoSuchKeyError, ObjectChangedError
from ..formats.shards import Expect, ShardRef
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectStore, Pin, StoreFactory
from ..s3.blocking import run_async, with_store
from .format import INDEX_NAME, parse_index, stale_reason
from .read import read_index

log = logging.getLogger(__name__)

SHOWN = 3  # shards named in an error before "and N more"


@dataclasses.dataclass
class Counts:
    """What is known of the shards' sample counts, and from where."""

    source: str  # "sample_counts=", "the index s3://b/x/index.json"
    fix: str  # how to put a wrong count right
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # url -> samples, usable
    versions: dict[str, tuple[int | None, str | None]] = dataclasses.field(default_factory=dict)
    offsets: dict[str, array.array[int]] = dataclasses.field(default_factory=dict)
    unindexed: list[str] = dataclasses.field(default_factory=list)
    stale: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (url, why)
    missing: list[str] = dataclasses.field(default_factory=list)  # named, but no such object

    def complete(self, shards: Sequence[ShardRef]) -> list[int] | None:
        """Samples per shard in ``shards`` order, or None when a shard has no usable count."""
        if self.unindexed or self.stale:
            return None
        return [self.counts[shard.url] for shard in shards]

    def expect(self, shard: ShardRef) -> Expect | None:
        count = self.counts.get(shard.url)
        return None if count is None else Expect(count, self.source, self.fix)

    def problems(self) -> str:
        """The shards without a usable count, for an error message ('' when none)."""
        parts = []
        if self.unindexed:
            parts.append(f"{len(self.unindexed)} shard(s) are not in {self.source}, e.g. "
                         f"{_some(self.unindexed)}")
        if self.stale:
            shown = "; ".join(f"{url} ({why})" for url, why in self.stale[:SHOWN])
            more = f" and {len(self.stale) - SHOWN} more" if len(self.stale) > SHOWN else ""
            parts.append(f"{len(self.stale)} shard(s) changed since {self.source} counted them: "
                         f"{shown}{more}")
        return "; ".join(parts)


def given_counts(shards: Sequence[ShardRef], counts: Mapping[str, int]) -> Counts:
    """``sample_counts=`` (keyed by URL or key): every shard must have an entry."""
    found = Counts("sample_counts=", "correct sample_counts= (or drop it and run python -m "
                   "loader index on the shards)")
    for shard in shards:
        count = counts.get(shard.url, counts.get(shard.key))
        if count is None:
            raise ConfigError(f"sample_counts has no entry for shard {shard.url}")
        found.counts[shard.url] = count
    return found


def index_location(shards: Sequence[ShardRef]) -> str | None:
    """Where the index of ``shards`` lives: ``index.json`` in their common folder (None when
    they lie in several buckets: then only ``index=`` can say)."""
    if not shards or len({shard.bucket for shard in shards}) != 1:
        return None
    folder = os.path.commonprefix([shard.key.rpartition("/")[0] + "/" for shard in shards])
    folder = folder[: folder.rfind("/") + 1]
    return f"s3://{shards[0].bucket}/{folder.lstrip('/')}{INDEX_NAME}"


def fetch_index(uri: str, store: StoreFactory, retry: RetryPolicy) -> tuple[dict[str, Any] | None, str]:
    """The parsed index at ``uri`` (one GET), or None and why there is none to use: an
    ``index.json`` that is not a shard index (another tool's) is left alone, with a warning."""
    try:
        return read_index(uri, store=store, retry=retry), ""
    except NoSuchKeyError:
        return None, f"no {INDEX_NAME} at {uri}"
    except ConfigError as exc:
        log.warning("ignored %s: %s", uri, exc)
        return None, f"{uri} is not a shard index ({exc})"


def match_index(shards: Sequence[ShardRef], document: Any, uri: str, *, fix: str,
                offsets: bool) -> Counts:
    """What an index says of ``shards``: a count for each shard whose entry is of the version
    listed (or, not listed, the entry's own version, which the reads are then pinned to)."""
    entries = parse_index(document, uri)
    found = Counts(f"the index {uri}", fix)
    for shard in shards:
        entry = entries.get(shard.url)
        if entry is None:
            found.unindexed.append(shard.url)
            continue
        why = stale_reason(entry, shard.size, shard.etag)
        if why is not None:
            found.stale.append((shard.url, why))
            continue
        found.counts[shard.url] = entry.samples
        if shard.size is None and shard.etag is None:
            found.versions[shard.url] = (entry.size, entry.etag)
        pinned = entry.etag is not None and shard.etag in (None, entry.etag)  # reads ask for that version
        if offsets and pinned and entry.offsets is not None and shard.compression is None:
            # Each sample's byte offset lets a worker fetch just its blocks (ranged GETs)
            # rather than every shard a step touches from its first byte. 8 bytes a sample.
            # Only for a read pinned to the indexed version: offsets of another version would
            # land inside members; without them the shard is read from its start, count checked.
            found.offsets[shard.url] = array.array("q", entry.offsets)
    return found


PROBES_INFLIGHT = 32  # one-byte GETs in flight while checking unlisted shards


def probe_unlisted(shards: Sequence[ShardRef], counts: Counts, factory: StoreFactory,
                   retry: RetryPolicy) -> list[tuple[ShardRef, str | None]]:
    """Check the shards that no listing described (named by a pattern or a list) against the
    index before anything is read: one pinned one-byte GET each (``If-Match`` the indexed ETag).

    Returns the shards overwritten since the index counted them, with the indexed ETag (the
    caller stops every rank before its first sample, not when it reaches that shard hours later);
    shards that do not exist go to ``Counts.missing`` (a misspelled range is not an unindexed
    shard). A listed shard needs no probe: its listing's ETag was compared already."""
    unlisted = [shard for shard in shards if shard.size is None and shard.etag is None]
    changed: list[tuple[ShardRef, str | None]] = []
    if not unlisted:
        return changed
    found: dict[str, BaseException] = {}

    async def use(store: ObjectStore) -> None:
        async def probe(shard: ShardRef) -> None:
            etag = counts.versions.get(shard.url, (None, None))[1]
            try:
                await call_with_retries(lambda: store.get_range(shard.bucket, shard.key, 0, 1,
                                                                pin=Pin(etag)), retry)
            except (NoSuchKeyError, ObjectChangedError, InvalidRangeError) as exc:
                found[shard.url] = exc

        await run_all((functools.partial(probe, shard) for shard in unlisted), PROBES_INFLIGHT)

    run_async(functools.partial(with_store, factory, use))
    for shard in unlisted:
        exc = found.get(shard.url)
        if isinstance(exc, NoSuchKeyError):
            counts.missing.append(shard.url)
            counts.counts.pop(shard.url, None)
            if shard.url in counts.unindexed:
                counts.unindexed.remove(shard.url)
        elif isinstance(exc, ObjectChangedError):
            changed.append((shard, counts.versions.get(shard.url, (None, None))[1]))
    return changed


def overwritten_shards(counts: Counts, changed: Sequence[tuple[ShardRef, str | None]]) -> ObjectChangedError:
    """The error for shards overwritten after the index counted them: no rank may start."""
    shard, etag = changed[0]
    more = (f" (and {len(changed) - 1} more: {_some([s.url for s, _ in changed[1:]])})"
            if len(changed) > 1 else "")
    return ObjectChangedError(
        f"{shard.url} is not the version {counts.source} counted (ETag {etag}): it was overwritten "
        f"after it was counted{more}, so the counts no longer hold and no rank starts; {counts.fix}",
        bucket=shard.bucket, key=shard.key,
    )


def missing_shards(spec: str | Sequence[str], shards: Sequence[ShardRef], missing: Sequence[str],
                   ) -> NoSuchKeyError:
    """The error for shards that were named but do not exist (a misspelled range or list)."""
    first = next(shard for shard in shards if shard.url == missing[0])
    folder = first.key.rpartition("/")[0]
    named = f"{spec!r}" if isinstance(spec, str) else f"the {len(shards)} shard URLs given"
    return NoSuchKeyError(
        f"{len(missing)} of the {len(shards)} shards named by {named} do not exist: {_some(missing)}; "
        f"check the pattern or list (a brace range, a digit count, the folder): "
        f"`python -m loader ls s3://{first.bucket}/{folder + '/' if folder else ''}` shows what is there",
        bucket=first.bucket, key=first.key,
    )


def with_versions(shards: list[ShardRef], counts: Counts) -> list[ShardRef]:
    """``shards`` with the size and ETag the index recorded where nothing listed them: reads
    are then pinned to that version, and large ones can be read in ranged parts."""
    if not counts.versions:
        return shards
    out = []
    for shard in shards:
        size, etag = counts.versions.get(shard.url, (shard.size, shard.etag))
        out.append(shard._replace(size=size, etag=etag))
    return out


def index_command(spec: str | Sequence[str], shards: Sequence[ShardRef]) -> str:
    """The ``loader index`` command for these shards, as the user named them."""
    if isinstance(spec, str):
        return f"python -m loader index '{spec}'"
    if len(spec) <= 3:
        return "python -m loader index " + " ".join(f"'{item}'" for item in spec)
    where = index_location(shards)
    return f"python -m loader index {where.rpartition('/')[0] + '/' if where else 's3://BUCKET/FOLDER/'}"


def unknown_counts_advice(command: str, problems: str) -> str:
    """What to do when the sample counts are unknown (for errors and ``len()``); ``problems``
    says why the index did not give them."""
    found = f" ({problems})" if problems else ""
    return (
        f"the sample count of each shard is unknown{found}, so ranks would read unequal numbers "
        f"of samples and a DDP job would hang at the epoch's end. Either index the shards once: "
        f"`{command}` (from_shards then finds the index by itself); or pass sample_counts={{shard "
        "url: samples}; or give split=Split(samples_per_epoch=N) for exactly N samples per rank and "
        "epoch (endless data, no counts needed). Split(uneven_ranks=True) accepts ranks of unequal length"
    )


def _some(urls: Sequence[str]) -> str:
    more = f" and {len(urls) - SHOWN} more" if len(urls) > SHOWN else ""
    return ", ".join(urls[:SHOWN]) + more
