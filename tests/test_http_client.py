"""The standard-library lister: which configs it serves (its signatures: tests/test_signing.py)."""

from __future__ import annotations

import pytest

from loader import S3Config
from loader.s3.http_client import HttpLister, usable


def test_it_serves_path_style_endpoints_with_keys_only():
    keys = {"access_key_id": "a", "secret_access_key": "b"}
    assert usable(S3Config(endpoint_url="http://127.0.0.1:9000", **keys))
    assert not usable(S3Config(endpoint_url="http://127.0.0.1:9000"))
    assert not usable(S3Config(**keys))  # AWS itself: virtual-hosted, through aioboto3
    with pytest.raises(ValueError, match="path-style custom endpoint"):
        HttpLister(S3Config())
