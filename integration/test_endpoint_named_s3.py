"""A transient fault that is not an error answer (a connection cut, a body cut short) names the
endpoint it met once the retries give up, as an error answer does (``... at http://host:port; gave
up ...``): with several endpoints, or a proxy in front, the bucket and key alone do not say which.
Both backends, object reads and listings, through the fault proxy in front of the real server."""

from __future__ import annotations

import dataclasses
import re

import pytest

from loader import AsyncS3Dataset, EndpointUnreachableError, RetryPolicy, Store, TransientStoreError

from datasets import upload_objects
from faults import FaultPlan, FaultProxy
from s3servers import fault_proxy

pytestmark = pytest.mark.timeout(120)

RETRY = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01, read_timeout=5)


@pytest.fixture(scope="module")
def objects(s3_server):
    bucket = s3_server.new_bucket()
    upload_objects(s3_server.minio, bucket, {f"named/{i}.bin": bytes([i]) * 50_000 for i in range(3)})
    return bucket


def gave_up_naming(proxy: FaultProxy, error: BaseException) -> str:
    """The final error's message, checked to be a transient fault's that names the proxy's endpoint."""
    message = str(error)
    assert isinstance(error, TransientStoreError), f"{type(error).__name__}: {message}"
    assert not isinstance(error, EndpointUnreachableError), message  # it connected: not a refusal
    assert re.search(rf" at {re.escape(proxy.endpoint_url)}; gave up after \d+ attempt\(s\)", message), message
    return message


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
@pytest.mark.parametrize("fault", ["reset", "truncate"])
def test_an_object_read_cut_short_names_its_endpoint_when_retries_give_up(s3_server, objects, store, fault):
    with fault_proxy(s3_server, FaultPlan(**{fault: 1.0})) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_keys(objects, ["named/0.bin"], config=config,
                                           store=Store(backend=store, retry=RETRY))
        with pytest.raises(TransientStoreError) as info:
            next(iter(dataset))
        injected = proxy.counts[fault]
    message = gave_up_naming(proxy, info.value)
    assert "named/0.bin" in message, message
    assert injected >= 2  # the first attempt and its retry each met the fault


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_a_listing_cut_short_names_its_endpoint_when_retries_give_up(s3_server, objects, store):
    plan = FaultPlan(reset=1.0, objects_only=False)  # the LIST requests too
    with fault_proxy(s3_server, plan) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_prefix(f"s3://{objects}/named/", config=config,
                                             store=Store(backend=store, retry=RETRY))
        with pytest.raises(TransientStoreError) as info:
            dataset.resolve()
        injected = proxy.counts["reset"]
    message = gave_up_naming(proxy, info.value)
    assert f"s3://{objects}/named/" in message, message
    assert injected >= 2
