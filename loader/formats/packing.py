"""Packing objects into WebDataset tar shards: the pure half of ``loader shard``.

A listing becomes shards in pure, deterministic steps (``group_samples``, ``shuffle_samples``,
``plan_shards``), so a rerun makes the same plan and skips what is uploaded. A sample never
straddles two shards, and every tar byte (headers included) is known before any data is read, so
the index with each sample's offset (``shard_index.format.build_index``) comes from the plan
alone (docs/design/packing.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..checks import check_int
from ..errors import ConfigError
from .compression import SUFFIX_OF, Compression, compression_of, is_shard_name
from .grouping import split_key
from .tar import BLOCK_SIZE

PROGRESS_NAME = "_progress.json"
PROGRESS_VERSION = 1  # the format of `_progress.json` (resume refuses another)
PLAN_VERSION = 1  # bump when the layout of planned shards changes (resume refuses old plans)
END_OF_ARCHIVE = 2 * BLOCK_SIZE
DEFAULT_NAME_FORMAT = "shard-{:05d}.tar"
_GNU_NAME_LIMIT = 100  # tarfile.LENGTH_NAME: longer names get a GNU long-name header
_RESERVED_FIELDS = frozenset({"__key__", "__url__", "__index__"})

# ------------------------------------------------------------------------ tar layout


def padding(size: int) -> int:
    """Zero bytes after ``size`` data bytes, up to the next 512-byte block."""
    return -size % BLOCK_SIZE


def header_size(name: str) -> int:
    """Bytes of the GNU header(s) ``tar_header(name, ...)`` writes (512, more for long names)."""
    length = len(name.encode("utf-8", "surrogateescape"))
    if length <= _GNU_NAME_LIMIT:
        return BLOCK_SIZE
    return 2 * BLOCK_SIZE + (length + 1) + padding(length + 1)


def member_size(name: str, size: int) -> int:
    """Tar bytes of one member: header(s), data and padding."""
    return header_size(name) + size + padding(size)


def tar_header(name: str, size: int) -> bytes:
    """The deterministic GNU header(s) of a regular file ``name`` of ``size`` bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def encode_member(name: str, data: bytes) -> list[bytes]:
    """One member as pieces to write in order: header(s), data, padding."""
    pieces = [tar_header(name, len(data)), data]
    pad = padding(len(data))
    if pad:
        pieces.append(bytes(pad))
    return pieces


def end_of_archive() -> bytes:
    """The two zero blocks that end a shard."""
    return bytes(END_OF_ARCHIVE)


# ------------------------------------------------------------------------ samples


class Member(NamedTuple):
    """One source object as a tar member: ``name`` in the tar, source ``key``, ``size`` in bytes."""

    name: str
    key: str
    size: int


@dataclasses.dataclass(frozen=True)
class Sample:
    """Objects sharing one WebDataset key; its members are written next to each other."""

    key: str
    members: tuple[Member, ...]

    @property
    def tar_bytes(self) -> int:
        """Bytes the sample takes in a shard (headers, data, padding)."""
        return sum(member_size(m.name, m.size) for m in self.members)

    @property
    def source_bytes(self) -> int:
        return sum(m.size for m in self.members)


class Skipped(NamedTuple):
    """An object that cannot be a WebDataset member, and why."""

    key: str
    reason: str


def source_directory(prefix: str) -> str:
    """The part of a listing prefix that member names are relative to: up to its last ``/``.

    ``"train/"`` -> ``"train/"``; ``"train/part-"`` -> ``"train/"`` (names keep their whole
    basename); ``"train"`` -> ``""`` (names are whole keys).
    """
    return prefix[: prefix.rfind("/") + 1]


def member_problem(name: str) -> str | None:
    """Why ``name`` cannot be a member of a WebDataset sample, or None when it can."""
    if not name:
        return "its name is empty relative to the source prefix"
    base = name[name.rfind("/") + 1 :]
    if base.startswith("."):
        return "its basename starts with '.' (hidden files are skipped by WebDataset readers)"
    key, ext = split_key(name)
    if not ext:
        return "its basename has no extension (a WebDataset member is named key.ext)"
    if ext in _RESERVED_FIELDS:
        return f"its extension {ext!r} is a reserved sample field"
    return None


def group_samples(
    objects: Iterable[tuple[str, int]], prefix: str
) -> tuple[list[Sample], list[Skipped]]:
    """Group listed ``(key, size)`` objects into samples by WebDataset key, in key order.

    Members inside a sample are in name order. Objects that cannot be members (no extension,
    hidden basename, reserved extension) come back in the second list, in key order.
    """
    base = source_directory(prefix)
    groups: dict[str, list[Member]] = {}
    skipped: list[Skipped] = []
    for key, size in objects:
        if not key.startswith(base):
            raise ConfigError(f"listed key {key!r} does not start with the prefix {prefix!r}")
        name = key[len(base) :]
        problem = member_problem(name)
        if problem is not None:
            skipped.append(Skipped(key, problem))
            continue
        groups.setdefault(split_key(name)[0], []).append(Member(name, key, int(size)))
    samples = [Sample(k, tuple(sorted(groups[k]))) for k in sorted(groups)]
    skipped.sort()
    return samples, skipped


def shuffle_samples(samples: Sequence[Sample], seed: int) -> list[Sample]:
    """The samples in a seeded random order (the same for the same seed and input)."""
    out = list(samples)
    random.Random(seed).shuffle(out)
    return out


# ------------------------------------------------------------------------ shards


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One planned shard: its number, samples, exact tar size and each sample's byte offset."""

    number: int
    samples: tuple[Sample, ...]
    bytes: int
    offsets: tuple[int, ...]

    @property
    def objects(self) -> int:
        return sum(len(s.members) for s in self.samples)

    @property
    def source_bytes(self) -> int:
        return sum(s.source_bytes for s in self.samples)

    @property
    def members(self) -> list[Member]:
        return [m for s in self.samples for m in s.members]


def plan_shards(samples: Iterable[Sample], target_size: int) -> list[ShardPlan]:
    """Fill shards greedily, in order, up to ``target_size`` bytes of tar each.

    A shard is closed when the next sample would take it past the target; a sample larger than
    the target on its own gets a shard to itself. Every sample lands in exactly one shard.
    """
    check_int("target_size", target_size, minimum=1, must="a positive number of bytes")
    plans: list[ShardPlan] = []
    current: list[Sample] = []
    offsets: list[int] = []
    used = 0

    def close() -> None:
        plans.append(ShardPlan(len(plans), tuple(current), used + END_OF_ARCHIVE, tuple(offsets)))

    for sample in samples:
        size = sample.tar_bytes
        if current and used + size + END_OF_ARCHIVE > target_size:
            close()
            current, offsets, used = [], [], 0
        current.append(sample)
        offsets.append(used)
        used += size
    if current:
        close()
    return plans


def default_name_format(compress: Compression | None = None) -> str:
    """``shard-{:05d}.tar``, or ``.tar.gz`` / ``.tar.zst`` for compressed shards."""
    return DEFAULT_NAME_FORMAT[: -len(".tar")] + SUFFIX_OF[compress]


def check_name_format(fmt: str, compress: Compression | None = None) -> str:
    """A shard name format: one integer field, distinct names, ending in a shard suffix that
    matches ``compress`` (``.tar``; ``.tar.gz``/``.tgz`` for gzip; ``.tar.zst``/``.tzst`` for zstd)."""
    try:
        first, second = fmt.format(0), fmt.format(1)
    except (IndexError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"name format {fmt!r} does not format a shard number ({exc}); "
            "write it like 'shard-{:05d}.tar'"
        ) from None
    if first == second:
        raise ConfigError(f"name format {fmt!r} gives every shard the same name; add a field such as {{:05d}}")
    if not is_shard_name(first):
        raise ConfigError(
            f"name format {fmt!r} makes {first!r}, which does not end in '{SUFFIX_OF[compress]}'; "
            "from_shards() finds shards under a prefix by that suffix"
        )
    if compression_of(first) != compress:
        what = f"{compress} shards" if compress else "plain tar shards (no --compress)"
        raise ConfigError(
            f"name format {fmt!r} makes {first!r}, but these are {what}: end it in "
            f"'{SUFFIX_OF[compress]}', since readers tell a shard's compression by its suffix"
        )
    if first.startswith("/") or "//" in first:
        raise ConfigError(f"name format {fmt!r} makes {first!r}; shard names are relative to DST_PREFIX")
    return fmt


def part_size_for(shard_bytes: int, part_size: int, max_parts: int = 10_000) -> int:
    """A multipart part size that fits ``shard_bytes`` into at most ``max_parts - 1`` parts
    (parts are flushed when at least this full, so the last one can run over)."""
    return max(part_size, -(-shard_bytes // (max_parts - 1)))


# ------------------------------------------------------------------------ plan identity and progress


def plan_fingerprint(source: str, objects: Iterable[tuple[str, int]], options: Mapping[str, Any]) -> str:
    """A digest of everything that decides the shards' bytes: the listing and the options."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"plan": PLAN_VERSION, "source": source, **options},
                             sort_keys=True).encode())
    for key, size in objects:
        digest.update(f"\n{key}\0{size}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def progress_document(fingerprint: str, source: str, dst: str, total: int,
                      done: Iterable[int], options: Mapping[str, Any]) -> dict[str, Any]:
    """What ``DST/_progress.json`` holds: the plan's identity and the shard numbers finished."""
    return {"version": PROGRESS_VERSION, "fingerprint": fingerprint, "source": source,
            "destination": dst, "options": dict(options), "shards": total, "done": sorted(done)}


def parse_progress(document: Any, fingerprint: str, where: str) -> set[int]:
    """The shard numbers a progress document says are done, if it belongs to this plan.

    A document for another plan (the source listing or the options changed) is an error that
    says what to do, since resuming it would mix two different packings.
    """
    if not isinstance(document, dict) or document.get("version") != PROGRESS_VERSION:
        raise ConfigError(f"{where} is not a progress file of this version of loader shard; "
                          "use a new DST_PREFIX, or --overwrite to start over")
    if document.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"{where} belongs to a different run (the source listing or the options "
            f"{document.get('options')} changed since); rerun with the same arguments to resume "
            "it, use a new DST_PREFIX, or pass --overwrite to repack from scratch"
        )
    done = document.get("done", [])
    if not isinstance(done, list) or not all(isinstance(n, int) for n in done):
        raise ConfigError(f"{where} has a malformed 'done' list; pass --overwrite to start over")
    return set(done)
