"""The aioboto3 backend keeps botocore sessions per process, lent to one store opening at a time."""

from __future__ import annotations

import multiprocessing

from loader import S3Config
from loader.s3 import aioboto3_store
from loader.s3.aioboto3_store import _SESSIONS

A = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="AK", secret_access_key="SK")
B = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="AK", secret_access_key="other")


def test_a_session_is_kept_per_credentials():
    with _SESSIONS.borrow(A) as first:
        pass
    with _SESSIONS.borrow(A) as again:
        assert again is first, "the second opening reuses the loaded session"
    with _SESSIONS.borrow(B) as other:
        assert other is not first, "other credentials, other session"


def test_a_session_already_lent_is_never_waited_for():
    with _SESSIONS.borrow(A) as lent, _SESSIONS.borrow(A) as meanwhile:  # same thread: waiting here would deadlock
        assert meanwhile is not lent
    with _SESSIONS.borrow(A) as after:
        assert after is lent, "the throwaway session did not replace the kept one"


def _child_cache_size(queue) -> None:
    queue.put(len(aioboto3_store._SESSIONS._sessions))
    with aioboto3_store._SESSIONS.borrow(A):  # the lock is free in the child
        queue.put("borrowed")


def test_a_forked_child_starts_with_no_sessions_and_a_free_lock():
    with _SESSIONS.borrow(A):
        pass
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with _SESSIONS.borrow(A):  # held by the parent at the moment of the fork
        child = ctx.Process(target=_child_cache_size, args=(queue,))
        child.start()
        got = [queue.get(timeout=30), queue.get(timeout=30)]
    child.join(timeout=30)
    assert got == [0, "borrowed"] and child.exitcode == 0


def test_static_keys_the_chain_found_are_kept_and_temporary_ones_are_not(monkeypatch):
    """A forked DataLoader worker signs with the keys its parent's chain found: no session, no
    credential chain (whose container provider builds an SSLContext, which can hang after fork)."""
    import asyncio

    from botocore.credentials import Credentials, RefreshableCredentials

    found = S3Config(endpoint_url="http://127.0.0.1:9", profile="found-keys-test")
    monkeypatch.setattr(aioboto3_store, "_FOUND_KEYS", {})
    assert aioboto3_store._found_credentials(found) is None
    temporary = RefreshableCredentials("AK", "SK", "T", expiry_time=None, refresh_using=lambda: {},
                                       method="test")
    assert aioboto3_store._keep_if_static(found, temporary) is None
    assert aioboto3_store._found_credentials(found) is None, "temporary keys are refreshed, not kept"
    assert aioboto3_store._keep_if_static(found, Credentials("AK", "SK", None)) is not None

    def no_session(config):
        raise AssertionError("a session was made for keys already found")

    monkeypatch.setattr(aioboto3_store, "_new_session", no_session)
    monkeypatch.setattr(aioboto3_store, "_SESSIONS", aioboto3_store._SessionCache())

    async def open_and_sign() -> tuple[str, str]:
        store = await aioboto3_store.Aioboto3Store.open(found)
        try:
            assert store._getter is not None
            keys = await store._getter._credentials()
            return keys.access_key, keys.secret_key
        finally:
            await store.aclose()

    assert asyncio.run(open_and_sign()) == ("AK", "SK")
    other = S3Config(endpoint_url="http://127.0.0.1:9", profile="another-profile")
    assert aioboto3_store._found_credentials(other) is None, "kept per profile and environment"
