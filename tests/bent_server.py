"""A fake S3 server on 127.0.0.1 that answers every request with a script: the bytes to send,
pauses between them, and whether to close. It accepts any signature and keeps connections
alive, so tests can make it bend HTTP one way at a time (a range ignored, bytes past the
framing, a trickling body) and watch what each transport makes of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

CLOSE = None  # a script item: close the connection here


class Request(NamedTuple):
    method: str
    target: str
    headers: dict[str, str]  # names in lower case


Script = list[bytes | float | None]  # bytes are sent, a float is a pause (s), None closes
Answer = Callable[[Request], Script]


def head(status: str, headers: dict[str, str | int] | None = None) -> bytes:
    """A status line and headers (``Content-Length`` only where given)."""
    lines = [f"HTTP/1.1 {status}"] + [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def ok(body: bytes, status: str = "200 OK", **headers: str | int) -> bytes:
    """A well-framed answer: ``Content-Length`` and an ETag unless given otherwise."""
    fields: dict[str, str | int] = {"Content-Length": len(body), "ETag": '"e"'}
    fields.update({name.replace("_", "-"): value for name, value in headers.items()})
    return head(status, {k: v for k, v in fields.items() if v != ""}) + body


@contextlib.asynccontextmanager
async def bent_server(answer: Answer) -> AsyncIterator[tuple[str, list[Request]]]:
    """Serve ``answer`` at ``http://127.0.0.1:port``; yields that endpoint and the requests seen."""
    seen: list[Request] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            while True:
                raw = await reader.readuntil(b"\r\n\r\n")
                lines = raw.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                request = Request(method, target, headers)
                seen.append(request)
                try:
                    script = answer(request)
                except Exception:  # a test's script that failed: close, never leave a client waiting
                    writer.close()
                    raise
                for item in script:
                    if item is None:
                        writer.close()
                        return
                    if isinstance(item, float):
                        await asyncio.sleep(item)
                    else:
                        writer.write(item)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        for writer in writers:
            writer.close()
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)
