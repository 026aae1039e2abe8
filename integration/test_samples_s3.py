"""Per-object samples on a real S3 server: stems grouped into one sample, class folders as
labels (nested ones as ``ImageFolder`` reads them), manifests with a label column, on_error and
the sibling-prefix warning, exactly once with and without DataLoader workers; files without an
extension read alike in per-object and shard mode."""

from __future__ import annotations

import io
import json
import tarfile
import warnings

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, ConfigError, Limits

from datasets import make_jpeg, sha256, upload_objects

STEMS = 150
CLASSES = ("dog", "cat", "Zebra", "ant")
PER_CLASS = 25


@pytest.fixture(scope="module")
def bucket(s3_server):
    """``imgs/NNNNN.jpg`` + ``.cls`` + ``.json`` per stem, ``imgs-shards/`` beside them (a
    sibling that ``s3://b/imgs`` also matches) and ``train/<class>/NNN.jpg`` class folders."""
    name = s3_server.new_bucket()
    items = {}
    for i in range(STEMS):
        items[f"imgs/{i:05d}.jpg"] = make_jpeg(i)
        items[f"imgs/{i:05d}.cls"] = str(i % 7).encode()
        items[f"imgs/{i:05d}.json"] = json.dumps({"i": i}).encode()
    items["imgs-shards/train-0000.tar"] = b"not read here"
    for c, label in enumerate(CLASSES):
        for i in range(PER_CLASS):
            items[f"train/{label}/{i:03d}.jpg"] = make_jpeg(1000 + c * PER_CLASS + i)
    items["train/.DS_Store"] = b"hidden"
    upload_objects(s3_server.minio, name, items)
    return name, {key: sha256(data) for key, data in items.items()}


def loader_options(num_workers):
    return {"num_workers": num_workers, "timeout": 120 if num_workers else 0}


def summary(sample):
    """Runs in the workers (module level, so any start method can pickle it)."""
    return {"key": sample["__key__"], "jpg": sha256(sample["jpg"]),
            "cls": sample["cls"] if isinstance(sample["cls"], int) else int(sample["cls"]),
            "json": json.loads(sample["json"])["i"] if "json" in sample else None}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_grouped_stems_exactly_once(s3_server, bucket, num_workers):
    name, digests = bucket
    ds = AsyncS3Dataset.from_prefix(f"s3://{name}/imgs/", shuffle=True, seed=1, limits=Limits(concurrency=16),
                                    transform=summary, config=s3_server.config)
    assert len(ds) == STEMS
    got = list(DataLoader(ds, batch_size=None, **loader_options(num_workers)))
    keys = [s["key"] for s in got]
    assert len(keys) == len(set(keys)) == STEMS
    for s in got:
        i = int(s["key"].rsplit("/", 1)[1])
        assert s["jpg"] == digests[f"{s['key']}.jpg"] and s["cls"] == i % 7 and s["json"] == i
    stats = ds.stats()  # three GETs a stem, and a hedge for any slow under the suite's load
    assert stats["samples"] == STEMS and stats["requests"] - stats["hedged"] == 3 * STEMS, stats


@pytest.mark.parametrize("num_workers", [0, 2])
def test_class_folders_exactly_once_in_collated_batches(s3_server, bucket, num_workers):
    """The docs' plain ``DataLoader(ds, batch_size=...)``: default collate, labels as a tensor."""
    name, digests = bucket
    ds = AsyncS3Dataset.from_prefix(f"s3://{name}/train/", label_from="parent", shuffle=True,
                                    config=s3_server.config)
    assert ds.classes == sorted(CLASSES) and len(ds) == len(CLASSES) * PER_CLASS
    seen = {}
    for batch in DataLoader(ds, batch_size=16, **loader_options(num_workers)):
        assert batch["cls"].dtype.is_floating_point is False
        for key, label, jpg in zip(batch["__key__"], batch["cls"].tolist(), batch["jpg"]):
            assert key not in seen
            seen[key] = label
            assert sha256(jpg) == digests[f"{key}.jpg"]
    assert len(seen) == len(CLASSES) * PER_CLASS
    assert all(ds.classes[label] == key.split("/")[1] for key, label in seen.items())


def test_map_dataset_grouped_across_workers(s3_server, bucket):
    name, _ = bucket
    mds = AsyncS3MapDataset.from_prefix(f"s3://{name}/imgs/", transform=summary,
                                        config=s3_server.config)
    assert len(mds) == STEMS
    got = [s for batch in DataLoader(mds, batch_size=32, shuffle=True, collate_fn=list,
                                     **loader_options(2)) for s in batch]
    assert sorted(s["json"] for s in got) == list(range(STEMS))
    mds.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_manifest_labels_and_missing_objects_skipped(s3_server, bucket, tmp_path, num_workers):
    name, _ = bucket
    manifest = tmp_path / "train.jsonl"
    rows = [{"key": f"s3://{name}/train/{label}/{i:03d}.jpg", "label": label}
            for label in CLASSES for i in range(0, PER_CLASS, 5)]
    rows.insert(3, {"key": f"s3://{name}/train/dog/gone.jpg", "label": "dog"})
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ds = AsyncS3Dataset.from_manifest(str(manifest), on_error="skip", config=s3_server.config)
    got = list(DataLoader(ds, batch_size=None, **loader_options(num_workers)))
    assert sorted(s["__key__"] for s in got) == sorted(r["key"][len(f"s3://{name}/"):-4]
                                                        for r in rows if "gone" not in r["key"])
    assert all(ds.classes[s["cls"]] == s["__key__"].split("/")[1] for s in got)
    stats = ds.stats()
    assert stats["samples_skipped"] == 1 and stats["samples"] == len(rows) - 1


def fails_on_seven(sample):
    if sample["__key__"].endswith("7"):
        raise ValueError("bad sample")
    return sample["__key__"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_errors_skipped_and_counted_across_workers(s3_server, bucket, num_workers):
    name, _ = bucket
    ds = AsyncS3Dataset.from_prefix(f"s3://{name}/imgs/", transform=fails_on_seven,
                                    on_error="skip", config=s3_server.config)
    got = list(DataLoader(ds, batch_size=None, **loader_options(num_workers)))
    assert sorted(got) == [f"imgs/{i:05d}" for i in range(STEMS) if i % 10 != 7]
    assert ds.stats()["samples_skipped"] == STEMS // 10


def test_prefix_without_slash_warns_naming_the_sibling(s3_server, bucket):
    name, _ = bucket
    ds = AsyncS3Dataset.from_prefix(f"s3://{name}/imgs", config=s3_server.config)
    with pytest.warns(UserWarning, match=r"also matched 1 sibling name.*'imgs-shards/'.*"
                                         rf"write s3://{name}/imgs/ to read only that folder"):
        ds.resolve()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AsyncS3Dataset.from_prefix(f"s3://{name}/imgs/", config=s3_server.config).resolve()


def tar_of(members: dict[str, bytes]) -> bytes:
    """A tar archive written by Python's ``tarfile`` (another tool than ours), members in order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def fields(sample):
    """Module level, so spawned workers can pickle it."""
    return {key: value for key, value in sample.items() if key not in ("__url__", "__index__")}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_files_without_extension_are_data_fields_in_both_modes(s3_server, num_workers):
    """``a.txt``, ``noext``, ``c.txt`` as objects and as members of one shard: three samples in
    each mode, the one without an extension in the field ``"data"``, nothing dropped."""
    name = s3_server.new_bucket("noext")
    members = {"set/a.txt": b"A", "set/noext": b"no extension", "set/c.txt": b"C", "set/d.": b"dot"}
    upload_objects(s3_server.minio, name, {**members, "shards/s-0.tar": tar_of(members)})
    expected = [{"__key__": "set/a", "txt": b"A"}, {"__key__": "set/c", "txt": b"C"},
                {"__key__": "set/d", "data": b"dot"}, {"__key__": "set/noext", "data": b"no extension"}]
    for dataset in (AsyncS3Dataset.from_prefix(f"s3://{name}/set/", transform=fields, config=s3_server.config),
                    AsyncS3Dataset.from_shards(f"s3://{name}/shards/", transform=fields,
                                               config=s3_server.config)):
        got = list(DataLoader(dataset, batch_size=None, **loader_options(num_workers)))
        assert sorted(got, key=lambda s: s["__key__"]) == expected, dataset.mode


@pytest.mark.parametrize("num_workers", [0, 2])
def test_class_folders_with_subfolders_follow_imagefolder(s3_server, num_workers):
    """``cat/sub/e.jpg`` belongs to ``cat`` and ``dog/sub/d.jpg`` to ``dog``: two classes, as
    torchvision's ``ImageFolder`` reads the same tree; with or without the prefix's slash."""
    name = s3_server.new_bucket("nested")
    tree = {"pets/cat/a.jpg": "cat", "pets/cat/sub/e.jpg": "cat", "pets/cat/kitten/f.jpg": "cat",
            "pets/dog/sub/d.jpg": "dog", "pets/dog/b.jpg": "dog"}
    upload_objects(s3_server.minio, name, {key: make_jpeg(i) for i, key in enumerate(tree)})
    for uri in (f"s3://{name}/pets/", f"s3://{name}/pets"):
        ds = AsyncS3Dataset.from_prefix(uri, label_from="parent", shuffle=True, config=s3_server.config)
        assert ds.classes == ["cat", "dog"] and ds.class_to_idx == {"cat": 0, "dog": 1}
        got = {key: ds.classes[label] for batch in DataLoader(ds, batch_size=2, **loader_options(num_workers))
               for key, label in zip(batch["__key__"], batch["cls"].tolist())}
        assert got == {key[:-4]: cls for key, cls in tree.items()}
    upload_objects(s3_server.minio, name, {"pets/README.jpg": make_jpeg(99)})
    with pytest.raises(ConfigError, match=rf"'pets/README.jpg' is not in a class folder under s3://{name}/pets/"):
        AsyncS3Dataset.from_prefix(f"s3://{name}/pets/", label_from="parent", config=s3_server.config).resolve()
