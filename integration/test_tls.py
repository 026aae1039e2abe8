"""TLS endpoints as AWS users run them: the embedded server on https with a CA made by the test.

A throwaway CA (``trustme``) signs a server certificate for 127.0.0.1; the embedded SeaweedFS
serves https with it (and plain http on another port), and clients trust the CA through
``AWS_CA_BUNDLE``, read from the environment like a user's job would. Both backends, epochs in
the main process, then DataLoader workers forked after them or spawned; and the errors a user
meets when the certificate does not verify or the endpoint is not https at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import trustme
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, S3Config, TLSError
from loader.retry import RetryPolicy
from loader.s3 import open_store
from loader.tools.devserver import DevServer

from datasets import jpeg_dataset
from s3servers import S3_VARS, minio_client, moto_server

BACKENDS = ["aioboto3", "obstore"]
QUICK = RetryPolicy(max_attempts=2, base_delay=0.01, connect_timeout=5, read_timeout=10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA."""
    where = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    paths = {name: where / f"{name}.pem" for name in ("ca", "other", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    other.cert_pem.write_to_path(paths["other"])
    leaf.private_key_pem.write_to_path(paths["key"])
    for index, pem in enumerate(leaf.cert_chain_pems):  # the server's certificate, then its chain
        pem.write_to_path(paths["cert"], append=index > 0)
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def tls_server(pki):
    with DevServer(certfile=pki["cert"], keyfile=pki["key"], cafile=pki["ca"]) as server:
        yield server


@pytest.fixture(scope="module")
def tls_data(tls_server):
    """60 small JPEGs under ``train/`` of a fresh bucket on the https server."""
    bucket = tls_server.create_bucket("tls-data")
    client = minio_client(tls_server.config)
    try:
        keys = jpeg_dataset(client, bucket, "train/", 60, seed=11)
    finally:
        client._http.clear()
    return bucket, {key.rsplit(".", 1)[0] for key in keys}


@pytest.fixture
def tls_env(tls_server, monkeypatch):
    """The environment a user sets for an https endpoint with a private CA."""
    for name in S3_VARS + ("AWS_CA_BUNDLE",):
        monkeypatch.delenv(name, raising=False)
    env = tls_server.config.to_env()
    assert tls_server.config.endpoint_url.startswith("https://") and env["AWS_CA_BUNDLE"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def keys_of(loader) -> list[str]:
    return [sample["__key__"] for batch in loader for sample in batch]


def collate(batch):
    return batch


@pytest.mark.parametrize("store", BACKENDS)
def test_https_epochs_in_the_parent_then_forked_or_spawned_workers(tls_env, tls_data, store):
    bucket, expected = tls_data
    dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", store=store, shuffle=True, seed=3)
    assert dataset.options.config.verify == tls_env["AWS_CA_BUNDLE"]
    for epoch in range(2):  # num_workers=0: the engine runs in this process
        dataset.set_epoch(epoch)
        seen = keys_of(DataLoader(dataset, batch_size=8, collate_fn=collate))
        assert sorted(seen) == sorted(expected)
    # obstore's runtime does not survive fork(): after it ran here, its workers must be spawned
    contexts = ["spawn"] if store == "obstore" else [None, "spawn"]  # None: the platform default
    for epoch, context in enumerate(contexts, start=2):
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context=context,
                            collate_fn=collate, timeout=120)
        seen = keys_of(loader)
        assert len(seen) == len(expected) and set(seen) == expected, (store, context)


FORKED_OBSTORE = """
import json, sys
from torch.utils.data import DataLoader
from loader import AsyncS3Dataset
dataset = AsyncS3Dataset.from_prefix(sys.argv[1], store="obstore")
dataset.set_epoch(0)
loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=lambda b: b, timeout=120)
print(json.dumps([sample["__key__"] for batch in loader for sample in batch]))
"""


def test_obstore_forked_workers_over_https(tls_env, tls_data):
    """obstore in forked workers of a parent that only listed (through aioboto3). In a process
    of its own: this one has used obstore already, and its forks refuse to."""
    bucket, expected = tls_data
    done = subprocess.run([sys.executable, "-c", FORKED_OBSTORE, f"s3://{bucket}/train/"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen) == len(expected) and set(seen) == expected


def read_one(config: S3Config, store: str, bucket: str = "tls-data") -> None:
    async def main() -> None:
        opened = await open_store(store, config, max_connections=2, retry=QUICK)
        try:
            await opened.get(bucket, "train/000000.jpg")
        finally:
            await opened.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("store", BACKENDS)
def test_a_certificate_from_an_untrusted_ca_says_it_did_not_verify(tls_server, tls_data, pki, store):
    config = dataclasses.replace(tls_server.config, verify=pki["other"])
    with pytest.raises(TLSError, match=r"TLS certificate of https://127\.0\.0\.1:\d+ did not "
                                       r"verify \(.*(issuer|not trusted).*\).*AWS_CA_BUNDLE"):
        read_one(config, store)


@pytest.mark.parametrize("store", BACKENDS)
def test_a_certificate_for_another_host_name_says_so(tls_server, tls_data, store):
    port = tls_server.ports.s3_https
    config = dataclasses.replace(tls_server.config, endpoint_url=f"https://localhost:{port}")
    with pytest.raises(TLSError, match=r"did not verify \(.*(name|[Hh]ostname|match).*\)"):
        read_one(config, store)


@pytest.mark.parametrize("store", BACKENDS)
def test_https_to_a_plain_http_server_says_to_use_http(tls_server, tls_data, store):
    plain = tls_server.http_endpoint_url
    config = dataclasses.replace(tls_server.config,
                                 endpoint_url=plain.replace("http://", "https://"))
    with pytest.raises(TLSError, match=rf"speaks plain http, not TLS .*use {plain} "):
        read_one(config, store)


@pytest.mark.parametrize("store", BACKENDS)
def test_a_ca_certificate_served_as_the_server_certificate_is_refused_with_advice(
        pki, tmp_path, store):
    """rustls refuses a CA certificate used as the server's own (botocore's OpenSSL accepts it,
    when it names the host); either way the error must not read like a server that is down."""
    ca = trustme.CA()
    cert, key = tmp_path / "ca-cert.pem", tmp_path / "ca-key.pem"
    ca.cert_pem.write_to_path(cert)
    ca.private_key_pem.write_to_path(key)
    with (DevServer(buckets=["tls-ca"], certfile=cert, keyfile=key, cafile=cert) as server,
          pytest.raises(TLSError, match=r"did not verify .*not the CA certificate itself")):
        read_one(server.config, store, bucket="tls-ca")


@pytest.fixture(scope="module")
def moto_https(pki):
    """moto's S3 server (AWS's semantics) on https with the test CA's certificate, 20 objects."""
    with moto_server(certfile=pki["cert"], keyfile=pki["key"], cafile=pki["ca"]) as server:
        bucket = server.new_bucket("tls")
        keys = jpeg_dataset(server.minio, bucket, "train/", 20, seed=12)
        yield server, bucket, {key.rsplit(".", 1)[0] for key in keys}


@pytest.mark.server_sensitive
@pytest.mark.parametrize("store", BACKENDS)
def test_moto_over_https_reads_every_object_and_refuses_an_untrusted_ca(
        moto_https, pki, monkeypatch, store):
    """The same CA bundle from the environment, against moto's https (werkzeug's TLS, not Go's)."""
    server, bucket, expected = moto_https
    for name in S3_VARS + ("AWS_CA_BUNDLE",):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", store=store)
    assert sorted(keys_of(DataLoader(dataset, batch_size=8, collate_fn=collate))) == sorted(expected)
    config = dataclasses.replace(server.config, verify=pki["other"])
    with pytest.raises(TLSError, match=r"did not verify"):
        read_one(config, store, bucket=bucket)
