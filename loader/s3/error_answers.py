"""What S3's answers mean, worded once for every backend.

Each backend finds the S3 error code, the HTTP status or the kind of connection failure in its
own exceptions; these functions turn that into ``loader.errors`` with one wording, so a user
reads the same advice whichever ``store=`` they picked (and tests hold both to it).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import (
    AccessDeniedError,
    BadAnswerError,
    ConfigError,
    EndpointUnreachableError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    ObjectChangedError,
    StoreError,
    ThrottledError,
    TLSError,
    TransientStoreError,
)
from ..retry import answered

E = TypeVar("E", bound=BaseException)

TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted", "503", "500", "502", "504",
})
THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "ServiceUnavailable", "503",
})
DENIED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "ExpiredToken", "AllAccessDisabled", "403",
})


def target(bucket: str, key: str, *, listing: bool = False) -> str:
    """How an error names what was asked for: the object's URI, or the prefix being listed."""
    return f"s3://{bucket}/{key}" + (" (listing)" if listing else "")


def clean(text: str, limit: int = 120) -> str:
    """A server's text as an error may quote it: control characters dropped, at most ``limit``
    characters (a server's words are not trusted to be short or printable)."""
    text = "".join(ch if ch.isprintable() else " " for ch in text[: limit * 4]).strip()
    return text if len(text) <= limit else text[:limit] + "..."


_CODE_LIMIT = 64  # S3's codes are short words; anything longer is not one


def answer_code(body: bytes) -> str:
    """The ``<Code>`` of an S3 error body (``""`` if it has none), for the transports that read
    answers themselves; botocore and obstore find it in their own exceptions."""
    if b"<Code>" not in body:
        return ""
    return body.split(b"<Code>", 1)[1].split(b"</Code>", 1)[0][:_CODE_LIMIT * 4].decode("utf-8", "replace")


def _tag(body: bytes, name: bytes) -> str | None:
    """The text of the first ``<name>`` element of an error body, if any."""
    start = body.find(b"<" + name + b">")
    if start < 0:
        return None
    text = body[start + len(name) + 2:].split(b"<", 1)[0][:400]
    return text.decode("utf-8", "replace")


def redirect_hint(status: int, header: Callable[[str], str | None] | None, body: bytes = b"") -> str:
    """Where a 301/302/307 answer sends the request, as advice: the bucket's region (S3's
    ``x-amz-bucket-region`` header) or the endpoint its body names ("" when it names neither)."""
    if status not in (301, 302, 307, 308):
        return ""
    region = header("x-amz-bucket-region") if header is not None else None
    endpoint = _tag(body, b"Endpoint")
    region = region or _tag(body, b"Region")
    hints = []
    if region:
        hints.append(f"the bucket is in region {clean(region, 40)!r}: set AWS_REGION={clean(region, 40)} "
                     "(or S3Config(region=...))")
    if endpoint:
        hints.append(f"the server names endpoint {clean(endpoint, 120)!r}: use it as AWS_ENDPOINT_URL")
    return "; ".join(hints)


def error_for_answer(
    code: str, status: int, *, bucket: str, key: str, endpoint: str, listing: bool = False,
    headers: Callable[[str], str | None] | None = None, body: bytes = b"",
) -> StoreError:
    """The error for an S3 error response: its code (``""`` if none), HTTP status and, where the
    transport has them, its headers (``headers(name)``) and body (a redirect's region, a
    throttle's ``Retry-After``). The server's code is quoted cleaned and capped."""
    answered(endpoint)  # an error answer is an answer: the endpoint is right
    code = clean(code, _CODE_LIMIT)
    what = target(bucket, key, listing=listing)
    if status in (301, 302, 307, 308) or code in ("PermanentRedirect", "TemporaryRedirect"):
        hint = redirect_hint(status, headers, body) or (
            "set AWS_REGION (or S3Config(region=...)) to the bucket's region, or AWS_ENDPOINT_URL "
            "to the endpoint that serves it")
        return StoreError(f"{what}: the server redirects the request elsewhere ({code or 'HTTP'} "
                          f"{status}); requests are signed for one endpoint and not followed: {hint}",
                          bucket=bucket, key=key)
    if code == "NoSuchBucket":
        return NoSuchBucketError(
            f"bucket {bucket!r} does not exist at {endpoint}; create it or fix the URI "
            f"(asked for {what})",
            bucket=bucket, key=key,
        )
    if code in ("NoSuchKey", "NotFound") or status == 404:
        return NoSuchKeyError(
            f"no object {key!r} in bucket {bucket!r} at {endpoint} (HTTP 404); "
            "check the key list or manifest",
            bucket=bucket, key=key,
        )
    if code in DENIED_CODES or status in (401, 403):
        return AccessDeniedError(
            f"access denied to {what} at {endpoint} ({code or status}): the credentials were "
            "rejected or lack permission; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "(or MINIO_ACCESS_KEY / MINIO_SECRET_KEY) and the bucket policy",
            bucket=bucket, key=key,
        )
    if code == "InvalidRange" or status == 416:
        return InvalidRangeError(
            f"{what}: the requested byte range is past the end of the object",
            bucket=bucket, key=key,
        )
    if code == "PreconditionFailed" or status == 412:
        return changed_during_read(bucket, key, "the server answered 412 PreconditionFailed to "
                                   "If-Match: it no longer holds the version the read began with")
    if code in THROTTLE_CODES or status in (429, 503):
        return ThrottledError(
            f"{what}: the server answered {code or status} (HTTP {status})",
            bucket=bucket, key=key, endpoint=endpoint,
            retry_after=retry_after(headers("retry-after") if headers is not None else None, time.time()),
        )
    if code in TRANSIENT_CODES or status >= 500 or status == 408:  # 408: the server gave up
        # waiting (on a kept-alive connection, often one it was closing): another try is right
        # the endpoint is named once the retries give up (``retry.gave_up``)
        return TransientStoreError(
            f"{what}: the server answered {code or status} (HTTP {status})",
            bucket=bucket, key=key, endpoint=endpoint,
        )
    return StoreError(f"{what}: the server answered {code or status} (HTTP {status})",
                      bucket=bucket, key=key)


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait at ``now`` (seconds since the epoch): its
    delta-seconds, or the time until its HTTP date (RFC 9110 10.2.3; a date past is 0); None for
    anything else. The retry policy bounds it (``loader.retry``). Pure."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value) if len(value) <= 19 else None
    if len(value) > 64 or not value.isascii():
        return None
    import email.utils  # here: a date is rare, and the import is not free

    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC with no zone said
        when = when.replace(tzinfo=datetime.timezone.utc)
    try:
        return max(0.0, when.timestamp() - now)
    except (ValueError, OverflowError):
        return None


def changed_during_read(bucket: str, key: str, how: str) -> ObjectChangedError:
    """The object was overwritten between two requests of one read (``how`` says how we know)."""
    return ObjectChangedError(
        f"s3://{bucket}/{key} changed during the read ({how}); the read stops rather than "
        "assemble data from two versions. Nothing from the new version was delivered: read it "
        "again (the next epoch, or a new load) to get the new version, and avoid overwriting "
        "objects that a running job reads",
        bucket=bucket, key=key,
    )


def unreachable(
    endpoint: str, bucket: str, key: str, *, listing: bool = False, reason: str | None = None
) -> EndpointUnreachableError:
    """No connection could be made (refused, DNS, connect timeout): transient, but says where."""
    return EndpointUnreachableError(
        f"cannot connect to {endpoint} for {target(bucket, key, listing=listing)}"
        + (f" ({reason})" if reason else "")
        + "; is the server running and is AWS_ENDPOINT_URL right?",
        bucket=bucket, key=key, endpoint=endpoint,
    )


def certificate_rejected(
    endpoint: str, bucket: str, key: str, reason: str, *, listing: bool = False
) -> TLSError:
    """The server's TLS certificate did not verify: say why, and how to trust the right CA."""
    return TLSError(
        f"the TLS certificate of {endpoint} did not verify ({reason}) for "
        f"{target(bucket, key, listing=listing)}; if the server uses a private CA, point "
        "AWS_CA_BUNDLE (or S3Config(verify=...)) at that CA's PEM file, and check that the "
        "certificate names the endpoint's host and is a server certificate issued by that CA, "
        "not the CA certificate itself",
        bucket=bucket, key=key,
    )


def plain_http_server(endpoint: str, bucket: str, key: str, *, listing: bool = False) -> TLSError:
    """An https:// endpoint whose server answered the TLS handshake in plain HTTP."""
    plain = endpoint.replace("https://", "http://", 1)
    return TLSError(
        f"{endpoint} speaks plain http, not TLS (asked for {target(bucket, key, listing=listing)}); "
        f"use {plain} as AWS_ENDPOINT_URL, or enable TLS on the server",
        bucket=bucket, key=key,
    )


def at_endpoint(exc: E, endpoint: str) -> E:
    """``exc``, where it is a transient error that names no endpoint yet (a cut connection, a
    stall, a broken or short answer), marked as met at ``endpoint``: the final error names it
    once the retries give up (``retry.gave_up``), as it names the endpoint of a 5xx."""
    if isinstance(exc, TransientStoreError) and not exc.endpoint:
        exc.endpoint = endpoint
    return exc


def failed_mid_request(
    bucket: str, key: str, detail: str, *, listing: bool = False
) -> TransientStoreError:
    """A connection that broke, stalled or ended a body early: worth another attempt."""
    return TransientStoreError(
        f"{target(bucket, key, listing=listing)}: the connection failed mid-request ({detail})",
        bucket=bucket, key=key,
    )


def broken_framing(bucket: str, key: str, detail: str, *, listing: bool = False,
                   request: str = "GET") -> BadAnswerError:
    """An answer that broke HTTP/1.1's grammar or framing: its connection was closed, nothing
    of it used; tried again a few times (``BadAnswerError``), then this names the violation."""
    return BadAnswerError(
        f"{target(bucket, key, listing=listing)}: the server's answer to {request} broke HTTP/1.1 "
        f"({clean(detail, 200)}); the connection was closed and nothing of the answer used. A "
        "proxy or server in front of the endpoint bends HTTP: check what is at AWS_ENDPOINT_URL",
        bucket=bucket, key=key)


def no_credentials() -> ConfigError:
    """Nothing to sign with: the fix is configuration, so it is not a ``StoreError``."""
    from .credentials import LIBRARY_ADVICE

    return ConfigError(f"no credentials found: {LIBRARY_ADVICE}")

