"""The standard-library lister's SigV4 signature matches botocore's, byte for byte."""

from __future__ import annotations

import datetime

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from hypothesis import given
from hypothesis import strategies as st

from loader import S3Config
from loader.s3.http_client import HttpLister, canonical_query, sign_v4, usable

query_values = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@given(st.dictionaries(st.sampled_from(["prefix", "start-after", "continuation-token", "delimiter"]),
                       query_values),
       st.sampled_from(["bucket", "b-1.x"]), st.one_of(st.none(), st.text("abc123/+=", min_size=1)))
def test_signatures_match_botocores(query, bucket, token):
    query = {"list-type": "2", "max-keys": "1000", **query}
    host, path = "127.0.0.1:9000", f"/{bucket}"
    request = AWSRequest(method="GET", url=f"http://{host}{path}?{canonical_query(query)}")
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+x", token), "s3", "eu-west-3").add_auth(request)
    when = datetime.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    ours = sign_v4("GET", host, path, query, access_key="AKIDEXAMPLE", secret_key="secret/key+x",
                   token=token, region="eu-west-3", when=when)
    assert ours["authorization"] == request.headers["Authorization"]


def test_it_serves_path_style_endpoints_with_keys_only():
    keys = {"access_key_id": "a", "secret_access_key": "b"}
    assert usable(S3Config(endpoint_url="http://127.0.0.1:9000", **keys))
    assert not usable(S3Config(endpoint_url="http://127.0.0.1:9000"))
    assert not usable(S3Config(**keys))  # AWS itself: virtual-hosted, through aioboto3
    with pytest.raises(ValueError, match="path-style custom endpoint"):
        HttpLister(S3Config())
