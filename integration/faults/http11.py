"""HTTP/1.1 framing: just enough to find where messages end, never to rewrite them: heads
parsed as received (and relayed unchanged), bodies relayed by Content-Length, chunks or EOF."""

from __future__ import annotations

import asyncio
import dataclasses

PIECE = 1 << 18  # most bytes moved per read when relaying a body
PACED_PIECE = 1 << 16  # the same under a bandwidth limit (smoother pacing)
BUFFER = 1 << 18  # StreamReader limit: buffered bytes before reading pauses; also the longest head


class BadMessage(Exception):
    """The peer sent something that is not HTTP/1.1 we can relay."""


@dataclasses.dataclass
class Head:
    raw: bytes  # exactly as received, relayed unchanged
    start: list[str]  # request line or status line, split in three
    headers: dict[str, list[str]]  # lower-case name -> values

    def get(self, name: str) -> str | None:
        values = self.headers.get(name)
        return values[-1] if values else None

    def tokens(self, name: str) -> set[str]:
        return {token.strip().lower() for value in self.headers.get(name, ()) for token in value.split(",")}

    @property
    def version(self) -> str:
        return self.start[0] if self.start[0].startswith("HTTP/") else self.start[2]

    def keep_alive(self) -> bool:
        connection = self.tokens("connection")
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    def body_framing(self) -> tuple[str, int]:
        """("chunked", 0), ("length", n) or ("none", 0) for a request; responses decide more."""
        if "transfer-encoding" in self.headers:
            codings = [t for t in self.tokens("transfer-encoding") if t]
            if "content-length" in self.headers or not codings or "chunked" not in codings:
                raise BadMessage("unsupported Transfer-Encoding / Content-Length combination")
            return "chunked", 0
        lengths = set(self.headers.get("content-length", ()))
        if not lengths:
            return "none", 0
        if len(lengths) != 1:
            raise BadMessage("conflicting Content-Length headers")
        value = lengths.pop().strip()
        if not value.isdigit():
            raise BadMessage(f"bad Content-Length {value!r}")
        return "length", int(value)


def parse_head(raw: bytes, *, request: bool) -> Head:
    try:
        text = raw[:-4].decode("latin-1")
    except UnicodeDecodeError as exc:  # latin-1 decodes anything; kept for clarity
        raise BadMessage("undecodable head") from exc
    lines = text.split("\r\n")
    start = lines[0].split(" ", 2)
    if len(start) != 3:
        raise BadMessage(f"bad start line {lines[0][:100]!r}")
    if request and not (start[0].isalpha() and start[2] in ("HTTP/1.1", "HTTP/1.0")):
        raise BadMessage(f"bad request line {lines[0][:100]!r}")
    if not request and not (start[0].startswith("HTTP/1.") and start[1].isdigit() and len(start[1]) == 3):
        raise BadMessage(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise BadMessage(f"bad header line {line[:100]!r}")
        headers.setdefault(name.lower(), []).append(value.strip())
    return Head(raw, start, headers)


async def read_head(reader: asyncio.StreamReader, *, request: bool) -> Head:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise BadMessage("head too long") from exc
    return parse_head(raw, request=request)


async def copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int,
                     rate: float | None = None) -> None:
    """Relay exactly ``size`` bytes, at most ``rate`` bytes/s if given; ``IncompleteReadError``
    if the reader ends first."""
    loop = asyncio.get_running_loop()
    started, sent = loop.time(), 0
    while size > 0:
        data = await reader.read(min(size, PIECE if rate is None else PACED_PIECE))
        if not data:
            raise asyncio.IncompleteReadError(b"", size)
        writer.write(data)
        size -= len(data)
        await writer.drain()
        if rate is not None:
            sent += len(data)
            ahead = sent / rate - (loop.time() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)


async def copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relay a chunked body raw: size lines, data, the last chunk and any trailers."""
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size = chunk_size(line)
        if size == 0:
            break
        await copy_exact(reader, writer, size + 2)  # data and its CRLF
    while True:  # trailers, then the empty line that ends the message
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        if line == b"\r\n":
            break
    await writer.drain()


async def copy_to_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(PIECE):
        writer.write(data)
        await writer.drain()


def chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip()
    try:
        size = int(text, 16)
    except ValueError:
        raise BadMessage(f"bad chunk size line {line[:40]!r}") from None
    if size < 0:
        raise BadMessage(f"bad chunk size line {line[:40]!r}")
    return size



class Sink:
    """A writer that forgets what it is given (to discard a chunked request body)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass
