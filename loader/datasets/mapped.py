"""``AsyncS3MapDataset``: a map-style ``Dataset`` whose batches become concurrent GETs.

The sampler decides order; ``__getitems__`` fetches a batch of indices with up to
``Limits(concurrency=)`` GETs in flight and returns the samples in index order. Calls arrive one batch
at a time with no end in sight, so each reading process keeps one loop thread and store open
between calls (created lazily, never pickled, closed by ``close()``, garbage collection or exit,
and disowned in a forked child). Why, and its lifetime: docs/design/map-dataset.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from multiprocessing.context import get_spawning_popen
from typing import Any

import anyio
from torch.utils.data import Dataset

from ..config import S3Config
from ..decode import apply_transform
from ..engine.core import run_all
from ..engine.loopthread import LoopThread
from ..errors import NoSuchKeyError, SampleError, say_skipped
from ..lifecycle import LiveObjects
from ..listing.inputs import read_manifest
from ..listing.keylist import KeyList
from ..listing.snapshots import is_snapshot, saved_snapshot, snapshot_option, snapshot_uri
from ..retry import RetryPolicy, call_with_retries
from ..s3 import ObjectStore, StoreFactory
from ..s3.hedging import TailStore
from ..s3.listed_reads import reread_listed
from ..uri import parse_s3_uri
from .groups import Limits, Store
from .object_samples import LabelFrom, OnError, SampleIndex, get_pinned, listed, skippable
from .object_source import ObjectSource
from .options import Options, Transform, check_map_options, map_options, warn_direct_construction

log = logging.getLogger(__name__)

THREAD_NAME = "loader-map-client"



class AsyncS3MapDataset(Dataset):
    """Random access to S3 samples. Build it with a constructor:

    ``from_prefix("s3://b/train/")``, ``from_keys(bucket, keys)`` or ``from_manifest(path)``.
    Samples are grouped and labelled as in ``AsyncS3Dataset`` (objects sharing a stem form one
    sample, ``label_from="parent"``, ``classes``): index ``i`` is sample ``i``, whose objects
    are fetched concurrently with the rest of the batch.
    ``on_error="skip"`` / ``"warn"`` leaves a sample whose object is gone or whose transform
    raised out of its batch (the batch is shorter); ``dataset[i]`` alone still raises.
    Options are those of ``AsyncS3Dataset`` that concern fetching: ``transform``, ``on_error``,
    ``config``, ``store`` (a ``Store`` or a backend's name) and ``limits=Limits(concurrency=)``
    (GETs in flight per process, default 64). Order and the split across ranks are the
    sampler's business, so ``shuffle``, ``seed``, ``split`` and ``batch_size`` are not taken;
    nor is ``Limits(memory=)``, as there is no queue.
    """

    def __init__(self, source: ObjectSource | None = None, *, options: Options | None = None,
                 **deprecated: Any) -> None:
        """``source`` and ``options`` come from a constructor; ``deprecated``: the keywords that
        described a source (``bucket=``, ``keys=`` or ``prefix=``, ``group=``, ``label_from=``,
        ``labels=``), which still work for one release, with a warning."""
        super().__init__()
        self.options = options or Options()
        check_map_options(self.options)
        if source is None:
            warn_direct_construction("AsyncS3MapDataset", "keys=|prefix=", shards=False)
            from .iterable import source_from_keywords

            described = source_from_keywords(self.options, objects_only=True, **deprecated)
            assert isinstance(described, ObjectSource)  # objects_only: never shards
            source = described
        self.source = source
        self._client: _Client | None = None
        self._closer: weakref.finalize | None = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_prefix(cls, uri: str, *, group: bool = True, label_from: LabelFrom | None = None,
                    snapshot: str | os.PathLike[str] | None = None, transform: Transform | None = None,
                    on_error: OnError = "raise", limits: Limits | None = None,
                    store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                    **deprecated: Any) -> AsyncS3MapDataset:
        """Every object under ``s3://bucket/prefix``, listed once when first needed (hidden
        objects left out; ``snapshot=``: see ``AsyncS3Dataset.from_prefix``)."""
        bucket, prefix = parse_s3_uri(uri)
        options = map_options(transform, on_error, limits, store, config, deprecated)
        return cls(ObjectSource(bucket, options, prefix=prefix, group=group, label_from=label_from,
                                snapshot=snapshot_option(snapshot)), options=options)

    @classmethod
    def from_keys(cls, bucket: str, keys: Iterable[str], *, group: bool = True,
                  label_from: LabelFrom | None = None, transform: Transform | None = None,
                  on_error: OnError = "raise", limits: Limits | None = None,
                  store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                  **deprecated: Any) -> AsyncS3MapDataset:
        """Exactly these keys of ``bucket``; index ``i`` is the ``i``-th stem to appear
        (``keys[i]`` when no two keys share a stem, or with ``group=False``)."""
        if bucket.startswith("s3://"):
            bucket = parse_s3_uri(bucket).bucket
        options = map_options(transform, on_error, limits, store, config, deprecated)
        return cls(ObjectSource(bucket, options, keys=keys, group=group, label_from=label_from),
                   options=options)

    @classmethod
    def from_manifest(cls, path: str, bucket: str | None = None, *, group: bool = True,
                      label_from: LabelFrom | None = None, transform: Transform | None = None,
                      on_error: OnError = "raise", limits: Limits | None = None,
                      store: str | StoreFactory | Store | None = None, config: S3Config | None = None,
                      **deprecated: Any) -> AsyncS3MapDataset:
        """Keys (and labels) from a manifest: plain text, CSV or JSON lines (see
        ``inputs.read_manifest``), or a listing snapshot (read without any LIST)."""
        options = map_options(transform, on_error, limits, store, config, deprecated)
        if is_snapshot(path):
            bucket, prefix = parse_s3_uri(snapshot_uri(path, bucket))
            return cls(ObjectSource(bucket, options, prefix=prefix, group=group, label_from=label_from,
                                    snapshot=saved_snapshot(path)), options=options)
        manifest = read_manifest(path, bucket)
        return cls(ObjectSource(manifest.bucket, options, keys=manifest.keys, group=group,
                                label_from=label_from, labels=manifest.labels), options=options)

    # ----------------------------------------------------------------------- what is read

    @property
    def bucket(self) -> str:
        return self.source.bucket

    def keys(self) -> Sequence[str]:
        """Every object key (the prefix is listed now if not yet)."""
        return self.source.keys()

    def samples(self) -> SampleIndex:
        """Which objects form each sample: index ``i`` is sample ``i``."""
        return self.source.samples()

    @property
    def classes(self) -> list[str] | None:
        """Class names by index when labels come from names (as ``ImageFolder``); else None."""
        return self.source.classes

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        return self.source.class_to_idx

    # ----------------------------------------------------------------------- the Dataset protocol

    def __len__(self) -> int:
        return len(self.samples())

    def __getitem__(self, index: int) -> Any:
        """The sample at ``index``: its objects' GETs (retried), then ``transform``."""
        return self._fetch([index], skip=False)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``, in that order, fetched concurrently (up to ``Limits(concurrency=)``).

        The DataLoader calls this with each batch of sampler indices. An index that appears
        more than once is fetched once and transformed once per appearance. The first failed
        GET (after retries) cancels the rest of the batch and is raised; it names the key.
        With ``on_error`` ``"skip"`` or ``"warn"``, a sample whose object is gone (404) or
        whose transform raised is left out of the returned batch instead.
        """
        return self._fetch(indices, skip=self.options.on_error != "raise")

    def _fetch(self, indices: Sequence[int], *, skip: bool) -> list[Any]:
        index = self.samples()
        wanted = [self._check_index(i, len(index)) for i in indices]
        if not wanted:
            return []
        unique = list(dict.fromkeys(key for i in wanted for key in index.objects(i)))
        etags = listings = None
        if isinstance(index.keys, KeyList) and (index.pinned or index.keys.has_sizes):
            where = {index.keys[p]: p for i in wanted for p in index.positions(i)}
            listings = [listed(index.keys, where[key]) for key in unique]  # what the listing gave
            if index.pinned:  # a snapshot: the versions it recorded
                etags = [index.keys.etag(where[key]) for key in unique]
        bodies = self._client_here().get_many(self.bucket, unique, missing_ok=skip, etags=etags,
                                              listings=listings)
        fetched = dict(zip(unique, bodies))
        out = []
        for i in wanted:
            parts = [fetched[key] for key in index.objects(i)]
            failed = next((part for part in parts if isinstance(part, NoSuchKeyError)), None)
            try:
                if failed is not None:
                    raise failed
                out.append(self._transform(index.sample(self.bucket, i, parts)))
            except (NoSuchKeyError, SampleError) as exc:
                if not skip or not skippable(exc):
                    raise
                self._skip(exc)
        return out

    def _skip(self, exc: Exception) -> None:
        say_skipped(f"skipping a sample (on_error={self.options.on_error!r}): {exc}", self.options.on_error,
                    log, level=logging.INFO, stacklevel=4)

    # ----------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop this process's event loop, close its store and join its thread (idempotent).

        The dataset stays usable: a later access opens a new client.
        """
        with self._lock:
            closer, self._closer, self._client = self._closer, None, None
        if closer is not None:
            closer()  # runs _Client.close once, and no more at GC or exit

    def __enter__(self) -> AsyncS3MapDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled to start a process (a spawned DataLoader worker, most often): list here, once,
        # rather than in every worker; other pickling lists nothing. The client (a thread, a
        # loop, open connections) belongs to this process alone.
        if get_spawning_popen() is not None:
            self.samples()
        state = self.__dict__.copy()
        for name in ("_client", "_closer", "_lock"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = None
        self._closer = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"AsyncS3MapDataset({self.source.describe()}, "
                f"concurrency={self.options.concurrency}, store={self.options.store.backend!r})")

    # ----------------------------------------------------------------------- helpers

    def _client_here(self) -> _Client:
        """This process's client, opened on first use (and again after a fork)."""
        client = self._client
        if client is not None and client.pid == os.getpid() and not client.closed:
            return client
        with self._lock:
            client = self._client
            if client is not None and client.pid != os.getpid():
                _park(client)  # inherited through fork (normally done by the fork hook already)
            elif client is not None and not client.closed:
                return client  # another thread opened it meanwhile
            if self._closer is not None:
                self._closer.detach()  # an inherited or already closed client's
            factory = self.options.store_factory(versions=self.source.versions())
            client = _Client.open(factory, self.options.concurrency, self.options.store.retry)
            self._closer = weakref.finalize(self, client.close)
            self._client = client
            _owners.add(self)
            return client

    @staticmethod
    def _check_index(index: Any, length: int) -> int:
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"AsyncS3MapDataset indices must be integers, not {type(index).__name__} ({index!r})"
            ) from None
        if not 0 <= position < length:
            raise IndexError(
                f"index {position} is out of range for AsyncS3MapDataset of length {length} "
                f"(valid: 0..{length - 1}; negative indices are not supported)"
            )
        return position

    def _transform(self, sample: dict[str, Any]) -> Any:
        return apply_transform(self.options.transform, sample)


class _Client:
    """One process's event-loop thread (a blocking portal) and the store opened inside it.

    Holds no reference to the dataset, so the dataset's ``weakref.finalize`` can close it.
    """

    def __init__(self, loop: LoopThread, retry: RetryPolicy) -> None:
        self.pid = os.getpid()
        self.loop = loop
        self.portal = loop.portal
        self.retry = retry
        self.store: TailStore | None = None
        self.limiter: anyio.Semaphore | None = None  # shared by concurrent calls from any thread
        self.watcher: Future[None] | None = None  # the store's hedging watcher (s3/hedging.py)
        self.closed = False

    @classmethod
    def open(cls, factory: StoreFactory, max_inflight: int, retry: RetryPolicy) -> _Client:
        client = cls(LoopThread.start(THREAD_NAME), retry)
        try:
            client.store, client.limiter = client.portal.call(_open_in_loop, factory, max_inflight)
            client.watcher = client.portal.start_task_soon(client.store.watch)  # hedges straggling reads
        except BaseException:
            client.closed = True
            client.loop.stop()
            raise
        return client

    def get_many(self, bucket: str, keys: list[str], *, missing_ok: bool = False,
                 etags: list[str | None] | None = None,
                 listings: list[tuple[int | None, str | None]] | None = None) -> list[Any]:
        """The objects ``keys`` of ``bucket``, in order; runs in the loop, waits here.

        ``missing_ok``: an object that is gone (404) gives its ``NoSuchKeyError`` in its place
        instead of failing the batch. ``etags``: the versions to get (a snapshot's, one per key).
        ``listings``: the size and ETag the listing gave each key, which each body is held to."""
        future = self.portal.start_task_soon(self._get_many, bucket, keys, missing_ok, etags, listings)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: do not leave the batch running
            raise

    async def _get_many(self, bucket: str, keys: list[str], missing_ok: bool,
                        etags: list[str | None] | None = None,
                        listings: list[tuple[int | None, str | None]] | None = None) -> list[Any]:
        out: list[Any] = [None] * len(keys)
        store, limiter = self.store, self.limiter
        assert store is not None and limiter is not None  # open() set both

        async def get(slot: int, key: str) -> None:
            try:
                size, etag = listings[slot] if listings else (None, None)
                async with limiter:
                    get = (functools.partial(get_pinned, store, bucket, key, etags[slot], size) if etags
                           else functools.partial(store.get, bucket, key))
                    out[slot] = await call_with_retries(get, self.retry)
                    if not etags and size is not None and len(out[slot]) != size:
                        out[slot] = await reread_listed(store, bucket, key, size, etag, self.retry)
            except NoSuchKeyError as exc:
                if not missing_ok:
                    raise
                out[slot] = exc

        await run_all(functools.partial(get, slot, key) for slot, key in enumerate(keys))
        return out

    def close(self) -> None:
        """Close the store in the loop, stop the loop, join the thread (idempotent).

        In a forked child this client's thread does not exist: it is parked, never touched.
        """
        if self.closed:
            return
        if self.pid != os.getpid():
            _park(self)
            return
        if threading.current_thread() is self.loop.thread:
            # Garbage collection can run a finalizer on any thread, this loop's included; a
            # thread cannot join itself, so another one does the closing.
            threading.Thread(target=self.close, name=f"{THREAD_NAME}-closer", daemon=True).start()
            return
        self.closed = True
        try:
            with contextlib.suppress(RuntimeError):  # the loop is already gone
                if self.watcher is not None:
                    self.watcher.cancel()
                if self.store is not None:
                    self.portal.call(_close_in_loop, self.store)
        finally:
            self.loop.stop()


async def _open_in_loop(factory: StoreFactory, max_inflight: int) -> tuple[TailStore, anyio.Semaphore]:
    # the engine's tail handling (hedged stragglers, fewer requests under SlowDown) here too
    return TailStore(await factory(), max_requests=max_inflight), anyio.Semaphore(max_inflight)


async def _close_in_loop(store: ObjectStore) -> None:
    with anyio.CancelScope(shield=True):
        await store.aclose()


# --------------------------------------------------------------------- process-wide hygiene

_orphans: list[_Client] = []


def _park(client: _Client) -> None:
    """Disown an inherited client for good: never call into it (its loop thread is the
    parent's, so a call would wait forever) and keep it referenced, so that its store's
    half-owned connections are not garbage-collected here with "unclosed" complaints."""
    client.closed = True
    _orphans.append(client)


def _disown(dataset: AsyncS3MapDataset) -> None:
    """In a forked child: disown the client whose loop thread stayed behind in the parent.

    Its finalizer is detached and its parts parked in ``_orphans``, so that neither garbage
    collection nor exit ever tries to stop a loop that does not run here. The lock is replaced
    too: one held by another parent thread at the fork would never be released.
    """
    if dataset._closer is not None:
        dataset._closer.detach()
    if dataset._client is not None:
        _park(dataset._client)
    dataset._client = dataset._closer = None
    dataset._lock = threading.Lock()


_owners: LiveObjects[AsyncS3MapDataset] = LiveObjects(in_child=_disown)


def live_clients() -> int:
    """How many datasets of this process hold an open client (for tests and leak checks)."""
    return sum(1 for dataset in _owners
               if dataset._client is not None and not dataset._client.closed)
