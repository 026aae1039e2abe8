"""Samples read as the listing's pages arrive (``datasets.streamed``): exactly the samples of the
whole listing, in its order, on servers listing in byte order and directory by directory."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, EmptyDatasetError, StoreError
from loader.datasets.object_samples import build_index, is_hidden
from loader.datasets.streamed import SettledSamples
from loader.listing.keylist import KeyList
from loader.s3.protocol import ObjectInfo

from fakes import FakeStore

PREFIX = "p/"
# Characters around "/" and "." in byte order ("-" < "." < "/" < "0"): stems that are prefixes of
# other keys, folders next to files of the same name, and hidden and marker keys.
NAMES = st.text(alphabet="-./0ab", min_size=1, max_size=7)


def pages_of(keys: set[str], order: str, page_size: int) -> list[list[ObjectInfo]]:
    """The pages a server listing in ``order`` answers for ``keys`` under ``PREFIX``."""
    store = FakeStore.with_objects("b", {key: b"x" for key in keys}, page_size=page_size, order=order)

    async def main() -> list[list[ObjectInfo]]:
        return [page.objects async for page in store.list_pages("b", PREFIX)]

    return anyio.run(main)


def samples(index) -> list[tuple[str, ...]]:
    return [index.objects(i) for i in range(len(index))]


@settings(deadline=None, max_examples=300)
@given(names=st.sets(NAMES, max_size=40), order=st.sampled_from(["bytes", "directories"]),
       page_size=st.integers(1, 9), group=st.booleans())
def test_pieces_are_the_whole_listings_samples_in_order(names, order, page_size, group):
    keys = {PREFIX + name for name in names if "//" not in PREFIX + name}
    settled = SettledSamples(PREFIX, group=group)
    pieces: list[list[ObjectInfo]] = []
    for page in pages_of(keys, order, page_size):
        settled.add(page)
        pieces.append(settled.take())
    settled.finish()
    pieces.append(settled.take())
    read = [info.key for piece in pieces for info in piece]
    visible = sorted(key for key in keys if not key.endswith("/") and not is_hidden(key))
    assert read == visible, "every key once, in key order"
    assert streamed_samples(pieces, group) == whole_samples(visible, group)


def whole_samples(keys: list[str], group: bool) -> list[tuple[str, ...]] | str:
    """The samples of the whole listing, or the error that refuses them."""
    try:
        return samples(build_index(KeyList.from_keys(keys), group=group)) if keys else []
    except ConfigError as exc:
        return str(exc)


def streamed_samples(pieces: list[list[ObjectInfo]], group: bool) -> list[tuple[str, ...]] | str:
    """The samples of the pieces one after the other, or the first piece's error."""
    out: list[tuple[str, ...]] = []
    for piece in pieces:
        if piece:
            try:
                out += samples(build_index(KeyList.from_infos(piece), group=group))
            except ConfigError as exc:
                return str(exc)
    return out


def test_a_flat_listing_is_read_from_its_first_page():
    settled = SettledSamples(PREFIX)
    page = [ObjectInfo(f"{PREFIX}{i:03d}.jpg", 1) for i in range(4)] + [ObjectInfo(f"{PREFIX}004.cls", 1)]
    settled.add(page)
    assert [info.key for info in settled.take()] == [info.key for info in page[:4]], \
        "the last stem may go on in the next page"
    settled.add([ObjectInfo(f"{PREFIX}004.jpg", 1), ObjectInfo(f"{PREFIX}005.jpg", 1)])
    assert [info.key for info in settled.take()] == [f"{PREFIX}004.cls", f"{PREFIX}004.jpg"]


def test_a_folder_waits_until_the_listing_has_passed_it():
    """On a server listing by directory, ``a-b`` may follow ``a/x``: nothing at or after ``a``
    is read before a page shows the listing beyond ``a``."""
    settled = SettledSamples(PREFIX)
    settled.add([ObjectInfo(f"{PREFIX}0.jpg", 1), ObjectInfo(f"{PREFIX}a/x.jpg", 1)])
    assert [info.key for info in settled.take()] == [f"{PREFIX}0.jpg"]
    settled.add([ObjectInfo(f"{PREFIX}a-b.jpg", 1), ObjectInfo(f"{PREFIX}b.jpg", 1)])
    assert [info.key for info in settled.take()] == [f"{PREFIX}a-b.jpg", f"{PREFIX}a/x.jpg"]


def test_a_key_listed_below_what_was_read_is_an_error_naming_it():
    settled = SettledSamples(PREFIX, group=False)
    settled.add([ObjectInfo(f"{PREFIX}b.jpg", 1)])
    settled.take()
    with pytest.raises(StoreError, match="listed 'p/a.jpg' after 'p/b.jpg'"):
        settled.add([ObjectInfo(f"{PREFIX}a.jpg", 1)])


def objects(n: int) -> dict[str, bytes]:
    """``n`` samples under ``train/``: most one ``.jpg``, every fifth with a ``.cls`` beside it,
    a folder named like a sample, and a hidden file."""
    out = {f"train/{i:04d}.jpg": f"jpg{i}".encode() for i in range(n)}
    out.update({f"train/{i:04d}.cls": str(i % 3).encode() for i in range(0, n, 5)})
    out.update({"train/0007/inner.jpg": b"inner", "train/.DS_Store": b"hidden"})
    return out


@pytest.mark.parametrize("order", ["bytes", "directories"])
def test_an_unshuffled_pass_reads_the_whole_listings_samples_and_gets_before_the_last_page(order):
    store = FakeStore.with_objects("train", objects(120), page_size=10, order=order,
                                   latency=lambda key: 0.002 if key == "train/" else 0.0)
    listed_before_get: list[int] = []
    store.on_read = lambda key, n: listed_before_get.append(store.list_requests)
    dataset = AsyncS3Dataset.from_prefix("s3://train/train/", store=store)
    streamed = [(s["__key__"], sorted(s)) for s in DataLoader(dataset, batch_size=None)]
    pages = store.list_requests
    assert dataset.source._keys is not None, "the key list is kept for the next pass"
    whole = [(s["__key__"], sorted(s)) for s in DataLoader(dataset, batch_size=None)]
    assert store.list_requests == pages, "the second pass lists nothing"
    assert streamed == whole
    assert len(whole) == 121 and whole[7][0] == "train/0007" and "train/0007/inner" in dict(whole)
    assert pages >= 12 and listed_before_get[0] < pages, (listed_before_get[:3], pages)


def test_a_shuffled_pass_lists_the_whole_prefix_first():
    store = FakeStore.with_objects("train", objects(60), page_size=10)
    listed_before_get: list[int] = []
    store.on_read = lambda key, n: listed_before_get.append(store.list_requests)
    dataset = AsyncS3Dataset.from_prefix("s3://train/train/", store=store, shuffle=True, seed=1)
    assert len(list(DataLoader(dataset, batch_size=None))) == 61
    assert min(listed_before_get) == store.list_requests


def test_an_empty_prefix_read_unshuffled_says_so():
    store = FakeStore.with_objects("train", {"other/1.jpg": b"1", "train/.hidden": b"h"}, page_size=10)
    with pytest.raises(EmptyDatasetError, match="under s3://train/missing/"):
        list(AsyncS3Dataset.from_prefix("s3://train/missing/", store=store))
    with pytest.raises(EmptyDatasetError, match="only hidden objects"):
        list(AsyncS3Dataset.from_prefix("s3://train/train/", store=store))


def test_a_pass_stopped_early_closes_its_listing_and_the_next_reads_every_sample():
    store = FakeStore.with_objects("train", objects(200), page_size=10,
                                   latency=lambda key: 0.002 if key == "train/" else 0.0)
    dataset = AsyncS3Dataset.from_prefix("s3://train/train/", store=store)
    for _ in zip(range(3), dataset):
        pass
    assert store.closed and store.list_inflight == 0, "the listing stopped with the pass"
    assert [s["__key__"] for s in dataset] == sorted({key.split(".")[0] for key in objects(200)} - {"train/"})


def test_a_first_page_sent_for_a_pass_whose_store_fails_to_open_has_its_connection_closed(monkeypatch):
    """The first LIST page goes out from a thread before the engine starts; when the engine's own
    store then fails to open, the listing's store is never opened (so never closed by the
    listing): the pass closes it, and with it that page's connection (counted at the server)."""
    import http.server
    import threading
    import time

    from loader import S3Config
    from loader import s3 as s3_module

    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name>'
            b"<Prefix>p/</Prefix><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated><Contents>"
            b"<Key>p/a.jpg</Key><Size>1</Size><ETag>&quot;e&quot;</ETag></Contents></ListBucketResult>")
    open_connections: list[int] = [0]
    answered = threading.Event()

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            open_connections[0] += 1

        def finish(self):
            open_connections[0] -= 1
            super().finish()

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            answered.set()

        def log_message(self, *args):
            pass

    async def cannot_open(*args, **kwargs):
        answered.wait(10)  # the first page's answer is in: its connection is parked in the lister
        raise ConfigError("the engine's store cannot open (as this test makes it)")

    monkeypatch.setattr(s3_module, "open_store", cannot_open)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            config = S3Config(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
                              access_key_id="a", secret_access_key="b")
            dataset = AsyncS3Dataset.from_prefix("s3://bkt/p/", config=config)
            with pytest.raises(ConfigError, match="cannot open") as failed:
                for _ in dataset:  # (not ``list``, whose length hint would list the prefix first)
                    pass
            assert answered.is_set(), "the first page was asked for"
            deadline = time.monotonic() + 10  # a bound for a busy machine, not a timing
            while open_connections[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert open_connections[0] == 0, "the first page's connection is still open"
            del failed  # (held until here: its frames hold the pass and its listing's store)
        finally:
            server.shutdown()
