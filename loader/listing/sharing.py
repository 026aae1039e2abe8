"""One listing per job, one copy of it per machine, however ranks and DataLoader workers start.

Where the listing happens, the one documented point (docs/design/listing-once-per-job.md): a
rank lists (or receives) its key list before its DataLoader starts workers, at the first of
``resolve``/``set_epoch``/``len``/``__iter__`` in the rank's own process, just before it forks
workers (``track``: an ``os.register_at_fork`` hook, for the datasets the process being started
holds), or when it pickles the dataset to start a spawned or forkserver worker. Pickling for
anything else lists nothing; nor does a fork that starts no process holding the dataset (a
plain ``os.fork``, another DataLoader's workers). A listing that fails in the fork hook cannot
raise there: it is logged as a warning, and each forked worker raises that very error at once
(``raise_if_failed_before_fork``) instead of listing again.

In a ``torch.distributed`` job rank 0 lists; one process per other machine fetches the result
once through the job's ``TCPStore``; every process of a machine maps the one file
``listing.nodeshare`` keeps. Listings are named by target and the dataset's ``ticket`` (so
ranks must build datasets in the same order) under a job id the store hands out. A plain process
lists in memory (its forked workers share the pages).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import logging
import os
import pickle
import sys
import time
import types
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .. import topology
from . import nodeshare
from .keyfile import to_bytes
from .keylist import KeyList

log = logging.getLogger(__name__)

START_WAIT = 300.0  # seconds a rank waits for rank 0 to start a listing before listing itself
CHUNK = 4 << 20  # bytes per store value: TCPStore's libuv server refuses values over 8 MiB
JOB_KEY = "loader/job"  # the job id every process of the job reads from its store
_POLL = (0.02, 0.5)  # first and longest pause between looks at the store

_tickets: collections.Counter[str] = collections.Counter()


class Ticket(int):
    """Which dataset over a target this is, in the order this process built them (from 1).

    An ``int`` that registers, wherever it arrives (built or unpickled), the clean-up of the
    shared files that DataLoader workers may anchor to that process (``nodeshare``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (int(self),))


def ticket(target: str) -> Ticket:
    """A new dataset over ``target``: its ticket (see the module doc)."""
    _tickets[target] += 1
    return _arrived(_tickets[target])


def _arrived(number: int) -> Ticket:
    if nodeshare.supported():
        nodeshare.release_at_exit()
    return Ticket(number)


class Job(NamedTuple):
    """A distributed job as this process reaches it: its rank, size and key-value store."""

    rank: int
    world_size: int
    store: Callable[[], Any]  # opens (or returns) this process's client of the job's store


def once_per_job(target: str, produce: Callable[[], KeyList], ticket: int = 0) -> KeyList:
    """The key list ``produce()`` makes, made once per job and mapped once per machine (see
    the module doc); just ``produce()`` in a plain process."""
    worker = topology.in_worker()
    job = _job(worker)
    if not nodeshare.supported():
        return produce()
    name = hashlib.sha256(f"{target}#{ticket}".encode()).hexdigest()[:20]
    anchor = (topology.parent_pid() or os.getpid()) if worker else os.getpid()
    if job is not None:
        return _in_job(job, name, target, anchor, produce)
    node = nodeshare.NodeFile(f"p{nodeshare.process_ident(anchor)}-{name}")
    if worker:  # the DataLoader workers of one process share its listing
        return _on_this_machine(node, anchor, produce)
    if node.exists():  # this process's workers listed already: no second listing here
        keys = node.open(anchor)
        if keys is not None:
            return keys
    return produce()  # a plain process: in memory, no file, no wait


def _on_this_machine(node: nodeshare.NodeFile, anchor: int, produce: Callable[[], KeyList]) -> KeyList:
    keys = node.open(anchor)
    if keys is not None:
        return keys
    with node.lock("produce"):
        keys = node.open(anchor)
        return keys if keys is not None else node.publish(produce(), anchor)


def _job(worker: bool) -> Job | None:
    """The job this process belongs to, if a multi-rank group is initialized here; else None.

    Never in a DataLoader worker: a forked worker must not open a connection to the job's store.
    A new connection makes rank 0's store thread resolve the peer's address, and a worker
    forked while that thread holds glibc's resolver lock inherits it held: its next name lookup
    (a store client's, or an S3 request's) then waits forever. Ranks list before their workers
    fork instead (``track``); a worker that still finds no key list lists for its rank, with a
    warning. A process that has not imported torch has no process group (and the command
    line, which needs no torch, is not made to import it here)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if worker:
        _warn_once("a DataLoader worker needs a key list its rank did not list before starting "
                   "it, so this rank's workers list it between them; call ds.resolve() (or "
                   "set_epoch) before iterating to list once per job")
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    except Exception as exc:  # noqa: BLE001 - any failure: this rank lists for itself
        log.debug("no key-value store in this process group (%s): this rank lists", exc)
        return None
    return Job(dist.get_rank(), dist.get_world_size(), lambda: store)


_pending: weakref.WeakSet[Any] = weakref.WeakSet()
_hooked_in: int | None = None
_REACH = 5_000  # objects the fork hook looks through for datasets in a process's arguments
_ITEMS = 1_000  # of each container: datasets are held in short ones, long ones are data (keys)


def track(dataset: Any) -> None:
    """List ``dataset``'s keys (if still needed) just before this process forks a process that
    holds it (a DataLoader worker reading it), so forked workers inherit them: the one point
    where a rank's own process runs before its workers do. Registered on first use, not at
    import. A failure there reaches the user through the workers (``raise_if_failed_before_fork``)."""
    global _hooked_in
    _pending.add(dataset)
    if _hooked_in != os.getpid():
        _hooked_in = os.getpid()
        os.register_at_fork(before=_before_fork)


def _before_fork() -> None:
    """List the pending datasets that the process being forked holds, and only those: a
    dataset never read by this fork (another DataLoader's, one whose endpoint is down) must
    not delay it, nor a plain ``os.fork``."""
    if topology.in_worker() or not _pending:
        return
    for dataset in held_by(_process_being_started(), list(_pending)):
        _pending.discard(dataset)  # one try per dataset, not one per worker forked
        try:
            resolve = getattr(dataset, "resolve", None)
            resolve() if resolve is not None else dataset.samples()
        except Exception as exc:  # noqa: BLE001 - a fork hook cannot raise: the workers will
            _failed[dataset] = (os.getpid(), _without_frames(exc))
            if _FAILED_NOTE not in getattr(exc, "__notes__", ()):
                exc.add_note(_FAILED_NOTE)
            log.warning("listing before the DataLoader forked its workers failed, so each worker "
                        "raises this error (none lists again): %s", exc)
        else:
            _failed.pop(dataset, None)


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` and the errors under it, their tracebacks dropped: a traceback's frames hold their
    callers' too, up to the DataLoader iterator that was forking, with its workers and the
    dataset this error is kept for (its weak key): kept, none of them would ever be freed. The
    workers raise it without the parent's traceback anyway."""
    stack, seen = [exc], set()
    while stack:
        error = stack.pop()
        if id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            stack.extend(e for e in (error.__cause__, error.__context__) if e is not None)
            stack.extend(getattr(error, "exceptions", ()))  # an ExceptionGroup's
    return exc


def _process_being_started() -> Any:
    """The ``multiprocessing`` process whose ``start()`` is forking now (a DataLoader worker,
    most often), else None (``os.fork`` called directly).

    The package's one read of a frame, and why: a fork hook is told nothing, and nothing of the
    process being started is reachable before ``os.fork`` returns (``multiprocessing`` records
    its children after). So the hook finds the standard library's
    ``multiprocessing.process.BaseProcess.start`` on the stack by its code object and reads only
    its ``self``; were that ever to change, the hook would find no process and list nothing,
    each forked worker would list for itself, and ``tests/test_sharing.py`` (one listing per
    job) would fail."""
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return None
    start = process.BaseProcess.start.__code__
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is start:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def held_by(process: Any, wanted: list[Any]) -> list[Any]:
    """Those of ``wanted`` that ``process``'s arguments hold: one of them, or a dataset (or a
    wrapper of one) holding it in an attribute or a container; none when ``process`` is None.
    Functions, classes and modules are not looked into (a module's globals hold everything);
    at most ``_ITEMS`` of a container and ``_REACH`` objects in all (a few ms at most)."""
    if process is None or not wanted:
        return []
    targets = {id(obj): obj for obj in wanted}
    found: dict[int, Any] = {}
    queue = collections.deque([getattr(process, "_args", ()), getattr(process, "_kwargs", {})])
    seen: set[int] = set()
    budget = _REACH  # objects queued in all: a bound on the hook's time, whatever the arguments
    while queue and len(found) < len(targets):
        obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in targets:
            found[id(obj)] = obj
        before = len(queue)
        queue.extend(itertools.islice(_parts(obj), min(budget, _ITEMS)))
        budget -= len(queue) - before
    return list(found.values())


_OPAQUE = (str, bytes, bytearray, memoryview, int, float, complex, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType)


def _parts(obj: Any) -> Iterable[Any]:
    """What ``obj`` holds, as far as the fork hook looks: items, values, instance attributes."""
    if obj is None or isinstance(obj, _OPAQUE):
        return ()
    if isinstance(obj, dict):
        return obj.values()
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return obj
    if isinstance(obj, functools.partial):
        return (*obj.args, *obj.keywords.values())
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no attributes to look into (or a proxy's): nothing held
        return ()
    return attributes.values() if isinstance(attributes, dict) else ()


_FAILED_NOTE = ("(raised by the listing this process ran just before the DataLoader forked its "
                "workers; no worker listed again)")
# what failed in the fork hook, with the pid of the process that tried: its forked children raise it
_failed: weakref.WeakKeyDictionary[Any, tuple[int, BaseException]] = weakref.WeakKeyDictionary()


def raise_if_failed_before_fork(dataset: Any) -> None:
    """In a process forked after ``dataset``'s listing failed in its parent's fork hook: raise
    that error now, rather than list again (against a dead endpoint, every worker would wait as
    long as the parent did). The parent itself may try again (``resolve``). Raised without the
    parent's traceback and the library error under it (this process's copy): the DataLoader
    prints the worker's traceback into its message, and the parent's frames (a refused
    connection deep in ``http.client``) would bury the error's own advice there."""
    failed = _failed.get(dataset)
    if failed is not None and failed[0] != os.getpid():
        raise failed[1].with_traceback(None) from None


def _in_job(job: Job, name: str, target: str, anchor: int, produce: Callable[[], KeyList]) -> KeyList:
    import torch.distributed as dist

    store = job.store()
    job_id = store.compare_set(JOB_KEY, "", uuid.uuid4().hex).decode()
    kv = dist.PrefixStore(f"loader/listing/{name}/", store)
    node = nodeshare.NodeFile(f"{job_id[:16]}-{name}")
    keys = node.open(anchor)
    if keys is None and job.rank == 0:
        keys = _lead(kv, node, target, anchor, produce)
    elif keys is None:
        keys = _follow(kv, node, target, anchor, produce)
    if job.rank != 0:
        _got(kv, job.rank, job.world_size)
    return keys


def _lead(kv: Any, node: nodeshare.NodeFile, target: str, anchor: int,
          produce: Callable[[], KeyList]) -> KeyList:
    """Rank 0: list (one process of it), share on this machine, then put it in the store."""
    with node.lock("produce"):
        keys = node.open(anchor)
        if keys is not None:
            return keys
        if kv.check(["state"]) and kv.get("state") == b"failed":
            raise pickle.loads(kv.get("error"))  # another process of rank 0 tried and failed
        kv.set("state", "listing")
        try:
            keys = node.publish(produce(), anchor)
        except BaseException as exc:
            _fail(kv, target, exc)
            raise
        blob = to_bytes(keys)
        chunks = max(1, -(-len(blob) // CHUNK))
        for index in range(chunks):
            kv.set(f"data/{index}", blob[index * CHUNK:(index + 1) * CHUNK])
        kv.set("chunks", str(chunks))
        kv.set("state", "done")
        log.info("rank 0 listed %s and shared it (%d keys, %d bytes)", target, len(keys), len(blob))
        return keys


def _fail(kv: Any, target: str, exc: BaseException) -> None:
    try:
        payload = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable error: its text still travels
        payload = pickle.dumps(RuntimeError(f"rank 0 could not list {target}: {exc}"))
    kv.set("error", payload)
    kv.set("state", "failed")


def _follow(kv: Any, node: nodeshare.NodeFile, target: str, anchor: int,
            produce: Callable[[], KeyList]) -> KeyList:
    """Another rank: one process per machine waits for rank 0's listing and fetches it (unless
    rank 0 runs on this machine and its file appears); the others then map that file."""
    with node.lock("fetch"):
        started = time.monotonic()
        pause = _POLL[0]
        while True:
            keys = node.open(anchor)
            if keys is not None:
                return keys
            if kv.check(["state"]):
                state = kv.get("state")
                if state == b"done":
                    break
                if state == b"failed":
                    raise pickle.loads(kv.get("error"))
            elif time.monotonic() - started > START_WAIT:
                log.warning(
                    "rank 0 did not start listing %s within %.0f s, so this rank lists it itself; "
                    "in a distributed job every rank should build its datasets in the same order "
                    "(or pass listing=ListOptions(once_per_job=False))", target, START_WAIT)
                return node.publish(produce(), anchor)
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])
        if not kv.check(["data/0"]):  # freed: every rank had it, and then this machine lost it
            log.warning("the listing of %s is no longer in the job's store; this rank lists it "
                        "again", target)
            return node.publish(produce(), anchor)
        chunks = int(kv.get("chunks"))
        return node.publish_bytes(b"".join(kv.get(f"data/{i}") for i in range(chunks)), anchor)


def _got(kv: Any, rank: int, world_size: int) -> None:
    """This rank has the listing; the last rank to get it frees the store's copy."""
    if kv.add(f"got/{rank}", 1) == 1 and kv.add("ranks", 1) == world_size - 1 and kv.check(["chunks"]):
        for index in range(int(kv.get("chunks"))):
            kv.delete_key(f"data/{index}")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
