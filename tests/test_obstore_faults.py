"""The obstore backend against a misbehaving HTTP stub on 127.0.0.1: error translation, no server.

Faults a real S3 server will not produce on demand (a body cut short, 503 SlowDown, a response
that never comes, a connection closed before any answer) are served by a tiny asyncio HTTP
server running in the test's own event loop; obstore talks to it over loopback exactly as it
would to S3. Behaviour against a real server lives in ``integration/test_obstore_store.py``.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import aclosing, asynccontextmanager

import anyio
import obstore  # noqa: F401  (an installed test dependency: a broken install must fail, not skip)
import pytest

from loader.config import S3Config
from loader.errors import (
    AccessDeniedError,
    BadAnswerError,
    ConfigError,
    EndpointUnreachableError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from loader.retry import RetryPolicy
from loader.s3.obstore_store import (
    ObstoreStore,
    forked_after_use,
    translate_error,
)

pytestmark = pytest.mark.anyio
SECRET = "stub-secret-do-not-show-0123456789"
DEADLINE = 10
XML = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>m</Message></Error>'


@pytest.fixture
def anyio_backend():
    return "asyncio"


def response(status: str, body: bytes = b"", *, length: int | None = None, extra: str = "") -> bytes:
    """Raw HTTP/1.1 response bytes; ``length`` may claim more than ``body`` holds."""
    head = (
        f"HTTP/1.1 {status}\r\nContent-Length: {len(body) if length is None else length}\r\n{extra}"
        'Last-Modified: Wed, 21 Oct 2015 07:28:00 GMT\r\nETag: "e"\r\nConnection: close\r\n\r\n'
    )
    return head.encode() + body


def error(status: str, code: str) -> bytes:
    return response(status, XML.format(code=code).encode())


class Hold(bytes):
    """An answer to send and then keep the connection open without another byte."""


@asynccontextmanager
async def stub(behaviour):
    """An HTTP server in this event loop. ``behaviour(request_head)`` answers: ``bytes`` are sent
    and the connection closed; a ``Hold`` is sent and the connection kept silent until the test
    ends; ``None`` sends nothing and holds the connection."""
    held: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        answer = behaviour(head.decode())
        if answer:
            writer.write(answer)
            await writer.drain()
        if answer is None or isinstance(answer, Hold):
            held.append(writer)
            return
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def open_at(endpoint: str, **retry_options) -> ObstoreStore:
    config = S3Config(endpoint_url=endpoint, access_key_id="STUBKEY", secret_access_key=SECRET)
    retry = RetryPolicy(**{"connect_timeout": 2, "read_timeout": 2, "deadline": 10, **retry_options})
    return await ObstoreStore.open(config, max_connections=4, retry=retry)


async def fails(coro, error_type, match=None):
    """Await ``coro`` expecting ``error_type``; check the secret stays out; return the error."""
    with pytest.raises(error_type, match=match) as info:
        await coro
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    return info.value


async def drain(iterator):
    async with aclosing(iterator) as chunks:
        return [chunk async for chunk in chunks]


# ----------------------------------------------------------------------- status answers


@pytest.mark.parametrize(
    "answer,error_type,match",
    [
        (error("404 Not Found", "NoSuchKey"), NoSuchKeyError,
         r"no object 'k' in bucket 'b' at http://127\.0\.0\.1:\d+ \(HTTP 404\); check the key list"),
        (error("404 Not Found", "NoSuchBucket"), NoSuchBucketError,
         r"bucket 'b' does not exist at http://127\.0\.0\.1:\d+; create it or fix the URI"),
        (error("403 Forbidden", "SignatureDoesNotMatch"), AccessDeniedError,
         r"access denied to s3://b/k at .* \(SignatureDoesNotMatch\): the credentials were rejected"),
        (error("403 Forbidden", "InvalidAccessKeyId"), AccessDeniedError, r"AWS_SECRET_ACCESS_KEY"),
        (error("503 Slow Down", "SlowDown"), ThrottledError,
         r"s3://b/k: the server answered SlowDown \(HTTP 503\)$"),
        (error("500 Internal Server Error", "InternalError"), TransientStoreError, r"HTTP 500"),
        (response("502 Bad Gateway", b"<html>proxy</html>"), TransientStoreError, r"HTTP 502"),
        (error("429 Too Many Requests", "TooManyRequests"), ThrottledError, r"HTTP 429"),
        (error("400 Bad Request", "InvalidArgument"), StoreError, r"InvalidArgument \(HTTP 400\)"),
    ],
)
async def test_status_answers_become_our_errors(answer, error_type, match):
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: answer) as endpoint:
            store = await open_at(endpoint)
            for request in (store.get("b", "k"), store.get_range("b", "k", 2, 5),
                            drain(store.stream("b", "k"))):
                exc = await fails(request, error_type, match)
                assert (exc.bucket, exc.key) == ("b", "k")
                assert type(exc) is error_type  # not a subclass picked by accident
            await store.aclose()


async def test_listing_errors_name_the_prefix():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: error("404 Not Found", "NoSuchBucket")) as endpoint:
            store = await open_at(endpoint)
            exc = await fails(drain(store.list("b", "train/")), NoSuchBucketError,
                              r"asked for s3://b/train/ \(listing\)")
            assert exc.bucket == "b"
        async with stub(lambda line: error("403 Forbidden", "AccessDenied")) as endpoint:
            store = await open_at(endpoint)
            await fails(drain(store.list("b", "train/")), AccessDeniedError,
                        r"access denied to s3://b/train/ \(listing\)")


async def test_put_errors_are_translated():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: error("403 Forbidden", "AccessDenied")) as endpoint:
            store = await open_at(endpoint)
            await fails(store.put("b", "k", b"data"), AccessDeniedError, r"s3://b/k")


# ----------------------------------------------------------------------- broken connections


def ranged(body: bytes, head: str, *, cut: int | None = None) -> bytes:
    """A 206 with the part of ``body`` that ``head``'s Range asks for (clipped like S3 does),
    or a 200 with all of it; ``cut`` sends only that many bytes of the promised length."""
    asked = RANGE_RE.search(head)
    if asked is None:
        return response("200 OK", body[:cut], length=len(body))
    first = int(asked.group(1))
    last = min(int(asked.group(2)), len(body) - 1)
    part = body[first:last + 1]
    return response("206 Partial Content", part[:cut], length=len(part),
                    extra=f"Content-Range: bytes {first}-{last}/{len(body)}\r\n")


RANGE_RE = re.compile(r"\r\nrange: bytes=(\d+)-(\d+)\r\n", re.I)


async def test_body_shorter_than_content_length_is_transient():
    """hyper notices the body ended early; obstore must not hand back the short body."""
    body = bytes(range(256)) * 4
    def behaviour(head):
        return ranged(body, head, cut=500)

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)
            await fails(store.get("b", "k"), TransientStoreError,
                        r"s3://b/k: the connection failed mid-request \(the body ended before its "
                        r"Content-Length\)$")
            await fails(store.get_range("b", "k", 0, 1000), TransientStoreError, "Content-Length")
            got = []
            with pytest.raises(TransientStoreError, match="Content-Length"):
                async with aclosing(store.stream("b", "k", chunk_size=100)) as chunks:
                    async for chunk in chunks:
                        got.append(chunk)
            assert b"".join(got) == body[: len(b"".join(got))]  # what came before the cut is right


async def test_no_answer_times_out_as_transient():
    """A server that accepts and never answers: RetryPolicy.read_timeout ends the attempt."""
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: None) as endpoint:
            # read_timeout=0.5 ends it: the default (30 s) would outlast fail_after(DEADLINE)
            store = await open_at(endpoint, read_timeout=0.5)
            await fails(store.get("b", "k"), TransientStoreError, r"timed out\)$")


async def test_stalled_body_times_out_as_transient():
    """Headers and a little of the body, then silence: the per-read timeout fires mid-body."""
    stalled = Hold(response("200 OK", b"x" * 10, length=1000))
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: stalled) as endpoint:
            store = await open_at(endpoint, read_timeout=0.5)  # the default 30 s: past fail_after
            # the read timeout, or the body's deadline (answer_pace) at the same moment
            await fails(store.get("b", "k"), TransientStoreError, r"(timed out|not whole after .*)\)$")
            with pytest.raises(TransientStoreError, match="timed out|bytes/s"):
                await drain(store.stream("b", "k"))


async def test_connection_closed_without_answer_is_transient():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: b"") as endpoint:
            store = await open_at(endpoint)
            exc = await fails(store.get("b", "k"), TransientStoreError, r"failed mid-request \(.*\)$")
            assert not isinstance(exc, EndpointUnreachableError)


async def test_refused_connection_is_unreachable_and_fast():
    with socket_that_refuses() as endpoint:
        with anyio.fail_after(DEADLINE):
            # Refused is final at once: retried to the policy's 60 s deadline, fail_after would end it.
            store = await open_at(endpoint, deadline=60)
            exc = await fails(store.get("b", "k"), EndpointUnreachableError,
                              r"cannot connect to http://127\.0\.0\.1:\d+ for s3://b/k "
                              r"\(Connection refused\); is the server running and is "
                              r"AWS_ENDPOINT_URL right\?")
            assert isinstance(exc, ConnectionError) and isinstance(exc, TransientStoreError)


class socket_that_refuses:
    """An endpoint on a port that was free a moment ago (nothing listens there)."""

    def __enter__(self):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------- whole objects


async def test_get_is_one_ranged_request():
    """A whole object is one GET for bytes=0-(huge), answered 206 and clipped by the server."""
    heads: list[str] = []
    body = bytes(range(256)) * 40

    def behaviour(head):
        heads.append(head)
        return ranged(body, head)

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)
            got = await store.get("b", "k")
            assert type(got) is bytes and got == body
            assert await store.get_range("b", "k", 100, None) == body[100:]
            assert await store.get_range("b", "k", 100, 200) == body[100:200]
            assert await store.get_range("b", "k", 10_000, 20_000) == body[10_000:]
    assert [RANGE_RE.search(h).groups() for h in heads] == [
        ("0", str((1 << 62) - 1)), ("100", str((1 << 62) - 1)), ("100", "199"),
        ("10000", "19999"),
    ]


async def test_empty_object_falls_back_to_a_plain_get():
    """S3 answers 416 to any range of an empty object: one plain GET then reads it."""
    seen: list[bool] = []  # whether each request had a Range header

    def behaviour(head):
        seen.append(RANGE_RE.search(head) is not None)
        if seen[-1]:
            return error("416 Range Not Satisfiable", "InvalidRange")
        return response("200 OK", b"")

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)
            assert await store.get("b", "k") == b""
            assert await store.get("b", "k") == b""
    assert seen == [True, False, True, False]


@pytest.mark.parametrize("answer", [
    "200",  # Range ignored
    "206 without Content-Range",
    "206 of another range",
])
async def test_a_server_that_ignores_ranges_gets_plain_gets_and_a_wrong_206_is_an_error(answer):
    """A 200 to the range from byte 0 is the whole object (a server that ignores Range): after
    it no range is asked for. A 206 that is not that range is a wrong answer, never the object."""
    body = b"0123456789" * 100
    seen: list[bool] = []

    def behaviour(head):
        seen.append(RANGE_RE.search(head) is not None)
        if not seen[-1] or answer == "200":
            return response("200 OK", body)
        if answer == "206 without Content-Range":
            return response("206 Partial Content", body)
        return response("206 Partial Content", body[:10], extra="Content-Range: bytes 0-9/1000\r\n")

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)
            if answer != "200":
                with pytest.raises(BadAnswerError, match=r"s3://b/k: .*(Requested|Content-Range)"):
                    await store.get("b", "k")
                return
            assert await store.get("b", "k") == body
            assert await store.get("b", "k") == body
    assert seen == [True, False, False]


async def test_plain_get_still_checks_the_length_against_content_length():
    """A chunked body that ends cleanly but short of the Content-Length it also claims (a
    server breaking HTTP/1.1, which hyper accepts): the plain GET path still refuses it."""
    def behaviour(head):
        chunk = b"x" * 500
        return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1024\r\n"
                b'ETag: "e"\r\nLast-Modified: Wed, 21 Oct 2015 07:28:00 GMT\r\n'
                b"Connection: close\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk
                + b"\r\n0\r\n\r\n")

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)  # a 200 to the ranged GET: plain GETs from then on
            await fails(store.get("b", "k"), TransientStoreError,
                        r"s3://b/k: body ended after 500 bytes, 524 short of its Content-Length")


# ----------------------------------------------------------------------- range arguments


async def test_invalid_range_arguments_fail_before_any_request():
    requests: list[str] = []
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: requests.append(line)) as endpoint:
            store = await open_at(endpoint)
            await fails(store.get_range("b", "k", -1, None), InvalidRangeError, r"\[-1, None\)")
            await fails(store.get_range("b", "k", 5, 3), InvalidRangeError, r"\[5, 3\)")
            await fails(drain(store.stream("b", "k", start=-2)), InvalidRangeError, "-2")
            with pytest.raises(ValueError, match="chunk_size=0"):
                await drain(store.stream("b", "k", chunk_size=0))
            assert await store.get_range("b", "k", 7, 7) == b""
            for key in ("/a", "a/"):  # object_store would drop the slash and read another object
                for request in (store.get("b", key), store.get_range("b", key, 0, 1),
                                drain(store.stream("b", key)), store.put("b", key, b"x")):
                    await fails(request, StoreError, "use store='aioboto3'")
    assert requests == []


async def test_416_past_the_end_asks_the_size_once():
    """A 416 is resolved with one HEAD: start == size is an empty range, beyond it an error."""
    seen: list[str] = []

    def behaviour(line):
        seen.append(line.split()[0])
        if line.startswith("HEAD"):
            return response("200 OK", length=10)
        return error("416 Range Not Satisfiable", "InvalidRange")

    with anyio.fail_after(DEADLINE):
        async with stub(behaviour) as endpoint:
            store = await open_at(endpoint)
            assert await store.get_range("b", "k", 10, None) == b""
            assert await drain(store.stream("b", "k", start=10)) == []
            await fails(store.get_range("b", "k", 11, 20), InvalidRangeError,
                        r"s3://b/k: the requested byte range \(\[11, 20\)\) is past the end of "
                        r"the object \(10 bytes\)")
    assert seen == ["GET", "HEAD", "GET", "HEAD", "GET", "HEAD"]


# ----------------------------------------------------------------------- open, repr, lifecycle


async def test_open_requires_credentials_for_a_custom_endpoint(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)  # profiles and metadata: see the root conftest
    with pytest.raises(ConfigError, match="no credentials for endpoint 'http://127.0.0.1:1'"):
        await ObstoreStore.open(S3Config(endpoint_url="http://127.0.0.1:1"))


async def test_repr_never_shows_the_secret():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: error("404 Not Found", "NoSuchKey")) as endpoint:
            store = await open_at(endpoint)
            await fails(store.get("b", "k"), NoSuchKeyError)
            text = repr(store) + str(store) + repr(vars(store))
            for s3store in store._stores.values():  # obstore's own view of its settings
                text += repr(s3store) + repr(s3store.config) + repr(s3store.credential_provider)
            assert SECRET not in text
            assert "ObstoreStore(endpoint='http://127.0.0.1:" in repr(store)


async def test_requests_after_aclose_are_refused():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: error("404 Not Found", "NoSuchKey")) as endpoint:
            store = await open_at(endpoint)
            await store.aclose()
            with pytest.raises(RuntimeError, match="closed"):
                await store.get("b", "k")


async def test_the_process_that_made_requests_is_not_marked_forked():
    with anyio.fail_after(DEADLINE):
        async with stub(lambda line: error("404 Not Found", "NoSuchKey")) as endpoint:
            store = await open_at(endpoint)
            await fails(store.get("b", "k"), NoSuchKeyError)
    assert not forked_after_use()


# ----------------------------------------------------------------------- translate_error


@pytest.mark.parametrize("exc", [NoSuchKeyError("x", bucket="b", key="k"), asyncio.CancelledError()])
def test_translate_error_passes_ours_through(exc):
    assert translate_error(exc, bucket="b", key="k", endpoint="e") is exc


def test_translate_error_keeps_unknown_errors_short():
    exc = RuntimeError("boom\n\nDebug source:\n" + "x" * 10_000)
    out = translate_error(exc, bucket="b", key="k", endpoint="e")
    assert type(out) is StoreError and out.key == "k"
    assert str(out) == "s3://b/k: unexpected RuntimeError: boom"


def test_unaddressable_keys_say_what_to_do():
    exc = ValueError('Could not parse path: Path "a//b" contained empty path segment')
    out = translate_error(exc, bucket="b", key="a//b", endpoint="e")
    assert type(out) is StoreError and "store='aioboto3'" in str(out)


