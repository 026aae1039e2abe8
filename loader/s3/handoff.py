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
the share its siblings of the same start took: read again then, the sum would count the limits
they have written since in place of the last epoch's (2 ranks x 4 spawned workers: the late ones
started at a fraction of their share, every run a little slower). In a job's first epoch, where
none was handed a share, a late worker takes its share of what the others found so far.

Summed, not scaled: a worker that ran alone for a while held the whole limit, and its limit
times the number of workers had handed the next epoch twice the limit (through the proxy: 113
SlowDowns of 500 GETs in that epoch). Summed as the workers stood at the end: a limited worker
writes its limit with the time once per ``RATE_WINDOW`` while it is answered, changed or not, so
a file that went unwritten for ``STALE_WINDOWS`` windows before the latest one is a worker that
had ended (its share read) while the others went on and took its part; its limit is left out
(the first epoch's worker 0 ended at 72/s, worker 1 then ran alone up to 98/s of the 100 the
proxy allowed: their sum handed the next epoch 170/s, 49 SlowDowns of 449 GETs). Files live
where ``nodeshare`` keeps the machine's shared key lists, held for the DataLoader's process from
a worker's first write: they go when it exits, or, if it was killed, at the next sweep (each
worker's first write sweeps). A worker never limited writes, holds and sweeps nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

# windows without a write after which a worker's limit is no longer part of the sum: a worker
# answered writes every window, so two without one is a worker that had ended (one, and a busy
# machine's late write would drop a live worker: an underestimate, which only costs a probe)
STALE_WINDOWS = 2


class Handoff:
    """The handed-over limits of one endpoint and bucket for the workers of one DataLoader: a file
    per worker, ``<base>.w<id>.rate``, holding the requests/s its control allowed, when it last
    wrote (``clock``: the wall clock, the one that DataLoader's processes share), the share it
    started at and which start of the DataLoader's workers it belongs to (``start``:
    ``topology.worker_start``)."""

    def __init__(self, base: Path, worker: int, workers: int, every: float,
                 first_write: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time, start: int = 0) -> None:
        self.base = base
        self.worker = worker
        self.workers = max(1, workers)
        self.every = every  # seconds between writes (the control's RATE_WINDOW: a limit is judged over one)
        # called before this worker's first write (holds the files for the DataLoader's process,
        # sweeps those of processes gone): a worker never limited leaves nothing on the machine
        self.first_write: Callable[[], None] | None = first_write
        self.clock = clock
        self.start = start
        self.started: float | None = None  # the share this worker started at (``read``)
        self.written: float | None = None  # the limit last written
        self.written_at = -math.inf

    def path(self, worker: int) -> Path:
        return self.base.with_name(f"{self.base.name}.w{worker}.rate")

    def read(self) -> float | None:
        """This worker's share of the limits its DataLoader's workers found (requests/s), or None
        when none did. The share its siblings of this start took, where one took one (they all
        start at the same share, however far apart they start); else the sum of the limits
        written within ``STALE_WINDOWS`` of the latest, over this DataLoader's workers now (a
        file of a worker id it no longer has is not read): the last start's, or, in a job's
        first epoch, what this start's found so far."""
        found = []
        for worker in range(self.workers):
            try:
                limit, written, started, start = self.path(worker).read_text().split()
                entry = (float(limit), float(written), float(started), int(start))
            except (OSError, ValueError):
                continue
            if math.isfinite(entry[0]) and entry[0] > 0 and math.isfinite(entry[1]):
                found.append(entry)
        shares = [started for _, _, started, start in found if start == self.start and started > 0]
        if shares:
            self.started = shares[0]
            return self.started
        earlier = [(limit, written) for limit, written, _, start in found if start != self.start]
        ours = [(limit, written) for limit, written, _, start in found if start == self.start]
        limits = earlier or ours
        if limits:
            latest = max(written for _, written in limits)
            ended = latest - STALE_WINDOWS * self.every
            self.started = sum(limit for limit, written in limits if written >= ended) / self.workers
        return self.started

    def note(self, rate: float | None) -> None:
        """This worker's control holds ``rate`` now (None: no limit): written once per ``every``,
        changed or not (the time written says the worker was still answered then)."""
        if rate is None:
            return
        now = self.clock()
        if now - self.written_at < self.every:
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
        started = math.nan if self.started is None else self.started
        try:
            temporary.write_text(f"{rate!r} {now!r} {started!r} {self.start}")
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
