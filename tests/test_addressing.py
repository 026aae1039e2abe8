"""Where the signed transports send a bucket's requests, and through which proxy: held to what
botocore itself sends (the URL of a real request, stopped before it leaves) and the proxy it picks."""

from __future__ import annotations

import functools

import boto3
import botocore.config
import botocore.httpsession
import botocore.utils
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import S3Config
from loader.s3.addressing import Origin, bucket_address, proxy_for, redirected, unserved, virtual_hostable

CREDS = dict(access_key_id="AK", secret_access_key="SK")
buckets = st.one_of(
    st.sampled_from(["my-bucket", "my.bucket", "ab", "data", "My_Bucket", "192.168.1.1", "a-b.c-d", "x" * 63,
                     "-dash", "dash-", "a..b"]),
    st.from_regex(r"[a-z0-9][a-z0-9.-]{1,20}[a-z0-9]", fullmatch=True))
regions = st.sampled_from(["us-east-1", "eu-west-1", "ap-southeast-2", "cn-north-1", "us-gov-west-1",
                           "aws-global"])
endpoints = st.sampled_from([None, "https://s3.lab.test:8443", "http://s3.lab.test:8333", "http://localhost",
                             "https://minio.example.com"])
styles = st.sampled_from(["auto", "path", "virtual"])


class _Stop(Exception):
    pass


@functools.lru_cache(maxsize=64)
def _client(region: str, endpoint: str | None, style: str):
    config = S3Config(endpoint_url=endpoint, region=region, addressing_style=style, **CREDS)
    client = boto3.client(
        "s3", region_name=region, endpoint_url=endpoint, aws_access_key_id="AK", aws_secret_access_key="SK",
        config=botocore.config.Config(
            # as the aioboto3 store configures botocore
            s3={"addressing_style": "path" if config.path_style else config.addressing_style},
            retries={"total_max_attempts": 1}))
    seen: dict[str, str] = {}

    def stop(request, **_):
        seen["url"] = request.url
        raise _Stop

    client.meta.events.register("before-send.s3", stop)
    return client, seen


def botocore_url(region: str, endpoint: str | None, style: str, bucket: str, key: str) -> str:
    client, seen = _client(region, endpoint, style)
    with pytest.raises(_Stop):
        client.get_object(Bucket=bucket, Key=key)
    return seen["url"]


def _netloc(origin: Origin) -> str:
    default = 443 if origin.https else 80
    return origin.host if origin.port == default else f"{origin.host}:{origin.port}"


@settings(max_examples=300, deadline=None)
@given(bucket=buckets, region=regions, endpoint=endpoints, style=styles,
       key=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20))
def test_requests_go_where_botocore_sends_them(bucket, region, endpoint, style, key):
    config = S3Config(endpoint_url=endpoint, region=region, addressing_style=style, **CREDS)
    theirs = botocore_url(region, endpoint, style, bucket, key)
    address = bucket_address(config, bucket)
    ours = f"{address.origin.scheme}://{_netloc(address.origin)}{address.path(key)}"
    assert ours == theirs


def test_aws_endpoints_are_regional_and_virtual_hosted():
    def url(bucket, region="eu-west-1", **options):
        address = bucket_address(S3Config(region=region, **options, **CREDS), bucket)
        return f"{address.origin.url}{address.path('k')}", address.host

    assert url("my-bucket") == ("https://my-bucket.s3.eu-west-1.amazonaws.com:443/k",
                                "my-bucket.s3.eu-west-1.amazonaws.com")
    assert url("my.bucket")[0] == "https://s3.eu-west-1.amazonaws.com:443/my.bucket/k", "dots: path-style"
    assert url("my-bucket", "us-east-1")[1] == "my-bucket.s3.amazonaws.com"
    assert url("my-bucket", addressing_style="path")[1] == "s3.eu-west-1.amazonaws.com"
    lab = bucket_address(S3Config(endpoint_url="https://s3.lab.test:8443", addressing_style="virtual", **CREDS),
                         "data")
    assert (lab.origin, lab.host, lab.path("")) == (Origin("https", "data.s3.lab.test", 8443),
                                                    "data.s3.lab.test:8443", "/")


@given(st.text(max_size=70))
def test_virtual_hostable_names_are_dns_labels(name):
    if virtual_hostable(name, dots=False):
        assert 3 <= len(name) <= 63 and name == name.lower() and "." not in name and "_" not in name
        assert name[0].isalnum() and name[-1].isalnum()


def test_what_the_path_cannot_serve_is_named(monkeypatch):
    config = S3Config(**CREDS)
    assert unserved(config, "data") is None
    assert "S3 Express" in unserved(config, "data--usw2-az1--x-s3")
    assert "isolated partition" in unserved(S3Config(region="us-iso-east-1", **CREDS), "data")
    monkeypatch.setenv("AWS_USE_DUALSTACK_ENDPOINT", "true")
    assert "dual-stack" in unserved(config, "data")
    monkeypatch.delenv("AWS_USE_DUALSTACK_ENDPOINT")
    monkeypatch.setenv("HTTPS_PROXY", "https://proxy.example:3129")
    assert "https:// proxy" in unserved(config, "data")


proxy_envs = st.fixed_dictionaries({}, optional={
    "HTTPS_PROXY": st.sampled_from(["http://proxy:3128", "proxy:3128", "http://u:p%40ss@proxy:8080",
                                    "//proxy:3128", "http://u@proxy:1"]),
    "http_proxy": st.sampled_from(["http://127.0.0.1:3128", "http://other:80"]),
    "NO_PROXY": st.sampled_from(["*", "localhost,127.0.0.1", ".lab.test", "s3.lab.test", "data.s3.lab.test:8443",
                                 "amazonaws.com", "example.org", ""]),
})
origins = st.sampled_from([Origin("https", "data.s3.lab.test", 8443), Origin("http", "s3.lab.test", 8333),
                           Origin("https", "my-bucket.s3.amazonaws.com", 443), Origin("http", "localhost", 80),
                           Origin("http", "127.0.0.1", 9000)])


@settings(max_examples=200, deadline=None)
@given(env=proxy_envs, origin=origins)
def test_the_proxy_is_the_one_botocore_picks(env, origin, monkeypatch_module):
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
                 "ALL_PROXY", "all_proxy"):
        monkeypatch_module.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch_module.setenv(name, value)
    url = f"{origin.scheme}://{_netloc(origin)}/key"
    configuration = botocore.httpsession.ProxyConfiguration(proxies=botocore.utils.get_environ_proxies(url))
    theirs = configuration.proxy_url_for(url)
    ours = proxy_for(origin)
    if theirs is None:
        assert ours is None
        return
    assert ours is not None
    their_origin = botocore.utils.urlparse(theirs)
    assert (ours.origin.scheme, ours.origin.host) == (their_origin.scheme, their_origin.hostname)
    assert ours.origin.port == (their_origin.port or 80)
    headers = configuration.proxy_headers_for(theirs)
    assert ours.authorization == headers.get("Proxy-Authorization")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch



def test_redirects_are_read_as_botocores_redirector_reads_them():
    region = {"x-amz-bucket-region": "eu-west-1"}
    assert "region redirect" in redirected(301, region, "data", "us-east-1")
    assert "AWS_REGION=eu-west-1" in redirected(400, region, "data", "us-east-1"), "a signature for the wrong region"
    assert redirected(400, {}, "data", "us-east-1") is None, "a plain bad request is an error, not a redirect"
    assert redirected(403, region, "data", "us-east-1") is None
    assert redirected(301, region, "data", "eu-west-1") is None, "already the bucket's region: not a redirect"
    assert "temporary redirect" in redirected(307, {"location": "https://data.s3-eu-west-1.amazonaws.com/k"},
                                              "data", "us-east-1")
