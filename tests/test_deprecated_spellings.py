"""Every flat spelling of earlier releases still works for one release: it warns with a
DeprecationWarning that names its new spelling, and its value lands where it always did (and,
where the new spelling says the same thing, where the new spelling puts it). The list is
``groups.DEPRECATED``; these tests walk it, so a spelling cannot be added untested."""

from __future__ import annotations

import argparse
import copy
import pickle
import re

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
from loader.datasets.groups import DEPRECATED, LANDS

from fakes import FakeStore, reusable

STORE = reusable(FakeStore({}))
RETRY = RetryPolicy(max_attempts=2)
LISTING = ListOptions(page_size=10)
SHARDS = "s3://bkt/s-{0..3}.tar"

# old keyword -> (a value, the new spelling's keywords saying the same, or None where the new
# spelling derives it instead)
CASES = {
    "max_inflight": (7, {"limits": Limits(concurrency=7)}),
    "memory_budget": (64 << 20, {"limits": Limits(memory=64 << 20)}),
    "queue_bytes": (1 << 20, None),
    "queue_items": (10, None),
    "ordered": (False, {"limits": Limits(ordered=False)}),
    "rank": (1, None),
    "world_size": (2, None),
    "pad_policy": ("drop", {"split": Split(pad="drop")}),
    "retry": (RETRY, {"store": Store(backend=STORE, retry=RETRY)}),
    "listing": (LISTING, {"store": Store(backend=STORE, listing=LISTING)}),
    "cache_dir": ("CACHE", None),
    "cache_limit": (1 << 30, None),
    "cache_validate": ("never", None),
    "log_stats": (True, None),
    "shards_inflight": (3, {"limits": Limits(concurrency=12)}),
    "parts_inflight": (2, None),
    "shuffle_buffer": (10, {"reading": Reading(shuffle_buffer=10)}),
    "shuffle_bytes": (1 << 20, None),
    "part_size": (2 << 20, {"reading": Reading(part_size=2 << 20)}),
    "chunk_size": (1 << 19, {"reading": Reading(chunk_size=1 << 19)}),
    "index": ("s3://bkt/i.json", {"reading": Reading(index="s3://bkt/i.json")}),
    "samples_per_epoch": (5, {"split": Split(samples_per_epoch=5)}),
    "uneven_ranks": (True, {"split": Split(uneven_ranks=True)}),
    "row_groups_inflight": (3, {"limits": Limits(concurrency=12)}),
}
NEEDS = {"rank": {"world_size": 2}, "world_size": {"rank": 1}, "cache_limit": {"cache_dir": "CACHE"},
         "cache_validate": {"cache_dir": "CACHE"}, "queue_bytes": {}, "shuffle_bytes": {"shuffle": True}}


def build(mode: str, **keywords):
    base = {} if isinstance(keywords.get("store"), Store) else {"store": STORE}
    if mode == "objects":
        return AsyncS3Dataset.from_keys("bkt", ["a.jpg"], **base, **keywords)
    if mode == "shards":
        return AsyncS3Dataset.from_shards(SHARDS, **base, **keywords)
    if mode == "parquet":
        pytest.importorskip("pyarrow")
        return AsyncS3Dataset.from_parquet("s3://bkt/d/x.parquet", **base, **keywords)
    if mode == "map":
        return AsyncS3MapDataset.from_keys("bkt", ["a.jpg"], **base, **keywords)
    parts = {"a": AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=STORE)}
    return mix(parts, **base, **keywords)


def landed(dataset, name: str):
    """Where ``LANDS`` says the old spelling's value goes (``reading``: the source's ShardOptions)."""
    group, field = LANDS[name]
    options = dataset.options
    shard_options = getattr(dataset.source, "shard_options", None)
    where = {"options": options, "limits": options.limits, "split": options.split, "store": options.store,
             "cache": options.store.cache, "reading": shard_options}[group]
    value = getattr(where, field)
    return str(value) if group == "cache" and field == "dir" else value


@pytest.mark.parametrize(("mode", "name"), [(mode, name) for mode, names in DEPRECATED.items()
                                            for name in names])
def test_an_old_spelling_warns_naming_the_new_one_and_lands_where_it_did(mode, name, tmp_path):
    value, new = CASES[name]
    if value == "CACHE":
        value = str(tmp_path)
    others = {k: (str(tmp_path) if v == "CACHE" else v) for k, v in NEEDS.get(name, {}).items()}
    with pytest.warns(DeprecationWarning) as caught:
        dataset = build(mode, **{name: value}, **others)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(m.startswith(f"{name}= is deprecated") and DEPRECATED[mode][name] in m for m in messages), messages
    assert {w.filename for w in caught if str(w.message).startswith(f"{name}=")} == {__file__}  # the caller's line
    assert landed(dataset, name) == value
    if new is not None and (name, mode in ("shards", "parquet")) != ("max_inflight", True):
        # (shards and Parquet read concurrency as files at once: shards_inflight, tested above)
        assert landed(build(mode, **new), name) == value


def test_every_old_spelling_is_tested():
    assert {name for names in DEPRECATED.values() for name in names} <= set(CASES)


def test_list_options_parallel_is_concurrency():
    with pytest.warns(DeprecationWarning, match=re.escape("ListOptions(concurrency=...)")):
        old = ListOptions(parallel=3)
    assert old == ListOptions(concurrency=3)


def test_a_cache_folder_as_before_and_as_a_cache_are_one(tmp_path):
    with pytest.warns(DeprecationWarning, match=re.escape("store=Store(cache=Cache(dir=...))")):
        old = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=STORE, cache_dir=tmp_path)
    new = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=Store(backend=STORE, cache=Cache(tmp_path)))
    assert old.options.store.cache == new.options.store.cache
    assert old.options.store.cache.dir == str(tmp_path)


@pytest.mark.parametrize("entry", ["from_keys", "from_shards", "from_parquet"])
def test_a_cache_where_a_store_goes_names_the_store_it_belongs_in(entry, tmp_path):
    what = {"from_keys": ("bkt", ["a.jpg"]), "from_shards": ("s3://bkt/s-{0..1}.tar",),
            "from_parquet": ("s3://bkt/pq/",)}[entry]
    with pytest.raises(ConfigError, match=re.escape("a Cache goes inside a Store; pass store=Store(cache=Cache(...))")):
        getattr(AsyncS3Dataset, entry)(*what, store=Cache(tmp_path))


def test_resume_from_batches_is_resume_over_samples_seen():
    ds = AsyncS3Dataset.from_keys("bkt", [f"{i}.jpg" for i in range(20)], store=STORE, batch_size=2,
                                  split=Split(rank=0, world_size=2))
    with pytest.warns(DeprecationWarning, match=re.escape("resume(epoch=, samples_seen=ds.samples_seen(")):
        ds.resume_from_batches(1, 3, 2)
    other = AsyncS3Dataset.from_keys("bkt", [f"{i}.jpg" for i in range(20)], store=STORE, batch_size=2,
                                     split=Split(rank=0, world_size=2))
    other.resume(epoch=1, samples_seen=3 * 2 * 2)
    assert (ds.epoch, len(ds)) == (other.epoch, len(other))


@pytest.mark.parametrize(("module", "argv", "dest", "value"), [
    ("index", ["index", "s3://bkt/s.tar", "--force"], "overwrite", True),
    ("cli", ["bench", "s3://bkt/p/", "--max-inflight", "9"], "concurrency", 9),
    ("cli", ["shard", "s3://bkt/src/", "s3://bkt/dst/", "--max-inflight", "9"], "max_inflight", 9),
    ("index", ["index", "s3://bkt/s.tar", "--parts-inflight", "3"], "parts_inflight", 3),
])
def test_old_cli_flags_warn_and_set_the_new_one(module, argv, dest, value, capsys):
    from loader.tools.cli import build_parser

    with pytest.warns(DeprecationWarning, match="deprecated .* use --"):
        args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    assert "is deprecated" in capsys.readouterr().err
    assert isinstance(args, argparse.Namespace)


def test_loader_options_at_the_top_level_warns_naming_the_option_groups():
    import loader
    from loader.datasets.options import LoaderOptions

    with pytest.warns(DeprecationWarning, match=r"loader.LoaderOptions is deprecated .*\(Limits, Split, Store"):
        assert loader.LoaderOptions is LoaderOptions
    assert "LoaderOptions" not in loader.__all__ and "LoaderOptions" not in dir(loader)


@pytest.mark.parametrize("cls", [AsyncS3Dataset, AsyncS3MapDataset])
def test_building_a_dataset_from_init_keywords_warns_naming_the_constructors(cls):
    """One way to build each dataset: its constructors. ``__init__``'s keywords, the second way,
    still build the same dataset for one release, with a warning that names them."""
    from loader.datasets.options import LoaderOptions

    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\(bucket=, .*\.from_keys\(bucket, keys\)") as caught:
        old = cls(bucket="bkt", keys=["a.jpg", "b.jpg"], options=LoaderOptions(store=STORE))
    assert {w.filename for w in caught if issubclass(w.category, DeprecationWarning)} == {__file__}
    new = cls.from_keys("bkt", ["a.jpg", "b.jpg"], store=STORE)
    assert list(old.keys()) == list(new.keys()) == ["a.jpg", "b.jpg"]
    assert ("from_shards" in str(caught[0].message)) == (cls is AsyncS3Dataset)


def test_no_module_of_the_package_builds_a_dataset_with_an_old_spelling():
    """What the package runs itself (``loader demo``, examples) shows users the current names."""
    import ast
    from pathlib import Path

    import loader

    entry = {"from_prefix": "objects", "from_keys": "objects", "from_shards": "shards",
             "from_parquet": "parquet", "mix": "mix"}
    found = []
    for path in sorted(Path(loader.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in entry:
                found += [f"{path.name}:{node.lineno}: {name}({word.arg}=)" for word in node.keywords
                          if word.arg in DEPRECATED[entry[name]]]
    assert found == []


def test_the_flat_record_of_earlier_releases_converts_once_to_the_groups(tmp_path):
    """``LoaderOptions(...)`` is only the old spelling: what it gives is the record a constructor
    builds from the groups, and that record holds the groups, not a flat copy of their fields."""
    import dataclasses

    from loader.datasets.options import LoaderOptions, Options, dataset_options

    old = LoaderOptions(store=STORE, max_inflight=7, memory_budget=64 << 20, rank=1, world_size=2,
                        pad_policy="drop", retry=RETRY, cache_dir=tmp_path, cache_limit=1 << 30, shuffle=True)
    new, _ = dataset_options("objects", shuffle=True, limits=Limits(concurrency=7, memory=64 << 20),
                             split=Split(rank=1, world_size=2, pad="drop"),
                             store=Store(backend=STORE, retry=RETRY, cache=Cache(tmp_path, limit=1 << 30)))
    assert isinstance(old, Options) and old == new
    assert old.limits == Limits(concurrency=7, memory=64 << 20) and old.queue_bytes == 32 << 20
    fields = {field.name for field in dataclasses.fields(Options)}
    assert not fields & {"max_inflight", "memory_budget", "rank", "world_size", "pad_policy", "retry",
                         "listing", "cache_dir", "cache_limit", "cache_validate", "ordered"}


def test_an_old_and_a_new_spelling_of_one_setting_are_refused_together(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"max_inflight=7 and its new spelling"):
        AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=STORE, limits=Limits(concurrency=8), max_inflight=7)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"cache_dir=.* and its new spelling"):
        AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=Store(backend=STORE, cache=tmp_path / "new"),
                                 cache_dir=tmp_path / "old")


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_a_bad_value_in_an_old_spelling_is_named_as_given_with_the_group_that_takes_it(mode):
    with pytest.warns(DeprecationWarning), pytest.raises(
            ConfigError, match=r"^max_inflight=0 must be what limits=Limits\(concurrency=\.\.\.\) takes: "
                               r"Limits\.concurrency=0 must be a positive integer"):
        build(mode, max_inflight=0)


def test_a_flat_field_of_the_old_record_still_reads_with_a_warning(tmp_path):
    ds = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store=Store(backend=STORE, cache=Cache(tmp_path)),
                                  limits=Limits(memory=64 << 20), split=Split(rank=1, world_size=2))
    for name, value, where in [("max_inflight", 64, "options.limits.concurrency"),
                               ("memory_budget", 64 << 20, "options.limits.memory"),
                               ("rank", 1, "options.split.rank"), ("pad_policy", "pad", "options.split.pad"),
                               ("retry", RetryPolicy(), "options.store.retry"),
                               ("cache_dir", str(tmp_path), "options.store.cache.dir")]:
        message = re.escape(f"options.{name} is deprecated") + ".*" + re.escape(where)
        with pytest.warns(DeprecationWarning, match=message):
            assert getattr(ds.options, name) == value
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        ds.options.nonsense  # noqa: B018
    named = AsyncS3Dataset.from_keys("bkt", ["a.jpg"], store="aioboto3", limits=Limits(memory=64 << 20)).options
    assert pickle.loads(pickle.dumps(named)) == copy.deepcopy(named) == named  # what workers get
