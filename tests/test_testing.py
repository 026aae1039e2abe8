"""``loader.testing.MemoryStore`` as users hand it to the loader: ``store=`` of both datasets and of
a checkpoint, through DataLoader workers (the default start method and spawn: the store travels
pickled with the dataset), with latency and faults; and docs/testing.md's example, run as a user
runs it."""

from __future__ import annotations

import io
import pickle
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, Limits, NoSuchKeyError, TransientStoreError, checkpoint
from loader.testing import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = re.compile(r"```python\n# runnable\n(.*?)```", re.S)


def objects(n: int) -> dict[str, bytes]:
    return {f"train/{i:03d}.bin": bytes([i]) * (i + 1) for i in range(n)}


def tar_of(names: list[str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in names:
            data = name.encode()
            info = tarfile.TarInfo(f"{name}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("context", [None, "spawn"], ids=["default", "spawn"])
def test_a_dataset_reads_a_memory_store_in_dataloader_workers(context):
    """The store pickles with the dataset; the listing runs once, in this process."""
    store = MemoryStore.with_objects("bucket", objects(30), latency=0.001)
    dataset = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=store, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context,
                        timeout=120)
    got = {sample["__key__"]: sample["bin"] for sample in loader}
    assert got == {key.removesuffix(".bin"): data for key, data in objects(30).items()}
    assert store.list_requests == 1
    assert store.requests == 0, "the workers read their own copies; the parent's counters count its requests"


def test_shards_and_keys_read_from_a_memory_store():
    store = MemoryStore(buckets=["shards"])
    store.objects["shards", "train-0.tar"] = tar_of(["a", "b"])
    store.objects["shards", "train-1.tar"] = tar_of(["c"])
    shards = AsyncS3Dataset.from_shards("s3://shards/train-{0..1}.tar", store=store)
    assert sorted(sample["__key__"] for sample in shards) == ["a", "b", "c"]
    keyed = AsyncS3Dataset.from_keys("shards", ["train-1.tar"], store=store)
    assert [sample["__key__"] for sample in keyed] == ["train-1"]


def test_the_map_dataset_and_a_checkpoint_take_a_memory_store():
    store = MemoryStore.with_objects("bucket", objects(5))
    mapped = AsyncS3MapDataset.from_prefix("s3://bucket/train/", store=store)
    assert len(mapped) == 5 and mapped[2]["bin"] == bytes([2]) * 3
    state = {"w": torch.arange(1000)}
    checkpoint.save(state, "s3://bucket/ckpt/step-1.pt", store=store)
    assert torch.equal(checkpoint.load("s3://bucket/ckpt/step-1.pt", store=store)["w"], state["w"])
    assert store.uploads == {} and store.puts + store.completed >= 1


def test_injected_faults_are_retried_or_reach_the_caller_naming_the_key():
    store = MemoryStore.with_objects("bucket", objects(6),
                                     fail={"train/002.bin": [TransientStoreError("reset")] * 2})
    dataset = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=store)
    assert len(list(dataset)) == 6
    assert store.requests_by_key["train/002.bin"] == 3  # two faults, then the object
    store.reset_counters()
    store.fail["train/004.bin"] = NoSuchKeyError("gone", bucket="bucket", key="train/004.bin")
    with pytest.raises(NoSuchKeyError) as info:
        list(dataset)
    assert info.value.key == "train/004.bin"
    assert store.requests_by_key["train/004.bin"] == 1, "a permanent error is not retried"


def test_injected_latency_keeps_requests_in_flight_together():
    store = MemoryStore.with_objects("bucket", objects(40), latency=0.02)
    dataset = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=store, limits=Limits(concurrency=8))
    assert len(list(dataset)) == 40
    assert 2 <= store.peak_inflight <= 8


def test_a_memory_store_pickles_with_its_objects_and_faults():
    store = MemoryStore.with_objects("bucket", objects(3), fail={"train/001.bin": TransientStoreError("x")})
    copy = pickle.loads(pickle.dumps(store))
    assert copy.objects == store.objects and copy.buckets == {"bucket"}
    assert isinstance(copy.fail["train/001.bin"], TransientStoreError)


def test_the_example_in_docs_testing_runs(tmp_path):
    """Run as a user runs it: a script of its own (DataLoader workers by the default start method)."""
    blocks = EXAMPLE.findall((ROOT / "docs" / "testing.md").read_text(encoding="utf-8"))
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0], encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
