"""The standard-library lister: which configs it serves (its signatures: tests/test_signing.py)."""

from __future__ import annotations

import pytest

from loader import S3Config
from loader.s3.http_lister import HttpLister, usable


def test_it_serves_every_endpoint_and_names_what_it_cannot(monkeypatch):
    keys = {"access_key_id": "a", "secret_access_key": "b"}
    assert usable(S3Config(endpoint_url="http://127.0.0.1:9000", **keys))
    assert usable(S3Config(endpoint_url="http://127.0.0.1:9000")), "botocore's chain finds the keys"
    assert usable(S3Config(**keys)), "AWS itself, virtual-hosted"
    assert usable(S3Config(endpoint_url="https://s3.lab.test", addressing_style="virtual", **keys))
    monkeypatch.setenv("AWS_USE_FIPS_ENDPOINT", "true")
    assert not usable(S3Config(**keys))
    with pytest.raises(ValueError, match="FIPS endpoints"):
        HttpLister(S3Config())
