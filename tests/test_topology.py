"""Tests for ``loader.topology``: rank from the environment or torch.distributed, worker ids."""

from __future__ import annotations

import os
import pickle
import socket
from multiprocessing.context import set_spawning_popen
from multiprocessing.popen_spawn_posix import _DupFd
from multiprocessing.reduction import ForkingPickler

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from loader import Split, topology
from loader.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_single_process_by_default():
    assert topology.world() == (0, 1)
    assert topology.local_rank() == 0
    assert topology.worker() == (0, 1)


def test_rank_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert topology.world() == (3, 8)
    assert topology.local_rank() == 1


def test_explicit_environ_mapping():
    assert topology.world({"RANK": "0", "WORLD_SIZE": "2"}) == (0, 2)
    assert topology.local_rank({"LOCAL_RANK": " 2 "}) == 2


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK='2' is not below WORLD_SIZE='2'"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK='-1' must be >= 0"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE='0' must be >= 1"),
        ({"RANK": "0"}, r"RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "4"}, r"WORLD_SIZE is set but RANK is not"),
    ],
)
def test_bad_environment_is_named(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        topology.world()


def test_bad_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='first' is not an integer"):
        topology.local_rank()


class _WhoAmI(IterableDataset):
    def __iter__(self):
        yield (*topology.worker(), topology.readers())


def test_worker_inside_dataloader_workers(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    got = sorted(DataLoader(_WhoAmI(), batch_size=None, num_workers=2))
    # (worker id, num_workers, readers): the job's 3 ranks x 2 workers read at once
    assert [tuple(int(x) for x in row) for row in got] == [(0, 2, 6), (1, 2, 6)]


@pytest.mark.parametrize(("env", "readers"), [({}, 1), ({"RANK": "2", "WORLD_SIZE": "4"}, 4),
                                               ({"RANK": "0"}, 1), ({"RANK": "5", "WORLD_SIZE": "4"}, 1)])
def test_readers_in_the_main_process_is_the_world_size(env, readers):
    """Wrong rank variables count as one process here: the dataset reports them where it needs the rank."""
    assert topology.readers(env) == readers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_initialized_process_group_wins_over_environment(monkeypatch):
    dist.init_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        monkeypatch.setenv("RANK", "5")
        monkeypatch.setenv("WORLD_SIZE", "8")
        assert topology.world() == (0, 1)
    finally:
        dist.destroy_process_group()
    assert topology.world() == (5, 8)


# ----------------------------------------------------------------- ranks carried into workers


@pytest.fixture
def in_worker(monkeypatch):
    """Run as if inside a DataLoader worker whose parent is ``parent[0]`` (this process by default)."""
    parent = [os.getpid()]
    monkeypatch.setattr(topology, "in_worker", lambda: True)
    monkeypatch.setattr(topology, "parent_pid", lambda: parent[0])
    monkeypatch.setattr(topology, "_carried_world_size", None)  # what world() carries here is undone after
    return parent


def test_a_spawned_worker_takes_the_world_its_parent_saw(in_worker, monkeypatch):
    monkeypatch.setattr(topology, "worker", lambda: (0, 4))
    assert topology.readers() == 4  # nothing says there are other ranks yet
    launch = topology.Launch(pid=os.getpid(), rank=2, world_size=3, source=topology.GROUP)
    assert topology.world(launch=launch, unpickled_here=True) == (2, 3)
    assert topology.readers() == 12  # its job: 3 ranks x 4 workers, from what the dataset carried


def test_a_forked_worker_reads_what_it_inherited(in_worker, monkeypatch):
    stale = topology.Launch(pid=12345, rank=2, world_size=3, source=topology.GROUP)
    assert topology.world(launch=stale, unpickled_here=False) == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert topology.world(launch=stale, unpickled_here=False) == (1, 4)


def test_a_worker_sent_the_dataset_by_another_process_uses_the_environment(in_worker, monkeypatch):
    other = topology.Launch(pid=12345, rank=2, world_size=3, source=topology.GROUP)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert topology.world(launch=other, unpickled_here=True) == (1, 4)


@pytest.mark.parametrize("launch", [None, topology.Launch(12345, 2, 3, topology.GROUP)])
def test_a_worker_that_cannot_know_its_rank_fails_loudly(in_worker, launch):
    with pytest.raises(ConfigError, match=r"cannot tell this DataLoader worker's rank.*"
                                          r"Pass rank= and world_size="):
        topology.world(launch=launch, unpickled_here=True)


def test_the_main_process_ignores_a_carried_world():
    launch = topology.Launch(pid=os.getpid(), rank=2, world_size=3, source=topology.GROUP)
    assert topology.world(launch=launch, unpickled_here=True) == (0, 1)


def test_slurm_without_a_rank_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(topology, "_warned_slurm", False)
    env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    with caplog.at_level("WARNING", logger=topology.__name__):
        assert topology.world(env) == (0, 1)
        assert topology.world(env) == (0, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "SLURM_NTASKS=4" in warnings[0]
    assert "RANK=$SLURM_PROCID" in warnings[0]


class _FakePopen:
    """Stands in for the Popen of a process being started, so that pickling behaves as it does
    for a spawned DataLoader worker (shared memory handed over as a file descriptor)."""

    DupFd = _DupFd  # the name multiprocessing looks up

    @staticmethod
    def duplicate_for_child(fd):
        return os.dup(fd)


def _pickled_for_a_worker(obj):
    set_spawning_popen(_FakePopen())
    try:
        data = ForkingPickler.dumps(obj)  # as multiprocessing pickles a process being started
    finally:
        set_spawning_popen(None)
    return pickle.loads(data)


def _dataset(n=24, **options):
    from loader import AsyncS3Dataset, S3Config

    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    keys = [f"train/{i:04d}.bin" for i in range(n)]
    return AsyncS3Dataset.from_keys("bucket", keys, shuffle=True, seed=3, config=config, **options)


def test_pickling_for_a_worker_carries_the_parents_rank(in_worker, monkeypatch):
    ds = _dataset()
    monkeypatch.setenv("RANK", "1")  # what the parent knows (its group, in an mp.spawn rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with monkeypatch.context() as m:
        m.setattr(topology, "in_worker", lambda: False)
        expected = ds.source.plan(ds._slot())
        worker_copy = _pickled_for_a_worker(ds)
    monkeypatch.delenv("RANK")  # the worker has neither group nor environment
    monkeypatch.delenv("WORLD_SIZE")
    assert worker_copy.source.plan(worker_copy._slot()) == expected
    assert len(expected) == 12


def test_explicit_rank_wins_over_everything(in_worker, monkeypatch):
    ds = _dataset(split=Split(rank=1, world_size=3))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    worker_copy = _pickled_for_a_worker(ds)
    assert worker_copy._world() == ds._world() == (1, 3)


def test_a_worker_copy_follows_the_epoch_set_after_it_was_made():
    ds = _dataset()  # no set_epoch before the worker copy is made
    worker_copy = _pickled_for_a_worker(ds)
    ds.set_epoch(1)
    assert worker_copy.epoch == 1
    ds.set_epoch(5)
    assert worker_copy.epoch == 5


def test_a_plain_copy_has_an_epoch_of_its_own():
    ds = _dataset()
    ds.set_epoch(2)
    copy = pickle.loads(pickle.dumps(ds))
    copy.set_epoch(7)
    assert (ds.epoch, copy.epoch) == (2, 7)


def test_a_process_that_is_not_the_owner_takes_its_own_cell(monkeypatch):
    """A rank started with a dataset built in its launcher must not move the launcher's (and the
    other ranks') epoch; a DataLoader worker, though, writes its parent's cell."""
    launcher = topology.SharedEpoch(0)
    rank_copy = _pickled_for_a_worker(launcher)
    rank_copy._owner = -1  # as if unpickled in another process
    rank_copy.value = 3
    assert (launcher.value, rank_copy.value) == (0, 3)
    worker_copy = _pickled_for_a_worker(launcher)
    worker_copy._owner = -1
    monkeypatch.setattr(topology, "in_worker", lambda: True)
    worker_copy.value = 4
    assert launcher.value == 4


def test_a_fork_hands_the_forking_process_its_own_cell():
    launcher = topology.SharedEpoch(0)
    rank_copy = _pickled_for_a_worker(launcher)
    rank_copy._owner = -1
    topology._epochs.run_before_fork()  # what runs before every fork
    rank_copy.value = 6
    assert (launcher.value, rank_copy.value, rank_copy._owner) == (0, 6, os.getpid())


def test_no_module_reads_another_librarys_frames():
    """What the loader learns of torch comes through its public API: no module reads a caller's
    frame (``sys._getframe``, ``inspect.currentframe``), whose locals change without notice.
    One exception, named: the fork hook finds the process being started on the stack, the
    standard library's ``multiprocessing`` ``BaseProcess.start``, and reads only its ``self``
    (``listing.sharing._process_being_started`` says why nothing else can tell it)."""
    import ast
    import pathlib
    import re

    package = pathlib.Path(topology.__file__).parent
    reading = re.compile(r"\b_getframe\b|\bcurrentframe\b|\bf_locals\b|\bf_back\b")
    found = []
    for path in sorted(package.rglob("*.py")):
        functions = [node for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if reading.search(line):
                inside = [f.name for f in functions if f.lineno <= number <= (f.end_lineno or f.lineno)]
                found.append((str(path.relative_to(package)), inside[-1] if inside else None))
    assert set(found) <= {("listing/sharing.py", "_process_being_started")}, found
