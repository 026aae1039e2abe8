"""One listing per job: in a ``torch.distributed`` job, rank 0 lists and the other ranks read it.

Every rank listing the same prefix multiplies the LIST requests (and the time: 100 million keys
are ~100,000 pages) by the number of ranks, and the ranks may even see different listings if
objects change meanwhile, which breaks the partition. So, in the process where a process group
is initialized (never in a DataLoader worker, which has none), rank 0 lists and publishes the
pickled ``KeyList`` through the group's key-value store (the ``TCPStore`` that
``init_process_group`` set up), and the other ranks wait for it there.

Why the store and not ``broadcast_object_list``: a collective would block the other ranks
inside the backend while rank 0 lists, and a long listing outlives NCCL's watchdog (10 minutes
by default); it would also hang for good where only rank 0 builds a dataset (a validation set,
say). Waiting on the store is a poll that no timeout cuts, and rank 0 never waits for anyone.

The rule that makes it work: every rank that builds a dataset over a prefix builds it in the
same order as rank 0 (as DDP requires of models anyway); listings are matched by their URI and
how many times this process listed it. A rank that finds no listing started by rank 0 within
``START_WAIT`` seconds lists for itself, with a warning. ``ListOptions(once_per_job=False)``
turns all this off.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

START_WAIT = 300.0  # seconds a rank waits for rank 0 to start a listing before listing itself
CHUNK = 64 << 20  # bytes per store value (the pickled key list is split into these)
_POLL = (0.02, 0.5)  # first and longest pause between looks at the store

_listed: collections.Counter[str] = collections.Counter()  # listings per target in this process


def once_per_job(target: str, produce: Callable[[], T]) -> T:
    """``produce()`` on rank 0 only, its result handed to every rank (see the module doc);
    just ``produce()`` outside a multi-rank process group."""
    job = _job()
    if job is None:
        return produce()
    rank, world_size, store = job
    _listed[target] += 1
    name = hashlib.sha256(f"{target}#{_listed[target]}".encode()).hexdigest()[:24]
    import torch.distributed as dist

    kv = dist.PrefixStore(f"loader/listing/{name}/", store)
    if rank == 0:
        return _publish(kv, target, produce)
    return _receive(kv, target, world_size, produce)


def _job() -> tuple[int, int, Any] | None:
    """``(rank, world_size, store)`` where a multi-rank group can share a listing, else None."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:  # a DataLoader worker: a forked copy of the group is unusable
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception as exc:  # noqa: BLE001 - any failure: every rank lists for itself
        log.debug("no key-value store in this process group (%s): every rank lists", exc)
        return None
    return dist.get_rank(), dist.get_world_size(), store


def _publish(kv: Any, target: str, produce: Callable[[], T]) -> T:
    kv.set("state", "listing")
    try:
        result = produce()
    except BaseException as exc:
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable error: its text still travels
            payload = pickle.dumps(RuntimeError(f"rank 0 could not list {target}: {exc}"))
        kv.set("error", payload)
        kv.set("state", "failed")
        raise
    blob = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = max(1, -(-len(blob) // CHUNK))
    for index in range(chunks):
        kv.set(f"data/{index}", blob[index * CHUNK:(index + 1) * CHUNK])
    kv.set("chunks", str(chunks))
    kv.set("state", "done")
    log.info("rank 0 listed %s and shared it (%d bytes)", target, len(blob))
    return result


def _receive(kv: Any, target: str, world_size: int, produce: Callable[[], T]) -> T:
    started = time.monotonic()
    pause = _POLL[0]
    while not kv.check(["state"]):
        if time.monotonic() - started > START_WAIT:
            log.warning(
                "rank 0 did not start listing %s within %.0f s, so this rank lists it itself; "
                "in a distributed job every rank should build its datasets in the same order "
                "(or pass listing=ListOptions(once_per_job=False))", target, START_WAIT)
            return produce()
        time.sleep(pause)
        pause = min(pause * 2, _POLL[1])
    pause = _POLL[0]
    while (state := kv.get("state")) == b"listing":  # as long as rank 0 takes: its retries bound it
        time.sleep(pause)
        pause = min(pause * 2, _POLL[1])
    if state == b"failed":
        raise pickle.loads(kv.get("error"))
    chunks = int(kv.get("chunks"))
    blob = b"".join(kv.get(f"data/{index}") for index in range(chunks))
    if kv.add("readers", 1) == world_size - 1:  # the last rank to read frees the store's copy
        for index in range(chunks):
            kv.delete_key(f"data/{index}")
    return pickle.loads(blob)
