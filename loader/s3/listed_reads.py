"""Whole reads held to the size their listing gave, whatever the transport.

The narrow store protocol carries no size, and the fast paths report no ETag (obstore's one
await per GET), so the check sits with the caller, which knows the listing: a body of the listed
size passes as it is; one of another size is read again with its ETag reported (a ``Pin`` that
asks for nothing), and ``answer_checks.check_listed`` tells a version written since the listing
(read as it now is, by policy) from a wrong answer (``BadAnswerError``, tried a few times).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..retry import RetryPolicy, call_with_retries
from .answer_checks import check_listed
from .protocol import Pin


async def reread_listed(store: Any, bucket: str, key: str, size: int, etag: str | None,
                        policy: RetryPolicy,
                        on_retry: Callable[[BaseException], None] | None = None) -> bytes:
    """The object ``key`` whose whole read came back at a length other than the listed ``size``:
    read again, with retries, and held to the listing (``check_listed``)."""

    async def attempt() -> bytes:
        answered = Pin()  # pins nothing: learns the answer's ETag
        data = await store.get(bucket, key, pin=answered)
        check_listed(len(data), answered.etag, size, etag, bucket, key)
        return data

    return await call_with_retries(attempt, policy, on_retry=on_retry)
