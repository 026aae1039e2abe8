"""A thread whose end at the OS level outlasts ``Thread.join``, as a thread's does while its
C-level exit handlers run (OpenSSL's free its random generators under a process-wide lock).

``linger_at_exit(seconds)``, called in a thread, makes the OS thread run that long after its
Python state is gone: a POSIX thread-specific value whose destructor is libc's ``usleep``,
called with the value (microseconds) when the thread exits. Linux only (``/proc/self/task``
shows whether the OS thread is still there).
"""

from __future__ import annotations

import ctypes
import functools
import os

HAS_TASKS = os.path.isdir("/proc/self/task")
WHY_NOT = "needs Linux's /proc/self/task to see an OS thread's end"


@functools.cache
def _key() -> ctypes.c_uint:
    libc = ctypes.CDLL(None)
    key = ctypes.c_uint()
    destructor = ctypes.cast(libc.usleep, ctypes.c_void_p)  # called as usleep(value) at thread exit
    assert libc.pthread_key_create(ctypes.byref(key), destructor) == 0
    return key


def linger_at_exit(seconds: float) -> None:
    """The calling thread, once its Python function returned, stays ``seconds`` at the OS level."""
    libc = ctypes.CDLL(None)
    assert libc.pthread_setspecific(_key(), ctypes.c_void_p(int(seconds * 1e6))) == 0


def alive(native_id: int | None) -> bool:
    """Whether the OS thread ``native_id`` of this process still exists."""
    return native_id is not None and os.path.exists(f"/proc/self/task/{native_id}")
