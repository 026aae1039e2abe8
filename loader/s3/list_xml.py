"""``ListObjectsV2`` requests built and answers read into ``ListPage`` s, for every lister that
speaks the HTTP API itself.

A page is a ``ListBucketResult`` or an error: an HTML page, an ``<Error>`` document, cut XML, a
DTD (entities: a bomb, or names that are not S3's), a truncated page without a token or with
nothing on it, each is a ``BadAnswerError`` naming the prefix and the page, never a listing
that silently ends. XML is read by expat (ElementTree) with no DTD allowed; the fast path reads
only pages it can prove are the plain shape, and any escape (``&``) sends a page to expat.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable

from ..errors import BadAnswerError
from .error_answers import clean
from .protocol import ListPage, ObjectInfo, normalize_etag

_KEY = re.compile(rb"<Key>([^<]*)</Key>")
_SIZE = re.compile(rb"<Size>([0-9]{1,19})</Size>")
_ETAG = re.compile(rb"<ETag>([^<]*)</ETag>")
_TOKEN = re.compile(rb"<NextContinuationToken>([^<]*)</NextContinuationToken>")
_TRUNCATED = re.compile(rb"<IsTruncated>(true|false)</IsTruncated>")
_ROOT = re.compile(rb"\s*(?:<\?xml[^>]*\?>\s*)?<ListBucketResult[\s>]")
_END = b"</ListBucketResult>"


class NotAListing(ValueError):
    """A page that is not a ``ListBucketResult`` S3 would send (``parse_list_page`` words it)."""


def list_query(prefix: str, page_size: int, token: str | None = None, start_after: str | None = None,
               delimiter: str | None = None) -> dict[str, str]:
    """The query of one ``ListObjectsV2`` request: keys come URL-encoded (``parse_list_page``
    decodes them); a continuation token wins over ``start_after``, as S3 itself would."""
    query = {"list-type": "2", "prefix": prefix, "max-keys": str(page_size), "encoding-type": "url"}
    if token:
        query["continuation-token"] = token
    elif start_after:
        query["start-after"] = start_after
    if delimiter:
        query["delimiter"] = delimiter
    return query


def parse_list_page(body: bytes, *, bucket: str = "", prefix: str = "", token: str | None = None) -> ListPage:
    """Keys, sizes, ETags, common prefixes and the next token of a ``ListObjectsV2`` answer
    (asked with ``encoding-type=url``, so keys with characters XML cannot carry arrive intact);
    ``BadAnswerError`` naming ``s3://bucket/prefix`` and the page (``token``: the one it was
    asked with) for anything else."""
    try:
        page = _parse_flat_page(body) or _parse_list_page(body)
        if page.token is None and _truncated(body):
            raise NotAListing("IsTruncated is true but there is no NextContinuationToken")
        if page.token is not None and not page.objects and not page.prefixes:
            raise NotAListing("a page with no keys that claims more follow (IsTruncated true)")
    except NotAListing as exc:
        raise not_a_listing(bucket, prefix, token, str(exc)) from None
    return page


def not_a_listing(bucket: str, prefix: str, token: str | None, what: str) -> BadAnswerError:
    """The error for a listing page that is not one (``what`` says why)."""
    page = "its first page" if token is None else f"the page at continuation token {clean(token, 60)!r}"
    return BadAnswerError(
        f"s3://{bucket}/{prefix} (listing, {page}): the server's answer is not a ListObjectsV2 "
        f"page ({what}); the listing stops rather than end early or loop. A proxy or server in "
        "front of the endpoint answers for S3: check what is at AWS_ENDPOINT_URL",
        bucket=bucket, key=prefix)


def _truncated(body: bytes) -> bool:
    found = _TRUNCATED.search(body)
    return found is not None and found.group(1) == b"true"


def _parse_flat_page(body: bytes) -> ListPage | None:
    """The common answer (objects only, no namespace prefixes, no escapes) read with regular
    expressions, for about half the CPU of ElementTree (bench/results/docstring-figures.md).
    None when the answer is not provably that plain shape (one Key, Size and ETag per Contents,
    or no ETags at all; a ListBucketResult from start to end), and ElementTree reads it instead."""
    if (b"<CommonPrefixes>" in body or b":Contents" in body or b"<!" in body
            or not _ROOT.match(body) or not body.rstrip().endswith(_END)):
        return None
    keys, sizes, etags = _KEY.findall(body), _SIZE.findall(body), _ETAG.findall(body)
    etags = [tag.replace(b"&#34;", b"").replace(b"&quot;", b"") for tag in etags]  # their quotes
    found = _TOKEN.search(body)
    if any(b"&" in text for text in (*keys, *etags, found.group(1) if found else b"")):
        return None  # an escape: expat reads it as XML means it
    if len(keys) != body.count(b"<Contents>") or len(sizes) != len(keys) or len(etags) not in (
            0, len(keys)) or len(_TRUNCATED.findall(body)) != 1:
        return None
    encoded = b"<EncodingType>url</EncodingType>" in body
    names = []
    for raw_key in keys:
        key = raw_key.decode("utf-8", "surrogateescape")
        if encoded and ("%" in key or "+" in key):
            key = urllib.parse.unquote_plus(key)
        names.append(key)
    tags = [normalize_etag(tag.decode("utf-8", "surrogateescape")) for tag in etags] or [None] * len(names)
    objects = list(map(ObjectInfo, names, map(int, sizes), tags))
    token = found.group(1).decode("utf-8", "surrogateescape") if found else None
    if not _truncated(body) or not token:
        token = None
    return ListPage(objects, [], token)


def _parse_list_page(body: bytes) -> ListPage:
    """Any ``ListBucketResult``, read by expat through ElementTree; ``NotAListing`` for
    anything else (a DTD is refused before parsing: S3 never sends one, and entities are how
    an XML page explodes or renames keys)."""
    if b"<!DOCTYPE" in body or b"<!ENTITY" in body:
        raise NotAListing("an XML document with a DTD")
    from xml.etree import ElementTree  # here: the plain pages most servers send never need it

    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        start = clean(body[:60].decode("utf-8", "replace"), 60)
        raise NotAListing(f"not XML ({exc}); it begins {start!r}") from None
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if root.tag != f"{ns}ListBucketResult":
        if root.tag.removeprefix(ns) == "Error":
            code = clean(root.findtext(f"{ns}Code") or "", 64)
            message = clean(root.findtext(f"{ns}Message") or "", 120)
            raise NotAListing(f"an <Error> document with a success status: {code} {message}".strip())
        raise NotAListing(f"a <{clean(root.tag, 40)}> document")
    encoded = root.findtext(f"{ns}EncodingType") == "url"
    unquote = urllib.parse.unquote_plus if encoded else str
    key_tag, size_tag, prefix_tag, etag_tag = f"{ns}Key", f"{ns}Size", f"{ns}Prefix", f"{ns}ETag"
    objects = []
    for item in root.iterfind(f"{ns}Contents"):
        key, size = item.findtext(key_tag), (item.findtext(size_tag) or "").strip()
        if key is None or not size.isascii() or not size.isdigit() or len(size) > 19:
            raise NotAListing(f"a <Contents> without a <Key> and a <Size> (size {clean(size, 30)!r})")
        objects.append(ObjectInfo(unquote(key), int(size), normalize_etag(item.findtext(etag_tag))))
    prefixes = [unquote(item.findtext(prefix_tag) or "")
                for item in root.iterfind(f"{ns}CommonPrefixes")]
    token = root.findtext(f"{ns}NextContinuationToken")
    truncated = root.findtext(f"{ns}IsTruncated")
    if truncated == "true" and not token:
        raise NotAListing("IsTruncated is true but there is no NextContinuationToken")
    if truncated != "true" or not token:
        token = None
    return ListPage(objects, prefixes, token)


def next_token(page: ListPage, seen: set[str], *, bucket: str, prefix: str,
               token: str | None) -> str | None:
    """The token that resumes after ``page`` (None: the listing is complete), remembered in
    ``seen``; a token answered before would list the same pages forever: an error instead."""
    if page.token is None:
        return None
    if page.token in seen or page.token == token:
        raise not_a_listing(bucket, prefix, token, f"its NextContinuationToken "
                            f"{clean(page.token, 60)!r} was answered before: the listing would loop")
    seen.add(page.token)
    return page.token


async def paged(fetch: Callable[[str | None], Awaitable[ListPage]], *, bucket: str, prefix: str,
                token: str | None = None) -> AsyncGenerator[ListPage, None]:
    """The paging loop of every ``list_pages``: ``fetch(token)`` page after page, from ``token``
    on, until a page has no next token (one answered before is an error: ``next_token``)."""
    seen: set[str] = set()
    while True:
        page = await fetch(token)
        yield page
        token = next_token(page, seen, bucket=bucket, prefix=prefix, token=token)
        if token is None:
            return
