"""The entry points' keywords: at most 12 each, the few everyone touches flat and the rest in
groups (``Limits``, ``Split``, ``Store`` with ``Cache``, ``Reading``), and where each group's
fields land. The old flat spellings are tested in test_deprecated_spellings.py."""

from __future__ import annotations

import inspect

import pytest

from loader import (
    AsyncS3Dataset,
    AsyncS3MapDataset,
    Cache,
    ConfigError,
    Limits,
    ListOptions,
    Reading,
    RetryPolicy,
    Split,
    Store,
    mix,
)
from loader.formats.shards import DEFAULT_PARTS_INFLIGHT

from fakes import FakeStore, reusable

MAX_KEYWORDS = 12
ENTRY_POINTS = {
    "AsyncS3Dataset.from_prefix": AsyncS3Dataset.from_prefix,
    "AsyncS3Dataset.from_keys": AsyncS3Dataset.from_keys,
    "AsyncS3Dataset.from_manifest": AsyncS3Dataset.from_manifest,
    "AsyncS3Dataset.from_shards": AsyncS3Dataset.from_shards,
    "AsyncS3Dataset.from_parquet": AsyncS3Dataset.from_parquet,
    "AsyncS3MapDataset.from_prefix": AsyncS3MapDataset.from_prefix,
    "AsyncS3MapDataset.from_keys": AsyncS3MapDataset.from_keys,
    "AsyncS3MapDataset.from_manifest": AsyncS3MapDataset.from_manifest,
    "mix": mix,
}
STORE = reusable(FakeStore({}))


def keywords(function) -> list[str]:
    """What a user may pass by name besides the source itself: every parameter with a default
    (``**deprecated`` holds only the old spellings, which warn)."""
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.default is not inspect.Parameter.empty]


def test_every_entry_point_takes_at_most_twelve_keywords(capsys):
    counts = {name: len(keywords(function)) for name, function in ENTRY_POINTS.items()}
    with capsys.disabled():
        print("\nkeywords per entry point:")
        for name, count in counts.items():
            print(f"  {name:32} {count:2}  {', '.join(keywords(ENTRY_POINTS[name]))}")
    assert max(counts.values()) <= MAX_KEYWORDS, counts


def test_the_entry_points_share_their_common_keywords():
    common = {"transform", "on_error", "limits", "store", "config"}
    for name, function in ENTRY_POINTS.items():
        assert common <= set(keywords(function)), name
    for name in ("from_prefix", "from_keys", "from_manifest", "from_shards", "from_parquet"):
        assert {"shuffle", "seed", "batch_size", "split"} <= set(keywords(getattr(AsyncS3Dataset, name)))


def test_limits_set_requests_in_flight_and_memory():
    ds = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=STORE, limits=Limits(concurrency=7, memory=64 << 20))
    assert ds.options.concurrency == 7 and ds.options.engine_limits("ordered").max_inflight == 7
    assert ds.options.limits.memory == 64 << 20 and ds.options.queue_bytes == 32 << 20  # half: the queue
    assert AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=STORE,
                                    limits=Limits(ordered=False)).options.limits.ordered is False


def test_concurrency_in_shard_mode_is_files_times_parts():
    ds = AsyncS3Dataset.from_shards("s3://bkt/s-{0..3}.tar", store=STORE, limits=Limits(concurrency=32))
    assert ds.source.shard_options.shards_inflight == 32 // DEFAULT_PARTS_INFLIGHT
    assert AsyncS3Dataset.from_shards("s3://bkt/s-{0..3}.tar", store=STORE,
                                      limits=Limits(concurrency=2)).source.shard_options.shards_inflight == 1


def test_split_store_and_reading_land_on_their_fields(tmp_path):
    retry = RetryPolicy(max_attempts=2)
    ds = AsyncS3Dataset.from_shards(
        "s3://bkt/s-{0..3}.tar", shuffle=True,
        split=Split(rank=1, world_size=2, pad="drop", samples_per_epoch=5, uneven_ranks=True),
        store=Store(backend=STORE, retry=retry, listing=ListOptions(page_size=10, concurrency=3),
                    cache=Cache(tmp_path, limit=1 << 30, validate="never")),
        reading=Reading(shuffle_buffer=10, part_size=2 << 20, chunk_size=1 << 20, index="s3://bkt/i.json"))
    o, s = ds.options, ds.source.shard_options
    assert (o.split.rank, o.split.world_size, o.split.pad) == (1, 2, "drop")
    assert o.store.retry == retry and o.store.listing == ListOptions(page_size=10, concurrency=3)
    assert o.store.cache == Cache(str(tmp_path), 1 << 30, "never")
    assert (s.samples_per_epoch, s.uneven_ranks) == (5, True)
    assert (s.shuffle_buffer, s.part_size, s.chunk_size, s.index) == (10, 2 << 20, 1 << 20, "s3://bkt/i.json")


def test_a_folder_is_a_cache_with_its_defaults(tmp_path):
    assert Store(cache=tmp_path).cache == Cache(tmp_path)
    assert Store(cache=str(tmp_path)).cache == Cache(str(tmp_path))


def test_a_backend_name_is_short_for_a_store():
    one = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store="aioboto3")
    other = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=Store(backend="aioboto3"))
    assert one.options.store == other.options.store


@pytest.mark.parametrize(("build", "match"), [
    (lambda: Limits(concurrency=0), r"Limits.concurrency=0"),
    (lambda: Limits(memory=1), r"Limits.memory=1 .*8 MiB"),
    (lambda: Split(pad="even"), r"Split.pad='even'"),
    (lambda: Store(cache=3), r"Store.cache=3"),
    (lambda: AsyncS3Dataset.from_keys("bkt", ["a"], store=STORE, limits={"concurrency": 3}),
     r"limits=.*loader.Limits"),
    (lambda: AsyncS3Dataset.from_keys("bkt", ["a"], store=STORE, split=Split(samples_per_epoch=3)),
     r"samples_per_epoch=\) is for shards and Parquet"),
    (lambda: AsyncS3Dataset.from_keys("bkt", ["a"], store=STORE, split=Split(uneven_ranks=True)),
     r"uneven_ranks=True\) is for shards"),
    (lambda: AsyncS3MapDataset.from_keys("bkt", ["a"], store=STORE, limits=Limits(memory=64 << 20)),
     r"only Limits\(concurrency=\)"),
    (lambda: AsyncS3MapDataset.from_keys("bkt", ["a"], store=STORE, shuffle=True),
     r"shuffle=True means nothing for AsyncS3MapDataset"),
])
def test_bad_groups_name_the_setting(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_in_flight'"):
        AsyncS3Dataset.from_keys("bkt", ["a"], store=STORE, max_in_flight=3)


def test_an_old_and_a_new_spelling_of_one_setting_conflict():
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="both given"):
        AsyncS3Dataset.from_keys("bkt", ["a"], store=STORE, limits=Limits(concurrency=3), max_inflight=4)


def test_parquet_row_groups_at_once_are_per_rank_unless_a_concurrency_is_given():
    pytest.importorskip("pyarrow")
    default = AsyncS3Dataset.from_parquet("s3://bkt/d/x.parquet", store=STORE)
    given = AsyncS3Dataset.from_parquet("s3://bkt/d/x.parquet", store=STORE, limits=Limits(concurrency=8))
    assert default.source._inflight_per_rank and not given.source._inflight_per_rank
    assert given.source.shard_options.shards_inflight == 8 // DEFAULT_PARTS_INFLIGHT
