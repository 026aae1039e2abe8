"""Objects of this process that a fork or the interpreter's exit must take care of.

A forked child inherits objects whose threads, event loops and locks stayed behind in the
parent: it must disown them, never call into them. One ``LiveObjects`` per kind of object holds
them weakly, with what to do for each; its hooks are registered on the first ``add``, never at
import (importing the package has no side effects).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
Hook = Callable[[T], None]

GONE_WITHIN = 1.0  # seconds ``join_thread`` waits for the OS to finish a joined thread: it takes
# microseconds (its C-level exit handlers); the bound only keeps a stuck one from stalling a close


def join_thread(thread: threading.Thread, most: float = GONE_WITHIN) -> None:
    """Join ``thread``, then wait until the OS has finished it too (Linux: its entry in
    ``/proc/self/task`` is gone), at most ``most`` seconds more.

    ``threading.Thread.join`` returns once the thread's Python state is gone, before the OS
    thread has run its C-level exit handlers; OpenSSL's free the thread's random generators
    under a lock of the whole process. A fork in that moment (a DataLoader starting its workers right after an epoch
    or a listing read over https in this process) gives the child that lock held by a thread it
    does not have: its first TLS handshake waits for good (openssl/openssl#19066). Every thread
    of the package that may have entered OpenSSL is joined through this.
    """
    thread.join()
    if thread.native_id is None or not os.path.isdir("/proc/self/task"):
        return  # never started, or no procfs (macOS: workers are spawned there by default)
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + most
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0002)


class LiveObjects(Generic[T]):
    """A weak set of live objects and what to do with each of them.

    ``before_fork``: in the parent, just before a fork. ``in_child``: in a forked child, after
    which the set is empty (the objects were the parent's; the child adds its own). ``at_exit``:
    at interpreter exit, errors suppressed (exit must go on).
    """

    def __init__(self, *, before_fork: Hook[T] | None = None, in_child: Hook[T] | None = None,
                 at_exit: Hook[T] | None = None) -> None:
        self._objects: weakref.WeakSet[T] = weakref.WeakSet()
        self._before_fork = before_fork
        self._in_child = in_child
        self._at_exit = at_exit
        self._hooked = False

    def add(self, obj: T) -> None:
        """Track ``obj`` (until it is garbage-collected); registers the hooks the first time."""
        if not self._hooked:
            self._hooked = True
            if self._before_fork is not None:
                os.register_at_fork(before=self.run_before_fork)
            if self._in_child is not None:
                os.register_at_fork(after_in_child=self.run_in_child)
            if self._at_exit is not None:
                atexit.register(self.run_at_exit)
        self._objects.add(obj)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._objects))  # a copy: hooks may drop objects while it runs

    def __len__(self) -> int:
        return len(self._objects)

    # What the hooks run (public, so that a test can run them without forking or exiting).

    def run_before_fork(self) -> None:
        for obj in self:
            if self._before_fork is not None:
                self._before_fork(obj)

    def run_in_child(self) -> None:
        for obj in self:
            if self._in_child is not None:
                self._in_child(obj)
        self._objects.clear()

    def run_at_exit(self) -> None:
        for obj in self:
            with contextlib.suppress(Exception):
                if self._at_exit is not None:
                    self._at_exit(obj)
