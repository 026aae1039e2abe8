"""``loader.stores.answers``: one S3 error response, one error class, one wording for all backends."""

from __future__ import annotations

import pytest

from loader.errors import (
    AccessDeniedError,
    EndpointUnreachableError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    StoreError,
    TransientStoreError,
)
from loader.stores.answers import error_for_answer, failed_mid_request, target, unreachable

END = "http://127.0.0.1:9000"


@pytest.mark.parametrize(("code", "status", "kind"), [
    ("NoSuchBucket", 404, NoSuchBucketError),
    ("NoSuchKey", 404, NoSuchKeyError),
    ("", 404, NoSuchKeyError),
    ("AccessDenied", 403, AccessDeniedError),
    ("", 401, AccessDeniedError),
    ("SignatureDoesNotMatch", 403, AccessDeniedError),
    ("InvalidRange", 416, InvalidRangeError),
    ("SlowDown", 503, TransientStoreError),
    ("", 500, TransientStoreError),
    ("", 429, TransientStoreError),
    ("RequestTimeout", 400, TransientStoreError),
    ("MalformedXML", 400, StoreError),
])
def test_each_answer_gets_its_error_class(code, status, kind):
    error = error_for_answer(code, status, bucket="b", key="k/1", endpoint=END)
    assert type(error) is kind
    assert (error.bucket, error.key) == ("b", "k/1")
    assert "b" in str(error) and (kind is NoSuchBucketError or "k/1" in str(error))


def test_messages_give_advice():
    denied = error_for_answer("AccessDenied", 403, bucket="b", key="k", endpoint=END)
    assert "check AWS_ACCESS_KEY_ID" in str(denied) and END in str(denied)
    missing = error_for_answer("NoSuchBucket", 404, bucket="b", key="k", endpoint=END)
    assert "create it or fix the URI" in str(missing)
    other = error_for_answer("", 400, bucket="b", key="k", endpoint=END)
    assert str(other) == "s3://b/k: the server answered 400 (HTTP 400)"


def test_connection_failures_name_the_target_and_are_transient():
    refused = unreachable(END, "b", "p/", listing=True, reason="Connection refused")
    assert isinstance(refused, TransientStoreError) and isinstance(refused, EndpointUnreachableError)
    assert str(refused) == (f"cannot connect to {END} for s3://b/p/ (listing) (Connection refused); "
                            "is the server running and is AWS_ENDPOINT_URL right?")
    cut = failed_mid_request("b", "k", "body ended early")
    assert isinstance(cut, TransientStoreError) and (cut.bucket, cut.key) == ("b", "k")
    assert target("b", "k") == "s3://b/k"
