"""Resume bookkeeping: the compact delivered-set, and resuming a plain DataLoader by batch count."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError
from loader.datasets.progress import Watermark

from fakes import FakeStore, payloads, reusable


@given(st.lists(st.integers(0, 300), max_size=400))
def test_watermark_is_a_set(numbers):
    mark = Watermark()
    for n in numbers:
        mark.add(n)
    assert {n for n in range(301) if n in mark} == set(numbers)
    assert len(mark) == len(set(numbers))
    assert Watermark.from_state(mark.to_state()) == mark


def test_watermark_state_stays_small_for_in_order_delivery():
    mark = Watermark()
    for n in range(100_000):
        mark.add(n)
    assert mark.to_state() == [100_000, []]


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_resume_from_batches_with_a_plain_dataloader(mode, tmp_path):
    objects = payloads(203, size=32)
    fake = FakeStore.with_objects("bucket", objects)
    if mode == "objects":
        def make():
            return AsyncS3Dataset.from_keys("bucket", sorted(objects), shuffle=True, seed=4,
                                            batch_size=8, store=reusable(fake))
    else:
        import io
        import tarfile

        keys = sorted(objects)
        counts = {}
        for number, start in enumerate(range(0, len(keys), 40)):
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as tar:
                for key in keys[start:start + 40]:
                    info = tarfile.TarInfo(key)
                    info.size = len(objects[key])
                    tar.addfile(info, io.BytesIO(objects[key]))
            fake.objects["bucket", f"shards/{number}.tar"] = out.getvalue()
            counts[f"s3://bucket/shards/{number}.tar"] = len(keys[start:start + 40])

        def make():
            return AsyncS3Dataset.from_shards("s3://bucket/shards/{0..5}.tar", shuffle=True, seed=4,
                                              batch_size=8, store=reusable(fake), sample_counts=counts)

    def run(dataset, stop=None):
        dataset_loader = DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context="fork",
                                    collate_fn=lambda batch: [s["__key__"] for s in batch])
        return list(itertools.islice(dataset_loader, stop))

    first = make()
    first.set_epoch(3)
    head = run(first, stop=9)
    second = make()
    if mode == "objects":
        with pytest.deprecated_call(match="resume_from_batches"):
            second.resume_from_batches(epoch=3, batches_seen=9, batch_size=8)
    else:  # a shuffled epoch of shards is dealt to lanes: the resume asks how many the first run had
        with pytest.raises(ConfigError, match="needs lanes="), pytest.warns(DeprecationWarning):
            second.resume_from_batches(epoch=3, batches_seen=9, batch_size=8)
        second.set_epoch(3)
        second.resume(epoch=3, samples_seen=second.samples_seen(9), lanes=1 * 2)
    tail = run(second)
    got = list(itertools.chain(*head, *tail))
    assert len(got) == len(objects), "no sample twice"
    assert sorted(got) == sorted(key.rsplit(".", 1)[0] for key in objects)


def test_resume_from_batches_needs_the_datasets_batch_size():
    ds = AsyncS3Dataset.from_keys("bucket", ["a.bin"],
                                  store=reusable(FakeStore.with_objects("bucket", {"a.bin": b"x"})))
    with pytest.raises(ConfigError, match=r"build the dataset with batch_size=8 \(the DataLoader's"), \
            pytest.deprecated_call(match="resume_from_batches"):
        ds.resume_from_batches(0, 1, 8)


def test_state_dict_is_small_after_a_long_epoch():
    objects = payloads(5000, size=8)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(FakeStore.with_objects("bucket", objects)))
    for _ in ds:
        pass
    assert ds.state_dict()["delivered"] == [5000, []]
