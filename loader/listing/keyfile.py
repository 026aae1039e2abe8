"""A ``KeyList`` in a file, mapped read-only: the node-shared key list and the snapshots users keep.

One versioned format serves both (``loader ls --save`` writes it, ``from_manifest`` reads it)::

    0    b"LOADKEYS"                 magic
    8    u32 version, u32 n          little-endian
    16   n bytes of JSON             id, count, created, source {bucket, prefix}, sections, crc32
    ...  sections, each starting at a multiple of 4096 so that each maps on its own:
         keys (UTF-8, back to back), ends (u32 or u64), sizes (i64), etags (packed), etag ends,
         and any annotations (``note:<name>``: bytes or i64, what a layer above derived from
         the keys and keeps beside them, such as how they group into samples)

A mapped list reads through the page cache, so every process of a machine that maps the same
file shares one copy of it. The file is written beside its final name and renamed into place,
so a reader never sees half of one. ``id`` is random per file: a process handed a reference
checks that the file at that path is still the one meant (a snapshot rewritten meanwhile is an
error, not a silent switch to other keys).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import datetime
import io
import json
import mmap
import os
import struct
import sys
import tempfile
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ConfigError
from .keylist import KeyList

MAGIC = b"LOADKEYS"
VERSION = 1
ALIGN = 4096
_PREAMBLE = struct.Struct("<8sII")
_SECTIONS = ("keys", "ends", "sizes", "etags", "etag_ends")
_FORMATS = {"keys": ("B",), "ends": ("I", "Q"), "sizes": ("q",), "etags": ("B",), "etag_ends": ("I", "Q")}
NOTE = "note:"  # the sections of annotations
NOTE_FORMATS = ("B", "q")  # bytes or i64; a note of another type (a later release's) is passed over
Annotations = Mapping[str, Any]  # name -> bytes or array('q') (or a map of either)


@dataclasses.dataclass(frozen=True)
class KeyFile:
    """Where a mapped ``KeyList`` comes from: its file, that file's id, and what was listed
    (``source``: ``{"bucket": ..., "prefix": ...}`` for a snapshot, else None)."""

    path: str
    id: str
    count: int
    created: str
    source: Mapping[str, str] | None = None
    notes: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # annotations, mapped

    @property
    def uri(self) -> str | None:
        """``s3://bucket/prefix`` the listing came from, when the file says."""
        if not self.source:
            return None
        return f"s3://{self.source['bucket']}/{self.source.get('prefix', '')}"


def is_keyfile(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file in this format (its first bytes are the magic)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def origin(keys: object) -> KeyFile | None:
    """The file a ``KeyList`` is mapped from, or None (in memory, or not a ``KeyList``)."""
    return getattr(keys, "_origin", None) if isinstance(keys, KeyList) else None


def write_keys(keys: KeyList, path: str | os.PathLike[str], *,
               source: Mapping[str, str] | None = None, durable: bool = False,
               notes: Annotations | None = None) -> KeyFile:
    """Write ``keys`` (with sizes and ETags when it has them) to ``path``, atomically: a
    temporary file beside it, renamed into place. ``durable``: fsync first (a snapshot on disk;
    not needed for a file in memory that dies with the machine). ``notes``: annotations kept
    beside the keys (bytes, or arrays of i64), mapped back as ``origin(keys).notes``."""
    target = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                             dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as f:
            written = dump_keys(keys, f, source=source, notes=notes)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return dataclasses.replace(written, path=str(target))


def dump_keys(keys: KeyList, f: BinaryIO, *, source: Mapping[str, str] | None = None,
              notes: Annotations | None = None) -> KeyFile:
    """Write ``keys`` (and ``notes``, see ``write_keys``) in this format to the binary file ``f``
    (at its start)."""
    parts = _parts(keys)
    for name, value in (notes or {}).items():
        view = memoryview(value)  # bytes, an array('q'), or the map of either (a note read back)
        if view.format not in NOTE_FORMATS:
            raise ValueError(f"annotation {name!r} holds {view.format!r} items: give bytes or array('q')")
        parts[NOTE + name] = (view.cast("B"), view.format)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header: dict[str, Any] = {"id": uuid.uuid4().hex, "count": len(keys), "created": created,
                              "source": dict(source) if source else None, "byteorder": "little",
                              "sections": {}, "crc32": {}}
    offset = 0  # sections are placed relative to the first aligned byte after the header
    for name, (data, fmt) in parts.items():
        header["sections"][name] = [offset, len(data), fmt]
        header["crc32"][name] = zlib.crc32(data)
        offset = _align(offset + len(data))
    body = json.dumps(header, sort_keys=True).encode()
    base = _align(_PREAMBLE.size + len(body))
    f.write(_PREAMBLE.pack(MAGIC, VERSION, len(body)))
    f.write(body)
    for name, (data, _) in parts.items():
        f.seek(base + header["sections"][name][0])
        f.write(data)
    return KeyFile("", header["id"], len(keys), created, header["source"])


def to_bytes(keys: KeyList) -> bytes:
    """The file a key list would be written as (its own file's bytes when it is mapped)."""
    file = origin(keys)
    if file is not None:
        with contextlib.suppress(OSError), open(file.path, "rb") as f:
            blob = f.read()
            if blob[:len(MAGIC)] == MAGIC:
                return blob
    buffer = io.BytesIO()
    dump_keys(keys, buffer)
    return buffer.getvalue()


def open_keys(path: str | os.PathLike[str], *, expect_id: str | None = None,
              verify: bool = False) -> KeyList:
    """Map the key list in ``path`` read-only (nothing is copied). ``expect_id``: the file must
    be that one (see the module doc); ``verify``: check every section's CRC (reads it all)."""
    name = str(path)
    try:
        f = open(name, "rb")  # noqa: SIM115 - closed by the with below; only the open's error is ours
    except FileNotFoundError:
        raise FileNotFoundError(f"key list file {name!r} does not exist (a snapshot moved or "
                                "deleted, or a shared listing of a job that has ended)") from None
    with f:
        header, base = _read_header(f, name)
        size = os.fstat(f.fileno()).st_size
        return _build(header, base, size, name, lambda offset, length, fmt: _map(f, offset, length, fmt),
                      expect_id=expect_id, verify=verify)


def parse_keys(blob: bytes, name: str = "<bytes>") -> KeyList:
    """The key list in ``blob`` (a whole file's bytes), copied into memory."""
    reader = io.BytesIO(blob)
    header, base = _read_header(reader, name)

    def section(offset: int, length: int, fmt: str) -> Any:
        data = blob[offset:offset + length]
        return data if fmt == "B" else _owned(data, fmt)

    return _build(header, base, len(blob), name, section, expect_id=None, verify=True,
                  read_from_file=False)


def _build(header: dict[str, Any], base: int, size: int, name: str, read: Any, *,
           expect_id: str | None, verify: bool, read_from_file: bool = True) -> KeyList:
    if expect_id is not None and header["id"] != expect_id:
        raise ConfigError(f"key list file {name!r} was replaced since this job read it "
                          f"(id {header['id']}, expected {expect_id}); keep a snapshot "
                          "unchanged while a job uses it")

    def load(section: str, allowed: tuple[str, ...]) -> Any:
        """One section, mapped (or read), its type, extent and (``verify``) checksum checked."""
        offset, length, fmt = header["sections"][section]
        if fmt not in allowed:
            raise ConfigError(f"key list file {name!r} is damaged: section {section!r} has "
                              f"type {fmt!r}")
        offset += base
        if length and offset + length > size:
            raise ConfigError(f"key list file {name!r} is truncated: section {section!r} "
                              f"ends at byte {offset + length}, the file at {size}")
        data = read(offset, length, fmt)
        if verify and zlib.crc32(data) != header["crc32"][section]:
            raise ConfigError(f"key list file {name!r} is corrupt: section {section!r} "
                              "does not match its checksum")
        return data

    sections = {section: load(section, _FORMATS[section]) if section in header["sections"] else None
                for section in _SECTIONS}
    keys = _assemble(sections, header["count"], name)
    if read_from_file:
        notes = {section[len(NOTE):]: load(section, NOTE_FORMATS) for section, (_, _, fmt)
                 in header["sections"].items() if section.startswith(NOTE) and fmt in NOTE_FORMATS}
        keys._origin = KeyFile(name, header["id"], header["count"], header["created"],
                               header["source"], notes)
    return keys


def _owned(data: bytes, fmt: str) -> array.array:
    out = array.array(fmt)
    out.frombytes(data)
    return out


def read_header(path: str | os.PathLike[str]) -> KeyFile:
    """What a key list file holds (its id, count, creation time and source), without mapping it."""
    name = str(path)
    try:
        with open(name, "rb") as f:
            header, _ = _read_header(f, name)
    except FileNotFoundError:
        raise FileNotFoundError(f"key list file {name!r} does not exist") from None
    return KeyFile(name, header["id"], header["count"], header["created"], header["source"])


def _read_header(f: Any, name: str) -> tuple[dict[str, Any], int]:
    """The JSON header, and where the sections start."""
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size or preamble[:len(MAGIC)] != MAGIC:
        raise ConfigError(f"{name!r} is not a key list file (no {MAGIC.decode()} header); "
                          "write one with `python -m loader ls --save PATH s3://bucket/prefix/`")
    _, version, length = _PREAMBLE.unpack(preamble)
    if version != VERSION:
        raise ConfigError(f"key list file {name!r} has format version {version}; this loader "
                          f"reads version {VERSION}: save it again with this version")
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise ConfigError(f"key list file {name!r} has a damaged header ({exc})") from None
    if header.get("byteorder") != sys.byteorder:
        raise ConfigError(f"key list file {name!r} was written {header.get('byteorder')}-endian; "
                          f"this machine is {sys.byteorder}-endian")
    return header, _align(_PREAMBLE.size + length)


def _parts(keys: KeyList) -> dict[str, tuple[bytes | memoryview, str]]:
    """The sections of a key list, as bytes-like objects and their array type codes."""
    parts: dict[str, tuple[bytes | memoryview, str]] = {
        "keys": (memoryview(keys._blob), "B"),
        "ends": (memoryview(keys._ends).cast("B"), _code(keys._ends)),
    }
    if keys._sizes is not None:
        parts["sizes"] = (memoryview(keys._sizes).cast("B"), "q")
    if keys._etags is not None:
        parts["etags"] = (memoryview(keys._etags._blob), "B")
        parts["etag_ends"] = (memoryview(keys._etags._ends).cast("B"), _code(keys._etags._ends))
    return parts


def _code(values: Any) -> str:
    """The array type code of offsets: "I" (4 bytes) or "Q" (8), as ``listing`` packs them."""
    return values.typecode if isinstance(values, array.array) else values.format


def _map(f: Any, offset: int, length: int, fmt: str) -> Any:
    """One section: a read-only map (bytes-like for keys, a typed view for numbers)."""
    if length == 0:
        return b"" if fmt == "B" else array.array(fmt)
    if offset % mmap.ALLOCATIONGRANULARITY:  # a platform with larger map granularity: read it
        f.seek(offset)
        data: Any = f.read(length)
        return data if fmt == "B" else memoryview(data).cast(fmt)  # type: ignore[call-overload]
    mapped = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset)
    return mapped if fmt == "B" else memoryview(mapped).cast(fmt)  # type: ignore[call-overload]


def _assemble(sections: dict[str, Any], count: int, name: str) -> KeyList:
    blob, ends, sizes = sections["keys"], sections["ends"], sections["sizes"]
    if blob is None or ends is None or len(ends) != count or (count and ends[-1] != len(blob)):
        raise ConfigError(f"key list file {name!r} is damaged: its offsets do not match its keys")
    if sizes is not None and len(sizes) != count:
        raise ConfigError(f"key list file {name!r} is damaged: {len(sizes)} sizes for {count} keys")
    etags = None
    if sections["etags"] is not None and sections["etag_ends"] is not None:
        etag_ends = sections["etag_ends"]
        if len(etag_ends) != count or (count and etag_ends[-1] != len(sections["etags"])):
            raise ConfigError(f"key list file {name!r} is damaged: its ETags do not match its keys")
        etags = KeyList(sections["etags"], etag_ends)
    return KeyList(blob, ends, sizes, etags)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
