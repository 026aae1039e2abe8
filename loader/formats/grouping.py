"""Tar members into WebDataset samples: the key and extension of a name, and the grouping of
consecutive members with the same key into one sample dict (pure, no I/O; docs/design/tar.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from loader.errors import ShardFormatError

if TYPE_CHECKING:  # (per-object datasets use ``split_key`` only: they start without the tar parser)
    from .tar import TarMember

__all__ = ["NO_EXTENSION_FIELD", "SampleGrouper", "iter_samples", "split_key"]

NO_EXTENSION_FIELD = "data"  # the field of a member (or object) whose name has no extension
_RESERVED_FIELDS = frozenset({"__key__", "__url__", "__index__"})


def split_key(name: str) -> tuple[str, str]:
    """Split a member name into (key, extension) by the WebDataset convention.

    The key is the directory plus the basename up to the basename's first dot; the extension is
    the rest after that dot, case kept: ``"a/b.c.jpg" -> ("a/b", "c.jpg")``. A name without a dot
    in its basename gives ``(name, "")``.
    """
    base = name.rfind("/") + 1
    dot = name.find(".", base)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


class SampleGrouper:
    """Groups consecutive members with the same key into WebDataset sample dicts.

    A sample is ``{"__key__": key, "__url__": url, "__index__": i, ext: bytes, ...}`` where
    ``__index__`` counts samples within the shard from ``start_index`` (0 unless resuming).
    Samples are runs of consecutive members with the same key; a key that comes back later starts
    another sample. A run with the same extension twice is a ShardFormatError naming the key.

    A member without an extension (no dot in its basename, or a trailing dot) fills the field
    ``"data"``, as such an object does in per-object mode, so both modes read the same files alike
    (webdataset drops such members without a word). Hidden files, whose basename starts with a dot
    (``.DS_Store``, macOS ``._x.jpg`` resource forks) and whose key would be just the directory,
    are skipped and counted in ``members_skipped``. Extensions named like the reserved fields
    (``__key__``, ``__url__``, ``__index__``) are an error.
    """

    def __init__(self, url: str, *, start_index: int = 0) -> None:
        self.url = url
        self.members_skipped = 0
        self._index = start_index
        self._sample: dict[str, Any] | None = None
        self._sample_offset: int | None = None

    @property
    def pending_offset(self) -> int | None:
        """Stream offset of the first member of the sample being collected (None if none)."""
        return self._sample_offset

    def add(self, member: TarMember) -> dict[str, Any] | None:
        """Add a member; returns the previous sample when this member starts a new one."""
        if member.name.startswith(".", member.name.rfind("/") + 1):
            self.members_skipped += 1
            return None
        key, ext = split_key(member.name)
        ext = ext or NO_EXTENSION_FIELD
        if ext in _RESERVED_FIELDS:
            raise self._error(member, f"has the extension {ext!r}, which is a reserved sample "
                                      "field; rename it")
        sample = self._sample
        if sample is not None and sample["__key__"] == key:
            if ext in sample:
                raise self._error(member, f"repeats a field: sample {key!r} already has a {ext!r} "
                                          "field (a duplicate member)")
            sample[ext] = member.data
            return None
        done = self.flush()
        self._sample = {"__key__": key, "__url__": self.url, "__index__": self._index}
        self._sample[ext] = member.data
        self._sample_offset = member.offset
        self._index += 1
        return done

    def _error(self, member: TarMember, text: str) -> ShardFormatError:
        return ShardFormatError(f"{self.url}: member {member.name!r} at byte {member.offset} {text}",
                                url=self.url, offset=member.offset)

    def flush(self) -> dict[str, Any] | None:
        """Return the sample being collected (at the end of the shard), or None."""
        sample, self._sample, self._sample_offset = self._sample, None, None
        return sample


def iter_samples(chunks: Iterable[bytes], url: str) -> Iterator[dict[str, Any]]:
    """Parse and group a whole shard given as chunks; for tests and synchronous callers."""
    from .tar import TarStreamParser

    parser = TarStreamParser(url)
    grouper = SampleGrouper(url)
    for chunk in chunks:
        for member in parser.feed(chunk):
            sample = grouper.add(member)
            if sample is not None:
                yield sample
    parser.close()
    last = grouper.flush()
    if last is not None:
        yield last
