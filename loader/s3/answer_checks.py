"""Every answer held to what its request asked for, for every transport: one place.

A server, proxy or cache that bends HTTP can answer a ranged GET with the whole object, a range
other than the one asked, fewer bytes than it announced, a gzip stream as the body, or a version
other than the pinned one. Each transport hands its answer's status and headers to
``check_head`` before it reads the body, and the body's length to ``check_length`` after: any
mismatch is a ``BadAnswerError`` naming the object, the request and what came back, and nothing
of that answer reaches the caller. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

from ..errors import BadAnswerError
from .error_answers import clean
from .protocol import normalize_etag

_RANGE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{0,19})\Z")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)\Z")
_LENGTH = re.compile(r"[0-9]{1,19}\Z")
ACCEPTED_CODINGS = frozenset({"identity", "chunked"})


class Asked(NamedTuple):
    """What one GET asked for: bytes ``[start, end)`` (``end`` None: to the end) when ``ranged``,
    the object's ``size`` when a listing or index gave it, the ``If-Match`` ETag it was pinned
    to, and whether ``If-None-Match`` allows a 304."""

    ranged: bool = False
    start: int = 0
    end: int | None = None
    size: int | None = None
    if_match: str | None = None
    if_none_match: bool = False

    def describe(self) -> str:
        """The request as an error quotes it."""
        parts = ["GET"]
        if self.ranged:
            parts.append(f"Range: bytes={self.start}-{'' if self.end is None else self.end - 1}")
        if self.if_match:
            parts.append(f"If-Match: {self.if_match}")
        if self.size is not None:
            parts.append(f"(listed size {self.size:,})")
        return " ".join(parts)


def asked_for(byte_range: str | None, conditions: dict[str, str] | None = None,
              size: int | None = None) -> Asked:
    """``Asked`` from the ``Range`` header this package built (``bytes=a-b`` or ``bytes=a-``)
    and the conditional headers sent."""
    conditions = conditions or {}
    if_match = normalize_etag(conditions.get("If-Match"))
    if_none_match = "If-None-Match" in conditions
    if not byte_range:
        return Asked(size=size, if_match=if_match, if_none_match=if_none_match)
    found = _RANGE.match(byte_range)
    if found is None:
        raise ValueError(f"not a range this package sends: {byte_range!r}")
    last = found.group(2)
    return Asked(True, int(found.group(1)), int(last) + 1 if last else None, size, if_match,
                 if_none_match)


def bad_answer(asked: Asked, bucket: str, key: str, what: str, *, listing: bool = False) -> BadAnswerError:
    """The error for an answer that is not what ``asked`` asked for (``what`` says how)."""
    target = f"s3://{bucket}/{key}" + (" (listing)" if listing else "")
    return BadAnswerError(
        f"{target}: the server's answer does not match the request ({asked.describe()}): {what}; "
        "nothing of it was used. A proxy, cache or server that ignores Range, If-Match or HTTP's "
        "framing sits in the way: check the endpoint (AWS_ENDPOINT_URL) and what is in front of it",
        bucket=bucket, key=key)


def check_codings(transfer_encoding: str | None, asked: Asked, bucket: str, key: str) -> None:
    """Only the ``identity`` and ``chunked`` transfer codings carry an object's bytes as stored."""
    if transfer_encoding is None:
        return
    codings = [part.strip().lower() for part in transfer_encoding.split(",")]
    if any(coding not in ACCEPTED_CODINGS for coding in codings):
        raise bad_answer(asked, bucket, key,
                         f"Transfer-Encoding {clean(transfer_encoding)!r} (only chunked is read)")


def check_head(status: int, header: Callable[[str], str | None], asked: Asked, bucket: str,
               key: str) -> int | None:
    """Hold an answer's status and headers (``header(name)``, any case) to ``asked``, before
    its body is read; return the body's length it must have (None: unknown, the object's
    whole length without a listed size). A 304 is allowed only where ``If-None-Match`` was sent
    (length 0). Statuses of 300 and above are errors the caller words (``error_answers``)."""
    coding = header("transfer-encoding")
    check_codings(coding, asked, bucket, key)
    if status == 304 and asked.if_none_match:
        return 0
    raw_length = header("content-length")
    if coding is not None and raw_length is not None:  # RFC 9112 6.3: a sign of smuggling
        raise bad_answer(asked, bucket, key, "both Transfer-Encoding and Content-Length")
    length: int | None = None
    if raw_length is not None:
        raw_length = raw_length.strip()
        if not _LENGTH.match(raw_length):
            raise bad_answer(asked, bucket, key, f"Content-Length {clean(raw_length)!r} is not a length")
        length = int(raw_length)
    if asked.if_match is not None:
        etag = normalize_etag(header("etag"))
        if etag is None:
            raise bad_answer(asked, bucket, key, f"HTTP {status} without an ETag to a read pinned to "
                             "one version: the version cannot be checked")
        # another ETag is ObjectChangedError, which the caller's Pin raises with the right words
    expected = _expected_length(status, header, length, asked, bucket, key)
    if length is not None and expected is not None and length != expected:
        raise bad_answer(asked, bucket, key,
                         f"HTTP {status} with Content-Length {length:,} where {expected:,} bytes are due")
    return expected if expected is not None else length


def _expected_length(status: int, header: Callable[[str], str | None], length: int | None,
                     asked: Asked, bucket: str, key: str) -> int | None:
    if status == 200:
        if not asked.ranged:
            return asked.size
        # a whole object is what a range from 0 asked for when it fits in the range, and when
        # a Content-Range sent beside it (it has no place on a 200) gives the same total
        found = _CONTENT_RANGE.match((header("content-range") or "").strip())
        total = found.group(3) if found else "*"
        if total != "*" and length is not None and int(total) != length:
            raise bad_answer(asked, bucket, key, f"HTTP 200 with Content-Length {length:,} and a "
                             f"Content-Range of {int(total):,} bytes in all, to a ranged read")
        if asked.start == 0 and (asked.end is None or (length is not None and length <= asked.end)):
            return asked.size
        raise bad_answer(asked, bucket, key, f"HTTP 200 (the whole object, Content-Length "
                         f"{'unknown' if length is None else f'{length:,}'}) to a ranged read")
    if status != 206:
        raise bad_answer(asked, bucket, key, f"HTTP {status} to a GET")
    if not asked.ranged:
        raise bad_answer(asked, bucket, key, f"HTTP 206 (part of the object, Content-Range "
                         f"{clean(header('content-range') or 'none')!r}) to a read of the whole object")
    raw = (header("content-range") or "").strip()
    found = _CONTENT_RANGE.match(raw)
    if found is None:
        raise bad_answer(asked, bucket, key, f"HTTP 206 with Content-Range {clean(raw or 'none')!r}")
    first, last, total_text = int(found.group(1)), int(found.group(2)), found.group(3)
    total = None if total_text == "*" else int(total_text)
    size = asked.size if asked.size is not None else total
    want_last = None
    if asked.end is not None:
        want_last = asked.end - 1 if size is None else min(asked.end, size) - 1
    elif size is not None:
        want_last = size - 1
    if (first != asked.start or last < first or (want_last is not None and last != want_last)
            or (total is not None and last >= total)
            or (total is not None and asked.size is not None and total != asked.size)):
        raise bad_answer(asked, bucket, key, f"HTTP 206 with Content-Range {clean(raw)!r}")
    return last - first + 1


def check_length(received: int, expected: int | None, asked: Asked, bucket: str, key: str) -> None:
    """The body that arrived is as long as ``check_head`` said it must be (and, for a range
    with no length known, no longer than the range)."""
    if expected is not None and received != expected:
        raise bad_answer(asked, bucket, key, f"a body of {received:,} bytes where {expected:,} are due")
    if expected is None and asked.ranged and asked.end is not None \
            and received > asked.end - asked.start:
        raise bad_answer(asked, bucket, key, f"a body of {received:,} bytes to a range of "
                         f"{asked.end - asked.start:,}")


def check_size(data: bytes, size: int | None, bucket: str, key: str) -> bytes:
    """A whole object's bytes against the size its listing or index gave (None: not known);
    for callers that know the size where the store's narrow protocol does not carry it."""
    if size is not None and len(data) != size:
        raise bad_answer(Asked(size=size), bucket, key, f"{len(data):,} bytes")
    return data


def check_listed(length: int, answer_etag: str | None, size: int, listed_etag: str | None,
                 bucket: str, key: str) -> None:
    """A whole read of ``length`` bytes whose answer carried ``answer_etag``, against the
    ``size`` and ``listed_etag`` its listing gave: the listed version must be the listed size;
    another ETag is a version written since, read as it is now. Without an ETag in the listing
    there is no version to compare (any length passes); with one, an answer without an ETag
    cannot be told apart from a wrong one and is refused."""
    if length == size or normalize_etag(listed_etag) is None:
        return
    asked = Asked(size=size)
    answer, listed = normalize_etag(answer_etag), normalize_etag(listed_etag)
    if answer is None:
        raise bad_answer(asked, bucket, key, f"{length:,} bytes, and no ETag to tell a version "
                         f"written since the listing (ETag {listed}) from a wrong answer")
    if answer == listed:
        raise bad_answer(asked, bucket, key, f"{length:,} bytes of the listed version (ETag {listed})")


def check_span(asked: Asked, first: int, stop: int, size: int | None, etag: str | None,
               bucket: str, key: str) -> None:
    """For a client that parsed the answer itself (obstore): the span ``[first, stop)`` of an
    object of ``size`` bytes that it says came back, and its ETag, held to ``asked``."""
    if asked.if_match is not None and normalize_etag(etag) is None:
        raise bad_answer(asked, bucket, key, "an answer without an ETag to a read pinned to one "
                         "version: the version cannot be checked")
    end = asked.end if asked.ranged else None
    want_stop = size if end is None else (end if size is None else min(end, size))
    want_first = asked.start if asked.ranged else 0
    if first != want_first or (want_stop is not None and stop != want_stop):
        raise bad_answer(asked, bucket, key, f"bytes [{first:,}, {stop:,}) of "
                         f"{'an object of unknown size' if size is None else f'{size:,}'}")
