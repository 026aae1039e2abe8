"""SigV4 for S3 requests without a body, signed exactly as botocore's ``S3SigV4Auth`` signs them.

The two transports that skip botocore (``signed_get``, ``http_lister``) sign here. Hand-written
because botocore's signer builds an ``AWSRequest``, an ``HTTPHeaders`` and a ``urlsplit`` per
request, about ten times the CPU of this function, and ``http_lister`` must not import botocore
at all (a listing before the first sample; docs/design/listing.md).

Every header the request sends is signed (botocore signs every header but ``expect``,
``transfer-encoding``, ``user-agent`` and ``x-amzn-trace-id``): ``host``, ``range``,
``if-match``, ``if-none-match``, ``x-amz-*`` and any other given. A header left out of the
signature could be altered on the way without the server noticing; a ``Range`` so changed
would hand a reader other bytes than it asked for. The day's signing key (four HMACs) is derived
once per secret, day and region and cached. tests/test_signing.py checks the result against
botocore's, header for header.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping
from typing import Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_HEADERS = frozenset({"expect", "transfer-encoding", "user-agent", "x-amzn-trace-id"})
_SAFE = "-_.~"  # what SigV4 leaves unescaped in a query


def canonical_query(query: Mapping[str, str]) -> str:
    """The query string as SigV4 signs it (and as it is sent): sorted, each part escaped."""
    return "&".join(f"{urllib.parse.quote(name, safe=_SAFE)}={urllib.parse.quote(value, safe=_SAFE)}"
                    for name, value in sorted(query.items()))


def host_header(endpoint: str) -> str:
    """The ``Host`` header for ``endpoint``, as botocore writes it: the port only when it is not
    the scheme's own, an IPv6 address in brackets."""
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


@functools.lru_cache(maxsize=16)
def signing_key(secret_key: str, day: str, region: str, service: str = "s3") -> bytes:
    """The key of one day's signatures (``day``: ``YYYYMMDD``): four HMACs, derived once a day.

    A few entries suffice: one per secret and region in use, and the day before at midnight."""
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def sign_v4(method: str, host: str, path: str, query: Mapping[str, str], *, access_key: str,
            secret_key: str, token: str | None, region: str, when: datetime.datetime,
            headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every header to send with a SigV4-signed S3 request without a body, all of them signed.

    ``path`` is the path as sent (already escaped; S3 signs it as is, no normalization);
    ``query`` is sent as ``canonical_query`` writes it; ``headers`` (``Range``, ``If-Match``,
    ...) are added to what is signed. Names come back in lower case.
    """
    stamp = (f"{when.year:04d}{when.month:02d}{when.day:02d}T"  # strftime costs 2-3x as much
             f"{when.hour:02d}{when.minute:02d}{when.second:02d}Z")
    sent = {name.lower(): value for name, value in (headers or {}).items()}
    sent.update({"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp})
    if token:
        sent["x-amz-security-token"] = token
    names = sorted(name for name in sent if name not in UNSIGNED_HEADERS)
    signed = ";".join(names)
    canonical = "\n".join([
        method, path, canonical_query(query),
        # botocore's "trimall": runs of whitespace inside a value become one space
        "".join(f"{name}:{' '.join(sent[name].split())}\n" for name in names),
        signed, EMPTY_SHA256])
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    signature = hmac.new(signing_key(secret_key, stamp[:8], region), to_sign.encode(),
                         hashlib.sha256).hexdigest()
    sent["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                             f"SignedHeaders={signed}, Signature={signature}")
    return sent


def signed_get_request(host: str, path: str, query: Mapping[str, str] | None, byte_range: str | None, *,
               credentials: Any, region: str, when: datetime.datetime,
               headers: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """The request target (``path`` and the query, encoded once, sorted, as SigV4 signs it) and
    the headers of one GET, every header signed, ``Range`` and ``headers`` too: the one GET that
    both transports skipping botocore send. ``credentials``: ``.access_key``, ``.secret_key``,
    ``.token`` (botocore's frozen credentials)."""
    extra = dict(headers or {})
    if byte_range:
        extra["range"] = byte_range
    signed = sign_v4("GET", host, path, query or {}, access_key=credentials.access_key,
                     secret_key=credentials.secret_key, token=credentials.token, region=region,
                     when=when, headers=extra)
    return (f"{path}?{canonical_query(query)}" if query else path), signed
