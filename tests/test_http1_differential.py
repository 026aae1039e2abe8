"""``loader.s3.http1``'s response parser against h11's (a well-kept one) on generated answers:
framings, codings, bent status lines, headers, lengths and chunk sizes, split at any byte and
fed one piece at a time. Both must reach the same verdict: the same status and body, or both
an error. Where ours is deliberately stricter (a framing RFC 9112 calls a sign of smuggling),
the answer is named in ``STRICTER`` and ours must refuse it."""

from __future__ import annotations

import asyncio

import h11
from hypothesis import example, given, settings
from hypothesis import strategies as st

from loader.s3.http1 import _Connection, _Watchdog

GET = b"GET /bkt/key HTTP/1.1\r\nhost: h\r\n\r\n"


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def ours(pieces: list[bytes], eof: bool) -> tuple:
    """Our parser's verdict: ``("ok", status, body)`` or ``("error",)``."""

    async def run() -> tuple:
        connection = _Connection(_Watchdog(5))
        connection.connection_made(_Transport())  # type: ignore[arg-type]
        connection.send(GET)
        for piece in pieces:
            connection.data_received(piece)
            if connection._error is not None:
                return ("error",)
        if eof:
            connection.eof_received()
            connection.connection_lost(None)
        if connection._error is not None or not connection.done or connection._in_head:
            return ("error",)
        return ("ok", connection.status, b"".join(bytes(part) for part in connection._body))

    return asyncio.run(run())


def theirs(pieces: list[bytes], eof: bool) -> tuple:
    """h11's verdict on the same bytes: bytes left after the answer are an error too (on a
    kept-alive connection they would be read as the next answer)."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="GET", target="/bkt/key", headers=[("Host", "h")]))
    connection.send(h11.EndOfMessage())
    status, body, ended = None, bytearray(), False
    try:
        for piece in [*pieces, *([b""] if eof else [])]:
            connection.receive_data(piece)
            while True:
                event = connection.next_event()
                if event in (h11.NEED_DATA, h11.PAUSED):
                    break
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    ended = True
                elif isinstance(event, h11.ConnectionClosed):
                    break
    except h11.RemoteProtocolError:
        return ("error",)
    if not ended or connection.trailing_data[0]:
        return ("error",)
    return ("ok", status, bytes(body))


STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.1 206 Partial Content", b"HTTP/1.0 200 OK",
                b"HTTP/1.1 200", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 204 No Content",
                b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 200 \x01odd reason\xff",
                # bent
                b"HTTP/1.1 2000 OK", "HTTP/1.1 ２00 OK".encode(), "HTTP/1.1 2٠0 OK".encode(),
                b"HTTP/1.1 20 OK", b"HTTP/2 200 OK", b"HTTP/1.1  200 OK", b"http/1.1 200 OK",
                b"HTTP/1.1 200 O\rK", b"HTTP/1.1 +20 OK", b"HTTP/1.1 099 Low", b"SSH-2.0-OpenSSH"]
FIELDS = [b"ETag: \"e\"", b"Server: x", b"Connection: close", b"Connection: keep-alive",
          b"x-amz-id:abc  ", b"Empty:", b"Tab:\tv\t",
          # bent
          b"Bad Header: x", b"No-colon", b"Name : x", b"X: a\x00b", b"X: a\x0bb", b": x",
          b"Caf\xe9: x"]
LENGTHS = ["{n}", "{n}", "-1", "1e3", "٣", " {n}", "{n} ", "+{n}", "{n}, {n}", "0x{n}",
           "1" + "0" * 40, "{n}0"]
CODINGS = ["chunked", "chunked", "Chunked", "gzip, chunked", "identity", "chunked, chunked", "gzip"]
SIZE_FORMS = ["{x}", "{x}", "{X}", "0{x}", "{x};ext=1", "{x} ", "{x};a=\"b c\"", "0x{x}",
              "+{x}", "{d}_0", " {x}", "{x}\x00", "-{x}", "１"]

answers = st.fixed_dictionaries({
    "status": st.sampled_from(STATUS_LINES),
    "interim": st.booleans(),
    "fields": st.lists(st.sampled_from(FIELDS), max_size=4),
    "framing": st.sampled_from(["length", "chunked", "close", "both", "twice"]),
    "length": st.sampled_from(LENGTHS),
    "delta": st.sampled_from([0, 0, 0, -1, 1]),
    "coding": st.sampled_from(CODINGS),
    "body": st.binary(max_size=80),
    "chunks": st.lists(st.tuples(st.integers(1, 40), st.sampled_from(SIZE_FORMS)), max_size=4),
    "trailer": st.sampled_from([b"", b"x-checksum: abc\r\n", b"bad trailer\r\n"]),
    "extra": st.sampled_from([b"", b"", b"XYZ", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]),
    "eof": st.booleans(),
})


def wire(answer: dict) -> bytes:
    """The bytes of a generated answer."""
    body: bytes = answer["body"]
    head = [answer["status"]] + list(answer["fields"])
    framing = answer["framing"]
    length = answer["length"].format(n=len(body) + answer["delta"]).encode()
    if framing in ("length", "both", "twice"):
        head.append(b"Content-Length: " + length)
    if framing == "twice":
        head.append(b"Content-Length: " + length)
    if framing in ("chunked", "both"):
        head.append(b"Transfer-Encoding: " + answer["coding"].encode())
    out = b"HTTP/1.1 100 Continue\r\n\r\n" if answer["interim"] else b""
    out += b"\r\n".join(head) + b"\r\n\r\n"
    if framing in ("chunked", "both"):
        at = 0
        for size, form in answer["chunks"]:
            piece = body[at:at + size]
            if not piece:
                break
            at += len(piece)
            size_line = form.format(x=f"{len(piece):x}", X=f"{len(piece):X}", d=len(piece))
            out += size_line.encode() + b"\r\n" + piece + b"\r\n"
        if at < len(body):
            out += f"{len(body) - at:x}\r\n".encode() + body[at:] + b"\r\n"
        out += b"0\r\n" + answer["trailer"] + b"\r\n"
    else:
        out += body
    return out + answer["extra"]


def stricter(answer: dict) -> bool:
    """Answers ours refuses on purpose where h11 reads them: both framings at once (RFC 9112
    section 6.3 calls it a sign of smuggling: an error here)."""
    return answer["framing"] == "both" and answer["status"] not in (
        b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified")


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _compare(answer: dict, pieces: list[bytes]) -> None:
    mine, h11s = ours(pieces, answer["eof"]), theirs(pieces, answer["eof"])
    if stricter(answer) and mine == ("error",):
        return
    assert mine == h11s, f"ours {mine!r}, h11 {h11s!r} for {b''.join(pieces)!r}"


@settings(max_examples=800, deadline=None)
@given(answer=answers, cuts=st.lists(st.integers(0, 400), max_size=8))
@example(answer={"status": b"HTTP/1.1 200 OK", "interim": False, "fields": [], "framing": "chunked",
                 "length": "{n}", "delta": 0, "coding": "chunked", "body": b"x" * 31,
                 "chunks": [(31, "0x{x}")], "trailer": b"", "extra": b"", "eof": False}, cuts=[])
def test_our_parser_reaches_h11s_verdict_on_any_answer_split_anywhere(answer, cuts):
    _compare(answer, split(wire(answer), cuts))


@settings(max_examples=100, deadline=None)
@given(answer=answers)
def test_our_parser_reaches_h11s_verdict_fed_one_byte_at_a_time(answer):
    data = wire(answer)
    _compare(answer, [data[i:i + 1] for i in range(len(data))])
