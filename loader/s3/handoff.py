"""The rate limit a DataLoader's workers found, handed to its next epoch's workers.

DataLoader workers end with their epoch unless ``persistent_workers``: each epoch's new workers
began knowing nothing and sent their start window into a limit the last epoch's workers had
found and held, every epoch (bench.tail, 2 ranks x 4 workers against one sliding second: 27-30 %
of each epoch's GETs answered SlowDown). Now each worker whose ``ThrottleControl`` holds a limit
writes it, at most once per ``RATE_WINDOW`` (a limit is judged over one), to a small file of its
own per endpoint and bucket, named by the process that runs its DataLoader and its worker id; a
control made later in a worker of that DataLoader starts at its share of their sum (the
DataLoader's limit, as its workers held it, split over its workers now) and probes up from it as
any limited control does. A worker that starts late (spawned workers start seconds apart) takes
its share of what the others found so far the same way.

Summed, not scaled: a worker that ran alone for a while held the whole limit, and its limit
times the number of workers had handed the next epoch twice the limit (through the proxy: 113
SlowDowns of 500 GETs in that epoch). Files live where ``nodeshare`` keeps the machine's shared
key lists, held for the DataLoader's process from a worker's first write: they go when it exits,
or, if it was killed, at the next sweep (each worker's first write sweeps). A worker never
limited writes, holds and sweeps nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path


class Handoff:
    """The handed-over limits of one endpoint and bucket for the workers of one DataLoader: a file
    per worker, ``<base>.w<id>.rate``, holding the requests/s its control allowed."""

    def __init__(self, base: Path, worker: int, workers: int, every: float,
                 first_write: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base = base
        self.worker = worker
        self.workers = max(1, workers)
        self.every = every  # seconds between writes (the control's RATE_WINDOW: a limit is judged over one)
        # called before this worker's first write (holds the files for the DataLoader's process,
        # sweeps those of processes gone): a worker never limited leaves nothing on the machine
        self.first_write: Callable[[], None] | None = first_write
        self.clock = clock
        self.written: float | None = None  # the limit last written
        self.written_at = -math.inf

    def path(self, worker: int) -> Path:
        return self.base.with_name(f"{self.base.name}.w{worker}.rate")

    def read(self) -> float | None:
        """This worker's share of the limits its DataLoader's workers found (requests/s), or None
        when none did: their sum over this DataLoader's workers now (a file of a worker id it no
        longer has is not read)."""
        found = []
        for worker in range(self.workers):
            try:
                limit = float(self.path(worker).read_text())
            except (OSError, ValueError):
                continue
            if math.isfinite(limit) and limit > 0:
                found.append(limit)
        return sum(found) / self.workers if found else None

    def note(self, rate: float | None) -> None:
        """This worker's control holds ``rate`` now (None: no limit): written when it is due."""
        if rate is None:
            return
        now = self.clock()
        if now - self.written_at < self.every or rate == self.written:
            return
        self.written, self.written_at = rate, now
        if self.first_write is not None:
            prepare, self.first_write = self.first_write, None
            try:
                prepare()
            except OSError:  # the folder is not writable: the next epoch starts from the window
                return
        path = self.path(self.worker)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            temporary.write_text(repr(rate))
            os.replace(temporary, path)
        except OSError:  # no room, or the folder went: the next epoch starts from the window
            with contextlib.suppress(OSError):
                temporary.unlink()


# Where a DataLoader worker's handoff lives: set by ``listing.nodeshare``, which keeps the
# machine's shared files (this layer knows stores, not machines; every dataset imports it)
PLACE: Callable[[str, str, float], Handoff | None] | None = None


def for_this_process(endpoint: str, bucket: str, every: float) -> Handoff | None:
    """The handoff of ``bucket`` at ``endpoint`` for this DataLoader worker (``PLACE``); None
    outside a worker, or where the machine cannot share files."""
    return None if PLACE is None else PLACE(endpoint, bucket, every)
