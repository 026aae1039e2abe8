"""Listings at scale on the real server: through the fault proxy, in parallel folders, once per job.

Keys are created with native PUTs of empty objects (obstore, 64 in flight): the fastest way to
make many keys on a 2-core machine. The 200,000-key listing is marked ``slow`` (``make
bench-listing`` runs it and prints its time and memory); the normal suite lists a few thousand
keys in pages of 100 through the same faults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
import tracemalloc

import pytest
import torch.multiprocessing as mp
from listing_worker import list_on_rank

from loader.listing.keylist import ListOptions, list_all
from loader.retry import RetryPolicy
from loader.s3 import ListingOpener, open_listing_store, open_store
from loader.s3.http_lister import HttpLister

from faults import FaultDecider, FaultPlan, FaultProxy

BACKENDS = ["aioboto3", "obstore"]
# "http": open_listing_store's standard-library lister; "http-ahead": the same with its first page
# asked for before the event loop runs, as datasets list (ListingOpener.send_first_page)
LISTERS = [*BACKENDS, "http", "http-ahead"]
RETRY = RetryPolicy(base_delay=0.01, max_delay=0.2, connect_timeout=5, read_timeout=30)


def put_empty(config, bucket: str, keys: list[str], concurrency: int = 64) -> float:
    """PUT an empty object at every key, ``concurrency`` at a time; returns the seconds taken."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=config.endpoint_url, access_key_id=config.access_key_id,
                    secret_access_key=config.secret_access_key, region=config.region,
                    virtual_hosted_style_request=False,
                    client_options={"allow_http": True, "timeout": "120s",
                                    "pool_max_idle_per_host": str(concurrency)})

    async def main() -> None:
        pending = iter(keys)

        async def runner() -> None:
            for key in pending:
                await obstore.put_async(store, key, b"", use_multipart=False)

        await asyncio.gather(*(runner() for _ in range(concurrency)))

    started = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - started


def folder_keys(prefix: str, folders: int, per_folder: int) -> list[str]:
    keys = [f"{prefix}f{f:03d}/{i:07d}.jpg" for f in range(folders) for i in range(per_folder)]
    return keys + [f"{prefix}top-{i}.txt" for i in range(5)]


def list_through(config, store: str, bucket: str, prefix: str, options: ListOptions):
    opener = ListingOpener(config, max_connections=options.concurrency, retry=RETRY)
    if store == "http-ahead":
        opener.send_first_page(bucket, prefix, options.page_size)

    async def main():
        if store.startswith("http"):
            opened = await opener()
            assert isinstance(opened, HttpLister)
        else:
            opened = await open_store(store, config, max_connections=options.concurrency, retry=RETRY)
        try:
            return await list_all(opened, bucket, prefix, RETRY, options=options)
        finally:
            await opened.aclose()

    return asyncio.run(main())


def seed_with_faults(plan: FaultPlan, first: int) -> FaultPlan:
    """The plan with the first seed whose first ``first`` requests get both a reset and a
    SlowDown: the proxy decides request by request in arrival order, so a listing of that many
    requests meets both faults whichever folder's request comes first."""
    for seed in range(1000):
        decider = FaultDecider(dataclasses.replace(plan, seed=seed))
        kinds = {decider.decide("GET", "/b?list-type=2").kind for _ in range(first)}
        if {"reset", "slowdown"} <= kinds:
            return dataclasses.replace(plan, seed=seed)
    raise AssertionError("no seed in 1000 gives both faults")


def list_requests(proxy: FaultProxy, bucket: str, marker: str = "") -> int:
    return sum(1 for method, target, _ in proxy.decisions
               if method == "GET" and target.startswith(f"/{bucket}") and "list-type=2" in target
               and marker in target)


@pytest.fixture(scope="module")
def keyspace(s3_server):
    bucket = s3_server.new_bucket("list")
    keys = folder_keys("data/", 6, 500)
    put_empty(s3_server.config, bucket, keys)
    return bucket, sorted(keys)


# On the first server only: these keys list in the same order by bytes and by directory, and the
# pages, StartAfter and faults are the client's; the tricky keys below run where servers differ.
@pytest.mark.parametrize("store", LISTERS)
@pytest.mark.parametrize("parallel", [1, 4])
def test_a_listing_through_resets_and_slowdowns_lists_every_key_once(s3_server, keyspace, store,
                                                                     parallel):
    bucket, expected = keyspace
    plan = seed_with_faults(FaultPlan(reset=0.1, slowdown=0.1, objects_only=False), first=4)
    with FaultProxy(s3_server.config.endpoint_url, plan) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        found = list_through(config, store, bucket, "data/",
                             ListOptions(page_size=100, concurrency=parallel))
        counts = proxy.counts
    assert len(found) == len(expected) and list(found) == expected
    assert found.size(0) == 0
    assert counts["reset"] >= 1 and counts["slowdown"] >= 1, counts



def test_the_first_page_asked_for_ahead_is_one_of_the_listings_requests_not_one_more(s3_server, keyspace):
    """Counted at the server's door: page after page, the listing with its first page sent ahead
    makes exactly the LIST requests of the one without (one per page)."""
    bucket, expected = keyspace
    pages = -(-len(expected) // 100)
    counted = {}
    for store in ("http", "http-ahead"):
        with FaultProxy(s3_server.config.endpoint_url, FaultPlan()) as proxy:
            config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
            found = list_through(config, store, bucket, "data/", ListOptions(page_size=100, concurrency=1))
            counted[store] = list_requests(proxy, bucket)
        assert list(found) == expected
    assert counted == {"http": pages, "http-ahead": pages}

# Not server-sensitive: three spawned ranks cost ~50 s a server; the list-once counting runs on
# every server in test_list_once.py (one process and its forked workers).
def test_a_three_rank_job_makes_the_list_requests_of_one_listing(s3_server):
    bucket = s3_server.new_bucket("list3")
    keys = folder_keys("shared/", 4, 300) + folder_keys("alone/", 4, 300)
    put_empty(s3_server.config, bucket, keys)
    with FaultProxy(s3_server.config.endpoint_url) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        one = list_through(config, "aioboto3", bucket, "shared/", ListOptions(page_size=100))
        single = list_requests(proxy, bucket)
        proxy.reset_counts()
        fields = {f: getattr(config, f) for f in
                  ("endpoint_url", "region", "access_key_id", "secret_access_key", "addressing_style")}
        spec = {"config": fields, "shared": f"s3://{bucket}/shared/",
                "alone": f"s3://{bucket}/alone/"}
        manager = mp.Manager()
        try:
            out = manager.dict()
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(list_on_rank, args=(3, port, spec, out), nprocs=3, join=True)
            found = dict(out)
        finally:
            manager.shutdown()
        shared = list_requests(proxy, bucket, "prefix=shared")
        alone = list_requests(proxy, bucket, "prefix=alone")
    assert 13 <= single <= 3 * 13, "13 pages of 100, listed as key ranges"
    assert {found[rank]["shared"] for rank in range(3)} == {found[0]["shared"]}
    assert found[0]["shared"][0] == len(one) == 1205
    # ranges are split as pages arrive, so one listing's request count varies a little
    assert 13 <= shared <= 3 * 13, "the job listed the shared prefix once, on rank 0"
    assert alone >= 3 * 13 and alone > shared, "with once_per_job=False every rank lists for itself"


# Keys that sort differently by bytes and by directory: characters just below and above '/',
# nested and flat keys side by side, a key that is also a folder's name, unicode.
TRICKY = ["m", "m/a", "m/b/c", "m/b/d", "m/b-", "m/b.x", "m/z", "m/\u00e4", "m ", "m!x", "m-a",
          "m.b", "m0", "m~/1", "m\u00e4/1", "n", "a-b/c", "a/b-c", "a.b", "\u4e2d/\u6587"]


def tricky_keys(prefix: str) -> list[str]:
    keys = [f"{prefix}{key}" for key in TRICKY]
    keys += [f"{prefix}m/b/{i:04d}" for i in range(150)] + [f"{prefix}m-{i:04d}" for i in range(150)]
    keys += [f"{prefix}flat{i:05d}.jpg" for i in range(400)]
    return keys + [f"{prefix}f{f:02d}/{i:03d}" for f in range(8) for i in range(60)]


@pytest.fixture(scope="module")
def tricky(s3_server):
    bucket = s3_server.new_bucket("tricky")
    keys = tricky_keys("t/")
    # one at a time where a key is also another key's folder ("t/m" and "t/m/a"): SeaweedFS keeps
    # keys as files and folders, and such a pair PUT concurrently on a loaded machine once lost
    # "t/m" and "t/m\u00e4/1" (the server's own listing lacked them), failing every case of the prefix
    put_empty(s3_server.config, bucket, [f"t/{key}" for key in TRICKY], concurrency=1)
    put_empty(s3_server.config, bucket, keys[len(TRICKY):] + ["u/outside"])
    return bucket, sorted(keys)


# Listing order and StartAfter differ by server (SeaweedFS by directory, S3 and moto by bytes). The
# range lister's order rules are the same whichever store lists, and the first server runs every
# store: on the others, the loader's own lister (its XML, with the first page sent ahead) suffices.
@pytest.mark.server_sensitive(beyond_first={"store": ("http-ahead",)})
@pytest.mark.parametrize("store", LISTERS)
@pytest.mark.parametrize("prefix", ["t/", "t/m"])
def test_key_ranges_in_parallel_list_exactly_the_keys_in_any_order_the_server_lists(
        s3_server, tricky, store, prefix):
    """Ranges split on a real server (SeaweedFS lists directory by directory, moto in byte order),
    through resets and SlowDowns: the same keys as a sorted sequential listing, each once."""
    bucket, keys = tricky
    expected = [key for key in keys if key.startswith(prefix)]
    sequential = list_through(s3_server.config, store, bucket, prefix,
                              ListOptions(page_size=20, concurrency=1))
    assert list(sequential) == expected
    # obstore asks for pages of 1,000 whatever page_size says (object_store sets no max-keys)
    plan = seed_with_faults(FaultPlan(reset=0.1, slowdown=0.1, objects_only=False),
                            first=2 if store == "obstore" else 6)
    with FaultProxy(s3_server.config.endpoint_url, plan) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        found = list_through(config, store, bucket, prefix, ListOptions(page_size=20, concurrency=6))
        counts = proxy.counts
        requests = list_requests(proxy, bucket)
    assert list(found) == expected
    assert counts["reset"] >= 1 and counts["slowdown"] >= 1, counts
    assert "start-after" in "".join(target for _, target, _ in proxy.decisions), "ranges were split"
    # a guessed bound may land between folders: a short or empty page, never a lost key
    assert requests <= 4 * (len(expected) / 20) + counts["reset"] + counts["slowdown"]


@pytest.mark.server_sensitive  # S3's error answers: servers differ
def test_the_standard_library_lister_names_what_went_wrong(s3_server):
    from loader.errors import EndpointUnreachableError, NoSuchBucketError

    # one attempt: timeouts a slow answer on a loaded machine cannot reach, or it fails on time
    once = RetryPolicy(max_attempts=1, base_delay=0.0, connect_timeout=10, read_timeout=30)

    async def listing(opener, bucket):
        lister = await opener()
        try:
            return await list_all(lister, bucket, "", once)
        finally:
            await lister.aclose()

    def opener(config, bucket, ahead):
        made = ListingOpener(config, max_connections=1, retry=once)
        if ahead:  # the first page's error comes from its own thread, raised as the listing's
            made.send_first_page(bucket, "", 1000)
        return made

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for ahead in (False, True):
        with pytest.raises(NoSuchBucketError, match="no-such-bucket"):
            asyncio.run(listing(opener(s3_server.config, "no-such-bucket", ahead), "no-such-bucket"))
        nowhere = dataclasses.replace(s3_server.config, endpoint_url=closed)
        with pytest.raises(EndpointUnreachableError, match="cannot connect"):
            asyncio.run(listing(opener(nowhere, "b", ahead), "b"))


@pytest.mark.server_sensitive  # ranged GETs and a missing key's answer: servers differ
def test_the_standard_library_lister_reads_small_objects_and_ranges(s3_server):
    import io

    from loader.errors import NoSuchKeyError

    bucket = s3_server.new_bucket("httpget")
    key = "shards/ä b+c/index.json"
    s3_server.minio.put_object(bucket, key, io.BytesIO(b"0123456789"), 10)

    async def main():
        lister = await open_listing_store(s3_server.config, max_connections=2, retry=RETRY)
        try:
            whole = await lister.get(bucket, key)
            part = await lister.get_range(bucket, key, 2, 5)
            with pytest.raises(NoSuchKeyError, match="index.jsn"):
                await lister.get(bucket, "shards/index.jsn")
            return whole, part
        finally:
            await lister.aclose()

    assert asyncio.run(main()) == (b"0123456789", b"234")


SLOW_KEYS = int(os.environ.get("LOADER_LISTING_KEYS", "200000"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("store", BACKENDS)
def test_200k_keys_through_5_percent_resets_and_slowdowns(s3_server, store, capsys):
    """The listing at scale: 200,000 keys in 200 folders, 5 % resets and 5 % SlowDowns on every
    LIST request, page after page (parallel=1) and 8 folders at a time; exact every time."""
    bucket = s3_server.new_bucket("list200k")
    keys = folder_keys("big/", 200, SLOW_KEYS // 200)
    upload = put_empty(s3_server.config, bucket, keys)
    expected = sorted(keys)
    lines = [f"{len(keys)} empty objects PUT in {upload:.1f} s ({len(keys) / upload:.0f}/s)"]
    plan = FaultPlan(reset=0.05, slowdown=0.05, objects_only=False, seed=12)
    with FaultProxy(s3_server.config.endpoint_url, plan, max_lifetime=3600) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        for parallel in (1, 8):
            proxy.reset_counts()
            tracemalloc.start()
            started = time.perf_counter()
            found = list_through(config, store, bucket, "big/", ListOptions(concurrency=parallel))
            seconds = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            counts = proxy.counts
            assert list(found) == expected, "every key exactly once, in order"
            assert counts["reset"] and counts["slowdown"], counts
            lines.append(
                f"{store} parallel={parallel}: {len(found)} keys in {seconds:.1f} s, "
                f"{counts['requests']} requests ({counts['reset']} resets, {counts['slowdown']} "
                f"SlowDowns), key list {found.nbytes / len(found):.1f} B/key, peak Python "
                f"allocations while listing {peak / len(found):.0f} B/key")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
