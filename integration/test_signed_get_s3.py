"""The aioboto3 backend's two read paths against the real server: they must not differ.

GETs to path-style endpoints go through ``signed_get`` (SigV4 over ``http1``, no botocore request
pipeline); with ``direct_gets=False`` they go through botocore's ``get_object``, the path AWS's
own endpoints take. boto3 (``s3_server.minio``) is the oracle for bytes; botocore's path is the
oracle for errors, which must be the same type with the same message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import anyio
import pytest

from loader import S3Config, StoreError
from loader.s3.aioboto3_store import Aioboto3Store

pytestmark = pytest.mark.anyio
DEADLINE = 60
BIG = 3 * 1024 * 1024 + 17  # several stream chunks, not a multiple of any of them
AWKWARD = ["odd/a b.txt", "odd/x%41.bin", "odd/ü.bin", "odd/q?x=1", "odd/hash#1", "odd/plus+sign",
           "odd/star*", "odd/tilde~", "odd/brace{1}", "odd/caret^", "odd/semi;colon",
           "odd//double", "odd/ctl\x01"]  # dot segments and a trailing "/": SeaweedFS refuses them


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def objects(s3_server):
    bucket = s3_server.new_bucket("sig")
    items = {key: b"body of " + key.encode() for key in AWKWARD}
    items["big.bin"] = os.urandom(BIG)
    items["empty"] = b""

    async def upload():  # botocore's PutObject: the MinIO client refuses '.' and '..' segments
        async with opened(s3_server.config, False) as store:
            for key, body in items.items():
                await store.put(bucket, key, body)

    anyio.run(upload)
    return bucket, items


@contextlib.asynccontextmanager
async def opened(config: S3Config, direct: bool):
    store = await Aioboto3Store.open(config, max_connections=4, direct_gets=direct)
    try:
        yield store
    finally:
        await store.aclose()


async def read_all(store, bucket, key, start=0, chunk_size=256 * 1024):
    return b"".join([chunk async for chunk in store.stream(bucket, key, start, chunk_size)])


@pytest.mark.server_sensitive
def test_direct_gets_are_used_for_path_style_endpoints(s3_server):
    async def check():
        async with opened(s3_server.config, True) as direct, opened(s3_server.config, False) as boto:
            assert direct._getter is not None and boto._getter is None
    anyio.run(check)


@pytest.mark.server_sensitive
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
async def test_every_read_returns_what_was_written(s3_server, objects, direct):
    bucket, items = objects
    with anyio.fail_after(DEADLINE):
        async with opened(s3_server.config, direct) as store:
            for key, body in items.items():
                assert await store.get(bucket, key) == body, key
                assert await read_all(store, bucket, key) == body, key
            big = items["big.bin"]
            for start, end in [(0, 1), (5, 1000), (BIG - 10, BIG), (BIG - 10, None), (1 << 20, 2 << 20)]:
                assert await store.get_range(bucket, "big.bin", start, end) == big[start:end]
                streamed = [chunk async for chunk in store.stream(bucket, "big.bin", start, 300_000, end=end)]
                assert b"".join(streamed) == big[start:end] and max(map(len, streamed)) <= 300_000
            # 7-byte pieces over the object's last 640 KiB + 3 (not the whole of it: the botocore
            # path awaits each piece, seconds per MiB): an odd offset, an open range to the end,
            # and pieces that straddle the body's start after the head and each read the socket
            # delivers (up to 256 KiB: about four here; the whole object took about fifteen)
            for start, chunk in [(BIG - (640 << 10) - 3, 7), (65_537, 100_000), (BIG - 1, 1 << 20)]:
                assert await read_all(store, bucket, "big.bin", start, chunk) == big[start:]


@pytest.mark.server_sensitive
async def test_a_stream_closed_early_returns_its_connection(s3_server, objects):
    bucket, items = objects
    with anyio.fail_after(DEADLINE):
        async with opened(s3_server.config, True) as store:
            for _ in range(10):  # more than the pool's 4 connections: a leak would block here
                async with contextlib.aclosing(store.stream(bucket, "big.bin", 0, 1024)) as pieces:
                    async for _chunk in pieces:
                        break
            assert await store.get(bucket, "big.bin") == items["big.bin"]


async def errors_of(config: S3Config, direct: bool, bucket: str) -> list[tuple[type, str]]:
    """The (type, message) of each failing read, in a fixed order."""
    seen = []
    async with opened(config, direct) as store:
        for request in (lambda: store.get(bucket, "no/such-key"),
                        lambda: store.get_range(bucket, "no/such-key", 1, 5),
                        lambda: read_all(store, bucket, "no/such-key"),
                        lambda: store.get("no-such-bucket-sig", "k"),
                        lambda: store.get_range(bucket, "empty", 10, 20)):
            with pytest.raises(StoreError) as info:
                await request()
            seen.append((type(info.value), str(info.value)))
    return seen


@pytest.mark.server_sensitive
async def test_errors_are_the_same_on_both_paths(s3_server, objects):
    bucket, _ = objects
    with anyio.fail_after(DEADLINE):
        direct = await errors_of(s3_server.config, True, bucket)
        boto = await errors_of(s3_server.config, False, bucket)
    assert direct == boto
    assert [kind.__name__ for kind, _ in direct] == [
        "NoSuchKeyError", "NoSuchKeyError", "NoSuchKeyError", "NoSuchBucketError", "InvalidRangeError"]


@pytest.mark.server_sensitive
async def test_wrong_secret_is_denied_the_same_way_without_showing_it(s3_server, objects):
    bucket, _ = objects
    wrong = "wrong-secret-" + "q" * 24
    config = S3Config(endpoint_url=s3_server.config.endpoint_url, access_key_id=s3_server.config.access_key_id,
                      secret_access_key=wrong)
    messages = {}
    with anyio.fail_after(DEADLINE):
        for direct in (True, False):
            async with opened(config, direct) as store:
                with pytest.raises(StoreError) as info:
                    await store.get(bucket, "big.bin")
            messages[direct] = (type(info.value).__name__, str(info.value))
            assert wrong not in str(info.value) + repr(info.value)
    assert messages[True] == messages[False]
    assert messages[True][0] == "AccessDeniedError"


def signed_headers(head: dict[str, list[str]]) -> set[str]:
    authorization = head["authorization"][-1]
    return set(authorization.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";"))


def through_proxy(s3_server):
    """A pass-through proxy in front of the real server that records each request's headers."""
    from faults import FaultPlan, FaultProxy

    try:
        return FaultProxy(s3_server.config.endpoint_url, FaultPlan())
    except ValueError as exc:
        pytest.skip(f"the recording proxy needs a loopback http server: {exc}")


async def test_every_header_the_server_receives_is_signed_range_and_if_match_too(s3_server, objects):
    """Ranged, pinned and conditional GETs and a listing, as the server received them: every
    header is under the signature, which the server checked (it answered): no User-Agent either."""
    from loader.s3.http_lister import HttpLister
    from loader.s3.protocol import Pin

    bucket, items = objects
    big = items["big.bin"]
    with through_proxy(s3_server) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        with anyio.fail_after(DEADLINE):
            async with opened(config, True) as store:
                pin = Pin()
                assert await store.get_range(bucket, "big.bin", 0, 100, pin=pin) == big[:100]
                assert await store.get_range(bucket, "big.bin", 100, 200, pin=pin) == big[100:200]
                assert await read_all(store, bucket, "big.bin", 5) == big[5:]
                assert await store.get_if_changed(bucket, "big.bin", str(pin.etag)) is None
                assert [info.key async for info in store.list(bucket, "odd/")]
            lister = HttpLister(config)
            try:
                assert await lister.get_range(bucket, "big.bin", 7, 70) == big[7:70]
                assert [info.key async for info in lister.list(bucket, "odd/")]
            finally:
                await lister.aclose()
        requests = list(zip(proxy.decisions, proxy.headers, strict=True))
    gets = [(target, head) for (method, target, _), head in requests if method == "GET"]
    assert len(gets) == 7
    for target, head in gets:
        unsigned = set(head) - signed_headers(head) - {"authorization"}
        assert unsigned == set(), f"{target}: sent unsigned: {sorted(unsigned)}"
    ranged = [head for _, head in gets if "range" in head]
    pinned = [head for _, head in gets if "if-match" in head]
    assert len(ranged) == 4 and all("range" in signed_headers(head) for head in ranged)
    assert len(pinned) == 1 and "if-match" in signed_headers(pinned[0])
    assert any("if-none-match" in signed_headers(head) for _, head in gets)
