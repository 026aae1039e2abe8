"""Pure parts of ``loader.stores.signed_get``: which configs it serves, URLs, TLS settings, and GET
signatures (the same headers as botocore's signer)."""

from __future__ import annotations

import datetime
import ssl
import urllib.parse
from pathlib import Path
from unittest import mock

import botocore
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials
from hypothesis import given
from hypothesis import strategies as st

from loader import S3Config
from loader.stores.signed_get import GetSigner, can_sign_directly, object_path_url, ssl_setting

CREDS = dict(access_key_id="AK", secret_access_key="SK")


def test_only_path_style_custom_endpoints_sign_directly():
    assert can_sign_directly(S3Config(endpoint_url="http://127.0.0.1:9000", **CREDS))
    assert not can_sign_directly(S3Config(**CREDS)), "AWS's endpoints need botocore's rules"
    assert not can_sign_directly(
        S3Config(endpoint_url="http://127.0.0.1:9000", addressing_style="virtual", **CREDS))


@given(key=st.text(min_size=1, max_size=300), bucket=st.from_regex(r"[a-z0-9][a-z0-9.-]{2,20}", fullmatch=True))
def test_the_url_path_names_exactly_the_bucket_and_key(key, bucket):
    url = object_path_url("http://127.0.0.1:9000/", bucket, key)
    assert url.raw_path == "/" + bucket + "/" + urllib.parse.quote(key, safe="/~")
    assert urllib.parse.unquote(url.raw_path) == f"/{bucket}/{key}", "no segment folded or dropped"
    assert str(url).startswith("http://127.0.0.1:9000/" + bucket + "/")
    assert url.raw_query_string == "" and url.raw_fragment == "", "'?' and '#' stay in the key"


def test_dot_segments_and_double_slashes_are_sent_as_written():
    for key in ("a/../b", "./x", "a//b", "/lead"):
        assert object_path_url("http://h:1", "bkt", key).raw_path == "/bkt/" + key


def test_tls_settings_follow_the_endpoint_and_verify():
    plain = S3Config(endpoint_url="http://127.0.0.1:9000", **CREDS)
    assert ssl_setting(plain) is False, "plain http builds no SSL context"
    assert ssl_setting(S3Config(endpoint_url="https://s3.example.com", **CREDS)) is True
    assert ssl_setting(S3Config(endpoint_url="https://s3.example.com", verify=False, **CREDS)) is False
    bundle = str(Path(botocore.__file__).with_name("cacert.pem"))  # a CA bundle botocore ships
    custom = ssl_setting(S3Config(endpoint_url="https://s3.example.com", verify=bundle, **CREDS))
    assert isinstance(custom, ssl.SSLContext) and custom.verify_mode == ssl.CERT_REQUIRED
    assert custom.cert_store_stats()["x509_ca"] > 0, "the bundle's CAs were loaded"


@given(
    key=st.text(min_size=1, max_size=100),
    endpoint=st.sampled_from(["http://127.0.0.1:9000", "https://s3.example.com", "http://LocalHost:80",
                              "https://[::1]:8443", "https://minio.internal:443/"]),
    region=st.sampled_from(["us-east-1", "eu-central-1"]),
    secret=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40),
    token=st.none() | st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=60),
    byte_range=st.none() | st.from_regex(r"bytes=[0-9]{1,6}-([0-9]{1,6})?", fullmatch=True),
    if_match=st.none() | st.from_regex(r'"[0-9a-f]{32}(-[0-9]+)?"', fullmatch=True),
    moment=st.datetimes(min_value=datetime.datetime(2020, 1, 1), max_value=datetime.datetime(2040, 1, 1)),
)
def test_get_signatures_match_botocores(key, endpoint, region, secret, token, byte_range, if_match, moment):
    """The hand-written GET signer gives exactly the headers botocore's S3SigV4Auth gives."""
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", secret, token)
    url = object_path_url(endpoint, "bucket", key)
    extra = {}
    if byte_range:
        extra["Range"] = byte_range
    if if_match:
        extra["If-Match"] = if_match
    request = AWSRequest(method="GET", url=str(url))
    for name, value in extra.items():
        request.headers[name] = value
    with mock.patch("botocore.auth.get_current_datetime", return_value=moment):
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
    signer = GetSigner(endpoint, region)
    ours = signer.headers(credentials, url.raw_path, extra, moment.strftime("%Y%m%dT%H%M%SZ"))
    assert ours == dict(request.headers.items())
    again = signer.headers(credentials, url.raw_path, extra, moment.strftime("%Y%m%dT%H%M%SZ"))
    assert again == ours, "the kept signing key gives the same signature"


def test_the_signing_key_is_kept_for_its_day_only():
    signer = GetSigner("http://127.0.0.1:9000", "us-east-1")
    credentials = ReadOnlyCredentials("AK", "SK", None)
    first = signer.headers(credentials, "/b/k", {}, "20260101T000000Z")["Authorization"]
    later = signer.headers(credentials, "/b/k", {}, "20260101T235959Z")["Authorization"]
    next_day = signer.headers(credentials, "/b/k", {}, "20260102T000000Z")["Authorization"]
    rotated = signer.headers(ReadOnlyCredentials("AK", "SK2", None), "/b/k", {}, "20260102T000000Z")
    assert "20260101/us-east-1/s3" in first and "20260102/us-east-1/s3" in next_day
    assert len({first, later, next_day, rotated["Authorization"]}) == 4
