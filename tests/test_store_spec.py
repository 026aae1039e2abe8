"""``StoreSpec``: the one place that tells a ``store=`` factory from a backend name."""

from __future__ import annotations

import functools

import pytest

from loader import ConfigError, S3Config
from loader.retry import RetryPolicy
from loader.s3 import StoreSpec, open_store

CONFIG = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")


async def my_factory():
    raise AssertionError("never opened here")


def test_a_callable_is_a_factory_used_as_it_is():
    spec = StoreSpec.of(my_factory, CONFIG)
    assert spec.factory is my_factory and spec.backend is None and spec.store is my_factory
    assert spec.config is CONFIG  # kept as given: the factory decides what to do with it
    assert spec.opener(max_connections=4, retry=RetryPolicy(), backend="aioboto3") is my_factory
    assert spec.identity == f"factory:{__name__}.my_factory"


def test_a_name_is_resolved_now_with_its_config(monkeypatch):
    monkeypatch.delenv("LOADER_STORE", raising=False)
    assert StoreSpec.of(None, CONFIG) == StoreSpec(backend="aioboto3", config=CONFIG)
    monkeypatch.setenv("LOADER_STORE", "obstore")
    spec = StoreSpec.of(None, CONFIG)
    assert spec.backend == "obstore" and spec.store == "obstore"
    retry = RetryPolicy()
    opener = spec.opener(max_connections=4, retry=retry)
    assert isinstance(opener, functools.partial) and opener.func is open_store
    assert opener.args == ("obstore", CONFIG) and opener.keywords == {"max_connections": 4, "retry": retry}
    assert spec.opener(max_connections=4, retry=retry, backend="aioboto3").args == ("aioboto3", CONFIG)
    assert spec.identity == "http://127.0.0.1:9"


def test_an_unknown_name_fails_before_any_io_naming_the_setting(monkeypatch):
    with pytest.raises(ConfigError, match=r"store='s3fs' is not a known backend"):
        StoreSpec.of("s3fs", CONFIG)
    monkeypatch.setenv("LOADER_STORE", "boto")
    with pytest.raises(ConfigError, match=r"LOADER_STORE='boto' is not a known backend"):
        StoreSpec.of(None, CONFIG)


def test_the_datasets_checkpoints_and_tools_decide_the_same_way():
    from loader import AsyncS3Dataset, checkpoint

    with pytest.raises(ConfigError, match=r"store='s3fs'"):
        AsyncS3Dataset.from_keys("bucket", ["k"], config=CONFIG, store="s3fs")
    with pytest.raises(ConfigError, match=r"store='s3fs'"):
        checkpoint.load("s3://bucket/ckpt.pt", config=CONFIG, store="s3fs")
    ds = AsyncS3Dataset.from_keys("bucket", ["k"], config=CONFIG, store=my_factory)
    assert ds.options.store.backend is my_factory and ds.options.config is CONFIG
