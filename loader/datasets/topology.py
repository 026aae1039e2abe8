"""Who am I: this process's rank in the job and this worker's id in its DataLoader.

Read these in ``__iter__``, never in ``__init__``: a dataset is often built before
``init_process_group`` runs, and it is pickled into DataLoader workers that did not exist yet.
Sources, in order: an initialized ``torch.distributed`` group; the ``RANK``/``WORLD_SIZE``
variables that ``torchrun`` and most launchers set; otherwise a single process, ``(0, 1)``.
torch is imported lazily so that importing this module stays cheap and free of side effects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError


def world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ if environ is None else environ
    rank, size = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None and size is None:
        return 0, 1
    if rank is None or size is None:
        missing, given = ("RANK", "WORLD_SIZE") if rank is None else ("WORLD_SIZE", "RANK")
        raise ConfigError(f"{given} is set but {missing} is not; set both (torchrun does) or neither")
    world_size = _env_int("WORLD_SIZE", size, minimum=1)
    rank_ = _env_int("RANK", rank, minimum=0)
    if rank_ >= world_size:
        raise ConfigError(
            f"RANK={rank!r} is not below WORLD_SIZE={size!r}; ranks run from 0 to WORLD_SIZE-1"
        )
    return rank_, world_size


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its machine (``LOCAL_RANK``), 0 when unset."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_RANK")
    return 0 if value is None else _env_int("LOCAL_RANK", value, minimum=0)


def worker() -> tuple[int, int]:
    """``(worker id, num_workers)`` inside a DataLoader worker, ``(0, 1)`` in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _env_int(name: str, value: str, *, minimum: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}")
    return number
