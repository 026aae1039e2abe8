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
DEFAULT_PAGE_SIZE = 1000  # S3's largest page (max-keys)


class ObjectInfo(NamedTuple):
    """One listed object: its key and its size in bytes."""

    key: str
    size: int


class ListPage(NamedTuple):
    """One page of a listing: its objects, its common prefixes (only with a delimiter: the
    "folders", each ending in the delimiter) and ``token``, which resumes the listing right
    after this page (``None``: this was the last page)."""

    objects: list[ObjectInfo]
    prefixes: list[str]
    token: str | None


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


@runtime_checkable
class PagedLister(Protocol):
    """Listings that can be resumed page by page (both backends; see ``loader.stores.listing``).

    A separate protocol because ``ObjectStore.list`` is all that most callers need; wrappers
    and test stores without it are listed whole, retried from the start.
    """

    def list_pages(
        self,
        bucket: str,
        prefix: str = "",
        *,
        token: str | None = None,
        delimiter: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[ListPage]:
        """The listing's pages from ``token`` on (``None``: from the start), at most
        ``page_size`` objects each. When it fails, calling it again with the last page's token
        resumes after that page: nothing is listed twice. With ``delimiter="/"`` the prefix
        must be ``""`` or end in ``/``; keys below a further ``/`` come back as ``prefixes``."""
        ...


S3_MIN_PART_SIZE = 5 << 20
"""S3's smallest part (every part but the last); a backend may accept less (``min_part_size``)."""
S3_MAX_PART_SIZE = 5 << 30
S3_MAX_PARTS = 10_000


@runtime_checkable
class MultipartStore(Protocol):
    """Multipart uploads, for objects written as a stream of parts (``loader.checkpoint``).

    A separate protocol because only writers need it: a backend offers it next to
    ``ObjectStore`` (``Aioboto3Store`` does; ``FakeStore`` does in tests), and callers check
    ``isinstance(store, MultipartStore)`` before using it. The rules of ``ObjectStore`` hold here
    too (one request per call, errors translated into ``loader.errors`` naming the object).
    Besides:

    * parts are numbered from 1 and, in S3, every part but the last must hold at least
      ``S3_MIN_PART_SIZE`` bytes; a backend that accepts smaller parts (a test fake) says so with
      an integer attribute ``min_part_size``, and callers read it with that default;
    * an upload that is neither completed nor aborted keeps its parts, invisibly and billed, until
      a bucket lifecycle rule removes them: whoever creates one aborts it on every failure path;
    * ``abort_multipart`` is idempotent: an upload that no longer exists is not an error;
    * ``complete_multipart`` takes ``(part_number, etag)`` pairs in ascending part order.
    """

    async def create_multipart(self, bucket: str, key: str) -> str:
        """Start an upload of ``key``; return its upload id."""
        ...

    async def upload_part(
        self, bucket: str, key: str, upload_id: str, part_number: int, data: bytes | bytearray
    ) -> str:
        """Upload one part (``part_number`` from 1); return its ETag."""
        ...

    async def complete_multipart(
        self, bucket: str, key: str, upload_id: str, parts: list[tuple[int, str]]
    ) -> None:
        """Join the parts into the object ``key`` (which appears only now, atomically)."""
        ...

    async def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        """Discard the upload and every part of it (no error if it is already gone)."""
        ...

    async def list_multipart_uploads(self, bucket: str, prefix: str = "") -> list[tuple[str, str]]:
        """``(key, upload_id)`` of every upload under ``prefix`` neither completed nor aborted."""
        ...
