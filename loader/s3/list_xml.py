"""``ListObjectsV2`` requests built and answers read into ``ListPage`` s, for every lister that
speaks the HTTP API itself."""

from __future__ import annotations

import html
import re
import urllib.parse
from xml.etree import ElementTree

from .protocol import ListPage, ObjectInfo, normalize_etag

_KEY = re.compile(rb"<Key>([^<]*)</Key>")
_SIZE = re.compile(rb"<Size>([0-9]+)</Size>")
_ETAG = re.compile(rb"<ETag>([^<]*)</ETag>")
_TOKEN = re.compile(rb"<NextContinuationToken>([^<]*)</NextContinuationToken>")


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


def parse_list_page(body: bytes) -> ListPage:
    """Keys, sizes, ETags, common prefixes and the next token of a ``ListObjectsV2`` answer
    (asked with ``encoding-type=url``, so keys with characters XML cannot carry arrive intact)."""
    return _parse_flat_page(body) or _parse_list_page(body)


def _parse_flat_page(body: bytes) -> ListPage | None:
    """The common answer (objects only, no namespace prefixes) read with three regular
    expressions, for about half the CPU of ElementTree (bench/results/docstring-figures.md).
    None when the answer is not that plain shape (one Key, Size and ETag per Contents, or no
    ETags at all), and ElementTree reads it instead."""
    if b"<CommonPrefixes>" in body or b":Contents" in body:
        return None
    keys, sizes, etags = _KEY.findall(body), _SIZE.findall(body), _ETAG.findall(body)
    if len(keys) != body.count(b"<Contents>") or len(sizes) != len(keys) or len(etags) not in (
            0, len(keys)):
        return None
    encoded = b"<EncodingType>url</EncodingType>" in body
    names = []
    for raw in keys:
        key = raw.decode("utf-8", "surrogateescape")
        if "&" in key:
            key = html.unescape(key)
        if encoded and ("%" in key or "+" in key):
            key = urllib.parse.unquote_plus(key)
        names.append(key)
    tags = [_etag(raw) for raw in etags] or [None] * len(names)
    objects = list(map(ObjectInfo, names, map(int, sizes), tags))
    found = _TOKEN.search(body)
    token = html.unescape(found.group(1).decode()) if found else None
    if b"<IsTruncated>true</IsTruncated>" not in body or not token:
        token = None
    return ListPage(objects, [], token)


def _etag(raw: bytes) -> str | None:
    """An ETag as listed: quoted with entities (``&#34;`` or ``&quot;``), quotes, or bare."""
    raw = raw.replace(b"&#34;", b"").replace(b"&quot;", b"")
    text = raw.decode("utf-8", "surrogateescape")
    return normalize_etag(html.unescape(text) if "&" in text else text)


def _parse_list_page(body: bytes) -> ListPage:
    root = ElementTree.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    encoded = root.findtext(f"{ns}EncodingType") == "url"
    unquote = urllib.parse.unquote_plus if encoded else str
    key_tag, size_tag, prefix_tag, etag_tag = f"{ns}Key", f"{ns}Size", f"{ns}Prefix", f"{ns}ETag"
    objects = [
        ObjectInfo(unquote(item.findtext(key_tag) or ""), int(item.findtext(size_tag) or 0),
                   normalize_etag(item.findtext(etag_tag)))
        for item in root.iterfind(f"{ns}Contents")
    ]
    prefixes = [unquote(item.findtext(prefix_tag) or "")
                for item in root.iterfind(f"{ns}CommonPrefixes")]
    token = root.findtext(f"{ns}NextContinuationToken")
    if root.findtext(f"{ns}IsTruncated") != "true" or not token:
        token = None
    return ListPage(objects, prefixes, token)
