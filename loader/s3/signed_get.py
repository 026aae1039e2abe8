"""The aioboto3 backend's second transport: GETs and listings signed here and sent over this
package's own HTTP/1.1 connections (``http1``), for every endpoint: AWS's own (regional,
virtual-hosted, ``https``) and S3-compatible servers (MinIO, SeaweedFS, Ceph, ...), through the
proxy that ``HTTPS_PROXY``/``HTTP_PROXY`` name unless ``NO_PROXY`` bypasses it (``addressing``).

Why a transport of its own: botocore spends most of its CPU per ``GetObject`` on work such a GET
does not need (the endpoint rules engine, event hooks, header parsing into dicts): measured at
about 82 µs of CPU per GET through botocore's signer and request pipeline against 8 µs here
(bench/results/signing-2026-11-27.md), and per-object datasets make one GET per sample; aiohttp's
client, under it, cost about as much again as ``http1`` (bench/results/http1-2026-11-28.md).
What is left is a request target, a SigV4 signature (``signing``: every header sent is signed,
as botocore signs it) and a body read to its Content-Length. What this path cannot serve (a
region redirect, an S3 Express directory bucket) the store names once and leaves to botocore.
An error answer becomes ours through ``error_answers.error_for_answer``, the one mapping every
transport uses (docs/design/stores.md).
"""

from __future__ import annotations

import datetime
import functools
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from ..config import S3Config
from ..retry import RetryPolicy, answered
from .addressing import Address, NotServed, Origin, bucket_address, proxy_for, redirected, unserved
from .answer_checks import asked_for, check_head, check_length
from .error_answers import answer_code, broken_framing, error_for_answer
from .http1 import ConnectionPool, FramingBroken, Response
from .list_xml import list_query, parse_list_page
from .protocol import ListPage
from .signing import signed_get_request

_MAX_ERROR_BODY = 64 << 10  # an error body larger than this is not S3's XML: keep only its start

Credentials = Any  # botocore ReadOnlyCredentials: .access_key, .secret_key, .token
Conditions = dict[str, str] | None  # conditional request headers: If-Match, If-None-Match
NOT_MODIFIED = 304  # the answer to If-None-Match when the object still has that ETag


def ssl_setting(config: S3Config) -> ssl.SSLContext | None:
    """The TLS context for the endpoint: none for plain http, else one that checks what
    ``verify`` asks (a CA bundle's path, the system's CAs, or nothing)."""
    if (config.endpoint_url or "https://").startswith("http://"):
        return None  # no context built: keeps OpenSSL out of forked workers (see aioboto3_store)
    return _context(config.verify if isinstance(config.verify, str) else config.verify is not False)


@functools.cache
def _context(verify: str | bool) -> ssl.SSLContext:
    """One context per process for each ``verify`` (a CA bundle's path, the system's CAs, or no
    check): loading CAs costs milliseconds, paid before the first sample of every engine
    otherwise, and the TLS connections a pool parks for the next epoch's (``tls``) are kept
    by their context."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return ssl.create_default_context()


class SignedGetter:
    """GETs objects and listing pages with SigV4-signed requests over one ``http1`` pool."""

    def __init__(
        self,
        config: S3Config,
        credentials: Callable[[], Awaitable[Credentials]],
        *,
        max_connections: int,
        retry: RetryPolicy,
    ) -> None:
        self._config = config
        self._endpoint = config.endpoint_url or "AWS S3"
        self._region = config.region
        self._credentials = credentials
        self._max_connections = max_connections
        self._retry = retry
        self._addresses: dict[str, Address] = {}
        self._reasons: dict[str, str | None] = {}
        self._pools: dict[Origin, ConnectionPool] = {}

    def serves(self, bucket: str) -> str | None:
        """Why requests for ``bucket`` cannot go this way (botocore's path then serves it), or None."""
        reason = self._reasons.get(bucket, "")
        if reason == "":
            reason = self._reasons[bucket] = unserved(self._config, bucket)
        return reason

    def _address(self, bucket: str) -> tuple[Address, ConnectionPool]:
        """Where ``bucket``'s requests go, and the pool of connections to there (one per origin:
        virtual-hosted addressing has one per bucket)."""
        address = self._addresses.get(bucket)
        if address is None:
            address = self._addresses[bucket] = bucket_address(self._config, bucket)
        pool = self._pools.get(address.origin)
        if pool is None:
            origin = address.origin
            context = ssl_setting(self._config) if origin.https else None
            pool = self._pools[origin] = ConnectionPool(
                origin.host, origin.port, ssl_context=context, limit=self._max_connections,
                connect_timeout=self._retry.connect_timeout, read_timeout=self._retry.read_timeout,
                proxy=proxy_for(origin))
        return address, pool

    async def get(
        self, bucket: str, key: str, byte_range: str | None = None, conditions: Conditions = None
    ) -> tuple[bytes | None, str | None]:
        """The object's bytes (or a range of them) and the response's ETag; a body short of its
        Content-Length raises. ``conditions``: headers such as ``If-Match``, sent as given and
        signed; ``None`` for the bytes when ``If-None-Match`` was answered 304 Not Modified."""
        asked = asked_for(byte_range, conditions)
        try:
            async with await self._send(bucket, key, byte_range, conditions=conditions) as response:
                if response.status == NOT_MODIFIED and asked.if_none_match:
                    return None, response.headers.get("etag")
                await self._raise_for_error(response, bucket, key)
                expected = check_head(response.status, response.headers.get, asked, bucket, key)
                data = await response.read()
                check_length(len(data), expected, asked, bucket, key)
                return data, response.headers.get("etag")
        except FramingBroken as exc:
            raise broken_framing(bucket, key, str(exc), request=asked.describe()) from exc

    async def stream(
        self, bucket: str, key: str, byte_range: str | None, chunk_size: int,
        conditions: Conditions = None,
    ) -> AsyncGenerator[tuple[bytes, int | None, str | None], None]:
        """Yield ``(piece, content_length, etag)``: the body as it arrives, in pieces of at most
        ``chunk_size`` bytes."""
        asked = asked_for(byte_range, conditions)
        try:
            async with await self._send(bucket, key, byte_range, conditions=conditions) as response:
                await self._raise_for_error(response, bucket, key)
                expected = check_head(response.status, response.headers.get, asked, bucket, key)
                etag = response.headers.get("etag")
                received = 0
                most = expected if expected is not None or asked.end is None else asked.end - asked.start
                while data := await response.read_some():
                    received += len(data)
                    if most is not None and received > most:  # never a byte past what is due
                        check_length(received, most, asked, bucket, key)
                    if len(data) <= chunk_size:
                        yield data, expected, etag
                        continue
                    view = memoryview(data)
                    for at in range(0, len(data), chunk_size):
                        yield bytes(view[at:at + chunk_size]), expected, etag
                check_length(received, expected, asked, bucket, key)
        except FramingBroken as exc:
            raise broken_framing(bucket, key, str(exc), request=asked.describe()) from exc

    async def list_page(
        self, bucket: str, prefix: str, token: str | None, delimiter: str | None, page_size: int,
        start_after: str | None = None,
    ) -> ListPage:
        """One ``ListObjectsV2`` page, read by ``list_xml``: botocore's parser builds dicts and
        datetimes for every listed key, many times the CPU of reading only what a listing needs
        (figures: bench/results/docstring-figures.md)."""
        query = list_query(prefix, page_size, token, start_after, delimiter)
        async with await self._send(bucket, "", None, query) as response:
            await self._raise_for_error(response, bucket, prefix, listing=True)
            body = await response.read()
        return parse_list_page(body, bucket=bucket, prefix=prefix, token=token)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()

    def request(
        self, bucket: str, key: str, byte_range: str | None, query: dict[str, str] | None,
        conditions: Conditions, credentials: Credentials, when: datetime.datetime,
    ) -> tuple[str, dict[str, str]]:
        """The request target (path and query) and the headers of one GET, every header signed
        (``Range`` and the conditions too); tests/test_signing.py holds this to botocore's
        signature."""
        address = self._addresses.get(bucket) or self._address(bucket)[0]
        # the bucket itself (a listing): no trailing slash, as botocore sends it
        return signed_get_request(address.host, address.path(key), query, byte_range, credentials=credentials,
                          region=self._region, when=when, headers=conditions)

    async def _send(
        self, bucket: str, key: str, byte_range: str | None, query: dict[str, str] | None = None,
        conditions: Conditions = None,
    ) -> Response:
        address, pool = self._address(bucket)
        target, headers = self.request(bucket, key, byte_range, query, conditions,
                                       await self._credentials(),
                                       datetime.datetime.now(datetime.timezone.utc))
        target = pool.target_prefix + target
        # nothing but the signed headers is sent (no User-Agent, no Accept-Encoding: the bytes
        # come as stored, a .gz object stays gzipped); a redirect is not followed (a signature
        # is for one host, and S3's 301/307 means a wrong region or endpoint, which the error names)
        head = f"GET {target} HTTP/1.1\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()) + pool.proxy_headers + "\r\n"
        response = await pool.get(head.encode())
        answered(self._endpoint)
        reason = redirected(response.status, response.headers, bucket, self._region)
        if reason is not None:
            response.close()
            raise NotServed(reason)
        return response

    async def _raise_for_error(self, response: Response, bucket: str, key: str, *,
                               listing: bool = False) -> None:
        """Raise ours for a non-2xx answer, worded by ``error_answers`` like every transport's."""
        if response.status < 300:
            return
        body = await response.read(_MAX_ERROR_BODY)
        raise error_for_answer(answer_code(body), response.status, bucket=bucket, key=key,
                               endpoint=self._endpoint, listing=listing,
                               headers=response.headers.get, body=body)
