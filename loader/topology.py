"""Who am I: this process's rank in the job, this worker's id in its DataLoader, and the epoch.

Read in ``__iter__``, never in ``__init__`` (a dataset is built before ``init_process_group`` and
pickled into workers): the process group, else ``RANK``/``WORLD_SIZE``, else ``(0, 1)``. The
process that starts spawned workers hands them its rank (``observe``, a ``Launch``), and the
epoch travels in shared memory (``SharedEpoch``). Why: docs/design/partition.md.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
from collections.abc import Mapping
from multiprocessing.context import get_spawning_popen
from typing import Any

from .errors import ConfigError
from .lifecycle import LiveObjects

log = logging.getLogger(__name__)

GROUP = "torch.distributed"
ENVIRONMENT = "RANK/WORLD_SIZE"
SINGLE = "single process"


@dataclasses.dataclass(frozen=True)
class Launch:
    """The world as the process that pickled a dataset to start a worker saw it (``source``
    says where from: the process group, the environment, or neither)."""

    pid: int
    rank: int
    world_size: int
    source: str


def observe(environ: Mapping[str, str] | None = None) -> Launch:
    """This process's view of the world, to carry into the processes it starts."""
    rank, world_size, source = _live(environ)
    return Launch(os.getpid(), rank, world_size, source)


def world(environ: Mapping[str, str] | None = None, *, launch: Launch | None = None,
          unpickled_here: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` of this process.

    In a DataLoader worker: a process group inherited by fork; else, when the dataset was
    unpickled in this worker (``unpickled_here``: spawn, forkserver), the ``launch`` its
    parent wrote; else ``RANK``/``WORLD_SIZE``. A worker that was sent the dataset and can
    learn its rank from none of these raises ``ConfigError`` instead of guessing.
    """
    rank, world_size, source = _live(environ)
    if source == GROUP:
        return rank, world_size
    if not in_worker():
        if source == SINGLE:
            _warn_if_slurm(os.environ if environ is None else environ)
        return rank, world_size
    if unpickled_here:
        parent = parent_pid()
        if launch is not None and launch.pid == parent:
            global _carried_world_size
            _carried_world_size = launch.world_size  # for ``readers``: nothing else here knows it
            return launch.rank, launch.world_size
        if source == SINGLE:
            sender = "without a rank" if launch is None else f"by process {launch.pid}"
            raise ConfigError(
                f"cannot tell this DataLoader worker's rank: its dataset was pickled {sender}, "
                f"not by the process that started the worker ({parent}); torch.distributed is "
                "not initialized here and RANK/WORLD_SIZE are unset. Pass rank= and world_size= "
                "to the dataset, or set RANK and WORLD_SIZE in the environment"
            )
    return rank, world_size


def _live(environ: Mapping[str, str] | None) -> tuple[int, int, str]:
    """What this process itself can see: the process group, else the environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), GROUP
    env = os.environ if environ is None else environ
    rank, size = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None and size is None:
        return 0, 1, SINGLE
    if rank is None or size is None:
        missing, given = ("RANK", "WORLD_SIZE") if rank is None else ("WORLD_SIZE", "RANK")
        raise ConfigError(f"{given} is set but {missing} is not; set both (torchrun does) or neither")
    world_size = _env_int("WORLD_SIZE", size, minimum=1)
    rank_ = _env_int("RANK", rank, minimum=0)
    if rank_ >= world_size:
        raise ConfigError(
            f"RANK={rank!r} is not below WORLD_SIZE={size!r}; ranks run from 0 to WORLD_SIZE-1"
        )
    return rank_, world_size, ENVIRONMENT


_warned_slurm = False


def _warn_if_slurm(env: Mapping[str, str]) -> None:
    """SLURM starts tasks without telling torch: say so once rather than let each task read
    everything. (SLURM_PROCID is not taken as the rank: ``srun`` also runs independent tasks.)"""
    global _warned_slurm
    tasks = env.get("SLURM_NTASKS", "1").strip()
    if _warned_slurm or not tasks.isdigit() or int(tasks) < 2:
        return
    _warned_slurm = True
    log.warning(
        "SLURM_NTASKS=%s, but no torch.distributed group is initialized and RANK/WORLD_SIZE are "
        "unset, so this task reads the whole data set as rank 0 of 1. For data parallel training "
        "call init_process_group before iterating, or set RANK=$SLURM_PROCID and "
        "WORLD_SIZE=$SLURM_NTASKS, or pass rank= and world_size=", tasks,
    )


def in_worker() -> bool:
    """Whether this code runs inside a DataLoader worker. A process that has not imported torch
    cannot be one, so the command line (which needs no torch) is not made to import it here."""
    if "torch" not in sys.modules:
        return False
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


def parent_pid() -> int | None:
    """The process that started this one through ``multiprocessing`` (the DataLoader's
    process for fork, spawn and forkserver workers alike; ``os.getppid()`` would give the
    fork server)."""
    parent = multiprocessing.parent_process()
    return None if parent is None else parent.pid


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its machine (``LOCAL_RANK``), 0 when unset."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_RANK")
    return 0 if value is None else _env_int("LOCAL_RANK", value, minimum=0)


# The world size a dataset carried into this spawned (or forkserver) DataLoader worker, as
# ``world`` read it: a worker started so sees no process group and often no RANK/WORLD_SIZE.
_carried_world_size: int | None = None


def readers(environ: Mapping[str, str] | None = None) -> int:
    """How many of this job's processes read at once, as far as this process can tell: the world
    size (the process group's, else ``WORLD_SIZE``, else the one a dataset carried into this
    spawned worker) times this process's DataLoader workers; 1 in
    a process without torch (the command line) or whose rank variables are wrong (they are
    reported where the rank is needed)."""
    if "torch" not in sys.modules:
        return 1
    try:
        _, world_size, source = _live(environ)
    except ConfigError:
        world_size, source = 1, SINGLE
    if source == SINGLE and _carried_world_size is not None and in_worker():
        world_size = _carried_world_size  # a spawned worker of a rank: the world its dataset carried
    return world_size * worker()[1]


def worker() -> tuple[int, int]:
    """``(worker id, num_workers)`` inside a DataLoader worker, ``(0, 1)`` in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class SharedEpoch:
    """The epoch, in shared memory that DataLoader workers keep reading.

    Made with the dataset, so workers hold it however they were started and whenever
    ``set_epoch`` runs: a plain attribute would freeze at the value a persistent worker was
    started with. Pickled to start a process (spawn, forkserver), the memory travels along; any
    other pickle (``deepcopy``, a checkpoint) gets a cell of its own. The cell belongs to the
    process that made it: another process that is not a DataLoader worker (a rank started with
    a dataset built in its launcher, say) takes a cell of its own before it writes, pickles the
    dataset or forks, so ranks never share one.
    """

    def __init__(self, value: int = 0) -> None:
        self._cell: Any = multiprocessing.RawValue("q", value)
        self._owner = os.getpid()
        _epochs.add(self)

    @property
    def value(self) -> int:
        return int(self._cell.value)

    @value.setter
    def value(self, value: int) -> None:
        self.claim()
        self._cell.value = value

    def claim(self) -> None:
        """Make the cell this process's own, unless this is a DataLoader worker (which
        follows the cell of the process that started it)."""
        if self._owner != os.getpid() and not in_worker():
            self._cell = multiprocessing.RawValue("q", self._cell.value)
            self._owner = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        if get_spawning_popen() is None:  # shared memory travels only to processes being started
            return SharedEpoch, (self.value,)
        self.claim()
        return _rebuild_epoch, (self._cell, self._owner)

    def __repr__(self) -> str:
        return f"SharedEpoch({self.value})"


def _rebuild_epoch(cell: Any, owner: int) -> SharedEpoch:
    epoch = SharedEpoch.__new__(SharedEpoch)
    epoch._cell, epoch._owner = cell, owner
    _epochs.add(epoch)
    return epoch


def _claim(epoch: SharedEpoch) -> None:
    """Before a fork: forked workers must hold this process's cells, not a launcher's."""
    if epoch._owner != os.getpid():
        epoch.claim()


_epochs: LiveObjects[SharedEpoch] = LiveObjects(before_fork=_claim)


def _env_int(name: str, value: str, *, minimum: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}")
    return number

