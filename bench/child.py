"""``python -m bench.child``: run a list of measurements in this process, report each as a line.

The harness (``bench.harness``) starts one child per loader, writes a JSON spec to its stdin and
reads ``@@START <id>`` / ``@@RESULT <json>`` lines from its stdout; everything else the child or
its DataLoader workers print goes to stderr (the log). A loader that raises is reported as a
result with ``error``; one that crashes or hangs the child is killed by the harness, which
records it and starts a new child for the runs that remain.

Credentials arrive in the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), never in
the spec or the command line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import psutil

from .loaders import LOADERS, Target, dataloader_kwargs

START = "@@START "
RESULT = "@@RESULT "
BEAT = "@@BEAT"
BEAT_SECONDS = 1.0
_channel: Any = None  # the harness's pipe (set in main)


def _beat() -> None:
    """Tell the harness we are alive (it kills a child that says nothing for a while)."""
    if _channel is not None:
        _channel.write(BEAT + "\n")
JPEG_MAGIC = b"\xff\xd8"


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _tree_cpu(pid: int | None) -> dict[int, float]:
    """CPU seconds of ``pid`` and its descendants, per pid (missing processes are skipped)."""
    if pid is None:
        return {}
    out: dict[int, float] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                out[proc.pid] = _cpu(proc)
    return out


def _delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two snapshots (a process that appeared counts from zero)."""
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def _busy() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class Snapshot:
    def __init__(self, server_pid: int | None, proxy_pid: int | None) -> None:
        self.t = time.perf_counter()
        self.client = _tree_cpu(os.getpid())
        self.server = _tree_cpu(server_pid)
        self.proxy = {proxy_pid: _cpu(psutil.Process(proxy_pid))} if proxy_pid else {}
        self.busy = _busy()


def _count(batch: Any, mean_size: float) -> tuple[int, float]:
    if isinstance(batch, list):  # raw: a list of bytes
        return len(batch), float(sum(map(len, batch)))
    return int(batch.shape[0]), batch.shape[0] * mean_size


def _check(batch: Any) -> None:
    if isinstance(batch, list):
        if not batch or not isinstance(batch[0], bytes) or not batch[0].startswith(JPEG_MAGIC):
            raise ValueError(f"raw batch does not hold JPEG bytes: {type(batch[0]).__name__}")
    elif tuple(batch.shape[1:]) != (3, 224, 224):
        raise ValueError(f"decoded batch has shape {tuple(batch.shape)}, expected (B, 3, 224, 224)")


def _epoch(loader: Any, dataset: Any, epoch: int, cap: float, mean_size: float) -> dict[str, Any]:
    """One pass, stopped after ``cap`` seconds (then it is not ``complete``)."""
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    samples, nbytes, complete, checked = 0, 0.0, True, False
    # iter() first, untimed: with persistent workers it waits until each worker has finished
    # what the previous (capped) epoch had queued, an artifact of capping, not the loader's cost
    batches = iter(loader)
    began = last_beat = time.perf_counter()
    for batch in batches:
        if time.perf_counter() - last_beat > BEAT_SECONDS:
            _beat()
            last_beat = time.perf_counter()
        if not checked:
            _check(batch)
            checked = True
        count, size = _count(batch, mean_size)
        samples += count
        nbytes += size
        # the empty training step
        if time.perf_counter() - began > cap:
            complete = False
            break
    seconds = time.perf_counter() - began
    return {"samples": samples, "bytes": nbytes, "seconds": seconds, "complete": complete}


def measure(run: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up epoch, then ``epochs`` timed ones; rates are medians over the timed epochs."""
    from torch.utils.data import DataLoader

    loader = LOADERS[run["loader"]]
    plan = spec["plan"]
    ctx = spec["context"]
    latency = run["latency"]
    endpoint = ctx["endpoints"][str(run["latency_ms"]) if loader.uses_network else "0"]
    data = ctx["sets"][run["workload"]]
    target = Target(endpoint_url=endpoint, region=ctx["region"], bucket=ctx["bucket"],
                    objects_prefix=data["objects_prefix"], shard_keys=tuple(data["shard_keys"]),
                    blob=data["blob"])
    proxy_pid = ctx["proxy_pid"] if loader.uses_network and latency else None
    mean_size = data["mean_size"]
    # Capping an epoch throws away what a loader has read ahead. For the peers and the ceiling that
    # is at most prefetch_factor x workers batches; ours read ahead up to queue_items (1024)
    # samples, so a capped epoch would charge them for work a full epoch uses: never cap ours.
    cap = plan["full_epoch_limit"] if loader.family == "ours" else plan["epoch_seconds"]
    dataset = loader.dataset(target, run["workload"])
    if hasattr(dataset, "resolve"):
        # ours: list now, as the docs suggest, not inside set_epoch() right before the DataLoader
        # forks its workers (a listing thread exiting during fork() hung workers, see README)
        dataset.resolve()
    dl = DataLoader(dataset, **dataloader_kwargs(run["workers"]))
    result = dict(run)
    try:
        warm = _epoch(dl, dataset, 0, plan["warmup_seconds"], mean_size)
        before = Snapshot(ctx["server_pid"], proxy_pid)
        epochs = [_epoch(dl, dataset, e, cap, mean_size) for e in range(1, plan["epochs"] + 1)]
        after = Snapshot(ctx["server_pid"], proxy_pid)
    finally:
        del dl  # persistent workers stop here
        gc.collect()
    wall = after.t - before.t
    samples = sum(e["samples"] for e in epochs)
    nbytes = sum(e["bytes"] for e in epochs)
    rates = [e["samples"] / e["seconds"] for e in epochs]
    client = _delta(before.client, after.client)
    server = _delta(before.server, after.server)
    proxy = _delta(before.proxy, after.proxy)
    other = max(0.0, (after.busy - before.busy) - client - server - proxy)
    complete = [e for e in epochs if e["complete"]]
    expected = data["num_samples"]
    wrong = [e["samples"] for e in complete if e["samples"] != expected]
    result.update(
        samples_per_s=statistics.median(rates),
        rates=rates,
        mb_per_s=statistics.median(rates) * (nbytes / samples) / 1e6 if samples else 0.0,
        samples_timed=samples,
        wall_s=wall,
        warmup_samples=warm["samples"],
        complete_epochs=len(complete),
        client_us=1e6 * client / samples if samples else None,
        server_us=1e6 * server / samples if samples else None,
        proxy_us=1e6 * proxy / samples if samples and proxy_pid else None,
        client_cores=client / wall,
        server_cores=server / wall,
        other_cores=other / wall,
        note=(f"epoch yielded {wrong[0]} samples, expected {expected}" if wrong else ""),
    )
    return result


def _redact(text: str) -> str:
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    return text.replace(secret, "***") if secret else text


def main() -> int:
    global _channel
    out = _channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (ours, peers', workers') go to the log, not the result channel
    sys.stdout = sys.stderr
    warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
    # the harness sends SIGUSR1 to the whole group before killing a hung child: every process
    # (DataLoader workers included, they inherit this) writes all its threads' stacks to the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # One intra-op thread, as DataLoader workers have: with the default (one per core) the
    # main process's collate (torch.stack of decoded batches) leaves an OpenMP thread spinning,
    # which doubled the CPU per decoded sample with num_workers=0 (6.3 vs 3.0 ms) for every loader
    import torch
    torch.set_num_threads(1)
    spec = json.load(sys.stdin)
    for run in spec["runs"]:
        out.write(START + run["id"] + "\n")
        began = time.perf_counter()
        try:
            result = measure(run, spec)
        except Exception as exc:
            traceback.print_exc()
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            result = dict(run, error=_redact(f"{type(exc).__name__}: {first}"))
        result["seconds"] = time.perf_counter() - began
        out.write(RESULT + json.dumps(result) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
