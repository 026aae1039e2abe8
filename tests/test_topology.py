"""Tests for ``loader.datasets.topology``: rank from the environment or torch.distributed, worker ids."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from loader.datasets import topology
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
        yield topology.worker()


def test_worker_inside_dataloader_workers():
    got = sorted(DataLoader(_WhoAmI(), batch_size=None, num_workers=2))
    assert [tuple(int(x) for x in pair) for pair in got] == [(0, 2), (1, 2)]


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
