"""``loader.s3.error_answers``: one S3 error response, one error class, one wording for all backends."""

from __future__ import annotations

import pytest

from loader.errors import (
    AccessDeniedError,
    EndpointUnreachableError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from loader.s3.error_answers import error_for_answer, failed_mid_request, target, unreachable

END = "http://127.0.0.1:9000"


@pytest.mark.parametrize(("code", "status", "kind"), [
    ("NoSuchBucket", 404, NoSuchBucketError),
    ("NoSuchKey", 404, NoSuchKeyError),
    ("", 404, NoSuchKeyError),
    ("AccessDenied", 403, AccessDeniedError),
    ("", 401, AccessDeniedError),
    ("SignatureDoesNotMatch", 403, AccessDeniedError),
    ("InvalidRange", 416, InvalidRangeError),
    ("SlowDown", 503, ThrottledError),
    ("", 503, ThrottledError),
    ("Throttling", 400, ThrottledError),
    ("", 500, TransientStoreError),
    ("", 429, ThrottledError),
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


HTTPS = "https://127.0.0.1:9443"
RUSTLS = ("Generic S3 error: Error performing GET https://127.0.0.1:9443/b/k - HTTP error: error "
          "sending request\n\nDebug source:\n HttpError {{\n kind: Connect,\n source: reqwest::Error "
          "{{ Custom {{ kind: InvalidData, error: {} }} }} }}")


@pytest.mark.parametrize(("text", "reason"), [
    ("InvalidCertificate(\n UnknownIssuer,\n )", "signed by a CA that is not trusted"),
    ("InvalidCertificate(\n NotValidForNameContext {\n expected: DnsName(\"x\") } )",
     "not issued for this host name"),
    ("InvalidCertificate(\n Other(\n OtherError(\n CaUsedAsEndEntity,\n ),\n ),\n )",
     "a CA certificate used as the server's own certificate"),
])
def test_obstore_certificate_verdicts_are_worded(text, reason):
    from obstore.exceptions import GenericError

    from loader.errors import TLSError
    from loader.s3.obstore_store import translate_error

    error = translate_error(GenericError(RUSTLS.format(text)), bucket="b", key="k", endpoint=HTTPS)
    assert type(error) is TLSError and not isinstance(error, TransientStoreError)
    assert f"the TLS certificate of {HTTPS} did not verify ({reason})" in str(error)
    assert "AWS_CA_BUNDLE" in str(error)


def test_both_backends_say_an_https_endpoint_speaks_plain_http():
    import ssl

    from botocore.exceptions import SSLError
    from obstore.exceptions import GenericError

    from loader.errors import TLSError
    from loader.s3 import aioboto3_store, obstore_store

    openssl = SSLError(endpoint_url=f"{HTTPS}/b/k",
                       error="[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    rustls = GenericError(RUSTLS.format("InvalidMessage(\n InvalidContentType,\n )"))
    for error in (aioboto3_store.translate_error(openssl, bucket="b", key="k", endpoint=HTTPS),
                  obstore_store.translate_error(rustls, bucket="b", key="k", endpoint=HTTPS)):
        assert type(error) is TLSError
        assert str(error) == (f"{HTTPS} speaks plain http, not TLS (asked for s3://b/k); use "
                              "http://127.0.0.1:9443 as AWS_ENDPOINT_URL, or enable TLS on the server")
    verify = aioboto3_store.translate_error(
        ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
                                        "failed: self-signed certificate (_ssl.c:1006)"),
        bucket="b", key="k", endpoint=HTTPS)
    assert type(verify) is TLSError and "did not verify (self-signed certificate)" in str(verify)


def test_the_aioboto3_backend_words_its_transports_errors_alike():
    """http1's and (where botocore's path imported it) aiohttp's connection errors become the
    same errors of ours: unreachable with the reason, or failed mid-request."""
    import errno

    import aiohttp

    from loader.errors import EndpointUnreachableError, TransientStoreError
    from loader.s3.aioboto3_store import translate_error
    from loader.s3.http1 import ConnectFailed, ResponseBroken

    where = dict(bucket="bkt", key="k", endpoint="http://127.0.0.1:1")
    refused = translate_error(ConnectFailed("Connection refused at 127.0.0.1:1"), **where)
    assert isinstance(refused, EndpointUnreachableError) and "Connection refused at" in str(refused)
    connector = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, False, None, None, None),
        OSError(errno.ECONNREFUSED, "Connection refused"))
    via_aiohttp = translate_error(connector, **where)
    assert isinstance(via_aiohttp, EndpointUnreachableError) and "Connection refused" in str(via_aiohttp)
    for broken in (ResponseBroken("cut"), TimeoutError("stalled"), aiohttp.ServerDisconnectedError()):
        mid = translate_error(broken, **where)
        assert type(mid) is TransientStoreError and "failed mid-request" in str(mid)
    stalled = translate_error(TimeoutError("no byte received for 30 s"), **where)
    assert "failed mid-request (TimeoutError: no byte received for 30 s)" in str(stalled)



def test_a_fault_that_is_no_answer_names_its_endpoint_once_retries_give_up():
    """A cut connection, a stall or a short body met on botocore's path (the one AWS endpoints
    take) is marked with the endpoint, as an error answer is, and ``retry.gave_up`` names it; an
    endpoint already named (a wrapper's) is kept."""
    from botocore.exceptions import ConnectionClosedError, IncompleteReadError, ReadTimeoutError

    from loader.retry import RetryPolicy, gave_up
    from loader.s3.aioboto3_store import translate_error

    where = dict(bucket="bkt", key="k", endpoint=END)
    for fault in (ConnectionClosedError(endpoint_url=END), ReadTimeoutError(endpoint_url=END),
                  IncompleteReadError(actual_bytes=3, expected_bytes=9)):
        error = translate_error(fault, **where)
        assert type(error) is TransientStoreError and error.endpoint == END, (fault, error)
        final = gave_up(error, RetryPolicy(max_attempts=2), 2, 0.5)
        assert f"failed mid-request ({type(fault).__name__}: " in str(final), final
        assert f") at {END}; gave up after 2 attempt(s)" in str(final), final
    named = failed_mid_request("bkt", "k", "cut")
    named.endpoint = "http://elsewhere:1"
    assert translate_error(named, **where).endpoint == "http://elsewhere:1"

def test_the_listing_lister_says_how_long_a_silent_server_was_waited_out():
    """A server that accepts and never answers: the standard-library lister's error says so, as
    the backends' do, not a bare '(TimeoutError)'."""
    import asyncio
    import socket

    from loader.config import S3Config
    from loader.errors import TransientStoreError
    from loader.retry import RetryPolicy
    from loader.s3.http_lister import HttpLister

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel accepts; nobody answers
        config = S3Config(endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                          access_key_id="a", secret_access_key="b")
        lister = HttpLister(config, retry=RetryPolicy(connect_timeout=0.3, read_timeout=0.3))

        async def first_page():
            async for page in lister.list_pages("bkt", "p/"):
                return page

        with pytest.raises(TransientStoreError,
                           match=r"s3://bkt/p/ \(listing\): the connection failed mid-request "
                                 r"\(TimeoutError: no answer within 0.3 s\)"):
            asyncio.run(first_page())
