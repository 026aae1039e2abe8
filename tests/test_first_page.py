"""A listing's first page asked for before its event loop runs (``ListingOpener``)."""

from __future__ import annotations

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
