"""Incremental tar parsing: a byte stream in, WebDataset samples out.

``TarStreamParser`` is a state machine fed chunks of any size: it never holds a shard whole (one
header of lookahead plus the member being assembled), does no I/O, and restarts at a member's
offset after a dropped connection without losing or repeating one. ``formats/grouping.py`` groups
members into samples. Reads ustar, GNU, pax and v7; skips (and counts) links; every problem is a
``ShardFormatError`` with the shard URL and byte offset. Formats and edge cases: docs/design/tar.md.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple
from zlib import adler32

from loader.errors import ShardFormatError

__all__ = [
    "BLOCK_SIZE",
    "TarMember",
    "TarStreamParser",
]

BLOCK_SIZE = 512
_ZERO_BLOCK = bytes(BLOCK_SIZE)
# Data pieces smaller than this are copied into a bytearray; larger ones are kept as zero-copy
# views into the fed chunk until the member is complete (then joined once). This keeps 1-byte
# feeding from building millions of views, and large chunks from being copied twice.
_COPY_BELOW = 64 * 1024

# Type flags (byte values of header[156]).
_REGULAR_TYPES = frozenset(b"0\x007")  # regular, old regular, contiguous
_NO_DATA_TYPES = frozenset(b"123456")  # links, devices, directory, FIFO: no data stored (POSIX)
_AREGTYPE = 0
_GNU_LONGNAME = ord("L")
_GNU_LONGLINK = ord("K")
_GNU_SPARSE = ord("S")
_HARD_LINK = ord("1")
_SYMLINK = ord("2")
_PAX_HEADER = ord("x")
_PAX_GLOBAL = ord("g")
_POSIX_MAGIC = b"ustar\x00"  # GNU writes b"ustar " and uses the prefix field for other things

# Parser states.
_HEADER = 0  # reading a header block
_DATA = 1  # collecting a member's (or an extension header's) data
_SKIP = 2  # skipping padding or a skipped member's data
_DONE = 3  # end-of-archive seen; everything else is ignored

# What collected data is for.
_K_MEMBER = 0
_K_PAX = 1
_K_GLOBAL = 2
_K_LONGNAME = 3
_K_LONGLINK = 4



class TarMember(NamedTuple):
    """A regular file from the archive.

    ``offset`` is the stream offset of the member's first header block, extension headers
    (GNU ``L``/``K``, pax ``x``) included: a ranged GET from there reads this member again.
    """

    name: str
    data: bytes
    offset: int


def _cstr(field: bytes) -> bytes:
    """The bytes of a NUL-terminated header field, up to the first NUL."""
    end = field.find(0)
    return field if end < 0 else field[:end]


def _decode_name(raw: bytes) -> str:
    """Names are UTF-8; bytes that are not survive as surrogate escapes (as tarfile does)."""
    return raw.decode("utf-8", "surrogateescape")


def _parse_number(field: bytes) -> int:
    """A numeric header field: octal text, or GNU base-256 (first byte 0x80 or 0xff).

    Raises ValueError when the field is neither.
    """
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    if field[0] == 0xFF:
        return int.from_bytes(field, "big", signed=True)
    text = _cstr(field).strip()
    return int(text, 8) if text else 0


def _byte_sum(block: bytes) -> int:
    """The sum of a block's 512 byte values, computed in C (4x faster than ``sum(block)``).

    Adler-32's low 16 bits are 1 + the byte sum modulo 65521, exact for 256 bytes (at most 65280).
    """
    return (adler32(block[:256]) & 0xFFFF) + (adler32(block[256:]) & 0xFFFF) - 2


def _checksum_ok(block: bytes) -> bool:
    """Whether the stored checksum matches the unsigned or (old writers) the signed byte sum."""
    try:
        stored = _parse_number(block[148:156])
    except ValueError:
        return False
    # The checksum field itself counts as eight spaces (8 * 32 = 256).
    if stored == _byte_sum(block) - sum(block[148:156]) + 256:
        return True
    return stored == sum(struct.unpack_from("148b8x356b", block)) + 256


def _parse_pax(data: bytes) -> dict[str, bytes]:
    """Records ``"%d %s=%s\\n"`` of a pax header; raises ValueError when malformed."""
    records: dict[str, bytes] = {}
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] == 0:  # some writers pad with NULs
            break
        space = data.find(b" ", pos)
        if space <= pos:
            raise ValueError("record without a length")
        digits = data[pos:space]
        if not digits.isdigit():
            raise ValueError(f"record length {digits!r} is not a number")
        length = int(digits)
        stop = pos + length
        if length <= space - pos or stop > end or data[stop - 1] != 0x0A:
            raise ValueError(f"record length {length} does not fit")
        record = data[space + 1 : stop - 1]
        equals = record.find(b"=")
        if equals <= 0:
            raise ValueError("record without 'key='")
        records[record[:equals].decode("utf-8", "surrogateescape")] = record[equals + 1 :]
        pos = stop
    return records


def _padding(size: int) -> int:
    return -size % BLOCK_SIZE


def _compression_hint(block: bytes) -> str:
    if block.startswith(b"\x1f\x8b"):
        return "; it looks gzip-compressed: name it .tar.gz or .tgz (read as gzip), or store it as plain tar"
    if block.startswith(b"\x28\xb5\x2f\xfd"):
        return "; it looks zstd-compressed: name it .tar.zst (read as zstd), or store it as plain tar"
    return ""


class TarStreamParser:
    """Turns a tar byte stream, fed in chunks of any size, into :class:`TarMember` s.

    ``start_offset`` is the absolute offset of the first byte that will be fed (non-zero when the
    stream is a ranged GET that resumes a shard); every offset reported is absolute.

    Usage: ``feed()`` every chunk and use the members it returns, then ``close()`` at the end of
    the stream, which raises if the stream stopped mid-member. After a broken connection, call
    ``restart_at(parser.resume_offset)`` and feed a new GET starting at that offset instead.
    """

    # Parser state, set by _reset(); declared here for the methods written above it.
    _state: int
    _offset: int
    _hdr: bytearray

    def __init__(self, url: str, start_offset: int = 0) -> None:
        self.url = url
        self.members_parsed = 0  # members returned by feed()
        self.bytes_parsed = 0  # bytes fed, over all restarts
        self.hard_links = 0  # link members skipped (they hold no data), over all restarts
        self.symlinks = 0
        self.first_link: tuple[str, str] | None = None  # (name, target) of the first link seen
        self._closed = False
        self._error: ShardFormatError | None = None
        self._reset(start_offset)

    # -- public API ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether the end-of-archive marker has been read."""
        return self._state == _DONE

    @property
    def offset(self) -> int:
        """Absolute stream offset of the next byte ``feed()`` expects."""
        return self._offset

    @property
    def resume_offset(self) -> int:
        """Where a restarted ranged GET must begin so that no member is lost or repeated.

        The first header block (extension headers included) of the member being assembled, or,
        between members, the next header: a member whose data is complete has been returned, so
        the padding after it is not read again.
        """
        if self._state == _DONE:
            return self._end_offset
        if self._unit_start is not None:
            return self._unit_start
        if self._state == _SKIP:
            return self._offset + self._need
        return self._offset - len(self._hdr)

    def restart_at(self, offset: int) -> None:
        """Drop the partial member and expect the next ``feed()`` to start at ``offset``.

        ``offset`` must equal :attr:`resume_offset` (ValueError otherwise): any other offset
        would lose or repeat members.
        """
        expected = self.resume_offset
        if offset != expected:
            raise ValueError(
                f"restart_at({offset!r}) for {self.url}: a restart must begin at resume_offset "
                f"{expected}, or members would be lost or repeated"
            )
        self._closed = False
        self._error = None
        self._reset(offset)

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[TarMember]:
        """Parse ``chunk`` and return the members it completed, in stream order.

        A format error is raised at once, unless members completed earlier in the same chunk:
        then they are returned and the error is raised by the next ``feed()`` or ``close()``, so
        that no parsed member is lost and :attr:`resume_offset` (the bad header) stays exact.
        """
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ValueError(f"feed() after close() for {self.url}")
        if not isinstance(chunk, bytes):
            chunk = bytes(chunk)  # data views below must not see the caller reuse its buffer
        end = len(chunk)
        self.bytes_parsed += end
        out: list[TarMember] = []
        view = memoryview(chunk)
        pos = 0
        try:
            while pos < end:
                state = self._state
                if state == _DATA:
                    pos = self._feed_data(chunk, view, pos, end, out)
                elif state == _HEADER:
                    pos = self._feed_header(chunk, pos, end, out)
                elif state == _SKIP:
                    pos = self._feed_skip(pos, end)
                else:  # _DONE: the end-of-archive padding (or anything after it) is ignored
                    self._offset += end - pos
                    pos = end
        except ShardFormatError as exc:
            self._error = exc  # raised again by every later feed() and close()
            if not out:
                raise
            # Members completed before the error are delivered first; the error comes next call.
        return out

    def close(self) -> None:
        """Declare the end of the stream; raises ShardFormatError if it stopped mid-member."""
        if self._error is not None:
            raise self._error
        self._closed = True
        if self._state == _DONE:
            return
        if self._state == _HEADER and self._unit_start is None:
            if not self._hdr:
                return  # at a block boundary between members (or an empty object)
            if not any(self._hdr):
                self._end_offset = self._offset - len(self._hdr)
                self._state = _DONE  # part of an end-of-archive block: no member was cut
                return
        self._error = self._truncation_error()
        raise self._error

    def __repr__(self) -> str:
        return (
            f"TarStreamParser(url={self.url!r}, offset={self._offset}, "
            f"members_parsed={self.members_parsed}, finished={self.finished})"
        )

    # -- state ------------------------------------------------------------------------------------

    def _reset(self, offset: int) -> None:
        self._state = _HEADER
        self._offset = offset  # absolute offset of the next byte to be fed
        self._hdr = bytearray()  # partial header block (< 512 bytes)
        self._unit_start: int | None = None  # first header of the member being assembled
        self._end_offset = offset
        self._need = 0  # bytes left in _DATA or _SKIP
        self._pieces: list[Any] = []  # collected data: views and bytearrays
        self._acc = bytearray()  # small pieces, copied
        self._kind = _K_MEMBER
        self._size = 0  # data size of the current member or extension header
        self._data_end = offset  # absolute offset where its data ends (padding follows)
        self._what = ""  # "member 'x.jpg'" etc., for messages
        self._header_at = offset  # offset of the last header block read
        self._global_alone = False  # whether the pax global header being read began a unit
        self._name = ""
        self._pax_path: str | None = None
        self._pax_size: int | None = None
        self._gnu_name: str | None = None
        self._pax_link: str | None = None
        self._gnu_link: str | None = None

    def _fail(self, offset: int, text: str) -> ShardFormatError:
        return ShardFormatError(f"{self.url or '<stream>'}: {text}", url=self.url, offset=offset)

    def _truncation_error(self) -> ShardFormatError:
        at = self._offset
        if self._state == _HEADER and self._hdr:
            start = at - len(self._hdr)
            if start == 0:
                text = (
                    f"truncated or not a tar archive: stream ended at byte {at}, inside the first "
                    f"header block (a tar archive starts with a {BLOCK_SIZE}-byte header)"
                    f"{_compression_hint(bytes(self._hdr))}"
                )
            else:
                text = (
                    f"truncated: stream ended at byte {at} inside the header block at byte "
                    f"{start} ({len(self._hdr)} of {BLOCK_SIZE} bytes)"
                )
        elif self._state == _HEADER:
            text = (
                f"truncated: stream ended at byte {at} after the extension header at byte "
                f"{self._unit_start}, before the member it describes"
            )
        elif at < self._data_end:
            text = (
                f"truncated: stream ended at byte {at} inside {self._what} which needs "
                f"{self._data_end - at} more bytes"
            )
        else:
            text = (
                f"truncated: stream ended at byte {at} inside the padding after {self._what} "
                f"({self._need} more bytes expected)"
            )
        return self._fail(at, text)

    # -- the three reading states -----------------------------------------------------------------

    def _feed_header(self, chunk: bytes, pos: int, end: int, out: list[TarMember]) -> int:
        hdr = self._hdr
        if not hdr and end - pos >= BLOCK_SIZE:
            block = chunk[pos : pos + BLOCK_SIZE]
            take = BLOCK_SIZE
        else:
            take = min(BLOCK_SIZE - len(hdr), end - pos)
            hdr += chunk[pos : pos + take]
            if len(hdr) < BLOCK_SIZE:
                self._offset += take
                return end
            block = bytes(hdr)
            hdr.clear()
        self._offset += take
        self._on_header(block, self._offset - BLOCK_SIZE, out)
        return pos + take

    def _feed_data(
        self, chunk: bytes, view: memoryview, pos: int, end: int, out: list[TarMember]
    ) -> int:
        take = min(self._need, end - pos)
        if take == self._need and not self._pieces and not self._acc:
            # the whole data is in this chunk: one slice, one copy (_on_data sets _need next)
            self._offset += take
            self._on_data(chunk[pos : pos + take], out)
            return pos + take
        piece = view[pos : pos + take]
        if take < _COPY_BELOW:
            self._acc += piece
        else:
            if self._acc:
                self._pieces.append(self._acc)
                self._acc = bytearray()
            self._pieces.append(piece)
        self._need -= take
        self._offset += take
        if not self._need:
            if self._acc:
                self._pieces.append(self._acc)
                self._acc = bytearray()
            data = b"".join(self._pieces)
            self._pieces = []
            self._on_data(data, out)
        return pos + take

    def _feed_skip(self, pos: int, end: int) -> int:
        take = min(self._need, end - pos)
        self._need -= take
        self._offset += take
        if not self._need:
            self._state = _HEADER
        return pos + take

    # -- headers ----------------------------------------------------------------------------------

    def _on_header(self, block: bytes, at: int, out: list[TarMember]) -> None:
        if block == _ZERO_BLOCK:
            self._on_end(at)
            return
        starts_unit = self._unit_start is None
        if starts_unit:  # set first, so that after an error resume_offset is this header
            self._unit_start = at
        if not _checksum_ok(block):
            raise self._bad_checksum(block, at)
        try:
            size = _parse_number(block[124:136])
        except ValueError:
            raise self._fail(
                at, f"corrupt tar header at byte {at}: size field {block[124:136]!r} is not a number",
            ) from None
        if size < 0:
            raise self._fail(at, f"corrupt tar header at byte {at}: negative size {size}")
        self._header_at = at
        self._global_alone = starts_unit
        typeflag = block[156]
        if typeflag in _REGULAR_TYPES or typeflag in _NO_DATA_TYPES:
            self._on_member_header(block, typeflag, size, out)
        elif typeflag == _PAX_HEADER:
            self._collect(_K_PAX, size, f"the pax extended header at byte {at}", out)
        elif typeflag == _GNU_LONGNAME:
            self._collect(_K_LONGNAME, size, f"the GNU long-name header at byte {at}", out)
        elif typeflag == _GNU_LONGLINK:
            self._collect(_K_LONGLINK, size, f"the GNU long-link header at byte {at}", out)
        elif typeflag == _PAX_GLOBAL:
            self._collect(_K_GLOBAL, size, f"the pax global header at byte {at}", out)
        elif typeflag == _GNU_SPARSE:
            name = self._member_name(block)
            raise self._fail(at, f"unsupported tar member at byte {at}: GNU sparse file {name!r}")
        else:  # unknown type (GNU volume label, dumpdir, ...): skip its data
            if self._pax_size is not None:
                size = self._pax_size
            self._skip_member(self._member_name(block), size)

    def _bad_checksum(self, block: bytes, at: int) -> ShardFormatError:
        if at == 0:
            return self._fail(
                at, f"not a tar archive (bad header checksum at byte 0){_compression_hint(block)}"
            )
        return self._fail(
            at,
            f"corrupt tar header at byte {at} (bad header checksum): the shard is damaged, or the "
            f"member before it has a wrong size",
        )

    def _on_end(self, at: int) -> None:
        if self._unit_start is not None:
            raise self._fail(
                at,
                f"corrupt tar: end-of-archive block at byte {at} right after the extension header "
                f"at byte {self._unit_start}, which must be followed by a member",
            )
        self._end_offset = at
        self._state = _DONE

    def _member_name(self, block: bytes) -> str:
        """The member's name: pax ``path``, else GNU long name, else ustar prefix + name."""
        if self._pax_path is not None:
            return self._pax_path
        if self._gnu_name is not None:
            return self._gnu_name
        name = _cstr(block[:100])
        if block[257:263] == _POSIX_MAGIC:
            prefix = _cstr(block[345:500])
            if prefix:
                name = prefix + b"/" + name
        return _decode_name(name)

    def _on_member_header(
        self, block: bytes, typeflag: int, size: int, out: list[TarMember]
    ) -> None:
        name = self._member_name(block)
        if self._pax_size is not None:
            size = self._pax_size
        if typeflag in (_HARD_LINK, _SYMLINK):
            self._count_link(typeflag, name, block)
        self._pax_path = self._pax_size = self._gnu_name = None
        self._pax_link = self._gnu_link = None
        if typeflag in _NO_DATA_TYPES or (typeflag == _AREGTYPE and name.endswith("/")):
            self._skip_member(name, 0)  # v7 wrote directories as regular files ending in '/'
            return
        self._name = name
        self._collect(_K_MEMBER, size, f"member {name!r}", out)

    def _count_link(self, typeflag: int, name: str, block: bytes) -> None:
        if typeflag == _HARD_LINK:
            self.hard_links += 1
        else:
            self.symlinks += 1
        if self.first_link is None:
            target = self._pax_link or self._gnu_link or _decode_name(_cstr(block[157:257]))
            self.first_link = (name, target)

    def _collect(self, kind: int, size: int, what: str, out: list[TarMember]) -> None:
        """Collect ``size`` data bytes for ``kind``; zero-size data is complete at once."""
        self._kind = kind
        self._size = size
        self._need = size
        self._data_end = self._offset + size
        self._what = what
        self._state = _DATA
        if not size:
            self._on_data(b"", out)

    def _skip_member(self, name: str, size: int) -> None:
        self._unit_start = None  # nothing is lost by restarting after a skipped member
        self._pax_path = self._pax_size = self._gnu_name = None
        self._pax_link = self._gnu_link = None
        self._what = f"member {name!r}"
        self._data_end = self._offset + size
        self._need = size + _padding(size)
        self._state = _SKIP if self._need else _HEADER

    # -- completed data ---------------------------------------------------------------------------

    def _on_data(self, data: bytes, out: list[TarMember]) -> None:
        kind = self._kind
        if kind == _K_MEMBER:
            assert self._unit_start is not None  # set by the member's first header
            out.append(TarMember(self._name, data, self._unit_start))
            self.members_parsed += 1
            self._unit_start = None
        elif kind == _K_LONGNAME:
            self._gnu_name = _decode_name(_cstr(data))
        elif kind == _K_LONGLINK:
            self._gnu_link = _decode_name(_cstr(data))
        elif kind == _K_PAX:
            self._apply_pax(self._pax_records(data))
        elif kind == _K_GLOBAL:
            self._pax_records(data)  # checked, then ignored (docs/design/tar.md)
            if self._global_alone:
                self._unit_start = None  # not part of a member: no need to read it again
        pad = _padding(self._size)
        self._need = pad
        self._state = _SKIP if pad else _HEADER

    def _pax_records(self, data: bytes) -> dict[str, bytes]:
        try:
            return _parse_pax(data)
        except ValueError as exc:
            at = self._header_at
            raise self._fail(at, f"corrupt tar: bad record in {self._what} ({exc})") from None

    def _apply_pax(self, records: dict[str, bytes]) -> None:
        at = self._header_at
        if any(key.startswith("GNU.sparse.") for key in records):
            raise self._fail(at, f"unsupported tar member: {self._what} is for a GNU sparse file")
        path = records.get("path")
        if path:
            self._pax_path = _decode_name(path)
        linkpath = records.get("linkpath")
        if linkpath:
            self._pax_link = _decode_name(linkpath)
        size = records.get("size")
        if size is not None:
            try:
                self._pax_size = int(size)
            except ValueError:
                self._pax_size = -1
            if self._pax_size < 0:
                raise self._fail(at, f"corrupt tar: {self._what} has a bad size {size!r}")
