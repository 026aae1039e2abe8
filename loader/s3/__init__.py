"""S3 access: the ``ObjectStore`` protocol (``protocol``), the one mapping of S3 error answers
(``error_answers``), credentials, one module per transport (``aioboto3_store``, ``signed_get``,
``http_lister``, ``obstore_store``), and the backends opened by name here."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import retry as contact
from .._version import install_hint
from ..config import S3Config, resolve_config
from ..errors import ConfigError
from ..retry import RetryPolicy
from .protocol import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ListPage,
    MultipartStore,
    ObjectInfo,
    ObjectStore,
    PagedLister,
    Pin,
    normalize_etag,
)

if TYPE_CHECKING:
    from .http_lister import HttpLister

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_PAGE_SIZE", "BACKENDS", "ListPage", "MultipartStore", "ObjectInfo",
           "ObjectStore", "PagedLister", "Pin", "StoreFactory", "StoreSpec", "normalize_etag",
           "ListingOpener", "check_backend", "open_listing_store", "open_store", "preload_backend", "resolve_backend"]

StoreFactory = Callable[[], Awaitable[ObjectStore]]
BACKENDS = ("aioboto3", "obstore")
STORE_ENV = "LOADER_STORE"


def resolve_backend(name: str | None) -> str:
    """``store=`` wins, then ``$LOADER_STORE``, then the default (aioboto3)."""
    chosen = name or os.environ.get(STORE_ENV) or "aioboto3"
    if chosen not in BACKENDS:
        source = "store" if name else STORE_ENV
        raise ConfigError(f"{source}={chosen!r} is not a known backend; use one of {BACKENDS}")
    return chosen


def preload_backend(backend: str, config: S3Config | None = None) -> None:
    """Import a backend's modules now, in the process that builds the dataset (while a
    dataset's listing runs, if it lists: ``Options.preload_backend``).

    DataLoader workers forked later inherit them rather than import them each (a faster
    worker start), and the SSL contexts aiohttp builds at import time are then built before
    any fork, not in a worker, where OpenSSL could wait forever on a lock that another thread
    of the parent held at the moment of the fork. aiohttp is imported only where no config
    says which endpoint: the signed transport (every endpoint) needs none of it (~90 ms of
    import). An obstore dataset does not import aioboto3 at all (its listing needs none).
    """
    if backend == "obstore":
        _obstore_backend()
    if backend == "aioboto3" or config is None:
        from . import aioboto3_store  # noqa: F401

        if config is None:
            import aiohttp  # noqa: F401


async def open_listing_store(
    config: S3Config, *, max_connections: int, retry: RetryPolicy
) -> ObjectStore:
    """A store to list prefixes with in the process that builds a dataset, whichever backend
    reads the data: ``HttpLister`` (the standard library's HTTP client: nothing to import, nothing
    that a later fork breaks) where it serves, else the aioboto3 backend."""
    from .http_lister import open_lister

    return await open_lister(config, max_connections=max_connections, retry=retry)


class ListingOpener:
    """``open_listing_store`` as a store factory that can also send a listing's first page
    before any event loop runs (``send_first_page``, which ``listing.inputs.list_prefix`` calls
    where a factory offers it): the lister made for that page is what the next call returns."""

    def __init__(self, config: S3Config, *, max_connections: int, retry: RetryPolicy) -> None:
        self.config = config
        self.max_connections = max_connections
        self.retry = retry
        self._ready: HttpLister | None = None

    def send_first_page(self, bucket: str, prefix: str, page_size: int) -> None:
        """Where ``HttpLister`` serves, make it and send the first page's request now."""
        from .http_lister import HttpLister, usable

        if usable(self.config):
            lister = HttpLister(self.config, max_connections=self.max_connections, retry=self.retry)
            lister.send_first_page(bucket, prefix, page_size)
            self._ready = lister

    async def __call__(self) -> ObjectStore:
        ready, self._ready = self._ready, None
        if ready is not None:
            return ready
        return await open_listing_store(self.config, max_connections=self.max_connections, retry=self.retry)

    def discard(self) -> None:
        """Close the lister made for a first page that no listing took (the pass ended or failed
        before it opened its store), and with it that page's connection; else nothing."""
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.close()


async def open_store(
    backend: str, config: S3Config, *, max_connections: int, retry: RetryPolicy
) -> ObjectStore:
    """Create a backend inside the running event loop (never earlier: clients bind to a loop)."""
    if backend == "aioboto3":
        from .aioboto3_store import Aioboto3Store

        return await Aioboto3Store.open(config, max_connections=max_connections, retry=retry)
    if backend == "obstore":
        return await _obstore_backend().ObstoreStore.open(
            config, max_connections=max_connections, retry=retry
        )
    raise ConfigError(f"store={backend!r} is not a known backend; use one of {BACKENDS}")


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """What a ``store=`` argument names, decided in one place (``of``): a user's async
    ``factory``, or a ``backend`` by name with its ``config``. Picklable when the factory is."""

    factory: StoreFactory | None = None
    backend: str | None = None
    config: S3Config | None = None

    @classmethod
    def of(cls, store: str | StoreFactory | None, config: S3Config | None = None) -> StoreSpec:
        """A callable ``store`` is a factory, used as it is; anything else names a backend
        (``resolve_backend``: an unknown name is a ``ConfigError`` now, before any I/O), whose
        ``config`` comes from the environment when not given. A backend whose extra is missing
        is a ``ConfigError`` now too (``check_backend``)."""
        if callable(store):
            return cls(factory=store, config=config)  # the factory decides; config is kept as given
        backend = resolve_backend(store)
        check_backend(backend)
        return cls(backend=backend, config=resolve_config(config))

    @property
    def store(self) -> str | StoreFactory:
        """The ``store=`` value that names the same store again (the factory, or the backend)."""
        chosen = self.factory or self.backend
        assert chosen is not None  # ``of`` sets one of them
        return chosen

    def opener(self, *, max_connections: int, retry: RetryPolicy, backend: str | None = None) -> StoreFactory:
        """How to open the store inside an event loop. ``backend``: open that backend instead of
        the named one (aioboto3, for listings before a fork and for multipart uploads); a user's
        factory is used as it is."""
        if self.factory is not None:
            return self.factory
        chosen = backend or self.backend
        assert chosen is not None and self.config is not None  # ``of`` resolved both
        return functools.partial(open_store, chosen, self.config, max_connections=max_connections,
                                 retry=retry)

    def lister(self, *, max_connections: int, retry: RetryPolicy) -> StoreFactory:
        """How to open a store to list with in the process that builds a dataset: a user's
        factory as it is, else ``open_listing_store`` (never obstore, whose runtime a later fork
        breaks)."""
        if self.factory is not None:
            return self.factory
        assert self.config is not None  # ``of`` resolved it
        return ListingOpener(self.config, max_connections=max_connections, retry=retry)

    def __getstate__(self) -> dict[str, Any]:
        # A dataset's store travels into its DataLoader workers with whether its endpoint has
        # answered here: a spawned worker then rides out an outage of a server the parent
        # listed from, instead of taking it for a wrong endpoint (loader.retry.answered).
        return {**self.__dict__, "answered": contact.has_answered(self.endpoint)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if state.pop("answered", False):
            contact.answered(self._endpoint_of(state.get("config")))
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def endpoint(self) -> str | None:
        """The endpoint as the backends name it in errors (None for a user's factory)."""
        return None if self.factory is not None else self._endpoint_of(self.config)

    @staticmethod
    def _endpoint_of(config: S3Config | None) -> str | None:
        return None if config is None else (config.endpoint_url or "AWS S3")

    @property
    def identity(self) -> str:
        """What tells this service's objects from another's, the same in every process and run
        (the disk cache names its files with it): the endpoint URL (``aws-s3`` when there is
        none), or a factory's qualified name (never its ``repr``: it may hold secrets)."""
        if self.factory is not None:
            factory: Any = self.factory
            while isinstance(factory, functools.partial):
                factory = factory.func
            kind = factory if hasattr(factory, "__qualname__") else type(factory)
            return f"factory:{kind.__module__}.{kind.__qualname__}"
        endpoint = getattr(self.config, "endpoint_url", None)
        return endpoint.rstrip("/") if endpoint else "aws-s3"


def check_backend(backend: str) -> None:
    """Raise now the error that importing ``backend`` later would (an extra not installed),
    without importing it (``preload_backend`` may come later, while a listing runs)."""
    if backend == "obstore" and importlib.util.find_spec("obstore") is None:
        raise _obstore_missing()


def _obstore_backend() -> Any:
    """The obstore backend's module, or advice on installing the extra it needs."""
    try:
        from . import obstore_store
    except ImportError as exc:
        raise _obstore_missing() from exc
    return obstore_store


def _obstore_missing() -> ConfigError:
    return ConfigError(f"store='obstore' needs the optional extra: {install_hint('obstore')}")
