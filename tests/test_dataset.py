"""AsyncS3Dataset in per-object mode over the in-memory store: shares, order, errors, resume."""

from __future__ import annotations

import contextlib
import gc
import itertools
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, EmptyDatasetError, Limits, SampleError, Split
from loader.datasets.partition import SMALL_ORDER
from loader.engine.fetch import live_engines

from fakes import FakeStore, payloads, reusable

BUCKET = "bucket"


def dataset(n=100, **options):
    objects = payloads(n, size=64)
    fake = FakeStore.with_objects(BUCKET, objects)
    options.setdefault("store", reusable(fake))
    return AsyncS3Dataset.from_keys(BUCKET, sorted(objects), **options), objects, fake


def keys_of(samples):
    return [sample["__key__"] for sample in samples]


def test_samples_are_webdataset_dicts_in_key_order():
    ds, objects, _ = dataset(20)
    samples = list(ds)
    assert keys_of(samples) == [key.rsplit(".", 1)[0] for key in sorted(objects)]
    first = samples[0]
    assert first["__url__"] == f"s3://{BUCKET}/train/000000.bin"
    assert first["bin"] == objects["train/000000.bin"]
    assert set(first) == {"__key__", "__url__", "bin"}


def test_from_prefix_lists_once_and_reads_everything():
    objects = payloads(30)
    fake = FakeStore.with_objects(BUCKET, {**objects, "other/x.bin": b"x"}, page_size=7)
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", store=reusable(fake))
    assert len(ds) == 30
    lists = fake.list_requests
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sorted(s["__key__"] for s in ds) == sorted(k[:-4] for k in objects)
    assert fake.list_requests == lists, "the listing must happen once, not per epoch"


def test_empty_prefix_is_a_clear_error():
    fake = FakeStore.with_objects(BUCKET, payloads(3))
    ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/nothing-here/", store=reusable(fake))
    with pytest.raises(EmptyDatasetError, match=r"no objects under s3://bucket/nothing-here/"):
        list(ds)


def test_shuffle_is_deterministic_per_seed_and_epoch():
    ds, _, _ = dataset(200, shuffle=True, seed=7)
    ds.set_epoch(0)
    first = keys_of(ds)
    assert keys_of(ds) == first, "same seed and epoch, same order"
    ds.set_epoch(1)
    second = keys_of(ds)
    assert second != first and sorted(second) == sorted(first)
    again, _, _ = dataset(200, shuffle=True, seed=7)
    again.set_epoch(1)
    assert keys_of(again) == second
    other, _, _ = dataset(200, shuffle=True, seed=8)
    other.set_epoch(1)
    assert keys_of(other) != second


@pytest.mark.parametrize("num_workers", [2, 4])
def test_dataloader_workers_take_disjoint_complete_shares(num_workers):
    ds, objects, _ = dataset(101, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers, multiprocessing_context="fork")
    got = [sample["__key__"] for sample in loader]
    assert sorted(got) == sorted(k[:-4] for k in objects)
    assert len(got) == len(set(got))


def test_ranks_split_the_epoch_with_equal_lengths():
    shares = []
    for rank in range(3):
        ds, objects, _ = dataset(100, shuffle=True, seed=3, split=Split(rank=rank, world_size=3))
        assert len(ds) == 34
        shares.append(keys_of(ds))
    assert {len(share) for share in shares} == {34}
    flat = list(itertools.chain(*shares))
    assert set(flat) == {k[:-4] for k in objects}
    assert len(flat) - len(set(flat)) == 2, "pad policy repeats exactly the remainder"


def test_transform_errors_name_the_key_and_keep_the_cause():
    def explode(sample):
        if sample["__key__"].endswith("07"):
            raise ValueError("bad pixels")
        return sample["__key__"]

    ds, _, _ = dataset(20, transform=explode)
    seen = []
    with pytest.raises(SampleError, match=r"s3://bucket/train/000007\.bin.*bad pixels") as info:
        for item in ds:
            seen.append(item)
    assert isinstance(info.value.__cause__, ValueError)
    assert len(seen) == 7
    gc.collect()
    assert live_engines() == 0


def test_sample_error_survives_pickling_with_its_cause():
    err = SampleError("transform failed on s3://b/k", url="s3://b/k")
    err.__cause__ = ValueError("inner")
    back = pickle.loads(pickle.dumps(err))
    assert back.url == "s3://b/k" and isinstance(back.__cause__, ValueError)


@pytest.mark.parametrize(
    "option,value,match",
    [
        ("limits", lambda: Limits(concurrency=-1), r"Limits\.concurrency=-1"),
        ("limits", lambda: Limits(concurrency=0), r"Limits\.concurrency=0"),
        ("queue_bytes", 0, "queue_bytes=0"),
        ("queue_items", 0, "queue_items=0"),
        ("seed", "x", "seed='x'"),
        ("transform", 3, "transform=3"),
        ("split", lambda: Split(pad="maybe"), r"Split\.pad='maybe'"),
        ("store", "s3fs", "store='s3fs'"),
    ],
)
def test_invalid_options_are_rejected_at_construction(option, value, match):
    # the queue's own size is an old spelling only (the new one derives it from Limits(memory=))
    old = pytest.deprecated_call() if option.startswith("queue_") else contextlib.nullcontext()
    with pytest.raises(ConfigError, match=match), old:
        AsyncS3Dataset.from_keys(BUCKET, ["a.bin"], **{option: value() if option in ("limits", "split") else value})


def test_empty_key_list_is_rejected():
    with pytest.raises(EmptyDatasetError, match="empty"):
        AsyncS3Dataset.from_keys(BUCKET, [])


@pytest.mark.parametrize("given", [{"keys": ["a.jpg"]}, {"prefix": "train/"}])
def test_keys_or_prefix_without_a_bucket_is_a_clear_error(given):
    with pytest.raises(ConfigError, match=f"{next(iter(given))}= needs bucket="), \
            pytest.warns(DeprecationWarning, match="from_keys"):
        AsyncS3Dataset(**given)


def test_state_dict_resumes_the_rest_of_the_epoch_exactly_once():
    ds, objects, _ = dataset(100, shuffle=True, seed=5)
    ds.set_epoch(2)
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(37)]
    state = ds.state_dict()
    del it
    fresh, _, _ = dataset(100, shuffle=True, seed=5)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    rest = keys_of(fresh)
    assert sorted(first + rest) == sorted(k[:-4] for k in objects)
    assert not set(first) & set(rest)


def test_a_state_of_the_previous_release_resumes_only_where_its_order_is_unchanged():
    """Version 1 states come from releases that shuffled every order as a whole list; since
    then orders longer than SMALL_ORDER are a keyed permutation. A version 1 state resumes
    where the order is the same (short or unshuffled), and is refused, saying what to do, where
    its position would point into another order."""
    ds, objects, _ = dataset(100, shuffle=True, seed=5)  # a short order: the same as before
    ds.set_epoch(2)
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(37)]
    state = {**ds.state_dict(), "version": 1}
    del it
    fresh, _, _ = dataset(100, shuffle=True, seed=5)
    fresh.load_state_dict(state)
    rest = keys_of(fresh)
    assert sorted(first + rest) == sorted(k[:-4] for k in objects)

    n = SMALL_ORDER + 1
    big, _, _ = dataset(n, shuffle=True, seed=5)
    old = {**big.state_dict(), "version": 1, "epoch": 3}
    with pytest.raises(ConfigError, match=r"earlier release \(state version 1\) in the middle of "
                       r"epoch 3.*ds\.set_epoch\(3\) instead of load_state_dict"):
        big.load_state_dict(old)
    unshuffled, _, _ = dataset(n, shuffle=False, seed=5)
    unshuffled.load_state_dict({**unshuffled.state_dict(), "version": 1, "epoch": 3})
    assert unshuffled.epoch == 3
    with pytest.raises(ConfigError, match=r"state \(version 0, mode 'objects'\) is not"):
        unshuffled.load_state_dict({**unshuffled.state_dict(), "version": 0})


def test_manifest_file(tmp_path):
    objects = payloads(10)
    fake = FakeStore.with_objects(BUCKET, objects)
    manifest = tmp_path / "keys.txt"
    manifest.write_text("# training split\n" + "\n".join(f"s3://{BUCKET}/{k}" for k in sorted(objects)) + "\n\n")
    ds = AsyncS3Dataset.from_manifest(str(manifest), store=reusable(fake))
    assert len(ds) == 10 and len(list(ds)) == 10


def test_missing_key_in_manifest_names_it():
    ds, _, fake = dataset(5)
    ds = AsyncS3Dataset.from_keys(BUCKET, ["train/000000.bin", "train/nope.bin"], store=reusable(fake))
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        list(ds)


def test_batches_collate_bytes_through_a_transform():
    ds, _, _ = dataset(64, transform=lambda s: torch.frombuffer(bytearray(s["bin"]), dtype=torch.uint8))
    batches = list(DataLoader(ds, batch_size=16))
    assert len(batches) == 4 and batches[0].shape == (16, 64)


def test_a_pickled_copy_keeps_its_own_epoch_cell():
    """What a spawned worker receives: the epoch at pickling time, then its own cell (spawned
    persistent workers following set_epoch run on the real server in test_launching.py)."""
    ds = AsyncS3Dataset.from_keys(BUCKET, ["a", "b"], config=_unused_config())
    ds.set_epoch(3)
    copy = pickle.loads(pickle.dumps(ds))  # not a process start: the copy gets its own cell
    assert copy.epoch == 3
    copy.set_epoch(4)
    assert (ds.epoch, copy.epoch) == (3, 4)


def test_set_epoch_reaches_persistent_forked_workers():
    """Forked workers share the in-memory fake store; spawn and forkserver cannot, and are
    covered against the real server in test_launching.py."""
    objects = payloads(40, size=16)
    fake = FakeStore.with_objects(BUCKET, objects)
    ds = AsyncS3Dataset.from_keys(BUCKET, sorted(objects), shuffle=True, seed=2, store=reusable(fake))
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        orders.append([s["__key__"] for s in loader])
    expected = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        expected.append([s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2,
                                                          multiprocessing_context="fork")])
    assert orders[0] != orders[1] != orders[2], "persistent workers must follow set_epoch"
    assert orders == expected, "each epoch's order must be the one fresh workers would give"


def _unused_config():
    from loader import S3Config

    return S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")


_LEFT_OPEN = """
from torch.utils.data import DataLoader
from loader import AsyncS3Dataset
from loader.testing import MemoryStore
store = MemoryStore.with_objects("train", {f"a/{i}.bin": b"x" * 100 for i in range(50)})
batches = iter(DataLoader(AsyncS3Dataset.from_prefix("s3://train/a/", store=store), batch_size=None))
print(next(batches)["__key__"])
"""


def test_an_iteration_left_open_at_exit_ends_quietly():
    """``next(iter(loader))`` and then the end of the script: the iteration is closed at exit,
    not in the interpreter's teardown, where its statistics met cleared modules (a traceback)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _LEFT_OPEN], capture_output=True, text=True,
                         timeout=120, check=False)
    assert (run.returncode, run.stdout.strip(), run.stderr.strip()) == (0, "a/0", "")
