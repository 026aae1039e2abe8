"""The one boundary between the loader and an object store: the ``ObjectStore`` protocol.

Everything above this line is backend-agnostic; everything below it is I/O. A backend:

* is created *inside* the event loop that will use it (by ``FetchEngine``) and closed there with
  ``aclose()``; it never outlives that loop and is never shared across threads or processes;
* translates its library's exceptions into ``loader.errors`` (one place per backend, ``from exc``),
  so callers and the retry policy see the same tree whatever the backend;
* reads every response body to the end, or closes it in ``finally``: a half-read body left
  behind pins a pooled connection, and ``stream()`` is an async generator whose ``aclose()``
  (use ``contextlib.aclosing``) releases the connection even when the caller stops early;
* issues exactly one request per ``get`` (no HEAD first), and raises ``TransientStoreError`` when
  a body ends before its Content-Length, since the HTTP libraries below do not retry that.

Ranges are half-open, ``[start, end)``, like Python slices; ``end=None`` means to the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol, runtime_checkable

DEFAULT_CHUNK_SIZE = 1 << 20


class ObjectInfo(NamedTuple):
    """One listed object: its key and its size in bytes."""

    key: str
    size: int


@runtime_checkable
class ObjectStore(Protocol):
    """Async access to one S3-compatible service (see the module docstring for the rules)."""

    def list(self, bucket: str, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object under ``prefix``, in key order, page by page."""
        ...

    async def get(self, bucket: str, key: str) -> bytes:
        """The whole object, with one GET."""
        ...

    async def get_range(self, bucket: str, key: str, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` of the object with one ranged GET."""
        ...

    def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """The object from byte ``start`` on, as chunks of at most ``chunk_size`` bytes."""
        ...

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        """Write ``data`` as the object ``key`` (whole-object PUT)."""
        ...

    async def aclose(self) -> None:
        """Release every connection; the store is unusable afterwards."""
        ...
