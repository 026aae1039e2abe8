"""SigV4 signing (``loader.s3.signing``) against botocore's ``S3SigV4Auth``, header for header.

The two transports that skip botocore build their requests (``SignedGetter.request``,
``HttpLister.request``); each request, as it would be sent, is given to botocore to sign at the
same instant with the same keys: the ``Authorization`` must be the same, and every header sent
(but the ``User-Agent`` that botocore leaves unsigned) must be among the ``SignedHeaders``.
Object paths with odd keys, ``Range``, ``If-Match``/``If-None-Match``, session tokens and
listing query strings are drawn by hypothesis.
"""

from __future__ import annotations

import datetime
import urllib.parse
from unittest import mock

import pytest
from botocore.auth import S3SigV4Auth, _host_from_url
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from hypothesis import given
from hypothesis import strategies as st

from loader import S3Config
from loader.retry import RetryPolicy
from loader.s3 import signing
from loader.s3.addressing import bucket_address
from loader.s3.credentials import GivenKeys
from loader.s3.http_lister import HttpLister
from loader.s3.list_xml import list_query
from loader.s3.signed_get import SignedGetter
from loader.s3.signing import canonical_query, host_header, sign_v4, signing_key

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
keys = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
buckets = st.sampled_from(["bucket", "b-1.x", "data.set"])
tokens = st.one_of(st.none(), st.text("abcXYZ123/+=", min_size=1, max_size=40))
secrets = st.text("abcXYZ123/+=", min_size=1, max_size=40)
regions = st.sampled_from(["us-east-1", "eu-west-3", "ap-southeast-2"])
endpoints = st.sampled_from(["http://127.0.0.1:9000", "https://127.0.0.1:9443", "http://localhost",
                             "https://s3.example.com:443", "http://[::1]:8333", None])
styles = st.sampled_from(["auto", "path", "virtual"])
ranges = st.one_of(st.none(), st.builds(lambda a, n: f"bytes={a}-" if n is None else f"bytes={a}-{a + n}",
                                        st.integers(0, 1 << 40), st.one_of(st.none(), st.integers(0, 1 << 30))))
etags = st.one_of(st.none(), st.from_regex(r'"[0-9a-f]{32}(-[0-9]{1,4})?"', fullmatch=True))
instants = st.datetimes(min_value=datetime.datetime(2020, 1, 1), max_value=datetime.datetime(2035, 1, 1))
listings = st.builds(lambda prefix, token, after, delimiter, size: list_query(prefix, size, token, after, delimiter),
                     texts, st.one_of(st.none(), texts.filter(bool)), st.one_of(st.none(), texts.filter(bool)),
                     st.sampled_from([None, "/"]), st.integers(1, 1000))


def botocore_headers(url: str, headers: dict[str, str], access: str, secret: str, token: str | None,
                     region: str, when: datetime.datetime) -> dict[str, str]:
    """The headers botocore's S3 signer gives a bodiless GET of ``url`` with ``headers``, at ``when``."""
    request = AWSRequest(method="GET", url=url, headers=headers)
    with mock.patch("botocore.auth.get_current_datetime", return_value=when):
        S3SigV4Auth(Credentials(access, secret, token), "s3", region).add_auth(request)
    return {name.lower(): value for name, value in request.headers.items()}


def signed_names(authorization: str) -> set[str]:
    return set(authorization.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";"))


def _config(endpoint: str | None, style: str, region: str = "us-east-1", **keys) -> S3Config:
    if endpoint is not None and "[" in endpoint:
        style = "path"  # no bucket name goes before an IPv6 address
    return S3Config(endpoint_url=endpoint, region=region, addressing_style=style, **keys)


def _url(config: S3Config, bucket: str, target: str) -> str:
    """The URL a request with ``target`` goes to, as botocore would derive its Host from it."""
    address = bucket_address(config, bucket)
    return f"{address.origin.scheme}://{address.host}{target}"


def assert_signed_like_botocore(url: str, sent: dict[str, str], botocore: dict[str, str]) -> None:
    assert sent["authorization"] == botocore["authorization"], url
    unsigned = set(sent) - signed_names(sent["authorization"]) - {"authorization"}
    assert unsigned == set(), f"sent but not signed: {unsigned}"
    assert {"range", "if-match", "if-none-match", "host", "x-amz-date"} & set(sent) <= signed_names(
        sent["authorization"])
    for name in signed_names(botocore["authorization"]) - {"host"}:  # botocore derives the host
        assert sent[name] == botocore[name], name
    assert sent["host"] == _host_from_url(url)


@given(endpoint=endpoints, style=styles, bucket=buckets, key=keys, byte_range=ranges, if_match=etags,
       if_none_match=etags, access=st.sampled_from(["AKIDEXAMPLE", "minioadmin"]), secret=secrets,
       token=tokens, region=regions, when=instants)
def test_the_signed_get_transport_signs_object_gets_as_botocore_does(
        endpoint, style, bucket, key, byte_range, if_match, if_none_match, access, secret, token, region,
        when):
    config = _config(endpoint, style, region)
    getter = SignedGetter(config, None, max_connections=1, retry=RetryPolicy())  # opens nothing yet
    conditions = {name: value for name, value in (("If-Match", if_match), ("If-None-Match", if_none_match))
                  if value is not None} or None
    target, sent = getter.request(bucket, key, byte_range, None, conditions,
                                  GivenKeys(access, secret, token), when)
    url = _url(config, bucket, target)
    given = {**(conditions or {}), **({"Range": byte_range} if byte_range else {})}
    theirs = botocore_headers(str(url), given, access, secret, token, config.region, when)
    assert_signed_like_botocore(str(url), sent, theirs)
    if byte_range:
        assert sent["range"] == byte_range
    if if_match:
        assert sent["if-match"] == if_match


@given(endpoint=endpoints, style=styles, bucket=buckets, query=listings, secret=secrets, token=tokens,
       region=regions, when=instants)
def test_the_signed_get_transport_signs_listings_as_botocore_does(endpoint, style, bucket, query, secret, token,
                                                                region, when):
    config = _config(endpoint, style, region)
    getter = SignedGetter(config, None, max_connections=1, retry=RetryPolicy())
    target, sent = getter.request(bucket, "", None, query, None, GivenKeys("AK", secret, token), when)
    url = _url(config, bucket, target)
    theirs = botocore_headers(str(url), {}, "AK", secret, token, region, when)
    assert_signed_like_botocore(str(url), sent, theirs)


@given(endpoint=endpoints, style=styles, bucket=buckets, key=st.one_of(st.none(), keys), query=listings,
       byte_range=ranges, secret=secrets, token=tokens, region=regions, when=instants)
def test_the_http_lister_transport_signs_as_botocore_does(endpoint, style, bucket, key, query, byte_range,
                                                          secret, token, region, when):
    config = _config(endpoint, style, region, access_key_id="AK", secret_access_key=secret,
                     session_token=token)
    lister = HttpLister(config)
    if key is None:  # a listing page
        target, sent = lister.request(bucket, "", query, None, when)
    else:  # an object (a shard index), maybe a range of it
        target, sent = lister.request(bucket, "/" + urllib.parse.quote(key, safe="/~"), {}, byte_range,
                                      when)
    url = _url(config, bucket, target)
    given = {"Accept-Encoding": "identity", **({"Range": byte_range} if byte_range and key else {})}
    theirs = botocore_headers(url, given, "AK", secret, token, region, when)
    assert_signed_like_botocore(url, sent, theirs)


@given(st.dictionaries(st.sampled_from(["prefix", "start-after", "continuation-token", "delimiter"]),
                       texts),
       st.sampled_from(["bucket", "b-1.x"]), tokens)
def test_signatures_match_botocores(query, bucket, token):
    query = {"list-type": "2", "max-keys": "1000", **query}
    host, path = "127.0.0.1:9000", f"/{bucket}"
    request = AWSRequest(method="GET", url=f"http://{host}{path}?{canonical_query(query)}")
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+x", token), "s3", "eu-west-3").add_auth(request)
    when = datetime.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    ours = sign_v4("GET", host, path, query, access_key="AKIDEXAMPLE", secret_key="secret/key+x",
                   token=token, region="eu-west-3", when=when)
    assert ours["authorization"] == request.headers["Authorization"]


def test_header_values_are_trimmed_as_botocore_trims_them():
    when = datetime.datetime(2026, 11, 27, 12, 0, 0)
    headers = {"Range": "  bytes=0-9 ", "x-amz-meta-note": "a   b\tc"}
    ours = sign_v4("GET", "127.0.0.1:9000", "/b/k", {}, access_key="AK", secret_key="SK", token=None,
                   region="us-east-1", when=when, headers=headers)
    theirs = botocore_headers("http://127.0.0.1:9000/b/k", headers, "AK", "SK", None, "us-east-1", when)
    assert ours["authorization"] == theirs["authorization"]
    assert "x-amz-meta-note" in signed_names(ours["authorization"])


def test_the_user_agent_stays_unsigned_as_botocore_leaves_it():
    when = datetime.datetime(2026, 11, 27, 12, 0, 0)
    ours = sign_v4("GET", "h", "/b/k", {}, access_key="AK", secret_key="SK", token=None,
                   region="us-east-1", when=when, headers={"User-Agent": "x"})
    assert "user-agent" not in signed_names(ours["authorization"])


def test_the_days_signing_key_is_derived_once():
    signing_key.cache_clear()
    when = datetime.datetime(2026, 11, 27, 12, 0, 0)
    with mock.patch.object(signing.hmac, "new", wraps=signing.hmac.new) as new:
        for second in range(5):
            sign_v4("GET", "h", "/b/k", {}, access_key="AK", secret_key="SK", token=None,
                    region="us-east-1", when=when.replace(second=second))
    assert new.call_count == 4 + 5, "four HMACs for the day's key, then one per request"
    info = signing_key.cache_info()
    assert (info.misses, info.hits) == (1, 4)
    next_day = sign_v4("GET", "h", "/b/k", {}, access_key="AK", secret_key="SK", token=None,
                       region="us-east-1", when=when + datetime.timedelta(days=1))
    assert signing_key.cache_info().misses == 2 and "20261128/us-east-1" in next_day["authorization"]


@pytest.mark.parametrize("endpoint, host", [
    ("http://127.0.0.1:9000", "127.0.0.1:9000"), ("https://s3.example.com:443", "s3.example.com"),
    ("http://h:80", "h"), ("https://h:80", "h:80"), ("http://[::1]:8333", "[::1]:8333"),
])
def test_the_host_header_is_botocores(endpoint, host):
    assert host_header(endpoint) == host == _host_from_url(endpoint)
