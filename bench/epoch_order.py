"""CPU and memory for one DataLoader worker to start its share of a shuffled epoch order.

    python -m bench.epoch_order                      # 1,000,000 and 100,000,000 keys
    python -m bench.epoch_order --out bench/results/epoch-order-DATE.md

"previous release": every worker built the whole order as a list (``random.shuffle`` of
``range(n)``), then strided out its rank's and its own share; run only where it fits (up to
``--list-max`` keys: at 100,000,000 it would take minutes of CPU and ~3.8 GB per worker).
"this tree": ``partition.partition`` returns the share as a view computed per index (a keyed
permutation), so starting it costs the same at any size. Each figure: process CPU time
(``time.process_time``) and the peak of Python allocations (``tracemalloc``) to take the share
and read its first 64 items; median of ``--rounds`` alternated rounds. The shared machine's load
moves CPU time little; tracemalloc slows both sides alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from loader.datasets.partition import epoch_seed, partition

RANK, WORLD, WORKER, WORKERS = 0, 1, 0, 2  # one rank, the first of two DataLoader workers


def previous(n: int) -> list[int]:
    """The previous release: the whole order as a list, then this worker's stride."""
    order = list(range(n))
    random.Random(epoch_seed(0, 1)).shuffle(order)
    return order[RANK::WORLD][WORKER::WORKERS]


def current(n: int) -> Sequence[int]:
    return partition(n, seed=0, epoch=1, shuffle=True, rank=RANK, world_size=WORLD, worker=WORKER,
                     num_workers=WORKERS)


def measure(take: Callable[[int], Sequence[int]], n: int) -> tuple[float, int]:
    """(CPU seconds, peak bytes) to take the share and read its first 64 items."""
    tracemalloc.start()
    began = time.process_time()
    share = take(n)
    first = [item for _, item in zip(range(64), share)]
    cpu = time.process_time() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(first) == 64 and len(share) == -(-n // WORKERS)
    del share
    return cpu, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 100_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--list-max", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = ["| keys | loader | CPU to start a worker's share | peak memory |", "|--:|---|--:|--:|"]
    for n in args.keys:
        ways = {"previous release (whole list)": previous, "this tree (keyed permutation)": current}
        if n > args.list_max:
            del ways["previous release (whole list)"]
        runs: dict[str, list[tuple[float, int]]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, take in ways.items():  # alternated
                runs[name].append(measure(take, n))
        for name, values in runs.items():
            cpu = statistics.median(v[0] for v in values)
            peak = statistics.median(v[1] for v in values)
            shown = f"{cpu * 1e3:.2f} ms" if cpu < 1 else f"{cpu:.2f} s"
            rows.append(f"| {n:,} | {name} | {shown} | {peak / 2**20:.3f} MiB |")
        if n > args.list_max:
            rows.append(f"| {n:,} | previous release (whole list) | not run: ~{n / 1e6 * 2.2:.0f} s, "
                        f"~{n * 38 / 1e6 / 1024:.1f} GiB by its 1,000,000-key figures | |")
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
