"""The endpoint shapes AWS users have, against the embedded server: ``https`` with a private CA
and virtual-hosted addressing (``<bucket>.s3.lab.test``), proxies named by ``HTTPS_PROXY`` /
``HTTP_PROXY`` and bypassed by ``NO_PROXY``, and a request the signed path cannot serve (a region
redirect) named once and left to botocore.

The lab's names resolve to 127.0.0.1 through a ``socket.getaddrinfo`` wrapper in this process
(no /etc/hosts edit): it reaches every client that resolves in Python (this package's signed path
and lister, botocore, the test proxy) and forked DataLoader workers, not obstore's resolver (Rust),
which reads the same server path-style at 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import urllib.parse
import warnings

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Limits, S3Config
from loader.retry import RetryPolicy
from loader.s3 import open_listing_store, open_store, tls
from loader.s3.aioboto3_store import Aioboto3Store, FallbackWarning
from loader.tools.devserver import DevServer

from datasets import jpeg_dataset
from faults import lab_certificates
from forward_proxy import ForwardProxy
from s3servers import S3_VARS, minio_client

DOMAIN = "s3.lab.test"
BUCKET = "vhost-data"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
              "ALL_PROXY", "all_proxy")
QUICK = RetryPolicy(max_attempts=2, base_delay=0.01, connect_timeout=5, read_timeout=20)


@pytest.fixture(scope="module")
def lab_names():
    """``*.s3.lab.test`` resolves to 127.0.0.1 in this process (and its forks) while the module runs."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and (name == DOMAIN or name.endswith("." + DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        socket.getaddrinfo = real


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return lab_certificates(tmp_path_factory.mktemp("pki-vhost"), DOMAIN)


@pytest.fixture(scope="module")
def lab(pki, lab_names):
    """The embedded server on https (and http) with the lab's domain, and 40 JPEGs in a bucket."""
    with DevServer(certfile=pki["cert"], keyfile=pki["key"], cafile=pki["ca"], domain=DOMAIN) as server:
        server.create_bucket(BUCKET)
        client = minio_client(server.config)
        try:
            digests = jpeg_dataset(client, BUCKET, "train/", 40, seed=21)
        finally:
            client._http.clear()
        yield server, digests


@pytest.fixture
def clean_env(monkeypatch):
    for name in S3_VARS + ("AWS_CA_BUNDLE",) + PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def vhost_config(server: DevServer, scheme: str = "https") -> S3Config:
    """What a user writes for the lab's AWS-shaped endpoint: the domain, virtual-hosted."""
    port = server.ports.s3_https if scheme == "https" else server.ports.s3
    base = server.config
    return S3Config(endpoint_url=f"{scheme}://{DOMAIN}:{port}", region=base.region,
                    access_key_id=base.access_key_id, secret_access_key=base.secret_access_key,
                    addressing_style="virtual", verify=base.verify)


def digests_of(loader) -> dict[str, str]:
    return {sample["__key__"] + ".jpg": hashlib.sha256(sample["jpg"]).hexdigest()
            for batch in loader for sample in batch}


def collate(batch):
    return batch


def test_https_virtual_hosted_reads_exactly_through_the_signed_path(lab, clean_env):
    """The default backend, the endpoint AWS users have: every byte as written, GETs and the
    listing on the signed path (botocore's client is never made)."""
    server, digests = lab
    config = vhost_config(server)

    async def main() -> tuple[dict[str, str], bool]:
        store = await Aioboto3Store.open(config, max_connections=8, retry=QUICK)
        try:
            keys = [info.key async for info in store.list(BUCKET, "train/")]
            read = {key: hashlib.sha256(await store.get(BUCKET, key)).hexdigest() for key in keys}
            ranged = await store.get_range(BUCKET, keys[0], 10, 20)
            assert ranged == (await store.get(BUCKET, keys[0]))[10:20]
            return read, callable(store._made_client)
        finally:
            await store.aclose()

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        read, botocore_unused = asyncio.run(main())
    assert read == digests
    assert botocore_unused, "botocore's client was made: a request left the signed path"


def test_the_default_dataset_reads_virtual_hosted_https_in_the_parent_and_forked_workers(lab, clean_env):
    server, digests = lab
    config = vhost_config(server)
    dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", config=config, shuffle=True, seed=5)
    assert digests_of(DataLoader(dataset, batch_size=8, collate_fn=collate)) == digests
    dataset.set_epoch(1)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate, timeout=120)
    assert digests_of(loader) == digests


def test_the_lister_serves_virtual_hosted_https_with_keys_from_the_environment(lab, clean_env):
    """No keys in the config: the listing finds them as botocore does (here the environment)."""
    server, digests = lab
    clean_env.setenv("AWS_ACCESS_KEY_ID", server.config.access_key_id)
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", server.config.secret_access_key)
    config = S3Config(endpoint_url=vhost_config(server).endpoint_url, addressing_style="virtual",
                      verify=server.config.verify)

    async def main() -> list[str]:
        lister = await open_listing_store(config, max_connections=4, retry=QUICK)
        try:
            assert type(lister).__name__ == "HttpLister"
            return [info.key async for info in lister.list(BUCKET, "train/")]
        finally:
            await lister.aclose()

    assert sorted(asyncio.run(main())) == sorted(digests)


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_both_backends_read_the_domain_server_over_https_path_style(lab, clean_env, store):
    """obstore resolves names itself (the lab's names are not in its reach): path-style at
    127.0.0.1, the certificate naming that address too."""
    server, digests = lab
    dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", config=server.config, store=store)
    assert server.config.endpoint_url.startswith("https://127.0.0.1:")
    assert digests_of(DataLoader(dataset, batch_size=8, collate_fn=collate)) == digests


def read_all(config: S3Config, store: str = "aioboto3") -> dict[str, str]:
    """List and read every object with ``store``, as a dataset's engine does."""

    async def main() -> dict[str, str]:
        lister = await open_listing_store(config, max_connections=4, retry=QUICK)
        try:
            keys = [info.key async for info in lister.list(BUCKET, "train/")]
        finally:
            await lister.aclose()
        reader = await open_store(store, config, max_connections=4, retry=QUICK)
        try:
            return {key: hashlib.sha256(await reader.get(BUCKET, key)).hexdigest() for key in keys}
        finally:
            await reader.aclose()

    return asyncio.run(main())


def test_a_second_epoch_makes_no_new_tls_connection(lab, clean_env):
    """Each epoch's engine runs its own event loop; the first epoch's TLS connections are parked
    when it ends and taken by the second (``loader.s3.tls``): counted at an ``HTTPS_PROXY``,
    where every new TLS connection is one CONNECT, and every byte read as written both times."""
    server, digests = lab
    config = vhost_config(server)
    try:
        with ForwardProxy() as proxy:
            clean_env.setenv("HTTPS_PROXY", proxy.url)
            dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", config=config, shuffle=True, seed=3,
                                                 limits=Limits(concurrency=4))
            loader = DataLoader(dataset, batch_size=8, collate_fn=collate)
            assert digests_of(loader) == digests
            first = proxy.methods().count("CONNECT")
            dataset.set_epoch(1)
            assert digests_of(loader) == digests
            assert proxy.methods().count("CONNECT") == first, "the second epoch shook hands again"
    finally:
        tls.PARKED.clear()  # the tunnels end with the proxy
    assert first >= 2, "the listing's connection and at least one for the GETs"


def test_https_proxy_carries_listing_and_gets_in_connect_tunnels(lab, clean_env):
    server, digests = lab
    config = vhost_config(server)
    with ForwardProxy() as proxy:
        clean_env.setenv("HTTPS_PROXY", proxy.url)
        clean_env.setenv("NO_PROXY", "localhost")
        assert read_all(config) == digests
    authorities = {entry.target for entry in proxy.log}
    assert set(proxy.methods()) == {"CONNECT"}
    assert authorities == {f"{BUCKET}.{DOMAIN}:{server.ports.s3_https}"}, "the bucket's own host"


def test_http_proxy_sees_every_get_and_list_in_absolute_form(lab, clean_env):
    server, digests = lab
    config = vhost_config(server, "http")
    with ForwardProxy() as proxy:
        clean_env.setenv("HTTP_PROXY", proxy.url)
        assert read_all(config) == digests
    targets = [urllib.parse.urlsplit(entry.target) for entry in proxy.log]
    assert all(t.scheme == "http" and t.hostname == f"{BUCKET}.{DOMAIN}" for t in targets)
    gets = [t for t in targets if "list-type=2" not in t.query]
    lists = [t for t in targets if "list-type=2" in t.query]
    assert len(gets) == len(digests) and len(lists) >= 1
    assert {t.path.lstrip("/") for t in gets} == set(digests)
    assert not any("Botocore" in entry.user_agent for entry in proxy.log), "all on the signed path"


@pytest.mark.parametrize("bypass", [DOMAIN, f".{DOMAIN}", "*"])
def test_no_proxy_bypasses_the_proxy(lab, clean_env, bypass):
    server, digests = lab
    with ForwardProxy() as proxy:
        clean_env.setenv("HTTPS_PROXY", proxy.url)
        clean_env.setenv("HTTP_PROXY", proxy.url)
        clean_env.setenv("NO_PROXY", bypass)
        assert read_all(vhost_config(server)) == digests
        assert read_all(vhost_config(server, "http")) == digests
    assert proxy.log == []


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_botocore_takes_the_same_proxy(lab, clean_env, scheme):
    """The reference the signed path follows: botocore's own pipeline (urllib3's rules, aiohttp's
    CONNECT) goes through the same proxy the same way, absolute-form for http, a tunnel for https."""
    server, digests = lab
    config = vhost_config(server, scheme)

    async def main() -> bytes:
        store = await Aioboto3Store.open(config, max_connections=2, retry=QUICK, direct_gets=False)
        try:
            return await store.get(BUCKET, "train/000000.jpg")
        finally:
            await store.aclose()

    with ForwardProxy() as proxy:
        clean_env.setenv("HTTP_PROXY", proxy.url)
        clean_env.setenv("HTTPS_PROXY", proxy.url)
        data = asyncio.run(main())
    assert hashlib.sha256(data).hexdigest() == digests["train/000000.jpg"]
    if scheme == "http":
        assert [entry.method for entry in proxy.log] == ["GET"] and "Botocore" in proxy.log[0].user_agent
    else:
        assert [(entry.method, entry.target) for entry in proxy.log] == [
            ("CONNECT", f"{BUCKET}.{DOMAIN}:{server.ports.s3_https}")]


def test_a_region_redirect_is_named_once_and_botocore_reads_the_rest(lab, clean_env):
    """S3's 301 with ``x-amz-bucket-region``: the signed path says so once, by name, and the
    bucket's requests go through botocore's pipeline from then on, every byte still exact."""
    server, digests = lab
    config = vhost_config(server, "http")
    with ForwardProxy(redirect_once="eu-west-1") as proxy, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        clean_env.setenv("HTTP_PROXY", proxy.url)
        assert read_all(config) == digests
    named = [w for w in said if issubclass(w.category, FallbackWarning)]
    assert len(named) == 1, [str(w.message) for w in said]
    assert "region redirect" in str(named[0].message) and "eu-west-1" in str(named[0].message)
    gets = [entry for entry in proxy.log if "list-type=2" not in entry.target]
    botocore_gets = [entry for entry in gets if "Botocore" in entry.user_agent]
    assert len(botocore_gets) == len(digests), "after the redirect, every GET through botocore"


def test_obstore_takes_the_proxy_and_no_proxy_as_botocore_does(lab, clean_env):
    """obstore's own client (reqwest) reads the same variables: GETs and LISTs through the proxy,
    none with ``NO_PROXY`` naming the host (path-style at 127.0.0.1: its resolver is its own)."""
    server, digests = lab
    config = S3Config(endpoint_url=server.http_endpoint_url, region=server.config.region,
                      access_key_id=server.config.access_key_id,
                      secret_access_key=server.config.secret_access_key)
    with ForwardProxy() as proxy:
        clean_env.setenv("HTTP_PROXY", proxy.url)
        assert read_all(config, "obstore") == digests
        through = list(proxy.log)
        clean_env.setenv("NO_PROXY", "127.0.0.1")
        assert read_all(config, "obstore") == digests
    gets = [entry for entry in through if "list-type=2" not in entry.target]
    assert len(gets) == len(digests) and all("object_store" in entry.user_agent for entry in gets)
    assert any("list-type=2" in entry.target for entry in through), "the listing went through it too"
    assert proxy.log == through, "nothing through the proxy with NO_PROXY naming the host"
