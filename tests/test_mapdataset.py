"""AsyncS3MapDataset over the in-memory store: concurrency per batch, order, errors, lifecycle, fork."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from loader import AccessDeniedError, ConfigError, Limits, NoSuchKeyError, SampleError, Store
from loader.datasets.mapped import THREAD_NAME, AsyncS3MapDataset, live_clients
from loader.datasets.options import LoaderOptions

from fakes import FakeStore, SharedFake, payloads, reusable
from waiting import wait_until

BUCKET = "bucket"
LATENCY = 0.01


def dataset(n=100, latency=LATENCY, picklable=False, **options):
    objects = payloads(n, size=64)
    fake = FakeStore.with_objects(BUCKET, objects, latency=latency)
    options.setdefault("store", SharedFake(fake) if picklable else reusable(fake))
    return AsyncS3MapDataset.from_keys(BUCKET, sorted(objects), **options), objects, fake


def key_of(sample):
    return sample["__key__"]


def our_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


@pytest.fixture
def closing():
    """Datasets to close after the test (their loop thread would otherwise live until GC)."""
    made = []
    yield made.append
    for ds in made:
        ds.close()


# ------------------------------------------------------------------------------ what it returns


def test_samples_are_webdataset_dicts_in_index_order(closing):
    ds, objects, _ = dataset(20)
    closing(ds)
    keys = sorted(objects)
    assert len(ds) == 20
    first = ds[0]
    assert first == {"__key__": "train/000000", "__url__": f"s3://{BUCKET}/train/000000.bin",
                     "bin": objects[keys[0]]}
    batch = ds.__getitems__([7, 2, 19, 0])
    assert [s["bin"] for s in batch] == [objects[keys[i]] for i in (7, 2, 19, 0)]


def test_duplicate_indices_are_fetched_once_and_transformed_per_position(closing):
    calls = []

    def tag(sample):
        calls.append(sample["__key__"])
        return {"key": sample["__key__"], "copy": bytearray(sample["bin"])}

    ds, objects, fake = dataset(10, transform=tag)
    closing(ds)
    batch = ds.__getitems__([3, 1, 3, 3, 0, 1])
    assert [s["key"] for s in batch] == ["train/000003", "train/000001", "train/000003",
                                         "train/000003", "train/000000", "train/000001"]
    assert fake.requests_by_key == {"train/000003.bin": 1, "train/000001.bin": 1, "train/000000.bin": 1}
    assert len(calls) == 6, "transform runs once per position (e.g. random augmentation)"
    assert batch[0]["copy"] is not batch[2]["copy"]


def test_an_empty_batch_fetches_nothing_and_starts_nothing():
    ds, _, fake = dataset(5)
    assert ds.__getitems__([]) == []
    assert fake.requests == 0 and not our_threads()


# ------------------------------------------------------------------------------ concurrency


def test_a_batch_of_64_is_64_concurrent_gets(closing):
    """At 10 ms per GET, 64 sequential GETs take 640 ms; concurrently all 64 are in flight at once:
    a process alone starts with the engine's requests (its share of the job's start window,
    ``start_window``), and so do its next batches."""
    ds, objects, fake = dataset(200)
    closing(ds)
    first = ds.__getitems__(list(range(64)))
    assert fake.peak_inflight == 64, fake.peak_inflight
    fake.reset_counters()
    batch = ds.__getitems__(list(range(64, 128)))
    assert fake.peak_inflight == 64
    assert fake.requests == 64
    assert [key_of(s) for s in first + batch] == [k[:-4] for k in sorted(objects)[:128]]


@pytest.mark.parametrize("max_inflight,batch_size", [(16, 64), (8, 8), (64, 5)])
def test_inflight_gets_are_bounded_by_max_inflight(closing, max_inflight, batch_size):
    ds, _, fake = dataset(100, limits=Limits(concurrency=max_inflight))
    closing(ds)
    assert len(ds.__getitems__(list(range(batch_size)))) == batch_size
    assert fake.peak_inflight == min(max_inflight, batch_size)


def test_max_inflight_bounds_concurrent_batches_from_several_threads(closing):
    ds, _, fake = dataset(100, limits=Limits(concurrency=10))
    closing(ds)
    ds[0]  # open the client first, so both threads share it
    results = {}

    def read(name, indices):
        results[name] = [key_of(s) for s in ds.__getitems__(indices)]

    threads = [threading.Thread(target=read, args=(n, list(range(n * 40, n * 40 + 40)))) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert fake.peak_inflight == 10
    assert results[1] == [f"train/{i:06d}" for i in range(40, 80)]


# ------------------------------------------------------------------------------ errors


def test_a_missing_key_names_it_and_the_dataset_keeps_working(closing):
    objects = payloads(10)
    fake = FakeStore.with_objects(BUCKET, objects, latency=LATENCY)
    keys = sorted(objects) + ["train/missing.bin"]
    ds = AsyncS3MapDataset.from_keys(BUCKET, keys, store=reusable(fake))
    closing(ds)
    with pytest.raises(NoSuchKeyError, match=r"'train/missing\.bin'.*'bucket'") as info:
        ds.__getitems__(list(range(11)))
    assert info.value.key == "train/missing.bin" and info.value.bucket == BUCKET
    assert fake.inflight == 0, "the failed batch's other GETs were cancelled or finished"
    assert [key_of(s) for s in ds.__getitems__([1, 2])] == ["train/000001", "train/000002"]
    with pytest.raises(FileNotFoundError, match="missing"):
        ds[10]


def test_a_permanent_store_error_is_not_retried_and_names_the_key(closing):
    objects = payloads(10)
    denied = AccessDeniedError("access denied to s3://bucket/train/000004.bin",
                               bucket=BUCKET, key="train/000004.bin")
    fake = FakeStore.with_objects(BUCKET, objects, fail={"train/000004.bin": denied})
    ds = AsyncS3MapDataset.from_keys(BUCKET, sorted(objects), store=reusable(fake))
    closing(ds)
    with pytest.raises(PermissionError, match=r"train/000004\.bin"):
        ds.__getitems__([3, 4, 5])
    assert fake.requests_by_key["train/000004.bin"] == 1


def test_transient_errors_are_retried(closing):
    from loader import RetryPolicy, TransientStoreError

    objects = payloads(4)
    flaky = [TransientStoreError("503", bucket=BUCKET, key="train/000002.bin")] * 2
    fake = FakeStore.with_objects(BUCKET, objects, fail={"train/000002.bin": flaky})
    ds = AsyncS3MapDataset.from_keys(BUCKET, sorted(objects),
                                     store=Store(backend=reusable(fake), retry=RetryPolicy(base_delay=0.001)))
    closing(ds)
    assert [key_of(s) for s in ds.__getitems__([2, 3])] == ["train/000002", "train/000003"]
    assert fake.requests_by_key["train/000002.bin"] == 3


def test_transform_errors_name_the_key_and_keep_the_cause(closing):
    def explode(sample):
        if sample["__key__"].endswith("07"):
            raise ValueError("bad pixels")
        return sample["__key__"]

    ds, _, _ = dataset(20, transform=explode)
    closing(ds)
    assert ds.__getitems__([5, 6]) == ["train/000005", "train/000006"]
    with pytest.raises(SampleError, match=r"s3://bucket/train/000007\.bin \(key 'train/000007'\).*bad pixels") as info:
        ds.__getitems__([6, 7, 8])
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.url == "s3://bucket/train/000007.bin"


@pytest.mark.parametrize("index", [100, 101, -1, -100])
def test_out_of_range_indices_name_the_index_and_length(index):
    ds, _, fake = dataset(100)
    with pytest.raises(IndexError, match=rf"index {index} is out of range .* length 100"):
        ds[index]
    with pytest.raises(IndexError, match=rf"index {index} "):
        ds.__getitems__([0, 1, index])
    assert fake.requests == 0, "indices are checked before any GET"
    assert not our_threads()


def test_non_integer_indices_are_a_type_error(closing):
    ds, _, _ = dataset(10)
    closing(ds)
    with pytest.raises(TypeError, match="must be integers, not str"):
        ds["train/000001.bin"]
    assert key_of(ds[torch.tensor(3)]) == "train/000003"  # anything with __index__


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    "option,value",
    [("shuffle", True), ("shuffle", False), ("seed", 0), ("ordered", False), ("rank", 0),
     ("world_size", 2), ("pad_policy", "drop")],
)
def test_order_options_are_rejected_because_samplers_decide(option, value):
    with pytest.raises(ConfigError, match=rf"{option}=.*the sampler decides order"):
        AsyncS3MapDataset.from_keys(BUCKET, ["a.bin"], **{option: value})


def test_queue_options_are_rejected_because_there_is_no_queue():
    with pytest.raises(ConfigError, match=r"queue_bytes=1024 .* no queue"):
        AsyncS3MapDataset.from_keys(BUCKET, ["a.bin"], queue_bytes=1024)


def test_loader_options_given_directly_are_checked_too():
    with pytest.raises(ConfigError, match="shuffle=True"):
        AsyncS3MapDataset(options=LoaderOptions(shuffle=True))


@pytest.mark.parametrize(
    "option,value,match",
    [("limits", lambda: Limits(concurrency=0), r"Limits\.concurrency=0"), ("transform", 3, "transform=3"),
     ("store", "s3fs", "store='s3fs'")],
)
def test_loader_options_validation_is_reused(option, value, match):
    with pytest.raises(ConfigError, match=match):
        AsyncS3MapDataset.from_keys(BUCKET, ["a.bin"], **{option: value() if option == "limits" else value})


def test_keys_are_validated_up_front():
    with pytest.raises(ValueError, match="empty"):
        AsyncS3MapDataset.from_keys(BUCKET, [])
    with pytest.raises(ConfigError, match=r"keys\[1\]=''"):
        AsyncS3MapDataset.from_keys(BUCKET, ["a", ""])


# ------------------------------------------------------------------------------ sources


def test_from_prefix_lists_once_for_len_batches_and_pickling(closing):
    objects = payloads(30)
    fake = FakeStore.with_objects(BUCKET, {**objects, "other/x.bin": b"x"}, page_size=7)
    ds = AsyncS3MapDataset.from_prefix(f"s3://{BUCKET}/train/", store=SharedFake(fake))
    closing(ds)
    assert not our_threads(), "listing leaves no thread behind"
    assert len(ds) == 30
    lists = fake.list_requests
    assert [key_of(s) for s in ds.__getitems__([0, 29])] == ["train/000000", "train/000029"]
    copy = pickle.loads(pickle.dumps(ds))
    assert len(copy) == 30 and copy.keys() == ds.keys()
    assert fake.list_requests == lists, "the listing happens once, in the process that pickles"


def test_pickling_to_start_a_worker_before_len_lists_in_the_parent():
    from multiprocessing.context import set_spawning_popen

    objects = payloads(12)
    fake = FakeStore.with_objects(BUCKET, objects)
    ds = AsyncS3MapDataset.from_prefix(f"s3://{BUCKET}/train/", store=SharedFake(fake))
    pickle.dumps(ds)
    assert fake.list_requests == 0, "pickling that starts no process lists nothing"
    set_spawning_popen(object())  # as multiprocessing does while it starts a spawned worker
    try:
        state = pickle.dumps(ds)
    finally:
        set_spawning_popen(None)
    assert fake.list_requests == 1 and ds.source._keys is not None
    copy = pickle.loads(state)
    assert copy.source._keys == ds.source._keys


def test_manifest_file(tmp_path, closing):
    objects = payloads(10)
    fake = FakeStore.with_objects(BUCKET, objects)
    manifest = tmp_path / "keys.txt"
    manifest.write_text("# split\n" + "\n".join(f"s3://{BUCKET}/{k}" for k in sorted(objects)) + "\n")
    ds = AsyncS3MapDataset.from_manifest(str(manifest), store=reusable(fake))
    closing(ds)
    assert len(ds) == 10 and key_of(ds[9]) == "train/000009"


# ------------------------------------------------------------------------------ lifecycle


def test_close_leaves_no_thread_and_the_dataset_reopens_on_demand(no_leaked_threads):
    before = set(threading.enumerate())
    ds, _, fake = dataset(10)
    assert not our_threads(), "nothing starts in __init__"
    ds.__getitems__([0, 1])
    assert len(our_threads()) == 1 and live_clients() >= 1
    ds.__getitems__([2, 3])
    assert len(our_threads()) == 1, "one loop per process, reused across calls"
    ds.close()
    assert set(threading.enumerate()) == before
    assert fake.closed, "the store was closed inside the loop"
    ds.close()  # idempotent
    assert key_of(ds[4]) == "train/000004", "a later access opens a new client"
    ds.close()
    assert set(threading.enumerate()) == before and live_clients() == 0


def test_context_manager_closes(no_leaked_threads):
    ds, _, _ = dataset(5)
    with ds:
        ds[0]
        assert our_threads()
    assert not our_threads()


def test_garbage_collection_closes_the_client(no_leaked_threads):
    ds, _, fake = dataset(5)
    ds[0]
    del ds
    gc.collect()
    assert not our_threads() and fake.closed


def test_closing_from_the_loop_thread_hands_the_join_to_another_thread(no_leaked_threads):
    """Garbage collection may run the finalizer on the loop's own thread, which cannot join
    itself: the close must still happen, from a helper thread, without raising."""
    ds, _, fake = dataset(5)
    ds[0]
    client = ds._client
    client.portal.call(client.close)  # a plain function run in the loop thread
    client.loop.thread.join(timeout=10)
    assert not client.loop.thread.is_alive() and fake.closed
    assert key_of(ds[1]) == "train/000001", "a client closed behind the dataset's back is replaced"
    ds.close()


def test_pickling_drops_the_client_and_the_copy_opens_its_own(closing):
    ds, objects, fake = dataset(10, picklable=True)
    closing(ds)
    ds[0]
    client = ds._client
    assert client is not None
    copy = pickle.loads(pickle.dumps(ds))
    closing(copy)
    assert copy._client is None and copy._closer is None
    assert ds._client is client, "pickling does not disturb the original"
    assert key_of(copy[3]) == "train/000003"
    assert copy._client is not client
    assert len(our_threads()) == 2


def test_a_store_that_cannot_open_reports_why_and_leaves_no_thread(no_leaked_threads):
    async def broken():
        raise ConfigError("no credentials found: set AWS_ACCESS_KEY_ID")

    ds = AsyncS3MapDataset.from_keys(BUCKET, ["a.bin"], store=broken)
    with pytest.raises(ConfigError, match="no credentials"):
        ds[0]
    assert not our_threads() and ds._client is None


# ------------------------------------------------------------------------------ DataLoader


def test_dataloader_batches_are_concurrent_and_cover_a_random_epoch_once(closing):
    ds, objects, fake = dataset(256, transform=key_of)
    closing(ds)
    loader = DataLoader(ds, batch_size=64, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(0)))
    got = [key for batch in loader for key in batch]
    assert sorted(got) == sorted(k[:-4] for k in objects) and len(got) == 256
    assert got != sorted(got), "the sampler's order, not key order"
    assert fake.peak_inflight == 64, "each batch of 64 indices became 64 GETs in flight"
    assert fake.requests == 256


def test_custom_batch_sampler_order_is_kept_exactly(closing):
    ds, _, _ = dataset(20, transform=key_of)
    closing(ds)
    batches = [[5, 5, 2], [19], [0, 18, 1]]
    got = list(DataLoader(ds, batch_sampler=batches, collate_fn=list))
    assert got == [[f"train/{i:06d}" for i in batch] for batch in batches]


def test_distributed_sampler_ranks_split_the_epoch_equally(closing):
    ds, objects, _ = dataset(101, transform=key_of)
    closing(ds)
    shares = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=4)
        sampler.set_epoch(3)
        shares.append([key for batch in DataLoader(ds, batch_size=16, sampler=sampler) for key in batch])
    assert len(shares[0]) == len(shares[1]) == 51
    assert set(shares[0]) | set(shares[1]) == {k[:-4] for k in objects}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_a_random_epoch_exactly_once(context):
    ds, objects, _ = dataset(200, picklable=True, latency=0.001)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2, collate_fn=list,
                        multiprocessing_context=context, timeout=120)
    got = [sample["__key__"] for batch in loader for sample in batch]
    assert len(got) == 200 and sorted(got) == sorted(k[:-4] for k in objects)
    assert not our_threads(), "the parent only listed/len'd; workers own their clients"


def test_fork_workers_after_use_in_the_parent(closing):
    """The parent reads in the main process (its loop thread is alive), then forks workers
    for two epochs: each worker must park the inherited client and open its own."""
    ds, objects, fake = dataset(128, latency=0.001, transform=key_of)
    closing(ds)
    for _ in range(3):
        assert len(ds.__getitems__(list(range(64)))) == 64
    parent_client = ds._client
    for _epoch in range(2):
        loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2,
                            multiprocessing_context="fork", timeout=60)
        got = [key for batch in loader for key in batch]
        assert sorted(got) == sorted(k[:-4] for k in objects)
    assert ds._client is parent_client, "the parent's client is untouched by its children"
    assert ds[5] == "train/000005"


# ------------------------------------------------------------------------------ fork hygiene


def wait_child(pid, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("forked child hung")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_fork_after_use_in_the_parent_does_not_hang(closing):
    """Use in the parent, a batch still in flight in another parent thread at fork time, then
    a forked child reads, closes, and drops the dataset: it must never touch the parent's loop."""
    objects = payloads(100)
    fake = FakeStore.with_objects(
        BUCKET, objects, latency=lambda key: 1.0 if key == "train/000099.bin" else 0.001)
    ds = AsyncS3MapDataset.from_keys(BUCKET, sorted(objects), store=reusable(fake))
    closing(ds)
    for start in range(0, 96, 32):
        assert len(ds.__getitems__(list(range(start, start + 32)))) == 32
    slow = threading.Thread(target=ds.__getitem__, args=(99,))
    slow.start()
    wait_until(lambda: fake.inflight >= 1, "the slow GET is in flight in the parent's loop")
    pid = os.fork()
    if pid == 0:  # child: exit code says whether it worked
        code = 1
        try:
            signal.alarm(20)
            got = [s["__key__"] for s in ds.__getitems__(list(range(50)))]
            code = 0 if got == [f"train/{i:06d}" for i in range(50)] else 2
            if code == 0 and (len(our_threads()) != 1 or ds._client.pid != os.getpid()):
                code = 3
            ds.close()
            del ds
            gc.collect()
            if code == 0 and our_threads():
                code = 4
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    slow.join(timeout=10)
    assert not slow.is_alive()
    assert key_of(ds[1]) == "train/000001", "the parent goes on with its own client"


SCRIPT = textwrap.dedent("""
    import os, sys, threading
    from fakes import FakeStore, SharedFake, payloads, reusable
    from test_mapdataset import SharedFake
    from loader.datasets.mapped import AsyncS3MapDataset
    objects = payloads(50)
    fake = FakeStore.with_objects("bucket", objects, latency=0.001)
    ds = AsyncS3MapDataset.from_keys("bucket", sorted(objects), store=SharedFake(fake))
    for _ in range(3):
        assert len(ds.__getitems__(list(range(50)))) == 50
    pid = os.fork()
    if pid == 0:
        assert len(ds.__getitems__(list(range(10)))) == 10
        sys.exit(7)  # a normal exit: atexit runs the inherited finalizer and ours
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    # the parent exits without close(): its finalizer closes the client at exit
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_normal_exit_of_a_forked_child_and_of_the_parent_does_not_hang():
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its forked child, if that hung
        proc.communicate()
        pytest.fail("a process hung at exit")
    assert proc.returncode == 0, stderr
    assert "child 7" in stdout
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
