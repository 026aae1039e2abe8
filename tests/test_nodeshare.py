"""Node-shared key list files: one maker per machine, held while an anchor lives, then removed."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import time

import pytest

from loader.listing import nodeshare
from loader.listing.keylist import KeyList
from loader.listing.nodeshare import NodeFile, is_alive, process_ident, release, sweep

KEYS = KeyList.from_keys([f"k/{i:04d}" for i in range(100)], range(100))


pytestmark = pytest.mark.usefixtures("share_dir")  # every test gets a directory of its own (conftest)


def names(where) -> list[str]:
    return sorted(path.name for path in where.iterdir())


def make_or_map(name: str, made: str, out) -> None:
    """In a child: the machine's one listing, made here only if nobody made it yet."""
    node = NodeFile(name)
    keys = node.open(os.getpid())
    if keys is None:
        with node.lock("produce"):
            keys = node.open(os.getpid())
            if keys is None:
                with open(made, "a") as f:
                    f.write(f"{os.getpid()}\n")
                time.sleep(0.3)  # long enough for the others to queue on the lock
                keys = node.publish(KEYS, os.getpid())
    out.put((keys._origin.id, list(keys) == list(KEYS)))


def test_racing_processes_make_one_file_and_all_map_it(tmp_path, share_dir):
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    made = tmp_path / "made"
    children = [context.Process(target=make_or_map, args=("race", str(made), out)) for _ in range(4)]
    for child in children:
        child.start()
    results = [out.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert len(made.read_text().split()) == 1, "exactly one process made the list"
    assert len({file_id for file_id, _ in results}) == 1 and all(same for _, same in results)
    # every child was its own anchor and has exited (through os._exit, as forked children do)
    sweep()
    assert names(share_dir) == []


def test_a_file_stays_while_an_anchor_lives_and_goes_with_the_last(share_dir):
    context = multiprocessing.get_context("fork")
    other = context.Process(target=time.sleep, args=(60,))
    other.start()
    try:
        node = NodeFile("held")
        node.publish(KEYS, os.getpid())
        node.hold(other.pid)  # e.g. a second rank's main process on this machine
        release(process_ident(os.getpid()))
        assert f"{node.name}.keys" in names(share_dir), "another anchor still holds it"
        sweep()
        assert f"{node.name}.keys" in names(share_dir)
    finally:
        other.kill()
        other.join()
    assert not is_alive(process_ident(other.pid))
    sweep()  # what the next process sharing a file on this machine does
    assert names(share_dir) == []


def test_a_file_being_made_is_not_swept(share_dir):
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    node = NodeFile("busy")
    node.hold(dead.pid)  # only a dead anchor...
    with node.lock("produce"):  # ...but someone is making it right now
        sweep()
        assert names(share_dir)
    sweep()
    assert names(share_dir) == []


def test_no_room_to_share_keeps_the_list_in_memory_with_a_warning(monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nodeshare, "write_keys", full)
    with caplog.at_level(logging.WARNING, logger="loader.listing.nodeshare"):
        keys = NodeFile("full").publish(KEYS, os.getpid())
    assert keys is KEYS
    assert "no room to share a key list" in caplog.text and "LOADER_SHARE_DIR" in caplog.text


def test_a_process_is_named_by_pid_and_start_time():
    me = process_ident(os.getpid())
    pid, start = me.split("-")
    assert int(pid) == os.getpid() and is_alive(me)
    assert not is_alive(f"{pid}-{int(start) + 1}"), "the same pid started later is another process"
