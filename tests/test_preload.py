"""Building a dataset imports its backend in that process, so forked workers inherit it; one
that lists imports it while its listing runs."""

from __future__ import annotations

import sys

import pytest

import loader.s3
from loader import AsyncS3Dataset, ConfigError, S3Config

# what every probe imports first; each case runs in a child forked from a fresh interpreter
# that ran only this, so what a case finds imported comes from what the case itself did
_SETUP = "import sys\nfrom loader import AsyncS3Dataset, S3Config\n"

_PROBE = """
config = S3Config(endpoint_url={endpoint!r} or None, access_key_id="a", secret_access_key="b")
before = {{name for name in ("aiohttp", "loader.s3.aioboto3_store", "loader.s3.obstore_store")
          if name in sys.modules}}
AsyncS3Dataset.from_keys("b", ["k"], config=config, store={store!r})
after = {{name for name in ("aiohttp", "loader.s3.aioboto3_store", "loader.s3.obstore_store")
         if name in sys.modules}}
print(sorted(before), sorted(after))
"""

_LISTED_PROBE = """
from loader.listing.keylist import KeyList
from loader.listing.snapshots import save_snapshot
path, uri = {path!r}, "s3://bkt/train/"
save_snapshot(KeyList.from_keys(["train/a.jpg", "train/b.jpg"], [1, 2]), path, uri)
config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
backend = "loader.s3." + {store!r} + "_store"
if {kind!r} == "objects":
    dataset = AsyncS3Dataset.from_prefix(uri, snapshot=path, config=config, store={store!r})
else:  # shards named, not listed: nothing to import beside
    dataset = AsyncS3Dataset.from_shards(["s3://bkt/t/a-0.tar"], sample_counts={{"s3://bkt/t/a-0.tar": 2}},
                                         config=config, store={store!r})
built = backend in sys.modules
count = len(dataset)
print(built, count, backend in sys.modules)
"""

STORES = ("aioboto3", "obstore")
ENDPOINTS = ("http://127.0.0.1:9", "")  # a lab endpoint, and AWS itself


@pytest.fixture(scope="module")
def probed(forked_probes, tmp_path_factory) -> dict[str, str]:
    """Every probe of this module, each in its own forked child: its stdout by case."""
    folder = tmp_path_factory.mktemp("snapshots")
    cases = {f"built-{store}-{endpoint}": _PROBE.format(store=store, endpoint=endpoint)
             for store in STORES for endpoint in ENDPOINTS}
    cases |= {f"listed-{store}-{kind}": _LISTED_PROBE.format(store=store, kind=kind,
                                                             path=str(folder / f"{store}-{kind}"))
              for store in STORES for kind in ("objects", "shards")}
    results = forked_probes(_SETUP, cases, timeout=120)
    return {name: out.strip() if code == 0 else f"exit {code}: {err[-3000:]}"
            for name, (code, out, err) in results.items()}


def test_building_a_dataset_imports_its_backend_and_aiohttp_before_any_fork(probed):
    # every endpoint goes through the signed transport, which needs nothing of aiohttp's
    assert probed["built-aioboto3-http://127.0.0.1:9"] == "[] ['loader.s3.aioboto3_store']"
    assert probed["built-aioboto3-"] == "[] ['loader.s3.aioboto3_store']", "AWS itself too"
    # obstore datasets list with the standard library's HTTP client: nothing of aiohttp's or
    # aioboto3's, in the parent or in a forked worker, whatever the endpoint
    assert probed["built-obstore-http://127.0.0.1:9"] == "[] ['loader.s3.obstore_store']"
    assert probed["built-obstore-"] == "[] ['loader.s3.obstore_store']"


@pytest.mark.parametrize("kind", ["objects", "shards"])
@pytest.mark.parametrize("store", STORES)
def test_a_dataset_that_lists_imports_its_backend_when_it_lists_not_at_construction(store, kind, probed):
    """(Where it lists, the import runs while the pages arrive: ``run_async``'s ``meanwhile``;
    here the keys come from a snapshot, or the shards are named, and the backend is imported
    all the same.)"""
    assert probed[f"listed-{store}-{kind}"].split() == ["False", "2", "True"]


def test_a_listing_runs_while_the_calling_thread_works_and_an_error_there_stops_it():
    import threading

    from loader.s3.blocking import run_async

    started, stopped = threading.Event(), threading.Event()

    async def listing() -> str:
        import anyio

        started.set()
        try:
            await anyio.sleep(30)
        finally:
            stopped.set()
        return "keys"

    async def quick() -> str:
        return "keys"

    assert run_async(quick, meanwhile=lambda: started.wait(0)) == "keys"

    def fails() -> None:
        assert started.wait(10), "the listing runs while the calling thread works"
        raise RuntimeError("import failed")

    with pytest.raises(RuntimeError, match="import failed"):
        run_async(listing, meanwhile=fails)
    assert stopped.is_set(), "the listing was cancelled"


def test_obstore_without_its_extra_fails_at_construction_with_advice(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # "not installed": its import raises
    monkeypatch.delitem(sys.modules, "loader.s3.obstore_store", raising=False)
    # ``from . import obstore_store`` finds an attribute the package got at an earlier import
    monkeypatch.delattr(loader.s3, "obstore_store", raising=False)
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    for build in (lambda: AsyncS3Dataset.from_keys("b", ["k"], config=config, store="obstore"),
                  lambda: AsyncS3Dataset.from_prefix("s3://bkt/p/", config=config, store="obstore")):
        with pytest.raises(ConfigError, match=r"store='obstore' needs the optional extra: "
                                              r"pip install 's3stream-loader\[obstore\]'"):
            build()


def test_first_error_is_the_first_leaf_that_is_not_a_cancellation_and_makes_no_cycle():
    """The engine's fatal error comes through ``first_error``: a recursive inner function there
    was a cycle (the function in its own closure) that held the leaves, and through their
    tracebacks every frame they passed, until a garbage collection."""
    import gc

    import anyio

    from loader.s3.blocking import first_error

    if sys.version_info >= (3, 11):
        from builtins import BaseExceptionGroup, ExceptionGroup
    else:  # anyio's dependency there
        from exceptiongroup import BaseExceptionGroup, ExceptionGroup

    async def check() -> None:  # first_error asks anyio for the running loop's cancellation class
        cancelled = anyio.get_cancelled_exc_class()
        first, second = ValueError("first"), KeyError("second")
        group = BaseExceptionGroup("outer", [
            BaseExceptionGroup("inner", [cancelled(), ExceptionGroup("deep", [first])]), second])
        assert first_error(group) is first
        assert type(first_error(BaseExceptionGroup("only", [cancelled()]))) is cancelled
        assert first_error(second) is second
        gc.collect()
        gc.disable()
        try:
            first_error(group)
            assert gc.collect() == 0, "first_error left a reference cycle behind"
        finally:
            gc.enable()

    anyio.run(check)


def test_an_error_through_run_async_frees_its_callers_frames_once_caught():
    """An error a one-shot loop raised reaches the caller through anyio's portal, whose frame
    holds the future the error was set on, inside the error's own traceback: a cycle. Caught and
    dropped, it must not keep the frames above it (their locals: a DataLoader iterator, a
    listing's pages) until a garbage collection."""
    import gc
    import weakref

    from loader.errors import NoSuchKeyError
    from loader.s3.blocking import run_async

    class Held:
        pass

    async def missing() -> None:
        raise NoSuchKeyError("no object 'index.json' in bucket 'b'")

    def caller() -> weakref.ref:
        held = Held()  # a local of a frame the error passed through
        try:
            run_async(missing)
        except NoSuchKeyError:
            pass
        return weakref.ref(held)

    gc.disable()
    try:
        assert caller()() is None, "the caller's frame outlived the call"
    finally:
        gc.enable()
