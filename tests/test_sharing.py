"""The job-wide protocol of ``sharing``: ranks as threads around a real ``TCPStore``.

Threads of one process stand for ranks (their ``flock``s on separate descriptors exclude each
other as processes' do); a second share directory stands for a second machine.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import time
import traceback

import pytest
import torch.distributed as dist

from loader import EmptyDatasetError, Store
from loader.listing import nodeshare, sharing
from loader.listing.keylist import KeyList
from loader.listing.sharing import Job, once_per_job, ticket

KEYS = KeyList.from_keys([f"train/{i:05d}.jpg" for i in range(500)], range(500))


pytestmark = pytest.mark.usefixtures("share_dir")  # every test gets a directory of its own (conftest)


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    host, port = master.host, master.port

    def client():
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=30))

    yield client
    del master


def ranks(world: int, store, produce, *, delays=(), name="n1") -> dict[int, object]:
    """Run ``_in_job`` as ``world`` ranks in threads; each rank's key list (or error)."""
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        time.sleep(delays[r] if r < len(delays) else 0)
        try:
            got[r] = sharing._in_job(Job(r, world, store), name, "s3://b/train/", os.getpid(), produce)
        except Exception as exc:
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return got


def counted(keys=KEYS, fail: Exception | None = None):
    calls = []

    def produce() -> KeyList:
        calls.append(threading.get_ident())
        time.sleep(0.2)
        if fail is not None:
            raise fail
        return keys

    return produce, calls


def test_rank_0_lists_once_and_every_rank_maps_the_same_file(store, share_dir):
    produce, calls = counted()
    got = ranks(3, store, produce, delays=(0.3, 0, 0))  # ranks 1 and 2 ask before rank 0 starts
    assert len(calls) == 1
    ids = {got[r]._origin.id for r in range(3)}
    assert len(ids) == 1 and all(list(got[r]) == list(KEYS) for r in range(3))
    kv = dist.PrefixStore("loader/listing/n1/", store())
    assert not kv.check(["data/0"]), "every rank has it: the store's copy is freed"
    assert [p.name for p in share_dir.glob("*.keys")], "one file on this machine"


def test_another_machine_fetches_the_file_once_from_the_store(store, share_dir, tmp_path):
    produce, calls = counted()
    job_id = store().compare_set(sharing.JOB_KEY, "", "feedfacefeedface").decode()
    kv = dist.PrefixStore("loader/listing/n2/", store())
    here = nodeshare.NodeFile(f"{job_id}-n2")
    there = nodeshare.NodeFile(f"{job_id}-n2")
    there.dirs = [tmp_path / "node-b"]
    there.dirs[0].mkdir()
    fetched = {}

    def follower() -> None:
        fetched["keys"] = sharing._follow(kv, there, "s3://b/train/", os.getpid(), produce)

    thread = threading.Thread(target=follower)
    thread.start()
    lead = sharing._lead(dist.PrefixStore("loader/listing/n2/", store()), here, "s3://b/train/",
                         os.getpid(), produce)
    thread.join(timeout=60)
    assert len(calls) == 1
    assert fetched["keys"]._origin.id == lead._origin.id and fetched["keys"] == KEYS
    assert fetched["keys"]._origin.path.startswith(str(tmp_path / "node-b"))


def test_a_failed_listing_reaches_every_rank_as_the_same_error(store):
    produce, calls = counted(fail=EmptyDatasetError("no objects under s3://b/train/"))
    got = ranks(3, store, produce, name="n3")
    assert len(calls) == 1, "the other ranks do not list again"
    assert all(isinstance(got[r], EmptyDatasetError) and "no objects under" in str(got[r])
               for r in range(3))


def test_a_rank_that_sees_no_listing_started_lists_itself_with_a_warning(store, monkeypatch, caplog):
    monkeypatch.setattr(sharing, "START_WAIT", 0.3)
    produce, calls = counted()
    with caplog.at_level(logging.WARNING, logger="loader.listing.sharing"):
        keys = sharing._in_job(Job(1, 2, store), "n4", "s3://b/train/", os.getpid(), produce)
    assert len(calls) == 1 and keys == KEYS
    assert "rank 0 did not start listing s3://b/train/" in caplog.text


def test_a_plain_process_lists_in_memory_without_files_or_waits(share_dir, monkeypatch):
    produce, calls = counted()
    monkeypatch.setattr(sharing, "_follow", lambda *args: pytest.fail("a plain process waits for no one"))
    keys = once_per_job("s3://b/train/", produce, ticket=1)
    assert keys is KEYS and len(calls) == 1
    assert list(share_dir.iterdir()) == []


def test_tickets_count_datasets_per_target_and_travel_with_them():
    first, second, other = ticket("s3://b/x/"), ticket("s3://b/x/"), ticket("s3://b/y/")
    assert second == first + 1 and other >= 1
    assert pickle.loads(pickle.dumps(second)) == second


def test_a_plain_process_uses_the_listing_its_workers_made(share_dir, monkeypatch):
    """Workers listed (the first epoch ran without ``set_epoch``); the process itself then needs
    the keys (``set_epoch``, ``len``): it maps their file instead of listing again."""
    produce, calls = counted()
    with monkeypatch.context() as as_a_worker:
        as_a_worker.setattr(sharing.topology, "in_worker", lambda: True)
        as_a_worker.setattr(sharing.topology, "parent_pid", lambda: os.getpid())
        in_worker = once_per_job("s3://b/train/", produce, ticket=7)
    in_parent = once_per_job("s3://b/train/", produce, ticket=7)
    assert len(calls) == 1 and in_parent._origin.id == in_worker._origin.id
    assert once_per_job("s3://b/train/", produce, ticket=8) is KEYS, "another dataset: its own listing"


def test_a_list_larger_than_a_store_value_travels_in_chunks(store, tmp_path):
    """TCPStore's libuv server drops a connection that sends a value over 8 MiB (and with it
    the job's store): the file crosses machines in chunks."""
    big = KeyList.from_keys([f"train/class-{i % 1000:04d}/{i:09d}.jpeg" for i in range(300_000)],
                            range(300_000))
    assert big.nbytes > 9 << 20
    produce, calls = counted(big)
    kv = dist.PrefixStore("loader/listing/n5/", store())
    here = nodeshare.NodeFile("job-n5")
    there = nodeshare.NodeFile("job-n5")
    there.dirs = [tmp_path / "node-b"]
    there.dirs[0].mkdir()
    sharing._lead(kv, here, "s3://b/train/", os.getpid(), produce)
    fetched = sharing._follow(dist.PrefixStore("loader/listing/n5/", store()), there, "s3://b/train/",
                              os.getpid(), produce)
    assert len(calls) == 1 and fetched == big and int(kv.get("chunks")) > 2


class _Wrapper:
    """A user's dataset that reads one of ours (held in an attribute)."""

    def __init__(self, inner) -> None:
        self.inner = inner


def _exit_holding(*datasets) -> None:
    os._exit(0)


def _fork_holding(*datasets) -> int:
    """Fork a ``multiprocessing`` child started with ``datasets`` as its arguments (as the
    DataLoader starts a worker with its dataset); its exit code."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_exit_holding, args=datasets)
    child.start()
    child.join()
    return child.exitcode


def test_a_process_lists_just_before_it_forks_a_process_holding_the_dataset():
    """The DataLoader forks workers without asking the dataset: the fork hook lists the
    datasets the process being started holds (itself, or in a wrapper), and only those."""
    from loader import AsyncS3Dataset, AsyncS3MapDataset

    from fakes import FakeStore, payloads, reusable

    fake = FakeStore.with_objects("bucket", payloads(7), page_size=3)
    objects = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=reusable(fake))
    mapped = AsyncS3MapDataset.from_prefix("s3://bucket/train/", store=reusable(fake))
    other_fake = FakeStore.with_objects("bucket", payloads(7), page_size=3)
    other = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=reusable(other_fake))
    assert objects.source._keys is None and mapped.source._keys is None and fake.list_requests == 0
    assert _fork_holding(objects, [_Wrapper(mapped)]) == 0
    assert len(objects.source._keys) == len(mapped.source._keys) == 7 and fake.list_requests == 6
    assert other.source._keys is None and other_fake.list_requests == 0, "not this fork's dataset"
    assert _fork_holding(objects, _Wrapper(mapped)) == 0
    assert fake.list_requests == 6, "listed once, not at every fork"


def test_the_hook_finds_a_dataset_in_a_process_arguments_but_not_through_functions():
    """What counts as held: an argument, an item, a value, an attribute, a ``partial``'s
    argument; not what a function reaches (its globals, its closure: everything)."""
    import functools
    import types

    wanted = [object(), object()]
    a, b = wanted

    def holds(*args, **kwargs) -> list:
        return sharing.held_by(types.SimpleNamespace(_args=args, _kwargs=kwargs), wanted)

    assert holds(1, a) == [a] and holds(x={"y": [_Wrapper(b)]}) == [b]
    assert holds(functools.partial(print, a)) == [a]
    assert holds(lambda: a, _Wrapper(len)) == [] and holds() == [] and sharing.held_by(None, wanted) == []
    assert holds(list(range(sharing._ITEMS)) + [a]) == [], "long containers are data, looked into in part"


def test_a_plain_fork_lists_nothing():
    """``os.fork()`` (or a ``multiprocessing`` child started without the dataset) reads no
    dataset of ours that the hook could know of: it does not wait for any listing."""
    from loader import AsyncS3Dataset

    from fakes import reusable

    fake = _dead_endpoint_store()
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=reusable(fake))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert _fork_holding() == 0 and _fork_holding([1, 2], {"a": None}) == 0
    assert fake.list_requests == 0 and ds.source._keys is None
    assert ds.source in sharing._pending, "still due at the fork of a process that reads it"


_read_store: list = []  # the store the DataLoader below reads (its workers see their fork's copy)


def _worker_lists(batch) -> tuple[int, int]:
    """In a DataLoader worker: this worker's copy of the store's LIST count, and its pid."""
    return _read_store[0].list_requests, os.getpid()


def test_a_dataset_never_read_does_not_hold_up_another_datasets_forked_workers(caplog):
    """A dataset over a dead endpoint, never iterated, is not listed when a DataLoader over
    another dataset forks its workers: no LIST to it, no warning naming it. The dataset read
    is listed once, in this process, and its workers share that listing."""
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset

    from fakes import FakeStore, SharedFake, payloads

    dead_fake = _dead_endpoint_store()
    dead = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=SharedFake(dead_fake))
    fake = FakeStore.with_objects("bucket", payloads(7), page_size=3)
    live = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=SharedFake(fake))
    _read_store[:] = [fake]
    with caplog.at_level(logging.WARNING, logger="loader"):
        got = list(DataLoader(live, batch_size=1, num_workers=2, collate_fn=_worker_lists))
    assert len(got) == 7 and len({pid for _, pid in got}) == 2
    assert fake.list_requests == 3 and {lists for lists, _ in got} == {3}, \
        "one listing, in this process; no worker listed again"
    assert dead_fake.list_requests == 0 and dead.source._keys is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _dead_endpoint_store():
    from loader.s3.error_answers import unreachable

    from fakes import FakeStore, payloads

    dead = unreachable("http://127.0.0.1:9", "bucket", "train/", listing=True, reason="refused")
    return FakeStore.with_objects("bucket", payloads(7), list_fail={"train/": dead})


def test_a_listing_that_fails_before_a_fork_is_raised_in_the_forked_workers_not_listed_again(caplog):
    """A fork hook cannot raise: its failure is a warning here, and each forked child raises
    that very error at once instead of listing again (against a dead endpoint, every worker
    would wait as long as the parent did)."""
    import multiprocessing

    from loader import AsyncS3Dataset, EndpointUnreachableError, RetryPolicy

    from fakes import reusable

    fake = _dead_endpoint_store()
    retry = RetryPolicy(max_attempts=2, base_delay=0.001)
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=Store(backend=reusable(fake), retry=retry))

    def child(ds) -> None:
        before = fake.list_requests
        try:
            ds.keys()
        except EndpointUnreachableError as exc:
            os._exit(0 if fake.list_requests == before and "127.0.0.1:9" in str(exc) else 2)
        os._exit(1)

    with caplog.at_level(logging.WARNING, logger="loader"):  # started holding the dataset, as a worker is
        process = multiprocessing.get_context("fork").Process(target=child, args=(ds,))
        process.start()
        process.join()
    assert process.exitcode == 0, "the child raised the parent's error without a LIST of its own"
    assert fake.list_requests == 2, "the parent tried, with its retries, once"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot connect to http://127.0.0.1:9" in m and "none lists again" in m for m in warned)
    with pytest.raises(EndpointUnreachableError, match="127.0.0.1:9"):
        ds.keys()  # the parent itself may try again, and meets the same answer
    assert fake.list_requests == 4


def test_a_dataloader_over_a_dead_endpoint_fails_with_the_listings_error():
    """What a user sees: the listing's own error, naming the endpoint and the fix, from the
    first batch; the workers the DataLoader forked did not list again."""
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, EndpointUnreachableError, RetryPolicy

    from fakes import reusable

    fake = _dead_endpoint_store()
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/",
                                    store=Store(backend=reusable(fake), retry=RetryPolicy(max_attempts=1)))
    with pytest.raises(EndpointUnreachableError, match=r"127\.0\.0\.1:9.*AWS_ENDPOINT_URL") as info:
        next(iter(DataLoader(ds, batch_size=None, num_workers=2)))
    assert "no worker listed again" in str(info.value) and fake.list_requests == 1
    traceback.clear_frames(info.tb)  # the iterator its frames hold ends its workers now, not in 10 s


def test_a_dataset_whose_listing_failed_before_the_fork_is_freed_with_its_workers():
    """The error kept for the forked workers holds no frame: once the user drops the DataLoader
    and the dataset, the garbage collector frees both and the workers end. (Its traceback's
    frames held the iterator that was forking, its workers and the dataset the error is kept
    under: none of them was ever freed.)"""
    import gc
    import multiprocessing
    import weakref

    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, EndpointUnreachableError, RetryPolicy

    from fakes import reusable

    before = set(multiprocessing.active_children())
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=Store(backend=reusable(_dead_endpoint_store()),
                                                                      retry=RetryPolicy(max_attempts=1)))
    try:
        next(iter(DataLoader(ds, batch_size=None, num_workers=2)))
    except EndpointUnreachableError as exc:
        # torch's reraise frame holds the error it raises (torch's cycle): cleared, the iterator
        # goes now, not in the collection below, where torch's finalizer waits 5 s a worker.
        # The error the package keeps for forked workers is another one, with frames of its own.
        traceback.clear_frames(exc.__traceback__)
    else:
        raise AssertionError("the DataLoader read a dead endpoint")
    dataset = weakref.ref(ds)
    del ds
    gc.collect()
    assert dataset() is None, "the dataset outlived every reference of the user's"
    assert not set(multiprocessing.active_children()) - before, "the workers still run"


def test_the_kept_error_drops_every_traceback_under_it_and_keeps_its_message():
    """Its cause, its context and an exception group's members lose their tracebacks too (each
    one's frames hold the stack it was raised on); the error still reads and types the same."""
    def raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
        try:
            raise error from cause
        except BaseException as exc:
            return exc

    if sys.version_info >= (3, 11):
        from builtins import ExceptionGroup
    else:  # anyio's dependency there
        from exceptiongroup import ExceptionGroup

    member = raised(ConnectionRefusedError("refused"))
    group = raised(ExceptionGroup("listing tasks", [member]))
    context = raised(TimeoutError("slow"))
    outer = raised(OSError("cannot list s3://bucket/train/"), cause=group)
    outer.__context__ = context
    assert all(e.__traceback__ is not None for e in (member, group, context, outer))

    kept = sharing._without_frames(outer)
    assert kept is outer and str(kept) == "cannot list s3://bucket/train/" and type(kept) is OSError
    assert [e.__traceback__ for e in (member, group, context, outer)] == [None] * 4
    assert kept.__cause__ is group and group.exceptions == (member,)


def test_pickling_a_dataset_lists_nothing_unless_it_starts_a_process():
    """``pickle.dumps(ds)`` does no I/O (a dead endpoint cannot make it hang); pickling that
    starts a spawned or forkserver worker is where a rank lists for such workers."""
    from multiprocessing.context import set_spawning_popen

    from loader import AsyncS3Dataset, AsyncS3MapDataset

    from fakes import FakeStore, SharedFake, payloads

    fake = FakeStore.with_objects("bucket", payloads(7), page_size=3)
    objects = AsyncS3Dataset.from_prefix("s3://bucket/train/", store=SharedFake(fake))
    mapped = AsyncS3MapDataset.from_prefix("s3://bucket/train/", store=SharedFake(fake))
    pickle.dumps(objects), pickle.dumps(mapped)
    assert fake.list_requests == 0 and objects.source._keys is None and mapped.source._keys is None
    set_spawning_popen(object())  # as multiprocessing does while it starts a spawned worker
    try:
        objects.__getstate__(), mapped.__getstate__()  # what multiprocessing's pickler calls
    finally:
        set_spawning_popen(None)
    assert fake.list_requests == 6, "one listing each, in the process that starts the worker"
    assert len(objects.source._keys) == len(mapped.source._keys) == 7
