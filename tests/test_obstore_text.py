"""``read_error_text``, the one reader of obstore's error texts, message by message.

obstore raises exception classes but exposes no status, S3 code or cause on them, so what
else an error says is read from its text (a Rust debug print that obstore, object_store,
reqwest or rustls may reword in any release). Every message the reader parses is produced
here by the installed obstore itself, against a stub server on 127.0.0.1, and the release is
pinned: on another one, this file fails until each message is checked again.
"""

from __future__ import annotations

import asyncio
import ssl

import anyio
import obstore
import pytest
import trustme
from test_obstore_faults import Hold, error, open_at, response, stub

from loader.s3.obstore_store import OBSTORE_TEXT_VERSION, read_error_text

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_the_texts_were_checked_against_the_installed_obstore():
    assert obstore.__version__ == OBSTORE_TEXT_VERSION, (
        f"obstore {obstore.__version__} is installed, its error texts were checked against "
        f"{OBSTORE_TEXT_VERSION}: run this file, fix read_error_text where a message changed, "
        "then move OBSTORE_TEXT_VERSION")


async def raw_error(endpoint: str, call: str = "get", **retry_options) -> BaseException:
    """obstore's own exception for one request of ``call`` to ``endpoint`` (ours untranslated)."""
    store = await open_at(endpoint, **{"connect_timeout": 1, "read_timeout": 1, "deadline": 3, **retry_options})
    try:
        s3 = store._store("b")
        with anyio.fail_after(10):
            if call == "range":
                await obstore.get_range_async(s3, "k", start=1, end=3)
            else:
                result = await obstore.get_async(s3, "k")
                await result.bytes_async()
    except Exception as exc:
        return exc
    finally:
        await store.aclose()
    raise AssertionError("the request succeeded")


@pytest.mark.parametrize(("answer", "status", "code"), [
    (error("404 Not Found", "NoSuchKey"), 404, "NoSuchKey"),
    (error("403 Forbidden", "SignatureDoesNotMatch"), 403, "SignatureDoesNotMatch"),
    (error("503 Slow Down", "SlowDown"), 503, "SlowDown"),
    (error("416 Requested Range Not Satisfiable", "InvalidRange"), 416, "InvalidRange"),
    (response("502 Bad Gateway", b"<html>proxy</html>"), 502, ""),
])
async def test_an_answers_status_and_s3_code(answer, status, code):
    async with stub(lambda head: answer) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint)))
    assert (facts.status, facts.code, facts.failure) == (status, code, None)


async def test_a_body_cut_short():
    async with stub(lambda head: response("200 OK", b"abc", length=10)) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint)))
    assert (facts.status, facts.failure) == (None, "the body ended before its Content-Length")


async def test_a_connection_closed_before_an_answer():
    async with stub(lambda head: b"") as endpoint:
        facts = read_error_text(str(await raw_error(endpoint)))
    assert (facts.status, facts.kind, facts.failure) == (None, "Request", "connection closed before a response")


async def test_no_answer_in_time():
    async with stub(lambda head: None) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint)))
    assert (facts.status, facts.kind, facts.failure) == (None, "Timeout", "timed out")


async def test_a_stalled_body():
    async with stub(lambda head: Hold(response("200 OK", b"abc", length=10))) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint)))
    assert facts.status is None and facts.failure == "timed out"


async def test_a_refused_connection():
    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        await listener.aclose()  # nothing listens there now
    facts = read_error_text(str(await raw_error(f"http://127.0.0.1:{port}")))
    assert (facts.status, facts.kind, facts.failure) == (None, "Connect", None)
    assert facts.os_message and "refused" in facts.os_message.lower()


async def test_a_range_answered_whole():
    async with stub(lambda head: response("200 OK", b"abcdef")) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint, "range")))
    assert facts.range_ignored and facts.status is None


@pytest.mark.parametrize(("answer", "call", "refused"), [
    (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 2\r\nContent-Range: bytes 2-3/6\r\n\r\ncd", "range",
     "Requested 1..3, got 2..4"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", "get",
     "Content-Length Header missing from response"),
    (b"HTTP/1.1 2000 OK\r\nContent-Length: 3\r\n\r\nabc", "get", "hyper could not parse the answer: Status"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\nabc", "get",
     "hyper could not parse the answer: Header ContentLengthInvalid"),
])
async def test_an_answer_object_store_refused(answer, call, refused):
    async with stub(lambda head: answer) as endpoint:
        facts = read_error_text(str(await raw_error(endpoint, call)))
    assert (facts.refused_answer, facts.status, facts.failure) == (refused, None, None)


async def tls_error(context: ssl.SSLContext | None) -> BaseException:
    """obstore's error for a GET over https to a server that answers plain HTTP to the TLS
    handshake (``context`` None), or shakes hands with ``context``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if context is None:
            await reader.read(1)  # the ClientHello's first bytes
            writer.write(error("400 Bad Request", "BadRequest"))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        return await raw_error(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    finally:
        server.close()
        await server.wait_closed()


async def test_plain_http_where_tls_was_expected():
    facts = read_error_text(str(await tls_error(None)))
    assert facts.plain_http and facts.kind == "Connect" and facts.status is None


async def test_a_certificate_from_an_unknown_ca():
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(context)
    facts = read_error_text(str(await tls_error(context)))
    assert (facts.certificate, facts.kind, facts.status) == ("UnknownIssuer", "Connect", None)


def test_a_key_object_store_cannot_address():
    from obstore.store import MemoryStore

    with pytest.raises(Exception) as info:
        obstore.put(MemoryStore(), "a//b", b"x")
    assert read_error_text(str(info.value)).unaddressable


def test_text_without_any_of_it():
    facts = read_error_text("boom")
    assert facts == (None, "", "", None, None, False, None, False, False, None)
