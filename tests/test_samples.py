"""Per-object samples over the in-memory store: grouped stems, class folders, manifests with
labels, on_error for objects and transforms, and the sibling-prefix warning."""

from __future__ import annotations

import json
import pickle
import warnings
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, ConfigError, Limits, NoSuchKeyError, SampleError, Split

from fakes import FakeStore, reusable

BUCKET = "bucket"


def stems(n, prefix="imgs/", exts=("jpg", "cls")):
    """``n`` samples of one object per extension: ``{key: bytes}``."""
    return {f"{prefix}{i:05d}.{ext}": f"{ext}-{i}".encode() for i in range(n) for ext in exts}


def class_folders(per_class, classes=("dog", "cat", "Zebra"), root="train/"):
    return {f"{root}{name}/{i:03d}.jpg": f"{name}-{i}".encode()
            for name in classes for i in range(per_class)}


def store(objects, **options):
    return FakeStore.with_objects(BUCKET, objects, **options)


# --------------------------------------------------------------------------- grouping


def test_objects_sharing_a_stem_form_one_sample():
    objects = stems(5)
    fake = store(objects)
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(fake))
    samples = list(ds)
    assert len(ds) == len(samples) == 5
    assert samples[0] == {"__key__": "imgs/00000", "__url__": f"s3://{BUCKET}/imgs/00000.cls",
                          "cls": b"cls-0", "jpg": b"jpg-0"}
    assert fake.requests == 10  # every object once


def test_group_false_keeps_one_object_per_sample():
    fake = store(stems(3))
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(fake), group=False)
    assert len(ds) == 6 and all(len(s) == 3 for s in ds)


def test_the_parts_of_a_sample_are_fetched_concurrently():
    fake = store(stems(4, exts=("jpg", "cls", "json")), latency=0.05)
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(fake), limits=Limits(concurrency=1))
    assert len(list(ds)) == 4
    assert fake.peak_inflight == 3  # one sample at a time, its three GETs together


def test_default_collate_batches_grouped_samples():
    """The docs' plain ``DataLoader(ds, batch_size=...)`` needs every sample to have the same
    fields: grouping gives that (one object per sample gave ``KeyError: 'jpg'``)."""
    fake = store(stems(10))
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(fake))
    batches = list(DataLoader(ds, batch_size=4))
    assert [len(b["jpg"]) for b in batches] == [4, 4, 2]
    assert batches[0]["cls"] == [b"cls-0", b"cls-1", b"cls-2", b"cls-3"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 3), workers=st.integers(0, 3),
       seed=st.integers(0, 5), shuffle=st.booleans())
def test_grouped_samples_exactly_once_across_ranks_and_workers(n, world, workers, seed, shuffle):
    """The unit of partitioning is the sample: every stem goes to exactly one (rank, worker),
    whole, and ranks get equal lengths (padding repeats whole samples)."""
    objects = stems(n)
    fake = store(objects)
    keys = sorted(objects)
    got = []
    for rank in range(world):
        ds = AsyncS3Dataset.from_keys(BUCKET, keys, store=reusable(fake), shuffle=shuffle,
                                      seed=seed, split=Split(rank=rank, world_size=world, pad="drop"))
        for worker in range(max(1, workers)):
            with mock.patch("loader.topology.worker", return_value=(worker, workers)):
                got.extend(sample["__key__"] for sample in ds)
    assert len(got) == len(set(got)) == (n // world) * world
    assert set(got) <= {f"imgs/{i:05d}" for i in range(n)}


def test_resume_mid_epoch_with_grouped_samples_is_exactly_once():
    objects = stems(30)
    fake = store(objects)
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(objects), store=reusable(fake), shuffle=True,
                                  seed=4)
    ds.set_epoch(2)
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(11)]
    state = pickle.loads(pickle.dumps(ds.state_dict()))
    it.close()
    assert state["size"] == 30
    fresh = AsyncS3Dataset.from_keys(BUCKET, sorted(objects), store=reusable(fake), shuffle=True,
                                     seed=4)
    fresh.load_state_dict(state)
    rest = [s["__key__"] for s in fresh]
    assert sorted(first + rest) == [f"imgs/{i:05d}" for i in range(30)]


def test_resume_from_batches_counts_samples():
    objects = stems(20)
    fake = store(objects)
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(objects), store=reusable(fake), batch_size=4)
    with pytest.deprecated_call(match="resume_from_batches"):
        ds.resume_from_batches(epoch=0, batches_seen=2, batch_size=4)
    assert [s["__key__"] for s in ds] == [f"imgs/{i:05d}" for i in range(8, 20)]


def test_duplicate_field_is_rejected_at_construction():
    with pytest.raises(ConfigError, match=r"'a/1.jpg' and 'a/1.jpg' both give field 'jpg'"):
        AsyncS3Dataset.from_keys(BUCKET, ["a/1.jpg", "a/1.jpg"], store=reusable(store({})))


def test_hidden_objects_are_left_out_of_a_listing():
    objects = {**stems(2), "imgs/.DS_Store": b"x", "imgs/._00000.jpg": b"y"}
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(store(objects)))
    assert [s["__key__"] for s in ds] == ["imgs/00000", "imgs/00001"]


# --------------------------------------------------------------------------- class folders


def test_class_folders_label_samples_like_imagefolder():
    objects = class_folders(4)
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", label_from="parent",
                                    store=reusable(store(objects)), shuffle=True)
    assert ds.classes == ["Zebra", "cat", "dog"]
    assert ds.class_to_idx == {"Zebra": 0, "cat": 1, "dog": 2}
    samples = list(ds)
    assert len(samples) == 12
    for sample in samples:
        assert sample["cls"] == ds.class_to_idx[sample["__key__"].split("/")[1]]
    batch = next(iter(DataLoader(ds, batch_size=12)))
    assert batch["cls"].dtype.is_floating_point is False and batch["cls"].shape == (12,)


def test_an_object_outside_any_class_folder_is_named():
    objects = {**class_folders(1), "train/README.txt": b"hi"}
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", label_from="parent",
                                    store=reusable(store(objects)))
    with pytest.raises(ConfigError, match=r"'train/README.txt' is not in a class folder under "
                                          r"s3://bucket/train/"):
        len(ds)


def test_map_dataset_groups_and_labels():
    objects = {**class_folders(3), **{k.replace(".jpg", ".json"): b"{}"
                                      for k in class_folders(3)}}
    fake = store(objects)
    mds = AsyncS3MapDataset.from_prefix(f"s3://{BUCKET}/train/", label_from="parent",
                                        store=reusable(fake))
    try:
        assert len(mds) == 9 and mds.classes == ["Zebra", "cat", "dog"]
        batch = mds.__getitems__([8, 0, 8])
        assert [s["__key__"] for s in batch] == ["train/dog/002", "train/Zebra/000", "train/dog/002"]
        assert set(batch[0]) == {"__key__", "__url__", "jpg", "json", "cls"} and batch[0]["cls"] == 2
        assert mds[3]["cls"] == 1
    finally:
        mds.close()


# --------------------------------------------------------------------------- manifests


def test_csv_manifest_with_class_names(tmp_path):
    objects = class_folders(2)
    manifest = tmp_path / "train.csv"
    manifest.write_text("key,label\n" + "".join(
        f"s3://{BUCKET}/{key},{key.split('/')[1].upper()}\n" for key in sorted(objects)))
    ds = AsyncS3Dataset.from_manifest(str(manifest), store=reusable(store(objects)))
    assert ds.classes == ["CAT", "DOG", "ZEBRA"]
    assert {s["__key__"]: s["cls"] for s in ds}["train/dog/001"] == 1


def test_jsonl_manifest_with_integer_labels_and_grouping(tmp_path):
    objects = stems(3)
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("\n".join(json.dumps({"key": f"imgs/{i:05d}.jpg", "label": 10 + i})
                                  for i in range(3)) + "\n")
    only_jpg = {k: v for k, v in objects.items() if k.endswith(".jpg")}
    ds = AsyncS3Dataset.from_manifest(str(manifest), bucket=BUCKET, store=reusable(store(only_jpg)))
    assert ds.classes is None
    assert [(s["__key__"], s["cls"]) for s in ds] == [(f"imgs/{i:05d}", 10 + i) for i in range(3)]


def test_csv_integer_labels_and_rows_without_a_label(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("url,cls\ns3://bkt/a.jpg,3\ns3://bkt/a.json,\ns3://bkt/c.jpg,1\n")
    ds = AsyncS3Dataset.from_manifest(str(manifest), store=reusable(store({})))
    index = ds.samples()
    assert len(index) == 2 and list(index.labels) == [3, 1]


def test_manifest_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("path,label\na.jpg,1\n")
    with pytest.raises(ConfigError, match=r"bad.csv.*first row must name the columns"):
        AsyncS3Dataset.from_manifest(str(bad), bucket=BUCKET, store=reusable(store({})))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a.jpg"}\n{"k": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl' line 2"):
        AsyncS3Dataset.from_manifest(str(bad), bucket=BUCKET, store=reusable(store({})))


# --------------------------------------------------------------------------- on_error


def failing_transform(sample):
    if sample["__key__"].endswith("3"):
        raise ValueError("cannot decode")
    return sample["__key__"]


def test_from_prefix_accepts_on_error():
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", on_error="skip",
                                    store=reusable(store(stems(1))))
    assert ds.options.on_error == "skip"
    with pytest.raises(ConfigError, match=r"on_error='ignore' must be one of 'raise', 'skip', 'warn'"):
        AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", on_error="ignore")


def test_transform_error_raises_by_default():
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(stems(5)), store=reusable(store(stems(5))),
                                  transform=failing_transform)
    with pytest.raises(SampleError, match=r"imgs/00003"):
        list(ds)


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_transform_error_skips_the_sample_and_counts_it(on_error, recwarn):
    objects = stems(24)
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(objects), store=reusable(store(objects)),
                                  transform=failing_transform, on_error=on_error)
    got = list(ds)
    assert got == [f"imgs/{i:05d}" for i in range(24) if i % 10 != 3]
    assert ds.stats()["samples_skipped"] == 3 and ds.stats()["samples"] == 21
    warned = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == (3 if on_error == "warn" else 0)
    if warned:
        assert "imgs/00003" in str(warned[0].message) and "cannot decode" in str(warned[0].message)


def test_missing_object_skips_its_sample_and_counts_as_delivered():
    objects = stems(6)
    del objects["imgs/00002.cls"]
    fake = store(objects)
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(stems(6)), store=reusable(fake), on_error="skip")
    it = iter(ds)
    got = [next(it)["__key__"] for _ in range(4)]
    state = ds.state_dict()
    it.close()
    assert got == ["imgs/00000", "imgs/00001", "imgs/00003", "imgs/00004"]
    assert state["delivered"][0] == 5, "the skipped sample is done, not retried on resume"
    with pytest.raises(NoSuchKeyError, match=r"imgs/00002.cls"):
        list(AsyncS3Dataset.from_keys(BUCKET, sorted(stems(6)), store=reusable(fake)))


def test_shards_take_skip_as_well_as_the_old_name():
    for name in ("skip", "skip_shard"):
        ds = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/s-0.tar", on_error=name,
                                        store=reusable(store({})))
        assert ds.options.on_error == "skip"


def test_map_dataset_skips_within_a_batch():
    objects = stems(6)
    del objects["imgs/00004.jpg"]
    keys = sorted(stems(6))
    mds = AsyncS3MapDataset.from_keys(BUCKET, keys, store=reusable(store(objects)), on_error="skip",
                                      transform=failing_transform)
    try:
        assert mds.__getitems__(list(range(6))) == ["imgs/00000", "imgs/00001", "imgs/00002",
                                                     "imgs/00005"]
        with pytest.raises(NoSuchKeyError):
            mds[4]
    finally:
        mds.close()


# --------------------------------------------------------------------------- sibling prefixes


def test_prefix_without_slash_warns_once_naming_siblings():
    objects = {**stems(2), "imgs-shards/s-0.tar": b"t", "imgs.txt": b"n"}
    fake = store(objects)
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs", store=reusable(fake), group=False)
    with pytest.warns(UserWarning, match=r"s3://bucket/imgs has no trailing slash.*"
                                         r"'imgs-shards/', 'imgs.txt'.*write s3://bucket/imgs/ "):
        ds.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.set_epoch(1)
        assert len(list(ds)) == 6
        AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/", store=reusable(fake)).resolve()
        AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/imgs/0000", store=reusable(fake)).resolve()
