"""Compressed shards: which names are shards, and streaming decompression with bounded output.

``.tar.gz``/``.tgz`` (zlib) and ``.tar.zst``/``.tzst`` (``compression.zstd``, else ``zstandard``)
are told by name, as webdataset does; decoders yield pieces of at most ``piece`` bytes so that a
highly compressible shard cannot blow up one chunk. Details per codec: docs/design/tar.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any, Literal

from .._version import install_hint
from ..errors import ConfigError, ShardFormatError

__all__ = [
    "SHARD_SUFFIXES",
    "SUFFIX_OF",
    "Compression",
    "Decoder",
    "Encoder",
    "compression_of",
    "is_shard_name",
    "open_decoder",
    "open_encoder",
    "require_codec",
]

Compression = Literal["gzip", "zstd"]
_SUFFIXES: dict[str, Compression | None] = {
    ".tar": None, ".tar.gz": "gzip", ".tgz": "gzip", ".tar.zst": "zstd", ".tzst": "zstd",
}
SHARD_SUFFIXES = tuple(_SUFFIXES)
ZSTANDARD_INPUT = 64 << 10
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_ADVICE = (
    f"zstd-compressed shards need a zstd library: {install_hint('zstd')} (the zstandard "
    "package), or use Python 3.14+, whose standard library has compression.zstd"
)


def is_shard_name(key: str) -> bool:
    """Whether ``key`` names a tar shard (plain or compressed) by its suffix."""
    return key.endswith(SHARD_SUFFIXES)


def compression_of(key: str) -> Compression | None:
    """``"gzip"``, ``"zstd"`` or None (plain ``.tar``, or not a shard name) from the suffix."""
    for suffix, kind in _SUFFIXES.items():
        if key.endswith(suffix):
            return kind
    return None


def _zstd_module() -> tuple[str, Any]:
    """The zstd implementation to use: ``("stdlib", compression.zstd)`` or ``("zstandard", mod)``."""
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+

        return "stdlib", zstd
    except ImportError:
        pass
    try:
        from backports import zstd  # type: ignore[import-not-found]  # the same API, backported

        return "stdlib", zstd
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise ConfigError(ZSTD_ADVICE) from None
    return "zstandard", zstandard


def require_codec(url: str) -> None:
    """Fail now, in the process that builds the dataset, when ``url`` cannot be decompressed here."""
    if compression_of(url) == "zstd":
        try:
            _zstd_module()
        except ConfigError:
            raise ConfigError(f"{url}: {ZSTD_ADVICE}") from None


class Decoder:
    """Compressed chunks in, decompressed pieces out; ``finish()`` at the end of the stream.

    An empty object is an empty shard (as for plain tar, and as Python's ``gzip`` reads it).
    """

    name = ""
    magic = b""

    def __init__(self, url: str, piece: int) -> None:
        self.url = url
        self.piece = piece
        self.consumed = 0  # compressed bytes given to decode()
        self.units = 0  # gzip members or zstd frames completed
        self._inside = False  # whether the current member/frame has begun and not ended
        self._head = b""  # the stream's first block, for "is this compressed at all?"

    def decode(self, data: bytes) -> Iterator[bytes]:
        """Decompress ``data``; yields pieces of at most ``piece`` bytes (zstandard: docs/design/tar.md)."""
        if len(self._head) < 512:
            self._head += data[: 512 - len(self._head)]
        start = self.consumed
        self.consumed += len(data)
        yield from self._decode(data, start)

    def finish(self) -> None:
        """The stream ended: raise ShardFormatError if it ended inside a member/frame."""
        if self._inside:
            raise self._fail(f"truncated {self.name} stream: it ended at compressed byte "
                             f"{self.consumed}, inside a {self.name} "
                             f"{'member' if self.name == 'gzip' else 'frame'}")

    def _decode(self, data: bytes, start: int) -> Iterator[bytes]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fail(self, text: str) -> ShardFormatError:
        return ShardFormatError(f"{self.url}: {text}", url=self.url, offset=self.consumed)

    def _corrupt(self, exc: Exception) -> ShardFormatError:
        if not self.units and not self._head.startswith(self.magic[: len(self._head)]):
            hint = (" (it is a plain tar archive: name it .tar)"
                    if self._head[257:262] == b"ustar" else "")
            return self._fail(f"not {self.name}-compressed ({exc}): a shard named "
                              f"{'.tar.gz or .tgz' if self.name == 'gzip' else '.tar.zst or .tzst'} "
                              f"must be {self.name} data{hint}")
        return self._fail(f"corrupt {self.name} stream near compressed byte {self.consumed} ({exc})")


class _Gzip(Decoder):
    name = "gzip"
    magic = _GZIP_MAGIC

    def __init__(self, url: str, piece: int) -> None:
        super().__init__(url, piece)
        self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        self._tail_only = False  # after the last member: only NUL padding may follow

    def _decode(self, data: bytes, start: int) -> Iterator[bytes]:
        buf = data
        while buf:
            if not self._inside and self.units and buf[:1] != _GZIP_MAGIC[:1]:
                self._tail_only = True  # not another member: the end, padded or not
            if self._tail_only:
                if buf.strip(b"\0"):
                    at = start + len(data) - len(buf)
                    raise self._fail(f"data that is not gzip after the end of the compressed "
                                     f"stream (at compressed byte {at})")
                return
            self._inside = True
            try:
                out = self._d.decompress(buf, self.piece)
            except zlib.error as exc:
                raise self._corrupt(exc) from None
            if out:
                yield out
            if self._d.eof:
                buf = self._d.unused_data
                self.units += 1
                self._inside = False
                self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            else:
                buf = self._d.unconsumed_tail


class _StdlibZstd(Decoder):
    """``compression.zstd`` (Python 3.14+, or ``backports.zstd``): output bounded by ``max_length``."""

    name = "zstd"
    magic = _ZSTD_MAGIC

    def __init__(self, url: str, piece: int, module: Any) -> None:
        super().__init__(url, piece)
        self._module = module
        self._d = module.ZstdDecompressor()

    def _decode(self, data: bytes, start: int) -> Iterator[bytes]:
        buf = data
        while True:
            if buf:
                self._inside = True
            try:
                out = self._d.decompress(buf, self.piece)
            except self._module.ZstdError as exc:
                raise self._corrupt(exc) from None
            if out:
                yield out
            if self._d.eof:
                buf = self._d.unused_data
                self.units += 1
                self._inside = False
                self._d = self._module.ZstdDecompressor()
                if not buf:
                    return
            elif self._d.needs_input:
                return
            else:
                buf = b""  # more output is waiting inside the decompressor


class _Zstandard(Decoder):
    """The ``zstandard`` package: no output limit per call, so input goes in bounded slices."""

    name = "zstd"
    magic = _ZSTD_MAGIC

    def __init__(self, url: str, piece: int, module: Any) -> None:
        super().__init__(url, piece)
        self._module = module
        self._dctx = module.ZstdDecompressor()
        self._d = self._new()

    def _new(self) -> Any:
        return self._dctx.decompressobj(write_size=min(self.piece, 1 << 20))

    def _decode(self, data: bytes, start: int) -> Iterator[bytes]:
        view = memoryview(data)
        for at in range(0, len(data), ZSTANDARD_INPUT):
            buf = bytes(view[at: at + ZSTANDARD_INPUT])
            while buf:
                self._inside = True
                try:
                    out = self._d.decompress(buf)
                except self._module.ZstdError as exc:
                    raise self._corrupt(exc) from None
                if out:
                    yield out
                buf = b""
                if self._d.eof:
                    buf = self._d.unused_data
                    self.units += 1
                    self._inside = False
                    self._d = self._new()


def open_decoder(kind: Compression, url: str, piece: int = 1 << 20) -> Decoder:
    """A fresh decoder for one pass over a compressed shard."""
    if kind == "gzip":
        return _Gzip(url, piece)
    if kind == "zstd":
        try:
            flavour, module = _zstd_module()
        except ConfigError:
            raise ConfigError(f"{url}: {ZSTD_ADVICE}") from None
        if flavour == "stdlib":
            return _StdlibZstd(url, piece, module)
        return _Zstandard(url, piece, module)
    raise ValueError(f"unknown compression {kind!r} for {url}")


class Encoder:
    """Tar bytes in, compressed bytes out (for ``loader shard --compress``)."""

    def __init__(self, compress: Any, flush: Any) -> None:
        self.compress = compress  # (bytes) -> bytes
        self.flush = flush  # () -> bytes: the rest, ending the stream


SUFFIX_OF: dict[Compression | None, str] = {None: ".tar", "gzip": ".tar.gz", "zstd": ".tar.zst"}


def open_encoder(kind: Compression, level: int | None = None) -> Encoder:
    """A compressor for one shard: gzip (zlib, level 6, mtime 0, so a rerun makes the same bytes)
    or zstd (level 3, with a content checksum)."""
    if kind == "gzip":
        zobj = zlib.compressobj(6 if level is None else level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return Encoder(zobj.compress, zobj.flush)
    if kind == "zstd":
        flavour, module = _zstd_module()
        zlevel = 3 if level is None else level
        if flavour == "stdlib":
            options = {module.CompressionParameter.compression_level: zlevel,
                       module.CompressionParameter.checksum_flag: 1}
            cobj = module.ZstdCompressor(options=options)
            return Encoder(cobj.compress, cobj.flush)
        zobj = module.ZstdCompressor(level=zlevel, write_checksum=True).compressobj()
        return Encoder(zobj.compress, zobj.flush)
    raise ValueError(f"unknown compression {kind!r}; use 'gzip' or 'zstd'")
