"""``LiveObjects``: what a forked child disowns and what exit closes, registered on first use."""

from __future__ import annotations

import gc
import os

from loader.lifecycle import LiveObjects


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
