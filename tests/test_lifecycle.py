"""``LiveObjects``: what a forked child disowns and what exit closes, registered on first use;
``join_thread``: a thread joined until the OS has it gone (a fork may follow)."""

from __future__ import annotations

import gc
import os
import threading

import pytest
from os_threads import HAS_TASKS, WHY_NOT, alive, linger_at_exit

from loader.lifecycle import LiveObjects, join_thread


class Thing:
    def __init__(self) -> None:
        self.events: list[str] = []


def test_hooks_run_for_each_live_object_and_a_child_forgets_the_parents():
    seen: list[str] = []
    live: LiveObjects[Thing] = LiveObjects(before_fork=lambda t: seen.append("before"),
                                           in_child=lambda t: t.events.append("disowned"))
    a, b = Thing(), Thing()
    live.add(a)
    live.add(b)
    live.run_before_fork()
    assert seen == ["before", "before"] and len(live) == 2
    live.run_in_child()
    assert a.events == b.events == ["disowned"] and len(live) == 0


def test_objects_are_held_weakly():
    live: LiveObjects[Thing] = LiveObjects(at_exit=lambda t: None)
    live.add(Thing())
    gc.collect()
    assert len(live) == 0


def test_an_exit_hook_that_fails_does_not_stop_the_others():
    closed: list[Thing] = []

    def close(thing: Thing) -> None:
        closed.append(thing)
        raise RuntimeError("already closed")

    live: LiveObjects[Thing] = LiveObjects(at_exit=close)
    things = [Thing(), Thing()]
    for thing in things:
        live.add(thing)
    live.run_at_exit()
    assert sorted(map(id, closed)) == sorted(map(id, things))


def test_a_real_fork_runs_the_hooks_registered_on_first_add():
    live: LiveObjects[Thing] = LiveObjects(in_child=lambda t: t.events.append("disowned"))
    thing = Thing()
    live.add(thing)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what the hook did, then leave without any cleanup
        os.write(write_end, f"{thing.events}|{len(live)}".encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        report = reader.read().decode()
    os.waitpid(pid, 0)
    assert report == "['disowned']|0"
    assert thing.events == [] and len(live) == 1  # the parent keeps its objects untouched


@pytest.mark.skipif(not HAS_TASKS, reason=WHY_NOT)
def test_join_thread_returns_once_the_os_has_the_thread_gone_not_only_python():
    """A fork right after a plain ``join`` can catch the thread in its C-level exit (OpenSSL's
    handlers hold a lock of the whole process there): ``join_thread`` waits that out."""
    # lingers long: nothing waits for it, and a loaded machine's pause before the check below
    # must not outlast it (the precondition, not the package, would then fail)
    plain = threading.Thread(target=linger_at_exit, args=(5.0,))
    plain.start()
    plain.join()
    assert alive(plain.native_id), "the lingering end this test relies on did not happen"

    ours = threading.Thread(target=linger_at_exit, args=(0.3,))
    ours.start()
    join_thread(ours)
    assert not alive(ours.native_id)


@pytest.mark.skipif(not HAS_TASKS, reason=WHY_NOT)
def test_join_thread_gives_up_on_an_os_thread_that_does_not_end_within_its_bound():
    stuck = threading.Thread(target=linger_at_exit, args=(2.0,))
    stuck.start()
    join_thread(stuck, most=0.05)  # returns (a close must not hang on it) ...
    assert not stuck.is_alive()
    assert alive(stuck.native_id), "it waited for the OS thread past its bound"  # ... while it lingers
