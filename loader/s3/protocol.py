"""The one boundary between the loader and an object store: the ``ObjectStore`` protocol.

Everything above it is backend-agnostic; everything below it is I/O. A backend is created and
closed inside the event loop that uses it (never shared across threads or processes); it
translates its library's errors into ``loader.errors`` in one place (``from exc``); it reads
every body to the end or closes it in ``finally`` (``stream()``: use ``contextlib.aclosing``);
it sends one request per ``get`` and raises ``TransientStoreError`` for a short body. Ranges
are half-open, ``[start, end)``. One version per read: every request of a read passes the same
``Pin``, sent as ``If-Match``; another ETag, or a 412, is ``ObjectChangedError``. What only a
wrapper needs (the cache's expected versions) is given to that wrapper, never to every read.
The rules in full: docs/design/stores.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import NamedTuple, Protocol, runtime_checkable

from .error_answers import changed_during_read

DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_PAGE_SIZE = 1000  # S3's largest page (max-keys)


class ObjectInfo(NamedTuple):
    """One listed object: its key, its size in bytes and, when the server sent one, its ETag
    (``normalize_etag``'s form: no quotes)."""

    key: str
    size: int
    etag: str | None = None


def normalize_etag(raw: str | None) -> str | None:
    """An ETag as compared here: without the quotes and the weak-validator ``W/`` prefix.

    Servers and clients disagree on quoting (botocore keeps the quotes, some listings drop them),
    and the same version must compare equal whichever path reported it.
    """
    if not raw:
        return None
    tag = raw.strip()
    tag = tag.removeprefix("W/")
    return tag.strip('"') or None


class Pin:
    """The version of one object that a read spanning several requests is pinned to.

    Create one per read (one shard, one checkpoint load; a resumed stream keeps its read's
    pin) and pass it to every request of that read; ``etag`` may start as a version the caller
    already knows. Not thread-safe, like the stores: one event loop uses it.
    """

    __slots__ = ("etag",)

    def __init__(self, etag: str | None = None) -> None:
        self.etag = normalize_etag(etag)

    def if_match(self) -> str | None:
        """The ``If-Match`` header value for the next request, or None while nothing is pinned."""
        return None if self.etag is None else f'"{self.etag}"'

    def observe(self, etag: str | None, bucket: str, key: str) -> None:
        """A response of this read came with ``etag``: pin it if it is the first, else check it.

        Raises ``ObjectChangedError`` (naming the object) when it differs from the pinned one.
        """
        tag = normalize_etag(etag)
        if tag is None:
            return  # a server without ETags: nothing to compare
        if self.etag is None:
            self.etag = tag
        elif tag != self.etag:
            raise changed_during_read(bucket, key, f"its ETag went from {self.etag} to {tag}")

    def __repr__(self) -> str:
        return f"Pin({self.etag!r})"


class ListPage(NamedTuple):
    """One page of a listing: its objects, its common prefixes (only with a delimiter: the
    "folders", each ending in the delimiter) and ``token``, which resumes the listing right
    after this page (``None``: this was the last page)."""

    objects: list[ObjectInfo]
    prefixes: list[str]
    token: str | None


@runtime_checkable
class ObjectStore(Protocol):
    """Async access to one S3-compatible service (the rules: the module docstring, docs/design/stores.md)."""

    def list(self, bucket: str, prefix: str = "") -> AsyncGenerator[ObjectInfo, None]:
        """Every object under ``prefix``, in key order, page by page."""
        ...

    async def get(self, bucket: str, key: str, *, pin: Pin | None = None) -> bytes:
        """The whole object, with one GET (``pin``: one version per read, see ``Pin``)."""
        ...

    async def get_range(
        self, bucket: str, key: str, start: int, end: int | None, *, pin: Pin | None = None
    ) -> bytes:
        """Bytes ``[start, end)`` of the object with one ranged GET."""
        ...

    def stream(
        self, bucket: str, key: str, start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
        pin: Pin | None = None, end: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The object from byte ``start`` on (to byte ``end``, exclusive, where given: a reader
        that stops early asks for no more than it reads), as chunks of at most ``chunk_size`` bytes."""
        ...

    async def get_if_changed(
        self, bucket: str, key: str, etag: str, start: int = 0, end: int | None = None, *,
        pin: Pin | None = None,
    ) -> bytes | None:
        """One conditional GET (``If-None-Match: etag``) of bytes ``[start, end)``: None when
        the object is still version ``etag`` (304 Not Modified, no body), else those bytes of
        the current version, whose ETag ``pin`` records."""
        ...

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        """Write ``data`` as the object ``key`` (whole-object PUT)."""
        ...

    async def aclose(self) -> None:
        """Release every connection; the store is unusable afterwards."""
        ...


@runtime_checkable
class PagedLister(Protocol):
    """Listings that can be resumed page by page and started after a key (both backends; see
    ``loader.listing.keylist``).

    A separate protocol because ``ObjectStore.list`` is all that most callers need; wrappers
    and test stores without it are listed whole, retried from the start.
    """

    def list_pages(
        self,
        bucket: str,
        prefix: str = "",
        *,
        token: str | None = None,
        start_after: str | None = None,
        delimiter: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncGenerator[ListPage, None]:
        """The listing's pages from ``token`` on (``None``: from the start), at most
        ``page_size`` objects each. When it fails, calling it again with the last page's token
        resumes after that page: nothing is listed twice. ``start_after`` (S3's ``StartAfter``,
        any string, used only without a token) starts the listing after that key in the
        server's own order. With ``delimiter="/"`` the prefix must be ``""`` or end in ``/``;
        keys below a further ``/`` come back as ``prefixes``."""
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


async def objects_of(pages: AsyncGenerator[ListPage, None]) -> AsyncGenerator[ObjectInfo, None]:
    """Every object of a listing's ``pages``, in order: ``list()`` for a store that has
    ``list_pages()``. Stopping early closes the pages (their connection goes back)."""
    async with contextlib.aclosing(pages) as opened:
        async for page in opened:
            for info in page.objects:
                yield info
