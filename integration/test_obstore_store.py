"""The obstore backend against a real S3 server (the embedded SeaweedFS of ``loader.tools.devserver``).

Skipped when obstore or the ``weed`` binary is missing. boto3 (``server.client()``) is the
oracle: what obstore lists and reads must be what botocore lists and reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing
import os
import pickle
from contextlib import aclosing, asynccontextmanager

import anyio
import obstore  # noqa: F401  (an installed test dependency: a broken install must fail, not skip)
import pytest

from loader import (
    AccessDeniedError,
    AsyncS3Dataset,
    ConfigError,
    EndpointUnreachableError,
    InvalidRangeError,
    Limits,
    NoSuchBucketError,
    NoSuchKeyError,
    RetryPolicy,
    S3Config,
    StoreError,
)
from loader.s3 import ObjectStore, open_store
from loader.s3.obstore_store import ObstoreStore
from loader.tools.devserver import DevServer, find_weed

pytestmark = pytest.mark.anyio
BUCKET = "obs"
DEADLINE = 60
BIG = 5 * 1024 * 1024 + 123  # 5 MB and not a multiple of any chunk size


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def server():
    try:
        find_weed()
    except ConfigError as exc:
        pytest.fail(f"the embedded SeaweedFS (a test dependency) is missing: {exc}")
    with DevServer(buckets=[BUCKET]) as running:
        yield running


@pytest.fixture(scope="module")
def probe(server):
    """A one-byte object that tests needing any existing object can read."""
    server.client().put_object(Bucket=BUCKET, Key="probe/one", Body=b"1")
    return "probe/one"


@pytest.fixture(scope="module")
def big():
    return os.urandom(BIG)


@asynccontextmanager
async def opened(config: S3Config, *, via_open_store: bool = False, **retry_options):
    """An ObstoreStore for ``config``, closed on exit (directly or through ``open_store``)."""
    retry = RetryPolicy(**{"connect_timeout": 2, "read_timeout": 10, "deadline": 30, **retry_options})
    if via_open_store:
        store = await open_store("obstore", config, max_connections=16, retry=retry)
    else:
        store = await ObstoreStore.open(config, max_connections=16, retry=retry)
    try:
        yield store
    finally:
        await store.aclose()


async def drain(iterator):
    async with aclosing(iterator) as items:
        return [item async for item in items]


def boto_keys(server, prefix: str) -> list[tuple[str, int, str]]:
    """What botocore lists under ``prefix`` (all pages): key, size and unquoted ETag."""
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [(item["Key"], item["Size"], item["ETag"].strip('"'))
            for page in pages for item in page.get("Contents", ())]


# ----------------------------------------------------------------------- reads and writes


@pytest.mark.parametrize("via_open_store", [False, True], ids=["direct", "open_store"])
@pytest.mark.parametrize("size", [0, 1, 100_000, BIG])
async def test_put_get_round_trip(server, big, size, via_open_store):
    data = big[:size]
    key = f"rt/{via_open_store}/{size}.bin"
    with anyio.fail_after(DEADLINE):
        async with opened(server.config, via_open_store=via_open_store) as store:
            assert isinstance(store, ObstoreStore) and isinstance(store, ObjectStore)
            await store.put(BUCKET, key, data)
            got = await store.get(BUCKET, key)
    assert type(got) is bytes and got == data  # plain bytes: samples must pickle
    assert pickle.loads(pickle.dumps(got)) == data
    assert server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read() == data


async def test_get_range_edges(server, big):
    ten, empty = b"0123456789", b""
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, "range/ten", ten)
            await store.put(BUCKET, "range/empty", empty)
            await store.put(BUCKET, "range/big", big)
            for start, end in [(0, None), (0, 5), (3, None), (9, None), (9, 10), (10, None),
                               (10, 12), (5, 100), (4, 4), (0, 10), (2, 3)]:
                got = await store.get_range(BUCKET, "range/ten", start, end)
                assert type(got) is bytes and got == ten[start:end], (start, end)
            assert await store.get_range(BUCKET, "range/empty", 0, None) == b""
            assert await store.get_range(BUCKET, "range/empty", 0, 5) == b""
            assert await store.get_range(BUCKET, "range/big", 1 << 20, 3 << 20) == big[1 << 20:3 << 20]
            assert await store.get_range(BUCKET, "range/big", BIG - 7, None) == big[-7:]
            for start, end in [(11, None), (11, 20), (100, 200)]:
                with pytest.raises(InvalidRangeError, match=r"past the end of the object \(10 bytes\)") as info:
                    await store.get_range(BUCKET, "range/ten", start, end)
                assert (info.value.bucket, info.value.key) == (BUCKET, "range/ten")
            with pytest.raises(InvalidRangeError):
                await store.get_range(BUCKET, "range/ten", 6, 2)


@pytest.mark.parametrize("chunk_size", [1 << 20, 64 * 1024, 1000])
async def test_stream_chunks_concatenate_to_the_object(server, big, chunk_size):
    data = big if chunk_size >= 64 * 1024 else big[:300_000]
    key = f"stream/{chunk_size}.bin"
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, key, data)
            for start in (0, 1, chunk_size, len(data) // 2, len(data) - 1, len(data)):
                chunks = await drain(store.stream(BUCKET, key, start=start, chunk_size=chunk_size))
                assert all(type(c) is bytes and 0 < len(c) <= chunk_size for c in chunks)
                assert b"".join(chunks) == data[start:], start
                end = min(len(data), start + chunk_size + 7)  # a bounded stream: [start, end)
                chunks = await drain(store.stream(BUCKET, key, start=start, chunk_size=chunk_size, end=end))
                assert b"".join(chunks) == data[start:end] and all(len(c) <= chunk_size for c in chunks), start
            with pytest.raises(InvalidRangeError, match="past the end"):
                await drain(store.stream(BUCKET, key, start=len(data) + 1, chunk_size=chunk_size))


async def test_stream_closed_early_leaves_the_store_usable(server, big):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, "stream/early", big)
            for _ in range(40):  # more than the pool holds: a pinned connection would show
                async with aclosing(store.stream(BUCKET, "stream/early", chunk_size=65536)) as chunks:
                    async for first in chunks:
                        assert first == big[:len(first)]
                        break
            assert await store.get(BUCKET, "stream/early") == big


async def test_zero_byte_object_streams_nothing(server):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, "stream/empty", b"")
            assert await drain(store.stream(BUCKET, "stream/empty")) == []


# ----------------------------------------------------------------------- listing


@pytest.fixture(scope="module")
def listed(server):
    """1,100 keys under ``many/`` (more than one 1,000-key page) and decoys around them."""
    keys = [f"many/{i:05d}.bin" for i in range(1100)]
    keys += ["many/sub/a.txt", "many/sub/b.txt", "many-x/1", "man", "manz/1", "many0"]

    async def upload():
        async with opened(server.config) as store:
            limiter = anyio.CapacityLimiter(32)

            async def put(key):
                async with limiter:
                    await store.put(BUCKET, key, key.encode())

            async with anyio.create_task_group() as tg:
                for key in keys:
                    tg.start_soon(put, key)

    anyio.run(upload)
    return sorted(keys)


@pytest.mark.parametrize(
    "prefix",
    ["many/", "many/0", "many/001", "many/0109", "many/00999", "many/sub/", "many/sub/b",
     "many", "man", "many-", "many-x", "many0", "many/s", "many/10", "nothing/", "many/01100", ""],
)
async def test_list_matches_botocore(server, listed, prefix):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            got = await drain(store.list(BUCKET, prefix))
    # the server's order, whatever it is (SeaweedFS lists directory by directory: many/... comes
    # before many-x/1), and exactly botocore's keys
    assert [tuple(info) for info in got] == boto_keys(server, prefix)
    keys = [info.key for info in got]
    if prefix:  # "" also lists what other tests wrote
        assert sorted(keys) == [key for key in listed if key.startswith(prefix)]
    if prefix == "many/":
        assert len(keys) == len(set(keys)) == 1102  # across pages, nothing lost or repeated


async def test_list_closed_early(server, listed):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store, aclosing(store.list(BUCKET, "many/")) as infos:
            async for info in infos:
                assert info.key == "many/00000.bin"
                break


async def test_awkward_keys_round_trip_with_botocore(server):
    keys = ["odd/a b.txt", "odd/x%41.bin", "odd/ü.bin", "odd/q?x=1", "odd/hash#1", "odd/plus+sign",
            "odd/star*", "odd/tilde~", "odd/brace{1}", "odd/caret^", "odd/semi;colon"]
    client = server.client()
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            for key in keys:
                client.put_object(Bucket=BUCKET, Key=key, Body=b"boto:" + key.encode())
                assert await store.get(BUCKET, key) == b"boto:" + key.encode()
                await store.put(BUCKET, key, b"obstore:" + key.encode())
                assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"obstore:" + key.encode()
            listed = [info.key for info in await drain(store.list(BUCKET, "odd/"))]
    assert listed == [listed[0] for listed in boto_keys(server, "odd/")] == sorted(keys)


async def test_keys_object_store_cannot_address_fail_clearly(server):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, "leading", b"not the object asked for")
            for key in ("odd//double", "/leading", "trailing/", "odd/./dot", "odd/../up", "odd/ctl\x01"):
                with pytest.raises(StoreError, match="use store='aioboto3'") as info:
                    await store.get(BUCKET, key)
                assert info.value.key == key


# ----------------------------------------------------------------------- errors


async def test_missing_key(server):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            for request in (store.get(BUCKET, "nope/k"), store.get_range(BUCKET, "nope/k", 1, 5),
                            drain(store.stream(BUCKET, "nope/k"))):
                with pytest.raises(NoSuchKeyError, match=(
                    rf"no object 'nope/k' in bucket '{BUCKET}' at {server.endpoint_url} \(HTTP 404\); "
                    "check the key list or manifest"
                )) as info:
                    await request
                assert (info.value.bucket, info.value.key) == (BUCKET, "nope/k")
                assert isinstance(info.value, FileNotFoundError)


async def test_missing_bucket(server):
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            for request in (store.get("no-such-bucket", "k"), drain(store.list("no-such-bucket", "p/")),
                            store.put("no-such-bucket", "k", b"x")):
                with pytest.raises(NoSuchBucketError, match=(
                    rf"bucket 'no-such-bucket' does not exist at {server.endpoint_url}; create it or "
                    "fix the URI"
                )) as info:
                    await request
                assert info.value.bucket == "no-such-bucket"


async def test_wrong_secret_is_access_denied_without_the_secret(server, probe):
    wrong = "wrong-secret-" + "z" * 20
    config = S3Config(endpoint_url=server.endpoint_url, access_key_id=server.config.access_key_id,
                      secret_access_key=wrong)
    with anyio.fail_after(DEADLINE):
        async with opened(config) as store:
            for request in (store.get(BUCKET, probe), drain(store.list(BUCKET, "many/")),
                            store.put(BUCKET, "denied", b"x")):
                with pytest.raises(AccessDeniedError, match=r"access denied to s3://obs/.* the "
                                   "credentials were rejected or lack permission") as info:
                    await request
                text = str(info.value) + repr(info.value) + repr(store)
                assert wrong not in text and server.config.secret_access_key not in text
                assert isinstance(info.value, PermissionError)


@pytest.mark.server_sensitive
async def test_s3_errors_read_the_same_on_each_server(s3_server):
    """Missing key and bucket, a range past the end, a wrong secret: servers word and code these
    answers differently (and obstore hands them over as text); the loader's errors must not."""
    bucket = s3_server.new_bucket("obs-errors")
    wrong = dataclasses.replace(s3_server.config, secret_access_key="wrong-secret-" + "z" * 20)
    with anyio.fail_after(DEADLINE):
        async with opened(s3_server.config) as store:
            await store.put(bucket, "ten", b"0123456789")
            with pytest.raises(NoSuchKeyError, match=rf"no object 'nope/k' in bucket '{bucket}'") as info:
                await store.get(bucket, "nope/k")
            assert (info.value.bucket, info.value.key) == (bucket, "nope/k")
            with pytest.raises(NoSuchBucketError, match="bucket 'no-such-bucket' does not exist"):
                await store.get("no-such-bucket", "k")
            with pytest.raises(InvalidRangeError, match=r"past the end of the object \(10 bytes\)"):
                await store.get_range(bucket, "ten", 11, 20)
        async with opened(wrong) as store:
            with pytest.raises(AccessDeniedError, match="credentials were rejected") as denied:
                await store.get(bucket, "ten")
            assert "wrong-secret" not in str(denied.value) + repr(store)


async def test_unreachable_endpoint_fails_fast(server):
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="AK", secret_access_key="SK")
    with anyio.fail_after(DEADLINE):
        async with opened(config, deadline=120) as store:  # retried to 120 s, fail_after would end it
            with pytest.raises(EndpointUnreachableError,
                               match=r"cannot connect to http://127\.0\.0\.1:9 for s3://obs/k"):
                await store.get(BUCKET, "k")


async def test_no_secret_in_repr(server, probe):
    secret = server.config.secret_access_key
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            assert await store.get(BUCKET, probe) == b"1"
            text = repr(store) + str(store)
            for s3store in store._stores.values():
                text += repr(s3store) + repr(s3store.config) + repr(s3store.credential_provider)
    assert secret not in text


async def test_the_environment_cannot_redirect_or_unsign(server, monkeypatch):
    """obstore reads AWS_* itself; S3Config must win over every one of them."""
    for name, value in {"AWS_SESSION_TOKEN": "bogus", "AWS_SKIP_SIGNATURE": "true",
                        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                        "AWS_ACCESS_KEY_ID": "WRONG", "AWS_SECRET_ACCESS_KEY": "WRONG",
                        "AWS_ALLOW_HTTP": "false", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "true"}.items():
        monkeypatch.setenv(name, value)
    with anyio.fail_after(DEADLINE):
        async with opened(server.config) as store:
            await store.put(BUCKET, "env/k", b"v")
            assert await store.get(BUCKET, "env/k") == b"v"


# ----------------------------------------------------------------------- through the dataset


def test_dataset_reads_200_objects_exactly_once(server):
    client = server.client()
    expected = {}
    for i in range(200):
        body = hashlib.sha256(str(i).encode()).digest() * 100
        client.put_object(Bucket=BUCKET, Key=f"ds/{i:04d}.bin", Body=body)
        expected[f"ds/{i:04d}"] = body
    dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/ds/", store="obstore", shuffle=True, seed=1,
                                         limits=Limits(concurrency=32), config=server.config)
    samples = list(dataset)
    keys = [sample["__key__"] for sample in samples]
    assert len(keys) == len(set(keys)) == 200
    assert {sample["__key__"]: sample["bin"] for sample in samples} == expected
    assert all(sample["__url__"] == f"s3://{BUCKET}/{sample['__key__']}.bin" for sample in samples)
    assert all(type(sample["bin"]) is bytes for sample in samples)


# ----------------------------------------------------------------------- fork


def _read_in_child(config: S3Config, queue) -> None:
    async def use():
        async with opened(config) as store:
            return await store.get(BUCKET, "fork/probe")

    try:
        queue.put(("ok", asyncio.run(use())))
    except Exception as exc:
        queue.put((type(exc).__name__, str(exc)))


async def _use_here(config: S3Config) -> None:
    async with opened(config) as store:
        await store.put(BUCKET, "fork/probe", b"probe")
        assert await store.get(BUCKET, "fork/probe") == b"probe"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_processes_after_use_in_the_parent(server, method):
    """obstore's runtime does not survive fork(): a forked child must fail fast with advice, never
    hang; a spawned child starts its own runtime and reads normally."""
    anyio.run(_use_here, server.config)  # this process has now made requests through obstore
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(server.config, queue))
    child.start()
    try:
        outcome = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if method == "fork":
        assert outcome[0] == "ConfigError" and "multiprocessing_context='spawn'" in outcome[1]
    else:
        assert outcome == ("ok", b"probe")
