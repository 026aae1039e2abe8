"""The aioboto3 backend's second transport: GETs and listings signed here and sent straight over
aiohttp, for path-style custom endpoints (MinIO, SeaweedFS, Ceph, ...).

Why a transport of its own: botocore spends most of its CPU per ``GetObject`` on work such a GET
does not need (the endpoint rules engine, event hooks, header parsing into dicts): measured at
about 82 µs of CPU per GET through botocore's signer and request pipeline against 8 µs here,
and per-object datasets make one GET per sample (bench/results/signing-2026-11-27.md). What is
left is a URL, a SigV4 signature (``signing``: every header sent is signed, as botocore signs it)
and a body read to its Content-Length. AWS's own endpoints keep botocore's path. An error answer
becomes ours through ``error_answers.error_for_answer``, the one mapping every transport uses
(docs/design/stores.md).
"""

from __future__ import annotations

import datetime
import ssl
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import aiohttp
import yarl

from ..config import S3Config
from ..retry import RetryPolicy, answered
from .error_answers import answer_code, error_for_answer
from .list_xml import list_query, parse_list_page
from .protocol import ListPage
from .signing import canonical_query, host_header, sign_v4

_MAX_ERROR_BODY = 64 << 10  # an error body larger than this is not S3's XML: keep only its start

Credentials = Any  # botocore ReadOnlyCredentials: .access_key, .secret_key, .token
Conditions = dict[str, str] | None  # conditional request headers: If-Match, If-None-Match
NOT_MODIFIED = 304  # the answer to If-None-Match when the object still has that ETag


def can_sign_directly(config: S3Config) -> bool:
    """Whether GETs for ``config`` can bypass botocore: a custom endpoint addressed path-style."""
    return config.endpoint_url is not None and config.path_style


def object_path_url(endpoint: str, bucket: str, key: str) -> yarl.URL:
    """``endpoint/bucket/key`` with the key percent-encoded the way botocore encodes it for S3.

    ``encoded=True`` keeps the path byte for byte (no ``..`` or ``//`` folding), so that what is
    signed is what is sent, and a key like ``a/../b`` names that key, not ``b``.
    """
    path = "/" + urllib.parse.quote(bucket, safe="") + "/" + urllib.parse.quote(key, safe="/~")
    return yarl.URL(endpoint.rstrip("/") + path, encoded=True)


def ssl_setting(config: S3Config) -> ssl.SSLContext | bool:
    """aiohttp's ``ssl=`` for the endpoint: none for plain http, else what ``verify`` asks."""
    if (config.endpoint_url or "").startswith("http://") or config.verify is False:
        return False  # no context built: keeps OpenSSL out of forked workers (see aioboto3_store)
    if isinstance(config.verify, str):
        return ssl.create_default_context(cafile=config.verify)
    return True


class SignedGetter:
    """GETs objects with SigV4-signed requests over one pooled aiohttp session."""

    def __init__(
        self,
        config: S3Config,
        credentials: Callable[[], Awaitable[Credentials]],
        *,
        max_connections: int,
        retry: RetryPolicy,
    ) -> None:
        assert config.endpoint_url is not None
        self._endpoint = config.endpoint_url
        self._host = host_header(config.endpoint_url)
        self._region = config.region
        self._credentials = credentials
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(1, max_connections), ssl=ssl_setting(config)),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=retry.connect_timeout, sock_read=retry.read_timeout
            ),
            auto_decompress=False,  # bytes as stored, like botocore: a .gz object stays gzipped
            # nothing unsigned but the User-Agent (which botocore leaves unsigned too)
            skip_auto_headers=("Accept", "Accept-Encoding"),
        )

    async def get(
        self, bucket: str, key: str, byte_range: str | None = None, conditions: Conditions = None
    ) -> tuple[bytes | None, str | None]:
        """The object's bytes (or a range of them) and the response's ETag; a body short of its
        Content-Length raises. ``conditions``: headers such as ``If-Match``, sent as given and
        signed; ``None`` for the bytes when ``If-None-Match`` was answered 304 Not Modified."""
        async with await self._send(bucket, key, byte_range, conditions=conditions) as response:
            if response.status == NOT_MODIFIED and conditions and "If-None-Match" in conditions:
                return None, response.headers.get("ETag")
            await self._raise_for_error(response, bucket, key)
            data = await response.read()  # aiohttp raises ClientPayloadError on a cut body
            expected = response.content_length
            if expected is not None and len(data) != expected:
                raise aiohttp.ClientPayloadError(
                    f"body of {len(data)} bytes, {expected} announced by Content-Length"
                )
            return data, response.headers.get("ETag")

    async def stream(
        self, bucket: str, key: str, byte_range: str | None, chunk_size: int,
        conditions: Conditions = None,
    ) -> AsyncGenerator[tuple[bytes, int | None, str | None], None]:
        """Yield ``(chunk, content_length, etag)`` pieces of the body as they arrive."""
        async with await self._send(bucket, key, byte_range, conditions=conditions) as response:
            await self._raise_for_error(response, bucket, key)
            expected = response.content_length
            etag = response.headers.get("ETag")
            while chunk := await response.content.read(chunk_size):
                yield chunk, expected, etag

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
            expected = response.content_length
            if expected is not None and len(body) != expected:
                raise aiohttp.ClientPayloadError(
                    f"listing of {len(body)} bytes, {expected} announced by Content-Length"
                )
        return parse_list_page(body)

    async def aclose(self) -> None:
        await self._session.close()

    def request(
        self, bucket: str, key: str, byte_range: str | None, query: dict[str, str] | None,
        conditions: Conditions, credentials: Credentials, when: datetime.datetime,
    ) -> tuple[yarl.URL, dict[str, str]]:
        """The URL and the headers of one GET, every header signed (``Range`` and the
        conditions too); tests/test_signing.py holds this to botocore's signature."""
        if key:
            url = object_path_url(self._endpoint, bucket, key)
        else:  # the bucket itself (a listing): no trailing slash, as botocore sends it
            url = yarl.URL(self._endpoint.rstrip("/") + "/" + urllib.parse.quote(bucket, safe=""),
                           encoded=True)
        if query:  # encoded once, sorted, exactly as SigV4 signs it
            url = yarl.URL(f"{url}?{canonical_query(query)}", encoded=True)
        extra = dict(conditions) if conditions else {}
        if byte_range:
            extra["Range"] = byte_range
        headers = sign_v4("GET", self._host, url.raw_path, query or {},
                          access_key=credentials.access_key, secret_key=credentials.secret_key,
                          token=credentials.token, region=self._region, when=when, headers=extra)
        return url, headers

    async def _send(
        self, bucket: str, key: str, byte_range: str | None, query: dict[str, str] | None = None,
        conditions: Conditions = None,
    ) -> aiohttp.ClientResponse:
        url, headers = self.request(bucket, key, byte_range, query, conditions,
                                    await self._credentials(),
                                    datetime.datetime.now(datetime.timezone.utc))
        # no redirects: a signature is for one host, and S3's 301/307 means a wrong region or
        # endpoint, which the error names
        response = await self._session.get(url, headers=headers, allow_redirects=False)
        answered(self._endpoint)
        return response

    async def _raise_for_error(self, response: aiohttp.ClientResponse, bucket: str, key: str, *,
                               listing: bool = False) -> None:
        """Raise ours for a non-2xx answer, worded by ``error_answers`` like every transport's."""
        if response.status < 300:
            return
        body = await response.content.read(_MAX_ERROR_BODY)
        raise error_for_answer(answer_code(body), response.status, bucket=bucket, key=key,
                               endpoint=self._endpoint, listing=listing)
