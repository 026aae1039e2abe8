"""Memory of a large key list on one machine: R simulated ranks x W DataLoader workers each.

    python -m bench.keylist_memory                       # 1,000,000 keys, 8 ranks x 2 workers
    python -m bench.keylist_memory --keys 200000 --ranks 4
    cd OTHER && PYTHONPATH=OTHER:THIS python -m bench.keylist_memory   # another checkout's loader

Ranks are forked from this launcher (they share torch's pages, so the numbers show the loader's
own memory), form a gloo group over TCP, build ``AsyncS3Dataset.from_prefix`` and iterate a
``DataLoader`` with forked workers (the default) for a few batches, as a job's first steps do.
Nothing lists on a server: the listing (``inputs.list_objects``) is replaced by one that makes N
synthetic keys with sizes and MD5 ETags (counted: how many processes listed), and GETs return a
byte. While every process holds its key list, the launcher reads each one's RSS, PSS and USS
(psutil) and what the mapped key list file adds to them. Prints a Markdown table and writes it,
with the raw numbers, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PAGE = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", type=Path, default=None, help="write the table and numbers here (.md + .json)")
    args = parser.parse_args()

    import psutil
    import torch.multiprocessing as mp

    signals = Path(tempfile.mkdtemp(prefix="keylist-memory-"))
    port = _free_port()
    started = time.monotonic()
    context = mp.start_processes(_rank, args=(args.ranks, port, args.keys, args.workers, str(signals)),
                                 nprocs=args.ranks, join=False, start_method="fork")
    try:
        while len(list(signals.glob("ready-*"))) < args.ranks:
            if not all(process.is_alive() for process in context.processes):
                context.join(timeout=1)  # raises the rank's error
            time.sleep(0.2)
        ready = time.monotonic() - started
        time.sleep(1.0)  # let workers settle (their prefetch queues are full)
        rows = []
        for marker in sorted(signals.glob("ready-*")):
            info = json.loads(marker.read_text())
            rows.append(_measure(psutil, info["main"], "rank", info["rank"]))
            rows.extend(_measure(psutil, pid, "worker", info["rank"]) for pid in info["workers"])
        listings = len((signals / "listed").read_text().split()) if (signals / "listed").exists() else 0
        (signals / "measured").write_text("1")
        context.join(timeout=120)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    result = {"label": args.label, "keys": args.keys,
              "ranks": args.ranks, "workers": args.workers, "listings": listings,
              "seconds_to_first_batches": round(ready, 1), "processes": rows}
    table = report(result)
    print(table)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


def report(result: dict[str, Any]) -> str:
    rows = result["processes"]
    lines = [f"{result['label']}: {result['keys']:,} keys, {result['ranks']} ranks x "
             f"{result['workers']} workers = {len(rows)} processes; listings made: {result['listings']}; "
             f"first batches on every rank after {result['seconds_to_first_batches']} s", "",
             "| processes | RSS median / max | PSS median | USS median / max | key list file: RSS / PSS per process |",
             "|---|--:|--:|--:|--:|"]
    for kind in ("rank", "worker"):
        some = [row for row in rows if row["kind"] == kind]
        if not some:
            continue
        mib = lambda values: f"{statistics.median(values) / PAGE:.0f}"  # noqa: E731
        top = lambda values: f"{max(values) / PAGE:.0f}"  # noqa: E731
        lines.append(
            f"| {len(some)} {kind} processes | {mib([r['rss'] for r in some])} / {top([r['rss'] for r in some])} MiB "
            f"| {mib([r['pss'] for r in some])} MiB | {mib([r['uss'] for r in some])} / {top([r['uss'] for r in some])} MiB "
            f"| {mib([r['keys_rss'] for r in some])} / {statistics.median([r['keys_pss'] for r in some]) / PAGE:.1f} MiB |")
    total_pss = sum(row["pss"] for row in rows)
    keys_pss = sum(row["keys_pss"] for row in rows)
    lines += ["", f"Sum of PSS over all {len(rows)} processes: {total_pss / PAGE:.0f} MiB, of which the "
              f"mapped key list file: {keys_pss / PAGE:.1f} MiB (the file's pages, counted once for the machine)."]
    return "\n".join(lines)


def _measure(psutil: Any, pid: int, kind: str, rank: int) -> dict[str, Any]:
    process = psutil.Process(pid)
    full = process.memory_full_info()
    keys_rss = keys_pss = 0
    for mapping in process.memory_maps(grouped=False):
        if "loader-keys-" in mapping.path:
            keys_rss += mapping.rss
            keys_pss += mapping.pss
    return {"kind": kind, "rank": rank, "pid": pid, "rss": full.rss, "pss": full.pss, "uss": full.uss,
            "keys_rss": keys_rss, "keys_pss": keys_pss}


# ----------------------------------------------------------------------------- in each rank


class _Store:
    """Answers every GET with one byte: the workers' reads cost nothing but the loader's own work."""

    async def get(self, bucket: str, key: str, **_: Any) -> bytes:
        return b"x"

    async def aclose(self) -> None:
        return None


async def _open_store() -> _Store:
    return _Store()


def _synthetic_listing(count: int, signals: str) -> Any:
    async def list_objects(store: Any, bucket: str, prefix: str, retry: Any, **_: Any) -> Any:
        from loader.listing.keylist import KeyList
        from loader.s3.protocol import ObjectInfo

        with open(os.path.join(signals, "listed"), "a") as f:
            f.write(f"{os.getpid()}\n")
        return KeyList.from_infos(
            ObjectInfo(f"{prefix}c{i % 1000:03d}/{i:08d}.jpg", 100_000 + i % 5000, f"{i * 2654435761:032x}"[-32:])
            for i in range(count))

    return list_objects


def _rank(rank: int, world_size: int, port: int, count: int, workers: int, signals: str) -> None:
    import faulthandler
    import signal

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset
    from loader.listing import inputs

    inputs.list_objects = _synthetic_listing(count, signals)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where a stuck process is
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        dataset = AsyncS3Dataset.from_prefix("s3://bench/train/", store=_open_store, max_inflight=8,
                                             queue_items=64)
        loader = DataLoader(dataset, batch_size=16, num_workers=workers, persistent_workers=workers > 0,
                            collate_fn=_keys, timeout=int(os.environ.get("BENCH_TIMEOUT", "600")))
        batches = iter(loader)
        for _ in range(2 * max(1, workers)):
            next(batches)
        pids = [w.pid for w in getattr(batches, "_workers", [])]
        Path(signals, f"ready-{rank}").write_text(json.dumps({"rank": rank, "main": os.getpid(), "workers": pids}))
        while not Path(signals, "measured").exists():
            time.sleep(0.2)
        del batches, loader
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _keys(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in batch]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
