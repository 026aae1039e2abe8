"""Where a bucket's requests go, as botocore sends them: the origin (scheme, host, port), the path
before the key, and the ``Host`` header that SigV4 signs; and whether a proxy carries them.

Pure functions, shared by the two transports that skip botocore (``signed_get``, ``http_lister``):
AWS's regional endpoints (``https://<bucket>.s3.<region>.amazonaws.com``), custom endpoints
path-style or virtual-hosted (``<bucket>.<host>``), and path-style wherever a bucket's name is
not a DNS label (botocore's rule). What they do not serve (S3 Express directory buckets, FIPS or
dual-stack endpoints, isolated partitions) is named by ``unserved``; the caller then says so once
and leaves the bucket to botocore. tests/test_addressing.py holds this to botocore's choices.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import NamedTuple

from ..config import S3Config
from .signing import host_header

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_SETTINGS_NOT_SERVED = {  # botocore reads these from the environment; the signed path does not
    "AWS_USE_FIPS_ENDPOINT": "FIPS endpoints (AWS_USE_FIPS_ENDPOINT)",
    "AWS_USE_DUALSTACK_ENDPOINT": "dual-stack endpoints (AWS_USE_DUALSTACK_ENDPOINT)",
}


class NotServed(Exception):
    """The signed path cannot serve this request (a region redirect, an S3 Express bucket):
    botocore's path will, once the caller has said why (``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def redirected(status: int, headers: Mapping[str, str], bucket: str, configured: str) -> str | None:
    """Why an answer sends the request elsewhere, as botocore's ``S3RegionRedirector`` reads it,
    or None: a region redirect (301, or 400 with ``x-amz-bucket-region``: a signature for the
    wrong region) or a temporary redirect (307, a new bucket's DNS not yet everywhere).
    ``headers``: names in lower case."""
    region = headers.get("x-amz-bucket-region")
    if status in (301, 400) and region and region != configured:
        return (f"a region redirect: bucket {bucket!r} is in {region!r}, not {configured!r} "
                f"(set AWS_REGION={region} to skip it)")
    if status == 307:
        return f"a temporary redirect to {headers.get('location', '(no Location)')!r}"
    return None


class Origin(NamedTuple):
    """A scheme, host and port that connections are made to (and pooled by)."""

    scheme: str
    host: str
    port: int

    @property
    def https(self) -> bool:
        return self.scheme == "https"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


class Address(NamedTuple):
    """Where one bucket's requests go: ``origin``, ``base`` (the path before the key, bucket
    included when path-style, never a trailing slash) and the ``Host`` header to sign."""

    origin: Origin
    base: str
    host: str

    def path(self, key: str) -> str:
        """The request path of ``key`` (empty: the bucket itself, as a listing names it), the key
        escaped as botocore escapes it and sent byte for byte (no ``..`` folding)."""
        if not key:
            return self.base or "/"
        return self.base + "/" + urllib.parse.quote(key, safe="/~")


def virtual_hostable(bucket: str, *, dots: bool) -> bool:
    """Whether ``bucket`` can be a host name's first label(s), as botocore's endpoint rules
    decide (``aws.isVirtualHostableS3Bucket``): 3-63 lowercase letters, digits and hyphens,
    not an IP address; dots only when ``dots`` (plain http, where no wildcard certificate has to
    match)."""
    if not 3 <= len(bucket) <= 63:
        return False
    labels = bucket.split(".") if dots else [bucket]
    if not all(_LABEL.fullmatch(label) for label in labels):
        return False
    try:
        ipaddress.ip_address(bucket)
    except ValueError:
        return True
    return False


def aws_host(region: str) -> str:
    """AWS's S3 endpoint host for ``region`` (no bucket): ``s3.amazonaws.com`` for us-east-1 and
    aws-global, as botocore sends it, else ``s3.<region>.amazonaws.com`` (``.com.cn`` in China)."""
    if region in ("us-east-1", "aws-global"):
        return "s3.amazonaws.com"
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"s3.{region}.{suffix}"


def unserved(config: S3Config, bucket: str) -> str | None:
    """Why the signed path cannot serve ``bucket`` under ``config`` (botocore then does), or None."""
    env = os.environ
    if bucket.endswith("--x-s3"):
        return "an S3 Express One Zone directory bucket (session authentication)"
    for name, what in _SETTINGS_NOT_SERVED.items():
        if env.get(name, "").strip().lower() == "true":
            return what
    if config.endpoint_url is None:
        if config.region.startswith(("us-iso", "eu-iso")):
            return f"the isolated partition of region {config.region!r}"
        if config.region == "us-east-1" and \
                env.get("AWS_S3_US_EAST_1_REGIONAL_ENDPOINT", "").strip().lower() == "regional":
            return "the us-east-1 regional endpoint (AWS_S3_US_EAST_1_REGIONAL_ENDPOINT)"
    proxy = proxy_for(bucket_address(config, bucket).origin)
    if proxy is not None and proxy.origin.https:
        return "an https:// proxy URL (TLS to the proxy itself)"
    return None


def bucket_address(config: S3Config, bucket: str) -> Address:
    """Where ``bucket``'s requests go under ``config`` (see the module's docstring)."""
    if config.endpoint_url is None:
        scheme, host, port, base = "https", aws_host(config.region), 443, ""
    else:
        parts = urllib.parse.urlsplit(config.endpoint_url)
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        base = parts.path.rstrip("/")
    virtual = not config.path_style and virtual_hostable(bucket, dots=scheme == "http")
    if virtual:
        host = f"{bucket}.{host}"
    else:
        base = f"{base}/{urllib.parse.quote(bucket, safe='')}"
    origin = Origin(scheme, host, port)
    return Address(origin, base, host_header(f"{scheme}://{_netloc(host, port)}"))


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Proxy(NamedTuple):
    """A proxy to reach an origin through: CONNECT tunnels for https, absolute-form requests for
    http. ``authorization``: the ``Proxy-Authorization`` header its URL's user and password make."""

    origin: Origin
    authorization: str | None

    def headers(self) -> str:
        return f"Proxy-Authorization: {self.authorization}\r\n" if self.authorization else ""


def proxy_for(origin: Origin) -> Proxy | None:
    """The proxy that ``HTTPS_PROXY``/``HTTP_PROXY`` name for ``origin``, None when there is none
    or ``NO_PROXY`` bypasses it: botocore's rule (``botocore.utils.get_environ_proxies``), on the
    standard library's own reading of those variables (either case; lower case wins)."""
    proxies = urllib.request.getproxies_environment()
    default = 443 if origin.https else 80  # the URL's netloc, as botocore hands it over
    bypass = urllib.request.proxy_bypass(
        _netloc(origin.host, origin.port) if origin.port != default else origin.host)
    url = proxies.get(origin.scheme)
    if not url or bypass:
        return None
    if not url.startswith(("http:", "https:")):  # botocore's fix-up of a bare host:port
        url = ("http:" if url.startswith("//") else "http://") + url
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    authorization = None
    if parts.username and parts.password:  # botocore sends both or nothing
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return Proxy(Origin(scheme, parts.hostname or "", port), authorization)

