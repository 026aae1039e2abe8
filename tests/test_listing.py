"""Listings at scale against the in-memory store: retries per page, folders in parallel, KeyList."""

from __future__ import annotations

import pickle
import sys
import types

import anyio
import pytest

from loader.errors import ConfigError, NoSuchBucketError, TransientStoreError
from loader.listing.keylist import KeyList, ListOptions, list_all
from loader.retry import RetryPolicy
from loader.s3 import ObjectInfo

from fakes import FakeStore

FAST = RetryPolicy(base_delay=0.0, max_delay=0.0)


def flaky(n: int) -> TransientStoreError:
    return TransientStoreError(f"injected SlowDown #{n}; will retry", bucket="b", key="")


def run_list(store, prefix="", **kwargs):
    retry = kwargs.pop("retry", FAST)

    async def main():
        with anyio.fail_after(30):
            return await list_all(store, "b", prefix, retry, **kwargs)

    return anyio.run(main)


def folder_keys() -> dict[str, bytes]:
    objects = {f"train/d{d}/k{i:04d}": b"x" * (i % 7) for d in range(5) for i in range(230)}
    objects.update({"train/top.txt": b"t", "train/d1/": b"", "other/x": b"o"})
    return objects


def test_a_failed_page_is_asked_again_from_its_token_not_from_page_one():
    objects = {f"k{i:05d}": b"" for i in range(2_500)}
    # 25 pages; pages 4, 5 (twice) and 19 fail once each
    pattern = [None] * 3 + [flaky(1), None, flaky(2), flaky(3)] + [None] * 13 + [flaky(4)]
    store = FakeStore.with_objects("b", objects, page_size=100, list_fail={"": pattern})
    found = run_list(store, options=ListOptions(page_size=100, concurrency=1))
    assert list(found) == sorted(objects)
    assert store.list_requests == 25 + 4, "each failure costs one request, never a restart"


def test_the_retry_deadline_counts_from_the_last_page_received():
    objects = {f"k{i:05d}": b"" for i in range(600)}
    faults = ([None] * 9 + [flaky(0)]) * 6
    store = FakeStore.with_objects("b", objects, page_size=10, latency=0.01,
                                   list_fail={"": faults})
    retry = RetryPolicy(base_delay=0.0, max_delay=0.0, deadline=0.2, max_attempts=2)
    # 60 pages of 10 ms: the listing takes ~3x the deadline, and fails every 10th page
    found = run_list(store, options=ListOptions(page_size=10, concurrency=1), retry=retry)
    assert len(found) == 600 and store.list_requests == 60 + 6


def test_a_page_that_keeps_failing_gives_up_with_the_attempts_counted():
    store = FakeStore.with_objects("b", {f"k{i}": b"" for i in range(50)}, page_size=10,
                                   list_fail={"": [None, None] + [flaky(n) for n in range(9)]})
    with pytest.raises(TransientStoreError, match=r"gave up after 3 attempt\(s\)"):
        run_list(store, options=ListOptions(page_size=10, concurrency=1),
                 retry=RetryPolicy(base_delay=0.0, max_delay=0.0, max_attempts=3))
    assert store.list_requests == 2 + 3


def test_permanent_errors_are_not_retried():
    store = FakeStore(buckets=["other"])
    with pytest.raises(NoSuchBucketError):
        run_list(store)
    assert store.list_requests == 1


def test_folders_are_listed_in_parallel_and_merged_in_key_order():
    objects = folder_keys()
    store = FakeStore.with_objects("b", objects, page_size=100, latency=0.005)
    found = run_list(store, "train/", options=ListOptions(page_size=100, concurrency=4))
    expected = sorted(k for k in objects if k.startswith("train/") and not k.endswith("/"))
    assert list(found) == expected
    assert [found.size(i) for i in range(3)] == [len(objects[k]) for k in expected[:3]]
    assert 2 <= store.peak_list_inflight <= 4, "ranges in parallel, at most four"
    pages = -(-len(expected) // 100)
    assert pages <= store.list_requests <= 2 * pages, "ranges cost partial and empty pages"


def test_one_flat_prefix_is_listed_in_parallel_ranges():
    """Pages that wait on a round trip: the listing widens to several ranges at once. How far it
    widens follows the rates it measures, so a busy machine may stop it early; how much faster
    that lists is measured side by side by ``bench.listing``, not asserted here."""
    objects = {f"flat/{i:07d}.jpg": b"" for i in range(20_000)}
    store = FakeStore.with_objects("b", objects, page_size=100, latency=0.01)
    found = run_list(store, "flat/", options=ListOptions(page_size=100, concurrency=8))
    assert list(found) == sorted(objects)
    assert 2 <= store.peak_list_inflight <= 8, store.peak_list_inflight
    assert store.list_requests <= 200 * 1.3, store.list_requests


def test_on_a_server_that_answers_no_faster_in_parallel_the_listing_stays_narrow(monkeypatch):
    """Pages that take as much longer as more are asked at once (a server short of CPU): more
    ranges would only add requests, so the number at once settles low."""
    objects = {f"flat/{i:07d}.jpg": b"" for i in range(6_000)}
    holder: list[FakeStore] = []
    store = FakeStore.with_objects("b", objects, page_size=100,
                                   latency=lambda _: 0.02 * holder[0].list_inflight)
    holder.append(store)
    # The lister's clock is the server's: 20 ms a page answered, however many are asked at once.
    # On the wall clock a loaded machine's stalls overlap with more ranges and read as a gain.
    server_clock = types.SimpleNamespace(
        monotonic=lambda: 0.02 * (store.list_requests - store.list_inflight))
    monkeypatch.setattr("loader.listing.ranges.time", server_clock)
    found = run_list(store, "flat/", options=ListOptions(page_size=100, concurrency=8))
    assert list(found) == sorted(objects)
    assert store.peak_list_inflight <= 2, store.peak_list_inflight
    assert store.list_requests <= 60 * 1.15, store.list_requests


@pytest.mark.parametrize("pages", [1, 2])
def test_a_prefix_of_one_or_two_pages_costs_its_pages_and_no_more(pages):
    objects = {f"k{i:04d}": b"" for i in range(pages * 100)}
    store = FakeStore.with_objects("b", objects, page_size=100)
    found = run_list(store, options=ListOptions(page_size=100, concurrency=8))
    assert list(found) == sorted(objects)
    assert store.list_requests == pages and store.peak_list_inflight == 1


def test_parallel_one_lists_page_after_page():
    objects = folder_keys()
    for prefix in ("train/", "train/d"):
        store = FakeStore.with_objects("b", objects, page_size=100)
        found = run_list(store, prefix, options=ListOptions(page_size=100, concurrency=1))
        assert list(found) == sorted(k for k in objects if k.startswith(prefix) and k[-1] != "/")
        assert store.peak_list_inflight == 1
        assert store.list_requests == -(-len(found) // 100)


def test_faults_in_parallel_ranges_still_list_every_key_once():
    objects = folder_keys()
    faults = [None, None, flaky(1), None, flaky(2), flaky(3)] * 4
    store = FakeStore.with_objects("b", objects, page_size=100, list_fail={"train/": faults})
    found = run_list(store, "train/", options=ListOptions(page_size=100, concurrency=3))
    assert list(found) == sorted(k for k in objects if k.startswith("train/") and k[-1] != "/")
    assert not store.list_fail["train/"], "every injected fault was met"


def test_suffix_and_directory_markers():
    objects = {"s/a.tar": b"1", "s/b.txt": b"2", "s/c/": b"", "s/c/d.tar": b"33"}
    store = FakeStore.with_objects("b", objects)
    found = run_list(store, "s/", suffix=".tar")
    assert list(found.infos()) == [ObjectInfo("s/a.tar", 1, store.etag_of("b", "s/a.tar")),
                                   ObjectInfo("s/c/d.tar", 2, store.etag_of("b", "s/c/d.tar"))]


class UnorderedStore:
    """Answers ``list`` (no pages) in a server's own order, with a repeat: the merge sorts."""

    def __init__(self, keys):
        self.keys = keys

    async def list(self, bucket, prefix=""):
        for key in self.keys:
            yield ObjectInfo(key, 1)


def test_stores_without_pages_are_listed_whole_sorted_and_without_repeats():
    found = run_list(UnorderedStore(["many/0", "many/2", "many-x/1", "a", "many/0"]))
    assert list(found) == ["a", "many-x/1", "many/0", "many/2"]


def test_keylist_is_a_compact_sequence_that_pickles():
    keys = [f"train/{i:06d}.jpg" for i in range(10_000)] + ["ünïcode/ключ", "a\udcff"]
    packed = KeyList.from_keys(keys)
    assert len(packed) == len(keys) and list(packed) == keys and packed == tuple(keys)
    assert packed[3] == keys[3] and packed[-1] == keys[-1] and list(packed[2:5]) == keys[2:5]
    assert keys[10] in packed and packed.index(keys[10]) == 10
    with pytest.raises(IndexError):
        packed[len(keys)]
    copy = pickle.loads(pickle.dumps(packed))
    assert copy == packed and len(pickle.dumps(packed)) < 30 * len(keys)
    as_tuple = tuple(keys)
    tuple_bytes = sys.getsizeof(as_tuple) + sum(sys.getsizeof(k) for k in keys)
    assert packed.nbytes < tuple_bytes / 2.5, (packed.nbytes, tuple_bytes)
    with pytest.raises(TypeError, match="no sizes"):
        packed.size(0)


def test_list_options_are_checked():
    with pytest.raises(ConfigError, match="page_size=0"):
        ListOptions(page_size=0)
    with pytest.raises(ConfigError, match="at most 1000"):
        ListOptions(page_size=5000)
    with pytest.raises(ConfigError, match="concurrency=True"):
        ListOptions(concurrency=True)
