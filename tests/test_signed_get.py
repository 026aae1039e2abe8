"""Pure parts of ``loader.s3.signed_get``: request paths, TLS settings."""

from __future__ import annotations

import ssl
import urllib.parse
from pathlib import Path

import botocore
from hypothesis import assume, given
from hypothesis import strategies as st

from loader import S3Config
from loader.s3.addressing import bucket_address
from loader.s3.signed_get import ssl_setting

CREDS = dict(access_key_id="AK", secret_access_key="SK")


@given(key=st.text(min_size=1, max_size=300), bucket=st.from_regex(r"[a-z0-9][a-z0-9.-]{2,20}", fullmatch=True))
def test_the_url_path_names_exactly_the_bucket_and_key(key, bucket):
    path = bucket_address(S3Config(endpoint_url="http://127.0.0.1:9000", **CREDS), bucket).path(key)
    assert path == "/" + bucket + "/" + urllib.parse.quote(key, safe="/~")
    assert urllib.parse.unquote(path) == f"/{bucket}/{key}", "no segment folded or dropped"
    assert "?" not in path and "#" not in path, "'?' and '#' stay in the key, escaped"


def test_dot_segments_and_double_slashes_are_sent_as_written():
    address = bucket_address(S3Config(endpoint_url="http://127.0.0.1:9000", **CREDS), "bkt")
    for key in ("a/../b", "./x", "a//b", "/lead"):
        assert address.path(key) == "/bkt/" + key


def test_tls_settings_follow_the_endpoint_and_verify():
    plain = S3Config(endpoint_url="http://127.0.0.1:9000", **CREDS)
    assert ssl_setting(plain) is None, "plain http builds no SSL context"
    system = ssl_setting(S3Config(endpoint_url="https://s3.example.com", **CREDS))
    assert isinstance(system, ssl.SSLContext) and system.verify_mode == ssl.CERT_REQUIRED
    assert system.check_hostname
    assert ssl_setting(S3Config(endpoint_url="https://s3.example.com", **CREDS)) is system, "one a process"
    unverified = ssl_setting(S3Config(endpoint_url="https://s3.example.com", verify=False, **CREDS))
    assert isinstance(unverified, ssl.SSLContext) and unverified.verify_mode == ssl.CERT_NONE
    bundle = str(Path(botocore.__file__).with_name("cacert.pem"))  # a CA bundle botocore ships
    custom = ssl_setting(S3Config(endpoint_url="https://s3.example.com", verify=bundle, **CREDS))
    assert isinstance(custom, ssl.SSLContext) and custom.verify_mode == ssl.CERT_REQUIRED
    assert custom.cert_store_stats()["x509_ca"] > 0, "the bundle's CAs were loaded"


# ---------------------------------------------------------------- listing answers

def _list_body(keys: list[str], etags: list[str | None], prefixes: list[str], encoded: bool,
               token: str | None, quote: str) -> bytes:
    """A ListObjectsV2 answer as S3 and SeaweedFS write it (elements in their orders)."""
    from xml.sax.saxutils import escape

    def text(value: str) -> str:
        return escape(urllib.parse.quote_plus(value, safe="/") if encoded else value)

    parts = ['<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult '
             'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix></Prefix>'
             f'<MaxKeys>1000</MaxKeys><IsTruncated>{"true" if token else "false"}</IsTruncated>']
    if encoded:
        parts.append("<EncodingType>url</EncodingType>")
    for key, etag in zip(keys, etags):
        tag = "" if etag is None else f"<ETag>{quote}{etag}{quote}</ETag>"
        parts.append(f"<Contents><Key>{text(key)}</Key>{tag}<Size>{len(key)}</Size>"
                     "<StorageClass>STANDARD</StorageClass></Contents>")
    parts += [f"<CommonPrefixes><Prefix>{text(p)}</Prefix></CommonPrefixes>" for p in prefixes]
    if token:
        parts.append(f"<NextContinuationToken>{escape(token)}</NextContinuationToken>")
    return ("".join(parts) + "</ListBucketResult>").encode()


@given(st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12),
                max_size=20),
       st.sampled_from(["etags", "none"]), st.booleans(), st.booleans(),
       st.sampled_from(["&#34;", "&quot;", ""]), st.one_of(st.none(), st.text("ab&<+ %", min_size=1)))
def test_the_fast_list_parser_reads_what_elementtree_reads(keys, etags, folders, encoded, quote,
                                                           token):
    from loader.s3.list_xml import _parse_flat_page, _parse_list_page, parse_list_page

    assume(keys or folders or not token)  # a page of nothing that claims more is refused (below)
    tags = [f"{i:032x}" for i in range(len(keys))] if etags == "etags" else [None] * len(keys)
    body = _list_body(keys, tags, ["p/"] if folders else [], encoded, token, quote)
    fast = _parse_flat_page(body)
    assert parse_list_page(body) == _parse_list_page(body)
    assert (fast is None) == (folders or b"&" in body.replace(b"&#34;", b"").replace(b"&quot;", b"")), \
        "only pages with folders or escapes go to expat"
    if fast is not None:
        assert fast == _parse_list_page(body)
        assert [info.key for info in fast.objects] == keys
