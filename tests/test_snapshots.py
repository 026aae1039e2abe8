"""Listing snapshots over the in-memory store: written once, read back without a LIST, never stale."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, Cache, ConfigError, NoSuchKeyError, Store
from loader.errors import ObjectChangedError
from loader.listing.keyfile import read_header

from fakes import FakeStore, payloads, reusable

BUCKET = "bucket"


@pytest.fixture
def fake():
    return FakeStore.with_objects(BUCKET, {**payloads(12), "train/.DS_Store": b"x"}, page_size=5)


def keys_read(dataset) -> list[str]:
    return sorted(sample["__key__"] for sample in dataset)


def test_the_first_listing_is_saved_and_later_datasets_read_it_without_listing(fake, tmp_path):
    path = tmp_path / "train.keys"
    first = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(path), store=reusable(fake))
    expected = keys_read(first)
    assert fake.list_requests == 3 and path.exists()
    header = read_header(path)
    assert header.uri == f"s3://{BUCKET}/train/" and header.count == 13, "the raw listing is kept"
    for again in (AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(path),
                                             store=reusable(fake)),
                  AsyncS3Dataset.from_manifest(str(path), store=reusable(fake))):
        assert keys_read(again) == expected and len(again.keys()) == 12, "hidden objects left out"
    mapped = AsyncS3MapDataset.from_manifest(str(path), store=reusable(fake))
    loader = DataLoader(mapped, batch_size=4, collate_fn=lambda batch: [s["__key__"] for s in batch])
    assert sorted(key for batch in loader for key in batch) == expected
    assert fake.list_requests == 3, "no LIST after the first"


def test_a_snapshot_of_another_prefix_or_bucket_is_refused(fake, tmp_path):
    path = tmp_path / "train.keys"
    AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(path), store=reusable(fake)).keys()
    other = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/val/", snapshot=str(path), store=reusable(fake))
    with pytest.raises(ConfigError, match=r"was listed from s3://bucket/train/, not s3://bucket/val/"):
        other.keys()
    with pytest.raises(ConfigError, match=r"lists bucket 'bucket', not 'elsewhere'"):
        AsyncS3Dataset.from_manifest(str(path), bucket="elsewhere")
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match=r"exists but is not a listing snapshot"):
        AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(tmp_path / "notes.txt"))


def test_objects_replaced_or_deleted_since_the_snapshot_are_errors_not_other_bytes(fake, tmp_path):
    path = tmp_path / "train.keys"
    AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(path), store=reusable(fake)).keys()
    fake.objects[BUCKET, "train/000003.bin"] = b"another version"
    replaced = AsyncS3Dataset.from_manifest(str(path), store=reusable(fake))
    with pytest.raises(ObjectChangedError, match=r"train/000003.bin"):
        keys_read(replaced)
    del fake.objects[BUCKET, "train/000003.bin"]
    with pytest.raises(NoSuchKeyError, match=r"train/000003.bin was deleted after the listing snapshot was "
                                             r"saved .* save a new one \(`loader ls --save`"):
        keys_read(AsyncS3Dataset.from_manifest(str(path), store=reusable(fake)))
    skipping = AsyncS3Dataset.from_manifest(str(path), store=reusable(fake), on_error="skip")
    assert len(keys_read(skipping)) == 11
    mapped = AsyncS3MapDataset.from_manifest(str(path), store=reusable(fake))
    fake.objects[BUCKET, "train/000005.bin"] = b"changed too"
    position = list(mapped.keys()).index("train/000005.bin")
    with pytest.raises(ObjectChangedError, match=r"train/000005.bin"):
        mapped[position]


def test_a_fresh_listing_is_not_pinned(fake):
    dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", store=reusable(fake))
    dataset.keys()
    fake.objects[BUCKET, "train/000003.bin"] = b"another version"
    samples = {s["__key__"]: s["bin"] for s in dataset}
    assert samples["train/000003"] == b"another version", "as before: the current object"


def test_a_disk_cache_serves_only_the_version_the_snapshot_recorded(fake, tmp_path):
    path, cache = tmp_path / "train.keys", tmp_path / "cache"
    options = dict(store=Store(backend=reusable(fake), cache=Cache(str(cache))))
    AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", snapshot=str(path), **options).keys()
    old = fake.objects[BUCKET, "train/000003.bin"]
    assert len(keys_read(AsyncS3Dataset.from_manifest(str(path), **options))) == 12  # cache filled
    fake.objects[BUCKET, "train/000003.bin"] = b"another version"
    cached = {s["__key__"]: s["bin"] for s in AsyncS3Dataset.from_manifest(str(path), **options)}
    assert cached["train/000003"] == old, "the cached copy is the snapshot's version"
    fresh = {s["__key__"]: s["bin"] for s in AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", **options)}
    assert fresh["train/000003"] == b"another version", "a fresh listing refills the cache"
    with pytest.raises(ObjectChangedError, match=r"train/000003.bin was replaced after the listing"):
        keys_read(AsyncS3Dataset.from_manifest(str(path), **options))


def test_ls_save_refuses_a_directory_or_a_foreign_file_before_listing(tmp_path):
    from loader.config import S3Config
    from loader.tools.ls import list_uri

    nowhere = S3Config(endpoint_url="http://127.0.0.1:1", access_key_id="k", secret_access_key="s")
    with pytest.raises(ConfigError, match=r"--save '.*' is a directory; give a file path"):
        list_uri("s3://bucket/train/", config=nowhere, save=str(tmp_path))
    notes = tmp_path / "notes.txt"
    notes.write_text("not a listing\n")
    with pytest.raises(ConfigError, match=r"--save '.*notes\.txt' exists but is not a listing snapshot"):
        list_uri("s3://bucket/train/", config=nowhere, save=str(notes))


def test_a_snapshot_keeps_how_keys_group_into_samples_so_reading_it_back_groups_nothing(fake, tmp_path, monkeypatch):
    """Grouping keys into samples goes over every key (~0.6 s at 10^6): a snapshot keeps the
    result beside the keys, and a dataset reading it back takes it from there, equal to what
    grouping the keys again gives (objects of one sample: a photo and its class file)."""
    from loader.datasets import object_samples
    from loader.listing import keyfile

    paired = FakeStore.with_objects(BUCKET, {f"pairs/{i:03d}.{ext}": b"%d" % i for i in range(7)
                                             for ext in ("jpg", "cls")})
    for store, prefix, count in ((fake, "train/", 12), (paired, "pairs/", 7)):
        path = tmp_path / f"{prefix[:-1]}.keys"
        first = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/{prefix}", snapshot=str(path), store=reusable(store))
        grouped = first.source.samples()
        notes = keyfile.origin(keyfile.open_keys(path)).notes
        if prefix == "train/":  # a hidden object: counted, and the samples left to group again
            assert notes["hidden"][0] == 1 and object_samples.STARTS_NOTE not in notes
            continue
        assert notes["hidden"][0] == 0 and object_samples.STARTS_NOTE in notes

        def no_grouping(keys):
            raise AssertionError("the keys were grouped again")

        with monkeypatch.context() as patch:
            patch.setattr(object_samples, "_groups", no_grouping)
            again = AsyncS3Dataset.from_manifest(str(path), store=reusable(store))
            index = again.source.samples()
        assert len(index) == count == len(grouped)
        assert [index.objects(i) for i in range(count)] == [grouped.objects(i) for i in range(count)]
        assert sorted(sample["__key__"] for sample in again) == [f"pairs/{i:03d}" for i in range(7)]
        assert {tuple(sorted(k for k in s if not k.startswith("__"))) for s in again} == {("cls", "jpg")}
