"""Shard counts found without asking: the index beside the shards, checked against each shard's
version, counts checked while reading, and the refusal of unequal ranks (in-memory store).

Shards and their index are built here (``test_shards.build_shard``: sample ``i`` of shard ``s``
is ``s{s:03d}/{i:06d}``), so every test knows what the index must say and what was read.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
from test_shards import BUCKET, FAST_RETRY, assert_exactly, build_shard, shard_key, shard_url
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, Reading, Split, Store
from loader.errors import NoSuchKeyError, ObjectChangedError, ShardFormatError
from loader.shard_index.format import entry_document, index_document

from fakes import FakeStore, reusable

SIZES = [30, 20, 25, 15]  # samples per shard: unequal, so a count that is off shows
PATTERN = f"s3://{BUCKET}/shards/train-{{0000..0003}}.tar"
PREFIX = f"s3://{BUCKET}/shards/"
INDEX = "shards/index.json"


def store_with_index(sizes=SIZES, *, index=True, offsets=True, versions=True):
    """Shards of ``sizes`` samples, and (with ``index``) an index of them as loader index writes it."""
    objects, expected, entries = {}, {}, []
    for s, n in enumerate(sizes):
        data, samples = build_shard(s, n, 100, 400)
        objects[shard_key(s)] = data
        expected.update({key: _digest(fields) for key, fields, _, _ in samples})
        fake_etag = FakeStore.with_objects(BUCKET, {"k": data}).etag_of(BUCKET, "k")
        entry = entry_document(shard_url(s), shard_key(s), samples=n, size=len(data), etag=fake_etag,
                               tar_bytes=len(data), offsets=[first for _, _, first, _ in samples])
        if not offsets:
            del entry["offsets"]
        if not versions:
            del entry["etag"], entry["size"]
        entries.append(entry)
    if index:
        objects[INDEX] = json.dumps(index_document(entries)).encode()
    return FakeStore.with_objects(BUCKET, objects), expected


def _digest(fields):
    from test_shards import fingerprint_fields

    return fingerprint_fields(fields)


def ds_of(fake, spec=PATTERN, **options):
    retry = options.pop("retry", FAST_RETRY)
    return AsyncS3Dataset.from_shards(spec, store=Store(backend=reusable(fake), retry=retry), **options)


def ranks(fake, world, spec=PATTERN, workers=0, uneven_ranks=False, **options):
    """Each simulated rank's samples (a DataLoader with ``workers`` forked workers)."""
    out = []
    for rank in range(world):
        ds = ds_of(fake, spec, split=Split(rank=rank, world_size=world, uneven_ranks=uneven_ranks), **options)
        loader = DataLoader(ds, batch_size=None, num_workers=workers,
                            multiprocessing_context="fork" if workers else None)
        out.append(list(loader))
    return out


def rewrite(fake, s, n):
    """Shard ``s`` written again with ``n`` samples (another version: its ETag changes)."""
    data, _ = build_shard(s, n, 100, 400)
    fake.objects[BUCKET, shard_key(s)] = data


# --------------------------------------------------------------------------- found without asking


@pytest.mark.parametrize("spec", [PATTERN, PREFIX])
def test_the_index_beside_the_shards_gives_equal_ranks_and_len_with_one_get(spec):
    fake, expected = store_with_index()
    ds = ds_of(fake, spec, split=Split(rank=0, world_size=3))
    assert ds.shard_counts() == SIZES and len(ds) == 30  # ceil(90 / 3): len() works, no argument
    assert fake.requests_by_key[INDEX] == 1
    got = ranks(fake, 3, spec, workers=2, shuffle=True, seed=4)
    assert [len(r) for r in got] == [30, 30, 30]
    assert_exactly([s for r in got for s in r], expected)


def test_a_pattern_takes_each_shards_size_and_etag_from_the_index():
    fake, _ = store_with_index()
    shards = ds_of(fake).shards()
    assert [s.size for s in shards] == [len(fake.objects[BUCKET, shard_key(s)]) for s in range(4)]
    assert [s.etag for s in shards] == [fake.etag_of(BUCKET, shard_key(s)) for s in range(4)]


def test_pad_policy_repeats_at_most_world_minus_one_with_the_index():
    fake, expected = store_with_index([7, 5, 4, 3])  # 19 samples over 4 ranks: 5 each, 1 repeat
    got = ranks(fake, 4, shuffle=True, seed=1)
    assert [len(r) for r in got] == [5, 5, 5, 5]
    keys = Counter(s["__key__"] for r in got for s in r)
    assert set(keys) == set(expected) and sum(keys.values()) - len(expected) == 1


def test_an_index_in_another_folder_is_named_with_index():
    fake, expected = store_with_index()
    fake.objects[BUCKET, "meta/train.json"] = fake.objects.pop((BUCKET, INDEX))
    with pytest.raises(ConfigError, match=r"index='s3://bucket/meta/none.json': no index.json at "
                                          r"s3://bucket/meta/none.json.*--out s3://bucket/meta/none.json"):
        ds_of(fake, reading=Reading(index="s3://bucket/meta/none.json")).shard_counts()
    got = ranks(fake, 2, reading=Reading(index="s3://bucket/meta/train.json"))
    assert [len(r) for r in got] == [45, 45]
    assert_exactly([s for r in got for s in r], expected)


def test_another_tools_index_json_is_left_alone_with_a_warning(caplog):
    fake, expected = store_with_index(index=False)
    fake.objects[BUCKET, INDEX] = b'{"files": ["a", "b"]}'
    with caplog.at_level(logging.WARNING, logger="loader"):
        ds = ds_of(fake)
        assert ds.shard_counts() is None
        assert_exactly(list(ds), expected)
    assert any("ignored s3://bucket/shards/index.json" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match=r"index.json is not a shard index"):
        len(ds)


def test_sample_counts_and_index_together_are_refused():
    fake, _ = store_with_index()
    with pytest.raises(ConfigError, match="sample_counts= or index=, not both"):
        ds_of(fake, sample_counts={}, reading=Reading(index="s3://bucket/shards/index.json"))


# --------------------------------------------------------------------------- never silently unequal


def test_unknown_counts_on_several_ranks_fail_before_any_sample_and_name_the_fixes():
    fake, _ = store_with_index(index=False)
    ds = ds_of(fake, split=Split(rank=1, world_size=3))
    fake.reset_counters()
    with pytest.raises(ConfigError) as caught:
        next(iter(ds))
    message = str(caught.value)
    for needle in ("3 ranks read 4 tar shards", "no index.json at s3://bucket/shards/index.json",
                   "python -m loader index 's3://bucket/shards/train-{0000..0003}.tar'",
                   "sample_counts=", "samples_per_epoch=", "uneven_ranks=True"):
        assert needle in message, needle
    assert all(key == INDEX for key in fake.requests_by_key), "no shard was read"
    with pytest.raises(TypeError, match="loader index"):
        len(ds)


def test_uneven_ranks_says_it_explicitly_and_reads_everything_once():
    fake, expected = store_with_index(index=False)
    got = ranks(fake, 3, uneven_ranks=True)
    assert_exactly([s for r in got for s in r], expected)
    assert len({len(r) for r in got}) > 1  # whole shards dealt: the ranks differ, as asked


def test_one_rank_needs_no_counts():
    fake, expected = store_with_index(index=False)
    assert_exactly(ranks(fake, 1)[0], expected)


# --------------------------------------------------------------------------- stale entries


def test_a_listed_shard_that_changed_since_indexing_is_not_counted_from_its_entry():
    fake, _ = store_with_index()
    rewrite(fake, 2, 24)  # one sample fewer than the index says
    ds = ds_of(fake, PREFIX, split=Split(rank=0, world_size=3))
    assert ds.shard_counts() is None
    with pytest.raises(ConfigError, match=r"1 shard\(s\) changed since the index s3://bucket/shards/"
                                          r"index.json counted them: s3://bucket/shards/train-0002.tar "
                                          r"\(its ETag is \w+ now, the index recorded \w+\)"):
        next(iter(ds))
    with pytest.raises(TypeError, match="train-0002.tar"):
        len(ds)


def test_a_listed_shard_missing_from_the_index_is_named():
    fake, _ = store_with_index()
    data, _ = build_shard(4, 10, 100, 400)
    fake.objects[BUCKET, shard_key(4)] = data
    with pytest.raises(ConfigError, match=r"1 shard\(s\) are not in the index .*train-0004.tar"):
        next(iter(ds_of(fake, PREFIX, split=Split(rank=0, world_size=2))))


@pytest.mark.parametrize("n", [24, 26])
@pytest.mark.parametrize("spec", [PATTERN, [shard_url(s) for s in range(4)]], ids=["pattern", "list"])
def test_a_named_shard_rewritten_after_indexing_stops_every_rank_before_its_first_sample(n, spec):
    """Whichever rank reads the rewritten shard, none starts: the shards that no listing
    described are checked against the index (one pinned one-byte GET each) before any read,
    and the advice is to index again (reading again would meet the same index)."""
    fake, _ = store_with_index()
    rewrite(fake, 2, n)
    for rank in range(3):
        delivered = []
        with pytest.raises(ObjectChangedError, match=r"s3://bucket/shards/train-0002.tar is not the version "
                                                      r"the index s3://bucket/shards/index.json counted.*"
                                                      r"no rank starts; run `python -m loader index .*` again"):
            for sample in ds_of(fake, spec, split=Split(rank=rank, world_size=3)):
                delivered.append(sample)
        assert delivered == []


def test_a_misspelled_range_says_the_shards_do_not_exist():
    """Not "not in the index" with advice to index them: they do not exist."""
    fake, _ = store_with_index()
    spec = f"s3://{BUCKET}/shards/train-{{0000..0013}}.tar"  # 14 where there are 4
    with pytest.raises(NoSuchKeyError, match=r"^10 of the 14 shards named by 's3://bucket/shards/train-"
                                             r"\{0000\.\.0013\}\.tar' do not exist: s3://bucket/shards/"
                                             r"train-0004\.tar, .* and 7 more; check the pattern .*"
                                             r"`python -m loader ls s3://bucket/shards/`"):
        next(iter(ds_of(fake, spec, batch_size=8)))


# --------------------------------------------------------------------------- counts checked while reading


def without_versions(sizes=SIZES, **options):
    return store_with_index(sizes, versions=False, **options)


@pytest.mark.parametrize("n", [24, 26])
@pytest.mark.parametrize("world", [1, 3])
def test_a_count_found_wrong_while_reading_is_an_error_naming_the_shard(n, world):
    fake, _ = without_versions(offsets=False)  # an old index: nothing to pin to
    rewrite(fake, 2, n)
    more = "more than 25" if n > 25 else str(n)
    with pytest.raises(ConfigError, match=rf"train-0002.tar holds {more} samples, but the index "
                                          r"s3://bucket/shards/index.json says it holds 25"):
        for rank in range(world):
            list(ds_of(fake, split=Split(rank=rank, world_size=world)))


@pytest.mark.parametrize("n", [24, 26])
def test_wrong_sample_counts_are_an_error_too(n):
    fake, _ = store_with_index(index=False)
    counts = {shard_url(s): size for s, size in enumerate(SIZES)}
    counts[shard_url(1)] = n - 5  # 19 or 21 where the shard holds 20
    with pytest.raises(ConfigError, match=r"train-0001.tar holds .* samples, but sample_counts= says it holds"):
        for rank in range(2):
            list(ds_of(fake, split=Split(rank=rank, world_size=2), sample_counts=counts))


@pytest.mark.parametrize("n", [24, 26])
def test_stale_offsets_are_never_blamed_on_a_valid_shard(n):
    fake, _ = without_versions()  # offsets, but no ETag to pin the reads to: they are not used
    rewrite(fake, 2, n)
    with pytest.raises(ConfigError, match=r"train-0002.tar holds .* samples, but the index .* says it "
                                          r"holds 25.*python -m loader index"):
        for rank in range(3):
            list(ds_of(fake, split=Split(rank=rank, world_size=3), batch_size=4, shuffle=True, seed=2))


def test_offsets_that_meet_another_version_say_so():
    """Offsets are used only for reads pinned to the indexed ETag; should a store not honour the
    pin, a read that finds no header at an indexed offset still blames the index, not the shard."""
    fake, _ = store_with_index()
    fake.etags = False  # a store that sends no ETags: the pin compares nothing
    data, _ = build_shard(2, 25, 600, 900)  # same count, other sample sizes: offsets point inside members
    fake.objects[BUCKET, shard_key(2)] = data
    with pytest.raises((ShardFormatError, ConfigError)) as caught:
        for rank in range(3):
            list(ds_of(fake, split=Split(rank=rank, world_size=3), batch_size=4, shuffle=True, seed=2))
    message = str(caught.value)
    assert "train-0002.tar" in message and "python -m loader index" in message
    if isinstance(caught.value, ShardFormatError):
        assert message.startswith("s3://bucket/shards/train-0002.tar: no tar header at byte ")
        assert "the shard changed after it was indexed" in message


def test_blocks_with_the_index_read_each_sample_once_with_ranged_gets():
    fake, expected = store_with_index()
    got = ranks(fake, 3, batch_size=4, shuffle=True, seed=2)
    assert [len(r) for r in got] == [30, 30, 30]
    assert_exactly([s for r in got for s in r], expected)
