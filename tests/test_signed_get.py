"""Pure parts of ``loader.stores.signed_get``: which configs it serves, URLs, TLS settings."""

from __future__ import annotations

import ssl
import urllib.parse
from pathlib import Path

import botocore
from hypothesis import given
from hypothesis import strategies as st

from loader import S3Config
from loader.stores.signed_get import can_sign_directly, object_path_url, ssl_setting

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
