"""Parallel listing of key ranges is exact: the same keys as a sequential listing, in every order.

Property tests over random key sets (characters that sort around '/', unicode, nested and flat
keys), random page sizes, parallelism and injected faults, against a fake that lists in byte
order (S3) and one that lists directory by directory with SeaweedFS's StartAfter.
"""

from __future__ import annotations

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.errors import TransientStoreError
from loader.listing.keylist import ListOptions, list_all
from loader.listing.keyspace import KeySpace, plain
from loader.retry import RetryPolicy
from loader.s3.listing_order import SERVERS

from fakes import FakeStore

past = SERVERS.past  # the rule where a range may end, on every server
FAST = RetryPolicy(base_delay=0.0, max_delay=0.0, max_attempts=50)
# characters just below and above '/' (0x2F), digits, letters, one above ASCII and one far above
CHARS = " !-./0129:AZaz~\u00e4\u4e2d"
segments = st.text(alphabet=CHARS.replace("/", ""), min_size=1, max_size=4)
keys = st.lists(segments, min_size=1, max_size=3).map("/".join)


def directory_order(key: str) -> list[str]:
    return key.split("/")


@given(st.lists(keys, min_size=20, max_size=300), st.lists(keys, max_size=20),
       st.sampled_from(["", "a", "a/", "0", "-"]), st.integers(1, 12), st.integers(1, 8),
       st.sampled_from(["bytes", "directories"]), st.lists(st.booleans(), max_size=60))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_ranges_list_exactly_the_keys_of_a_sequential_listing(inside, outside, prefix, page_size,
                                                               parallel, order, faults):
    objects = {key: key.encode()[: len(key) % 5] for key in [prefix + k for k in inside] + outside}
    fault_list = [TransientStoreError("injected SlowDown", bucket="b", key="") if fail else None
                  for fail in faults]
    store = FakeStore.with_objects("b", objects, page_size=page_size, order=order,
                                   list_fail={prefix: fault_list})

    async def main():
        with anyio.fail_after(30):
            return await list_all(store, "b", prefix, FAST,
                                  options=ListOptions(page_size=page_size, concurrency=parallel))

    listed = anyio.run(main)
    expected = sorted(key for key in objects if key.startswith(prefix) and not key.endswith("/"))
    assert list(listed) == expected
    assert [info.size for info in listed.infos()] == [len(objects[key]) for key in expected]
    assert listed.etags() == [store.etag_of("b", key) for key in expected]


@given(keys, keys)
def test_past_means_after_the_bound_in_both_orders_and_outside_its_folder(key, bound):
    if past(key, bound):
        assert key > bound and directory_order(key) > directory_order(bound)
        assert not key.startswith(bound + "/")
    elif key > bound and directory_order(key) > directory_order(bound):
        assert key.startswith(bound + "/")


def test_seaweedfs_skips_the_folder_named_by_start_after_and_past_accounts_for_it():
    # SeaweedFS, StartAfter="o/m/b": "o/m/b/c" is not listed although it sorts after "o/m/b"
    assert not past("o/m/b/c", "o/m/b") and past("o/m/b-", "o/m/b")
    # byte order and directory order disagree on '-' against '/'
    assert not past("o/m-a", "o/m/z") and not past("o/m/z", "o/m-a")


@given(st.lists(keys, min_size=2, max_size=50), st.floats(0.01, 0.99))
def test_a_split_point_lies_strictly_between_and_is_plain(sample, fraction):
    lo, hi = min(sample), max(sample)
    space = KeySpace.of(sample)
    bound = space.between(lo, hi, fraction)
    if bound is not None:
        assert lo < bound < hi and plain(bound)
    assert space.position(lo) <= space.position(hi)


def test_split_points_follow_the_keys_alphabet():
    space = KeySpace.of([f"flat/{i:07d}.jpg" for i in range(0, 100_000, 997)])
    middle = space.between("flat/0000000.jpg", "flat/0099999.jpg")
    assert middle is not None and "flat/004" <= middle < "flat/006"
    assert space.between("flat/0000001.jpg", "flat/0000001.jpg") is None
    # an open end: as far ahead as asked, not half the alphabet away
    ahead = space.between("flat/0000999.jpg", None, 0.5,
                          space.position("flat/0001999.jpg") - space.position("flat/0000999.jpg"))
    assert ahead is not None and "flat/0000999.jpg" < ahead <= "flat/0001999.jpg"


def test_bounds_are_not_cut_where_the_keys_have_folders():
    space = KeySpace.of([f"n/f{f:03d}/{i:04d}.jpg" for f in range(0, 40, 3) for i in range(0, 50, 7)])
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        bound = space.between("n/f000/0000.jpg", "n/f039/0049.jpg", fraction)
        assert bound is not None and len(bound) != len("n/f000"), bound


def test_plain_bounds():
    assert plain("a/b") and plain("ä") and plain("a-b.c")
    for bad in ("", "a//b", "a/", "./a", "a/..", "a\x00", "a\x7f"):
        assert not plain(bad)


def test_a_server_listing_out_of_byte_order_ends_the_splitting_and_the_listing_ends():
    """Directory order puts 'a-…' after 'a/…'; byte-order split points there once made pieces
    wrap back over each other's keys, split after split (hundreds of thousands of LISTs)."""
    inside = ["90", "z/中9/..", "!0ä/!A9", "zaZ/Z", "!/: /:", "ä中", ".中/990./a2", "中~/ ~ä.", ".zA", ".Z",
              "-/ 2/A0", "2/99", "12/1!/9A!9", "!-Z:/~/9", "0 .Z", "2-/~: z", "ä!:a", "0A", "中",
              "1/9:中/za", "z9.A/~!! /.9A ", "ä", " /9:1", ".a中", " 2中/0", "Z ", "0a/Z/...", "z",
              " !./ a./-1!中", "./:ä中/~.20", "ä!2A"]
    objects = {key: b"x" for key in ["a" + k for k in inside] + ["-9/z9/1"]}

    async def listing(store, parallel):
        with anyio.fail_after(30):
            return await list_all(store, "b", "a", FAST, options=ListOptions(page_size=1, concurrency=parallel))

    for parallel in (4, 8, 8, 8):
        store = FakeStore.with_objects("b", objects, page_size=1, order="directories")
        assert list(anyio.run(listing, store, parallel)) == sorted(key for key in objects if key.startswith("a"))
        assert store.list_requests <= 4 * len(objects), store.list_requests


@given(st.lists(keys, min_size=1, max_size=30), st.text("ab-/", min_size=1, max_size=4))
def test_a_key_beyond_the_stem_ends_a_directory_listing_in_both_orders(listed, stem):
    """obstore's lister lists a directory and stops at the first key that shows no later one
    can start with the stem (a key that does not start with it, asked about as obstore's lister
    asks); that must hold whether the server sorts by bytes or by directory."""
    stem = stem.strip("/") or "a"
    for order in (sorted, lambda ks: sorted(ks, key=directory_order)):
        seen = order(set(listed))
        for i, key in enumerate(seen):
            if not key.startswith(stem) and SERVERS.beyond_stem(key, 0, stem):
                assert not any(later.startswith(stem) for later in seen[i + 1:]), (seen, key)


def test_only_the_listing_order_module_knows_that_servers_order_listings_differently():
    """The SeaweedFS quirk is one capability (``s3/listing_order.py``) that the listers consult,
    not comparisons spread over the range lister, the key space and a backend."""
    from pathlib import Path

    import loader

    root = Path(loader.__file__).parent
    for path in ("listing/ranges.py", "listing/keyspace.py", "s3/obstore_store.py"):
        code = (root / path).read_text(encoding="utf-8")
        assert 'split("/") >' not in code and 'partition("/")[0] >' not in code, path
    assert "SERVERS" in (root / "listing" / "ranges.py").read_text(encoding="utf-8")
