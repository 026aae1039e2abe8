"""The shard index's pure parts: entries written and read back, stale entries told apart, where
the index of a set of shards lives, and what an index says of a shard list (property tests)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader import ConfigError
from loader.formats.shards import ShardRef
from loader.shard_index.counts import index_location, match_index
from loader.shard_index.format import entry_document, index_document, parse_index, stale_reason

names = st.text(string.ascii_lowercase + string.digits + "-_", min_size=1, max_size=8)
etags = st.none() | st.text("0123456789abcdef", min_size=8, max_size=8)
suffixes = st.sampled_from([".tar", ".tar.gz", ".tgz", ".tar.zst"])


@st.composite
def shards(draw):
    """Entries of distinct shards: (key, samples, size, etag, offsets or None)."""
    keys = draw(st.lists(st.tuples(st.lists(names, max_size=3), names, suffixes), min_size=1, max_size=8,
                         unique_by=lambda k: ("/".join(k[0]), k[1], k[2])))
    out = []
    for folders, name, suffix in keys:
        key = "/".join([*folders, name]) + suffix
        samples = draw(st.integers(0, 20))
        offsets = sorted(draw(st.sets(st.integers(0, 10**6), min_size=samples, max_size=samples)))
        out.append((key, samples, draw(st.integers(0, 10**9)), draw(etags),
                    None if suffix != ".tar" else offsets))
    return out


def document_of(entries, bucket="b"):
    return index_document([entry_document(f"s3://{bucket}/{key}", key, samples=n, size=size, etag=etag,
                                          tar_bytes=size, offsets=offsets)
                           for key, n, size, etag, offsets in entries])


@given(shards())
def test_entries_read_back_as_written(entries):
    document = document_of(entries)
    parsed = parse_index(document, "x")
    assert document["samples"] == sum(n for _, n, _, _, _ in entries)
    assert [s["url"] for s in document["shards"]] == sorted(s["url"] for s in document["shards"])
    for key, n, size, etag, offsets in entries:
        entry = parsed[f"s3://b/{key}"]
        assert (entry.samples, entry.size, entry.etag) == (n, size, etag)
        assert (list(entry.offsets) if entry.offsets is not None else None) == offsets


@given(size=st.integers(0, 10**6), etag=etags, other_size=st.integers(0, 10**6), other_etag=etags)
def test_an_entry_is_stale_exactly_when_the_version_differs(size, etag, other_size, other_etag):
    (entry,) = parse_index(document_of([("k.tar", 1, size, etag, [0])]), "x").values()
    why = stale_reason(entry, other_size, other_etag)
    if etag is not None and other_etag is not None:
        assert (why is None) == (etag == other_etag)  # ETags decide when both are known
    else:
        assert (why is None) == (size == other_size)
    assert stale_reason(entry, None, None) is None  # nothing listed: nothing to compare
    assert stale_reason(entry, size, etag) is None


@given(shards(), st.data())
def test_what_an_index_says_of_a_shard_list(entries, data):
    document = document_of(entries)
    refs = []
    for key, _, size, etag, _ in entries:
        listed = data.draw(st.sampled_from(["unlisted", "same", "changed"]))
        if listed == "unlisted":
            refs.append(ShardRef("b", key))
        elif listed == "same":
            refs.append(ShardRef("b", key, size, etag))
        else:  # rewritten: another size, and another ETag where there are ETags
            refs.append(ShardRef("b", key, size + 1, None if etag is None else etag + "0"))
    refs.append(ShardRef("b", "not/indexed.tar"))
    found = match_index(refs, document, "s3://b/index.json", fix="f", offsets=True)
    assert found.unindexed == ["s3://b/not/indexed.tar"] and found.complete(refs) is None
    for ref, (_, n, size, etag, offsets) in zip(refs, entries):
        stale = ref.url in dict(found.stale)
        assert stale == (ref.size is not None and ref.size != size)
        if not stale:
            assert found.counts[ref.url] == n
            assert (ref.url in found.offsets) == (offsets is not None and etag is not None)
        if ref.size is None:  # a pattern's shard: read pinned to the indexed version
            assert found.versions[ref.url] == (size, etag)


@given(st.lists(st.tuples(st.lists(names, max_size=3), names), min_size=1, max_size=6))
def test_the_index_lives_in_the_shards_common_folder(paths):
    refs = [ShardRef("b", "/".join([*folders, name]) + ".tar") for folders, name in paths]
    where = index_location(refs)
    folder = where.removeprefix("s3://b/").removesuffix("index.json")
    assert where.endswith("/index.json") and (folder == "" or folder.endswith("/"))
    assert all(ref.key.startswith(folder) for ref in refs)
    deeper = {ref.key[len(folder):].split("/")[0] for ref in refs if "/" in ref.key[len(folder):]}
    files_here = any("/" not in ref.key[len(folder):] for ref in refs)
    assert files_here or len(deeper) > 1, "the deepest folder they all share"
    assert index_location([*refs, ShardRef("c", "x.tar")]) is None  # two buckets: no one place


@pytest.mark.parametrize("document, match", [
    ({"version": 2, "shards": []}, "not a shard index of version 1"),
    ({"version": 1}, "has no list of shards"),
    ({"version": 1, "shards": [{"url": "s3://b/a.tar"}]}, r"shards\[0\] lacks a url or a sample count"),
    ({"version": 1, "shards": [{"url": "s3://b/a.tar", "samples": True}]}, "lacks a url or a sample count"),
    ({"version": 1, "shards": [{"url": "s3://b/a.tar", "samples": 1, "size": -1}]}, "size -1 is not"),
    ({"version": 1, "shards": [{"url": "s3://b/a.tar", "samples": 1, "etag": 5}]}, "etag 5 is not a string"),
])
def test_malformed_indexes_are_named(document, match):
    with pytest.raises(ConfigError, match=match):
        parse_index(document, "s3://b/index.json")


def test_offsets_that_do_not_fit_are_not_used():
    shard = {"url": "s3://b/a.tar", "samples": 3, "bytes": 10}
    for offsets in ([0, 5], [0, 5, 5], [0, -1, 3], "x"):
        (entry,) = parse_index({"version": 1, "shards": [{**shard, "offsets": offsets}]}, "x").values()
        assert entry.offsets is None
    (entry,) = parse_index({"version": 1, "shards": [{**shard, "stored_bytes": 7}]}, "x").values()
    assert entry.size == 7  # loader shard's compressed shards, before it recorded size
    (entry,) = parse_index({"version": 1, "shards": [{**shard, "url": "s3://b/a.tgz"}]}, "x").values()
    assert entry.size is None  # a compressed shard's tar bytes are not its size
