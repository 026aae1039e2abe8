"""Key lists the processes of one machine share: one file per listing, found by name, mapped
read-only by each process, removed when the last process that may need it has gone. The same
files hold the rate limit a DataLoader's workers hand on to its next epoch's (``rate_handoff``).

* **Where**: ``$LOADER_SHARE_DIR``, else ``/dev/shm`` (memory: mapping it reads no disk), else
  the temporary directory; a file that does not fit in the first goes to the next.
* **Names**: ``loader-keys-<job>-<listing>``. The caller's ``<job>`` differs between jobs by
  construction (an id the job's key-value store hands out, or an anchor's pid and start time),
  so a file left by a killed job is never taken for this job's.
* **Holders**: a file stays while one of its *anchors* lives, the long-lived processes whose
  processes use it (a rank's main process; never a DataLoader worker, which may end every epoch
  while the file must stay for the next one). Each anchor has a marker file
  ``<name>.h<pid>-<start time>``; at exit it removes its markers, and the files whose last
  anchor it was. Files whose anchors all died without that (SIGKILL) are removed by the next
  process that shares a file on the machine (``sweep``).
* **Locks**: ``flock`` on ``<name>.<role>.lock`` elects the process that lists or fetches; the
  others wait, then map its file. A lock dies with its process, so a crash never wedges one.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any

from .. import topology
from ..s3 import handoff
from ..s3.handoff import Handoff
from . import keylist
from .keyfile import KeyFile, open_keys, parse_keys, write_keys
from .keylist import KeyList

try:
    import fcntl
except ImportError:  # Windows: no flock; sharing between processes is then off (see ``supported``)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

PREFIX = "loader-keys-"
SHARE_DIR_ENV = "LOADER_SHARE_DIR"
SPILL_MIN = 1 << 20  # a key list smaller than this pickles as bytes into a spawned process
_LOCK_POLL = (0.005, 0.1)  # first and longest pause between tries of a held lock


def supported() -> bool:
    """Whether this platform has what sharing needs (``flock``)."""
    return fcntl is not None


def share_dirs() -> list[Path]:
    """Where shared key lists go, in order of preference (the same in every process)."""
    chosen = os.environ.get(SHARE_DIR_ENV)
    if chosen:
        return [Path(chosen)]
    places = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    usable = [p for p in places if p.is_dir() and os.access(p, os.W_OK | os.X_OK)]
    return list(dict.fromkeys(usable)) or [Path(tempfile.gettempdir())]


def process_ident(pid: int) -> str:
    """``<pid>-<start time>``: names one process for good (a pid alone is reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        start = stat[stat.rindex(b")") + 2:].split()[19].decode()  # field 22, starttime
    except (OSError, IndexError, ValueError):
        start = "0"  # no /proc: the pid alone
    return f"{pid}-{start}"


def is_alive(ident: str) -> bool:
    """Whether the process ``process_ident`` named is still running."""
    pid_text, _, start = ident.partition("-")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass  # someone else's process with that pid: alive, but maybe not ours
    return start == "0" or process_ident(pid) == ident


class NodeFile:
    """One shared key list on this machine: ``open`` it if it is there, else, under ``lock``,
    make it with ``publish`` (or ``publish_bytes``, the file as another node sent it)."""

    def __init__(self, name: str) -> None:
        self.name = PREFIX + name
        self.dirs = share_dirs()

    def open(self, anchor: int) -> KeyList | None:
        """The mapped key list if a process of this machine made it already (held for
        ``anchor`` from now on), else None."""
        self.hold(anchor)
        for where in self.dirs:
            path = where / f"{self.name}.keys"
            with contextlib.suppress(FileNotFoundError):
                return open_keys(path)
        return None

    def exists(self) -> bool:
        """Whether a process of this machine made the file (nothing is held or created)."""
        return any((where / f"{self.name}.keys").exists() for where in self.dirs)

    def hold(self, anchor: int) -> None:
        """Keep the file while ``anchor`` lives (see the module doc)."""
        marker = self.dirs[0] / f"{self.name}.h{process_ident(anchor)}"
        if not marker.exists():
            marker.touch()
        if anchor == os.getpid():
            release_at_exit()

    @contextlib.contextmanager
    def lock(self, role: str) -> Iterator[None]:
        """Hold ``<name>.<role>.lock`` (waiting for it, interruptibly) for the block."""
        path = self.dirs[0] / f"{self.name}.{role}.lock"
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            pause = _LOCK_POLL[0]
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(pause)
                    pause = min(pause * 2, _LOCK_POLL[1])
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def publish(self, keys: KeyList, anchor: int,
                source: dict[str, str] | None = None) -> KeyList:
        """Write ``keys`` for the other processes of this machine; the mapped copy (the
        in-memory one can go). A machine short of room gets the list in memory, with a warning."""
        self.hold(anchor)
        sweep()
        notes = keys._origin.notes if keys._origin is not None else None  # a snapshot's, kept
        return self._place(lambda path: write_keys(keys, path, source=source, notes=notes), keys)

    def publish_bytes(self, blob: bytes, anchor: int) -> KeyList:
        """Write a key list file received whole (from another machine); the mapped copy."""
        self.hold(anchor)
        sweep()

        def write(path: Path) -> None:
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                temporary.write_bytes(blob)
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    temporary.unlink()
                raise

        return self._place(write, None, blob)

    def _place(self, write: Any, keys: KeyList | None, blob: bytes | None = None) -> KeyList:
        failure: OSError | None = None
        for where in self.dirs:
            path = where / f"{self.name}.keys"
            try:
                write(path)
                return open_keys(path)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
                    raise
                failure = exc
        log.warning("no room to share a key list in %s (%s): each process keeps its own copy; "
                    "set %s to a directory with room", ", ".join(map(str, self.dirs)), failure,
                    SHARE_DIR_ENV)
        return keys if keys is not None else parse_keys(blob or b"")


_released_for: int | None = None


def release_at_exit() -> None:
    """Remove this process's markers (and the files only it held) when it exits; once per
    process. Forked children do not run it (they leave through ``os._exit``)."""
    global _released_for
    if _released_for != os.getpid():
        _released_for = os.getpid()
        atexit.register(release, process_ident(os.getpid()))


def release(ident: str) -> None:
    """``ident`` no longer holds anything: drop its markers, and every file no live anchor
    holds any more."""
    suffix = f".h{ident}"
    for where in share_dirs()[:1]:
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                if entry.name.startswith(PREFIX) and entry.name.endswith(suffix):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    _remove_unheld(entry.name[:-len(suffix)])


def sweep() -> None:
    """Remove the shared files of this machine that no live process holds (killed jobs')."""
    names: set[str] = set()
    for where in share_dirs():
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                base = _base_of(entry.name)
                if base is not None:
                    names.add(base)
    for name in names:
        _remove_unheld(name)


def _base_of(file: str) -> str | None:
    """``loader-keys-<job>-<listing>`` of any of its files (data, marker, lock, temporary)."""
    if file.startswith("." + PREFIX) and file.endswith(".tmp"):
        file = file[1:]
    if not file.startswith(PREFIX):
        return None
    return file.split(".", 1)[0]


def _remove_unheld(name: str) -> None:
    """Remove every file of ``name`` unless a live anchor holds it or a process is making it."""
    dirs = share_dirs()
    markers = []
    with contextlib.suppress(OSError):
        markers = [e for e in os.scandir(dirs[0]) if e.name.startswith(f"{name}.h")]
    if any(is_alive(marker.name[len(name) + 2:]) for marker in markers):
        return
    locks = []
    with contextlib.ExitStack() as held:
        for where in dirs[:1]:
            with contextlib.suppress(OSError):
                locks = [e.path for e in os.scandir(where)
                         if e.name.startswith(name + ".") and e.name.endswith(".lock")]
        for lock in locks:
            try:
                descriptor = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            held.callback(os.close, descriptor)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a process is listing or fetching it right now
        for where in dirs:
            with contextlib.suppress(OSError):
                for entry in os.scandir(where):
                    if _base_of(entry.name) == name:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)


# ---------------------------------------------------------------------------- pickling


def reduce_keys(keys: KeyList) -> tuple[Any, ...] | None:
    """How a ``KeyList`` pickles into a process being started (a spawned or forkserver
    DataLoader worker, an ``mp.spawn`` rank): as a reference to its file, after writing one when
    the list is large and in memory, so that the machine keeps one copy. Otherwise (a checkpoint,
    a queue) None: its buffers, self-contained (``KeyList.__reduce__``)."""
    file: KeyFile | None = keys._origin
    if get_spawning_popen() is None or not supported():
        return None
    if file is None and keys.nbytes >= SPILL_MIN:
        file = spill(keys)
    return None if file is None else (_reopen, (file.path, file.id))


keylist.SPAWN_REDUCER = reduce_keys


# ---------------------------------------------------------------------------- a DataLoader's rate limit


def rate_handoff(endpoint: str, bucket: str, every: float) -> Handoff | None:
    """Where this DataLoader worker hands the rate limit of ``bucket`` at ``endpoint`` on to the
    next epoch's workers (``s3.handoff``): files held for the process that runs its DataLoader;
    None outside a worker, or where the machine cannot share files."""
    anchor = topology.parent_pid() if topology.in_worker() else None
    if anchor is None or not supported():
        return None
    which = hashlib.sha256(f"{endpoint}\0{bucket}".encode()).hexdigest()[:16]
    node = NodeFile(f"r{process_ident(anchor)}-{which}")

    def first_write() -> None:
        sweep()
        node.hold(anchor)

    worker, workers = topology.worker()
    return Handoff(node.dirs[0] / node.name, worker, workers, every, first_write=first_write)


handoff.PLACE = rate_handoff


def spill(keys: KeyList) -> KeyFile:
    """Move ``keys`` into a shared file held by this process; ``keys`` reads from the map from
    now on (same content), and its in-memory buffers are released."""
    me = os.getpid()
    node = NodeFile(f"s{process_ident(me)}-{uuid.uuid4().hex[:12]}")
    mapped = node.publish(keys, me)
    if mapped is not keys:
        keys._blob, keys._ends, keys._sizes = mapped._blob, mapped._ends, mapped._sizes
        keys._etags, keys._origin = mapped._etags, mapped._origin
    return keys._origin


def _reopen(path: str, file_id: str) -> KeyList:
    return open_keys(path, expect_id=file_id)
