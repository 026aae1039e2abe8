"""``loader serve --background`` and ``--stop``: a server a shell script can start and end.

``eval "$(loader serve --background --pidfile F)"`` returns once the server is ready: a detached
second ``loader serve`` runs it and lets go of the pipe that ``$(...)`` waits on; ``--stop F``
ends it and waits until it is gone. How the hand-off works: docs/design/devserver.md.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from ..errors import ConfigError, LoaderError

DETACHED_FLAG = "--detached"  # the hidden option of the process that keeps serving
STOP_TIMEOUT = 30.0  # the server's own stop takes ~2 s (SIGTERM, then SIGKILL of weed)


class BackgroundError(LoaderError, RuntimeError):
    """The background server did not start, or a pidfile names no server to stop."""


def start_detached(argv: list[str], pidfile: Path, timeout: float) -> tuple[str, str]:
    """Run ``loader serve`` with ``argv`` detached; return (exports, status) once it is ready.

    Raises ``BackgroundError`` with the server's own error if it exits before it is ready, or
    if it is not ready within ``timeout`` seconds (then it is killed).
    """
    running = running_pid(pidfile)
    if running is not None:
        raise BackgroundError(
            f"a server already runs with pidfile {pidfile} (pid {running}); stop it with "
            f"`loader serve --stop {pidfile}` or choose another --pidfile"
        )
    command = [sys.executable, "-m", "loader", "serve", DETACHED_FLAG, "--pidfile", str(pidfile), *argv]
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = _read_until_closed(child, time.monotonic() + timeout)
    except TimeoutError:
        from .devserver import _terminate_group

        _terminate_group(child, STOP_TIMEOUT)
        raise BackgroundError(f"the server was not ready within {timeout:.0f} s; it was stopped") from None
    exports, status = out.decode(errors="replace"), err.decode(errors="replace")
    if child.poll() is None and "export " in exports:
        return exports, status
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=STOP_TIMEOUT)
    lines = [line for line in status.splitlines() if line.strip()]
    reason = lines[-1] if lines else f"it exited with code {child.returncode} and said nothing"
    raise BackgroundError(reason.removeprefix("loader serve: error: "))


def detach_stdio() -> None:
    """Close this process's hold on the caller's pipes: stdin, stdout, stderr -> /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)


def write_pidfile(pidfile: Path, endpoint: str) -> None:
    """``pid`` and endpoint, written whole (a reader never sees half a file)."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    partial = pidfile.with_name(pidfile.name + f".{os.getpid()}.tmp")
    partial.write_text(f"{os.getpid()}\n{endpoint}\n")
    os.replace(partial, pidfile)


def remove_pidfile(pidfile: Path) -> None:
    """Remove ``pidfile`` if it still names this process."""
    with contextlib.suppress(OSError, ValueError):
        if _read_pid(pidfile) == os.getpid():
            pidfile.unlink()


def stop(pidfile: Path, err: IO[str]) -> None:
    """SIGTERM the server ``pidfile`` names and wait until it is gone."""
    pid = running_pid(pidfile)
    if pid is None:
        raise BackgroundError(f"no server runs with pidfile {pidfile} (no such file, or its "
                              "process has ended)")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while _alive(pid):
        if time.monotonic() > deadline:
            raise BackgroundError(f"the server (pid {pid}) is still running {STOP_TIMEOUT:.0f} s "
                                  f"after SIGTERM; kill it with `kill -9 {pid}`")
        time.sleep(0.1)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    print(f"loader serve: stopped the server (pid {pid}) of {pidfile}", file=err)


def running_pid(pidfile: Path) -> int | None:
    """The pid of the live ``loader serve`` that ``pidfile`` names; None (and a stale file
    removed) when there is none. Refuses a pidfile whose pid is another program."""
    try:
        pid = _read_pid(pidfile)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"pidfile {pidfile} is not one `loader serve` wrote ({exc})") from None
    if not _alive(pid):
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()
        return None
    command = _command_line(pid)
    if command is not None and not (DETACHED_FLAG in command and str(pidfile) in command):
        raise BackgroundError(
            f"pidfile {pidfile} names pid {pid}, which is not a `loader serve` of this pidfile "
            f"({' '.join(command)[:120]!r}); not touching it"
        )
    return pid


def _read_pid(pidfile: Path) -> int:
    return int(pidfile.read_text().split()[0])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to a parent that does not reap counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) is all we know
    return state != "Z"


def _command_line(pid: int) -> list[str] | None:
    """The process's argv from /proc (None where there is no /proc)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _read_until_closed(child: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, bytes]:
    """Everything ``child`` writes to stdout and stderr until it has closed both."""
    assert child.stdout is not None and child.stderr is not None
    out_fd, err_fd = child.stdout.fileno(), child.stderr.fileno()
    received: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    try:
        with selectors.DefaultSelector() as selector:
            for fd in received:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        received[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
    finally:
        child.stdout.close()
        child.stderr.close()
    return b"".join(received[out_fd]), b"".join(received[err_fd])
