"""Answers that bend HTTP, from a fake S3 server on 127.0.0.1, through every transport: the
signed ``http1`` path, the standard-library lister's reads, botocore's path and obstore. A
wrong answer is an error naming the request and what came back, never bytes handed on."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bent_server import CLOSE, bent_server, head, ok

from loader.config import S3Config
from loader.errors import BadAnswerError, StoreError, TransientStoreError
from loader.retry import RetryPolicy
from loader.s3.protocol import Pin

pytestmark = pytest.mark.anyio
OBJECT = (bytes(range(256)) * 4)[:1000]
TRANSPORTS = ["http1", "stdlib", "botocore", "obstore"]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def store_at(transport: str, endpoint: str, read_timeout: float = 2,
                   deadline: float = 5, connect_timeout: float = 2) -> AsyncIterator[Any]:
    config = S3Config(endpoint_url=endpoint, access_key_id="AK", secret_access_key="SK")
    retry = RetryPolicy(connect_timeout=connect_timeout, read_timeout=read_timeout, deadline=deadline)
    if transport == "stdlib":
        from loader.s3.http_lister import HttpLister

        store: Any = HttpLister(config, retry=retry)
    elif transport == "obstore":
        from loader.s3.obstore_store import ObstoreStore

        store = await ObstoreStore.open(config, max_connections=2, retry=retry)
    else:
        from loader.s3.aioboto3_store import Aioboto3Store

        store = await Aioboto3Store.open(config, max_connections=2, retry=retry,
                                         direct_gets=transport == "http1")
    try:
        yield store
    finally:
        await store.aclose()


def partial(first: int, last: int, body: bytes | None = None, total: int = len(OBJECT), **extra) -> bytes:
    body = OBJECT[first:last + 1] if body is None else body
    return ok(body, "206 Partial Content", Content_Range=f"bytes {first}-{last}/{total}", **extra)


# request (what the test asks for), the server's answer, and a word for the table
CASES = {
    "200 whole object to a range": (("range", 0, 100), lambda r: [ok(OBJECT)]),
    "206 of another range": (("range", 10, 20), lambda r: [partial(20, 29)]),
    "206 of a shifted range, labelled": (("range", 100, 200), lambda r: [partial(104, 203)]),
    "206 shorter than asked": (("range", 10, 20), lambda r: [partial(10, 14)]),
    "206 without a Content-Range": (("range", 10, 20), lambda r: [ok(OBJECT[10:20], "206 Partial Content")]),
    "206 of half to a pinned read": (("pinned",), lambda r: [partial(0, 499)]),
    "206 of half to a stream of the whole object": (("stream",), lambda r: [partial(0, 499)]),
    "206 to a plain GET": (("get",), lambda r: [partial(0, 499)]),
    "204 to a GET": (("get",), lambda r: [head("204 No Content", {"ETag": '"e"'})]),
    "Content-Range past its total": (("range", 990, 1000), lambda r: [partial(990, 999, total=995)]),
    "gzip, chunked": (("get",), lambda r: [head("200 OK", {"Transfer-Encoding": "gzip, chunked",
                                                           "ETag": '"e"'}) + b"5\r\nabcde\r\n0\r\n\r\n"]),
    "close-delimited range cut short": (("range", 10, 20), lambda r: [
        head("206 Partial Content", {"Content-Range": "bytes 10-19/1000", "ETag": '"e"'}) + OBJECT[10:15],
        CLOSE]),
    "206 of part of the remainder": (("range", 900, None), lambda r: [partial(900, 949)]),
    "206 of half to a whole read by range": (("range", 0, None), lambda r: [partial(0, 499)]),
    "pinned read without an ETag": (("pinned",), lambda r: [ok(OBJECT, ETag="")]),
    "pinned range without an ETag": (("pinned-range", 10, 20), lambda r: [partial(10, 19, ETag="")]),
}


async def ask(store: Any, request: tuple) -> bytes:
    kind = request[0]
    if kind == "get":
        return await store.get("bkt", "key")
    if kind == "pinned":
        return await store.get("bkt", "key", pin=Pin("e"))
    if kind == "stream":
        return b"".join([piece async for piece in store.stream("bkt", "key")])
    if kind == "pinned-range":
        return await store.get_range("bkt", "key", request[1], request[2], pin=Pin("e"))
    return await store.get_range("bkt", "key", request[1], request[2])


def _skip_unasked(transport: str, request: tuple) -> bool:
    """The standard-library lister reads whole objects and ranges, unpinned (a shard index)."""
    return transport == "stdlib" and request[0].startswith(("pinned", "stream"))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
async def test_an_answer_not_what_was_asked_is_an_error_naming_both(transport, case):
    request, answer = CASES[case]
    if _skip_unasked(transport, request):
        return
    async with bent_server(answer) as (endpoint, seen), store_at(transport, endpoint) as store:
        with pytest.raises(StoreError) as info:
            got = await ask(store, request)
            pytest.fail(f"{case}: {len(got)} bytes handed on: {got[:40]!r}")
    error = info.value
    assert seen, "the request reached the server"
    assert isinstance(error, BadAnswerError), f"{case} through {transport}: {error!r}"
    assert "s3://bkt/key" in str(error) and "GET" in str(error), str(error)
    assert len(str(error)) < 600
    assert error.endpoint == endpoint, "retried, then given up on: the final error names the endpoint"
    # our own check's error, let through as it is, never raised ``from`` itself: that cycle
    # through its traceback keeps every frame it passed until a garbage collection
    assert error.__cause__ is not error, "the error is its own cause"


GOOD = {
    "a range": (("range", 10, 20), lambda r: [partial(10, 19)], OBJECT[10:20]),
    "a range past the end": (("range", 990, 2000), lambda r: [partial(990, 999)], OBJECT[990:]),
    "200 to a range that covers the object": (("range", 0, 2000), lambda r: [ok(OBJECT)], OBJECT),
    "the remainder": (("range", 900, None), lambda r: [partial(900, 999)], OBJECT[900:]),
    "a pinned read": (("pinned",), lambda r: [ok(OBJECT)], OBJECT),
    "chunked": (("get",), lambda r: [head("200 OK", {"Transfer-Encoding": "chunked", "ETag": '"e"'})
                                     + b"3e8\r\n" + OBJECT + b"\r\n0\r\n\r\n"], OBJECT),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(GOOD))
async def test_answers_that_are_what_was_asked_are_read(transport, case):
    request, answer, want = GOOD[case]
    if _skip_unasked(transport, request):
        return
    async with bent_server(answer) as (endpoint, _), store_at(transport, endpoint) as store:
        if transport == "obstore" and case in OBSTORE_REFUSES:
            with pytest.raises(StoreError, match=OBSTORE_REFUSES[case]):
                await ask(store, request)  # object_store's own parser is stricter here
            return
        assert await ask(store, request) == want


# what obstore (object_store's own HTTP client) refuses of answers that are right
OBSTORE_REFUSES = {"200 to a range that covers the object": "non-partial response when range requested",
                   "chunked": "Content-Length Header missing"}


@pytest.mark.parametrize("transport", ["http1", "botocore", "obstore"])  # (the lister does not stream)
async def test_a_stream_of_a_range_ignored_fails_before_a_byte(transport):
    async with bent_server(lambda r: [ok(OBJECT)]) as (endpoint, _), store_at(transport, endpoint) as store:
        pieces = []
        with pytest.raises(BadAnswerError, match=r"HTTP 200 .* to a ranged read|non-partial response"):
            async for piece in store.stream("bkt", "key", start=100):
                pieces.append(piece)
        assert pieces == [], "nothing of the wrong answer was delivered"


# ---------------------------------------------------------------- listings

def page(keys: list[str], *, truncated: bool = False, token: str | None = None, root: str = "ListBucketResult",
         raw_keys: list[str] | None = None) -> bytes:
    contents = "".join(f"<Contents><Key>{key}</Key><LastModified>2026-11-28T10:00:00.000Z</LastModified>"
                       "<Size>3</Size><ETag>&quot;e&quot;</ETag></Contents>"
                       for key in (raw_keys if raw_keys is not None else keys))
    tail = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>bkt</Name><Prefix>p/</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{contents}{tail}</{root}>").encode()


BOMB = (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;">]>'
        b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>&b;</Key><Size>1</Size>"
        b"</Contents></ListBucketResult>")
BAD_PAGES = {
    "an HTML page": lambda n: b"<html><body>Service is up</body></html>",
    "an <Error> with 200": lambda n: b"<Error><Code>InternalError</Code><Message>x</Message></Error>",
    "cut XML": lambda n: page(["p/a", "p/b"])[:150],
    "truncated without a token": lambda n: page(["p/a", "p/b"], truncated=True),
    "a token answered again": lambda n: page([f"p/{n}"], truncated=True, token="same"),
    "zero keys claiming more": lambda n: page([], truncated=True, token=f"t{n}"),
    "an entity bomb": lambda n: BOMB,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(BAD_PAGES))
async def test_a_listing_page_is_a_list_bucket_result_or_an_error(transport, case):
    """obstore lists through this package's lister (object_store read an HTML page or an
    ``<Error>`` as an empty listing, and a truncated page without a token as the last one)."""
    count = [0]

    def answer(request):
        count[0] += 1
        return [ok(BAD_PAGES[case](count[0]), ETag="")]

    if transport == "botocore" and case == "an entity bomb":
        return  # botocore's own XML parser expands entities (within expat's limits): AWS's path
    async with bent_server(answer) as (endpoint, seen), store_at(transport, endpoint) as store:
        with pytest.raises(StoreError) as info:
            async for _ in store.list("bkt", "p/"):
                pass
    assert len(seen) <= 3, f"{len(seen)} LIST requests: the listing must not loop"
    text = str(info.value)
    assert "s3://bkt/p/" in text and len(text) < 600, text
    if transport != "botocore" or case not in ("an HTML page", "cut XML", "an <Error> with 200"):
        assert isinstance(info.value, BadAnswerError), f"{case} through {transport}: {info.value!r}"
        assert "page" in text


@pytest.mark.parametrize("transport", ["http1", "stdlib", "botocore", "obstore"])
async def test_keys_are_read_as_xml_means_them_not_as_html_would(transport):
    """A server that ignores encoding-type=url sends ``&#x85;`` for U+0085: html.unescape made
    it an ellipsis (another key); expat reads the character itself."""
    body = page(["p/a\x85", "p/b"], raw_keys=["p/a&#x85;", "p/b&amp;c"])
    async with bent_server(lambda r: [ok(body)]) as (endpoint, _), store_at(transport, endpoint) as store:
        keys = [info.key async for info in store.list("bkt", "p/")]
    assert keys == ["p/a\x85", "p/b&c"]


# ---------------------------------------------------------------- framing

def chunked(size_line: bytes) -> bytes:
    body = OBJECT[:31]
    return (head("200 OK", {"Transfer-Encoding": "chunked", "ETag": '"e"'}) + size_line + b"\r\n"
            + body + b"\r\n0\r\n\r\n")


FRAMINGS = {
    "chunk size 0x1f": chunked(b"0x1f"),
    "chunk size +1f": chunked(b"+1f"),
    "chunk size 1_f": chunked(b"1_f"),
    "chunk size in Unicode digits": chunked("１f".encode()),
    "chunk size negative": chunked(b"-1f"),
    "status 2000": b"HTTP/1.1 2000 OK\r\nContent-Length: 3\r\n\r\nabc",
    "status in Unicode digits": "HTTP/1.1 ２00 OK\r\nContent-Length: 3\r\n\r\nabc".encode(),
    "Content-Length of 10^40": head("200 OK", {"Content-Length": "1" + "0" * 40}) + b"abc",
    "Content-Length in Unicode digits": head("200 OK", {"Content-Length": "١٠"}) + b"abc",
    "Transfer-Encoding and Content-Length": head("200 OK", {"Transfer-Encoding": "chunked",
                                                            "Content-Length": "3"}) + b"3\r\nabc\r\n0\r\n\r\n",
}


# hyper (under obstore) reads a body framed both ways by its chunks, as RFC 9112 says to, where
# ours refuse it as a sign of smuggling: both read the chunked body whole, no byte past it
OBSTORE_READS = {"Transfer-Encoding and Content-Length": b"abc"}


@pytest.mark.parametrize("transport", ["http1", "stdlib", "botocore", "obstore"])
@pytest.mark.parametrize("case", list(FRAMINGS))
async def test_an_answer_that_breaks_framing_is_an_error_and_its_connection_closed(transport, case):
    async with bent_server(lambda r: [FRAMINGS[case]]) as (endpoint, seen), \
            store_at(transport, endpoint) as store:
        if transport == "obstore" and case in OBSTORE_READS:
            assert await store.get("bkt", "key") == OBSTORE_READS[case]
            return
        with pytest.raises(BadAnswerError, match=r"s3://bkt/key") as info:
            await store.get("bkt", "key")
        assert len(str(info.value)) < 600
        with pytest.raises(BadAnswerError):
            await store.get("bkt", "key")
    assert len(seen) == 2


@pytest.mark.parametrize("transport", ["http1", "stdlib", "botocore", "obstore"])
async def test_bytes_past_an_answer_never_become_the_next_one(transport):
    smuggled = head("200 OK", {"Content-Length": 12, "ETag": '"e"'}) + b"WRONG BYTES!"
    answers = iter([[ok(OBJECT) + smuggled], [ok(OBJECT)], [ok(OBJECT)]])
    async with bent_server(lambda r: next(answers)) as (endpoint, seen), \
            store_at(transport, endpoint) as store:
        got = []
        for _ in range(2):
            try:
                got.append(await store.get("bkt", "key"))
            except BadAnswerError:
                got.append(None)
    assert got[1] == OBJECT and got[0] in (OBJECT, None), "never the 12 bytes sent too many"


# ---------------------------------------------------------------- deadlines

def right(request, body: bytes = OBJECT) -> bytes:
    """The answer ``request`` asked for: a 206 of its range, else the whole object."""
    asked = request.headers.get("range")
    if not asked:
        return ok(body)
    first, _, last = asked.removeprefix("bytes=").partition("-")
    if int(first) >= len(body):
        return s3_error("416 Requested Range Not Satisfiable", "InvalidRange", "past the end")
    stop = min(len(body), int(last) + 1) if last else len(body)
    return partial(int(first), stop - 1, body[int(first):stop], total=len(body))


def trickle(part: str, body: bytes = OBJECT[:200]):
    """An answer of one byte every 50 ms, from the head on or once the head is whole."""

    def answer(request):
        wire = right(request, body)
        start = wire.index(b"\r\n\r\n") + 4 if part == "body" else 0
        script: list = [wire[:start]] if start else []
        for at in range(start, len(wire)):
            script += [0.05, wire[at:at + 1]]
        return script

    return answer


async def read_by(store: Any, how: str) -> bytes:
    if how == "get":
        return await store.get("bkt", "key")
    if how == "range":
        return await store.get_range("bkt", "key", 0, 150)
    if how == "remainder":
        return await store.get_range("bkt", "key", 50, None)
    if how == "pinned":
        return await store.get("bkt", "key", pin=Pin())
    return b"".join([piece async for piece in store.stream("bkt", "key", start=10)])


# each way a transport reads (with its own deadline code), the body trickled; the head trickled
# where the head is awaited apart (one await of head and body in obstore's get and get_range)
SLOW_BODIES = {"http1": ["get", "range", "stream"], "stdlib": ["get", "range"],
               "botocore": ["get", "range", "stream"],
               "obstore": ["get", "range", "remainder", "pinned", "stream"]}
SLOW_HEADS = {"http1": ["get"], "stdlib": ["get"], "botocore": ["get", "stream"],
              "obstore": ["get", "range", "pinned", "stream"]}


@pytest.mark.parametrize(("transport", "how", "part"),
                         [(t, how, "body") for t, hows in SLOW_BODIES.items() for how in hows]
                         + [(t, how, "head") for t, hows in SLOW_HEADS.items() for how in hows])
async def test_a_slowloris_answer_fails_like_a_stall(transport, how, part):
    """One byte every 50 ms never leaves a read waiting for read_timeout (0.2 s), yet the answer
    fails before the trickle ends (10 s, which would read it whole: obstore's own limit per
    request, the deadline, is 60 s here), as a stall does (retried: TransientStoreError)."""
    async with bent_server(trickle(part)) as (endpoint, seen), \
            store_at(transport, endpoint, read_timeout=0.2, deadline=60, connect_timeout=0.2) as store:
        with pytest.raises(TransientStoreError) as info:
            await read_by(store, how)
    assert not isinstance(info.value, BadAnswerError), "a slow server is a stall, not a wrong answer"
    text = str(info.value)
    assert "s3://bkt/key" in text and any(word in text for word in SLOW_WORDS), text
    assert len(seen) <= 2


SLOW_WORDS = ("not whole", "bytes/s", "timed out")  # ours (answer_pace, http1), or obstore's own


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["get", "stream"])
async def test_a_body_cut_short_is_transient_and_names_the_endpoint(transport, how):
    """A connection that ends inside the body is worth another attempt, and the error that
    reaches the user once the retries give up names the endpoint that answered so: our own
    check's error as well as a library's (the store marks both)."""
    if _skip_unasked(transport, (how,)):
        return
    cut = head("200 OK", {"Content-Length": str(len(OBJECT)), "ETag": '"e"'}) + OBJECT[:500]
    async with bent_server(lambda r: [cut, CLOSE]) as (endpoint, _), store_at(transport, endpoint) as store:
        with pytest.raises(TransientStoreError) as info:
            await ask(store, (how,))
    assert not isinstance(info.value, BadAnswerError), str(info.value)
    assert info.value.endpoint == endpoint, f"{info.value!r} names {info.value.endpoint!r}"
    assert info.value.__cause__ is not info.value, "the error is its own cause"


# ---------------------------------------------------------------- error answers

def s3_error(status: str, code: str, message: str, **headers: str | int) -> bytes:
    body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    return ok(body, status, ETag="", **headers)


ERRORS = {
    "403 that mentions NoSuchKey": (s3_error("403 Forbidden", "AccessDenied", "not NoSuchKey but denied"),
                                    "AccessDeniedError", r"access denied"),
    "301 with the bucket's region": (s3_error("301 Moved Permanently", "PermanentRedirect", "elsewhere",
                                              x_amz_bucket_region="eu-west-1"),
                                     "StoreError", r"AWS_REGION=eu-west-1"),
    "a code with control characters, 60 kB long": (s3_error("400 Bad Request", "Bad\x1b[31m" + "x" * 60_000, "m"),
                                                  "StoreError", r"Bad \[31mx+\.\.\."),
    "408 on a kept-alive connection": (s3_error("408 Request Timeout", "", "idle"),
                                       "TransientStoreError", r"HTTP 408"),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(ERRORS))
async def test_error_answers_are_ours_short_and_say_what_to_do(transport, case):
    answer, kind, match = ERRORS[case]
    if transport == "obstore" and case.startswith("301"):  # object_store's error has no header
        match = r"redirects the request elsewhere .*set AWS_REGION .*or AWS_ENDPOINT_URL"
    if transport in ("botocore", "obstore") and case.startswith("a code"):
        match = r"HTTP 400"  # botocore and object_store drop such a code before we see it
    async with bent_server(lambda r: [answer]) as (endpoint, _), store_at(transport, endpoint) as store:
        with pytest.raises(StoreError, match=match) as info:
            await store.get("bkt", "key")
    text = str(info.value)
    assert type(info.value).__name__ == kind, f"{case} through {transport}: {info.value!r}"
    assert len(text) < 700 and "\x1b" not in text, text


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_server_that_answers_wrong_every_time_is_tried_three_times_not_two_minutes(transport):
    from loader.retry import BAD_ANSWER_ATTEMPTS, call_with_retries

    async with bent_server(lambda r: [ok(OBJECT)]) as (endpoint, seen), \
            store_at(transport, endpoint) as store:
        with pytest.raises(BadAnswerError, match=r"(HTTP 200 .* to a ranged read|non-partial response)"
                                                 r".*gave up after 3 attempt"):
            await call_with_retries(lambda: store.get_range("bkt", "key", 10, 20),
                                    RetryPolicy(deadline=120, base_delay=0.01))
    assert len(seen) == BAD_ANSWER_ATTEMPTS


# ---------------------------------------------------------------- whole reads against the listing

def listing_of(objects: dict[str, tuple[int, str]]) -> bytes:
    """A ListBucketResult naming each key with the size and ETag given."""
    contents = "".join(f"<Contents><Key>{key}</Key><LastModified>2026-11-28T10:00:00.000Z</LastModified>"
                       f"<Size>{size}</Size><ETag>&quot;{etag}&quot;</ETag></Contents>"
                       for key, (size, etag) in objects.items())
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
            f'2006-03-01/"><Name>bkt</Name><Prefix>p/</Prefix><KeyCount>{len(objects)}</KeyCount>'
            f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>").encode()


def listed_server(listed: dict[str, tuple[int, str]], served: dict[str, tuple[bytes, str]]):
    """LIST answers ``listed``; a GET of a key answers its body and ETag from ``served``."""

    def answer(request):
        path = request.target.split("?")[0]
        if "list-type=2" in request.target:
            return [ok(listing_of(listed), ETag="")]
        body, etag = served[path.removeprefix("/bkt/")]
        return [right(request, body).replace(b'ETag: "e"', f'ETag: "{etag}"'.encode())]

    return answer


def dataset_over(transport: str, endpoint: str, mapped: bool = False, cache: Any = None) -> Any:
    from loader import AsyncS3Dataset, AsyncS3MapDataset, Store

    async def factory() -> Any:
        return await _open(transport, endpoint)

    kind = AsyncS3MapDataset if mapped else AsyncS3Dataset
    return kind.from_prefix("s3://bkt/p/", store=Store(backend=factory, cache=cache,
                                                       retry=RetryPolicy(deadline=60, base_delay=0.01)))


async def _open(transport: str, endpoint: str) -> Any:
    config = S3Config(endpoint_url=endpoint, access_key_id="AK", secret_access_key="SK")
    # these tests end on a count of attempts (a wrong answer is tried 3 times): timeouts and a
    # deadline a loaded machine cannot reach, or a slow answer ends them on time instead
    retry = RetryPolicy(connect_timeout=10, read_timeout=10, deadline=60)
    if transport == "obstore":
        from loader.s3.obstore_store import ObstoreStore

        return await ObstoreStore.open(config, max_connections=2, retry=retry)
    from loader.s3.aioboto3_store import Aioboto3Store

    return await Aioboto3Store.open(config, max_connections=2, retry=retry, direct_gets=transport == "http1")


WHOLE_READS = ["http1", "botocore", "obstore"]


@pytest.mark.parametrize("grouped", [False, True], ids=["one object", "two objects"])
@pytest.mark.parametrize("mapped", [False, True], ids=["iterable", "map"])
@pytest.mark.parametrize("transport", WHOLE_READS)
def test_a_listed_version_shorter_than_listed_is_an_error(transport, mapped, grouped):
    """990 of the 1,000 bytes the listing gave, under the ETag it gave: never a sample (of one
    object, or of two, p/a.bin and p/a.cls, read together)."""
    listed = {"p/a.bin": (1000, "e"), **({"p/a.cls": (1000, "e")} if grouped else {})}
    short = "p/a.cls" if grouped else "p/a.bin"
    answer = listed_server(listed, {"p/a.bin": (OBJECT, "e"), short: (OBJECT[:990], "e")})
    with _serving(answer) as (endpoint, seen):
        ds = dataset_over(transport, endpoint, mapped)
        with pytest.raises(BadAnswerError, match=rf"s3://bkt/{short}: .*listed size 1,000.* 990 bytes of "
                                                 r"the listed version \(ETag e\).*gave up after 3 attempt"):
            list(ds) if not mapped else ds[0]
    gets = [r for r in seen if "list-type" not in r.target and r.target.endswith(short)]
    assert 2 <= len(gets) <= 8, f"{len(gets)} GETs: one read, then three that learn the ETag"


@pytest.mark.parametrize("transport", WHOLE_READS)
def test_a_version_written_since_the_listing_is_read_as_it_now_is(transport):
    listed = {"p/a.bin": (1000, "e"), "p/b.bin": (1000, "e")}
    newer = (OBJECT + b"more", "f")
    answer = listed_server(listed, {"p/a.bin": (OBJECT, "e"), "p/b.bin": newer})
    with _serving(answer) as (endpoint, _):
        samples = list(dataset_over(transport, endpoint))
    assert [s["bin"] for s in samples] == [OBJECT, OBJECT + b"more"]


def cached_bodies(directory: Any) -> list[bytes]:
    """Every entry a disk cache folder holds, read back whole."""
    from loader.cache.files import DiskCache

    cache = DiskCache(directory, 1 << 30)
    bodies = []
    for path in sorted(directory.glob("*/*")):
        if len(path.name) == 64:
            entry = cache.open(path.name)
            if entry is not None:
                bodies.append(entry.read(0, entry.length))
                entry.close()
    return bodies


@pytest.mark.parametrize("transport", ["http1", "obstore"])
@pytest.mark.parametrize("short", ["once", "always"])
def test_a_short_body_is_never_cached(tmp_path, transport, short):
    """990 of the listed 1,000 bytes under the listed ETag, once (then the object) or every time:
    the disk cache holds the right bytes or nothing, and a later epoch never serves the wrong
    body (it was cached before the listing's size was checked, and every later read hit it)."""
    gets = [0]
    right_answer = listed_server({"p/a.bin": (1000, "e")}, {"p/a.bin": (OBJECT, "e")})
    short_answer = listed_server({"p/a.bin": (1000, "e")}, {"p/a.bin": (OBJECT[:990], "e")})

    def answer(request):
        if "list-type" not in request.target:
            gets[0] += 1
            if short == "always" or gets[0] == 1:
                return short_answer(request)
        return right_answer(request)

    with _serving(answer) as (endpoint, _):
        for _epoch in range(2):
            ds = dataset_over(transport, endpoint, cache=tmp_path / "cache")
            if short == "always":
                with pytest.raises(BadAnswerError, match=r"s3://bkt/p/a.bin: .*990 bytes"):
                    list(ds)
            else:
                assert [sample["bin"] for sample in list(ds)] == [OBJECT]
            assert cached_bodies(tmp_path / "cache") in ([], [OBJECT])
    if short == "once":
        assert gets[0] == 2, "the second epoch read the right bytes from the cache"


async def test_a_cached_body_unlike_its_listing_is_not_served(tmp_path):
    """An entry of the listed version at another size (cached before this check existed) is
    read again from the store, not served, and replaced by the right bytes."""
    from typing import NamedTuple

    from loader.cache.files import DiskCache
    from loader.cache.store import CachedStore
    from loader.listing.versions import versions_of

    from fakes import FakeStore

    class Listed(NamedTuple):
        bucket: str
        key: str
        etag: str | None
        size: int | None

    inner = FakeStore({("bkt", "p/a.bin"): OBJECT})
    etag = [info async for info in inner.list("bkt", "p/")][0].etag
    cache = DiskCache(tmp_path, 1 << 20)
    cache.put(cache.name_for("ep", "bkt", "p/a.bin"), OBJECT[:990], etag)
    store = CachedStore(inner, cache, "ep", versions=versions_of([Listed("bkt", "p/a.bin", etag, 1000)]))
    try:
        assert await store.get("bkt", "p/a.bin") == OBJECT
        assert store.statistics().hits == 0
        assert cached_bodies(tmp_path) == [OBJECT]
    finally:
        await store.aclose()


@contextlib.contextmanager
def _serving(answer):
    """``bent_server`` in a thread of its own, for datasets, which run their own event loops."""
    import threading

    ready: Any = {}
    stop = threading.Event()

    async def run() -> None:
        async with bent_server(answer) as served:
            ready["served"] = served
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    while "served" not in ready and thread.is_alive():
        stop.wait(0.01)
    try:
        yield ready["served"]
    finally:
        stop.set()
        thread.join(5)


class RecordedClock:
    """A retry clock that waits no time: it records each wait asked for and moves by it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def http_date(seconds_from_now: float) -> str:
    import email.utils
    import time

    return email.utils.formatdate(time.time() + seconds_from_now, usegmt=True)


RETRY_AFTER = {  # the header (made when the test runs), the policy's max_delay, the wait due (at least, at most)
    "2 seconds": (lambda: "2", 5.0, (2.0, 2.0)),
    "30 seconds, past max_delay": (lambda: "30", 4.0, (4.0, 4.0)),
    # a date made at collection was past by the time a loaded worker ran the test
    "an HTTP date a minute on, past max_delay": (lambda: http_date(60), 4.0, (4.0, 4.0)),
    "an HTTP date past": (lambda: http_date(-60), 4.0, (0.0, 0.01)),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(RETRY_AFTER))
async def test_a_throttles_retry_after_is_waited_within_the_policy(transport, case):
    """Twice ``503 SlowDown`` with ``Retry-After``, then the object: each wait between attempts
    is what the header asked, bounded by ``max_delay`` (the clock records waits: no wall time).
    obstore exposes no header of an error answer: there the backoff alone decides (recorded)."""
    from loader.errors import ThrottledError
    from loader.retry import call_with_retries

    make_header, max_delay, (least, most) = RETRY_AFTER[case]
    header = make_header()
    answers = iter([s3_error("503 Slow Down", "SlowDown", "slow", Retry_After=header)] * 2)
    clock = RecordedClock()
    async with bent_server(lambda r: [next(answers, None) or right(r)]) as (endpoint, seen), \
            store_at(transport, endpoint) as store:
        with pytest.raises(ThrottledError, match=r"s3://bkt/key.*SlowDown") as info:
            await store.get("bkt", "key")
        policy = RetryPolicy(base_delay=0.01, max_delay=max_delay, deadline=60)
        assert await call_with_retries(lambda: store.get("bkt", "key"), policy, clock=clock) == OBJECT
    assert len(seen) == 3 and len(clock.waits) == 1
    if transport == "obstore":
        assert info.value.retry_after is None and clock.waits[0] <= 0.01
    else:
        assert info.value.retry_after is not None
        assert least <= clock.waits[0] <= most, clock.waits


# ---------------------------------------------------------------- shards through a DataLoader

SHARDS = 3
PER_SHARD = 12


def shard_objects() -> tuple[dict[str, bytes], dict[str, dict[str, str]]]:
    """Three tar shards and the index beside them (with each shard's sample offsets, which
    ``batch_size=`` reads by ranged GETs), and the fingerprint of every sample."""
    import hashlib
    import json

    from test_shards import build_shard, fingerprint_fields

    from loader.shard_index.format import entry_document, index_document

    objects, expected, entries = {}, {}, []
    for s in range(SHARDS):
        data, samples = build_shard(s, PER_SHARD, 100, 400)
        key = f"shards/train-{s:04d}.tar"
        objects[key] = data
        expected.update({name: fingerprint_fields(fields) for name, fields, _, _ in samples})
        entries.append(entry_document(f"s3://bkt/{key}", key, samples=PER_SHARD, size=len(data),
                                      etag=hashlib.md5(data).hexdigest(), tar_bytes=len(data),
                                      offsets=[first for _, _, first, _ in samples]))
    objects["shards/index.json"] = json.dumps(index_document(entries)).encode()
    return objects, expected


def serving_objects(objects: dict[str, bytes], bend: str, times: int, probes: bool = False):
    """Each object at ``/bkt/key`` (its ETag its MD5); the first ``times`` ranged GETs of a
    shard's samples bent (the one-byte probes before the DataLoader starts too with ``probes``):
    the whole shard (``range ignored``), or a 206 of the range 4 bytes on, labelled as such
    (``shifted 206``)."""
    import hashlib

    bent = [0]

    def answer(request):
        key = request.target.split("?")[0].removeprefix("/bkt/")
        body = objects.get(key)
        if body is None:
            return [s3_error("404 Not Found", "NoSuchKey", "no such key")]
        etag = f'"{hashlib.md5(body).hexdigest()}"'.encode()
        asked = request.headers.get("range")
        if asked and (probes or asked != "bytes=0-0") and key.endswith(".tar") and bent[0] < times:
            bent[0] += 1
            if bend == "range ignored":
                return [ok(body).replace(b'ETag: "e"', b"ETag: " + etag)]
            first, _, last = asked.removeprefix("bytes=").partition("-")
            stop = min(len(body), int(last) + 5 if last else len(body))
            start = min(int(first) + 4, stop - 1)
            return [partial(start, stop - 1, body[start:stop], total=len(body))
                    .replace(b'ETag: "e"', b"ETag: " + etag)]
        return [right(request, body).replace(b'ETag: "e"', b"ETag: " + etag)]

    return answer


@pytest.mark.parametrize(("bend", "times", "probes"), [
    ("range ignored", 1_000, False), ("shifted 206", 1, False), ("shifted 206", 1_000, False),
    ("range ignored", 1, False), ("range ignored", 1_000, True)])
def test_shards_by_batch_through_two_workers_never_repeat_or_drop_a_sample(bend, times, probes):
    """``from_shards(batch_size=)`` reads an indexed shard by ranged GETs; with the range bent
    every time, the epoch ends in an error naming the shard (the probes of the shards against
    their index too: our error, not a task group's, which the workers could not even unpickle);
    bent once, the retry reads the right bytes: every sample exactly once, never one twice or
    one lost. Through a DataLoader with two workers, started the platform's default way."""
    from test_shards import assert_exactly
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, Store

    objects, expected = shard_objects()
    with _serving(serving_objects(objects, bend, times, probes)) as (endpoint, seen):
        config = S3Config(endpoint_url=endpoint, access_key_id="AK", secret_access_key="SK")
        ds = AsyncS3Dataset.from_shards(
            "s3://bkt/shards/train-{0000..0002}.tar", batch_size=4, config=config,
            store=Store(backend="aioboto3", retry=RetryPolicy(deadline=60, base_delay=0.01,
                                                              read_timeout=5)))
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
        if times > 1:
            with pytest.raises(Exception, match=r"s3://bkt/shards/train-000[0-2]\.tar") as info:
                [sample for batch in loader for sample in batch]
            assert "gave up after 3 attempt" in str(info.value), str(info.value)
            assert type(info.value).__name__ == "BadAnswerError", repr(info.value)
            # let go of the error now: its traceback's frames hold the iterator, which a garbage
            # collection would find later and torch, finalizing it there, waits 5 s per worker
            traceback.clear_frames(info.tb)
            return
        samples = [sample for batch in loader for sample in batch]
    assert_exactly(samples, expected)
    assert any("range" in request.headers for request in seen), "the shards were read by ranges"


@pytest.mark.parametrize("backend", ["aioboto3", "obstore"])
@pytest.mark.parametrize("times", [1, 1_000])
@pytest.mark.parametrize("parts", [False, True], ids=["streamed", "in parts"])
def test_a_shard_cut_short_cleanly_is_held_to_its_listed_size(backend, times, parts):
    """A listed shard answered with a well-framed body that ends early, at a member's boundary
    (its Content-Length short of the listing, under the listed ETag): before, 6 of its 12
    samples and no error. Now an error naming the shard, or after one such answer the rest read
    from where it stopped: every sample once. Streamed, or in ranged parts of known size."""
    import hashlib

    from test_shards import assert_exactly, build_shard, fingerprint_fields

    from loader import AsyncS3Dataset, Reading, Store

    data, samples = build_shard(0, 12, 100, 400) if not parts else build_shard(1, 12, 150_000, 300_000)
    cut, etag = samples[6][2], hashlib.md5(data).hexdigest()
    listed = {"p/train-0000.tar": (len(data), etag)}
    short = [0]

    def answer(request):
        if "list-type" in request.target:
            return [ok(listing_of(listed), ETag="")]
        if not request.target.startswith("/bkt/p/train-0000.tar"):
            return [s3_error("404 Not Found", "NoSuchKey", "no such key")]
        body = data
        first, _, last = (request.headers.get("range") or "bytes=0-").removeprefix("bytes=").partition("-")
        if times > 1 or (short[0] < times and int(first) < cut and (not last or int(last) >= cut)):
            short[0] += 1  # (once: the first request that the cut falls in, whatever the order)
            body = data[:cut]
        return [right(request, body).replace(b'ETag: "e"', f'ETag: "{etag}"'.encode())]

    with _serving(answer) as (endpoint, _):
        config = S3Config(endpoint_url=endpoint, access_key_id="AK", secret_access_key="SK")
        ds = AsyncS3Dataset.from_shards(
            "s3://bkt/p/", config=config, reading=Reading(part_size=1 << 20) if parts else None,
            store=Store(backend=backend, retry=RetryPolicy(deadline=60, base_delay=0.01)))
        if times > 1:
            with pytest.raises(BadAnswerError, match=r"s3://bkt/p/train-0000\.tar: .*"
                                                     r"gave up .*after 3 attempt"):
                list(ds)
            return
        got = list(ds)
    assert_exactly(got, {key: fingerprint_fields(fields) for key, fields, _, _ in samples})
