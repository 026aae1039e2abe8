"""A listing's first page asked for before its event loop runs (``ListingOpener``)."""

from __future__ import annotations

from os_threads import HAS_TASKS, alive, linger_at_exit

from loader.listing.inputs import list_prefix
from loader.listing.keylist import ListOptions
from loader.listing.snapshots import Snapshot
from loader.retry import RetryPolicy

from fakes import FakeStore, payloads


class AheadFactory:
    """A store factory that offers ``send_first_page``, as ``s3.ListingOpener`` does."""

    def __init__(self, fake: FakeStore) -> None:
        self.fake = fake
        self.sent: list[tuple[str, str, int]] = []

    def send_first_page(self, bucket: str, prefix: str, page_size: int) -> None:
        self.sent.append((bucket, prefix, page_size))

    async def __call__(self) -> FakeStore:
        self.fake.closed = False
        return self.fake


def test_the_first_page_is_asked_for_where_the_listing_runs_and_only_there(tmp_path):
    fake = FakeStore.with_objects("bkt", payloads(30), page_size=7)
    factory = AheadFactory(fake)
    options = ListOptions(page_size=7, once_per_job=False)
    found = list_prefix("s3://bkt/train/", factory=factory, retry=RetryPolicy(), options=options)
    assert len(found) == 30
    assert factory.sent == [("bkt", "train/", 7)], "asked once, for the page the listing starts with"
    path = str(tmp_path / "keys")
    list_prefix("s3://bkt/train/", factory=factory, retry=RetryPolicy(), options=options,
                snapshot=Snapshot(path, create=True))
    again = list_prefix("s3://bkt/train/", factory=factory, retry=RetryPolicy(), options=options,
                        snapshot=Snapshot(path, create=True))
    assert list(again) == list(found)
    assert len(factory.sent) == 2, "a listing read from its snapshot asks for no page"


def test_the_first_pages_thread_is_joined_when_the_lister_closes(monkeypatch):
    """A short-lived listing thread still ending when the DataLoader forks right after the
    listing once hung a forked worker: the thread that fetched the first page is joined by the
    lister's close, to its end at the OS level, not left to end on its own."""
    import asyncio
    import concurrent.futures
    import http.server
    import threading
    import time

    from loader.config import S3Config
    from loader.s3 import http_lister
    from loader.s3.http_lister import HttpLister

    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name>'
            b"<Prefix>p/</Prefix><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated><Contents>"
            b"<Key>p/a</Key><Size>1</Size><ETag>&quot;e&quot;</ETag></Contents></ListBucketResult>")

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    fetched_in: list[int] = []

    class SlowToEnd(concurrent.futures.Future):
        """The answer handed over, then the thread lingers, in Python and after it at the OS
        level: what a thread ending looks like (its C-level exit handlers, OpenSSL's among them)."""

        def set_result(self, result):
            super().set_result(result)
            fetched_in.append(threading.get_native_id())
            if HAS_TASKS:
                linger_at_exit(0.3)
            time.sleep(0.3)

    monkeypatch.setattr(http_lister.concurrent.futures, "Future", SlowToEnd)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            config = S3Config(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
                              access_key_id="a", secret_access_key="b")
            lister = HttpLister(config)
            lister.send_first_page("bkt", "p/", 1000)

            async def listing():
                keys = [info.key async for page in lister.list_pages("bkt", "p/") for info in page.objects]
                await lister.aclose()
                return keys

            assert asyncio.run(listing()) == ["p/a"]
            assert not [t for t in threading.enumerate() if t.name == "loader-first-page"]
            assert fetched_in and not alive(fetched_in[0]), "the OS thread outlived the lister's close"
        finally:
            server.shutdown()
