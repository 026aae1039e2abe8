"""Signed S3 GETs sent straight over aiohttp: the aioboto3 backend's read path.

botocore spends most of its CPU per ``GetObject`` on work a GET to a path-style custom endpoint
does not need (rules engine, hooks, header parsing): here it is a URL, a SigV4 signature
(``http_client.sign_v4``) and a body read to its Content-Length. AWS's own endpoints keep
botocore's path; error answers become botocore ``ClientError`` s, worded as on that path (docs/design/stores.md).
"""

from __future__ import annotations

import datetime
import re
import ssl
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import aiohttp
import yarl
from botocore.exceptions import ClientError

from ..config import S3Config
from ..retry import RetryPolicy
from .http_client import sign_v4
from .list_xml import list_query, parse_list_page
from .protocol import ListPage

# Looked up in an S3 error body (small XML); a regex because the body is tiny and ElementTree
# would need the namespace handled for no gain.
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")
_MAX_ERROR_BODY = 64 << 10  # an error body larger than this is not S3's XML: keep only its start

Credentials = Any  # botocore ReadOnlyCredentials: .access_key, .secret_key, .token
Conditions = dict[str, str] | None  # conditional request headers: If-Match, If-None-Match


def _host(url: yarl.URL) -> str:
    """The Host header as signed and sent: the port only when it is not the scheme's own."""
    host = url.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    port = url.explicit_port
    if port is not None and port != {"http": 80, "https": 443}.get(url.scheme):
        host = f"{host}:{port}"
    return host


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
        self._host = _host(yarl.URL(config.endpoint_url))  # the same for every request: once
        self._region = config.region
        self._credentials = credentials
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(1, max_connections), ssl=ssl_setting(config)),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=retry.connect_timeout, sock_read=retry.read_timeout
            ),
            auto_decompress=False,  # bytes as stored, like botocore: a .gz object stays gzipped
            skip_auto_headers=("Accept-Encoding",),
        )

    async def get(
        self, bucket: str, key: str, byte_range: str | None = None, conditions: Conditions = None
    ) -> tuple[bytes, str | None]:
        """The object's bytes (or a range of them) and the response's ETag; a body short of its
        Content-Length raises. ``conditions``: headers such as ``If-Match``, sent as given."""
        async with await self._send(bucket, key, byte_range, conditions=conditions) as response:
            await _raise_for_error(response)
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
            await _raise_for_error(response)
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
            await _raise_for_error(response)
            body = await response.read()
            expected = response.content_length
            if expected is not None and len(body) != expected:
                raise aiohttp.ClientPayloadError(
                    f"listing of {len(body)} bytes, {expected} announced by Content-Length"
                )
        return parse_list_page(body)

    async def aclose(self) -> None:
        await self._session.close()

    async def _send(
        self, bucket: str, key: str, byte_range: str | None, query: dict[str, str] | None = None,
        conditions: Conditions = None,
    ) -> aiohttp.ClientResponse:
        if key:
            url = object_path_url(self._endpoint, bucket, key)
        else:  # the bucket itself (a listing): no trailing slash, as botocore sends it
            url = yarl.URL(self._endpoint.rstrip("/") + "/" + urllib.parse.quote(bucket, safe=""),
                           encoded=True)
        if query:  # encoded once, sorted, exactly as SigV4 signs it
            url = yarl.URL(str(url) + "?" + "&".join(
                f"{name}={urllib.parse.quote(value, safe='-_.~')}" for name, value in sorted(query.items())
            ), encoded=True)
        credentials = await self._credentials()
        headers = sign_v4("GET", self._host, url.raw_path, query or {},
                          access_key=credentials.access_key, secret_key=credentials.secret_key,
                          token=credentials.token, region=self._region,
                          when=datetime.datetime.now(datetime.timezone.utc))
        if byte_range:
            headers["Range"] = byte_range
        if conditions:
            headers.update(conditions)
        # no redirects: a signature is for one host, and S3's 301/307 means a wrong region or
        # endpoint, which the error names
        return await self._session.get(url, headers=headers, allow_redirects=False)


async def _raise_for_error(response: aiohttp.ClientResponse) -> None:
    """Raise a botocore ``ClientError`` for a non-2xx answer, with S3's code and message."""
    if response.status < 300:
        return
    body = await response.content.read(_MAX_ERROR_BODY)
    code = _CODE.search(body)
    message = _MESSAGE.search(body)
    error = {
        "Code": code.group(1).decode("utf-8", "replace") if code else str(response.status),
        "Message": message.group(1).decode("utf-8", "replace") if message else response.reason or "",
    }
    raise ClientError(
        {"Error": error, "ResponseMetadata": {"HTTPStatusCode": response.status}}, "GetObject"
    )
