"""The fault-injecting proxy (integration/faults/): exact pass-through, each fault as a client sees it.

Two upstreams: a tiny aiohttp S3 look-alike of our own (fixed bodies, a 64 MB one, a chunked one,
PUT that stores; it records what reached it), and a real S3 server on this machine (the session's
``s3_server`` when it is local, else the embedded SeaweedFS), which also checks request
signatures: a signed request that arrives altered fails there. Clients are boto3 with retries off, so each
fault surfaces as exactly one error.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import http.client
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
from aiohttp import web
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from faults import FAULT_KINDS, Decision, FaultDecider, FaultPlan, FaultProxy

pytestmark = pytest.mark.timeout(60)

BIG = 64 * 1024 * 1024
SMALL = b"hello, proxy\n" * 100
CHUNKS = [bytes([i]) * (1000 + 37 * i) for i in range(20)]


# ---------------------------------------------------------------------------------------------
# A tiny S3 look-alike upstream: path-style /bucket/key, GET/HEAD/PUT, no signature checks.


class Upstream:
    """An aiohttp server on 127.0.0.1 in a thread; ``objects`` maps key -> bytes."""

    def __init__(self, *, keepalive_timeout: float = 75.0) -> None:
        self.keepalive_timeout = keepalive_timeout
        self.objects: dict[str, bytes] = {
            "small": SMALL,
            "big": random.Random(7).randbytes(BIG),
            "empty": b"",
        }
        self.seen: list[dict] = []  # per request: method, path, host, peer port, headers
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-upstream", daemon=True)
        self.port = 0

    def __enter__(self) -> Upstream:
        self._thread.start()
        if not self._ready.wait(10):  # where its thread stands says why (seen once, not explained)
            frame = sys._current_frames().get(self._thread.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "its thread has ended"
            raise AssertionError(f"upstream did not start within 10 s; its thread:\n{where}")
        return self

    def __exit__(self, *exc_info) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        """Client connections the server holds open now (idle keep-alive ones included)."""
        return len(self._server.connections)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.run_until_complete(self._cancel_leftovers())
        self._loop.close()

    @staticmethod
    async def _cancel_leftovers() -> None:
        """Handlers of connections cut mid-request may still wait: end them before the loop."""
        leftover = asyncio.all_tasks() - {asyncio.current_task()}
        for task in leftover:
            task.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=BIG * 2)
        app.router.add_route("GET", "/{bucket}", self._list)
        app.router.add_route("PUT", "/denied/{key:.*}", self._handle, expect_handler=self._deny)
        app.router.add_route("*", "/{bucket}/{key:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.keepalive_timeout)
        await runner.setup()
        self._server = runner.server
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _deny(self, request: web.Request) -> web.Response:
        """Refuse an upload at ``Expect: 100-continue`` time, before its body is sent."""
        self.seen.append({"method": "EXPECT", "path": request.path, "host": request.headers.get("Host"),
                          "peer_port": request.transport.get_extra_info("peername")[1],
                          "headers": dict(request.headers)})
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        return web.Response(status=403, body=body, content_type="application/xml")

    async def _list(self, request: web.Request) -> web.Response:
        contents = "".join(f"<Contents><Key>{key}</Key><Size>{len(body)}</Size></Contents>"
                           for key, body in sorted(self.objects.items()))
        body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                f"<Name>{request.match_info['bucket']}</Name><KeyCount>{len(self.objects)}</KeyCount>"
                f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>")
        return web.Response(body=body.encode(), content_type="application/xml")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        self.seen.append({
            "method": request.method,
            "path": request.path,
            "host": request.headers.get("Host"),
            "peer_port": request.transport.get_extra_info("peername")[1],
            "headers": dict(request.headers),
        })
        if request.method == "PUT":
            body = await request.read()
            if "aws-chunked" in request.headers.get("Content-Encoding", ""):
                body = _decode_aws_chunked(body)
            self.objects[key] = body
            return web.Response(status=200, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
        if key == "chunked":
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for chunk in CHUNKS:
                await response.write(chunk)
            await response.write_eof()
            return response
        if key not in self.objects:
            body = b"<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>"
            return web.Response(status=404, body=body, content_type="application/xml")
        body = self.objects[key]
        return web.Response(body=body, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'},
                            content_type="application/octet-stream")


def _decode_aws_chunked(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            return bytes(out)
        out += body[pos:pos + size]
        pos += size + 2


@pytest.fixture(scope="module")
def upstream():
    with Upstream() as server:
        yield server


def s3_client(endpoint_url: str, *, read_timeout: float = 10, access_key: str = "test",
              secret_key: str = "test-secret", **config):
    """A boto3 client that never retries: one call, one request, one error."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(
            retries={"total_max_attempts": 1},  # note: {"max_attempts": 1} would still retry once
            connect_timeout=5,
            read_timeout=read_timeout,
            s3={"addressing_style": "path"},
            **config,
        ),
    )


@dataclasses.dataclass
class Target:
    """An upstream S3 endpoint with ``small`` and ``big`` objects in ``bucket``."""

    name: str
    url: str
    access_key: str
    secret_key: str
    bucket: str
    big: bytes
    fake: Upstream | None = None  # the aiohttp upstream, whose records tests can inspect

    def client(self, endpoint_url: str | None = None, **options):
        return s3_client(endpoint_url or self.url, access_key=self.access_key, secret_key=self.secret_key,
                         **options)


@pytest.fixture(scope="module", params=["fake", "real"])
def target(request, upstream):
    """Each test runs against our aiohttp look-alike and a real S3 server, which verifies
    signatures and so proves that the proxy forwards signed requests unaltered. The real one is the
    session's ``s3_server`` (integration/conftest.py) when it runs on this machine, else an
    embedded SeaweedFS of our own; the proxy only ever forwards to 127.0.0.1."""
    if request.param == "fake":
        yield Target("fake", upstream.url, "test", "test-secret", "b", upstream.objects["big"], upstream)
        return
    with contextlib.ExitStack() as stack:
        kind, config, bucket = _real_server(request, stack)
        target = Target(kind, _loopback(config.endpoint_url), config.access_key_id, config.secret_access_key,
                        bucket, upstream.objects["big"])
        client = target.client()
        client.put_object(Bucket=bucket, Key="small", Body=SMALL)
        client.put_object(Bucket=bucket, Key="big", Body=target.big)
        client.close()
        yield target


def _real_server(request, stack: contextlib.ExitStack):
    """``(kind, S3Config, bucket)`` of a real S3 server listening on this machine."""
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.FixtureLookupError:  # run without integration/conftest.py
        server = None
    except Exception:
        server = None
    if server is not None and _loopback(server.config.endpoint_url):
        return server.kind, server.config, server.new_bucket("faults")
    try:
        from loader.tools.devserver import DevServer
    except ImportError as exc:
        pytest.fail(f"the embedded SeaweedFS (a test dependency) is missing: {exc}")
    try:
        dev = stack.enter_context(DevServer(buckets=["faults"]))  # SeaweedFS wants 3+ characters
    except Exception as exc:
        pytest.fail(f"the embedded SeaweedFS (a test dependency) did not start: {exc}")
    return "seaweedfs-embedded", dev.config, "faults"


def _loopback(endpoint_url: str | None) -> str | None:
    """``http://127.0.0.1:<port>`` for an endpoint on this machine (``localhost`` included), else None."""
    parts = urlsplit(endpoint_url or "")
    if parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost") and parts.port:
        return f"http://127.0.0.1:{parts.port}"
    return None


@contextlib.contextmanager
def closing_client(target: Target, proxy: FaultProxy, **options):
    client = target.client(proxy.endpoint_url, **options)
    try:
        yield client
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# Pass-through.


def test_pass_through_is_exact(target, no_leaked_threads):
    start = len(target.fake.seen) if target.fake is not None else 0
    with FaultProxy(target.url) as proxy, closing_client(target, proxy) as client:
        assert client.get_object(Bucket=target.bucket, Key="small")["Body"].read() == SMALL
        body = client.get_object(Bucket=target.bucket, Key="big")["Body"].read()
        assert len(body) == BIG and hashlib.sha256(body).digest() == hashlib.sha256(target.big).digest()
        payload = random.Random(3).randbytes(3 * 1024 * 1024 + 17)
        client.put_object(Bucket=target.bucket, Key="uploaded", Body=payload)  # Expect: 100-continue
        assert client.get_object(Bucket=target.bucket, Key="uploaded")["Body"].read() == payload
        assert client.head_object(Bucket=target.bucket, Key="big")["ContentLength"] == BIG
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=target.bucket)["Contents"]]
        assert {"small", "big", "uploaded"} <= set(keys)
        with pytest.raises(ClientError) as info:
            client.get_object(Bucket=target.bucket, Key="missing")
        assert info.value.response["Error"]["Code"] == "NoSuchKey"
        assert proxy.counts == {"requests": 7}
    if target.fake is not None:
        # The Host header reached the upstream as the client signed it: the proxy's address.
        # (The upstream is shared by this module's tests: a late request of an earlier test's
        # proxy may land meanwhile, so keep this test's own; the listing is not recorded.)
        seen = [s for s in target.fake.seen[start:] if s["host"] == f"127.0.0.1:{proxy.port}"]
        assert len(seen) == 6, [s["host"] for s in target.fake.seen[start:]]
        assert seen[2]["method"] == "PUT" and seen[2]["headers"].get("Expect") == "100-continue"
        # One client connection, one upstream connection, reused (keep-alive on both sides).
        assert len({s["peer_port"] for s in seen}) == 1


@pytest.mark.parametrize("target", ["real"], indirect=True)  # only a real server checks signatures
def test_wrongly_signed_request_is_refused_upstream(target):
    with FaultProxy(target.url) as proxy:
        bad = s3_client(proxy.endpoint_url, access_key=target.access_key, secret_key="not-the-secret")
        with pytest.raises(ClientError) as info:
            bad.get_object(Bucket=target.bucket, Key="small")
        bad.close()
        assert info.value.response["Error"]["Code"] in ("SignatureDoesNotMatch", "AccessDenied",
                                                          "InvalidAccessKeyId")


def test_chunked_response_and_keep_alive_raw(upstream):
    """Chunked bodies pass through byte for byte (framing included) on a keep-alive connection."""
    with FaultProxy(upstream.url) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            stream = sock.makefile("rb")
            for _ in range(3):
                sock.sendall(b"GET /b/chunked HTTP/1.1\r\nHost: anything\r\n\r\n")
                head = _read_head(stream)
                assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
                body = bytearray()
                while True:
                    size = int(stream.readline().split(b";")[0], 16)
                    if size == 0:
                        assert stream.readline() == b"\r\n"
                        break
                    body += stream.read(size)
                    assert stream.read(2) == b"\r\n"
                assert bytes(body) == b"".join(CHUNKS)
                sock.sendall(b"GET /b/small HTTP/1.1\r\nHost: anything\r\n\r\n")
                head = _read_head(stream)
                assert b"content-length: %d" % len(SMALL) in head.lower()
                assert stream.read(len(SMALL)) == SMALL
        assert proxy.counts["requests"] == 6
    with FaultProxy(upstream.url) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/b/chunked")
        assert conn.getresponse().read() == b"".join(CHUNKS)
        conn.close()


def _read_head(stream) -> bytes:
    lines = []
    while (line := stream.readline()) not in (b"\r\n", b""):
        lines.append(line)
    return b"".join(lines)


def test_idle_upstream_connection_closed_by_upstream_is_reopened(no_leaked_threads):
    with Upstream(keepalive_timeout=0.1) as quick, FaultProxy(quick.url) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        for _ in range(3):
            conn.request("GET", "/b/small")
            assert conn.getresponse().read() == SMALL
            deadline = time.monotonic() + 10
            while quick.open_connections:  # the upstream drops its idle side of the connection
                assert time.monotonic() < deadline, "the upstream kept its idle connection for 10 s"  # hang guard
                time.sleep(0.01)
        conn.close()
        assert proxy.counts == {"requests": 3}
        assert len({s["peer_port"] for s in quick.seen}) == 3


def test_upload_refused_before_its_body_is_sent(upstream):
    """``Expect: 100-continue`` answered with a final status: relayed, and the connection ends."""
    with FaultProxy(upstream.url) as proxy:
        client = s3_client(proxy.endpoint_url)
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket="denied", Key="k", Body=b"z" * 100_000)
        assert info.value.response["Error"]["Code"] == "AccessDenied"
        assert upstream.seen[-1]["method"] == "EXPECT"  # refused at 100-continue time
        client.close()
        # The refused connection is closed by design; whether the client notices before reusing
        # it is a race in urllib3, so the proxy's health is checked on a fresh connection.
        client = s3_client(proxy.endpoint_url)
        assert client.get_object(Bucket="b", Key="small")["Body"].read() == SMALL
        client.close()
        assert proxy.counts == {"requests": 2}


def test_client_gone_mid_upload_leaves_the_proxy_serving(upstream):
    with FaultProxy(upstream.url) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"PUT /b/partial HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n" + b"p" * 1000)
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/b/small")
        assert conn.getresponse().read() == SMALL
        conn.close()
        assert "partial" not in upstream.objects
        assert proxy.counts == {"requests": 2}


def test_upstream_down_gives_502():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]  # bound, not listening: connections are refused
        with FaultProxy(f"http://127.0.0.1:{port}") as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            conn.request("GET", "/b/small")
            response = conn.getresponse()
            assert response.status == 502
            response.read()
            conn.close()
            assert proxy.counts == {"requests": 1, "upstream_errors": 1}


# ---------------------------------------------------------------------------------------------
# Each fault, as a boto3 client sees it.


def test_latency_delays_each_request(target):
    with FaultProxy(target.url, FaultPlan(latency=0.25)) as proxy, closing_client(target, proxy) as client:
        client.get_object(Bucket=target.bucket, Key="small")["Body"].read()  # connect outside the clock
        for _ in range(3):
            start = time.perf_counter()
            assert client.get_object(Bucket=target.bucket, Key="small")["Body"].read() == SMALL
            assert time.perf_counter() - start >= 0.25
        client.put_object(Bucket=target.bucket, Key="slow-put", Body=b"x")  # latency hits every method
        assert proxy.counts == {"requests": 5, "latency": 5}


def test_bandwidth_paces_each_answer_not_the_proxy(target):
    """Each answer's body comes at most at ``bandwidth`` bytes/s; answers in parallel are paced
    each on its own (as S3 serves each connection): their bodies arrive side by side, not one
    after the other. (Orders and a lower bound: both hold however busy the machine is.)"""
    rate = 4 * len(target.big)  # a quarter of a second per answer of the big object
    arrivals: list[str] = []  # who got the next MiB, in the order they came

    def fetch(name: str, client) -> bytes:
        body, got = client.get_object(Bucket=target.bucket, Key="big")["Body"], []
        while chunk := body.read(1 << 20):
            got.append(chunk)
            arrivals.append(name)
        return b"".join(got)

    with (FaultProxy(target.url, FaultPlan(bandwidth=rate)) as proxy,
          closing_client(target, proxy) as first, closing_client(target, proxy) as second):
        for client in (first, second):
            client.get_object(Bucket=target.bucket, Key="small")["Body"].read()  # connect outside the clock
        start = time.perf_counter()
        assert first.get_object(Bucket=target.bucket, Key="big")["Body"].read() == target.big
        one = time.perf_counter() - start
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bodies = list(pool.map(fetch, ("first", "second"), (first, second)))
    assert bodies == [target.big, target.big]
    assert one >= 0.9 * len(target.big) / rate  # no faster than the bandwidth allows ...
    # ... per answer: each body began before the other ended (one after the other, either would
    # have come whole before the other's first MiB).
    last = {name: len(arrivals) - 1 - arrivals[::-1].index(name) for name in ("first", "second")}
    assert arrivals.index("second") < last["first"] and arrivals.index("first") < last["second"], arrivals


def test_reset_is_a_connection_error(target):
    with FaultProxy(target.url, FaultPlan(reset=1.0)) as proxy, closing_client(target, proxy) as client:
        with pytest.raises(ConnectionClosedError) as info:
            client.get_object(Bucket=target.bucket, Key="small")
        assert "closed before we received a valid response" in str(info.value)
        # Only GETs of objects are hit by default: uploads and listings stay reliable.
        client.put_object(Bucket=target.bucket, Key="reliable", Body=b"data")
        client.list_objects_v2(Bucket=target.bucket)
        assert proxy.counts == {"requests": 3, "reset": 1}
        # A reset, not an orderly close: the client's next read fails with ECONNRESET.
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"GET /b/small HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(ConnectionResetError):
                sock.recv(100)


def test_slowdown_is_503_with_s3_error_body(target):
    with FaultProxy(target.url, FaultPlan(slowdown=1.0, slowdown_close=False)) as proxy, \
            closing_client(target, proxy) as client:
        seen_before = len(target.fake.seen) if target.fake else 0
        for _ in range(2):  # the connection stays usable after a SlowDown
            with pytest.raises(ClientError) as info:
                client.get_object(Bucket=target.bucket, Key="small")
            error = info.value.response
            assert error["Error"]["Code"] == "SlowDown"
            assert error["Error"]["Message"] == "Please reduce your request rate."
            assert error["ResponseMetadata"]["HTTPStatusCode"] == 503
        if target.fake:
            assert len(target.fake.seen) == seen_before  # the upstream was never asked
        assert proxy.counts == {"requests": 2, "slowdown": 2}
    with FaultProxy(target.url, FaultPlan(slowdown=1.0, slowdown_close=False)) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/b/small")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 503 and int(response.headers["Content-Length"]) == len(body)
        assert body.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>')
        assert b"<Resource>/b/small</Resource>" in body
        conn.close()


def test_slowdown_closes_the_connection_with_a_chunked_body_as_s3_does(upstream):
    """The default: ``Connection: close``, the XML error chunked, then the connection ends (every
    SlowDown costs the client a new connection, as on S3)."""
    with FaultProxy(upstream.url, FaultPlan(slowdown=1.0)) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/b/small")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 503 and response.headers["Connection"] == "close"
        assert response.headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in response.headers
        assert body.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>')
        assert response.will_close
        conn.close()


def _answered(decider: FaultDecider, times) -> list[bool]:
    """Whether each GET, arriving at these times, was let through by the throttle."""
    return [not decider.decide("GET", "/b/k", now).throttled for now in times]


def test_a_window_throttle_answers_at_most_its_rate_in_any_second():
    """A burst takes the window's whole second: what comes after it in that second is refused,
    where the token bucket lets the refill through."""
    burst = [0.0] * 300 + [0.1 * i for i in range(1, 10)]
    window = _answered(FaultDecider(FaultPlan(get_rate=100.0, throttle="window")), burst + [1.0, 1.05])
    assert sum(window[:300]) == 100 and not any(window[300:309])  # the rest of the second refused
    assert window[309:] == [True, True]  # a second later there is room again
    bucket = _answered(FaultDecider(FaultPlan(get_rate=100.0)), burst)
    assert sum(bucket[:300]) == 50 and all(bucket[300:])  # half a second's worth, then the refill
    times = [i / 250 for i in range(2500)]  # 250/s for 10 s against 100/s
    got = _answered(FaultDecider(FaultPlan(get_rate=100.0, throttle="window")), times)
    for start in range(0, 2500 - 250, 25):
        assert sum(got[start:start + 250]) <= 100  # no one-second stretch over the limit


@pytest.mark.parametrize("shape", ["bucket", "window"])
def test_a_throttle_doubles_after_sustained_load_and_starts_over_after_a_pause(shape):
    plan = FaultPlan(get_rate=100.0, throttle=shape, get_rate_rises_after=20.0)
    decider = FaultDecider(plan)
    answered = _answered(decider, [i / 400 for i in range(400 * 30)])  # 400/s for 30 s
    first, last = sum(answered[400 * 10:400 * 19]) / 9, sum(answered[400 * 21:400 * 30]) / 9
    assert first == pytest.approx(100, abs=3) and last == pytest.approx(200, abs=3)
    assert decider.rate_at(30.0 + 2 * plan.get_rate_rises_after) == 100.0  # a pause: load starts over
    with pytest.raises(ValueError, match="throttle="):
        FaultPlan(get_rate=1.0, throttle="leaky")
    with pytest.raises(ValueError, match="get_rate_rises_after="):
        FaultPlan(get_rate=1.0, get_rate_rises_after=0)


def test_truncate_breaks_off_the_body(target):
    with FaultProxy(target.url, FaultPlan(truncate=1.0, seed=5)) as proxy, closing_client(target, proxy) as client:
        for key, size in (("small", len(SMALL)), ("big", BIG)):
            response = client.get_object(Bucket=target.bucket, Key=key)
            assert response["ContentLength"] == size  # the real Content-Length
            with pytest.raises((IncompleteReadError, ResponseStreamingError)):
                response["Body"].read()
        assert proxy.counts == {"requests": 2, "truncate": 2}


def test_stall_is_a_read_timeout(target, no_leaked_threads):
    plan = FaultPlan(stall=1.0, stall_seconds=60)
    with FaultProxy(target.url, plan) as proxy, closing_client(target, proxy, read_timeout=1) as client:
        start = time.perf_counter()
        with pytest.raises(ReadTimeoutError):
            client.get_object(Bucket=target.bucket, Key="big")["Body"].read()
        assert time.perf_counter() - start >= 0.9  # the client's timeout, not sooner
        assert proxy.counts == {"requests": 1, "stall": 1}
    # Leaving the block stopped the proxy: stop() raises if its thread outlives its 10 s, and
    # the stall still had most of its 60 s to go, so stopping did not wait for it.
    assert not proxy.running and not proxy.thread.is_alive()


def test_faults_on_every_method_when_asked(target):
    plan = FaultPlan(reset=1.0, only_methods=None)
    with FaultProxy(target.url, plan) as proxy, closing_client(target, proxy) as client:
        with pytest.raises(ConnectionClosedError):
            client.put_object(Bucket=target.bucket, Key="never", Body=b"x" * 1000)
        proxy.set_plan(FaultPlan(reset=1.0, only_methods=("PUT",)))
        assert client.get_object(Bucket=target.bucket, Key="small")["Body"].read() == SMALL
        with pytest.raises(ConnectionClosedError):
            client.put_object(Bucket=target.bucket, Key="never", Body=b"x")
        proxy.set_plan(FaultPlan(reset=1.0, objects_only=False))
        with pytest.raises(ConnectionClosedError):
            client.list_objects_v2(Bucket=target.bucket)
        proxy.set_plan(FaultPlan())  # live change: everything passes again
        client.put_object(Bucket=target.bucket, Key="now", Body=b"x")
        client.list_objects_v2(Bucket=target.bucket)
        assert proxy.counts == {"requests": 6, "reset": 3}


# ---------------------------------------------------------------------------------------------
# Seeds and counts.


def run_sequence(target: Target, plan: FaultPlan, n: int) -> tuple[list[str], FaultProxy]:
    """``n`` GETs of ``small``, each classified by what the client saw."""
    outcomes = []
    with FaultProxy(target.url, plan) as proxy, closing_client(target, proxy, read_timeout=0.5) as client:
        for _ in range(n):
            try:
                body = client.get_object(Bucket=target.bucket, Key="small")["Body"].read()
                assert body == SMALL
                outcomes.append("ok")
            except ConnectionClosedError:
                outcomes.append("reset")
            except ClientError as exc:
                assert exc.response["Error"]["Code"] == "SlowDown"
                outcomes.append("slowdown")
            except (IncompleteReadError, ResponseStreamingError):
                outcomes.append("truncate")
            except ReadTimeoutError:
                outcomes.append("stall")
    return outcomes, proxy


def test_same_seed_same_faults_and_counts_add_up(target):
    plan = FaultPlan(reset=0.15, slowdown=0.15, truncate=0.15, stall=0.05, stall_seconds=2, seed=5)
    first, proxy = run_sequence(target, plan, 40)
    again, proxy_again = run_sequence(target, plan, 40)
    assert first == again
    assert proxy.decisions == proxy_again.decisions
    # What the client saw is what the proxy decided, which is the pure decider's sequence.
    decider = FaultDecider(plan)
    expected = [decider.decide("GET", "/b/small").kind or "ok" for _ in range(40)]
    assert first == expected
    assert [kind or "ok" for _, _, kind in proxy.decisions] == expected
    counts = proxy.counts
    assert counts["requests"] == 40
    for kind in FAULT_KINDS:
        assert counts[kind] == expected.count(kind), kind
    assert len(set(expected)) == 5  # every outcome occurs at least once with this seed
    other, _ = run_sequence(target, dataclasses.replace(plan, seed=43), 40)
    assert other != first


def test_decider_is_a_pure_function_of_seed_and_methods():
    plan = FaultPlan(reset=0.1, slowdown=0.2, truncate=0.3, stall=0.1, seed=9)
    methods = random.Random(1).choices(["GET", "PUT", "HEAD"], k=500)
    one, two = FaultDecider(plan), FaultDecider(plan)
    decisions = [one.decide(m, "/b/k") for m in methods]
    assert decisions == [two.decide(m, "/b/k") for m in methods]
    assert all(d.kind is None for d, m in zip(decisions, methods) if m != "GET")
    gets = [d.kind for d, m in zip(decisions, methods) if m == "GET"]
    for kind, p in (("reset", 0.1), ("slowdown", 0.2), ("truncate", 0.3), ("stall", 0.1)):
        assert abs(gets.count(kind) / len(gets) - p) < 0.1
    # Every request draws, whatever its method, so a GET's fate depends only on its position.
    only_gets = FaultDecider(plan)
    all_gets = [only_gets.decide("GET", "/b/k") for _ in methods]
    assert [d.fraction for d in all_gets] == [d.fraction for d in decisions]
    assert [g.kind for g, m in zip(all_gets, methods) if m == "GET"] == gets
    other = FaultDecider(dataclasses.replace(plan, seed=10))
    assert [other.decide("GET", "/b/k").kind for _ in range(50)] != [d.kind for d in all_gets[:50]]
    assert all(isinstance(d, Decision) and 0 <= d.fraction < 1 for d in decisions)


# ---------------------------------------------------------------------------------------------
# Many connections at once (the benchmarks' use).


async def _raw_get(reader, writer, path: str) -> str:
    """One GET on a raw connection, classified by what came back."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except ConnectionResetError:
        return "reset"
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        return "truncate"
    if lines[0].startswith("HTTP/1.1 503") and b"<Code>SlowDown</Code>" in body:
        return "slowdown"
    assert lines[0].startswith("HTTP/1.1 200") and body == SMALL
    return "ok"


def test_many_keep_alive_connections_with_latency(upstream):
    connections, per_connection, latency = 64, 10, 0.05

    async def one_connection(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        outcomes = [await _raw_get(reader, writer, "/b/small") for _ in range(per_connection)]
        writer.close()
        await writer.wait_closed()
        return outcomes

    async def run(port):
        return await asyncio.wait_for(asyncio.gather(*(one_connection(port) for _ in range(connections))), 30)

    seen_before = len(upstream.seen)
    with FaultProxy(upstream.url, FaultPlan(latency=latency)) as proxy:
        start = time.perf_counter()
        results = asyncio.run(run(proxy.port))
        elapsed = time.perf_counter() - start
        assert all(outcome == "ok" for outcomes in results for outcome in outcomes)
        assert proxy.counts == {"requests": 640, "latency": 640}
    assert per_connection * latency <= elapsed  # each connection's requests one after the other
    # Concurrent across connections, not one connection at a time: the upstream's first 64
    # requests came from many connections (served in turn, from the first 7).
    first_requests = upstream.seen[seen_before:seen_before + connections]
    assert len({s["peer_port"] for s in first_requests}) > connections // 2
    # Each client connection kept one upstream connection alive for all its requests.
    assert len({s["peer_port"] for s in upstream.seen[seen_before:]}) == connections


def test_counts_are_right_under_concurrency(upstream):
    plan = FaultPlan(reset=0.2, slowdown=0.2, truncate=0.2, seed=11, slowdown_close=False)

    async def one_request(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await _raw_get(reader, writer, "/b/small")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def run(port):
        outcomes = []
        for _ in range(10):
            outcomes += await asyncio.wait_for(asyncio.gather(*(one_request(port) for _ in range(32))), 30)
        return outcomes

    with FaultProxy(upstream.url, plan) as proxy:
        outcomes = collections.Counter(asyncio.run(run(proxy.port)))
        counts = proxy.counts
    assert counts.pop("requests") == 320 == sum(outcomes.values())
    assert counts == {kind: n for kind, n in outcomes.items() if kind != "ok"}
    assert set(outcomes) == {"ok", "reset", "slowdown", "truncate"}
    # The decisions in arrival order are the decider's sequence, whatever the interleaving.
    decider = FaultDecider(plan)
    assert [kind for _, _, kind in proxy.decisions] == [decider.decide("GET", "/b/small").kind
                                                        for _ in range(320)]


@settings(max_examples=60, deadline=None)
@given(
    probabilities=st.lists(st.floats(0, 0.25), min_size=4, max_size=4),
    seed=st.integers(0, 2**32),
    requests=st.lists(st.tuples(st.sampled_from(["GET", "PUT", "HEAD", "DELETE"]),
                                st.sampled_from(["/b/k", "/b/dir/k?x=1", "/b", "/b?list-type=2", "/"])),
                      max_size=60),
)
def test_decider_properties(probabilities, seed, requests):
    plan = FaultPlan(**dict(zip(FAULT_KINDS, probabilities)), seed=seed)
    one, two = FaultDecider(plan), FaultDecider(plan)
    first = [one.decide(m, t) for m, t in requests]
    assert [two.decide(m, t) for m, t in requests] == first
    for (method, target), decision in zip(requests, first):
        if not plan.applies_to(method, target):
            assert decision.kind is None
        assert decision.kind is None or getattr(plan, decision.kind) > 0
        assert 0 <= decision.fraction < 1
    everything = FaultDecider(FaultPlan(stall=0.5, truncate=0.5, seed=seed, only_methods=None, objects_only=False))
    assert all(everything.decide(m, t).kind in ("stall", "truncate") for m, t in requests)


# ---------------------------------------------------------------------------------------------
# Lifetime, stopping, validation.


def test_stops_by_itself_after_max_lifetime(upstream, no_leaked_threads):
    proxy = FaultProxy(upstream.url, max_lifetime=0.5).start()
    port = proxy.port
    held = socket.create_connection(("127.0.0.1", port), timeout=5)  # an idle keep-alive connection
    held.sendall(b"GET /b/small HTTP/1.1\r\nHost: x\r\n\r\n")
    assert held.recv(12) == b"HTTP/1.1 200"
    assert proxy.wait(5), "the proxy is still running after max_lifetime"
    assert not proxy.running and not proxy.thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("FaultProxy")]
    held.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        while held.recv(65536):  # the rest of the answer, then the end of the connection
            pass
    held.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    proxy.stop()  # idempotent


def test_stop_closes_connections_it_holds(upstream, no_leaked_threads):
    proxy = FaultProxy(upstream.url, FaultPlan(stall=1.0, stall_seconds=60)).start()
    held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    held.sendall(b"GET /b/big HTTP/1.1\r\nHost: x\r\n\r\n")
    assert held.recv(12) == b"HTTP/1.1 200"
    proxy.stop()  # raises if its thread outlives 10 s: the stall had 60 s to go
    assert not proxy.thread.is_alive()
    with contextlib.suppress(ConnectionResetError):
        while held.recv(1 << 20):
            pass
    held.close()
    assert not proxy.running


@pytest.mark.parametrize("url", [
    "http://localhost:9000", "http://10.0.0.1:9000", "http://0.0.0.0:9000", "https://127.0.0.1:9000",
    "http://127.0.0.1", "http://127.0.0.1:0", "http://127.0.0.1:9000/bucket", "http://[::1]:9000",
    "http://user:pw@127.0.0.1:9000", "127.0.0.1:9000", "http://127.0.0.2:9000",
])
def test_only_a_loopback_upstream_is_allowed(url):
    with pytest.raises(ValueError, match="upstream="):
        FaultProxy(url)


@pytest.mark.parametrize("kwargs, match", [
    ({"reset": 1.5}, "reset=1.5 must be a probability"),
    ({"stall": -0.1}, "stall=-0.1 must be a probability"),
    ({"reset": 0.6, "slowdown": 0.6}, "add up to"),
    ({"latency": -1}, "latency=-1 must be"),
    ({"stall_seconds": float("inf")}, "stall_seconds=inf"),
    ({"seed": 1.5}, "seed=1.5"),
    ({"bandwidth": 0}, "bandwidth=0 must be a positive number"),
    ({"only_methods": ["GET", ""]}, "only_methods"),
])
def test_plan_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultPlan(**kwargs)


def test_plan_normalises_methods():
    assert FaultPlan(only_methods="put").only_methods == ("PUT",)
    assert FaultPlan(only_methods=["get", "Head"]).applies_to("HEAD")
    assert FaultPlan(only_methods=None).applies_to("DELETE")
    assert not FaultPlan().applies_to("PUT")
    assert FaultPlan().applies_to("GET", "/bucket/dir/key.jpg?versionId=1")
    assert not FaultPlan().applies_to("GET", "/bucket?list-type=2&prefix=a/")
    assert not FaultPlan().applies_to("GET", "/bucket/")
    assert not FaultPlan().applies_to("GET", "/")
    assert FaultPlan(objects_only=False).applies_to("GET", "/bucket?list-type=2")


def test_not_started_proxy_has_no_endpoint(upstream):
    proxy = FaultProxy(upstream.url)
    with pytest.raises(RuntimeError, match="not started"):
        _ = proxy.endpoint_url
    proxy.stop()  # harmless
    assert "not started" in repr(proxy)


def test_command_line(upstream):
    """``python -m faults`` (from ``integration/``): prints the endpoint, serves, stops on SIGTERM."""
    here = Path(__file__).parent
    command = [sys.executable, "-m", "faults"]
    proc = subprocess.Popen([*command, "--upstream", upstream.url, "--slowdown", "1", "--max-lifetime", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=here)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        conn = http.client.HTTPConnection("127.0.0.1", int(endpoint.rsplit(":", 1)[1]), timeout=10)
        conn.request("GET", "/b/small")
        assert conn.getresponse().status == 503
        conn.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    assert "'slowdown': 1" in err
    refused = subprocess.run([*command, "--upstream", "http://10.0.0.1:9000"],
                             capture_output=True, text=True, timeout=30, cwd=here)
    assert refused.returncode == 2 and "not allowed" in refused.stderr
